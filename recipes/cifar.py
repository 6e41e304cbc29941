"""CIFAR-10: data in memory, augmented on the device; the airbench-style net or ResNet-18.

Reads top to bottom: config → data → model and optimizer → trainer and
evaluator → handlers → resume → run → summary. Validation uses the official
test split unless ``val_fraction`` holds out part of the training set.
"""

import dataclasses
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import ignite.distributed as idist
import torch
from ignite.engine import Events
from ignite.metrics import Accuracy, Loss

from engine import (
    NonFiniteGradientError,
    RngState,
    TrainEvents,
    create_evaluator,
    create_trainer,
    new_run_id,
    resolve_precision,
)
from handlers import (
    SCHEDULER_NAMES,
    Checkpointer,
    CheckpointError,
    EarlyStopping,
    GradientTelemetry,
    Lookahead,
    LRSchedulerHandler,
    Progress,
    TensorBoardLogger,
    build_scheduler,
    continue_with_new_settings,
    optimizer_steps_per_epoch,
)
from handlers.graceful_stop import GracefulStop
from handlers.history import RunHistory
from recipes.cifar_data import CifarArrays, holdout_validation, load_cifar10, make_synthetic, subset
from recipes.config import ConfigError, field, resume_overrides
from recipes.curves import plot_curves
from recipes.data_batches import FLIPS, EvalBatches, TrainBatches
from recipes.distributed import (
    BACKENDS,
    Launch,
    RankZeroSave,
    launched_by_torchrun,
    plan_launch,
    process_device,
    rank_zero_exit_code,
    share_machine,
    spawn,
)
from recipes.errors import USER_ERRORS
from recipes.models import MODELS, TTA_PREDICTS, TTAPredict, build_model, param_groups
from recipes.run_folder import check_run_name, read_saved_config, resolve_run_dir, write_json_atomic

SHARED_CIFAR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "cifar10"
SYNTHETIC_SIZES = (10_000, 2_000)  # train, test samples when no subset is given
# Lookahead as airbench94 tuned it, in samples rather than steps so that it means the same
# at any batch size: an update every 5120 samples keeping 0.95**5 (times the ramp), from
# 30% of the run on.
LOOKAHEAD_EVERY_SAMPLES, LOOKAHEAD_DECAY, LOOKAHEAD_START = 5 * 1024, 0.95**5, 0.3


def _check_resume(value: str) -> str | None:
    if value in ("auto", "never") or Path(value).is_file():
        return None
    return f"must be 'auto', 'never' or the path of a checkpoint file; {value!r} is not a file"


@dataclass
class Config:
    # fixed_on_resume: keys that shape the saved tensors, or whose value the checkpoint
    # carries (optimizer hyperparameters, the schedule's kind and shape, telemetry cadence,
    # early stopping): a resume would silently keep the saved value, so a change is refused.
    # lr and epochs may change: the schedule is rebuilt for them (_follow_new_lr_and_length).
    data_dir: str = field("auto", "CIFAR-10 folder (image folders or python batches); auto: "
                          "../shared/data/cifar10, else data/cifar10 (downloaded if missing)")
    dataset: str = field("cifar10", "data set", choices=("cifar10", "synthetic"),
                         fixed_on_resume=True)
    model: str = field("airbench", "network", choices=tuple(MODELS), fixed_on_resume=True)
    epochs: int = field(10, "epochs to train", min=1)
    batch_size: int = field(256, "global batch size (samples per micro-batch, all processes)",
                            min=1, fixed_on_resume=True)
    lr: float = field(0.375, "peak learning rate (airbench's 1.5 per 1024 samples)", min=0,
                      min_exclusive=True)
    momentum: float = field(0.85, "SGD momentum", min=0, max=0.999, fixed_on_resume=True)
    nesterov: bool = field(True, "Nesterov momentum", fixed_on_resume=True)
    weight_decay: float = field(1.33e-3, "weight decay (not on biases and norm weights)", min=0,
                                fixed_on_resume=True)
    label_smoothing: float = field(0.2, "label smoothing of the training loss", min=0, max=0.99)
    scheduler: str = field("warmup_cosine", "LR schedule",
                           choices=SCHEDULER_NAMES, fixed_on_resume=True)
    warmup_epochs: float = field(2.3, "linear warmup (warmup_cosine only)", min=0,
                                 fixed_on_resume=True)
    warmup_start_factor: float = field(0.2, "warmup starts at this fraction of lr", min=0,
                                       max=1, min_exclusive=True, fixed_on_resume=True)
    min_lr_ratio: float = field(0.07, "warmup_cosine ends at this fraction of lr", min=0, max=1,
                                fixed_on_resume=True)
    crop_padding: int = field(2, "random-translate augmentation, in pixels (0: off)", min=0,
                              max=16)
    flip: str = field("alternating", "horizontal flips: random in each epoch, or alternating "
                      "(each image mirrored in every other epoch)", choices=FLIPS)
    lookahead: bool = field(True, "lookahead weight averaging (from 30% of the run on)",
                            fixed_on_resume=True)
    precision: str = field("auto", "fp32 | fp16 | bf16 | auto (fp32 on CPU, bf16/fp16 on GPU)",
                           choices=("auto", "fp32", "fp16", "bf16"), fixed_on_resume=True)
    accum_steps: int = field(1, "micro-batches per optimizer step", min=1, fixed_on_resume=True)
    max_grad_norm: float | None = field(None, "clip the global gradient norm (none: no clip)",
                                        min=0, min_exclusive=True)
    patience: int | None = field(None, "early stopping: evaluations without improvement "
                                 "(none: off)", min=1, fixed_on_resume=True)
    seed: int = field(0, "seed of init, data order and augmentation", min=0, fixed_on_resume=True)
    device: str = field("auto", "cpu | cuda | cuda:N | auto")
    nproc: int = field(1, "processes to spawn on this machine (DDP, one per GPU); 1 under "
                       "torchrun, which starts them itself", min=1)
    backend: str = field("auto", "process group of several processes: auto (nccl for CUDA, "
                         "else gloo)", choices=BACKENDS)
    run_name: str = field("", "run folder runs/cifar/<run_name> (default: a timestamp)",
                          check=check_run_name)
    run_dir: str = field("", "any run folder (overrides run_name)")
    resume: str = field("auto", "auto (newest good checkpoint in the run folder) | never | "
                        "<checkpoint path>", check=_check_resume)
    eval_every: int = field(1, "evaluate every N epochs (and after the last)", min=1)
    log_every: int = field(10, "report training statistics every N optimizer steps", min=1,
                           fixed_on_resume=True)
    checkpoint_every: int = field(50, "save 'last' every N optimizer steps (and every epoch)",
                                  min=1)
    keep_last: int = field(3, "history checkpoints to keep", min=1)
    train_subset: int | None = field(None, "use only the first N training samples", min=1,
                                     fixed_on_resume=True)
    val_subset: int | None = field(None, "use only the first N validation samples", min=1,
                                   fixed_on_resume=True)
    val_fraction: float | None = field(None, "hold out this fraction of train for validation "
                                       "instead of the test split", min=0, max=0.5,
                                       min_exclusive=True, fixed_on_resume=True)
    channels_last: bool = field(True, "channels_last memory format (faster on CPU, measured)")
    tta: str = field("mirror", "test-time augmentation of the evaluations during the run",
                     choices=tuple(TTA_PREDICTS))
    final_tta: str = field("mirror_translate", "test-time augmentation of the evaluation after "
                           "the last epoch (mirror_translate: 6 forwards per image)",
                           choices=tuple(TTA_PREDICTS))
    progress: str = field("auto", "progress display", choices=("auto", "bar", "plain", "off"))


def load_data(config: Config) -> CifarArrays:
    if config.dataset == "synthetic":
        sizes = config.train_subset or SYNTHETIC_SIZES[0], config.val_subset or SYNTHETIC_SIZES[1]
        arrays = make_synthetic(*sizes, seed=config.seed)
    else:
        data_dir = Path(config.data_dir)
        if config.data_dir == "auto":
            data_dir = SHARED_CIFAR if SHARED_CIFAR.is_dir() else Path("data/cifar10")
        # Only the auto fallback downloads: a --data-dir that holds nothing is most likely
        # a typo, and a failed download would leave its (empty) folder behind.
        arrays = load_cifar10(data_dir, download=config.data_dir == "auto")
    if config.val_fraction:
        try:
            arrays = holdout_validation(arrays, config.val_fraction)
        except ValueError as error:  # too few training samples to hold any out
            raise ConfigError(f"--val-fraction: {error}") from None
    return subset(arrays, config.train_subset, config.val_subset)


def prepare(config: Config, given: set[str]) -> tuple[Path, str, list[str]]:
    """Resolve the run folder and run id; on resume, merge the saved config. Writes nothing."""
    if "run_name" in given and not config.run_name:
        raise ConfigError("--run-name: must not be empty; leave it out for a timestamp")
    run_dir = resolve_run_dir("cifar", config.run_name, config.run_dir)
    saved = read_saved_config(run_dir)
    has_checkpoints = any((run_dir / "checkpoints").glob("*.pt"))
    if config.resume == "never" and has_checkpoints:
        raise ConfigError(f"--resume never: {run_dir} already holds checkpoints; use --resume auto "
                          "to continue it or another --run-name to start anew")
    if saved is None or config.resume == "never":
        return run_dir, new_run_id(), []
    messages = resume_overrides(saved["config"], config, given)
    return run_dir, saved["run_id"], messages


def launch_of(config: Config) -> Launch:
    return plan_launch(config.nproc, config.backend, config.device, config.batch_size)


def setup(config: Config, given: set[str]) -> tuple[Path, str, CifarArrays]:
    """Check the config and the data, then write the run folder and its config.json: a user
    error (exit 2) leaves nothing on disk."""
    run_dir, run_id, overrides = prepare(config, given)
    launch = launch_of(config)
    if launched_by_torchrun() and launch.backend != idist.backend():
        raise ConfigError(f"--backend: this run resolves to {launch.backend}, but the group "
                          f"was started with {idist.backend()}; give --device and --backend")
    try:
        resolve_precision(config.precision, config.device)
    except ValueError as error:
        raise ConfigError(f"--device/--precision: {error}") from None
    if config.scheduler == "warmup_cosine" and config.warmup_epochs >= config.epochs:
        raise ConfigError(f"--warmup-epochs: must be < --epochs {config.epochs} for "
                          f"warmup_cosine, got {config.warmup_epochs}")
    arrays = load_data(config)  # a DataError here leaves nothing on disk
    if config.batch_size > len(arrays.train_labels):
        raise ConfigError(f"--batch-size {config.batch_size} exceeds the "
                          f"{len(arrays.train_labels)} training samples")
    # Every process needs a validation sample: the first evaluation forward of the DDP
    # model is a collective (it broadcasts rank 0's BatchNorm statistics to all).
    if len(arrays.test_labels) < launch.world_size:
        raise ConfigError(f"{len(arrays.test_labels)} validation samples cannot be shared by "
                          f"{launch.world_size} processes")
    for line in overrides:
        print(line)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # not writable, or a file in the way
        raise ConfigError(f"--run-dir/--run-name: cannot create {run_dir}: {error.strerror}"
                          ) from None
    write_json_atomic(run_dir / "config.json",
                      {"run_id": run_id, "config": dataclasses.asdict(config)})
    return run_dir, run_id, arrays


def main(config: Config, given: set[str]) -> int:
    """Train here, in ``--nproc`` spawned processes, or as one of the processes of torchrun."""
    if launched_by_torchrun():
        with idist.Parallel(backend=launch_of(config).backend):  # joins torchrun's group
            return _join_group(config, given)
    run_dir, run_id, arrays = setup(config, given)
    if config.nproc == 1:
        return train(config, run_dir, run_id, arrays)
    return spawn(train_process, config, run_dir, run_id, nproc=config.nproc,
                 backend=launch_of(config).backend)


def _join_group(config: Config, given: set[str]) -> int:
    """Rank 0 checks everything and writes the run folder, then tells every rank the run
    (or the user error, so that all exit 2); each trains."""
    started = ""
    if idist.get_rank() == 0:
        try:
            run_dir, run_id, _ = setup(config, given)
            started = json.dumps({"run_dir": str(run_dir), "run_id": run_id,
                                  "config": dataclasses.asdict(config)})
        except USER_ERRORS as error:
            started = json.dumps({"error": str(error)})
    started = json.loads(idist.broadcast(started, src=0))
    if "error" in started:
        raise ConfigError(started["error"])
    return train_process(idist.get_local_rank(), Config(**started["config"]),
                         Path(started["run_dir"]), started["run_id"])


def train_process(local_rank: int, config: Config, run_dir: Path, run_id: str) -> int:
    """One process of a group: it loads the data itself (decoding is deterministic, so all
    hold the same arrays) and trains on its rank's slice of each batch."""
    share_machine(process_device(config.device))
    return rank_zero_exit_code(train(config, run_dir, run_id, load_data(config)))


def _follow_new_lr_and_length(config: Config, saved: dict, trainer, optimizer,
                              scheduler: LRSchedulerHandler | None, make_scheduler,
                              epoch_length: int) -> None:
    """The resume rule for ``--lr`` and ``--epochs`` (README, "Resuming"): the LR schedule
    becomes the one a fresh run with the new values would follow, from the step reached."""
    trainer.state.max_epochs = config.epochs  # else Ignite restarts a run that was done
    if (saved.get("lr"), saved.get("epochs")) == (config.lr, config.epochs):
        return
    if scheduler is None:
        for group in optimizer.param_groups:
            group["lr"] = config.lr
        return
    continue_with_new_settings(scheduler, make_scheduler, old_lr=saved.get("lr", config.lr),
                               new_lr=config.lr, optimizer_steps=trainer.state.optimizer_step,
                               epochs_completed=trainer.state.iteration // epoch_length)


def train(config: Config, run_dir: Path, run_id: str, arrays: CifarArrays) -> int:
    rank, world = idist.get_rank(), idist.get_world_size()
    device = process_device(config.device)
    torch.manual_seed(config.seed)
    random.seed(config.seed)  # its state is in every checkpoint (RngState)
    train_batches = TrainBatches(arrays.train_images, arrays.train_labels, config.batch_size,
                                 seed=config.seed, device=device, rank=rank, world_size=world,
                                 channels_last=config.channels_last,
                                 crop_padding=config.crop_padding, flip=config.flip)
    val_batches = EvalBatches(arrays.test_images, arrays.test_labels, 1024 // world,
                              device=device, rank=rank, world_size=world,
                              channels_last=config.channels_last)
    net = build_model(config.model, num_classes=len(arrays.classes)).to(device)
    if hasattr(net, "init_whitening"):  # fitted to the first 5000 (normalised) train images
        net.init_whitening(train_batches.normalise(train_batches.images[:5000]))
    if config.channels_last:
        net = net.to(memory_format=torch.channels_last)
    model = idist.auto_model(net) if world > 1 else net  # DDP wraps; checkpoints hold `net`
    optimizer = torch.optim.SGD(param_groups(model, config.weight_decay), lr=config.lr,
                                momentum=config.momentum, nesterov=config.nesterov)
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=config.label_smoothing)
    trainer = create_trainer(model, optimizer, loss_fn, device=device,
                             precision=config.precision, accum_steps=config.accum_steps,
                             max_grad_norm=config.max_grad_norm)
    predict = TTAPredict(config.tta)
    # Metrics accumulate on the device (no host copy per batch) and are summed over all
    # processes when computed: the result is that of one process seeing every sample.
    metrics = {"accuracy": Accuracy(device=device),
               "loss": Loss(torch.nn.functional.cross_entropy, device=device)}
    evaluator = create_evaluator(model, metrics, device=device, precision=config.precision,
                                 predict=predict)
    trainer.run_id = run_id

    steps_per_epoch = optimizer_steps_per_epoch(len(train_batches), config.accum_steps)

    def make_scheduler() -> LRSchedulerHandler | None:
        return build_scheduler(
            config.scheduler, optimizer, steps_per_epoch=steps_per_epoch, epochs=config.epochs,
            **({"warmup_epochs": config.warmup_epochs,
                "warmup_start_factor": config.warmup_start_factor,
                "min_lr_ratio": config.min_lr_ratio} if config.scheduler == "warmup_cosine"
               else {}),
            **({"metric": "loss"} if config.scheduler == "plateau" else {}))

    scheduler = make_scheduler()
    lookahead = None
    if config.lookahead:  # before the checkpoints: a save sees this step's averaging
        total_steps = steps_per_epoch * config.epochs
        # At least 10 updates in a run, however short (a smoke run averages too).
        every = min(round(LOOKAHEAD_EVERY_SAMPLES / (config.batch_size * config.accum_steps)),
                    total_steps // 10)
        lookahead = Lookahead(net, total_steps, decay_base=LOOKAHEAD_DECAY, every=max(1, every),
                              start_step=round(LOOKAHEAD_START * total_steps))
        lookahead.attach(trainer)
    telemetry = GradientTelemetry(log_every=config.log_every, layer_every=config.log_every * 10)
    telemetry.attach(trainer)
    history = RunHistory(batch_size=config.batch_size)
    history.attach(trainer, telemetry, evaluator)
    early_stopping = None
    if config.patience is not None:
        early_stopping = EarlyStopping("accuracy", config.patience, trainer=trainer, mode="max")
        evaluator.add_event_handler(Events.COMPLETED, early_stopping)
    if scheduler is not None:
        scheduler.attach(trainer, evaluator)

    def evaluate(engine) -> None:
        if engine.state.epoch % config.eval_every == 0 or engine.state.epoch == config.epochs:
            predict.name = config.final_tta if engine.state.epoch == config.epochs else config.tta
            evaluator.run(val_batches)

    trainer.add_event_handler(Events.EPOCH_COMPLETED, evaluate)
    to_save = {"model": net, "optimizer": optimizer, "scaler": trainer.scaler,
               "trainer": trainer, "telemetry": telemetry, "history": history,
               "rng": RngState()}
    to_save |= {"scheduler": scheduler} if scheduler is not None else {}
    to_save |= {"early_stopping": early_stopping} if early_stopping is not None else {}
    to_save |= {"lookahead": lookahead} if lookahead is not None else {}
    if rank == 0:  # only rank 0 writes; every rank loads the same checkpoint
        tensorboard = TensorBoardLogger(run_dir, hparams=dataclasses.asdict(config),
                                        batch_size=config.batch_size)
        to_save["tensorboard"] = tensorboard
    checkpointer = Checkpointer(run_dir / "checkpoints", to_save, run_id=run_id,
                                config=dataclasses.asdict(config), keep_last=config.keep_last,
                                metric="accuracy", mode="max")
    if rank == 0:  # before the saves: a checkpoint taken at an evaluation holds its best
        tensorboard.attach(trainer, telemetry, evaluator)
    # Only rank 0 writes, but every rank takes part in each save (RankZeroSave): a failed
    # save stops all of them.
    save_last, save_best = RankZeroSave(checkpointer.save_last), RankZeroSave(
        checkpointer.save_best)
    evaluator.add_event_handler(Events.COMPLETED, save_best)
    # Not at an epoch's last iteration: that one is saved at EPOCH_COMPLETED, after
    # validation, so that a resumed run never skips an epoch's evaluation.
    trainer.add_event_handler(
        TrainEvents.OPTIMIZER_STEP(event_filter=lambda engine, step: (
            step % config.checkpoint_every == 0
            and engine.state.iteration % engine.state.epoch_length != 0)),
        save_last)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, save_last)
    if rank == 0:
        Progress(mode=config.progress).attach(trainer, telemetry)
    # Every rank stops at a signal (all of them receive Ctrl-C) and saves together.
    stop = GracefulStop(save_last)
    stop.attach(trainer)

    info = checkpointer.resume(config.resume) if rank == 0 else None
    if world > 1:  # rank 0 picked the file (and cleared stale temp files); all load that one
        chosen = idist.broadcast(str(info.path) if info is not None else "never", src=0)
        info = checkpointer.resume(chosen) if rank > 0 else info
    if info is not None and rank == 0:
        for name, reason in info.rejected:
            print(f"skipped checkpoint {name}: {reason}", file=sys.stderr)
        print(f"resumed from {info.path} (epoch {trainer.state.epoch}, "
              f"iteration {trainer.state.iteration}, step {trainer.state.optimizer_step})")
    status, exit_code = "completed", 0
    # A run killed after its final save, or started again once done, has nothing left to
    # train: Ignite would restart a finished state at iteration 0, on the trained weights.
    finished = info is not None and (
        trainer.state.iteration >= config.epochs * len(train_batches)
        or bool(early_stopping and early_stopping.stopped_early))
    if finished and rank == 0:
        print("the run is already complete: nothing left to train")
    if info is not None and not finished:
        _follow_new_lr_and_length(config, info.meta.get("config") or {}, trainer, optimizer,
                                  scheduler, make_scheduler, epoch_length=len(train_batches))
    try:
        if not finished:
            trainer.run(train_batches.bind(trainer), max_epochs=config.epochs)
    except NonFiniteGradientError as error:  # raised by every rank at the same step
        status, exit_code = f"stopped: {error}", 3
        if rank == 0:
            print(f"error: {error}", file=sys.stderr)
    except CheckpointError as error:  # a save failed (disk full, permission, read-only folder)
        status, exit_code = f"stopped: {error}", 4  # not a usage error: 2 is for those
        if rank == 0:  # every rank raises it (RankZeroSave); rank 0 has the cause
            print(f"error: {error}", file=sys.stderr)
    finally:
        stop.restore()
    if stop.exit_code is not None and exit_code == 0:  # a failed save outranks the signal
        status, exit_code = f"interrupted by {stop.received.name}", stop.exit_code
    if rank == 0:
        history.stopped_early = bool(early_stopping and early_stopping.stopped_early)
        summary = {"status": status, "run_id": run_id, **history.summary(trainer)}
        print(json.dumps(summary, indent=2))
        try:  # the disk that failed a checkpoint may fail these too: the checkpoints matter
            write_json_atomic(run_dir / "summary.json", summary)
            plot_curves(history, run_dir / "curves.png", title=f"cifar {run_dir.name}")
        except OSError as error:
            print(f"error: could not write the summary or curves in {run_dir}: "
                  f"{error.strerror or error}", file=sys.stderr)
            exit_code = exit_code or 4
    return exit_code
