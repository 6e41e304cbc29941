"""A run's parts, built: the recipe's model, optimizer and data for this process, its trainer
and evaluator, and every handler attached (the standard ones, averaging, the profiler)."""

import random
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ignite.distributed as idist
import torch
from ignite.engine import Engine

from engine.precision import resolve_precision
from engine.trainer import Trainer, create_evaluator, create_trainer
from handlers.cost import CostMeter, device_peak_flops
from handlers.lr_scheduling import optimizer_steps_per_epoch
from recipes.runner.api import Context, Parts, Recipe, RunPlan
from recipes.runner.config.run_keys import RunConfig, profile_window
from recipes.runner.training.init_from import load_init_weights
from recipes.runner.training.launch import process_device
from recipes.runner.training.standard_handlers import (
    TRAIN_DATA,
    Evaluation,
    RunSite,
    StandardHandlers,
    attach_standard_handlers,
    attach_weight_averaging,
)
from recipes.runner.training.start_checks import Started
from recipes.runner.training.strategy import distributor, evaluate_unsharded, is_sharded

if TYPE_CHECKING:
    from handlers.profiler import StepProfiler

TRACES = "profile"  # in the run folder: trace-steps-FIRST-LAST.json.gz


def build_parts(recipe: Recipe, config: RunConfig, data: Any, run_dir: Path, init_from: str = ""
                ) -> tuple[Context, Parts, Trainer]:
    """Seed, build the recipe's parts for this process and its trainer (no handlers); the
    model begins with the weights of ``init_from`` when given (the resume plan's)."""
    device, world_size = process_device(config.device), idist.get_world_size()
    distribute = distributor(config.strategy, recipe.blocks,
                             resolve_precision(config.precision, device), world_size)
    ctx = Context(device, idist.get_rank(), world_size, run_dir, distribute)
    torch.manual_seed(config.seed)
    random.seed(config.seed)  # its state is in every checkpoint (RngState)
    parts = recipe.build(config, data, ctx)
    if init_from:  # a fresh run: before averaging copies the weights
        load_init_weights(parts.model, init_from)
    trainer = create_trainer(parts.train_model or parts.model, parts.optimizer, parts.loss_fn,
                             forward=parts.forward, device=ctx.device,
                             precision=config.precision, accum_steps=config.accum_steps,
                             max_grad_norm=config.max_grad_norm,
                             prepare_batch=parts.prepare_batch, compile=config.compile,
                             cuda_graphs=config.cuda_graphs)
    return ctx, parts, trainer


def build_run(recipe: Recipe, config: RunConfig, started: Started,
              sinks: Mapping[str, Any] | None = None
              ) -> tuple[Trainer, Engine, Parts, StandardHandlers]:
    """Build the parts and the engines and attach every handler; ``sinks`` get every scalar
    besides TensorBoard and metrics.jsonl. Returns (trainer, evaluator, parts, standard
    handlers)."""
    ctx, parts, trainer = build_parts(recipe, config, started.data, started.run_dir,
                                      started.init_from)
    train_model = parts.train_model or parts.model
    evaluator = create_evaluator(train_model, parts.metrics, device=ctx.device,
                                 precision=config.precision, predict=parts.predict,
                                 prepare_batch=parts.prepare_batch)
    trainer.run_id = started.run_id
    plan = RunPlan(optimizer_steps_per_epoch(len(parts.train_batches), config.accum_steps),
                   config.epochs)
    extra = dict(parts.attach_extra(trainer, evaluator, plan) if parts.attach_extra else {})
    if hasattr(parts.train_batches, "state_dict"):  # a loader's position (workers, sampler)
        extra[TRAIN_DATA] = parts.train_batches
    if is_sharded(train_model):
        evaluate_unsharded(evaluator, train_model)
    if config.averaging != "none":
        replay = getattr(parts.train_batches, "epoch_batches", None)
        extra["averaging"] = attach_weight_averaging(
            config, parts.model, trainer, evaluator,
            bn_batches=(lambda: replay(1)) if replay else None,
            bn_input=lambda batch: parts.prepare_batch(batch, ctx.device, True)[0])
    site = RunSite(started.run_dir, started.run_id, recipe.metrics, recipe.best, plan,
                   rank=ctx.rank, model=parts.model,
                   checkpoint_meta={"data": started.fingerprint}, num_classes=parts.num_classes,
                   cost=cost_meter(config, ctx, parts), sinks=sinks or {})
    evaluation = Evaluation(parts.val_batches, config.eval_every, config.epochs,
                            before=parts.before_evaluation, forwards=parts.evaluation_forwards,
                            every_steps=config.eval_every_steps)
    handlers = attach_standard_handlers(trainer, evaluator, config, site, evaluation, extra)
    if ctx.rank == 0:  # one trace: the other ranks run the same steps
        attach_profiler(config, trainer, started.run_dir, ctx.device)
    return trainer, evaluator, parts, handlers


def cost_meter(config: RunConfig, ctx: Context, parts: Parts) -> CostMeter:
    """A ``CostMeter`` with the recipe's FLOPs and tokens per sample and the peak of this
    process's device in the step's number format."""
    number_format = resolve_precision(config.precision, ctx.device).name
    return CostMeter(config.batch_size, ctx.world_size, ctx.device,
                     flops_per_sample=parts.model_flops,
                     tokens_per_sample=parts.tokens_per_sample,
                     peak_flops=device_peak_flops(ctx.device, number_format))


def attach_profiler(config: RunConfig, trainer: Trainer, run_dir: Path,
                    device: torch.device) -> "StepProfiler | None":
    """The profiler of ``--profile``, attached after every other handler (its window closes
    once the step's handlers ran); None when the key is off."""
    window = profile_window(config.profile)
    if window is None:
        return None
    from handlers.profiler import StepProfiler  # torch.profiler: loaded for --profile only

    profiler = StepProfiler(*window, run_dir / TRACES, cuda=device.type == "cuda")
    profiler.attach(trainer)
    return profiler
