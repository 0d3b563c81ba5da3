"""GPU speed at a real size (issue 34, scope 3): the FwPKM paper's model shape trained in bf16, our
delta-rule layers against flash-linear-attention's kernels, and our FwPKM layer against lucidrains'.

    python benchmarks/gpu/cuda_scale.py --out $OUT/cuda_scale.json     # one CUDA GPU, about 6-8 minutes (H100)
    python benchmarks/gpu/cuda_scale.py --device cpu --tiny --out X    # dry run of every path at toy sizes

Parts, in this order (each measured item in its own try/except, its error recorded as a string; the JSON
is rewritten after every item, with ``incomplete: true`` until the end; an item that would start past
``--budget-s`` is recorded as skipped):

1. models: 12 layers, d_model 768, 12 heads of 64, SwiGLU 2048, vocab 32000 (tied), GDN and attention
   interleaved 3:1 (attention at layers 3, 7, 11: the paper's GDN+FA layout), T = 4096, batch 8, bf16
   autocast with fp32 parameters, AdamW; tokens/s (median step after warm-up, synchronised) and peak
   memory of (a) our hybrid (``fastweights`` LanguageModel, gdn backend "auto"), (b) fla's
   ``GatedDeltaNetForCausalLM`` of the same shape, (c) (a) with FwPKM before the mixers of layers 2, 6, 10
   at the paper's App. C configuration (512^2 slots, d_k = d_v = 512, top-8, chunk 512).
2. kernels: at T = 2K / 8K / 32K (batch 32K / T), 12 heads, bf16 autocast, forward + backward: fla's raw
   ``chunk_delta_rule`` (K = 128, V = 64: fwp's default DPFP features) and ``chunk_gated_delta_rule``
   (K = V = 64, L2 norm in the kernel: gdn's); our ``delta_rule`` op as the layers call it (fp32 inputs
   under autocast, backend "auto", and the "torch" / "compiled" forms) and, like for like with the raw
   kernel, fed bf16 leaves (``delta_op_auto_bf16``); our ``fwp`` and ``gdn`` layers
   (768 -> 768, projections included) and fla's ``GatedDeltaNet`` layer.
3. FwPKM: one layer at the paper's configuration (d_model 768, T = 4096) forward + backward in fp32 (the
   paper's FwPKM precision; lucidrains' layer fails under bf16 autocast), ours against lucidrains'
   ``fast-weight-product-key-memory`` (``fwPKM``) at batch 1 and 8.

Size of a run on a fresh H100 (measured, benchmarks/results/cuda_scale*.json): fla's Triton autotuning
costs 80-100 s per kernel family on first use (the delta rule's, the gated rule's forward, its backward)
and inductor ~17-30 s per new compiled shape, so the whole plan needs about two 10-minute calls; the
recorded runs split it with ``--items`` (globs over ``part/key``, run in the order given).

flash-linear-attention 0.6 refuses the gated backward on Hopper with 3.4 <= Triton < 3.7.1 unless its TileLang
backend is usable (wrong results, its issue 640). Where it refuses, the refusal is recorded, and fla is also timed with that check switched off
("guard_bypassed": its gradients may be wrong there, the time is what its kernels take), so that our
compiled fallback and fla's model have a time to be compared with. fla's attention layers import
``flash_attn``; a stand-in ``flash_attn_func`` over ``F.scaled_dot_product_attention`` (the kernel our
attention uses) is installed when the package is absent, and recorded.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

from fastweights.core.errors import UserError
from fastweights.evidence.result_files import REPO, RESULTS, command_line_without, provenance
from fastweights.cli.script_parser import ScriptParser
from fastweights.evidence.timing import step_timing
import torch

from fastweights.experiments.fla_comparison import (BackendLog, fla_gdn_layer, fla_guard_bypassed, fla_info,
                                                    fla_model, fwpkm_layer_step, install_flash_attn_standin,
                                                    kernel_inputs, layer_step, our_config, our_op_step, raw_fla_step)
from fastweights.layers.fwp import FastWeightProgrammer, FWPOptions
from fastweights.testing.device_check import err_text
from fastweights.layers.gdn import GatedDeltaNet, GDNOptions
from fastweights.models.lm import LanguageModel

NAME = "cuda_scale"
PAPER_FWPKM = dict(n_subkeys=512, d_key=512, d_value=512, heads=1, topk=8, chunk_size=512)
FULL = dict(d_model=768, n_layers=12, n_heads=12, head_dim=64, mlp=2048, vocab=32000, seq_len=4096, batch=8,
            kernel_lengths=(2048, 8192, 32768), kernel_tokens=32768, fwpkm=PAPER_FWPKM, attn_every=4,
            fwpkm_layers=(2, 6, 10), warmup=3, steps=8, repeat=5)
TINY = dict(d_model=64, n_layers=4, n_heads=4, head_dim=16, mlp=128, vocab=256, seq_len=64, batch=2,
            kernel_lengths=(32, 64), kernel_tokens=128, attn_every=4, fwpkm_layers=(1,), warmup=1, steps=2, repeat=2,
            fwpkm=dict(n_subkeys=8, d_key=16, d_value=16, heads=1, topk=4, chunk_size=16))


# ----------------------------------------------------------------------------- 1. models


def train_model(kind: str, cfg: dict, device, bypass: bool = False) -> dict:
    torch.manual_seed(0)
    if kind == "fla":
        model = fla_model(cfg)
        loss_of = lambda toks: model(input_ids=toks, labels=toks, use_cache=False).loss  # noqa: E731
    else:
        model = LanguageModel(our_config(cfg, fwpkm=kind == "ours_fwpkm"))
        if kind == "ours_fla_bypassed":
            for m in model.modules():
                if isinstance(m, GatedDeltaNet):
                    m.options.backend = "fla"
        # the loss only, as the trainer asks for it (ops.linear_cross_entropy: no [B, T, V] logits kept)
        loss_of = lambda toks: model(toks, targets=toks, return_logits=False).loss  # noqa: E731
    model.to(device).train()
    n_params = sum(p.numel() for p in model.parameters())
    fast_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda")
    g = torch.Generator().manual_seed(1)
    toks = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq_len"]), generator=g).to(device)
    losses = []

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_of(toks)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    with fla_guard_bypassed() if bypass else contextlib.nullcontext():
        res = step_timing(step, device, cfg["warmup"], cfg["steps"])
    tokens = cfg["batch"] * cfg["seq_len"]
    res.update(parameters=n_params, fast_weight_buffer_bytes=fast_bytes, tokens_per_step=tokens,
               tokens_per_s=tokens / res["seconds_median"],
               losses=[round(float(x), 4) for x in losses], finite=all(math.isfinite(float(x)) for x in losses))
    return res


# ----------------------------------------------------------------------------- 2. kernels


def kernel_items(cfg, device, fla_ok: bool, on_hopper_refusal: bool):
    """(name, T, thunk returning a step_timing() dict) for part 2, in order."""
    items = []
    h, d, dm = cfg["n_heads"], cfg["head_dim"], cfg["d_model"]
    for t in cfg["kernel_lengths"]:
        b = max(1, cfg["kernel_tokens"] // t)
        w = dict(warmup=2, repeat=cfg["repeat"])

        def make(kind, t=t, b=b, w=w):
            def run():
                torch.manual_seed(0)
                gated = kind.startswith("gated") or kind.endswith("gdn")
                dk = d if gated else 2 * d  # fwp's default DPFP doubles K
                xs = kernel_inputs(b, t, h, dk, d, device)
                if kind in ("delta_raw_fla", "gated_raw_fla"):
                    step = raw_fla_step(gated, xs, device)
                elif kind == "gated_raw_fla_guard_bypassed":
                    step = raw_fla_step(True, xs, device)
                    with fla_guard_bypassed():
                        return step_timing(step, device, **w)
                elif kind.startswith(("delta_op_", "gated_op_")):  # <rule>_op_<backend>[_bf16]
                    leaves = torch.bfloat16 if kind.endswith("_bf16") else torch.float32
                    step = our_op_step(gated, xs, kind.split("_")[2], device, leaves)
                else:
                    if kind == "layer_fwp":
                        layer = FastWeightProgrammer(dm, h, FWPOptions(rule="delta", feature_map="dpfp"))
                    elif kind == "layer_gdn":
                        layer = GatedDeltaNet(dm, h, GDNOptions(head_dim=d))
                    else:
                        layer = fla_gdn_layer(cfg)
                    layer = layer.to(device)
                    x = torch.randn(b, t, dm, generator=torch.Generator().manual_seed(2)).to(device)
                    step = layer_step(layer, x, device)
                    if kind == "layer_fla_gdn_guard_bypassed":
                        with fla_guard_bypassed():
                            return step_timing(step, device, **w)
                return step_timing(step, device, **w)

            return run

        kinds = ["delta_raw_fla", "delta_op_auto_bf16", "delta_op_auto", "delta_op_torch", "layer_fwp",
                 "gated_op_auto", "gated_op_compiled", "gated_op_torch", "layer_gdn"]
        if fla_ok and on_hopper_refusal:  # fla's gated training refuses here: timed with its check bypassed
            kinds += ["gated_raw_fla_guard_bypassed", "layer_fla_gdn_guard_bypassed"]
        else:
            kinds += ["gated_raw_fla", "layer_fla_gdn"]
        for kind in kinds:
            items.append((f"T{t}/{kind}", {"T": t, "B": b, "H": h}, make(kind)))
    return items


# ----------------------------------------------------------------------------- main


def ratios(rec: dict) -> dict:
    """The issue's acceptance ratios from what was measured (None where a side is missing)."""
    m, k, f = rec["models"], rec["kernels"], rec["fwpkm_layer"]

    def sec(d, key):
        v = d.get(key, {})
        return v.get("seconds_median") if isinstance(v, dict) else None

    def div(a, b):
        return None if a is None or b is None else a / b

    out = {
        "ours_hybrid_step_over_fla_model_step": div(sec(m, "ours_hybrid"), sec(m, "fla_gdn_hybrid"))
        or div(sec(m, "ours_hybrid"), sec(m, "fla_gdn_hybrid_guard_bypassed")),
        "fwpkm_hybrid_tokens_per_s_over_backbone": div(sec(m, "ours_hybrid"), sec(m, "ours_hybrid_fwpkm")),
        "ours_hybrid_fla_kernels_step_over_fla_model_step": div(sec(m, "ours_hybrid_fla_kernels_guard_bypassed"),
                                                                sec(m, "fla_gdn_hybrid_guard_bypassed")),
    }
    for t in {key.split("/")[0] for key in k}:
        fla_gated = sec(k, f"{t}/gated_raw_fla") or sec(k, f"{t}/gated_raw_fla_guard_bypassed")
        out[f"{t}/fwp_layer_over_raw_fla_delta_kernel"] = div(sec(k, f"{t}/layer_fwp"), sec(k, f"{t}/delta_raw_fla"))
        out[f"{t}/delta_op_auto_over_raw_fla"] = div(sec(k, f"{t}/delta_op_auto"), sec(k, f"{t}/delta_raw_fla"))
        out[f"{t}/delta_op_auto_bf16_over_raw_fla"] = div(sec(k, f"{t}/delta_op_auto_bf16"),
                                                          sec(k, f"{t}/delta_raw_fla"))
        out[f"{t}/gdn_layer_over_raw_fla_gated_kernel"] = div(sec(k, f"{t}/layer_gdn"), fla_gated)
        out[f"{t}/gated_op_auto_over_raw_fla"] = div(sec(k, f"{t}/gated_op_auto"), fla_gated)
        out[f"{t}/gated_op_compiled_over_raw_fla"] = div(sec(k, f"{t}/gated_op_compiled"), fla_gated)
        out[f"{t}/gated_op_torch_over_compiled"] = div(sec(k, f"{t}/gated_op_torch"), sec(k, f"{t}/gated_op_compiled"))
        out[f"{t}/gdn_layer_over_fla_gdn_layer"] = div(sec(k, f"{t}/layer_gdn"), sec(k, f"{t}/layer_fla_gdn")
                                                        or sec(k, f"{t}/layer_fla_gdn_guard_bypassed"))
    for b in ("B1", "B8"):
        out[f"fwpkm_{b}_ours_time_over_lucidrains"] = div(sec(f, f"ours_{b}"), sec(f, f"lucidrains_{b}"))
        mem = [f.get(f"{impl}_{b}", {}).get("peak_bytes") for impl in ("ours", "lucidrains")]
        out[f"fwpkm_{b}_ours_peak_over_lucidrains"] = div(*mem)
    return {key: (None if v is None else round(v, 4)) for key, v in sorted(out.items())}


def parse_args(argv):
    p = ScriptParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --tiny: a dry run)")
    p.add_argument("--tiny", action="store_true", help="toy sizes (a dry run of every path)")
    p.add_argument("--out", help="write here instead of benchmarks/results/cuda_scale.json")
    p.add_argument("--budget-s", type=float, default=420.0, help="an item that would start after this is skipped")
    p.add_argument("--items", help="comma-separated globs over item names (part/key, e.g. 'kernels/T8192/*,"
                                   "fwpkm_layer/*_B1'): run only those, in the order of the globs")
    a = p.parse_args(argv)
    try:
        a.device = torch.device(a.device)
    except RuntimeError:
        raise UserError(f"--device {a.device!r} is not a device name") from None
    if a.device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: torch sees no CUDA device here (use --device cpu --tiny for a dry run)")
    if a.device.type not in ("cuda", "cpu"):
        raise UserError(f"--device {a.device} is not supported: choose cuda or cpu")
    if not a.budget_s > 0:
        raise UserError("--budget-s must be > 0")
    return a


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py)."""
    # the kernels, and the hybrids' parts: gdn and attention mixers, the FwPKM memory at the paper's options
    return [probes.probe("ops", op="delta_rule"), probes.probe("ops", op="gated_delta_rule"),
            probes.probe("layer", role="mixer", name="gdn"), probes.probe("layer", role="mixer", name="attention"),
            probes.probe("layer", role="memory", name="fwpkm", options=dict(PAPER_FWPKM))]


def provenance_record(argv) -> dict:
    try:
        rec = provenance()
    except Exception as e:  # the provenance helper must not cost the GPU run
        from fastweights.evidence import provenance as prov

        rec = {**prov.provenance(REPO), "provenance_error": err_text(e)}
    rec["command"] = command_line_without(argv, "--out")
    if os.environ.get("FASTWEIGHTS_GIT_COMMIT"):
        rec["git"] = {"commit": os.environ["FASTWEIGHTS_GIT_COMMIT"], "dirty": None, "dirty_paths": [],
                      "note": "named by FASTWEIGHTS_GIT_COMMIT: the run used a copy of the working tree at this "
                              f"commit (the copy's own git said {rec.get('git', {}).get('commit')})"}
    return rec


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        a = parse_args(argv)
    except UserError as e:
        print(f"cuda_scale: {e}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    device, cfg = a.device, dict(TINY if a.tiny else FULL)
    if device.type == "cpu":  # the dry run traces the compiled form without inductor's C++ build (minutes on a CPU)
        sys.modules["fastweights.ops.delta_rule"].COMPILE_OPTIONS = {"backend": "aot_eager"}
    standin = install_flash_attn_standin()
    log = BackendLog()
    logging.getLogger("fastweights.ops.delta_rule").addHandler(log)
    logging.getLogger("fastweights.ops.delta_rule").setLevel(logging.INFO)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"cuda_scale on {name} (torch {torch.__version__})", flush=True)
    info = fla_info()
    from fastweights.ops.fla_backend import fla_available, fla_refuses_gated_backward

    fla_ok = fla_available() and device.type == "cuda"
    refuses = fla_ok and fla_refuses_gated_backward(device)
    print(f"  {info}; fla refuses the gated backward here: {refuses}", flush=True)
    rec = {**provenance_record(argv), "device": name, "tiny": a.tiny, "config": cfg, "packages": info,
           "flash_attn_standin": standin, "fla_refuses_gated_backward": refuses,
           "settings": {"autocast": "bfloat16", "params": "fp32", "optimizer": "AdamW(lr=3e-4, fused on CUDA)",
                        "tf32": torch.backends.cuda.matmul.allow_tf32, "cuda": torch.version.cuda,
                        "budget_s": a.budget_s},
           "timing": "median wall seconds per step after warm-up, torch.cuda.synchronize around each; peak_bytes: "
                     "torch.cuda.max_memory_allocated over warm-up and timed steps",
           "result_file": f"benchmarks/results/{NAME}.json", "models": {}, "kernels": {}, "fwpkm_layer": {}}
    path = Path(a.out) if a.out else RESULTS / f"{NAME}.json"

    def save(final=False):
        rec["wall_s"] = round(time.perf_counter() - start, 1)
        rec["backend_log"] = list(log.lines)
        rec["ratios"] = ratios(rec)
        if final:
            rec.pop("incomplete", None)
        else:
            rec["incomplete"] = True
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec, indent=2) + "\n")
        tmp.replace(path)

    def run(part: str, key: str, thunk, meta: dict | None = None):
        if time.perf_counter() - start > a.budget_s:
            rec[part][key] = {**(meta or {}), "skipped": f"--budget-s {a.budget_s:g} spent"}
            print(f"  {part} {key}: skipped (budget)", flush=True)
            save()
            return
        t0 = time.perf_counter()
        try:
            res = {**(meta or {}), **thunk()}
        except Exception as e:
            res = {**(meta or {}), "error": err_text(e)}
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        res["item_wall_s"] = round(time.perf_counter() - t0, 2)
        rec[part][key] = res
        detail = res.get("error") or (f"{res['seconds_median'] * 1e3:.2f} ms"
                                      + (f", {res['tokens_per_s']:,.0f} tok/s" if "tokens_per_s" in res else "")
                                      + (f", peak {res['peak_bytes'] / 2**30:.2f} GiB" if "peak_bytes" in res else ""))
        print(f"  {part} {key}: {detail} [{res['item_wall_s']} s]", flush=True)
        save()

    fla_model_item = ("models", "fla_gdn_hybrid", lambda: train_model("fla", cfg, device), None)
    plan = [("models", "ours_hybrid", lambda: train_model("ours", cfg, device), None)]
    if refuses:  # the refusal comes after fla's forward autotuning (minutes): recorded last
        plan.append(("models", "fla_gdn_hybrid_guard_bypassed", lambda: train_model("fla", cfg, device, bypass=True),
                     None))
    else:
        plan.append(fla_model_item)
    plan.append(("models", "ours_hybrid_fwpkm", lambda: train_model("ours_fwpkm", cfg, device), None))
    plan += [("kernels", key, thunk, meta)
             for key, meta, thunk in kernel_items(cfg, device, fla_ok or device.type == "cpu", refuses)]
    for batch in (1, 8):
        for impl in ("ours", "lucidrains"):
            def thunk(impl=impl, batch=batch):
                step, n_params = fwpkm_layer_step(impl, cfg, batch, device)
                return {**step_timing(step, device, 1, max(2, cfg["repeat"] - 2)), "slow_parameters": n_params}

            plan.append(("fwpkm_layer", f"{impl}_B{batch}", thunk, {"B": batch, "T": cfg["seq_len"]}))
    if refuses:
        plan.append(("models", "ours_hybrid_fla_kernels_guard_bypassed",
                     lambda: train_model("ours_fla_bypassed", cfg, device, bypass=True), None))
        plan.append(fla_model_item)
    if a.items:
        globs = [g.strip() for g in a.items.split(",") if g.strip()]
        chosen = []
        for g in globs:
            chosen += [item for item in plan if fnmatch.fnmatch(f"{item[0]}/{item[1]}", g) and item not in chosen]
        plan = chosen
    rec["items_planned"] = [f"{part}/{key}" for part, key, _, _ in plan]
    for part, key, thunk, meta in plan:
        run(part, key, thunk, meta)
    save(final=True)
    print(json.dumps(rec["ratios"], indent=1), flush=True)
    print(f"wrote {path}; wall {rec['wall_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
