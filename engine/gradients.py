"""The window's gradient norm and clip, in as few device ops as the reference computes them."""

import torch

# clip_grad_norm_'s guard against a zero norm: the same constant keeps the clip bit-identical.
CLIP_EPS = 1e-6


def norms_and_clip(
    grads: list[torch.Tensor], max_grad_norm: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-gradient norms, global pre-clip norm), both on the device; the gradients are
    scaled in place by ``min(1, max_grad_norm / (norm + 1e-6))`` when ``max_grad_norm`` is set.

    The same ops as ``clip_grad_norm_``/``get_total_norm`` (one ``_foreach_norm``, the norm
    of the stacked norms, one ``_foreach_mul_``), so values are bit-identical when every
    gradient shares one device and dtype (those functions group by both; the norms of
    mixed groups are summed in another order). Nothing is read on the host, and the
    multiply by 1.0 of an unclipped window costs less than deciding on the host would.
    """
    per_gradient = torch.stack(torch._foreach_norm(grads))
    norm = torch.linalg.vector_norm(per_gradient)
    if max_grad_norm is not None:
        # max / (norm + eps) is reciprocal-then-multiply in torch; the in-place chain keeps
        # that order and allocates one tensor instead of three.
        coef = (norm + CLIP_EPS).reciprocal_().mul_(max_grad_norm).clamp_(max=1.0)
        torch._foreach_mul_(grads, coef)
    return per_gradient, norm
