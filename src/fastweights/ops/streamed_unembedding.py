"""The unembedding ``y E + c`` over a large vocabulary without autograd, and the gradient of the
cross-entropy through it without the ``[M, V]`` logits (an online softmax over slices of E).

M. Milakov, N. Gimelshein, "Online normalizer calculation for softmax", arXiv 1805.02867 (2018): a softmax
over slices j of the vocabulary keeps a running max m and sum l,

    m' = max(m, max L_j),   l' = l exp(m - m') + sum exp(L_j - m'),       L_j = y E_j + c_j

and here also ``acc' = acc exp(m - m') + exp(L_j - m') E_j^T``, so that at the end

    E (softmax(y E + c) - onehot(label)) = acc / l - E[:, label]        (per row, [s])

Each slice of E (``[s, vocab_chunk]``) serves both of its products while it is in cache, so E is read from
memory once, not twice, and no ``[M, V]`` tensor is allocated. Used by the FWL's no-grad scoring
(:func:`fastweights.ops.fwl.scoring_upstream`); the differentiable path is :func:`fastweights.ops.fwl.upstream_grads`.

The products go through :func:`fastweights.ops.linear.linear`: each on the faster of torch's (MKL's) and oneDNN's
fp32 GEMM on the machine that runs it (on an AMD EPYC core oneDNN's, about 175 GFLOP/s for SmolLM2's
64 x 576 x 49,152 against MKL's 85; on an Intel Xeon the two are level). Same fp32 arithmetic, another summation
order: the results agree to rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fastweights.ops.linear import call_kernels, linear

#: vocabulary columns per slice (576 x 1,024 fp32 = 2.4 MB of SmolLM2's E): on one thread 512 to 2,048 measured
#: about equal for the gradient (MKL and oneDNN), 4,096 and 8,192 slower
VOCAB_CHUNK = 1024


@torch.no_grad()
def unembedding_grad_streamed(y: Tensor, E: Tensor, c: Tensor, labels: Tensor, scale: Tensor,
                              vocab_chunk: int = VOCAB_CHUNK) -> Tensor:
    """``g3 = scale * E (softmax(y E + c) - onehot(label))`` without the ``[M, V]`` logits (no autograd).

    The same value as :func:`fastweights.ops.fwl.upstream_grads`'s g3 (to rounding), computed over slices of ``vocab_chunk``
    columns of E with an online softmax: per slice j, logits ``L_j = y E_j + c_j``, running max ``m``,
    ``l <- l exp(m_old - m) + sum exp(L_j - m)``, ``acc <- acc exp(m_old - m) + exp(L_j - m) E_j^T``; at the
    end ``g3 = scale (acc / l - E[:, label]^T)``. Each slice of E serves both products while it is in
    cache, and only ``[M, vocab_chunk]`` floats are ever allocated.

    Args:
        y: ``[M, s]`` unembedding inputs; E: ``[s, V]``; c: ``[V]``; labels: ``[M]``; scale: ``[M]``
            (w / Z of each row).
    """
    m_rows, vocab = y.shape[0], E.shape[1]
    run_max = y.new_full((m_rows, 1), float("-inf"))
    run_sum = y.new_zeros(m_rows, 1)
    acc = y.new_zeros(m_rows, E.shape[0])  # [M, s]
    for lo in range(0, vocab, vocab_chunk):
        e_slice = E[:, lo : lo + vocab_chunk]  # [s, C]
        logits = linear(y, e_slice.T, c[lo : lo + vocab_chunk])  # [M, C]
        new_max = torch.maximum(run_max, logits.amax(-1, keepdim=True))
        logits.sub_(new_max).exp_()
        rescale = torch.exp(run_max - new_max)  # 0 at the first slice (exp(-inf))
        run_sum = run_sum * rescale + logits.sum(-1, keepdim=True)
        acc = acc.mul_(rescale).add_(linear(logits, e_slice))  # + exp(L_j - m) E_j^T
        run_max = new_max
    return (acc / run_sum - E[:, labels].T) * scale.unsqueeze(-1)  # [M, s]


@torch.no_grad()
def unembedding_no_grad(y: Tensor, E: Tensor, c: Tensor, vocab_chunk: int = VOCAB_CHUNK) -> Tensor:
    """``y E + c`` (``y [M, s]`` -> ``[M, V]``, no autograd): one oneDNN GEMM where :func:`fastweights.ops.linear.linear`
    chooses oneDNN for it; otherwise written ``vocab_chunk`` columns at a time, so that a slice of the output stays in
    cache while it is written (with MKL, 43 against 47 ms for SmolLM2's 64 x 576 x 49,152 on one thread)."""
    if (call_kernels(y, E.T, c) or ["torch"])[0] != "torch":
        return linear(y, E.T, c)
    out = y.new_empty(y.shape[0], E.shape[1])
    for lo in range(0, E.shape[1], vocab_chunk):
        torch.addmm(c[lo : lo + vocab_chunk], y, E[:, lo : lo + vocab_chunk], out=out[:, lo : lo + vocab_chunk])
    return out
