"""Section 1: what the engine costs per iteration, next to a hand-written loop,
Ignite's stock trainer and PyTorch Lightning, with a loss-parity check."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from benchmarks.arms import ARMS, ArmResult, run_arm
from benchmarks.report import table
from benchmarks.timing import Stats, interleaved_order
from benchmarks.workloads import NEVER_REACHED_GRAD_NORM, Workload

REFERENCE = "hand"
FULL_HANDLERS = "trainer+recipe"
# Lightning's own parity test (tests/parity_pytorch/test_basic_parity.py) requires the final
# losses of its loop and a vanilla loop to agree to 5 decimals (np.testing.assert_almost_equal,
# decimal=5: |difference| < 1.5e-5). We use the same bound on the probe loss.
LOSS_TOLERANCE = 1.5e-5
# Targets: the full handler set at most this much slower than the hand loop (CIFAR model).
MAX_SLOWDOWN = 0.03

ARM_NOTES = {
    "hand": "the canonical loop (autocast, scaled backward, unscale, clip, scaler step), "
            "written plainly",
    "trainer": "`create_trainer`, no handlers",
    "trainer+recipe": "`create_trainer` + the CIFAR recipe's handler set "
                      "(`benchmarks/recipe_handlers.py`)",
    "ignite": "Ignite `create_supervised_trainer`, stock: no unscale/clip/norm (it has no "
              "hook for them), `loss.item()` every iteration",
    "lightning": "`LightningModule`, automatic optimization, `gradient_clip_val`; no logger, "
                 "checkpointing, progress bar or model summary",
}


@dataclass
class OverheadResult:
    workload: str
    batch_size: int
    warmup: int
    timed: int
    runs: dict[str, list[ArmResult]]  # arm -> one result per repeat

    def per_iteration(self, arm: str) -> list[float]:
        return [run.seconds / self.timed for run in self.runs[arm]]

    def images_per_second(self, arm: str) -> list[float]:
        return [self.batch_size / seconds for seconds in self.per_iteration(arm)]

    def paired(self, arm: str, combine: Callable[[float, float], float]) -> list[float]:
        """``combine(arm, hand)`` of each repeat's per-iteration seconds: the two ran
        back to back, so drift of the machine cancels."""
        return [combine(a, h) for a, h in
                zip(self.per_iteration(arm), self.per_iteration(REFERENCE), strict=True)]


def measure(workload: Workload, repeats: int, threads: int, log: Callable[[str], None],
            arms: Sequence[str] = tuple(ARMS)) -> OverheadResult:
    runs: dict[str, list[ArmResult]] = {arm: [] for arm in arms}
    for repeat, arm in interleaved_order(list(arms), repeats):
        result = run_arm(arm, workload, threads)
        runs[arm].append(result)
        log(f"  {workload.name} repeat {repeat + 1}/{repeats} {arm}: "
            f"{1e3 * result.seconds / workload.timed:.3f} ms/iteration")
    return OverheadResult(workload.name, workload.batch_size, workload.warmup, workload.timed,
                          runs)


def parity_failures(result: OverheadResult, tolerance: float = LOSS_TOLERANCE) -> list[str]:
    """Every run whose probe loss differs from the hand loop's first run by ``tolerance``
    or more."""
    reference = result.runs[REFERENCE][0].probe_loss
    failures = []
    for arm, runs in result.runs.items():
        for repeat, run in enumerate(runs):
            if not abs(run.probe_loss - reference) < tolerance:
                failures.append(f"{result.workload}: {arm} repeat {repeat + 1} probe loss "
                                f"{run.probe_loss:.8f} vs hand {reference:.8f}")
    return failures


def _probe_cell(result: OverheadResult, arm: str) -> str:
    reference = result.runs[REFERENCE][0].probe_loss
    worst = max(abs(run.probe_loss - reference) for run in result.runs[arm])
    return f"{result.runs[arm][0].probe_loss:.6f} (max diff {worst:.1e})"


def tiny_table(result: OverheadResult) -> str:
    rows = []
    for arm in result.runs:
        overhead = "-" if arm == REFERENCE else Stats.of(
            result.paired(arm, lambda a, h: a - h)).format(3, 1e6)
        rows.append([f"`{arm}`", Stats.of(result.per_iteration(arm)).format(3, 1e6), overhead,
                     Stats.of([run.end_seconds for run in result.runs[arm]]).format(3, 1e3),
                     _probe_cell(result, arm)])
    return table(["arm", "µs / iteration", "overhead vs hand, µs / iteration",
                  "run end, ms", "probe loss"], rows)


def cifar_table(result: OverheadResult) -> str:
    rows = []
    for arm in result.runs:
        ratio = extra = "-"
        if arm != REFERENCE:
            ratio = Stats.of(result.paired(arm, lambda a, h: h / a)).format(4)
            extra = Stats.of(result.paired(arm, lambda a, h: a - h)).format(3, 1e3)
        rows.append([f"`{arm}`", Stats.of(result.images_per_second(arm)).format(4), ratio,
                     extra, Stats.of([run.end_seconds for run in result.runs[arm]]).format(3, 1e3),
                     _probe_cell(result, arm)])
    return table(["arm", "images/s", "throughput ratio arm/hand", "ms / iteration over hand",
                  "run end, ms", "probe loss"], rows)


def targets(tiny: OverheadResult, cifar: OverheadResult) -> list[str]:
    lines = []
    ratio = Stats.of(cifar.paired(FULL_HANDLERS, lambda a, h: h / a)).median
    met = "met" if ratio >= 1 - MAX_SLOWDOWN else "NOT met"
    lines.append(f"- Full handler set at most {100 * MAX_SLOWDOWN:.0f}% slower than the hand "
                 f"loop on the CIFAR model: median throughput ratio {ratio:.4f} "
                 f"({100 * (1 - ratio):+.1f}% slower) - **{met}**.")
    if "lightning" in tiny.runs:
        lightning = Stats.of(tiny.paired("lightning", lambda a, h: a - h)).median
        for arm in ("trainer", FULL_HANDLERS):
            ours = Stats.of(tiny.paired(arm, lambda a, h: a - h)).median
            met = "met" if ours < lightning else "NOT met"
            lines.append(f"- `{arm}` per-iteration overhead below Lightning's on the tiny "
                         f"model: {1e6 * ours:.1f} µs vs {1e6 * lightning:.1f} µs - **{met}**.")
    return lines


def render(tiny: OverheadResult, cifar: OverheadResult, cifar_note: str) -> str:
    arms = "\n".join(f"- `{arm}`: {ARM_NOTES[arm]}" for arm in tiny.runs)
    failures = parity_failures(tiny) + parity_failures(cifar)
    parity = ("All runs of all arms reached the same probe loss." if not failures else
              "**PARITY FAILED** (the timings below compare different work):\n" +
              "\n".join(f"- {failure}" for failure in failures))
    return f"""## 1. Engine overhead

Arms:
{arms}

Every arm trains a fresh copy of the same initial model on the same batches with the same SGD
optimizer and clips the global gradient norm at {NEVER_REACHED_GRAD_NORM:g}, above every norm
these runs reach: the clip does its full work (a global norm, a multiply of every gradient)
but multiplies by exactly 1.0, so Ignite's stock trainer, which cannot clip, trains the same
weights. Times cover the iterations after a warm-up: from the end of the last warm-up
iteration to the end of the last one, every handler of those iterations included. "Run end"
is the time from the last iteration to the run's return (the recipe's epoch checkpoint, the
TensorBoard hparams, Lightning's teardown). Paired columns compare each repeat of an arm with
the hand loop's run of the same repeat.

**Loss parity.** After training, each run's model (eval mode) computes the loss of one
held-out probe batch; every run must match the hand loop within {LOSS_TOLERANCE:g}
(absolute), the bound of Lightning's own parity test (final losses equal to 5 decimals,
`tests/parity_pytorch/test_basic_parity.py`). All arms do the same float operations in the
same order (Lightning zeroes gradients before the backward instead of after the step, which
does not change a value), so on one machine and thread count they agree to the last bit in
practice; one skipped or repeated step, a different learning rate or a real clip moves the
probe loss by far more. {parity}

### Tiny model: Linear(32,32)-ReLU-Linear(32,10), batch {tiny.batch_size}

{tiny.warmup} warm-up + {tiny.timed} timed iterations per repeat, {len(tiny.runs[REFERENCE])}
repeats. Overhead = arm time per iteration - hand loop time per iteration.

{tiny_table(tiny)}

### CIFAR default model (airbench, batch {cifar.batch_size}, channels_last, fp32)

{cifar_note} {cifar.warmup} warm-up + {cifar.timed} timed iterations per repeat,
{len(cifar.runs[REFERENCE])} repeats. Ratio = arm images/s / hand images/s (1.0 = as fast).

{cifar_table(cifar)}

### Targets

""" + "\n".join(targets(tiny, cifar))
