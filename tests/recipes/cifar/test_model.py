import pytest
import torch

from recipes.cifar.model import (
    TTA_PREDICTS,
    AirbenchNet,
    build_model,
    flip_tta_predict,
)
from recipes.common.optimizers import param_groups


def count(model, trainable_only=False):
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def test_default_model_has_about_two_million_parameters_and_ten_logits():
    model = build_model("airbench")
    assert 1.8e6 < count(model) < 2.2e6
    assert model(torch.randn(3, 3, 32, 32)).shape == (3, 10)


def test_resnet18_is_the_cifar_variant():
    model = build_model("resnet18", num_classes=7)
    assert 11.0e6 < count(model) < 11.3e6
    assert model.conv1.stride == (1, 1) and model.conv1.kernel_size == (3, 3)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)


def test_unknown_model_name_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="'airbench', 'resnet18'"):
        build_model("vgg")


def test_param_groups_exempt_biases_and_norm_parameters_from_decay():
    model = build_model("airbench")
    decay, no_decay = param_groups(model, weight_decay=5e-4)
    assert decay["weight_decay"] == 5e-4 and no_decay["weight_decay"] == 0.0
    assert decay["params"] and all(p.ndim > 1 for p in decay["params"])
    assert no_decay["params"] and all(p.ndim <= 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    with pytest.raises(ValueError, match="weight_decay"):
        param_groups(model, weight_decay=-1.0)


def test_whitening_decorrelates_patches_and_freezes_the_first_layer():
    torch.manual_seed(0)
    # Strongly correlated pixels: a smooth random field, scaled so that even the weakest
    # patch direction has variance far above the whitening's eigenvalue floor.
    images = 10 * torch.nn.functional.interpolate(torch.randn(64, 3, 8, 8), size=32,
                                                  mode="bilinear")
    model = AirbenchNet()
    model.init_whitening(images)
    assert not model.whiten.weight.requires_grad and model.whiten.bias.requires_grad
    half = model.whiten.weight.shape[0] // 2
    torch.testing.assert_close(model.whiten.weight[:half], -model.whiten.weight[half:])
    response = torch.nn.functional.conv2d(images, model.whiten.weight[:half])
    features = response.permute(1, 0, 2, 3).flatten(1)
    second_moment = features @ features.T / features.shape[1]  # whitening is uncentred
    torch.testing.assert_close(second_moment, torch.eye(half), atol=0.02, rtol=0.0)
    frozen = [p for group in param_groups(model, 0.1) for p in group["params"]]
    assert all(p is not model.whiten.weight for p in frozen)


def test_flip_tta_averages_logits_of_the_image_and_its_mirror():
    model = build_model("airbench").eval()
    x, y = torch.randn(4, 3, 32, 32), torch.arange(4)
    with torch.no_grad():
        logits, labels = flip_tta_predict(model, (x, y))
        expected = (model(x) + model(x.flip(-1))) / 2
    torch.testing.assert_close(logits, expected)
    assert labels is y


@pytest.mark.parametrize("channels_last", [False, True])
def test_mirror_translate_tta_weighs_six_views_by_hand(channels_last):
    model = build_model("airbench").eval()
    x, y = torch.randn(3, 3, 32, 32), torch.arange(3)
    padded = torch.nn.functional.pad(x, (1, 1, 1, 1), mode="reflect")
    up_left, down_right = padded[..., :32, :32], padded[..., 2:, 2:]
    assert torch.equal(up_left[..., 1:, 1:], x[..., :31, :31])  # the content moved by one
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        logits, labels = TTA_PREDICTS["mirror_translate"](model, (x, y))
        views = [model(v) + model(v.flip(-1)) for v in (x, up_left, down_right)]
        expected = views[0] / 4 + views[1] / 8 + views[2] / 8
    torch.testing.assert_close(logits, expected)
    assert labels is y


def test_no_tta_is_the_plain_forward():
    model = build_model("airbench").eval()
    x, y = torch.randn(2, 3, 32, 32), torch.arange(2)
    with torch.no_grad():
        torch.testing.assert_close(TTA_PREDICTS["none"](model, (x, y))[0], model(x))


def test_default_model_learns_a_separable_toy_problem():
    torch.manual_seed(0)
    model = AirbenchNet(widths=(16, 32, 32))
    x = torch.randn(64, 3, 32, 32)
    y = torch.arange(64) % 2
    x[y == 1] += 0.5  # class 1 is brighter
    optimizer = torch.optim.SGD(param_groups(model, 5e-4), lr=0.2, momentum=0.9, nesterov=True)
    loss_fn = torch.nn.CrossEntropyLoss()
    for _ in range(30):
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        assert (model(x).argmax(1) == y).float().mean() > 0.95
