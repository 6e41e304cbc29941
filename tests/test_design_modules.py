"""docs/design.md's module list ("Every module") against the tree: every module of engine/,
handlers/ and recipes/ is listed, and everything listed exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
PACKAGES = ("engine", "handlers", "recipes")
# An entry: a name ending in "/" (a folder) or ".py", indented two spaces a level, then two
# spaces before its description (or the line's end); wrapped descriptions match no entry.
ENTRY = re.compile(r"^( *)(\S+?(?:/|\.py))(?: {2,}|$)")


def listed(text: str) -> set[str]:
    """The paths the first code block after "### Every module" names, from its indentation."""
    block = text.split("### Every module", 1)[1].split("```\n", 2)[1]
    paths: set[str] = set()
    folders: list[str] = []
    for line in block.splitlines():
        match = ENTRY.match(line)
        if match is None:
            continue
        depth = len(match.group(1)) // 2
        del folders[depth:]
        paths.add("".join(folders) + match.group(2))
        if match.group(2).endswith("/"):
            folders.append(match.group(2))
    return paths


def modules() -> set[str]:
    return {str(path.relative_to(ROOT)) for package in PACKAGES
            for path in (ROOT / package).rglob("*.py") if path.name != "__init__.py"}


def test_listed_reads_paths_from_the_indentation():
    text = ("### Every module\n\n```\na/\n  b.py           what b does,\n                 "
            "wrapped\n  c/\n    d.py\n  e.py\nf/\n```\n")
    assert listed(text) == {"a/", "a/b.py", "a/c/", "a/c/d.py", "a/e.py", "f/"}


def test_every_module_is_listed():
    assert sorted(modules() - listed(DESIGN.read_text())) == []


def test_everything_listed_exists():
    missing = [path for path in listed(DESIGN.read_text())
               if not (ROOT / path).is_dir() and not (ROOT / path).is_file()]
    assert missing == []
