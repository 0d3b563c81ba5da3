"""The gated delta rule's output norm and gate, keeping its two inputs for the backward (Yang et al. 2024, "Gated
Delta Networks", the output block of Fig. 1; fla's ``FusedRMSNormGated``):

    r = 1 / sqrt(mean_v o_v^2 + eps)          o, g [..., V]; r [..., 1]
    n = o r
    y = n w silu(g)                           w [V]
    dL/dg = dL/dy n w silu'(g)
    dL/dw = sum_{...} dL/dy n silu(g)
    dL/dn = dL/dy w silu(g)
    dL/do = r (dL/dn - n mean_v(dL/dn n))

Why: autograd of the plain form keeps o, n, n w, g and silu(g), five [..., V] tensors per layer; here only o and g
are kept, and r, n and silu(g) are recomputed in the backward (elementwise, O(V) per token against the layer's
O(V d) projections). fla fuses the same norm and gate and keeps the same two inputs.

:func:`gated_rms_norm_reference` is the plain form the tests hold this to in fp64 and fp32, gradients and second
derivatives included (the backward is written in differentiable ops). Where
:func:`fastweights.ops.recompute.recomputes` says no, :func:`gated_rms_norm` is the plain form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fastweights.ops.recompute import recomputes


def gated_rms_norm_reference(o: Tensor, g: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``o / rms(o) * weight * silu(g)`` over the last axis (``o``, ``g`` [..., V], ``weight`` [V]), through
    autograd's own ops."""
    return o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * weight * F.silu(g)


class _GatedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(o: Tensor, g: Tensor, weight: Tensor, eps: float) -> Tensor:
        return gated_rms_norm_reference(o, g, weight, eps)

    @staticmethod
    def setup_context(ctx, inputs, output):
        o, g, weight, eps = inputs
        ctx.save_for_backward(o, g, weight)
        ctx.eps = eps

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        o, g, weight = ctx.saved_tensors
        need_o, need_g, need_w, _ = ctx.needs_input_grad
        r = torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + ctx.eps)
        n = o * r
        gate = F.silu(g)
        grad_nw = grad_y * gate  # dL/d(n w)
        grad_g = grad_w = grad_o = None
        if need_g:
            if torch.is_grad_enabled():  # create_graph: silu' in differentiable ops (silu_backward has none)
                sig = torch.sigmoid(g)
                grad_g = grad_y * (n * weight) * (sig * (1 + g * (1 - sig)))
            else:
                grad_g = torch.ops.aten.silu_backward(grad_y * (n * weight), g)
        if need_w:
            grad_w = (grad_nw * n).flatten(0, -2).sum(0)
        if need_o:
            grad_n = grad_nw * weight
            grad_o = r * (grad_n - n * (grad_n * n).mean(-1, keepdim=True))
        return grad_o, grad_g, grad_w, None


def gated_rms_norm(o: Tensor, g: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``o / rms(o) * weight * silu(g)`` (``o``, ``g`` [..., V], ``weight`` [V]), keeping only ``o`` and ``g`` for
    the backward (module docstring)."""
    if recomputes(o, g, weight):
        return _GatedRMSNorm.apply(o, g, weight, eps)
    return gated_rms_norm_reference(o, g, weight, eps)
