"""``handlers.atomic_write``: a JSON file written whole or not at all, and every atomic write of a
run keeps the promise (fsync of the file before the rename, of the folder after)."""

import json
import os
import re
from pathlib import Path

import pytest

from handlers.atomic_write import write_json_atomic
from recipes.__main__ import main


def test_write_json_atomic_writes_sorted_json_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "summary.json"
    write_json_atomic(path, {"b": 1, "a": [1.5, None]})
    write_json_atomic(path, {"c": "replaced"})
    assert json.loads(path.read_text()) == {"c": "replaced"}
    assert path.read_text().endswith("\n")
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_a_failed_json_write_keeps_the_old_file_and_no_temp_file(tmp_path):
    path = tmp_path / "config.json"
    write_json_atomic(path, {"kept": True})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"not json": object()})
    assert json.loads(path.read_text()) == {"kept": True}
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


def record_disk_promises(monkeypatch) -> list[tuple]:
    """Records every ``os.fsync`` as ("fsync", inode) and every ``os.replace`` as
    ("replace", inode of the file, inode of the destination folder, destination)."""
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def inode(stat: os.stat_result) -> tuple[int, int]:
        return stat.st_dev, stat.st_ino

    def fsync(fd):
        events.append(("fsync", inode(os.fstat(fd))))
        real_fsync(fd)

    def replace(source, destination, **kwargs):
        folder = os.path.dirname(os.path.abspath(destination))
        events.append(("replace", inode(os.stat(source)), inode(os.stat(folder)),
                       Path(destination)))
        real_replace(source, destination, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def broken_promises(events: list[tuple]) -> list[str]:
    """Each rename whose file was not fsynced before it, or whose folder not after it."""
    broken = []
    for at, event in enumerate(events):
        if event[0] != "replace":
            continue
        _, file, folder, destination = event
        if ("fsync", file) not in events[:at]:
            broken.append(f"{destination.name}: no fsync of the file before the rename")
        if ("fsync", folder) not in events[at + 1:]:
            broken.append(f"{destination.name}: no fsync of the folder after the rename")
    return broken


def test_a_json_write_fsyncs_the_file_before_the_rename_and_the_folder_after(tmp_path,
                                                                            monkeypatch):
    events = record_disk_promises(monkeypatch)
    write_json_atomic(tmp_path / "summary.json", {"status": "completed"})
    assert [event[0] for event in events] == ["fsync", "replace", "fsync"]
    assert broken_promises(events) == []
    assert events[2][1] == (tmp_path.stat().st_dev, tmp_path.stat().st_ino)


def test_every_atomic_write_of_a_run_keeps_the_checkpoints_promise(tmp_path, monkeypatch):
    text = tmp_path / "corpus.txt"
    text.write_text(" ".join(["def", "return", "self", "value", "import"] * 120))
    events = record_disk_promises(monkeypatch)
    assert main(["charlm", "--text", str(text), "--run-dir", str(tmp_path / "run"),
                 "--val-fraction", "0.2", "--block-size", "8", "--n-layer", "1", "--n-head",
                 "2", "--n-embd", "16", "--batch-size", "16", "--epochs", "1", "--progress",
                 "off", "--device", "cpu"]) == 0
    # Writes outside the run folder (charlm's encoded text in the cache, on a first use)
    # keep the same promise: broken_promises checks every event.
    run = tmp_path / "run"
    renamed = {event[3].relative_to(run).as_posix() for event in events
               if event[0] == "replace" and event[3].is_relative_to(run)}
    assert {"config.json", "summary.json", "checkpoints/last.pt"} <= renamed
    assert any(re.fullmatch(r"checkpoints/(best-)?step-\d+\.pt", name) for name in renamed)
    assert broken_promises(events) == []
