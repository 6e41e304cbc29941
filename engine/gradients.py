"""The window's gradient norm and clip, with the ops and rounding of ``clip_grad_norm_``."""

import numpy as np
import torch

# clip_grad_norm_'s guard against a zero norm: the same constant keeps the clip bit-identical.
CLIP_EPS = 1e-6
# A norm below this fraction of max_grad_norm is never clipped: float32 rounding cannot get
# its coefficient below 1.
NEVER_CLIPPED_BELOW = 1 - 1e-3


def gradient_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """One norm per gradient, stacked: ``get_total_norm``'s first two ops. Its global norm is
    ``vector_norm`` of these, bit-identical when every gradient shares one device and dtype
    (it groups by both; mixed groups are summed in another order)."""
    return torch.stack(torch._foreach_norm(grads))


def clip_on_device(grads: list[torch.Tensor], norm: torch.Tensor, max_grad_norm: float) -> None:
    """Scale ``grads`` by ``min(1, max_grad_norm / (norm + 1e-6))`` without reading the norm:
    an unclipped window is multiplied by exactly 1.0."""
    # max / (norm + eps) is reciprocal-then-multiply in torch; the in-place chain keeps that
    # order and allocates one tensor instead of three.
    coef = (norm + CLIP_EPS).reciprocal_().mul_(max_grad_norm).clamp_(max=1.0)
    torch._foreach_mul_(grads, coef)


def host_clip_coefficient(norm: float, max_grad_norm: float) -> float:
    """``clip_on_device``'s coefficient from a float32 norm read on the host, in float32
    arithmetic as torch's ops round it, so a multiply by it is bit-identical."""
    if norm < NEVER_CLIPPED_BELOW * max_grad_norm:
        return 1.0
    one, norm32 = np.float32(1.0), np.float32(norm)
    coef = np.float32(max_grad_norm) * (one / (norm32 + np.float32(CLIP_EPS)))
    return float(min(coef, one))
