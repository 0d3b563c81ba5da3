"""What the commands that read a checkpoint share: their common flags, loading, the output prefix."""

from __future__ import annotations

import time
from pathlib import Path


from fastweights.cli.types import nonneg_int
from fastweights.core.errors import UserError
from fastweights.core.threads import WORK





def device_flag(p, default: str = "auto") -> None:
    p.add_argument("--device", default=default, help="where the model runs: auto (CUDA when available, else the "
                                                     "CPU), cpu, cuda or cuda:N")


def threads_flag(p, work: str = "scoring") -> None:
    """``--threads N`` of a command whose kind of work (``core.threads.WORK``) is ``work``; the command line
    sets it once (:func:`fastweights.core.threads.use_threads`) before the command runs."""
    p.add_argument("--threads", type=nonneg_int, default=0,
                   help=f"torch CPU threads (0: OMP_NUM_THREADS when set, else {WORK[work]}; "
                        "docs/language-model.md#threads)")
    p.set_defaults(thread_work=work)


def common_flags(p, several: bool = False) -> None:
    if several:
        p.add_argument("--checkpoint", action="append", required=True,
                       help="checkpoint directory; repeat to compare models on the same text")
    else:
        p.add_argument("--checkpoint", required=True, help="checkpoint directory")
    device_flag(p)
    threads_flag(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument("--overwrite", action="store_true", help="replace the outputs of an earlier run in --out")


def out_flag(p, default: str | None, writes: str, optional: bool = False) -> None:
    """``--out DIR``: the one meaning of --out in every command, the directory it writes into (created).
    ``optional``: without it nothing is written."""
    where = "" if default else " (default: not written)" if optional else " (default: a new runs/NAME-DATE-TIME)"
    p.add_argument("--out", metavar="DIR", default=default,
                   help=f"directory to write {writes} into (created if missing){where}")


def load(path, device: str = "auto"):
    from fastweights.models.loading import load_checkpoint
    from fastweights.core.distributed import resolve_device

    return load_checkpoint(Path(path), map_location=str(resolve_device(device)))


def output_prefix(args, stem: str) -> Path:
    """``--out DIR`` (the directory a command writes into) joined with the command's file stem: the outputs
    are ``DIR/STEM.json`` and ``DIR/STEM.png``, checked before any work: an earlier run's outputs there are
    refused unless ``--overwrite``. Without ``--out`` a fresh directory ``runs/STEM-DATE-TIME``."""
    given = getattr(args, "out", None)
    if given:
        directory = Path(given)
    else:  # a fresh directory, also for two runs within one second
        base = Path(time.strftime(f"runs/{stem}-%Y%m%d-%H%M%S"))
        directory, n = base, 2
        while directory.exists():
            directory, n = base.with_name(f"{base.name}-{n}"), n + 1
    if directory.exists() and not directory.is_dir():
        raise UserError(f"--out {directory} is a file; --out names the directory to write into")
    out = directory / stem
    from fastweights.core.files import refuse_links

    for p in (out.with_suffix(".json"), out.with_suffix(".png")):  # replaced by rename: refused, not followed
        refuse_links(directory, p, "the results")
    taken = [p for p in (out.with_suffix(".json"), out.with_suffix(".png")) if p.exists()]
    if taken and not getattr(args, "overwrite", False):
        raise UserError(f"{taken[0]} exists (an earlier run); pass --overwrite or choose another --out")
    return out


def change(new: float, old: float, versus: str = "") -> str:
    """A loss ``new`` against ``old`` in words, the sign never left to the reader: "3.10% lower" or
    "5.48% higher (worse)" (with ``versus``: "3.10% lower than static", "5.48% higher than static (worse)")."""
    than = f" than {versus}" if versus else ""
    if old <= 0 or new == old:
        return f"no change from {versus}" if versus else "no change"
    rel = 100 * (new - old) / old
    return f"{-rel:.2f}% lower{than}" if rel < 0 else f"{rel:.2f}% higher{than} (worse)"


def describe(cfg) -> str:
    m = cfg.model
    mixers = sorted(set(m.layer_mixers or [m.mixer]))
    parts = ["+".join(mixers)]
    if m.memory:
        parts.append(f"{m.memory}@{','.join(str(i) for i in m.memory_layers)}")
    if m.head != "linear":
        parts.append(f"head {m.head}")
    return " | ".join(parts)
