"""FwPKM on real long documents (issue 7): perplexity with and without FwPKM, the frozen-memory check
(Zhao & Jones 2026, App. D.2) and the addressing statistics with and without the addressing loss (App. D.3).

Models (presets configs/longdocs-swa.toml and configs/longdocs-fwpkm.toml, same backbone, data, split,
seed and number of steps): a character-level Transformer with 64-character sliding-window attention,

    swa                 no memory (the baseline)
    fwpkm-addressing    FwPKM at layers 1 and 3, keys updated by the addressing loss (eqs 16-18; the paper's default)
    fwpkm-mse           keys follow the gradient of the memorisation MSE instead (the paper's "w/o addr loss")
    fwpkm-none          keys never move (no key update at all; only the values are written)
    fwpkm-shared        as fwpkm-addressing, but one memory shared by the whole batch (persistence
                        "stream", the paper's training setup); the preset gives every sequence its own
                        memory ("per_sequence"), as scoring one document at a time does

trained on the State of the Union addresses (the bundled corpus ``state-of-the-union``, ``--data``) with a
*document* split: the held-out (test) addresses are whole documents that no training batch ever contains.

Evaluation streams every held-out document from a fresh state with the state carried through the
document (as ``fastweights eval``: calls of seq_len / 2 tokens, memory writes every chunk), so the memory
can carry what it read earlier in the address.  FwPKM models are scored with writes (normal) and
frozen (``FwPKM.frozen``: reads the initial tables, never writes; App. D.2); to save compute only
the main models (fwpkm-addressing, fwpkm-shared) get the frozen pass.  Addressing statistics
(collision, coverage, KLD; ``fastweights.experiments.addressing``) come from the slots read during the normal
held-out pass, per window of N / (H k) tokens (so a window makes about N reads, as the paper's
32K-token windows with N = 512^2 and top-8), averaged over windows, documents and the two FwPKM layers.

    OMP_NUM_THREADS=1 python benchmarks/quality/fwpkm_longdocs.py [--steps 1000] [--variants swa,fwpkm-addressing,...]
        [--data state-of-the-union] [--set SECTION.KEY=VALUE ...] [--runs DIR] [--name NAME]

``--train-only`` with disjoint ``--variants`` lets several processes train at once; a last call without
it then scores the saved checkpoints.

A run whose checkpoint already exists under --runs with the same configuration is reused (the JSON says
which were trained in this invocation).  Writes benchmarks/results/fwpkm_longdocs.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from fastweights.evidence.result_files import write_result
from fastweights.cli.script_parser import ScriptParser, exit_status_of
from fastweights.core.threads import use_threads
from fastweights.evidence.script_args import benchmark_threads_flag

from fastweights.models.loading import load_checkpoint
from fastweights.core.config import make_config
from fastweights.data import load_corpus, split_corpus
from fastweights.experiments.fwpkm_documents import EARLY, addressing, memory_layers, score_documents
from fastweights.loops.train import train

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = {
    "swa": ("longdocs-swa", []),
    "fwpkm-addressing": ("longdocs-fwpkm", ['model.options.fwpkm.key_update="addressing"']),
    "fwpkm-mse": ("longdocs-fwpkm", ['model.options.fwpkm.key_update="mse"']),
    "fwpkm-none": ("longdocs-fwpkm", ['model.options.fwpkm.key_update="none"']),
    "fwpkm-shared": ("longdocs-fwpkm", ['model.options.fwpkm.key_update="addressing"',
                                        'model.options.fwpkm.persistence="stream"']),
}
MAIN = ("fwpkm-addressing", "fwpkm-shared")  # the models that also get the frozen (D.2) pass


def run_config(name: str, a) -> tuple:
    preset, overrides = VARIANTS[name]
    overrides = list(overrides) + [f"train.max_steps={a.steps}", f"train.max_minutes={a.max_minutes}",
                                   'train.budget_clock="cpu"',  # an optional time cap counts CPU time (issue 22)
                                   f"train.threads={a.threads}", f'data.corpus="{a.data}"', "train.device=\"cpu\"", *a.set]
    return make_config(str(ROOT / "configs" / f"{preset}.toml"), overrides), preset, overrides


def same_config(out: Path, cfg) -> bool:
    path = out / "config.json"
    if not (path.is_file() and (out / "summary.json").is_file()):
        return False
    saved = json.loads(path.read_text())
    saved = saved.get("run", saved)
    want = cfg.to_dict()
    want["model"] = dict(want["model"], vocab_size=saved.get("model", {}).get("vocab_size", 0))
    return all(saved.get(sec) == want[sec] for sec in ("model", "data", "train"))


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py)."""
    return [s for preset, overrides in VARIANTS.values() for s in probes.preset_probes(preset, overrides, ("carry",))]


def main():
    ap = ScriptParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="state-of-the-union",
                    help="corpus: a registered name (default: the bundled State of the Union addresses), file or directory")
    ap.add_argument("--runs", default="runs/longdocs", help="where the models are trained (relative: to the repository root)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=1000, help="training steps of every model (same for all)")
    ap.add_argument("--max-minutes", type=float, default=0.0,
                    help="CPU-time cap per training run (0 = none; a cap also shortens the lr schedule, so models then differ by their speed)")
    benchmark_threads_flag(ap)
    ap.add_argument("--train-only", action="store_true", help="train the missing runs, write no result")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override applied to every variant (e.g. train.carry_state=true)")
    ap.add_argument("--name", default="fwpkm_longdocs", help="results file benchmarks/results/NAME.json")
    a = ap.parse_args()
    use_threads("benchmark", a.threads)
    names = [v.strip() for v in a.variants.split(",") if v.strip()]
    for n in names:
        if n not in VARIANTS:
            raise SystemExit(f"unknown variant {n!r}; choose from {', '.join(VARIANTS)}")

    runs = {}
    t_all = time.perf_counter()
    for n in names:
        cfg, preset, overrides = run_config(n, a)
        out = ROOT / a.runs / n  # a relative --runs is under the repository root
        fresh = not same_config(out, cfg)
        if fresh:
            print(f"== training {n} -> {out}", flush=True)
            train(cfg, out, progress=False)
        summary = json.loads((out / "summary.json").read_text())
        runs[n] = {"dir": str(out.relative_to(ROOT)) if out.is_relative_to(ROOT) else str(out),
                   "preset": preset, "overrides": overrides, "trained_in_this_invocation": fresh,
                   "train_summary": summary, "config": cfg}
    if a.train_only:
        return

    cfg0 = runs[names[0]]["config"]
    docs = load_corpus(a.data)
    split = split_corpus(docs, "document", cfg0.data.val_fraction, cfg0.data.test_fraction)
    test, train_names = split["test"], {d.name for d in split["train"]}
    assert not {d.name for d in test} & train_names, "held-out documents overlap the training split"
    for r in runs.values():
        c = r.pop("config")
        assert (c.data.split, c.data.val_fraction, c.data.test_fraction) == ("document", cfg0.data.val_fraction,
                                                                              cfg0.data.test_fraction)

    results = {}
    loads = [round(os.getloadavg()[0], 2)]  # 1-min load average before and after each model's evaluation
    for n in names:
        model, tok, cfg = load_checkpoint(ROOT / runs[n]["dir"] if not Path(runs[n]["dir"]).is_absolute()
                                          else Path(runs[n]["dir"]))
        model.eval()
        mems = memory_layers(model)
        print(f"== scoring {n} on {len(test)} held-out documents", flush=True)
        t0 = time.perf_counter()
        normal, reads = score_documents(model, tok, test, cfg.train.seq_len, frozen=False, record=bool(mems))
        entry = {"normal": normal, "eval_seconds": round(time.perf_counter() - t0, 1)}
        if mems:
            entry["addressing"] = addressing(reads, mems)
            entry["addressing_window_x8"] = addressing(reads, mems, 8)
            if n in MAIN:  # the D.2 check on the main FwPKM models only (compute budget)
                frozen, _ = score_documents(model, tok, test, cfg.train.seq_len, frozen=True, record=False)
                entry["frozen"] = frozen
        results[n] = entry
        loads.append(round(os.getloadavg()[0], 2))
        print(n, {k: (round(v["bits_per_char"], 4) if isinstance(v, dict) and "bits_per_char" in v else None)
                  for k, v in entry.items()}, flush=True)

    headline = []
    base = results.get("swa")
    if base:
        headline.append({"what": "held-out bits/char, baseline (SWA-64, no memory)",
                         "value": round(base["normal"]["bits_per_char"], 4), "unit": "bits/char"})
    results_summary = {}
    for n in MAIN:
        fw = results.get(n)
        if not fw:
            continue
        label = "FwPKM@1,3 (addressing loss)" + (", one memory shared by the batch" if n == "fwpkm-shared" else "")
        headline.append({"what": f"held-out bits/char, {label}", "value": round(fw["normal"]["bits_per_char"], 4),
                         "unit": "bits/char", "target": "< baseline"})
        headline.append({"what": "held-out bits/char, same FwPKM model with fast weights frozen (D.2)",
                         "value": round(fw["frozen"]["bits_per_char"], 4), "unit": "bits/char",
                         "target": "> FwPKM (most of the gain removed)"})
        if not base:
            continue
        gain = base["normal"]["bits_per_char"] - fw["normal"]["bits_per_char"]
        lost = fw["frozen"]["bits_per_char"] - fw["normal"]["bits_per_char"]
        results_summary[n] = {"gain_bits_per_char": gain, "freezing_costs_bits_per_char": lost,
                              "share_of_gain_removed_by_freezing": lost / gain if gain > 0 else None,
                              "perplexity_per_char": {"swa": base["normal"]["perplexity_per_char"],
                                                      "fwpkm": fw["normal"]["perplexity_per_char"],
                                                      "fwpkm_frozen": fw["frozen"]["perplexity_per_char"]}}
        headline.append({"what": "FwPKM gain over baseline (bits/char; > 0 = FwPKM better)",
                         "value": round(gain, 4), "unit": "bits/char", "target": "> 0"})
        headline.append({"what": "bits/char change when its fast weights are frozen (> 0 = the writes help)",
                         "value": round(lost, 4), "unit": "bits/char", "target": "> 0"})
        if gain > 0:
            headline.append({"what": "share of that gain removed by freezing the fast weights",
                             "value": round(lost / gain, 3), "target": "most (> 0.5)"})
    for n in ("fwpkm-addressing", "fwpkm-mse", "fwpkm-none"):
        if n in results:
            s = results[n]["addressing"]["mean_over_layers"]
            label = {"fwpkm-addressing": "with addressing loss", "fwpkm-mse": "w/o addressing loss (keys follow MSE, paper's ablation)",
                     "fwpkm-none": "w/o addressing loss (keys fixed)"}[n]
            headline.append({"what": f"held-out slot coverage, {label}", "value": round(100 * s["coverage"], 1),
                             "unit": "%", **({} if n == "fwpkm-addressing" else {"target": "< with addressing loss"})})
            headline.append({"what": f"held-out slot KLD from uniform, {label}", "value": round(s["kld"], 3),
                             "unit": "nats", **({} if n == "fwpkm-addressing" else {"target": "> with addressing loss"})})

    payload = {
        "what": "FwPKM on held-out long documents: perplexity vs a no-memory baseline, frozen-memory check (App. D.2), "
                "addressing statistics with / without the addressing loss (App. D.3)",
        "data": {"corpus": a.data, "split": "document", "tokenizer": "char",
                 "held_out_documents": [d.name for d in test], "held_out_chars": sum(d.n_chars for d in test),
                 "train_documents": len(split["train"]), "val_documents": len(split["val"])},
        "protocol": {"eval": "each held-out document streamed from a fresh state, state carried through it, calls of "
                             "seq_len/2 tokens (fastweights eval); frozen = FwPKM.frozen (no writes, initial tables)",
                     "addressing_window_tokens": "N / (H k): about N reads per window, as the paper's 32K-token windows",
                     "early_late_split_chars": EARLY},
        "budget": {"threads": a.threads, "steps_per_model": a.steps, "max_minutes_per_training": a.max_minutes,
                   "invocation_seconds": round(time.perf_counter() - t_all, 1),
                   "training_seconds": {n: round(r["train_summary"]["elapsed_s"], 1) for n, r in runs.items()},
                   "load_average_1m_during_eval": loads,
                   "note": "CPU, one torch thread, on a shared 2-core machine with other jobs running; training_seconds "
                           "are wall-clock under that load, not speed measurements (see bench_fwpkm_model.json)"},
        "runs": runs, "results": results, "summary": results_summary, "headline": headline,
    }
    write_result(a.name, payload)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(exit_status_of(main))
