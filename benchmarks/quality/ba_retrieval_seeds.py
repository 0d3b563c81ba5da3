"""Associative retrieval (Ba et al. 2016, section 4.1) at R = 20 hidden units, K = 4 keys, over seeds.

Trains the paper's task network with the fast-weights RNN and with an LSTM of the same size
(optionally the IRNN) for the same budget per run, one CPU thread each, and reports the test error
of every run, the mean and std per model, and the budget used (steps, examples, CPU seconds).
The acceptance this checks: fast weights at most 5% test error, the LSTM above 30% (the paper:
1.81% and 60.81%).

    python benchmarks/quality/ba_retrieval_seeds.py [--seeds 0 1 2] [--steps 45000] [--workers 2]

Output: benchmarks/results/ba_retrieval_seeds.json.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from fastweights.evidence.result_files import provenance
from fastweights.cli.script_parser import ScriptParser, exit_status_of
from fastweights.core.threads import use_threads
from fastweights.tasks.ba_retrieval import RetrievalNet, make_splits, train_retrieval


def one_run(job: dict) -> dict:
    use_threads("benchmark", 1)
    splits = make_splits(job["data_seed"], job["keys"])
    torch.manual_seed(job["seed"])
    net = RetrievalNet(job["model"], job["hidden"])
    cpu0 = time.process_time()
    result = train_retrieval(
        net,
        splits,
        steps=job["steps"],
        batch_size=job["batch_size"],
        lr=job["lr"],
        decay_fraction=job["decay_fraction"],
        grad_clip=job["grad_clip"],
        eval_every=job["eval_every"],
        target_val_error=job["target_val_error"],
        seed=job["seed"],
    )
    result["cpu_seconds"] = round(time.process_time() - cpu0, 1)
    result["parameters"] = sum(p.numel() for p in net.parameters())
    print(
        f"{job['model']:8s} seed {job['seed']}: test error {100 * result['test_error']:.2f}% "
        f"({result['steps']} steps, {result['cpu_seconds']}s CPU)",
        flush=True,
    )
    return {**job, **result}


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py)."""
    return [probes.probe("retrieval_net", model=m) for m in ("fast-rnn", "lstm")] + [probes.probe("task", name="ba_retrieval")]



def main() -> int:
    parser = ScriptParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["fast-rnn", "lstm"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--hidden", type=int, default=20)
    parser.add_argument("--keys", type=int, default=4)
    parser.add_argument("--steps", type=int, default=45_000, help="maximum Adam updates per run")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--decay-fraction", type=float, default=0.2, help="final fraction of --steps with linear decay to 0")
    parser.add_argument("--grad-clip", type=float, default=5.0)
    parser.add_argument("--eval-every", type=int, default=1000)
    parser.add_argument("--target-val-error", type=float, default=0.01, help="a run stops once validation error <= this")
    parser.add_argument("--data-seed", type=int, default=1234)
    parser.add_argument("--workers", type=int, default=1, help="runs in parallel (one thread each)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results" / "ba_retrieval_seeds.json")
    args = parser.parse_args()
    jobs = [
        {
            "model": model,
            "seed": seed,
            "hidden": args.hidden,
            "keys": args.keys,
            "steps": args.steps,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "decay_fraction": args.decay_fraction,
            "grad_clip": args.grad_clip,
            "eval_every": args.eval_every,
            "target_val_error": args.target_val_error,
            "data_seed": args.data_seed,
        }
        for model in args.models
        for seed in args.seeds
    ]
    wall0 = time.perf_counter()
    if args.workers > 1:
        with ProcessPoolExecutor(args.workers) as pool:
            runs = list(pool.map(one_run, jobs))
    else:
        runs = [one_run(job) for job in jobs]
    summary = {}
    for model in args.models:
        errs = [r["test_error"] for r in runs if r["model"] == model]
        summary[model] = {
            "test_error_per_seed": errs,
            "test_error_mean": statistics.mean(errs),
            "test_error_std": statistics.stdev(errs) if len(errs) > 1 else 0.0,
            "test_error_max": max(errs),
            "test_error_min": min(errs),
            "steps_per_seed": [r["steps"] for r in runs if r["model"] == model],
            "cpu_seconds_total": round(sum(r["cpu_seconds"] for r in runs if r["model"] == model), 1),
        }
    report = {
        **provenance(),  # command (relative paths), date, git commit and dirty flag, machine and load
        "task": f"associative retrieval, K={args.keys}, R={args.hidden}, splits 100k/10k/20k (data seed {args.data_seed})",
        "machine": {
            "cpu": next(
                (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                platform.processor(),
            )
            if os.path.exists("/proc/cpuinfo")
            else platform.processor(),
            "logical_cpus": os.cpu_count(),
            "torch_threads_per_run": 1,
            "workers": args.workers,
            "torch": torch.__version__,
            "note": "shared machine (other jobs ran at the same time): wall-clock times are inflated; "
            "cpu_seconds is the process CPU time of each run",
        },
        "budget": {
            "max_steps_per_run": args.steps,
            "batch_size": args.batch_size,
            "optimizer": f"Adam lr {args.lr}, linear decay to 0 over the last {args.decay_fraction:.0%} of the steps, "
            f"gradient-norm clip {args.grad_clip}",
            "early_stop": f"validation error <= {args.target_val_error} (checked every {args.eval_every} steps)",
            "selection": "test error at the parameters with the best validation error",
            "cpu_seconds_all_runs": round(sum(r["cpu_seconds"] for r in runs), 1),
            "wall_seconds_all_runs": round(time.perf_counter() - wall0, 1),
        },
        "paper_table1_R20": {"fast weights": 0.0181, "LSTM": 0.6081, "IRNN": 0.6211, "note": "unverified against the PDF"},
        "summary": summary,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for model, s in summary.items():
        print(f"{model:8s} test error {100 * s['test_error_mean']:.2f}% +- {100 * s['test_error_std']:.2f}% "
              f"(per seed {[round(100 * e, 2) for e in s['test_error_per_seed']]})")
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
