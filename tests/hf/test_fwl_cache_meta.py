"""The hidden-state cache's description (``cache.json``) is read whole or refused in one line saying what is wrong
with it and what to do: every check of ``fwl_cache.read_meta``, each corruption's line to the letter."""

import json

import numpy as np
import pytest

from fastweights.core.errors import UserError
from fastweights.hf.fwl_cache import CACHE_META, read_meta

GOOD = {"tokens_sha": "ab", "data": "mix:x", "window": 4, "doc_windows": [2, 1], "trainable_blocks": 0,
        "backbone": "m", "dtype": "float32", "windows": 3, "d_model": 8, "done": 2, "static_nats": [3.5, 3.25],
        "sources": ["x"]}


def _write(tmp_path, meta) -> None:
    (tmp_path / CACHE_META).write_text(json.dumps(meta) if not isinstance(meta, str) else meta)


def test_a_whole_description_is_read_as_written(tmp_path):
    _write(tmp_path, GOOD)
    assert read_meta(tmp_path) == GOOD
    complete = {**GOOD, "done": 3, "static_nats": [3.5, 3.25, 3.0]}  # every window cached; fp16 is a cache's dtype too
    _write(tmp_path, {**complete, "dtype": "float16"})
    assert read_meta(tmp_path) == {**complete, "dtype": "float16"}


@pytest.mark.parametrize("change, why", [
    (lambda m: "[1, 2]", "not an object"),
    (lambda m: "{", "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
    (lambda m: {k: v for k, v in m.items() if k != "window"}, "window missing or not int"),
    (lambda m: {**m, "windows": True}, "windows missing or not int"),
    (lambda m: {**m, "backbone": 3}, "backbone missing or not str"),
    (lambda m: {**m, "dtype": "bfloat16"}, "dtype or done out of range"),
    (lambda m: {**m, "done": 4}, "dtype or done out of range"),
    (lambda m: {**m, "done": -1}, "dtype or done out of range"),
    (lambda m: {**m, "doc_windows": [2, 2]}, "doc_windows do not split the windows into documents"),
    (lambda m: {**m, "doc_windows": [3, 0]}, "doc_windows do not split the windows into documents"),
    (lambda m: {**m, "static_nats": [3.5]}, "static_nats is not one finite loss per cached window"),
    (lambda m: {**m, "static_nats": [3.5, float("nan")]}, "static_nats is not one finite loss per cached window"),
    (lambda m: {**m, "static_nats": [3.5, 3]}, "static_nats is not one finite loss per cached window"),
], ids=["list", "truncated", "no-window", "bool-windows", "int-backbone", "dtype", "done-past", "done-negative",
        "doc-sum", "doc-empty", "nats-count", "nats-nan", "nats-int"])
def test_each_corruption_is_one_line_saying_what_and_how_to_rebuild(change, why, tmp_path):
    _write(tmp_path, change(dict(GOOD)))
    with pytest.raises(UserError) as e:
        read_meta(tmp_path)
    assert str(e.value) == (f"hidden-state cache {tmp_path}: {CACHE_META} is unreadable ({why}); delete {tmp_path} "
                            "to rebuild it")


def test_a_missing_description_says_so(tmp_path):
    with pytest.raises(UserError) as e:
        read_meta(tmp_path)
    assert str(e.value).startswith(f"hidden-state cache {tmp_path}: {CACHE_META} is unreadable ([Errno 2] No such "
                                   f"file or directory: '{tmp_path / CACHE_META}'); delete {tmp_path}")


def test_a_cache_with_nothing_cached_yet_is_read(tmp_path):
    """done = 0 (an interruption before the first eight windows were flushed) is a cache to continue."""
    _write(tmp_path, {**GOOD, "done": 0, "static_nats": []})
    assert read_meta(tmp_path)["done"] == 0


# ------------------------------------------------------------------ the cache's arrays (load_cache, open_hidden)


def _cache(tmp_path, windows=3, window=4, d=8, dtype="float16"):
    """A complete cache written by hand: tokens, hidden states, and the description that names them."""
    from fastweights.hf.fwl_cache import _digest

    tokens = np.arange(windows * window, dtype=np.int64).reshape(windows, window)
    hidden = np.lib.format.open_memmap(tmp_path / "hidden.npy", mode="w+", dtype=dtype, shape=(windows, window, d))
    hidden[:] = np.linspace(-1, 1, windows * window * d).reshape(windows, window, d)
    hidden.flush()
    np.save(tmp_path / "tokens.npy", tokens)
    meta = {**GOOD, "tokens_sha": _digest(tokens), "dtype": dtype, "windows": windows, "window": window, "d_model": d,
            "done": windows, "doc_windows": [windows], "static_nats": [3.0] * windows}
    _write(tmp_path, meta)
    return tokens, meta


def _refused(directory) -> str:
    from fastweights.hf.fwl_cache import load_cache

    with pytest.raises(UserError) as e:
        load_cache(directory)
    return str(e.value)


def test_a_complete_cache_loads_memory_mapped_read_only(tmp_path):
    from fastweights.hf.fwl_cache import load_cache, open_hidden

    tokens, meta = _cache(tmp_path)
    hidden, got_tokens, got_meta = load_cache(str(tmp_path))
    assert isinstance(hidden, np.memmap) and hidden.shape == (3, 4, 8) and hidden.dtype == np.float16
    assert not hidden.flags.writeable and np.array_equal(got_tokens, tokens) and got_meta == meta
    assert float(hidden[2, 3, 7]) == 1.0
    writable = open_hidden(tmp_path, meta, mode="r+")
    assert writable.flags.writeable  # the cache's writer opens it so


def test_each_broken_part_of_a_cache_is_one_line_naming_it(tmp_path):
    assert _refused(tmp_path) == f"hidden-state cache {tmp_path} holds no {CACHE_META}: not a cache"
    tokens, meta = _cache(tmp_path)
    _write(tmp_path, {**meta, "done": 2, "static_nats": [3.0, 3.0]})
    assert _refused(tmp_path) == f"hidden-state cache {tmp_path} is incomplete (2 of 3 windows)"
    _write(tmp_path, meta)
    rebuild = f"; delete {tmp_path} to rebuild it"
    # dtype, shape, content, and the same bytes in another shape (the digest alone would pass it)
    for bad in (tokens.astype(np.int32), tokens[:2], tokens + 1, tokens.reshape(4, 3)):
        np.save(tmp_path / "tokens.npy", bad)
        assert _refused(tmp_path) == (f"hidden-state cache {tmp_path}: tokens.npy is not the tokens its {CACHE_META} "
                                      f"was made for{rebuild}")
    (tmp_path / "tokens.npy").write_bytes(b"\x93NUMPY")  # truncated
    assert _refused(tmp_path).startswith(f"hidden-state cache {tmp_path}: tokens.npy is unreadable (")
    np.save(tmp_path / "tokens.npy", tokens)
    np.save(tmp_path / "hidden.npy", np.zeros((3, 4, 8), np.float32))  # another dtype
    assert _refused(tmp_path) == (f"hidden-state cache {tmp_path}: hidden.npy is not the cache its {CACHE_META} "
                                  "describes (it holds float32 (3, 4, 8), the metadata says float16 (3, 4, 8))"
                                  + rebuild)
    np.save(tmp_path / "hidden.npy", np.zeros((3, 4, 7), np.float16))  # another shape
    assert "it holds float16 (3, 4, 7), the metadata says float16 (3, 4, 8)" in _refused(tmp_path)
    (tmp_path / "hidden.npy").write_bytes(b"")  # empty: numpy's own words, or the error's name
    assert _refused(tmp_path).startswith(f"hidden-state cache {tmp_path}: hidden.npy is not the cache its "
                                         f"{CACHE_META} describes (")
    assert "\n" not in _refused(tmp_path)


def test_a_window_of_nan_is_named_and_only_the_windows_asked_for_are_read(tmp_path):
    from fastweights.hf.fwl_cache import open_hidden

    _, meta = _cache(tmp_path)
    hidden = np.load(tmp_path / "hidden.npy", mmap_mode="r+")
    hidden[1, 2, 3] = np.nan
    hidden.flush()
    assert _refused(tmp_path) == (f"hidden-state cache {tmp_path}: window 1 of hidden.npy holds NaN or infinite "
                                  f"values (the file is corrupt); delete {tmp_path} to rebuild it")
    assert open_hidden(tmp_path, meta, check_finite_upto=1).shape == (3, 4, 8)  # window 1 not checked
    assert open_hidden(tmp_path, meta).shape == (3, 4, 8)  # none checked by default


def test_the_backbones_digest_covers_every_weight():
    import types

    import torch

    from fastweights.hf.fwl_cache import backbone_digest
    from fastweights.hf.fwl_head import tensors_digest

    net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 2))
    backbone = types.SimpleNamespace(hf=net)
    digest = backbone_digest(backbone)
    assert digest == tensors_digest(sorted(net.state_dict().items())) and len(digest) == 64
    with torch.no_grad():
        net[0].bias[1] += 1e-3  # any weight, not only the output layer
    assert backbone_digest(backbone) != digest


class _Payload:
    """Unpickling this runs code: it writes the file it names."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_a_planted_pickle_in_the_tokens_is_refused_without_running(tmp_path):
    """tokens.npy replaced by an object array whose element unpickles into code: refused as unreadable, and the
    code never ran (numpy's allow_pickle stays off)."""
    _cache(tmp_path)
    planted = np.empty(1, dtype=object)
    planted[0] = _Payload(tmp_path / "ran")
    np.save(tmp_path / "tokens.npy", planted, allow_pickle=True)
    assert "tokens.npy is unreadable (" in _refused(tmp_path)
    assert not (tmp_path / "ran").exists()


def test_an_unreadable_file_is_named_with_the_first_line_of_the_error_or_its_kind(tmp_path, monkeypatch):
    from fastweights.hf import fwl_cache

    _, meta = _cache(tmp_path)
    real = np.load

    def failing(path, *a, **k):
        if str(path).endswith("tokens.npy"):
            raise ValueError("first line\nsecond line")
        if str(path).endswith("hidden.npy"):
            raise OSError()  # no words at all
        return real(path, *a, **k)

    monkeypatch.setattr(fwl_cache.np, "load", failing)
    assert _refused(tmp_path) == (f"hidden-state cache {tmp_path}: tokens.npy is unreadable (first line); delete "
                                  f"{tmp_path} to rebuild it")
    with pytest.raises(UserError) as e:
        fwl_cache.open_hidden(tmp_path, meta)
    assert str(e.value) == (f"hidden-state cache {tmp_path}: hidden.npy is not the cache its {CACHE_META} describes "
                            f"(OSError); delete {tmp_path} to rebuild it")
