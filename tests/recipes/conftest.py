"""Fixtures shared by the recipe tests."""

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

IMAGE_CLASSES = ("cat", "dog", "eel")


@pytest.fixture(autouse=True)
def keep_ignite_log_level():
    """``main`` quiets Ignite's engine logger for the process; other test files log with it."""
    engine_logger = logging.getLogger("ignite.engine.engine")
    level = engine_logger.level
    yield
    engine_logger.setLevel(level)


def _make_image_tree(root: Path, per_class: dict[str, int],
                     classes: tuple[str, ...] = IMAGE_CLASSES) -> Path:
    """``root/<split>/<class>/NNN.{png,jpg}``: 8 and 12 px images alternately, PNG and JPEG,
    each class its own colour range (so a model can learn them)."""
    rng = np.random.default_rng(0)
    for split, count in per_class.items():
        for label, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for index in range(count):
                side = 8 if index % 2 else 12
                pixels = rng.integers(0, 80, (side, side, 3)) + 80 * label
                suffix = "png" if index % 3 else "jpg"
                Image.fromarray(pixels.astype(np.uint8)).save(folder / f"{index:03d}.{suffix}")
    return root


@pytest.fixture
def make_image_tree() -> Callable[..., Path]:
    return _make_image_tree


@pytest.fixture(scope="module")
def make_image_tree_once() -> Callable[..., Path]:
    """``make_image_tree`` for module-scoped fixtures."""
    return _make_image_tree
