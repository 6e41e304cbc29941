"""Section 1: what the engine costs per iteration, next to a hand-written loop,
Ignite's stock trainer and PyTorch Lightning, with a loss-parity check."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from benchmarks.arms.loops import ARMS, WITH_MLFLOW, ArmResult, run_arms_lockstep
from benchmarks.arms.workloads import NEVER_REACHED_GRAD_NORM, Workload
from benchmarks.harness.report import table
from benchmarks.harness.timing import MedianInterval, Stats

REFERENCE = "hand"
TUNED = "hand-tuned"
FULL_HANDLERS = "trainer+recipe"
# The trainer's loop around the tuned step: the floor under the trainer's overhead. Run on
# the tiny model only: on the CIFAR model the loop is lost in the step.
LOOP_ONLY = "trainer-loop"
# Lightning's own parity test (tests/parity_pytorch/test_basic_parity.py) requires the final
# losses of its loop and a vanilla loop to agree to 5 decimals (np.testing.assert_almost_equal,
# decimal=5: |difference| < 1.5e-5). We use the same bound on the probe loss.
LOSS_TOLERANCE = 1.5e-5
# Targets, against the tuned hand loop: per-iteration overhead on the tiny model, and the
# full handler set's throughput on the CIFAR model.
MAX_OVERHEAD_SECONDS = {"trainer": 10e-6, FULL_HANDLERS: 40e-6}
# `python -m benchmarks --only tracker`: the tracker's arm, the one it adds to, the floor.
TRACKER_ARMS = (TUNED, FULL_HANDLERS, WITH_MLFLOW)
MIN_CIFAR_RATIO = 0.99

ARM_NOTES = {
    "hand": "the canonical loop (autocast, scaled backward, unscale, clip, scaler step), "
            "written plainly",
    "hand-tuned": "the same work as fast as we know how to write it: `_foreach_norm` and one "
                  "host read, the clip decided on the host, no autocast/scaler/division, "
                  "`model.train()` once",
    "trainer": "`create_trainer`, no handlers",
    "trainer-loop": "our `Trainer`'s epoch loop and events running the tuned loop's step as "
                    "its process function (no step guarantees, no batch move): what the loop "
                    "alone costs, the floor under `trainer` (tiny model only)",
    "trainer+recipe": "`create_trainer` + the CIFAR recipe's handler set "
                      "(`benchmarks/arms/recipe_handlers.py`)",
    WITH_MLFLOW: "`trainer+recipe` with `--tracker mlflow`: every scalar also kept for MLflow "
                 "and sent in one `log_batch` to a local file store at each flush (in this "
                 "run, with no checkpoint or evaluation inside it, at the epoch's end)",
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
    threads: int = 1  # torch intra-op threads of every arm
    block: int | None = None  # iterations per timed block (None: the whole window)

    def per_iteration(self, arm: str) -> list[float]:
        return [run.seconds / self.timed for run in self.runs[arm]]

    def images_per_second(self, arm: str) -> list[float]:
        return [self.batch_size / seconds for seconds in self.per_iteration(arm)]

    def paired(self, arm: str, combine: Callable[[float, float], float],
               reference: str = REFERENCE) -> list[float]:
        """``combine(arm, reference)`` of the per-iteration seconds of every block the two
        ran in the same round (``benchmarks.harness.lockstep``): side by side, so the machine's
        changes of speed fall on both."""
        per_block = self.block or self.timed
        return [combine(a / per_block, r / per_block)
                for arm_run, reference_run in zip(self.runs[arm], self.runs[reference],
                                                  strict=True)
                for a, r in zip(arm_run.blocks, reference_run.blocks, strict=True)]


def measure(workload: Workload, repeats: int, threads: int, log: Callable[[str], None],
            arms: Sequence[str] = tuple(ARMS)) -> OverheadResult:
    """``repeats`` runs of every arm; in each repeat the arms run at once, block by block,
    each round in a new random order (``benchmarks.harness.lockstep``, seeded by the repeat), and
    are set up in an order rotated by one each repeat."""
    runs: dict[str, list[ArmResult]] = {arm: [] for arm in arms}
    for repeat in range(repeats):
        shift = repeat % len(arms)
        results = run_arms_lockstep([*arms[shift:], *arms[:shift]], workload, threads,
                                    seed=repeat)
        for arm in arms:
            runs[arm].append(results[arm])
        log(f"  {workload.name} repeat {repeat + 1}/{repeats}: " + ", ".join(
            f"{arm} {1e3 * results[arm].seconds / workload.timed:.3f}" for arm in arms)
            + " ms/iteration")
    return OverheadResult(workload.name, workload.batch_size, workload.warmup, workload.timed,
                          runs, threads, workload.block)


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


def paired_interval(result: OverheadResult, arm: str, reference: str, combine,
                    digits: int, scale: float = 1.0) -> str:
    """``combine(arm, reference)`` over every paired block, as ``median (low to high)``;
    ``-`` for the reference itself or an arm without one."""
    if arm == reference or reference not in result.runs:
        return "-"
    return MedianInterval.of(result.paired(arm, combine, reference)).format(digits, scale)


def tiny_table(result: OverheadResult) -> str:
    rows = []
    for arm in result.runs:
        rows.append([f"`{arm}`", Stats.of(result.per_iteration(arm)).format(3, 1e6),
                     paired_interval(result, arm, REFERENCE, lambda a, h: a - h, 3, 1e6),
                     paired_interval(result, arm, TUNED, lambda a, h: a - h, 3, 1e6),
                     Stats.of([run.end_seconds for run in result.runs[arm]]).format(3, 1e3),
                     _probe_cell(result, arm)])
    return table(["arm", "µs / iteration", "overhead vs hand, µs / iteration",
                  "overhead vs hand-tuned, µs / iteration", "run end, ms", "probe loss"], rows)


def cifar_table(result: OverheadResult) -> str:
    rows = []
    for arm in result.runs:
        rows.append([f"`{arm}`", Stats.of(result.images_per_second(arm)).format(4),
                     paired_interval(result, arm, REFERENCE, lambda a, h: h / a, 4),
                     paired_interval(result, arm, TUNED, lambda a, h: h / a, 4),
                     paired_interval(result, arm, TUNED, lambda a, h: a - h, 3, 1e3),
                     Stats.of([run.end_seconds for run in result.runs[arm]]).format(3, 1e3),
                     _probe_cell(result, arm)])
    return table(["arm", "images/s", "throughput ratio arm/hand",
                  "throughput ratio arm/hand-tuned", "ms / iteration over hand-tuned",
                  "run end, ms", "probe loss"], rows)


def targets(tiny: OverheadResult, cifar: OverheadResult) -> list[str]:
    lines = []
    for arm, limit in MAX_OVERHEAD_SECONDS.items():
        overhead = MedianInterval.of(tiny.paired(arm, lambda a, h: a - h, TUNED))
        met = "met" if overhead.median <= limit else "NOT met"
        lines.append(f"- `{arm}` at most {1e6 * limit:.0f} µs per iteration over the tuned "
                     f"hand loop on the tiny model: median {overhead.format(3, 1e6)} µs - "
                     f"**{met}**.")
    ratio = MedianInterval.of(cifar.paired(FULL_HANDLERS, lambda a, h: h / a, TUNED))
    met = "met" if ratio.median >= MIN_CIFAR_RATIO else "NOT met"
    lines.append(f"- Full handler set at least {MIN_CIFAR_RATIO:g} of the tuned hand loop's "
                 f"throughput on the CIFAR model: median ratio {ratio.format(4)} - **{met}**.")
    if "lightning" in tiny.runs:
        lightning = MedianInterval.of(tiny.paired("lightning", lambda a, h: a - h)).median
        for arm in ("trainer", FULL_HANDLERS):
            ours = MedianInterval.of(tiny.paired(arm, lambda a, h: a - h)).median
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
weights. Times cover the iterations after a warm-up, every handler of those iterations
included. "Run end" is the time from the last iteration to the run's return (the recipe's
epoch checkpoint, the TensorBoard hparams, Lightning's teardown).

**Side by side.** This machine changes speed by 20-50% within tens of milliseconds, more
than the overheads measured here, so in each repeat all arms run at once in one thread
(`benchmarks/harness/lockstep.py`): each arm trains a block of iterations, then hands on to the
next, each round of blocks in a new random order. Paired columns compare every block of an arm with
the same block of the reference loop, run in the same round, and give the median over all
those pairs with its 95% confidence interval in parentheses (distribution-free: it holds
the true median whatever the noise's shape). The interval is this run's: the machine's
overall speed also differs from run to run, and every overhead in µs with it (the trainer's
over the tuned loop read 21-31 µs in six runs of one afternoon, in blocks of 10). The other
columns give median [min, max] over repeats.

**Loss parity.** After training, each run's model (eval mode) computes the loss of one
held-out probe batch; every run must match the hand loop within {LOSS_TOLERANCE:g}
(absolute), the bound of Lightning's own parity test (final losses equal to 5 decimals,
`tests/parity_pytorch/test_basic_parity.py`). All arms do the same float operations in the
same order (Lightning zeroes gradients before the backward instead of after the step, which
does not change a value), so on one machine and thread count they agree to the last bit in
practice; one skipped or repeated step, a different learning rate or a real clip moves the
probe loss by far more. {parity}

### Tiny model: Linear(32,32)-ReLU-Linear(32,10), batch {tiny.batch_size}

{tiny.warmup} warm-up + {tiny.timed} timed iterations per repeat in blocks of
{tiny.block or tiny.timed}, {len(tiny.runs[REFERENCE])} repeats
({len(tiny.paired(REFERENCE, lambda a, h: a))} paired blocks per arm), {tiny.threads}
intra-op thread(s): the overhead is host-side Python, and on this
model a second thread only spin-waits (on a shared 2-core machine it spread the hand loop's
repeats over 770-1210 µs against about 150-250 µs with one). Overhead = arm time per
iteration - hand loop (or tuned hand loop) time per iteration; a negative overhead is an arm
faster than that loop.

{tiny_table(tiny)}

### CIFAR default model (airbench, batch {cifar.batch_size}, channels_last, fp32, \
{cifar.threads} threads)

{cifar_note} {cifar.warmup} warm-up + {cifar.timed} timed iterations per repeat in blocks of
{cifar.block or cifar.timed}, {len(cifar.runs[REFERENCE])} repeats
({len(cifar.paired(REFERENCE, lambda a, h: a))} paired blocks per arm). Ratio = arm images/s
/ hand images/s (1.0 = as fast).

{cifar_table(cifar)}

{tracker_cost(tiny)}

### Targets

""" + "\n".join(targets(tiny, cifar))


def tracker_cost(tiny: OverheadResult) -> str:
    """The MLflow tracker's cost on the tiny model: its arm against ``trainer+recipe``, block
    by block; or why it was not measured."""
    heading = "### The MLflow tracker (`--tracker mlflow`), tiny model"
    if WITH_MLFLOW not in tiny.runs:
        return (f"{heading}\n\nUnmeasured: MLflow is not installed (`pip install -e "
                f"'.[mlflow]'`).")
    rows = [[f"`{arm}`", Stats.of(tiny.per_iteration(arm)).format(3, 1e6),
             paired_interval(tiny, arm, FULL_HANDLERS, lambda a, h: a - h, 3, 1e6),
             Stats.of([run.end_seconds for run in tiny.runs[arm]]).format(3, 1e3)]
            for arm in (FULL_HANDLERS, WITH_MLFLOW)]
    ends = {arm: Stats.of([run.end_seconds for run in tiny.runs[arm]]).median
            for arm in (FULL_HANDLERS, WITH_MLFLOW)}
    spread = (ends[WITH_MLFLOW] - ends[FULL_HANDLERS]) / (tiny.warmup + tiny.timed)
    return f"""{heading}

The recipe's handler set with and without the tracker's scalar sink, side by side in the same
rounds ({len(tiny.runs[WITH_MLFLOW])} repeats of {tiny.timed} iterations in blocks of
{tiny.block or tiny.timed}). Per iteration the sink only keeps each telemetry report as it
comes (every `log_every` steps); the `log_batch` to the store happens at each flush (every
checkpoint, evaluation and epoch end), here once, in the run end, for all
{tiny.warmup + tiny.timed} iterations: spread over them, the difference of the median run ends
is {1e6 * spread:.1f} µs an iteration (MLflow's file store writes each metric value on its own).

{table(["arm", "µs / iteration", "over trainer+recipe, µs / iteration", "run end, ms"], rows)}"""


def render_tracker(tiny: OverheadResult) -> str:
    """``--only tracker``: the tracker's cost alone."""
    return f"## 1. Engine overhead: the MLflow tracker\n\n{tracker_cost(tiny)}"
