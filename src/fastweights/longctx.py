"""Long-context memory measurements: streaming perplexity along documents and continual adaptation.

Both build on the explicit state of :class:`~fastweights.models.lm.LanguageModel`. Its parts play two
roles, and the measurements treat them differently:

* **memories** -- block memories with a separate write step (FwPKM, FwMLP: ``layers[i]["memory"]``)
  and the head's fast weights (FWL: ``state["head"]``): knowledge the model writes while it reads;
* **context** -- the mixers' states (``layers[i]["mixer"]``: the KV cache of softmax attention,
  the fast-weight matrix of a fast weight programmer / GDN, the fast-weights RNN's h and A): the
  working context of the current passage.

Streaming perplexity (:func:`stream_eval`), in the spirit of the FwPKM paper's PPL protocol and the
time-scale analysis of dynamic evaluation (Krause et al. 2018, Fig. 2). Documents are read in order
at batch 1, in calls of ``stride`` tokens; the KV cache keeps ``seq_len - stride`` tokens between calls
(constant memory). The first token of every document is context only. Modes:

    carry    the whole state carries across calls and document boundaries
    reset    the whole state starts fresh at every document
    frozen   as carry, but memories never write (FwPKM/FwMLP ``frozen``; the paper's App. D.2 check);
             with dynamic evaluation: no updates
    memory   mixer (context) states start fresh every ``seq_len`` predictions and at every document (within
             a segment the KV cache is not trimmed), memories carry across everything (the paper: "caches
             reset per segment, fast weights not")

Per-position curves aggregate the NLL of the i-th prediction of each document d over documents, in
bins b = floor(i / bin_width)::

    windowed_b   = sum_{d, i in b} nll_{d,i} / #{(d, i): i in b}           (Krause et al.'s non-cumulative curve)
    cumulative_b = sum_{d, i in b' <= b} nll_{d,i} / #{(d, i): i in b' <= b}

Only the bin sums and counts are kept, never a per-token array, so a stream of any length runs in
constant memory (as long as the model's own state is bounded).

Continual adaptation (:func:`adapt_test`, the FwPKM paper's continual-learning protocol): the model
reads the adaptation text of domain 1, 2, ... in sequence with memory writes on (or with dynamic
evaluation updating the slow weights); after every stage the held-out text of *every* domain is
scored from a copy of the post-stage state with updates off, so later stages continue from the
post-stage state untouched. Stage 0 is the model before any adaptation. The table reports the NLL
per (stage, domain) and its change from stage 0.

Mechanisms without a write step cannot be frozen: the mixers (their state is the context itself)
and the FWL head (its fast weights change at every token inside the forward; it has no switch),
which :func:`unfrozen_fast_parts` lists so that results can say so.
"""

from __future__ import annotations

import contextlib
import dataclasses
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

from fastweights.components import FastHead, FastMemory, GatedMemory, TrimsState
from fastweights.errors import UserError
from fastweights.progress import Progress

STREAM_MODES = ("carry", "reset", "frozen", "memory")


# ----------------------------------------------------------------------------- state parts and switches


def fast_memories(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Block memories with a write step and a ``frozen`` switch (FwPKM, FwMLP) inside ``model``."""
    return [m for m in model.modules() if isinstance(m, FastMemory)]


def unfrozen_fast_parts(model: torch.nn.Module) -> list[str]:
    """Components whose weights change at test time but that have no freeze switch (the FWL head)."""
    head = getattr(model, "head", None)
    out = []
    if isinstance(head, FastHead):
        out.append(f"head ({type(head).__name__})")
    return out


@contextlib.contextmanager
def memory_writes(model: torch.nn.Module, frozen: bool | None = None, chunk_size: int | None = None):
    """Temporarily switch the memories' writes: ``frozen=True`` reads without writing; ``chunk_size``
    makes them write every ``chunk_size`` tokens (e.g. once per read of a context of that length; start
    from a state whose current chunk is empty, see :func:`check_chunk_empty`).

    ``None`` leaves a setting as it is. The memories' own settings come back on exit, whatever happens.
    The switches are the memories' public ``frozen`` attribute and their ``options.chunk_size``
    (replaced by a copy of the options for the duration).
    """
    mems = fast_memories(model)
    saved = [(m, m.frozen, m.options) for m in mems]
    try:
        for m in mems:
            if frozen is not None:
                m.frozen = frozen
            if chunk_size is not None:
                if chunk_size <= m.options.lookahead:
                    raise UserError(f"memory write chunk {chunk_size} must exceed the lookahead {m.options.lookahead}")
                m.options = dataclasses.replace(m.options, chunk_size=int(chunk_size))
        yield mems
    finally:
        for m, fr, opts in saved:
            m.frozen, m.options = fr, opts


def memory_only_state(state: dict | None) -> dict | None:
    """The state with the mixers' (context) states dropped: memories and the head's fast weights kept."""
    if state is None:
        return None
    layers = [{"memory": s["memory"]} if "memory" in s else {} for s in state["layers"]]
    return {"layers": layers, "head": state.get("head")}


def check_chunk_empty(state) -> None:
    """UserError unless every memory's current chunk is empty (nothing read since its last write), which a
    write-chunk override needs: a chunk already longer than the new size would never close."""
    if state is None:
        return
    for s in state["layers"]:
        mem = s.get("memory")
        if mem is not None and getattr(mem, "n_read", 0):
            raise UserError("a per-read memory write needs a state whose memory chunk is empty; "
                            "use write_chunk='model' to read with the memory's own chunk size")


def _trim(model, state, keep: int | None):
    if keep is None or state is None or not isinstance(model, TrimsState):
        return state
    return model.trim_state(state, max(0, keep))


@torch.no_grad()
def read_tokens(model, ids: torch.Tensor, state=None, piece: int = 512, context: int | None = None,
                want_logits: bool = False):
    """Feed ``ids`` ([T]) to ``model`` in calls of ``piece`` tokens, carrying the state.

    ``context``: KV-cache tokens kept between calls (None: unbounded). Returns the state, or
    ``(logits [1, t, V] of the last call, state)`` with ``want_logits``.
    """
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"read_tokens needs a non-empty 1-D token tensor, got shape {tuple(ids.shape)}")
    logits = None
    for a in range(0, ids.numel(), piece):
        out = model(ids[None, a : a + piece], state)
        state = _trim(model, out.state, context)
        logits = out.logits
    return (logits, state) if want_logits else state


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


# ----------------------------------------------------------------------------- documents as token streams


def encode_documents(docs: Sequence, tokenizer, max_chars: int = 0) -> Iterator[tuple[str, Iterator[np.ndarray]]]:
    """``(name, blocks)`` per document; ``blocks`` yields the token ids of consecutive text pieces.

    Pieces are cut where no tokenizer's output changes (``Document.pieces``), so the blocks
    concatenate to the document's encoding, and a long file is never held as one token array.
    ``max_chars`` > 0 stops after that many characters in all.
    """
    left = max_chars if max_chars > 0 else math.inf
    for d in docs:
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
                ids = np.asarray(tokenizer.encode(piece), dtype=np.int64)
                if ids.size:
                    yield ids

        yield name, blocks()


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
                "rss_mb": self.rss_mb, "curve": self.curve.to_dict(), "documents": self.documents}


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> np.ndarray:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return (-logp.gather(-1, targets[..., None])[..., 0]).reshape(-1).double().cpu().numpy()


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
                evaluator=None, progress: bool | Progress = False) -> StreamResult:
    """Score documents in order at batch 1 under ``mode`` (see the module docstring).

    Args:
        model: a LanguageModel (or anything with ``forward(tokens, state) -> .logits, .state``).
        documents: ``(name, blocks of token ids)`` per document, e.g. from :func:`encode_documents`.
        mode: one of :data:`STREAM_MODES`.
        seq_len: the context length (KV cache keeps ``seq_len - stride``); the segment of "memory" mode.
        stride: predictions per forward call (default ``seq_len // 2``).
        bin_width: predictions per bin of the per-position curves.
        max_tokens: stop after this many predictions in all (0: everything).
        evaluator: a :class:`~fastweights.adapt.dynamic.DynamicEvaluator` to add dynamic evaluation on
            top (modes carry and reset; frozen runs static; its own segment and context apply).
        progress: show a progress line (or a :class:`Progress` to update).
    """
    if mode not in STREAM_MODES:
        raise UserError(f"unknown stream mode {mode!r}; choose from {', '.join(STREAM_MODES)}")
    stride = stride or max(1, seq_len // 2)
    if not 0 < stride <= seq_len:
        raise UserError(f"stride must be in (0, seq_len={seq_len}], got {stride}")
    if evaluator is not None and mode == "memory":
        raise UserError("stream mode 'memory' does not combine with dynamic evaluation (use carry, reset or frozen)")
    bar = progress if isinstance(progress, Progress) else Progress(max_tokens or None, "tok", desc=f"stream {mode}",
                                                                   enabled=bool(progress))
    res = StreamResult(mode, curve=PositionCurve(bin_width))
    rss0 = current_rss_mb()
    rss_max = rss0
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    dynamic = evaluator is not None and mode != "frozen"
    # the KV cache keeps seq_len - stride tokens between calls; in memory mode the segment bounds it instead
    keep = None if mode == "memory" else seq_len - stride
    state = None
    try:
        with memory_writes(model, frozen=True if mode == "frozen" else None):
            for name, blocks in documents:
                if res.tokens >= max_tokens > 0:
                    break
                doc_nll, doc_n = 0.0, 0
                if dynamic:
                    doc_nll, doc_n, state = _dynamic_document(evaluator, blocks, state if mode == "carry" else None,
                                                              res, max_tokens, bar)
                else:
                    if mode in ("reset",):
                        state = None
                    elif mode == "memory":
                        state = memory_only_state(state)
                    seg_used = 0
                    for x, y in _calls(blocks, stride):
                        if mode == "memory":
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
                            state = _trim(model, out.state, keep)
                            res.curve.add(doc_n, nll)
                            doc_nll += float(nll.sum())
                            doc_n += nll.size
                            res.nll += float(nll.sum())
                            res.tokens += nll.size
                            bar.update(nll.size, loss=res.loss)
                            if mode == "memory":
                                seg_used += xs.size
                                if seg_used >= seq_len:
                                    state, seg_used = memory_only_state(state), 0
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


def _dynamic_document(ev, blocks, prev, res: StreamResult, max_tokens: int, bar):
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
        _record(res, r.token_losses, doc_n, bar)
        doc_nll, doc_n = doc_nll + r.nll, doc_n + r.tokens
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
    bar.update(arr.size, loss=res.loss)


def plot_stream(runs: Sequence[dict], path: str | Path, title: str = "", unit: str = "nats") -> Path:
    """PNG: windowed (top) and cumulative (bottom) loss against position, one line per (model, mode).

    ``runs``: dicts with ``"label"`` and ``"curve"`` (a :meth:`PositionCurve.to_dict`), optionally
    ``"checkpoint"`` (one colour per model) and ``"mode"`` (one line style per mode). ``unit``: "nats" or "bits".
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastweights.checkpoint import atomic_write

    scale = 1 / math.log(2) if unit == "bits" else 1.0
    styles = {"carry": "-", "reset": "--", "frozen": ":", "memory": "-."}
    models = list(dict.fromkeys(r.get("checkpoint", r["label"]) for r in runs))  # one colour per model
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for run in runs:
        c = run["curve"]
        style = dict(color=f"C{models.index(run.get('checkpoint', run['label'])) % 10}",
                     ls=styles.get(run.get("mode"), "-"), lw=1.2)
        xs = [p for p, v in zip(c["position"], c["windowed"]) if v is not None]
        ax.plot(xs, [v * scale for v in c["windowed"] if v is not None], label=run["label"], **style)
        xs = [p for p, v in zip(c["position"], c["cumulative"]) if v is not None]
        ax2.plot(xs, [v * scale for v in c["cumulative"] if v is not None], **style)
    bw = runs[0]["curve"]["bin_width"] if runs else 0
    ax.set_ylabel(f"{unit}/token, window {bw}")
    ax2.set_ylabel(f"{unit}/token, cumulative")
    ax2.set_xlabel("position in the document (predictions)")
    for a in (ax, ax2):
        a.grid(alpha=0.3)
        if runs and max(len(r["curve"]["position"]) for r in runs) > 64:
            a.set_xscale("log")
    ax.legend(fontsize=8)
    ax.set_title(title or "streaming loss along documents")
    fig.tight_layout()
    path = Path(path)
    atomic_write(path, lambda p: fig.savefig(p, dpi=110, format="png"))
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- continual adaptation


@dataclass
class Domain:
    """A domain of the continual-adaptation test: disjoint adaptation and evaluation token ids."""

    name: str
    adapt: torch.Tensor  # [A + 1] ids (A predictions)
    eval: torch.Tensor  # [E + 1] ids, taken from the end of the text


def make_domain(name: str, text: str, tokenizer, adapt_tokens: int, eval_tokens: int) -> Domain:
    """Adaptation ids from the start of ``text``, evaluation ids from its end; their characters never overlap."""
    if adapt_tokens < 1 or eval_tokens < 1:
        raise UserError("adapt and eval token counts must be >= 1")

    def take(n_tokens: int, from_end: bool) -> np.ndarray:
        """Ids of the shortest doubling of a text span (from the start or the end) holding n_tokens + 1."""
        n_chars = 4 * (n_tokens + 1) + 256
        while True:
            piece = text[-n_chars:] if from_end else text[:n_chars]
            ids = np.asarray(tokenizer.encode(piece), dtype=np.int64)
            if ids.size >= n_tokens + 1 or n_chars >= len(text):
                return ids
            n_chars *= 2

    head = take(adapt_tokens, False)
    tail = take(eval_tokens, True)
    too_short = head.size < adapt_tokens + 1 or tail.size < eval_tokens + 1
    if not too_short:  # the characters the two id ranges cover must not overlap
        adapt_chars = len(tokenizer.decode(head[: adapt_tokens + 1].tolist()))
        eval_chars = len(tokenizer.decode(tail[-(eval_tokens + 1):].tolist()))
        too_short = adapt_chars + eval_chars > len(text)
    if too_short:
        raise UserError(f"domain {name!r} is too short for --adapt-tokens {adapt_tokens} and --eval-tokens "
                        f"{eval_tokens} without overlap ({len(text)} characters)")
    return Domain(name, torch.from_numpy(head[: adapt_tokens + 1].copy()), torch.from_numpy(tail[-(eval_tokens + 1):].copy()))


def _score(model, ids: torch.Tensor, state, seq_len: int, stride: int, evaluator=None, values=None) -> float:
    """Mean NLL of ``ids`` from ``state`` with updates off (memories frozen, adapted weights fixed)."""
    from fastweights.evaluate import score_tokens

    device = next(model.parameters()).device
    with memory_writes(model, frozen=True):
        if evaluator is not None:
            with evaluator._session(values):
                r, _ = score_tokens(model, ids.to(device), seq_len, stride, state=state)
        else:
            r, _ = score_tokens(model, ids.to(device), seq_len, stride, state=state)
    return r.loss


def adapt_test(model, domains: Sequence[Domain], seq_len: int, stride: int | None = None,
               eval_state: str = "memory", evaluator=None, progress: bool = False) -> dict:
    """The continual-adaptation protocol (module docstring); returns a JSON-ready dict.

    Args:
        model: the model; its slow weights never change (dynamic evaluation adapts a copy's deltas).
        domains: in adaptation order.
        seq_len, stride: the streaming protocol of adaptation and scoring (as :func:`stream_eval`).
        eval_state: "memory" (scores start from the post-stage memories with fresh mixer states) or
            "all" (from the whole post-stage state, the KV cache trimmed to ``seq_len - stride``).
        evaluator: a DynamicEvaluator: adaptation also updates the slow weights (score-then-update);
            scoring uses the post-stage weights without updates.

    Returns ``{"domains", "stages", "nll": [[stage][domain]], "delta": nll - stage 0, "adapt_nll": per stage,
    "mean_delta"}`` (nats per token).
    """
    from fastweights.adapt.dynamic import DynamicState
    from fastweights.evaluate import score_tokens

    if eval_state not in ("memory", "all"):
        raise UserError(f"eval_state must be 'memory' or 'all', got {eval_state!r}")
    if not domains:
        raise UserError("adapt-test needs at least one domain")
    stride = stride or max(1, seq_len // 2)
    keep = seq_len - stride
    n_adapt = sum(d.adapt.numel() - 1 for d in domains)
    n_eval = sum(d.eval.numel() - 1 for d in domains) * (len(domains) + 1)
    bar = Progress(n_adapt + n_eval, "tok", desc="adapt-test", enabled=progress)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()

    def evaluate_all(state, values):
        start = memory_only_state(state) if eval_state == "memory" else _trim(model, state, keep)
        row = []
        for d in domains:
            row.append(_score(model, d.eval, start, seq_len, stride, evaluator, values))
            bar.update(d.eval.numel() - 1)
        return row

    nll = []
    adapt_nll = []
    try:
        nll.append(evaluate_all(None, None))
        state, dstate = None, None
        for d in domains:
            if evaluator is None:
                r, state = score_tokens(model, d.adapt.to(device), seq_len, stride, state=state)
                values = None
            else:
                start = None if dstate is None else DynamicState(dstate.values, dstate.model_state,
                                                                 torch.zeros(0, dtype=torch.long), 0)
                r, dstate = evaluator.evaluate(d.adapt, start, final=True, keep_token_losses=False)
                state, values = dstate.model_state, dstate.values
            bar.update(d.adapt.numel() - 1)
            adapt_nll.append(r.loss)
            nll.append(evaluate_all(state, values))
    finally:
        model.train(was_training)
        bar.close()
    base = nll[0]
    delta = [[v - b for v, b in zip(row, base)] for row in nll]
    return {"domains": [d.name for d in domains], "stages": ["before"] + [f"after {d.name}" for d in domains],
            "nll": nll, "delta": delta, "adapt_nll": adapt_nll,
            "mean_delta": [sum(r) / len(r) for r in delta],
            "tokens": {d.name: {"adapt": d.adapt.numel() - 1, "eval": d.eval.numel() - 1} for d in domains},
            "eval_state": eval_state, "seq_len": seq_len, "stride": stride,
            "not_frozen": unfrozen_fast_parts(model)}


def format_adapt_table(result: dict) -> str:
    """The NLL-change table as text: one row per stage, one column per domain (nats/token vs stage 0)."""
    names = result["domains"]
    w = max(8, *(len(n) for n in names))
    head = f"{'stage':<{max(len(s) for s in result['stages'])}}  " + "  ".join(f"{n:>{w}}" for n in names) + f"  {'mean':>8}"
    lines = [head, "-" * len(head)]
    sw = max(len(s) for s in result["stages"])
    for i, stage in enumerate(result["stages"]):
        if i == 0:
            cells = "  ".join(f"{v:>{w}.4f}" for v in result["nll"][0])
            lines.append(f"{stage:<{sw}}  {cells}  {sum(result['nll'][0]) / len(names):>8.4f}")
        else:
            cells = "  ".join(f"{v:>+{w}.4f}" for v in result["delta"][i])
            lines.append(f"{stage:<{sw}}  {cells}  {result['mean_delta'][i]:>+8.4f}")
    lines.append("(first row: NLL in nats/token before adaptation; others: change from it)")
    return "\n".join(lines)


def plot_adapt(result: dict, path: str | Path, title: str = "") -> Path:
    """PNG: change of each domain's NLL after each adaptation stage (the continual-learning plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastweights.checkpoint import atomic_write

    stages = result["stages"]
    fig, ax = plt.subplots(figsize=(1.4 * len(stages) + 3, 4))
    for j, name in enumerate(result["domains"]):
        ax.plot(range(len(stages)), [row[j] for row in result["delta"]], marker="o", label=name)
    ax.plot(range(len(stages)), result["mean_delta"], color="k", ls="--", lw=1, label="mean")
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xticks(range(len(stages)), stages, rotation=20, ha="right")
    ax.set_ylabel("NLL change vs before (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "continual adaptation: held-out NLL after each stage")
    fig.tight_layout()
    path = Path(path)
    atomic_write(path, lambda p: fig.savefig(p, dpi=110, format="png"))
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- FwPKM gate map


@torch.no_grad()
def gate_values(model, tokenizer, text: str, chunk_size: int | None = 32, piece: int = 512):
    """Per-token gate g_t of every FwPKM layer while ``model`` reads ``text`` (memory writes on).

    ``chunk_size``: the memories write every this many tokens (the paper's visualisation uses 32;
    None keeps the trained chunk). Returns ``(token ids [T], {layer index: gates [T] numpy})``.
    """
    layers = {i: b.memory for i, b in enumerate(getattr(model, "blocks", [])) if isinstance(b.memory, GatedMemory)}
    if not layers:
        raise UserError("this model has no FwPKM layer (no memory exposing its gate)")
    device = next(model.parameters()).device
    ids = torch.as_tensor(np.asarray(tokenizer.encode(text)), dtype=torch.long, device=device)
    if ids.numel() == 0:
        raise UserError("the text to visualise is empty")
    saved = {i: (m.record_reads, m.gate_log, m.read_log) for i, m in layers.items()}
    was_training = model.training
    model.eval()
    try:
        for m in layers.values():
            m.record_reads, m.gate_log, m.read_log = True, [], []
        with memory_writes(model, chunk_size=chunk_size):
            read_tokens(model, ids, None, piece)
        gates = {i: torch.cat([g.reshape(-1) for g in m.gate_log]).float().numpy() for i, m in layers.items()}
    finally:
        for i, m in layers.items():
            m.record_reads, m.gate_log, m.read_log = saved[i]
        model.train(was_training)
    return ids.cpu().numpy(), gates


def plot_gate_map(tokens: Sequence[str], gates: dict, path: str | Path, width: int = 64, title: str = "") -> Path:
    """PNG: the text laid out in rows of ``width`` tokens, each cell coloured by its gate, one panel per layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastweights.checkpoint import atomic_write

    T = len(tokens)
    rows = max(1, math.ceil(T / width))
    n = len(gates)
    fig, axes = plt.subplots(n, 1, figsize=(max(6, width * 0.16), (rows * 0.22 + 0.8) * n), squeeze=False)
    for ax, (layer, g) in zip(axes[:, 0], sorted(gates.items())):
        grid = np.full((rows, width), np.nan)
        grid.flat[:T] = g[:T]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto", interpolation="nearest")
        for t, tok in enumerate(tokens):
            shown = tok.replace("\n", "\u21b5").replace(" ", "\u00b7")[:3]
            ax.text(t % width, t // width, shown, ha="center", va="center", fontsize=5,
                    color="white" if g[t] < 0.5 else "black")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_ylabel(f"layer {layer}")
        fig.colorbar(im, ax=ax, fraction=0.02, pad=0.01, label="gate g_t")
    axes[0, 0].set_title(title or "FwPKM gate per token (1 = memory read, 0 = bypass)")
    path = Path(path)
    atomic_write(path, lambda p: fig.savefig(p, dpi=130, format="png", bbox_inches="tight"))
    plt.close(fig)
    return path
