"""What the commands that read a checkpoint share: their common flags, loading, the output prefix."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from fastweights.cli.types import nonneg_int
from fastweights.core.errors import UserError


def common_flags(p, several: bool = False) -> None:
    if several:
        p.add_argument("--checkpoint", action="append", required=True,
                       help="checkpoint directory; repeat to compare models on the same text")
    else:
        p.add_argument("--checkpoint", required=True, help="checkpoint directory")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=nonneg_int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument("--overwrite", action="store_true", help="replace the outputs of an earlier run at --out")


def set_threads(args):
    if getattr(args, "threads", 0):
        torch.set_num_threads(args.threads)


def load(path, device: str = "auto"):
    from fastweights.models.loading import load_checkpoint
    from fastweights.core.distributed import resolve_device

    return load_checkpoint(Path(path), map_location=str(resolve_device(device)))


def output_prefix(args, default: str) -> Path:
    """``--out`` as a path prefix (PREFIX.json, PREFIX.png), checked before any work: the outputs of an
    earlier run there are refused unless ``--overwrite``. Without ``--out`` (``eval --stream``), a fresh
    name ``DEFAULT-DATE-TIME``."""
    given = getattr(args, "out", None)
    out = Path(given or time.strftime(f"{default}-%Y%m%d-%H%M%S"))
    if not given:  # a fresh name, also for two runs within one second
        base, n = out, 2
        while out.with_suffix(".json").exists() or out.with_suffix(".png").exists():
            out, n = base.with_name(f"{base.name}-{n}"), n + 1
    taken = [p for p in (out.with_suffix(".json"), out.with_suffix(".png")) if p.exists()]
    if taken and not getattr(args, "overwrite", False):
        raise UserError(f"{taken[0]} exists (an earlier run); pass --overwrite or choose another --out")
    if out.parent.exists() and not out.parent.is_dir():
        raise UserError(f"--out {out}: {out.parent} is not a directory")
    return out


def describe(cfg) -> str:
    m = cfg.model
    mixers = sorted(set(m.layer_mixers or [m.mixer]))
    parts = ["+".join(mixers)]
    if m.memory:
        parts.append(f"{m.memory}@{','.join(str(i) for i in m.memory_layers)}")
    if m.head != "linear":
        parts.append(f"head {m.head}")
    return " | ".join(parts)
