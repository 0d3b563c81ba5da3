"""The delta rule fast weight programmer and its gated form (Gated DeltaNet), chunkwise and fast.

Schlag, Irie, Schmidhuber 2021, "Linear Transformers Are Secretly Fast Weight Programmers"
(arXiv 2102.11174), eq. 24: the fast weight W in R^{V x K} retrieves the value currently stored under
key k, v_bar = W k, and replaces it by an interpolation with the new value:

    W_t = W_{t-1} + beta_t (v_t - W_{t-1} k_t) k_t^T

With the project state layout S = W^T in R^{K x V} per head ([B, H, K, V], as flash-linear-attention)
and an optional per-step decay a_t = exp(g_t) in (0, 1] (Yang, Kautz, Hatamizadeh 2025, "Gated Delta
Networks", arXiv 2412.06464):

    S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,      o_t = scale * S_t^T q_t

The read comes after the same step's write. ``delta_rule_recurrent`` is this loop, verbatim.

Chunkwise WY / UT form (Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule
over Sequence Length", arXiv 2406.06484). In a chunk of C tokens (rows Q, K, V; S the state entering
the chunk; gamma = cumsum of g in the chunk, b_t = exp(gamma_t), Gamma_ij = exp(gamma_i - gamma_j)
for i >= j; M lower-triangular including the diagonal):

    T = (I + tril(diag(beta) (Gamma * K K^T), -1))^{-1} diag(beta)     (unit lower-triangular solve)
    U = T V,   W = T diag(b) K,   U~ = U - W S                          (pseudo-values)
    O = diag(b) Q S + (Q K^T * Gamma * M) U~,     S_next = b_C S + (diag(b_C / b) K)^T U~

Derivation: S_t = b_t S + sum_{i<=t} (b_t / b_i) k_i u~_i^T with
u~_i = beta_i (v_i - b_i S^T k_i - sum_{j<i} (b_i / b_j) (k_i^T k_j) u~_j); stacking the rows gives
(I + tril(diag(beta)(Gamma * K K^T), -1)) U~ = diag(beta)(V - diag(b) K S). g = 0 recovers the
ungated form.

Backward without a state per step: the forward keeps the inputs, the state at each chunk boundary
([B, H, T/C, K, V]), each chunk's L^{-1} ([B, H, T/C, C, C]) and the per-token [U, W] and U~; the
hand-written backward
(``_ChunkedDeltaRule``) recomputes the C x C matrices, runs the state-gradient recursion over chunks
in reverse and differentiates all chunks in parallel. Saved memory grows as T*(3K+3V+C) + (T/C)*K*V
and the transient as T*C, instead of T*K*V for autograd through the per-step loop. This is
checkpointing at chunk boundaries (exact), not lmtool-fwp's reversal of the writes (exact only in
exact arithmetic).

Numerics: K K^T and the triangular solve are built in fp32 (fp64 for fp64 inputs) even under bf16
autocast. Keys must be normalised (L2 or sum normalisation after a non-negative feature map) for
the recurrence itself to be stable: with beta |k|^2 > 2 the true recurrence diverges, whatever the
implementation. ``qk_l2norm=True`` L2-normalises q and k inside the op (fla's
``use_qk_l2norm_in_kernel``).

Backends: ``backend="torch"`` is the same chunkwise form laid out for eager PyTorch
(:mod:`fastweights.ops.delta_rule_chunked`: chunk-major tensors, in-place scans, fewer products in the
backward; about twice as fast on one CPU thread); ``"compiled"`` is this file's functional form with its
parallel per-chunk parts (the C x C matrices, the solve, the outputs, the backward's per-chunk
gradients) compiled by ``torch.compile`` and the scans over chunks eager; ``"fla"`` calls
flash-linear-attention's ``chunk_delta_rule`` / ``chunk_gated_delta_rule`` (CUDA, fp16/bf16, or fp32
under autocast, cast to the autocast dtype right before the kernel, the state fp32);
``"auto"`` uses fla when it is importable (flash-linear-attention >= 0.6.0), the tensors are on CUDA and
the kernel dtype is fp16/bf16, and the compiled form where fla refuses (its gated backward on Hopper GPUs
with Triton 3.4 to 3.7.0 and no TileLang) unless a one-time gradient check of fla's gated backward on the device
passes (:mod:`fastweights.ops.fla_selfcheck`; ``FASTWEIGHTS_FLA_GATED_BACKWARD=check|fla|safe``); else torch. The contract with fla, the choice and the GPU
measurements behind it are in :mod:`fastweights.ops.fla_backend`; each distinct choice is logged once per
process.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from fastweights.ops.delta_rule_chunked import delta_rule_chunk_major
from fastweights.ops.fla_backend import (  # noqa: F401  (select_backend, fla_available: part of this module's names)
    fla_available,
    fla_delta_rule as _delta_rule_fla,
    fla_refuses_gated_backward as _fla_refuses,
    fla_unusable_reason,
    kernel_dtype,
    log_choice_once,
    select_backend,
)
from fastweights.ops.fla_selfcheck import fla_gated_backward_allowed
from fastweights.ops.linear_attention import (
    causal_mask,
    check_inputs,
    chunk_inputs,
    compute_dtype,
    decay_terms,
    from_chunks,
    no_autocast,
    recurrent_scan,
    resolve_scale,
    scalars_to_chunks,
    start_state,
)

__all__ = ["delta_rule", "delta_rule_recurrent", "select_backend", "fla_available"]

BACKENDS = ("auto", "torch", "compiled", "fla")  # as fastweights.ops.fla_backend.BACKENDS


# ----------------------------------------------------------------------------- reference


# slow reference, kept independent of the fast path it checks; same signature, so tests call both alike
def delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    log_decay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-step reference of :func:`delta_rule`, written straight from the paper's equation.

    Same arguments and results as :func:`delta_rule` (no backend, no chunking). Autograd through it
    stores every state, O(T K V) memory: use it for tests and as the benchmark baseline.
    """
    check_inputs("delta_rule_recurrent", q, k, v, beta=beta, log_decay=log_decay, initial_state=initial_state)
    cd = compute_dtype(q)
    scale = resolve_scale(scale, k)

    def step(i, state, q_i, k_i, v_i):  # state already decayed: a_t S_{t-1}
        beta_i = beta[:, i].to(cd).unsqueeze(-1)  # [B, H, 1]
        v_bar = torch.einsum("bhkv,bhk->bhv", state, k_i)  # value currently stored under k_t
        state = state + k_i.unsqueeze(-1) * (beta_i * (v_i - v_bar)).unsqueeze(-2)
        return state, torch.einsum("bhkv,bhk->bhv", state, q_i) * scale  # o_t = S_t^T q_t

    return recurrent_scan(q, k, v, initial_state, output_final_state, step, log_decay=log_decay)


# ----------------------------------------------------------------------------- chunkwise form


def _wy_parts(q, k, v, beta, log_decay):
    """Intra-chunk quantities, all chunks at once. Inputs ``[B, H, N, C, *]`` (q already scaled).

    Returns a dict with ``qb`` (diag(b) Q), ``p`` (Q K^T * Gamma * M), ``u`` (T V), ``w`` (T diag(b) K),
    ``kd`` (diag(b_C / b) K) and ``b_last`` (b_C per chunk, None without decay).
    """
    dv = v.shape[-1]
    kk = k @ k.transpose(-1, -2)  # [B, H, N, C, C]
    qk = q @ k.transpose(-1, -2)  # [B, H, N, C, C]
    if log_decay is None:
        a = beta.unsqueeze(-1) * kk
        p = qk * causal_mask(q.shape[-2], q.device, q.dtype)  # diagonal included: the read sees the current write
        rhs_k = beta.unsqueeze(-1) * k
        qb, kd, b_last = q, k, None
    else:
        gamma_mat, b_in, b_last, to_end = decay_terms(log_decay)
        a = beta.unsqueeze(-1) * kk * gamma_mat
        p = qk * gamma_mat  # gamma_mat is zero above the diagonal
        rhs_k = (beta * b_in).unsqueeze(-1) * k
        qb = q * b_in.unsqueeze(-1)
        kd = k * to_end.unsqueeze(-1)
    # L^{-1} = (I + strictly-lower(A))^{-1} by one unit-triangular solve against the identity (with
    # upper=False, unitriangular=True the solve reads only A's strictly lower triangle, so A needs no
    # masking); then X = L^{-1} [diag(beta) V, diag(beta) diag(b) K] is a matmul. Keeping L^{-1} lets the
    # backward apply L^{-T} as a matmul too, which on CPU is several times faster than a second solve.
    c = k.shape[-2]
    eye = torch.eye(c, dtype=k.dtype, device=k.device)
    l_inv = torch.linalg.solve_triangular(a, eye.expand_as(a), upper=False, unitriangular=True)  # [B, H, N, C, C]
    rhs = torch.cat([beta.unsqueeze(-1) * v, rhs_k], dim=-1)  # [B, H, N, C, V + K]
    x = l_inv @ rhs
    u, w = x.split([dv, x.shape[-1] - dv], dim=-1)
    return {"qb": qb, "p": p, "u": u, "w": w, "x": x, "l_inv": l_inv, "kd": kd, "b_last": b_last}


def _flat(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, N, ...] -> [B*H, N, ...]`` (a view), so per-chunk slices are 3-D and fit baddbmm."""
    return x.flatten(0, 1)


def _scan_states(parts, s0):
    """Sequential pass over chunks: states at chunk starts ``[B, H, N, K, V]``, pseudo-values and final state."""
    b, h = s0.shape[:2]
    u, w, kd = _flat(parts["u"]), _flat(parts["w"]), _flat(parts["kd"])  # [BH, N, C, *]
    b_last = None if parts["b_last"] is None else _flat(parts["b_last"])  # [BH, N]
    state = s0.flatten(0, 1)  # [BH, K, V]
    starts, pseudo = [], []
    for i in range(u.shape[1]):
        starts.append(state)
        u_tilde = torch.baddbmm(u[:, i], w[:, i], state, alpha=-1)  # U~ = U - W S, [BH, C, V]
        pseudo.append(u_tilde)
        decayed = state if b_last is None else b_last[:, i, None, None] * state
        state = torch.baddbmm(decayed, kd[:, i].transpose(-1, -2), u_tilde)  # S_next = b_C S + Kd^T U~
    unflat = lambda x: x.unflatten(0, (b, h))  # noqa: E731
    return unflat(torch.stack(starts, dim=1)), unflat(torch.stack(pseudo, dim=1)), unflat(state)


def _chunk_output(qb, p, starts, pseudo):
    """O = Qb S + P U~ for all chunks at once, ``[B, H, N, C, V]``."""
    return qb @ starts + p @ pseudo


def _bwd_prepare(q, k, log_decay, d_o):
    """Backward, before the reverse scan: the C x C matrices and decay factors, recomputed."""
    t_ = lambda x: x.transpose(-1, -2)  # noqa: E731
    kk = k @ t_(k)  # [B, H, N, C, C]
    if log_decay is not None:
        gamma_mat, b_in, b_last, to_end = decay_terms(log_decay)
        pre = {"kk_g": kk * gamma_mat, "qb": q * b_in.unsqueeze(-1), "kd": k * to_end.unsqueeze(-1),
               "b_k": k * b_in.unsqueeze(-1), "gamma_mat": gamma_mat, "b_in": b_in, "b_last": b_last,
               "to_end": to_end}
    else:
        pre = {"kk_g": kk, "qb": q, "kd": k, "b_k": k, "gamma_mat": None, "b_in": None, "b_last": None,
               "to_end": None}
    pre["kk"] = kk
    if d_o is not None:
        qk = q @ t_(k)
        p = qk * (pre["gamma_mat"] if log_decay is not None else causal_mask(q.shape[-2], q.device, q.dtype))
        pre.update(qk=qk, pt_do=t_(p) @ d_o, qbt_do=t_(pre["qb"]) @ d_o)  # [B, H, N, C, V], [B, H, N, K, V]
    return pre


def _bwd_scan(pre, w, starts, d_final, with_do):
    """Reverse pass over chunks: dS_next of every chunk ``[B, H, N, K, V]`` and dS of the initial state."""
    b, h = starts.shape[:2]
    d_state = (d_final if d_final is not None else torch.zeros_like(starts[:, :, 0])).flatten(0, 1)  # [BH, K, V]
    kd_f, w_f = _flat(pre["kd"]), _flat(w)
    b_last_f = None if pre["b_last"] is None else _flat(pre["b_last"])
    if with_do:
        pt_do_f, qbt_do_f = _flat(pre["pt_do"]), _flat(pre["qbt_do"])
    d_next = [None] * starts.shape[2]
    for i in reversed(range(starts.shape[2])):
        d_next[i] = d_state
        decayed = d_state if b_last_f is None else b_last_f[:, i, None, None] * d_state
        if not with_do:
            d_pseudo_i = torch.bmm(kd_f[:, i], d_state)  # [BH, C, V]
            carried = decayed
        else:
            d_pseudo_i = torch.baddbmm(pt_do_f[:, i], kd_f[:, i], d_state)
            carried = decayed + qbt_do_f[:, i]
        d_state = torch.baddbmm(carried, w_f[:, i].transpose(-1, -2), d_pseudo_i, alpha=-1)
    return torch.stack(d_next, dim=1).unflatten(0, (b, h)), d_state.unflatten(0, (b, h))


def _bwd_chunks(q, k, v, beta, log_decay, starts, l_inv, x, pseudo, d_o, d_next, pre):
    """Backward, after the reverse scan: every chunk's input gradients in parallel (class docstring)."""
    c = k.shape[-2]
    dv = v.shape[-1]
    gated = log_decay is not None
    t_ = lambda x: x.transpose(-1, -2)  # noqa: E731
    kk, kk_g, b_k, gamma_mat, b_in, to_end = (pre[n] for n in ("kk", "kk_g", "b_k", "gamma_mat", "b_in", "to_end"))
    d_pseudo = pre["kd"] @ d_next  # [B, H, N, C, V]
    if d_o is not None:
        d_pseudo = d_pseudo + pre["pt_do"]
    d_kd = pseudo @ t_(d_next)  # [B, H, N, C, K]
    d_x = torch.cat([d_pseudo, -(d_pseudo @ t_(starts))], dim=-1)  # [dU, dW], [B, H, N, C, V + K]
    d_r = t_(l_inv) @ d_x  # dR = L^{-T} dX
    d_a = -(d_r @ t_(x)) * causal_mask(c, k.device, k.dtype, strict=True)  # [B, H, N, C, C]
    d_rv, d_rk = d_r.split([dv, d_r.shape[-1] - dv], dim=-1)
    d_v = beta.unsqueeze(-1) * d_rv
    d_beta = (d_rv * v).sum(-1) + (d_rk * b_k).sum(-1) + (d_a * kk_g).sum(-1)
    d_k = (beta * b_in).unsqueeze(-1) * d_rk if gated else beta.unsqueeze(-1) * d_rk
    d_kk_g = beta.unsqueeze(-1) * d_a
    d_kk = d_kk_g * gamma_mat if gated else d_kk_g
    d_k = d_k + (d_kk + t_(d_kk)) @ k
    d_k = d_k + (to_end.unsqueeze(-1) * d_kd if gated else d_kd)  # from Kd
    d_q = None
    if d_o is not None:
        d_p = d_o @ t_(pseudo)  # [B, H, N, C, C]
        d_qb = d_o @ t_(starts)  # [B, H, N, C, K]
        d_qk = d_p * (gamma_mat if gated else causal_mask(c, k.device, k.dtype))
        d_q = d_qk @ k + (b_in.unsqueeze(-1) * d_qb if gated else d_qb)
        d_k = d_k + t_(d_qk) @ q
    d_g = None
    if gated:
        # gradient w.r.t. the within-chunk cumulative log decay gamma, then through the cumsum
        d_gamma_mat = d_kk_g * kk  # from A (strictly lower)
        d_b = beta * (d_rk * k).sum(-1)  # from R
        if d_o is not None:
            d_gamma_mat = d_gamma_mat + d_p * pre["qk"]
            d_b = d_b + (d_qb * q).sum(-1)
        d_diff = d_gamma_mat * gamma_mat  # Gamma = exp(gamma_i - gamma_j), zero above the diagonal
        d_gamma = d_diff.sum(-1) - d_diff.sum(-2) + d_b * b_in
        d_to_end = (d_kd * k).sum(-1) * to_end  # to_end = exp(gamma_C - gamma_t)
        d_gamma = d_gamma - d_to_end
        d_last = d_to_end.sum(-1) + (starts * d_next).sum((-1, -2)) * pre["b_last"]  # b_last = exp(gamma_C)
        d_gamma = torch.cat([d_gamma[..., :-1], (d_gamma[..., -1] + d_last).unsqueeze(-1)], dim=-1)
        d_g = d_gamma.flip(-1).cumsum(-1).flip(-1)  # gamma = cumsum(g)
    return d_q, d_k, d_v, d_beta, d_g


_COMPILED: dict = {}


def _impl(fn, compiled: bool):
    """``fn`` itself, or (``compiled``) ``torch.compile(fn)`` built on first use: the parallel, per-chunk
    parts of the forward and backward compile into fused kernels; the scans over chunks stay eager (a
    loop of T/C small matmuls, which compiled would unroll into a graph that grows with T). Shapes are
    torch.compile's default: the first compiled static, a second one of other sizes dynamic, so new
    batch sizes and lengths do not recompile each time."""
    if not compiled:
        return fn
    if fn not in _COMPILED:
        inner = torch.compile(fn, fullgraph=True, **COMPILE_OPTIONS)

        def run(*args):
            with warnings.catch_warnings():  # Dynamo traces through causal_mask's lru_cache (a pure function)
                warnings.filterwarnings("ignore", message=".*functools.lru_cache.*")
                return inner(*args)

        _COMPILED[fn] = run
    return _COMPILED[fn]


COMPILE_OPTIONS: dict = {}  # extra torch.compile arguments (the CPU tests trace with backend="aot_eager")


class _ChunkedDeltaRule(torch.autograd.Function):
    """Chunkwise delta rule with a hand-written backward that needs no state per step.

    Saved between forward and backward: the inputs, the state entering each chunk ([B, H, N, K, V]),
    L^{-1} per chunk ([B, H, N, C, C]), X = [U, W] and U~ (T x (K + 2V) numbers). K K^T, Q K^T and the
    decay matrix are recomputed in backward. Derivation, per chunk with S the entering state:

        U~ = U - W S,   O = Qb S + P U~,   S_next = b_C S + Kd^T U~,   [U, W] = X = L^{-1} R
        dU~ = P^T dO + Kd dS_next,   dP = dO U~^T,   dQb = dO S^T,   dKd = U~ dS_next^T,   db_C = <S, dS_next>
        dX = [dU~, -dU~ S^T],   dR = L^{-T} dX,   dA = -strictly_lower(dR X^T)      (L = I + strictly_lower(A))
        dS (chunk to chunk, in reverse) = Qb^T dO + b_C dS_next - W^T dU~

    and the chain rule through R = [diag(beta) V, diag(beta b) K], A = diag(beta) (K K^T * Gamma),
    P = Q K^T * Gamma * M, Qb = diag(b) Q, Kd = diag(b_C / b) K, Gamma_ij = exp(gamma_i - gamma_j),
    b = exp(gamma), gamma = cumsum(g). ``compiled`` runs the parallel parts through ``torch.compile``.
    """

    @staticmethod
    def forward(ctx, q, k, v, beta, log_decay, s0, compiled):
        # q, k [B, H, N, C, K]; v [B, H, N, C, V]; beta, log_decay [B, H, N, C]; s0 [B, H, K, V] or None.
        b, h, _, _, dk = k.shape
        has_s0 = s0 is not None
        if not has_s0:
            s0 = k.new_zeros(b, h, dk, v.shape[-1])
        parts = _impl(_wy_parts, compiled)(q, k, v, beta, log_decay)
        starts, pseudo, final = _scan_states(parts, s0)
        o = _impl(_chunk_output, compiled)(parts["qb"], parts["p"], starts, pseudo)  # [B, H, N, C, V]
        # All O(T * (D + C)) besides the chunk-boundary states; nothing of size T * K * V.
        ctx.save_for_backward(q, k, v, beta, log_decay, starts, parts["l_inv"], parts["x"], pseudo)
        ctx.has_s0, ctx.compiled = has_s0, compiled
        ctx.set_materialize_grads(False)  # an unused output (often o or the final state) gets None: skip its work
        return o, final

    @staticmethod
    @once_differentiable
    def backward(ctx, d_o, d_final):
        q, k, v, beta, log_decay, starts, l_inv, x, pseudo = ctx.saved_tensors
        if d_o is None and d_final is None:
            return (None,) * 7
        pre = _impl(_bwd_prepare, ctx.compiled)(q, k, log_decay, d_o)
        d_next, d_state = _bwd_scan(pre, x[..., v.shape[-1]:], starts, d_final, d_o is not None)  # x = [U, W]
        d_s0 = d_state if (ctx.has_s0 and ctx.needs_input_grad[5]) else None
        grads = _impl(_bwd_chunks, ctx.compiled)(q, k, v, beta, log_decay, starts, l_inv, x, pseudo, d_o, d_next, pre)
        needs = ctx.needs_input_grad
        return (*(g if need else None for g, need in zip(grads, needs[:5])), d_s0, None)


def _delta_rule_torch(q, k, v, beta, scale, initial_state, log_decay, chunk_size, compiled=False):
    cd = compute_dtype(q)
    b, t, h, _ = q.shape
    if t == 0:
        return v.new_zeros(b, 0, h, v.shape[-1]), start_state(initial_state, q, v)
    chunk = min(chunk_size, t)
    if not compiled:  # the same form, laid out for eager PyTorch (about twice as fast on CPU; see that module)
        return delta_rule_chunk_major(q, k, v, beta, scale, initial_state, log_decay, chunk)
    qc, kc, vc = chunk_inputs(q, k, v, scale, chunk)  # [B, H, N, C, K], [B, H, N, C, K], [B, H, N, C, V]
    bc = scalars_to_chunks(beta.to(cd), chunk)  # [B, H, N, C]; padding beta = 0 writes nothing
    gc = None if log_decay is None else scalars_to_chunks(log_decay.to(cd), chunk)  # padding g = 0
    s0 = None if initial_state is None else initial_state.to(cd)
    o, final = _ChunkedDeltaRule.apply(qc, kc, vc, bc, gc, s0, compiled)
    return from_chunks(o, t), final


# ----------------------------------------------------------------------------- the op


_warned_fallback = False


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    log_decay: torch.Tensor | None = None,
    chunk_size: int = 64,
    backend: str = "auto",
    qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(Gated) delta rule, chunkwise: ``S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``.

    Args:
        q, k: ``[B, T, H, K]`` queries and keys (after any feature map; keys should be L2- or
            sum-normalised, see the module docstring).
        v: ``[B, T, H, V]`` values.
        beta: ``[B, T, H]`` write strengths in (0, 1).
        scale: multiplies the read, default ``K ** -0.5`` (flash-linear-attention's default).
        initial_state: ``[B, H, K, V]`` starting fast weight; default zeros.
        output_final_state: also return the final state ``[B, H, K, V]`` (fp32; fp64 for fp64 inputs).
        log_decay: optional ``[B, T, H]`` log decay g_t <= 0 (a_t = exp(g_t)): the gated delta rule.
        chunk_size: chunk length C (default 64); T need not be a multiple of it.
        backend: "auto" | "torch" | "compiled" | "fla" (see the module docstring).
        qk_l2norm: L2-normalise q and k (in fp32) before the rule.

    Returns:
        ``(o [B, T, H, V], final state or None)``: o in q's dtype, except from fla, which returns it in
        the kernel dtype (under autocast the autocast dtype, as the matmul after it would cast it).
    """
    global _warned_fallback
    out_dtype = q.dtype
    check_inputs("delta_rule", q, k, v, beta=beta, log_decay=log_decay, initial_state=initial_state,
                 chunk_size=chunk_size)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, beta, log_decay, initial_state)
    )
    choice = dict(device_type=q.device.type, dtype=kernel_dtype(q), gated=log_decay is not None,
                  needs_grad=needs_grad)
    fla_ok = backend in ("auto", "fla") and fla_available()
    gated = log_decay is not None
    fla_unusable = None if fla_ok or backend not in ("auto", "fla") else fla_unusable_reason()
    refuses = fla_ok and gated and needs_grad and _fla_refuses(q.device)
    if backend == "auto" and refuses and select_backend("auto", **choice, fla_ok=True,
                                                        fla_refuses_gated_backward=True) == "compiled":
        # auto would leave fla for the refusal alone: fla's gradient self-check on this device may lift it
        refuses = not fla_gated_backward_allowed(q.device, k.shape[-1], v.shape[-1], choice["dtype"])
    chosen = select_backend(backend, **choice, fla_ok=fla_ok, fla_refuses_gated_backward=refuses,
                            fla_unusable=fla_unusable)
    log_choice_once(backend, chosen, **choice, fla_unusable=fla_unusable)
    if chosen == "fla":
        try:
            return _delta_rule_fla(q, k, v, beta, scale, initial_state, output_final_state, log_decay, qk_l2norm)
        except Exception as e:
            if backend == "fla":
                raise
            if not _warned_fallback:
                warnings.warn(f"delta_rule: flash-linear-attention refused the call ({e}); using the PyTorch form")
                _warned_fallback = True
    with no_autocast(q.device):
        if qk_l2norm:
            cd = compute_dtype(q)
            q = F.normalize(q.to(cd), dim=-1, eps=1e-6)
            k = F.normalize(k.to(cd), dim=-1, eps=1e-6)
        o, final = _delta_rule_torch(q, k, v, beta, resolve_scale(scale, k), initial_state, log_decay, chunk_size,
                                     compiled=chosen == "compiled")
    return o.to(out_dtype), (final if output_final_state else None)
