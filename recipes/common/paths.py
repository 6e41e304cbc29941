"""Where a recipe looks for its data when ``--data-dir`` is ``auto``: first a ``shared/data``
folder next to the repository (a data set kept once for every checkout on the machine),
then ``data/`` in the working directory; and where data prepared from it are cached."""

import os
from collections.abc import Iterable
from pathlib import Path

SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"  # <repository>/../shared
LOCAL_DATA = Path("data")
CACHE_ENV = "IGNITE_ENGINE_CACHE"  # overrides the cache folder, e.g. for tests


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


def cache_root() -> Path:
    """Where recipes cache what they prepare from their data (decoded images, encoded text):
    ``$IGNITE_ENGINE_CACHE`` if set, else ``$XDG_CACHE_HOME`` (or ``~/.cache``)
    ``/ignite-engine``. Not beside the data, which may be a read-only shared folder."""
    root = os.environ.get(CACHE_ENV)
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ignite-engine"
    return Path(root).expanduser()
