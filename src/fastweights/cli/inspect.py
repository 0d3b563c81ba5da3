"""``fastweights inspect compare | addressing | gates``: look inside trained checkpoints.

- ``compare``: per-token NLL improvement of one checkpoint over another (:mod:`fastweights.experiments.analysis`);
- ``addressing``: product-key addressing statistics of PKM/FwPKM layers over a text and a trace of what
  retrieved slots stored (:mod:`fastweights.experiments.addressing`);
- ``gates``: the FwPKM gate value of every token of a text as a heatmap (``experiments.fwpkm_gates``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from fastweights.experiments.addressing import collect_reads, memory_layers, trace_position, windowed_addressing_stats
from fastweights.experiments.analysis import analyze, plot_analysis
from fastweights.cli.common import common_flags, device_flag, load, out_flag, output_prefix, threads_flag
from fastweights.cli.types import nonneg_int, positive_int
from fastweights.core.errors import UserError
from fastweights.evidence.provenance import write_cli_result


def register(top, parser_class) -> None:
    """Add ``fastweights inspect compare | addressing | gates``."""
    group = top.add_parser("inspect", help="look inside checkpoints: compare two, product-key addressing, FwPKM gates")
    sub = group.add_subparsers(dest="inspect_command", metavar="compare|addressing|gates", required=True,
                               parser_class=parser_class)
    _register_compare(sub)
    _register_addressing(sub)
    _register_gates(sub)


def cmd_compare(args) -> int:
    from fastweights.core.distributed import resolve_device

    result = analyze(Path(args.base), Path(args.model), data=args.data, split=args.split, seq_len=args.seq_len,
                     stride=args.stride, max_chars=args.max_chars, freq_from=args.freq_from,
                     device=str(resolve_device(args.device)), progress=not args.quiet)
    out = Path(args.out)
    write_cli_result(out / "analysis.json", result, args.argv)  # with command, commit, machine
    plot_analysis(result, out / "analysis.png")
    o = result["overall"]
    print(f"{result['data']}: {o['tokens']} tokens, base {o['base_bits']:.4f} -> model {o['model_bits']:.4f} "
          f"bits/token ({o['improvement_bits']:+.4f}); {o['repeat_share']:.0%} of tokens occurred before")
    for key in ("by_position", "by_frequency", "by_prior_count"):
        print(f"  {key}: " + ", ".join(f"{r['bucket']}: {r['improvement_bits']:+.3f}" for r in result[key]))
    print(f"wrote {out / 'analysis.json'} and {out / 'analysis.png'}")
    return 0


def _register_compare(sub) -> None:
    p = sub.add_parser("compare", help="per-token NLL improvement of one checkpoint over another, by position, "
                                       "token frequency and earlier occurrences (JSON + PNG)")
    p.add_argument("--base", required=True, help="checkpoint directory of the reference model")
    p.add_argument("--model", required=True, help="checkpoint directory of the model compared with it")
    p.add_argument("--data", help="text to score (file, directory, corpus name); default: the model's split")
    p.add_argument("--split", default="test", choices=["train", "val", "test"],
                   help="split of the model's corpus to score when --data is not given")
    p.add_argument("--context", dest="seq_len", metavar="TOKENS", type=nonneg_int, default=0,
                   help="attention context in tokens (0: the model's training seq_len)")
    p.add_argument("--stride", type=positive_int, default=None, help="tokens per call (default: half the context)")
    p.add_argument("--max-chars", type=nonneg_int, default=0, help="score only the first N characters (0 = all)")
    p.add_argument("--freq-from", default="train", choices=["train", "eval"],
                   help="token frequencies from the base's training split or from the scored text")
    out_flag(p, "runs/analysis", "analysis.json and analysis.png")
    device_flag(p, "cpu")
    threads_flag(p)
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.set_defaults(func=cmd_compare)


def cmd_addressing(args) -> int:
    from fastweights.models.loading import load_checkpoint
    from fastweights.data import load_corpus
    from fastweights.core.distributed import resolve_device

    _check_window(args.window)
    out = output_prefix(args, "addressing") if args.out else None
    model, tokenizer, cfg = load_checkpoint(Path(args.checkpoint), map_location=str(resolve_device(args.device)))
    if args.text is not None:
        texts = [args.text]
    elif args.data:
        texts = [d.text for d in load_corpus(args.data, text_field=cfg.data.text_field)]
    else:  # the validation split: a bounded default, never the whole training corpus
        from fastweights.adapt.setup import load_texts

        texts = load_texts(None, cfg, "val")
    ids: list[int] = []
    for t in texts:  # one stream in document order, as the paper's 8M-token evaluation sets
        ids.extend(int(i) for i in tokenizer.encode(t))
    if args.max_tokens:
        ids = ids[: args.max_tokens]
    if len(ids) < 2:
        raise UserError("the text has fewer than two tokens")
    seq_len = args.seq_len or cfg.train.seq_len
    tokens = torch.tensor(ids, dtype=torch.long)
    reads, tracers, loss = collect_reads(model, tokens, seq_len, args.stride, trace=bool(args.trace))
    layers = {}
    for name, (idx, _, gates) in reads.items():
        n_slots = dict(memory_layers(model))[name].n_slots
        stats = windowed_addressing_stats(idx, n_slots, args.window)
        stats.pop("per_window")
        if gates is not None:
            stats["gate_mean"] = float(gates.float().mean())
        layers[name] = stats
    fw = [s for name, s in layers.items() if type(dict(memory_layers(model))[name]).__name__ == "FwPKM"]
    summary = {"checkpoint": str(args.checkpoint), "data": "text" if args.text is not None else args.data or
               f"{cfg.data.corpus}:val", "tokens": len(ids), "window": args.window, "loss_nats": loss,
               "loss_bits": loss / math.log(2), "better": BETTER, "layers": layers}
    if fw:
        summary["fwpkm_mean"] = {k: sum(s[k] for s in fw) / len(fw) for k in ("collision", "coverage", "kld")}
    decode = lambda t: tokenizer.decode(list(t))  # noqa: E731
    if args.trace:
        summary["trace"] = {}
        for pos in args.trace:
            summary["trace"][str(pos)] = {
                "token": decode([ids[pos]]) if 0 <= pos < len(ids) else None,
                "layers": {name: trace_position(reads[name][0], reads[name][1], tr, ids, pos, decode)
                           for name, tr in tracers.items()},
            }
    if out is not None:
        from fastweights.core.files import atomic_write

        atomic_write(out.with_suffix(".json"), lambda p: p.write_text(json.dumps(summary, indent=2) + "\n"))
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"{summary['data']}: {len(ids)} tokens, loss {loss / math.log(2):.4f} bits/token, windows of "
              f"{args.window} tokens")
        print("  (balanced addressing: collision lower is better, coverage higher is better, KLD from uniform lower "
              "is better)")
        for name, s in layers.items():
            note = " (text shorter than one window)" if s["partial"] else ""
            gate = f"  mean gate {s['gate_mean']:.3f}" if "gate_mean" in s else ""
            print(f"  {name}: collision {100 * s['collision']:.1f}%  coverage {100 * s['coverage']:.1f}%  "
                  f"KLD {s['kld']:.3f}{gate}  over {s['windows']} window(s){note}")
        for pos, t in summary.get("trace", {}).items():
            print(f"token {pos} {t['token']!r}:")
            for name, rows in t["layers"].items():
                print(f"  {name}")
                for r in rows:
                    stored = "; ".join(
                        f"{e['query_token']!r}->{e['target_token']!r} @{e['target_pos']}: {e['context']!r}"
                        for e in r["stored"][:3]) or "(initial value: never written before this read)"
                    print(f"    slot {r['slot']}: {stored}")
    return 0


def _register_addressing(sub) -> None:
    p = sub.add_parser("addressing", help="addressing statistics (collision, coverage, KLD) of PKM/FwPKM "
                                            "layers over a text, and a trace of what retrieved slots stored")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory")
    p.add_argument("--data", help="file, directory or corpus name (default: the checkpoint's validation split)")
    p.add_argument("--text", help="score this literal text instead of --data, e.g. a prompt plus a generation "
                                  "(default: --data)")
    p.add_argument("--window", type=positive_int, default=32768, help="tokens per statistics window (paper: 32768)")
    p.add_argument("--context", dest="seq_len", metavar="TOKENS", type=nonneg_int, default=0,
                   help="attention context in tokens (0: the training seq_len)")
    p.add_argument("--stride", type=positive_int, default=None, help="tokens per model call (default: half the context)")
    p.add_argument("--max-tokens", type=nonneg_int, default=ADDRESSING_TOKENS,
                   help="score only the first N tokens (0: all; the paper's statistics use windows of 32768)")
    p.add_argument("--trace", type=nonneg_int, nargs="*", default=None,
                   help="token positions to trace: list the slots each read and what they stored at their last write "
                        "(default: no trace)")
    device_flag(p, "cpu")
    threads_flag(p)
    out_flag(p, None, "addressing.json (the summary)", optional=True)
    p.add_argument("--overwrite", action="store_true", help="replace the outputs of an earlier run in --out")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_addressing)


# which direction is good for each addressing statistic (printed with them, and kept in the JSON)
BETTER = {"collision": "lower (fewer reads land on a slot read more than once)",
          "coverage": "higher (more of the memory's slots are used)",
          "kld": "lower (reads spread closer to uniform over the slots)"}
ADDRESSING_TOKENS = 65536  # inspect addressing's default text: two of the paper's 32768-token windows


def _check_window(window: int) -> None:
    if window < 1:
        raise UserError(f"--window must be a positive number of tokens, got {window}")


def _register_gates(sub) -> None:
    g = sub.add_parser("gates", help="FwPKM gate value of every token of a text, as a heatmap PNG")
    common_flags(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="text file (or corpus name) to read")
    src.add_argument("--text", help="the text itself")
    g.add_argument("--max-tokens", type=positive_int, default=1024, help="tokens shown (from the start of the text)")
    g.add_argument("--write-chunk", type=nonneg_int, default=32, help="memory write chunk while reading (paper: 32; 0: trained)")
    g.add_argument("--width", type=positive_int, default=64, help="tokens per row of the picture")
    out_flag(g, "runs/fwpkm_gates", "gates.png and gates.json (the values)")
    g.set_defaults(func=cmd_gates)


def cmd_gates(args) -> int:
    from fastweights.data import load_corpus
    from fastweights.experiments.fwpkm_gates import gate_values, plot_gate_map

    out = output_prefix(args, "gates")
    model, tok, cfg = load(args.checkpoint, args.device)
    text = args.text if args.text is not None else "\n\n".join(d.text for d in load_corpus(args.data))
    if args.max_tokens < 1 or args.width < 1:
        raise UserError("--max-tokens and --width must be >= 1")
    ids = tok.encode(text)[: args.max_tokens]
    text = tok.decode(list(ids))
    ids, gates = gate_values(model, tok, text, chunk_size=args.write_chunk or None)
    tokens = [tok.decode([int(i)]) for i in ids]
    plot_gate_map(tokens, gates, out.with_suffix(".png"), width=args.width,
                  title=f"FwPKM gates, {Path(args.checkpoint).name}, write chunk {args.write_chunk or 'trained'}")
    doc = {"checkpoint": str(args.checkpoint), "tokens": tokens,
           "gates": {str(k): [round(float(x), 5) for x in v] for k, v in gates.items()},
           "mean_gate": {str(k): float(v.mean()) for k, v in gates.items()}}
    write_cli_result(out.with_suffix(".json"), doc, args.argv)
    if args.json:
        print(json.dumps({k: doc[k] for k in ("checkpoint", "mean_gate")}, indent=2))
    else:
        print("mean gate per FwPKM layer: " + ", ".join(f"layer {k} {v:.3f}" for k, v in doc["mean_gate"].items()))
        print(f"-> {out.with_suffix('.png')}, {out.with_suffix('.json')}")
    return 0
