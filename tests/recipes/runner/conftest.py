"""The tiny trained runs the command tests read (``evaluate``, ``export``, ``predict``): one of
each recipe per test module that asks for it."""

from pathlib import Path

import pytest

from tests.helpers import CHARLM_RUN, CIFAR_RUN, IMAGES_RUN, train, write_text


@pytest.fixture(scope="module")
def cifar_run(tmp_path_factory) -> Path:
    return train(CIFAR_RUN, tmp_path_factory.mktemp("cifar") / "run")


@pytest.fixture(scope="module")
def image_tree(tmp_path_factory, make_image_tree_once) -> Path:
    return make_image_tree_once(tmp_path_factory.mktemp("tree"), {"train": 8, "val": 2})


@pytest.fixture(scope="module")
def images_run(tmp_path_factory, image_tree) -> Path:
    return train([*IMAGES_RUN, "--data-dir", str(image_tree)],
                 tmp_path_factory.mktemp("images") / "run")


@pytest.fixture(scope="module")
def charlm_run(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("charlm")
    text = write_text(folder / "text.txt", words=800)
    return train([*CHARLM_RUN, "--text", str(text)], folder / "run")
