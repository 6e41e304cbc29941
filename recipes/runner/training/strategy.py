"""``--strategy ddp|fsdp``: how the processes of a run hold the model.

``ddp`` (the default): every process holds the whole model and its optimizer state, and
DDP all-reduces the gradients (``idist.auto_model``). ``fsdp``: FSDP2
(``torch.distributed.fsdp.fully_shard``) on each of the recipe's repeated blocks
(``Recipe.blocks``) and on the root, so each process holds a 1/N slice of every parameter,
gradient and optimizer state; a block's parameters are all-gathered just before it runs
and freed after, and the gradients are reduce-scattered. On CUDA with bf16, FSDP2's own
``MixedPrecisionPolicy`` runs the blocks in bf16 and reduces in bf16 while the slices the
optimizer updates stay fp32; on the CPU everything stays fp32. One process works too (a
one-rank group).

A recipe's ``build`` calls ``ctx.distribute(model)`` before it builds the optimizer (FSDP2
replaces the parameters with their slices).

How a run's checkpoints take part across processes, by its ``--strategy`` (the format
itself is picked by ``handlers.checkpoint.formats.format_for``): rank 0 writes each ``.pt``,
every process its own shards of each ``.dcp``. A checkpoint of the other kind is refused
before anything is written.
"""

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import ignite.distributed as idist
import torch
import torch.distributed as dist
from ignite.engine import Engine, Events
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from engine.precision import Precision, resolve_precision
from handlers.checkpoint.files import CHECKPOINT_NAME, claimed_position, committed_checkpoints
from handlers.checkpoint.formats import SUFFIXES
from recipes.runner.config.command_line import ConfigError
from recipes.runner.training.launch import RankZeroSave

if TYPE_CHECKING:
    from recipes.runner.api import Recipe
    from recipes.runner.config.run_keys import RunConfig

Blocks = Callable[[nn.Module], list[nn.Module]]


def check_strategy(recipe: "Recipe", config: "RunConfig") -> None:
    """``ConfigError`` for what ``--strategy fsdp`` cannot run, before anything is written."""
    if config.strategy != "fsdp":
        return
    if recipe.blocks is None:
        raise ConfigError(f"--strategy fsdp: the recipe {recipe.name} names no blocks to "
                          "shard (Recipe.blocks); use --strategy ddp")
    if config.averaging != "none":
        raise ConfigError("--strategy fsdp: --averaging keeps a whole copy of the weights; "
                          "use --averaging none or --strategy ddp")
    if config.precision == "fp16" or (config.precision == "auto" and resolve_precision(
            "auto", config.device).name == "fp16"):
        raise ConfigError("--strategy fsdp: fp16 would need a gradient scaler for sharded "
                          "gradients; use --precision bf16 or fp32")


def strategy_line(precision: Precision, world_size: int) -> str:
    """An FSDP run's first lines say how the model is held and in which precision."""
    if uses_policy(precision):
        kept = "the blocks compute and reduce in bf16 over fp32 master slices"
    else:
        kept = f"{precision.name} throughout, no mixed-precision policy"
    return (f"strategy: fsdp (FSDP2 over {world_size} process(es), sharded per block and "
            f"at the root; {kept} on {precision.device.type})")


def uses_policy(precision: Precision) -> bool:
    return precision.device.type == "cuda" and precision.name == "bf16"


def distributor(strategy: str, blocks: Blocks | None, precision: Precision,
                world_size: int) -> Callable[[nn.Module], nn.Module]:
    """``ctx.distribute`` for this run: the model as the step should call it."""
    if strategy == "fsdp":
        return lambda model: shard(model, blocks(model), precision)
    return idist.auto_model if world_size > 1 else (lambda model: model)


def shard(model: nn.Module, blocks: list[nn.Module], precision: Precision) -> nn.Module:
    """``fully_shard`` each block, then the root (which takes every parameter outside the
    blocks), over all of this run's processes; the same module object is returned."""
    if not dist.is_initialized():  # one process: FSDP2 still needs a group, of one rank
        dist.init_process_group("nccl" if precision.device.type == "cuda" else "gloo",
                                store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh(precision.device.type, (dist.get_world_size(),))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
              if uses_policy(precision) else MixedPrecisionPolicy())
    # FSDP2 shards contiguous parameters only; channels_last inputs keep convolutions
    # channels_last (they follow the input's format).
    model.to(memory_format=torch.contiguous_format)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def evaluate_unsharded(evaluator: Engine, model: FSDPModule) -> None:
    """Every rank gathers the whole model once before an evaluation and frees it after:
    the evaluation's forwards then need no collective, so ranks with different numbers of
    validation batches (a split that the processes do not divide) cannot wait on each
    other."""
    modules = [module for module in model.modules() if isinstance(module, FSDPModule)]

    def gather(_: Engine) -> None:
        model.set_reshard_after_forward(False)
        for module in modules:
            module.unshard()

    def free(_: Engine) -> None:
        for module in modules:
            module.reshard()
        model.set_reshard_after_forward(True)  # fully_shard's defaults: the blocks free
        model.set_reshard_after_forward(False, recurse=False)  # after forward, the root not

    evaluator.add_event_handler(Events.STARTED, gather)
    evaluator.add_event_handler(Events.COMPLETED, free)


def save_wrapper(strategy: str) -> type:
    """How each save takes part across processes: ``EveryRankSave`` for sharded saves,
    ``RankZeroSave`` for single files."""
    return EveryRankSave if strategy == "fsdp" else RankZeroSave


class EveryRankSave(RankZeroSave):
    """Every process saves (a sharded save is a collective: each writes its own shards) and
    learns whether every process's save worked; all raise the same ``CheckpointError`` if
    not, so all stop together with exit code 4. Attach it on every rank at the same events."""

    failure = "another process could not save it"

    def saves_here(self) -> bool:
        return True


def refuse_other_format(strategy: str, run_dir: Path, resume: str) -> None:
    """``ConfigError`` (one line) when the checkpoint this start would resume from is of the
    other strategy's kind: ``--resume FILE``, or a run folder whose committed checkpoints
    are all of the other kind."""
    wanted = SUFFIXES[strategy]
    if resume not in ("auto", "never"):
        found = [Path(resume)]
    else:
        found = [path for path in committed_checkpoints(run_dir / "checkpoints")
                 if CHECKPOINT_NAME.match(path.name)]
    if not found or any(path.suffix == wanted for path in found):
        return
    other = max(found, key=claimed_position)  # the newest
    theirs = next((name for name, suffix in SUFFIXES.items() if suffix == other.suffix), None)
    if theirs is None:
        return  # not a checkpoint name at all: the resume's own check names the problem
    raise ConfigError(f"--strategy {strategy}: {other} is a checkpoint of a --strategy {theirs} "
                      f"run ({other.suffix}, this run reads {wanted}); resume with --strategy "
                      f"{theirs}, or start a new run from its weights with --init-from")
