"""The device contract on a device against the CPU (what ``benchmarks/gpu/cuda_check.py`` runs on a GPU; the same
contract on the CPU alone is ``tests/contracts/test_device_contract.py``): every registered component and variant
(``registry_cases.VARIANTS``) built on the CPU (``device_contract.build``: fixed seed, fp32), copied to the device,
run for two calls (the second reading the state the first returned) forward and backward on both, every output,
input gradient, carried state and parameter gradient compared (:func:`compare_devices`); and three Adam steps under
bf16 autocast on the device against the same steps in fp32 (:func:`bf16_training`). A pass over the rows
(:func:`component_pass`) records each failure in its row and counts the calls the delta rule hands to fla."""

from __future__ import annotations

import copy
import importlib
import math
import time
import traceback
from pathlib import Path

import torch

from fastweights.testing import device_contract as contract
from fastweights.testing import registry_cases as reg

dr = importlib.import_module("fastweights.ops.delta_rule")  # the module (fastweights.ops.delta_rule is the function)

FP32_REL_TOL = 1e-4  # CPU vs CUDA, fp32 (TF32 off): max |cuda - cpu| / max |cpu| per tensor
BF16_LOSS_TOL = 0.05  # bf16-autocast loss vs fp32 loss, relative, per step (as tests/contracts/test_device_contract.py)


def _package_roots() -> list[Path]:
    """The folders of our package and of fla's, where fla is installed (found without importing it)."""
    import importlib.util
    import sys

    import fastweights

    if "fla" in sys.modules:  # imported (or stood in for: a stand-in module has no __path__, and lives in ours)
        fla = getattr(sys.modules["fla"], "__path__", None) or []
    else:
        spec = importlib.util.find_spec("fla")
        fla = (spec.submodule_search_locations or []) if spec else []
    return [Path(p).resolve() for p in [Path(fastweights.__file__).parent, *fla]]


def err_text(e: BaseException) -> str:
    """One line: the exception and where in our code or fla's it was raised (the last frame inside either package:
    a path that merely contains "fastweights" or "fla", a test's or a user's, does not count)."""
    roots = _package_roots()
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if any(Path(f.filename).resolve().is_relative_to(r) for r in roots)]
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:400] if str(e) else ''}{where}"


# ----------------------------------------------------------------------------- one component on two devices


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
    """Component ``kind``/``name`` with options ``raw``, built on the CPU and copied to ``device``: :func:`two_calls`
    on both on the same input, each tensor's :func:`rel_diff`, the worst of each kind, and whether every one is
    within :data:`FP32_REL_TOL` (with nothing missing or on the wrong device)."""
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
    """Three Adam steps of the component on ``device`` under bf16 autocast against the same steps in fp32: finite
    losses within :data:`BF16_LOSS_TOL`, fp32 parameters, the fast-weight state fp32 and on the device."""
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
    """One row per registered component and variant (``tiny``: the first variant of each)."""
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
    """Each row's verdict over both parts (None while a part was skipped), and the counts, failures, skips and
    tolerances of the pass."""
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
