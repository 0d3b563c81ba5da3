"""Fast-weight Product Key Memory (FwPKM), Zhao & Jones 2026, arXiv 2601.00671.

A product-key memory (Lample et al. 2019) whose keys and values are *fast* weights: they are
rewritten while the model reads, after every chunk of C tokens, so a chunk only ever reads memory
written by earlier chunks.  Per token h_t (the residual stream entering the layer), with q_t, v_t, g_t
and the output y_t of eqs 8-10 and 12 (``layers/fast_memory.py``)::

    (11) v_hat_t = sum_{(i,j) in I_t} s'_ij V[i n + j]     (product-key top-k, IDW scores, eq 20)

After each chunk, with lookahead L (= 1) pairing query t with the value of token t + L::

    (19) L_mem = sum_t 1/2 g_t ||v_{t+L} - v_hat_t||^2        (sum over tokens and features)
    (14) grad_r = (1 / N_r) dL_mem/dV_r                        (N_r = reads of row r by those queries)
    (15) V_r <- V_r - eta * scale * grad_r                      (scale = k H "rewrite" or 1 "literal")
    (16) p_bar^m = mean_t s'^m_t   (top-k-masked softmax over all n sub-keys of half m)
    (17) L_addr = -H(p_bar^1) - H(p_bar^2)
    (18) K^m <- K^m - eta_K w_addr dL_addr/dK^m

"rewrite" is the scale the released code applies (derived in the project spec, section 4): with
near-uniform weights s' ~ 1/(kH) a unit step moves v_hat onto its target.

Chunking along the stream, the boundary carry, second-order training, fp32 fast weights and the
``persistence`` modes are the protocol both fast memories follow (``layers/fast_memory.py``). What is
FwPKM's own (the paper's choices are in its sections 2-3 and the released code;
docs/product-key-memory.md compares them):

* The addressing loss averages over the queries written in this chunk (the pairs' query side).
* The value write touches only the rows read, and each write is kept as a sparse row delta on top
  of the initial table (never a dense copy of the N x d_v table, never a dense gradient of it);
  reads gather the base rows and add the hits of each delta.  Past ``max_parts`` writes the deltas
  are merged into one; under ``torch.no_grad`` deltas grown large are folded into a private dense
  copy of the table.
* The write is differentiable as gather and index_add, and the key gradient is written out
  analytically, so training backpropagates through every inner update without nested autograd.
* The slow reference written from the equations, which the tests hold this layer to, is
  :func:`fastweights.layers.fast_memory_reference.fwpkm_memory_reference`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from fastweights.components import register_memory
from fastweights.layers.fast_memory import (FastMemoryIO, FastMemoryOptions, PerRowState, call_state, fast_dtype,
                                            padded_forward, piece_sizes, state_pytree, validate_options)
from fastweights.ops.linear_attention import no_autocast
from fastweights.ops.pkm import (
    gather_rows,
    marginal_entropy_topk_grad,
    pkm_aggregated_grad,
    pkm_search,
    softmax_short,
    sparse_parts_add,
    sparse_parts_merge,
    split_halves,
    subkey_grad_topk,
)

@dataclass
class FwPKMOptions(FastMemoryOptions):
    """Options of :class:`FwPKM` (defaults: the paper's App. C configuration; the ones FwMLP takes too
    are declared in ``FastMemoryOptions``).

    Sizes: ``n_subkeys`` n (N = n^2 slots), ``d_key`` d_k (per head, split in two halves),
    ``d_value`` d_v, ``heads`` H, ``topk`` k, ``chunk_size`` C.
    Update: ``lr`` eta for values; ``update_scale`` "rewrite" (k H / N_r, the released code) or
    "literal" (1 / N_r, eq 14); ``key_update`` "addressing" (eqs 16-18), "mse" (keys follow the
    MSE gradient, mean-reduced as in the code: the paper's "w/o addr loss" ablation) or "none";
    ``key_lr`` and ``addressing_weight`` scale the key step.
    Ablations: ``lookahead`` (0 = target v_t), ``score`` "idw"/"dot", ``value_norm``, ``gating``,
    ``gate_weighted_loss``; ``boundary`` "carry"/"drop" (``layers/fast_memory.py``); ``gate_form``.
    State: ``persistence`` "stream"/"official"/"per_sequence"; ``second_order`` False detaches the
    inner updates (gradients then flow only through the current chunk's reads); ``frozen`` True
    never writes (the paper's frozen-memory check, D.2).
    """

    n_subkeys: int = 512
    heads: int = 1
    topk: int = 8
    score: str = "idw"
    idw_eps: float = 1e-3
    lr: float = 1.0
    update_scale: str = "rewrite"
    key_update: str = "addressing"
    key_lr: float = 1.0
    addressing_weight: float = 1.0


@state_pytree
@dataclass
class _Reads:
    """Reads of a run of tokens.  local [B, R, m] slot ids in [0, N); gid [B, R, m] table row ids
    (b N + r per sequence, else r); w [B, R, m]; v_hat [B, R, d_v]; top/idx [B, R, 2H, k]: each
    half's top-k sub-key scores and ids (half m of head h at m H + h, as ``ProductKeySearch``)."""

    local: torch.Tensor
    gid: torch.Tensor
    w: torch.Tensor
    v_hat: torch.Tensor
    top: torch.Tensor
    idx: torch.Tensor

    @staticmethod
    def cat(a: "_Reads | None", b: "_Reads") -> "_Reads":
        if a is None:
            return b
        return _Reads(*(torch.cat([x, y], dim=1) for x, y in zip(a.fields(), b.fields())))

    def fields(self) -> tuple[torch.Tensor, ...]:
        return (self.local, self.gid, self.w, self.v_hat, self.top, self.idx)

    def head(self, n: int) -> "_Reads":
        return _Reads(*(x[:, :n] for x in self.fields()))

    def tail(self, n: int) -> "_Reads":
        return _Reads(*(x[:, n:] for x in self.fields()))


@state_pytree
@dataclass
class FwPKMState:
    """Fast weights and the queue of tokens not yet written.

    keys1, keys2: ``[Bk, H, n, d_k/2]`` fp32 (Bk = 1 shared, = B per sequence).
    base: value table the deltas apply to: ``[N, d_v]`` (the layer's initial table until the first
    fold) or ``[B N, d_v]`` once a per-sequence memory is folded.  parts: the writes since, each a
    sparse row delta ``(rows [M], delta [M, d_v] fp32)`` in the run-start form of ``ops/pkm.py``
    (:func:`~fastweights.ops.pkm.pkm_aggregated_grad`, :func:`~fastweights.ops.pkm.sparse_parts_merge`):
    ``rows`` are the ids read by the write's tokens, sorted, with repeats (M counts reads, not
    distinct rows; a merged part holds the reads of the writes it merged); a row's whole change
    stands at its first occurrence, zero at its repeats.  The value table is ``base`` with each part
    added by ``index_add(0, rows_p, delta_p)`` (the repeats add zero).
    pending_*: queued tokens (q ``[B, P, H, d_k]``, v ``[B, P, d_v]``, g ``[B, P]``, positions ``[P]``);
    the first ``n_stale`` were read before the last write and are re-read (with the tables of the
    next write) together with the next tokens read; ``reads`` holds the reads of the others.
    n_read: tokens read since the last write; position: tokens seen so far; writes: writes so far.
    """

    keys1: torch.Tensor
    keys2: torch.Tensor
    base: torch.Tensor
    parts: tuple  # ((rows [M], delta [M, d_v]), ...): run-start form, M reads per write
    batch: int
    per_sequence: bool
    rows_total: int  # distinct row ids: N (shared) or B N (per sequence)
    pending_q: torch.Tensor
    pending_v: torch.Tensor
    pending_g: torch.Tensor
    pending_pos: torch.Tensor
    n_stale: int = 0
    reads: _Reads | None = None
    n_read: int = 0
    position: int = 0
    writes: int = 0

    def detach(self) -> "FwPKMState":
        """The same state cut from the autograd graph (for truncated backpropagation across calls)."""
        rd = None if self.reads is None else _Reads(*(x.detach() for x in self.reads.fields()))
        return replace(
            self,
            keys1=self.keys1.detach(), keys2=self.keys2.detach(), base=self.base.detach(),
            parts=tuple((r, d.detach()) for r, d in self.parts),
            pending_q=self.pending_q.detach(), pending_v=self.pending_v.detach(),
            pending_g=self.pending_g.detach(), reads=rd,
        )

    def row(self, b: int) -> "FwPKMState":
        """Sequence ``b`` of a per-sequence state, as a state of batch 1 (a padded call runs rows alone): its
        keys, its value rows ``b N .. b N + N - 1`` (of a folded table, and of each sparse delta, renumbered
        from 0; a delta's rows of one sequence keep their run-start form), its queue and reads."""
        n = self.rows_total // self.batch
        lo, one = b * n, slice(b, b + 1)
        base = self.base if self.base.shape[0] != self.rows_total or self.batch == 1 else self.base[lo:lo + n]
        parts = []
        for rows, delta in self.parts:
            mine = (rows >= lo) & (rows < lo + n)
            parts.append((rows[mine] - lo, delta[mine]))
        rd = self.reads
        if rd is not None:
            rd = _Reads(rd.local[one], rd.gid[one] - lo, rd.w[one], rd.v_hat[one], rd.top[one], rd.idx[one])
        return replace(self, keys1=self.keys1[one], keys2=self.keys2[one], base=base, parts=tuple(parts), batch=1,
                       rows_total=n, pending_q=self.pending_q[one], pending_v=self.pending_v[one],
                       pending_g=self.pending_g[one], reads=rd)

    @property
    def delta_rows(self) -> int:
        """Entries held in the sparse deltas: the reads of every write since the last fold, repeats
        included (not distinct rows: a row read twice by one write counts twice)."""
        return sum(r.numel() for r, _ in self.parts)

    def dense_values(self) -> torch.Tensor:
        """The full value table(s): ``[N, d_v]`` shared or ``[B, N, d_v]`` per sequence (for tests/analysis)."""
        n_slots = self.rows_total // (self.batch if self.per_sequence else 1)
        base = self.base.to(self.keys1.dtype)
        if self.per_sequence and base.shape[0] == n_slots:
            full = base.repeat(self.batch, 1)
        else:
            full = base.clone()
        for rows, delta in self.parts:
            full = full.index_add(0, rows, delta)
        return full.view(self.batch, n_slots, -1) if self.per_sequence else full


@register_memory("fwpkm", FwPKMOptions)
class FwPKM(nn.Module):
    """Fast-weight product key memory, a residual sub-block inserted before a block's token mixer.

    ``y, state = layer(x, state=None)``: x ``[B, T, d_model]``, y ``[B, T, d_model]`` to be added to
    the residual stream.  The paper feeds the raw residual stream; the layer has its own RMSNorms
    for q, v and g, so an outer pre-norm only changes the scale those norms see.  ``state`` is a
    :class:`FwPKMState` (None = fresh, see ``persistence``).

    Attributes the model may read after a forward: ``aux_loss`` (always None: FwPKM adds no outer
    loss), ``last_stats`` (detached tensors: mean memorisation loss and addressing loss of the last
    write, mean gate).  Analysis hooks: set ``record_reads = True`` to append every read
    (stream positions, slot ids ``[B, t, H k]``, weights) to ``read_log`` and the gates
    ``[B, t]`` to ``gate_log``; set ``tracer`` to an object with
    ``record_write(rows, weights, query_pos, target_pos, per_sequence, n_slots)`` (see
    :class:`fastweights.experiments.addressing.SlotTracer`, used by ``fastweights inspect addressing``)
    to log what each write stored.
    """

    placement = "before_mixer"

    # facts for the project's checks and the memory estimate (fastweights.components, "what a component declares");
    # a test variant's id starts with its persistence
    test_variants = {vid: {"n_subkeys": 3, "d_key": 4, "d_value": 6, "topk": 2, "chunk_size": 4,
                           "persistence": vid.split("-")[0], **extra}
                     for vid, extra in (("stream", {}), ("per_sequence", {"lookahead": 2}),
                                        ("stream-dot-drop", {"score": "dot", "boundary": "drop"}), ("official", {}),
                                        ("stream-mse-keys", {"key_update": "mse"}),
                                        ("per_sequence-mse-keys-literal", {"key_update": "mse",
                                                                           "update_scale": "literal"}),
                                        ("stream-no-key-update", {"key_update": "none"}),
                                        ("stream-literal", {"update_scale": "literal"}),
                                        ("stream-gate-mean8", {"gate_form": "mean8"}))}
    tiny_options = {"n_subkeys": 4, "d_key": 8, "d_value": 8, "heads": 1, "topk": 2, "chunk_size": 4}
    bounded_variants = {"default": {"n_subkeys": 8, "d_key": 16, "d_value": 16, "topk": 4, "chunk_size": 16}}

    @staticmethod
    def state_floats(o, *, seq_len, **_):
        # the value table is shared (each sequence's writes are sparse row deltas on it); the keys are per sequence
        # with persistence = "per_sequence"; each second-order write keeps its row deltas for the backward pass:
        # at most C k H rows per sequence, and never more than the table
        writes = math.ceil(seq_len / o.chunk_size) if o.second_order and not o.frozen else 0
        keys = o.heads * o.n_subkeys * o.d_key  # two halves of d_key / 2
        per_sequence = o.persistence == "per_sequence"
        return {"carried": keys if per_sequence else 0,
                "shared": o.n_subkeys**2 * o.d_value + (0 if per_sequence else keys),
                "backward": writes * min(o.n_subkeys**2, o.chunk_size * o.topk * o.heads) * o.d_value}

    def __init__(self, d_model: int, options: FwPKMOptions | None = None):
        super().__init__()
        o = options or FwPKMOptions()
        self.options = o
        _validate(o)
        self.n = o.n_subkeys
        self.n_slots = o.n_subkeys**2
        self.heads, self.k, self.d_key, self.d_value = o.heads, o.topk, o.d_key, o.d_value
        self.io = FastMemoryIO(d_model, o.heads * o.d_key, o.d_value, value_norm=o.value_norm,
                               gating=o.gating, gate_form=o.gate_form, norm_eps=o.norm_eps)
        half = o.d_key // 2
        # Initial fast tables (code reset_parameters): keys U(+-1/sqrt(d_k)), values N(0, d_v^-1/2).
        self.register_buffer("keys1", torch.empty(o.heads, o.n_subkeys, half))
        self.register_buffer("keys2", torch.empty(o.heads, o.n_subkeys, half))
        self.register_buffer("values", torch.empty(self.n_slots, o.d_value))
        self.reset_memory()
        self.frozen = o.frozen
        self.aux_loss: torch.Tensor | None = None
        self.last_stats: dict[str, torch.Tensor] = {}
        self.record_reads = False
        self.read_log: list[dict[str, torch.Tensor]] = []
        self.gate_log: list[torch.Tensor] = []
        self.tracer: Any = None
        self.fold_threshold: int | None = None  # delta rows before a no-grad fold; None = automatic
        self.max_parts = 16  # sparse deltas kept before they are merged into one

    @torch.no_grad()
    def reset_memory(self) -> None:
        """Re-draw the initial fast tables (the explicit reset of ``persistence="official"``)."""
        bound = 1.0 / math.sqrt(self.d_key)
        self.keys1.uniform_(-bound, bound)
        self.keys2.uniform_(-bound, bound)
        self.values.normal_(0.0, self.d_value**-0.5)

    # ------------------------------------------------------------------ state

    def init_state(self, batch: int, device: torch.device | None = None,
                   dtype: torch.dtype | None = None) -> FwPKMState:
        """A fresh state for ``batch`` sequences, starting from the layer's current tables.

        ``dtype`` of the fast arithmetic: fp32 by default (fp64 when the tables are fp64).
        """
        device = device or self.values.device
        dtype = dtype or fast_dtype(self.values)
        per_seq = self.options.persistence == "per_sequence"
        k1 = self.keys1.to(device=device, dtype=dtype).unsqueeze(0)  # [1, H, n, dh]
        k2 = self.keys2.to(device=device, dtype=dtype).unsqueeze(0)
        if per_seq:
            k1, k2 = k1.expand(batch, -1, -1, -1), k2.expand(batch, -1, -1, -1)  # [B, H, n, dh] views
        f32 = dict(device=device, dtype=dtype)
        return FwPKMState(
            keys1=k1, keys2=k2, base=self.values.to(device),
            parts=(),
            batch=batch, per_sequence=per_seq, rows_total=self.n_slots * (batch if per_seq else 1),
            pending_q=torch.zeros(batch, 0, self.heads, self.d_key, **f32),
            pending_v=torch.zeros(batch, 0, self.d_value, **f32),
            pending_g=torch.zeros(batch, 0, **f32),
            pending_pos=torch.zeros(0, dtype=torch.long, device=device),
        )

    # ------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor, state: FwPKMState | PerRowState | None = None,
                attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, FwPKMState | PerRowState]:
        """x ``[B, T, d_model]`` -> (y ``[B, T, d_model]``, state); ``attention_mask`` [B, T] (0 = padding, never
        written, chunks count real tokens only: ``layers.fast_memory.padded_forward``)."""
        if attention_mask is not None or isinstance(state, PerRowState):
            return padded_forward(self, x, state, attention_mask)
        B, T, _ = x.shape
        q, v, g = self.io.inputs(x)
        q = q.view(B, T, self.heads, self.d_key)  # [B, T, H, d_k]
        g_loss = g if (self.options.gating and self.options.gate_weighted_loss) else torch.ones_like(g)
        v_hat, state = self.memory(q, v, g_loss, state)
        y = self.io.output(v_hat, v, g)
        self.aux_loss = None
        self.last_stats["gate_mean"] = g.detach().float().mean()
        if self.record_reads:
            self.gate_log.append(g.detach().cpu())
        if self.options.persistence == "official":
            state = self._persist(state)
        return y, state

    def memory(
        self, q: torch.Tensor, v: torch.Tensor, g: torch.Tensor, state: FwPKMState | None = None
    ) -> tuple[torch.Tensor, FwPKMState]:
        """The fast-weight core: read every token, write after every C tokens.

        Args:
            q: ``[B, T, H, d_k]`` queries; v: ``[B, T, d_v]`` value targets; g: ``[B, T]`` loss weights.
            state: :class:`FwPKMState` or None (fresh).
        Returns:
            v_hat ``[B, T, d_v]`` fp32 (token t reads the tables as written before its chunk), state.
        """
        B, T = q.shape[:2]
        dtype, st = call_state(self, q, state)
        C = self.options.chunk_size
        takes = piece_sizes(T, st.n_read, C, self.frozen)
        outs = []
        with no_autocast(q.device):
            # split once (not slice per piece): autograd then joins the pieces' gradients in one cat
            pieces = zip(*(x.to(dtype).split(takes, dim=1) for x in (q, v, g)))
            for (qc, vc, gc), take in zip(pieces, takes):
                positions = torch.arange(st.position, st.position + take, device=q.device)
                if self.frozen:
                    reads = self._read(qc, st)
                    st = replace(st, position=st.position + take)
                else:
                    # queries left from before the last write are re-read now, with the tables this
                    # piece reads (the ones the next write updates), in the same search
                    s0 = st.n_stale
                    q_read = torch.cat([st.pending_q[:, :s0], qc], 1) if s0 else qc
                    both = self._read(q_read, st)
                    reads = both.tail(s0)
                    st = replace(
                        st,
                        pending_q=torch.cat([st.pending_q, qc], 1),
                        pending_v=torch.cat([st.pending_v, vc], 1),
                        pending_g=torch.cat([st.pending_g, gc], 1),
                        pending_pos=torch.cat([st.pending_pos, positions]),
                        reads=_Reads.cat(st.reads, both),
                        n_stale=0,
                        n_read=st.n_read + take,
                        position=st.position + take,
                    )
                outs.append(reads.v_hat)
                if self.record_reads:
                    self.read_log.append({"position": positions.cpu(), "indices": reads.local.detach().cpu(),
                                          "weights": reads.w.detach().cpu()})
                if not self.frozen and st.n_read == C:
                    st = self._write(st)
        v_hat = torch.cat(outs, dim=1) if outs else q.new_zeros(B, 0, self.d_value)
        return v_hat, st

    # ------------------------------------------------------------------ read

    def _table_rows(self, st: FwPKMState, local: torch.Tensor, gid: torch.Tensor) -> torch.Tensor:
        """Current value rows ``[..., d_v]`` (fp32) for slot ids: base rows plus the sparse deltas."""
        base_ids = local if st.base.shape[0] == self.n_slots else gid
        rows = gather_rows(st.base, base_ids.reshape(-1)).to(st.keys1.dtype)  # [R*m, d_v]
        rows = sparse_parts_add(rows, gid.reshape(-1), st.parts, st.rows_total)
        return rows.view(*gid.shape, self.d_value)

    def _read(self, q: torch.Tensor, st: FwPKMState) -> _Reads:
        """Product-key retrieval (eqs 6, 7, 11) of q ``[B, R, H, d_k]`` from the state's tables."""
        B, R = q.shape[:2]
        o = self.options
        res = pkm_search(q, st.keys1, st.keys2, self.k, o.score, o.idw_eps)
        m = self.heads * self.k
        # one softmax over all H*k selected slots (heads share V; the code's score normalisation)
        w = softmax_short(res.scores.reshape(B, R, m))  # [B, R, m]
        local = res.indices.reshape(B, R, m)  # [B, R, m]
        gid = local
        if st.per_sequence:
            gid = local + (torch.arange(B, device=q.device) * self.n_slots).view(B, 1, 1)
        rows = self._table_rows(st, local, gid)  # [B, R, m, d_v]
        v_hat = torch.matmul(w.unsqueeze(-2), rows).squeeze(-2)  # [B, R, d_v]
        return _Reads(local, gid, w, v_hat, res.sub_top, res.sub_indices)

    # ------------------------------------------------------------------ write

    def _write(self, st: FwPKMState) -> FwPKMState:
        """Apply eqs 14-15 and 16-18 for the queued tokens; keep the last L queued if carrying."""
        o = self.options
        L = o.lookahead
        reads = st.reads  # every queued token was read with the current tables (memory() re-reads stale ones)
        P = st.pending_q.shape[1]
        n_pairs = P - L
        keys1, keys2, parts = st.keys1, st.keys2, st.parts
        if n_pairs > 0:
            with torch.set_grad_enabled(torch.is_grad_enabled() and o.second_order):
                keys1, keys2, parts = self._update(st, reads.head(n_pairs), n_pairs)
                if len(parts) > self.max_parts:
                    parts = (sparse_parts_merge(parts),)  # bound the per-read cost of many deltas
        carry = o.carried()
        new = replace(
            st, keys1=keys1, keys2=keys2, parts=parts,
            pending_q=st.pending_q[:, P - carry:], pending_v=st.pending_v[:, P - carry:],
            pending_g=st.pending_g[:, P - carry:], pending_pos=st.pending_pos[P - carry:],
            n_stale=carry, reads=None, n_read=0, writes=st.writes + 1,
        )
        return self._maybe_fold(new)

    def _update(self, st: FwPKMState, rd: _Reads, n_pairs: int):
        o = self.options
        L = o.lookahead
        target = st.pending_v[:, L: L + n_pairs]  # [B, P', d_v]: value of token t + L
        gate = st.pending_g[:, :n_pairs]  # [B, P']
        err = rd.v_hat - target  # [B, P', d_v]
        resid = gate.unsqueeze(-1) * err  # dL_mem/dv_hat for L_mem = sum 1/2 g ||v_hat - v||^2
        with torch.no_grad():
            self.last_stats["mem_loss"] = (0.5 * (gate.unsqueeze(-1) * err * err).sum(-1)).mean()
        urows, grad, _ = pkm_aggregated_grad(rd.gid, rd.w, resid, average=True)  # eq 14
        scale = self.k * self.heads if o.update_scale == "rewrite" else 1.0
        parts = st.parts + ((urows, -o.lr * scale * grad),)  # eq 15, as a sparse row delta
        if self.tracer is not None:
            qpos = st.pending_pos[:n_pairs]
            self.tracer.record_write(rd.gid.detach(), rd.w.detach(), qpos, qpos + L,
                                     per_sequence=st.per_sequence, n_slots=self.n_slots)

        keys1, keys2 = st.keys1, st.keys2
        if o.key_update != "none":
            q = split_halves(st.pending_q[:, :n_pairs])  # [B, P', 2H, d_k/2]
            if o.key_update == "addressing":  # eqs 16-18, both halves as 2H heads (the loss sums them)
                gs, loss = marginal_entropy_topk_grad(rd.top, rd.idx, self.n, st.per_sequence)
                gs = o.addressing_weight * gs
                self.last_stats["addr_loss"] = loss.detach()
            else:
                gs = self._mse_subscore_grads(st, rd, resid, n_pairs)
            keys = torch.cat([keys1, keys2], dim=-3)  # [Bk, 2H, n, d_k/2]
            d = subkey_grad_topk(gs, rd.idx, rd.top, q, keys, o.score, st.per_sequence)
            if not st.per_sequence:
                d = d.unsqueeze(0)  # [1, 2H, n, d_k/2]
            keys = keys - o.key_lr * d
            keys1, keys2 = keys[:, : self.heads], keys[:, self.heads :]
        return keys1, keys2, parts

    def _mse_subscore_grads(self, st: FwPKMState, rd: _Reads, resid: torch.Tensor, n_pairs: int):
        """dL/ds^m on each half's top-k sub-keys ``[B, P', 2H, k]`` of the memorisation loss,
        mean-reduced over pairs and features as in the code."""
        B = st.batch
        count = n_pairs * (1 if st.per_sequence else B) * self.d_value
        dl_dvhat = resid / count  # [B, P', d_v]
        rows = self._table_rows(st, rd.local, rd.gid)  # [B, P', m, d_v]
        dl_dw = torch.matmul(rows, dl_dvhat.unsqueeze(-1)).squeeze(-1)  # [B, P', m]
        dl_ds = rd.w * (dl_dw - (rd.w * dl_dw).sum(-1, keepdim=True))  # softmax backward, [B, P', m]
        shape = (B, n_pairs, self.heads, self.k)
        dl_ds = dl_ds.view(shape)
        local = rd.local.view(shape)  # slot i*n + j: s_ij = s^1_i + s^2_j
        idx1, idx2 = rd.idx[:, :, : self.heads], rd.idx[:, :, self.heads :]
        # position of each slot's i (j) among the half's top-k: [B, P', H, k slots, k sub-keys]
        in1 = ((local // self.n).unsqueeze(-1) == idx1.unsqueeze(-2)).to(dl_ds.dtype)
        in2 = ((local % self.n).unsqueeze(-1) == idx2.unsqueeze(-2)).to(dl_ds.dtype)
        g1 = (dl_ds.unsqueeze(-1) * in1).sum(-2)  # [B, P', H, k]
        g2 = (dl_ds.unsqueeze(-1) * in2).sum(-2)
        return torch.cat([g1, g2], dim=2)  # [B, P', 2H, k], the layout of rd.idx

    def _maybe_fold(self, st: FwPKMState) -> FwPKMState:
        """Without autograd, fold deltas grown large into a private dense copy of the table.

        Deltas cost a search per read and O(M d_v) per merge (every ``max_parts`` writes) for M
        delta rows; a fold costs O(N d_v) once.  Folding when M exceeds sqrt(2 N R) (R = rows one
        write can add) balances the two, so a long no-grad stream costs O(sqrt(N R) d_v) per write
        at most, amortised.  ``fold_threshold`` overrides the bound.
        """
        if torch.is_grad_enabled() and any(d.requires_grad for _, d in st.parts):
            return st
        per_write = st.batch * self.options.chunk_size * self.heads * self.k
        threshold = self.fold_threshold
        if threshold is None:
            threshold = max(per_write, int(math.sqrt(2.0 * st.rows_total * per_write)))
        if st.delta_rows <= threshold:
            return st
        with torch.no_grad():
            base = st.base.to(st.keys1.dtype)
            if st.per_sequence and base.shape[0] == self.n_slots:
                base = base.repeat(st.batch, 1)  # [B N, d_v]: each sequence gets its own copy
            else:
                base = base.clone()
            for rows, delta in st.parts:
                base.index_add_(0, rows, delta)
        return replace(st, base=base, parts=())

    @torch.no_grad()
    def _persist(self, st: FwPKMState) -> FwPKMState:
        """``persistence="official"``: write the final tables back into the module."""
        # keys: new tensors, because the old ones may be saved for this forward's backward
        self._buffers["keys1"] = st.keys1[0].detach().to(self.keys1.dtype).clone()
        self._buffers["keys2"] = st.keys2[0].detach().to(self.keys2.dtype).clone()
        if st.base is not self.values:
            self.values.copy_(st.base.to(self.values.dtype))
        # values are only ever gathered (index_select saves no copy of them), so update in place
        for rows, delta in st.parts:
            self.values.index_add_(0, rows, delta.detach().to(self.values.dtype))
        # the returned state holds a copy of the value table, not the buffer: the next forward updates the
        # buffer in place, which would otherwise change a state its holder kept (the keys are fresh tensors)
        return replace(st, keys1=self.keys1.unsqueeze(0).to(st.keys1.dtype),
                       keys2=self.keys2.unsqueeze(0).to(st.keys2.dtype), base=self.values.clone(), parts=())


def _validate(o: FwPKMOptions) -> None:
    validate_options("fwpkm", o, [
        (o.n_subkeys >= 1, f"n_subkeys must be >= 1, got {o.n_subkeys}"),
        (o.d_key >= 2 and o.d_key % 2 == 0, f"d_key must be even and >= 2, got {o.d_key}"),
        (o.d_value >= 2, f"d_value must be >= 2 (z-scoring needs 2 features), got {o.d_value}"),
        (o.heads >= 1, f"heads must be >= 1, got {o.heads}"),
        (1 <= o.topk <= o.n_subkeys, f"topk must be in [1, n_subkeys={o.n_subkeys}], got {o.topk}"),
        (o.score in ("idw", "dot"), f"score must be 'idw' or 'dot', got {o.score!r}"),
        (o.update_scale in ("rewrite", "literal"),
         f"update_scale must be 'rewrite' or 'literal', got {o.update_scale!r}"),
        (o.key_update in ("addressing", "mse", "none"),
         f"key_update must be addressing/mse/none, got {o.key_update!r}"),
    ])
