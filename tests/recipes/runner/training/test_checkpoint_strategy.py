"""``recipes.runner.training.checkpoint_strategy``: the format by strategy, saves in which every
process takes part, and the refusal of the other strategy's checkpoints."""

import os
import socket
from pathlib import Path

import ignite.distributed as idist
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from handlers.checkpoint.files import CheckpointError, SingleFile
from handlers.checkpoint.formats import format_for
from handlers.checkpoint.sharded import ShardedFolder
from recipes.__main__ import main
from recipes.runner.config.command_line import ConfigError
from recipes.runner.training.checkpoint_strategy import (
    EveryRankSave,
    refuse_other_format,
    save_wrapper,
)
from recipes.runner.training.launch import RankZeroSave, exit_process
from tests.helpers import CHARLM_RUN, digests, leave_the_group, one_error_line, write_text


def test_each_strategy_has_its_format_and_its_save():
    assert isinstance(format_for("fsdp"), ShardedFolder)
    assert isinstance(format_for("ddp"), SingleFile)
    assert (save_wrapper("fsdp"), save_wrapper("ddp")) == (EveryRankSave, RankZeroSave)


def _committed(run_dir: Path, *names: str) -> Path:
    folder = run_dir / "checkpoints"
    folder.mkdir(parents=True)
    for name in names:
        (folder / name).mkdir() if name.endswith(".dcp") else (folder / name).touch()
        (folder / f"{name}.json").touch()
    return run_dir


@pytest.mark.parametrize(("strategy", "suffix", "theirs"), [("ddp", ".dcp", "fsdp"),
                                                            ("fsdp", ".pt", "ddp")])
def test_a_run_folder_of_the_other_strategy_is_refused_in_one_line(tmp_path, strategy, suffix,
                                                                  theirs):
    run_dir = _committed(tmp_path / "run", f"step-00000009{suffix}", f"step-00000012{suffix}")
    with pytest.raises(ConfigError) as refused:
        refuse_other_format(strategy, run_dir, "auto")
    message = str(refused.value)
    assert message.startswith(f"--strategy {strategy}: ") and "\n" not in message
    assert f"step-00000012{suffix} is a checkpoint of a --strategy {theirs} run" in message
    assert f"resume with --strategy {theirs}, or start a new run" in message


def test_resume_file_of_the_other_strategy_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"x/step-00000003.pt is a checkpoint of a --strategy "
                                          r"ddp run \(.pt, this run reads .dcp\)"):
        refuse_other_format("fsdp", tmp_path, str(Path("x/step-00000003.pt")))


@pytest.mark.parametrize(("strategy", "names"), [
    ("ddp", ()), ("fsdp", ("step-00000003.dcp",)), ("ddp", ("step-00000003.pt",)),
    ("fsdp", ("step-00000003.pt", "step-00000006.dcp"))])
def test_a_fresh_folder_or_checkpoints_of_this_strategy_pass(tmp_path, strategy, names):
    refuse_other_format(strategy, _committed(tmp_path / "run", *names), "auto")


def test_an_uncommitted_save_of_the_other_kind_is_not_a_checkpoint(tmp_path):
    """A first save killed before its sidecar: nothing was committed, the run starts fresh."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step-00000003.dcp").mkdir(parents=True)
    refuse_other_format("ddp", run_dir, "auto")


def _save_fails_on(rank: int, failing: int, port: int, results: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        calls = []

        def save(engine):
            calls.append(engine)
            if idist.get_rank() == failing:
                raise CheckpointError("checkpoints/step-00000003.dcp", "could not save: full")

        with pytest.raises(CheckpointError) as raised:
            EveryRankSave(save)("engine")
        assert calls == ["engine"]  # every process saved
        reason = raised.value.reason
        (results / f"rank{rank}.txt").write_text(reason)
    finally:
        dist.destroy_process_group()
    exit_process(0)  # passed: skip the interpreter's teardown (see its docstring)


def test_every_rank_saves_and_a_failure_on_any_one_stops_them_all(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_save_fails_on, args=(1, port, tmp_path), nprocs=2)
    assert (tmp_path / "rank1.txt").read_text() == "could not save: full"
    assert (tmp_path / "rank0.txt").read_text() == "another process could not save it"


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    return write_text(tmp_path_factory.mktemp("text") / "text.txt", words=800)


@pytest.mark.parametrize(("trained", "resumed"), [("ddp", "fsdp"), ("fsdp", "ddp")])
def test_resuming_under_the_other_strategy_is_refused_in_one_line_writing_nothing(
        tmp_path, capsys, text, trained, resumed):
    run = [*CHARLM_RUN, "--text", str(text), "--run-dir", str(tmp_path / "run")]
    assert main([*run, "--strategy", trained]) == 0
    leave_the_group()
    before = digests(tmp_path / "run")
    capsys.readouterr()  # the training's own output
    longer = [("3" if key == "--epochs" else value)
              for key, value in zip(["", *run], run, strict=False)]
    code = main([*longer, "--strategy", resumed])  # a run left to train, not one complete
    suffix = ".dcp" if trained == "fsdp" else ".pt"
    one_error_line(code, capsys.readouterr().err, f"--strategy {resumed}: ",
                   f"{suffix} is a checkpoint of a --strategy {trained} run",
                   f"resume with --strategy {trained}")
    assert digests(tmp_path / "run") == before
