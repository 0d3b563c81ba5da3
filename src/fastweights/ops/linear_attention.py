"""Causal linear attention = the sum-rule fast weight programmer, and Peng et al.'s gated rule.

Schlag, Irie, Schmidhuber 2021, "Linear Transformers Are Secretly Fast Weight Programmers"
(arXiv 2102.11174), section 3: causal linear attention (Katharopoulos et al. 2020, arXiv 2006.16236)
is a fast weight programmer whose fast weight is written with the *sum* rule. With the project
state layout S = W^T in R^{K x V} per head ([B, H, K, V], as flash-linear-attention), keys/queries
already passed through a feature map:

    sum rule:      S_t = a_t S_{t-1} + k_t v_t^T            (a_t = exp(g_t) = 1 without log_decay)
                   o_t = scale * S_t^T q_t                   (the read comes after the same step's write)
    normalize:     z_t = z_{t-1} + k_t,   o_t = S_t^T q_t / (z_t^T q_t + eps)   (scale cancels; a_t = 1)
    gated rule     S_t = (1 - beta_t) S_{t-1} + beta_t k_t v_t^T                (Peng et al. 2021,
    (Peng et al.):                                   "Random Feature Attention", arXiv 2103.02143; eq. 52
                                                     of Schlag et al.'s appendix B)

The gated rule is the decayed sum rule with log_decay = log(1 - beta) and values beta * v (this
mapping is the project's reading; flash-linear-attention has no op named after Peng et al.).

Chunked form (tokens are rows inside a chunk of length C; gamma = cumsum of log decays within the
chunk, b_t = exp(gamma_t), Gamma_ij = exp(gamma_i - gamma_j) for i >= j else 0):

    O_chunk = diag(b) Q S + (Q K^T * Gamma) V,      S_next = b_C S + (diag(b_C / b) K)^T V

Only the chunk-to-chunk state pass is sequential (and without decay it is a cumulative sum). Autograd
through this form keeps one state per chunk, not per step: memory O(T C + (T / C) K V).

Every fast path has its per-step reference here (``*_recurrent``) and tests hold them together.
Arithmetic is fp32 (fp64 for fp64 inputs) even under bf16 autocast; outputs come back in the input
dtype, states in fp32/fp64.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn.functional as F

from fastweights.core.errors import UserError

__all__ = [
    "linear_attention",
    "linear_attention_recurrent",
    "gated_rule",
    "gated_rule_recurrent",
]


# ----------------------------------------------------------------------------- shared helpers
# (also used by fastweights.ops.delta_rule)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp64 stays fp64 (for exactness tests); everything else computes in fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def no_autocast(device: torch.device):
    """Context that turns autocast off, so fast-weight arithmetic is not silently done in bf16."""
    if device.type in ("cuda", "cpu"):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


def check_inputs(
    name: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor | None = None,
    log_decay: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> None:
    """Validate the [B, T, H, D] layout; raise UserError with one line naming the culprit."""
    if q.dim() != 4:
        raise UserError(f"{name}: q must be [B, T, H, K], got shape {tuple(q.shape)}")
    if k.shape != q.shape:
        raise UserError(f"{name}: k must have the shape of q {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise UserError(f"{name}: v must be [B, T, H, V] with B, T, H of q {tuple(q.shape[:3])}, got {tuple(v.shape)}")
    for label, t in (("beta", beta), ("log_decay", log_decay)):
        if t is not None and t.shape != q.shape[:3]:
            raise UserError(f"{name}: {label} must be [B, T, H] = {tuple(q.shape[:3])}, got {tuple(t.shape)}")
    if initial_state is not None:
        want = (q.shape[0], q.shape[2], q.shape[3], v.shape[3])
        if tuple(initial_state.shape) != want:
            raise UserError(f"{name}: initial_state must be [B, H, K, V] = {want}, got {tuple(initial_state.shape)}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise UserError(f"{name}: chunk_size must be a positive integer, got {chunk_size!r}")


def to_chunks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """``[B, T, H, D] -> [B, H, N, C, D]`` with N = ceil(T / C), zero-padding the tail."""
    b, t, h, d = x.shape
    n = math.ceil(t / chunk)
    x = x.transpose(1, 2)  # [B, H, T, D]
    if n * chunk != t:
        x = F.pad(x, (0, 0, 0, n * chunk - t))  # [B, H, N*C, D]
    return x.reshape(b, h, n, chunk, d)


def scalars_to_chunks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """``[B, T, H] -> [B, H, N, C]`` with zero padding (beta = 0 and log decay = 0 change nothing)."""
    return to_chunks(x.unsqueeze(-1), chunk).squeeze(-1)


def from_chunks(x: torch.Tensor, t: int) -> torch.Tensor:
    """``[B, H, N, C, D] -> [B, T, H, D]``, dropping the padded tail."""
    b, h, n, c, d = x.shape
    return x.reshape(b, h, n * c, d)[:, :, :t].transpose(1, 2)  # [B, T, H, D]


@functools.lru_cache(maxsize=64)
def causal_mask(c: int, device: torch.device, dtype: torch.dtype, strict: bool = False) -> torch.Tensor:
    """``[C, C]`` lower-triangular ones, diagonal included unless ``strict``. Multiplying by it is much
    faster on CPU than ``tril`` on large batched tensors."""
    return torch.ones(c, c, device=device, dtype=dtype).tril(-1 if strict else 0)


def decay_terms(log_decay: torch.Tensor):
    """Within-chunk decay factors from log decays ``g [B, H, N, C]`` (each g <= 0).

    Returns ``gamma_mat [B, H, N, C, C]`` (exp(gamma_i - gamma_j) for i >= j, else 0),
    ``b [B, H, N, C]`` = exp(gamma_t), ``b_last [B, H, N]`` = exp(gamma_C) and
    ``to_end [B, H, N, C]`` = exp(gamma_C - gamma_t). Differences of cumulative log decays are
    exponentiated, never ratios of products, which would under- or overflow.
    """
    c = log_decay.shape[-1]
    gamma = log_decay.cumsum(-1)  # [B, H, N, C]
    causal = causal_mask(c, log_decay.device, log_decay.dtype)
    diff = gamma.unsqueeze(-1) - gamma.unsqueeze(-2)  # [B, H, N, C, C], gamma_i - gamma_j
    # Zero the exponent above the diagonal before exp (there gamma_i - gamma_j >= 0 could overflow), then
    # zero those entries; both masks also zero their gradient.
    gamma_mat = torch.exp(diff * causal) * causal
    b = torch.exp(gamma)
    b_last = torch.exp(gamma[..., -1])
    to_end = torch.exp(gamma[..., -1:] - gamma)
    return gamma_mat, b, b_last, to_end


def resolve_scale(scale: float | None, k: torch.Tensor) -> float:
    """Default scale 1/sqrt(K) on the query, as flash-linear-attention."""
    return k.shape[-1] ** -0.5 if scale is None else float(scale)


def start_state(initial_state: torch.Tensor | None, q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The ``[B, H, K, V]`` state a call starts from: ``initial_state`` in the compute dtype, else zeros."""
    cd = compute_dtype(q)
    if initial_state is not None:
        return initial_state.to(cd)
    b, _, h, dk = q.shape
    return torch.zeros(b, h, dk, v.shape[-1], dtype=cd, device=q.device)


def chunk_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, chunk: int):
    """``scale * q``, ``k`` and ``v`` in the compute dtype as ``[B, H, N, C, D]`` chunks (zero-padded tail)."""
    cd = compute_dtype(q)
    return to_chunks(q.to(cd) * scale, chunk), to_chunks(k.to(cd), chunk), to_chunks(v.to(cd), chunk)


def recurrent_scan(q, k, v, initial_state, output_final_state, step, log_decay=None):
    """The loop every per-step reference (``*_recurrent``) runs, one token at a time with autocast off.

    The state starts as :func:`start_state`; at step t it is first decayed by ``a_t = exp(g_t)`` when
    ``log_decay`` is given, then ``state, o_t = step(t, state, q_t, k_t, v_t)`` with ``q_t, k_t, v_t``
    ``[B, H, D]`` in the compute dtype. Returns ``(o [B, T, H, V] in q's dtype, final state or None)``.
    """
    cd = compute_dtype(q)
    b, t, h, _ = q.shape
    state = start_state(initial_state, q, v)
    outs = []
    with no_autocast(q.device):
        for i in range(t):
            if log_decay is not None:
                state = torch.exp(log_decay[:, i].to(cd))[..., None, None] * state  # a_t S_{t-1}
            state, o_i = step(i, state, q[:, i].to(cd), k[:, i].to(cd), v[:, i].to(cd))
            outs.append(o_i)
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(b, 0, h, v.shape[-1], dtype=cd)  # [B, T, H, V]
    return o.to(q.dtype), (state if output_final_state else None)


# ----------------------------------------------------------------------------- sum rule


def _sum_rule_scale(scale: float | None, k: torch.Tensor, normalize: bool, log_decay) -> float:
    """The read's scale: 1 with ``normalize`` (it cancels), which is defined for the undecayed rule only."""
    if normalize and log_decay is not None:
        raise UserError("linear_attention: normalize=True is defined for the undecayed sum rule only")
    return 1.0 if normalize else resolve_scale(scale, k)


# slow reference, kept independent of the fast path it checks; same signature, so tests call both alike
def linear_attention_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    normalize: bool = False,
    log_decay: torch.Tensor | None = None,
    initial_normalizer: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-step reference of :func:`linear_attention`, written straight from the sum rule.

    Same arguments and results as :func:`linear_attention`. Stores every state for autograd, so use
    it for tests only.
    """
    check_inputs("linear_attention_recurrent", q, k, v, log_decay=log_decay, initial_state=initial_state)
    scale = _sum_rule_scale(scale, k, normalize, log_decay)
    cd = compute_dtype(q)
    b, _, h, dk = q.shape
    z = torch.zeros(b, h, dk, dtype=cd, device=q.device) if initial_normalizer is None else initial_normalizer.to(cd)

    def step(i, state, q_i, k_i, v_i):
        nonlocal z
        state = state + k_i.unsqueeze(-1) * v_i.unsqueeze(-2)  # S_t = a_t S_{t-1} + k_t v_t^T
        o_i = torch.einsum("bhkv,bhk->bhv", state, q_i) * scale  # o_t = S_t^T q_t
        if normalize:
            z = z + k_i
            o_i = o_i / ((z * q_i).sum(-1, keepdim=True) + eps)
        return state, o_i

    return recurrent_scan(q, k, v, initial_state, output_final_state, step, log_decay=log_decay)


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    normalize: bool = False,
    chunk_size: int = 64,
    log_decay: torch.Tensor | None = None,
    initial_normalizer: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal linear attention (sum-rule fast weight programmer), chunked.

    Args:
        q, k: ``[B, T, H, K]`` queries and keys, already through the feature map.
        v: ``[B, T, H, V]`` values.
        scale: multiplies the read; default ``K ** -0.5`` (flash-linear-attention's default).
            Ignored when ``normalize=True`` (it cancels).
        initial_state: ``[B, H, K, V]`` fast weight to start from; default zeros.
        output_final_state: return the final ``[B, H, K, V]`` state (fp32, fp64 for fp64 inputs).
        normalize: divide each read by ``z_t^T q_t + eps`` with ``z_t = z_0 + sum_{j<=t} k_j``
            (Katharopoulos et al.). To stream with ``normalize=True`` pass the previous normaliser
            as ``initial_normalizer`` ``[B, H, K]``; the next one is ``z_0 + k.sum(1)``.
        chunk_size: chunk length C (default 64); any T works, the tail is zero-padded.
        log_decay: optional ``[B, T, H]`` per-step log decay g_t <= 0, ``S_t = exp(g_t) S_{t-1} + ...``.
        eps: added to the normaliser (default 1e-6, the synthetic-task code's value).

    Returns:
        ``(o [B, T, H, V] in q's dtype, final state or None)``.
    """
    check_inputs("linear_attention", q, k, v, log_decay=log_decay, initial_state=initial_state, chunk_size=chunk_size)
    scale = _sum_rule_scale(scale, k, normalize, log_decay)
    cd = compute_dtype(q)
    b, t, h, _ = q.shape
    if t == 0:
        final = start_state(initial_state, q, v)
        return v.new_zeros(b, 0, h, v.shape[-1]), (final if output_final_state else None)
    chunk = min(chunk_size, t)
    with no_autocast(q.device):
        qc, kc, vc = chunk_inputs(q, k, v, scale, chunk)  # [B, H, N, C, K], [B, H, N, C, K], [B, H, N, C, V]
        n = qc.shape[2]
        scores = qc @ kc.transpose(-1, -2)  # [B, H, N, C, C]
        if log_decay is None:
            scores = scores * causal_mask(chunk, q.device, cd)  # diagonal included: the read sees the current write
            kv = kc.transpose(-1, -2) @ vc  # [B, H, N, K, V], each chunk's sum of k v^T
            # State at the start of chunk n = S_0 + sum of earlier chunks' writes (exclusive cumsum).
            starts = torch.cat([torch.zeros_like(kv[:, :, :1]), kv[:, :, :-1].cumsum(2)], dim=2)
            final = kv.sum(2)
            if initial_state is not None:
                s0 = initial_state.to(cd)
                starts = starts + s0.unsqueeze(2)
                final = final + s0
        else:
            gamma_mat, b_in, b_last, to_end = decay_terms(scalars_to_chunks(log_decay.to(cd), chunk))
            scores = scores * gamma_mat
            qc = qc * b_in.unsqueeze(-1)  # the carried state has decayed by b_t at step t
            kv = (kc * to_end.unsqueeze(-1)).transpose(-1, -2) @ vc  # [B, H, N, K, V]
            state = start_state(initial_state, q, v)
            starts_list = []
            for i in range(n):  # sequential over chunks only
                starts_list.append(state)
                state = b_last[:, :, i, None, None] * state + kv[:, :, i]
            starts = torch.stack(starts_list, dim=2)  # [B, H, N, K, V]
            final = state
        o = qc @ starts + scores @ vc  # [B, H, N, C, V]
        o = from_chunks(o, t)  # [B, T, H, V]
        if normalize:
            z = k.to(cd).cumsum(1)  # [B, T, H, K]
            if initial_normalizer is not None:
                z = z + initial_normalizer.to(cd).unsqueeze(1)
            o = o / ((z * q.to(cd)).sum(-1, keepdim=True) + eps)
    return o.to(q.dtype), (final if output_final_state else None)


# ----------------------------------------------------------------------------- gated rule (Peng et al.)


def _gated_rule_decay(beta: torch.Tensor) -> torch.Tensor:
    """log(1 - beta), with beta kept one ulp below 1 so the log and its gradient stay finite."""
    cd = compute_dtype(beta)
    beta = beta.to(cd)
    return torch.log1p(-beta.clamp(max=1.0 - torch.finfo(cd).eps))


# slow reference, kept independent of the fast path it checks; same signature, so tests call both alike
def gated_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-step reference of :func:`gated_rule`: ``S_t = (1 - beta_t) S_{t-1} + beta_t k_t v_t^T``."""
    check_inputs("gated_rule_recurrent", q, k, v, beta=beta, initial_state=initial_state)
    cd = compute_dtype(q)
    scale = resolve_scale(scale, k)

    def step(i, state, q_i, k_i, v_i):
        beta_i = beta[:, i].to(cd)[..., None, None]  # [B, H, 1, 1]
        state = (1.0 - beta_i) * state + beta_i * (k_i.unsqueeze(-1) * v_i.unsqueeze(-2))  # k_t v_t^T
        return state, torch.einsum("bhkv,bhk->bhv", state, q_i) * scale

    return recurrent_scan(q, k, v, initial_state, output_final_state, step)


def gated_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Peng et al.'s gated rule ``S_t = (1 - beta_t) S_{t-1} + beta_t k_t v_t^T``, chunked.

    Args:
        q, k: ``[B, T, H, K]`` (after the feature map); v: ``[B, T, H, V]``.
        beta: ``[B, T, H]`` write strengths in [0, 1].
        scale, initial_state, output_final_state, chunk_size: as :func:`linear_attention`.

    Computed as the decayed sum rule with ``log_decay = log(1 - beta)`` and values ``beta * v``; beta
    is clamped one ulp below 1 so that the log stays finite (a relative change of ~1e-7 in fp32).

    Returns ``(o [B, T, H, V], final state [B, H, K, V] or None)``.
    """
    check_inputs("gated_rule", q, k, v, beta=beta, initial_state=initial_state, chunk_size=chunk_size)
    cd = compute_dtype(q)
    with no_autocast(q.device):
        v_scaled = v.to(cd) * beta.to(cd).unsqueeze(-1)  # beta_t v_t, [B, T, H, V]
        o, state = linear_attention(
            q.to(cd),
            k.to(cd),
            v_scaled,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            chunk_size=chunk_size,
            log_decay=_gated_rule_decay(beta),
        )
    return o.to(q.dtype), state
