"""Scoring throughput of backbone + Fast Weight Layer head over the same backbone with its plain linear
head, measured in the same run (Clark et al. 2022 report 1340 / 1575 = 0.85 for Transformer-XL on a V100).

    python benchmarks/speed/bench_fwl.py [--threads 1] [--batch 16] [--seq-len 128] [--hidden 0 64 32] [--layers 12] [--data NAME]

The backbone is the ``shakespeare-char`` preset and the FWL model the ``shakespeare-char-fwl`` preset
(same backbone, ``head = "fwl"``); ``--hidden`` adds FWL variants with another block width s (0 = the
preset's); ``--layers`` sets the depth of both backbones (0 = the preset's 4). The head's cost does not
depend on the depth, so the ratio does: the paper's 0.85 is for Transformer-XL large (18 layers), and
its sparse transformer has 12. Three measurements per model, interleaved so that load on a shared
machine hits all alike:

- ``window``: ``model(tokens)`` on ``[batch, seq_len]`` windows in eval mode without autograd (how the
  trainer scores validation text) -- the target metric, ratio >= 0.85;
- ``stream``: :func:`fastweights.loops.evaluate.score_tokens` over one long random document, ``seq_len``
  context and ``seq_len // 2`` stride, the state carried (how ``fastweights eval`` scores a document);
- ``train``: forward + backward (second-order through the FWL) + AdamW step on ``[batch, seq_len]``.

It also counts the matrix-multiply FLOPs of one window call of each model (``torch.utils.flop_counter``;
elementwise ops are not counted): ``flop_ratio`` = backbone FLOPs / model FLOPs is the window ratio a
perfectly efficient head would reach, the ceiling for the measured one.

Writes benchmarks/results/bench_fwl.json (or ``--name``). Random weights and random token ids: speed does
not depend on them. The vocabulary size is ``--vocab``, by default the character vocabulary of ``--data``
(a registered corpus, default ``tinyshakespeare``, the presets' corpus: 65).
"""

from __future__ import annotations

import sys
from statistics import median

import torch
from torch.utils.flop_counter import FlopCounterMode

from fastweights.evidence.result_files import write_result
from fastweights.cli.script_parser import ScriptParser, exit_status_of
from fastweights.core.threads import use_threads
from fastweights.evidence.script_args import benchmark_threads_flag
from fastweights.evidence.timing import bench_clock, timeit

from fastweights.core.config import make_config
from fastweights.data import load_corpus
from fastweights.loops.evaluate import score_tokens
from fastweights.models.lm import LanguageModel


DATA = "tinyshakespeare"  # the corpus of both presets (fastweights data list)


def char_vocab(corpus: str) -> int:
    """Size of the character vocabulary of ``corpus`` (the presets' ``char`` tokenizer, no special ids)."""
    return len(set().union(*(set(d.text) for d in load_corpus(corpus))))


def build(preset: str, overrides: list[str], vocab: int, device) -> LanguageModel:
    cfg = make_config(preset, overrides)
    cfg.model.vocab_size = vocab
    torch.manual_seed(0)
    return LanguageModel(cfg.model).to(device)


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py)."""
    return probes.preset_probes("shakespeare-char") + probes.preset_probes("shakespeare-char-fwl")



def main():
    ap = ScriptParser()
    benchmark_threads_flag(ap)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--stream-tokens", type=int, default=2048, help="length of the streamed document")
    ap.add_argument("--data", default=DATA, help=f"registered corpus whose character vocabulary sizes the models "
                                                 f"(default {DATA})")
    ap.add_argument("--vocab", type=int, default=0, help="vocabulary size (0: the character vocabulary of --data)")
    ap.add_argument("--hidden", type=int, nargs="*", default=[0], help="FWL block widths s (0 = the preset's)")
    ap.add_argument("--layers", type=int, default=0, help="backbone depth of both models (0 = the preset's)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds; ratios are per round, then the median")
    ap.add_argument("--repeat", type=int, default=4, help="timed calls per round")
    ap.add_argument("--no-train", action="store_true", help="skip the training-step measurement")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--name", default="bench_fwl")
    a = ap.parse_args()
    a.vocab = a.vocab or char_vocab(a.data)
    use_threads("benchmark", a.threads)
    dev = torch.device(a.device)

    depth = [f"model.n_layers={a.layers}"] if a.layers else []
    models = {"backbone (linear head)": build("shakespeare-char", depth, a.vocab, dev)}
    for s in a.hidden:
        sets = depth + ([f"model.options.fwl.hidden={s}"] if s else [])
        label = "backbone + fwl" + (f" (hidden={s})" if s else " (preset)")
        models[label] = build("shakespeare-char-fwl", sets, a.vocab, dev)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, a.vocab, (a.batch, a.seq_len), generator=gen).to(dev)
    y = torch.randint(0, a.vocab, (a.batch, a.seq_len), generator=gen).to(dev)
    doc = torch.randint(0, a.vocab, (a.stream_tokens,), generator=gen)

    def window(m):
        def f():
            with torch.no_grad():
                m(x)
        return f

    def stream(m):
        return lambda: score_tokens(m, doc, a.seq_len)

    def train_step(m, opt):
        def f():
            out = m(x, targets=y)
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            opt.step()
        return f

    kinds = {"window": (window, a.batch * a.seq_len), "stream": (stream, a.stream_tokens - 1)}
    fns = {}
    for label, m in models.items():
        m.eval()
        fns[("window", label)] = window(m)
        fns[("stream", label)] = stream(m)
    if not a.no_train:
        kinds["train"] = (None, a.batch * a.seq_len)
        for label, m in models.items():
            fns[("train", label)] = train_step(m, torch.optim.AdamW(m.parameters(), 1e-4))

    clock, clock_name = bench_clock(dev)
    times = {k: [] for k in fns}
    for _ in range(a.rounds):
        for key, f in fns.items():
            models[key[1]].train(key[0] == "train")
            repeat = a.repeat if key[0] != "stream" else max(1, a.repeat // 2)
            times[key].append(timeit(f, warmup=1, repeat=repeat, clock=clock))

    base = "backbone (linear head)"
    results = {}
    for kind, (_, tokens) in kinds.items():
        tps = {label: tokens / median(times[(kind, label)]) for label in models}
        # the ratio of each round's two measurements, taken minutes apart at most, then the median over
        # rounds: robust to the load of a shared machine drifting during the run
        per_round = {label: [tb / tf for tb, tf in zip(times[(kind, base)], times[(kind, label)])]
                     for label in models if label != base}
        results[kind] = {"tokens_per_s": tps,
                         "ratio_over_backbone": {label: median(r) for label, r in per_round.items()},
                         "ratio_per_round": per_round}
    flops = {}
    for label, m in models.items():
        m.eval()
        counter = FlopCounterMode(display=False)
        with counter:
            window(m)()
        flops[label] = counter.get_total_flops() / (a.batch * a.seq_len)
    results["window"]["matmul_flops_per_token"] = flops
    results["window"]["flop_ratio"] = {label: flops[base] / f for label, f in flops.items() if label != base}
    params = {label: m.num_parameters() for label, m in models.items()}
    head_opts = {label: dict(vars(m.head.options)) for label, m in models.items() if label != base}
    res = {
        "what": "scoring throughput, backbone + FWL head over backbone alone (same run, interleaved rounds)",
        "note": "CPU timings on a machine shared with other engineers; compare ratios from the same run only",
        "clock": clock_name,
        "config": vars(a),
        "parameters": params,
        "fwl_options": head_opts,
        "results": results,
        "target": {"metric": "results.window.ratio_over_backbone['backbone + fwl (preset)']", "at_least": 0.85,
                   "paper": "Transformer-XL + FWL 1340 tok/s vs 1575 tok/s on a V100 (Table 1): 0.85"},
    }
    key = "backbone + fwl (preset)"
    if key in results["window"]["ratio_over_backbone"]:
        res["target"]["measured"] = results["window"]["ratio_over_backbone"][key]
    print("flop ratio (ceiling)", {k: round(v, 3) for k, v in results["window"]["flop_ratio"].items()})
    for kind in results:
        print(kind, {k: round(v, 3) for k, v in results[kind]["ratio_over_backbone"].items()},
              {k: round(v) for k, v in results[kind]["tokens_per_s"].items()})
    write_result(a.name, res)


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
