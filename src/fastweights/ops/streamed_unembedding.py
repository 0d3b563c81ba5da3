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

The products go through :func:`cpu_linear`: on an x86 CPU in fp32, oneDNN's GEMM, not torch's (MKL's). On an
AMD EPYC core (AVX-512) MKL's fp32 GEMM runs its AVX2 path, about 85 GFLOP/s for SmolLM2's 64 x 576 x 49,152,
where oneDNN's reaches about 175 (one thread; ``benchmarks/speed/fwl_scoring.py`` records both on the machine
it runs on). Same fp32 arithmetic, another summation order: the results agree to rounding.
"""

from __future__ import annotations

import platform

import torch
from torch import Tensor

#: vocabulary columns per slice (576 x 1,024 fp32 = 2.4 MB of SmolLM2's E): on one thread 512 to 2,048 measured
#: about equal for the gradient (MKL and oneDNN), 4,096 and 8,192 slower
VOCAB_CHUNK = 1024


def _onednn_linear():
    """oneDNN's linear on dense tensors (``torch.ops.mkldnn._linear_pointwise``, the op torch's compiler emits
    for CPU linears), or None where this torch build or machine has none (not x86, no oneDNN) or where the op,
    a private one, no longer gives ``F.linear``'s numbers for a small strided call (another signature or meaning)."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not torch.backends.mkldnn.is_available():
        return None
    try:
        op = torch.ops.mkldnn._linear_pointwise.default
        x, w, b = torch.linspace(-1, 1, 12).view(3, 4), torch.linspace(1, -2, 20).view(4, 5).T, torch.arange(5.0)
        with torch.no_grad():
            ok = torch.allclose(op(x, w, b, "none", [], ""), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    except (AttributeError, RuntimeError, TypeError):
        return None
    return op if ok else None


ONEDNN_LINEAR = _onednn_linear()


def cpu_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x weight^T + bias`` (``x [M, K]``, ``weight [N, K]``, any strides, ``bias [N]`` or None -> ``[M, N]``):
    oneDNN's GEMM for fp32 CPU tensors where it exists, ``torch.backends.mkldnn`` is enabled and no gradient is
    wanted (the op has no autograd formula: backward through it would silently give none);
    ``torch.nn.functional.linear`` otherwise (autograd, other dtypes, devices and machines)."""
    wants_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    if not wants_grad and _onednn_serves(x, weight):
        return ONEDNN_LINEAR(x, weight, bias, "none", [], "")
    return torch.nn.functional.linear(x, weight, bias)


def _onednn_serves(*tensors: Tensor) -> bool:
    return (ONEDNN_LINEAR is not None and torch.backends.mkldnn.enabled
            and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors))


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
        logits = cpu_linear(y, e_slice.T, c[lo : lo + vocab_chunk])  # [M, C]
        new_max = torch.maximum(run_max, logits.amax(-1, keepdim=True))
        logits.sub_(new_max).exp_()
        rescale = torch.exp(run_max - new_max)  # 0 at the first slice (exp(-inf))
        run_sum = run_sum * rescale + logits.sum(-1, keepdim=True)
        acc = acc.mul_(rescale).add_(cpu_linear(logits, e_slice))  # + exp(L_j - m) E_j^T
        run_max = new_max
    return (acc / run_sum - E[:, labels].T) * scale.unsqueeze(-1)  # [M, s]


@torch.no_grad()
def unembedding_no_grad(y: Tensor, E: Tensor, c: Tensor, vocab_chunk: int = VOCAB_CHUNK) -> Tensor:
    """``y E + c`` (``y [M, s]`` -> ``[M, V]``, no autograd): one oneDNN GEMM where :func:`cpu_linear` takes
    that route; otherwise written ``vocab_chunk`` columns at a time, so that a slice of the output stays in
    cache while it is written (with MKL, 43 against 47 ms for SmolLM2's 64 x 576 x 49,152 on one thread)."""
    if _onednn_serves(y, E, c):
        return cpu_linear(y, E.T, c)
    out = y.new_empty(y.shape[0], E.shape[1])
    for lo in range(0, E.shape[1], vocab_chunk):
        torch.addmm(c[lo : lo + vocab_chunk], y, E[:, lo : lo + vocab_chunk], out=out[:, lo : lo + vocab_chunk])
    return out
