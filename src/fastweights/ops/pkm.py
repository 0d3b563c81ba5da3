"""Product-key memory ops: product-key top-k search, sparse weighted read, per-row aggregated write.

Product keys (Lample et al. 2019, "Large Memory Layers with Product Keys", arXiv 1907.05242) index
N = n^2 value slots with two sub-key tables K^1, K^2 in R^{n x d_k/2}.  A query q = [q^1; q^2] is
scored against each half separately, and slot (i, j) -- row i*n + j of the value table -- gets the
sum of its two sub-scores (Zhao & Jones 2026, "Fast-weight Product Key Memory", eqs 6-7, 20)::

    dot score:   s^m_i = q^m . K^m_i
    IDW score:   s^m_i = -log(eps + ||q^m - K^m_i||^2)            (eps = 1e-3)
    I^m = TopK_k(s^m),  m in {1, 2}
    s_ij = s^1_i + s^2_j  for (i, j) in I^1 x I^2,   I = TopK_k of these k^2 candidates
    s'   = softmax over I,   v_hat = sum_{(i,j) in I} s'_ij V[i*n + j]                     (eq 11)

Because the combined score is a sum, the true top-k over all n^2 slots always lies inside
I^1 x I^2: a pair (i, j) with i outside I^1 is beaten by the k pairs (i', j), i' in I^1.  The search
is therefore exact, and costs 2n sub-key scores plus k^2 candidates per query instead of N; fewer
still, as the pair of per-half ranks (a, b) is beaten by the (a+1)(b+1) - 1 pairs of lower ranks, so
only the ~k ln k pairs with (a+1)(b+1) <= k are candidates (20 for k = 8).

Under IDW the softmax weights are the normalised inverse-distance products
s'_ij ∝ 1 / [(eps + ||q^1 - K^1_i||^2)(eps + ||q^2 - K^2_j||^2)].

The write side (FwPKM eq 14) needs, for each value row r read by a chunk, the gradient of a loss
L = sum_t <e_t, v_hat_t> (e_t = dL/dv_hat_t) divided by N_r, the number of reads of r::

    grad_r = (1 / N_r) * sum_{(t, j): idx_tj = r} w_tj e_t

computed here over the reads only, never as a dense [N, d_v] tensor, and with shapes that depend
on the number of reads M alone (no data-dependent size, so no host sync on a GPU and one graph
under ``torch.compile``): the M read ids are sorted, each read's contribution is added (index_add)
onto the position of the first read of its row in that sorted list (found by a binary search of
the sorted list in itself), so the result is M sorted ids with each distinct row's gradient at its
first occurrence and zero at the repeats.

Fast weights that change over a sequence are kept as a base table plus sparse row deltas, one
per write, each in that form ("run-start form": ids sorted, non-decreasing; the whole delta of a
row at its first occurrence, zero at the repeats).  Summing a part into a table by index_add
(repeats add zero) and looking a row up at its first occurrence (binary search, leftmost) both
read it correctly.  :func:`sparse_parts_add` reads them and :func:`sparse_parts_merge` merges
several into one, at a cost proportional to the reads, not to N.

Layout: queries ``[B, T, H, d_k]``; sub-key tables ``[H, n, d_k/2]`` (shared) or
``[B, H, n, d_k/2]`` (one per sequence); slot ids in ``[0, n^2)``.  Every fast path has its
brute-force reference below it (``*_reference``), and ``tests/ops/test_pkm_ops.py`` holds them together.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from fastweights.core.errors import UserError

SCORES = ("idw", "dot")


class ProductKeySearch(NamedTuple):
    """Everything a product-key lookup produces (all over the last axes ``[B, T, H, ...]``).

    scores:       [B, T, H, k] combined scores s_ij of the selected slots, sorted descending
    indices:      [B, T, H, k] slot ids i*n + j in [0, n^2)
    sub_top:      [B, T, 2H, k] each half's top-k sub-key scores, sorted descending; entry m*H + h
                  is half m+1 of head h (``sub_top1`` / ``sub_top2`` are the two halves)
    sub_indices:  [B, T, 2H, k] their sub-key ids (I^1 for the first H entries, I^2 for the rest)
    """

    scores: torch.Tensor
    indices: torch.Tensor
    sub_top: torch.Tensor
    sub_indices: torch.Tensor

    sub_top1 = property(lambda self: _half(self.sub_top, 0))
    sub_top2 = property(lambda self: _half(self.sub_top, 1))
    sub_indices1 = property(lambda self: _half(self.sub_indices, 0))
    sub_indices2 = property(lambda self: _half(self.sub_indices, 1))


def _half(x: torch.Tensor, m: int) -> torch.Tensor:
    """Half ``m`` (0: first, 1: second) of a ``[B, T, 2H, k]`` tensor: its entries ``m H .. m H + H - 1``."""
    h = x.shape[2] // 2
    return x[:, :, h:] if m else x[:, :, :h]


def _check_score(score: str) -> None:
    if score not in SCORES:
        raise UserError(f"unknown product-key score {score!r}; choose one of {', '.join(SCORES)}")


def softmax_short(x: torch.Tensor) -> torch.Tensor:
    """Softmax over a short last axis (the k or H*k selected slots), equal to ``torch.softmax(x, -1)``.

    Written out because on the CPU ``torch.softmax`` is slower on rows this short.  The shift by
    the row max is detached: softmax does not depend on it, so the gradient is unchanged."""
    e = torch.exp(x - x.detach().amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def subkey_scores(q_half: torch.Tensor, keys: torch.Tensor, score: str = "idw", eps: float = 1e-3) -> torch.Tensor:
    """Scores of every sub-key of one half: ``[B, T, H, dh] x [H or B, H, n, dh] -> [B, T, H, n]``.

    ``score="dot"``: q.K;  ``score="idw"``: -log(eps + ||q - K||^2), with the squared distance
    expanded as |q|^2 + |K|^2 - 2 q.K so no [B, T, H, n, dh] difference tensor is formed.
    """
    _check_score(score)
    raw = _subkey_dots_or_sqdist(q_half, keys, score)
    return raw if score == "dot" else _idw(raw, eps)


def _subkey_dots_or_sqdist(q_half: torch.Tensor, keys: torch.Tensor, score: str) -> torch.Tensor:
    """``[B, T, H, n]``: q.K for "dot", ||q - K||^2 for "idw" (whose score decreases with it)."""
    if keys.dim() == 3:
        keys = keys.unsqueeze(0)  # [1, H, n, dh]: one table shared by every sequence
    q_bh = q_half.permute(0, 2, 1, 3)  # [B, H, T, dh]
    if score == "dot":
        return torch.matmul(q_bh, keys.transpose(-1, -2)).permute(0, 2, 1, 3)
    # |q|^2 + |K|^2 - 2 q.K as one matmul of augmented vectors [q, |q|^2, 1] . [-2K, 1, |K|^2]
    q_sq = (q_bh * q_bh).sum(-1, keepdim=True)  # [B, H, T, 1]  (x * x: pow's backward is slower)
    k_sq = (keys * keys).sum(-1, keepdim=True)  # [Bk, H, n, 1]
    q_aug = torch.cat([q_bh, q_sq, torch.ones_like(q_sq)], dim=-1)  # [B, H, T, dh + 2]
    k_aug = torch.cat([-2.0 * keys, torch.ones_like(k_sq), k_sq], dim=-1)  # [Bk, H, n, dh + 2]
    return torch.matmul(q_aug, k_aug.transpose(-1, -2)).permute(0, 2, 1, 3)  # [B, T, H, n]


def _idw(sq_dist: torch.Tensor, eps: float) -> torch.Tensor:
    """Eq 20's score from squared distances (rounding in the expansion can dip below 0: clamp)."""
    return -torch.log(eps + sq_dist.clamp_min(0.0))


def pkm_search(
    q: torch.Tensor,
    keys1: torch.Tensor,
    keys2: torch.Tensor,
    k: int,
    score: str = "idw",
    eps: float = 1e-3,
) -> ProductKeySearch:
    """Exact product-key top-k search.

    Args:
        q: ``[B, T, H, d_k]`` queries; the first d_k/2 features score against ``keys1``.
        keys1, keys2: ``[H, n, d_k/2]`` sub-key tables, or ``[B, H, n, d_k/2]`` per sequence.
        k: slots to return per head (also the per-half candidate count), ``k <= n``.
        score: ``"idw"`` (default, eq 20) or ``"dot"``.
        eps: IDW epsilon (default 1e-3).

    Returns:
        :class:`ProductKeySearch` with combined scores and slot ids ``[B, T, H, k]`` (sorted by
        score, descending) and each half's top-k sub-keys and their scores.  Scores are differentiable w.r.t.
        ``q`` and the keys (twice: the ops are plain gathers and matmuls); indices are not.
    """
    n = keys1.shape[-2]
    half = keys1.shape[-1]
    if q.shape[-1] != 2 * half:
        raise ValueError(f"query dim {q.shape[-1]} != 2 x sub-key dim {half}")
    if not 0 < k <= n:
        raise UserError(f"top-k {k} must be between 1 and the number of sub-keys {n}")
    _check_score(score)
    B, T, H = q.shape[:3]
    # both halves scored as 2H heads of one batch: query half m of head h is entry m*H + h
    q_halves = split_halves(q)  # [B, T, 2H, dh]
    raw = _subkey_dots_or_sqdist(q_halves, torch.cat([keys1, keys2], dim=-3), score)  # [B, T, 2H, n]
    if score == "dot":
        top, idx = raw.topk(k, dim=-1)  # [B, T, 2H, k], sorted descending
    else:  # the score falls with the distance: take the k nearest, then score only those
        near, idx = raw.topk(k, dim=-1, largest=False)  # [B, T, 2H, k], nearest first
        top = _idw(near, eps)
    top1, top2, i1, i2 = top[:, :, :H], top[:, :, H:], idx[:, :, :H], idx[:, :, H:]
    # candidates: pair (a, b) of the per-half ranks is beaten by the (a+1)(b+1) - 1 pairs of lower
    # ranks, so only pairs with (a+1)(b+1) <= k can be in the top-k (20 of 64 for k = 8)
    a, b = _rank_pairs(k, q.device)
    cand_scores = top1.index_select(-1, a) + top2.index_select(-1, b)  # [B, T, H, P]
    cand_ids = i1.index_select(-1, a) * n + i2.index_select(-1, b)  # [B, T, H, P]
    scores, best = cand_scores.topk(k, dim=-1)  # [B, T, H, k]
    indices = cand_ids.gather(-1, best)  # [B, T, H, k]
    return ProductKeySearch(scores, indices, top, idx)


def split_halves(q: torch.Tensor) -> torch.Tensor:
    """``[B, T, H, d_k] -> [B, T, 2H, d_k/2]``: the query halves as 2H heads, half m of head h at m*H + h
    (the layout of :attr:`ProductKeySearch.sub_top` and of ``torch.cat([keys1, keys2], dim=-3)``)."""
    B, T, H, d = q.shape
    return q.unflatten(-1, (2, d // 2)).transpose(2, 3).reshape(B, T, 2 * H, d // 2)


_RANK_PAIRS: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def _rank_pairs(k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank pairs (a, b), 0-based, with (a + 1)(b + 1) <= k: the only cells of the k x k grid of
    sorted per-half candidates that can hold one of the top-k sums."""
    key = (k, str(device))
    if key not in _RANK_PAIRS:
        pairs = [(a, b) for a in range(k) for b in range(k) if (a + 1) * (b + 1) <= k]
        ab = torch.tensor(pairs, dtype=torch.long, device=device)
        _RANK_PAIRS[key] = (ab[:, 0].contiguous(), ab[:, 1].contiguous())
    return _RANK_PAIRS[key]


def pkm_topk(
    q: torch.Tensor,
    keys1: torch.Tensor,
    keys2: torch.Tensor,
    k: int,
    score: str = "idw",
    eps: float = 1e-3,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Product-key top-k: ``(weights, indices)``, both ``[B, T, H, k]``, over the N = n^2 slots.

    ``weights`` is the softmax of the selected combined scores within each head (eq 7); for IDW
    these are the normalised inverse-distance products.  See :func:`pkm_search` for arguments.
    """
    res = pkm_search(q, keys1, keys2, k, score, eps)
    return softmax_short(res.scores), res.indices


# slow reference, kept independent of the fast path it checks; same signature, so tests call both alike
def pkm_topk_reference(
    q: torch.Tensor,
    keys1: torch.Tensor,
    keys2: torch.Tensor,
    k: int,
    score: str = "idw",
    eps: float = 1e-3,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Brute force: score all N = n^2 slots and take the top-k.  Returns ``(weights, indices, scores)``.

    Memory O(B*T*H*N); for tests only.
    """
    _check_score(score)
    n, half = keys1.shape[-2], keys1.shape[-1]
    if keys1.dim() == 3:
        keys1, keys2 = keys1.unsqueeze(0), keys2.unsqueeze(0)  # [1, H, n, dh]
    q1, q2 = q[..., :half], q[..., half:]

    def half_scores(qh: torch.Tensor, kh: torch.Tensor) -> torch.Tensor:
        # direct difference form, straight from eq 20: [B, T, H, 1, dh] - [Bk, 1, H, n, dh]
        if score == "dot":
            return (qh.unsqueeze(-2) * kh.unsqueeze(1)).sum(-1)  # [B, T, H, n]
        diff = qh.unsqueeze(-2) - kh.unsqueeze(1)
        return -torch.log(eps + diff.pow(2).sum(-1))  # [B, T, H, n]

    s1, s2 = half_scores(q1, keys1), half_scores(q2, keys2)
    all_scores = (s1.unsqueeze(-1) + s2.unsqueeze(-2)).flatten(-2)  # [B, T, H, n*n], slot i*n + j
    assert all_scores.shape[-1] == n * n
    scores, indices = all_scores.topk(k, dim=-1)
    return torch.softmax(scores, dim=-1), indices, scores


def pkm_read(values: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Sparse weighted read (eq 11): ``out[..., :] = sum_j weights[..., j] * values[indices[..., j]]``.

    Args:
        values: ``[N, d_v]`` value table.
        indices: ``[..., m]`` slot ids (m = heads * top-k, summed together).
        weights: ``[..., m]`` read weights.

    Returns ``[..., d_v]``.  Uses ``F.embedding_bag`` (no ``[..., m, d_v]`` intermediate); the
    gradient w.r.t. ``values`` is the usual dense embedding gradient, so this is the read for a
    *slow* table.  Fast tables are read with :func:`gather_rows` instead (twice differentiable).
    """
    lead = indices.shape[:-1]
    m = indices.shape[-1]
    flat_idx = indices.reshape(-1, m)  # [R, m]
    flat_w = weights.reshape(-1, m).to(values.dtype)  # [R, m]
    out = F.embedding_bag(flat_idx, values, per_sample_weights=flat_w, mode="sum")  # [R, d_v]
    return out.reshape(*lead, values.shape[-1])


def pkm_read_reference(values: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Dense reference of :func:`pkm_read`: scatter the weights into ``[..., N]`` and matmul with V."""
    dense = torch.zeros(*indices.shape[:-1], values.shape[0], dtype=values.dtype, device=values.device)
    dense.scatter_add_(-1, indices, weights.to(values.dtype))  # [..., N]
    return dense @ values


def gather_rows(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``values[indices]`` for any index shape: ``[N, d] x [...] -> [..., d]`` (twice differentiable)."""
    return values.index_select(0, indices.reshape(-1)).reshape(*indices.shape, values.shape[-1])


def pkm_aggregated_grad(
    indices: torch.Tensor,
    weights: torch.Tensor,
    out_grad: torch.Tensor,
    average: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row gradient of ``L = sum_t <out_grad_t, sum_j weights_tj V[indices_tj]>`` w.r.t. V (eq 14).

    Args:
        indices: ``[..., m]`` slot ids that were read (any integer ids: global ids such as
            ``b * N + r`` work for per-sequence tables).
        weights: ``[..., m]`` read weights.
        out_grad: ``[..., d_v]`` dL/dv_hat for each read.
        average: divide each row's gradient by its read count N_r (eq 14).  Default True.

    Returns:
        ``(rows [M], grad [M, d_v], counts [M])`` for the M = ``indices.numel()`` reads, in run-start
        form (module docstring): ``rows`` the read ids sorted; at the first occurrence of each
        distinct row its (count-averaged) gradient and read count N_r, at its repeats zero.  Every
        shape depends on M only (no host sync, one graph under ``torch.compile``); memory and time
        are O(M d_v + M log M) whatever N is.  Differentiable (twice) w.r.t. weights and out_grad.
    """
    d_v = out_grad.shape[-1]
    flat_idx = indices.reshape(-1)  # [M]
    contrib = (weights.unsqueeze(-1) * out_grad.unsqueeze(-2)).reshape(-1, d_v)  # [M, d_v], read order
    rows, order = torch.sort(flat_idx, stable=True)  # [M]
    run_start = torch.searchsorted(rows, rows)  # [M]: first position of each sorted id (leftmost)
    target = torch.empty_like(order).scatter_(0, order, run_start)  # [M]: run start of each read, read order
    counts = torch.zeros_like(rows).index_add_(0, target, torch.ones_like(rows))  # N_r at run starts, else 0
    grad = contrib.new_zeros(rows.shape[0], d_v).index_add(0, target, contrib)  # [M, d_v]
    if average:
        grad = grad / counts.clamp_min(1).unsqueeze(-1).to(grad.dtype)
    return rows, grad, counts


# slow dense reference, kept independent of the sparse fast path it checks (plus n_rows: the table size)
def pkm_aggregated_grad_reference(
    indices: torch.Tensor,
    weights: torch.Tensor,
    out_grad: torch.Tensor,
    n_rows: int,
    average: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense reference of :func:`pkm_aggregated_grad`: autograd through a full ``[n_rows, d_v]`` table."""
    d_v = out_grad.shape[-1]
    table = torch.zeros(n_rows, d_v, dtype=out_grad.dtype, device=out_grad.device, requires_grad=True)
    with torch.enable_grad():
        read = (weights.unsqueeze(-1) * table[indices]).sum(-2)  # [..., d_v], eq 11
        loss = (read * out_grad.detach()).sum()
        (dense_grad,) = torch.autograd.grad(loss, table)
    counts = torch.bincount(indices.reshape(-1), minlength=n_rows)
    rows = torch.nonzero(counts).squeeze(-1)
    grad = dense_grad[rows]
    if average:
        grad = grad / counts[rows].unsqueeze(-1).to(grad.dtype)
    return rows, grad, counts[rows]


def static_shapes(t: torch.Tensor) -> bool:
    """Whether ops on ``t`` must keep data-independent shapes: on an accelerator (or the meta device)
    an op whose output size depends on the data (``nonzero``, ``unique``) is a host sync, and under
    ``torch.compile`` a graph break.  On the CPU outside compilation such an op costs nothing extra."""
    return t.device.type != "cpu" or torch.compiler.is_compiling()


def sparse_parts_add(rows: torch.Tensor, ids: torch.Tensor, parts, n_ids: int | None = None,
                     static: bool | None = None) -> torch.Tensor:
    """Add sparse row deltas to gathered rows: ``rows[i] + sum_p delta_p[ids[i]]`` (0 where absent).

    Args:
        rows: ``[R, d]`` rows already gathered from the base table.
        ids: ``[R]`` their row ids.
        parts: sequence of ``(part_rows [U], part_delta [U, d])`` in run-start form (module
            docstring: ids sorted, a row's delta at its first occurrence, zero at repeats), as
            :func:`pkm_aggregated_grad` and :func:`sparse_parts_merge` return them.
        n_ids: the number of possible row ids (ids lie in ``[0, n_ids)``), or None.  When given and
            at most 64 R, each part is looked up through a ``[n_ids]`` row -> first position map
            (O(n_ids + R) per part, no search); otherwise by binary search, O(R log U) per part.
        static: shapes independent of the data (default: :func:`static_shapes`, i.e. on a GPU or
            under ``torch.compile``): each part costs a gather of all R rows, weighted by 0/1 hits.
            Otherwise (CPU) only the hits are gathered and added, O(hits d) per part.
    Returns ``[R, d]``.  Differentiable (twice) w.r.t. ``rows`` and every ``part_delta``.
    """
    static = static_shapes(ids) if static is None else static
    use_map = n_ids is not None and n_ids <= 64 * ids.numel()
    targets, sources = [], []
    for part_rows, part_delta in parts:
        u = part_rows.numel()
        if u == 0:
            continue
        if use_map:
            first = torch.full((n_ids,), u, dtype=torch.long, device=ids.device)  # u: absent
            first.scatter_reduce_(0, part_rows, torch.arange(u, device=ids.device), reduce="amin")
            pos = first.index_select(0, ids)  # [R]: first position of each id in the part, u if absent
            hit = pos < u
            pos = pos.clamp_(max=u - 1)
        else:
            pos = torch.searchsorted(part_rows, ids).clamp_(max=u - 1)  # [R]: leftmost match if present
            hit = part_rows.index_select(0, pos) == ids
        if static:  # rows + hit * delta[pos], one fused op
            found = part_delta.index_select(0, pos).to(rows.dtype)  # [R, d]
            rows = torch.addcmul(rows, found, hit.unsqueeze(-1).to(rows.dtype))
        else:
            where = torch.nonzero(hit).squeeze(-1)  # [hits]
            targets.append(where)
            sources.append(part_delta.index_select(0, pos[where]).to(rows.dtype))  # [hits, d]
    if not targets:
        return rows
    return rows.index_add(0, torch.cat(targets), torch.cat(sources))


def sparse_parts_merge(parts) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge sparse row deltas ``[(rows [U_p], delta [U_p, d]), ...]`` into one ``(rows [M], delta [M, d])``.

    Any input with sorted or unsorted, repeated or distinct ids is summed (index_add semantics); the
    result is in run-start form (module docstring) with M = sum_p U_p (static: no host sync).
    O(M d + M log M).  Differentiable w.r.t. the deltas.
    """
    all_rows = torch.cat([r for r, _ in parts])
    deltas = torch.cat([d for _, d in parts])  # [M, d]
    merged, order = torch.sort(all_rows, stable=True)
    run_start = torch.searchsorted(merged, merged)
    target = torch.empty_like(order).scatter_(0, order, run_start)  # run start of each input entry
    return merged, deltas.new_zeros(deltas.shape).index_add(0, target, deltas)


def topk_masked_softmax(sub_scores: torch.Tensor, k: int) -> torch.Tensor:
    """Softmax over the sub-key scores that are >= the k-th largest, zero elsewhere (eq 16's s'^m).

    ``[..., n] -> [..., n]``, dense; the reference form of what :func:`marginal_entropy_topk_grad`
    computes on the top-k entries only.  Ties at the threshold can let more than k through, as in
    the released FwPKM code (on real-valued scores ties do not occur).
    """
    kth = sub_scores.detach().topk(k, dim=-1).values[..., -1:]  # [..., 1]
    masked = sub_scores.masked_fill(sub_scores < kth, float("-inf"))
    return torch.softmax(masked, dim=-1)


def marginal_entropy_topk_grad(
    top_scores: torch.Tensor, top_idx: torch.Tensor, n: int, per_sequence: bool = False, delta: float = 1e-8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Addressing loss of one half (eqs 16-17) and its gradient on the selected sub-key scores.

    With p_t = softmax of token t's top-k sub-key scores (the top-k-masked softmax over all n
    sub-keys, zero off the top-k), p_bar = mean_t p_t per head (over batch and time for a shared
    memory, over time per sequence) and L = -H(p_bar) = sum_i p_bar_i log(p_bar_i + delta).

    Args:
        top_scores: ``[B, T, H, k]`` scores of the top-k sub-keys; top_idx: ``[B, T, H, k]`` their ids.
        n: sub-keys per half.  per_sequence: one p_bar (and loss) per sequence.
    Returns:
        ``(grad [B, T, H, k], loss)``: dL/d(top_scores) and L summed over heads (and sequences).
        Everything runs on the k selected entries (the gradient is zero off them) plus ``[., H, n]``
        histograms, and is a plain differentiable expression (twice differentiable).
    """
    B, T, H, k = top_scores.shape
    p = softmax_short(top_scores)  # [B, T, H, k]
    count = T if per_sequence else B * T
    p_bh = p.permute(0, 2, 1, 3).reshape(B, H, T * k)  # [B, H, T*k]
    i_bh = top_idx.permute(0, 2, 1, 3).reshape(B, H, T * k)
    p_bar = p.new_zeros(B, H, n).scatter_add(-1, i_bh, p_bh)  # [B, H, n]
    if not per_sequence:
        p_bar = p_bar.sum(0, keepdim=True)  # [1, H, n]
    p_bar = p_bar / count
    log_p = torch.log(p_bar + delta)
    loss = (p_bar * log_p).sum()
    dl_dpbar = log_p + p_bar / (p_bar + delta)  # [Bk, H, n]
    dl_dp = dl_dpbar.expand(B, H, n).gather(-1, i_bh).view(B, H, T, k).permute(0, 2, 1, 3) / count
    # softmax backward: dL/ds_j = p_j (dL/dp_j - sum_l p_l dL/dp_l)
    return p * (dl_dp - (p * dl_dp).sum(-1, keepdim=True)), loss


def subkey_grad_topk(
    score_grad: torch.Tensor,
    top_idx: torch.Tensor,
    top_scores: torch.Tensor,
    q_half: torch.Tensor,
    keys: torch.Tensor,
    score: str = "idw",
    per_sequence: bool = False,
) -> torch.Tensor:
    """Chain rule from gradients on the selected sub-key scores to a sub-key table.

    Args:
        score_grad: ``[B, T, H, k]`` dL/ds for each token's top-k sub-keys ``top_idx`` ``[B, T, H, k]``,
            whose scores are ``top_scores`` ``[B, T, H, k]``.
        q_half: ``[B, T, H, dh]`` the matching query halves.
        keys: ``[H, n, dh]`` (shared) or ``[B, H, n, dh]`` (per sequence).
        score: ``"idw"`` or ``"dot"``.  per_sequence: keep the batch axis instead of summing it.

    Returns dL/dK with the shape of ``keys``:
    dot: sum_t G_ti q_t;  IDW: ds_i/dK_i = 2 (q - K_i) / (eps + ||q - K_i||^2), so
    sum_t c_ti 2 (q_t - K_i) with c = G * exp(s).  Twice differentiable.
    """
    _check_score(score)
    n = keys.shape[-2]
    B, T, H, k = score_grad.shape
    c = score_grad if score == "dot" else score_grad * torch.exp(top_scores)  # [B, T, H, k]
    c_dense = c.new_zeros(B, T, H, n).scatter_add(-1, top_idx, c)  # [B, T, H, n], zero off the top-k
    cq = torch.matmul(c_dense.permute(0, 2, 3, 1), q_half.permute(0, 2, 1, 3))  # [B, H, n, dh]
    if score == "dot":
        grad = cq
    else:
        k4 = keys if keys.dim() == 4 else keys.unsqueeze(0)  # [Bk, H, n, dh]
        c_sum = c_dense.sum(1)  # [B, H, n]: sum_t c_ti
        grad = 2.0 * (cq - k4 * c_sum.unsqueeze(-1))  # [B, H, n, dh]
    if not per_sequence:
        grad = grad.sum(0)  # [H, n, dh]: one shared table collects every sequence's gradient
    return grad
