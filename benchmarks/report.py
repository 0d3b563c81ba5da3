"""Regenerate the results and claims tables of the README and docs/*.md from benchmarks/results/*.json, so
no number is typed by hand.

    python benchmarks/report.py            # rewrite every table between results / claims markers
    python benchmarks/report.py --check    # exit 1 if any page is out of date (used by the tests)

A results table (``<!-- results:start -->`` ... ``<!-- results:end -->``) lists every result file
(docs/results.md holds that full list); a docs page lists only the files it names:
``<!-- results:start fwl_quality bench_fwl -->``.

A result file contributes rows through its ``headline`` list:
``{"what": "...", "value": 1.23, "unit": "bits/char", "target": ">= 0.9"}`` (unit and target optional).

The claims table (``<!-- claims:start -->`` ... ``<!-- claims:end -->``, in the README; issue 21) puts each
paper's headline claims (CLAIMS) beside the closest result we have, with a verdict computed from the value
and the claim's rule.

Pages: README.md, docs/*.md and docs/experiments/*.md (one write-up per benchmark).

``--check`` also fails (issues 22, 30) on
  * a cited number that disagrees with its source: ``0.805 <!-- src: bench_fwpkm_model ratio -->`` (the shown
    digits must be the JSON value rounded to them; key paths as in EXTRACT), on any page;
  * a decimal number without a source inside ``<!-- numbers:start -->`` ... ``<!-- numbers:end -->``;
  * a citation marker in the prose of a user's-guide page (docs/*.md but results.md) outside a numbers region:
    markers live in the generated tables, the README's claims table, numbers regions and the measurement write-ups
    (docs/results.md, docs/experiments/*.md); a user's guide links to those (``marker_in_prose_problems``);
  * the evidence rules of ``evidence.py``: a JSON without its command, git commit, ``result_file`` or
    behaviour probes; and a results/TO_RERUN.md (the stale results, generated here) out of date.
A stale result (its probes changed) is no error: the tables mark it and TO_RERUN.md lists it.
"""

from __future__ import annotations

import argparse
import json
import operator
import re
import sys
from pathlib import Path
from typing import NamedTuple

import evidence  # benchmarks/evidence.py, the script's folder (on sys.path when run)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
START, END = "<!-- results:start", "<!-- results:end -->"
CLAIMS_START, CLAIMS_END = "<!-- claims:start -->", "<!-- claims:end -->"
# the equal-compute leaderboard (issue 21): markdown_table below, of results/leaderboard.json
BOARD_START, BOARD_END = "<!-- leaderboard:start -->", "<!-- leaderboard:end -->"
# Pages that must hold a block, so that deleting one does not pass the check silently.
REQUIRED = {"README.md": CLAIMS_START, "docs/results.md": START + " -->"}


# Rows for result files that carry no ``headline`` list: (file stem, what, dotted path, unit, target).
EXTRACT = [
    ("cuda_scale", "H100, 115M params, T=4096, bf16: FwPKM hybrid tokens/s over its GDN/attention backbone",
     "ratios/fwpkm_hybrid_tokens_per_s_over_backbone", "x", ">= 0.6 (paper: 0.35)"),
    ("cuda_scale", "H100, same size: our GDN/attention hybrid's step time over fla's GatedDeltaNetForCausalLM "
     "(fla's gated-backward guard bypassed: timing only)", "ratios/ours_hybrid_step_over_fla_model_step", "x", "<= 1.1"),
    ("cuda_scale_kernels", "H100, T=8192: gated delta rule fwd+bwd, our compiled chunked form over fla's kernel",
     "ratios/T8192|gated_op_compiled_over_raw_fla", "x", "<= 2"),
    ("cuda_scale_kernels", "H100, T=8192: gdn layer fwd+bwd over fla's raw gated kernel",
     "ratios/T8192|gdn_layer_over_raw_fla_gated_kernel", "x", "<= 1.15"),
    ("cuda_scale_kernels", "H100, T=8192: delta rule op (auto: fla, state in and out) over fla's raw kernel",
     "ratios/T8192|delta_op_auto_over_raw_fla", "x", "<= 1.15"),
    ("bench_delta_rule", "delta rule fwd+bwd, chunked (C=64) vs per-step loop, CPU, B=1 T=2048 H=4 D=64 (median)",
     "speed/delta/speedup_fwd_bwd/C64_wall_median", "x", ">= 20x"),
    ("bench_delta_rule", "gated delta rule fwd+bwd, chunked (C=64) vs per-step loop, CPU (median)",
     "speed/gated_delta/speedup_fwd_bwd/C64_wall_median", "x", ">= 20x"),
    ("bench_delta_rule", "delta rule peak memory per token, chunked (D=64)",
     "memory/peak_rss_bytes_per_token_D64/chunked", "bytes", "grows with T*D"),
    ("bench_delta_rule", "delta rule peak memory per token, per-step loop (D=64)",
     "memory/peak_rss_bytes_per_token_D64/per_step", "bytes", ""),
    ("assoc_capacity", "assoc. retrieval setting 1: first S where sum rule / ELU+1 (d_dot=64) loss > 0.01",
     "acceptance/setting1_sum_elu1_fails_before_S100/first_S_with_loss_above_0.01", "keys", "< 100"),
    ("assoc_capacity", "assoc. retrieval setting 1: DPFP nu=1 final loss at S=60",
     "acceptance/setting1_sum_dpfp1_solves_S60/final_loss", "", "near 0"),
    ("assoc_capacity", "assoc. retrieval setting 2, S=60: sum-rule loss / delta-rule loss (the delta run solved the task; "
     "the sum run stopped at the 3,000-step cap)",
     "acceptance/setting2_delta_below_sum_at_S60/ratio_sum_over_delta", "x", "> 1"),
    ("bench_fwpkm_layer", "FwPKM layer (paper config, B=1 T=4096) fwd+bwd time / SwiGLU of same width, CPU (interleaved median)",
     "ratios/interleaved_b1_fwpkm_over_swiglu", "x", ""),
    ("bench_fwpkm_layer", "FwPKM layer fwd+bwd peak RSS above setup, CPU, B=1 T=4096",
     "results/fwpkm_b1/peak_rss_over_setup_bytes", "bytes", "< 4 GiB"),
    ("bench_fast_rnn", "fast-weights RNN training step vs plain loop with explicit A, CPU, T=128 H=128 B=32 (wall median)",
     "training_step/speedup/plain_loop|ours_auto (wall median)", "x", ">= 2x"),
    ("ba_retrieval_fw_seed1_90k", "Ba et al. retrieval R=20 K=4: fast-weights RNN, the worst seed (1) rerun for 90k steps, test error",
     "summary/fast-rnn/test_error_mean", "", "<= 0.05"),
    ("ba_retrieval_lr1e-4", "Ba et al. retrieval R=20 K=4 at Adam lr 1e-4 (the public code's), seed 0, 30k steps: fast-weights RNN test error",
     "summary/fast-rnn/test_error_mean", "", ""),
    ("ba_retrieval_lr1e-4", "  same protocol: LSTM test error (the plateau the paper's 60.8% sits on)",
     "summary/lstm/test_error_mean", "", ""),
    ("ba_retrieval_lr3e-4", "Ba et al. retrieval R=20 K=4 at Adam lr 3e-4, seed 0, 40k steps: fast-weights RNN test error",
     "summary/fast-rnn/test_error_mean", "", ""),
    ("ba_retrieval_lr3e-4", "  same protocol: LSTM test error", "summary/lstm/test_error_mean", "", ""),
    ("ba_retrieval_lr3e-3", "Ba et al. retrieval R=20 K=4 at Adam lr 3e-3, 3 seeds, 15k steps: fast-weights RNN worst seed test error",
     "summary/fast-rnn/test_error_max", "", ""),
    ("ba_retrieval_lr3e-3", "  same protocol: LSTM best seed test error", "summary/lstm/test_error_min", "", ""),
    ("ba_retrieval_seeds", "Ba et al. retrieval R=20 K=4: fast-weights RNN test error, mean of 3 seeds (45k steps)",
     "summary/fast-rnn/test_error_mean", "", "<= 0.05 (paper 0.018)"),
    ("ba_retrieval_seeds", "Ba et al. retrieval R=20 K=4: fast-weights RNN worst seed test error", "summary/fast-rnn/test_error_max",
     "", "<= 0.05"),
    ("ba_retrieval_seeds", "Ba et al. retrieval R=20 K=4: LSTM test error, mean of 3 seeds (45k steps)",
     "summary/lstm/test_error_mean", "", "> 0.30 (paper 0.608)"),
    ("dynamic_eval_quality", "dynamic eval (rms-global-prior), 3 held-out Shakespeare plays: relative bpc reduction",
     "shakespeare_heldout_plays/overall/relative_improvement", "", ">= 0.03"),
    ("dynamic_eval_quality", "  same plays: static bits/char", "shakespeare_heldout_plays/overall/static_bpc", "bits/char", ""),
    ("dynamic_eval_quality", "  same plays: dynamic bits/char", "shakespeare_heldout_plays/overall/dynamic_bpc", "bits/char", ""),
    ("dynamic_eval_quality", "  same plays: neural cache bits/char", "shakespeare_heldout_plays/overall/cache_bpc", "bits/char", ""),
    ("dynamic_eval_quality", "dynamic eval on Spanish (Don Quijote, Shakespeare-tuned): relative bpc reduction",
     "spanish/shakespeare_tuned/relative_improvement", "", "much more than 0.03"),
    ("bench_fwl", "FWL head: scoring tokens/s, backbone + FWL / backbone (shakespeare-char shapes, B=16 T=128, CPU)",
     "results/window/ratio_over_backbone/backbone + fwl (preset)", "x", ">= 0.85 (paper 0.85, V100)"),
    ("bench_fwl_depth12", "FWL head: scoring tokens/s, same shapes but a 12-layer backbone (the paper's sparse transformer depth), CPU",
     "results/window/ratio_over_backbone/backbone + fwl (preset)", "x", ">= 0.85 (paper 0.85, V100, 18 layers)"),
    ("bench_fwl", "  4-layer matmul-FLOP ratio, backbone / backbone + FWL per token (torch flop counter; not a ceiling)",
     "results/window/flop_ratio/backbone + fwl (preset)", "x", ""),
    ("bench_fwl_depth12", "  12-layer matmul-FLOP ratio (the measured 12-layer ratio is above it: not a ceiling)",
     "results/window/flop_ratio/backbone + fwl (preset)", "x", ""),
    ("bench_fwl", "FWL head: training-step tokens/s, backbone + FWL / backbone (second-order, CPU)",
     "results/train/ratio_over_backbone/backbone + fwl (preset)", "x", ""),
    ("fwl_quality", "FWL vs linear head, same backbone, equal CPU time (2.5 min): val bits/char difference (fwl - base)",
     "differences_bits/fwl - base/val_bits_window", "bits/char", "< 0 (FWL better)"),
    ("fwl_quality_equal_steps", "FWL vs linear head, same backbone, 200 steps each: val bits/char difference (fwl - base)",
     "differences_bits/fwl - base/val_bits_window", "bits/char", "< 0 (FWL better)"),
    ("adapt_test_dynamic", "continual adaptation (Shakespeare, Tolstoy, State of the Union, Spanish; 20K chars each), "
     "Shakespeare char model + dynamic evaluation: Spanish NLL change after its own stage", "delta/4/3", "nats/char", ""),
    ("adapt_test_dynamic", "  same: Shakespeare NLL change after the last stage (forgetting)", "delta/4/0", "nats/char", ""),
    ("adapt_test_fwpkm", "same protocol, FwPKM long-docs model, its memory only (no slow-weight update): Spanish NLL change "
     "after its own stage", "delta/4/3", "nats/char", ""),
    ("adapt_test_fwpkm", "  same: Shakespeare NLL change after the last stage (forgetting)", "delta/4/0", "nats/char", ""),
    ("fwl_quality_1000", "FWL vs linear head, same backbone, 1000 steps each: val bits/char difference (fwl - base)",
     "differences_bits/fwl - base/val_bits_window", "bits/char", "< 0 (FWL better)"),
    ("fwl_quality_1000", "  same: test split streamed with state carried, bits/char difference (fwl - base)",
     "differences_bits/fwl - base/test_bits_stream", "bits/char", "< 0 (FWL better)"),
    ("fwl_quality_1000", "  same, FWL trained with carried state (train.carry_state): val bits/char difference",
     "differences_bits/fwl-carry - base/val_bits_window", "bits/char", "< 0 (FWL better)"),
    ("dynamic_timescale_spanish", "dynamic eval on Spanish by position: mean bits/char, static",
     "static_mean_bits", "bits/char", ""),
    ("dynamic_timescale_spanish", "  same: mean bits/char, dynamic (rms-global-prior)", "dynamic_mean_bits", "bits/char", ""),
    ("bench_dynamic_eval", "dynamic / static evaluation tokens/s (full parameters, CPU)", "ratio_dynamic_over_static", "x", ">= 0.30"),
    ("bench_dynamic_eval", "sparse dynamic / static evaluation tokens/s (CPU)", "ratio_sparse_over_static", "x", ""),
    ("stream_memory", "streaming 1M vs 100K tokens, softmax attention (bounded KV cache) + FwPKM model: peak RSS ratio",
     "ratios_largest_over_smallest/attention+fwpkm/peak_rss", "x", "~1 (constant)"),
    ("stream_memory", "streaming 1M vs 100K tokens, delta-rule + FwPKM model: peak RSS ratio",
     "ratios_largest_over_smallest/fwp_delta+fwpkm/peak_rss", "x", "~1 (constant)"),
]


class Claim(NamedTuple):
    """One headline claim of a paper beside the closest result we have (a row of the claims table).

    ``key`` is one key path into ``benchmarks/results/STEM.json`` (as in EXTRACT), or ``{label: key path}``
    for values shown side by side ("base 181.2 vs FWL 154.5 ppl"), ours last. ``rule`` is what the last
    value must satisfy for the claim to hold: ``"OP NUMBER"`` or ``"OP [FACTOR *] LABEL"`` (against another
    value of the row), OP one of < <= > >=; a number is in the JSON's units (a fraction when unit is "%").
    """

    claim: str  # the claim in words, with where our setting differs from the paper's
    paper: str  # the paper's number and where it is in the paper
    stem: str
    key: str | dict[str, str]
    unit: str  # "%": the JSON holds a fraction, shown times 100
    rule: str


_TRANSCRIBED = "as transcribed, not checked against the PDF"
CLAIMS = [
    Claim("Fast Weight Layers (Clark et al. 2022): an FWL head lowers a language model's test perplexity. Ours: PTB "
          "word level, a 2-layer attention LM, 1,000 training steps on the CPU, test split streamed with state carried",
          "Transformer-XL on WikiText-103: 18.1 -> 16.6 test ppl (Table 1)", "fwl_ptb_seg16",
          {"base": "runs/base/test_stream_ppl", "FWL": "runs/fwl/test_stream_ppl"}, "ppl", "< base"),
    Claim("FWL: close to dynamic evaluation's perplexity (here: within 2%) without updating weights at test time. "
          "Ours: the same PTB run against dynamic evaluation (rms-global-prior) of its own base checkpoint",
          "16.6 (FWL) vs 16.4 (dynamic evaluation) test ppl (Table 1)", "fwl_ptb_seg16",
          {"dynamic eval": "dynamic_eval_reference/dynamic/rms-global-prior", "FWL": "runs/fwl/test_stream_ppl"},
          "ppl", "<= 1.02 * dynamic eval"),
    Claim("FWL: scoring with the head keeps most of the backbone's speed. Ours: tokens/s with / without the head, "
          "12-layer backbone, window scoring, CPU",
          "1340 / 1575 tok/s = 0.85, Transformer-XL, one V100 (Table 1)", "bench_fwl_depth12",
          "results/window/ratio_over_backbone/backbone + fwl (preset)", "x", ">= 0.85"),
    Claim("Fast weight programmers (Schlag et al. 2021): the sum rule runs out of capacity once the number of keys S "
          "passes d_dot. Ours: first S of the sweep (20-100) where ELU+1 (d_dot 64) final loss exceeds 0.01, "
          "setting 1, runs capped at 3,000 steps",
          "ELU+1 loss 0.025 at S = 60, 0.172 at S = 100 (Fig. 2; the authors' logs)", "assoc_capacity",
          "acceptance/setting1_sum_elu1_fails_before_S100/first_S_with_loss_above_0.01", "keys", "< 100"),
    Claim("Fast weight programmers: a larger d_dot (DPFP, nu = 1, d_dot 128) raises the capacity. Ours: its final loss "
          "at S = 100, setting 1",
          "DPFP-1 loss 0.000 at S = 100 (Fig. 2; the authors' logs)", "assoc_capacity", "runs/9/final_eval_loss",
          "", "< 0.01"),
    Claim("Fast weight programmers: with overwrites (setting 2) the delta rule beats the sum rule. Ours: DPFP-1 at "
          "S = 60, runs capped at 3,000 steps",
          "sum 0.123 vs delta 0.006 final loss at S = 60 (Fig. 5; the authors' logs)", "assoc_capacity",
          {"sum": "acceptance/setting2_delta_below_sum_at_S60/sum_dpfp1",
           "delta": "acceptance/setting2_delta_below_sum_at_S60/delta_dpfp1"}, "", "< sum"),
    Claim("Fast-weights RNN (Ba et al. 2016): fast weights solve associative retrieval with 20 hidden units "
          "(R = 20, K = 4; solved = at most 5% test error). Ours: mean of 3 seeds, 45k steps",
          f"1.81% test error (Table 1, {_TRANSCRIBED})", "ba_retrieval_seeds", "summary/fast-rnn/test_error_mean",
          "%", "<= 0.05"),
    Claim("Fast-weights RNN: an LSTM of the same size fails at that task (here: above 30% test error). Ours: mean of "
          "3 seeds, same protocol",
          f"60.81% test error (Table 1, {_TRANSCRIBED})", "ba_retrieval_seeds", "summary/lstm/test_error_mean",
          "%", "> 0.30"),
    Claim("Dynamic evaluation (Krause et al. 2018): adapting to the test text lowers word-level perplexity. Ours: PTB, "
          "a small attention LM trained on the CPU, rms-global-prior tuned on validation, segment 20",
          "AWD-LSTM on PTB: 57.7 -> 51.1 test ppl (Table 1)", "ptb_dynamic_eval",
          {"static": "test/static/perplexity", "dynamic": "test/dynamic/rms-global-prior/perplexity"}, "ppl",
          "< static"),
    Claim("Dynamic evaluation: it beats the neural cache. Ours: character level, three held-out Shakespeare plays, a "
          "small Shakespeare model trained on the CPU",
          "52.8 (cache) vs 51.1 (dynamic evaluation) PTB test ppl (Table 1)", "dynamic_eval_quality",
          {"cache": "shakespeare_heldout_plays/overall/cache_bpc",
           "dynamic": "shakespeare_heldout_plays/overall/dynamic_bpc"}, "bits/char", "< cache"),
    Claim("Dynamic evaluation: it also helps a pretrained transformer. Ours: SmolLM2-135M-Instruct on long "
          "texts, relative perplexity reduction, mean over the scored texts, setting chosen on other (tuning) text",
          "Transformer-XL on WikiText-103: 18.3 -> 16.4 test ppl, 10.4% lower (Krause et al. 2019, abstract)",
          "smollm2_dynamic_eval", "best_mean_relative_perplexity_reduction", "%", "> 0"),
    Claim("FWL on a pretrained model: about dynamic evaluation's gain (here: at least 80% of its perplexity reduction). "
          "Ours: SmolLM2-135M, a head trained 20 CPU-minutes on a frozen backbone, 3 long texts, mean relative "
          "perplexity reduction against the dynamic-evaluation setting chosen on tuning text",
          "Transformer-XL on WikiText-103 dev: 17.3 -> 15.9 (FWL) vs 15.8 (dynamic evaluation) ppl (Table 1)",
          "fwl_smollm2", {"dynamic": "results/dynamic/mean_relative_perplexity_reduction",
                          "FWL": "results/fwl/mean_relative_perplexity_reduction"}, "%", ">= 0.8 * dynamic"),
    Claim("FWL on a pretrained model: at a fraction of dynamic evaluation's cost (here: at least 2.5x its scoring "
          "throughput). Ours: the same runs, scoring tokens per CPU-second / static's, one thread",
          "about 3x faster than dynamic evaluation (section 3)", "fwl_smollm2",
          {"dynamic": "results/dynamic/mean_throughput_ratio_to_static",
           "FWL": "results/fwl/mean_throughput_ratio_to_static"}, "x", ">= 2.5 * dynamic"),
    Claim("Fast-weight PKM (Zhao & Jones 2026): the memory lowers long-context perplexity. Ours: State of the Union "
          "addresses, 4-layer character model with 64-character sliding-window attention, 1,000 steps, one seed",
          f"GDN on LC64: 10.12 -> 8.89 ppl (Fig. 2, {_TRANSCRIBED})", "fwpkm_longdocs_1000",
          {"SWA": "results/swa/normal/bits_per_char", "FwPKM": "results/fwpkm-addressing/normal/bits_per_char"},
          "bits/char", "< SWA"),
    Claim("Fast-weight PKM: a second read of the haystack turns needle retrieval from failing to working (here: exact "
          "match of at least 50% after it). Ours: token NIAH at 1,024 tokens (2x training), 2-layer model, "
          "15 CPU-minutes",
          f"<10% -> >50% exact match in many cases (Fig. 4, GDN and GDN+SWA; {_TRANSCRIBED})", "niah_token",
          {"1 read": "models/fwpkm/exact/1/1024", "2 reads": "models/fwpkm/exact/2/1024"}, "%", ">= 0.5"),
    Claim("Fast-weight PKM: retrieval generalises far beyond the training length (here: exact match of at least 50%). "
          "Ours: the same model, trained on 512 tokens, read twice at 8,192 (16x)",
          f"88.6% at 4K (training length), 75.8% at 128K (Fig. 4, {_TRANSCRIBED})", "niah_token",
          {"512 tokens": "models/fwpkm/exact/2/512", "8,192 tokens": "models/fwpkm/exact/2/8192"}, "%", ">= 0.5"),
]


def _get(rec: dict, key_path: str):
    node = rec
    for part in key_path.split("/"):
        node = node[int(part)] if isinstance(node, list) else node[part.replace("|", "/")]  # "|": a "/" in a key
    return node


def _fmt(v) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int) or float(v).is_integer() and abs(v) >= 100:
        return f"{int(v):,}"
    if 0.9 <= abs(v) < 1.1 and v != round(v):
        return f"{v:.4f}"  # ratios near 1: three significant figures would print 1.0023 as "1"
    return f"{v:.3g}" if abs(v) < 10 else f"{v:,.1f}"


def table(stems: list[str] | None = None) -> str:
    """Rows from every result file (the first row of each anchored as STEM), or from the named ones (file stems)
    in that order."""
    rows = ["| result | value | target | source (command in the JSON) |", "|---|---|---|---|"]
    if stems:
        missing = [s for s in stems if not (RESULTS / f"{s}.json").exists()]
        if missing:
            raise SystemExit(f"no result file benchmarks/results/{missing[0]}.json")
    for path in [RESULTS / f"{s}.json" for s in stems] if stems else sorted(RESULTS.glob("*.json")):
        rec = json.loads(path.read_text())
        heads = rec.get("headline") or [{"what": what, "value": _get(rec, key), "unit": unit, "target": target}
                                         for stem, what, key, unit, target in EXTRACT if stem == path.stem]
        for i, h in enumerate(heads):
            value = _fmt(h["value"]) + (f" {h['unit']}" if h.get("unit") else "")
            mark = evidence.status(path)
            source = f"`{path.relative_to(ROOT)}`" + (f" ({mark})" if mark else "")
            if not stems and i == 0:  # the full table (docs/results.md): pages link a file's rows as results.md#STEM
                source = f'<a id="{path.stem}"></a>{source}'
            rows.append(f"| {h['what']} | {value} | {h.get('target', '')} | {source} |")
    return "\n".join(rows)


def render(page: str, name: str) -> str:
    """Rewrite each ``<!-- results:start [stems] -->`` ... ``<!-- results:end -->`` block of a page."""
    if START not in page:
        raise SystemExit(f"{name} has no {START} ... {END} markers")
    out, rest = page.split(START, 1)
    while True:
        opening, rest = rest.split("-->", 1)
        if END not in rest:
            raise SystemExit(f"{name}: {START}{opening}--> has no {END}")
        _, rest = rest.split(END, 1)
        out += f"{START}{opening}-->\n{table(opening.split())}\n{END}"
        if START not in rest:
            return out + rest
        between, rest = rest.split(START, 1)
        out += between


def _num(v, unit: str) -> str:
    return _fmt(v * 100) + "%" if unit == "%" else _fmt(v)


def _shown(values: dict[str, float], unit: str) -> str:
    """One value ("0.951 x"), or labelled values side by side ("base 181.2 vs FWL 154.5 ppl")."""
    text = " vs ".join(f"{label} {_num(v, unit)}".strip() for label, v in values.items())
    return text + (f" {unit}" if unit and unit != "%" else "")


RULE = re.compile(r"(<=|>=|<|>)\s*(?:(\d+(?:\.\d+)?)\s*\*\s*)?(.+)")
OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}


def verdict(values: dict[str, float], rule: str, unit: str = "") -> str:
    """"holds" when the last value satisfies the rule, else "does not hold: ..." saying how it misses."""
    m = RULE.fullmatch(rule.strip())
    if not m:
        raise ValueError(f"a claim's rule must read 'OP NUMBER' or 'OP [FACTOR *] LABEL': {rule!r}")
    op, factor, target = m.group(1), m.group(2), m.group(3).strip()
    label, value = list(values.items())[-1]
    if target in values:
        bound = float(values[target]) * float(factor or 1)
        against = (f"{factor} x " if factor else "") + f"{target} {_num(values[target], unit)}"
    elif factor is None and re.fullmatch(r"-?\d+(?:\.\d+)?", target):
        bound = float(target)
        against = _num(bound, unit)
    else:
        raise ValueError(f"{rule!r}: {target!r} is neither a number nor a label of the row ({', '.join(values)})")
    if OPS[op](float(value), bound):
        return "holds"
    return f"does not hold: {f'{label} ' if label else ''}{_num(value, unit)} is not {op} {against}"


def claims_table() -> str:
    """The claims table: each claim of CLAIMS with our value, its verdict and its source."""
    rows = ["| claim | paper | ours | verdict | source |", "|---|---|---|---|---|"]
    for c in CLAIMS:
        path = RESULTS / f"{c.stem}.json"
        if not path.exists():
            raise SystemExit(f"claim {c.claim[:40]!r}...: no result file benchmarks/results/{c.stem}.json")
        rec = json.loads(path.read_text())
        keys = c.key if isinstance(c.key, dict) else {"": c.key}
        values = {label: _get(rec, key) for label, key in keys.items()}
        mark = evidence.status(path)
        said = verdict(values, c.rule, c.unit) + (f"; {mark}" if mark else "")
        rows.append(f"| {c.claim} | {c.paper} | {_shown(values, c.unit)} | {said} | `{path.relative_to(ROOT)}` |")
    return "\n".join(rows)


def render_claims(page: str, name: str) -> str:
    """Rewrite each ``<!-- claims:start -->`` ... ``<!-- claims:end -->`` block of a page."""
    if CLAIMS_START not in page:
        raise SystemExit(f"{name} has no {CLAIMS_START} ... {CLAIMS_END} markers")
    out, table_text = [], None
    for i, part in enumerate(page.split(CLAIMS_START)):
        if i == 0:
            out.append(part)
            continue
        if CLAIMS_END not in part:
            raise SystemExit(f"{name}: {CLAIMS_START} has no {CLAIMS_END}")
        table_text = table_text or claims_table()
        out.append(f"\n{table_text}\n{CLAIMS_END}" + part.split(CLAIMS_END, 1)[1])
    return CLAIMS_START.join(out)


def markdown_table(rec: dict) -> str:
    """The README's leaderboard from benchmarks/leaderboard.py's JSON (rendered between ``<!-- leaderboard:start -->``
    and ``<!-- leaderboard:end -->``): one row per entry, best streamed score first, marked rows footnoted.
    Here, not in leaderboard.py, so that a change of presentation leaves the measured JSON current."""
    p = rec["protocol"]
    params = [t["parameters"] / 1e6 for t in rec["table"]]
    lines = [f"Char-level, {min(params):.2f}-{max(params):.2f}M parameters, {p['cpu_minutes_per_model']:g} "
             "CPU-minutes of training each on "
             f"`{p['train_corpus']}` (one thread), scored on {len(p['heldout'])} held-out plays "
             f"({len(p['heldout']) * p['chars_per_play']:,} characters). bits/char: lower is better. "
             "\"streamed\": one stream, state carried; \"windows\": state reset every 128 characters.", ""]
    if rec["missing"]:
        lines += [f"**Incomplete:** not yet measured: {', '.join(rec['missing'])} (and then 3 seeds for the "
                  "best three).", ""]
    elif not rec["complete"]:
        pending = [t["entry"] for t in rec["table"] if t["entry"] in rec["top_entries_for_seeds"] and len(t["seeds"]) < 3]
        lines += [f"**Incomplete:** the best three need 3 seeds each; pending: {', '.join(pending)}.", ""]
    dynamic = [t["entry"] for t in rec["table"] if "dynamic" in t]
    lines += ["Columns: **streamed** and **windows** in bits/char, lower is better (after \"±\": the standard "
              "deviation over seeds). **streamed - windows**: below zero, carrying the state helps (the row uses more than the last "
              "128 characters); above zero, streaming hurts, and \"(> 0.05)\" marks a row that streams more than 0.05 "
              "bits/char worse (its reason below, when known)."
              + (f" The {', '.join(f'`{e}`' for e in dynamic)} row adapts a trained model: its \"windows\" is that "
                 "static model's score, not adapted, so its \"streamed - windows\" is what adapting to the text (and "
                 "carrying the cache) gains; its training columns are the static model's." if dynamic else "")
              + " **params**: parameters. **train tok/s** and **score tok/s**: tokens per CPU-second on one thread (the "
              "process's CPU time, so time spent waiting for a busy machine's cores is not counted; higher is faster); "
              "\"score\" is the streamed pass" + (", dynamic evaluation's weight updates included" if dynamic else "")
              + ". **train RSS MB**: peak resident memory of the training process, lower is better. **seeds**: training "
              "seeds the row averages.", ""]
    lines += ["| # | mechanism | streamed | windows | streamed - windows | params | train tok/s | score tok/s "
              "| train RSS MB | seeds |", "|---|---|---|---|---|---|---|---|---|---|"]
    limits: dict[str, int] = {}  # a marked row's reason -> its footnote number
    for t in rec["table"]:
        sd = f" ± {t['streamed_std']:.3f}" if t["streamed_std"] is not None else ""
        gap = f"{t['streamed_minus_windows_bits']:+.3f}" + ("" if t["streams_within_0_05"] else " (> 0.05)")
        if "streaming_limit" in t:
            gap += f" [{limits.setdefault(t['streaming_limit'], len(limits) + 1)}]"
        lines.append(f"| {t['rank']} | {t['mechanism']} (`{t['entry']}`) | {t['streamed_bits_per_char']:.3f}{sd} "
                     f"| {t['windows_bits_per_char']:.3f} | {gap} | {t['parameters'] / 1e6:.2f}M "
                     f"| {t['train_tokens_per_cpu_s']:,.0f} | {t['score_tokens_per_cpu_s']:,.0f} "
                     f"| {t['train_max_rss_mb']:,.0f} | {len(t['seeds'])} |")
    for why, i in limits.items():  # each footnote its own paragraph
        lines += ["", f"[{i}] {why}."]
    return "\n".join(lines)


def render_board(page: str, name: str) -> str:
    """Rewrite the ``<!-- leaderboard:start -->`` ... ``<!-- leaderboard:end -->`` block of a page."""
    path = RESULTS / "leaderboard.json"
    if not path.exists():
        raise SystemExit(f"{name} has a leaderboard block but there is no benchmarks/results/leaderboard.json")
    head, rest = page.split(BOARD_START, 1)
    if BOARD_END not in rest:
        raise SystemExit(f"{name}: {BOARD_START} has no {BOARD_END}")
    mark = evidence.status(path)
    text = markdown_table(json.loads(path.read_text())) + (f"\n\n({mark})" if mark else "")
    return f"{head}{BOARD_START}\n{text}\n{BOARD_END}{rest.split(BOARD_END, 1)[1]}"


def render_page(page: str, name: str) -> str:
    """The page with every results, claims and leaderboard block regenerated."""
    if START in page:
        page = render(page, name)
    if CLAIMS_START in page:
        page = render_claims(page, name)
    if BOARD_START in page:
        page = render_board(page, name)
    return page


# a cited number: the digits shown (a "-" right after a digit is a range's dash, not a sign), its unit ("%":
# the JSON holds the fraction), the JSON file's stem and the key path into it
CITE = re.compile(r"((?:(?<![\w.])-)?\d[\d,]*(?:\.\d+)?)(\s?[a-zA-Z%/*]*)\s*<!-- src: (\S+) (.+?) -->")
NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*\.\d+")  # a measured number has decimals; counts like "12-layer" do not
REGION = re.compile(r"<!-- numbers:start -->(.*?)<!-- numbers:end -->", re.S)


def cited_number_problems(page: str, name: str) -> list[str]:
    """Cited prose numbers that disagree with their JSON, and uncited numbers in numbers regions."""
    out = []
    for m in CITE.finditer(page):
        shown, stem, key = m.group(1), m.group(3), m.group(4)
        path = RESULTS / f"{stem}.json"
        try:
            value = float(_get(json.loads(path.read_text()), key))
        except (OSError, KeyError, IndexError, ValueError, TypeError) as e:
            out.append(f"{name}: {shown} cites {stem} {key}, which cannot be read ({type(e).__name__})")
            continue
        digits = len(shown.split(".")[1]) if "." in shown else 0
        scale = 100.0 if m.group(2).strip().startswith("%") else 1.0
        if round(value * scale, digits) != float(shown.replace(",", "")):
            out.append(f"{name}: {shown}{m.group(2).strip()} cites {stem} {key} = {value}")
    for region in REGION.finditer(page):
        bare = CITE.sub("", region.group(1))
        bare = re.sub(r"<!--.*?-->|`[^`]*`|[\w./-]+\.(?:json|py|md|png|toml)\b", "", bare, flags=re.S)
        for m in NUMBER.finditer(bare):
            out.append(f"{name}: the number {m.group(0)} in a numbers region cites no source")
    return out


# Where citation markers live (issue 30). Markers are required in the generated tables (their source column), in
# the README's claims table and in numbers regions (above: there every decimal must cite its key). The measurement
# write-ups (docs/results.md and docs/experiments/*.md) may also cite numbers in their prose; every marker anywhere
# is checked against its JSON (cited_number_problems). The user's-guide pages (every other page of docs/) carry no
# markers in prose: they state a measured number by linking to its row of docs/results.md or to an experiments
# page, or inside a numbers region; a marker in their prose outside one is a problem (marker_in_prose_problems).
GUIDE_PAGES = "docs/*.md"
WRITEUPS = {"docs/results.md"}  # and docs/experiments/*.md, which GUIDE_PAGES does not match
_NOT_SCANNED = re.compile(r"^[ \t]*```.*?^[ \t]*```[ \t]*$|`[^`\n]*`", re.S | re.M)  # fenced and inline code


def marker_in_prose_problems(page: str, name: str) -> list[str]:
    """Citation markers in the prose of a user's-guide page, outside numbers regions and code."""
    def blank(m: re.Match) -> str:
        return re.sub(r"[^\n]", " ", m.group(0))  # keep line numbers

    text = _NOT_SCANNED.sub(blank, REGION.sub(blank, page))
    return [f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(1)} cites {m.group(3)} in the prose of a "
            "user's-guide page: link its row of docs/results.md or an experiments page, move it to docs/experiments/, "
            "or put it in a <!-- numbers:start --> ... <!-- numbers:end --> region" for m in CITE.finditer(text)]


def prose_problems(root: Path = ROOT) -> list[str]:
    """marker_in_prose_problems of every user's-guide page (GUIDE_PAGES but WRITEUPS)."""
    problems = []
    for path in sorted(root.glob(GUIDE_PAGES)):
        name = str(path.relative_to(root))
        if name not in WRITEUPS:
            problems += marker_in_prose_problems(path.read_text(), name)
    return problems


def update_cited(page: str) -> str:
    """Rewrite every cited prose number to its JSON value, at the precision the page shows it (after a re-run)."""
    def repl(m: re.Match) -> str:
        shown, stem, key = m.group(1), m.group(3), m.group(4)
        try:
            value = float(_get(json.loads((RESULTS / f"{stem}.json").read_text()), key))
        except (OSError, KeyError, IndexError, ValueError, TypeError):
            return m.group(0)  # --check names it
        digits = len(shown.split(".")[1]) if "." in shown else 0
        value *= 100.0 if m.group(2).strip().startswith("%") else 1.0
        new = f"{value:,.{digits}f}" if "," in shown else f"{value:.{digits}f}"
        return new + m.group(0)[len(shown):]
    return CITE.sub(repl, page)


def pages() -> list[Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "docs" / "experiments").glob("*.md"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--update-cited", action="store_true",
                    help="rewrite cited prose numbers (<!-- src: STEM KEY -->) to their JSON values, then render")
    args = ap.parse_args()
    if args.update_cited:
        for path in pages():
            old = path.read_text()
            new = update_cited(old)
            if new != old:
                path.write_text(new)
                print(f"updated cited numbers in {path.relative_to(ROOT)}")
    for name, marker in REQUIRED.items():
        if not (ROOT / name).is_file() or marker not in (ROOT / name).read_text():
            raise SystemExit(f"{name} must hold a {marker} block")
    stale = []
    rerun = evidence.rerun_page()
    if not evidence.RERUN_PAGE.exists() or evidence.RERUN_PAGE.read_text() != rerun:
        stale.append(evidence.RERUN_PAGE)
        if not args.check:
            evidence.RERUN_PAGE.write_text(rerun)
            print(f"updated {evidence.RERUN_PAGE.relative_to(ROOT)}")
    for path in pages():
        old = path.read_text()
        if START not in old and CLAIMS_START not in old and BOARD_START not in old:
            continue  # a docs page without a results, claims or leaderboard table
        new = render_page(old, str(path.relative_to(ROOT)))
        if new != old:
            stale.append(path)
            if not args.check:
                path.write_text(new)
                print(f"updated {path.relative_to(ROOT)}")
    problems = []
    if args.check:
        for path in pages():
            problems += cited_number_problems(path.read_text(), str(path.relative_to(ROOT)))
        problems += prose_problems() + evidence.problems()
        for p in problems:
            print(p, file=sys.stderr)
    if args.check and stale:
        names = ", ".join(str(p.relative_to(ROOT)) for p in stale)
        print(f"results or claims tables out of date in {names}: run python benchmarks/report.py", file=sys.stderr)
    return 1 if args.check and (stale or problems) else 0


if __name__ == "__main__":
    raise SystemExit(main())
