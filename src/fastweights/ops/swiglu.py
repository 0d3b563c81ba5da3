"""SwiGLU's gate that keeps one tensor for its backward: ``h = silu(g) * u`` recomputed from ``[g | u]``.

    gu = [g | u]                 [..., 2F]   (the MLP's one gate-and-up matmul, Shazeer 2020)
    h  = silu(g) * u             [..., F],   silu(g) = g sigmoid(g)
    dL/du = dL/dh silu(g)
    dL/dg = dL/dh u sigmoid(g) (1 + g (1 - sigmoid(g)))

Why: autograd of the plain form keeps ``gu`` (both halves, as views of it) and ``silu(g)`` [..., F] for the
product's backward, and the down projection keeps ``h``. Here only ``gu`` is kept and ``silu(g)`` is recomputed
in the backward (a sigmoid and a few elementwise products, O(F) per token against the MLP's O(F d) matmuls): one
[tokens, F] tensor less per MLP layer, the largest of a Transformer's per-layer activations after the
attention's. fla's ``swiglu`` recomputes the same way. The down projection stays a module of its own (its hooks,
e.g. low-rank dynamic evaluation's, see its input).

:func:`swiglu_reference` is the plain form the tests hold this to, in fp64 and fp32, gradients and second
derivatives included: under ``create_graph`` the backward is written in differentiable ops.
Where :func:`fastweights.ops.recompute.recomputes` says no (no gradient recorded, ``torch.compile``,
``torch.func`` transforms), :func:`swiglu` is the plain form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fastweights.ops.recompute import recomputes


def swiglu_reference(gu: Tensor) -> Tensor:
    """``silu(g) * u`` of ``gu = [g | u]`` ``[..., 2F]`` -> ``[..., F]``, through autograd's own ops."""
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(gu: Tensor) -> Tensor:
        return swiglu_reference(gu)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad_h: Tensor) -> Tensor:
        (gu,) = ctx.saved_tensors
        gate, up = gu.chunk(2, dim=-1)
        if torch.is_grad_enabled():  # create_graph: the module docstring's formulas in differentiable ops
            sig = torch.sigmoid(gate)
            return torch.cat([grad_h * up * sig * (1 + gate * (1 - sig)), grad_h * gate * sig], dim=-1)
        # four passes over [.., F], each half written into the result (no cat): the plain form's backward
        # makes the same products and one cat, and its forward the silu recomputed here
        grad = torch.empty_like(gu)
        grad_gate, grad_up = grad.chunk(2, dim=-1)
        torch.mul(grad_h, F.silu(gate), out=grad_up)
        torch.ops.aten.silu_backward.grad_input(grad_h * up, gate, grad_input=grad_gate)
        return grad


def swiglu(gu: Tensor) -> Tensor:
    """``silu(g) * u`` of ``gu = [g | u]`` ``[..., 2F]`` -> ``[..., F]``, keeping only ``gu`` for the backward
    (module docstring)."""
    return _SwiGLU.apply(gu) if recomputes(gu) else swiglu_reference(gu)
