"""Muon for weight matrices and conv filters, SGD with momentum or AdamW for everything
else: one optimizer.

Muon (Keller Jordan, 2024) replaces a weight's momentum update by the nearest
semi-orthogonal matrix, found with a few Newton-Schulz iterations, so every direction of
the update moves at the same rate. airbench94_muon trains the conv filters of the
airbench CIFAR net this way (each filter bank flattened to out x in*kh*kw, its weight
renormalised before each step) and the rest with SGD-Nesterov.

Why not ``torch.optim.Muon``: in torch 2.14.1 it refuses any parameter that is not 2-D
(conv filters are 4-D) and updates nothing else, so a net would need a second optimizer
beside it, and then the step's unscale, clip, non-finite gate, LR schedule and checkpoint
would each have to handle two objects. Here one optimizer holds both kinds of group
(``use_muon``): everything built for one optimizer works unchanged, and the other groups
run torch's own functional SGD or AdamW, bit-identical to ``torch.optim.SGD`` and
``torch.optim.AdamW``.
"""

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.adam import adam
from torch.optim.sgd import sgd

from engine.sharding import on_whole, shard_group

# The quintic Newton-Schulz coefficients of Muon: they push every singular value into
# roughly [0.7, 1.2] in a few steps rather than converging slowly to exactly 1.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def orthogonalize(update: torch.Tensor, steps: int, eps: float = 1e-7) -> torch.Tensor:
    """A near-semi-orthogonal matrix with the singular vectors of the 2-D ``update``
    (``U S' V^T`` for ``update = U S V^T``, ``S'`` close to 1), by quintic Newton-Schulz."""
    # Iterated on the wide form: a smaller Gram matrix.
    transposed = update.shape[0] > update.shape[1]
    wide = update.T if transposed else update
    x = newton_schulz(wide.to(_work_dtype(update))[None], steps, eps)[0]
    return (x.T if transposed else x).to(update.dtype)


def newton_schulz(stack: torch.Tensor, steps: int, eps: float = 1e-7,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``orthogonalize`` of each matrix of a ``[k, rows, columns]`` stack (each wide: rows
    <= columns) at once, in ``out`` if given (``stack`` itself too: only the first op reads
    it). A matrix zero-padded to the
    stack's shape stays zero-padded, its block what it would be alone (to rounding): its
    Gram matrix and every product of the iteration keep the padding's zeros exactly."""
    a, b, c = NS_COEFFICIENTS
    # Every singular value <= 1, where the iteration converges.
    x = stack / (torch.linalg.vector_norm(stack, dim=(1, 2), keepdim=True) + eps)
    for step in range(steps):
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b * gram + c * gram @ gram
        x = torch.baddbmm(x, poly, x, beta=a, out=out if step == steps - 1 else None)
    return x


def _work_dtype(update: torch.Tensor) -> torch.dtype:
    # bf16 on an accelerator (what Muon is tuned with, on tensor cores); fp32 on the CPU,
    # where bf16 matrix products are about 20 times slower.
    return torch.bfloat16 if update.is_cuda else torch.float32


class _Stack:
    """The weights of one Muon group on one device, in one dtype, orthogonalised together:
    each weight's update, flattened to ``rows x rest`` and in its wide form, is copied into
    the corner of its own matrix of one zero-padded ``[k, R, C]`` stack, so one Newton-Schulz
    (a few batched matrix products) serves them all, whatever their shapes. The padding
    costs flops, not dispatches: on a GPU this net's step is bound by the host's dispatches.
    Built once per set of weights; ``views`` are each weight's corner, shaped like it."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        first = params[0]
        matrices = [(p.shape[0], p.numel() // p.shape[0]) for p in params]
        rows = max(min(shape) for shape in matrices)
        columns = max(max(shape) for shape in matrices)
        work_dtype = _work_dtype(first)
        self.work = torch.zeros(len(params), rows, columns, dtype=work_dtype, device=first.device)
        # The scaled result, in the weights' dtype (the work stack itself when the same).
        self.result = (self.work if work_dtype == first.dtype else
                       torch.zeros_like(self.work, dtype=first.dtype))
        self.work_views = [_corner(self.work[i], p) for i, p in enumerate(params)]
        self.result_views = [_corner(self.result[i], p) for i, p in enumerate(params)]
        # A tall matrix steps by the square root of its aspect ratio (see Muon).
        self.shape_scales = torch.tensor(
            [max(1.0, r / c) ** 0.5 for r, c in matrices], dtype=first.dtype,
            device=first.device).view(-1, 1, 1)


def _corner(matrix: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The top-left block of the 2-D ``matrix`` that holds ``weight`` flattened to ``rows x
    rest`` in its wide form, as a view shaped like ``weight``."""
    rows, rest = weight.shape[0], weight.numel() // weight.shape[0]
    block = matrix[:rest, :rows].mT if rows > rest else matrix[:rows, :rest]
    return block.unflatten(1, weight.shape[1:]) if weight.ndim > 2 else block


OTHERS = ("sgd", "adamw")  # what updates the groups that are not use_muon


class Muon(torch.optim.Optimizer):
    """Muon for the param groups with ``use_muon=True`` (each parameter at least 2-D),
    ``other`` (SGD or AdamW) for the rest.

    Every group has ``lr``, ``momentum``, ``nesterov``, ``weight_decay``, ``betas`` and
    ``eps``. SGD groups are ``torch.optim.SGD``'s update (weight decay added to the
    gradient, ``momentum`` and ``nesterov``); AdamW groups are ``torch.optim.AdamW``'s
    (``betas``, ``eps``, decoupled ``weight_decay``). A Muon group
    keeps a momentum buffer ``b = momentum * b + g``, takes ``g + momentum * b`` (Nesterov)
    or ``b``, flattens it to ``rows x rest``, orthogonalises it (``ns_steps`` iterations)
    and steps ``lr * max(1, rows / rest) ** 0.5`` times that. With ``normalize`` (the
    default, as airbench94_muon) each weight is first rescaled to a Frobenius norm of
    ``sqrt(rows)``: the size of a weight that BatchNorm follows does not matter, only its
    direction, and this pins the step's relative size to ``lr``. Without it, a Muon group's
    ``weight_decay`` is decoupled (``w *= 1 - lr * weight_decay``).
    """

    def __init__(self, params: Iterable[Any], lr: float, momentum: float = 0.9,
                 nesterov: bool = True, weight_decay: float = 0.0, ns_steps: int = 3,
                 normalize: bool = True, other: str = "sgd",
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        if other not in OTHERS:
            raise ValueError(f"other must be one of {', '.join(OTHERS)}, got {other!r}")
        self.other = other
        self._stacks: dict[tuple[int, ...], _Stack] = {}  # see _Stack; rebuilt, not saved
        defaults = {"lr": lr, "momentum": momentum, "nesterov": nesterov,
                    "weight_decay": weight_decay, "ns_steps": ns_steps,
                    "normalize": normalize, "use_muon": False, "betas": betas, "eps": eps}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_number("lr", group["lr"], low=0.0)
        _check_number("momentum", group["momentum"], low=0.0, high=1.0)
        _check_number("weight_decay", group["weight_decay"], low=0.0)
        if group["nesterov"] and group["momentum"] == 0 and (
                group["use_muon"] or self.other == "sgd"):
            raise ValueError("nesterov needs a momentum > 0")
        for beta in group["betas"]:
            _check_number("each of betas", beta, low=0.0, high=0.999999)
        _check_number("eps", group["eps"], low=0.0)
        steps = group["ns_steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"ns_steps must be an int >= 1, got {steps!r}")
        if group["use_muon"]:
            flat = [tuple(p.shape) for p in group["params"] if p.ndim < 2]
            if flat:
                raise ValueError(f"a use_muon group takes weights of 2 or more dimensions "
                                 f"(matrices, conv filters), got a parameter of shape {flat[0]}; "
                                 "put biases and norm parameters in an SGD group")
            if group["params"] and shard_group(group["params"]) is None:
                # Built now rather than in the first step: a compiled step traced while its
                # stack is missing is another graph, which rounds the update differently in
                # the last bit, and a resumed run (whose stacks are not saved) would take
                # that graph where the uninterrupted run takes the steady one.
                self._stack(list(group["params"]))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["use_muon"]:
                self._muon_step(group, params)
            elif self.other == "adamw":
                self._adamw_step(group, params)
            else:
                self._sgd_step(group, params)
        return loss

    def _adamw_step(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        for p in params:  # AdamW's lazy state: a host step counter, two moments
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adam(params, [p.grad for p in params], [state["exp_avg"] for state in states],
             [state["exp_avg_sq"] for state in states], [], [state["step"] for state in states],
             decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2,
             lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
             maximize=False)

    def _sgd_step(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        buffers = [self.state[p].get("momentum_buffer") for p in params]
        # foreach (as torch.optim.SGD on a GPU, bit-identical to its CPU loop): a few ops
        # for the group instead of a few per parameter.
        sgd(params, [p.grad for p in params], buffers, weight_decay=group["weight_decay"],
            momentum=group["momentum"], lr=group["lr"], dampening=0.0,
            nesterov=group["nesterov"], maximize=False, foreach=True)
        if group["momentum"] != 0:
            for p, buffer in zip(params, buffers, strict=True):
                self.state[p]["momentum_buffer"] = buffer

    def _muon_step(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        # Foreach and batched ops only: on a GPU the step is bound by the host's dispatches.
        # ``lr`` and ``momentum`` may be 0-dim tensors (a compiled step's schedule): nothing
        # here reads them on the host.
        if not params:
            return
        lr, momentum = group["lr"], group["momentum"]
        grads = [p.grad for p in params]
        kept = [p for p in params if "momentum_buffer" in self.state[p]]
        if kept:
            buffers = [self.state[p]["momentum_buffer"] for p in kept]
            torch._foreach_mul_(buffers, momentum)
            torch._foreach_add_(buffers, [p.grad for p in kept])
        for p in params:
            if "momentum_buffer" not in self.state[p]:  # a first step: the gradient
                self.state[p]["momentum_buffer"] = p.grad.clone()
        buffers = [self.state[p]["momentum_buffer"] for p in params]
        if group["nesterov"]:
            updates = torch._foreach_mul(buffers, momentum)
            torch._foreach_add_(updates, grads)
        else:
            updates = buffers
        if group["normalize"]:
            # sqrt(rows) * (1 / norm): the rounding of ``sqrt(rows) / norm`` on a tensor.
            # Out of place: under FSDP2 a norm is a partial sum that a clamp must reduce first.
            factors = torch._foreach_clamp_min(torch._foreach_norm(params), 1e-12)
            torch._foreach_reciprocal_(factors)
            torch._foreach_mul_(factors, [math.sqrt(p.shape[0]) for p in params])
            torch._foreach_mul_(params, factors)
        elif group["weight_decay"]:
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        if shard_group(params) is not None:
            self._step_sharded(params, updates, lr, group["ns_steps"])
            return
        stack = self._stack(params)
        stack.work.zero_()  # a non-finite update must not stay in the padding
        torch._foreach_copy_(stack.work_views, updates)
        newton_schulz(stack.work, group["ns_steps"], out=stack.work)
        torch.mul(stack.work, stack.shape_scales * lr, out=stack.result)
        torch._foreach_sub_(params, stack.result_views)

    def _stack(self, params: list[torch.Tensor]) -> _Stack:
        key = tuple(map(id, params))
        stack = self._stacks.get(key)
        if stack is None:
            stack = self._stacks[key] = _Stack(params)
        return stack

    @staticmethod
    def _step_sharded(params: list[torch.Tensor], updates: list[torch.Tensor], lr: Any,
                      steps: int) -> None:
        """Under FSDP2 each rank holds rows of each matrix: orthogonalised whole, one by one."""
        for p, update in zip(params, updates, strict=True):
            matrix = update.reshape(p.shape[0], -1)
            shape_scale = max(1.0, matrix.shape[0] / matrix.shape[1]) ** 0.5
            # Under FSDP2 each rank holds rows of the matrix: orthogonalised whole.
            orthogonal = on_whole(orthogonalize, matrix, steps)
            p.sub_(orthogonal.view_as(p) * (lr * shape_scale))


def _check_number(name: str, value: Any, low: float, high: float = math.inf) -> None:
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not low <= value <= high):
        raise ValueError(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}")
