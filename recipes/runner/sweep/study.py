"""The sweep's Optuna study: where it is stored, and the checks before it is opened.

The default storage is an SQLite database in the sweep folder (``study.db``), which
``optuna.load_study`` and optuna-dashboard read as they are. ``--storage`` takes any URL
Optuna's ``RDBStorage`` takes (``sqlite:///``, ``postgresql://``, ``mysql://``: workers on
several machines) or ``journal:PATH``, Optuna's journal file (for a shared filesystem where
SQLite's locking is unreliable). The study remembers its sweep's definition (the searched
keys, the fixed keys, the metric): the same command finds it again, and another command
naming it is refused rather than mixing two searches in one study.
"""

import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import optuna
from sqlalchemy.exc import SQLAlchemyError

from recipes.runner.config.command_line import ConfigError

DATABASE = "study.db"
DEFINITION = "sweep"  # the study's user attribute that holds its sweep's definition
JOURNAL = "journal:"
PRUNERS = {"median": optuna.pruners.MedianPruner, "none": optuna.pruners.NopPruner}
SAMPLERS = {"tpe": optuna.samplers.TPESampler, "random": optuna.samplers.RandomSampler}
# What Optuna raises for a storage it cannot use: a damaged file, a schema of another
# version, a server that refuses.
STORAGE_ERRORS = (SQLAlchemyError, RuntimeError, ValueError, OSError)
CREATION_TRIES = 4


@dataclass(frozen=True)
class StudyPlace:
    """Where a sweep's study lives: the storage URL as given (or the default database's) and
    the study's name."""

    url: str
    name: str

    @classmethod
    def of(cls, sweep_dir: Path, name: str, storage: str) -> "StudyPlace":
        return cls(storage or f"sqlite:///{(sweep_dir / DATABASE).resolve()}", name)

    @property
    def sqlite_file(self) -> Path | None:
        parsed = urlparse(self.url)
        if parsed.scheme != "sqlite" or self.url in ("sqlite://", "sqlite:///:memory:"):
            return None
        return Path(self.url.removeprefix("sqlite:///"))

    def exists(self) -> bool:
        """Whether a study could be stored here already (a server always may hold one)."""
        if self.url.startswith(JOURNAL):
            return Path(self.url.removeprefix(JOURNAL)).is_file()
        file = self.sqlite_file
        return file is None or file.is_file()

    def check(self) -> None:
        """Refuse a storage that is not an Optuna one, before Optuna adds its tables to it:
        an SQLite file that is not a database, or one holding another program's tables."""
        scheme = urlparse(self.url).scheme
        if not self.url.startswith(JOURNAL) and scheme.split("+")[0] not in (
                "sqlite", "postgresql", "mysql", "oracle", "mssql"):
            raise ConfigError(f"--storage {self.url}: not a storage URL; give sqlite:///FILE, "
                              "postgresql://..., mysql://... or journal:FILE")
        file = self.sqlite_file
        if file is None or not file.is_file():
            return
        try:
            with sqlite3.connect(f"file:{file}?mode=ro", uri=True) as connection:
                tables = {row[0] for row in connection.execute(
                    "SELECT name FROM sqlite_master WHERE type='table'")}
        except sqlite3.Error as error:
            raise ConfigError(f"{file} is not a readable study database ({error}); move it "
                              "away or give another --sweep-dir or --storage") from None
        # "studies" alone: another worker may be creating Optuna's tables at this instant.
        if tables and "studies" not in tables:
            raise ConfigError(f"{file} is a database of something else than an Optuna study "
                              f"(tables {', '.join(sorted(tables)[:4])}); give another "
                              "--sweep-dir or --storage")

    def storage(self) -> Any:
        """Optuna's storage object (created, with its tables, when new)."""
        try:
            if self.url.startswith(JOURNAL):
                from optuna.storages.journal import JournalFileBackend, JournalStorage

                return JournalStorage(JournalFileBackend(self.url.removeprefix(JOURNAL)))
            return _rdb_storage(self.url)
        except STORAGE_ERRORS as error:
            raise ConfigError(f"--storage {self.url}: {_first_line(error)}") from None


def _rdb_storage(url: str) -> Any:
    """``RDBStorage(url)``, tried again while another worker creates the same database:
    Optuna creates its tables and stamps their version without a lock, so of two workers
    started at once on a new sweep one fails (a table or version row that the other has just
    made); a moment later the tables are there and it opens them."""
    for attempt in range(1, CREATION_TRIES):
        try:
            return optuna.storages.RDBStorage(url)
        except SQLAlchemyError:
            time.sleep(0.5 * attempt)
    return optuna.storages.RDBStorage(url)  # the last try: its error is the one reported


def open_study(place: StudyPlace, definition: dict[str, Any], direction: str,
               sampler: Any = None, pruner: Any = None) -> optuna.Study:
    """The study at ``place``, created for ``definition`` when new; ConfigError for a study of
    that name that another definition made (or none of ours)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the sweep prints its own lines
    storage = place.storage()
    try:
        study = optuna.create_study(storage=storage, study_name=place.name, direction=direction,
                                    sampler=sampler, pruner=pruner, load_if_exists=True)
        saved = study.user_attrs.get(DEFINITION)
        if saved is None and not study.trials:
            study.set_user_attr(DEFINITION, definition)
            saved = definition
    except STORAGE_ERRORS as error:
        raise ConfigError(f"{place.url}: cannot open study {place.name!r}: "
                          f"{_first_line(error)}") from None
    if saved != definition:
        raise ConfigError(f"study {place.name!r} in {place.url} {_differs(saved, definition)}; "
                          "give another --sweep-name (or --sweep-dir) for a new sweep")
    return study


def load_study(place: StudyPlace) -> optuna.Study:
    """An existing study, for ``--status``; ConfigError when there is none."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if not place.exists():
        raise ConfigError(f"no sweep in {place.url} (start it without --status first)")
    place.check()
    try:
        return optuna.load_study(study_name=place.name, storage=place.storage())
    except (KeyError, *STORAGE_ERRORS) as error:
        raise ConfigError(f"{place.url}: no study {place.name!r} ({_first_line(error)})"
                          ) from None


def _differs(saved: dict[str, Any] | None, wanted: dict[str, Any]) -> str:
    if saved is None:
        return "is not a sweep of this command line"
    changed = sorted(key for key in saved.keys() | wanted.keys()
                     if saved.get(key) != wanted.get(key))
    return f"was started with other {', '.join(changed)}"


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
