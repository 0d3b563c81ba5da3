"""The fast-weights RNN's recurrence as functions (Ba et al. 2016, arXiv 1610.06258): the reference
written from the paper's equations and the attention-form read with its hand-written backward.

The equations, the write order and the defaults are in :mod:`fastweights.layers.fast_rnn`, the module that
uses these functions.

Two read forms of the same model:

* ``matrix``: the explicit A [B, H, H] updated every step; O(H^2) per step and an A per step kept
  for backward. :func:`fast_rnn_reference` is this form, written straight from the equations; it
  is also the reference the fast form is tested against.
* ``attention``: unrolling A gives decayed, unnormalised dot-product attention over the past states,
  ``A_{t-1} q = lam^n A_0 q + eta sum_{i=1..n} lam^(n-i) (g_i^T q) g_i`` where g_1..g_n are the
  states written so far (a carried history followed by this call's h_1..h_{t-1}) and A_0 is the
  matrix that summarises everything older. :func:`fast_rnn_attention` never materialises A; its
  hand-written backward pass keeps O(B T H) activations (and read weights, O(B T min(T, H)))
  instead of one A per step, O(B T H^2). The history is folded into A (:func:`fold_history`)
  once it holds ``hidden`` states, so the read stays O(H^2).

Time cannot be parallelised (h_t depends non-linearly on h_{t-1}); only the batch and the read
vectorise. On CPU in fp32/fp64 the attention form runs its time loop in a small C kernel compiled on
first use (``backend="kernel"``, the default where it builds; ``fastweights/ops/fast_rnn_kernel.py`` and ``.c``), else
in torch ops (``backend="torch"``); both have hand-written backward passes tested against autograd
through :func:`fast_rnn_reference`. Fast-weight arithmetic runs in fp32 (fp64 if the inputs are
fp64), autocast disabled.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from fastweights.ops.fast_rnn_kernel import AttentionReadRNNKernel, decay_weights, kernel_applies


# ----------------------------------------------------------------------------- functional forms


def fast_rnn_reference(
    u: Tensor,
    W: Tensor,
    h0: Tensor | None = None,
    A0: Tensor | None = None,
    *,
    lam: float,
    eta: float,
    inner_steps: int = 1,
    ln_weight: Tensor | None = None,
    ln_bias: Tensor | None = None,
    ln_preliminary: bool = True,
    eps: float = 1e-5,
) -> tuple[Tensor, Tensor]:
    """Per-step loop with the explicit fast matrix A, straight from the equations (matrix read).

    Args:
        u: input term C x_t (+ bias) for every step, [B, T, H].
        W: slow recurrent weights [H, H]; the boundary term is ``b_t = W h_{t-1} + u_t``.
        h0: hidden state before the first step [B, H]; None = zeros.
        A0: fast matrix before the first step [B, H, H]; None = zeros.
        lam, eta: decay and fast learning rate of ``A_t = lam A_{t-1} + eta h_t h_t^T``.
        inner_steps: S, the number of fast-weight reads per step (0 = plain (LN-)RNN).
        ln_weight, ln_bias: LayerNorm gain and bias [H]; None = no LayerNorm anywhere.
        ln_preliminary: apply LN to the preliminary vector h^(0) too.
        eps: LayerNorm epsilon.

    Returns:
        hs [B, T, H] (the states h_1..h_T) and A_T [B, H, H].
    """
    B, T, H = u.shape
    h = u.new_zeros(B, H) if h0 is None else h0
    A = u.new_zeros(B, H, H) if A0 is None else A0

    def ln(z: Tensor) -> Tensor:
        return z if ln_weight is None else F.layer_norm(z, (H,), ln_weight, ln_bias, eps)

    outs = []
    for t in range(T):
        b = h @ W.T + u[:, t]
        hs = torch.relu(ln(b) if ln_preliminary else b)
        for _ in range(inner_steps):
            read = (hs.unsqueeze(1) @ A.transpose(1, 2)).squeeze(1)  # A h^(s), as the row h^T A^T (faster on CPU)
            hs = torch.relu(ln(b + read))
        h = hs
        A = lam * A + eta * h.unsqueeze(-1) * h.unsqueeze(-2)  # write after the inner loop
        outs.append(h)
    return torch.stack(outs, 1), A


def fold_history(A: Tensor | None, history: Tensor | None, lam: float, eta: float) -> Tensor | None:
    """Fold stored states g_1..g_n [B, n, H] into the fast matrix: ``lam^n A + eta sum_i lam^(n-i) g_i g_i^T``.

    ``A`` [B, H, H] may be None (zero); returns None when both are None/empty.
    """
    if history is None or history.shape[1] == 0:
        return A
    n = history.shape[1]
    exponents = torch.arange(n - 1, -1, -1, device=history.device, dtype=history.dtype)
    weights = eta * torch.pow(torch.as_tensor(lam, dtype=history.dtype), exponents)  # [n]
    # sum_i w_i g_i g_i^T as one batched matmul: [B, H, n] @ [B, n, H]
    folded = torch.bmm((history * weights[:, None]).transpose(1, 2), history)
    return folded if A is None else folded + (lam**n) * A


class _AttentionReadRNN(torch.autograd.Function):
    """The fast-weights RNN with the attention-form read and a hand-written backward pass.

    Forward and backward are per-step loops of a few fused ops each (addmm, native LayerNorm, two
    bmm for the read); the gradients of W, the LN parameters and A_0 are summed over all steps
    with a single batched op at the end. Past states are kept in one buffer G [B, L + T, H].
    """

    @staticmethod
    def forward(ctx, u, W, ln_weight, ln_bias, h0, A0, history, lam, eta, inner_steps, ln_preliminary, eps):
        B, T, H = u.shape
        L = 0 if history is None else history.shape[1]
        N = L + T
        S = inner_steps
        use_ln = ln_weight is not None
        prelim_ln = use_ln and ln_preliminary
        rev = decay_weights(N, lam, eta, u)
        G = u.new_empty(B, N, H)  # all states written so far: carried history, then this call's h_t
        if L:
            G[:, :L] = history
        u_steps = u.transpose(0, 1).contiguous()  # [T, B, H] so that each step's slice is contiguous
        # per stage s (0 = preliminary) and step t: LN input, LN mean/rstd, post-ReLU state, read weights
        Z = [[None] * T for _ in range(S + 1)]
        MU = [[None] * T for _ in range(S + 1)]
        RS = [[None] * T for _ in range(S + 1)]
        HS = [[None] * T for _ in range(S + 1)]
        WS = [[None] * T for _ in range(S + 1)]
        h = h0
        W_t = W.t()
        for t in range(T):
            n = L + t  # states written before this step
            b = torch.addmm(u_steps[t], h, W_t)  # W h_{t-1} + C x_t, [B, H]
            z = b
            for s in range(S + 1):
                if s > 0:  # read the fast memory with the previous inner state q
                    q = HS[s - 1][t]
                    z = b
                    if n:
                        Gp = G[:, :n]  # [B, n, H]
                        # row-vector products (q^T G^T, ws^T G): far faster on CPU than G q as a column
                        ws = torch.bmm(q.unsqueeze(1), Gp.transpose(1, 2)).mul_(rev[N - n :])  # [B, 1, n]
                        z = torch.baddbmm(b.unsqueeze(1), ws, Gp).squeeze(1)  # b + sum_i ws_i g_i
                        WS[s][t] = ws
                    if A0 is not None:  # (A0 q)^T = q^T A0^T
                        z = torch.baddbmm(z.unsqueeze(1), q.unsqueeze(1), A0.transpose(1, 2), alpha=lam**n).squeeze(1)
                if (s > 0 and use_ln) or (s == 0 and prelim_ln):
                    a, MU[s][t], RS[s][t] = torch.native_layer_norm(z, (H,), ln_weight, ln_bias, eps)
                else:
                    a = z
                Z[s][t] = z
                if s == S:
                    HS[s][t] = torch.clamp_min(a, 0, out=G[:, n])  # h_t goes straight into the buffer
                else:
                    HS[s][t] = torch.relu(a)
            h = HS[S][t]
        ctx.save_for_backward(u, W, ln_weight, ln_bias, h0, A0)
        ctx.G, ctx.rev, ctx.Z, ctx.MU, ctx.RS, ctx.HS, ctx.WS = G, rev, Z, MU, RS, HS, WS
        ctx.config = (L, lam, S, use_ln, prelim_ln, eps)
        return G[:, L:].clone()

    @staticmethod
    @once_differentiable  # the hand-written backward is not itself differentiable
    def backward(ctx, d_out):
        u, W, ln_weight, ln_bias, h0, A0 = ctx.saved_tensors
        G, rev, Z, MU, RS, HS, WS = ctx.G, ctx.rev, ctx.Z, ctx.MU, ctx.RS, ctx.HS, ctx.WS
        L, lam, S, use_ln, prelim_ln, eps = ctx.config
        B, T, H = u.shape
        N = L + T
        need = ctx.needs_input_grad
        ln_mask = [True, bool(need[2]), bool(need[3])]
        d_lnw = torch.zeros_like(ln_weight) if use_ln else None
        d_lnb = torch.zeros_like(ln_bias) if use_ln else None
        # dG[:, i]: gradient reaching stored state i from the output and from every later read
        dG = torch.cat([u.new_zeros(B, L, H), d_out], 1) if L else d_out.clone()
        dB = [None] * T  # dL/db_t
        a0_terms = []  # (lam^n dL/dr, q) for the A_0 gradient
        db_next = None
        for t in range(T - 1, -1, -1):
            n = L + t
            dh = dG[:, n]
            if db_next is not None:  # b_{t+1} = W h_t + u_{t+1}
                dh = torch.addmm(dh, db_next, W)
            db = None
            for s in range(S, -1, -1):
                if dh is None:  # this stage's state reached the output only through a read of empty memory
                    break
                da = torch.ops.aten.threshold_backward(dh, HS[s][t], 0)  # through the ReLU
                if (s > 0 and use_ln) or (s == 0 and prelim_ln):
                    dz, dw, dbias = torch.ops.aten.native_layer_norm_backward(
                        da, Z[s][t], (H,), MU[s][t], RS[s][t], ln_weight, ln_bias, ln_mask
                    )
                    if dw is not None:
                        d_lnw += dw
                    if dbias is not None:
                        d_lnb += dbias
                else:
                    dz = da
                db = dz if db is None else db + dz
                if s == 0:
                    break
                # z = b + sum_i ws_i g_i (+ lam^n A0 q), ws_i = eta lam^(n-1-i) g_i^T q: back to q and to g_i
                q = HS[s - 1][t]
                dh = None
                if n:
                    Gp = G[:, :n]  # [B, n, H]
                    wr = torch.bmm(dz.unsqueeze(1), Gp.transpose(1, 2)).mul_(rev[N - n :])  # [B, 1, n]
                    dh = torch.bmm(wr, Gp).squeeze(1)
                    # dG_i += ws_i dz + wr_i q
                    dG[:, :n].addcmul_(WS[s][t].transpose(1, 2), dz.unsqueeze(1)).addcmul_(
                        wr.transpose(1, 2), q.unsqueeze(1)
                    )
                if A0 is not None:  # (A0^T dz)^T = dz^T A0
                    dq = torch.bmm(dz.unsqueeze(1), A0).squeeze(1) * lam**n
                    dh = dq if dh is None else dh + dq
                    a0_terms.append((dz * lam**n, q))
            dB[t] = db
            db_next = db
        dB = torch.stack(dB, 1)  # [B, T, H]
        d_u = dB if need[0] else None
        d_W = d_h0 = d_A0 = d_hist = None
        if need[1]:
            h_prev = torch.cat([h0.unsqueeze(1), G[:, L : N - 1]], 1)  # h_{t-1} for every step, [B, T, H]
            d_W = dB.reshape(-1, H).t() @ h_prev.reshape(-1, H)
        if need[4]:
            d_h0 = dB[:, 0] @ W
        if A0 is not None and need[5]:
            if a0_terms:
                dr, q = (torch.stack(x, 1) for x in zip(*a0_terms))  # [B, K, H]
                d_A0 = torch.bmm(dr.transpose(1, 2), q)  # sum_k dr_k q_k^T
            else:
                d_A0 = torch.zeros_like(A0)
        if L and need[6]:
            d_hist = dG[:, :L]
        return d_u, d_W, d_lnw, d_lnb, d_h0, d_A0, d_hist, None, None, None, None, None


BACKENDS = ("auto", "kernel", "torch")


def _recurrence(*, lam: float, eta: float, inner_steps: int = 1, ln_weight: Tensor | None = None,
                ln_bias: Tensor | None = None, ln_preliminary: bool = True, eps: float = 1e-5) -> tuple:
    """The keyword arguments of :func:`fast_rnn_reference` that set the recurrence, checked and in order."""
    if ln_weight is not None and ln_bias is None:
        ln_bias = torch.zeros_like(ln_weight)
    return ln_weight, ln_bias, float(lam), float(eta), int(inner_steps), bool(ln_preliminary), float(eps)


def fast_rnn_attention(
    u: Tensor,
    W: Tensor,
    h0: Tensor | None = None,
    A0: Tensor | None = None,
    history: Tensor | None = None,
    *,
    backend: str = "auto",
    **recurrence,
) -> Tensor:
    """The fast-weights RNN with the attention-form read (A never materialised); same model as
    :func:`fast_rnn_reference`.

    Args:
        u, W, h0: as in :func:`fast_rnn_reference`.
        A0: fast matrix [B, H, H] summarising everything older than ``history``; None = zeros.
        history: states written before this call and not folded into A0, oldest first,
            [B, L, H]; None = none. The memory before step t is
            ``fold_history(A0, cat(history, h_1..h_{t-1}))``.
        backend: "kernel" (each step's inner loop in the compiled C kernel; CPU, fp32/fp64), "torch"
            (torch ops only), or "auto" (the kernel where it applies, else torch).
        recurrence: the keyword arguments of :func:`fast_rnn_reference` (lam, eta, inner_steps,
            ln_weight, ln_bias, ln_preliminary, eps).

    Returns:
        hs [B, T, H]. The memory after the call is ``fold_history(A0, cat(history, hs))``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"fast_rnn_attention: backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    ln_weight, ln_bias, *config = _recurrence(**recurrence)
    B, T, H = u.shape
    if h0 is None:
        h0 = u.new_zeros(B, H)
    if history is not None and history.shape[1] == 0:
        history = None
    inputs = (u, W, ln_weight, ln_bias, h0, A0, history)
    use_kernel = backend == "kernel" or (backend == "auto" and kernel_applies(*inputs))
    if use_kernel and not kernel_applies(*inputs):
        raise ValueError("fast_rnn_attention: the step kernel needs CPU fp32/fp64 inputs of one dtype and a C compiler")
    function = AttentionReadRNNKernel if use_kernel else _AttentionReadRNN
    return function.apply(*inputs, *config)
