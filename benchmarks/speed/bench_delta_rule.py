"""Delta rule speed and memory: chunkwise form vs the per-step loop (CPU), and vs flash-linear-attention (GPU).

CPU (default): forward+backward at B=1, T=2048, H=4, D=64, fp32, for the delta rule and the gated
delta rule: ``delta_rule`` (chunkwise WY form with the chunk-recomputing backward, C=64) against
``delta_rule_recurrent`` (the per-step loop autograd differentiates, which stores every state).
Memory of forward+backward, two ways:
  * bytes autograd saves for backward (saved-tensor hooks; exact and noise-free), T = 512..4096;
  * peak resident memory growth of a fresh process (VmHWM) around one forward+backward, across
    T (at D=64) and across D (at T=1024), to show the growth with T*D (ours) vs T*D^2 (loop).

Against flash-linear-attention on the CPU (same run, T = 512, 1024, 2048, B=1, H=4, D=64, fp32, one thread):
fla's pure-PyTorch chunked forms, the only ones of its that run without Triton, at chunk 16, 32 and 64 --
``delta_rule_chunkwise`` (fla/ops/delta_rule/naive.py, [B, H, T, D]) and ``naive_chunk_gated_delta_rule``
(fla/ops/gated_delta_rule/naive.py; with g = 0 for the plain rule) -- forward+backward through autograd, against
``delta_rule`` (backend "torch", C=64). Recorded per T: every timing, fla's fastest, and the ratio
fla_fastest / ours (median and minimum, process CPU time and wall). fla is loaded from wherever ``fla`` is
importable (its package ``__init__`` needs Triton, so the two naive files are loaded directly; they need
einops); without it the record says so. For example, fla-core 0.6.0 installed apart from the project:

    .venv/bin/python -m pip install --no-deps --target runs/peers/fla fla-core==0.6.0 einops
    PYTHONPATH=runs/peers/fla OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speed/bench_delta_rule.py

GPU (``--device cuda``): B=8, T=4096, H=16, D=128, bf16, forward+backward of ours (backend "torch" and
"auto") and fla's ``chunk_delta_rule`` when installed, as time ratios, with peak CUDA memory.

Writes ``benchmarks/results/bench_delta_rule.json`` (or ``bench_delta_rule_cuda.json``).

    .venv/bin/python benchmarks/speed/bench_delta_rule.py               # CPU (a few minutes)
    .venv/bin/python benchmarks/speed/bench_delta_rule.py --device cuda # GPU, when one is there
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from fastweights.evidence.result_files import write_result
from fastweights.cli.script_parser import ScriptParser, exit_status_of
from fastweights.core.compare import relative_error
from fastweights.core.threads import use_threads
from fastweights.evidence.script_args import benchmark_threads_flag
from fastweights.evidence.timing import WALL_AND_CPU, interleaved_samples, samples, upper_median
import torch
import torch.nn.functional as F

from fastweights.experiments.fla_comparison import FLA_CHUNKS, FLA_FILES, fla_candidates, load_fla_cpu
from fastweights.ops.delta_rule import delta_rule, delta_rule_recurrent, fla_available
from fastweights.testing.memory_use import peak_rss_growth, saved_bytes


def make_inputs(b, t, h, d, *, device="cpu", dtype=torch.float32, gated=False, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(b, t, h, d, generator=g)
    k = F.normalize(torch.randn(b, t, h, d, generator=g), dim=-1)
    v = torch.randn(b, t, h, d, generator=g)
    beta = torch.rand(b, t, h, generator=g)
    xs = [x.to(device=device, dtype=dtype) for x in (q, k, v, beta)]
    log_decay = (-torch.rand(b, t, h, generator=g) * 0.1).to(device) if gated else None
    return [x.requires_grad_() for x in xs], log_decay


def fwd_bwd(fn, xs, log_decay, **kw):
    for x in xs:
        x.grad = None
    o, _ = fn(*xs, log_decay=log_decay, **kw)
    o.float().pow(2).mean().backward()


def median_time(fn, repeat, warmup=1, sync=None):
    """Median wall seconds per call, and all (wall, process-CPU) pairs.

    On a shared CPU the process CPU time (one thread) is the less noisy of the two.
    """
    times = samples(fn, repeat, warmup, WALL_AND_CPU, sync)
    return upper_median(t for t, _ in times), times


def stats(times) -> dict:
    """Median and minimum of wall and process-CPU seconds. On a shared machine interference only adds
    time, so the minimum is the most faithful estimate of the cost; both are reported."""
    walls, cpus = sorted(t for t, _ in times), sorted(c for _, c in times)
    return {"wall_min_s": walls[0], "wall_median_s": walls[len(walls) // 2],
            "cpu_min_s": cpus[0], "cpu_median_s": cpus[len(cpus) // 2], "all_wall_cpu_s": times}


def saved_bytes_of(impl, t, d=64, h=4):
    """Bytes autograd saves for backward in one forward of ``impl`` at T = ``t`` (then the backward, outside)."""
    xs, _ = make_inputs(1, t, h, d)
    fn = delta_rule if impl == "chunked" else delta_rule_recurrent
    out = []
    nbytes = saved_bytes(lambda: out.append(fn(*xs)[0]))
    out[0].sum().backward()
    return nbytes


def rss_child(impl, t, d, h=4):
    """Run in a fresh process: peak RSS growth (bytes) around one forward+backward (``peak_rss_growth``)."""
    use_threads("benchmark", 1)
    fn = delta_rule if impl == "chunked" else delta_rule_recurrent
    warm, _ = make_inputs(1, 64, h, d)
    fwd_bwd(fn, warm, None)  # load kernels and allocator pools first
    xs, _ = make_inputs(1, t, h, d)
    print(json.dumps({"peak_rss_growth_bytes": peak_rss_growth(lambda: fwd_bwd(fn, xs, None))}))


def rss_growth(impl, t, d):
    out = subprocess.run([sys.executable, __file__, "--rss-child", impl, str(t), str(d)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_growth_bytes"]


FLA_SEQ_LENS = (512, 1024, 2048)


def vs_fla_cpu(args) -> dict:
    """Ours against fla's fastest CPU form per T, forward+backward, all candidates timed round-robin."""
    mods, info = load_fla_cpu()
    if mods is None:
        print(f"fla CPU comparison not performed: {info['reason']}", flush=True)
        return {"performed": False, **info}
    b, h, d = 1, 4, 64
    by_t = {}
    for t in args.fla_seq_lens:
        row = {}
        for gated in (False, True):
            xs, g = make_inputs(b, t, h, d, gated=gated)
            if g is None:
                g_in = torch.zeros(b, t, h)  # the gated form with g = 0 is the plain rule
            else:
                g_in = g.clone().requires_grad_()
                g = g_in
            bh_layout = [x.detach().transpose(1, 2).contiguous().requires_grad_() for x in xs]  # [B, H, T, (D)]

            def run(fn, inputs, g_arg):
                for x in (*inputs, g_arg):
                    if x is not None:
                        x.grad = None
                o = fn(*inputs, g_arg)
                o.float().pow(2).mean().backward()
                return o

            def ours(q, k, v, be, gg):
                return delta_rule(q, k, v, be, log_decay=gg, backend="torch")[0]

            fns = {"ours": lambda xs=xs, g=g: run(ours, xs, g)}
            with torch.no_grad():
                ref = delta_rule(*xs, log_decay=g, backend="torch")[0]
            agreement = {}
            for name, (fn, bhtd) in fla_candidates(mods, gated).items():
                inputs, ld = (bh_layout, g_in) if bhtd else (xs, g_in)
                fns["fla_" + name] = lambda fn=fn, inputs=inputs, ld=ld: run(fn, inputs, ld)
                with torch.no_grad():
                    o = fn(*[x.detach() for x in inputs], ld.detach())
                o = o.transpose(1, 2) if bhtd else o
                agreement["fla_" + name] = relative_error(o, ref)
            times = interleaved_samples(fns, args.fla_repeat)  # one warm-up call each, then round-robin
            st = {name: stats(v) for name, v in times.items()}
            fla_names = [n for n in st if n != "ours"]
            fastest = min(fla_names, key=lambda n: st[n]["cpu_median_s"])
            ratio = {stat: min(st[n][f"{stat}_s"] for n in fla_names) / st["ours"][f"{stat}_s"]
                     for stat in ("cpu_median", "wall_median", "cpu_min", "wall_min")}
            name = "gated_delta" if gated else "delta"
            row[name] = {"times": st, "fla_fastest_by_cpu_median": fastest,
                         "ratio_fla_fastest_over_ours": ratio, "fla_output_rel_err_vs_ours": agreement}
            print(f"T={t} {name}: ours {st['ours']['cpu_median_s'] * 1e3:.1f} ms cpu median, fla fastest "
                  f"({fastest}) {st[fastest]['cpu_median_s'] * 1e3:.1f} ms: {ratio['cpu_median']:.2f}x cpu, "
                  f"{ratio['wall_median']:.2f}x wall", flush=True)
        by_t[t] = row
    return {
        "performed": True, "fla": info, "files": {k: f"fla/{v}" for k, v in FLA_FILES.items()},
        "shape": {"B": b, "H": h, "D": d, "dtype": "float32", "threads": torch.get_num_threads()},
        "ours": "delta_rule(..., backend='torch'), chunk 64",
        "fla_chunks": list(FLA_CHUNKS), "repeats": args.fla_repeat,
        "by_T": by_t,
        "rule": "ratio = fla's fastest candidate (each statistic's own minimum over fla's forms and chunk sizes) / "
                "ours, forward+backward of mean(o^2) through every input; the target is >= 3 at T=2048",
        "target_3x_at_T2048": {k: min(v["ratio_fla_fastest_over_ours"]["cpu_median"],
                                      v["ratio_fla_fastest_over_ours"]["wall_median"]) >= 3
                               for k, v in by_t.get(2048, {}).items()},
    }


def cpu_benchmark(args) -> dict:
    use_threads("benchmark", args.threads)
    b, t, h, d = 1, args.seq_len, 4, 64
    speed = {}
    for gated in (False, True):
        name = "gated_delta" if gated else "delta"
        xs, g = make_inputs(b, t, h, d, gated=gated)
        row = {}
        for chunk in (64, 32):
            _, times = median_time(lambda: fwd_bwd(delta_rule, xs, g, chunk_size=chunk, backend="torch"), args.repeat)
            row[f"chunked_C{chunk}_fwd_bwd"] = stats(times)
        _, times = median_time(lambda: fwd_bwd(delta_rule_recurrent, xs, g), args.loop_repeat, warmup=0)
        row["per_step_fwd_bwd"] = stats(times)
        with torch.no_grad():
            _, times = median_time(lambda: delta_rule(*xs, log_decay=g, backend="torch"), args.repeat)
            row["chunked_C64_fwd"] = stats(times)
            _, times = median_time(lambda: delta_rule_recurrent(*xs, log_decay=g), args.loop_repeat, warmup=0)
            row["per_step_fwd"] = stats(times)
        loop = row["per_step_fwd_bwd"]
        row["speedup_fwd_bwd"] = {
            f"C{chunk}_{stat}": loop[f"{stat}_s"] / row[f"chunked_C{chunk}_fwd_bwd"][f"{stat}_s"]
            for chunk in (64, 32) for stat in ("cpu_min", "wall_min", "cpu_median", "wall_median")
        }
        row["speedup_fwd_C64"] = {stat: row["per_step_fwd"][f"{stat}_s"] / row["chunked_C64_fwd"][f"{stat}_s"]
                                  for stat in ("cpu_min", "wall_min", "cpu_median", "wall_median")}
        sp = row["speedup_fwd_bwd"]
        print(f"{name}: fwd+bwd per-step {loop['cpu_min_s'] * 1e3:.0f} ms cpu; chunked C=64 "
              f"{row['chunked_C64_fwd_bwd']['cpu_min_s'] * 1e3:.0f} ms ({sp['C64_cpu_min']:.1f}x cpu, "
              f"{sp['C64_wall_min']:.1f}x wall), C=32 {row['chunked_C32_fwd_bwd']['cpu_min_s'] * 1e3:.0f} ms "
              f"({sp['C32_cpu_min']:.1f}x cpu, {sp['C32_wall_min']:.1f}x wall)", flush=True)
        speed[name] = row

    saved = {"chunked": {}, "per_step": {}}
    for tt in (512, 1024, 2048, 4096):
        saved["chunked"][tt] = saved_bytes_of("chunked", tt)
        if tt <= 2048:
            saved["per_step"][tt] = saved_bytes_of("per_step", tt)
    state_bytes_per_step = h * d * d * 4
    rss = {"by_T_at_D64": {"chunked": {}, "per_step": {}}, "by_D_at_T1024": {"chunked": {}, "per_step": {}}}
    if not args.skip_rss:
        for tt in (512, 1024, 2048, 4096):
            rss["by_T_at_D64"]["chunked"][tt] = rss_growth("chunked", tt, 64)
            if tt <= 2048:
                rss["by_T_at_D64"]["per_step"][tt] = rss_growth("per_step", tt, 64)
        for dd in (32, 64, 128):
            for impl in ("chunked", "per_step"):
                rss["by_D_at_T1024"][impl][dd] = rss_growth(impl, 1024, dd)
        print("peak RSS growth (MiB), T at D=64:",
              {k: {tt: round(v / 2**20, 1) for tt, v in row.items()} for k, row in rss["by_T_at_D64"].items()})
        print("peak RSS growth (MiB), D at T=1024:",
              {k: {dd: round(v / 2**20, 1) for dd, v in row.items()} for k, row in rss["by_D_at_T1024"].items()})

    def slope(row):  # bytes per extra token between the smallest and largest T measured
        ts = sorted(row)
        return (row[ts[-1]] - row[ts[0]]) / (ts[-1] - ts[0])

    memory = {
        "saved_for_backward_bytes": saved,
        "saved_bytes_per_token": {k: slope(v) for k, v in saved.items()},
        "one_state_per_step_bytes_per_token": state_bytes_per_step,
        "peak_rss_growth_bytes": rss,
        "notes": "saved_for_backward: storages autograd keeps between forward and backward (B=1, H=4, D=64, "
                 "fp32). per_step keeps every [H, D, D] state (~H*D*D*4 bytes per token); chunked keeps the inputs "
                 "and one state per chunk of 64. peak_rss_growth: max RSS of a fresh process during one "
                 "forward+backward minus before it (includes transient intra-chunk matrices of size T*C).",
    }
    if rss["by_T_at_D64"]["chunked"]:
        memory["peak_rss_bytes_per_token_D64"] = {k: slope(v) for k, v in rss["by_T_at_D64"].items() if v}
    return {
        "device": "cpu",
        "shape": {"B": b, "T": t, "H": h, "D": d, "dtype": "float32", "chunk_size": 64},
        "speed": speed,
        "acceptance_speedup_at_least_20x": {
            "rule": "per-step loop vs chunked (C=64, the op default), forward+backward, minimum over repeats of "
                    "process CPU time and of wall time; both must be >= 20",
            **{k: min(v["speedup_fwd_bwd"]["C64_cpu_min"], v["speedup_fwd_bwd"]["C64_wall_min"]) >= 20
               for k, v in speed.items()},
        },
        "memory": memory,
        "vs_fla_cpu": {"performed": False, "reason": "--skip-fla"} if args.skip_fla else vs_fla_cpu(args),
        "gpu": {"performed": False,
                "reason": "no GPU in this run; run `benchmarks/speed/bench_delta_rule.py --device cuda` on a CUDA machine"},
        "note": "shared 2-core machine: other engineers' jobs ran at the same time. Times are the minimum and "
                "median over repeats of wall clock and of process CPU time (one torch thread); the ratios, "
                "measured in the same run, are what matter.",
    }


def cuda_benchmark(args) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    b, t, h, d = 8, 4096, 16, 128
    sync = torch.cuda.synchronize
    result = {"device": torch.cuda.get_device_name(), "shape": {"B": b, "T": t, "H": h, "D": d, "dtype": "bfloat16"},
              "fla_available": fla_available(), "runs": {}}
    impls = {"ours_torch": dict(backend="torch"), "ours_auto": dict(backend="auto")}
    if fla_available():
        from fla.ops.delta_rule import chunk_delta_rule

        impls["fla_chunk_delta_rule"] = None
    xs, _ = make_inputs(b, t, h, d, device="cuda", dtype=torch.bfloat16)
    for name, kw in impls.items():
        if kw is None:
            def fn(q, k, v, beta, log_decay=None):
                return chunk_delta_rule(q, k, v, beta)
        else:
            def fn(*a, _kw=kw, **k):
                return delta_rule(*a, **k, **_kw)
        torch.cuda.reset_peak_memory_stats()
        secs, all_s = median_time(lambda: fwd_bwd(fn, xs, None), args.repeat, warmup=2, sync=sync)
        result["runs"][name] = {"fwd_bwd_s": secs, "all_s": all_s,
                                "peak_cuda_memory_bytes": torch.cuda.max_memory_allocated()}
        print(f"{name}: {secs * 1e3:.2f} ms fwd+bwd", flush=True)
    if "fla_chunk_delta_rule" in result["runs"]:
        ref = result["runs"]["fla_chunk_delta_rule"]["fwd_bwd_s"]
        result["time_ratio_vs_fla"] = {k: v["fwd_bwd_s"] / ref for k, v in result["runs"].items()}
    return result


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py)."""
    return [probes.probe("ops", op="delta_rule"), probes.probe("ops", op="gated_delta_rule")]



def main() -> int:
    p = ScriptParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    benchmark_threads_flag(p)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--loop-repeat", type=int, default=3)
    p.add_argument("--skip-rss", action="store_true", help="skip the subprocess peak-RSS measurements")
    p.add_argument("--skip-fla", action="store_true", help="skip the comparison with fla's CPU forms")
    p.add_argument("--fla-repeat", type=int, default=9, help="repeats of each form in the fla comparison")
    p.add_argument("--fla-seq-lens", type=lambda s: [int(x) for x in s.split(",")], default=list(FLA_SEQ_LENS),
                   help="sequence lengths of the fla comparison (default 512,1024,2048)")
    p.add_argument("--rss-child", nargs=3, metavar=("IMPL", "T", "D"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rss_child:
        impl, t, d = args.rss_child
        rss_child(impl, int(t), int(d))
        return 0
    if args.device == "cuda":
        write_result("bench_delta_rule_cuda", cuda_benchmark(args))
    else:
        write_result("bench_delta_rule", cpu_benchmark(args))
    return 0


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
