"""The run keys: what every recipe's config holds besides its task's own keys.

A recipe's ``Config`` is a dataclass that extends ``RunConfig``; it may give a run key
another default by declaring it again (``epochs: int = field(10, ...)``). Every key is a
command-line flag (``recipes.runner.config``).

``fixed_on_resume`` marks keys that shape the saved tensors or whose value the checkpoint
carries (optimizer hyperparameters, the schedule's kind and shape, telemetry cadence,
early stopping): a resume would silently keep the saved value, so a change is refused.
``lr`` and ``epochs`` may change: the schedule is rebuilt for them.
"""

from dataclasses import dataclass
from pathlib import Path

from handlers import SCHEDULER_NAMES
from recipes.runner.config import field
from recipes.runner.folder import check_run_name
from recipes.runner.launch import BACKENDS

PRECISIONS = ("auto", "fp32", "fp16", "bf16")
PROGRESS = ("auto", "bar", "plain", "off")
AVERAGING = ("none", "ema", "swa")


def _check_resume(value: str) -> str | None:
    if value in ("auto", "never") or Path(value).is_file():
        return None
    return f"must be 'auto', 'never' or the path of a checkpoint file; {value!r} is not a file"


@dataclass
class RunConfig:
    epochs: int = field(10, "epochs to train", min=1)
    batch_size: int = field(256, "global batch size (samples per micro-batch, all processes)",
                            min=1, fixed_on_resume=True)
    lr: float = field(1e-3, "peak learning rate", min=0, min_exclusive=True)
    scheduler: str = field("warmup_cosine", "LR schedule", choices=SCHEDULER_NAMES,
                           fixed_on_resume=True)
    warmup_fraction: float = field(0.23, "linear warmup, as a fraction of the run "
                                   "(warmup_cosine only)", min=0, max=1,
                                   fixed_on_resume=True)
    warmup_epochs: float | None = field(None, "linear warmup in epochs; overrides "
                                        "--warmup-fraction (none: use the fraction)", min=0,
                                        fixed_on_resume=True)
    warmup_start_factor: float = field(0.2, "warmup starts at this fraction of lr", min=0,
                                       max=1, min_exclusive=True, fixed_on_resume=True)
    min_lr_ratio: float = field(0.07, "warmup_cosine ends at this fraction of lr", min=0, max=1,
                                fixed_on_resume=True)
    precision: str = field("auto", "fp32 | fp16 | bf16 | auto (fp32 on CPU, bf16/fp16 on GPU)",
                           choices=PRECISIONS, fixed_on_resume=True)
    accum_steps: int = field(1, "micro-batches per optimizer step", min=1, fixed_on_resume=True)
    compile: bool = field(False, "torch.compile the model's forward (a one-time compile of "
                          "about a minute on a CPU; checkpoints are the same either way)")
    max_grad_norm: float | None = field(None, "clip the global gradient norm (none: no clip)",
                                        min=0, min_exclusive=True)
    averaging: str = field("none", "weight averaging: an EMA of the weights (after every step) "
                           "or SWA (an equal average of epoch ends, from --swa-start of the "
                           "run on); evaluations and the best checkpoint use the average",
                           choices=AVERAGING, fixed_on_resume=True)
    ema_decay: float = field(0.999, "EMA decay (with a warm-up: min(decay, (1+n)/(10+n)) at "
                             "update n)", min=0, max=0.9999, fixed_on_resume=True)
    swa_start: float = field(0.75, "SWA averages the epoch ends from this fraction of the "
                             "run on", min=0, max=1, fixed_on_resume=True)
    patience: int | None = field(None, "early stopping: evaluations without improvement "
                                 "(none: off)", min=1, fixed_on_resume=True)
    seed: int = field(0, "seed of init, data order and augmentation", min=0, fixed_on_resume=True)
    device: str = field("auto", "cpu | cuda | cuda:N | auto")
    nproc: int = field(1, "processes to spawn on this machine (DDP, one per GPU); 1 under "
                       "torchrun, which starts them itself", min=1)
    backend: str = field("auto", "process group of several processes: auto (nccl for CUDA, "
                         "else gloo)", choices=BACKENDS)
    run_name: str = field("", "run folder runs/<recipe>/<run_name> (default: a timestamp)",
                          check=check_run_name)
    run_dir: str = field("", "any run folder (overrides run_name)")
    resume: str = field("auto", "auto (newest good checkpoint in the run folder) | never | "
                        "<checkpoint path>", check=_check_resume)
    allow_data_change: bool = field(False, "resume even though the data differ from the "
                                    "checkpoint's (logged as an override)")
    eval_every: int = field(1, "evaluate every N epochs (and after the last)", min=1)
    log_every: int = field(10, "report training statistics every N optimizer steps", min=1,
                           fixed_on_resume=True)
    checkpoint_every: int = field(50, "save 'last' every N optimizer steps (and every epoch)",
                                  min=1)
    keep_last: int = field(3, "history checkpoints to keep", min=1)
    progress: str = field("auto", "progress display", choices=PROGRESS)
    checks: str = field("on", "start-up checks: NaN/Inf in the first batch, labels in range, "
                        "first loss near ln(classes)", choices=("on", "off"))
    overfit_batches: int = field(0, "debug: train on this many fixed batches to near-zero "
                                 "loss and report whether it got there, instead of the run "
                                 "(writes nothing; 0: off)", min=0)
    spike_guard: bool = field(False, "loss-spike recovery: skip a step whose loss or gradient "
                              "norm exceeds --spike-factor x their running median; after "
                              "--spike-repeat such spikes roll back, skip batches and cool the "
                              "LR; stop (exit 3) if they repeat after --spike-max-rollbacks",
                              fixed_on_resume=True)
    spike_factor: float = field(6.0, "a spike is above this multiple of the median", min=1,
                                min_exclusive=True, fixed_on_resume=True)
    spike_window: int = field(100, "steps whose median the spike threshold uses", min=1,
                              fixed_on_resume=True)
    spike_min_history: int = field(20, "steps known before any spike is decided", min=1,
                                   fixed_on_resume=True)
    spike_watch: str = field("both", "values compared with their median",
                             choices=("both", "loss", "grad_norm"), fixed_on_resume=True)
    spike_repeat: int = field(3, "spikes within --spike-repeat-window steps that roll back",
                              min=1, fixed_on_resume=True)
    spike_repeat_window: int = field(50, "steps in which --spike-repeat spikes roll back",
                                     min=1, fixed_on_resume=True)
    spike_snapshot_every: int = field(100, "optimizer steps between the in-memory snapshots a "
                                      "rollback returns to", min=1, fixed_on_resume=True)
    spike_skip_batches: int = field(200, "batches skipped after a rollback (at most to the "
                                    "epoch's end)", min=0, fixed_on_resume=True)
    spike_cooldown_factor: float = field(0.5, "LR factor after a rollback", min=0, max=1,
                                         min_exclusive=True, fixed_on_resume=True)
    spike_cooldown_steps: int = field(100, "optimizer steps the LR stays cooled", min=0,
                                      fixed_on_resume=True)
    spike_max_rollbacks: int = field(1, "rollbacks before repeated spikes stop the run", min=0,
                                     fixed_on_resume=True)

    def spike_guard_options(self) -> dict:
        """``SpikeGuard``'s arguments from the ``--spike-*`` keys."""
        watch = ("loss", "grad_norm") if self.spike_watch == "both" else (self.spike_watch,)
        return {"factor": self.spike_factor, "history": self.spike_window,
                "min_history": self.spike_min_history, "watch": watch,
                "repeat": self.spike_repeat, "repeat_window": self.spike_repeat_window,
                "snapshot_every": self.spike_snapshot_every,
                "skip_batches": self.spike_skip_batches,
                "cooldown_factor": self.spike_cooldown_factor,
                "cooldown_steps": self.spike_cooldown_steps,
                "max_rollbacks": self.spike_max_rollbacks}

    def warmup(self) -> float:
        """Warmup in epochs: ``warmup_epochs`` when given, else the fraction of ``epochs``
        (rounded so that 0.23 x 10 is 2.3, not 2.3000000000000003)."""
        if self.warmup_epochs is not None:
            return self.warmup_epochs
        return round(self.warmup_fraction * self.epochs, 9)
