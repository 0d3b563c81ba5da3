"""Search of the dynamic-evaluation learning rate and decay on validation text.

Krause et al. (2018) tune dynamic evaluation after training, on validation data, before anything
else: one dynamic pass per setting, which is cheap, and a small subset of the validation text
suffices. The learning rate matters "by far the most". Two modes:

- a grid (``lrs`` x ``decays``; ``official_grid`` gives ``dynamiceval.py --grid``): as there, the
  decay lambda is the outer loop and every run starts from the trained weights theta_g;
- the default automatic search: coarse log-spaced learning rates until the loss turns up, a finer
  look around the best, then the decay (see :func:`tune_dynamic`).

Unlike the official grid, RMS_norm is recomputed (and clipped at 1/lambda) for every setting
instead of being clipped in place.

Never tune on the text you report: pass validation documents (pitfall 1 of the spec).

A search never chooses a point that does not beat static evaluation: a point whose loss is not finite or
more than :data:`DIVERGED_MARGIN` above static's is marked ``diverged`` (its ``status``), one at most that much
worse ``worse than static``, and the best is the lowest loss among the points below static's; when none is,
the search is a ``UserError`` (nothing is saved, so ``dynamic eval`` never uses a setting that hurts).

A search cut short continues (``points_file``): every finished point is written there at once, with what the search
scores (the evaluator's settings, the documents, the grid asked for, static's loss); a later search of the same
kind takes those points instead of scoring them again, and the file goes once the search ends.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Callable, Sequence

from fastweights.adapt.dynamic import DynamicEvaluator
from fastweights.adapt.update_rules import DEFAULT_DECAY, canonical_rule
from fastweights.core.errors import UserError

# dynamiceval.py --grid: lr x lambda, both scaled by segment_len / 5 (its bptt / 5)
OFFICIAL_LRS = (3e-5, 4e-5, 5e-5, 6e-5, 7e-5, 1e-4)
OFFICIAL_DECAYS = (0.001, 0.002, 0.003, 0.005)
# the automatic search: a coarse log grid of learning rates, then a finer look around the best one,
# then the decay. The official grid is tuned for one AWD-LSTM; other models' best lr can lie an
# order of magnitude away (pitfall 3), so the search brackets it first.
COARSE_LRS = (1e-6, 3e-6, 1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
LR_REFINE = (0.5, 0.7, 1.4, 2.0)
DECAY_FACTORS = (0.0, 0.1, 0.25, 0.5, 2.0, 4.0)  # 0: no prior at all
TUNED_FILE = "dynamic_tuned.json"
DIVERGED_MARGIN = 0.05  # a point's loss this fraction above static's (nats): diverged, not a near miss
TUNE_CHARS = 5000  # validation characters a search reads by default: minutes on a CPU for a first run (issue 49)


def point_status(loss: float, static: float) -> str:
    """``ok`` (below static), ``worse than static`` (by at most :data:`DIVERGED_MARGIN`) or ``diverged``."""
    if not math.isfinite(loss) or loss > static * (1 + DIVERGED_MARGIN):
        return "diverged"
    return "ok" if loss < static else "worse than static"


def official_grid(segment_len: int) -> tuple[list[float], list[float]]:
    """The official grid, scaled by segment_len / 5 as ``dynamiceval.py`` does."""
    s = segment_len / 5
    return [lr * s for lr in OFFICIAL_LRS], [d * s for d in OFFICIAL_DECAYS]


def tune_dynamic(make_evaluator: Callable[[float, float], DynamicEvaluator], documents: Sequence,
                 lrs: Sequence[float] | None = None, decays: Sequence[float] | None = None,
                 reset: str = "per_document", progress: bool = False, points_file: str | Path | None = None) -> dict:
    """Score ``documents`` (validation token sequences) statically, then dynamically per setting.

    ``make_evaluator(lr, decay)`` builds a fresh evaluator (every run starts from theta_g).
    With ``lrs`` given: the grid ``decays x lrs`` (decay the outer loop; ``decays`` defaults to the
    official middle value 0.002 * segment_len / 5). Without: an automatic search at that decay (or
    ``decays[0]``): the learning rates of :data:`COARSE_LRS` in increasing order, stopping once a
    run is worse than both static evaluation and the previous learning rate (larger ones only
    diverge further), then the best lr times :data:`LR_REFINE`, then, for rules with a prior, the
    decay times :data:`DECAY_FACTORS`. Rules without a prior use decay 0.

    Returns {"static": {...}, "grid": [{"lr", "decay", "loss_nats", "bits_per_token",
    "relative_improvement", "stage", "status"}, ...] in run order, "best": the entry with the lowest loss
    among those below static's, "tokens", "settings", "reset"}. A run with a non-finite loss counts as infinite
    loss; :func:`point_status` marks each point. UserError when no point beats static. ``points_file``: where
    finished points are kept while the search runs (an earlier search's points there are taken when it searched the
    same thing, see the module docstring); removed at the end.
    """
    probe = make_evaluator(lrs[0] if lrs else COARSE_LRS[0], 0.0)
    has_prior = canonical_rule(probe.rule) not in ("sgd", "rms")
    d0 = DEFAULT_DECAY * probe.segment_len / 5
    if not has_prior:
        decays = [0.0]
    elif decays is not None and not decays:
        raise UserError("the tuning grid needs at least one decay")
    if lrs:
        planned = len({_point_key(lr, d) for d in (decays or [d0]) for lr in lrs})
    else:  # an upper bound until the coarse stage stops (see _SearchBar)
        planned = len(COARSE_LRS) + len(LR_REFINE) + (len(DECAY_FACTORS) if has_prior else 0)
    bar = _SearchBar(sum(max(0, len(d) - 1) for d in documents), planned, exact=bool(lrs), enabled=progress)
    static_nll, tokens = 0.0, 0
    for d in documents:
        if len(d) > 1:
            r = probe.static(d, keep_token_losses=False, progress=bar.bar)
            static_nll += r.nll
            tokens += r.tokens
    if tokens == 0:
        bar.close()
        raise UserError("the validation text has no tokens to score")
    static = static_nll / tokens
    grid: list[dict] = []
    done: dict[tuple, dict] = {}
    journal = _PointsFile(points_file, probe.metadata(), documents, reset, lrs, decays, static)
    if journal.earlier:
        print(f"dynamic tune: continuing a search cut short: {len(journal.earlier)} setting(s) it scored are taken "
              f"from {journal.path}", file=sys.stderr)

    def run(lr: float, decay: float, stage: str) -> float:
        key = _point_key(lr, decay)
        if key not in done and key in journal.earlier:  # scored by a search that was cut short
            done[key] = {**journal.earlier[key], "stage": stage}
            grid.append(done[key])
        if key not in done:
            bar.point(len(grid) + 1, stage, key[0], key[1])
            with bar.bar.adopting():  # the evaluator's own bar counts toward the search's line
                r = make_evaluator(key[0], key[1]).evaluate_documents(documents, reset=reset, progress=False)
            loss = r.nll / r.tokens
            loss = loss if math.isfinite(loss) else math.inf
            done[key] = {"lr": key[0], "decay": key[1], "loss_nats": loss, "bits_per_token": loss / math.log(2),
                         "relative_improvement": 1 - loss / static, "stage": stage,
                         "status": point_status(loss, static)}
            grid.append(done[key])
            journal.write(grid)
        return done[key]["loss_nats"]

    def best() -> dict:
        """The lowest loss so far (the next stage centres on it; at the end it must be below static's)."""
        return min(grid, key=lambda g: g["loss_nats"])

    if lrs:
        for decay in (decays or [d0]):  # lambda outer, as the official grid
            for lr in lrs:
                run(lr, decay, "grid")
    else:
        decay = decays[0] if decays else d0
        prev = math.inf
        for lr in COARSE_LRS:
            loss = run(lr, decay, "coarse lr")
            if loss > static and loss > prev:
                break
            prev = loss
        lr_best = best()["lr"]
        fine = [lr_best * f for f in LR_REFINE]
        bar.plan(len(grid) + len({_point_key(lr, decay) for lr in fine} - set(done))
                 + (len(DECAY_FACTORS) if has_prior else 0), exact=not has_prior)
        for lr in fine:
            run(lr, decay, "fine lr")
        if has_prior:
            lr_best = best()["lr"]
            factors = [f for f in DECAY_FACTORS
                       # a uniform decay above 1 overshoots theta_g
                       if canonical_rule(probe.rule) == "rms-global-prior" or decay * f <= 1]
            bar.plan(len(grid) + len({_point_key(lr_best, decay * f) for f in factors} - set(done)), exact=True)
            for f in factors:
                run(lr_best, decay * f, "decay")
    bar.close()
    journal.remove()
    if best()["status"] != "ok":
        b = best()
        raise UserError(f"dynamic tune: none of the {len(grid)} settings tried beats static evaluation on the "
                        f"validation text (static {static / math.log(2):.4f} bits/token, the best lr {b['lr']:.3g} "
                        f"decay {b['decay']:.3g}: {b['bits_per_token']:.4f}, {b['status']}); nothing saved: try "
                        "other --lrs, another rule or more validation text")
    return {"static": {"loss_nats": static, "bits_per_token": static / math.log(2)}, "grid": grid, "best": best(),
            "tokens": tokens, "settings": probe.metadata() | {"lr": None, "decay": None}, "reset": reset}


class _PointsFile:
    """The finished points of a search, kept in a JSON file while it runs (None: not kept). ``earlier``: point key ->
    entry, from a file written by a search of the same settings, documents, reset, grid and static loss."""

    def __init__(self, path: str | Path | None, settings: dict, documents: Sequence, reset: str, lrs, decays,
                 static: float):
        self.path = Path(path) if path is not None else None
        digest = hashlib.sha256()
        for d in documents:
            digest.update(json.dumps([int(t) for t in d]).encode())
        self.key = {"settings": settings, "documents_sha256": digest.hexdigest(), "reset": reset,
                    "lrs": list(lrs) if lrs else None, "decays": list(decays) if decays else None, "static": static}
        self.earlier: dict[tuple, dict] = {}
        if self.path is None or not self.path.is_file():
            return
        try:
            doc = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return  # not ours or cut mid-write: scored again, then replaced
        if isinstance(doc, dict) and doc.get("search") == json.loads(json.dumps(self.key)):
            self.earlier = {_point_key(g["lr"], g["decay"]): g for g in doc.get("points", [])}

    def write(self, grid: list[dict]) -> None:
        if self.path is None:
            return
        from fastweights.core.files import atomic_write

        doc = {"search": self.key, "points": [{k: v for k, v in g.items() if k != "stage"} for g in grid]}
        atomic_write(self.path, lambda p: p.write_text(json.dumps(doc)))

    def remove(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def points_file_of(tuned: str | Path) -> Path:
    """Where a search whose result goes to ``tuned`` keeps its finished points while it runs."""
    tuned = Path(tuned)
    return tuned.with_name(tuned.stem + ".points.json")


def _point_key(lr: float, decay: float) -> tuple[float, float]:
    """A grid point as the search keys it (6 significant digits: the same point is never run twice)."""
    return float(f"{lr:.6g}"), float(f"{decay:.6g}")


class _SearchBar:
    """The search's one progress line: the point being run (``point 3/12``, ``<=21`` while the automatic
    search may still stop early) and tokens over the static pass plus every planned point, so the ETA
    covers the whole search."""

    def __init__(self, tokens: int, points: int, exact: bool, enabled: bool):
        from fastweights.core.progress import Progress

        self.tokens, self.points, self.exact = tokens, points, exact
        self.bar = Progress(tokens * (1 + points), "tok", desc="dynamic tune: static pass", enabled=enabled)
        self.bar.approximate = not exact

    def plan(self, points: int, exact: bool) -> None:
        self.points, self.exact = points, exact
        self.bar.total, self.bar.approximate = self.tokens * (1 + points), not exact

    def point(self, k: int, stage: str, lr: float, decay: float) -> None:
        n = f"{self.points}" if self.exact else f"<={self.points}"
        self.bar.desc = f"dynamic tune: point {k}/{n} ({stage}, lr {lr:.3g}, decay {decay:.3g})"

    def close(self) -> None:
        self.bar.close()


def format_table(result: dict) -> str:
    """The grid as text: one row per decay, one column per learning rate, bits per token (best starred, diverged
    points marked !)."""
    lrs = sorted({g["lr"] for g in result["grid"]})
    decays = sorted({g["decay"] for g in result["grid"]})
    cell = {(g["decay"], g["lr"]): g["bits_per_token"] for g in result["grid"]}
    status = {(g["decay"], g["lr"]): g.get("status") for g in result["grid"]}
    best = (result["best"]["decay"], result["best"]["lr"])
    lines = [f"static: {result['static']['bits_per_token']:.4f} bits/token over {result['tokens']} tokens; "
             "dynamic bits/token per setting:",
             "decay \\ lr " + "".join(f"{lr:>11.3g}" for lr in lrs)]
    for d in decays:
        row = f"{d:<11.3g}"
        for lr in lrs:
            v = cell.get((d, lr))
            mark = "*" if (d, lr) == best else "!" if status.get((d, lr)) == "diverged" else " "
            row += (f"{v:>10.4f}" if v is not None else f"{'-':>10}") + mark
        lines.append(row)
    if "diverged" in status.values():
        lines.append(f"! diverged: a loss not finite or more than {100 * DIVERGED_MARGIN:g}% above static's")
    b = result["best"]
    lines.append(f"best: lr {b['lr']:.3g}, decay {b['decay']:.3g}: {b['bits_per_token']:.4f} bits/token "
                 f"({100 * b['relative_improvement']:.2f}% lower than static)")
    return "\n".join(lines)


def save_tuned(result: dict, path: str | Path, weights_sha256: str | None = None) -> Path:
    """Write the tuning result (best setting first) as JSON; ``dynamic eval --tuned FILE`` reads it.

    ``weights_sha256``: the fingerprint of the weights it was tuned for (a checkpoint's), so that the
    file is refused for other weights.
    """
    from fastweights.core.files import atomic_write

    path = Path(path)
    payload = {"best": result["best"], "rule": result["settings"]["rule"], "settings": result["settings"],
               "static": result["static"], "tokens": result["tokens"], "grid": result["grid"]}
    if weights_sha256 is not None:
        payload["weights_sha256"] = weights_sha256
    atomic_write(path, lambda p: p.write_text(json.dumps(payload, indent=2) + "\n"))
    return path


def is_tuned_file(path: str | Path) -> bool:
    """Whether ``path`` is a file :func:`save_tuned` wrote (``dynamic tune --save`` may replace it)."""
    try:
        return load_tuned(path) is not None
    except UserError:
        return False


def load_tuned(path: str | Path) -> dict | None:
    """The JSON written by :func:`save_tuned`, or None if there is none; UserError if it is not one.

    The file is data only (JSON, nothing is executed); its fields are checked: a finite lr and decay
    >= 0, a rule name, a settings table, a 64-hex-digit weights fingerprint when present.
    """
    path = Path(path)
    if not path.is_file():
        return None
    try:
        d = json.loads(path.read_text())
        best, settings = d["best"], d["settings"]
        for key in ("lr", "decay"):
            v = best[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"best.{key} is {v!r}, not a finite number >= 0")
        if not isinstance(d["rule"], str) or not isinstance(settings, dict):
            raise ValueError("rule must be a name and settings a table")
        fp = d.get("weights_sha256")
        if fp is not None and not (isinstance(fp, str) and len(fp) == 64 and all(c in "0123456789abcdef" for c in fp)):
            raise ValueError("weights_sha256 is not a SHA-256")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: unreadable tuning result ({e})") from None
    except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
        raise UserError(f"{path} is not a tuning result written by `fastweights dynamic tune` ({e})") from None
    return d
