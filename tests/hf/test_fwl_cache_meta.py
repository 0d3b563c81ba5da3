"""The hidden-state cache's description (``cache.json``) is read whole or refused in one line saying what is wrong
with it and what to do: every check of ``fwl_cache.read_meta``, each corruption's line to the letter."""

import json

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
