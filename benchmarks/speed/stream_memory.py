"""Streaming evaluation in constant memory: peak RSS of `stream_eval` over 100K and 1M tokens, same run.

Two small models with an FwPKM memory (random initialisation: this measures memory and speed, not
quality), one with softmax-attention mixers (RoPE, KV cache bounded to ``seq_len - stride`` tokens) and
one with delta-rule fast weight programmer mixers, stream the documents of ``--data`` (a corpus name,
file or directory; default the bundled ``long-docs``: the three novels and the 65 State of the Union
addresses, repeated when shorter than the stream) in ``carry`` mode:
state carried across documents, per-position curves kept as bin sums. Each (model, length) runs in
its own process, so each peak RSS is that run's own; the 100K-token run is the baseline of the ratios.
(RoPE angles are computed per call for that call's positions, so no table grows with the stream.)
A progress line goes to stderr every 10 s; the script counts those lines.

    python benchmarks/speed/stream_memory.py [--tokens 100000,1000000] [--data long-docs] [--threads 1]

Writes benchmarks/results/stream_memory.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from fastweights.evidence.result_files import write_result
from fastweights.cli.script_parser import ScriptParser, exit_status_of
from fastweights.core.threads import use_threads
from fastweights.evidence.script_args import benchmark_threads_flag

FWPKM = dict(d_model=64, n_layers=2, n_heads=4, memory="fwpkm", memory_layers=[1],
             options={"fwpkm": dict(n_subkeys=64, d_key=64, d_value=64, topk=8, chunk_size=256)})
MODELS = {"attention+fwpkm": dict(FWPKM, mixer="attention"),
          "fwp_delta+fwpkm": dict(FWPKM, mixer="fwp", options={**FWPKM["options"], "fwp": {"rule": "delta"}})}
SEQ_LEN = 256


def child(name: str, tokens: int, data: str, threads: int) -> dict:
    import torch

    use_threads("benchmark", threads)
    from fastweights.core.config import ModelConfig
    from fastweights.data import CharTokenizer, load_corpus
    from fastweights.experiments.streaming import current_rss_mb, encode_documents, peak_rss_mb, stream_eval
    from fastweights.models.lm import LanguageModel

    docs = load_corpus(data)
    while sum(d.n_chars for d in docs) < tokens + len(docs):  # a short corpus is read again
        docs = docs + docs
    tok = CharTokenizer.from_text(d.text for d in docs[:20])
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(vocab_size=tok.vocab_size, **MODELS[name])).eval()
    rss_loaded = current_rss_mb()
    res = stream_eval(model, encode_documents(docs, tok), "carry", SEQ_LEN, bin_width=1024, max_tokens=tokens,
                      progress=True)
    return {"tokens": res.tokens, "documents": len(res.documents), "elapsed_s": res.elapsed_s,
            "tokens_per_s": res.tokens / res.elapsed_s, "loss_nats": res.loss,
            "rss_mb_after_model_load": rss_loaded, "rss_mb_during_stream_max": res.rss_mb["max_sampled"],
            "peak_rss_mb": peak_rss_mb(), "curve_bins": len(res.curve.to_dict()["position"])}


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py)."""
    return [s for config in MODELS.values() for s in probes.model_probes(config, ("carry",))]



def main() -> None:
    p = ScriptParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="100000,1000000")
    p.add_argument("--data", default="long-docs", help="corpus name, file or directory (default: long-docs)")
    benchmark_threads_flag(p)
    p.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--model", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.child, args.data, args.threads)))
        return
    sizes = sorted(int(x) for x in args.tokens.split(","))
    runs: dict[str, dict] = {}
    for name in MODELS:
        runs[name] = {}
        for n in sizes:
            proc = subprocess.run([sys.executable, __file__, "--child", str(n), "--model", name, "--data", args.data,
                                   "--threads", str(args.threads)], capture_output=True, text=True, check=True)
            rec = json.loads(proc.stdout.strip().splitlines()[-1])
            rec["progress_lines"] = sum(1 for line in proc.stderr.splitlines() if line.startswith("stream carry"))
            rec["progress_last_line"] = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
            runs[name][str(n)] = rec
            print(f"{name:>16} {n:>9,} tokens: {rec['tokens_per_s']:,.0f} tok/s, peak RSS {rec['peak_rss_mb']:.0f} MiB "
                  f"(after model load {rec['rss_mb_after_model_load']:.0f} MiB), "
                  f"{rec['progress_lines']} progress lines")
    ratios = {}
    for name, r in runs.items():
        base, big = r[str(sizes[0])], r[str(sizes[-1])]
        ratios[name] = {"tokens": big["tokens"] / base["tokens"], "peak_rss": big["peak_rss_mb"] / base["peak_rss_mb"]}
    write_result("stream_memory", {
        "note": "machine shared with other engineers: timings are noisy; the RSS ratios are what matter",
        "models": {k: {**v, "seq_len": SEQ_LEN, "stride": SEQ_LEN // 2} for k, v in MODELS.items()},
        "init": "random (seed 0)", "tokenizer": "char", "data": args.data, "mode": "carry", "threads": args.threads,
        "runs": runs, "ratios_largest_over_smallest": ratios,
    })


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
