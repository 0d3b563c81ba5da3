"""Per-token losses of ``dynamic eval --per-token PATH``: every prediction's static and dynamic NLL.

The file is JSON::

    {"unit": "nats", "documents": [{"tokens": n, "targets": [ids], "static": [n losses],
      "dynamic": [n losses]}, ...], "static_nll": total, "dynamic_nll": total, "settings": {...}}

``targets[i]`` is the token predicted at position ``i + 1`` of the document (its first token is
context only); ``sum(dynamic)`` over all documents is the run's total dynamic NLL (``static``
likewise), up to float rounding. With ``--cache-on-dynamic`` each document also has
``"dynamic_cache"`` losses, summing to ``"dynamic_cache_nll"``. Loss-against-position plots and
significance tests start here.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def per_token_record(docs: list[torch.Tensor], static: list[list[float]], dynamic: list[list[float]],
                     result: dict | None = None) -> dict:
    """The JSON-ready record; ``result`` (``adapt.evaluate.evaluate_static_and_dynamic``'s dict) contributes its settings."""
    if not (len(docs) == len(static) == len(dynamic)):
        raise ValueError("one static and one dynamic loss list per document are needed")
    out = []
    for d, s, y in zip(docs, static, dynamic):
        n = d.numel() - 1
        if len(s) != n or len(y) != n:
            raise ValueError(f"a document of {n} predictions has {len(s)} static and {len(y)} dynamic losses")
        out.append({"tokens": n, "targets": d[1:].tolist(), "static": s, "dynamic": y})
    rec = {"unit": "nats", "documents": out, "static_nll": sum(sum(s) for s in static),
           "dynamic_nll": sum(sum(y) for y in dynamic)}
    if result is not None:
        rec["settings"] = result.get("settings")
    return rec


def is_per_token_file(path: str | Path) -> bool:
    """Whether ``path`` holds a :func:`per_token_record` (a file ``--per-token`` may replace)."""
    try:
        rec = json.loads(Path(path).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(rec, dict) and rec.get("unit") == "nats" and isinstance(rec.get("documents"), list)


def write_per_token(path: str | Path, docs, static, dynamic, result: dict | None = None) -> Path:
    """Write :func:`per_token_record` to ``path`` (atomically); returns the path."""
    from fastweights.core.files import atomic_write

    path = Path(path)
    rec = per_token_record(docs, static, dynamic, result)
    atomic_write(path, lambda p: p.write_text(json.dumps(rec) + "\n"))
    return path
