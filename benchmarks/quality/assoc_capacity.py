"""Capacity sweep of the synthetic associative retrieval task (Schlag et al. 2021, sec. 6.1), CPU-sized.

Runs the points the paper's claims rest on, one training run each (seed 1, paper hyper-parameters,
stopping rule included) but capped at ``--max-steps`` / ``--max-minutes`` per run so the whole sweep
fits a shared 2-core CPU:

  setting 1 (capacity):   sum/elu1 (d_dot 64) and sum/dpfp1 (d_dot 128) at S = 20, 40, 60, 80, 100
  setting 2 (overwrites): sum/dpfp1, delta/dpfp1 and delta/elu1 at S = 20, 40, 60

Writes ``benchmarks/results/assoc_capacity.json`` (command, machine, every run with its eval history,
the paper's logged values for comparison, and the acceptance checks computed from the measured
numbers) and one PNG per setting. Progress is saved after every run; re-running resumes (runs whose
configuration is already in the JSON are skipped) unless ``--fresh``.

    .venv/bin/python benchmarks/quality/assoc_capacity.py            # the sweep (tens of minutes)
    .venv/bin/python benchmarks/quality/assoc_capacity.py --tiny     # a smoke test of the script (seconds)
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from fastweights.evidence.provenance import machine as machine_info
from fastweights.evidence.result_files import provenance
from fastweights.cli.script_parser import ScriptParser, exit_status_of
from fastweights.core.threads import use_threads
from fastweights.evidence.script_args import benchmark_threads_flag

from fastweights.tasks.assoc import AssocConfig, plot_capacity, train_assoc

RESULTS = Path(__file__).resolve().parents[1] / "results"

SWEEP = [
    # (setting, rule, feature_map, nu, keys)
    *[(1, "sum", "elu1", 1, s) for s in (20, 40, 60, 80, 100)],
    *[(1, "sum", "dpfp", 1, s) for s in (20, 40, 60, 80, 100)],
    *[(2, rule, fm, 1, s) for rule, fm in (("sum", "dpfp"), ("delta", "dpfp"), ("delta", "elu1"))
      for s in (20, 40, 60)],
]

# Last logged eval losses in ischlag/fast-weight-transformers/synthetic/logs (read from the logs, as
# quoted in the project's method spec); for comparison only, not measured here.
PAPER_LOGS = {
    "setting1 sum/elu1": {"S=60": 0.025, "S=100": 0.172},
    "setting1 sum/dpfp1": {"S=60": 0.000, "S=100": 0.000},
    "setting2 sum/dpfp1": {"S=60": 0.123},
    "setting2 delta/dpfp1": {"S=60": 0.006},
    "setting2 delta/elu1": {"S=60": 0.001},
}


def machine() -> dict:
    info = machine_info()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        info["cpu_model"] = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info["note"] = "shared machine: other engineers ran jobs on the same 2 cores; wall times are noisy"
    return info


def key_of(r: dict) -> tuple:
    return (r["setting"], r["rule"], r["feature_map"], r["nu"], r["keys"], r["max_steps"], r["max_minutes"])


def find(results: list[dict], setting: int, label: str, keys: int) -> dict | None:
    return next((r for r in results if r["setting"] == setting and r["label"] == label and r["keys"] == keys), None)


def acceptance(results: list[dict]) -> dict:
    """The issue's acceptance, evaluated on the measured final eval losses."""
    out = {}
    elu = {s: find(results, 1, "sum/elu1", s) for s in (20, 40, 60, 80, 100)}
    dp60 = find(results, 1, "sum/dpfp1", 60)
    if all(elu.values()) and dp60:
        knee = next((s for s, r in elu.items() if r["final_eval_loss"] > 0.01), None)
        out["setting1_sum_elu1_fails_before_S100"] = {
            "final_loss_by_S": {s: r["final_eval_loss"] for s, r in elu.items()},
            "first_S_with_loss_above_0.01": knee,
            "pass": knee is not None and knee < 100 and elu[100]["final_eval_loss"] > 0.05,
        }
        out["setting1_sum_dpfp1_solves_S60"] = {
            "final_loss": dp60["final_eval_loss"],
            "pass": dp60["final_eval_loss"] <= 0.01,
        }
    s_sum, s_delta = find(results, 2, "sum/dpfp1", 60), find(results, 2, "delta/dpfp1", 60)
    if s_sum and s_delta:
        out["setting2_delta_below_sum_at_S60"] = {
            "sum_dpfp1": s_sum["final_eval_loss"],
            "delta_dpfp1": s_delta["final_eval_loss"],
            "ratio_sum_over_delta": s_sum["final_eval_loss"] / max(s_delta["final_eval_loss"], 1e-12),
            "pass": s_delta["final_eval_loss"] < 0.5 * s_sum["final_eval_loss"],
        }
    return out


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py)."""
    # the retrieval model of every (rule, feature map) the sweep trains, and the task's sampler
    runs = {(rule, fm, setting) for setting, rule, fm, _, _ in SWEEP}
    return ([probes.probe("assoc_model", rule=r, feature_map=fm, setting=st) for r, fm, st in sorted(runs)]
            + [probes.probe("task", name="assoc")])



def main() -> int:
    p = ScriptParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-steps", type=int, default=3000, help="per run (the paper: 100k, stopping earlier)")
    # 0 (none) by default since issue 22: a wall-clock cap under load stopped the S=60 delta/DPFP run early
    # and made its 24.8x ratio a property of the machine's load; quality runs use the step cap only
    p.add_argument("--max-minutes", type=float, default=0.0, help="per-run wall-clock cap (0 = none)")
    benchmark_threads_flag(p)
    p.add_argument("--tiny", action="store_true", help="the dry run: a tiny smoke run of the script (not a measurement)")
    p.add_argument("--fresh", action="store_true", help="ignore results already in the JSON")
    p.add_argument("--out", default=str(RESULTS / "assoc_capacity.json"))
    args = p.parse_args()
    use_threads("benchmark", args.threads)
    out = Path(args.out)
    sweep = SWEEP
    if args.tiny:
        sweep = [(1, "sum", "elu1", 1, 4), (1, "sum", "elu1", 1, 6), (2, "delta", "dpfp", 1, 4),
                 (2, "sum", "dpfp", 1, 4)]
        args.max_steps, out = 30, out.with_name(out.stem + "_tiny.json")
    results: list[dict] = []
    if out.exists() and not args.fresh:
        results = json.loads(out.read_text()).get("runs", [])
    done = {key_of(r) for r in results}
    base = AssocConfig(max_steps=args.max_steps, max_minutes=args.max_minutes)
    started = time.perf_counter()
    for setting, rule, fm, nu, s in sweep:
        cfg = dataclasses.replace(base, setting=setting, rule=rule, feature_map=fm, nu=nu, keys=s)
        if key_of(dataclasses.asdict(cfg)) in done:
            continue
        r = train_assoc(cfg, progress=True)
        print(f"setting {setting} {r['label']:<12} S={s:<4} final {r['final_eval_loss']:.4f} "
              f"({r['steps']} steps, {r['stopped']}, {r['seconds']:.0f}s)", flush=True)
        results.append(r)
        write(out, args, results, time.perf_counter() - started)
    write(out, args, results, time.perf_counter() - started)
    for setting in (1, 2):
        rows = [r for r in results if r["setting"] == setting]
        if rows:
            plot_capacity(rows, out.with_name(f"{out.stem}_setting{setting}.png"),
                          title=f"associative retrieval, setting {setting} (CPU-sized sweep)")
    print(json.dumps(acceptance(results), indent=2))
    return 0


def write(out: Path, args, results: list[dict], seconds: float) -> None:
    report = {
        "benchmark": "assoc_capacity",
        **provenance(),  # command, date, git commit and dirty flag
        "machine": machine(),
        "protocol": {
            "paper": "Schlag, Irie, Schmidhuber 2021, sec. 6.1 (ischlag/fast-weight-transformers/synthetic)",
            "per_run_caps": {"max_steps": args.max_steps, "max_minutes": args.max_minutes},
            "otherwise_as_paper": "Adam lr 1e-3, batch 32, hidden 64, eval every 100 steps on 20 sequences, "
                                  "stop at eval loss <= 0.001 or > 10 evals without improvement, seed 1",
            "metric": "final_eval_loss = the last logged eval loss of the run",
        },
        "sweep_seconds_this_invocation": round(seconds, 1),
        "runs": results,
        "paper_logged_values_for_comparison": PAPER_LOGS,
        "acceptance": acceptance(results),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(out)


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
