"""Slow references of the two fast memories (Zhao & Jones 2026, arXiv 2601.00671), written straight
from the paper's equations, for the tests that hold :meth:`fastweights.layers.fwpkm.FwPKM.memory` and
:meth:`fastweights.layers.fwmlp.FwMLP.memory` to them.

:func:`reference_schedule` is the order of reads and writes both follow. FwPKM, per chunk of C tokens
(lookahead L pairs query t with the value of token t + L)::

    (11) v_hat_t = sum_{(i,j) in top-k} softmax(s)_ij V[i n + j]        s_ij = s^1_i + s^2_j
    (19) L_mem = sum_t 1/2 g_t ||v_{t+L} - v_hat_t||^2
    (14) grad_r = (1 / N_r) dL_mem/dV_r,   (15) V_r <- V_r - eta scale grad_r
    (16) p_bar^m = mean_t softmax_topk(s^m_t),   (17) L_addr = -H(p_bar^1) - H(p_bar^2)
    (18) K^m <- K^m - eta_K w_addr dL_addr/dK^m

FwMLP: v_hat_t = W_d (u_t * silu(a_t)) + b_d, and after each chunk plain SGD on the mean squared error
of the queued pairs.

Dense tables, one token at a time, gradients by autograd: slow, and obviously the equations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastweights.layers.fast_memory import FastMemoryOptions
from fastweights.layers.fwmlp import PARAM_NAMES, FwMLPOptions
from fastweights.layers.fwpkm import FwPKMOptions


def reference_schedule(T: int, o: FastMemoryOptions):
    """The order of reads and writes of the slow references (``fwpkm_memory_reference``,
    ``fwmlp_memory_reference``), from the paper: token t is read with the memory as written so far;
    after every C read tokens the queued pairs are written, query t with the value of token t + L, and
    with ``boundary="carry"`` the last L queued tokens wait in the queue for their values. Yields
    ``(t, pairs)`` after token t is read: ``pairs`` the ``(query position, value position)`` pairs to
    write before token t + 1 is read (empty when nothing is written then; always empty when frozen)."""
    L, C = o.lookahead, o.chunk_size
    pending: list[int] = []  # token positions queued for the next write
    n_read = 0
    for t in range(T):
        if o.frozen:
            yield t, []
            continue
        pending.append(t)
        n_read += 1
        if n_read < C:
            yield t, []
            continue
        yield t, [(tq, pending[j + L]) for j, tq in enumerate(pending[: len(pending) - L])]
        keep = L if (o.boundary == "carry" and L > 0) else 0
        pending = pending[len(pending) - keep:]
        n_read = 0


def fwpkm_memory_reference(
    q: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    keys1: torch.Tensor,
    keys2: torch.Tensor,
    values: torch.Tensor,
    options: FwPKMOptions,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slow reference of :meth:`FwPKM.memory` for one shared memory, written straight from the equations.

    Dense tables, every token scored against all N slots one at a time, the value gradient of eq 19 by
    autograd through the full ``[N, d_v]`` table, eq 14's counts by ``bincount``, and the key
    gradient by autograd of eq 17 over all sub-keys.  Twice differentiable (``create_graph`` when
    grad is enabled).  Args as :meth:`FwPKM.memory` plus the initial tables (keys ``[H, n, dh]``,
    values ``[N, d_v]``).  Returns ``(v_hat [B, T, d_v], keys1, keys2, values)`` after the stream.
    """
    o = options
    B, T, H, d_k = q.shape
    n, half, k = keys1.shape[1], d_k // 2, o.topk
    N = n * n
    K1, K2, V = keys1.clone(), keys2.clone(), values.clone()
    create = torch.is_grad_enabled()

    def half_scores(qh, K):  # qh [H, dh], K [H, n, dh] -> [H, n]
        if o.score == "dot":
            return (qh.unsqueeze(1) * K).sum(-1)
        return -torch.log(o.idw_eps + (qh.unsqueeze(1) - K).pow(2).sum(-1))

    def retrieve(qt, K1, K2, V):  # one token's query [H, d_k] -> v_hat [d_v], slot ids [H k], sub-scores
        s1, s2 = half_scores(qt[:, :half], K1), half_scores(qt[:, half:], K2)  # [H, n]
        all_scores = (s1.unsqueeze(-1) + s2.unsqueeze(-2)).reshape(H, N)  # slot i*n + j
        top, idx = all_scores.topk(k, dim=-1)  # [H, k]
        w = torch.softmax(top.reshape(H * k), dim=0)
        return (w.unsqueeze(-1) * V[idx.reshape(-1)]).sum(0), idx.reshape(-1), s1, s2

    out_list = []
    for t, pairs in reference_schedule(T, o):
        out_list.append(torch.stack([retrieve(q[b, t], K1, K2, V)[0] for b in range(B)]))
        if pairs:
            with torch.enable_grad():
                Vg = V if V.requires_grad else V.detach().requires_grad_()
                K1g = K1 if K1.requires_grad else K1.detach().requires_grad_()
                K2g = K2 if K2.requires_grad else K2.detach().requires_grad_()
                mem_loss = 0.0
                reads = []
                p1, p2 = [], []
                for b in range(B):
                    for tq, tv in pairs:
                        vh, idx, s1, s2 = retrieve(q[b, tq], K1g, K2g, Vg)
                        target = v[b, tv]
                        mem_loss = mem_loss + 0.5 * g[b, tq] * (target - vh).pow(2).sum()  # eq 19
                        reads.append(idx)
                        p1.append(_masked_softmax_reference(s1, k))
                        p2.append(_masked_softmax_reference(s2, k))
                (gV,) = torch.autograd.grad(mem_loss, Vg, create_graph=create)
                counts = torch.bincount(torch.cat(reads), minlength=N).to(V.dtype).clamp_min(1.0)
                scale = k * H if o.update_scale == "rewrite" else 1.0
                V_new = V - o.lr * scale * gV / counts.unsqueeze(-1)  # eqs 14-15
                if o.key_update == "addressing":
                    addr = 0.0
                    for probs in (torch.stack(p1), torch.stack(p2)):  # [rows, H, n]
                        p_bar = probs.mean(0)  # eq 16, per head
                        addr = addr + (p_bar * torch.log(p_bar + 1e-8)).sum()  # eq 17: -H summed over heads
                    gK1, gK2 = torch.autograd.grad(o.addressing_weight * addr, (K1g, K2g), create_graph=create)
                elif o.key_update == "mse":
                    mean_loss = mem_loss / (len(reads) * V.shape[1])
                    gK1, gK2 = torch.autograd.grad(mean_loss, (K1g, K2g), create_graph=create)
                else:
                    gK1, gK2 = torch.zeros_like(K1), torch.zeros_like(K2)
                K1, K2, V = K1 - o.key_lr * gK1, K2 - o.key_lr * gK2, V_new
    outs = torch.stack(out_list, dim=1) if out_list else V.new_zeros(B, 0, V.shape[1])
    return outs, K1, K2, V


def _masked_softmax_reference(s: torch.Tensor, k: int) -> torch.Tensor:
    """Softmax over the entries >= the k-th largest of each row, zero elsewhere."""
    kth = s.detach().sort(dim=-1, descending=True).values[..., k - 1: k]
    return torch.softmax(torch.where(s >= kth, s, torch.full_like(s, float("-inf"))), dim=-1)


def fwmlp_memory_reference(q: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           weights: dict[str, torch.Tensor], options: FwMLPOptions):
    """Slow reference of :meth:`FwMLP.memory` (one shared MLP, fresh state), from the equations.

    Token-by-token reads; after every C tokens the loss of the queued pairs is differentiated by
    autograd (``create_graph`` when grad is enabled).  ``weights`` are unbatched ``[out, in]``/``[out]``.
    Returns ``(v_hat [B, T, d_v], final weights)``.
    """
    o = options
    B, T, _ = q.shape
    W = {k: w.clone() for k, w in weights.items()}
    create = torch.is_grad_enabled()

    def mlp(W, x):  # x [d_in] -> [d_out]
        return W["w_down"] @ ((W["w_up"] @ x + W["b_up"]) * F.silu(W["w_gate"] @ x + W["b_gate"])) + W["b_down"]

    outs = []
    for t, pairs in reference_schedule(T, o):
        outs.append(torch.stack([mlp(W, q[b, t]) for b in range(B)]))
        if pairs:
            with torch.enable_grad():
                Wg = {k: (w if w.requires_grad else w.detach().requires_grad_()) for k, w in W.items()}
                losses = [g[b, tq] * (mlp(Wg, q[b, tq]) - v[b, tv]).pow(2).mean()
                          for b in range(B) for tq, tv in pairs]
                loss = torch.stack(losses).mean()
                grads = torch.autograd.grad(loss, [Wg[k] for k in PARAM_NAMES], create_graph=create)
            if o.grad_clip > 0:
                grads = [gr.clamp(-o.grad_clip, o.grad_clip) for gr in grads]
            W = {k: W[k] - o.lr * gr for k, gr in zip(PARAM_NAMES, grads)}
    v_hat = torch.stack(outs, 1) if outs else q.new_zeros(B, 0, W["b_down"].shape[0])
    return v_hat, W
