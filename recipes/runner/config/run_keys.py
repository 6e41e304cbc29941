"""The run keys: what every recipe's config holds besides its task's own keys.

A recipe's ``Config`` is a dataclass that extends ``RunConfig``; it may give a run key
another default by declaring it again (``epochs: int = field(10, ...)``), and the key stays
in its group. Every key is a command-line flag (``recipes.runner.config.command_line``).

The keys come in groups, declared (and listed by ``--help``) in this order: ``run`` (what
to train, how long, where), ``schedule`` (the LR over the run), ``precision``,
``checkpoints`` (saving and resuming), ``health`` (checks that a run is learning and the
switch of the loss-spike guard), ``spike`` (the guard's settings: ``--spike-<name>`` is
``SpikeGuard``'s argument ``<name>``, so ``group_values(config, "spike")`` builds it),
``distributed`` and ``tracking`` (an experiment tracker besides TensorBoard).

``fixed_on_resume`` marks keys that shape the saved tensors or whose value the checkpoint
carries (optimizer hyperparameters, the schedule's kind and shape, telemetry cadence,
early stopping): a resume would silently keep the saved value, so a change is refused.
``lr`` and ``epochs`` may change: the schedule is rebuilt for them.
"""

import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from recipes.runner.config.command_line import field

# --tracker NAME -> the module of recipes.runner.training.trackers that implements it: the
# table lives here, with the key that names it, so that the config never imports upwards.
TRACKERS = {
    "mlflow": "recipes.runner.training.trackers.mlflow",
    "wandb": "recipes.runner.training.trackers.wandb",
}
TRACKER_NAMES = ("none", *TRACKERS)

# This module imports no torch: ``python -m recipes`` parses and checks the command line
# before torch loads (seconds), so a mistyped key is answered at once. The choices that the
# engine and the handlers define next to their torch code are spelled out here again;
# tests/recipes/runner/config/test_command_line.py checks that each copy equals its original.
PRECISIONS = ("auto", "fp32", "fp16", "bf16")  # engine.precision.PRECISIONS
SCHEDULER_NAMES = ("none", "step", "cosine", "onecycle", "plateau", "cosine_restarts",
                   "warmup_cosine")  # handlers.lr_scheduling.SCHEDULER_NAMES
WATCH_CHOICES = ("both", "loss", "grad_norm")  # handlers.spike_guard.WATCH_CHOICES
BACKENDS = ("auto", "gloo", "nccl")
STRATEGIES = ("ddp", "fsdp")
PROGRESS = ("auto", "bar", "plain", "off")
AVERAGING = ("none", "ema", "swa")
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
PROFILE_WINDOW = re.compile(r"([0-9]+):([0-9]+)")
MAX_TIME = re.compile(r"([0-9]+(?:\.[0-9]+)?)|(?=[0-9])(?:([0-9]+)d)?(?:([0-9]+)h)?"
                      r"(?:([0-9]+)m)?(?:([0-9]+)s)?")
MAX_SEED = 2**64 - 1  # torch's generators take seeds from 0 to 2**64 - 1

run_key = partial(field, group="run")
schedule_key = partial(field, group="schedule")
precision_key = partial(field, group="precision")
checkpoints_key = partial(field, group="checkpoints")
health_key = partial(field, group="health")
spike_key = partial(field, group="spike", fixed_on_resume=True)  # the guard is checkpointed
distributed_key = partial(field, group="distributed")
tracking_key = partial(field, group="tracking")


def _tensorboard_is_on(tracker: str) -> str | None:
    if tracker == "tensorboard":
        return ("every run already writes TensorBoard's event file into its folder: make "
                "tensorboard; --tracker adds another")
    return None


def check_run_name(name: str) -> str | None:
    """An error text for a bad run name, else None: 1-64 of letters, digits, '.', '_', '-',
    not starting with '.' or '-' (so no '..', no '/', no hidden folders)."""
    if name == "":
        return None  # empty means "a timestamp"
    if len(name) > 64:
        return f"must be at most 64 characters, got {len(name)}"
    if not RUN_NAME.fullmatch(name):
        return (
            f"{name!r} may only hold letters, digits, '.', '_', '-' "
            "and must start with a letter or digit"
        )
    return None


def profile_window(text: str) -> tuple[int, int] | None:
    """``--profile START:STOP`` as (start, stop); None for "" (off) or a malformed window."""
    match = PROFILE_WINDOW.fullmatch(text)
    if match is None or int(match[1]) >= int(match[2]):
        return None
    return int(match[1]), int(match[2])


def _check_profile(value: str) -> str | None:
    if value == "" or profile_window(value) is not None:
        return None
    return (f"must be START:STOP optimizer steps with 0 <= START < STOP (e.g. 10:20), "
            f"got {value!r}")


def max_time_seconds(text: str) -> float | None:
    """``--max-time`` in seconds: ``90``, ``90s``, ``45m``, ``2h``, ``1h30m``, ``1d``; None for ""
    (off) or a malformed text (``handlers.run_budget.parse_duration``, spelled out here
    again: this module imports no torch)."""
    match = MAX_TIME.fullmatch(text)
    if not text or match is None:
        return None
    if match[1] is not None:
        seconds = float(match[1])
    else:
        seconds = sum(int(part) * unit for part, unit in zip(match.groups()[1:],
                                                             (86400, 3600, 60, 1), strict=True)
                      if part)
    return seconds if seconds > 0 else None


def _check_max_time(value: str) -> str | None:
    if value == "" or max_time_seconds(value) is not None:
        return None
    return f"must be a duration such as 90s, 45m, 2h, 1h30m or 1d (or seconds), got {value!r}"


def _check_resume(value: str) -> str | None:
    if value in ("auto", "never") or Path(value).is_file():
        return None
    return f"must be 'auto', 'never' or the path of a checkpoint file; {value!r} is not a file"


@dataclass
class RunConfig:
    epochs: int = run_key(10, "epochs to train", min=1)
    batch_size: int = run_key(256, "global batch size (samples per micro-batch, all "
                              "processes)", min=1, fixed_on_resume=True)
    lr: float = run_key(1e-3, "peak learning rate", min=0, min_exclusive=True)
    accum_steps: int = run_key(1, "micro-batches per optimizer step", min=1,
                               fixed_on_resume=True)
    max_grad_norm: float | None = run_key(None, "clip the global gradient norm (none: no "
                                          "clip)", min=0, min_exclusive=True)
    averaging: str = run_key("none", "weight averaging: an EMA of the weights (after every "
                             "step) or SWA (an equal average of epoch ends, from --swa-start "
                             "of the run on); evaluations and the best checkpoint use the "
                             "average", choices=AVERAGING, fixed_on_resume=True)
    ema_decay: float = run_key(0.999, "EMA decay (with a warm-up: min(decay, (1+n)/(10+n)) "
                               "at update n)", min=0, max=0.9999, fixed_on_resume=True)
    swa_start: float = run_key(0.75, "SWA averages the epoch ends from this fraction of the "
                               "run on", min=0, max=1, fixed_on_resume=True)
    seed: int = run_key(0, "seed of init, data order and augmentation", min=0, max=MAX_SEED,
                        fixed_on_resume=True)
    device: str = run_key("auto", "cpu | cuda | cuda:N | auto")
    compile: bool = run_key(False, "torch.compile the step: the model's forward and backward "
                            "and the optimizer update (a one-time compile of about a minute on "
                            "a CPU; checkpoints are the same either way)")
    cuda_graphs: bool = run_key(False, "with --compile on CUDA: record the compiled step in CUDA "
                                "graphs and replay them (compile's reduce-overhead mode)")
    activation_checkpointing: bool = run_key(
        False, "keep only each transformer block's input for the backward and recompute the "
        "rest there: less activation memory for about one more forward (charlm)")
    max_steps: int | None = run_key(None, "stop cleanly (saved, resumable, exit 0) after this "
                                    "many optimizer steps of the whole run; the LR schedule "
                                    "still follows --epochs (none: no limit)", min=1)
    max_time: str = run_key("", "stop cleanly (saved, resumable, exit 0) once the run has run "
                            "this long, all its starts together: 90s, 45m, 2h, 1h30m, 1d "
                            "(empty: no limit)", check=_check_max_time)
    eval_every: int = run_key(1, "evaluate every N epochs (and after the last)", min=1)
    eval_every_steps: int | None = run_key(None, "also evaluate every N optimizer steps "
                                           "inside an epoch, for long epochs (none: only at "
                                           "epoch ends)", min=1)
    log_every: int = run_key(10, "report training statistics every N optimizer steps", min=1,
                             fixed_on_resume=True)
    progress: str = run_key("auto", "progress display", choices=PROGRESS)
    profile: str = run_key("", "torch.profiler over optimizer steps START:STOP (e.g. 10:20: "
                           "steps 11 to 20): profile/trace-steps-11-20.json.gz in the run folder "
                           "and the top operators printed (empty: off)", check=_check_profile)
    run_name: str = run_key("", "run folder runs/<recipe>/<run_name> (default: a timestamp)",
                            check=check_run_name)
    run_dir: str = run_key("", "any run folder (overrides run_name)")

    scheduler: str = schedule_key("warmup_cosine", "LR schedule", choices=SCHEDULER_NAMES,
                                  fixed_on_resume=True)
    warmup_fraction: float = schedule_key(0.23, "linear warmup, as a fraction of the run "
                                          "(warmup_cosine only)", min=0, max=1,
                                          fixed_on_resume=True)
    warmup_epochs: float | None = schedule_key(None, "linear warmup in epochs; overrides "
                                               "--warmup-fraction (none: use the fraction)",
                                               min=0, fixed_on_resume=True)
    warmup_start_factor: float = schedule_key(0.2, "warmup starts at this fraction of lr",
                                              min=0, max=1, min_exclusive=True,
                                              fixed_on_resume=True)
    min_lr_ratio: float = schedule_key(0.07, "warmup_cosine ends at this fraction of lr",
                                       min=0, max=1, fixed_on_resume=True)

    precision: str = precision_key("auto", "the step's number format (auto: fp32 on CPU, "
                                   "bf16/fp16 on GPU)", choices=PRECISIONS,
                                   fixed_on_resume=True)

    resume: str = checkpoints_key("auto", "auto (newest good checkpoint in the run folder) | "
                                  "never | <checkpoint path>", check=_check_resume)
    allow_data_change: bool = checkpoints_key(False, "resume even though the data differ "
                                              "from the checkpoint's (logged as an override)")
    checkpoint_every: int = checkpoints_key(50, "save 'last' every N optimizer steps (and "
                                            "every epoch)", min=1)
    async_checkpoint: bool = checkpoints_key(False, "write each checkpoint behind training: "
                                             "a save holds the step only while the state is "
                                             "copied into CPU memory (one more copy of it, "
                                             "kept for the run), the write and commit follow "
                                             "on a thread, one save at a time (a new save "
                                             "first waits for the previous one); the run's "
                                             "end waits for the last")
    keep_last: int = checkpoints_key(3, "history checkpoints to keep", min=1)
    keep_best: int = checkpoints_key(1, "best checkpoints to keep, ranked by the run's metric "
                                     "(top-k; best.pt links the first)", min=1)
    init_from: str = checkpoints_key("", "start a new run from the model weights of a run "
                                     "folder (its best.pt, else last.pt) or a checkpoint "
                                     "file: no optimizer, step or schedule state; ignored "
                                     "once the run has checkpoints (it resumes)")

    checks: str = health_key("on", "start-up checks: NaN/Inf in the first batch, labels in "
                             "range, first loss near ln(classes)", choices=("on", "off"))
    overfit_batches: int = health_key(0, "debug: train on this many fixed batches to "
                                      "near-zero loss and report whether it got there, "
                                      "instead of the run (writes nothing; 0: off)", min=0)
    patience: int | None = health_key(None, "early stopping: evaluations without improvement "
                                      "(none: off)", min=1, fixed_on_resume=True)
    spike_guard: bool = health_key(False, "loss-spike recovery: skip a step whose loss or "
                                   "gradient norm exceeds --spike-factor x their running "
                                   "median; after --spike-repeat such spikes roll back, skip "
                                   "batches and cool the LR; stop (exit 3) if they repeat "
                                   "after --spike-max-rollbacks", fixed_on_resume=True)

    spike_factor: float = spike_key(6.0, "a spike is above this multiple of the median",
                                    min=1, min_exclusive=True)
    spike_window: int = spike_key(100, "steps whose median the spike threshold uses", min=1)
    spike_min_history: int = spike_key(20, "steps known before any spike is decided", min=1)
    spike_watch: str = spike_key("both", "values compared with their median",
                                 choices=WATCH_CHOICES)
    spike_repeat: int = spike_key(3, "spikes within --spike-repeat-window steps that roll "
                                  "back", min=1)
    spike_repeat_window: int = spike_key(50, "steps in which --spike-repeat spikes roll back",
                                         min=1)
    spike_snapshot_every: int = spike_key(100, "optimizer steps between the in-memory "
                                          "snapshots a rollback returns to", min=1)
    spike_skip_batches: int = spike_key(200, "batches skipped after a rollback (at most to "
                                        "the epoch's end)", min=0)
    spike_cooldown_factor: float = spike_key(0.5, "LR factor after a rollback", min=0, max=1,
                                             min_exclusive=True)
    spike_cooldown_steps: int = spike_key(100, "optimizer steps the LR stays cooled", min=0)
    spike_max_rollbacks: int = spike_key(1, "rollbacks before repeated spikes stop the run",
                                         min=0)

    nproc: int = distributed_key(1, "processes to spawn on this machine (DDP, one per GPU); "
                                 "1 under torchrun, which starts them itself", min=1)
    strategy: str = distributed_key("ddp", "how the processes hold the model: ddp (each "
                                    "the whole model, gradients all-reduced) | fsdp (FSDP2: "
                                    "parameters, gradients and optimizer state sharded "
                                    "over the processes, block by block)", choices=STRATEGIES)
    backend: str = distributed_key("auto", "process group of several processes: auto (nccl "
                                   "for CUDA, else gloo)", choices=BACKENDS)
    collective_timeout: int = distributed_key(
        600, "seconds a process of a group waits in a collective for the others (a gradient "
        "all-reduce, a checkpoint's save) before it stops with exit 5, naming the peer that "
        "stopped answering; must cover the longest a process works alone while the others "
        "wait: rank 0 saving the largest checkpoint, or checking the data at the start", min=1)

    tracker: str = tracking_key("none", "also log the config, every scalar, the best checkpoint "
                                "and curves.png to an experiment tracker (mlflow: pip install "
                                "-e '.[mlflow]'; wandb: pip install -e '.[wandb]', offline "
                                "unless WANDB_MODE says otherwise; TensorBoard is always "
                                "written)", choices=TRACKER_NAMES, check=_tensorboard_is_on)
    tracker_uri: str = tracking_key("", "where the tracker logs (mlflow: a tracking URI or a "
                                    "folder; default: mlruns/ in the working directory, or "
                                    "the store this run logged to before; wandb: the folder "
                                    "W&B writes its wandb/ folder in; default: WANDB_DIR, "
                                    "or the one this run used before, or the run folder)")

    def warmup(self) -> float:
        """Warmup in epochs: ``warmup_epochs`` when given, else the fraction of ``epochs``
        (rounded so that 0.23 x 10 is 2.3, not 2.3000000000000003)."""
        if self.warmup_epochs is not None:
            return self.warmup_epochs
        return round(self.warmup_fraction * self.epochs, 9)
