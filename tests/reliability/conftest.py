"""Shared machinery of the reliability suite: start the recipe's command line in a child
process, fault it, and compare what it leaves behind with an uninterrupted run.

Every guarantee is checked for every recipe: the session fixture ``recipe_case`` runs the
whole suite once per recipe in ``RECIPE_CASES``, each as a tiny job of the same shape
(``RUN_ARGS``: 8 iterations per epoch, 3 epochs, a step-clocked OneCycle schedule, a
checkpoint every 3 optimizer steps) on data the test makes (CIFAR: synthetic images;
charlm: one generated text file; images: a tree of tiny PNGs), through ``run_recipe.py``, which is
``python -m recipes`` plus test-only faults. The child
runs with one intra-op thread: on this 2-core shared machine a second thread only
spin-waits (a run took 35 s with two threads, 10 s with one), and the uninterrupted
reference and the resumed runs must use the same thread count to be bit-identical.
"""

import dataclasses
import functools
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.util.tensor_util import make_ndarray

from handlers.checkpoint.files import checkpoint_in
from handlers.checkpoint.formats import read_checkpoint
from tests.helpers import copy_run, digests

RUN_RECIPE = Path(__file__).with_name("run_recipe.py")
ITERATIONS_PER_EPOCH, EPOCHS = 8, 3  # 256 samples / batch 32; every iteration is a step
TOTAL_ITERATIONS = ITERATIONS_PER_EPOCH * EPOCHS
LOG_EVERY = 2  # a progress line ("epoch 1/3 step 2 ...") every 2 optimizer steps
# The run keys every recipe's tiny job shares; 32 x 8 = 256 training samples per epoch.
RUN_ARGS = (
    "--batch-size", "32", "--accum-steps", "1", "--epochs", str(EPOCHS), "--checkpoint-every", "3",
    "--progress", "plain", "--log-every", str(LOG_EVERY), "--scheduler", "onecycle",
    "--device", "cpu",
)
# Run keys whose change a resume refuses, with a value that differs from RUN_ARGS'.
FIXED_RUN_KEYS = {"batch-size": "64", "precision": "bf16", "seed": "1", "scheduler": "cosine",
                  "accum-steps": "2", "log-every": "5", "patience": "2", "warmup-epochs": "1"}


@dataclass(frozen=True)
class RecipeCase:
    """One recipe's tiny job: its name, its own arguments (the data), and its own keys that
    a resume refuses to change (with a changed value)."""

    name: str
    args: tuple[str, ...]
    fixed_keys: dict[str, str]

    @property
    def command_args(self) -> tuple[str, ...]:
        return (self.name, *self.args, *RUN_ARGS)


def _cifar_case(data_dir: Path) -> RecipeCase:
    return RecipeCase("cifar", ("--dataset", "synthetic", "--train-subset", "256",
                                "--val-subset", "64"),
                      {"model": "resnet18", "train-subset": "128", "dataset": "cifar10",
                       "momentum": "0.5", "weight-decay": "0", "lookahead": "false"})


def _charlm_case(data_dir: Path) -> RecipeCase:
    """One text file: the last 20% validates. Windows of 8 + 1 bytes: 2057 training bytes
    are 256 windows (one slot is kept free for the random shift), 513 validation bytes 64."""
    words = ["def", "return", "self", "value", "import", "class", "for", "in", "if", "else"]
    chooser = torch.Generator().manual_seed(0)
    picks = torch.randint(len(words), (1200,), generator=chooser).tolist()
    text = data_dir / "corpus.txt"
    text.write_text(" ".join(words[i] for i in picks))
    return RecipeCase("charlm", ("--text", str(text), "--val-fraction", "0.2",
                                 "--max-train-bytes", "2057", "--max-val-bytes", "513",
                                 "--block-size", "8", "--n-layer", "1", "--n-head", "2",
                                 "--n-embd", "16"),
                      {"block-size": "16", "n-embd": "32", "weight-decay": "0"})


def _images_case(data_dir: Path) -> RecipeCase:
    """An image-folder tree of 8 px PNGs, two classes in their own colour ranges: 128 + 128
    training images (8 batches of 32), 32 + 32 validation images; one DataLoader worker, so
    the loader's checkpointed position covers a worker process. ``--lr 0.02``: at the
    recipe's 0.1 this tiny job's loss spikes on its own, which the spike-guard tests would
    rightly count."""
    generator = torch.Generator().manual_seed(0)
    for split, count in (("train", 128), ("val", 32)):
        for label, name in enumerate(("dark", "light")):
            folder = data_dir / split / name
            folder.mkdir(parents=True)
            for index in range(count):
                pixels = torch.randint(0, 100, (8, 8, 3), dtype=torch.uint8,
                                       generator=generator) + 120 * label
                Image.fromarray(pixels.numpy()).save(folder / f"{index:03d}.png")
    return RecipeCase("images", ("--data-dir", str(data_dir), "--model", "resnet18",
                                 "--lr", "0.02", "--num-workers", "1"),
                      {"model": "squeezenet1_1", "num-workers": "2"})


RECIPE_CASES = {"cifar": _cifar_case, "charlm": _charlm_case, "images": _images_case}
RUN_TIMEOUT_SEC = 300  # a run takes ~10 s; generous for a loaded machine
FAULT_VARIABLES = ("RELIABILITY_", "CKPT_TEST_")
# Entries of a final checkpoint that legitimately differ between two runs of the same job:
# identity and clocks.
VOLATILE = {
    ("meta", "run_id"), ("meta", "saved_at_unix"), ("meta", "config", "run_dir"),
    ("history", "wall_time_sec"), ("history", "train_time_sec"),
}


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def child_env(faults: dict[str, str] | None = None) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(FAULT_VARIABLES)}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(faults or {})
    return env


def recipe_command(case: RecipeCase, run_dir: Path, *extra: str,
                   entry: tuple[str, ...] = (str(RUN_RECIPE),)) -> list[str]:
    """The case's command with ``--run-dir``; a ``--key value`` pair in ``extra`` replaces
    the base one (the command line refuses a key given twice). ``entry=("-m", "recipes")``
    runs the unwrapped command line: no faults, CIFAR's full-size net."""
    name, *base_args = case.command_args
    overridden = set(extra[::2])
    base = [item for key, value in zip(base_args[0::2], base_args[1::2], strict=True)
            if key not in overridden for item in (key, value)]
    return [sys.executable, *entry, name, *base, "--run-dir", str(run_dir), *extra]


def run_recipe(case: RecipeCase, run_dir: Path, *extra: str,
               faults: dict[str, str] | None = None,
               entry: tuple[str, ...] = (str(RUN_RECIPE),)) -> Result:
    """Run the recipe to its end (or its crash) and return what it printed."""
    start = time.monotonic()
    done = subprocess.run(recipe_command(case, run_dir, *extra, entry=entry),
                          env=child_env(faults),
                          cwd=run_dir.parent, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_SEC)
    return Result(done.returncode, done.stdout, done.stderr, time.monotonic() - start)


def run_and_signal(case: RecipeCase, run_dir: Path, signum: int, after_lines: int,
                   delay_sec: float = 0.0, *extra: str, faults: dict[str, str] | None = None,
                   entry: tuple[str, ...] = (str(RUN_RECIPE),), group: bool = False) -> Result:
    """Start the recipe, send ``signum`` ``delay_sec`` after its ``after_lines``-th progress
    line, and wait for it; ``extra["exit_sec"]`` is the time from the signal to the exit.
    ``group``: the signal goes to every process the command started (the ``--nproc``
    spawner and its ranks, as when a job is killed), not to the first alone."""
    stderr_path = run_dir.parent / f"{run_dir.name}.stderr.txt"
    with open(stderr_path, "w") as stderr:
        child = subprocess.Popen(recipe_command(case, run_dir, *extra, entry=entry),
                                 env=child_env(faults),
                                 cwd=run_dir.parent, stdout=subprocess.PIPE, stderr=stderr,
                                 text=True, start_new_session=group)
        lines, progress_lines = [], 0
        try:
            while progress_lines < after_lines:
                line = child.stdout.readline()
                if not line:
                    break  # ended before the wanted line: the caller's asserts will say so
                lines.append(line)
                progress_lines += line.startswith("epoch ")
            time.sleep(delay_sec)
            signalled = time.monotonic()
            if group:
                os.killpg(child.pid, signum)
            else:
                child.send_signal(signum)
            rest, _ = child.communicate(timeout=RUN_TIMEOUT_SEC)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        exit_sec = time.monotonic() - signalled
    result = Result(child.returncode, "".join(lines) + rest, stderr_path.read_text())
    result.extra.update(exit_sec=exit_sec, progress_lines=progress_lines)
    return result


def final_checkpoint(run_dir: Path) -> dict[str, Any]:
    """``last.pt`` (or a sharded run's ``last.dcp``, read whole), verified against its
    sidecar and loaded with weights_only=True."""
    return read_checkpoint(checkpoint_in(run_dir / "checkpoints", "last"))


def differences(actual: Any, expected: Any, path: tuple = ()) -> list[str]:
    """Every place where two checkpoint payloads differ; tensors must be ``torch.equal``
    with the same dtype (bit-identical), floats equal (NaN equals NaN)."""
    if path in VOLATILE:
        return []
    where = "/".join(str(part) for part in path) or "<root>"
    if isinstance(expected, torch.Tensor):
        same = (isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype
                and actual.shape == expected.shape and torch.equal(actual, expected))
        return [] if same else [f"{where}: tensors differ"]
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or actual.keys() != expected.keys():
            keys = sorted(map(str, actual.keys())) if isinstance(actual, dict) else actual
            return [f"{where}: keys {keys} != {sorted(map(str, expected.keys()))}"]
        return [found for key in expected
                for found in differences(actual[key], expected[key], (*path, key))]
    if isinstance(expected, list | tuple):
        if type(actual) is not type(expected) or len(actual) != len(expected):
            return [f"{where}: {actual!r} != {expected!r}"]
        return [found for index, (a, e) in enumerate(zip(actual, expected, strict=True))
                for found in differences(a, e, (*path, index))]
    if isinstance(expected, float) and isinstance(actual, float) and math.isnan(expected):
        return [] if math.isnan(actual) else [f"{where}: {actual!r} != nan"]
    return [] if actual == expected and type(actual) is type(expected) else [
        f"{where}: {actual!r} != {expected!r}"]


def tensorboard_scalars(run_dir: Path, tag: str) -> dict[int, list[float]]:
    """Every value written for ``tag`` by step, over all event files of the run (a resumed
    run has one per session; a killed session may have logged steps the resume redoes)."""
    values: dict[int, list[float]] = {}
    for events_file in sorted(run_dir.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(events_file)).Load():
            for value in event.summary.value:
                if value.tag == tag:
                    values.setdefault(event.step, []).append(float(make_ndarray(value.tensor)))
    return values


def metrics_records(run_dir: Path) -> list[dict[str, Any]]:
    """``metrics.jsonl`` without what differs between two runs of the same job: each
    record's ``time`` and the values of its ``perf/*`` timings (their tags stay)."""
    records = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        del record["time"]
        records.append({tag: None if tag.startswith("perf/") else value
                        for tag, value in record.items()})
    return records


def checkpoint_files(run_dir: Path) -> list[str]:
    return sorted(path.name for path in (run_dir / "checkpoints").iterdir())


@dataclass
class Reference:
    """The uninterrupted run every faulted run must end up identical to."""

    run_dir: Path
    state: dict[str, Any]
    losses: dict[int, list[float]]
    files: list[str]
    metrics: list[dict[str, Any]]

    @classmethod
    def of(cls, run_dir: Path) -> "Reference":
        return cls(run_dir, final_checkpoint(run_dir), tensorboard_scalars(run_dir, "train/loss"),
                   checkpoint_files(run_dir), metrics_records(run_dir))

    def assert_same_metrics(self, run_dir: Path) -> None:
        """``metrics.jsonl`` holds the reference's records, in its order, each with the same
        step, epoch, tags and values (but times): none duplicated, none missing."""
        records = metrics_records(run_dir)
        assert [(r["step"], r["epoch"]) for r in records] == [
            (r["step"], r["epoch"]) for r in self.metrics]
        assert records == self.metrics

    def assert_matches(self, run_dir: Path, stopped_at_step: int | None = None) -> None:
        """Final model, optimizer, scaler, scheduler, trainer counters, RNG, handler states
        and history bit-identical; every train/loss value ever logged equal to the
        reference's value at that step; the same checkpoint files left; no temp file.

        A run stopped by a signal saved one more history checkpoint, at ``stopped_at_step``,
        which retention keeps if it is among the newest ``keep_last``; it also logged its
        partial interval there (as every run does at its end), which the resumed run's next
        report covers again.
        """
        expected_state, expected_files = self.state, self.files
        if stopped_at_step is not None:
            history = self.state["checkpointer"]["history"]  # names sort by step
            kept = sorted({*history, f"step-{stopped_at_step:08d}.pt"})[-len(history):]
            expected_state = {**self.state,
                              "checkpointer": {**self.state["checkpointer"], "history": kept}}
            expected_files = sorted(
                {name for name in self.files if name.partition(".pt")[0] + ".pt" not in history}
                | {name + suffix for name in kept for suffix in ("", ".json")})
            # The extra save also changes which file retention evicted last.
            expected_state["checkpointer"]["evict"] = final_checkpoint(run_dir)[
                "checkpointer"]["evict"]
        state = final_checkpoint(run_dir)
        assert differences(state, expected_state) == []
        losses = tensorboard_scalars(run_dir, "train/loss")
        assert set(losses) - set(self.losses) <= {stopped_at_step}
        for step, expected in self.losses.items():
            assert set(losses.get(step, [])) == set(expected), f"train/loss at step {step}"
        assert checkpoint_files(run_dir) == expected_files
        summary = (run_dir / "summary.json").read_text()
        assert '"status": "completed"' in summary


# Every recipe runs the suite's core: a kill -9 at a random moment, a crash in the first save,
# a damaged newest checkpoint, SIGTERM, a refused resume change and every bad input. The
# exhaustive variants (12 kill moments, every crash phase, every kind of damage, the disk
# errors, ...; marked slow) exercise machinery every recipe shares (the checkpointer, the
# resume, the signal handler) and run for cifar in `make test-reliability`; for charlm and
# images (~90 s and ~190 s a case on 2 cores, a ResNet-18 on the CPU) only in `make test-slow`.
OTHER_RECIPES = ("charlm", "images")


@pytest.fixture(scope="session", params=[
    pytest.param(name, marks=pytest.mark.other_recipes) if name in OTHER_RECIPES else name
    for name in RECIPE_CASES])
def recipe_case(request, tmp_path_factory) -> RecipeCase:
    """Every test that uses the reference, the interrupted run or the harness runs once per
    recipe."""
    return RECIPE_CASES[request.param](tmp_path_factory.mktemp(f"{request.param}-data"))


@pytest.fixture(scope="session")
def reference(recipe_case, tmp_path_factory) -> Reference:
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    result = run_recipe(recipe_case, run_dir)
    assert result.returncode == 0, result.stderr
    print(f"reference run: {result.seconds:.1f} s")
    reference = Reference.of(run_dir)
    assert reference.state["meta"]["iteration"] == TOTAL_ITERATIONS
    assert all(len(values) == 1 for values in reference.losses.values())
    return reference


@pytest.fixture(scope="session")
def interrupted_run(recipe_case, tmp_path_factory) -> Path:
    """A run killed at the start of its 7th save. Committed: step 3, 6, best-step-8 (the
    epoch-end save; as it is also the newest, no separate step-8 is written), 9, 12, 15;
    history keeps 9, 12, 15; last.pt is a hard link to step 15 (iteration 15), best.pt to
    best-step-8. Tests copy it (``copy_run``) before changing anything."""
    run_dir = tmp_path_factory.mktemp("interrupted") / "run"
    result = run_recipe(recipe_case, run_dir, faults={"CKPT_TEST_CRASH_PHASE": "before_temp:7"})
    assert result.returncode == 137, result.stderr
    assert read_checkpoint(run_dir / "checkpoints" / "last.pt")["meta"]["iteration"] == 15
    return run_dir


@pytest.fixture(scope="session", params=["fp16", pytest.param("bf16", marks=pytest.mark.slow)])
def low_precision_job(request, tmp_path_factory) -> SimpleNamespace:
    """The charlm job at ``--precision fp16`` or ``bf16``, with its own uninterrupted
    reference. Every other run here is fp32 (``auto`` on the CPU), whose scaler is disabled
    and saves nothing; fp16's GradScaler puts its scale and growth tracker in every
    checkpoint, which a resume must restore. charlm is the cheapest recipe at fp16 on the
    CPU: ~11 s a run, where CIFAR's fp16 convolutions take ~90 s."""
    precision = request.param
    base = _charlm_case(tmp_path_factory.mktemp(f"charlm-{precision}-data"))
    case = dataclasses.replace(base, args=(*base.args, "--precision", precision))
    run_dir = tmp_path_factory.mktemp(f"reference-{precision}") / "run"
    result = run_recipe(case, run_dir)
    assert result.returncode == 0, result.stderr
    print(f"{precision} reference run: {result.seconds:.1f} s")
    return SimpleNamespace(precision=precision, reference=Reference.of(run_dir),
                           run_recipe=functools.partial(run_recipe, case),
                           run_and_signal=functools.partial(run_and_signal, case))


@pytest.fixture(scope="session")
def fsdp_job(tmp_path_factory) -> SimpleNamespace:
    """The charlm job under ``--strategy fsdp`` on 2 gloo processes (``--nproc 2``), with its
    own uninterrupted reference: its checkpoints are sharded ``.dcp`` folders, every process
    writing its own shards. charlm is the cheapest recipe to start twice over."""
    base = _charlm_case(tmp_path_factory.mktemp("charlm-fsdp-data"))
    case = dataclasses.replace(base, args=(*base.args, "--strategy", "fsdp", "--nproc", "2"))
    run_dir = tmp_path_factory.mktemp("reference-fsdp") / "run"
    result = run_recipe(case, run_dir)
    assert result.returncode == 0, result.stderr
    print(f"fsdp reference run: {result.seconds:.1f} s")
    reference = Reference.of(run_dir)
    assert (run_dir / "checkpoints" / "last.dcp").is_symlink()
    return SimpleNamespace(reference=reference, run_recipe=functools.partial(run_recipe, case),
                           run_and_signal=functools.partial(run_and_signal, case, group=True))


@pytest.fixture(scope="session")
def async_job(tmp_path_factory) -> SimpleNamespace:
    """The charlm job with ``--async-checkpoint true`` (every save written behind training),
    with its own uninterrupted reference."""
    base = _charlm_case(tmp_path_factory.mktemp("charlm-async-data"))
    case = dataclasses.replace(base, args=(*base.args, "--async-checkpoint", "true"))
    run_dir = tmp_path_factory.mktemp("reference-async") / "run"
    result = run_recipe(case, run_dir)
    assert result.returncode == 0, result.stderr
    print(f"async reference run: {result.seconds:.1f} s")
    return SimpleNamespace(reference=Reference.of(run_dir),
                           run_recipe=functools.partial(run_recipe, case))


SIGNALS = {"SIGTERM": (signal.SIGTERM, 143), "SIGINT": (signal.SIGINT, 130),
           "SIGUSR1": (signal.SIGUSR1, 138)}


@pytest.fixture(scope="session")
def harness(recipe_case) -> SimpleNamespace:
    """The helpers and constants above, bound to this session's recipe, for the test
    modules, which cannot import this conftest under ``--import-mode=importlib``."""
    return SimpleNamespace(
        recipe=recipe_case.name, fixed_keys={**FIXED_RUN_KEYS, **recipe_case.fixed_keys},
        run_recipe=functools.partial(run_recipe, recipe_case),
        run_and_signal=functools.partial(run_and_signal, recipe_case), copy_run=copy_run,
        command=functools.partial(recipe_command, recipe_case), child_env=child_env,
        file_digests=digests, final_checkpoint=final_checkpoint, differences=differences,
        checkpoint_files=checkpoint_files, tensorboard_scalars=tensorboard_scalars,
        Reference=Reference, SIGNALS=SIGNALS,
        ITERATIONS_PER_EPOCH=ITERATIONS_PER_EPOCH, TOTAL_ITERATIONS=TOTAL_ITERATIONS,
        LOG_EVERY=LOG_EVERY,
    )
