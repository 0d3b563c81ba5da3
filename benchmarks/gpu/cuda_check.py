"""CUDA check of the package on one GPU: every registered component against its CPU result, bf16 training
steps, our delta rule against flash-linear-attention, and ``fastweights train`` throughput.

    python benchmarks/gpu/cuda_check.py                        # on a CUDA machine (about 5 minutes on one H100)
    python benchmarks/gpu/cuda_check.py --device cpu --tiny   # dry run of every path on the CPU (seconds)

Three parts, each failure recorded with its message instead of stopping the run:

1. components: every mixer, head and memory with every variant that ``tests/contracts/test_device_contract.py``
   enumerates (``fastweights.testing.registry_cases.VARIANTS``, built by ``fastweights.testing.device_contract.build``:
   fixed seed, CPU, fp32) is copied to the device; forward + backward of two calls (the second reading the state the first
   returned) on the same random input on both devices. Recorded: the largest absolute difference of each
   output, input gradient, carried state and parameter gradient, relative to that tensor's largest CPU
   value; pass when every one is within ``FP32_REL_TOL`` (TF32 off). Then three Adam steps under bf16
   autocast on the device, as the device-contract test runs them on the CPU: finite losses within 5% of
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

import copy
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from fastweights.core.errors import UserError
from fastweights.evidence.result_files import RESULTS, command_line_without, git_state, provenance, write_result
from fastweights.cli.script_parser import ScriptParser
from fastweights.evidence.timing import timeit
import torch
import torch.nn.functional as F

from fastweights.ops.delta_rule import delta_rule
from fastweights.ops.fla_selfcheck import BF16_GRAD_TOL, BF16_OUT_TOL  # the tolerances of fla's gradient self-check
from fastweights.testing import device_contract as contract
from fastweights.testing import registry_cases as reg

dr = sys.modules["fastweights.ops.delta_rule"]  # the module (fastweights.ops.delta_rule is the function)

FP32_REL_TOL = 1e-4  # CPU vs CUDA, fp32 (TF32 off): max |cuda - cpu| / max |cpu| per tensor
BF16_LOSS_TOL = 0.05  # bf16-autocast loss vs fp32 loss, relative, per step (as tests/contracts/test_device_contract.py)
PRESETS = ("shakespeare-char", "shakespeare-char-fwp-gated-delta-l2", "shakespeare-char-fwp-delta-dpfp")
NAME = "cuda_check"



def err_text(e: BaseException) -> str:
    """One line: the exception and where in our code it was raised."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "fastweights" in f.filename]
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:400] if str(e) else ''}{where}"


# ----------------------------------------------------------------------------- 1. components


def rel_diff(a: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |a - ref|, that over max |ref|); tensors of other dtypes compared exactly."""
    a, ref = a.detach().cpu(), ref.detach().cpu()
    if a.shape != ref.shape:
        return math.inf, math.inf
    if not ref.is_floating_point():
        return (0.0, 0.0) if torch.equal(a, ref) else (math.inf, math.inf)
    if ref.numel() == 0:
        return 0.0, 0.0
    a, ref = a.double(), ref.double()
    if not torch.isfinite(a).all() or not torch.isfinite(ref).all():
        return math.inf, math.inf
    diff = (a - ref).abs().max().item()
    return diff, diff / max(ref.abs().max().item(), 1e-30)


def two_calls(layer, kind, x, tokens, weights, device):
    """Forward of two calls (the second reading the first's state), backward of a fixed weighted sum."""
    x1, x2 = (t.detach().clone().to(device).requires_grad_() for t in x)  # fresh leaves on each device
    t1, t2 = (t.to(device) for t in tokens)
    y1, s1 = contract.call(layer, kind, x1, t1)
    y2, s2 = contract.call(layer, kind, x2, t2, s1)
    w1, w2 = weights(y1.shape)
    loss = (y1.float() * w1.to(device)).sum() + (y2.float() * w2.to(device)).sum()
    aux = getattr(layer, "aux_loss", None)
    if isinstance(aux, torch.Tensor) and aux.requires_grad:
        loss = loss + aux
    loss.backward()
    out = {"output_1": y1, "output_2": y2, "input_grad_1": x1.grad, "input_grad_2": x2.grad}
    for where, leaf in contract.state_leaves(s2):
        out[f"state[{where}]" if where else "state"] = leaf
    for n, p in layer.named_parameters():
        if p.grad is not None:
            out[f"param_grad[{n}]"] = p.grad
    return out


def compare_devices(kind, name, raw, device) -> dict:
    layer_cpu = contract.build(kind, name, raw)  # fixed seed, built on the CPU, fp32
    layer_dev = copy.deepcopy(layer_cpu).to(device)
    g = torch.Generator().manual_seed(2)
    x = [torch.randn(reg.B, reg.T, reg.D, generator=g) for _ in range(2)]
    tokens = [torch.randint(0, reg.V, (reg.B, reg.T), generator=g) for _ in range(2)]
    cache = {}

    def weights(shape):
        if "w" not in cache:
            gw = torch.Generator().manual_seed(3)
            cache["w"] = (torch.randn(shape, generator=gw), torch.randn(shape, generator=gw))
        return cache["w"]

    ref = two_calls(layer_cpu, kind, x, tokens, weights, torch.device("cpu"))
    got = two_calls(layer_dev, kind, x, tokens, weights, device)
    diffs, problems = {}, []
    for key in sorted(set(ref) | set(got)):
        if key not in ref or key not in got:
            problems.append(f"{key} only on {'cpu' if key in ref else device.type}")
            continue
        if got[key].device.type != device.type:
            problems.append(f"{key} is on {got[key].device.type}, not {device.type}")
        diffs[key] = rel_diff(got[key], ref[key])
    worst_key = max(diffs, key=lambda k: diffs[k][1]) if diffs else None
    worst = diffs[worst_key] if worst_key else (0.0, 0.0)
    main = [k for k in diffs if k.startswith(("output", "input_grad"))]
    return {
        "max_abs_diff_outputs": max((diffs[k][0] for k in main if k.startswith("output")), default=0.0),
        "max_rel_diff_outputs": max((diffs[k][1] for k in main if k.startswith("output")), default=0.0),
        "max_abs_diff_input_grads": max((diffs[k][0] for k in main if k.startswith("input_grad")), default=0.0),
        "max_rel_diff_input_grads": max((diffs[k][1] for k in main if k.startswith("input_grad")), default=0.0),
        "max_rel_diff_state": max((v[1] for k, v in diffs.items() if k.startswith("state")), default=0.0),
        "max_rel_diff_param_grads": max((v[1] for k, v in diffs.items() if k.startswith("param_grad")), default=0.0),
        "worst": {"tensor": worst_key, "abs": worst[0], "rel": worst[1]},
        "tensors_compared": len(diffs),
        "problems": problems,
        "pass": not problems and worst[1] <= FP32_REL_TOL,
    }


def bf16_training(kind, name, raw, device) -> dict:
    fp32, _, _ = contract.train(kind, name, raw, False, device)
    bf16, state, layer = contract.train(kind, name, raw, True, device)
    problems = []
    if not all(math.isfinite(v) for v in bf16):
        problems.append(f"non-finite bf16 loss {bf16}")
    if not all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in layer.parameters()):
        problems.append("a parameter is not finite fp32 after the bf16 steps")
    worst = max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(fp32, bf16))
    if not worst <= BF16_LOSS_TOL:
        problems.append(f"bf16 loss differs from fp32 by {worst:.3g} (relative)")
    allowed = contract.compute_dtype_state(kind, name)
    for where, leaf in contract.state_leaves(state):
        if leaf.is_floating_point() and not ("" in allowed or where in allowed) and leaf.dtype != torch.float32:
            problems.append(f"state {where!r} is {leaf.dtype} under bf16 autocast")
        if leaf.device.type != device.type:
            problems.append(f"state {where!r} is on {leaf.device.type}")
    return {"losses_fp32": fp32, "losses_bf16": bf16, "max_rel_loss_diff": worst, "problems": problems,
            "pass": not problems}


class FlaCounter:
    """Counts the calls our delta_rule hands to fla (and fla's refusals) while it is installed."""

    def __init__(self):
        self.ok = self.refused = 0
        self.inner = dr._delta_rule_fla

    def __call__(self, *a, **k):
        try:
            out = self.inner(*a, **k)
        except Exception:
            self.refused += 1
            raise
        self.ok += 1
        return out

    def take(self) -> dict:
        counts = {"fla_calls": self.ok, "fla_refused": self.refused}
        self.ok = self.refused = 0
        return counts


PARTS = {"fp32_cpu_vs_device": compare_devices, "bf16_training": bf16_training}


def component_rows(tiny: bool) -> list[dict]:
    return [{"component": f"{kind}/{name}", "variant": vid, "options": raw}
            for (kind, name), variants in reg.VARIANTS.items()
            for i, (vid, raw) in enumerate(variants.items()) if not (tiny and i > 0)]  # --tiny: first variant


def component_pass(rows: list[dict], part: str, device: torch.device, deadline: float) -> None:
    """Run one part (fp32 comparison or bf16 training) for every row; a failure is recorded in its row."""
    counter = FlaCounter()
    dr._delta_rule_fla = counter
    try:
        for row in rows:
            kind, name = row["component"].split("/")
            if time.perf_counter() > deadline:
                row[part] = {"skipped": f"time budget of the {part} pass spent", "pass": None}
                continue
            t0 = time.perf_counter()
            try:
                row[part] = PARTS[part](kind, name, row["options"], device)
            except Exception as e:  # one component's failure is a result, not the end of the run
                row[part] = {"error": err_text(e), "pass": False}
            row[part].update(counter.take())
            row[part]["seconds"] = round(time.perf_counter() - t0, 3)
            res = row[part]
            detail = res.get("error") or "; ".join(res.get("problems", []))
            if part == "fp32_cpu_vs_device" and "worst" in res:
                detail = f"max rel diff {res['worst']['rel']:.2e} ({res['worst']['tensor']}) {detail}"
            elif "max_rel_loss_diff" in res:
                detail = f"loss rel diff {res['max_rel_loss_diff']:.2e}, fla calls {res['fla_calls']} {detail}"
            print(f"  {'PASS' if res['pass'] else 'FAIL'} {row['component']} {row['variant']}: {detail}", flush=True)
    finally:
        dr._delta_rule_fla = counter.inner


def component_summary(rows: list[dict]) -> dict:
    for row in rows:
        verdicts = [row.get(part, {}).get("pass") for part in PARTS]
        row["pass"] = None if None in verdicts else all(verdicts)
    done = [r for r in rows if r["pass"] is not None]
    return {
        "tolerance": {"fp32_rel": FP32_REL_TOL, "bf16_loss_rel": BF16_LOSS_TOL,
                      "rule": "fp32: every output, input gradient, carried state and parameter gradient within "
                              "fp32_rel of the CPU's (max |device - cpu| / max |cpu| per tensor), TF32 off; bf16: "
                              "3 Adam steps under autocast, finite, each loss within bf16_loss_rel of fp32's, "
                              "fp32 parameters, fast-weight state fp32 (activation caches excepted, as in "
                              "tests/contracts/test_device_contract.py)"},
        "shape": {"B": reg.B, "T": reg.T, "d_model": reg.D, "vocab": reg.V, "calls": 2},
        "variants": len(rows), "checked": len(done), "passed": sum(bool(r["pass"]) for r in done),
        "failed": [f"{r['component']} {r['variant']}" for r in done if not r["pass"]],
        "skipped": [f"{r['component']} {r['variant']}" for r in rows if r["pass"] is None],
        "fla_calls_in_bf16_training": sum(r.get("bf16_training", {}).get("fla_calls", 0) for r in rows),
        "rows": rows,
    }


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


def delta_inputs(b, t, h, d, device, gated, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, d, generator=g)
    k = F.normalize(torch.randn(b, t, h, d, generator=g), dim=-1)  # keys normalised: a stable recurrence
    v = torch.randn(b, t, h, d, generator=g)
    beta = torch.rand(b, t, h, generator=g) * 0.9 + 0.05
    log_decay = -torch.rand(b, t, h, generator=g) * 0.1 if gated else None
    do = torch.randn(b, t, h, d, generator=g)
    bf = [x.to(device=device, dtype=torch.bfloat16) for x in (q, k, v, beta)]
    return bf, (None if log_decay is None else log_decay.to(device)), do.to(device)


def run_impl(impl, fns, xs, log_decay, do, backward: bool):
    """One call: output (and input gradients when ``backward``)."""
    xs = [x.detach().requires_grad_(backward) for x in xs]
    g = None if log_decay is None else log_decay.detach().requires_grad_(backward)
    q, k, v, beta = xs
    if impl == "fla":
        if g is None:
            o, _ = fns["delta"](q, k, v, beta)
        else:
            o, _ = fns["gated"](q, k, v, g, beta)
    else:  # ours, torch backend (fp32 arithmetic inside for bf16 inputs)
        o, _ = delta_rule(q, k, v, beta, log_decay=g, backend="torch")
    if not backward:
        return o, None
    (o.float() * do).sum().backward()
    return o, [x.grad for x in xs] + ([g.grad] if g is not None else [])


def rel_norm(a, ref) -> float:
    a, ref = a.detach().double(), ref.detach().double()
    return ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()


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
                                entry["grad_rel_err_vs_fp32"] = [rel_norm(a, r) for a, r in zip(grads, ref_g)]
                            else:
                                entry["output_rel_err_vs_fp32"] = rel_norm(o, ref_o)

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
                    row["fla_vs_ours_output_rel_err"] = rel_norm(o_fla, o_ours)
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
