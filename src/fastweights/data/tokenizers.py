"""Tokenizers: byte-level (UTF-8), char-level and word-level (vocabularies from training text), and
GPT-2 byte-level BPE.

All four follow the ``Tokenizer`` protocol: ``encode(text) -> np.ndarray[int64]``,
``decode(ids) -> str``, ``save(directory)`` (writes ``tokenizer.json``), ``fingerprint()``.

- ``ByteTokenizer``: the 256 byte values of the UTF-8 encoding; decoding uses ``errors="replace"``.
  Text read with ``encoding_check=False`` keeps invalid bytes (see ``corpus.to_utf8``), so those
  bytes are encoded as themselves.
- ``CharTokenizer``: one id per Unicode code point seen in the training text, in sorted order
  (ids 0..n-1), plus one unknown symbol with id ``n`` (the last id, so ``vocab_size = n + 1``).
  Unseen characters encode to it; it decodes to U+FFFD.
- ``GPT2Tokenizer``: Radford et al. 2019 (GPT-2) byte-level BPE, from the ``vocab.json`` /
  ``merges.txt`` shipped in ``assets/gpt2`` (or given files of the same format). Text is cut into
  pre-tokens by the GPT-2 pattern, each pre-token's UTF-8 bytes are mapped to printable characters
  by the byte<->unicode table, and merges are applied lowest rank first (Sennrich et al. 2016). The
  special ``<|endoftext|>`` (id 50256) is never produced from text: ``encode`` treats its characters as
  ordinary text; use ``eot_id`` as a document separator.
- ``WordTokenizer``: whitespace-separated words (the Penn Treebank convention of Mikolov et al.
  2010): every newline is an end-of-sentence token ``<eos>`` (id 0), every other run of whitespace
  only separates words; ``<unk>`` (id 1) stands for words outside the vocabulary, then the words
  of the training text by descending count (ties in code-point order). A literal ``<unk>`` or
  ``<eos>`` in the text is that special token. ``decode`` joins words with one space and turns
  ``<eos>`` into a newline, so normalised text (single spaces, none at line ends) round-trips.

Mismatch detection: ``fingerprint()`` is ``"<name>:<vocab_size>:<16 hex of SHA-256 of the
vocabulary>"``. ``tokenizer.json`` records it, ``load_tokenizer`` recomputes it and refuses a file that
does not match, and ``check_fingerprint`` compares a tokenizer with one a checkpoint or token stream
recorded.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Iterable, Protocol, runtime_checkable

import numpy as np
import regex

from fastweights.data.corpus import to_utf8
from fastweights.core.errors import UserError

TOKENIZER_FILE = "tokenizer.json"
_FORMAT = "fastweights-tokenizer"
_FORMAT_VERSION = 1


@runtime_checkable
class Tokenizer(Protocol):
    name: str  # "byte" | "char" | "word" | "gpt2"
    vocab_size: int

    def encode(self, text: str) -> np.ndarray: ...  # [N] int64

    def decode(self, ids) -> str: ...

    def save(self, directory: Path) -> None: ...

    def fingerprint(self) -> str: ...


def _digest(payload: object) -> str:
    """16 hex digits of SHA-256 of a canonical JSON rendering of ``payload``."""
    blob = json.dumps(payload, sort_keys=True, ensure_ascii=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode("ascii")).hexdigest()[:16]


def _ids_array(ids, vocab_size: int) -> np.ndarray:
    """``ids`` (list, array, tensor, or one int) as a 1-D int64 array, checked against the vocabulary."""
    if hasattr(ids, "detach"):  # torch tensor, maybe on an accelerator
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise ValueError(f"decode takes a 1-D sequence of ids, got shape {tuple(arr.shape)}")
    if arr.size == 0:
        return arr.astype(np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"token id out of range [0, {vocab_size}): min {lo}, max {hi}")
    return arr


def _write_json_atomic(path: Path, payload: dict) -> None:
    from fastweights.core.files import atomic_write

    # a link at the name is refused (a prepared-data or run directory may come from elsewhere); json.dumps escapes
    # every non-ASCII character by default, so the file is ASCII
    atomic_write(path, lambda p: p.write_text(json.dumps(payload, indent=1) + "\n", encoding="ascii"),
                 root=path.parent, what="the tokenizer")


class _Base:
    name = ""
    vocab_size = 0

    def fingerprint(self) -> str:
        return f"{self.name}:{self.vocab_size}:{self._content_digest()}"

    def _content_digest(self) -> str:
        raise NotImplementedError

    def _payload(self, directory: Path) -> dict:
        """The kind-specific part of tokenizer.json (may write companion files into ``directory``)."""
        return {}

    def save(self, directory: str | os.PathLike) -> None:
        """Write ``directory/tokenizer.json`` (atomically), from which ``load_tokenizer`` rebuilds this tokenizer."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        payload = {"format": _FORMAT, "version": _FORMAT_VERSION, "kind": self.name,
                   "vocab_size": self.vocab_size, "fingerprint": self.fingerprint(), **self._payload(directory)}
        _write_json_atomic(directory / TOKENIZER_FILE, payload)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"


class ByteTokenizer(_Base):
    """UTF-8 bytes as ids 0..255. ``encode(text) -> [len(utf8)] int64``; ``decode`` replaces invalid UTF-8 with U+FFFD."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(to_utf8(text), dtype=np.uint8).astype(np.int64)

    def decode(self, ids) -> str:
        return _ids_array(ids, 256).astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def _content_digest(self) -> str:
        return _digest({"kind": "byte", "encoding": "utf-8"})


class CharTokenizer(_Base):
    """One id per character of a fixed vocabulary, plus an unknown symbol.

    ``CharTokenizer(chars)``: ``chars`` are distinct single characters in ascending code-point order
    (what ``from_text`` builds); character ``chars[i]`` has id ``i`` and ``unk_id = len(chars)``.
    """

    name = "char"

    def __init__(self, chars: Iterable[str]):
        chars = list(chars)
        if not chars:
            raise UserError("the char tokenizer needs a non-empty vocabulary (its training text is empty)")
        if any(not isinstance(c, str) or len(c) != 1 for c in chars):
            raise ValueError("char vocabulary entries must be single characters")
        codes = np.fromiter((ord(c) for c in chars), dtype=np.int64, count=len(chars))
        if np.any(np.diff(codes) <= 0):
            raise ValueError("char vocabulary must be distinct characters in ascending code-point order")
        self.chars: list[str] = chars
        self._codes = codes  # sorted code points, for searchsorted in encode
        self.unk_id = len(chars)
        self.vocab_size = len(chars) + 1
        self._id_to_char = chars + ["\ufffd"]

    @classmethod
    def from_text(cls, text: str | Iterable[str]) -> "CharTokenizer":
        """Vocabulary = the sorted distinct characters of ``text`` (a string or an iterable of pieces)."""
        pieces = [text] if isinstance(text, str) else text
        seen = np.zeros(0, dtype=np.int64)
        for piece in pieces:
            if piece:
                seen = np.union1d(seen, np.unique(_code_points(piece)))
        return cls(chr(c) for c in seen.tolist())

    def encode(self, text: str) -> np.ndarray:
        codes = _code_points(text)
        pos = np.searchsorted(self._codes, codes)  # index of each code point if it is in the vocabulary
        pos_clipped = np.minimum(pos, len(self._codes) - 1)
        known = self._codes[pos_clipped] == codes
        return np.where(known, pos_clipped, self.unk_id).astype(np.int64)

    def decode(self, ids) -> str:
        table = self._id_to_char
        return "".join([table[i] for i in _ids_array(ids, self.vocab_size).tolist()])

    def _content_digest(self) -> str:
        return _digest({"kind": "char", "chars": [ord(c) for c in self.chars], "unk": "last"})

    def _payload(self, directory: Path) -> dict:
        # code points, not strings: lone surrogates (from surrogateescape) survive JSON either way,
        # but integers keep the file readable and unambiguous
        return {"code_points": [ord(c) for c in self.chars], "unk_id": self.unk_id}


def _code_points(text: str) -> np.ndarray:
    """[len(text)] uint32 code points ("surrogatepass" keeps lone surrogates as themselves)."""
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")


# --------------------------------------------------------------------------------------------
# Words

EOS = "<eos>"
UNK = "<unk>"
# a word (a run of non-whitespace) or a newline; any other whitespace only separates words. A text
# cut where a non-space meets whitespace (``corpus.safe_pieces``) encodes piece by piece exactly.
_WORD_PATTERN = regex.compile(r"\S+|\n")


class WordTokenizer(_Base):
    """Whitespace-split words with a fixed vocabulary, an end-of-sentence and an unknown symbol.

    ``WordTokenizer(words)``: ``words`` are the ids in order: ``words[0] == "<eos>"``,
    ``words[1] == "<unk>"``, then distinct non-empty strings without whitespace (what ``from_text``
    builds). ``encode`` maps each newline to ``eos_id`` (0) and each word to its id, or to
    ``unk_id`` (1) when it is not in the vocabulary.
    """

    name = "word"

    def __init__(self, words: Iterable[str]):
        words = list(words)
        if words[:2] != [EOS, UNK]:
            raise ValueError(f"a word vocabulary starts with {EOS!r}, {UNK!r}")
        if len(words) < 3:
            raise UserError("the word tokenizer needs a non-empty vocabulary (its training text has no words)")
        for w in words:
            if not isinstance(w, str) or not w or regex.search(r"\s", w):
                raise ValueError(f"word vocabulary entries must be non-empty strings without whitespace, got {w!r}")
        if len(set(words)) != len(words):
            raise ValueError("word vocabulary entries must be distinct")
        self.words: list[str] = words
        self.eos_id, self.unk_id = 0, 1
        self.vocab_size = len(words)
        self._ids = {w: i for i, w in enumerate(words)}
        self._ids["\n"] = self.eos_id

    @classmethod
    def from_text(cls, text: str | Iterable[str]) -> "WordTokenizer":
        """Vocabulary = the distinct words of ``text`` (a string or an iterable of pieces cut at
        safe boundaries, e.g. ``corpus.text_pieces``), most frequent first, ties in code-point order."""
        from collections import Counter

        pieces = [text] if isinstance(text, str) else text
        counts: Counter = Counter()
        for piece in pieces:
            counts.update(_WORD_PATTERN.findall(piece))
        for special in ("\n", EOS, UNK):
            counts.pop(special, None)
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        return cls([EOS, UNK, *(w for w, _ in ranked)])

    def encode(self, text: str) -> np.ndarray:
        get, unk = self._ids.get, self.unk_id
        return np.array([get(w, unk) for w in _WORD_PATTERN.findall(text)], dtype=np.int64)

    def decode(self, ids) -> str:
        words, out, line_start = self.words, [], True
        for i in _ids_array(ids, self.vocab_size).tolist():
            if i == self.eos_id:
                out.append("\n")
                line_start = True
            else:
                out.append(words[i] if line_start else " " + words[i])
                line_start = False
        return "".join(out)

    def _content_digest(self) -> str:
        return _digest({"kind": "word", "words": self.words, "eos": "newline"})

    def _payload(self, directory: Path) -> dict:
        return {"words": self.words, "eos_id": self.eos_id, "unk_id": self.unk_id}


# --------------------------------------------------------------------------------------------
# GPT-2 byte-level BPE

# The GPT-2 pre-tokenizer (OpenAI gpt-2 encoder.py): contractions, optional-space + letters,
# optional-space + digits, optional-space + other symbols, whitespace not followed by a non-space
# (so the last space joins the next word), remaining whitespace.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_CACHE_LIMIT = 500_000  # pre-token -> ids entries kept before the cache is cleared


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes map to themselves, the
    other 68 bytes to U+0100.. in byte order, so BPE tokens are strings without control characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@dataclass(frozen=True)
class _BPETables:
    """Everything ``GPT2Tokenizer`` derives from one vocab.json + merges.txt; read-only, so shared."""

    encoder: dict[str, int]  # BPE symbol string -> id
    merges: list[tuple[str, str]]  # in rank order
    ranks: dict[tuple[str, str], int]
    id_bytes: list[bytes]  # id -> the bytes it stands for
    digest: str  # content digest for the fingerprint


def _build_tables(vocab_text: str, merges_text: str, source: str) -> _BPETables:
    try:
        encoder = json.loads(vocab_text)
    except json.JSONDecodeError as e:
        raise UserError(f"{source}: vocab.json is not valid JSON ({e.msg})") from None
    if not isinstance(encoder, dict) or not all(type(v) is int for v in encoder.values()):
        raise UserError(f"{source}: vocab.json must map token strings to integer ids")
    vocab_size = len(encoder)
    if set(encoder.values()) != set(range(vocab_size)):
        raise UserError(f"{source}: vocab.json ids must be exactly 0..{vocab_size - 1}")
    lines = merges_text.splitlines()
    if lines and lines[0].startswith("#version"):
        lines = lines[1:]
    merges = [tuple(line.split(" ")) for line in lines if line.strip()]
    bad = next((m for m in merges if len(m) != 2), None)
    if bad is not None:
        raise UserError(f"{source}: merges.txt line {' '.join(bad)!r} is not two symbols separated by one space")
    byte_encoder = bytes_to_unicode()
    missing = [b for b, c in byte_encoder.items() if c not in encoder]
    if missing:
        raise UserError(f"{source}: vocab.json lacks the single-byte symbols for bytes {missing[:8]}")
    unknown = next((a + b for a, b in merges if a + b not in encoder), None)
    if unknown is not None:
        raise UserError(f"{source}: merges.txt produces a symbol missing from vocab.json: {unknown!r}")
    # symbol string -> bytes: undo the byte table with one translate, then latin-1 gives the bytes;
    # a symbol outside the table (a special token of a custom vocabulary) stands for its UTF-8
    to_bytes = {ord(c): b for b, c in byte_encoder.items()}
    id_bytes = [b""] * vocab_size
    for token, i in encoder.items():
        try:
            id_bytes[i] = token.translate(to_bytes).encode("latin-1")
        except UnicodeEncodeError:
            id_bytes[i] = token.encode("utf-8")
    digest = _digest({"kind": "gpt2", "pattern": GPT2_PATTERN,
                      "vocab": sorted(encoder.items(), key=lambda kv: kv[1]), "merges": merges})
    return _BPETables(encoder, merges, {pair: rank for rank, pair in enumerate(merges)}, id_bytes, digest)


@lru_cache(maxsize=1)
def _bundled_tables() -> _BPETables:
    base = resources.files("fastweights.data").joinpath("assets", "gpt2")
    with base.joinpath("vocab.json.gz").open("rb") as f:
        vocab = gzip.decompress(f.read()).decode("utf-8")
    with base.joinpath("merges.txt.gz").open("rb") as f:
        merges = gzip.decompress(f.read()).decode("utf-8")
    return _build_tables(vocab, merges, "bundled GPT-2 files")


class GPT2Tokenizer(_Base):
    """GPT-2 byte-level BPE (50,257 ids with the shipped files).

    Args:
        vocab_file, merges_file: a ``vocab.json`` (token string -> id) and ``merges.txt`` (one merge
            per line, lowest rank first, optional ``#version`` header) in the GPT-2 format; both
            ``None`` (default) uses the files shipped with the package (parsed once per process).
            No network access.
    """

    name = "gpt2"

    def __init__(self, vocab_file: str | os.PathLike | None = None, merges_file: str | os.PathLike | None = None):
        if (vocab_file is None) != (merges_file is None):
            raise ValueError("give both vocab_file and merges_file, or neither")
        self.bundled = vocab_file is None
        if self.bundled:
            tables = _bundled_tables()
        else:
            try:
                vocab_text = Path(vocab_file).read_text(encoding="utf-8")
                merges_text = Path(merges_file).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise UserError(f"cannot read BPE files {vocab_file}, {merges_file}: {e}") from None
            tables = _build_tables(vocab_text, merges_text, str(vocab_file))
        self._tables = tables
        self.encoder = tables.encoder
        self.bpe_ranks = tables.ranks
        self.vocab_size = len(tables.encoder)
        self.eot_id: int | None = tables.encoder.get("<|endoftext|>")
        self._byte_to_symbol = bytes_to_unicode()  # str.translate table: latin-1 char of byte b -> its symbol
        self._pattern = regex.compile(GPT2_PATTERN)
        self._cache: dict[str, tuple[int, ...]] = {}  # pre-token -> ids

    def _bpe(self, symbols: str) -> list[str]:
        """Merge the byte symbols of one pre-token, always taking the lowest-ranked adjacent pair
        (all its non-overlapping occurrences, left to right), until no pair has a rank."""
        word = list(symbols)
        ranks = self.bpe_ranks
        while len(word) > 1:
            best_rank, best = None, None
            for pair in zip(word, word[1:]):
                r = ranks.get(pair)
                if r is not None and (best_rank is None or r < best_rank):
                    best_rank, best = r, pair
            if best is None:
                break
            first, second = best
            merged: list[str] = []
            i = 0
            while i < len(word):
                if i < len(word) - 1 and word[i] == first and word[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        return word

    def _encode_pretoken(self, piece: str) -> tuple[int, ...]:
        symbols = to_utf8(piece).decode("latin-1").translate(self._byte_to_symbol)
        return tuple(self.encoder[t] for t in self._bpe(symbols))

    def encode(self, text: str) -> np.ndarray:
        """[N] int64 ids of ``text``; ``<|endoftext|>`` in the text is encoded as ordinary characters."""
        cache = self._cache
        out: list[int] = []
        for piece in self._pattern.findall(text):
            ids = cache.get(piece)
            if ids is None:
                ids = self._encode_pretoken(piece)
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()
                cache[piece] = ids
            out.extend(ids)
        return np.array(out, dtype=np.int64)

    def decode(self, ids) -> str:
        table = self._tables.id_bytes
        data = b"".join([table[i] for i in _ids_array(ids, self.vocab_size).tolist()])
        return data.decode("utf-8", errors="replace")

    def _content_digest(self) -> str:
        return self._tables.digest

    def _payload(self, directory: Path) -> dict:
        if self.bundled:
            return {"files": "bundled"}
        # a custom BPE travels with the checkpoint, in the same format it was read from
        from fastweights.core.files import atomic_write

        vocab = json.dumps(self.encoder, ensure_ascii=False)
        merges = "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in self._tables.merges)
        for name, text in (("vocab.json", vocab), ("merges.txt", merges)):
            atomic_write(directory / name, lambda p, text=text: p.write_text(text, encoding="utf-8"), root=directory,
                         what="the tokenizer")
        return {"files": {"vocab": "vocab.json", "merges": "merges.txt"}}


# --------------------------------------------------------------------------------------------

TOKENIZER_KINDS = ("char", "byte", "word", "gpt2")
# kinds whose vocabulary is built from the training text (``build_tokenizer`` needs ``train_text``)
TRAINED_KINDS = ("char", "word")


def build_tokenizer(kind: str, train_text: str | Iterable[str] | None = None) -> Tokenizer:
    """A new tokenizer of ``kind`` ("char", "byte", "word" or "gpt2").

    ``train_text`` (a string or an iterable of pieces, e.g. ``corpus.text_pieces(train_docs)``) is
    needed for "char" and "word" (:data:`TRAINED_KINDS`) and builds their vocabulary; the others
    ignore it.
    """
    if kind == "byte":
        return ByteTokenizer()
    if kind == "gpt2":
        return GPT2Tokenizer()
    if kind == "char":
        if train_text is None:
            raise UserError("the char tokenizer needs training text to build its vocabulary")
        return CharTokenizer.from_text(train_text)
    if kind == "word":
        if train_text is None:
            raise UserError("the word tokenizer needs training text to build its vocabulary")
        return WordTokenizer.from_text(train_text)
    raise UserError(f"unknown tokenizer {kind!r}; choose one of {', '.join(TOKENIZER_KINDS)}")


def load_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """The tokenizer saved in ``directory/tokenizer.json`` (or a path to that file itself).

    Raises ``UserError`` when the file is missing or corrupt, or when the rebuilt tokenizer's
    fingerprint differs from the recorded one (e.g. edited files, or changed bundled GPT-2 files).
    """
    path = Path(directory)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise UserError(f"no {TOKENIZER_FILE} in {directory}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
        if meta.get("format") != _FORMAT:
            raise ValueError(f"format is {meta.get('format')!r}, not {_FORMAT!r}")
        if meta.get("version") != _FORMAT_VERSION:
            raise ValueError(f"version {meta.get('version')!r} is not supported (expected {_FORMAT_VERSION})")
        kind, recorded = meta["kind"], meta["fingerprint"]
        if kind == "byte":
            tok: Tokenizer = ByteTokenizer()
        elif kind == "char":
            tok = CharTokenizer(chr(c) for c in meta["code_points"])
            if meta.get("unk_id") != tok.unk_id:
                raise ValueError(f"unk_id {meta.get('unk_id')!r} does not follow the vocabulary ({tok.unk_id})")
        elif kind == "word":
            tok = WordTokenizer(meta["words"])
            if (meta.get("eos_id"), meta.get("unk_id")) != (tok.eos_id, tok.unk_id):
                raise ValueError(f"eos_id/unk_id {meta.get('eos_id')!r}/{meta.get('unk_id')!r} are not 0/1")
        elif kind == "gpt2":
            files = meta["files"]
            if files == "bundled":
                tok = GPT2Tokenizer()
            else:
                for f in (files["vocab"], files["merges"]):  # plain names beside tokenizer.json, never a path out
                    if not isinstance(f, str) or Path(f).name != f or f in ("", ".", ".."):
                        raise ValueError(f"files names {f!r}, not a file beside {TOKENIZER_FILE}")
                tok = GPT2Tokenizer(path.parent / files["vocab"], path.parent / files["merges"])
        else:
            raise ValueError(f"unknown kind {kind!r}")
    except UserError:
        raise
    except (ValueError, KeyError, TypeError, OverflowError) as e:  # JSONDecodeError is a ValueError
        raise UserError(f"{path} is corrupt: {e}") from None
    if tok.fingerprint() != recorded:
        raise UserError(f"{path}: recorded fingerprint {recorded} but the files give {tok.fingerprint()}; "
                        "the tokenizer files changed since it was saved")
    return tok


def unknown_symbols_warning(tokenizer: Tokenizer, texts: Iterable[str], what: str = "the text") -> str | None:
    """One line saying how much of ``texts`` lies outside a char/word vocabulary (and so reads as the
    unknown symbol), with examples; None when everything is known or the tokenizer has no unknown symbol."""
    unk = getattr(tokenizer, "unk_id", None)
    if unk is None:
        return None
    total = unknown = 0
    examples: list[str] = []
    for text in texts:
        ids = tokenizer.encode(text)
        mask = ids == unk
        total += len(ids)
        unknown += int(mask.sum())
        if mask.any() and len(examples) < 5:
            pieces = list(text) if tokenizer.name == "char" else _WORD_PATTERN.findall(text)
            for i in np.flatnonzero(mask)[:50].tolist():
                if pieces[i] not in examples and len(examples) < 5:
                    examples.append(pieces[i])
    if not unknown:
        return None
    unit = "characters" if tokenizer.name == "char" else "words"
    return (f"warning: {unknown:,} of {total:,} {unit} of {what} are not in the model's {tokenizer.name} vocabulary "
            f"and read as its unknown symbol (e.g. {', '.join(repr(e) for e in examples)})")


def check_fingerprint(tokenizer: Tokenizer, expected: str, what: str) -> None:
    """Raise ``UserError`` unless ``tokenizer.fingerprint() == expected``; ``what`` names the thing
    that recorded ``expected`` (e.g. "checkpoint runs/x" or "token stream cache/train.bin")."""
    got = tokenizer.fingerprint()
    if got != expected:
        raise UserError(f"{what} was made with tokenizer {expected}, but the tokenizer in use is {got}")


def vocab_size_of(tokenizer) -> int | None:
    """A tokenizer's vocabulary size (ours: ``vocab_size``; a transformers tokenizer: its length), None if unknown."""
    size = getattr(tokenizer, "vocab_size", None)
    try:
        return int(size) if size else len(tokenizer)
    except TypeError:
        return None


__all__ = [
    "vocab_size_of",
    "unknown_symbols_warning",
    "Tokenizer", "ByteTokenizer", "CharTokenizer", "WordTokenizer", "GPT2Tokenizer", "build_tokenizer",
    "load_tokenizer", "check_fingerprint", "bytes_to_unicode", "GPT2_PATTERN", "TOKENIZER_KINDS", "TRAINED_KINDS",
    "TOKENIZER_FILE",
]

