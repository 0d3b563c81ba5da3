"""Addressing metrics and slot tracing for product-key memories (Zhao & Jones 2026, App. D.3).

With c_r the number of reads of value row r over a window of text (every token reads H*k slots)
and T_acc = sum_r c_r::

    collision = sum_{r: c_r > 1} c_r / T_acc        share of reads that land on a slot read more than once
    coverage  = |{r : c_r > 0}| / N                  share of the N slots read at all
    KLD       = KL(c / T_acc || Uniform(N)) = sum_{r: c_r > 0} p_r log(p_r N)

The paper computes each per 32K-token window (8 slots x 32K = 256K ~ N reads, so perfectly balanced
use would cover every slot once), then averages over windows and over the FwPKM layers.

Trace mode: a :class:`SlotTracer` attached to an FwPKM layer remembers, for every slot, the
(query position, lookahead-target position, weight) of the tokens that wrote it at its last
write; :func:`trace_position` lists, for one scored token, the slots it read and what they stored.

Command line: ``fastweights inspect addressing --checkpoint DIR --data PATH [--trace POS ...]``.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from fastweights.components import GatedMemory, SlotMemory
from fastweights.core.errors import UserError
from fastweights.core.progress import Progress


def addressing_stats(counts: torch.Tensor) -> dict[str, float]:
    """Collision rate, coverage and KLD from per-slot read counts ``[N]`` (formulas in the module doc)."""
    counts = counts.to(torch.float64)
    n_slots = counts.numel()
    total = counts.sum()
    if total <= 0:
        raise UserError("no memory reads to compute addressing statistics from")
    p = counts / total
    used = p > 0
    return {
        "collision": float(counts[counts > 1].sum() / total),
        "coverage": float(used.sum()) / n_slots,
        "kld": float((p[used] * torch.log(p[used] * n_slots)).sum()),
        "reads": int(total),
    }


def slot_counts(indices: torch.Tensor, n_slots: int) -> torch.Tensor:
    """Read counts ``[n_slots]`` of any tensor of slot ids."""
    return torch.bincount(indices.reshape(-1).long().cpu(), minlength=n_slots)


def windowed_addressing_stats(indices: torch.Tensor, n_slots: int, window: int = 32768) -> dict:
    """Addressing statistics per window of ``window`` tokens, averaged over the windows.

    Args:
        indices: ``[T, m]`` slot ids read by each token of one stream, in order (or ``[B, T, m]``:
            each row is its own stream).
        n_slots: N.
        window: tokens per window (paper: 32768).

    Returns ``{"collision", "coverage", "kld"}`` means, ``"windows"`` (count), ``"partial"`` (True
    when the text was shorter than one window and the single partial window was used) and
    ``"per_window"`` (the list of per-window dicts).
    """
    if indices.dim() == 2:
        indices = indices.unsqueeze(0)  # [1, T, m]
    T = indices.shape[1]
    if T == 0:
        raise UserError("no memory reads to compute addressing statistics from")
    n_full = T // window
    partial = n_full == 0
    spans = [(0, T)] if partial else [(i * window, (i + 1) * window) for i in range(n_full)]
    per_window = [addressing_stats(slot_counts(row[a:b], n_slots)) for row in indices for a, b in spans]
    out = {key: sum(w[key] for w in per_window) / len(per_window) for key in ("collision", "coverage", "kld")}
    out.update(windows=len(per_window), partial=partial, per_window=per_window)
    return out


class SlotTracer:
    """Remembers what each slot stored at each write.

    An FwPKM layer with ``layer.tracer = SlotTracer()`` calls :meth:`record_write` at every write
    with the rows written (table row ids), their weights, and the stream positions of the queries
    and of their lookahead targets.  Positions are the layer's stream positions (tokens since the
    state was fresh).  ``keep_writes`` bounds the history kept per slot (None = all).
    """

    def __init__(self, keep_writes: int | None = None):
        self.history: dict[int, list[tuple[int, int, list[tuple]]]] = defaultdict(list)
        self.keep_writes = keep_writes
        self.per_sequence = False
        self.n_slots = 0
        self.writes = 0

    def record_write(self, rows: torch.Tensor, weights: torch.Tensor, query_pos: torch.Tensor,
                     target_pos: torch.Tensor, per_sequence: bool = False, n_slots: int = 0) -> None:
        """rows, weights ``[B, P, m]``; query_pos, target_pos ``[P]``."""
        self.per_sequence, self.n_slots = per_sequence, n_slots
        B, P, m = rows.shape
        qp, tp = query_pos.tolist(), target_pos.tolist()
        last_target = max(tp) if tp else -1
        fresh: dict[int, list[tuple]] = defaultdict(list)
        for flat, (row, weight) in enumerate(zip(rows.reshape(-1).tolist(), weights.reshape(-1).tolist())):
            b, rest = divmod(flat, P * m)
            p = rest // m
            fresh[row].append((b, qp[p], tp[p], weight))
        for row, entries in fresh.items():
            hist = self.history[row]
            hist.append((self.writes, last_target, entries))
            if self.keep_writes is not None and len(hist) > self.keep_writes:
                del hist[0]
        self.writes += 1

    def lookup(self, slot: int, batch: int = 0, before: int | None = None) -> list[dict]:
        """What ``slot`` (of sequence ``batch`` for per-sequence memories) held from its last write.

        ``before``: only writes completed before the token at this stream position was read
        (a write follows the read of its last target), i.e. what that token actually retrieved.
        Returns one dict per contribution: batch, query_pos, target_pos, weight, write.
        """
        row = slot + batch * self.n_slots if self.per_sequence else slot
        for write, last_target, entries in reversed(self.history.get(row, [])):
            if before is None or last_target < before:
                return [{"batch": b, "query_pos": q, "target_pos": t, "weight": w, "write": write}
                        for b, q, t, w in entries]
        return []


def memory_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every product-key memory (FwPKM or PKM) in a model."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, SlotMemory)]


def collect_reads(model, tokens: torch.Tensor, seq_len: int, stride: int | None = None, trace: bool = False,
                  progress: bool = True):
    """Run ``model`` over ``tokens`` ``[T]`` (one stream, state carried) recording every memory read.

    ``progress``: a progress line on stderr (the ``T - 1`` scored tokens, with an ETA).

    Returns ``(reads, tracers, loss)``: ``reads[name] = (indices, weights, gates)``: the slots
    ``[T - 1, m]`` read by each scored token in each memory layer, their weights, and the FwPKM gate
    g_t ``[T - 1]`` (None for PKM); ``tracers[name]`` the :class:`SlotTracer` of each FwPKM layer
    (when ``trace``); and the mean next-token loss (nats).
    """
    from fastweights.loops.evaluate import score_tokens

    layers = memory_layers(model)
    if not layers:
        raise UserError("the model has no product-key memory layer (pkm or fwpkm)")
    tracers = {}
    for name, m in layers:
        m.read_log = []
        if isinstance(m, GatedMemory):
            m.gate_log = []
        m.record_reads = True
        if trace and isinstance(m, GatedMemory):
            tracers[name] = m.tracer = SlotTracer()
    bar = Progress(max(0, tokens.shape[-1] - 1), "tok", desc=f"addressing: reading {len(layers)} memory layer(s)",
                   enabled=progress)
    try:
        result, _ = score_tokens(model, tokens, seq_len, stride, progress=bar)
    finally:
        bar.close()
        for _, m in layers:
            m.record_reads = False
            if isinstance(m, GatedMemory):
                m.tracer = None
    reads = {}
    for name, m in layers:
        # FwPKM logs [B, t, H k] per call (B = 1 here); keep the stream order
        gates = torch.cat([g[0] for g in m.gate_log]) if isinstance(m, GatedMemory) and m.gate_log else None
        reads[name] = (torch.cat([entry["indices"][0] for entry in m.read_log], dim=0),
                       torch.cat([entry["weights"][0] for entry in m.read_log], dim=0), gates)
        m.read_log = []
        if isinstance(m, GatedMemory):
            m.gate_log = []
    return reads, tracers, result.loss


def trace_position(reads: torch.Tensor, weights: torch.Tensor | None, tracer: SlotTracer, tokens: list[int],
                   position: int, decode, context: int = 12) -> list[dict]:
    """For the token read at stream ``position``: each slot it read, its read weight, and the tokens
    stored there by the slot's last write before that read (query token, lookahead target, the
    target's context).  ``reads``/``weights`` ``[T, m]``; ``decode`` maps a list of ids to text."""
    if not 0 <= position < reads.shape[0]:
        raise UserError(f"trace position {position} outside the scored text (0..{reads.shape[0] - 1})")
    rows = []
    for j, slot in enumerate(reads[position].tolist()):
        stored = []
        for e in sorted(tracer.lookup(slot, before=position), key=lambda e: -e["weight"]):
            qp, tp = e["query_pos"], e["target_pos"]
            lo, hi = max(0, tp - context), min(len(tokens), tp + context + 1)
            stored.append({"query_token": decode([tokens[qp]]), "target_token": decode([tokens[tp]]),
                           "query_pos": qp, "target_pos": tp, "weight": round(e["weight"], 4),
                           "context": decode(tokens[lo:tp]) + "[" + decode([tokens[tp]]) + "]"
                           + decode(tokens[tp + 1: hi])})
        rows.append({"slot": slot, "read_weight": None if weights is None else round(float(weights[position, j]), 4),
                     "stored": stored})
    return rows
