"""Re-stamp the behaviour probes of the stored results in the current format, without re-running a result.

    python tools/stamp_probes.py --verified-at COMMIT [--capability avx2] [--commit-probe-dtype float32]

The stored probes of a result say what the measured code did; when their format changes (fingerprints
became summaries on 2026-11-28), every result needs its probes written anew. Re-running the results would
cost CPU-hours; this script instead proves, for each result, that nothing but the format changed:

1. ``COMMIT`` is checked out into a temporary folder (``git archive``), and its own evidence tools decide,
   under ``ATEN_CPU_CAPABILITY=CAPABILITY`` (the kernels the old records were made with), which results are
   current there. A result that was already stale at ``COMMIT`` is refused: it needs a re-run, not a stamp.
2. The raw outputs of every probe are computed by ``COMMIT``'s code and by the current code, both under
   that capability and with the same default dtype while a probe builds its model (``--commit-probe-dtype``:
   what ``COMMIT``'s probes used), and compared output by output: every output must agree within
   ``--tolerance`` of its norm (default 1e-6: precision changes between the two, such as an fp32 loss made
   fp64, move outputs by about 1e-7; a change of behaviour by far more). A probe that disagrees is refused.
3. Each result whose probes all agree gets its probes' summaries from the current code (its own default
   dtype, :data:`probes.PROBE_DTYPE`), and a ``probes_stamped`` record naming
   ``COMMIT`` and this command. Nothing else in a result changes.

Exit status: 0 when every result was stamped, 1 when some were refused (they are listed and left as they
were), 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import evidence  # tools/evidence.py
from fastweights.core.files import atomic_write
from fastweights.evidence.result_files import REPO, command_line
from fastweights.cli.script_parser import ScriptParser, exit_status_of

# Run in a subprocess over one source tree, its tools' folders on PYTHONPATH (``_dump``): which results its own
# tools call current, and the raw outputs of every probe spec given on stdin (saved with torch.save to argv[2]).
_DUMP = r"""
import importlib, json, sys
import torch
root, out, dtype, results = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
for name in ("probes", "fastweights.evidence.probes", "fastweights.experiments.probes"):  # where they lived
    try:
        probes = importlib.import_module(name)
        break
    except ImportError:
        continue
assert probes.__file__.startswith(root), probes.__file__
if hasattr(probes, "PROBE_DTYPE"):
    probes.PROBE_DTYPE = getattr(torch, dtype)
specs = json.loads(sys.stdin.read())
current = None
if len(sys.argv) > 5:
    import pathlib
    import evidence
    results = pathlib.Path(results)
    current = [evidence.result_key(p, results) for p in evidence.result_paths(results)
               if not evidence.staleness(json.loads(p.read_text()))]
outputs = {}
for key, spec in specs.items():
    with probes._deterministic():
        raw = probes.KINDS[spec["kind"]](**spec.get("args", {}))
    outputs[key] = {k: (v.detach().to(torch.float64).clone() if isinstance(v, torch.Tensor) and v.is_floating_point()
                        else v) for k, v in raw.items()}
torch.save({"current": current, "outputs": outputs, "capability": torch.backends.cpu.get_cpu_capability()}, out)
"""


def _dump(root: Path, specs: dict, out: Path, capability: str, dtype: str, results: Path, with_staleness: bool) -> dict:
    import torch

    # the tree's evidence tools and probes, where they are now (tools/) or were (benchmarks/tools/, benchmarks/), and
    # its package
    path = os.pathsep.join(str(root / d) for d in ("tools", "benchmarks/tools", "benchmarks", "src"))
    env = {**os.environ, "PYTHONPATH": path, "ATEN_CPU_CAPABILITY": capability, "PYTHONWARNINGS": "ignore"}
    argv = [sys.executable, "-c", _DUMP, str(root), str(out), dtype, str(results)] + (["staleness"] if with_staleness else [])
    done = subprocess.run(argv, input=json.dumps(specs), cwd=root, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"error: computing the probes at {root} failed:\n{done.stderr[-3000:]}")
    return torch.load(out, weights_only=True)  # tensors, lists and strings: nothing to unpickle


def _disagreement(a: dict, b: dict, tolerance: float) -> str | None:
    import numpy as np
    import torch

    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            return f"{key}: present on one side only"
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            if not isinstance(y, torch.Tensor) or x.shape != y.shape:
                return f"{key}: shape or type differs"
            if not (torch.isfinite(x).all() and torch.isfinite(y).all()):  # NaN agrees with nothing (issue 52)
                if not torch.equal(x.isnan(), y.isnan()) or not torch.equal(torch.nan_to_num(x), torch.nan_to_num(y)):
                    return f"{key}: not finite on one side or differently"
                continue
            scale = max(float(x.norm()), float(y.norm()))
            worst = float((x - y).abs().max()) if x.numel() else 0.0
            if not worst <= tolerance * scale:
                return f"{key}: differs by {worst / scale:.2g} of its norm"
        elif isinstance(x, (torch.Tensor, np.ndarray)):
            if not np.array_equal(np.asarray(x), np.asarray(y)):
                return f"{key}: differs"
        elif x != y:
            return f"{key}: differs"
    return None


def _tolerance(text: str) -> float:
    """argparse type of --tolerance: a finite number >= 0 (nan compared as agreeing with everything)."""
    import math

    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return v


def main(argv: list[str] | None = None) -> int:
    ap = ScriptParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verified-at", required=True, metavar="COMMIT",
                    help="a commit whose own tools call the stored results current")
    ap.add_argument("--capability", default="avx2", help="ATEN_CPU_CAPABILITY the old records were made under")
    ap.add_argument("--commit-probe-dtype", default="float32", choices=("float32", "float64"),
                    help="the default dtype COMMIT's probes built their models in")
    ap.add_argument("--tolerance", type=_tolerance, default=1e-6,
                    help="largest difference, relative to an output's norm, between COMMIT's and today's outputs")
    ap.add_argument("--results", type=Path, default=evidence.RESULTS,
                    help="the folder of result JSON files to stamp (default: benchmarks/results)")
    args = ap.parse_args(argv)
    from probes import PROBE_DTYPE, run_probe  # tools/probes.py

    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", f"{args.verified_at}^{{commit}}"],
                            capture_output=True, text=True)
    if commit.returncode:
        print(f"error: {args.verified_at!r} is no commit of this repository", file=sys.stderr)
        return 2
    commit = commit.stdout.strip()

    paths = evidence.result_paths(args.results)
    records = {p: json.loads(p.read_text()) for p in paths}
    specs = {}
    for rec in records.values():
        for p in rec.get("probes") or []:
            spec = {"kind": p["kind"], "args": p.get("args", {})}
            specs[json.dumps(spec, sort_keys=True)] = spec

    with tempfile.TemporaryDirectory() as tmp:
        old_root = Path(tmp) / "tree"
        old_root.mkdir()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", commit], capture_output=True,
                                 check=True).stdout
        archive_path = Path(tmp) / "tree.tar"
        archive_path.write_bytes(archive)
        with tarfile.open(archive_path) as tar:
            tar.extractall(old_root, filter="data")
        print(f"probes of {len(specs)} specs in {len(paths)} results: at {commit[:10]} and now, "
              f"ATEN_CPU_CAPABILITY={args.capability}", flush=True)
        old = _dump(old_root, specs, Path(tmp) / "old.pt", args.capability, args.commit_probe_dtype, args.results, True)
        new = _dump(REPO, specs, Path(tmp) / "new.pt", args.capability, args.commit_probe_dtype, args.results, False)

    current_then = set(old["current"])
    refused, stamped = [], 0
    for path, rec in records.items():
        key = evidence.result_key(path, args.results)
        if key not in current_then:
            refused.append(f"{key}: stale at {commit[:10]} already (re-run it)")
            continue
        problem = None
        for p in rec.get("probes") or []:
            spec_key = json.dumps({"kind": p["kind"], "args": p.get("args", {})}, sort_keys=True)
            why = _disagreement(old["outputs"][spec_key], new["outputs"][spec_key], args.tolerance)
            if why:
                problem = f"{key}: probe {p['kind']} behaves otherwise now ({why})"
                break
        if problem:
            refused.append(problem)
            continue
        rec["probes"] = [{"kind": p["kind"], "args": p.get("args", {}),
                          "summary": run_probe({"kind": p["kind"], "args": p.get("args", {})})}
                         for p in rec.get("probes") or []]
        rec["probes_stamped"] = {"verified_current_at": commit, "capability_then": old["capability"],
                                 "probe_dtype": str(PROBE_DTYPE).removeprefix("torch."),
                                 "command": command_line()}
        atomic_write(path, lambda p, rec=rec: p.write_text(json.dumps(rec, indent=2) + "\n"))
        stamped += 1
    print(f"stamped {stamped} of {len(paths)} results")
    for line in refused:
        print(f"refused: {line}")
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
