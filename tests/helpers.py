"""What several test modules share: each recipe's tiny command line, a run folder's digests and
copy, tiny text corpora, the one-line error check, the export tests' evaluator outputs, and the
bound within which two runs whose reductions sum in another order agree.

Test modules import from here, never from one another (tests/test_layering.py checks it);
fixtures live in the conftest.py files."""

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import ignite.distributed as idist
import torch
import torch.distributed as dist
from ignite.engine import Events
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from engine.trainer import create_evaluator
from recipes.__main__ import main
from recipes.runner.commands.trained import load_trained
from recipes.runner.config.command_line import parse_args
from recipes.runner.config.registry import load_recipe

REPO = Path(__file__).resolve().parents[1]
RUN_RECIPE = REPO / "tests" / "reliability" / "run_recipe.py"  # the command line plus faults

# Each recipe's tiny run; a test module adds what it needs (epochs, the data) to it.
CHARLM = ["charlm", "--val-fraction", "0.2", "--block-size", "8", "--n-layer", "1",
          "--n-head", "2", "--n-embd", "16", "--batch-size", "16", "--progress", "off",
          "--device", "cpu"]
CIFAR = ["cifar", "--dataset", "synthetic", "--train-subset", "128", "--val-subset", "32",
         "--batch-size", "32", "--accum-steps", "1", "--progress", "off"]
IMAGES = ["images", "--model", "squeezenet1_1", "--num-workers", "0", "--batch-size", "8",
          "--progress", "off"]
# Two epochs: the tiny runs the command tests train (tests/recipes/runner/conftest.py).
CHARLM_RUN = [*CHARLM, "--epochs", "2"]
CIFAR_RUN = [*CIFAR, "--epochs", "2", "--warmup-epochs", "0.5"]
IMAGES_RUN = [*IMAGES, "--epochs", "2", "--lr", "0.02", "--warmup-epochs", "0.5"]
# About 16 iterations an epoch on write_text's 600 words, run in a folder holding text.txt.
CHARLM_IN_FOLDER = [*CHARLM, "--text", "text.txt", "--epochs", "2", "--checkpoint-every", "2"]
# CIFAR's default (airbench) run on a few samples, for runs of several processes.
TINY_AIRBENCH_RUN = ("--dataset", "synthetic", "--train-subset", "64", "--val-subset", "9",
                     "--batch-size", "32", "--accum-steps", "1", "--epochs", "1",
                     "--warmup-epochs", "0.5", "--device", "cpu", "--progress", "off",
                     "--run-name", "r")


def write_text(path: Path, words: int = 600, seed: int = 0) -> Path:
    """``words`` Python-like words drawn with ``seed``: a corpus for the charlm recipe."""
    vocabulary = ["def", "return", "self", "value", "import", "class", "for", "in", "if"]
    picks = torch.randint(len(vocabulary), (words,), generator=torch.Generator().manual_seed(seed))
    path.write_text(" ".join(vocabulary[i] for i in picks.tolist()))
    return path


def write_text_folder(root: Path, n_files: int = 20, lines_per_file: int = 6) -> Path:
    """``n_files`` small Python-like files, some in a subfolder."""
    for index in range(n_files):
        path = root / ("sub" if index % 3 else "") / f"module_{index}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(f"def f{index}_{line}(x):\n    return x + {line}\n"
                                for line in range(lines_per_file)))
    return root


def charlm_config(*extra: str):
    """The charlm recipe and its config parsed from ``CHARLM_IN_FOLDER`` plus ``extra``."""
    recipe = load_recipe("charlm")
    config, given = parse_args(recipe.config, [*CHARLM_IN_FOLDER[1:], *extra])
    return recipe, config, given


def train(args: list[str], run_dir: Path) -> Path:
    assert main([*args, "--run-dir", str(run_dir)]) == 0
    return run_dir


def digests(folder: Path, *skipped: str) -> dict[str, str]:
    """sha256 of every file under ``folder`` by relative path (what "untouched" means), but
    those inside a folder named in ``skipped``."""
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*"))
            if path.is_file() and not set(path.relative_to(folder).parts[:-1]) & set(skipped)}


def copy_run(source: Path, destination: Path, keep: Callable[[str], bool] = lambda path: True,
             *, hard_links: bool = True) -> Path:
    """Copy the files of a run folder whose path in it (``checkpoints/last.pt``) ``keep``
    takes, keeping hard links as hard links (last.pt shares a file with a step);
    ``hard_links=False``: every file its own copy, for a test that damages one alone."""
    copied: dict[tuple[int, int], Path] = {}
    destination.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.rglob("*")):
        name = str(path.relative_to(source))
        if path.is_dir() or not keep(name):
            continue
        target = destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        key = (path.stat().st_dev, path.stat().st_ino)
        if hard_links and key in copied:
            os.link(copied[key], target)
        else:
            shutil.copy2(path, target)
            copied[key] = target
    return destination


def one_error_line(code: int, err: str, *fragments: str) -> str:
    """``err`` is one ``error: ...`` line holding every fragment, and ``code`` is 2."""
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def leave_the_group() -> None:
    """End the one-rank group a one-process fsdp run leaves in this process (and
    ``ignite.distributed``'s hold on it), so that what runs next runs without one."""
    if dist.is_initialized():
        idist.sync()
        idist.finalize()


# --- a trained run's evaluations -----------------------------------------------------------


def recorded(run_dir: Path) -> dict[str, float]:
    """The run's best metrics as it recorded them in summary.json."""
    summary = json.loads((run_dir / "summary.json").read_text())
    return {key.removeprefix("best_val_"): value for key, value in summary.items()
            if key.startswith("best_val_")}


def evaluated(run_dir: Path, name: str = "best-validation") -> dict:
    return json.loads((run_dir / "evaluations" / f"{name}.json").read_text())


# The tiny runs' fixtures (tests/recipes/runner/conftest.py), by name.
RUNS = ["cifar_run", "images_run", "charlm_run"]
# The model's input in a prepared validation batch: a charlm window's last byte is a target.
MODEL_INPUT = {"cifar": lambda batch: batch[0], "images": lambda batch: batch[0],
               "charlm": lambda batch: batch[:, :-1]}
# Where the tiny runs' outputs may differ between the evaluator and the export (both fp32 on
# the CPU; the measured difference is 0 for every recipe).
TOLERANCE = 1e-5


def evaluation(recipe: str, run_dir: Path) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(model inputs, evaluator outputs) over the validation batches, in order; CIFAR's
    evaluator without test-time augmentation (the export is the plain forward)."""
    trained = load_trained(load_recipe(recipe), str(run_dir))
    parts = trained.parts
    if recipe == "cifar":
        parts.predict.name = "none"
    inputs = [MODEL_INPUT[recipe](parts.prepare_batch(batch, trained.device, False))
              for batch in parts.val_batches]
    evaluator = create_evaluator(parts.model, {}, device=trained.device,
                                 precision=trained.config.precision, predict=parts.predict,
                                 prepare_batch=parts.prepare_batch)
    outputs: list[torch.Tensor] = []
    evaluator.add_event_handler(Events.ITERATION_COMPLETED,
                                lambda engine: outputs.append(engine.state.output[0]))
    evaluator.run(parts.val_batches)
    return inputs, outputs


class RunsCodeWhenUnpickled:
    """Unpickling calls ``os.mkdir(marker)``: what a booby-trapped checkpoint would do; a test
    asserts ``marker`` never appears."""

    def __init__(self, marker: Path | str) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def scalar_tags(run_dir: Path) -> list[str]:
    """Every scalar tag TensorBoard holds."""
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return events.Tags()["scalars"]


def scalar_steps(run_dir: Path, tag: str) -> list[int]:
    """The steps TensorBoard holds for ``tag``."""
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return sorted(event.step for event in events.Scalars(tag))


# Hostile sharded checkpoints, made as their author would make them: the folder's own
# (honest) .metadata is read with plain pickle here, changed, and the sidecar resealed so that
# only the reader's own checks stand in the way.

# A pickle prefix that BUILDs the class pathlib.PosixPath itself: under plain pickle every
# path of the process would read as "X".
BUILD_ON_A_CLASS = (b"cpathlib\nPosixPath\n" b"N}X\x04\x00\x00\x00_strX\x01\x00\x00\x00Xs\x86b"
                    b"0")


def reseal(folder: Path) -> None:
    """Rewrite every sidecar of a sharded folder (its own, ``best.dcp.json``...) to match its
    files as they now are."""
    files = {name: {"sha256": hashlib.sha256((folder / name).read_bytes()).hexdigest(),
                    "size_bytes": (folder / name).stat().st_size}
             for name in json.loads(folder.with_name(folder.name + ".json").read_text())["files"]}
    for sidecar_path in folder.parent.glob("*.dcp.json"):
        sidecar = json.loads(sidecar_path.read_text())
        if (folder.parent / sidecar_path.name[:-5]).resolve() == folder.resolve():
            sidecar["files"] = files
            sidecar_path.write_text(json.dumps(sidecar))


def plant_pickle_in_a_bytes_entry(folder: Path, marker: Path) -> None:
    """Point a byte entry of the sharded checkpoint ``folder`` (an optimizer's param_groups,
    say) at a ``torch.save`` archive, appended to its shard, whose pickle runs
    ``os.mkdir(marker)``: DCP's own planner loads it with ``weights_only=False``."""
    import io
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = pickle.loads((folder / ".metadata").read_bytes())
    index = next(index for index in metadata.storage_data
                 if isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata))
    blob = io.BytesIO()
    torch.save(RunsCodeWhenUnpickled(marker), blob)
    shard = folder / metadata.storage_data[index].relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as stream:
        stream.write(blob.getvalue())
    metadata.storage_data[index] = _StorageInfo(shard.name, offset, len(blob.getvalue()))
    _replace(folder / ".metadata", pickle.dumps(metadata))
    reseal(folder)


def plant_build_on_a_class(folder: Path) -> None:
    """Make the sharded checkpoint ``folder``'s .metadata BUILD ``pathlib.PosixPath`` itself
    before its real content (which still loads as metadata)."""
    data = (folder / ".metadata").read_bytes()
    assert data[:2] == b"\x80\x04"
    _replace(folder / ".metadata", data[:2] + BUILD_ON_A_CLASS + data[2:])
    reseal(folder)


def _replace(path: Path, data: bytes) -> None:
    path.unlink()  # never write through a hard link into another checkpoint
    path.write_bytes(data)


# --- runs of several processes --------------------------------------------------------------


# Muon's Newton-Schulz iteration: five steps of a quintic whose slope at 0 is 3.4445.
NEWTON_SCHULZ_GAIN = 3.4445 ** 5


def assert_within_reduction_order(got: torch.Tensor, expected: torch.Tensor, steps: int):
    """DDP all-reduces gradients; FSDP reduce-scatters them and sums the clipping norm's
    squares shard by shard: the same sums in another order, so each step's gradients differ in
    their last bit (eps = 2**-23 of their size; which bits depends on the CPU's vector width).
    The optimizers here magnify a relative change by at most Muon's Newton-Schulz gain along a
    gradient's smallest singular directions (a**5, about 487; AdamW's update is scale-free),
    and every step adds its own: ``steps * gain * eps`` of the tensor's largest value. A wrong
    reduction changes the update itself, not its last bits. The same holds for a group whose
    processes use another number of threads, or sit on other machines."""
    bound = steps * NEWTON_SCHULZ_GAIN * torch.finfo(torch.float32).eps
    torch.testing.assert_close(got, expected, rtol=0,
                               atol=bound * expected.abs().max().item())


def assert_state_within_reduction_order(got: dict, expected: dict, steps: int) -> None:
    """Two checkpoints' model weights and optimizer state (``param_groups`` equal, each state
    tensor) within ``assert_within_reduction_order``'s bound after ``steps`` steps."""
    assert got["model"].keys() == expected["model"].keys()
    for name, tensor in expected["model"].items():
        assert_within_reduction_order(got["model"][name], tensor, steps)
    assert got["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]
    for index, state in expected["optimizer"]["state"].items():
        for key, value in state.items():
            assert_within_reduction_order(got["optimizer"]["state"][index][key], value, steps)


def assert_bit_identical(actual, expected, where: str) -> None:
    """Tensors bit-identical, everything else equal, through nested dicts and lists."""
    if isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected) and actual.dtype == expected.dtype, where
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), where
        for key in expected:
            assert_bit_identical(actual[key], expected[key], f"{where}/{key}")
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), where
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_bit_identical(a, e, f"{where}/{index}")
    else:
        assert actual == expected, where
