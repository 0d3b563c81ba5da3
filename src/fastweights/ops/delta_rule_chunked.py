"""The chunkwise (gated) delta rule of :mod:`fastweights.ops.delta_rule`, laid out and ordered for eager PyTorch.

Same equations as :mod:`fastweights.ops.delta_rule` (Yang et al. 2024, "Parallelizing Linear Transformers with
the Delta Rule over Sequence Length", arXiv 2406.06484; gated: Yang, Kautz, Hatamizadeh 2025, arXiv 2412.06464).
Per chunk of C tokens with S the state entering it, gamma = cumsum(g), b = exp(gamma),
Gamma_ij = exp(gamma_i - gamma_j) (i >= j, else 0), M lower-triangular including the diagonal:

    A = diag(beta) (K K^T * Gamma),   L = I + strictly_lower(A),   U = L^{-1} diag(beta) V,
    W = L^{-1} diag(beta b) K,        U~ = U - W S,
    O = diag(b) Q S + (Q K^T * Gamma * M) U~,       S_next = b_C S + (diag(b_C / b) K)^T U~

This module computes exactly that (``backend="torch"``); :mod:`fastweights.ops.delta_rule` keeps the functional
form that ``torch.compile`` traces (``backend="compiled"``). The two differ only in how the work is laid out,
which on one CPU thread is most of the time (T=2048, B=1, H=4, D=64, fp32, forward+backward, measured with
``benchmarks/speed/bench_delta_rule.py``):

* Chunk-major layout ``[N, B*H, C, D]``, contiguous, made by one copy per input (the input layout
  ``[B, T, H, D]`` chunked as ``[B, H, N, C, D]`` is a strided view, and every batched matmul on it copied
  it again: q, k and d_o several times each). Each chunk ``x[i]`` is then contiguous, so the scans over
  chunks write states and pseudo-values in place (``out=``, ``baddbmm_``) instead of stacking lists.
* The state buffer ``[N + 1, B*H, K, V]`` holds the initial state, every chunk's entering state and the final
  state; the backward scan likewise turns Q_b^T dO (one batched matmul) into dS chunk by chunk in place.
* The backward needs fewer products, by identities of the forward (dX = [dU, dW] the gradient of
  X = [U, W] = L^{-1} R, dU = dU~ and dW = -dU~ S^T; dR = L^{-T} dX):

      dR_V = L^{-T} dU~,   dR_K = -dR_V S^T,   dA = -strictly_lower(dR X^T) = -strictly_lower(dR_V U~^T)

  (dR X^T = dR_V U^T - dR_V S^T W^T = dR_V (U - W S)^T), so U is never kept (its buffer becomes U~) and
  dA costs one C x V x C product, not C x (V+K) x C. With dA_g = dA * Gamma and Z = b * dR_K + dA_g K:

      dbeta = <dR_V, V> + <Z, K>   (row-wise),      dK (from A and R) = beta * Z + dA_g^T diag(beta) K

  which needs neither K K^T (recomputed only for the gated dgamma) nor the symmetrised dA + dA^T.
* Products run in place into their consumers (``baddbmm_``) and sign flips ride on the next operation.

Saved for backward: the chunk-major q (scaled), k, v, beta, log decay, the states (N + 1 of them), L^{-1},
W and U~: T * (4D + C + 2) + (T/C + 1) K V numbers per head, less than the functional form's.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from fastweights.ops.linear_attention import causal_mask, compute_dtype, decay_terms

__all__ = ["delta_rule_chunk_major"]


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-1, -2)


def _to_chunk_major(x: torch.Tensor, chunk: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``[B, T, H, D] -> [N, B*H, C, D]`` contiguous in ``dtype``, N = ceil(T / C), the tail zero-padded
    (q = k = v = 0 and beta = g = 0 there: padding writes nothing and decays nothing). One copy."""
    b, t, h, d = x.shape
    n, full = math.ceil(t / chunk), t // chunk
    out = (x.new_zeros if n != full else x.new_empty)(n, b, h, chunk, d, dtype=dtype)
    if full:
        out[:full].copy_(x[:, : full * chunk].view(b, full, chunk, h, d).permute(1, 0, 3, 2, 4))
    if n != full:
        out[full, :, :, : t - full * chunk].copy_(x[:, full * chunk:].permute(0, 2, 1, 3))
    if scale != 1.0:
        out.mul_(scale)
    return out.view(n, b * h, chunk, d)


def _from_chunk_major(x: torch.Tensor, b: int, h: int, t: int, dtype: torch.dtype) -> torch.Tensor:
    """``[N, B*H, C, D] -> [B, T, H, D]`` contiguous in ``dtype``, the padded tail dropped. One copy."""
    n, _, c, d = x.shape
    out = x.new_empty(b, t, h, d, dtype=dtype)
    full = t // c
    x = x.view(n, b, h, c, d)
    if full:
        out[:, : full * c].view(b, full, c, h, d).copy_(x[:full].permute(1, 0, 3, 2, 4))
    if n != full:
        out[:, full * c:].copy_(x[full, :, :, : t - full * c].permute(0, 2, 1, 3))
    return out


def _scalars_to(x: torch.Tensor, chunk: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, T, H] -> [N, B*H, C]``."""
    return _to_chunk_major(x.unsqueeze(-1), chunk, dtype).squeeze(-1)


def _scalars_from(x: torch.Tensor, b: int, h: int, t: int, dtype: torch.dtype) -> torch.Tensor:
    """``[N, B*H, C] -> [B, T, H]``."""
    return _from_chunk_major(x.unsqueeze(-1), b, h, t, dtype).squeeze(-1)


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise dot product over the last dimension."""
    return (a * b).sum(-1)


def _bmm_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """``out += alpha * a @ b`` over all chunks at once, in place (``[N, BH, ...]`` flattened to 3-D)."""
    return out.flatten(0, 1).baddbmm_(a.flatten(0, 1), b.flatten(0, 1), alpha=alpha).view(out.shape)


def _forward(q, k, v, beta, g, s0):
    """Chunk-major forward. ``q`` (scaled), ``k [N, BH, C, K]``, ``v [N, BH, C, V]``, ``beta``, ``g [N, BH, C]``
    (``g`` None: ungated), ``s0 [BH, K, V]``. Returns ``o [N, BH, C, V]``, the states ``[N + 1, BH, K, V]``
    (entering each chunk, then the final one), ``L^{-1} [N, BH, C, C]``, ``W [N, BH, C, K]``, ``U~ [N, BH, C, V]``."""
    n, bh, c, dk = k.shape
    bt = beta.unsqueeze(-1)
    kb = k * bt
    a = kb @ _t(k)  # only its strict lower triangle is read by the solve
    p = q @ _t(k)
    if g is None:
        p.mul_(causal_mask(c, q.device, q.dtype))  # the read sees the same step's write: diagonal kept
        qb, kd, b_last, rk = q, k, None, kb
    else:
        gamma_mat, b_in, b_last, to_end = decay_terms(g)
        a.mul_(gamma_mat)
        p.mul_(gamma_mat)  # zero above the diagonal
        rk = kb * b_in.unsqueeze(-1)
        qb = q * b_in.unsqueeze(-1)
        kd = k * to_end.unsqueeze(-1)
    # L^{-1} by one unit-triangular solve against the identity: the backward applies L^{-T} as a matmul,
    # several times faster on CPU than a second solve.
    eye = torch.eye(c, dtype=k.dtype, device=k.device)
    l_inv = torch.linalg.solve_triangular(a, eye.expand_as(a), upper=False, unitriangular=True)
    pseudo = l_inv @ (v * bt)  # U, turned into U~ = U - W S chunk by chunk below
    w = l_inv @ rk
    states = k.new_empty(n + 1, bh, dk, v.shape[-1])
    states[0] = s0
    for i in range(n):
        s = states[i]
        pseudo[i].baddbmm_(w[i], s, alpha=-1)
        decayed = s if b_last is None else b_last[i, :, None, None] * s
        torch.baddbmm(decayed, _t(kd[i]), pseudo[i], out=states[i + 1])  # S_next = b_C S + Kd^T U~
    o = _bmm_(qb @ states[:n], p, pseudo)  # O = Qb S + P U~
    return o, states, l_inv, w, pseudo


def _backward(q, k, v, beta, g, states, l_inv, w, pseudo, d_o, d_final, need_dg):
    """Chunk-major backward (module docstring), inputs as :func:`_forward`'s plus ``d_o [N, BH, C, V]`` and
    ``d_final [BH, K, V]`` (either None: zero). Returns dq (w.r.t. the scaled q), dk, dv, dbeta, dg (None
    ungated or unless ``need_dg``) and the gradient of the initial state."""
    n, c = k.shape[0], k.shape[2]
    gated = g is not None
    bt = beta.unsqueeze(-1)
    starts = states[:n]
    if gated:
        gamma_mat, b_in, b_last, to_end = decay_terms(g)
        qb, kd = q * b_in.unsqueeze(-1), k * to_end.unsqueeze(-1)
        p_mask = gamma_mat
    else:
        qb, kd, b_last = q, k, None
        p_mask = causal_mask(c, q.device, q.dtype)
    # ds[i]: gradient of the state entering chunk i; ds[N] of the final state. Starts as Qb^T dO (the reads'
    # share) and becomes dS in the reverse scan: dS = Qb^T dO + b_C dS_next - W^T dU~.
    ds = torch.empty_like(states)
    if d_o is not None:
        p = (q @ _t(k)).mul_(p_mask)
        d_pseudo = _t(p) @ d_o  # dU~ = P^T dO + Kd dS_next, the second term added in the scan
        torch.matmul(_t(qb), d_o, out=ds[:n])
    else:
        d_pseudo = torch.zeros_like(pseudo)
        ds[:n].zero_()
    if d_final is None:
        ds[n].zero_()
    else:
        ds[n] = d_final
    for i in reversed(range(n)):
        d_next = ds[i + 1]
        d_pseudo[i].baddbmm_(kd[i], d_next)
        ds[i].add_(d_next if b_last is None else b_last[i, :, None, None] * d_next)
        ds[i].baddbmm_(_t(w[i]), d_pseudo[i], alpha=-1)
    d_next = ds[1:]
    d_kd = pseudo @ _t(d_next)
    d_rv = _t(l_inv) @ d_pseudo
    neg_da = (d_rv @ _t(pseudo)).mul_(causal_mask(c, k.device, k.dtype, strict=True))  # -dA
    if gated:
        neg_da.mul_(gamma_mat)  # -dA_g
    neg_drk = d_rv @ _t(starts)  # -dR_K
    neg_z = neg_da @ k  # -Z = -(b dR_K + dA_g K)
    if gated:
        neg_z.addcmul_(neg_drk, b_in.unsqueeze(-1))
    else:
        neg_z.add_(neg_drk)
    d_beta = _rowdot(d_rv, v).sub_(_rowdot(neg_z, k))
    d_k = neg_z.mul_(bt).neg_()  # beta Z
    _bmm_(d_k, _t(neg_da), k * bt, alpha=-1)  # + dA_g^T diag(beta) K
    if gated:
        d_k.addcmul_(d_kd, to_end.unsqueeze(-1))  # Kd = diag(b_C / b) K
    else:
        d_k.add_(d_kd)
    d_q = d_p = None
    if d_o is not None:
        d_p = d_o @ _t(pseudo)
        d_q = d_o @ _t(starts)  # dQb
    d_g = None
    if gated and need_dg:
        # gradient w.r.t. the within-chunk cumulative log decay gamma, then through the cumsum
        kk = (k @ _t(k)).mul_(neg_da).mul_(bt)  # -beta dA_g * K K^T (A's share of dGamma * Gamma)
        d_diff = kk.neg_() if d_p is None else kk.neg_().addcmul_(d_p, p)  # d(Gamma) * Gamma
        d_b = _rowdot(neg_drk, k).mul_(beta).neg_()  # from R_K = diag(beta b) K
        if d_q is not None:
            d_b.add_(_rowdot(d_q, q))  # from Qb
        d_gamma = d_diff.sum(-1) - d_diff.sum(-2) + d_b * b_in
        d_to_end = _rowdot(d_kd, k) * to_end  # to_end = exp(gamma_C - gamma_t)
        d_gamma.sub_(d_to_end)
        d_last = d_to_end.sum(-1) + (starts * d_next).sum((-1, -2)) * b_last  # b_last = exp(gamma_C)
        d_gamma[..., -1] += d_last
        d_g = d_gamma.flip(-1).cumsum(-1).flip(-1)  # gamma = cumsum(g)
    if d_o is not None:
        d_qk = d_p.mul_(p_mask)
        if gated:
            d_q.mul_(b_in.unsqueeze(-1))
        _bmm_(d_q, d_qk, k)
        _bmm_(d_k, _t(d_qk), q)
    return d_q, d_k, d_rv.mul_(bt), d_beta, d_g, ds[0]


class _DeltaRuleChunkMajor(torch.autograd.Function):
    """Takes and returns the op's layout (``[B, T, H, D]``); chunk-major inside. Forward: ``(o [B, T, H, V]`` in
    the compute dtype, ``final state [B, H, K, V])``; backward: gradients in the inputs' dtypes."""

    @staticmethod
    def forward(ctx, q, k, v, beta, log_decay, s0, scale, chunk):
        cd = compute_dtype(q)
        b, t, h, dk = q.shape
        dv = v.shape[-1]
        qc = _to_chunk_major(q, chunk, cd, scale)
        kc, vc = _to_chunk_major(k, chunk, cd), _to_chunk_major(v, chunk, cd)
        bc = _scalars_to(beta, chunk, cd)
        gc = None if log_decay is None else _scalars_to(log_decay, chunk, cd)
        s = q.new_zeros(b * h, dk, dv, dtype=cd) if s0 is None else s0.to(cd).reshape(b * h, dk, dv)
        o, states, l_inv, w, pseudo = _forward(qc, kc, vc, bc, gc, s)
        ctx.save_for_backward(qc, kc, vc, bc, gc, states, l_inv, w, pseudo)
        ctx.meta = (b, h, t, scale, [x.dtype for x in (q, k, v, beta)], None if log_decay is None else log_decay.dtype,
                    None if s0 is None else s0.dtype)
        ctx.set_materialize_grads(False)  # an unused output (often o or the final state) gets None: skip its work
        # the final state is cloned: a caller changing it in place must not change the saved states
        return _from_chunk_major(o, b, h, t, cd), states[-1].clone().view(b, h, dk, dv)

    @staticmethod
    @once_differentiable
    def backward(ctx, d_o, d_final):
        qc, kc, vc, bc, gc, states, l_inv, w, pseudo = ctx.saved_tensors
        b, h, t, scale, dtypes, g_dtype, s0_dtype = ctx.meta
        if d_o is None and d_final is None:
            return (None,) * 8
        c, cd = qc.shape[-2], qc.dtype
        doc = None if d_o is None else _to_chunk_major(d_o, c, cd)
        dfin = None if d_final is None else d_final.to(cd).reshape(states.shape[1:])
        needs = ctx.needs_input_grad
        d_q, d_k, d_v, d_beta, d_g, d_s0 = _backward(qc, kc, vc, bc, gc, states, l_inv, w, pseudo, doc, dfin,
                                                     need_dg=needs[4])
        grads = [None if d_q is None else _from_chunk_major(d_q.mul_(scale), b, h, t, dtypes[0]),
                 _from_chunk_major(d_k, b, h, t, dtypes[1]), _from_chunk_major(d_v, b, h, t, dtypes[2]),
                 _scalars_from(d_beta, b, h, t, dtypes[3]),
                 None if d_g is None else _scalars_from(d_g, b, h, t, g_dtype),
                 None if s0_dtype is None else d_s0.view(b, h, *d_s0.shape[1:]).to(s0_dtype)]
        return (*(x if need else None for x, need in zip(grads, needs[:6])), None, None)


def delta_rule_chunk_major(q, k, v, beta, scale: float, initial_state, log_decay, chunk: int):
    """The chunkwise (gated) delta rule, ``q, k [B, T, H, K]``, ``v [B, T, H, V]``, ``beta``/``log_decay``
    ``[B, T, H]``, ``initial_state [B, H, K, V]`` or None, chunk length ``chunk`` (1 <= chunk <= T, T >= 1).
    Returns ``o [B, T, H, V]`` and the final state ``[B, H, K, V]``, both in the compute dtype (fp32; fp64 for
    fp64 inputs). Autocast must be off (the caller's job, as in :func:`fastweights.ops.delta_rule.delta_rule`)."""
    return _DeltaRuleChunkMajor.apply(q, k, v, beta, log_decay, initial_state, scale, chunk)
