"""``--optimizer <the recipe's own>|muon``: the weight-decay groups, which weights Muon takes
and the groups each optimizer gets."""

import pytest
import torch
from torch import nn

from engine.muon import Muon
from recipes.charlm import recipe as charlm
from recipes.charlm.model import GPT
from recipes.cifar.model import AirbenchNet, cifar_resnet18
from recipes.cifar.recipe import Config
from recipes.common.optimizers import build_optimizer, hidden_weights, param_groups


def names(model: nn.Module, params: list[nn.Parameter]) -> set[str]:
    ids = {id(p) for p in params}
    return {name for name, p in model.named_parameters() if id(p) in ids}


def test_decay_groups_take_every_matrix_and_embedding_and_list_a_tied_weight_once():
    model = nn.Sequential(nn.Embedding(10, 8), nn.LayerNorm(8), nn.Linear(8, 10))
    model[2].weight = model[0].weight  # tied, as a language model's head
    model[1].bias.requires_grad_(False)
    decayed, plain = param_groups(model, weight_decay=0.1)
    assert (decayed["weight_decay"], plain["weight_decay"]) == (0.1, 0.0)
    assert names(model, decayed["params"]) == {"0.weight"} and len(decayed["params"]) == 1
    assert names(model, plain["params"]) == {"1.weight", "2.bias"}  # frozen 1.bias left out
    for wrong in (-1.0, float("nan"), "0.1"):
        with pytest.raises(ValueError, match="weight_decay must be a finite number >= 0"):
            param_groups(model, wrong)


def test_muon_takes_the_conv_filters_but_not_the_frozen_whitening_or_the_head():
    model = AirbenchNet()
    model.init_whitening(torch.randn(16, 3, 32, 32))
    chosen = names(model, hidden_weights(model))
    convs = {name for name, p in model.named_parameters() if p.ndim == 4 and p.requires_grad}
    assert chosen == convs and len(convs) == 6
    assert "whiten.weight" not in chosen and "head.weight" not in chosen


def test_muon_takes_a_resnets_convs_but_not_its_classifier():
    model = cifar_resnet18()
    chosen = names(model, hidden_weights(model))
    assert "fc.weight" not in chosen and "conv1.weight" in chosen
    assert all(model.get_parameter(name).ndim == 4 for name in chosen)


def test_embeddings_are_left_to_the_other_optimizer():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 10))
    assert names(model, hidden_weights(model)) == {"1.weight"}


def test_sgd_is_plain_torch_sgd_and_muon_moves_only_the_hidden_weights():
    model = AirbenchNet()
    model.init_whitening(torch.randn(16, 3, 32, 32))  # freezes whiten.weight
    sgd = build_optimizer(Config(optimizer="sgd"), model, own="sgd", lr=0.1)
    assert type(sgd) is torch.optim.SGD
    assert [group["weight_decay"] for group in sgd.param_groups] == [1.33e-3, 0.0]

    muon = build_optimizer(Config(optimizer="muon", muon_lr=0.1, muon_momentum=0.5), model,
                           own="sgd", lr=0.1)
    assert isinstance(muon, Muon)
    by_name = {group["name"]: group for group in muon.param_groups}
    assert set(by_name) == {"decayed", "not_decayed", "muon"}
    assert (by_name["muon"]["lr"], by_name["muon"]["momentum"]) == (0.1, 0.5)
    assert by_name["muon"]["use_muon"] and not by_name["decayed"]["use_muon"]
    assert names(model, by_name["muon"]["params"]) == names(model, hidden_weights(model))
    assert names(model, by_name["decayed"]["params"]) == {"head.weight"}
    assert by_name["decayed"]["lr"] == 0.1 and by_name["muon"]["normalize"]
    every = [p for group in muon.param_groups for p in group["params"]]
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(every) == len({id(p) for p in every}) == len(trainable)


def test_the_language_model_gives_its_matrices_to_muon_and_the_rest_to_adamw():
    model = GPT(256, 16, n_layer=2, n_head=2, n_embd=8)
    chosen = names(model, hidden_weights(model))
    assert chosen and all(".attn." in name or ".mlp." in name for name in chosen)
    assert "transformer.wte.weight" not in chosen  # the token embedding, tied to lm_head
    assert "transformer.wpe.weight" not in chosen
    config = charlm.Config(optimizer="muon")
    optimizer = build_optimizer(config, model, own="adamw", normalize=False, lr=1e-3)
    assert optimizer.other == "adamw"
    muon = next(group for group in optimizer.param_groups if group["use_muon"])
    assert (muon["lr"], muon["momentum"], muon["normalize"]) == (0.02, 0.95, False)
    assert muon["weight_decay"] == config.weight_decay
    assert type(build_optimizer(charlm.Config(), model, own="adamw", lr=1e-3)) is (
        torch.optim.AdamW)
