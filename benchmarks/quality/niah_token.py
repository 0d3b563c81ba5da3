"""Token-level needle in a haystack on a CPU (issue 17): FwPKM against its baselines and ablations.

Every model is the preset configs/niah-token.toml (word-level Shakespeare with one-token needles,
``fastweights.tasks.niah_token``; 2 layers, d_model 128, 32-token sliding-window attention, 512-token
training sequences) with the overrides below, trained for the same CPU budget (``--minutes`` of process
CPU time on one thread each), then read by ``fastweights task niah`` on held-out text (the last tenth of
tinyshakespeare) with held-out keys, at 1x-16x the training length, target depths uniform in [0, 1]
(5 bins), 5 needles per sample (1 target, 4 distractors), the paper's n-iter protocol (memories write
once per read; the question sees the memory of the n - 1 earlier reads):

    fwpkm               SWA + FwPKM before layer 0 (the preset)
    swa                 SWA alone
    attention           full causal attention, no memory
    gdn                 layer 0 gated delta rule (Gated DeltaNet), layer 1 SWA, no memory
    fwmlp               SWA + FwMLP before layer 0 (fast MLP memory, hidden 1024)
    fwpkm-no-lookahead  FwPKM writing v_t instead of v_{t+1} (the paper's "w/o lookahead")
    fwpkm-no-addressing FwPKM whose keys follow the MSE gradient (the paper's "w/o addr loss")
    fwpkm-top32         FwPKM reading 32 slots instead of 8
    fwpkm-frozen        the fwpkm checkpoint read with its memory frozen (App. D.2); no training of its own

    python benchmarks/quality/niah_token.py --variants fwpkm,swa --train-only     # one process per core
    python benchmarks/quality/niah_token.py --variants attention,gdn --train-only
    python benchmarks/quality/niah_token.py                                        # train what is missing, evaluate all

A checkpoint under ``--runs`` trained with the same overrides is reused. Writes
benchmarks/results/niah_token.json and one heatmap per model (benchmarks/results/niah_token/VARIANT.png).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from fastweights.core.threads import use_threads
from fastweights.evidence.result_files import RESULTS, write_result
from fastweights.evidence.timing import children_cpu_seconds
from fastweights.cli.script_parser import ScriptParser, exit_status_of

ROOT = Path(__file__).resolve().parents[2]
NO_MEMORY = ['model.memory=""', "model.memory_layers=[]"]
VARIANTS: dict[str, list[str]] = {
    "fwpkm": [],
    "swa": NO_MEMORY,
    "attention": NO_MEMORY + ["model.options.attention.window=0"],
    "gdn": NO_MEMORY + ['model.layer_mixers=["gdn", "attention"]'],
    "fwmlp": ['model.memory="fwmlp"', "model.options.fwmlp.d_key=64", "model.options.fwmlp.d_value=64",
              "model.options.fwmlp.hidden=1024", "model.options.fwmlp.chunk_size=64",
              'model.options.fwmlp.persistence="per_sequence"'],
    "fwpkm-no-lookahead": ["model.options.fwpkm.lookahead=0"],
    "fwpkm-no-addressing": ['model.options.fwpkm.key_update="mse"'],
    "fwpkm-top32": ["model.options.fwpkm.topk=32"],
}
EVAL_ONLY = {"fwpkm-frozen": ("fwpkm", ["--frozen-memory"])}
MEMORY_VARIANTS = ("fwpkm", "fwmlp", "fwpkm-no-lookahead", "fwpkm-no-addressing", "fwpkm-top32", "fwpkm-frozen")
CHANCE = 1 / 64  # exact match of a uniform guess among the value tokens


def overrides(name: str, a) -> list[str]:
    return [*VARIANTS[name], f"train.max_minutes={a.minutes}", 'train.budget_clock="cpu"', "train.threads=1",
            'train.device="cpu"', f"train.seed={a.seed}", *a.set]


def fastweights(*args: str) -> None:
    cmd = [sys.executable, "-m", "fastweights", *args]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def _eval_settings(doc: dict) -> dict:
    o = doc.get("options", {})
    return {"lengths": doc.get("lengths"), "samples_per_cell": doc.get("samples_per_cell"), "seed": doc.get("seed"),
            "iters": o.get("iters"), "frozen_memory": bool(o.get("frozen_memory"))}


def trained(out: Path, sets: list[str]) -> bool:
    meta = out / "niah_token_overrides.json"
    return (out / "model.safetensors").exists() and meta.exists() and json.loads(meta.read_text()) == sets


def train(name: str, a) -> None:
    out = Path(a.runs) / name
    sets = overrides(name, a)
    if trained(out, sets):
        print(f"{name}: reusing {out}")
        return
    if out.exists():
        shutil.rmtree(out)
    fastweights("train", "--preset", "niah-token", "--out", str(out), "--quiet",
                *[x for s in sets for x in ("--set", s)])
    (out / "niah_token_overrides.json").write_text(json.dumps(sets))


def evaluate(name: str, a) -> dict:
    base, extra = EVAL_ONLY.get(name, (name, []))
    ckpt = Path(a.runs) / base
    iters = a.iters if name in ("fwpkm",) else a.baseline_iters
    prefix = Path(a.runs) / "eval" / name
    prefix.parent.mkdir(parents=True, exist_ok=True)
    wanted = {"lengths": [int(x) for x in a.lengths.split(",")], "samples_per_cell": a.samples, "seed": a.seed,
              "iters": [int(x) for x in iters.split(",")], "frozen_memory": bool(extra)}
    t0 = children_cpu_seconds()
    done = prefix / "niah.json"  # task niah writes niah.json and niah.png into --out DIR
    if done.exists() and done.stat().st_mtime > (ckpt / "model.safetensors").stat().st_mtime and \
            _eval_settings(json.loads(done.read_text())) == wanted:
        print(f"{name}: reusing {done}")  # the same checkpoint read with the same settings
    else:
        done.unlink(missing_ok=True)
        done.with_suffix(".png").unlink(missing_ok=True)
        fastweights("task", "niah", "--checkpoint", str(ckpt), "--lengths", a.lengths, "--iters", iters, "--samples",
                    str(a.samples), "--seed", str(a.seed), "--out", str(prefix), "--quiet", "--threads", "1",
                    "--device", "cpu", *extra)
        prefix.with_suffix(".cpu").write_text(str(children_cpu_seconds() - t0))  # CPU seconds of that evaluation
    eval_cpu = float(prefix.with_suffix(".cpu").read_text())
    doc = json.loads(done.read_text())
    figures = RESULTS / "niah_token"
    figures.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(prefix.with_suffix(".png"), figures / f"{name}.png")
    metrics = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = max((m.get("step", 0) for m in metrics), default=0)
    vals = [m["val_loss"] for m in metrics if "val_loss" in m]
    train_cpu = max((m.get("elapsed", 0.0) for m in metrics), default=0.0)  # CPU seconds (budget_clock = "cpu")
    summary = doc["summary"]
    return {
        "checkpoint_overrides": overrides(base, a), "eval_flags": extra, "train_steps": steps,
        "train_cpu_seconds": round(train_cpu, 1), "eval_cpu_seconds": round(eval_cpu, 1),
        "val_loss_nats": vals[-1] if vals else None,
        "exact": {n: {L: v["by_length"][L]["exact"] for L in v["by_length"]} for n, v in summary["by_iters"].items()},
        "candidate": {n: {L: v["by_length"][L]["candidate"] for L in v["by_length"]} for n, v in summary["by_iters"].items()},
        "cells": summary["cells"], "samples_per_length": a.samples, "figure": f"benchmarks/results/niah_token/{name}.png",
    }


def probe(name: str, a) -> dict:
    """Per length and reads: mean cosine of the memory read at the question with the target needle's value
    target and with the closest distractor's, and the share of questions where the target's is larger."""

    from fastweights.models.loading import load_checkpoint
    from fastweights.tasks import niah_token as nt

    use_threads("benchmark", 1)
    model, tok = load_checkpoint(str(Path(a.runs) / name))[:2]
    nt.init_heldout_keys(model, tok, seed=a.seed)  # as `fastweights task niah` does for held-out keys
    hay = nt.eval_haystack()
    iters = tuple(int(x) for x in a.iters.split(","))
    out: dict = {}
    for L in (int(x) for x in a.lengths.split(",")):
        rows = [r for i in range(a.probe_samples)
                for r in nt.memory_probe(model, tok, nt.make_sample(hay, L, None, a.seed, i), iters)]
        out[str(L)] = {str(n): {k: round(sum(float(r[k]) for r in rows if r["iters"] == n) / a.probe_samples, 4)
                                for k in ("cos_target", "cos_distractor_max", "target_wins")} for n in iters}
    return out


def heldout_key_diagnosis(a) -> dict:
    """Why held-out keys need :func:`init_heldout_keys`: the fwpkm model's gate at key tokens, and 2-read
    exact match at 2x the training length with never-trained key rows, with drawn rows, and with training keys."""
    import torch

    from fastweights.models.loading import load_checkpoint
    from fastweights.tasks import niah_token as nt
    from fastweights.tasks.niah import NiahOptions, evaluate_niah, summarize

    use_threads("benchmark", 1)
    model, tok = load_checkpoint(str(Path(a.runs) / "fwpkm"))[:2]
    hay, L, n = nt.eval_haystack(), 2 * a.train_len, a.sweep_samples
    ids = torch.as_tensor(tok.encode(" ".join(nt.KEYS)))
    mem, block = model.blocks[0].memory, model.blocks[0]

    @torch.no_grad()
    def gates() -> dict:
        g = mem.io.inputs(block.memory_norm(model.embed(ids[None])))[2][0]
        return {"trained_keys": round(float(g[: nt.TRAIN_KEYS].mean()), 3), "heldout_keys": round(float(g[nt.TRAIN_KEYS:].mean()), 3)}

    def exact(keys: str) -> float:
        samples = nt.make_samples(hay, [L], "uniform", n, a.seed, keys=keys)
        return round(summarize(evaluate_niah(model, tok, samples, NiahOptions(iters=(2,))))["by_iters"][2]["overall"]["exact"], 3)

    probe_raw = [nt.memory_probe(model, tok, nt.make_sample(hay, L, None, a.seed, i), (2,))[0] for i in range(n)]
    out = {"length": L, "samples": n, "gate_raw": gates(), "exact_2read_raw_heldout": exact("heldout"),
           "exact_2read_train_keys": exact("train"),
           "probe_raw_heldout": {"cos_target_mean": round(sum(r["cos_target"] for r in probe_raw) / n, 4),
                                 "target_wins": round(sum(r["target_wins"] for r in probe_raw) / n, 3)}}
    nt.init_heldout_keys(model, tok, seed=a.seed)
    out["gate_drawn"] = gates()
    out["exact_2read_drawn_heldout"] = exact("heldout")
    return out


def slots_sweep(a) -> dict:
    """Memory size against haystack length: the fwpkm checkpoint read with fresh random tables of n^2 slots
    (its slow weights unchanged; the tables are buffers drawn at random, never trained), 2 reads."""
    import copy

    import torch

    from fastweights.models.loading import load_checkpoint
    from fastweights.models.lm import LanguageModel
    from fastweights.tasks import niah_token as nt
    from fastweights.tasks.niah import NiahOptions, evaluate_niah, summarize

    use_threads("benchmark", 1)
    model, tok, cfg = load_checkpoint(str(Path(a.runs) / "fwpkm"))[:3]
    nt.init_heldout_keys(model, tok, seed=a.seed)
    hay = nt.eval_haystack()
    lengths = [int(x) for x in a.sweep_lengths.split(",")]
    samples = nt.make_samples(hay, lengths, "uniform", a.sweep_samples, a.seed)
    out = {}
    for n in (int(x) for x in a.slots_sweep.split(",")):
        mcfg = copy.deepcopy(cfg.model)
        mcfg.options["fwpkm"]["n_subkeys"] = n
        torch.manual_seed(a.seed)
        swept = LanguageModel(mcfg)
        tables = {k for k in swept.state_dict() if k.rsplit(".", 1)[-1] in ("keys1", "keys2", "values")}
        swept.load_state_dict({k: v for k, v in model.state_dict().items() if k not in tables}, strict=False)
        summary = summarize(evaluate_niah(swept, tok, samples, NiahOptions(iters=(2,), piece=512)))
        out[str(n * n)] = {str(L): round(summary["by_iters"][2]["by_length"][L]["exact"], 3) for L in lengths}
        print(f"slots {n * n}: {out[str(n * n)]}", flush=True)
    return {"what": "2-read exact match of the fwpkm model with fresh tables of N slots (rows: N)",
            "samples_per_length": a.sweep_samples, "exact": out}


def checks(models: dict, a) -> dict:
    """The issue's acceptance lines, computed from the table (None where a model is missing)."""
    lengths = [int(x) for x in a.lengths.split(",")]
    L2, L16 = str(2 * a.train_len), str(16 * a.train_len)
    beyond = [str(L) for L in lengths if L > a.window]
    out = {}
    fw = models.get("fwpkm")
    if fw:
        ex = fw["exact"]
        out["fwpkm_2read_exact_2x"] = ex["2"].get(L2)
        out["fwpkm_2read_exact_16x"] = ex["2"].get(L16)
        out["fwpkm_1read_at_most_half_of_2read"] = all(ex["1"][L] <= 0.5 * ex["2"][L] for L in beyond)
        for other, key in (("fwpkm-no-lookahead", "lookahead_drop_points_2read"),
                           ("fwpkm-frozen", "frozen_minus_swa_points_2read")):
            if other in models:
                o = models[other]["exact"]
                if key.startswith("lookahead"):
                    out[key] = {L: round(100 * (ex["2"][L] - o["2"][L]), 1) for L in ex["2"]}
                elif "swa" in models:
                    s = models["swa"]["exact"]
                    out[key] = {L: round(100 * (o["2"][L] - s["2"][L]), 1) for L in o["2"]}
    if "swa" in models:
        out["swa_minus_chance_points"] = {L: round(100 * (v - CHANCE), 1) for L, v in models["swa"]["exact"]["1"].items()}
    return out


def headline(models: dict, a) -> list[dict]:
    """README rows (tools/report.py): exact match at 2x and 16x the training length."""
    rows = []
    for name, n, target in (("fwpkm", "2", ">= 0.8 at 2x, >= 0.6 at 16x"), ("fwpkm", "1", "<= half of 2 reads"),
                            ("fwpkm-frozen", "2", "SWA +- 0.05"), ("fwpkm-no-lookahead", "2", "-0.30 vs fwpkm"),
                            ("fwpkm-no-addressing", "2", ""), ("fwpkm-top32", "2", ""), ("fwmlp", "2", ""),
                            ("swa", "1", "chance (0.016)"), ("attention", "1", ""), ("gdn", "1", "")):
        if name not in models or n not in models[name]["exact"]:
            continue
        ex = models[name]["exact"][n]
        for mult in (2, 16):
            L = str(mult * a.train_len)
            if L in ex:
                rows.append({"what": f"token NIAH, {name}, {n} read{'s' if n != '1' else ''}, {L} tokens "
                                     f"({mult}x training), exact match, {a.samples} held-out samples",
                             "value": round(ex[L], 3), "target": target if mult == 2 else ""})
    return rows


def diagnostics(names: list[str], a) -> dict:
    """Memory probes, the memory-size sweep and the held-out-key diagnosis; kept in RUNS/eval/diagnostics.json
    and reused while the checkpoints and settings are the same (``--diagnostics-only`` computes them alone,
    e.g. in a second process while the evaluations run)."""
    path = Path(a.runs) / "eval" / "diagnostics.json"
    settings = {k: getattr(a, k) for k in ("lengths", "iters", "probe_samples", "slots_sweep", "sweep_lengths",
                                             "sweep_samples", "seed")}
    probed = [n for n in names if n in MEMORY_VARIANTS and n not in EVAL_ONLY and a.probe_samples]
    newest = max((Path(a.runs) / n / "model.safetensors").stat().st_mtime for n in {*probed, "fwpkm"} & set(names)) \
        if {*probed, "fwpkm"} & set(names) else 0.0
    if path.exists() and path.stat().st_mtime > newest:
        saved = json.loads(path.read_text())
        if saved["settings"] == settings and set(probed) <= set(saved["probes"]):
            print(f"diagnostics: reusing {path}")
            return {**saved, "probes": {n: saved["probes"][n] for n in probed}}
    t0 = time.process_time()
    out = {"settings": settings, "probes": {n: probe(n, a) for n in probed},
           "sweep": slots_sweep(a) if a.slots_sweep and "fwpkm" in names else None,
           "keys": heldout_key_diagnosis(a) if "fwpkm" in names and a.sweep_samples else None}
    out["cpu_seconds"] = round(time.process_time() - t0, 1)  # this process's CPU for the three (one thread)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out))
    return out


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py)."""
    return ([s for overrides in VARIANTS.values() for s in probes.preset_probes("niah-token", overrides)]
            + [probes.probe("task", name="niah")])



def main() -> int:
    ap = ScriptParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join([*VARIANTS, *EVAL_ONLY]))
    ap.add_argument("--minutes", type=float, default=15.0, help="CPU minutes of training per model")
    ap.add_argument("--runs", default="runs/niah-token")
    ap.add_argument("--lengths", default="512,1024,2048,4096,8192")
    ap.add_argument("--iters", default="1,2,3", help="reads for the fwpkm model")
    ap.add_argument("--baseline-iters", default="1,2", help="reads for every other model")
    ap.add_argument("--samples", type=int, default=100, help="samples per length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--probe-samples", type=int, default=20, help="samples per length for the memory probe")
    ap.add_argument("--train-len", type=int, default=512)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--slots-sweep", default="32,64,128,256", help="n_subkeys for the memory-size sweep ('' skips it)")
    ap.add_argument("--sweep-lengths", default="1024,4096,8192")
    ap.add_argument("--sweep-samples", type=int, default=50)
    ap.add_argument("--set", action="append", default=[], help="extra override for every model")
    ap.add_argument("--train-only", action="store_true")
    ap.add_argument("--diagnostics-only", action="store_true", help="compute the probes, sweep and key diagnosis only")
    ap.add_argument("--name", default="niah_token")
    a = ap.parse_args()
    names = [n for n in a.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS and n not in EVAL_ONLY]
    if unknown:
        print(f"error: unknown variants {unknown}; choose from {[*VARIANTS, *EVAL_ONLY]}", file=sys.stderr)
        return 2
    for n in names:
        base = EVAL_ONLY.get(n, (n,))[0]
        train(base, a)
    if a.train_only:
        return 0
    extras = diagnostics(names, a)
    if a.diagnostics_only:
        return 0
    models = {n: evaluate(n, a) for n in names}
    for n, p in extras["probes"].items():
        models[n]["memory_probe"] = p
    sweep, keys = extras["sweep"], extras["keys"]
    # CPU seconds of the whole reproduction, summed from what each part measured (training runs in other
    # processes under --train-only, evaluations in child processes, diagnostics possibly cached)
    cpu = {"training": round(sum(m["train_cpu_seconds"] for n, m in models.items() if n not in EVAL_ONLY), 1),
           "evaluation": round(sum(m["eval_cpu_seconds"] for m in models.values()), 1),
           "diagnostics": extras.get("cpu_seconds")}
    cpu["total"] = round(sum(v for v in cpu.values() if v is not None), 1)
    write_result(a.name, {
        "what": "token-level NIAH: exact match of the answer token (chance 1/64) by reads and context length; "
                "held-out text (tinyshakespeare's last tenth) and held-out keys; training length 512 tokens",
        "minutes_per_model": a.minutes, "cpu_seconds": cpu, "cpu_hours_total": round(cpu["total"] / 3600, 2),
        "chance_exact": CHANCE, "lengths": a.lengths, "models": models,
        "memory_size_sweep": sweep, "heldout_key_diagnosis": keys,
        "checks": {**checks(models, a), "reproduction_under_3_cpu_hours": cpu["total"] < 3 * 3600}, "headline": headline(models, a)})
    return 0


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
