"""docs/reference.md states the public signatures a user calls: every parameter, by name."""

import inspect
from pathlib import Path

import pytest

from handlers.checkpoint.checkpointer import Checkpointer
from recipes.runner.training.fingerprint import fingerprint_arrays

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "reference.md"


@pytest.mark.parametrize("function, marker", [
    (Checkpointer, "| `Checkpointer("),
    (fingerprint_arrays, "### The data fingerprint: `fingerprint_arrays("),
])
def test_the_reference_names_every_parameter(function, marker):
    text = REFERENCE.read_text()
    assert marker in text
    entry = text[text.index(marker):].split("\n\n")[0]
    missing = [name for name in inspect.signature(function).parameters
               if name != "self" and f"`{name}" not in entry and f" {name}" not in entry
               and f"({name}" not in entry]
    assert not missing, f"docs/reference.md's entry for {function.__name__} lacks {missing}"
