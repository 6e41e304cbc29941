"""The recipe example of docs/writing-a-recipe.md runs exactly as printed."""

import json
import re
import subprocess
import sys
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "writing-a-recipe.md"
EXAMPLE = re.compile(r"<!-- recipe-example -->\n```python\n(.*?)```\n<!-- /recipe-example -->",
                     re.DOTALL)


def test_the_documented_recipe_runs_as_printed_and_learns(tmp_path):
    source = EXAMPLE.search(GUIDE.read_text())
    assert source is not None, f"{GUIDE} lost its recipe example markers"
    recipe = tmp_path / "spirals.py"
    recipe.write_text(source.group(1))
    assert 60 <= len(source.group(1).splitlines()) <= 130  # "about 100 lines"

    done = subprocess.run([sys.executable, "-m", "recipes", str(recipe), "--device", "cpu",
                           "--progress", "off", "--run-name", "readme"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)

    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "runs" / "spirals" / "readme" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["epochs_completed"] == 20
    assert summary["best_val_accuracy"] > 0.9  # two spirals are not linearly separable
