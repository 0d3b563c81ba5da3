"""CUDA check of the package on one GPU: every registered component against its CPU result, bf16 training
steps, our delta rule against flash-linear-attention, and ``fastweights train`` throughput.

    python benchmarks/gpu/cuda_check.py                        # on a CUDA machine (about 5 minutes on one H100)
    python benchmarks/gpu/cuda_check.py --device cpu --tiny   # dry run of every path on the CPU (seconds)

Three parts, each failure recorded with its message instead of stopping the run:

1. components: every mixer, head and memory with every variant that ``tests/contracts/test_device_contract.py``
   enumerates (``fastweights.testing.registry_cases.VARIANTS``, built by ``fastweights.testing.device_contract.build``:
   fixed seed, CPU, fp32) is copied to the device (``fastweights.testing.device_check``); forward + backward of two
   calls (the second reading the state the first returned) on the same random input on both devices. Recorded: the
   largest absolute difference of each output, input gradient, carried state and parameter gradient, relative to that
   tensor's largest CPU value; pass when every one is within ``FP32_REL_TOL`` (TF32 off). Then three Adam steps under
   bf16 autocast on the device, as the device-contract test runs them on the CPU: finite losses within 5% of
   the same steps in fp32, fp32 parameters, fast-weight state kept in fp32.
2. delta rule: ``delta_rule(backend="torch")`` (ours) against flash-linear-attention's ``chunk_delta_rule``
   / ``chunk_gated_delta_rule`` in bf16, forward + backward and forward only (median of repeats after
   warm-up, ``torch.cuda.synchronize`` around each), and their agreement with our fp32 result on the same
   (bf16-rounded) inputs. fla refusing a call (not installed, or its gated backward on Hopper with
   3.4 <= Triton < 3.7.1) is recorded with its message.
3. train: ``fastweights train`` on the device for a few dozen steps of three presets; tokens/s is the
   median of the per-step ``tokens_per_s`` in metrics.jsonl after the first 5 steps.

Writes ``benchmarks/results/cuda_check.json``; ``--out DIR`` writes ``DIR/cuda_check.json`` instead
(the recorded command leaves ``--out`` out: it is where the file went, not what was measured).
Exit status 2 with one line on stderr for bad arguments (or ``--device cuda`` without CUDA).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fastweights.core.errors import UserError
from fastweights.evidence.result_files import RESULTS, command_line_without, git_state, provenance, write_result
from fastweights.cli.script_parser import ScriptParser
from fastweights.evidence.timing import timeit
import torch

from fastweights.core.compare import relative_error
from fastweights.experiments.fla_comparison import delta_inputs, run_impl
from fastweights.ops.fla_selfcheck import BF16_GRAD_TOL, BF16_OUT_TOL  # the tolerances of fla's gradient self-check
from fastweights.testing.device_check import (FP32_REL_TOL, component_pass, component_rows, component_summary,
                                              err_text)

PRESETS = ("shakespeare-char", "shakespeare-char-fwp-gated-delta-l2", "shakespeare-char-fwp-delta-dpfp")
NAME = "cuda_check"


# ----------------------------------------------------------------------------- 2. delta rule


def fla_import() -> tuple[dict | None, str]:
    """fla's two chunk functions and its version, or None and why not."""
    try:
        import fla
        from fla.ops.delta_rule import chunk_delta_rule
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:
        return None, err_text(e)
    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = None
    return {"delta": chunk_delta_rule, "gated": chunk_gated_delta_rule}, \
        f"fla {getattr(fla, '__version__', '?')}, triton {triton_version}"


def delta_rule_timing(device: torch.device, deadline: float, tiny: bool, repeat: int) -> dict:
    fns, fla_info = fla_import() if device.type == "cuda" else (None, "not on CUDA: fla runs on CUDA tensors only")
    shapes = [(1, 128, 2, 16)] if tiny else [(8, 2048, 8, 64), (8, 8192, 8, 64)]
    out = {"fla": fla_info if fns else None, "fla_unavailable": None if fns else fla_info,
           "dtype": "bfloat16", "chunk_size_ours": 64, "repeat": repeat, "warmup": 3,
           "timing": "median wall seconds per call after warm-up, torch.cuda.synchronize before and after each",
           "tolerance": {"output_rel": BF16_OUT_TOL, "grad_rel": BF16_GRAD_TOL,
                         "rule": "||x - ref|| / ||ref|| against our delta rule in fp32 on the same bf16-rounded inputs"},
           "runs": []}
    for gated in (False, True):
        for b, t, h, d in shapes:
            row = {"rule": "gated_delta" if gated else "delta", "B": b, "T": t, "H": h, "K": d, "V": d}
            out["runs"].append(row)
            if time.perf_counter() > deadline:
                row["skipped"] = "time budget of the delta-rule part spent"
                continue
            try:
                xs, log_decay, do = delta_inputs(b, t, h, d, device, gated)
                # fp32 reference: our torch form on the same (bf16-rounded) values
                ref_o, ref_g = run_impl("ours", None, [x.float() for x in xs], log_decay, do, True)
                impls = ["ours"] + (["fla"] if fns else [])
                for impl in impls:
                    entry = row.setdefault(impl, {})
                    for mode, backward in (("fwd_bwd", True), ("fwd", False)):
                        try:
                            o, grads = run_impl(impl, fns, xs, log_decay, do, backward)
                            if backward:
                                entry["grad_rel_err_vs_fp32"] = [relative_error(a, r) for a, r in zip(grads, ref_g)]
                            else:
                                entry["output_rel_err_vs_fp32"] = relative_error(o, ref_o)

                            def call(_b=backward):
                                with torch.set_grad_enabled(_b):
                                    run_impl(impl, fns, xs, log_decay, do, _b)

                            if device.type == "cuda":
                                torch.cuda.reset_peak_memory_stats(device)
                            entry[f"{mode}_s"] = timeit(call, warmup=3, repeat=repeat)
                            if device.type == "cuda":
                                entry[f"{mode}_peak_bytes"] = torch.cuda.max_memory_allocated(device)
                        except Exception as e:
                            entry[f"{mode}_error"] = err_text(e)
                    ok = [entry.get("output_rel_err_vs_fp32", math.inf) <= BF16_OUT_TOL]
                    if "grad_rel_err_vs_fp32" in entry:
                        ok.append(max(entry["grad_rel_err_vs_fp32"]) <= BF16_GRAD_TOL)
                    entry["agrees_with_fp32"] = all(ok)
                if fns and "fwd_s" in row.get("fla", {}):
                    o_ours, _ = run_impl("ours", None, xs, log_decay, do, False)
                    o_fla, _ = run_impl("fla", fns, xs, log_decay, do, False)
                    row["fla_vs_ours_output_rel_err"] = relative_error(o_fla, o_ours)
                    for mode in ("fwd_bwd", "fwd"):
                        if f"{mode}_s" in row["fla"] and f"{mode}_s" in row["ours"]:
                            row[f"ours_over_fla_{mode}"] = row["ours"][f"{mode}_s"] / row["fla"][f"{mode}_s"]
                print(f"  {row['rule']} B={b} T={t} H={h} K=V={d}: ours fwd+bwd "
                      f"{row['ours'].get('fwd_bwd_s', math.nan) * 1e3:.2f} ms, fwd {row['ours'].get('fwd_s', math.nan) * 1e3:.2f} ms"
                      + (f"; fla fwd+bwd {row['fla'].get('fwd_bwd_s', math.nan) * 1e3:.2f} ms "
                         f"({row['fla'].get('fwd_bwd_error', 'ok')}), fwd {row['fla'].get('fwd_s', math.nan) * 1e3:.2f} ms"
                         if "fla" in row else ""), flush=True)
            except Exception as e:
                row["error"] = err_text(e)
                print(f"  {row['rule']} T={t}: {row['error']}", flush=True)
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------------------- 3. train


def train_runs(device: torch.device, deadline: float, tiny: bool, steps: int) -> dict:
    presets = ("tiny",) if tiny else PRESETS
    rows = []
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with tempfile.TemporaryDirectory() as tmp:
        for preset in presets:
            sets = [f"train.device={device.type}", f"train.max_steps={steps}", "train.max_minutes=0",
                    "train.eval_every=0", "train.log_every=1", "train.eval_tokens=8192"]
            cmd = [sys.executable, "-m", "fastweights", "train", "--preset", preset, "--out", f"{tmp}/{preset}",
                   "--quiet", "--json"] + [w for s in sets for w in ("--set", s)]
            row = {"preset": preset, "command": "fastweights train --preset " + preset + " "
                   + " ".join(f"--set {s}" for s in sets) + " --out DIR"}
            rows.append(row)
            left = deadline - time.perf_counter()
            if left < 20:
                row["skipped"] = "time budget of the train part spent"
                continue
            t0 = time.perf_counter()
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=max(left, 20), env=env)
            except subprocess.TimeoutExpired:
                row["error"] = f"timed out after {left:.0f} s"
                continue
            row["wall_s"] = round(time.perf_counter() - t0, 2)
            if r.returncode != 0:
                row["error"] = f"exit {r.returncode}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ''}"
                print(f"  train {preset}: {row['error']}", flush=True)
                continue
            summary = json.loads(r.stdout[r.stdout.index("{"):])
            logs = [json.loads(line) for line in Path(f"{tmp}/{preset}/metrics.jsonl").read_text().splitlines()]
            rates = [rec["tokens_per_s"] for rec in logs if "tokens_per_s" in rec and rec.get("step", 0) > 5]
            losses = [rec["loss"] for rec in logs if "tokens_per_s" in rec]
            row.update({"steps": summary["steps"], "parameters": summary["parameters"], "device": summary["device"],
                        "tokens_per_s_median": statistics.median(rates) if rates else None,
                        "first_loss": losses[0] if losses else None, "last_loss": summary["train_loss"],
                        "val_bits_per_token": summary["val_bits_per_token"],
                        "finite": all(math.isfinite(v) for v in losses + [summary["val_loss"]])})
            print(f"  train {preset}: {row['steps']} steps, {row['tokens_per_s_median'] or math.nan:,.0f} tok/s, "
                  f"loss {row['first_loss']:.3f} -> {row['last_loss']:.3f}", flush=True)
    return {"steps": steps, "rows": rows,
            "note": "tokens/s: median over steps 6.. of metrics.jsonl's per-step tokens_per_s (batch x seq_len / "
                    "step wall time, the step's loss .item() syncing the device); bf16 autocast on CUDA"}


# ----------------------------------------------------------------------------- main


def headline(rec: dict) -> list[dict]:
    comp = rec["components"]
    rows = [{"what": f"CUDA check ({rec['device']}): registered component variants matching the CPU in fp32 "
                     f"(two calls, state carried, fwd+bwd, rel. tol {FP32_REL_TOL:g}) and training 3 steps "
                     f"under bf16 autocast",
             "value": f"{comp['passed']} of {comp['checked']}", "target": "all"}]
    for run in rec["delta_rule"]["runs"]:
        for mode, label in (("fwd_bwd", "fwd+bwd"), ("fwd", "fwd")):
            ratio = run.get(f"ours_over_fla_{mode}")
            if ratio is not None and (mode == "fwd_bwd" or run["rule"] == "gated_delta"):
                rows.append({"what": f"  {run['rule'].replace('_', ' ')} rule {label} time, ours (torch backend) / "
                                     f"fla, bf16, B={run['B']} T={run['T']} H={run['H']} K=V={run['K']}",
                             "value": round(ratio, 2), "unit": "x"})
    for run in rec["train"]["rows"]:
        if run.get("tokens_per_s_median"):
            rows.append({"what": f"  `fastweights train --preset {run['preset']}` on {rec['device']}, "
                                 f"{run['steps']} steps: tokens/s (median)",
                         "value": round(run["tokens_per_s_median"]), "unit": "tok/s"})
    return rows


def parse_args(argv):
    p = ScriptParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu (a dry run of every path)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, one variant per component, the tiny preset")
    p.add_argument("--out", metavar="DIR", help="write DIR/cuda_check.json instead of benchmarks/results/cuda_check.json")
    p.add_argument("--budget-s", type=float, default=330.0,
                   help="seconds for the whole run: a part that would start after its share is skipped and recorded")
    p.add_argument("--repeat", type=int, default=10, help="timed repeats per delta-rule measurement (median)")
    p.add_argument("--train-steps", type=int, default=40, help="steps of each fastweights train run")
    a = p.parse_args(argv)
    try:
        a.device = torch.device(a.device)
    except RuntimeError:
        raise UserError(f"--device {a.device!r} is not a device name (cuda, cuda:N or cpu)") from None
    if a.device.type not in ("cuda", "cpu"):
        raise UserError(f"--device {a.device} is not supported: choose cuda, cuda:N or cpu")
    if a.device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: torch sees no CUDA device here (use --device cpu --tiny for a dry run)")
    if a.device.type == "cuda" and (a.device.index or 0) >= torch.cuda.device_count():
        raise UserError(f"--device {a.device}: only {torch.cuda.device_count()} CUDA device(s)")
    if not a.budget_s > 0 or a.repeat < 1 or a.train_steps < 6:
        raise UserError("--budget-s must be > 0, --repeat >= 1 and --train-steps >= 6")
    if a.out is not None and Path(a.out).exists() and not Path(a.out).is_dir():
        raise UserError(f"--out {a.out} exists and is not a directory")
    return a


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py)."""
    return probes.registry_probes() + [s for p in PRESETS for s in probes.preset_probes(p)]



def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        a = parse_args(argv)
    except UserError as e:
        print(f"cuda_check: {e}", file=sys.stderr)
        return 2
    device = a.device
    start = time.perf_counter()
    steps = 6 if a.tiny else a.train_steps
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
        # fp32 comparisons in fp32: no TF32 in matmuls or cuDNN (convolutions, the LSTM)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"cuda_check on {name} (torch {torch.__version__})", flush=True)
    git = git_state()
    if os.environ.get("FASTWEIGHTS_GIT_COMMIT"):
        # a copy of the working tree on another machine (a lent GPU), whose .git need not be the checkout's:
        # the commit the copy was made of, named by whoever started the run
        git = {"commit": os.environ["FASTWEIGHTS_GIT_COMMIT"], "dirty": None, "dirty_paths": [],
               "note": "named by FASTWEIGHTS_GIT_COMMIT: the run used a copy of the working tree at this commit "
                       f"(the copy's own git said {git.get('commit')})"}
    rec = {
        **provenance(),
        "command": command_line_without(argv, "--out"),
        "git": git,
        "device": name,
        "tiny": a.tiny,
        "settings": {"tf32_in_fp32_comparisons": False, "budget_s": a.budget_s, "cuda": torch.version.cuda,
                     "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None},
    }
    path = Path(a.out) / f"{NAME}.json" if a.out is not None else RESULTS / f"{NAME}.json"

    def save(final: bool) -> None:
        """The record so far (``incomplete`` until the end: a run killed midway still leaves its parts)."""
        rec["wall_s"] = round(time.perf_counter() - start, 1)
        if final:
            rec.pop("incomplete", None)
            rec["headline"] = headline(rec)
        else:
            rec["incomplete"] = True
        if final and a.out is None:
            write_result(NAME, rec)  # the same record (rec holds provenance()'s fields)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rec, indent=2) + "\n")

    # Order: the fp32 comparisons (the point of the check) first; fla's kernels compile in part 2 before
    # the bf16 steps may call them at other shapes; each pass stops at its share of the budget.
    at = lambda f: start + f * a.budget_s  # noqa: E731
    rows = component_rows(a.tiny)
    print("1a. components: fp32, CPU vs device", flush=True)
    component_pass(rows, "fp32_cpu_vs_device", device, at(0.3))
    rec["components"] = component_summary(rows)
    save(False)
    print("2. delta rule: ours vs fla", flush=True)
    rec["delta_rule"] = delta_rule_timing(device, at(0.55), a.tiny, 2 if a.tiny else a.repeat)
    save(False)
    print("1b. components: 3 training steps under bf16 autocast", flush=True)
    component_pass(rows, "bf16_training", device, at(0.75))
    comp = rec["components"] = component_summary(rows)
    save(False)
    print("3. fastweights train", flush=True)
    rec["train"] = train_runs(device, at(1.0), a.tiny, steps)
    save(True)
    if a.out is not None:
        print(f"wrote {path}")
    print(f"components: {comp['passed']} of {comp['checked']} pass; failed: {comp['failed'] or 'none'}; "
          f"wall {rec['wall_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
