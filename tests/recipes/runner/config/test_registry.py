"""The registry: recipe folders found without importing them, their keys read without torch,
and the nearest name for a mistyped one."""

import pytest

from recipes.runner.config.command_line import ConfigError
from recipes.runner.config.registry import find_recipes, load_recipe, recipe_keys


@pytest.mark.parametrize("name", sorted(find_recipes()))
def test_a_recipe_folders_keys_are_those_its_recipe_runs_with(name):
    keys, recipe = recipe_keys(name), load_recipe(name)
    assert (keys.name, keys.summary, keys.config) == (recipe.name, recipe.summary, recipe.config)


@pytest.mark.parametrize("typed, meant", [("CIFAR", "cifar"), ("cifar10", "cifar"),
                                          ("Images", "images"), ("char-lm", "charlm")])
def test_a_mistyped_recipe_name_gets_the_nearest(typed, meant):
    with pytest.raises(ConfigError, match=rf"^unknown recipe '{typed}'; did you mean {meant}\? "
                                          r"available: charlm, cifar, images \(or the path"):
        recipe_keys(typed)


def test_a_name_near_nothing_lists_what_is_available():
    with pytest.raises(ConfigError, match=r"^unknown recipe 'mnist'; available: charlm, "):
        recipe_keys("mnist")


def test_cifars_choices_are_its_models_augmentations_and_flips():
    """recipes/cifar/config.py names them without importing torch; the names must be the
    keys of the dictionaries the recipe builds from."""
    from recipes.cifar import config
    from recipes.cifar.model import MODELS, TTA_PREDICTS

    assert tuple(MODELS) == config.MODEL_NAMES
    assert tuple(TTA_PREDICTS) == config.TTA_NAMES


def test_the_images_model_check_knows_torchvisions_models():
    from recipes.images.config import Config
    from recipes.runner.config.command_line import parse_args

    assert parse_args(Config, ["--model", "resnet18"])[0].model == "resnet18"
    with pytest.raises(ConfigError, match="--model: must be a torchvision classification"):
        parse_args(Config, ["--model", "resnet19"])
