"""The frozen backbone's hidden states of the training text, computed once and stored on disk for
``fastweights fwl-head train`` (:mod:`fastweights.hf.fwl_training`).

On a CPU the backbone's forward pass is the cost that matters (SmolLM2-135M: about 500 tokens/s on one
thread), so the frozen part of the backbone runs once: for each window ``x [W]`` of the training text the
cache stores, memory-mapped (``hidden.npy``, ``[windows, W, d_model]``, float16 or float32),

    h_in = blocks_input(x, K)    (the input of decoder block N - K; K = 0: the final hidden state)

where K is the number of top backbone blocks trained with the head (``trainable_blocks``; the N - K blocks
below stay frozen), and the static model's loss of that window, from the cached value (cast back to fp32):

    static = mean_t CE(top_blocks(h_in, K)_t E + c, x_{t+1})    (nats; the pretrained logits, no head)

so that training logs the head's gain over the static model on the same windows at no extra cost. Each
window is read by the backbone alone (positions 0..W-1, a fresh KV cache): the head's running update is
what training carries across the consecutive windows of a document, not the backbone's context.

Windows are stored in document order (``doc_windows``: how many consecutive windows each document gave).
The cache is keyed by everything that changes its contents: the tokens (SHA-256 of the windows: the data's
content under the tokenizer, and the window size), the data spec, the window, the document split, K, the
backbone (SHA-256 of every weight) and the dtype. A cache made for another key is rebuilt, a partial one
of the same key resumed; what is reused is checked first (:func:`open_hidden`, :func:`load_cache`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fastweights.core.errors import UserError
from fastweights.core.progress import Progress

CACHE_META = "cache.json"
#: the fields of a cache's metadata that name its contents: a cache whose metadata differs in one is rebuilt
KEY_FIELDS = ("tokens_sha", "data", "window", "doc_windows", "trainable_blocks", "backbone", "dtype")


@torch.no_grad()
def cache_hidden_states(backbone, tokens: np.ndarray, directory: str | Path, sources: list | None = None,
                        fingerprint: str = "", progress: bool = True, dtype: str = "float16", *,
                        doc_windows: list[int] | None = None, data: str = "", trainable_blocks: int = 0) -> dict:
    """Cache ``blocks_input(tokens[i], trainable_blocks)`` and the static loss of every window ``tokens [n, W]``
    (int64) in ``directory`` (``hidden.npy``, ``tokens.npy``, the metadata ``cache.json``); ``dtype`` float16
    halves the disk, float32 keeps the states exact. ``doc_windows``: consecutive windows per document, in
    order (default: every window its own document); ``data``: the data spec the windows came from;
    ``fingerprint``: :func:`backbone_digest`. Files are written refusing a symbolic link below ``directory``.
    Returns the metadata, with ``computed_this_call`` (windows the backbone ran on in this call: 0 when the
    cache was reused)."""
    from fastweights.core.files import atomic_write, make_dirs, refuse_links
    from fastweights.hf.fwl_head import blocks_input, top_blocks

    directory = Path(directory)
    make_dirs(directory, directory, "the hidden-state cache")
    if dtype not in ("float16", "float32"):
        raise UserError(f"hidden-state cache dtype must be float16 or float32, got {dtype!r}")
    n, window = tokens.shape
    doc_windows = [1] * n if doc_windows is None else [int(c) for c in doc_windows]
    if sum(doc_windows) != n or min(doc_windows, default=1) < 1:
        raise ValueError(f"doc_windows {doc_windows} do not split {n} windows into documents")
    out_layer = backbone.hf.get_output_embeddings()
    width = out_layer.weight.shape[1]
    meta_path = directory / CACHE_META
    key = {"tokens_sha": _digest(tokens), "data": data, "window": window, "doc_windows": doc_windows,
           "trainable_blocks": int(trainable_blocks), "backbone": fingerprint, "dtype": dtype}
    meta = read_meta(directory) if meta_path.is_file() else None
    if meta is not None and any(meta.get(k) != key[k] for k in KEY_FIELDS):
        meta = None  # made for other contents: rebuilt

    def write_meta(m: dict) -> None:
        atomic_write(meta_path, lambda p: p.write_text(json.dumps(m)), root=directory, what="the cache's metadata")

    if meta is None:
        meta = {**key, "windows": n, "d_model": width, "done": 0, "static_nats": [], "sources": sources}
        if meta_path.is_file():
            meta_path.unlink()  # no metadata claims the files while they are rebuilt

        def save_tokens(p: Path) -> None:
            with open(p, "wb") as f:
                np.save(f, tokens)

        atomic_write(directory / "tokens.npy", save_tokens, root=directory, what="the cached tokens")
        hidden_path = refuse_links(directory, directory / "hidden.npy", "the cached hidden states")
        if hidden_path.exists():
            hidden_path.unlink()
        np.lib.format.open_memmap(hidden_path, mode="w+", dtype=np.dtype(dtype), shape=(n, window, width))
        write_meta(meta)
    hidden = open_hidden(directory, meta, mode="r+", check_finite_upto=meta["done"])
    computed = n - meta["done"]
    bar = Progress(n * window, "tok", desc="cache hidden states", enabled=progress)
    bar.update(meta["done"] * window)
    was_training = backbone.training
    backbone.eval()
    cast = getattr(torch, dtype)
    try:
        for i in range(meta["done"], n):
            x = torch.from_numpy(tokens[i : i + 1])
            h = blocks_input(backbone, x, trainable_blocks)[0].to(cast)
            if not torch.isfinite(h).all():
                raise UserError(f"the backbone's hidden states of window {i} are not finite in {dtype}"
                                + (" (they exceed float16's range)" if dtype == "float16" else "")
                                + f"; nothing past window {meta['done']} was cached in {directory}")
            hidden[i] = h.numpy()
            final = top_blocks(backbone, h.float()[None].to(out_layer.weight.dtype), trainable_blocks)
            logits = out_layer(final).float()
            meta["static_nats"].append(F.cross_entropy(logits[0, :-1], x[0, 1:]).item())
            if (i + 1) % 8 == 0 or i + 1 == n:  # the memmap first, then the count that says it is there
                hidden.flush()
                meta["done"] = i + 1
                write_meta(meta)
            bar.update(window)
    finally:
        del meta["static_nats"][meta["done"]:]  # the losses of windows whose states are not on disk yet
        backbone.train(was_training)
    bar.close()
    return {**meta, "computed_this_call": computed}


_META_KEYS = {"tokens_sha": str, "backbone": str, "dtype": str, "data": str, "windows": int, "window": int,
              "d_model": int, "done": int, "trainable_blocks": int, "doc_windows": list, "static_nats": list}


def read_meta(directory: Path) -> dict:
    """The cache's metadata, checked (one-line UserError when it is unreadable)."""
    path = directory / CACHE_META
    try:
        meta = json.loads(path.read_text())
        if not isinstance(meta, dict):
            raise ValueError("not an object")
        for k, kind in _META_KEYS.items():
            if not isinstance(meta.get(k), kind) or isinstance(meta.get(k), bool):
                raise ValueError(f"{k} missing or not {kind.__name__}")
        if meta["dtype"] not in ("float16", "float32") or not 0 <= meta["done"] <= meta["windows"]:
            raise ValueError("dtype or done out of range")
        counts = meta["doc_windows"]
        if not all(isinstance(c, int) and c >= 1 for c in counts) or sum(counts) != meta["windows"]:
            raise ValueError("doc_windows do not split the windows into documents")
        if len(meta["static_nats"]) != meta["done"] or not all(
                isinstance(v, float) and math.isfinite(v) for v in meta["static_nats"]):
            raise ValueError("static_nats is not one finite loss per cached window")
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise UserError(f"hidden-state cache {directory}: {CACHE_META} is unreadable ({e}); delete {directory} "
                        "to rebuild it") from None
    return meta


def open_hidden(directory: Path, meta: dict, mode: str = "r", check_finite_upto: int = 0) -> np.ndarray:
    """``hidden.npy`` of a cache, memory-mapped, checked against its metadata: a plain float16/float32 array of
    shape [windows, window, d_model] (an object array, another dtype or shape, a truncated file: one line), its
    first ``check_finite_upto`` windows finite (NaN or inf there: one line naming the window)."""
    path = directory / "hidden.npy"
    shape = (meta["windows"], meta["window"], meta["d_model"])
    why = None
    try:
        hidden = np.load(path, mmap_mode=mode, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        hidden, why = None, str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if hidden is not None and (hidden.dtype != np.dtype(meta["dtype"]) or hidden.shape != shape):
        why = f"it holds {hidden.dtype} {tuple(hidden.shape)}, the metadata says {meta['dtype']} {shape}"
    if why is not None:
        raise UserError(f"hidden-state cache {directory}: hidden.npy is not the cache its {CACHE_META} describes "
                        f"({why}); delete {directory} to rebuild it")
    for i in range(check_finite_upto):
        if not np.isfinite(hidden[i]).all():
            raise UserError(f"hidden-state cache {directory}: window {i} of hidden.npy holds NaN or infinite values "
                            f"(the file is corrupt); delete {directory} to rebuild it")
    return hidden


def load_cache(directory: str | Path) -> tuple[np.ndarray, np.ndarray, dict]:
    """``(hidden [windows, window, d_model] memory-mapped, tokens [windows, window], metadata)`` of a complete
    cache, every file checked against the metadata (the tokens' SHA-256, the hidden states' dtype, shape and
    finiteness): one line naming what is wrong otherwise. ``metadata["static_nats"][i]``: window i's static loss."""
    directory = Path(directory)
    if not (directory / CACHE_META).is_file():
        raise UserError(f"hidden-state cache {directory} holds no {CACHE_META}: not a cache")
    meta = read_meta(directory)
    if meta["done"] < meta["windows"]:
        raise UserError(f"hidden-state cache {directory} is incomplete ({meta['done']} of {meta['windows']} windows)")
    try:
        tokens = np.load(directory / "tokens.npy", allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise UserError(f"hidden-state cache {directory}: tokens.npy is unreadable ({str(e).splitlines()[0]}); "
                        f"delete {directory} to rebuild it") from None
    if tokens.dtype != np.int64 or tokens.shape != (meta["windows"], meta["window"]) or _digest(tokens) != meta["tokens_sha"]:
        raise UserError(f"hidden-state cache {directory}: tokens.npy is not the tokens its {CACHE_META} was made for; "
                        f"delete {directory} to rebuild it")
    return open_hidden(directory, meta, check_finite_upto=meta["windows"]), tokens, meta


def _digest(a: np.ndarray) -> str:
    import hashlib

    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def backbone_digest(backbone) -> str:
    """SHA-256 of every weight of the backbone (names, dtypes, shapes and bytes): the hidden states depend on all
    of them and on their precision, not only on the output layer ``fwl_head.backbone_fingerprint`` looks at."""
    from fastweights.hf.fwl_head import tensors_digest

    return tensors_digest(sorted(backbone.hf.state_dict().items()))
