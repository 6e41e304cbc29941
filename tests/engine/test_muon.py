"""``Muon``: the orthogonalisation, its SGD groups against ``torch.optim.SGD`` and its
Muon groups against the update written out by hand, weight for weight; its checkpoint."""

import io
import math

import pytest
import torch
from torch import nn

from engine.muon import Muon, orthogonalize


@pytest.mark.parametrize("shape", [(32, 72), (72, 32)])
def test_orthogonalize_keeps_the_singular_vectors_and_pulls_the_values_near_one(shape):
    update = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 7.0
    result = orthogonalize(update, steps=3)
    u, _, vh = torch.linalg.svd(update, full_matrices=False)
    inner = u.T @ result @ vh.T  # diagonal when the singular vectors are the update's
    off_diagonal = inner - torch.diag(torch.diagonal(inner))
    assert off_diagonal.abs().max() < 1e-5
    values = torch.linalg.svdvals(result)
    assert values.min() > 0.6 and values.max() < 1.25  # the raw ones span 0.5 .. 110
    assert result.shape == update.shape and result.dtype == update.dtype


def two_layer_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 4 * 4, 5))


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 3, 6, 6, generator=generator),
             torch.randint(0, 5, (8,), generator=generator)) for _ in range(count)]


def train(model: nn.Module, optimizer: torch.optim.Optimizer, data) -> None:
    for x, y in data:
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def groups(model: nn.Sequential, muon_options: dict) -> list[dict]:
    conv, head = model[0], model[2]
    return [{"params": [conv.weight], "use_muon": True, **muon_options},
            {"params": [conv.bias, head.bias], "weight_decay": 0.0},
            {"params": [head.weight], "weight_decay": 5e-3}]


def test_sgd_groups_are_torch_sgd_bit_for_bit():
    model, reference = two_layer_model(), two_layer_model()
    options = {"lr": 0.1, "momentum": 0.85, "nesterov": True}
    sgd_groups = [{"params": list(model.parameters())[:2], "weight_decay": 1e-3},
                  {"params": list(model.parameters())[2:]}]
    train(model, Muon(sgd_groups, **options), batches(4))
    reference_groups = [{"params": list(reference.parameters())[:2], "weight_decay": 1e-3},
                        {"params": list(reference.parameters())[2:]}]
    train(reference, torch.optim.SGD(reference_groups, **options), batches(4))
    for got, expected in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(got, expected)


def test_adamw_groups_are_torch_adamw_bit_for_bit():
    model, reference = two_layer_model(), two_layer_model()
    options = {"lr": 1e-2, "betas": (0.9, 0.99), "weight_decay": 0.1}
    train(model, Muon(model.parameters(), other="adamw", **options), batches(4))
    train(reference, torch.optim.AdamW(reference.parameters(), **options), batches(4))
    for got, expected in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("normalize", [True, False], ids=["normalized", "decoupled_decay"])
@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "plain"])
def test_muon_groups_follow_the_update_written_out_by_hand(normalize, nesterov):
    lr, momentum, weight_decay = 0.05, 0.6, 0.1
    model = two_layer_model()
    optimizer = Muon(groups(model, {"lr": lr, "momentum": momentum, "nesterov": nesterov,
                                    "weight_decay": weight_decay, "normalize": normalize}),
                     lr=0.1, momentum=0.9)
    data = batches(3)
    reference = two_layer_model()
    weight, buffer = reference[0].weight, None
    others = torch.optim.SGD(
        [{"params": [reference[0].bias, reference[2].bias], "weight_decay": 0.0},
         {"params": [reference[2].weight], "weight_decay": 5e-3}], lr=0.1, momentum=0.9,
        nesterov=True)
    for x, y in data:
        nn.functional.cross_entropy(reference(x), y).backward()
        with torch.no_grad():
            grad = weight.grad
            buffer = grad.clone() if buffer is None else buffer * momentum + grad
            step = grad + momentum * buffer if nesterov else buffer
            if normalize:  # the Frobenius norm back to sqrt(out channels) = 2
                weight.mul_(2.0 / weight.norm())
            else:
                weight.mul_(1 - lr * weight_decay)
            # 4 x 27: wider than tall, so no shape scale
            weight.sub_(lr * orthogonalize(step.reshape(4, 27), steps=3).view_as(weight))
        others.step()
        reference.zero_grad(set_to_none=True)
    train(model, optimizer, data)
    for name, got in model.state_dict().items():
        assert torch.allclose(got, reference.state_dict()[name], rtol=0, atol=1e-6), name
    assert not torch.equal(model[0].weight, two_layer_model()[0].weight)
    if normalize:
        assert math.isclose(model[0].weight.norm().item(), 2.0, rel_tol=0.2)


def test_a_tall_weight_steps_by_the_square_root_of_its_aspect_ratio():
    weight = nn.Parameter(torch.zeros(8, 2))
    optimizer = Muon([{"params": [weight], "use_muon": True, "normalize": False}], lr=0.1,
                     momentum=0.0, nesterov=False)
    weight.grad = torch.randn(8, 2, generator=torch.Generator().manual_seed(0))
    optimizer.step()
    expected = -0.1 * 2.0 * orthogonalize(weight.grad, steps=3)  # sqrt(8 / 2) = 2
    assert torch.equal(weight.detach(), expected)


def test_state_round_trips_through_a_weights_only_checkpoint_and_resumes_bit_identical():
    options = {"lr": 0.05, "momentum": 0.6, "nesterov": True}
    data = batches(6)
    straight = two_layer_model()
    train(straight, Muon(groups(straight, options), lr=0.1, momentum=0.9), data)

    resumed = two_layer_model()
    first = Muon(groups(resumed, options), lr=0.1, momentum=0.9)
    train(resumed, first, data[:3])
    buffer = io.BytesIO()
    torch.save({"model": resumed.state_dict(), "optimizer": first.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    model = two_layer_model()
    model.load_state_dict(saved["model"])
    second = Muon(groups(model, options), lr=0.1, momentum=0.9)
    second.load_state_dict(saved["optimizer"])
    assert saved["optimizer"]["param_groups"][0]["use_muon"] is True
    train(model, second, data[3:])
    for got, expected in zip(model.parameters(), straight.parameters(), strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize(("group", "options", "message"), [
    ({"use_muon": True}, {}, "a use_muon group takes weights of 2 or more dimensions "
     "(matrices, conv filters), got a parameter of shape (3,); put biases and norm parameters "
     "in an SGD group"),
    ({}, {"ns_steps": 0}, "ns_steps must be an int >= 1, got 0"),
    ({}, {"ns_steps": True}, "ns_steps must be an int >= 1, got True"),
    ({}, {"momentum": 0.0, "nesterov": True}, "nesterov needs a momentum > 0"),
    ({}, {"lr": -1.0}, "lr must be a number in [0, inf], got -1.0"),
    ({}, {"lr": "0.1"}, "lr must be a number in [0, inf], got '0.1'"),
    ({"momentum": 1.5}, {}, "momentum must be a number in [0, 1], got 1.5"),
    ({}, {"weight_decay": -0.1}, "weight_decay must be a number in [0, inf], got -0.1"),
    ({}, {"eps": -1e-8}, "eps must be a number in [0, inf], got -1e-08"),
    ({}, {"other": "adam"}, "other must be one of sgd, adamw, got 'adam'"),
    ({}, {"other": "adamw", "betas": (0.9, 1.0)},
     "each of betas must be a number in [0, 0.999999], got 1.0"),
])
def test_bad_settings_are_refused_naming_the_setting_and_what_is_allowed(group, options,
                                                                          message):
    bias = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError) as refused:
        Muon([{"params": [bias], **group}], **{"lr": 0.1, **options})
    assert str(refused.value) == message


def test_a_momentum_of_1_is_allowed_and_sgd_groups_keep_their_buffers_as_torch_sgd():
    model, reference = two_layer_model(), two_layer_model()
    options = {"lr": 0.01, "momentum": 1.0, "nesterov": True}
    train(model, Muon(model.parameters(), **options), batches(3))
    train(reference, torch.optim.SGD(reference.parameters(), **options), batches(3))
    for got, expected in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(got, expected)


def test_ns_steps_of_1_is_allowed():
    weight = nn.Parameter(torch.randn(4, 6))
    optimizer = Muon([{"params": [weight], "use_muon": True, "ns_steps": 1}], lr=0.1)
    assert optimizer.param_groups[0]["ns_steps"] == 1


@pytest.mark.parametrize("scale", [0.01, 10.0])
def test_normalize_brings_a_weights_norm_back_to_the_root_of_its_rows_from_below_or_above(
        scale):
    weight = nn.Parameter(torch.full((4, 3), scale))
    optimizer = Muon([{"params": [weight], "use_muon": True}], lr=0.0, momentum=0.0,
                     nesterov=False)
    weight.grad = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    optimizer.step()  # lr 0: the weight is only normalized
    assert math.isclose(weight.norm().item(), 2.0, rel_tol=1e-6)  # sqrt(4 rows)


def test_orthogonalize_first_scales_the_update_by_its_norm_plus_eps():
    """No iteration: only the scaling that brings every singular value to at most 1, with
    eps guarding a zero norm (1e-6 here, so eps shows in the result)."""
    update = torch.zeros(2, 3)
    update[0, 0] = 1e-6
    assert torch.equal(orthogonalize(torch.zeros(2, 3), steps=0), torch.zeros(2, 3))
    assert math.isclose(orthogonalize(update, steps=0)[0, 0].item(), 1e-6 / (1e-6 + 1e-7),
                        rel_tol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_orthogonalize_returns_the_updates_dtype(dtype):
    update = torch.randn(4, 6, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert orthogonalize(update, steps=2).dtype == dtype


def reference_orthogonalize(update: torch.Tensor, steps: int, eps: float = 1e-7) -> torch.Tensor:
    """Muon's Newton-Schulz on one matrix, written out plainly (fp32)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = update.float()
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    x = x / (x.norm() + eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


def reference_muon_step(weights, buffers, lr, momentum, nesterov, normalize, weight_decay):
    """One Muon step, weight by weight; ``buffers`` (None at the first step) is updated."""
    for i, weight in enumerate(weights):
        grad = weight.grad
        buffers[i] = grad.clone() if buffers[i] is None else buffers[i] * momentum + grad
        update = grad + momentum * buffers[i] if nesterov else buffers[i]
        if normalize:
            weight.mul_(math.sqrt(weight.shape[0]) / weight.norm())
        else:
            weight.mul_(1 - lr * weight_decay)
        matrix = update.reshape(weight.shape[0], -1)
        shape_scale = max(1.0, matrix.shape[0] / matrix.shape[1]) ** 0.5
        weight.sub_(lr * shape_scale * reference_orthogonalize(matrix, 3).view_as(weight))


# Same-shape pairs, a tall matrix, conv filters (one channels_last), a vector-wide one.
SHAPES = [(16, 40), (16, 40), (48, 6), (8, 3, 3, 3), (8, 3, 3, 3), (32, 8, 2, 2), (1, 30)]


def muon_weights(seed: int = 0, scale: float = 1.0) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    weights = [nn.Parameter(torch.randn(shape, generator=generator) * scale) for shape in SHAPES]
    weights[4] = nn.Parameter(weights[4].detach().to(memory_format=torch.channels_last))
    return weights


def set_grads(weights: list[nn.Parameter], step: int) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    for weight in weights:
        weight.grad = torch.randn(weight.shape, generator=generator).to(
            memory_format=torch.channels_last if weight.is_contiguous(
                memory_format=torch.channels_last) and weight.ndim == 4 else
            torch.contiguous_format) * 3.0


@pytest.mark.parametrize("normalize", [True, False], ids=["normalized", "decoupled_decay"])
@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "plain"])
def test_batched_muon_equals_the_per_matrix_update_to_1e6_relative(normalize, nesterov):
    """Every weight of every shape is orthogonalised in one padded stack: each step of each
    weight equals the per-matrix update written out plainly, to 1e-6 of its size. (An LR of
    1 and small weights: at 0.05 the weight's own fp32 rounding, in both, is 1e-6 of a step.)
    """
    lr, momentum, weight_decay = 1.0, 0.6, 0.1
    weights, reference = muon_weights(scale=1e-2), muon_weights(scale=1e-2)
    optimizer = Muon([{"params": weights, "use_muon": True, "normalize": normalize}],
                     lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
    buffers = [None] * len(reference)
    for step in range(3):
        set_grads(weights, step)
        set_grads(reference, step)
        before = [w.detach().clone() for w in weights]
        optimizer.step()
        with torch.no_grad():
            reference_muon_step(reference, buffers, lr, momentum, nesterov, normalize,
                                weight_decay)
        for got, expected, start in zip(weights, reference, before, strict=True):
            delta, expected_delta = got.detach() - start, expected.detach() - start
            assert (delta - expected_delta).norm() <= 1e-6 * expected_delta.norm()
            for weight in (got, expected):  # the next step starts from the same weights
                weight.data.copy_(start + expected_delta)
        for i, weight in enumerate(weights):  # and the same momentum
            optimizer.state[weight]["momentum_buffer"].copy_(buffers[i])


def test_lr_and_momentum_may_be_0_dim_tensors_read_by_no_host_copy():
    """A compiled step's schedule holds them as tensors: the step is the same and never
    copies a value to the host (``aten._local_scalar_dense``, what ``.item()`` runs)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class NoHostReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            assert func is not torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    runs = []
    for make in (float, torch.tensor):
        for normalize in (True, False):
            weights = muon_weights()
            optimizer = Muon([{"params": weights, "use_muon": True, "normalize": normalize}],
                             lr=0.05, momentum=0.6, weight_decay=0.1)
            optimizer.param_groups[0]["lr"] = make(0.05)
            optimizer.param_groups[0]["momentum"] = make(0.6)
            for step in range(2):
                set_grads(weights, step)
                with NoHostReads():
                    optimizer.step()
            runs.append([w.detach() for w in weights])
    for floats, tensors in zip(runs[:2], runs[2:], strict=True):
        for got, expected in zip(tensors, floats, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def test_a_non_finite_update_leaves_nothing_behind_in_the_stack():
    """The masked gate puts back weights and momentum after a non-finite step; the next
    step must not meet the NaN in the padding of the shared stack."""
    weights, fresh = muon_weights(), muon_weights()
    optimizer = Muon([{"params": weights, "use_muon": True}], lr=0.05, momentum=0.6)
    set_grads(weights, 0)
    optimizer.step()
    state = {i: (w.detach().clone(), optimizer.state[w]["momentum_buffer"].clone())
             for i, w in enumerate(weights)}
    weights[2].grad = torch.full_like(weights[2], float("nan"))  # the tall, padded one
    optimizer.step()
    for i, weight in enumerate(weights):  # what MaskedGate restores
        weight.data.copy_(state[i][0])
        optimizer.state[weight]["momentum_buffer"].copy_(state[i][1])
    other = Muon([{"params": fresh, "use_muon": True}], lr=0.05, momentum=0.6)
    for i, weight in enumerate(fresh):
        weight.data.copy_(state[i][0])
        other.state[weight]["momentum_buffer"] = state[i][1].clone()
    set_grads(weights, 1)
    set_grads(fresh, 1)
    optimizer.step()
    other.step()
    for got, expected in zip(weights, fresh, strict=True):
        assert torch.equal(got, expected)


def test_sharded_muon_weights_step_as_whole_ones(tmp_path):
    """Under FSDP2 (a one-process gloo group: real DTensors, trivial collectives) the Muon
    group's weights are orthogonalised whole, one by one: the step equals the unsharded
    (stacked) one to float tolerance."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    def model() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 12, bias=False), nn.Linear(12, 4, bias=False))

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        plain, sharded = model(), model()
        for layer in sharded:
            fully_shard(layer)
        runs = []
        for net in (plain, sharded):
            optimizer = Muon([{"params": list(net.parameters()), "use_muon": True}],
                             lr=0.1, momentum=0.6)
            for x in torch.randn(2, 8, 6, generator=torch.Generator().manual_seed(1)):
                net(x).square().sum().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            runs.append([p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                         for p in net.parameters()])
    finally:
        dist.destroy_process_group()
    for got, expected in zip(*runs, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_a_weight_whose_first_gradient_comes_later_starts_its_momentum_then():
    """One weight has no gradient at the first step: at the second its buffer starts as its
    gradient while the other's carries on, as two optimizers of one weight each would do."""
    weights, alone = muon_weights()[:2], muon_weights()[:2]
    optimizer = Muon([{"params": weights, "use_muon": True}], lr=0.05, momentum=0.6)
    singles = [Muon([{"params": [w], "use_muon": True}], lr=0.05, momentum=0.6) for w in alone]
    for step in range(2):
        set_grads(weights, step)
        set_grads(alone, step)
        if step == 0:
            weights[1].grad = alone[1].grad = None
        optimizer.step()
        for single, weight in zip(singles, alone, strict=True):
            if weight.grad is not None:
                single.step()
    for got, expected in zip(weights, alone, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
