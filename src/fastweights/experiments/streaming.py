"""Streaming perplexity along documents (``fastweights eval --stream``).

In the spirit of the FwPKM paper's PPL protocol and the time-scale analysis of dynamic evaluation
(Krause et al. 2018, Fig. 2). Documents are read in order at batch 1, in calls of ``stride`` tokens;
the KV cache keeps ``seq_len - stride`` tokens between calls (constant memory). The first token of
every document is context only. Modes (memories and context: see :mod:`fastweights.models.memory_switches`):

    carry    the whole state carries across calls and document boundaries
    reset    the whole state starts fresh at every document
    frozen   as carry, but memories never write (FwPKM/FwMLP ``frozen``; the paper's App. D.2 check);
             with dynamic evaluation: no updates
    windows  every state (context, memories, a head's fast weights) starts fresh every ``seq_len`` predictions
             and at every document: independent windows of the training length, what validation measures
    memory   mixer (context) states start fresh every ``seq_len`` predictions and at every document (within
             a segment the KV cache is not trimmed), memories carry across everything (the paper: "caches
             reset per segment, fast weights not")

Per-position curves aggregate the NLL of the i-th prediction of each document d over documents, in
bins b = floor(i / bin_width)::

    windowed_b   = sum_{d, i in b} nll_{d,i} / #{(d, i): i in b}           (Krause et al.'s non-cumulative curve)
    cumulative_b = sum_{d, i in b' <= b} nll_{d,i} / #{(d, i): i in b' <= b}

Only the bin sums and counts are kept, never a per-token array, so a stream of any length runs in
constant memory (as long as the model's own state is bounded).

Along the stream each layer's carried state is measured after every call: its L2 norm (all its
floating-point tensors: fast weight matrices, memories, KV caches, recurrent states), averaged per
bin of position like the loss. A state that grows without bound, or drifts far from the sizes it had
over the training length, shows there before the loss does (:class:`StateNormCurve`).
"""

from __future__ import annotations

import math
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from fastweights.core.errors import UserError
from fastweights.models.memory_switches import memory_only_state, memory_writes, trimmed_state
from fastweights.ops.nll import token_nll
from fastweights.core.progress import Progress

STREAM_MODES = ("carry", "reset", "frozen", "memory", "windows")
SEGMENTED = ("memory", "windows")  # modes that cut the stream into segments of seq_len predictions


# ----------------------------------------------------------------------------- curves


class PositionCurve:
    """NLL sums and counts by prediction index within a document, in bins of ``bin_width``."""

    def __init__(self, bin_width: int = 256):
        if bin_width < 1:
            raise UserError(f"bin width must be >= 1, got {bin_width}")
        self.bin_width = int(bin_width)
        self.sums = np.zeros(0, dtype=np.float64)
        self.counts = np.zeros(0, dtype=np.int64)

    def add(self, start: int, nll: np.ndarray) -> None:
        """Predictions ``start, start + 1, ...`` (0-based, within their document) with NLLs ``nll``."""
        nll = np.asarray(nll, dtype=np.float64).reshape(-1)
        if nll.size == 0:
            return
        idx = (start + np.arange(nll.size)) // self.bin_width
        lo, hi = int(idx[0]), int(idx[-1]) + 1
        if hi > self.sums.size:
            grow = max(hi, 2 * self.sums.size)
            self.sums = np.concatenate([self.sums, np.zeros(grow - self.sums.size)])
            self.counts = np.concatenate([self.counts, np.zeros(grow - self.counts.size, dtype=np.int64)])
        self.sums[lo:hi] += np.bincount(idx - lo, weights=nll, minlength=hi - lo)
        self.counts[lo:hi] += np.bincount(idx - lo, minlength=hi - lo)

    def to_dict(self) -> dict:
        """``position`` (bin end: predictions made in the document), ``windowed`` and ``cumulative`` mean
        NLL in nats, ``count`` (predictions per bin)."""
        used = int(np.nonzero(self.counts)[0].max()) + 1 if self.counts.any() else 0
        sums, counts = self.sums[:used], self.counts[:used]
        windowed = [float(s / c) if c else None for s, c in zip(sums, counts)]
        csum, ccount = np.cumsum(sums), np.cumsum(counts)
        cumulative = [float(s / c) if c else None for s, c in zip(csum, ccount)]
        return {"bin_width": self.bin_width, "position": [(i + 1) * self.bin_width for i in range(used)],
                "windowed": windowed, "cumulative": cumulative, "count": counts.tolist()}


def state_norms(state) -> list[float]:
    """L2 norm of each layer's state (every floating-point tensor in it), ``[n_layers]``.

    ``state``: a LanguageModel state ``{"layers": [per-layer state, ...], ...}`` (anything else counts
    as one layer); tensors that are not floating point (positions, counters) are left out."""
    from torch.utils._pytree import tree_leaves

    layers = state.get("layers") if isinstance(state, dict) and "layers" in state else [state]
    out = []
    for layer in layers:
        sq = 0.0
        for leaf in tree_leaves(layer):
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.numel():
                sq += float(leaf.detach().double().pow(2).sum())
        out.append(math.sqrt(sq))
    return out


class StateNormCurve:
    """Per-layer state norms after each call, averaged in bins of the position reached (like :class:`PositionCurve`)."""

    def __init__(self, bin_width: int = 256):
        self.bin_width = int(bin_width)
        self.sums: list[list[float]] = []  # [bin][layer]
        self.counts: list[int] = []

    def add(self, position: int, norms: list[float]) -> None:
        """Norms of the state after ``position`` predictions of the current document."""
        b = max(0, position - 1) // self.bin_width
        while len(self.counts) <= b:
            self.sums.append([0.0] * len(norms))
            self.counts.append(0)
        if len(self.sums[b]) < len(norms):
            self.sums[b] += [0.0] * (len(norms) - len(self.sums[b]))
        for i, v in enumerate(norms):
            self.sums[b][i] += v
        self.counts[b] += 1

    def to_dict(self) -> dict:
        """``position`` (bin end), ``per_layer`` mean norm per bin ``[layer][bin]`` (None: no call ended
        there), ``max`` the largest layer's, ``count`` calls per bin."""
        layers = max((len(r) for r in self.sums), default=0)
        per_layer = [[(r[i] / c if c and i < len(r) else None) for r, c in zip(self.sums, self.counts)]
                     for i in range(layers)]
        top = [max((v[b] for v in per_layer if v[b] is not None), default=None) for b in range(len(self.counts))]
        return {"bin_width": self.bin_width, "position": [(b + 1) * self.bin_width for b in range(len(self.counts))],
                "per_layer": per_layer, "max": top, "count": list(self.counts)}


# ----------------------------------------------------------------------------- documents as token streams


class EncodedDocuments:
    """``(name, blocks)`` per document (what :func:`encode_documents` returns), iterable once per ``iter``.

    Besides the blocks it knows the size of the work before it is read: ``chars`` (characters that will be
    read, ``max_chars`` included) and ``documents``; and, as blocks are encoded, ``chars_read`` and
    ``tokens_read``. :meth:`estimated_predictions` turns these into the number of predictions the text
    will give (exact once every block is encoded), which :func:`stream_eval` shows as its total.
    """

    def __init__(self, docs: Sequence, tokenizer, max_chars: int = 0):
        self.docs, self.tokenizer = docs, tokenizer
        self.max_chars = max_chars if max_chars > 0 else math.inf
        self.chars, self.documents, left = 0, 0, self.max_chars
        for d in docs:
            if left <= 0:
                break
            n = min(_n_chars(d), left)
            self.chars += int(n)
            self.documents += n > 0
            left -= n
        self.chars_read = self.tokens_read = 0

    def estimated_predictions(self) -> tuple[int, bool]:
        """(predictions, exact): tokens minus each document's first (context only), from the tokens per
        character read so far (exact once everything is read); (0, False) before the first block."""
        if self.chars_read >= self.chars:
            return max(0, self.tokens_read - self.documents), True
        if self.chars_read == 0:
            return 0, False
        return max(0, round(self.tokens_read / self.chars_read * self.chars) - self.documents), False

    def __iter__(self) -> Iterator[tuple[str, Iterator[np.ndarray]]]:
        left = self.max_chars
        self.chars_read = self.tokens_read = 0
        for d in self.docs:
            if left <= 0:
                return
            name = getattr(d, "name", "text")

            def blocks(d=d):
                nonlocal left
                for piece in (d.pieces() if hasattr(d, "pieces") else [d]):
                    if left <= 0:
                        return
                    if len(piece) > left:
                        piece = piece[: int(left)]
                    left -= len(piece)
                    ids = np.asarray(self.tokenizer.encode(piece), dtype=np.int64)
                    self.chars_read += len(piece)
                    self.tokens_read += int(ids.size)
                    if ids.size:
                        yield ids

            yield name, blocks()


def _n_chars(doc) -> int:
    n = getattr(doc, "n_chars", None)
    return int(n) if n is not None else len(doc)


def encode_documents(docs: Sequence, tokenizer, max_chars: int = 0) -> EncodedDocuments:
    """``(name, blocks)`` per document; ``blocks`` yields the token ids of consecutive text pieces.

    Pieces are cut where no tokenizer's output changes (``Document.pieces``), so the blocks
    concatenate to the document's encoding, and a long file is never held as one token array.
    ``max_chars`` > 0 stops after that many characters in all. The result also knows how much text
    it holds (:class:`EncodedDocuments`), so a stream over it has a total and an ETA.
    """
    return EncodedDocuments(docs, tokenizer, max_chars)


def current_rss_mb() -> float | None:
    """Resident set size of this process now, in MiB (Linux /proc), else None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


# ----------------------------------------------------------------------------- streaming perplexity


@dataclass
class StreamResult:
    mode: str
    nll: float = 0.0  # total NLL, nats
    tokens: int = 0  # predictions scored
    curve: PositionCurve = field(default_factory=PositionCurve)
    state_norm: StateNormCurve = field(default_factory=StateNormCurve)
    documents: list = field(default_factory=list)  # {"name", "tokens", "loss"} per document
    elapsed_s: float = 0.0
    rss_mb: dict = field(default_factory=dict)  # {"start", "max_sampled", "end"} current RSS during the run

    @property
    def loss(self) -> float:
        return self.nll / max(1, self.tokens)

    def to_dict(self) -> dict:
        return {"mode": self.mode, "loss_nats": self.loss, "bits_per_token": self.loss / math.log(2),
                "perplexity": math.exp(min(self.loss, 700)), "tokens": self.tokens, "elapsed_s": self.elapsed_s,
                "tokens_per_s": self.tokens / self.elapsed_s if self.elapsed_s > 0 else None,
                "rss_mb": self.rss_mb, "curve": self.curve.to_dict(), "state_norm": self.state_norm.to_dict(),
                "documents": self.documents}


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> np.ndarray:
    return token_nll(logits, targets).reshape(-1).double().cpu().numpy()


def _calls(blocks: Iterable[np.ndarray], stride: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(inputs, targets) of ``stride`` predictions each (the last call: what is left) over a document given
    in blocks; the first token is context only. The calls are those of one array, whatever the blocks
    (attention contexts depend on call boundaries); at most one block plus ``stride`` tokens are held."""
    buf = np.zeros(0, dtype=np.int64)
    for block in blocks:
        buf = np.concatenate([buf, block])
        i = 0
        while buf.size - 1 - i >= stride:
            yield buf[i : i + stride], buf[i + 1 : i + stride + 1]
            i += stride
        buf = buf[i:]
    if buf.size > 1:
        yield buf[:-1], buf[1:]


def stream_eval(model, documents: Iterable[tuple[str, Iterable[np.ndarray]]], mode: str = "carry",
                seq_len: int = 512, stride: int | None = None, bin_width: int = 256, max_tokens: int = 0,
                evaluator=None, progress: bool | Progress = False, desc: str = "") -> StreamResult:
    """Score documents in order at batch 1 under ``mode`` (see the module docstring).

    Args:
        model: a LanguageModel (or anything with ``forward(tokens, state) -> .logits, .state``).
        documents: ``(name, blocks of token ids)`` per document, e.g. from :func:`encode_documents`.
        mode: one of :data:`STREAM_MODES`.
        seq_len: the context length (KV cache keeps ``seq_len - stride``); the segment of "memory" and
            "windows" modes.
        stride: predictions per forward call (default ``seq_len // 2``).
        bin_width: predictions per bin of the per-position curves.
        max_tokens: stop after this many predictions in all (0: everything).
        evaluator: a :class:`~fastweights.adapt.dynamic.DynamicEvaluator` to add dynamic evaluation on
            top (modes carry and reset; frozen runs static; its own segment and context apply).
        progress: show a progress line (or a :class:`Progress` to update). Over :func:`encode_documents`
            the line's total is the text's predictions (estimated from the tokens per character read so far,
            marked ``~``, until all is read) or ``max_tokens``; the loss is shown in bits per token.
        desc: the line's label (default ``stream MODE``), e.g. ``stream carry (run 2 of 6)``.
    """
    if mode not in STREAM_MODES:
        raise UserError(f"unknown stream mode {mode!r}; choose from {', '.join(STREAM_MODES)}")
    stride = stride or max(1, seq_len // 2)
    if not 0 < stride <= seq_len:
        raise UserError(f"stride must be in (0, seq_len={seq_len}], got {stride}")
    if evaluator is not None and mode in SEGMENTED:
        raise UserError(f"stream mode {mode!r} does not combine with dynamic evaluation (use carry, reset or frozen)")
    bar = progress if isinstance(progress, Progress) else Progress(max_tokens or None, "tok",
                                                                   desc=desc or f"stream {mode}", enabled=bool(progress))
    sized = documents if isinstance(documents, EncodedDocuments) and not isinstance(progress, Progress) else None
    if sized is not None:  # the total: predictions of the whole text (estimated until it is all read), or max_tokens
        bar.total, bar.approximate = _stream_total(sized, max_tokens)
    res = StreamResult(mode, curve=PositionCurve(bin_width), state_norm=StateNormCurve(bin_width))
    rss0 = current_rss_mb()
    rss_max = rss0
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    dynamic = evaluator is not None and mode != "frozen"
    # the KV cache keeps seq_len - stride tokens between calls; in memory mode the segment bounds it instead
    keep = None if mode in SEGMENTED else seq_len - stride
    state = None
    try:
        with memory_writes(model, frozen=True if mode == "frozen" else None):
            for name, blocks in documents:
                if res.tokens >= max_tokens > 0:
                    break
                doc_nll, doc_n = 0.0, 0
                if dynamic:
                    doc_nll, doc_n, state = _dynamic_document(evaluator, blocks, state if mode == "carry" else None,
                                                              res, max_tokens, bar, sized)
                else:
                    if mode in ("reset",):
                        state = None
                    elif mode == "memory":
                        state = memory_only_state(state)
                    elif mode == "windows":
                        state = None
                    seg_used = 0
                    for x, y in _calls(blocks, stride):
                        if mode in SEGMENTED:
                            # a call never crosses a segment boundary: cut it where the segment ends
                            m = min(x.size, seq_len - seg_used)
                            pieces = [(x[:m], y[:m]), (x[m:], y[m:])] if m < x.size else [(x, y)]
                        else:
                            pieces = [(x, y)]
                        for xs, ys in pieces:
                            if xs.size == 0:
                                continue
                            if max_tokens > 0 and res.tokens + xs.size > max_tokens:
                                xs, ys = xs[: max_tokens - res.tokens], ys[: max_tokens - res.tokens]
                                if xs.size == 0:
                                    break
                            with torch.no_grad():
                                out = model(torch.from_numpy(xs)[None].to(device), state)
                            nll = _nll(out.logits, torch.from_numpy(ys)[None].to(device))
                            state = trimmed_state(model, out.state, keep)
                            res.curve.add(doc_n, nll)
                            doc_nll += float(nll.sum())
                            doc_n += nll.size
                            res.state_norm.add(doc_n, state_norms(state))
                            res.nll += float(nll.sum())
                            res.tokens += nll.size
                            if sized is not None:
                                bar.total, bar.approximate = _stream_total(sized, max_tokens)
                            bar.update(nll.size, loss=_bits(res.loss))
                            if mode in SEGMENTED:
                                seg_used += xs.size
                                if seg_used >= seq_len:
                                    state = memory_only_state(state) if mode == "memory" else None
                                    seg_used = 0
                        if res.tokens >= max_tokens > 0:
                            break
                        r = current_rss_mb()
                        if r is not None and rss_max is not None:
                            rss_max = max(rss_max, r)
                res.documents.append({"name": name, "tokens": doc_n, "loss": doc_nll / doc_n if doc_n else None})
    finally:
        model.train(was_training)
        if not isinstance(progress, Progress):
            bar.close()
    res.elapsed_s = time.perf_counter() - t0
    res.rss_mb = {"start": rss0, "max_sampled": rss_max, "end": current_rss_mb(), "peak_process": peak_rss_mb()}
    return res


def _stream_total(docs: EncodedDocuments, max_tokens: int) -> tuple[int, bool]:
    """(total, approximate) of a stream's progress line: the text's predictions, at most ``max_tokens``."""
    n, exact = docs.estimated_predictions()
    if max_tokens > 0 and (n == 0 or n >= max_tokens):  # nothing read yet, or the text is long enough
        return max_tokens, False
    return n, not exact


def _bits(loss_nats: float) -> str:
    return f"{loss_nats / math.log(2):.4f} bits/tok"


def _dynamic_document(ev, blocks, prev, res: StreamResult, max_tokens: int, bar, sized=None):
    """One document under dynamic evaluation; ``prev`` (a DynamicState) carries weights and model state."""
    from fastweights.adapt.dynamic import DynamicState

    state = None
    if prev is not None:  # carry: the adapted weights and the model state continue; the first token is context
        state = DynamicState(prev.values, prev.model_state, torch.zeros(0, dtype=torch.long), 0)
    limit = max_tokens - res.tokens + 1 if max_tokens > 0 else math.inf  # tokens of this document we may feed
    doc_nll, doc_n, fed = 0.0, 0, 0
    for block in blocks:
        ids = torch.from_numpy(block)
        if fed + ids.numel() > limit:
            ids = ids[: int(limit - fed)]
        if ids.numel() == 0:
            break
        fed += ids.numel()
        r, state = ev.evaluate(ids, state, final=False, keep_token_losses=True)
        if sized is not None:
            bar.total, bar.approximate = _stream_total(sized, max_tokens)
        _record(res, r.token_losses, doc_n, bar)
        doc_nll, doc_n = doc_nll + r.nll, doc_n + r.tokens
        res.state_norm.add(doc_n, state_norms(state.model_state))
    if state is not None and state.pending.numel() > 1:  # the unscored tail (shorter than a segment)
        r, state = ev.evaluate(torch.zeros(0, dtype=torch.long), state, final=True, keep_token_losses=True)
        _record(res, r.token_losses, doc_n, bar)
        doc_nll, doc_n = doc_nll + r.nll, doc_n + r.tokens
    return doc_nll, doc_n, state


def _record(res: StreamResult, losses: list, start: int, bar) -> None:
    if not losses:
        return
    arr = np.asarray(losses, dtype=np.float64)
    res.curve.add(start, arr)
    res.nll += float(arr.sum())
    res.tokens += arr.size
    bar.update(arr.size, loss=_bits(res.loss))


def plot_stream(runs: Sequence[dict], path: str | Path, title: str = "", unit: str = "nats") -> Path:
    """PNG: windowed (top) and cumulative (middle) loss against position, one line per (model, mode), and
    the carried state's norm (bottom; the largest layer's, when the runs recorded it).

    ``runs``: dicts with ``"label"`` and ``"curve"`` (a :meth:`PositionCurve.to_dict`), optionally
    ``"checkpoint"`` (one colour per model) and ``"mode"`` (one line style per mode). ``unit``: "nats" or "bits".
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastweights.core.files import save_figure

    scale = 1 / math.log(2) if unit == "bits" else 1.0
    styles = {"carry": "-", "reset": "--", "frozen": ":", "memory": "-.", "windows": (0, (1, 3))}
    models = list(dict.fromkeys(r.get("checkpoint", r["label"]) for r in runs))  # one colour per model
    norms = [r for r in runs if any(v is not None for v in (r.get("state_norm") or {}).get("max", []))]
    fig, axes = plt.subplots(3 if norms else 2, 1, figsize=(11, 9.5 if norms else 7), sharex=True)
    ax, ax2 = axes[0], axes[1]
    for run in runs:
        c = run["curve"]
        style = dict(color=f"C{models.index(run.get('checkpoint', run['label'])) % 10}",
                     ls=styles.get(run.get("mode"), "-"), lw=1.2)
        xs = [p for p, v in zip(c["position"], c["windowed"]) if v is not None]
        ax.plot(xs, [v * scale for v in c["windowed"] if v is not None], label=run["label"], **style)
        xs = [p for p, v in zip(c["position"], c["cumulative"]) if v is not None]
        ax2.plot(xs, [v * scale for v in c["cumulative"] if v is not None], **style)
        sn = run.get("state_norm")
        if norms and sn:
            xs = [p for p, v in zip(sn["position"], sn["max"]) if v is not None]
            axes[2].plot(xs, [v for v in sn["max"] if v is not None], **style)
    bw = runs[0]["curve"]["bin_width"] if runs else 0
    ax.set_ylabel(f"{unit}/token, window {bw}")
    ax2.set_ylabel(f"{unit}/token, cumulative")
    if norms:
        axes[2].set_ylabel("state norm (largest layer)")
        axes[2].set_yscale("log")
    axes[-1].set_xlabel("position in the document (predictions)")
    for a in axes:
        a.grid(alpha=0.3)
        if runs and max(len(r["curve"]["position"]) for r in runs) > 64:
            a.set_xscale("log")
    ax.set_title(title or "streaming loss along documents")
    fig.tight_layout(rect=(0, 0, 0.72, 1))  # the right quarter holds the legend, outside the curves
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    return save_figure(fig, path, dpi=110)

