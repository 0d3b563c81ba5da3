"""Record a `make demo` run (its runs/demo/demo.json) as a benchmark result with the command that made it.

    /usr/bin/time make demo && python benchmarks/quality/demo_record.py --wall-seconds 345

The demo trains a fixed number of steps (fastweights.experiments.demo.DEMO_STEPS) on the cores idle at its
start, so its model does not depend on the machine's load; its times do: record a run on an idle machine (the
record keeps the load average). Writes benchmarks/results/demo.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fastweights.evidence.result_files import write_result
from fastweights.cli.script_parser import ScriptParser, exit_status_of


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py)."""
    config = probes.preset_model_config("shakespeare-char")  # the demo's model (fastweights/experiments/demo.py)
    return probes.model_probes(config) + [probes.probe("dynamic", config=config, rule="rms-global-prior")]



def main():
    ap = ScriptParser()
    ap.add_argument("--run", default="runs/demo")
    ap.add_argument("--wall-seconds", type=float, required=True, help="measured wall time of the whole demo command")
    ap.add_argument("--busy-run", help="the same command's output folder from a run on a busy machine (the same "
                                       "model is expected: same steps, validation within 0.01 bits/char)")
    ap.add_argument("--busy-what", default="", help="what kept the machine busy during --busy-run")
    ap.add_argument("--fresh-clone-seconds", type=float,
                    help="measured wall time of `make demo` in a fresh clone (creating .venv and installing included)")
    a = ap.parse_args()
    demo = json.loads((Path(a.run) / "demo.json").read_text())
    busy = json.loads((Path(a.busy_run) / "demo.json").read_text()) if a.busy_run else None
    res = {"demo_command": ".venv/bin/python -m fastweights demo --out runs/demo  (what `make demo` runs)",
           "demo": demo, "demo_wall_seconds": a.wall_seconds,
           "headline": [
               {"what": f"`make demo`: validation bits/char after its {demo['train_steps']:,} training steps "
                        f"({demo['train_threads']} CPU threads, {demo['train_seconds']:.0f} s)",
                "value": round(demo["val_bits_per_char"], 3), "unit": "bits/char", "target": "<= 2.15"},
               {"what": "`make demo`: test split bits/char (streamed, state carried)",
                "value": round(demo["test_bits_per_char"], 3), "unit": "bits/char"},
               {"what": "`make demo`: dynamic evaluation (rms-global-prior) relative reduction on test text",
                "value": round(demo["dynamic_eval"]["relative_improvement"], 3), "target": ""},
               {"what": "`make demo`: whole command wall time (environment already made; training, evaluation, "
                        "dynamic evaluation, sample)", "value": round(a.wall_seconds), "unit": "s", "target": "<= 480"},
           ]}
    if a.fresh_clone_seconds is not None:
        res["headline"].append({"what": "`make demo` in a fresh clone, end to end: .venv created and installed (pip's "
                                        "download cache already filled), then the demo", "value": round(a.fresh_clone_seconds),
                                "unit": "s"})
    if busy is not None:
        res["busy_run"] = {"demo": busy, "what_kept_it_busy": a.busy_what}
        res["headline"] += [
            {"what": f"`make demo` on a busy machine ({a.busy_what}): validation bits/char minus the idle run's "
                     f"({busy['train_steps']:,} steps both; {busy['train_threads']} thread(s), "
                     f"{busy['train_seconds']:.0f} s of training)",
             "value": round(busy["val_bits_per_char"] - demo["val_bits_per_char"], 4), "unit": "bits/char",
             "target": "within 0.01"}]
    write_result("demo", res)


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
