"""The GPU queue (issue 42): the pending GPU measurements in order of value, as many run as fit the minutes left.

    python benchmarks/gpu/gpu_queue.py --list                          # the items, estimates, what is pending
    python benchmarks/gpu/gpu_queue.py --minutes 9 --out $OUT          # on a lent GPU: the first command, one call
    python benchmarks/gpu/gpu_queue.py --device cpu --tiny --out DIR   # dry run: tiny shapes, stand-in fla, seconds
    python benchmarks/gpu/gpu_queue.py --unpack DIR/gpu_queue.json     # a device run's items into benchmarks/results/

(Named ``gpu_queue.py``, not ``queue.py``: run as a script its folder comes first on ``sys.path``, and a
``queue.py`` there would shadow the standard library's ``queue`` that torch imports.)

Order of value (``ITEMS``): scope 2's gradient checks first (a kernel that trains wrong makes every timing
of it worthless), then scope 3's like-for-like ratios against their bars, then scope 4's open
measurements, then scope 5's FWL recipe. An item is pending until its result file
``benchmarks/results/gpu_queue_<item>.json`` holds a completed run on a GPU; ``--all`` runs done items
again, ``--items`` picks items by glob. Each item has an estimate in minutes (fla's Triton autotuning
costs 80-100 s per kernel family on first use, inductor 17-30 s per compiled shape: the recorded
cuda_scale runs on one H100); an item runs when the minutes spent plus its estimate fit ``--minutes``,
else it is left pending and the next one is tried. Each item is timed, and its JSON written as soon as it
finishes; an item that raises is recorded with its error and the queue goes on.

The default ``--minutes 9`` fits one device command (at most 10 minutes; a 15-minute lease less the
machine's start and the transfers leaves about 11, the rest for a second, short call). An item that
overruns its estimate can be cut off by the command's limit: what finished before it is already written.

``--out DIR`` (a device run's $OUT) writes there instead of benchmarks/results/: the summary
``gpu_queue.json`` (rewritten after every item, holding every item's record in full) and the first
``MAX_ITEM_FILES`` item files (a device run returns at most 8 files); ``--unpack`` writes a summary's items
into benchmarks/results/. The measurements reuse ``cuda_scale.py``'s item functions (inputs, fla's raw
kernels, our op and layers, the models, the FwPKM layers, fla's guard bypass for timing); what each item
measures is in its sibling ``gpu_measurements.py``.

Exit status 2 with one line on stderr for bad arguments (or ``--device cuda`` without CUDA); 0 otherwise,
failed items included (they are in the JSON and in the pending list).
"""

from __future__ import annotations

import fnmatch
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import cuda_scale as cs  # its sibling benchmarks/gpu/cuda_scale.py, on sys.path as the script's folder
from gpu_measurements import (  # its sibling benchmarks/gpu/gpu_measurements.py: what each item measures
    TINY_LENGTHS, Ctx, NotWritten, delta_op, dispatch_choices, fwl_recipe, fwp_layer, fwpkm, gdn_chunks, gdn_layer,
    gdn_layer_selfcheck, grad_check, hybrid, hybrid_selfcheck)
import torch

from fastweights.core.errors import UserError
from fastweights.evidence.result_files import command_line, repo_relative
from fastweights.experiments.fla_comparison import install_fla_standin
from fastweights.cli.script_parser import ScriptParser
from fastweights.ops import fla_backend as fb

NAME = "gpu_queue"
MAX_ITEM_FILES = 7  # + the summary: a device run returns at most 8 files
# the checkout this script is in (issue 52: --unpack wrote into the installed package's checkout instead)
REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"


@dataclass
class Item:
    id: str
    scope: int
    minutes: float  # estimate on one H100, cold process
    what: str
    run: Callable[["Ctx"], dict] = field(repr=False)

    @property
    def slug(self) -> str:
        return self.id.replace("/", "_")


# ----------------------------------------------------------------------------- the queue, in order of value


ITEMS = [
    Item("grad/dispatch", 2, 0.3, "what auto picks here: the fla kernels and chunk sizes the checks below cover",
         dispatch_choices),
    Item("grad/delta_c32", 2, 2.5, "fla's ungated backward at chunk 32 (what auto trained through on Hopper with "
         "Triton >= 3.4 before grad/delta_c64 was measured) vs our fp32 reference, T=8192",
         lambda c: grad_check(c, False, 32)),
    Item("grad/delta_c64", 2, 2.0, "fla's ungated backward at its default chunk 64 (what auto trains through; fla "
         "issue 984 reports dk, dbeta wrong on Hopper before fla 0.6.0) vs our fp32 reference, T=8192",
         lambda c: grad_check(c, False, None)),
    Item("grad/gated_c64", 2, 2.5, "fla's gated backward (guard bypassed where fla refuses it) vs our fp32 "
         "reference, T=8192: does fla issue 640 bite at our shapes", lambda c: grad_check(c, True, None)),
    Item("like/delta_op_T8192", 3, 2.0, "delta-rule op (auto; fed bf16 as the raw kernel, and fp32 as fwp feeds it) "
         "over fla's raw kernel, state in and out, bar 1.15",
         lambda c: delta_op(c, 1)),
    Item("like/gdn_layer_T8192", 3, 2.5, "gdn layer (auto, and forced onto fla's kernel) over fla's GatedDeltaNet "
         "layer, bar 1.15", lambda c: gdn_layer(c, 1)),
    Item("like/hybrid", 3, 3.0, "our hybrid on fla's kernels over fla's GatedDeltaNetForCausalLM, 115M, T=4096, "
         "bar 1.1", hybrid),
    Item("like/gdn_chunk64_vs_32", 3, 1.2, "gdn layer at chunk 64 vs 32 (auto), T=8192", gdn_chunks),
    Item("grad/gated_c64_T2048", 3, 0.8, "the bypassed gated kernel's gradients at T=2048",
         lambda c: grad_check(c, True, None, 0)),
    Item("grad/gated_c64_T32768", 3, 1.0, "the bypassed gated kernel's gradients at T=32768",
         lambda c: grad_check(c, True, None, 2)),
    Item("like/delta_op_T2048", 3, 1.0, "delta-rule op over fla's raw kernel at T=2048", lambda c: delta_op(c, 0)),
    Item("like/delta_op_T32768", 3, 1.5, "delta-rule op over fla's raw kernel at T=32768", lambda c: delta_op(c, 2)),
    Item("like/gdn_layer_T2048", 3, 1.5, "gdn layer over fla's layer at T=2048", lambda c: gdn_layer(c, 0)),
    Item("like/gdn_layer_T32768", 3, 2.0, "gdn layer over fla's layer at T=32768", lambda c: gdn_layer(c, 2)),
    Item("like/gdn_auto_selfcheck", 3, 3.0, "issue 51: gdn layer on auto after the gradient self-check of "
         "fla's gated backward (its verdict recorded) over fla's layer, T=8192, bar 1.1", gdn_layer_selfcheck),
    Item("like/hybrid_auto_selfcheck", 3, 2.5, "issue 51: our hybrid on auto after the self-check, with the loss "
         "without logits (ops.linear_cross_entropy) and the recomputing SwiGLU, gdn norm-and-gate and convolution, "
         "over fla's GatedDeltaNetForCausalLM, 115M, T=4096, bars 1.1 time, 1.2 peak", hybrid_selfcheck),
    Item("open/fwp_layer", 4, 1.0, "fwp layer (DPFP, delta rule) over fla's raw delta kernel, T=8192", fwp_layer),
    Item("open/fwpkm_vs_lucidrains", 4, 0.7, "FwPKM layer vs lucidrains' fwPKM, fp32, d_model 768, 512^2 slots, "
         "top-8, 1 head, chunk 512, T=1,024, time and peak memory", fwpkm),
    Item("fwl/smollm2_recipe", 5, 8.0, "issue 41's FWL GPU recipe (SmolLM2-135M, FWL head and top blocks "
         "fine-tuned, about 8 minutes; the model file travels in two calls)", fwl_recipe),
]


def result_path(item: Item, folder: Path | None = None) -> Path:
    return (RESULTS if folder is None else folder) / f"{NAME}_{item.slug}.json"


def done(item: Item, folder: Path | None = None) -> bool:
    """Measured: a completed run of the item on a GPU is in the results (benchmarks/results/ by default)."""
    try:
        rec = json.loads(result_path(item, folder).read_text())
    except (OSError, ValueError):
        return False
    return rec.get("status") in ("ok", "partial") and not rec.get("tiny") and rec.get("device_type") == "cuda"


def plan(items: list[Item], minutes: float, spent: float = 0.0) -> list[tuple[Item, bool]]:
    """Each item with whether it fits by estimate, in order, greedily (an item that does not fit is skipped
    and the next one tried)."""
    out, used = [], spent
    for item in items:
        fits = used + item.minutes <= minutes
        used += item.minutes if fits else 0
        out.append((item, fits))
    return out


# ----------------------------------------------------------------------------- running


def parse_args(argv):
    p = ScriptParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --tiny: the dry run)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (the dry run)")
    p.add_argument("--minutes", type=float, default=9.0,
                   help="minutes this run may take (default 9: one device command runs at most 10 minutes, and a "
                        "15-minute lease less start-up and transfers leaves about 11)")
    p.add_argument("--out", help="write the item files and the summary gpu_queue.json here (a device run's $OUT)")
    p.add_argument("--items", help="comma-separated globs over item ids (e.g. 'grad/*,like/hybrid')")
    p.add_argument("--all", action="store_true", help="also run items already measured on a GPU")
    p.add_argument("--list", action="store_true", help="only list the items, their estimates and what is pending")
    p.add_argument("--unpack", metavar="SUMMARY", help="write a device run's summary items into benchmarks/results/")
    p.add_argument("--fail", default="", help="comma-separated item ids made to raise (tests the failure path)")
    a = p.parse_args(argv)
    if a.unpack or a.list:
        return a
    try:
        a.device = torch.device(a.device)
    except RuntimeError:
        raise UserError(f"--device {a.device!r} is not a device name") from None
    if a.device.type not in ("cuda", "cpu"):
        raise UserError(f"--device {a.device} is not supported: choose cuda or cpu")
    if a.device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: torch sees no CUDA device here (use --device cpu --tiny for the dry run)")
    if a.device.type == "cpu" and not a.tiny:
        raise UserError("--device cpu runs the dry run only: add --tiny")
    if not a.minutes > 0:
        raise UserError("--minutes must be > 0")
    return a


def select(items: list[Item], globs: str | None) -> list[Item]:
    if not globs:
        return list(items)
    chosen = []
    for g in (g.strip() for g in globs.split(",") if g.strip()):
        matched = [i for i in items if fnmatch.fnmatch(i.id, g) and i not in chosen]
        if not matched and not any(fnmatch.fnmatch(i.id, g) for i in items):
            raise UserError(f"--items {g!r} matches no item (see --list)")
        chosen += matched
    return chosen


def print_list(items: list[Item], minutes: float) -> None:
    print(f"GPU queue: {len(items)} items in order of value; estimates in minutes on one H100; "
          f"fits = within --minutes {minutes:g} by estimate")
    for item, fits in plan([i for i in items if not done(i)], minutes):
        print(f"  pending  {item.id:28s} scope {item.scope}  ~{item.minutes:4.1f} min  "
              f"{'fits' if fits else '    '}  {item.what}")
    for item in items:
        if done(item):
            print(f"  done     {item.id:28s} scope {item.scope}  {repo_relative(result_path(item))}")


def unpack(summary: str) -> int:
    """A device run's summary items into this checkout's benchmarks/results/: every item checked first (a known id,
    measured on CUDA at full size: a dry run is no result), then written; bad input one line, exit 2."""
    try:
        rec = json.loads(Path(summary).read_text())
        items = {k: v for k, v in rec["items"].items() if "status" in v and v["status"] != "not_written"}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        print(f"gpu_queue: --unpack {summary}: not a device run's summary ({e})", file=sys.stderr)
        return 2
    known = {i.id for i in ITEMS}
    for item_id, item_rec in items.items():
        device, tiny = item_rec.get("device_type", rec.get("device_type")), item_rec.get("tiny", rec.get("tiny"))
        why = ("an item this queue does not have" if item_id not in known else
               f"measured on {device!r}, not CUDA (a dry run)" if device != "cuda" else
               "a tiny dry run" if tiny is not False else None)
        if why:
            print(f"gpu_queue: --unpack {summary}: {item_id!r} is {why}; nothing written", file=sys.stderr)
            return 2
    for item_id, item_rec in items.items():
        path = RESULTS / f"{NAME}_{item_id.replace('/', '_')}.json"
        write(path, {**item_rec, "result_file": repo_relative(path)})
    return 0


def write(path: Path, rec: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rec, indent=2, default=str) + "\n")
    tmp.replace(path)


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code the queue measures: cuda_scale's (the delta rules, gdn, attention, FwPKM)."""
    return cs.probe_specs(probes)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        a = parse_args(argv)
        items = select(ITEMS, a.items)
    except UserError as e:
        print(f"gpu_queue: {e}", file=sys.stderr)
        return 2
    if a.unpack:
        return unpack(a.unpack)
    if a.list:
        print_list(items, a.minutes)
        return 0
    start = time.perf_counter()
    device, tiny = a.device, a.tiny
    cfg = dict(cs.TINY, kernel_lengths=TINY_LENGTHS) if tiny else dict(cs.FULL)
    notes = []
    if device.type == "cpu":  # the dry run traces the compiled form without inductor's C++ build
        sys.modules["fastweights.ops.delta_rule"].COMPILE_OPTIONS = {"backend": "aot_eager"}
        if not fb.fla_available():
            notes.append(install_fla_standin())
    standin_flash = cs.install_flash_attn_standin()
    if standin_flash:
        notes.append(standin_flash)
    log = cs.BackendLog()
    logging.getLogger("fastweights.ops.delta_rule").addHandler(log)
    logging.getLogger("fastweights.ops.delta_rule").setLevel(logging.INFO)
    fla_ok = fb.fla_available()
    refuses = fla_ok and fb.fla_refuses_gated_backward(device)
    ctx = Ctx(device, tiny, cfg, fla_ok, refuses, log, fail={f.strip() for f in a.fail.split(",") if f.strip()})
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    info = cs.fla_info()
    print(f"gpu_queue on {name} (torch {torch.__version__}, {info}); fla refuses the gated backward here: {refuses}",
          flush=True)
    prov = cs.provenance_record(argv)
    out_dir = Path(a.out) if a.out else None
    folder = out_dir or RESULTS
    todo = [i for i in items if a.all or not done(i)]
    summary = {**prov, "device": name, "device_type": device.type, "tiny": tiny, "packages": info, "notes": notes,
               "minutes": a.minutes, "fla_refuses_gated_backward": refuses,
               "order": [i.id for i in todo], "items": {}, "pending": {}, "incomplete": True}
    words = without(argv, ("--out", "--items", "--fail", "--minutes"), ("--all",))
    written = 0

    def save_summary(final=False):
        summary["wall_s"] = round(time.perf_counter() - start, 1)
        if final:
            summary.pop("incomplete", None)
        if out_dir:
            write(out_dir / f"{NAME}.json", summary)

    for item in todo:
        spent = (time.perf_counter() - start) / 60
        if not tiny and spent + item.minutes > a.minutes:
            summary["items"][item.id] = {"skipped": f"~{item.minutes:g} min does not fit: {spent:.1f} of "
                                                    f"{a.minutes:g} spent"}
            summary["pending"][item.id] = "did not fit the minutes left"
            print(f"  {item.id}: left pending (~{item.minutes:g} min, {spent:.1f} of {a.minutes:g} spent)", flush=True)
            save_summary()
            continue
        t0 = time.perf_counter()
        rec = {"item": item.id, "scope": item.scope, "what": item.what, "estimate_minutes": item.minutes}
        try:
            if item.id in ctx.fail:
                raise RuntimeError(f"failure injected by --fail {item.id}")
            res = item.run(ctx)
            parts = res.get("parts", {})
            status = "partial" if any("error" in p for p in parts.values()) else "ok"
            rec.update(status=status, result=res)
        except NotWritten as e:
            rec.update(status="not_written", note=str(e))
        except Exception as e:
            rec.update(status="error", error=cs.err_text(e))
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rec["item_wall_s"] = round(time.perf_counter() - t0, 2)
        print(f"  {item.id}: {rec['status']} [{rec['item_wall_s']} s]"
              + (f" {rec.get('error') or rec.get('note')}" if rec["status"] in ("error", "not_written") else ""),
              flush=True)
        if rec["status"] in ("error", "not_written"):
            summary["pending"][item.id] = rec.get("error") or rec["note"]
        elif tiny or device.type != "cuda":
            summary["pending"][item.id] = "dry run: not a GPU measurement"
        full = {**prov, "command": command_line([sys.argv[0], *words, "--items", item.id]), "device": name,
                "device_type": device.type,
                "tiny": tiny, "packages": info, "notes": notes, **rec}
        summary["items"][item.id] = full
        if rec["status"] != "not_written" and (out_dir is None or written < MAX_ITEM_FILES):
            path = result_path(item, folder)
            write(path, {**full, "result_file": repo_relative(path.resolve())})
            written += 1
        save_summary()
    for i in ITEMS:
        if i not in todo and not done(i):
            summary["pending"][i.id] = "not selected (--items)"
    summary["pending"] = {i.id: summary["pending"][i.id] for i in ITEMS if i.id in summary["pending"]}  # queue order
    save_summary(final=True)
    print(f"done in {summary['wall_s']} s; wrote {written} item files to {repo_relative(folder.resolve())}"
          + (f" and {NAME}.json" if out_dir else ""), flush=True)
    print("still pending on a GPU:" + ("".join(f"\n  {k}: {v}" for k, v in summary["pending"].items())
                                       or " nothing"), flush=True)
    return 0


def without(argv: list[str], with_value: tuple[str, ...], bare: tuple[str, ...]) -> list[str]:
    """``argv`` less these options (and their values): the command recorded for one item reruns that item."""
    words, skip = [], False
    for w in argv:
        if skip:
            skip = False
        elif w in with_value:
            skip = True
        elif w not in bare and not any(w.startswith(f + "=") for f in with_value):
            words.append(w)
    return words


if __name__ == "__main__":
    sys.exit(main())
