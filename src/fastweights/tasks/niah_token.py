"""Token-level needle in a haystack: one-token keys bound to one-token values, planted in real text.

The FwPKM paper's NIAH (Zhao & Jones 2026, section 4; :mod:`fastweights.tasks.niah`) writes keys and values
as strings of characters or BPE pieces, so a model must first learn to match a key over several tokens.
On a CPU that circuit does not form in an hour (``docs/long-context.md``). This format keeps the
paper's protocol and makes the lookup itself the task: each needle binds a single-token key to a single-
token value, and the memory's lookahead write (the query of token t stored with the value of token t + 1,
eq 19 with L = 1) performs the binding directly::

    needle     "<needle> <k417> <v23>"       planted in the haystack
    question   "<question> <k417>"            asked after the context; the answer is the token "<v23>"

Text is word-level (``tokenizer = "word"``): the haystack is lower-cased and cut into words and
punctuation (:func:`normalize_words`), words outside the training vocabulary (``VOCAB_WORDS`` most frequent
words of the training text) become ``<unk>``. ``N_KEYS`` key tokens ``<k000>`` ... ``<k511>`` and
``N_VALUES`` value tokens ``<v00>`` ... ``<v63>`` are reserved; the first ``TRAIN_KEYS`` keys are used in
training, the rest only in evaluation (``keys="heldout"``, the default), so no evaluated key was ever seen
in a needle during training. The held-out keys are in the vocabulary because the training text opens with
one line that lists every reserved token once (the word tokenizer's vocabulary is the set of words of the
training split); their embeddings are never trained, so before evaluation :func:`init_heldout_keys` draws
them from the trained keys' distribution, as one initialises tokens added to a vocabulary.

Training text (:func:`training_text`): a stream of haystack words with a needle every ``gap`` tokens
and each needle's question (with its answer) ``distance`` tokens after it. With the defaults (distances
80-240 tokens, a 32-token attention window, 64-token memory chunks) every question is beyond the attention
window of its needle and in a later memory chunk, so the memory is the only path to the answer.
Evaluation samples (:func:`make_sample`) follow the paper: a context of ``length`` tokens with 5 needles at
random depths (one is the target, the others distractors, at a fixed or uniform random target depth), then
the question; the model's answer is its greedy next token. They are :class:`~fastweights.tasks.niah.NiahSample`
objects, scored and read by the n-iter evaluator of :mod:`fastweights.tasks.niah`.
"""

from __future__ import annotations

import contextlib
import random
from collections import Counter
from functools import lru_cache

import regex
import torch

from fastweights.core.errors import UserError
from fastweights.models.memory_switches import fast_memories

N_KEYS = 512
TRAIN_KEYS = 384  # keys <k000>..<k383> appear in training needles; <k384>..<k511> only in evaluation
N_VALUES = 64
N_NEEDLES = 5
VOCAB_WORDS = 2000
NEEDLE = "<needle>"
QUESTION = "<question>"
UNK = "<unk>"
KEYS = tuple(f"<k{i:03d}>" for i in range(N_KEYS))
VALUES = tuple(f"<v{i:02d}>" for i in range(N_VALUES))
RESERVED = (NEEDLE, QUESTION, *KEYS, *VALUES)

# lower-cased words (with inner apostrophes), numbers, single punctuation marks, newlines
_WORDS = regex.compile(r"[\p{L}]+(?:'[\p{L}]+)*|[0-9]+|[^\s\p{L}0-9]|\n")


def normalize_words(text: str) -> list[str]:
    """Lower-cased words, numbers and punctuation marks of ``text``, newlines kept as ``"\\n"``; runs of
    blank lines become one newline. Reserved tokens never come out of this (``<`` is a separate mark)."""
    out: list[str] = []
    for w in _WORDS.findall(text.lower()):
        if w == "\n" and (not out or out[-1] == "\n"):
            continue
        out.append(w)
    return out


def join_words(words: list[str]) -> str:
    """Text that the word tokenizer reads back as ``words`` (newlines as ``<eos>``)."""
    return " ".join(words)


def needle_words(key: str, value: str) -> list[str]:
    return [NEEDLE, key, value]


def question_words(key: str) -> list[str]:
    return [QUESTION, key]


class WordHaystack:
    """Haystack words for token-level needles: a corpus normalised by :func:`normalize_words`.

    ``vocab``: the words kept (others become ``<unk>``); None keeps every word (evaluation haystacks are
    mapped to ``<unk>`` by the model's own tokenizer instead).
    """

    def __init__(self, words: list[str], name: str = "text", vocab: set[str] | None = None):
        if vocab is not None:
            words = [w if (w in vocab or w == "\n") else UNK for w in words]
        if len(words) < 1000:
            raise UserError(f"haystack {name!r} is too short ({len(words)} words; need at least 1000)")
        if any(w in _RESERVED_SET for w in words):
            raise UserError(f"haystack {name!r} contains reserved needle tokens")
        self.words = words
        self.name = name

    @classmethod
    def load(cls, spec: str | None = None, part: tuple[float, float] = (0.0, 1.0)) -> "WordHaystack":
        """The words of a corpus (anything ``load_corpus`` accepts; default tinyshakespeare), the fraction
        ``part`` of them (e.g. ``(0.9, 1.0)``: the last tenth, never used by :func:`training_text`)."""

        spec = spec or "tinyshakespeare"
        words = _corpus_words(spec)
        a, b = (round(f * len(words)) for f in part)
        return cls(words[a:b], name=spec if part == (0.0, 1.0) else f"{spec}[{part[0]:g}:{part[1]:g}]")

    def window(self, start: int, n: int) -> list[str]:
        """``n`` words from ``start``, wrapping around."""
        out, pos = [], start % len(self.words)
        while len(out) < n:
            take = self.words[pos : pos + n - len(out)]
            out.extend(take)
            pos = 0
        return out


_RESERVED_SET = frozenset(RESERVED)


@lru_cache(maxsize=8)
def _corpus_words(spec: str) -> list[str]:
    from fastweights.data import load_corpus

    return normalize_words("\n\n".join(d.text for d in load_corpus(spec)))


def training_vocab(words: list[str], size: int = VOCAB_WORDS) -> set[str]:
    """The ``size`` most frequent words (ties in code-point order)."""
    counts = Counter(w for w in words if w != "\n")
    return {w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]}


def needle_stream(haystack: WordHaystack, n_tokens: int, rng: random.Random, reserved, draw_key, draw_value,
                  gap: tuple[int, int], distance: tuple[int, int]) -> list[str]:
    """The words of a token-format training text: the ``reserved`` tokens on one line, then haystack words with a
    needle ``<needle> *KEY *VALUE`` every ``gap`` tokens (uniform in the range), asked again as ``<question> *KEY
    *VALUE`` ``distance`` tokens later. ``draw_key()`` / ``draw_value()`` give a key / value as a tuple of words; a
    key is not drawn again while a needle of it is to be asked, nor within ``2 * distance[1]`` tokens, so within any
    window a key names one value. Shared by the one-token and the multi-token formats."""
    if not (0 < gap[0] <= gap[1]) or not (0 < distance[0] <= distance[1]):
        raise UserError(f"gap and distance must be positive ranges, got {gap} and {distance}")
    out: list[str] = list(reserved) + ["\n"]
    pending: list[tuple] = []  # (position of the question, key, value)
    last_used: dict[tuple, int] = {}
    pos = rng.randrange(len(haystack.words))
    next_needle = len(out) + rng.randint(*gap)
    reuse = 2 * distance[1]
    while len(out) < n_tokens:
        n = len(out)
        if pending and pending[0][0] <= n:
            _, key, value = pending.pop(0)
            out.extend([QUESTION, *key, *value])
            continue
        if n >= next_needle:
            key = draw_key()
            while n - last_used.get(key, -reuse) < reuse:
                key = draw_key()
            value = draw_value()
            out.extend([NEEDLE, *key, *value])
            ask = len(out) + rng.randint(*distance)
            pending.append((ask, key, value))
            pending.sort()
            last_used[key] = ask
            next_needle = len(out) + rng.randint(*gap)
            continue
        out.append(haystack.words[pos])
        pos = (pos + 1) % len(haystack.words)
    return out[:n_tokens]


def training_text(haystack: WordHaystack, n_tokens: int, seed: int = 0, gap: tuple[int, int] = (24, 72),
                  distance: tuple[int, int] = (80, 240)) -> str:
    """Haystack words with needles and their questions (answers included), ``n_tokens`` tokens
    (:func:`needle_stream`): keys from the training keys, any value. The text opens with a line listing every
    reserved token once (see the module docstring). Deterministic by ``seed``."""
    rng = random.Random(f"niah-token-train:{seed}")
    return join_words(needle_stream(haystack, n_tokens, rng, RESERVED, lambda: (rng.choice(KEYS[:TRAIN_KEYS]),),
                                    lambda: (rng.choice(VALUES),), gap, distance))


def plant_needles(haystack: WordHaystack, filler_len: int, depths: list[float], needles: list[list[str]],
                  rng: random.Random) -> tuple[list[str], list[int]]:
    """``filler_len`` haystack words from a random start with ``needles[i]`` (its words) planted at relative depth
    ``depths[i]``. Returns (the words, each needle's character offset in their text, as the character format
    records it)."""
    filler = haystack.window(rng.randrange(len(haystack.words)), filler_len)
    points = sorted((round(d * filler_len), i) for i, d in enumerate(depths))
    words: list[str] = []
    offsets = [0] * len(needles)
    prev = 0
    for p, i in points:
        words.extend(filler[prev:p])
        offsets[i] = len(words)
        words.extend(needles[i])
        prev = p
    words.extend(filler[prev:])
    return words, [len(join_words(words[:o])) + (1 if o else 0) for o in offsets]


def make_sample(haystack: WordHaystack, length: int, depth: float | None = None, seed: int = 0, index: int = 0,
                n_needles: int = N_NEEDLES, keys: str = "heldout"):
    """One token-level sample: ``length`` context tokens (haystack + ``n_needles`` needles), the question,
    and the answer token. ``keys``: "heldout" draws keys never used in training needles, "train" the
    training keys. Deterministic by (seed, length, depth, index, keys). Returns a ``NiahSample``."""
    from fastweights.tasks.niah import Needle, NiahSample

    if keys not in ("heldout", "train"):
        raise UserError(f"keys must be 'heldout' or 'train', got {keys!r}")
    if not 1 <= n_needles <= N_VALUES:
        raise UserError(f"n_needles must be in [1, {N_VALUES}], got {n_needles}")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise UserError(f"needle depth must be in [0, 1], got {depth}")
    filler_len = length - 3 * n_needles
    if filler_len < 1:
        raise UserError(f"context length {length} is too short for {n_needles} needles")
    tag = f"niah-token:{seed}:{length}:{'uniform' if depth is None else f'{depth:.6g}'}:{index}:{keys}"
    rng = random.Random(tag)
    pool = KEYS[TRAIN_KEYS:] if keys == "heldout" else KEYS[:TRAIN_KEYS]
    chosen_keys = rng.sample(pool, n_needles)
    chosen_values = rng.sample(VALUES, n_needles)
    target = rng.randrange(n_needles)
    depths = [rng.random() for _ in range(n_needles)]
    depths[target] = rng.random() if depth is None else depth
    words, char_offsets = plant_needles(haystack, filler_len, depths,
                                        [needle_words(chosen_keys[i], chosen_values[i]) for i in range(n_needles)], rng)
    context = join_words(words)
    needles = tuple(Needle(chosen_keys[i], chosen_values[i], depths[i], char_offsets[i]) for i in range(n_needles))
    return NiahSample(context=context, question=" " + join_words(question_words(chosen_keys[target])),
                      answer=chosen_values[target], needles=needles, target=target, length=length,
                      tokens=len(words), depth=depths[target], seed=tag, format="token")


def make_samples(haystack: WordHaystack, lengths, depths="uniform", samples: int = 10, seed: int = 0,
                 keys: str = "heldout") -> list:
    """``samples`` samples per length (``depths="uniform"``) or per (length, depth) cell."""
    out = []
    for length in lengths:
        cells = [None] if isinstance(depths, str) else list(depths)
        for d in cells:
            out.extend(make_sample(haystack, length, d, seed, i, keys=keys) for i in range(samples))
    return out


@contextlib.contextmanager
def capture_memory_calls(layer):
    """Record ``(v, v_hat)`` of every call of ``layer.memory`` (the fast-weight core of FwPKM / FwMLP)."""
    calls: list[tuple] = []
    inner = layer.memory

    def spy(q, v, g, state=None):
        v_hat, st = inner(q, v, g, state)
        calls.append((v.detach()[0].float(), v_hat.detach()[0].float()))
        return v_hat, st

    layer.memory = spy
    try:
        yield calls
    finally:
        del layer.memory  # the instance attribute goes; the class method is back


@torch.no_grad()
def memory_probe(model, tokenizer, sample, iters: tuple[int, ...] = (1, 2), piece: int = 512) -> list[dict]:
    """What the first fast memory retrieves for the question, per number of reads (issue 17's diagnostic).

    For each n in ``iters`` (the n-iter protocol of :func:`fastweights.tasks.niah.evaluate_sample`), the
    memory's read ``v_hat`` at the question's key token against each needle's value target (the ``v`` its
    lookahead write stores: the value token's, read during the first pass over the context): the cosine with
    the target needle's, the largest cosine with a distractor's, and whether the target's is the larger.
    Returns ``[{"iters", "cos_target", "cos_distractor_max", "target_wins"}]``.
    """
    from fastweights.tasks.niah import NiahOptions, evaluate_sample

    mems = [m for m in fast_memories(model) if hasattr(m, "memory")]
    if not mems:
        raise UserError("memory_probe needs a model with a fast memory (FwPKM or FwMLP)")
    ctx_len = len(tokenizer.encode(sample.context))
    q_len = len(tokenizer.encode(sample.question))
    words = sample.context.split(" ")
    value_pos = [words.index(n.key) + 1 for n in sample.needles]  # the lookahead target of the key's query
    with capture_memory_calls(mems[0]) as calls:
        evaluate_sample(model, tokenizer, sample, NiahOptions(iters=tuple(range(1, max(iters) + 1)), piece=piece))
    targets, reads, i = None, [], 0
    while i < len(calls):  # per read: the context's pieces, then the question, then the decoded tokens
        got, vs = 0, []
        while got < ctx_len:
            vs.append(calls[i][0])
            got += calls[i][0].shape[0]
            i += 1
        if targets is None:
            targets = torch.cat(vs)[value_pos]  # [n_needles, d_v]
        assert calls[i][0].shape[0] == q_len, "memory calls out of the expected order"
        reads.append(calls[i][1][-1])
        i += 1
        while i < len(calls) and calls[i][0].shape[0] == 1:
            i += 1
    out = []
    for n in iters:
        cos = torch.nn.functional.cosine_similarity(reads[n - 1][None], targets, dim=-1)
        others = torch.cat([cos[: sample.target], cos[sample.target + 1 :]])
        out.append({"iters": n, "cos_target": round(float(cos[sample.target]), 4),
                    "cos_distractor_max": round(float(others.max()), 4) if others.numel() else None,
                    "target_wins": bool(others.numel() == 0 or cos[sample.target] > others.max())})
    return out


@torch.no_grad()
def init_heldout_keys(model, tokenizer, seed: int = 0) -> None:
    """Give the held-out key tokens embeddings drawn like the trained keys' (in place).

    A key never used in training keeps its initial embedding, which lacks what every trained key learned in
    common (the component that makes the memory's gate open and the readout trust what the memory returns):
    on the niah-token model the memory still returns the right value for such a key, but its gate stays
    lower and the answer is mostly wrong (``heldout_key_diagnosis`` in benchmarks/results/niah_token.json). As is
    usual for tokens added to a vocabulary, each held-out key gets the mean of the trained keys' embeddings
    plus Gaussian noise with their per-dimension spread (seeded), so it is a new sample from the trained keys'
    distribution. The held-out keys' own rows carry no information (they were never trained), so nothing of
    them is kept.
    """
    ids = torch.as_tensor(tokenizer.encode(" ".join(KEYS)))
    if ids.numel() != N_KEYS:
        raise UserError("init_heldout_keys needs a tokenizer of the token needle format")
    weight = model.embed.weight
    trained, heldout = ids[:TRAIN_KEYS].to(weight.device), ids[TRAIN_KEYS:].to(weight.device)
    rows = weight[trained].float()
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(len(heldout), weight.shape[1], generator=gen).to(weight.device)
    weight[heldout] = (rows.mean(0) + rows.std(0) * noise).to(weight.dtype)


def is_token_format(tokenizer) -> bool:
    """True when ``tokenizer`` is a word tokenizer that holds every reserved needle token (a model
    trained on :func:`training_text`)."""
    words = getattr(tokenizer, "words", None)
    if getattr(tokenizer, "name", None) != "word" or words is None:
        return False
    have = set(words)
    return all(t in have for t in RESERVED)


def _register_corpus() -> None:
    """``niah-token-tinyshakespeare``: 4M tokens of :func:`training_text` on the first nine tenths of the
    bundled Shakespeare (its most frequent ``VOCAB_WORDS`` words kept); :func:`eval_haystack` is the last
    tenth, never used in training."""
    from fastweights.data.corpus import CORPORA, Document

    def loader():
        hay = train_haystack()
        return [Document("niah-token-tinyshakespeare", training_text(hay, 4_000_000, seed=0))]

    CORPORA.setdefault("niah-token-tinyshakespeare", loader)


TRAIN_PART = (0.0, 0.9)
EVAL_PART = (0.9, 1.0)


def train_haystack(spec: str = "tinyshakespeare") -> WordHaystack:
    """The training haystack: the first nine tenths of ``spec`` with its ``VOCAB_WORDS`` most frequent words."""
    words = WordHaystack.load(spec, TRAIN_PART).words
    return WordHaystack(words, name=f"{spec}[0:0.9]", vocab=training_vocab(words))


def eval_haystack(spec: str = "tinyshakespeare") -> WordHaystack:
    """An evaluation haystack: for the training corpus its last tenth (never trained on), else the whole text."""
    return WordHaystack.load(spec, EVAL_PART if spec == "tinyshakespeare" else (0.0, 1.0))


_register_corpus()

__all__ = [
    "N_KEYS", "TRAIN_KEYS", "N_VALUES", "KEYS", "VALUES", "NEEDLE", "QUESTION", "RESERVED", "WordHaystack",
    "normalize_words", "needle_stream", "plant_needles", "training_text", "training_vocab", "make_sample", "make_samples", "is_token_format",
    "train_haystack", "eval_haystack", "memory_probe", "init_heldout_keys",
]
