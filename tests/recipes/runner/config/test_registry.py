"""The registry: recipe folders found without importing them, their keys read without torch,
the nearest name for a mistyped one, and what loads with torch imported without the cyclic
collector."""

import gc

import pytest

from recipes.runner.config.command_line import ConfigError
from recipes.runner.config.registry import (
    find_recipes,
    load_recipe,
    recipe_keys,
    uncollected_imports,
)


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


def test_a_start_imports_without_the_collector_then_freezes_what_it_imported(
        tmp_path, monkeypatch):
    (tmp_path / "freshly_imported.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert gc.isenabled()
    before = gc.get_freeze_count()
    with uncollected_imports():
        assert not gc.isenabled()
        import freshly_imported
    assert gc.isenabled() and freshly_imported.VALUE == 1
    frozen = gc.get_freeze_count()
    assert frozen > before  # the module's objects and everything before them, set aside
    with uncollected_imports():
        import freshly_imported  # noqa: F811 (already imported: nothing new to freeze)
    assert gc.get_freeze_count() == frozen
    with pytest.raises(ZeroDivisionError), uncollected_imports():
        1 / 0  # noqa: B018
    assert gc.isenabled()  # on again, whatever the block raised
