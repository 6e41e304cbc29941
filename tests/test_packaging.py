"""setup.cfg states the versions the project supports, as ranges; constraints.txt pins the set
CI tests, which ``make`` installs: every pinned dependency must lie within its range."""

import configparser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
# Followed line by line in its private code (engine/ignite_loop.py): one version, on purpose.
ONE_VERSION = {"pytorch-ignite"}


def _requirements(section: str, key: str) -> list[Requirement]:
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    return [Requirement(line) for line in config[section][key].splitlines() if line.strip()]


def _pinned() -> dict[str, str]:
    lines = (REPO / "constraints.txt").read_text().splitlines()
    pairs = (line.split("==") for line in lines if line.strip() and not line.startswith("#"))
    return {canonicalize_name(name): version for name, version in pairs}


def test_the_dependencies_are_ranges_and_the_tested_set_lies_within_them():
    pinned = _pinned()
    for requirement in [*_requirements("options", "install_requires"),
                        *_requirements("options.extras_require", "dev")]:
        exact = requirement.name in ONE_VERSION
        assert exact or not any(spec.operator in ("==", "===") for spec in requirement.specifier), (
            f"{requirement}: setup.cfg states a range; the exact version goes in "
            "constraints.txt")
        version = pinned.get(canonicalize_name(requirement.name))
        assert version is not None, f"{requirement.name} is not pinned in constraints.txt"
        assert requirement.specifier.contains(version), (requirement, version)


def test_make_installs_the_tested_set():
    makefile = (REPO / "Makefile").read_text()
    assert "pip install -q -c constraints.txt" in makefile
    assert "$(STAMP): setup.cfg pyproject.toml constraints.txt" in makefile
