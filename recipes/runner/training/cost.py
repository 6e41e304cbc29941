"""The run layer's side of what training costs: the cost meter for a run's parts and
device, and the check of the keys that trade time for memory."""

from engine import resolve_precision
from handlers.cost import CostMeter, device_peak_flops
from recipes.runner.api import Context, Parts, Recipe
from recipes.runner.config.command_line import ConfigError
from recipes.runner.config.run_keys import RunConfig


def check_recipe_keys(recipe: Recipe, config: RunConfig) -> None:
    """Refuse ``--activation-checkpointing`` for a recipe whose build does not honour it."""
    if config.activation_checkpointing and not recipe.activation_checkpointing:
        raise ConfigError(f"--activation-checkpointing: the {recipe.name} recipe's model has "
                          "no blocks to recompute in the backward; it applies to charlm's "
                          "transformer blocks")


def cost_meter(config: RunConfig, ctx: Context, parts: Parts) -> CostMeter:
    """A ``CostMeter`` with the recipe's FLOPs and tokens per sample and the peak of this
    process's device in the step's number format."""
    number_format = resolve_precision(config.precision, ctx.device).name
    return CostMeter(config.batch_size, ctx.world_size, ctx.device,
                     flops_per_sample=parts.model_flops,
                     tokens_per_sample=parts.tokens_per_sample,
                     peak_flops=device_peak_flops(ctx.device, number_format))
