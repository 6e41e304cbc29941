"""The README's Python example prints exactly the output the README shows."""

import os
import re
import subprocess
import sys
from pathlib import Path

from recipes.common.paths import data_dir_candidates

README = Path(__file__).resolve().parents[1] / "README.md"
EXAMPLE = re.compile(r"<!-- python-example -->\n```python\n(.*?)```\n<!-- /python-example -->",
                     re.DOTALL)
OUTPUT = re.compile(r"<!-- python-example-output -->\n```text\n(.*?)```\n"
                    r"<!-- /python-example-output -->", re.DOTALL)


def test_the_readme_example_prints_what_the_readme_shows(tmp_path):
    text = README.read_text()
    source, expected = EXAMPLE.search(text), OUTPUT.search(text)
    assert source is not None and expected is not None, "the README lost its example markers"
    example = tmp_path / "toy.py"
    example.write_text(source.group(1))

    done = subprocess.run([sys.executable, str(example)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)

    assert done.returncode == 0, done.stderr
    assert done.stdout == expected.group(1)


def test_the_example_comes_within_the_readmes_first_80_lines():
    lines = README.read_text().splitlines()
    assert lines.index("<!-- /python-example -->") < 80


def test_the_quick_start_says_where_the_cifar_recipe_looks_for_its_data():
    quick_start = README.read_text().split("## Composing")[0]
    shared, local = data_dir_candidates("cifar10")
    for place in (os.path.relpath(shared, README.parent), local):
        assert f"`{place}/`" in quick_start, place
    assert "--data-dir PATH" in quick_start and "--dataset synthetic" in quick_start
