"""Multi-token needle in a haystack: two-token keys bound to three-token values, answered by generation.

The step between the one-token format (:mod:`fastweights.tasks.niah_token`) and the FwPKM paper's NIAH
(Zhao & Jones 2026, section 4: a 4-character key and a 6-digit value, :mod:`fastweights.tasks.niah`): the
paper's needle in word-level pieces. A key is two of ``KEY_PIECES`` = 64 key tokens (4,096 keys, as four hex
digits would be two pieces of two), a value three of ``VALUE_PIECES`` = 100 two-digit tokens (10^6 values, the
paper's six digits)::

    needle     "<needle> <k12> <k40> <d04> <d91> <d33>"      planted in the haystack
    question   "<question> <k12> <k40>"                      the model generates "<d04> <d91> <d33>"

Neither piece of a key names it alone, and no value piece follows from the one before it except through the
needle: the model must bind the first value piece to the two key pieces and each later piece to the key and
the pieces before it. With the FwPKM memory's lookahead write (the query of token t stored with the value of
token t + 1, eq 19 with L = 1) that is three bindings per needle, each keyed on a query that has to encode
its local context, which a memory reading token embeddings alone cannot do: the ``niah-multitoken`` preset puts a
short causal convolution (4 tokens) in front of it.

Held-out keys and values: a fixed quarter of the 4,096 key pairs (:data:`HELDOUT_KEYS`, a seeded draw) and an
eighth of the values (:func:`heldout_value`, a hash of the value) never occur in training needles; evaluation
draws from them (``keys="heldout"``), so every evaluated key and value is new as a whole while every piece of it
was trained. Haystack text and the word vocabulary are those of the one-token format (tinyshakespeare's first
nine tenths for training, its last tenth for evaluation). Samples follow the paper: five needles with distinct
keys and distinct values (one target, four distractors) at random depths, then the question; greedy generation
after it is scored exact (all three pieces) and per token (:func:`fastweights.tasks.niah.score_answer`), and
the n-iter evaluator of :mod:`fastweights.tasks.niah` reads it.
"""

from __future__ import annotations

import random

import torch

from fastweights.core.errors import UserError
from fastweights.tasks.niah_token import (WordHaystack, capture_memory_calls, join_words, needle_stream, plant_needles,
                                          train_haystack)

KEY_PIECES = 64
VALUE_PIECES = 100
KEY_LEN = 2
VALUE_LEN = 3
N_NEEDLES = 5
NEEDLE = "<needle>"
QUESTION = "<question>"
KEY_TOKENS = tuple(f"<k{i:02d}>" for i in range(KEY_PIECES))
VALUE_TOKENS = tuple(f"<d{i:02d}>" for i in range(VALUE_PIECES))
RESERVED = (NEEDLE, QUESTION, *KEY_TOKENS, *VALUE_TOKENS)
#: every key (pairs of key tokens), in a fixed order
ALL_KEYS = tuple((a, b) for a in KEY_TOKENS for b in KEY_TOKENS)
#: a quarter of the keys, never in a training needle (a seeded draw: no structure a model could learn)
HELDOUT_KEYS = frozenset(random.Random("niah-multitoken:heldout-keys").sample(ALL_KEYS, len(ALL_KEYS) // 4))
TRAIN_KEYS = tuple(k for k in ALL_KEYS if k not in HELDOUT_KEYS)
EVAL_KEYS = tuple(k for k in ALL_KEYS if k in HELDOUT_KEYS)
HELDOUT_VALUE_SHARE = 8  # one value in 8 is held out


def heldout_value(value: tuple[str, ...]) -> bool:
    """Whether ``value`` (three value tokens) is one of the held-out eighth: a multiplicative hash of its number."""
    n = 0
    for t in value:
        n = n * VALUE_PIECES + int(t[2:-1])
    return (n * 2654435761 >> 7) % HELDOUT_VALUE_SHARE == 0


def draw_value(rng: random.Random, heldout: bool) -> tuple[str, ...]:
    """A value of :data:`VALUE_LEN` tokens from the held-out eighth (``heldout``) or from the rest."""
    while True:
        v = tuple(rng.choice(VALUE_TOKENS) for _ in range(VALUE_LEN))
        if heldout_value(v) == heldout:
            return v


def needle_words(key: tuple[str, ...], value: tuple[str, ...]) -> list[str]:
    return [NEEDLE, *key, *value]


def question_words(key: tuple[str, ...]) -> list[str]:
    return [QUESTION, *key]


def training_text(haystack: WordHaystack, n_tokens: int, seed: int = 0, gap: tuple[int, int] = (24, 72),
                  distance: tuple[int, int] = (80, 240)) -> str:
    """Haystack words with needles and their questions (answers included), ``n_tokens`` tokens
    (:func:`fastweights.tasks.niah_token.needle_stream`): keys from :data:`TRAIN_KEYS`, values never held out. The
    text opens with a line listing every reserved token once (the word tokenizer's vocabulary is the training
    split's words). Deterministic by ``seed``."""
    rng = random.Random(f"niah-multitoken-train:{seed}")
    return join_words(needle_stream(haystack, n_tokens, rng, RESERVED, lambda: rng.choice(TRAIN_KEYS),
                                    lambda: draw_value(rng, heldout=False), gap, distance))


def make_sample(haystack: WordHaystack, length: int, depth: float | None = None, seed: int = 0, index: int = 0,
                n_needles: int = N_NEEDLES, keys: str = "heldout"):
    """One sample: ``length`` context tokens (haystack + ``n_needles`` needles with distinct keys and distinct
    values), the question and the answer (three value tokens joined by spaces). ``keys``: "heldout" draws keys
    and values never in a training needle, "train" training ones. Deterministic by (seed, length, depth, index,
    keys). Returns a :class:`~fastweights.tasks.niah.NiahSample` of format "multitoken"."""
    from fastweights.tasks.niah import Needle, NiahSample

    if keys not in ("heldout", "train"):
        raise UserError(f"keys must be 'heldout' or 'train', got {keys!r}")
    if not 1 <= n_needles <= 64:
        raise UserError(f"n_needles must be in [1, 64], got {n_needles}")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise UserError(f"needle depth must be in [0, 1], got {depth}")
    per_needle = 1 + KEY_LEN + VALUE_LEN
    filler_len = length - per_needle * n_needles
    if filler_len < 1:
        raise UserError(f"context length {length} is too short for {n_needles} needles")
    tag = f"niah-multitoken:{seed}:{length}:{'uniform' if depth is None else f'{depth:.6g}'}:{index}:{keys}"
    rng = random.Random(tag)
    chosen_keys = rng.sample(EVAL_KEYS if keys == "heldout" else TRAIN_KEYS, n_needles)
    chosen_values: list[tuple[str, ...]] = []
    while len(chosen_values) < n_needles:
        v = draw_value(rng, heldout=keys == "heldout")
        if v not in chosen_values:
            chosen_values.append(v)
    target = rng.randrange(n_needles)
    depths = [rng.random() for _ in range(n_needles)]
    depths[target] = rng.random() if depth is None else depth
    words, char_offsets = plant_needles(haystack, filler_len, depths,
                                        [needle_words(chosen_keys[i], chosen_values[i]) for i in range(n_needles)], rng)
    needles = tuple(Needle(" ".join(chosen_keys[i]), " ".join(chosen_values[i]), depths[i], char_offsets[i])
                    for i in range(n_needles))
    return NiahSample(context=join_words(words), question=" " + join_words(question_words(chosen_keys[target])),
                      answer=" ".join(chosen_values[target]), needles=needles, target=target, length=length,
                      tokens=len(words), depth=depths[target], seed=tag, format="multitoken")


def make_samples(haystack: WordHaystack, lengths, depths="uniform", samples: int = 10, seed: int = 0,
                 keys: str = "heldout") -> list:
    """``samples`` samples per length (``depths="uniform"``) or per (length, depth) cell."""
    out = []
    for length in lengths:
        for d in [None] if isinstance(depths, str) else list(depths):
            out.extend(make_sample(haystack, length, d, seed, i, keys=keys) for i in range(samples))
    return out


def is_multitoken_format(tokenizer) -> bool:
    """True when ``tokenizer`` is a word tokenizer holding every reserved token of this format."""
    words = getattr(tokenizer, "words", None)
    if getattr(tokenizer, "name", None) != "word" or words is None:
        return False
    have = set(words)
    return all(t in have for t in RESERVED)


@torch.no_grad()
def forced_answer_probe(model, tokenizer, sample, iters: tuple[int, ...] = (1, 2), piece: int = 512) -> list[dict]:
    """Per answer token, with the right earlier answer tokens given (teacher forcing), for each n in ``iters``:
    whether the model's greedy token is right, and what the first fast memory reads at the position that predicts
    it (the second key token for the first answer token, then the answer tokens before) against each needle's
    stored value for that position (the lookahead write's target ``v``, read during the first pass over the
    context): the cosine with the target needle's, the largest with a distractor's, and whether the target's
    is larger. Tells which answer token fails: the first (bound to the key) or a later one (bound to the key
    and the value tokens before it).

    Returns ``[{"iters", "token": j, "right": bool, "cos_target", "cos_distractor_max", "target_wins"}]``
    (memory fields None for a model without a fast memory).
    """
    from dataclasses import replace

    from fastweights.models.memory_switches import fast_memories
    from fastweights.tasks.niah import NiahOptions, evaluate_sample

    answer = sample.answer.split(" ")
    mems = [m for m in fast_memories(model) if hasattr(m, "memory")]
    out = []
    for j in range(VALUE_LEN):
        # the question with the first j answer tokens given; the model's next token is the one scored
        forced = replace(sample, question=sample.question + "".join(" " + t for t in answer[:j]), answer=answer[j])
        opts = NiahOptions(iters=tuple(range(1, max(iters) + 1)), piece=piece, max_new_tokens=1)
        if not mems:
            records, _ = evaluate_sample(model, tokenizer, forced, opts)
            out += [{"iters": r["iters"], "token": j, "right": bool(r["exact"]), "cos_target": None,
                     "cos_distractor_max": None, "target_wins": None} for r in records if r["iters"] in iters]
            continue
        with capture_memory_calls(mems[0]) as calls:
            records, _ = evaluate_sample(model, tokenizer, forced, opts)
        ctx_len = len(tokenizer.encode(sample.context))
        q_len = len(tokenizer.encode(forced.question))
        # the position whose query predicts answer token j: the second key token (j = 0) or value token j - 1
        at = [len(sample.context[: n.offset].split(" ")) - 1 + KEY_LEN + j for n in sample.needles]
        reads, targets, i = [], None, 0
        while i < len(calls):  # per read: the context's pieces, then the question
            got, vs = 0, []
            while got < ctx_len:
                vs.append(calls[i][0])
                got += calls[i][0].shape[0]
                i += 1
            if targets is None:
                targets = torch.cat(vs)[[p + 1 for p in at]]  # the lookahead write stores v of the next token
            assert calls[i][0].shape[0] == q_len, "memory calls out of the expected order"
            reads.append(calls[i][1][-1])
            i += 1
        by_n = {r["iters"]: r for r in records}
        for n in iters:
            cos = torch.nn.functional.cosine_similarity(reads[n - 1][None], targets, dim=-1)
            others = torch.cat([cos[: sample.target], cos[sample.target + 1 :]])
            out.append({"iters": n, "token": j, "right": bool(by_n[n]["exact"]),
                        "cos_target": round(float(cos[sample.target]), 4),
                        "cos_distractor_max": round(float(others.max()), 4) if others.numel() else None,
                        "target_wins": bool(others.numel() == 0 or cos[sample.target] > others.max())})
    return out


def _register_corpus() -> None:
    """``niah-multitoken-tinyshakespeare``: 4M tokens of :func:`training_text` on the training haystack of the
    one-token format (tinyshakespeare's first nine tenths, its ``VOCAB_WORDS`` most frequent words)."""
    from fastweights.data.corpus import CORPORA, Document

    def loader():
        return [Document("niah-multitoken-tinyshakespeare", training_text(train_haystack(), 4_000_000, seed=0))]

    CORPORA.setdefault("niah-multitoken-tinyshakespeare", loader)


_register_corpus()

__all__ = [
    "KEY_PIECES", "VALUE_PIECES", "KEY_LEN", "VALUE_LEN", "KEY_TOKENS", "VALUE_TOKENS", "RESERVED", "ALL_KEYS",
    "HELDOUT_KEYS", "TRAIN_KEYS", "EVAL_KEYS", "heldout_value", "draw_value", "training_text", "make_sample",
    "make_samples", "is_multitoken_format", "forced_answer_probe",
]
