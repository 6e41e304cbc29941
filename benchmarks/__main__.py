"""Run every benchmark and write the report:
``python -m benchmarks [--quick] [--only gpu|tracker] [--out PATH]``.

Exit status 0; 1 when an arm's loss parity failed (the report is still written, with the
failures); 2 when PyTorch Lightning is missing (``pip install -e '.[bench]'``), with
``--only gpu`` when the GPU section cannot run here (no CUDA, no airbench, no data), or with
``--only tracker`` when MLflow is missing (``pip install -e '.[mlflow]'``).
"""

import argparse
import dataclasses
import importlib.util
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.arms.loops import ARMS, WITH_MLFLOW
from benchmarks.arms.workloads import cifar_workload, tiny_workload
from benchmarks.harness.machine import describe_machine, load_average
from benchmarks.harness.plan import FULL, QUICK, Plan
from benchmarks.harness.report import document
from benchmarks.sections import (
    s1_overhead,
    s2_syncs,
    s3_data,
    s4_epoch,
    s5_gpu,
    s6_image_folder,
    s7_sweep,
    s8_async_checkpoint,
)
from benchmarks.tools import op_count
from recipes.cifar.recipe import Config

DOC_OUT = Path("docs/benchmarks.md")
SMOKE_OUT = Path("runs/benchmarks-smoke.md")  # runs/ is git-ignored: smoke numbers stay out
GPU_OUT = Path("runs/benchmarks-gpu.md")  # one section: it must not replace the full report
TRACKER_OUT = Path("runs/benchmarks-tracker.md")  # likewise
SYNC_STEP_ITERATIONS = 8  # two windows of 4 micro-batches
# The tiny model's engine overhead is host-side Python; a second intra-op thread only
# spin-waits there and, on a shared machine, multiplies the spread of every arm.
TINY_THREADS = 1
Log = Callable[[str], None]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: tiny sizes, seconds; proves the code runs")
    parser.add_argument("--only", choices=("gpu", "tracker"), default=None,
                        help="run only this section (gpu: our CIFAR recipe against "
                             "airbench94 on a CUDA device; tracker: section 1's cost of the "
                             "MLflow tracker on the tiny model; neither needs Lightning nor "
                             "the other sections' 10-15 minutes)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"report path (default {DOC_OUT}; {SMOKE_OUT} with --quick; "
                             f"{GPU_OUT} with --only gpu)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads of the CIFAR and data arms (the tiny "
                             "model runs on one; default: torch's, "
                             "normally the core count)")
    args = parser.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    return args


def missing_requirement(only: str | None) -> str | None:
    """Why the requested run cannot start here, or None."""
    if only == "gpu":
        reason = s5_gpu.skip_reason()
        return None if reason is None else f"the GPU section cannot run here: {reason}"
    if only == "tracker":
        return (None if WITH_MLFLOW in ARMS else
                "MLflow is not installed; `pip install -e '.[mlflow]'`")
    if importlib.util.find_spec("pytorch_lightning") is None:
        return ("PyTorch Lightning is not installed; run `make bench` or "
                "`pip install -e '.[dev,bench]'`")
    return None


def default_out(args: argparse.Namespace) -> Path:
    if args.only is not None:
        return {"gpu": GPU_OUT, "tracker": TRACKER_OUT}[args.only]
    return SMOKE_OUT if args.quick else DOC_OUT


def gpu_section(plan: Plan, log: Log) -> str:
    reason = s5_gpu.skip_reason()
    log(f"5/6 GPU: {reason or 'measuring'}")
    if reason is not None:
        return s5_gpu.render([], [], reason)
    return s5_gpu.render(*s5_gpu.measure(plan, log), None)


def tracker_section(plan: Plan, log: Log) -> str:
    log("1/6 engine overhead: the MLflow tracker, tiny model")
    tiny = s1_overhead.measure(
        dataclasses.replace(tiny_workload(plan.tiny_warmup, plan.tiny_timed),
                            block=plan.tiny_block),
        plan.tiny_repeats, TINY_THREADS, log=log, arms=s1_overhead.TRACKER_ARMS)
    return s1_overhead.render_tracker(tiny)


def all_sections(plan: Plan, threads: int, quick: bool, log: Log) -> tuple[list[str], list[str]]:
    """Every section of the report, and the loss-parity failures of section 1."""
    log("1/6 engine overhead: tiny model")
    tiny = s1_overhead.measure(
        dataclasses.replace(tiny_workload(plan.tiny_warmup, plan.tiny_timed),
                            block=plan.tiny_block),
        plan.tiny_repeats, TINY_THREADS, log=log)
    log("1/6 engine overhead: CIFAR default model")
    cifar = s1_overhead.measure(
        dataclasses.replace(cifar_workload(plan.cifar_warmup, plan.cifar_timed,
                                           plan.cifar_batch), block=plan.cifar_block),
        plan.cifar_repeats, threads, log=log,
        # The tracker's cost is host-side, measured on the tiny model.
        arms=[arm for arm in ARMS if arm not in (s1_overhead.LOOP_ONLY, WITH_MLFLOW)])

    log("2/6 host syncs")
    config = Config()
    recipe_iterations = config.log_every * 10 + config.log_every // 2  # one layer-norm report
    with tempfile.TemporaryDirectory(prefix="bench-syncs-") as run_dir:
        scenarios = [
            s2_syncs.step_only(tiny_workload(0, SYNC_STEP_ITERATIONS), accum_steps=1),
            s2_syncs.step_only(tiny_workload(0, SYNC_STEP_ITERATIONS), accum_steps=4),
            s2_syncs.with_recipe_handlers(tiny_workload(0, recipe_iterations), Path(run_dir),
                                          config),
            s2_syncs.ignite_stock(tiny_workload(0, SYNC_STEP_ITERATIONS)),
        ]

    log("2/6 aten ops per iteration")
    ops = op_count.measure()

    log("4/6 epoch time (also the data-wait share for section 3)")
    epochs = s4_epoch.measure(plan.epoch_batch, plan.epoch_warmup, plan.epoch_timed,
                              plan.epoch_eval_images, plan.epoch_repeats,
                              plan.epoch_train_images, log=log)
    log("3/6 data pipelines")
    source = s4_epoch.synthetic_images(plan.data_batch * (plan.data_timed + 1))
    pipelines = s3_data.measure(*source, plan.data_batch, plan.data_timed, plan.data_repeats,
                                log=log)

    gpu_report = gpu_section(plan, log)

    if s6_image_folder.SHARED_CIFAR.is_dir():
        log("6/6 image-folder data path")
        images_section = s6_image_folder.render(
            s6_image_folder.measure(s6_image_folder.SHARED_CIFAR,
                                    s6_image_folder.QUICK if quick else s6_image_folder.FULL,
                                    log),
            s6_image_folder.SHARED_CIFAR)
    else:
        images_section = (f"## 6. Image-folder data path\n\nUnmeasured: no CIFAR-10 JPEG folders "
                          f"at `{s6_image_folder.SHARED_CIFAR}`.")
    log("7/7 sweep: what it adds to its trials")
    sweep_section = s7_sweep.render(s7_sweep.measure(2, (1,), 1, log) if quick
                                    else s7_sweep.measure(*s7_sweep.FULL, log))
    log("8/8 checkpoints written behind training")
    async_section = s8_async_checkpoint.render(
        s8_async_checkpoint.measure(s8_async_checkpoint.QUICK_SHAPES if quick
                                    else s8_async_checkpoint.SHAPES, log), load_average())
    cifar_note = ("Synthetic CIFAR-shaped images (`make_synthetic`), cropped, flipped and "
                  "normalised by `TrainBatches` before timing, held in memory.")
    sections = [
        s1_overhead.render(tiny, cifar, cifar_note),
        s2_syncs.render(scenarios) + "\n\n" + op_count.render_section(ops),
        s3_data.render(pipelines, epochs.fetch_shares(), threads),
        s4_epoch.render(epochs),
        gpu_report,
        images_section,
        sweep_section,
        async_section,
    ]
    failures = s1_overhead.parity_failures(tiny) + s1_overhead.parity_failures(cifar)
    return sections, failures


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    missing = missing_requirement(args.only)
    if missing is not None:
        print(f"error: {missing}", file=sys.stderr)
        return 2
    plan = QUICK if args.quick else FULL
    out = args.out or default_out(args)
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    load_before, started = load_average(), time.perf_counter()

    def log(line: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s] {line}", file=sys.stderr, flush=True)

    log(f"plan {plan.name}, {threads} threads, report -> {out}")
    if args.only == "gpu":
        sections, failures = [gpu_section(plan, log)], []
    elif args.only == "tracker":
        sections, failures = [tracker_section(plan, log)], []
    else:
        sections, failures = all_sections(plan, threads, args.quick, log)
    wall = time.perf_counter() - started
    command = shlex.join(["python", "-m", "benchmarks", *argv])
    torch.set_num_threads(threads)  # the machine line reports the arms' count, not the last set
    report = document(describe_machine(), command, plan.name, load_before, load_average(),
                      wall, sections)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    log(f"wrote {out} ({wall / 60:.1f} min)")
    for failure in failures:
        print(f"error: loss parity: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
