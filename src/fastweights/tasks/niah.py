"""Needle in a haystack (NIAH) with iterative reading, after Zhao & Jones 2026 (FwPKM, arXiv 2601.00671,
section 4 and ``src/corpus/create_niah.py`` / ``src/eval_niah.py`` of the released code).

A sample is a window of real text (the haystack) with ``N_NEEDLES`` = 5 needles planted in it::

    "The secret number for ID-3fa9 is 048213."        key: "ID-" + 4 hex digits, value: 6 decimal digits

keys are distinct, values are distinct, and neither occurs in the haystack text. One needle is the
target; the prompt is the context followed by ``" The secret number for ID-3fa9 is"`` and the model
decodes greedily until it has produced 6 non-blank characters. Metrics: exact match, per-digit
accuracy (share of the 6 positions right) and candidate match (the answer equals the value of *some*
needle: the model found a needle but not the right one).

Depths: the target needle is put at a fixed relative depth (``depths=[0.0, 0.5, 1.0]``: 0 = start
of the context, 1 = end) or at a uniform random depth (``"uniform"``, reported in depth bins); the 4
distractors are at uniform random depths. Lengths are in tokens of the model's tokenizer (the paper
counts haystack words); the context holds the filler text and the needles, the question comes after.

Iterative reading (the paper's n-iter protocol): read the bare context n - 1 times, then the context
and the question, then decode the answer. Fast-weight memories write once at the end of every read
(``write_chunk="read"``: the memory's chunk is the context length, as the paper's evaluation sets
C = the haystack length) and never while the question is read or the answer decoded (they are frozen,
see :func:`fastweights.models.memory_switches.memory_writes`). The model state (KV cache, fast-weight matrices,
memory tables) carries from read to read (``reread="carry"``, as the released code's cache object);
``reread="memory"`` resets the mixers' states before each re-read so that only the memories carry.
As in the paper, where the last read is context + question in one call whose outputs come before that
call's memory write, the question of n reads sees the memories written by the n - 1 earlier reads (with
1 read, the fresh memory: only the mixers can answer) and the mixer state (KV cache) of all n reads. The
answers for n = 1, 2, ... come from one sequence of reads: the question is asked from a copy of the state
after read n with the memories of read n - 1, and read n + 1 continues from the state before the question.
(Before issue 17 the question saw the memories of all n reads, one read ahead of the paper.)

Each sample starts from a fresh state (the project default); ``carry=True`` carries the state from one
sample to the next (the released code's behaviour). Samples are deterministic functions of
``(seed, length, depth, index)``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch

from fastweights.core.config import setting_field
from fastweights.core.errors import UserError
from fastweights.core.numbers import nonneg_int, positive_int
from fastweights.models.memory_switches import check_chunk_empty, memory_only_state, memory_writes, read_tokens
from fastweights.core.progress import Progress

N_NEEDLES = 5
KEY_HEX = 4
VALUE_DIGITS = 6
NEEDLE_TEMPLATE = "The secret number for {key} is {value}."
QUESTION_TEMPLATE = " The secret number for {key} is"
_MARKER = "secret number for"  # a haystack window containing this could make a question ambiguous


# ----------------------------------------------------------------------------- haystacks


class Haystack:
    """Filler text for NIAH contexts: one string (documents joined by blank lines).

    ``Haystack.load(spec)``: ``spec`` is anything :func:`fastweights.data.load_corpus` accepts (a file,
    a directory of ``*.txt``, a corpus name); None is the bundled tinyshakespeare.
    """

    def __init__(self, text: str, name: str = "text"):
        text = text.strip()
        if len(text) < 1000:
            raise UserError(f"haystack {name!r} is too short ({len(text)} characters; need at least 1000)")
        if _MARKER in text:
            raise UserError(f"haystack {name!r} contains {_MARKER!r}, which would make the questions ambiguous")
        self.text = text
        self.name = name
        self._ratio: dict[str, float] = {}

    @classmethod
    def load(cls, spec: str | None = None) -> "Haystack":
        from fastweights.data import load_corpus

        spec = spec or "tinyshakespeare"
        docs = load_corpus(spec)
        return cls("\n\n".join(d.text.strip() for d in docs if d.n_chars), name=spec)

    def chars_per_token(self, tokenizer) -> float:
        """Characters per token of this text under ``tokenizer`` (from its first 50,000 characters)."""
        key = f"{getattr(tokenizer, 'name', '')}:{id(tokenizer)}"
        if key not in self._ratio:
            probe = self.text[:50000]
            self._ratio[key] = len(probe) / max(1, len(tokenizer.encode(probe)))
        return self._ratio[key]

    def window(self, start: int, n_chars: int) -> str:
        """``n_chars`` characters from ``start``, wrapping around to the beginning (after a blank line)."""
        out, pos = [], start % len(self.text)
        while n_chars > 0:
            piece = self.text[pos : pos + n_chars]
            out.append(piece)
            n_chars -= len(piece)
            if n_chars > 0:
                out.append("\n\n")
                n_chars -= 2
                pos = 0
        return "".join(out)


# ----------------------------------------------------------------------------- samples


@dataclass(frozen=True)
class Needle:
    key: str  # "ID-" + 4 lowercase hex digits
    value: str  # 6 decimal digits
    depth: float  # requested relative depth in [0, 1]
    offset: int  # character offset of the needle's text in the context


@dataclass(frozen=True)
class NiahSample:
    """One NIAH prompt. ``context + question`` is what the model reads; ``answer`` is never shown to it."""

    context: str
    question: str
    answer: str
    needles: tuple[Needle, ...]
    target: int  # index of the asked needle in ``needles``
    length: int  # requested context length in tokens
    tokens: int  # actual context length in tokens
    depth: float  # requested depth of the target
    seed: str  # what the sample was generated from
    format: str = "char"  # "char" (this module) or "token" (fastweights.tasks.niah_token)

    @property
    def candidates(self) -> list[str]:
        return [n.value for n in self.needles]

    @property
    def target_depth(self) -> float:
        """Where the target needle actually sits: its character offset over the context length."""
        return self.needles[self.target].offset / max(1, len(self.context))


def needle_text(key: str, value: str) -> str:
    return NEEDLE_TEMPLATE.format(key=key, value=value)


def question_text(key: str) -> str:
    return QUESTION_TEMPLATE.format(key=key)


def check_tokenizer(tokenizer) -> None:
    """UserError when the tokenizer cannot write the needle format (a char vocabulary without digits)."""
    unk = getattr(tokenizer, "unk_id", None)
    if unk is None:
        return
    probe = needle_text("ID-0123456789abcdef", "0123456789") + question_text("ID-x")
    ids = tokenizer.encode(probe)
    if (np.asarray(ids) == unk).any():
        missing = sorted({c for c in probe if unk in tokenizer.encode(c)})
        raise UserError(f"the model's tokenizer cannot encode {''.join(missing)!r}, which NIAH needles use; "
                        "train on text containing digits and hex letters (e.g. the niah-cpu preset)")


def _distinct(rng: random.Random, n: int, draw, banned_text: str) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        s = draw()
        if s not in out and s not in banned_text:
            out.append(s)
    return out


def _word_start(text: str, p: int) -> int:
    """The first position >= p that starts a word (0, or just after a whitespace character)."""
    while 0 < p < len(text) and not text[p - 1].isspace():
        p += 1
    return min(p, len(text))


def _filler(haystack: Haystack, tokenizer, n_tokens: int, rng: random.Random) -> str:
    """``n_tokens`` tokens of haystack text from a random word start, free of the needle marker."""
    if n_tokens <= 0:
        return ""
    for _ in range(100):
        start = _word_start(haystack.text, rng.randrange(len(haystack.text)))
        n_chars = int(n_tokens * haystack.chars_per_token(tokenizer) * 1.2) + 64
        while True:
            ids = tokenizer.encode(haystack.window(start, n_chars))
            if len(ids) >= n_tokens:
                break
            n_chars *= 2
        text = tokenizer.decode(ids[:n_tokens])
        # end on a whole word (the question then follows a complete word) when that costs little text
        cut = max(text.rfind(" "), text.rfind("\n"))
        if cut >= 0.9 * len(text):
            text = text[:cut]
        if _MARKER not in text:
            return text
    raise UserError(f"could not find haystack text without {_MARKER!r}")  # pragma: no cover


def make_sample(haystack: Haystack, tokenizer, length: int, depth: float | None = None, seed: int = 0,
                index: int = 0, n_needles: int = N_NEEDLES) -> NiahSample:
    """One sample: a context of about ``length`` tokens with ``n_needles`` needles, one of them asked.

    Args:
        haystack: filler text.
        tokenizer: the model's tokenizer (lengths are counted in its tokens).
        length: context length in tokens (filler + needles; the question comes on top).
        depth: relative depth of the target needle in [0, 1]; None = uniform random.
        seed, index: the sample is a deterministic function of (seed, length, depth, index).
        n_needles: needles planted (the target + distractors).
    """
    if n_needles < 1:
        raise UserError(f"n_needles must be >= 1, got {n_needles}")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise UserError(f"needle depth must be in [0, 1], got {depth}")
    tag = f"niah:{seed}:{length}:{'uniform' if depth is None else f'{depth:.6g}'}:{index}"
    rng = random.Random(tag)  # str seeds hash with SHA-512: stable across runs and Python processes
    keys = _distinct(rng, n_needles, lambda: "ID-" + "".join(rng.choice("0123456789abcdef") for _ in range(KEY_HEX)), "")
    values = _distinct(rng, n_needles, lambda: "".join(rng.choice("0123456789") for _ in range(VALUE_DIGITS)), "")
    target = rng.randrange(n_needles)
    depths = [rng.random() for _ in range(n_needles)]
    depths[target] = rng.random() if depth is None else depth
    texts = [needle_text(k, v) + " " for k, v in zip(keys, values)]
    needle_tokens = sum(len(tokenizer.encode(t)) for t in texts)
    if needle_tokens >= length:
        raise UserError(f"context length {length} is too short for {n_needles} needles ({needle_tokens} tokens)")
    filler = _filler(haystack, tokenizer, length - needle_tokens, rng)
    # a key or value that happens to occur in this window would be a collision: redraw those
    for i in range(n_needles):
        while keys[i] in filler or keys.count(keys[i]) > 1:
            keys[i] = "ID-" + "".join(rng.choice("0123456789abcdef") for _ in range(KEY_HEX))
        while values[i] in filler or values.count(values[i]) > 1:
            values[i] = "".join(rng.choice("0123456789") for _ in range(VALUE_DIGITS))
    texts = [needle_text(k, v) + " " for k, v in zip(keys, values)]
    # insertion points: word starts of the filler at each depth; ties keep needle order
    points = sorted(((_word_start(filler, round(d * len(filler))), i) for i, d in enumerate(depths)))
    parts, offsets, prev, pos = [], [0] * n_needles, 0, 0
    for p, i in points:
        chunk = filler[prev:p]
        if p == len(filler) and pos + len(chunk) > 0 and not (chunk or parts[-1])[-1:].isspace():
            chunk += " "  # a needle at the very end follows the last word after a space
        parts.append(chunk)
        pos += len(chunk)
        offsets[i] = pos
        parts.append(texts[i])
        pos += len(texts[i])
        prev = p
    parts.append(filler[prev:])
    context = "".join(parts).rstrip(" ")
    needles = tuple(Needle(keys[i], values[i], depths[i], offsets[i]) for i in range(n_needles))
    return NiahSample(context=context, question=question_text(keys[target]), answer=values[target],
                      needles=needles, target=target, length=length, tokens=len(tokenizer.encode(context)),
                      depth=depths[target], seed=tag)


def make_samples(haystack: Haystack, tokenizer, lengths: Sequence[int], depths: str | Sequence[float] = "uniform",
                 samples: int = 10, seed: int = 0) -> list[NiahSample]:
    """``samples`` samples per length (``depths="uniform"``) or per (length, depth) cell (a list of depths)."""
    out = []
    for length in lengths:
        cells = [None] if isinstance(depths, str) else list(depths)
        for d in cells:
            out.extend(make_sample(haystack, tokenizer, length, d, seed, i) for i in range(samples))
    return out


def parse_depths(text: str) -> str | list[float]:
    """``"uniform"`` or a comma-separated list of depths in [0, 1]."""
    if text.strip() == "uniform":
        return "uniform"
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--depths must be 'uniform' or numbers in [0, 1] separated by commas, got {text!r}") from None
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise UserError(f"--depths must be 'uniform' or numbers in [0, 1] separated by commas, got {text!r}")
    return values


# ----------------------------------------------------------------------------- scoring


METRICS = {"char": ("exact", "digits", "candidate"), "token": ("exact", "candidate"),
           "multitoken": ("exact", "per_token", "candidate")}
METRIC_ORDER = ("exact", "digits", "per_token", "candidate")


def score_answer(prediction: str, sample: NiahSample) -> dict:
    """Exact match, per-digit or per-token accuracy and candidate match of a decoded answer.

    Char format: the first ``len(answer)`` characters after leading blanks, "digits" the share of the 6 positions
    right. Token format: the answer is one token (``<v23>``), so its record has no "digits" (comparing the
    characters of ``<v23>`` and ``<v17>`` would score 0.6 for a wrong answer). Multi-token format: the first as
    many generated tokens (words) as the answer has, "per_token" the share right position by position and
    "token_hits" which. Every record names its ``format``."""
    if sample.format == "multitoken":
        want = sample.answer.split(" ")
        got = prediction.split()[: len(want)]
        hits = [int(a == b) for a, b in zip(got, want)] + [0] * (len(want) - len(got))
        pred = " ".join(got)
        return {"prediction": pred, "format": sample.format, "exact": float(got == want),
                "per_token": sum(hits) / len(want), "token_hits": hits, "candidate": float(pred in sample.candidates)}
    pred = prediction.strip()[: len(sample.answer)]
    rec = {"prediction": pred, "format": sample.format, "exact": float(pred == sample.answer)}
    if "digits" in METRICS[sample.format]:
        rec["digits"] = sum(a == b for a, b in zip(pred, sample.answer)) / len(sample.answer)
    rec["candidate"] = float(pred in sample.candidates)
    return rec


# ----------------------------------------------------------------------------- the evaluator


def parse_iters(text: str) -> tuple[int, ...]:
    """``"1,2,3"`` -> ``(1, 2, 3)``: the distinct reads to report, sorted; UserError unless each is an integer >= 1."""
    parts = [x.strip() for x in text.split(",")]
    if not all(x.isdigit() and int(x) >= 1 for x in parts):
        raise UserError(f"--iters must be comma-separated integers >= 1, got {text!r}")
    return tuple(sorted({int(x) for x in parts}))


@dataclass
class NiahOptions:
    """How samples are read (the flags of ``fastweights task niah`` are generated from these fields)."""

    iters: tuple[int, ...] = setting_field((1,), "reads of the context before the question to report, "
                                                 "comma-separated, e.g. 1,2,3,4 (the n of the n-iter protocol)",
                                           type=parse_iters)
    write_chunk: str = setting_field("read", "memories write once per read (the paper) or every trained chunk",
                                     choices=("read", "model"))
    reread: str = setting_field("carry", "between reads carry the whole state, or only the memories (mixer states "
                                         "reset)", choices=("carry", "memory"))
    piece: int = setting_field(512, "tokens per forward call (bounds the attention score matrix)", type=positive_int)
    context: int = setting_field(0, "attention context in tokens: KV-cache tokens kept between calls (0: unbounded)",
                                 type=nonneg_int)
    carry: bool = setting_field(False, "carry the state from sample to sample (the released code)")
    max_new_tokens: int = setting_field(0, "decoding budget (0: automatic)", type=nonneg_int)
    frozen_memory: bool = setting_field(False, "memories never write (the paper's frozen-memory check, App. D.2)")

    def validate(self) -> None:
        if not self.iters or min(self.iters) < 1:
            raise UserError(f"--iters must be positive integers, got {list(self.iters)}")
        if self.write_chunk not in ("read", "model"):
            raise UserError(f"write_chunk must be 'read' or 'model', got {self.write_chunk!r}")
        if self.reread not in ("carry", "memory"):
            raise UserError(f"reread must be 'carry' or 'memory', got {self.reread!r}")
        if self.piece < 1:
            raise UserError(f"--piece must be >= 1, got {self.piece}")
        if self.context < 0:
            raise UserError(f"--context must be >= 0, got {self.context}")


def _read(model, ids: torch.Tensor, state, opts: NiahOptions, bar: Progress | None):
    """``read_tokens`` of ``ids`` (the same calls of ``opts.piece`` tokens), counting each call's tokens on ``bar``."""
    for a in range(0, ids.numel(), opts.piece):
        state = read_tokens(model, ids[a : a + opts.piece], state, opts.piece, opts.context or None)
        if bar is not None:
            bar.update(min(opts.piece, ids.numel() - a))
    return state


def _decode_answer(model, tokenizer, question_ids: torch.Tensor, state, n_chars: int, budget: int,
                   opts: NiahOptions, bar: Progress | None = None):
    """Greedy decoding after the question until ``n_chars`` non-blank characters (or ``budget`` tokens).
    ``bar`` counts the question's tokens and ``budget`` decoding steps (those not needed when it ends)."""
    logits, state = read_tokens(model, question_ids, state, opts.piece, opts.context or None, want_logits=True)
    generated: list[int] = []
    text = ""
    device = question_ids.device
    if bar is not None:
        bar.update(question_ids.numel())
    for step in range(budget):
        nxt = int(logits[0, -1].float().argmax())
        generated.append(nxt)
        text = tokenizer.decode(generated).lstrip()
        if len(text) >= n_chars or step == budget - 1:
            break
        logits, state = read_tokens(model, torch.tensor([nxt], device=device), state, 1, opts.context or None,
                                    want_logits=True)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.update(budget - (len(generated) - 1))
    return text, state


def _budget(tokenizer, sample: NiahSample, opts: NiahOptions) -> int:
    return opts.max_new_tokens or 2 * len(tokenizer.encode(" " + sample.answer)) + 2


def sample_work(tokenizer, sample: NiahSample, opts: NiahOptions) -> int:
    """Tokens the model reads for one sample: the context once per read, and for every reported n the
    question and the decoding budget. The progress line of :func:`evaluate_niah` counts these, so its ETA
    weighs samples by their length (a sample of 8K tokens counts 8 times one of 1K)."""
    question = len(tokenizer.encode(sample.question))
    return max(opts.iters) * sample.tokens + len(opts.iters) * (question + _budget(tokenizer, sample, opts))


def _with_memories(state: dict, source: dict | None) -> dict:
    """``state`` with every layer's memory state taken from ``source`` (None: fresh memories)."""
    layers = []
    for i, s in enumerate(state["layers"]):
        s = {k: v for k, v in s.items() if k != "memory"}
        src = source["layers"][i].get("memory") if source is not None else None
        if src is not None:
            s["memory"] = src
        layers.append(s)
    return {**state, "layers": layers}


@torch.no_grad()
def evaluate_sample(model, tokenizer, sample: NiahSample, opts: NiahOptions, state=None,
                    progress: Progress | None = None):
    """Answers of one sample for every n in ``opts.iters``; returns (list of records, state after it).

    The state after the sample is the one after its last answer (used when ``opts.carry``). ``progress``
    counts the tokens read (:func:`sample_work` in all).
    """
    device = next(model.parameters()).device
    ctx = torch.as_tensor(np.asarray(tokenizer.encode(sample.context)), dtype=torch.long, device=device)
    question = torch.as_tensor(np.asarray(tokenizer.encode(sample.question)), dtype=torch.long, device=device)
    budget = _budget(tokenizer, sample, opts)
    chunk = ctx.numel() if opts.write_chunk == "read" else None
    records, last_state = [], state
    n_max = max(opts.iters)
    for n in range(1, n_max + 1):
        if n > 1 and opts.reread == "memory":
            state = memory_only_state(state)
        if chunk is not None:
            check_chunk_empty(state)
        before = state
        with memory_writes(model, chunk_size=chunk, frozen=opts.frozen_memory or None):  # "read": one write per read
            state = _read(model, ctx, state, opts, progress)
        if n in opts.iters:
            # "read": the paper reads context + question in one call whose outputs come before that call's
            # write, so the question sees the memory of the n - 1 earlier reads (the KV cache holds all n)
            asked = _with_memories(state, before) if chunk is not None else state
            with memory_writes(model, frozen=True):  # no writes while the question is read and answered
                text, after = _decode_answer(model, tokenizer, question, asked, len(sample.answer), budget, opts,
                                             progress)
            after = _with_memories(after, state)  # the write of read n still happens (after the outputs)
            rec = score_answer(text, sample)
            rec.update(iters=n, length=sample.length, tokens=sample.tokens, depth=sample.depth,
                       target_depth=sample.target_depth, answer=sample.answer, seed=sample.seed)
            records.append(rec)
            last_state = after
    return records, last_state


def evaluate_niah(model, tokenizer, samples: Sequence[NiahSample], opts: NiahOptions,
                  progress: bool = False) -> list[dict]:
    """Records of all samples (one per sample and n); see :func:`summarize` for the tables."""
    opts.validate()
    if any(s.format == "char" for s in samples):
        check_tokenizer(tokenizer)
    was_training = model.training
    model.eval()
    # the line counts tokens read, not samples: samples of different lengths cost different times
    bar = Progress(sum(sample_work(tokenizer, s, opts) for s in samples), "tok", desc="niah", enabled=progress)
    records: list[dict] = []
    state = None
    try:
        for k, s in enumerate(samples):
            bar.desc = f"niah sample {k + 1}/{len(samples)} ({s.length:,} tokens)"
            recs, after = evaluate_sample(model, tokenizer, s, opts, state if opts.carry else None, progress=bar)
            state = after if opts.carry else None
            records.extend(recs)
            done = [r["exact"] for r in records if r["iters"] == max(opts.iters)]
            bar.update(0, exact=f"{sum(done) / max(1, len(done)):.2f}")
    finally:
        model.train(was_training)
        bar.close()
    return records


def depth_bin(depth: float, bins: int) -> int:
    return min(bins - 1, int(depth * bins))


def summarize(records: Iterable[dict], depths: str | Sequence[float] = "uniform", depth_bins: int = 5) -> dict:
    """Accuracy tables: overall and by (n, length), by (n, length, depth).

    Returns ``{"format", "metrics", "by_iters": {n: {...}}, "cells": [{"iters", "length", "depth", "exact",
    ["digits",] "candidate", "samples"}], "depth_labels": [...], "depth_edges", "lengths": [...], "iters": [...]}``:
    ``format`` is the needle format of the records ("char" or "token"; "mixed" for both), ``metrics`` the
    metrics every record has ("digits" only for the char format). With uniform depths the target depth is
    binned into ``depth_bins`` equal bins (``depth_edges``), labelled by their centre; with fixed depths
    ``depth_edges`` is None. A cell without samples has ``samples`` 0 and None metrics.
    """
    records = list(records)
    formats = sorted({r.get("format", "char") for r in records})
    fmt = formats[0] if len(formats) == 1 else ("mixed" if formats else "char")
    metrics = [m for m in METRIC_ORDER if all(m in r for r in records)]
    if isinstance(depths, str):
        labels = [round((b + 0.5) / depth_bins, 4) for b in range(depth_bins)]
        row_of = lambda r: labels[depth_bin(r["depth"], depth_bins)]  # noqa: E731
    else:
        labels = sorted(set(float(d) for d in depths))
        row_of = lambda r: float(r["depth"])  # noqa: E731
    iters = sorted({r["iters"] for r in records})
    lengths = sorted({r["length"] for r in records})

    def agg(rs: list[dict]) -> dict:
        n = len(rs)
        return {"samples": n, **{m: (sum(r[m] for r in rs) / n if n else None) for m in metrics}}

    cells, by_iters = [], {}
    for n in iters:
        rs_n = [r for r in records if r["iters"] == n]
        by_iters[n] = {"overall": agg(rs_n), "by_length": {L: agg([r for r in rs_n if r["length"] == L]) for L in lengths}}
        for L in lengths:
            for d in labels:
                rs = [r for r in rs_n if r["length"] == L and row_of(r) == d]
                cells.append({"iters": n, "length": L, "depth": d, **agg(rs)})
    edges = [round(b / depth_bins, 4) for b in range(depth_bins + 1)] if isinstance(depths, str) else None
    return {"format": fmt, "metrics": metrics, "by_iters": by_iters, "cells": cells, "depth_labels": labels,
            "depth_edges": edges, "lengths": lengths, "iters": iters}


def plot_niah(summary: dict, path: str | Path, title: str = "", metric: str = "exact") -> Path:
    """PNG: one depth x length accuracy heatmap per n (reads), cells without samples marked and explained, and
    accuracy by length for each n (drawn by :func:`fastweights.tasks.niah_report.draw_niah`)."""
    from fastweights.tasks.niah_report import draw_niah

    return draw_niah(summary, path, title, metric)


# ----------------------------------------------------------------------------- training text


def training_text(haystack: Haystack, n_chars: int, seed: int = 0, sample_chars: tuple[int, int] = (200, 900),
                  needles: tuple[int, int] = (1, 5)) -> str:
    """Text that teaches the needle format: haystack windows with needles, then every needle asked again.

    Each record is a window of ``sample_chars`` characters (a random size in the range) with a random
    number of needles in ``needles``, followed by ``" The secret number for KEY is VALUE."`` for each of
    them in random order, and a blank line. Deterministic by ``seed``; ``n_chars`` characters in all.
    """
    rng = random.Random(f"niah-train:{seed}")
    out, total = [], 0
    while total < n_chars:
        size = rng.randint(*sample_chars)
        start = _word_start(haystack.text, rng.randrange(len(haystack.text)))
        filler = haystack.window(start, size)
        k = rng.randint(*needles)
        keys = _distinct(rng, k, lambda: "ID-" + "".join(rng.choice("0123456789abcdef") for _ in range(KEY_HEX)), filler)
        values = _distinct(rng, k, lambda: "".join(rng.choice("0123456789") for _ in range(VALUE_DIGITS)), filler)
        points = sorted((_word_start(filler, rng.randrange(len(filler) + 1)), i) for i in range(k))
        parts, prev = [], 0
        for p, i in points:
            parts.append(filler[prev:p])
            parts.append(needle_text(keys[i], values[i]) + " ")
            prev = p
        parts.append(filler[prev:].rstrip())
        order = list(range(k))
        rng.shuffle(order)
        parts.extend(QUESTION_TEMPLATE.format(key=keys[i]) + f" {values[i]}." for i in order)
        parts.append("\n\n")
        rec = "".join(parts)
        out.append(rec)
        total += len(rec)
    return "".join(out)[:n_chars]


def _register_corpus() -> None:
    """``niah-tinyshakespeare``: 6M characters of :func:`training_text` on the bundled Shakespeare;
    ``niah-dense-tinyshakespeare``: the same with shorter windows (50-400 characters) and 3-8 needles
    each, more questions (answer digits) per character."""
    from fastweights.data.corpus import CORPORA, Document

    def loader(name, **kw):
        return lambda: [Document(name, training_text(Haystack.load("tinyshakespeare"), 6_000_000, seed=0, **kw))]

    CORPORA.setdefault("niah-tinyshakespeare", loader("niah-tinyshakespeare"))
    CORPORA.setdefault("niah-dense-tinyshakespeare",
                       loader("niah-dense-tinyshakespeare", sample_chars=(50, 400), needles=(3, 8)))


_register_corpus()


def records_to_json(records: list[dict], summary: dict, meta: dict) -> dict:
    """The JSON document ``fastweights task niah`` writes."""
    by_iters = {str(n): {"overall": v["overall"], "by_length": {str(L): a for L, a in v["by_length"].items()}}
                for n, v in summary["by_iters"].items()}
    return {**meta, "summary": {**summary, "by_iters": by_iters}, "records": records}


__all__ = [
    "N_NEEDLES", "NEEDLE_TEMPLATE", "QUESTION_TEMPLATE", "Haystack", "Needle", "NiahSample", "NiahOptions",
    "make_sample", "make_samples", "parse_depths", "check_tokenizer", "score_answer", "evaluate_sample",
    "evaluate_niah", "summarize", "plot_niah", "training_text", "records_to_json", "sample_work",
]
