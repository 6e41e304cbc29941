"""Where a recipe looks for its data when ``--data-dir`` is ``auto``: first a ``shared/data``
folder next to the repository (a data set kept once for every checkout on the machine),
then ``data/`` in the working directory."""

from collections.abc import Iterable
from pathlib import Path

SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"  # <repository>/../shared
LOCAL_DATA = Path("data")


def data_dir_candidates(name: str) -> tuple[Path, Path]:
    """The places looked at, in order: ``SHARED_DATA/<name>``, then ``data/<name>``."""
    return SHARED_DATA / name, LOCAL_DATA / name


def default_data_dir(name: str) -> Path:
    """The shared copy when that folder exists, else ``data/<name>`` (relative to the
    working directory, which may not exist yet)."""
    shared, local = data_dir_candidates(name)
    return shared if shared.is_dir() else local


def places_looked_in(places: Iterable[Path]) -> str:
    """``a (no such folder) and b``: each place once, in order, for a missing-data error."""
    unique = list(dict.fromkeys(places))
    named = [f"{place}{'' if place.exists() else ' (no such folder)'}" for place in unique]
    return " and ".join(named) if len(named) <= 2 else ", ".join(named[:-1]) + ", and " + named[-1]
