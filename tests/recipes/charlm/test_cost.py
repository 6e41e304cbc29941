"""charlm's cost: its FLOPs estimate, and activation checkpointing changing no number."""

import pytest
import torch
from torch.nn import functional as F

from handlers.cost import training_flops
from recipes.charlm.model import GPT
from recipes.charlm.recipe import Config, build, load_data, next_byte_logits
from recipes.runner.api import Context
from tests.helpers import write_text_folder


def test_the_flops_estimate_is_6n_plus_attention_per_token_with_n_by_hand():
    model = GPT(vocab_size=256, block_size=8, n_layer=2, n_head=2, n_embd=8)
    d, t = 8, 8
    block = (2 * d  # ln_1
             + d * 3 * d + 3 * d  # c_attn
             + d * d + d  # attn.c_proj
             + 2 * d  # ln_2
             + d * 4 * d + 4 * d  # c_fc
             + 4 * d * d + d)  # mlp.c_proj
    n = 2 * block + 2 * d + 256 * d  # blocks, ln_f, lm_head = wte (tied); wpe left out
    assert n == 3808
    per_token = 6 * n + 12 * 2 * 2 * (d // 2) * t  # 12 * n_layer * n_head * head_dim * T
    assert model.training_flops_per_sample() == per_token * t == 195072


def test_an_untied_token_embedding_is_a_lookup_and_not_counted():
    tied = GPT(256, 8, 2, 2, 8).training_flops_per_sample()
    assert GPT(256, 8, 2, 2, 8, tie_weights=False).training_flops_per_sample() == tied


@pytest.mark.parametrize("shape", [(8, 2, 2, 8), (32, 2, 4, 32)])
def test_the_estimate_is_torchs_own_count_plus_6_per_token_for_each_bias_and_norm(shape):
    block_size = shape[0]
    model = GPT(256, *shape)
    counted = training_flops(model, torch.zeros(1, block_size, dtype=torch.long))
    vectors = sum(parameter.numel() for parameter in model.parameters() if parameter.ndim == 1)
    assert model.training_flops_per_sample() == counted + 6 * vectors * block_size


def loss_and_grads(checkpointing: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(256, 16, 3, 2, 16, dropout=0.2, activation_checkpointing=checkpointing)
    batch = torch.randint(0, 256, (4, 17))
    loss = F.cross_entropy(*next_byte_logits(model, batch))
    loss.backward()
    return loss.detach(), [parameter.grad for parameter in model.parameters()]


def test_activation_checkpointing_gives_the_same_loss_and_gradients_dropout_included():
    loss, grads = loss_and_grads(False)
    rng = torch.get_rng_state()
    loss_ac, grads_ac = loss_and_grads(True)
    assert torch.equal(torch.get_rng_state(), rng)  # the run's random stream goes on the same
    assert torch.equal(loss, loss_ac)
    for grad, grad_ac in zip(grads, grads_ac, strict=True):
        torch.testing.assert_close(grad_ac, grad, rtol=1e-6, atol=1e-7)


def test_activation_checkpointing_keeps_fewer_tensors_for_the_backward():
    def saved_bytes(checkpointing: bool) -> int:
        model = GPT(256, 32, 4, 2, 32, activation_checkpointing=checkpointing)
        total = 0

        def keep(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += tensor.numel() * tensor.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            model(torch.zeros(8, 32, dtype=torch.long)).sum()
        return total

    assert saved_bytes(True) < saved_bytes(False) / 2


def test_the_recipe_builds_the_model_the_key_asks_for(tmp_path):
    write_text_folder(tmp_path / "text")
    config = Config(text=str(tmp_path / "text"), n_layer=1, n_head=2, n_embd=16,
                    block_size=16, batch_size=8, activation_checkpointing=True)
    parts = build(config, load_data(config), Context(torch.device("cpu"), 0, 1, tmp_path))
    assert parts.model.activation_checkpointing
    assert parts.model_flops == parts.model.training_flops_per_sample()
    assert parts.tokens_per_sample == 16
