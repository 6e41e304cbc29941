"""Sharded checkpoints (``handlers.checkpoint.sharded``): two ``fully_shard`` processes on the
CPU (gloo) save, verify and resume bit-identically; the same folders resume on one process
and read whole into a plain model; an incomplete or corrupt newest folder gives way to the
previous one; a save killed at each phase of its commit resumes from a complete checkpoint."""

import errno
import json
import os
import shutil
import subprocess
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard

import handlers.checkpoint.sharded as sharded_checkpoint
from engine.run_state import RngState
from engine.trainer import create_trainer
from handlers.checkpoint.checkpointer import Checkpointer
from handlers.checkpoint.crash_points import CRASH_PHASES, CrashPoints
from handlers.checkpoint.files import CheckpointError, SingleFile
from handlers.checkpoint.formats import format_for, read_checkpoint
from handlers.checkpoint.sharded import ShardedFolder
from recipes.runner.training.launch import exit_process
from tests.handlers.checkpoint.checkpoint_run import Run

REPO_ROOT = Path(__file__).resolve().parents[3]
WORLD_SIZE = 2
STEPS_PER_EPOCH = 4


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each process's own slice of the data, as a distributed sampler gives it."""
    generator = torch.Generator().manual_seed(7 + rank)
    return [(torch.randn(4, 6, generator=generator), torch.randint(0, 3, (4,), generator=generator))
            for _ in range(STEPS_PER_EPOCH)]


def _build(dirname: Path, *, shard: bool, rank: int = 0, **ckpt_kwargs) -> Run:
    """Dropout draws from each process's own generator (seeded by rank), so a resume that
    gave every process rank 0's random state would not be bit-identical."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))
    if shard:
        fully_shard(model[0])
        fully_shard(model[3])
        fully_shard(model)
    torch.manual_seed(100 + rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    trainer = create_trainer(model, optimizer, nn.CrossEntropyLoss())
    to_save = {"model": model, "optimizer": optimizer, "trainer": trainer, "rng": RngState()}
    ckpt = Checkpointer(dirname, to_save, run_id="run-a", checkpoint_format=ShardedFolder(),
                        **ckpt_kwargs)
    return Run(model, optimizer, trainer, ckpt)


def _train(run: Run, data: list, until_step: int, save: bool = True) -> None:
    """Plain steps from the trainer's position on, each saved as the trainer's
    ``OPTIMIZER_STEP`` handler would save it. (The engine's own step, its gradient-norm gate
    included, is the FSDP strategy's to run: this tests the checkpoints alone.)"""
    state = run.trainer.state
    state.epoch_length, state.max_epochs = STEPS_PER_EPOCH, 2
    for step in range(state.iteration + 1, until_step + 1):
        inputs, targets = data[(step - 1) % len(data)]
        nn.functional.cross_entropy(run.model(inputs), targets).backward()
        run.optimizer.step()
        run.optimizer.zero_grad()
        state.iteration = state.optimizer_step = step
        state.epoch = (step - 1) // STEPS_PER_EPOCH + 1
        if save:
            run.ckpt.save_last(run.trainer)


def _whole(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).clone()
            for name, tensor in model.state_dict().items()}


def _two_process_worker(rank: int, port: int, root: Path) -> None:
    """One epoch saved every step, then a fresh process state resumed from it (rank 0 picks
    and loads first, as the run layer does, then the others), then the second epoch: equal
    to two epochs without a break."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        data = _batches(rank)
        straight = _build(root / "straight", shard=True, rank=rank)
        _train(straight, data, 2 * STEPS_PER_EPOCH, save=False)
        expected = _whole(straight.model)

        first = _build(root / "checkpoints", shard=True, rank=rank, keep_last=2)
        _train(first, data, STEPS_PER_EPOCH)
        saved = _whole(first.model)

        resumed = _build(root / "checkpoints", shard=True, rank=rank + 50, keep_last=2)
        info = resumed.ckpt.resume("auto") if rank == 0 else None
        chosen = [str(info.path) if info else None]
        dist.broadcast_object_list(chosen, src=0)
        info = info or resumed.ckpt.resume(chosen[0])
        assert info.path.name == "last.dcp" and info.rejected == []
        assert resumed.trainer.state.iteration == STEPS_PER_EPOCH
        reloaded = _whole(resumed.model)
        assert all(torch.equal(reloaded[name], saved[name]) for name in saved)
        _train(resumed, data, 2 * STEPS_PER_EPOCH)
        got = _whole(resumed.model)
        for name, tensor in expected.items():
            assert torch.equal(got[name], tensor), name
        optimizer = get_optimizer_state_dict(resumed.model, resumed.optimizer,
                                             options=StateDictOptions(full_state_dict=True))
        if rank == 0:  # what the two processes held at the end, whole
            torch.save({"model": got, "optimizer": optimizer}, root / "final.pt")
        _disk_full_on_rank_zero(resumed, rank, root / "checkpoints")
        _saves_behind_training(rank, data, root / "behind", saved)
    finally:
        dist.destroy_process_group()
    exit_process(0)  # passed: skip the interpreter's teardown (see its docstring)


@contextmanager
def _disk_full_on_rank_zero_while(rank: int) -> Iterator[None]:
    """On rank 0, every file a sharded save writes durably (state.pt) finds the disk full."""
    real = sharded_checkpoint._write_durably
    if rank == 0:
        def full(file, payload):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        sharded_checkpoint._write_durably = full
    try:
        yield
    finally:
        sharded_checkpoint._write_durably = real


def _disk_full_on_rank_zero(run: Run, rank: int, folder: Path) -> None:
    """A save in which rank 0 finds the disk full as it writes state.pt, after every process
    wrote its shards: rank 0 raises CheckpointError naming the disk error (the run layer's
    EveryRankSave then stops every process), the temp folder with every process's shards is
    removed, and the newest checkpoint is untouched."""
    run.trainer.state.iteration = run.trainer.state.optimizer_step = 9
    with _disk_full_on_rank_zero_while(rank):
        try:
            run.ckpt.save_last(run.trainer)
            raised = None
        except CheckpointError as error:
            raised = error
    dist.barrier()
    assert (raised is not None) == (rank == 0)
    if rank == 0:
        assert "could not save: [Errno 28] No space left on device" in raised.reason
        assert not [path for path in folder.iterdir() if path.name.endswith(".tmp")]
        assert os.readlink(folder / "last.dcp") == "step-00000008.dcp"


def _saves_behind_training(rank: int, data: list, folder: Path,
                           saved: dict[str, torch.Tensor]) -> None:
    """The first epoch again, each save written behind training (DCP's ``async_save`` on a
    process group of its own, while the steps' collectives run on the default one): its
    last checkpoint holds the synchronous run's weights. Then rank 0 finds the disk full as
    it writes state.pt behind training: the save returns, the next ``wait()`` raises on
    every process (rank 0 naming the disk), and ``last.dcp`` is untouched."""
    run = _build(folder, shard=True, rank=rank, keep_last=2, asynchronous=True)
    _train(run, data, STEPS_PER_EPOCH)
    run.ckpt.wait()
    if rank == 0:
        whole = read_checkpoint(folder / "last.dcp")
        assert whole["meta"]["iteration"] == STEPS_PER_EPOCH
        for name, tensor in saved.items():
            assert torch.equal(whole["model"][name], tensor), name
    run.trainer.state.iteration = run.trainer.state.optimizer_step = 9
    with _disk_full_on_rank_zero_while(rank):
        run.ckpt.save_last(run.trainer)
        with pytest.raises(CheckpointError) as raised:
            run.ckpt.wait()
    expected = ("could not save: [Errno 28] No space left on device" if rank == 0
                else "another process could not save it")
    assert expected in raised.value.reason
    if rank == 0:
        assert not [path for path in folder.iterdir() if path.name.endswith(".tmp")]
        assert os.readlink(folder / "last.dcp") == f"step-{STEPS_PER_EPOCH:08d}.dcp"


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def two_process_checkpoints(tmp_path_factory) -> Path:
    """The checkpoint folder two fully_shard processes left after two epochs (resumed once):
    steps 7 and 8 kept, ``last.dcp`` at step 8; ``final.pt`` holds the processes' whole
    weights and optimizer state at step 8."""
    root = tmp_path_factory.mktemp("sharded")
    mp.spawn(_two_process_worker, args=(_free_port(), root), nprocs=WORLD_SIZE)
    return root


def _copy(root: Path, tmp_path: Path) -> Path:
    """A copy of the checkpoint folder (symbolic links kept) to change in one test."""
    return Path(shutil.copytree(root / "checkpoints", tmp_path / "checkpoints", symlinks=True))


def test_two_processes_save_resume_and_end_bit_identical(two_process_checkpoints):
    folder = two_process_checkpoints / "checkpoints"
    assert {path.name for path in folder.iterdir()} == {
        "step-00000007.dcp", "step-00000007.dcp.json", "step-00000008.dcp",
        "step-00000008.dcp.json", "last.dcp", "last.dcp.json"}
    assert os.readlink(folder / "last.dcp") == "step-00000008.dcp"
    assert (folder / "last.dcp.json").samefile(folder / "step-00000008.dcp.json")
    assert {path.name for path in (folder / "last.dcp").iterdir()} == {
        "__0_0.distcp", "__1_0.distcp", ".metadata", "state.pt"}
    sidecar = json.loads((folder / "last.dcp.json").read_text())
    assert (sidecar["world_size"], sidecar["optimizer_step"], sidecar["kind"]) == (2, 8, "last")
    assert set(sidecar["files"]) == {"__0_0.distcp", "__1_0.distcp", ".metadata", "state.pt"}
    assert sidecar["sharded"] == ["model", "optimizer"]
    state = torch.load(folder / "last.dcp" / "state.pt", weights_only=True)
    assert "model" not in state and len(state["rng"]) == WORLD_SIZE
    # Each process's generators, not rank 0's twice: their dropout draws differ.
    assert not torch.equal(state["rng"][0]["torch_cpu"], state["rng"][1]["torch_cpu"])


def _final(root: Path) -> dict:
    return torch.load(root / "final.pt", weights_only=True)


def test_a_two_process_checkpoint_resumes_on_one_process_with_equal_state(
        two_process_checkpoints, tmp_path):
    folder = _copy(two_process_checkpoints, tmp_path)
    final = _final(two_process_checkpoints)
    one = _build(folder, shard=False)
    info = one.ckpt.resume("auto")
    assert info.path.name == "last.dcp" and one.trainer.state.iteration == 8
    for name, tensor in one.model.state_dict().items():
        assert torch.equal(tensor, final["model"][name]), name
    names = [name for name, _ in one.model.named_parameters()]
    for index, state in one.optimizer.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(value, final["optimizer"]["state"][names[index]][key])
    # Rank 0's generators when the checkpoint has more processes than this run.
    assert torch.equal(torch.get_rng_state(), torch.load(
        folder / "last.dcp" / "state.pt", weights_only=True)["rng"][0]["torch_cpu"])


def test_the_whole_read_is_a_single_file_checkpoint_that_loads_into_a_plain_model(
        two_process_checkpoints, tmp_path):
    final = _final(two_process_checkpoints)
    whole = read_checkpoint(two_process_checkpoints / "checkpoints" / "last.dcp")
    assert whole["meta"]["optimizer_step"] == 8 and whole["trainer"]["iteration"] == 8
    plain = _build(tmp_path / "plain", shard=False)
    plain.model.load_state_dict(whole["model"])  # strict: every key, every shape
    plain.optimizer.load_state_dict(whole["optimizer"])  # keyed by index, as torch keys it
    names = [name for name, _ in plain.model.named_parameters()]
    for index, name in enumerate(names):
        assert torch.equal(plain.model.get_parameter(name), final["model"][name])
        assert torch.equal(plain.optimizer.state_dict()["state"][index]["exp_avg_sq"],
                           final["optimizer"]["state"][name]["exp_avg_sq"])
    assert whole["rng"]["torch_cpu"].dtype == torch.uint8  # rank 0's, as one process has one


@pytest.mark.parametrize(("damage", "reason"), [
    (lambda step: (step / "__1_0.distcp").unlink(), "incomplete: __1_0.distcp is missing"),
    (lambda step: os.truncate(step / "__0_0.distcp", 10), "truncated __0_0.distcp"),
    (lambda step: (step / "state.pt").write_bytes(b"x" * (step / "state.pt").stat().st_size),
     "checksum mismatch in state.pt"),
    (lambda step: shutil.rmtree(step), "incomplete: the folder is missing"),
])
def test_an_incomplete_or_corrupt_newest_folder_gives_way_to_the_previous_one(
        two_process_checkpoints, tmp_path, damage, reason):
    folder = _copy(two_process_checkpoints, tmp_path)
    damage(folder / "step-00000008.dcp")
    one = _build(folder, shard=False)
    info = one.ckpt.resume("auto")
    assert info.path.name == "step-00000007.dcp" and one.trainer.state.iteration == 7
    # A deleted folder leaves only last.dcp, dangling, to reject.
    assert [Path(name).name for name, _ in info.rejected][:2] in (
        ["last.dcp", "step-00000008.dcp"], ["last.dcp"])
    assert all(reason in why for _, why in info.rejected)


def test_a_folder_without_its_sidecar_is_not_trusted(two_process_checkpoints, tmp_path):
    folder = _copy(two_process_checkpoints, tmp_path)
    (folder / "last.dcp.json").unlink()
    (folder / "step-00000008.dcp.json").unlink()
    info = _build(folder, shard=False).ckpt.resume("auto")
    assert info.path.name == "step-00000007.dcp"
    assert "no checksum sidecar last.dcp.json" in info.rejected[0][1]


def test_checkpoints_of_the_other_format_are_an_error_not_a_fresh_start(
        two_process_checkpoints, tmp_path):
    folder = _copy(two_process_checkpoints, tmp_path)
    single = _build(folder, shard=False)
    single.ckpt.format = SingleFile()
    with pytest.raises(CheckpointError, match=r"another format \(step-00000008.dcp\), this run "
                                              r"reads .pt ones"):
        single.ckpt.resume("auto")


# A save killed at each phase, in one process (the commit is rank 0's; the shards of a
# one-process group are written by the same code).


def _run_until_killed(dirname: Path, phase: str, asynchronous: bool = False) -> None:
    script = (
        "import sys; sys.path.insert(0, 'tests/handlers/checkpoint'); import test_sharded as t; "
        f"run = t._build(t.Path({str(dirname)!r}), shard=False, keep_last=1, "
        f"asynchronous={asynchronous}); "
        "t._train(run, t._batches(0), 3); run.ckpt.wait_handler(run.trainer)"
    )
    env = {**os.environ, "CKPT_TEST_CRASH_PHASE": phase}
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=env, timeout=300,
                          capture_output=True, text=True)
    assert done.returncode == 137, done.stderr


RESUMED_AFTER = {"before_link": ("step-00000002.dcp", 2), "during_eviction": ("last.dcp", 2)}


# Three phases in `make test`, one of each outcome; the others in `make test-slow`. Written
# behind training, every phase again and two of its own (final_wait's outcome depends on how
# far the write got: test_async.py kills there); in `make test`, those two and one phase
# reached on the background thread.
FAST_PHASES = ("mid_write", "before_link", "during_eviction")
OWN_ASYNC_PHASES = ("after_copy", "background_start")
FAST_ASYNC_PHASES = (*OWN_ASYNC_PHASES, "mid_write")


@pytest.mark.parametrize(("phase", "asynchronous"), [
    pytest.param(phase, asynchronous,
                 marks=[] if phase in (FAST_ASYNC_PHASES if asynchronous else FAST_PHASES)
                 else [pytest.mark.slow])
    for asynchronous in (False, True)
    for phase in CRASH_PHASES + (OWN_ASYNC_PHASES if asynchronous else ())])
def test_a_sharded_save_killed_at_each_phase_resumes_from_a_complete_checkpoint(
        tmp_path, phase, asynchronous):
    _run_until_killed(tmp_path, f"{phase}:2", asynchronous)
    run = _build(tmp_path, shard=False, keep_last=1)
    info = run.ckpt.resume("auto")
    assert (info.path.name, info.meta["iteration"]) == RESUMED_AFTER.get(phase, ("last.dcp", 1))
    assert not [path for path in tmp_path.iterdir() if path.name.endswith(".tmp")]
    assert run.ckpt.state_dict()["evict"] == []
    _train(run, _batches(0), 3)
    assert {path.name for path in tmp_path.iterdir()} == {
        "step-00000003.dcp", "step-00000003.dcp.json", "last.dcp", "last.dcp.json"}


@pytest.mark.parametrize("phase", [pytest.param("mid_write", marks=pytest.mark.slow),
                                   "before_sidecar"])
def test_a_sharded_first_save_killed_before_its_sidecar_starts_fresh(tmp_path, phase):
    _run_until_killed(tmp_path, f"{phase}:1")
    fresh = _build(tmp_path, shard=False, keep_last=1)
    assert fresh.ckpt.resume("auto") is None
    assert not [path for path in tmp_path.iterdir() if path.name.endswith(".tmp")]


class _Holder:
    """A handler whose state holds a copy of the (sharded) weights, as an average does."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict:
        return {"average": {name: tensor.detach().clone()
                            for name, tensor in self.model.state_dict().items()}}

    def load_state_dict(self, state: dict) -> None:
        pass


def test_sharded_tensors_outside_the_model_and_optimizer_are_refused_by_name(tmp_path):
    dist.init_process_group("gloo", rank=0, world_size=1,
                            store=dist.FileStore(str(tmp_path / "store"), 1))
    try:
        run = _build(tmp_path / "checkpoints", shard=True)
        run.ckpt.to_save["averaging"] = _Holder(run.model)
        run.trainer.state.iteration = run.trainer.state.optimizer_step = 1
        with pytest.raises(CheckpointError, match=r"checkpoint\['averaging'\] holds sharded "
                                                  r"tensors \(DTensor\): only model and "
                                                  r"optimizer are saved sharded"):
            run.ckpt.save_last(run.trainer)
    finally:
        dist.destroy_process_group()
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_a_full_disk_under_dcp_is_named_as_a_full_disk(tmp_path, monkeypatch):
    """DCP gathers each process's failure into a CheckpointException whose first line names
    only the ranks; a full disk's is torch.save's RuntimeError with the disk's OSError as
    its ``__context__``. The save raises that OSError and leaves no temp folder."""
    def dcp_on_a_full_disk(*args, **kwargs):
        try:
            try:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            except OSError:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected "  # noqa: B904
                                   "pos 704 vs 598")
        except RuntimeError as failure:
            raise CheckpointException("save failed", {
                0: (ValueError("rank 0 waited"), traceback.StackSummary()),
                1: (failure, traceback.StackSummary())}) from None

    monkeypatch.setattr(sharded_checkpoint.dcp, "save", dcp_on_a_full_disk)
    with pytest.raises(OSError) as raised:
        ShardedFolder().write(tmp_path / "step-00000001.dcp", {"model": {}}, {},
                              file_mode=0o640, crash=CrashPoints())
    assert str(raised.value) == "[Errno 28] No space left on device"
    assert list(tmp_path.iterdir()) == []


def test_the_group_of_saves_behind_training_waits_the_runs_collective_timeout(monkeypatch):
    """A peer lost during a sharded save written behind training ends the run after
    ``--collective-timeout``, as one lost in a training collective does, not after gloo's
    default 30 minutes."""
    made = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "new_group", lambda **kwargs: made.update(kwargs) or "its group")
    folder = format_for("fsdp", timedelta(seconds=7))
    assert folder._behind_group() == "its group"
    assert made == {"backend": "gloo", "timeout": timedelta(seconds=7)}
