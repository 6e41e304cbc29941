"""Section 5, CUDA only: the CIFAR recipe's step on the GPU, eager and compiled, at the
recipe's batch size and at airbench's. airbench94's own training code is not an arm yet."""

import time
from dataclasses import dataclass

import torch
from ignite.engine import Events

from benchmarks.report import table
from benchmarks.timing import Stats
from benchmarks.workloads import cifar_workload
from engine import create_trainer

BATCH_SIZES = (256, 1024)


@dataclass(frozen=True)
class GpuRow:
    arm: str
    batch_size: int
    ms_per_iteration: Stats

    @property
    def images_per_second(self) -> float:
        return 1e3 * self.batch_size / self.ms_per_iteration.median


def skip_reason() -> str | None:
    """Why the section cannot run here, or None."""
    if not torch.cuda.is_available():
        return "no CUDA device on this machine"
    return None


def _trainer_ms(batch_size: int, compile: bool, warmup: int, timed: int) -> float:
    workload = cifar_workload(warmup, timed, batch_size)
    model, optimizer = workload.fresh()
    trainer = create_trainer(model, optimizer, workload.loss_fn, device="cuda",
                             max_grad_norm=workload.max_grad_norm, compile=compile)
    batches = [(x.cuda(), y.cuda()) for x, y in workload.batches]
    marks: dict[int, float] = {}

    def mark(engine) -> None:
        if engine.state.iteration in (warmup, warmup + timed):
            torch.cuda.synchronize()  # only at the window's two ends
            marks[engine.state.iteration] = time.perf_counter()

    trainer.add_event_handler(Events.ITERATION_COMPLETED, mark)
    trainer.run(batches, max_epochs=1)
    return 1e3 * (marks[warmup + timed] - marks[warmup]) / timed


def measure(warmup: int, timed: int, repeats: int) -> list[GpuRow]:
    rows = []
    for batch_size in BATCH_SIZES:
        for compile in (False, True):
            times = [_trainer_ms(batch_size, compile, warmup, timed) for _ in range(repeats)]
            arm = "trainer, compiled" if compile else "trainer, eager"
            rows.append(GpuRow(arm, batch_size, Stats.of(times)))
    return rows


def render(rows: list[GpuRow], reason: str | None) -> str:
    if reason is not None:
        return f"## 5. GPU\n\nUnmeasured: {reason}. Run `make bench` on a CUDA machine."
    cells = [[f"`{row.arm}`", str(row.batch_size), f"{row.images_per_second:.0f}",
              row.ms_per_iteration.format(3)] for row in rows]
    return f"""## 5. GPU

The CIFAR default model and optimizer (synthetic images, held on the device), through
`create_trainer` on CUDA, timed between two `torch.cuda.synchronize()` calls.

{table(["arm", "batch", "images/s", "ms / iteration"], cells)}"""
