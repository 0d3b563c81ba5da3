"""What FwPKM and FwMLP share (Zhao & Jones 2026, arXiv 2601.00671): the slow projections around a
fast-weight memory, the options both take, and the protocol by which both read and write.

Per token h_t (the residual stream entering the layer)::

    (8)  q_t = Linear^q(RMSNorm^q(h_t))
    (9)  v_t = Linear^v(RMSNorm^v(h_t)),  v_t <- (v_t - mean(v_t)) / (std(v_t) + 1e-6)
    (10) g_t = sigmoid(Linear^g(RMSNorm^g(h_t)))            one scalar per token
    (12) o_t = g_t v_hat_t + (1 - g_t) v_t,   y_t = Linear^o(RMSNorm^o(o_t))

where v_hat_t is the memory's read (FwPKM: a product-key lookup, ``layers/fwpkm.py``; FwMLP: a fast
MLP, ``layers/fwmlp.py``). RMSNorm here is the offset form of the paper's Qwen3-Next backbone, scale
(1 + w) with w from zero.

The protocol (the paper's sections 2-3 and its released code; docs/product-key-memory.md compares them):

* Token t is read with the memory as written so far; after every chunk of C read tokens the memory is
  written, query t paired with the value of token t + L (``lookahead`` L). Chunks are counted along the
  stream: a write happens exactly when C tokens have been read since the last one, whatever the call
  boundaries are (:func:`piece_sizes`), so streaming calls of any length equal one call.
* ``boundary="carry"`` (default): the last L queries of a chunk have no target yet; they stay queued
  and are written with the next chunk (re-read with the memory of that moment), so no pair is lost at a
  chunk boundary -- what the released inference queue does. ``"drop"`` discards them, as the released
  training forward does (:meth:`FastMemoryOptions.carried`).
* Training backpropagates through every inner update (``second_order``; False detaches them): each
  write is a plain differentiable expression. ``frozen`` never writes (the paper's frozen-memory check).
* Fast weights live in fp32 (fp64 for fp64 inputs, for exactness tests) and their arithmetic runs with
  autocast disabled.
* The initial fast weights are buffers (not Parameters): the outer optimiser never sees them, as in
  the released code, which drops them from AdamW. Neither memory adds an outer loss (``aux_loss`` is None).

State and reset (``persistence``, :data:`PERSISTENCE`):

* ``"stream"`` (default): one memory shared by the batch; ``state=None`` starts from the initial fast
  weights, so a caller resets per document by passing ``state=None`` at its start, or never by
  carrying the returned state.
* ``"official"``: as the released code, the final fast weights are also written back into the module
  after every forward, and ``state=None`` starts from them: memory persists across batches and is
  never reset (call the layer's ``reset_memory`` to reset it).
* ``"per_sequence"``: every sequence of the batch has its own fast weights (TTT/LaCT style).

Padding (``attention_mask`` [B, T], 0 = padding; :func:`padded_forward`): a padded position is never read
into a write (never queued, never a target), and chunks count real tokens only, so each row's writes fall
where they fall alone. With ``"per_sequence"`` each row's real tokens run alone from the row's own state,
and the returned state is a :class:`PerRowState` (one state per row; later calls, padded or not, run row by
row from it). A shared memory (``"stream"``, ``"official"``) is one memory written by the whole batch, so a
padded row cannot be "alone" in it: padding is accepted where it falls on the same positions in every row
(e.g. batch 1), which are then left out of the call, and refused otherwise with a one-line error.

The slow references both memories are tested against, written from the equations, are in
``layers/fast_memory_reference.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch import nn

from fastweights.core.errors import UserError
from fastweights.ops.linear import Linear, linear

PERSISTENCE = ("stream", "official", "per_sequence")


@dataclass
class FastMemoryOptions:
    """The options FwPKM and FwMLP share, with the paper's defaults (``FwPKMOptions`` and ``FwMLPOptions``
    say what each means for that memory and add their own): ``d_key`` / ``d_value`` the query and read
    widths, ``chunk_size`` C (tokens between writes), ``lookahead`` L (query t is paired with the value of
    t + L), ``boundary`` "carry"/"drop", ``value_norm``, ``gating``, ``gate_weighted_loss``, ``gate_form``,
    ``persistence``, ``second_order``, ``frozen`` (never writes), ``norm_eps``."""

    d_key: int = 512
    d_value: int = 512
    chunk_size: int = 512
    lookahead: int = 1
    boundary: str = "carry"
    value_norm: bool = True
    gating: bool = True
    gate_weighted_loss: bool = True
    gate_form: str = "linear"
    persistence: str = "stream"
    second_order: bool = True
    frozen: bool = False
    norm_eps: float = 1e-6

    def carried(self) -> int:
        """Queued tokens kept for the next write at a chunk boundary: L with ``boundary="carry"``, else 0."""
        return self.lookahead if (self.boundary == "carry" and self.lookahead > 0) else 0


def validate_options(name: str, o: FastMemoryOptions, checks: list[tuple[bool, str]]) -> None:
    """UserError ``"NAME: message"`` for the first failed check: the memory's own ``checks``, then those of
    the options every fast memory takes."""
    checks = checks + [
        (o.lookahead >= 0, f"lookahead must be >= 0, got {o.lookahead}"),
        (o.chunk_size > o.lookahead, f"chunk_size ({o.chunk_size}) must exceed lookahead ({o.lookahead})"),
        (o.boundary in ("carry", "drop"), f"boundary must be 'carry' or 'drop', got {o.boundary!r}"),
        (o.persistence in PERSISTENCE, f"persistence must be one of {', '.join(PERSISTENCE)}, got {o.persistence!r}"),
    ]
    for ok, msg in checks:
        if not ok:
            raise UserError(f"{name}: {msg}")


def piece_sizes(T: int, n_read: int, chunk_size: int, frozen: bool) -> list[int]:
    """How a call of ``T`` tokens is cut: up to each chunk end (where a write follows), then the rest.

    ``n_read``: tokens read since the last write before this call; a frozen memory never writes, so its
    call is one piece."""
    takes, done = [], 0
    while done < T:
        take = T - done if frozen else min(T - done, chunk_size - n_read)
        takes.append(take)
        done, n_read = done + take, (n_read + take) % chunk_size
    return takes


def call_state(layer, q: torch.Tensor, state):
    """``(dtype, state)`` a fast-memory call starts from: the fast dtype of ``q`` and ``state``, or the layer's
    fresh state when None; raises UserError when the state is for another batch size than ``q [B, T, ...]``."""
    dtype = fast_dtype(q)
    st = state if state is not None else layer.init_state(q.shape[0], q.device, dtype)
    if st.batch != q.shape[0]:
        raise UserError(f"{type(layer).__name__} state is for batch size {st.batch}, got input of batch size {q.shape[0]}")
    return dtype, st


def padded_forward(layer, x: torch.Tensor, state, mask: torch.Tensor | None):
    """A fast memory's forward on a padded batch (see the module docstring): ``(y [B, T, d], state)``, zero
    output at padding. ``mask`` None continues a :class:`PerRowState` row by row."""
    from fastweights.layers.common import per_row

    B, T = x.shape[:2]
    name = type(layer).__name__
    if mask is None:
        mask = torch.ones(B, T, dtype=torch.bool, device=x.device)
    if layer.options.persistence == "per_sequence":
        if state is None:
            rows = [None] * B
        elif isinstance(state, PerRowState):
            if len(state.rows) != B:
                raise UserError(f"{name} state is for batch size {len(state.rows)}, got input of batch size {B}")
            rows = list(state.rows)
        else:  # a batched per-sequence state (read unpadded so far): each row's own part
            rows = [state.row(b) for b in range(B)]
        y, rows = per_row(lambda xb, sb: layer(xb, sb), x, mask, rows)
        return y, PerRowState(tuple(rows))
    if not bool((mask == mask[:1]).all()):
        raise UserError(f"{name.lower()}: a padded batch whose rows differ needs persistence = \"per_sequence\" (with "
                        "\"stream\" or \"official\" the batch writes into one shared memory, so no row reads it "
                        "alone); use prompts of equal length or per_sequence")
    keep = mask[0].nonzero().squeeze(1)
    y_kept, state = layer(x[:, keep], state)
    y = y_kept.new_zeros(B, T, y_kept.shape[-1])
    y[:, keep] = y_kept
    return y, state


def state_pytree(cls):
    """Register a state dataclass as a pytree node (every field a child), so generic state
    utilities such as ``tree_map(detach, state)`` reach the tensors inside it."""
    names = [f.name for f in dataclasses.fields(cls)]
    pytree.register_pytree_node(
        cls,
        lambda s: ([getattr(s, n) for n in names], names),
        lambda children, ctx: cls(**dict(zip(ctx, children))),
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
    )
    return cls


@state_pytree
@dataclass
class PerRowState:
    """The state of a part run row by row after a padded call (a per-sequence fast memory; the FWL head): each
    row's own state (batch 1), None for a row that has read nothing yet. Rows have read different numbers of
    real tokens, so their chunk and position counters differ and cannot be one batched state. Beam search
    reorders its rows (``hf.ours_as_transformers.select_sequences``)."""

    rows: tuple

    @property
    def batch(self) -> int:
        return len(self.rows)

    def detach(self) -> "PerRowState":
        return PerRowState(tuple(None if r is None else r.detach() for r in self.rows))


class OffsetRMSNorm(nn.Module):
    """RMSNorm with scale (1 + w), w initialised to zero (as in the paper's Qwen3-Next backbone).

    Normalises in fp32 and returns the input dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """x / rms(x) in fp32 (fp64 for fp64), before the gain."""
        xf = x.to(fast_dtype(x))
        # (x * x).sum / d rather than x.pow(2).mean: the same value, a cheaper backward on CPU
        return xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) / xf.shape[-1] + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.normalize(x)
        return (y * (1.0 + self.weight.to(y.dtype))).to(x.dtype)


def fast_dtype(x: torch.Tensor) -> torch.dtype:
    """Fast-weight arithmetic dtype: fp32, or fp64 when the inputs are fp64 (exactness tests)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def zscore(v: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(v - mean) / (std + eps) over the last axis; std is unbiased, as ``torch.std`` in the code.

    Written out rather than calling ``torch.std`` (whose CPU kernel is much slower at these widths),
    with sums rather than means (mean's backward is the slower one)."""
    c = v - v.sum(-1, keepdim=True) / v.shape[-1]
    return c / ((c * c).sum(-1, keepdim=True).div(v.shape[-1] - 1).sqrt() + eps)


class FastMemoryIO(nn.Module):
    """The slow part shared by FwPKM and FwMLP: q/v/gate projections (eqs 8-10) and output (eq 12).

    ``gate_form="linear"``: Linear(d, 1); ``"mean8"``: Linear(d, 8) then the mean of the 8 outputs,
    as the released code (a workaround for a compiler limitation).
    """

    def __init__(self, d_model: int, d_query: int, d_value: int, *, value_norm: bool, gating: bool,
                 gate_form: str, norm_eps: float):
        super().__init__()
        if gate_form not in ("linear", "mean8"):
            raise UserError(f"gate_form must be 'linear' or 'mean8', got {gate_form!r}")
        self.value_norm = value_norm
        self.gating = gating
        self.q_norm = OffsetRMSNorm(d_model, norm_eps)
        self.q_proj = Linear(d_model, d_query)
        self.v_norm = OffsetRMSNorm(d_model, norm_eps)
        self.v_proj = Linear(d_model, d_value)
        self.g_norm = OffsetRMSNorm(d_model, norm_eps)
        self.g_proj = Linear(d_model, 1 if gate_form == "linear" else 8)
        self.out_norm = OffsetRMSNorm(d_value, norm_eps)
        self.out_proj = Linear(d_value, d_model)

    def inputs(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h ``[B, T, d]`` -> q ``[B, T, d_query]``, v ``[B, T, d_value]``, g ``[B, T]`` in (0, 1).

        Equal to ``q_proj(q_norm(h))``, ``v_proj(v_norm(h))``, ``g_proj(g_norm(h))``, computed as one
        normalisation and one matmul: the three norms differ only in their gains (1 + w), and a gain
        on the input of a projection is a column scaling of its weight. The three norms share one eps.
        """
        norms = (self.q_norm, self.v_norm, self.g_norm)
        projs = (self.q_proj, self.v_proj, self.g_proj)
        xhat = self.q_norm.normalize(h).to(h.dtype)  # [B, T, d]
        weight = torch.cat([p.weight * (1.0 + n.weight).to(p.weight.dtype) for n, p in zip(norms, projs)])
        bias = torch.cat([p.bias for p in projs])
        q, v, g_logits = linear(xhat, weight, bias).split([p.out_features for p in projs], -1)
        if self.value_norm:
            v = zscore(v.to(fast_dtype(v)))
        g = torch.sigmoid(g_logits.to(fast_dtype(g_logits)).mean(-1))  # [B, T]
        return q, v, g

    def output(self, v_hat: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Gated residual (eq 12) and output projection; without gating o = v_hat + v (the code's ablation)."""
        if self.gating:
            gu = g.unsqueeze(-1)
            vf = v.to(v_hat.dtype)
            o = vf + gu * (v_hat - vf)  # = g v_hat + (1 - g) v, one product fewer
        else:
            o = v_hat + v.to(v_hat.dtype)
        # out_proj(out_norm(o)) with the norm's gain (1 + w) folded into the weight's columns
        gain = (1.0 + self.out_norm.weight).to(self.out_proj.weight.dtype)
        return linear(self.out_norm.normalize(o), self.out_proj.weight * gain, self.out_proj.bias)

