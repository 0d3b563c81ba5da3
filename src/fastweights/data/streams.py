"""Token streams on disk: documents encoded once into a raw array, then read through ``np.memmap``.

File layout, for ``path = cache/train.bin``:

- ``train.bin``: the token ids, little-endian ``uint16`` when the vocabulary fits (<= 65,536 ids),
  else ``uint32``; no header, so ``np.memmap(path, dtype)`` reads it;
- ``train.bin.json``: ``{"format", "version", "dtype", "length", "vocab_size", "tokenizer",
  "tokenizer_fingerprint", "doc_separator", "doc_offsets"}``. ``doc_offsets[i]`` is the index of the
  first token of document i. With a ``doc_separator`` id, one separator token sits *between*
  consecutive documents (not after the last one).

``encode_to_file`` streams: it encodes each document piece by piece (``Document.pieces`` or, for
a ``FileDocument`` or a path, reading the file block by block) and appends each piece's ids to the
file, so memory stays about one piece (1 Mi characters) whatever the corpus size. It writes under
temporary names and renames at the end (the .bin first, then the .json), so a reader never sees a
half-written stream.

``cached_stream`` keys the file by the tokenizer fingerprint and a SHA-256 of the documents'
contents, and reuses it when it already exists.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch

from fastweights.data.corpus import PIECE_CHARS, Document, FileDocument, content_digest
from fastweights.data.tokenizers import Tokenizer, check_fingerprint
from fastweights.core.errors import UserError
from fastweights.core.files import make_dirs, open_nofollow, refuse_links

_FORMAT = "fastweights-tokens"
_FORMAT_VERSION = 1
_META_KEYS = ("doc_offsets", "vocab_size", "tokenizer", "tokenizer_fingerprint", "doc_separator")


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def _as_document(item) -> Document | FileDocument:
    if isinstance(item, str):
        return Document("", item)
    if isinstance(item, (Document, FileDocument)):
        return item
    if isinstance(item, os.PathLike):
        return FileDocument.from_path(item, encoding_check=False)
    raise TypeError(f"encode_to_file takes strings, Documents, FileDocuments or paths, got {type(item).__name__}")


class TokenStream:
    """A token file opened read-only as ``np.memmap``.

    Attributes:
        tokens: [N] memmap of uint16/uint32 ids.
        doc_offsets: [n_docs] int64, the first token of each document.
        vocab_size, tokenizer_name, tokenizer_fingerprint, doc_separator, path.
    """

    def __init__(self, path: Path, tokens: np.ndarray, meta: dict):
        self.path = path
        self.tokens = tokens
        self.doc_offsets = np.asarray(meta["doc_offsets"], dtype=np.int64)
        self.vocab_size: int = meta["vocab_size"]
        self.tokenizer_name: str = meta["tokenizer"]
        self.tokenizer_fingerprint: str = meta["tokenizer_fingerprint"]
        self.doc_separator: int | None = meta["doc_separator"]

    @classmethod
    def open(cls, path: str | os.PathLike, tokenizer: Tokenizer | None = None) -> "TokenStream":
        """Open ``path`` (the .bin) and its .json sidecar; with ``tokenizer``, refuse a stream that
        another tokenizer wrote. Raises ``UserError`` when missing, corrupt or mismatched."""
        path = Path(path)
        side = _sidecar(path)
        if not path.is_file() or not side.is_file():
            raise UserError(f"token stream {path}: missing {path.name if not path.is_file() else side.name}")
        try:
            meta = json.loads(side.read_text(encoding="utf-8"))
            if meta.get("format") != _FORMAT or meta.get("version") != _FORMAT_VERSION:
                raise ValueError(f"unknown format {meta.get('format')!r} version {meta.get('version')!r}")
            dtype = np.dtype(meta["dtype"])
            if dtype not in (np.dtype("<u2"), np.dtype("<u4")):
                raise ValueError(f"dtype {meta['dtype']!r} is not uint16/uint32")
            length = int(meta["length"])
            missing = [k for k in _META_KEYS if k not in meta]
            if missing:
                raise ValueError(f"missing {', '.join(missing)}")
            if length < 0 or not isinstance(meta["vocab_size"], int) or isinstance(meta["vocab_size"], bool) \
                    or not isinstance(meta["doc_offsets"], list) \
                    or not all(isinstance(o, int) and not isinstance(o, bool) for o in meta["doc_offsets"]) \
                    or not (meta["doc_separator"] is None or isinstance(meta["doc_separator"], int)) \
                    or not isinstance(meta["tokenizer"], str) or not isinstance(meta["tokenizer_fingerprint"], str):
                raise ValueError("a field of the wrong type")
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
            raise UserError(f"token stream {side} is corrupt: {e}") from None
        size = path.stat().st_size
        if size != length * dtype.itemsize:
            raise UserError(f"token stream {path}: {size} bytes on disk, but the sidecar says {length} tokens "
                            f"of {dtype.itemsize} bytes; delete it to re-encode")
        # np.memmap cannot map an empty file
        tokens = np.memmap(path, dtype=dtype, mode="r", shape=(length,)) if length else np.zeros(0, dtype=dtype)
        stream = cls(path, tokens, meta)
        if tokenizer is not None:
            check_fingerprint(tokenizer, stream.tokenizer_fingerprint, f"token stream {path}")
        vocab = tokenizer.vocab_size if tokenizer is not None else stream.vocab_size
        top = max((int(tokens[i : i + (1 << 24)].max()) for i in range(0, length, 1 << 24)), default=-1)
        if top >= vocab:  # ids the model's embedding cannot look up (a damaged or crafted file)
            raise UserError(f"token stream {path} holds id {top}, outside the vocabulary of {vocab} symbols; "
                            "delete it to re-encode")
        return stream

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def __repr__(self) -> str:
        return f"TokenStream({str(self.path)!r}, tokens={len(self)}, docs={len(self.doc_offsets)}, tokenizer={self.tokenizer_name})"

    def _need(self, n: int, what: str) -> None:
        if len(self) < n:
            raise UserError(f"token stream {self.path} has {len(self)} tokens, fewer than {what} needs ({n}); "
                            "use a longer corpus or a shorter sequence length")

    def get_batch(self, batch_size: int, seq_len: int,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows: x [B, T] int64 and y [B, T] int64 with ``y[:, t] = x[:, t + 1]`` in the stream.

        Window starts are uniform over all ``len - seq_len`` valid positions, drawn from ``generator``
        (a CPU ``torch.Generator``; ``None`` uses torch's global one). ``UserError`` if the stream is
        shorter than ``seq_len + 1``.
        """
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}")
        self._need(seq_len + 1, f"one sequence of seq_len {seq_len} plus its target")
        starts = torch.randint(0, len(self) - seq_len, (batch_size,), generator=generator).numpy()
        return self._windows(starts, seq_len)

    def _windows(self, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T], y [B, T] int64 for the windows starting at ``starts`` [B]."""
        index = starts[:, None] + np.arange(seq_len + 1)  # [B, T + 1] positions; memmap reads just these
        windows = torch.from_numpy(np.asarray(self.tokens[index], dtype=np.int64))  # [B, T + 1]
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def get_lane_batch(self, batch_size: int, seq_len: int, step: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Contiguous windows for truncated BPTT: x [B, T], y [B, T] and whether the lanes restart.

        The stream is cut into ``batch_size`` equal lanes; at ``step`` row i reads window
        ``step mod W`` of lane i (W = windows per lane), so row i of one step continues exactly where
        row i of the step before ended, and every lane restarts at its beginning after W steps (then
        ``restart`` is True and a carried state must be dropped).
        """
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}")
        lane = (len(self) - 1) // batch_size
        windows = lane // seq_len
        if windows < 1:
            raise UserError(f"train.carry_state: {len(self):,} tokens cut into {batch_size} lanes leave less "
                            f"than one window of seq_len {seq_len} per lane")
        k = step % windows
        x, y = self._windows(np.arange(batch_size) * lane + k * seq_len, seq_len)
        return x, y, k == 0

    def iter_chunks(self, seq_len: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Contiguous, non-overlapping (x [1, T], y [1, T]) int64 pairs in stream order: every token
        after the first is a target exactly once; the last chunk may be shorter. For streaming
        evaluation with the state carried from chunk to chunk."""
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self._need(2, "one prediction")
        n = len(self)
        for start in range(0, n - 1, seq_len):
            stop = min(start + seq_len, n - 1)  # last input position (exclusive); its target is at stop
            window = torch.from_numpy(np.asarray(self.tokens[start:stop + 1], dtype=np.int64))  # [t + 1]
            yield window[None, :-1], window[None, 1:]


def encode_to_file(texts: Iterable, tokenizer: Tokenizer, path: str | os.PathLike, *,
                   doc_separator: int | None = None, progress: bool = False,
                   piece_chars: int = PIECE_CHARS, root: str | os.PathLike | None = None) -> TokenStream:
    """Encode ``texts`` (each a ``str``, ``Document``, ``FileDocument`` or path of a UTF-8 file; one
    document each) into ``path`` and its sidecar, streaming; returns the opened ``TokenStream``.

    Args:
        doc_separator: an id written between consecutive documents (e.g. GPT-2's ``eot_id``); None
            writes the documents back to back.
        progress: print characters/s and ETA to stderr (``fastweights.core.progress.Progress``).
        piece_chars: characters encoded at a time (memory bound; does not change the result).
        root: the folder the user named (``--out``): a symbolic link at ``path`` or at any folder between
            ``root`` and it is refused (:func:`fastweights.core.files.refuse_links`).
    """
    path = Path(path)
    vocab = tokenizer.vocab_size
    if doc_separator is not None and not 0 <= doc_separator < vocab:
        raise ValueError(f"doc_separator {doc_separator} is outside the vocabulary [0, {vocab})")
    dtype = np.dtype("<u2") if vocab <= 1 << 16 else np.dtype("<u4")
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp_side = path.with_name(f"{path.name}.json.{os.getpid()}.tmp")
    if root is not None:
        for p in (path, _sidecar(path)):
            refuse_links(Path(root), p, "the token cache")
        make_dirs(Path(root), path.parent, "the token cache")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
    for t in (tmp, tmp_side):  # never write through a link planted at a temporary name
        if os.path.islink(t):
            os.unlink(t)
    for p in (path, _sidecar(path)):
        if p.is_dir() and not p.is_symlink():
            raise UserError(f"{p} is a folder; cannot write the token cache there (remove it)")
    bar = None
    if progress:
        from fastweights.core.progress import Progress

        # a total only when it is free: a list of in-memory texts or documents (not a generator)
        known = isinstance(texts, (list, tuple)) and all(isinstance(t, (str, Document, FileDocument)) for t in texts)
        total = sum(len(t) if isinstance(t, str) else t.n_chars for t in texts) if known else None
        bar = Progress(total=total, unit="chars", desc=f"encoding {path.name}")
    offsets: list[int] = []
    length = 0
    try:
        with os.fdopen(open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "the token cache"), "wb") as f:
            # one document at a time: a generator of texts is never held whole
            for i, doc in enumerate(map(_as_document, texts)):
                if i and doc_separator is not None:
                    f.write(np.array([doc_separator], dtype=dtype).tobytes())
                    length += 1
                offsets.append(length)
                for piece in doc.pieces(piece_chars):
                    ids = tokenizer.encode(piece)
                    f.write(np.asarray(ids).astype(dtype).tobytes())
                    length += len(ids)
                    if bar is not None:
                        bar.update(len(piece), tokens=length)
        meta = {"format": _FORMAT, "version": _FORMAT_VERSION, "dtype": dtype.str, "length": length,
                "vocab_size": vocab, "tokenizer": tokenizer.name, "tokenizer_fingerprint": tokenizer.fingerprint(),
                "doc_separator": doc_separator, "doc_offsets": offsets}
        with os.fdopen(open_nofollow(tmp_side, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "the token cache"), "w",
                       encoding="utf-8") as f:
            f.write(json.dumps(meta))
        # .bin first: a sidecar on disk always describes the .bin next to it (or a stale one, which
        # TokenStream.open catches by size; caches use content-keyed names anyway)
        os.replace(tmp, path)
        os.replace(tmp_side, _sidecar(path))
    finally:
        for t in (tmp, tmp_side):
            if t.exists():
                t.unlink()
        if bar is not None:
            bar.close()
    return TokenStream.open(path)


_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def cached_stream(docs: Iterable, tokenizer: Tokenizer, cache_dir: str | os.PathLike, tag: str, *,
                  doc_separator: int | None = None, progress: bool = False,
                  root: str | os.PathLike | None = None) -> TokenStream:
    """``encode_to_file(docs, ...)`` into ``cache_dir/<tag>-<key>.bin``, or the existing file.

    ``root`` (the folder the user named, e.g. ``--out`` for ``--out/data``): a symbolic link at any level
    between it and the cache file is refused, whether the file is to be read or written.

    ``docs`` is read twice (hash, then encode), so a generator is collected into a list first;
    ``FileDocument`` entries stay on disk either way.

    ``key`` is 16 hex digits of SHA-256 over the tokenizer fingerprint, ``doc_separator``, the
    format version and the documents' contents (``corpus.content_digest``: one streaming pass; names
    do not count). ``tag`` (e.g. "train") only makes the file name readable.
    """
    docs = [_as_document(d) for d in docs]
    key_src = json.dumps({"tokenizer": tokenizer.fingerprint(), "doc_separator": doc_separator,
                          "format": _FORMAT_VERSION, "content": content_digest(docs)}, sort_keys=True)
    key = hashlib.sha256(key_src.encode("utf-8")).hexdigest()[:16]
    path = Path(cache_dir) / f"{_UNSAFE.sub('_', tag) or 'stream'}-{key}.bin"
    if root is not None:
        for p in (path, _sidecar(path)):
            refuse_links(Path(root), p, "the token cache")
    if path.is_file() and _sidecar(path).is_file():
        try:
            return TokenStream.open(path, tokenizer)
        except UserError:
            pass  # a damaged cache entry is rebuilt below
    return encode_to_file(docs, tokenizer, path, doc_separator=doc_separator, progress=progress, root=root)


__all__ = ["TokenStream", "encode_to_file", "cached_stream"]
