"""The study's storage: two workers started at once on a new sweep both open it (Optuna's
RDBStorage creates its tables without a lock: one of the two used to fail)."""

import multiprocessing
from pathlib import Path

from recipes.runner.sweep.study import StudyPlace, open_study

ROUNDS = 3


def _open(folder: str, results) -> None:
    try:
        open_study(StudyPlace.of(Path(folder), "s", ""), {"a": 1}, "minimize")
        results.put("ok")
    except Exception as error:  # the test reports it
        results.put(f"{type(error).__name__}: {error}")


def test_two_workers_creating_one_new_study_at_once_both_open_it(tmp_path):
    context = multiprocessing.get_context("fork")
    for round_ in range(ROUNDS):
        folder = tmp_path / f"sweep-{round_}"
        folder.mkdir()
        results = context.Queue()
        workers = [context.Process(target=_open, args=(str(folder), results)) for _ in range(2)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=60)
        assert [results.get(timeout=5) for _ in workers] == ["ok", "ok"]
