"""Corpora: documents of text from the bundled corpora, local files, JSONL, or Hugging Face ``datasets``.

A corpus is a ``list[Document]``. ``load_corpus(spec)`` understands

- a registered name (``CORPORA``): the corpora shipped inside the package (``tinyshakespeare``,
  ``state-of-the-union``, ``novels``, ``don-quijote``, ``shakespeare-complete`` / ``-train`` /
  ``-heldout``, ``bible-en``, ``bible-es``, ...; see ``fastweights.data.bundled`` and
  ``fastweights data list``), and names other modules register (e.g. ``fastweights.tasks.niah``);
- ``"NAME:DOCUMENT"``: the one document called DOCUMENT of the registered corpus NAME;
- a text file (any suffix except ``.jsonl``; ``.gz`` and ``.xz`` are decompressed): one document;
- a directory: every ``*.txt`` below it, recursively, sorted by relative path, one document each,
  named by that relative path;
- a ``.jsonl`` (or ``.jsonl.gz``, ``.jsonl.xz``) file: one document per non-blank line, from the
  field ``text_field``;
- ``"hf:<dataset>[:<config>][:<split>]"``: a Hugging Face dataset, when ``datasets`` is installed.

Big files stay on disk. A plain text file larger than ``lazy_bytes`` (64 MiB by default) becomes a
``FileDocument``: it holds a path and a byte range, and hands out its text in pieces
(``FileDocument.pieces``), so ``streams.encode_to_file`` tokenizes a 100 MB file without holding it
in memory. ``.text`` still works on it (it reads the range), for callers that want the whole string.
``Document`` and ``FileDocument`` share one interface: ``name``, ``text``, ``n_chars``,
``pieces(max_chars)``, ``split_at(cuts)``, ``utf8_chunks()``.

Undecodable bytes. With ``encoding_check=True`` (the default, and what the char tokenizer needs) a
file that is not valid UTF-8 raises ``UserError`` naming the file and the byte offset. With
``encoding_check=False`` invalid bytes are kept losslessly as lone surrogates ("surrogateescape"):
``to_utf8`` turns them back into the original bytes, so the byte and GPT-2 tokenizers see exactly the
bytes of the file.

Splits into train, validation and test: :mod:`fastweights.data.splits`.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import json
import lzma
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Union

import regex

from fastweights.data.bundled import BUNDLED, BundledCorpus
from fastweights.core.errors import UserError

# Pieces handed to tokenizers: big enough that per-piece overhead vanishes, small enough that the
# ids of one piece (a Python list inside the GPT-2 encoder) stay a few tens of MB.
PIECE_CHARS = 1 << 20
# Plain text files above this size are read lazily (FileDocument) instead of into memory.
LAZY_FILE_BYTES = 64 << 20
# Bytes read from disk per step when streaming a file.
READ_BYTES = 1 << 20

_BOM = "\ufeff"
_BOM_BYTES = codecs.BOM_UTF8
# A place where text may be cut without changing any tokenizer's output: a non-space character
# followed by a whitespace character. The GPT-2 pre-tokenizer can never join the two into one
# pre-token (its letter/number/punctuation classes stop at whitespace and its whitespace classes
# never take a non-space character), and it has no look-behind, so matching from the cut onwards is
# the same in the piece as in the whole text. The byte and char tokenizers may be cut anywhere.
# `\s` here is the `regex` module's, the same as in the GPT-2 pattern; (?r) searches from the end.
_LAST_BOUNDARY = regex.compile(r"(?r)\S(?=\s)")


def to_utf8(text: str) -> bytes:
    """UTF-8 bytes of ``text``; lone surrogates from ``surrogateescape`` decoding become their bytes again.

    Other lone surrogates (e.g. from a JSON ``"\\ud800"`` escape) are written with ``surrogatepass``.
    """
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass")


def _decode(data: bytes, source: str, encoding_check: bool) -> str:
    """Decode UTF-8, naming ``source`` and the byte offset when it is invalid and checking is on."""
    if not encoding_check:
        text = data.decode("utf-8", "surrogateescape")
    else:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(_bad_utf8_message(source, e.start, data[e.start:e.start + 4])) from None
    return text[1:] if text.startswith(_BOM) else text


def _bad_utf8_message(source: str, offset: int, sample: bytes) -> str:
    return (f"{source}: not valid UTF-8 at byte offset {offset} (bytes {sample.hex(' ')}); "
            "convert the file to UTF-8, or set data.tokenizer = \"byte\" (or \"gpt2\"), which keep invalid bytes")


@dataclass(frozen=True)
class Document:
    """One text held in memory. ``name`` identifies it (file path relative to the corpus root,
    ``file.jsonl:LINE``, ...) and is what ``split_corpus(how="document")`` hashes."""

    name: str
    text: str

    @property
    def n_chars(self) -> int:
        return len(self.text)

    def pieces(self, max_chars: int = PIECE_CHARS) -> Iterator[str]:
        """The text in consecutive pieces of about ``max_chars``, cut only where no tokenizer
        output changes (see ``_LAST_BOUNDARY``); ``"".join(pieces) == text``."""
        blocks = (self.text[i:i + max_chars] for i in range(0, len(self.text), max_chars))
        return safe_pieces(blocks, max_chars)

    def utf8_chunks(self) -> Iterator[bytes]:
        """The UTF-8 bytes of the text (what ``to_utf8`` gives), in chunks; for content hashing."""
        for i in range(0, len(self.text), PIECE_CHARS):
            yield to_utf8(self.text[i:i + PIECE_CHARS])

    def split_at(self, cuts: list[int]) -> list["Document"]:
        """Consecutive pieces [0, c1), [c1, c2), ..., [ck, n_chars) at character offsets ``cuts``
        (sorted, within [0, n_chars]); a piece that is not the whole text is named ``name[a:b]``."""
        bounds = [0, *cuts, self.n_chars]
        return [self if (a, b) == (0, self.n_chars) else Document(f"{self.name}[{a}:{b}]", self.text[a:b])
                for a, b in zip(bounds[:-1], bounds[1:])]


@dataclass(frozen=True)
class FileDocument:
    """A document that stays on disk: the UTF-8 bytes ``[byte_start, byte_end)`` of ``path``.

    ``n_chars`` is its length in characters (as decoded with "surrogateescape"). Build one with
    ``FileDocument.from_path`` (one pass over the file: validates UTF-8 when asked, counts characters).
    """

    name: str
    path: Path
    byte_start: int
    byte_end: int
    n_chars: int

    @classmethod
    def from_path(cls, path: str | os.PathLike, name: str | None = None,
                  encoding_check: bool = True) -> "FileDocument":
        """The whole file (after a UTF-8 byte-order mark, if any). Raises ``UserError`` on invalid
        UTF-8 (file and byte offset) when ``encoding_check``."""
        path = Path(path)
        size = path.stat().st_size
        with open(path, "rb") as f:
            start = len(_BOM_BYTES) if f.read(len(_BOM_BYTES)) == _BOM_BYTES else 0
        errors = "strict" if encoding_check else "surrogateescape"
        n_chars = sum(len(s) for _, s in _decoded_blocks(path, start, size, errors))
        return cls(name if name is not None else path.name, path, start, size, n_chars)

    @property
    def text(self) -> str:
        """The whole text, read from disk now (memory: the size of the range)."""
        with open(self.path, "rb") as f:
            f.seek(self.byte_start)
            return f.read(self.byte_end - self.byte_start).decode("utf-8", "surrogateescape")

    def pieces(self, max_chars: int = PIECE_CHARS) -> Iterator[str]:
        """Like ``Document.pieces``, reading the file block by block (memory: about ``max_chars``)."""
        blocks = (s for _, s in _decoded_blocks(self.path, self.byte_start, self.byte_end, "surrogateescape"))
        return safe_pieces(blocks, max_chars)

    def utf8_chunks(self) -> Iterator[bytes]:
        """The raw bytes of the range, in chunks (equal to ``to_utf8(self.text)``)."""
        with open(self.path, "rb") as f:
            f.seek(self.byte_start)
            left = self.byte_end - self.byte_start
            while left > 0:
                data = f.read(min(READ_BYTES, left))
                if not data:
                    raise UserError(f"{self.path}: file shrank while being read")
                left -= len(data)
                yield data

    def split_at(self, cuts: list[int]) -> list["FileDocument"]:
        """Like ``Document.split_at``; finds the byte offsets of all cuts in one pass over the range."""
        byte_cuts = _char_to_byte_offsets(self, cuts)
        bounds = [0, *cuts, self.n_chars]
        byte_bounds = [self.byte_start, *byte_cuts, self.byte_end]
        out = []
        for i in range(len(bounds) - 1):
            a, b = bounds[i], bounds[i + 1]
            if (a, b) == (0, self.n_chars):
                out.append(self)
            else:
                out.append(FileDocument(f"{self.name}[{a}:{b}]", self.path, byte_bounds[i], byte_bounds[i + 1], b - a))
        return out


AnyDocument = Union[Document, FileDocument]


def _decoded_blocks(path: Path, start: int, end: int, errors: str) -> Iterator[tuple[int, str]]:
    """(byte offset where the block's text starts, text) for the bytes [start, end) of ``path``,
    decoded incrementally so that a character split across two reads is decoded whole."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors)
    pos = start  # bytes handed to the decoder so far, as a file offset
    with open(path, "rb") as f:
        f.seek(start)
        while pos < end:
            data = f.read(min(READ_BYTES, end - pos))
            if not data:
                raise UserError(f"{path}: file shrank while being read")
            pending = len(decoder.getstate()[0])  # bytes of an unfinished character from the last read
            final = pos + len(data) >= end
            try:
                text = decoder.decode(data, final=final)
            except UnicodeDecodeError as e:
                # e.start counts from the decoder's buffer, which begins `pending` bytes before `pos`
                offset = pos - pending + e.start
                raise UserError(_bad_utf8_message(str(path), offset, e.object[e.start:e.start + 4])) from None
            if text:
                yield pos - pending, text
            pos += len(data)


def _char_to_byte_offsets(doc: FileDocument, cuts: list[int]) -> list[int]:
    """File byte offsets of the character offsets ``cuts`` (sorted) inside ``doc``."""
    out: list[int] = []
    todo = list(cuts)
    seen = 0  # characters before the current block
    for block_byte, text in _decoded_blocks(doc.path, doc.byte_start, doc.byte_end, "surrogateescape"):
        while todo and todo[0] < seen + len(text):
            # surrogateescape decoding is inverted exactly by to_utf8, so the prefix's byte length
            # is the byte distance from the block start
            out.append(block_byte + len(to_utf8(text[:todo.pop(0) - seen])))
        seen += len(text)
    out.extend(doc.byte_end for _ in todo)  # cuts at n_chars
    return out


def safe_pieces(blocks: Iterable[str], max_chars: int = PIECE_CHARS) -> Iterator[str]:
    """Re-cut a stream of text blocks into pieces of at least ``max_chars`` (except the last) that
    end at a safe boundary (non-space then whitespace), so encoding the pieces one by one equals
    encoding the whole text. A stretch with no boundary stays in one piece, however long."""
    pending: list[str] = []  # blocks not yet handed out, in order
    pending_chars = 0
    for block in blocks:
        if not block:
            continue
        # a boundary may straddle two blocks: prefix the previous block's last character
        prev = pending[-1][-1] if pending else ""
        pending.append(block)
        pending_chars += len(block)
        if pending_chars < max_chars:
            continue
        m = _LAST_BOUNDARY.search(prev + block)
        if m is None:
            continue
        cut = m.end() - len(prev)  # position in `block`; 0 means "between the previous block and this one"
        head = "".join(pending[:-1]) + block[:cut]
        yield head
        pending = [block[cut:]] if cut < len(block) else []
        pending_chars = len(block) - cut
    if pending_chars:
        yield "".join(pending)


def text_pieces(docs: Iterable[AnyDocument | str], max_chars: int = PIECE_CHARS) -> Iterator[str]:
    """All documents' text in order, as pieces (nothing inserted between documents). Feed this to
    ``build_tokenizer("char", train_text=...)`` to build a vocabulary without one big string."""
    for doc in docs:
        yield from (Document("", doc) if isinstance(doc, str) else doc).pieces(max_chars)


# --------------------------------------------------------------------------------------------
# Loaders


def _bundled_loader(corpus: BundledCorpus) -> Callable[[], list[Document]]:
    """The loader registered for a corpus shipped in the package: its texts as ``Document``s."""
    return lambda: [Document(name, text) for name, text in corpus.read()]


# Registered corpus names -> loader: the corpora shipped in the package (``fastweights.data.bundled``);
# other modules may add entries (e.g. ``fastweights.tasks.niah``).
CORPORA: dict[str, Callable[[], list[Document]]] = {name: _bundled_loader(c) for name, c in BUNDLED.items()}


def load_corpus(spec: str, text_field: str = "text", encoding_check: bool = True,
                lazy_bytes: int = LAZY_FILE_BYTES) -> list[AnyDocument]:
    """Documents named by ``spec`` (see the module docstring for the forms it takes).

    Args:
        spec: registered name, ``"NAME:DOCUMENT"`` (one document of a registered corpus), path to
            a text file, a directory, a ``.jsonl`` file, or ``"hf:<dataset>[:<config>][:<split>]"``
            (split defaults to ``"train"``; write ``"hf:name::validation"`` for a split without a
            config).
        text_field: the JSONL / Hugging Face field holding the text.
        encoding_check: raise ``UserError`` (file and byte offset) on invalid UTF-8; when False,
            keep invalid bytes losslessly (surrogateescape).
        lazy_bytes: plain text files larger than this stay on disk as ``FileDocument``.

    Empty documents are dropped. Raises ``UserError`` when the path does not exist, when there is
    no document, or when every document is empty.
    """
    if spec in CORPORA:
        docs = CORPORA[spec]()
    elif spec.partition(":")[0] in CORPORA:
        docs = _registered_document(spec)
    elif spec.startswith("hf:"):
        docs = _load_hf(spec, text_field)
    else:
        path = Path(spec).expanduser()
        if not path.exists():
            raise UserError(f"corpus {spec!r}: no such file or directory, and not a registered corpus "
                            f"({', '.join(sorted(CORPORA))})")
        try:
            docs = _load_path(path, text_field, encoding_check, lazy_bytes)
        except OSError as e:  # permissions, a directory that vanished, ...
            raise UserError(f"corpus {spec!r}: cannot read {e.filename or path}: {e.strerror or e}") from None
    if not docs:
        raise UserError(f"corpus {spec!r}: no documents")
    kept = [d for d in docs if d.n_chars > 0]
    if not kept:
        raise UserError(f"corpus {spec!r}: empty (all {len(docs)} document(s) have no text)")
    return kept


def _registered_document(spec: str) -> list[Document]:
    """``"NAME:DOCUMENT"``: the document named DOCUMENT of the registered corpus NAME, as a one-item list."""
    name, _, doc_name = spec.partition(":")
    docs = CORPORA[name]()
    picked = [d for d in docs if d.name == doc_name]
    if not picked:
        shown = ", ".join(d.name for d in docs[:8]) + (f", ... ({len(docs)} in all)" if len(docs) > 8 else "")
        raise UserError(f"corpus {spec!r}: {name!r} has no document {doc_name!r} (it has: {shown})")
    return picked


def _decompress(path: Path, data: bytes) -> bytes:
    """``data`` read from ``path``, gunzipped for ``.gz`` and unxz'd for ``.xz`` (else unchanged)."""
    try:
        if path.name.endswith(".gz"):
            return gzip.decompress(data)
        if path.name.endswith(".xz"):
            return lzma.decompress(data)
    except (OSError, EOFError, lzma.LZMAError) as e:
        kind = "gzip" if path.name.endswith(".gz") else "xz"
        raise UserError(f"{path}: not a readable {kind} file ({e})") from None
    return data


def _load_path(path: Path, text_field: str, encoding_check: bool, lazy_bytes: int) -> list[AnyDocument]:
    if path.is_dir():
        found = sorted(path.rglob("*.txt"), key=lambda p: p.relative_to(path).as_posix())
        odd = next((p for p in found if not p.is_file() and not p.is_dir()), None)
        if odd is not None:  # as when given directly: /dev/zero, a FIFO, a socket are endless or block
            what = "a broken link" if odd.is_symlink() and not odd.exists() else \
                "not a regular file (a device, pipe or socket, or a link to one)"
            raise UserError(f"corpus directory {path}: {odd.relative_to(path).as_posix()} is {what}; remove it or "
                            "move it out of the folder")
        files = [p for p in found if p.is_file()]
        if not files:
            raise UserError(f"corpus directory {path}: no .txt files in it")
        return [_load_text_file(p, p.relative_to(path).as_posix(), encoding_check, lazy_bytes) for p in files]
    if not path.is_file():  # /dev/zero, a FIFO, a socket: endless or blocking, never read
        raise UserError(f"corpus {path}: not a regular file or directory (a device, pipe or socket)")
    if path.name.endswith((".jsonl", ".jsonl.gz", ".jsonl.xz")):
        return _load_jsonl(path, text_field, encoding_check)
    return [_load_text_file(path, path.name, encoding_check, lazy_bytes)]


def _load_text_file(path: Path, name: str, encoding_check: bool, lazy_bytes: int) -> AnyDocument:
    if path.name.endswith((".gz", ".xz")):
        return Document(name, _decode(_decompress(path, path.read_bytes()), str(path), encoding_check))
    if path.stat().st_size > lazy_bytes:
        return FileDocument.from_path(path, name, encoding_check)
    return Document(name, _decode(path.read_bytes(), str(path), encoding_check))


def _load_jsonl(path: Path, text_field: str, encoding_check: bool) -> list[Document]:
    data = _decompress(path, path.read_bytes())
    docs = []
    for lineno, line in enumerate(_decode(data, str(path), encoding_check).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path} line {lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(row, dict) or text_field not in row:
            fields = ", ".join(map(str, row)) if isinstance(row, dict) else type(row).__name__
            raise UserError(f"{path} line {lineno}: no field {text_field!r} (has: {fields}); set data.text_field")
        text = row[text_field]
        if not isinstance(text, str):
            raise UserError(f"{path} line {lineno}: field {text_field!r} is {type(text).__name__}, not a string")
        docs.append(Document(f"{path.name}:{lineno}", _check_surrogates(text, f"{path} line {lineno}", encoding_check)))
    return docs


def _check_surrogates(text: str, where: str, encoding_check: bool) -> str:
    """JSON can carry lone surrogate escapes ("\\ud83d"), which are not text; refuse or replace them."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError as e:
        if encoding_check:
            raise UserError(f"{where}: invalid Unicode (lone surrogate U+{ord(text[e.start]):04X} "
                            f"at character {e.start})") from None
        # through UTF-16, where a lone surrogate is one undecodable unit that "replace" turns into U+FFFD
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def _hub_unreachable(timeout: float = 5.0) -> str | None:
    """Why the Hugging Face hub cannot be reached (its host does not answer within ``timeout`` seconds), or None
    (reachable, or HF_HUB_OFFLINE already set: then ``datasets`` reads its cache and fails at once)."""
    import socket
    from urllib.parse import urlparse

    try:
        from huggingface_hub import constants

        if constants.HF_HUB_OFFLINE:
            return None
        url = urlparse(constants.ENDPOINT)
    except Exception:  # noqa: BLE001 - without huggingface_hub, datasets reports its own error
        return None
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
    except OSError as e:
        return f"{url.hostname} cannot be reached ({e.strerror or e})"
    return None


class _offline:
    """While active (``on``): huggingface_hub and datasets in offline mode, as with HF_HUB_OFFLINE=1."""

    def __init__(self, on: bool):
        self.on, self.saved = on, []

    def __enter__(self):
        if self.on:
            import importlib

            for name, key in (("huggingface_hub.constants", "HF_HUB_OFFLINE"), ("datasets.config", "HF_HUB_OFFLINE"),
                              ("datasets.config", "HF_DATASETS_OFFLINE")):
                try:
                    mod = importlib.import_module(name)
                except Exception:  # noqa: BLE001 - a module that is not there has no switch to set
                    continue
                if hasattr(mod, key):
                    self.saved.append((mod, key, getattr(mod, key)))
                    setattr(mod, key, True)
        return self

    def __exit__(self, *exc):
        for mod, key, value in reversed(self.saved):
            setattr(mod, key, value)


def _load_hf(spec: str, text_field: str) -> list[Document]:
    parts = spec[len("hf:"):].split(":")
    if not parts[0] or len(parts) > 3:
        raise UserError(f"corpus {spec!r}: expected hf:<dataset>[:<config>][:<split>]")
    dataset = parts[0]
    config = parts[1] if len(parts) > 1 and parts[1] else None
    split = parts[2] if len(parts) > 2 and parts[2] else "train"
    try:
        import datasets
    except ImportError:
        raise UserError(f"corpus {spec!r} needs the Hugging Face `datasets` package: "
                        "pip install 'fastweights[hf]'") from None
    why = _hub_unreachable()
    try:
        with _offline(why is not None):  # no network: the local cache or an error now, not minutes of retries
            rows = datasets.load_dataset(dataset, config, split=split)
    except Exception as e:  # network, missing dataset, bad config: all reach the user the same way
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if why is not None:
            raise UserError(f"corpus {spec!r}: Hugging Face dataset {dataset!r} (config {config!r}, split {split!r}) "
                            f"is not in the local cache, and {why}") from None
        raise UserError(f"corpus {spec!r}: could not load Hugging Face dataset {dataset!r} "
                        f"(config {config!r}, split {split!r}): {first_line}") from None
    columns = list(getattr(rows, "column_names", None) or (rows[0].keys() if len(rows) else []))
    if text_field not in columns:
        raise UserError(f"corpus {spec!r}: no field {text_field!r} (has: {', '.join(columns)}); set data.text_field")
    docs = []
    for i, row in enumerate(rows):
        text = row[text_field]
        if not isinstance(text, str):
            raise UserError(f"corpus {spec!r} row {i}: field {text_field!r} is {type(text).__name__}, not a string")
        docs.append(Document(f"{dataset}/{split}:{i}", text))
    return docs


def content_digest(docs: Iterable[AnyDocument | str]) -> str:
    """SHA-256 (hex) of the documents' UTF-8 contents and boundaries, streaming; names are ignored."""
    h = hashlib.sha256()
    for doc in docs:
        if isinstance(doc, str):
            doc = Document("", doc)
        n = 0
        for chunk in doc.utf8_chunks():
            h.update(chunk)
            n += len(chunk)
        # a length suffix after each document makes the digest tell "ab"+"c" from "a"+"bc"
        h.update(b"|%d|" % n)
    return h.hexdigest()


def first_chars(texts: Iterable[str], max_chars: int | None) -> list[str]:
    """The first ``max_chars`` characters of the texts in order (the last text kept cut short); all of
    them when ``max_chars`` is 0 or None."""
    texts = list(texts)
    if not max_chars or max_chars <= 0:
        return texts
    kept, left = [], max_chars
    for t in texts:
        if left <= 0:
            break
        kept.append(t[:left])
        left -= len(kept[-1])
    return kept


__all__ = [
    "CORPORA", "Document", "FileDocument", "AnyDocument", "load_corpus", "text_pieces",
    "safe_pieces", "content_digest", "first_chars", "to_utf8", "PIECE_CHARS", "LAZY_FILE_BYTES",
]
