"""How far each CPU path is from the machine's GEMM limit: the fp32 GEMMs of a training step of the demo model and of
SmolLM2-135M's scoring, on torch's kernel, on oneDNN's and on the route :mod:`fastweights.ops.linear` chooses, and
the share of each training preset's step spent in GEMMs.

    python benchmarks/speed/gemm_ceiling.py [--threads 1] [--rounds 5]

Per shape and product (forward x W^T, input grad g W, weight grad g^T x): GFLOP/s of each kernel (the best of
``--rounds`` interleaved rounds, each the best of several calls) and of the chosen route, which must be within 10%
of the best kernel (``route_within_10pct``). Per preset (``shakespeare-char`` is the demo's): seconds per training
step (forward, backward, AdamW) with every linear on torch's kernel and on the chosen route, and the share of the
step that the profiler puts in GEMM ops. Writes ``benchmarks/results/gemm_ceiling.json``.
"""

from __future__ import annotations

import os
import platform
import sys
import time

import torch

from fastweights.core.config import make_config
from fastweights.evidence.result_files import write_result
from fastweights.cli.script_parser import ScriptParser, exit_status_of
from fastweights.core.threads import use_threads
from fastweights.evidence.script_args import benchmark_threads_flag
from fastweights.evidence.timing import bench_clock, op_shares, timed_rounds, upper_median
from fastweights.loops.schedule import make_optimizer
from fastweights.models.lm import LanguageModel
from fastweights.ops import linear as lin

DEMO = "shakespeare-char"
# (name, M, K, N) of SmolLM2-135M's linears for one 64-token scoring segment (its config: d 576, 9 heads and 3 KV
# heads of 64, MLP 1,536, vocabulary 49,152); the demo's are read off its model (demo_shapes)
SMOLLM2_SHAPES = [
    ("smollm2.q_o", 64, 576, 576), ("smollm2.k_v", 64, 576, 192), ("smollm2.gate_up", 64, 576, 1536),
    ("smollm2.down", 64, 1536, 576), ("smollm2.head", 64, 576, 49152),
]
PRESETS = [DEMO, "shakespeare-char-fwl", "shakespeare-char-fwp-delta-dpfp", "longdocs-fwpkm"]
# A step on the route "nothing slower" than on torch's kernel: the median ratio over rounds at least this (with the
# same kernels on both sides, 9 rounds on a 2-core Intel Xeon gave per-round ratios of 0.85-1.17, medians 0.99-1.0)
LEVEL = 0.98


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code measured: the presets' models (their linears among them)."""
    return [spec for preset in PRESETS for spec in probes.preset_probes(preset)]


def demo_shapes() -> list[tuple]:
    """(name, M, K, N) of each distinct linear of the demo's model at its batch: M = batch x sequence length."""
    cfg = make_config(DEMO, ["model.vocab_size=65"])
    model = LanguageModel(cfg.model)
    m = cfg.train.batch_size * cfg.train.seq_len
    shapes = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            shapes.setdefault((module.in_features, module.out_features), f"demo.{name.split('.')[-1]}")
    shapes.setdefault((cfg.model.d_model, cfg.model.vocab_size), "demo.head")  # the head (tied to the embedding)
    return [(name, m, k, n) for (k, n), name in shapes.items()]


def gemm_table(rounds: int) -> list[dict]:
    """GFLOP/s of every product on every kernel (``ops.linear.measure``: the kernels in turn, best of ``rounds``),
    and of the kernel the route chose."""
    rows = []
    for name, m, k, n in demo_shapes() + SMOLLM2_SHAPES:
        chosen = lin.kernels_for(m, k, n, False)
        seconds = lin.measure(m, k, n, False, rounds=rounds)
        for i, product in enumerate(lin.PRODUCTS):
            gflops = {kern: 2 * m * k * n / t / 1e9 for kern, t in seconds[product].items()}
            route = gflops[chosen[i]]
            rows.append({"shape": name, "M": m, "K": k, "N": n, "product": product, "gflops": gflops,
                         "route_kernel": chosen[i], "route_gflops": route,
                         "route_over_best": route / max(gflops.values()),
                         "route_within_10pct": route >= 0.9 * max(gflops.values())})
            print(f"{name:18s} {product:12s} " + " ".join(f"{k}={v:6.1f}" for k, v in gflops.items())
                  + f"  route={chosen[i]}")
    return rows


def preset_step(preset: str, route: str) -> tuple:
    """A training step of ``preset``'s model at its batch and sequence length (random characters)."""
    cfg = make_config(preset, ["model.vocab_size=65"])
    torch.manual_seed(0)
    model = LanguageModel(cfg.model)
    opt = make_optimizer(model, cfg.train)
    x = torch.randint(0, 65, (cfg.train.batch_size, cfg.train.seq_len + 1))

    def step():
        os.environ["FASTWEIGHTS_LINEAR"] = route
        out = model(x[:, :-1], targets=x[:, 1:])
        loss = out.loss if out.aux_loss is None else out.loss + out.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step, cfg.train.batch_size * cfg.train.seq_len


def preset_table(rounds: int, repeat: int) -> list[dict]:
    clock, _ = bench_clock("cpu")
    rows = []
    for preset in PRESETS:
        steps = {route: preset_step(preset, route) for route in ("torch", "auto")}
        tokens = steps["torch"][1]
        times = timed_rounds({route: step for route, (step, _) in steps.items()}, rounds, repeat, clock)
        sec = {route: upper_median(v) for route, v in times.items()}
        ratios = [a / b for a, b in zip(times["torch"], times["auto"])]
        row = {"preset": preset, "tokens_per_step": tokens, "seconds_per_step": sec,
               "tokens_per_s": {r: tokens / s for r, s in sec.items()},
               "route_speedup_over_torch": upper_median(ratios), "route_speedup_per_round": ratios,
               "gemm_share": {route: op_shares(step)["gemm"] for route, (step, _) in steps.items()}}
        rows.append(row)
        print(row)
    os.environ.pop("FASTWEIGHTS_LINEAR", None)
    return rows


def main():
    ap = ScriptParser(description=__doc__.split("\n\n")[0])
    benchmark_threads_flag(ap)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per GEMM and per preset")
    ap.add_argument("--repeat", type=int, default=3, help="timed training steps per preset and route per round")
    a = ap.parse_args()
    use_threads("benchmark", a.threads)
    t0 = time.time()
    gemms = gemm_table(a.rounds)
    presets = preset_table(a.rounds, a.repeat)
    best = max(max(r["gflops"].values()) for r in gemms)
    res = {"config": vars(a), "cpu": platform.processor() or platform.machine(),
           "onednn_available": lin.onednn_available(), "gemms": gemms, "presets": presets,
           "best_gflops_any_shape": best, "all_routes_within_10pct": all(r["route_within_10pct"] for r in gemms),
           "seconds": time.time() - t0}
    res["headline"] = [
        {"what": "chosen CPU linear / best kernel's GFLOP/s, the lowest over the listed shapes and products",
         "value": round(min(r["route_over_best"] for r in gemms), 3), "target": ">= 0.9"},
        *({"what": f"{r['preset']} training step, chosen route / torch's kernel (speed-up)",
           "value": round(r["route_speedup_over_torch"], 3), "target": f">= {LEVEL} (nothing slower)"} for r in presets),
    ]
    write_result("gemm_ceiling", res)


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
