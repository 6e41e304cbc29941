"""No file of the project names a place on one machine: data is found through
``recipes.common.paths`` (``SHARED_DATA``, ``--data-dir``), docs name folders relative to the
repository."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A home or a development machine's work folder; "/" + the name, so this file does not match.
MACHINE_PATH = re.compile("(?<![\\w.~-])/" + "(?:work|root|home|Users)/")


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    return [ROOT / name for name in names if (ROOT / name).is_file()
            and (ROOT / name).suffix in {".py", ".md", ".cfg", ".toml", ".txt", ""}]


def test_the_pattern_finds_a_machine_path_and_leaves_relative_ones():
    assert MACHINE_PATH.search("from " + "/" + "work/shared/data/cifar10")
    assert not MACHINE_PATH.search("../shared/data/cifar10 or runs/x/work/y")


def test_no_tracked_file_names_a_machine_path():
    found = [f"{path.relative_to(ROOT)}:{number}" for path in tracked_text_files()
             for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
             if MACHINE_PATH.search(line)]
    assert found == []
