"""Fast Weight Layers: a gradient-updated output head, computed in parallel as linear attention.

K. Clark, K. Guu, M.-W. Chang, P. Pasupat, G. Hinton, M. Norouzi, "Meta-Learning Fast Weight Language
Models", EMNLP 2022 (arXiv 2212.02475); the official layer is google-research/google-research ``fwl/``.

The head sits on the backbone's final hidden states h_t (row vectors, width d_in) and feeds the softmax:

    f_theta(h) = LayerNorm( ReLU(h U + a)^2 W + b )                 U [d_in, 4s], W [4s, s], gain/bias [s]
    L_t        = (w_t / Z) CE( softmax(f_theta(h_t) E + c), x_{t+1} )   E [s, V], c [V] (unembedding, slow)

On a pretrained model (``residual=True``, s = d_in) the block is a residual branch before the model's own
unembedding, logits = (h_t + f_theta(h_t)) E + c: with the LayerNorm gain and bias at 0 the head is the
identity and the logits are the pretrained model's. h does not depend on theta, so the inner-gradient
formulas below are unchanged (p_s comes from the residual logits).

Slow pass: one forward and one hand-written backward give the per-position upstream gradients
(column vectors; x^ = normalised LN input, 1/sigma its inverse std):

    e_s  = (w_s / Z)(p_s - y_s)                        w.r.t. the logits
    g3_s = E e_s                                       w.r.t. the LayerNorm output
    g2_s = (g^ - mean(g^) - x^_s mean(g^ . x^_s)) / sigma_s,   g^ = g3_s . gain     w.r.t. o_s = u_s W + b
    g1_s = (W g2_s) . 2 ReLU(z_s)                      w.r.t. z_s = h_s U + a

and the parameter gradients are rank one: dU = h_s^T g1_s, dW = u_s^T g2_s, da = g1_s, db = g2_s,
dgain = g3_s . x^_s, dbias = g3_s. Fast pass: every position t uses the weights after one SGD step on
the losses of all *strictly earlier* positions, theta'_t = theta - alpha . sum_{s<t} grad L_s, i.e.

    z'_t = h_t U + a - alpha_U sum_{s<t} (h_t . h_s) g1_s - alpha_a sum_{s<t} g1_s        u'_t = ReLU(z'_t)^2
    o'_t = u'_t W + b - alpha_W sum_{s<t} (u'_t . u_s) g2_s - alpha_b sum_{s<t} g2_s
    y'_t = (gain - alpha_g sum_{s<t} g3_s . x^_s) . LN(o'_t) + (bias - alpha_beta sum_{s<t} g3_s)
    logits'_t = y'_t E + c

The matrix sums are causal linear attention (query = fast-pass input, key = slow-pass input,
value = upstream gradient) with a *strict* mask, taken from the inclusive op
:func:`fastweights.ops.linear_attention.linear_attention` by shifting keys and values one step
right; the vector sums are exclusive cumulative sums. No per-position weight copy is ever made. A mask
that includes the diagonal would leak the label x_{t+1} into position t's own prediction.

The fast tensors are the keys of ``step_sizes`` (any of U, a, W, b, ln_weight, ln_bias and the output
bias c: a fast c alone gives logits'_t = logits_t - alpha_c sum_{s<t} e_s). Autograd differentiates
through the g's (second-order MAML with one inner step); ``first_order=True`` treats each inner gradient
(keys and values) as a constant. Z is given by the caller (``z_norm``).

Segments (the paper's Transformer-XL recipe, section 9 of the spec). Absolute stream positions are cut
into segments of ``segment_len`` tokens (0 = one endless segment). For position t in segment k

    theta'_t = theta - alpha . ( Delta_k + sum_{i in segment k, i < t} grad L_i )
    Delta_{k+1} = gamma . stopgrad(Delta_k) + stopgrad( sum_{i in segment k} grad L_i )

with one decay gamma per fast tensor and no gradient into earlier segments (``stopgrad_segments``). The
label of the last position of a segment is the first token of the next one, so its gradient joins its
own segment's sum (i <= last, never i = t). Because segments are fixed by absolute position, one call
over a text equals any split of it into calls with the deltas carried (``state``, then
:func:`fold_deltas` of the call's writes); with gamma = 1 the segmented forward equals one unsegmented
pass.

Computation of the sums: a call of at most ``chunk_size`` positions is one exact masked block,
``(q k^T * D) v`` with D the strict mask times the segment decays (the spec's G = 1 form of mixed chunk
attention); a longer call goes piece by piece through the chunked linear-attention op (memory linear in
T). Both equal :func:`fwl_recurrent_reference`, the explicit per-step weights. Arithmetic is in the
inputs' dtype (the head calls this in fp32, or fp64, with autocast off); every product with a weight goes
through :func:`fastweights.ops.linear.linear` (the machine's faster CPU GEMM, any order of autograd). Scoring
without autograd never forms the slow logits: g3 = E e_s comes from an online softmax over slices of E
(:mod:`fastweights.ops.streamed_unembedding`), the same numbers to rounding.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fastweights.ops.linear import linear
from fastweights.ops.linear_attention import linear_attention
from fastweights.ops.streamed_unembedding import unembedding_grad_streamed, unembedding_no_grad
# Fast tensors of the block, in forward order (the unembedding E, c is slow unless bias_only).
BLOCK_FAST = ("U", "a", "W", "b", "ln_weight", "ln_bias")

# ----------------------------------------------------------------------------- slow pass


class SlowPass(NamedTuple):
    """Activations of the head with the slow weights, each ``[B, N, ...]``."""

    z: Tensor  # h U + a                        [B, N, 4s]
    r: Tensor  # ReLU(z)                        [B, N, 4s]
    u: Tensor  # ReLU(z)^2                      [B, N, 4s]
    o: Tensor  # u W + b                        [B, N, s]
    xhat: Tensor  # (o - mean) * rstd           [B, N, s]
    rstd: Tensor  # 1 / sqrt(var(o) + eps)      [B, N, 1]
    y: Tensor  # LN(o) (+ h when residual), the unembedding's input   [B, N, s]
    logits: Tensor | None  # y E + c            [B, N, V] (None from slow_block)


class Upstream(NamedTuple):
    """Per-position upstream gradients of the inner loss at the slow weights (None when not needed)."""

    e: Tensor | None  # w.r.t. the logits           [B, N, V]
    g3: Tensor | None  # w.r.t. the LN output       [B, N, s]
    g2: Tensor | None  # w.r.t. o                   [B, N, s]
    g1: Tensor | None  # w.r.t. z                   [B, N, 4s]


def slow_block(h: Tensor, params: dict[str, Tensor], eps: float = 1e-5, residual: bool = False) -> SlowPass:
    """The block with the slow weights, without the unembedding: a :class:`SlowPass` whose ``logits`` is None
    and whose ``y`` is the unembedding's input (see :func:`slow_pass` for the arguments)."""
    z = linear(h, params["U"].T, params["a"])
    r = F.relu(z)
    u = r * r
    o = linear(u, params["W"].T, params["b"])
    var, mean = torch.var_mean(o, -1, unbiased=False, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    xhat = (o - mean) * rstd
    y = xhat * params["ln_weight"] + params["ln_bias"]
    if residual:
        y = y + h
    return SlowPass(z, r, u, o, xhat, rstd, y, None)


def slow_pass(h: Tensor, params: dict[str, Tensor], eps: float = 1e-5, residual: bool = False) -> SlowPass:
    """The block and unembedding with the slow weights.

    Args:
        h: ``[B, N, d_in]`` hidden states.
        params: ``U [d_in, 4s]``, ``a [4s]``, ``W [4s, s]``, ``b [s]``, ``ln_weight [s]``, ``ln_bias [s]``,
            ``E [s, V]``, ``c [V]``.
        eps: LayerNorm epsilon.
        residual: add the input to the block's output before the unembedding, ``(h + y) E + c`` (needs
            s = d_in); the head of a pretrained model, which starts as the identity when the LN gain is 0.
    """
    sp = slow_block(h, params, eps, residual)
    logits = linear(sp.y, params["E"].T, params["c"])
    return sp._replace(logits=logits)


def upstream_grads(sp: SlowPass, params: dict[str, Tensor], labels: Tensor, weights: Tensor, z_norm,
                   depth: int = 3) -> Upstream:
    """Hand-written backward of the inner loss ``(1/Z) sum w_s CE_s`` (the formulas of the docstring).

    Built from differentiable ops, so autograd differentiates through it (second order).

    Args:
        sp: the slow pass.
        labels: ``[B, N]`` label ids (any valid id where the weight is 0).
        weights: ``[B, N]`` per-position weights w (0 = no label).
        z_norm: Z, a float or a 0-d tensor.
        depth: how far back to go: 0 = e only, 1 = + g3, 2 = + g2, 3 = + g1.
    """
    probs = torch.softmax(sp.logits, dim=-1)  # [B, N, V]
    minus_onehot = torch.zeros_like(probs).scatter_(-1, labels.unsqueeze(-1), -1.0)
    e = (weights.to(probs.dtype) / z_norm).unsqueeze(-1) * (probs + minus_onehot)
    g3 = None
    if depth >= 1:
        g3 = linear(e, params["E"])  # e E^T [B, N, s]
    return Upstream(e, *block_backward(sp, params, g3, depth))


def block_backward(sp: SlowPass, params: dict[str, Tensor], g3: Tensor | None, depth: int):
    """``(g3, g2, g1)`` from g3 through the LayerNorm and the two layers, to ``depth`` (as :func:`upstream_grads`)."""
    g2 = g1 = None
    if depth >= 2:
        gh = g3 * params["ln_weight"]
        g2 = sp.rstd * (gh - gh.mean(-1, keepdim=True) - sp.xhat * (gh * sp.xhat).mean(-1, keepdim=True))
    if depth >= 3:
        g1 = linear(g2, params["W"]) * (2.0 * sp.r)  # g2 W^T [B, N, 4s], ReLU(z)^2 has slope 2 ReLU(z)
    return g3, g2, g1


def scoring_upstream(sp: SlowPass, params: dict[str, Tensor], labels: Tensor, weights: Tensor, z_norm,
                     depth: int) -> Upstream:
    """:func:`upstream_grads` without autograd or logits (``e`` None: not for a fast c; depth >= 1): g3 of the
    rows of non-zero weight from :func:`unembedding_grad_streamed`, 0 for the others (a call's last position)."""
    b, n, s = sp.y.shape
    scale = (weights.to(sp.y.dtype) / z_norm).flatten()  # [B N]
    rows = scale.nonzero().squeeze(1)
    g3 = sp.y.new_zeros(b * n, s)
    g3[rows] = unembedding_grad_streamed(sp.y.flatten(0, 1)[rows], params["E"], params["c"],
                                         labels.flatten()[rows], scale[rows])
    return Upstream(None, *block_backward(sp, params, g3.view(b, n, s), depth))


def upstream_grads_autograd(h: Tensor, params: dict[str, Tensor], labels: Tensor, weights: Tensor, z_norm,
                            eps: float = 1e-5, residual: bool = False) -> Upstream:
    """Reference for :func:`upstream_grads`: autograd of the inner loss w.r.t. zero perturbations.

    Zero tensors are added to z, o and the logits, and to a per-position copy of the LN bias;
    ``torch.autograd.grad(..., create_graph=True)`` then gives each position's upstream gradient as a
    differentiable function of the slow weights (spec section 7, implementation (a)).
    """
    b, n, _ = h.shape
    s = params["W"].shape[1]
    dz = h.new_zeros(b, n, params["U"].shape[1], requires_grad=True)
    do = h.new_zeros(b, n, s, requires_grad=True)
    dbias = h.new_zeros(b, n, s, requires_grad=True)
    dlogits = h.new_zeros(b, n, params["E"].shape[1], requires_grad=True)
    with torch.enable_grad():
        z = h @ params["U"] + params["a"] + dz
        o = F.relu(z).square() @ params["W"] + params["b"] + do
        y = F.layer_norm(o, (s,), eps=eps) * params["ln_weight"] + (params["ln_bias"] + dbias)
        if residual:
            y = y + h
        logits = y @ params["E"] + params["c"] + dlogits
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(b, n)
        loss = (weights.to(ce.dtype) * ce).sum() / z_norm
        g1, g2, g3, e = torch.autograd.grad(loss, [dz, do, dbias, dlogits], create_graph=True)
    return Upstream(e, g3, g2, g1)


# ----------------------------------------------------------------------------- fast pass


def segment_pieces(start: int, n: int, segment_len: int) -> list[tuple[int, int]]:
    """Index ranges of a call whose first position is the absolute position ``start``, cut where an
    absolute position is a multiple of ``segment_len`` (0 = no cut). The first piece continues the
    segment of ``start``."""
    if segment_len <= 0:
        return [(0, n)]
    cuts = [j for j in range(1, n) if (start + j) % segment_len == 0]
    edges = [0, *cuts, n]
    return list(zip(edges[:-1], edges[1:]))


def _decay_pow(gamma: Tensor, m: Tensor, stopgrad: bool) -> Tensor:
    """gamma^m (m >= 0 integer tensor). Under ``stopgrad`` the gradient is that of the recurrence
    Delta_k = gamma * stopgrad(Delta_{k-1}) + ...: only the last factor gamma is differentiated."""
    m = m.to(gamma.dtype)
    if not stopgrad or not (torch.is_grad_enabled() and gamma.requires_grad):
        return gamma**m
    return torch.where(m > 0, gamma * gamma.detach() ** (m - 1).clamp_min(0), torch.ones_like(m))


def _cross_boundary(base: Tensor | None, carry: Tensor | None, gamma: Tensor | None, stopgrad: bool) -> Tensor:
    """The delta after a segment boundary: ``gamma Delta + (finished segment sum)``, with the finished sum
    ``carry - base`` (``carry`` alone when ``base`` is None, i.e. zeros); both detached when ``stopgrad``."""
    finished = carry if base is None else carry - base  # the gradient sum of the segment just ended
    old = base
    if stopgrad:
        finished = finished.detach()
        old = None if old is None else old.detach()
    return finished if old is None else gamma * old + finished


def _strict_attention(q: Tensor, k: Tensor, v: Tensor, carry: Tensor | None, chunk_size: int):
    """``o_t = q_t C + sum_{s<t} (q_t . k_s) v_s`` over one segment piece, through the chunked op.

    q, k: ``[B, n, K]``; v: ``[B, n, V]``; carry C: ``[B, K, V]`` or None (zeros). The strict mask comes
    from the inclusive op by shifting keys and values one step right (position 0 sees only C). Also
    returns ``C + sum_s k_s^T v_s`` (the op's final state plus the last position's own write).
    """
    k_shift = F.pad(k[:, :-1], (0, 0, 1, 0))  # [B, n, K], k_shift[t] = k[t-1], k_shift[0] = 0
    v_shift = F.pad(v[:, :-1], (0, 0, 1, 0))  # [B, n, V]
    o, state = linear_attention(
        q.unsqueeze(2), k_shift.unsqueeze(2), v_shift.unsqueeze(2),  # [B, n, H=1, D]
        scale=1.0,
        initial_state=None if carry is None else carry.unsqueeze(1),  # [B, 1, K, V]
        output_final_state=True,
        chunk_size=chunk_size,
    )
    state = state[:, 0] + k[:, -1].unsqueeze(-1) * v[:, -1].unsqueeze(-2)  # [B, K, V]
    return o[:, :, 0], state


def _exclusive_prefix(v: Tensor, carry: Tensor | None):
    """``o_t = C + sum_{s<t} v_s`` over one piece (v ``[B, n, D]``), and ``C + sum_s v_s``."""
    o = F.pad(v[:, :-1].cumsum(1), (0, 0, 1, 0))  # [B, n, D], row 0 = 0
    total = v.sum(1)
    if carry is not None:
        o = o + carry.unsqueeze(1)
        total = total + carry
    return o, total


def _segmented_sum(q: Tensor | None, k: Tensor | None, v: Tensor, base: Tensor | None, carry: Tensor | None,
                   pieces: list[tuple[int, int]], gamma: Tensor | None, stopgrad: bool, chunk_size: int):
    """Running gradient sums of one fast tensor, piece by piece (the recurrence as written).

    For a matrix tensor (q, k given) position t gets ``q_t (Delta_k + sum_{i in seg, i<t} k_i^T v_i)``;
    for a vector tensor ``Delta_k + sum_{i in seg, i<t} v_i``. At each piece after the first a segment
    boundary is crossed: ``Delta <- gamma Delta + (finished segment sum)``, detached when ``stopgrad``.

    Returns ``(out [B, N, V], base, carry)``: the running sums per position, then Delta of the last
    segment and Delta plus that segment's sum (None = zeros).
    """
    outs = []
    for i, (lo, hi) in enumerate(pieces):
        if i > 0:  # a segment boundary at position lo
            base = carry = _cross_boundary(base, carry, gamma, stopgrad)
        if q is None:
            out, carry = _exclusive_prefix(v[:, lo:hi], carry)
        else:
            out, carry = _strict_attention(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], carry, chunk_size)
        outs.append(out)
    return torch.cat(outs, 1), base, carry


def _vector_block(v: Tensor, base: Tensor | None, carry: Tensor | None, pieces: list[tuple[int, int]],
                  segment_len: int, gamma: Tensor | None, stopgrad: bool) -> Tensor:
    """The same sums as :func:`_segmented_sum` for vector tensors, all pieces at once.

    ``v [B, N, D]``; position t gets ``C_p(t) + sum_{start(p(t)) <= i < t} v_i``, where C_p, the delta
    carried into piece p, follows the segment recurrence over the (few) pieces. Every piece but the
    first and the last is one whole segment, so zero-padding the first piece at the front and the last
    at the end lays the pieces on a ``[B, P, L, D]`` grid (a view, no gather): the sums run along L and
    no value (or gradient) of one piece passes through another's sum.
    """
    b, n, d = v.shape
    if len(pieces) == 1:
        out = F.pad(v[:, :-1].cumsum(1), (0, 0, 1, 0))  # [B, N, D], exclusive prefix, row 0 = 0
        return out if carry is None else out + carry.unsqueeze(1)
    seg = segment_len
    front = seg - (pieces[0][1] - pieces[0][0])
    back = seg - (pieces[-1][1] - pieces[-1][0])
    padded = F.pad(v, (0, 0, front, back)) if front or back else v  # aligned calls need no padding
    grid = padded.view(b, len(pieces), seg, d)  # [B, P, L, D]
    # exclusive prefix within each piece, from a shifted cumsum: "inclusive minus self" would let
    # position t's own value move its output by rounding (t must not see its own label at all)
    excl = F.pad(grid[:, :, :-1].cumsum(2), (0, 0, 1, 0))  # [B, P, L, D], row 0 = 0
    totals = excl[:, :, -1] + grid[:, :, -1]  # [B, P, D], each piece's sum (the padding adds zeros)
    carried = []
    for p in range(len(pieces)):
        if p > 0:  # boundary: Delta <- gamma Delta + (finished segment sum)
            base = carry = _cross_boundary(base, carry, gamma, stopgrad)
        carried.append(torch.zeros_like(totals[:, 0]) if carry is None else carry)
        carry = totals[:, p] if carry is None else carry + totals[:, p]
    excl += torch.stack(carried, 1).unsqueeze(2)  # [B, P, L, D]
    return excl.reshape(b, len(pieces) * seg, d)[:, front : front + n]  # [B, N, D]


def _matrix_block(q: Tensor, k: Tensor, v: Tensor, base: Tensor | None, carry: Tensor | None,
                  pieces: list[tuple[int, int]], gamma: Tensor | None, stopgrad: bool) -> Tensor:
    """The same sums as :func:`_segmented_sum` for a matrix tensor, as one exact masked block.

    ``o = (q k^T * D) v + (read of the carried deltas)``, where ``D[t, i]`` is 1 for an earlier position
    of t's piece, ``gamma^(p(t) - 1 - p(i))`` for a position of an earlier piece, 0 otherwise (i >= t):
    the strict mask with the segment decays folded in. Piece p >= 1 reads the carried deltas as
    ``gamma^p base + gamma^(p-1) (carry - base)``. Costs O(N^2 (K + V)) per sequence and never forms a
    K x V matrix inside the call; used for calls of at most ``chunk_size`` positions.
    """
    n = q.shape[1]
    pid = torch.zeros(n, dtype=torch.long, device=q.device)
    for p, (lo, hi) in enumerate(pieces):
        pid[lo:hi] = p
    idx = torch.arange(n, device=q.device)
    same = ((pid[:, None] == pid[None, :]) & (idx[None, :] < idx[:, None])).to(q.dtype)  # [N, N], strict
    if len(pieces) == 1:
        out = (q @ k.transpose(1, 2) * same) @ v  # [B, N, V]
    else:
        earlier = pid[None, :] < pid[:, None]  # [N, N]
        m = (pid[:, None] - 1 - pid[None, :]).clamp_min(0)
        decay = _decay_pow(gamma, m, stopgrad) * earlier.to(q.dtype)  # [N, N]
        if stopgrad and torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            # earlier segments enter as constants: their keys and values get no gradient (q still does)
            out = (q @ k.transpose(1, 2) * same) @ v + (q @ k.detach().transpose(1, 2) * decay) @ v.detach()
        else:  # one product with the combined mask
            out = (q @ k.transpose(1, 2) * (same + decay)) @ v
    if carry is not None:
        qc = q @ carry  # [B, N, V]
        if len(pieces) == 1:
            return out + qc
        # piece 0 reads carry; piece p >= 1 reads gamma^p base + gamma^(p-1) (carry - base)
        w_carry = _decay_pow(gamma, (pid - 1).clamp_min(0), stopgrad)
        w_carry = torch.where(pid == 0, torch.ones_like(w_carry), w_carry)[:, None]  # [N, 1]
        out = out + w_carry * qc
        if base is not None:
            w_base = _decay_pow(gamma, pid, stopgrad)[:, None] - w_carry
            out = out + w_base * (q @ base)
    return out


def fold_deltas(base: Tensor | None, carry: Tensor | None, k: Tensor | None, v: Tensor,
                pieces: list[tuple[int, int]], gamma: Tensor | None) -> tuple[Tensor | None, Tensor]:
    """Add the gradients of a run of positions to the running deltas of one fast tensor (no autograd).

    ``k [B, N, K]``, ``v [B, N, V]`` for a matrix tensor (each position writes k^T v), ``k = None`` and
    ``v [B, N, D]`` for a vector. Applies ``Delta <- gamma Delta + (finished segment sum)`` at each
    boundary between pieces, as ``carry + (gamma - 1) Delta``, and adds each piece's ``k^T v`` in the same
    op (``baddbmm``): a few passes over a K x V matrix, never one of the inputs changed in place. Returns the
    new ``(base, carry)`` at the last piece.
    """
    for i, (lo, hi) in enumerate(pieces):
        if i > 0:  # Delta <- gamma Delta + (carry - Delta), the finished segment's sum added
            base = carry = carry if base is None else torch.addcmul(carry, base, gamma - 1)
        if k is None:
            total = v[:, lo:hi].sum(1)
            carry = total if carry is None else carry + total
        else:
            k_t, v_p = k[:, lo:hi].transpose(1, 2), v[:, lo:hi]  # [B, K, n], [B, n, V]
            carry = k_t @ v_p if carry is None else torch.baddbmm(carry, k_t, v_p)
    return base, carry


def fwl_parallel(
    h: Tensor,
    labels: Tensor,
    weights: Tensor,
    params: dict[str, Tensor],
    step_sizes: dict[str, Tensor],
    *,
    z_norm=1.0,
    eps: float = 1e-5,
    chunk_size: int = 256,
    segment_len: int,
    start: int = 0,
    decays: dict[str, Tensor] | None = None,
    state: dict | None = None,
    stopgrad_segments: bool = True,
    first_order: bool = False,
    upstream: str = "manual",
    residual: bool = False,
    logits_from: int = 0,
) -> tuple[Tensor, dict]:
    """FWL logits for every position, in parallel (slow pass, hand-written backward, fast pass).

    Args:
        h: ``[B, N, d_in]`` hidden states.
        labels: ``[B, N]`` the label of each position (the next token).
        weights: ``[B, N]`` inner-loss weight of each position (0 for a position without label).
        params: the slow weights, as :func:`slow_pass`.
        step_sizes: alpha per fast tensor; the keys name the fast tensors (any of ``U, a, W, b,
            ln_weight, ln_bias, c``).
        z_norm: inner-loss normaliser Z (float or 0-d tensor).
        eps: LayerNorm epsilon.
        chunk_size: calls of at most this many positions are one exact masked block (quadratic in N);
            longer calls go through the chunked linear-attention op with chunks of this length, so
            memory stays linear in N.
        segment_len, start, decays: segments of ``segment_len`` absolute positions (0 = none; required, with
            no default here: the layer's default is ``FWLOptions.segment_len``, a recipe's its own); ``start``
            is the absolute position of ``h[:, 0]``; ``decays`` gamma per fast tensor (needed when a call
            crosses a segment boundary).
        state: ``{"base": {...}, "carry": {...}}`` running deltas of the segment of ``start`` carried in
            from earlier positions (None = none): Delta_k and Delta_k plus the gradients of the
            segment's positions before ``start``, each ``[B, *tensor shape]``.
        stopgrad_segments: no gradient into earlier segments.
        first_order: treat the inner gradients (keys and values) as constants.
        upstream: ``"manual"`` (hand-written backward) or ``"autograd"`` (the reference).
        residual: the block's output is added to its input, ``(h + y') E + c`` (see :func:`slow_pass`); the
            inner-gradient formulas are unchanged (h does not depend on the fast tensors).
        logits_from: the first position whose logits are computed and returned (the head's position carried
            from its previous call, already scored there, needs none).

    Without autograd (``torch.no_grad()``, scoring) the slow logits are never formed: the inner gradient
    through the unembedding comes from :func:`scoring_upstream` (unless c is fast, whose update needs them).

    Returns:
        ``(logits' [B, N - logits_from, V], writes)``; ``writes[name] = (k or None, v)`` are the detached
        per-position gradient factors of each fast tensor, for :func:`fold_deltas`.
    """
    fast = set(step_sizes)
    unknown = fast - set(BLOCK_FAST) - {"c"}
    if unknown:
        raise ValueError(f"unknown fast tensors {sorted(unknown)}")
    depth = 3 if fast & {"U", "a"} else 2 if fast & {"W", "b"} else 1 if fast & {"ln_weight", "ln_bias"} else 0
    if upstream not in ("manual", "autograd"):
        raise ValueError(f"upstream must be 'manual' or 'autograd', got {upstream!r}")
    scoring = not torch.is_grad_enabled() and upstream == "manual" and depth >= 1 and "c" not in fast
    sp = slow_block(h, params, eps, residual) if scoring else slow_pass(h, params, eps, residual)
    with torch.set_grad_enabled(torch.is_grad_enabled() and not first_order):
        if scoring:
            g = scoring_upstream(sp, params, labels, weights, z_norm, depth)
        elif upstream == "autograd":
            g = upstream_grads_autograd(h, params, labels, weights, z_norm, eps, residual)
        else:
            g = upstream_grads(sp, params, labels, weights, z_norm, depth)
    keys = {"h": h, "u": sp.u, "xhat": sp.xhat}
    if first_order:  # the whole inner gradient k_s^T v_s is a constant
        keys = {name: t.detach() for name, t in keys.items()}
        g = Upstream(*(None if t is None else t.detach() for t in g))
    n = h.shape[1]
    pieces = segment_pieces(start, n, segment_len)
    if len(pieces) > 1 and decays is None:
        raise ValueError("a call that crosses a segment boundary needs decays")
    base_in = (state or {}).get("base", {})
    carry_in = (state or {}).get("carry", {})
    writes = {}

    # Vector tensors: every value comes from the slow pass, so all their running sums are computed at
    # once, concatenated along the feature axis (one exclusive prefix per piece, not one per tensor).
    vec_values = {"a": g.g1, "b": g.g2, "ln_weight": None if g.g3 is None else g.g3 * keys["xhat"],
                  "ln_bias": g.g3, "c": g.e}
    vec_names = [name for name in vec_values if name in fast]
    vec_sums = {}
    if vec_names:
        values = [vec_values[name] for name in vec_names]
        widths = [v.shape[-1] for v in values]
        for name, v in zip(vec_names, values):
            writes[name] = (None, v.detach())

        def cat(table):
            parts = [table.get(name) for name in vec_names]
            if all(p is None for p in parts):
                return None
            return torch.cat([p if p is not None else v.new_zeros(v.shape[0], v.shape[-1])
                              for p, v in zip(parts, values)], -1)

        gamma = None
        if decays is not None:  # one decay per tensor, repeated over its features
            gamma = torch.cat([decays[name].expand(w) for name, w in zip(vec_names, widths)])
        if n <= chunk_size:
            out = _vector_block(torch.cat(values, -1), cat(base_in), cat(carry_in), pieces, segment_len, gamma,
                                stopgrad_segments)
        else:
            out, _, _ = _segmented_sum(None, None, torch.cat(values, -1), cat(base_in), cat(carry_in), pieces, gamma,
                                       stopgrad_segments, chunk_size)
        vec_sums = dict(zip(vec_names, out.split(widths, -1)))

    def matrix_term(name, q, k, v):
        gamma = None if decays is None else decays[name]
        writes[name] = (k.detach(), v.detach())
        if n <= chunk_size:
            out = _matrix_block(q, k, v, base_in.get(name), carry_in.get(name), pieces, gamma, stopgrad_segments)
        else:
            out, _, _ = _segmented_sum(q, k, v, base_in.get(name), carry_in.get(name), pieces, gamma,
                                       stopgrad_segments, chunk_size)
        return step_sizes[name] * out

    def vector_term(name):
        return step_sizes[name] * vec_sums[name]

    # layer 1: the fast pass sees the same input h, so reuse the slow z and subtract the corrections
    z = sp.z
    if "U" in fast:
        z = z - matrix_term("U", h, keys["h"], g.g1)
    if "a" in fast:
        z = z - vector_term("a")
    if z is sp.z:
        u = sp.u
    else:
        u = F.relu(z)
        u = u * u
    # layer 2: query u'_t from the fast pass, keys u_s from the slow pass
    o = sp.o if u is sp.u else linear(u, params["W"].T, params["b"])
    if "W" in fast:
        o = o - matrix_term("W", u, keys["u"], g.g2)
    if "b" in fast:
        o = o - vector_term("b")
    xhat = sp.xhat if o is sp.o else F.layer_norm(o, (o.shape[-1],), eps=eps)
    gain, bias = params["ln_weight"], params["ln_bias"]
    if "ln_weight" in fast:
        gain = gain - vector_term("ln_weight")
    if "ln_bias" in fast:
        bias = bias - vector_term("ln_bias")
    if xhat is sp.xhat and "ln_weight" not in fast and "ln_bias" not in fast:
        logits = sp.logits[:, logits_from:]
    else:
        y = (xhat * gain + bias)[:, logits_from:]  # gain and bias are per position when fast
        y = y + h[:, logits_from:] if residual else y
        logits = (unembedding_no_grad(y.flatten(0, 1), params["E"], params["c"]) if scoring
                  else linear(y.flatten(0, 1), params["E"].T, params["c"])).view(*y.shape[:-1], -1)  # [B, N', V]
    if "c" in fast:
        logits = logits - vector_term("c")[:, logits_from:]
    return logits, writes


# slow reference, kept independent of the fast path it checks; it takes fwl_parallel's leading arguments
def fwl_recurrent_reference(
    h: Tensor,
    labels: Tensor,
    weights: Tensor,
    params: dict[str, Tensor],
    step_sizes: dict[str, Tensor],
    *,
    z_norm=1.0,
    eps: float = 1e-5,
    segment_len: int,
    start: int = 0,
    decays: dict[str, Tensor] | None = None,
    residual: bool = False,
) -> Tensor:
    """Per-step reference, straight from the definition: explicit fast weights, one position at a time.

    For each row b and position t: ``theta'_t = theta - alpha . (Delta_k + partial)``, output
    ``f_{theta'_t}(h_t) E + c``, then ``partial += grad_theta (w_t / Z) CE_t(theta)`` (autograd at the
    slow weights); at a segment boundary ``Delta <- gamma Delta + partial, partial <- 0``. This is also
    the paper's generation procedure. Slow, for tests only. Returns ``[B, N, V]``.
    """
    fast = list(step_sizes)
    outs = []
    for row in range(h.shape[0]):
        base = {n: torch.zeros_like(params[n]) for n in fast}
        partial = {n: torch.zeros_like(params[n]) for n in fast}
        row_out = []
        for t in range(h.shape[1]):
            if segment_len > 0 and t > 0 and (start + t) % segment_len == 0:
                base = {n: decays[n] * base[n] + partial[n] for n in fast}
                partial = {n: torch.zeros_like(params[n]) for n in fast}
            theta = dict(params)
            for n in fast:
                theta[n] = params[n] - step_sizes[n] * (base[n] + partial[n])
            row_out.append(slow_pass(h[row, t].view(1, 1, -1), theta, eps, residual).logits[0, 0])
            with torch.enable_grad():
                leaves = {n: params[n].detach().requires_grad_(True) for n in fast}
                theta = {**params, **leaves}
                logits = slow_pass(h[row, t].view(1, 1, -1).detach(), theta, eps, residual).logits[0, 0]
                loss = weights[row, t] * F.cross_entropy(logits[None], labels[row, t].view(1)) / z_norm
                grads = torch.autograd.grad(loss, [leaves[n] for n in fast])
            partial = {n: partial[n] + gr for n, gr in zip(fast, grads)}
        outs.append(torch.stack(row_out))
    return torch.stack(outs)
