"""The GPU queue's measurements (``benchmarks/gpu/gpu_queue.py`` lists them in order of value and runs them):
scope 2's gradient checks of fla's kernels against our fp32 chunkwise form, scope 3's like-for-like timings
against fla, scope 4's open measurements and scope 5's FWL recipe. Each takes a :class:`Ctx` (the device, the
dry run's tiny shapes, the cuda_scale config) and returns the item's record. Built on ``cuda_scale.py``'s item
functions (inputs, fla's raw kernels, our op and layers, the models, the FwPKM layers, fla's guard bypass)."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import cuda_scale as cs  # its sibling benchmarks/gpu/cuda_scale.py, on sys.path as the script's folder
import torch

from fastweights.evidence.result_files import REPO, repo_relative
from fastweights.evidence.timing import call_seconds, step_timing
from fastweights.core.compare import relative_error
from fastweights.layers.gdn import GatedDeltaNet, GDNOptions
from fastweights.ops import fla_backend as fb
from fastweights.ops import fla_selfcheck as fsc
from fastweights.ops.delta_rule import delta_rule
from fastweights.ops.fla_selfcheck import BF16_GRAD_TOL, BF16_OUT_TOL  # the dispatch's self-check uses the same

HERE = Path(__file__).resolve().parent
BARS = {"delta_op": 1.15, "gdn_layer": 1.15, "hybrid": 1.1}
FWL_RECIPE = HERE / "fwl_smollm2_gpu.py"  # issue 41's GPU recipe: not yet written when absent
SMOLLM2_GGUF = REPO / ".fwl-gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"  # where its two-call procedure joins the file
LENGTHS = (2048, 8192, 32768)  # the kernels' T; the dry run maps them to TINY_LENGTHS
TINY_LENGTHS = (32, 64, 128)
FWPKM_T = 1024  # the FwPKM comparison as on the CPU: d_model 768, 512^2 slots, top-8, 1 head, chunk 512, T=1,024
GRAD_SHAPE = dict(B=4, H=12, D=64)  # the kernel benchmarks' shape at T=8192 (batch 32K / T, 12 heads of 64)


class NotWritten(Exception):
    """An item whose script does not exist yet (pending, not failed)."""



@dataclass
class Ctx:
    device: torch.device
    tiny: bool
    cfg: dict
    fla_ok: bool
    refuses: bool  # fla refuses the gated backward here: its kernel is timed / checked with the guard bypassed
    log: cs.BackendLog
    fail: set = field(default_factory=set)

    def T(self, i: int) -> int:
        return (TINY_LENGTHS if self.tiny else LENGTHS)[i]

    @property
    def w(self) -> dict:
        return dict(warmup=1, repeat=2) if self.tiny else dict(warmup=2, repeat=self.cfg["repeat"])

# ----------------------------------------------------------------------------- scope 2: gradients


def bypass(ctx: Ctx, gated: bool):
    return cs.fla_guard_bypassed() if (gated and ctx.refuses) else contextlib.nullcontext()


def grad_check(ctx: Ctx, gated: bool, chunk: int | None, t_index: int = 1) -> dict:
    """fla's kernel as our dispatch calls it (``fla_backend.fla_delta_rule``: bf16 q, k, v, beta, fp32 g and
    state, state in and out) against our fp32 chunkwise form on the same bf16-rounded inputs, TF32 off;
    loss = <o, do> + <final state, dht> with random do, dht; relative error of o, the final state and every
    input gradient."""
    dev, t = ctx.device, ctx.T(t_index)
    b, h, d = (1, 2, 8) if ctx.tiny else (max(1, 32768 // t), GRAD_SHAPE["H"], GRAD_SHAPE["D"])
    dk = d if gated else 2 * d  # fwp's default DPFP doubles K; gdn's K = V = 64
    q, k, v, beta, g = cs.kernel_inputs(b, t, h, dk, d, dev)
    gen = torch.Generator().manual_seed(5)
    h0 = (0.1 * torch.randn(b, h, dk, d, generator=gen)).to(dev)
    do = torch.randn(b, t, h, d, generator=gen).to(dev)
    dht = torch.randn(b, h, dk, d, generator=gen).to(dev)
    low = [x.to(torch.bfloat16) for x in (q, k, v, beta)]
    names = ["q", "k", "v", "beta"] + (["g"] if gated else []) + ["h0"]

    def run(fn, xs):
        leaves = [x.detach().clone().requires_grad_() for x in xs]
        o, ht = fn(*leaves)
        ((o.float() * do).sum() + (ht.float() * dht).sum()).backward()
        return o.detach(), ht.detach(), {n: x.grad for n, x in zip(names, leaves)}

    def fla_call(q_, k_, v_, b_, *rest):
        g_, s0 = (rest[0], rest[1]) if gated else (None, rest[0])
        return fb.fla_delta_rule(q_, k_, v_, b_, None, s0, True, g_, gated, chunk_size=chunk)

    def ref_call(q_, k_, v_, b_, *rest):
        g_, s0 = (rest[0], rest[1]) if gated else (None, rest[0])
        return delta_rule(q_, k_, v_, b_, initial_state=s0, output_final_state=True, log_decay=g_, backend="torch",
                          qk_l2norm=gated)

    extra = ([g] if gated else []) + [h0]
    fla_out = []

    def first_fla_call():
        with bypass(ctx, gated):
            fla_out.append(run(fla_call, low + extra))

    (first_call_s,) = call_seconds(first_fla_call)
    o, ht, grads = fla_out[0]
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ref_o, ref_ht, ref_grads = run(ref_call, [x.float() for x in low] + extra)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    errs = {"o": relative_error(o, ref_o), "final_state": relative_error(ht, ref_ht)}
    errs.update({f"d{n}": relative_error(grads[n], ref_grads[n]) for n in names})
    tol = {key: BF16_OUT_TOL if key in ("o", "final_state") else BF16_GRAD_TOL for key in errs}
    wrong = sorted(key for key in errs if not errs[key] <= tol[key])

    def step():
        with bypass(ctx, gated):
            run(fla_call, low + extra)

    timing = step_timing(step, dev, **dict(ctx.w, warmup=0))
    return {"kernel": "chunk_gated_delta_rule" if gated else "chunk_delta_rule", "chunk_size": chunk or 64,
            "shape": {"B": b, "T": t, "H": h, "K": dk, "V": d}, "guard_bypassed": gated and ctx.refuses,
            "qk_l2norm_in_kernel": gated, "rel_err": {key: round(x, 6) for key, x in errs.items()},
            "tolerance": tol, "wrong": wrong, "right": not wrong, "first_call_s": round(first_call_s, 2),
            "fwd_bwd": timing,
            "reference": "delta_rule(backend='torch') in fp32 on the bf16-rounded inputs, TF32 off"}


def dispatch_choices(ctx: Ctx) -> dict:
    """What the dispatch knows and chooses on this device: the fla kernels it can pick (always at fla's default
    chunk size, 64)."""
    dev = ctx.device
    facts = {"fla_available": fb.fla_available(), "fla_unusable": fb.fla_unusable_reason(),
             "fla_min_version": ".".join(map(str, fb.FLA_MIN_VERSION)),
             "fla_refuses_gated_backward": fb.fla_refuses_gated_backward(dev),
             "tilelang_takes_gated_backward": fb._tilelang_takes_gated_backward()}
    if dev.type == "cuda":
        facts["capability"] = list(torch.cuda.get_device_capability(dev))
    choices = {}
    for gated in (False, True):
        for grad in (True, False):
            key = f"{'gated' if gated else 'ungated'}_{'training' if grad else 'no_grad'}"
            choices[key] = fb.select_backend(
                "auto", device_type=dev.type, dtype=torch.bfloat16, gated=gated, needs_grad=grad,
                fla_ok=facts["fla_available"], fla_refuses_gated_backward=gated and facts["fla_refuses_gated_backward"])
    return {"facts": facts, "auto_bf16": choices,
            "note": "linear attention has no fla dispatch (ops/linear_attention.py is PyTorch only): nothing to check"}


# ----------------------------------------------------------------------------- scope 3 and 4: timings


def kernel_parts(ctx: Ctx, t_index: int, kinds: list[str]) -> dict:
    """cuda_scale's kernel items ``T<t>/<kind>`` at this T, each measured (or its error recorded)."""
    t = ctx.T(t_index)
    cfg = dict(ctx.cfg, kernel_lengths=(t,))
    items = {name.split("/", 1)[1]: (meta, thunk)
             for name, meta, thunk in cs.kernel_items(cfg, ctx.device, ctx.fla_ok, ctx.refuses)}
    out = {}
    for kind in kinds:
        if kind not in items:
            out[kind] = {"error": f"cuda_scale has no kernel item {kind!r} here"}
            continue
        meta, thunk = items[kind]
        out[kind] = part(thunk, meta)
    return out


def part(thunk, meta: dict | None = None) -> dict:
    t0 = time.perf_counter()
    try:
        res = {**(meta or {}), **thunk()}
    except Exception as e:
        res = {**(meta or {}), "error": cs.err_text(e)}
    res["part_wall_s"] = round(time.perf_counter() - t0, 2)
    return res


def sec(parts: dict, key: str) -> float | None:
    v = parts.get(key) or {}
    return v.get("seconds_median")


def ratio(parts: dict, num: str, den: str, bar: float | None = None) -> dict:
    a, b = sec(parts, num), sec(parts, den)
    r = None if a is None or b is None else round(a / b, 4)
    out = {"ratio": r, "of": f"{num} / {den}"}
    if bar is not None:
        out.update(bar=bar, met=None if r is None else r <= bar)
    return out


def fla_side(ctx: Ctx, base: str) -> str:
    return f"{base}_guard_bypassed" if ctx.refuses else base


def delta_op(ctx: Ctx, t_index: int) -> dict:
    parts = kernel_parts(ctx, t_index, ["delta_raw_fla", "delta_op_auto_bf16", "delta_op_auto"])
    return {"T": ctx.T(t_index), "parts": parts, "backend_log": list(ctx.log.lines),
            "ratios": {"delta_op_auto_bf16_over_raw_fla": ratio(parts, "delta_op_auto_bf16", "delta_raw_fla",
                                                                BARS["delta_op"]),
                       "delta_op_auto_over_raw_fla": ratio(parts, "delta_op_auto", "delta_raw_fla",
                                                           BARS["delta_op"])},
            "like_for_like": "bf16 autocast, fwd+bwd, state in and out on both sides, fla's default chunk 64 "
                             "(see backend_log). delta_op_auto_bf16: our op fed bf16 leaves, as the raw kernel is "
                             "(like for like); delta_op_auto: fed fp32 leaves, as the fwp layer's fp32 features "
                             "reach it, so it adds four casts to bf16, their fp32 gradients and fp32 leaves"}


def gdn_on_fla_layer(ctx: Ctx, t: int):
    """Our gdn layer forced onto fla's gated kernel (its guard bypassed where fla refuses): our layer's
    overhead around fla's kernel."""
    h, d, dm = ctx.cfg["n_heads"], ctx.cfg["head_dim"], ctx.cfg["d_model"]
    b = max(1, ctx.cfg["kernel_tokens"] // t)

    def thunk():
        torch.manual_seed(0)
        layer = GatedDeltaNet(dm, h, GDNOptions(head_dim=d, backend="fla")).to(ctx.device)
        x = torch.randn(b, t, dm, generator=torch.Generator().manual_seed(2)).to(ctx.device)
        with bypass(ctx, True):
            return step_timing(cs.layer_step(layer, x, ctx.device), ctx.device, **ctx.w)

    return thunk, {"T": t, "B": b, "H": h}


def gdn_layer(ctx: Ctx, t_index: int) -> dict:
    t = ctx.T(t_index)
    parts = kernel_parts(ctx, t_index, ["layer_gdn", fla_side(ctx, "layer_fla_gdn"), fla_side(ctx, "gated_raw_fla")])
    thunk, meta = gdn_on_fla_layer(ctx, t)
    parts[fla_side(ctx, "layer_gdn_on_fla")] = part(thunk, meta)
    fla_layer, ours_fla = fla_side(ctx, "layer_fla_gdn"), fla_side(ctx, "layer_gdn_on_fla")
    return {"T": t, "parts": parts, "backend_log": list(ctx.log.lines),
            "ratios": {"gdn_layer_auto_over_fla_layer": ratio(parts, "layer_gdn", fla_layer, BARS["gdn_layer"]),
                       "gdn_layer_on_fla_over_fla_layer": ratio(parts, ours_fla, fla_layer, BARS["gdn_layer"]),
                       "gdn_layer_auto_over_raw_fla_gated": ratio(parts, "layer_gdn", fla_side(ctx, "gated_raw_fla"))},
            "guard_bypassed": ctx.refuses}


def hybrid(ctx: Ctx) -> dict:
    parts = {fla_side(ctx, "ours_hybrid_fla_kernels"):
             part(lambda: cs.train_model("ours_fla_bypassed", ctx.cfg, ctx.device, bypass=ctx.refuses)),
             fla_side(ctx, "fla_gdn_hybrid"): part(lambda: cs.train_model("fla", ctx.cfg, ctx.device, bypass=ctx.refuses)),
             "ours_hybrid_auto": part(lambda: cs.train_model("ours", ctx.cfg, ctx.device))}
    return {"parts": parts, "guard_bypassed": ctx.refuses,
            "ratios": {"ours_on_fla_kernels_over_fla_model": ratio(parts, fla_side(ctx, "ours_hybrid_fla_kernels"),
                                                                   fla_side(ctx, "fla_gdn_hybrid"), BARS["hybrid"]),
                       "ours_auto_over_fla_model": ratio(parts, "ours_hybrid_auto", fla_side(ctx, "fla_gdn_hybrid"),
                                                         BARS["hybrid"])}}


ISSUE51_BARS = {"time": 1.1, "peak": 1.2}  # issue 51's acceptance: auto's step time and peak over fla's


def selfcheck_record(ctx: Ctx) -> dict:
    """What issue 51's gradient self-check of fla's gated backward decided in this process: the mode, its log lines,
    fla's guard flag now, the verdicts in the cache file (the check runs on the first gated training call on auto
    where fla refuses the backward; none where fla allows it, as on the dry run's CPU)."""
    try:
        cached = json.loads(fsc._cache_path().read_text())
    except (OSError, ValueError):
        cached = {}
    return {"mode": fsc.gated_backward_mode(), "refused_by_fla": ctx.refuses,
            "lines": [line for line in ctx.log.lines if "which fla refuses" in line],
            "decisions": [{"device": m[1], "K": m[2], "V": m[3], "dtype": str(m[4]), "mode": m[0], "fla_taken": v}
                          for m, v in fsc._DECISIONS.items()],
            "cached_verdicts": cached}


def gdn_layer_selfcheck(ctx: Ctx) -> dict:
    """The gdn layer on auto after issue 51's self-check (fla's gated backward where the check on this device passes)
    over fla's GatedDeltaNet layer at T=8192, against issue 51's bar, with the check's record."""
    rec = gdn_layer(ctx, 1)
    rec["ratios"]["gdn_layer_auto_over_fla_layer_issue51"] = ratio(rec["parts"], "layer_gdn",
                                                                   fla_side(ctx, "layer_fla_gdn"), ISSUE51_BARS["time"])
    return {**rec, "selfcheck": selfcheck_record(ctx), "backend_log": list(ctx.log.lines)}


def hybrid_selfcheck(ctx: Ctx) -> dict:
    """Our hybrid on auto after issue 51's self-check over fla's GatedDeltaNetForCausalLM: step time and peak memory
    against issue 51's bars, with the check's record."""
    fla_model = fla_side(ctx, "fla_gdn_hybrid")
    parts = {"ours_hybrid_auto": part(lambda: cs.train_model("ours", ctx.cfg, ctx.device)),
             fla_model: part(lambda: cs.train_model("fla", ctx.cfg, ctx.device, bypass=ctx.refuses))}
    mem = [parts[k].get("peak_bytes") for k in ("ours_hybrid_auto", fla_model)]
    peak = None if None in mem else round(mem[0] / mem[1], 4)
    return {"parts": parts, "selfcheck": selfcheck_record(ctx), "backend_log": list(ctx.log.lines),
            "ratios": {"ours_auto_over_fla_model": ratio(parts, "ours_hybrid_auto", fla_model, ISSUE51_BARS["time"]),
                       "ours_auto_peak_over_fla_model": {"ratio": peak, "bar": ISSUE51_BARS["peak"],
                                                         "met": None if peak is None else peak <= ISSUE51_BARS["peak"]}}}


def gdn_chunks(ctx: Ctx) -> dict:
    t = ctx.T(1)
    h, d, dm = ctx.cfg["n_heads"], ctx.cfg["head_dim"], ctx.cfg["d_model"]
    b = max(1, ctx.cfg["kernel_tokens"] // t)
    parts = {}
    for chunk in (32, 64):
        def thunk(chunk=chunk):
            torch.manual_seed(0)
            layer = GatedDeltaNet(dm, h, GDNOptions(head_dim=d, chunk_size=chunk)).to(ctx.device)
            x = torch.randn(b, t, dm, generator=torch.Generator().manual_seed(2)).to(ctx.device)
            return step_timing(cs.layer_step(layer, x, ctx.device), ctx.device, **ctx.w)

        parts[f"layer_gdn_chunk{chunk}"] = part(thunk, {"T": t, "B": b, "chunk_size": chunk})
    r = ratio(parts, "layer_gdn_chunk64", "layer_gdn_chunk32")
    faster = None if r["ratio"] is None else (64 if r["ratio"] < 1 else 32)
    return {"parts": parts, "ratios": {"chunk64_over_chunk32": r}, "faster_chunk": faster,
            "backend_log": list(ctx.log.lines),
            "note": "GDNOptions.chunk_size (default 32) matters for the torch/compiled forms only; the faster one "
                    "is to become the GPU default"}


def fwp_layer(ctx: Ctx) -> dict:
    parts = kernel_parts(ctx, 1, ["layer_fwp", "delta_raw_fla"])
    return {"T": ctx.T(1), "parts": parts, "backend_log": list(ctx.log.lines),
            "ratios": {"fwp_layer_over_raw_fla_delta": ratio(parts, "layer_fwp", "delta_raw_fla")}}


def fwpkm(ctx: Ctx) -> dict:
    cfg = dict(ctx.cfg, seq_len=ctx.cfg["seq_len"] if ctx.tiny else FWPKM_T)
    parts = {}
    for impl in ("ours", "lucidrains"):
        def thunk(impl=impl):
            step, n = cs.fwpkm_layer_step(impl, cfg, 1, ctx.device)
            return {**step_timing(step, ctx.device, 1, 2 if ctx.tiny else 5), "slow_parameters": n}

        parts[f"{impl}_B1"] = part(thunk, {"B": 1, "T": cfg["seq_len"]})
    mem = [parts[f"{i}_B1"].get("peak_bytes") for i in ("ours", "lucidrains")]
    return {"config": dict(cfg["fwpkm"], d_model=cfg["d_model"], T=cfg["seq_len"], dtype="fp32"), "parts": parts,
            "ratios": {"ours_time_over_lucidrains": ratio(parts, "ours_B1", "lucidrains_B1"),
                       "ours_peak_over_lucidrains": {"ratio": None if None in mem else round(mem[0] / mem[1], 4)}}}


def fwl_recipe(ctx: Ctx) -> dict:
    """Issue 41's recipe on SmolLM2, whose GGUF ``SMOLLM2_GGUF`` the two-call procedure of fwl_smollm2_gpu.py's
    docstring has joined on the machine; its JSON goes into this item's record (not a ninth file in $OUT)."""
    if not FWL_RECIPE.exists():
        raise NotWritten(f"not yet written: {repo_relative(FWL_RECIPE)} (issue 41's GPU recipe) does not exist")
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "fwl_smollm2_gpu.json"
        args = [sys.executable, str(FWL_RECIPE), "--device", ctx.device.type, "--out", str(out)]
        args += ["--tiny"] if ctx.tiny else ["--gguf", str(SMOLLM2_GGUF)]
        r = subprocess.run(args, capture_output=True, text=True, timeout=600)
        if r.returncode:
            raise RuntimeError(f"{FWL_RECIPE.name} exited {r.returncode}: {r.stderr.strip().splitlines()[-1:]}")
        return {"recipe": json.loads(out.read_text()), "stdout_tail": r.stdout[-4000:]}
