"""The language-model loss without the [N, V] logits: output layer and cross-entropy fused, a chunk of rows at a time.

    logits_n = h_n W^T                          h [N, d], W [V, d]
    loss     = 1/|S| sum_{n in S} (logsumexp(logits_n) - logits_n[y_n])      S: the rows whose target is not ignored
    dL/dlogits_n = (softmax(logits_n) - onehot(y_n)) / |S|   (0 for ignored rows)
    dL/dh_n  = dL/dlogits_n W,      dL/dW = sum_n dL/dlogits_n^T h_n

Why: the plain form (``F.cross_entropy(F.linear(h, W))``) keeps the logits, their fp32 copy, the saved
log-softmax and the logits' gradient, each [N, V], alive at once. At a 32k vocabulary and 32,768 tokens per step
(the GPU queue's hybrid, issue 51) one fp32 copy is 4.3 GB, and fla's model, whose loss is a fused linear
cross-entropy, peaked at half our memory. Here the forward computes, for :data:`CHUNK_ELEMENTS` logits at a time,
the chunk's loss and both gradients at once (the fused form of Liger-Kernel and fla), and keeps only dL/dh [N, d]
and dL/dW [V, d] for the backward, which scales them by the incoming gradient. Its two gradient products run
on the kernels ``ops.linear`` measured fastest on the machine (``linear_grads``), as the plain form's backward
does. Peak memory above the plain form's inputs: two [chunk, V] fp32 blocks, dL/dh and dL/dW.

Numbers: the logits are computed as the plain form computes them (``ops.linear.linear``; under autocast in its
dtype) and upcast as :func:`fastweights.ops.nll.upcast_logits` does (fp32, or fp64 for fp64 inputs); dL/dW is
accumulated in that dtype. :func:`linear_cross_entropy_reference` is the plain form, the slow reference the tests
hold this to. The backward is not differentiable again (``create_graph`` through it raises): second-order
training (the FWL head's) keeps the plain form. Without gradients (``torch.no_grad``, or neither input requiring
one) only the loss is computed, in chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from fastweights.ops.linear import linear, linear_grads
from fastweights.ops.nll import upcast_logits

CHUNK_ELEMENTS = 1 << 23  # logits per chunk: 8M, 32 MB in fp32 (a 32k vocabulary: 256 rows)


def linear_cross_entropy_reference(h: Tensor, w: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """The plain form: ``F.cross_entropy`` of the upcast logits ``h W^T`` (h [N, d], w [V, d], targets [N])."""
    return F.cross_entropy(upcast_logits(linear(h, w)), targets, ignore_index=ignore_index)


def _chunk_rows(vocab: int, chunk_elements: int) -> int:
    return max(1, chunk_elements // max(1, vocab))


def _chunk_loss_and_grad(hc: Tensor, w: Tensor, yc: Tensor, ignore_index: int, count: Tensor | None):
    """One chunk: (summed loss over its counted rows, dL/dlogits [c, V] of the mean over ``count`` rows; None
    without ``count``)."""
    logits = upcast_logits(linear(hc, w))  # [c, V]
    counted = yc != ignore_index
    safe = torch.where(counted, yc, 0)
    lse = torch.logsumexp(logits, dim=-1)  # [c]
    picked = logits.gather(-1, safe[:, None])[:, 0]
    loss = torch.where(counted, lse - picked, 0).sum()
    if count is None:
        return loss, None
    grad = torch.exp(logits.sub_(lse[:, None]))  # softmax, in place of the logits
    grad.scatter_add_(-1, safe[:, None], -torch.ones_like(lse)[:, None])
    grad.mul_((counted.to(grad.dtype) / count.to(grad.dtype))[:, None])
    return loss, grad


def _fused(h: Tensor, w: Tensor, targets: Tensor, ignore_index: int, chunk_elements: int, need_h: bool,
           need_w: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(mean loss, dL/dh or None, dL/dW in the loss dtype or None), a chunk of rows at a time; the gradients'
    products on the kernels ``ops.linear`` chose for this machine."""
    count = (targets != ignore_index).sum()
    rows = _chunk_rows(w.shape[0], chunk_elements)
    total = h.new_zeros((), dtype=upcast_logits(h[:0, :0]).dtype)
    dh = torch.empty_like(h) if need_h else None
    dw = None
    for a in range(0, h.shape[0], rows):
        b = min(a + rows, h.shape[0])
        loss, grad = _chunk_loss_and_grad(h[a:b], w, targets[a:b], ignore_index, count if need_h or need_w else None)
        total = total + loss
        if need_h:  # in h's dtype, as the plain form's backward (under autocast: bf16)
            dh[a:b] = linear_grads(h[a:b], w.to(h.dtype), grad.to(h.dtype), need_w=False)[0]
        if need_w:  # accumulated in the loss dtype
            part = linear_grads(h[a:b].to(grad.dtype), w.to(grad.dtype), grad, need_x=False)[1]
            dw = part if dw is None else dw.add_(part)
    return total / count, dh, dw  # count 0: nan, as F.cross_entropy gives


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, w: Tensor, targets: Tensor, ignore_index: int, chunk_elements: int) -> Tensor:
        loss, dh, dw = _fused(h, w, targets, ignore_index, chunk_elements, *ctx.needs_input_grad[:2])
        ctx.save_for_backward(dh, None if dw is None else dw.to(w.dtype))
        ctx.w_shape = w.shape
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: Tensor):
        dh, dw = ctx.saved_tensors
        gh = dh * grad_loss.to(dh.dtype) if dh is not None else None
        if ctx.needs_input_grad[1]:
            gw = dw * grad_loss.to(dw.dtype) if dw is not None else grad_loss.new_zeros(ctx.w_shape)
        else:
            gw = None
        return gh, gw, None, None, None


def linear_cross_entropy(h: Tensor, w: Tensor, targets: Tensor, ignore_index: int = -100,
                         chunk_elements: int = CHUNK_ELEMENTS) -> Tensor:
    """Mean cross-entropy (nats) of the logits ``h W^T`` against ``targets``, the [N, V] logits never kept.

    h: [N, d] (or [..., d], flattened with targets [...]); w: [V, d]; targets: int64, ``ignore_index`` rows not
    counted. Equal to :func:`linear_cross_entropy_reference` in value and gradients (the tests: fp64 to 1e-12,
    fp32 to its rounding)."""
    h2, t2 = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    if h2.shape[0] != t2.shape[0]:
        raise ValueError(f"{h2.shape[0]} rows of h but {t2.shape[0]} targets")
    if torch.is_grad_enabled() and (h.requires_grad or w.requires_grad):
        return _LinearCrossEntropy.apply(h2, w, t2, ignore_index, chunk_elements)
    with torch.no_grad():
        return _fused(h2, w, t2, ignore_index, chunk_elements, False, False)[0]
