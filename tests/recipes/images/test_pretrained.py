"""``--weights``: torchvision's pretrained weights for ``--model`` with a new head for the
folder's classes, from a local state_dict file (no network here) or torch's cache; bad
weights exit 2 with one line and write nothing."""

import dataclasses
import json
import urllib.error
from pathlib import Path

import pytest
import torch
import torchvision

from recipes.__main__ import main
from recipes.images import pretrained
from recipes.images.recipe import RECIPE
from recipes.runner.api import Context
from tests.helpers import IMAGES

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

CLASSES = 3  # the image tree's (conftest)
RUN = [*IMAGES, "--image-size", "32", "--epochs", "1", "--device", "cpu"]


def save_torchvision_weights(path: Path, model_name: str) -> dict[str, torch.Tensor]:
    """A file such as torchvision's downloads: a fresh model's state_dict (1000 classes)."""
    state = torchvision.models.get_model(model_name, weights=None).state_dict()
    torch.save(state, path)
    return state


@pytest.mark.parametrize(("model_name", "head"), [
    ("resnet18", "fc"), ("squeezenet1_1", "classifier.1"), ("vit_b_16", "heads.head"),
    ("convnext_tiny", "classifier.2"), ("efficientnet_b0", "classifier.1"),
    ("mobilenet_v3_small", "classifier.3")])
def test_the_classifier_head_is_the_layer_that_gives_the_class_scores(model_name, head):
    with torch.device("meta"):
        model = torchvision.models.get_model(model_name, weights=None, num_classes=7)
    assert pretrained.classifier_head(model) == head
    layer = model.get_submodule(head)
    assert getattr(layer, "out_features", None) == 7 or layer.out_channels == 7


@pytest.mark.parametrize("model_name", ["resnet18", "squeezenet1_1", "mobilenet_v3_small"])
def test_the_backbone_is_the_files_and_the_head_has_the_folders_classes(tmp_path, model_name):
    saved = save_torchvision_weights(tmp_path / "weights.pth", model_name)
    state = pretrained.read_pretrained(tmp_path / "weights.pth", model_name)
    model = pretrained.pretrained_classifier(model_name, state, CLASSES)
    head = pretrained.classifier_head(model)
    loaded = model.state_dict()
    assert loaded.keys() == saved.keys()
    for key, tensor in saved.items():
        if key.startswith(f"{head}."):
            assert loaded[key].shape[0] == CLASSES
        else:
            assert torch.equal(loaded[key], tensor), key


def test_a_run_with_a_weights_file_starts_from_it(tmp_path, make_image_tree, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tree = make_image_tree(tmp_path / "tree", {"train": 8, "val": 2})
    saved = save_torchvision_weights(tmp_path / "squeezenet.pth", "squeezenet1_1")
    args = [*RUN, "--data-dir", str(tree), "--weights", str(tmp_path / "squeezenet.pth")]

    # The model the run layer gets from the recipe: the file's backbone, a 3-class head.
    config = dataclasses.replace(RECIPE.config(), model="squeezenet1_1", image_size=32,
                                 num_workers=0, batch_size=8, data_dir=str(tree),
                                 weights=str(tmp_path / "squeezenet.pth"))
    parts = RECIPE.build(config, RECIPE.load_data(config),
                         Context(torch.device("cpu"), 0, 1, tmp_path))
    first = parts.model.state_dict()
    assert first["classifier.1.weight"].shape[0] == CLASSES
    assert all(torch.equal(first[key], saved[key]) for key in saved
               if not key.startswith("classifier.1."))

    assert main([*args, "--run-dir", str(tmp_path / "run")]) == 0
    assert json.loads((tmp_path / "run" / "config.json").read_text())["config"]["weights"] \
        == str(tmp_path / "squeezenet.pth")


def test_bad_weights_exit_2_with_one_line_and_write_nothing(tmp_path, make_image_tree, capsys,
                                                            monkeypatch):
    monkeypatch.chdir(tmp_path)
    tree = make_image_tree(tmp_path / "tree", {"train": 8, "val": 2})
    save_torchvision_weights(tmp_path / "resnet18.pth", "resnet18")
    torch.save({"model": {}, "meta": {}}, tmp_path / "checkpoint.pt")
    (tmp_path / "junk.pth").write_bytes(b"not a weights file")
    hub = tmp_path / "hub"
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(hub))

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(torchvision.models._api, "load_state_dict_from_url", offline)
    url = torchvision.models.get_model_weights("squeezenet1_1").DEFAULT.url
    cases = {
        "missing": ("nowhere.pth", "must be DEFAULT, none or a weights file"),
        "junk": (str(tmp_path / "junk.pth"), "not a state_dict file"),
        "a run's checkpoint": (str(tmp_path / "checkpoint.pt"), "--init-from"),
        "another model": (str(tmp_path / "resnet18.pth"), "not weights of torchvision's "
                          "squeezenet1_1"),
        "offline": ("DEFAULT", str(hub / "checkpoints" / url.rsplit("/", 1)[-1])),
    }
    for name, (weights, fragment) in cases.items():
        capsys.readouterr()
        code = main([*RUN, "--data-dir", str(tree), "--weights", weights,
                     "--run-dir", str(tmp_path / "refused")])
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "--weights" in lines[0], (name, lines)
        assert fragment in lines[0], (name, lines[0])
        assert not (tmp_path / "refused").exists() and not (tmp_path / "runs").exists(), name
