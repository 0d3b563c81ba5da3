"""Commands of the long-context experiments: ``fastweights niah | stream-eval | adapt-test | fwpkm-gates``.

    fastweights niah --checkpoint runs/niah-cpu --lengths 1024,2048,4096 --iters 1,2 --samples 20 \\
        --haystack tinyshakespeare --out runs/niah-cpu/niah              # -> niah.json, niah.png
    fastweights stream-eval --checkpoint runs/a --checkpoint runs/b --data long-docs \\
        --modes carry,reset,frozen --out runs/stream                           # -> stream.json, stream.png
    fastweights adapt-test --checkpoint runs/a --domain shakespeare=shakespeare-heldout --domain spanish=don-quijote \\
        --out runs/adapt                                                       # -> adapt.json, adapt.png
    fastweights fwpkm-gates --checkpoint runs/fwpkm --data page.txt --out runs/gates.png

``stream-eval`` and ``adapt-test`` take ``--dynamic RULE`` (with ``--dynamic-lr`` etc.) to put dynamic
evaluation on top of the checkpoint (see ``fastweights dynamic-eval``).

``run_stream_eval(args)`` is the function behind ``stream-eval`` and behind ``fastweights eval
--stream``; it reads these attributes of ``args`` (missing ones take the defaults shown):
``checkpoint`` (a path, or a list of paths: one run per checkpoint and mode, same documents),
``data`` (None: the first checkpoint's ``split`` split), ``split`` ("test"), ``seq_len`` (0: the training
seq_len), ``stride`` (None: seq_len // 2), ``modes`` ("carry,reset,frozen"), ``bin`` (256),
``max_tokens`` (0: all), ``max_chars`` (0: all), ``out`` ("runs/stream": writes OUT.json and OUT.png),
``labels`` (None), ``device`` ("auto"), ``threads`` (0), ``json`` (False), ``quiet`` (False), and the
dynamic-evaluation attributes ``dynamic`` (None), ``dynamic_lr``, ``dynamic_decay``,
``dynamic_segment_len``, ``dynamic_stats``, ``dynamic_params``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch

import fastweights.tasks.niah  # noqa: F401  (registers the corpus "niah-tinyshakespeare" used by configs/niah-cpu.toml)
import fastweights.tasks.niah_token  # noqa: F401  (registers "niah-token-tinyshakespeare", configs/niah-token.toml)
from fastweights.errors import UserError
from fastweights.experiments.probes import fingerprinted, probe, run_probes
from fastweights.provenance import write_cli_result

PROBED_MODES = ("carry", "reset", "memory", "windows")  # stream modes a result's probes re-run (frozen: as carry)
from fastweights.validate import nonneg_float, nonneg_int, positive_int, seed


def _ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{what} must be integers separated by commas, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise UserError(f"{what} must be positive integers separated by commas, got {text!r}")
    return vals


def _common(p, several: bool = False) -> None:
    if several:
        p.add_argument("--checkpoint", action="append", required=True,
                       help="checkpoint directory; repeat to compare models on the same text")
    else:
        p.add_argument("--checkpoint", required=True, help="checkpoint directory")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=nonneg_int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument("--overwrite", action="store_true", help="replace the outputs of an earlier run at --out")


def _dynamic_args(p) -> None:
    g = p.add_argument_group("dynamic evaluation on top (see `fastweights dynamic-eval`)")
    g.add_argument("--dynamic", metavar="RULE", help="adapt the slow weights too: sgd, rms-global-prior, ...")
    g.add_argument("--dynamic-lr", type=nonneg_float, default=None, help="eta (default 5e-5, or the --dynamic-tuned file's)")
    g.add_argument("--dynamic-decay", type=nonneg_float, default=None, help="lambda (default 0.002, or the --dynamic-tuned file's)")
    g.add_argument("--dynamic-segment-len", type=nonneg_int, default=0, help="predictions per update (default 20 char/byte, 128 BPE)")
    g.add_argument("--dynamic-stats", help="gradient statistics file for the RMS rules")
    g.add_argument("--dynamic-tuned", help="lr and decay from this tune-dynamic --save file (used only when named)")
    g.add_argument("--dynamic-params", help="adapt only parameters matching these globs")


def register_cli(sub) -> None:
    n = sub.add_parser("niah", help="needle in a haystack with n-iter re-reading: accuracy by depth x length (PNG + JSON)")
    _common(n)
    n.add_argument("--haystack", default="tinyshakespeare",
                   help="haystack text: a file, a directory of .txt files, or a corpus name (default tinyshakespeare)")
    n.add_argument("--lengths", default="1024,2048,4096", help="context lengths in tokens, comma-separated")
    n.add_argument("--depths", default="uniform", help="'uniform' or target depths in [0, 1], e.g. 0,0.25,0.5,0.75,1")
    n.add_argument("--depth-bins", type=positive_int, default=5, help="rows of the heatmap with --depths uniform")
    n.add_argument("--samples", type=positive_int, default=10, help="samples per length (or per length and depth)")
    n.add_argument("--iters", default="1", help="n-iter protocol: reads of the context before the question, e.g. 1,2,3,4")
    n.add_argument("--seed", type=seed, default=0)
    n.add_argument("--write-chunk", default="read", choices=["read", "model"],
                   help="memories write once per read (the paper) or every trained chunk")
    n.add_argument("--reread", default="carry", choices=["carry", "memory"],
                   help="between reads carry the whole state, or only the memories (mixer states reset)")
    n.add_argument("--piece", type=positive_int, default=512, help="tokens per forward call")
    n.add_argument("--context", type=nonneg_int, default=0, help="KV-cache tokens kept between calls (0: unbounded)")
    n.add_argument("--carry", action="store_true", help="carry the state from sample to sample (the released code)")
    n.add_argument("--max-new-tokens", type=nonneg_int, default=0, help="decoding budget (0: automatic)")
    n.add_argument("--out", default="runs/niah", help="output prefix: writes PREFIX.json and PREFIX.png")
    n.add_argument("--show", type=nonneg_int, default=0, help="print the first N prompts with the model's answers")
    n.add_argument("--format", default="auto", choices=["auto", "char", "token"],
                   help="needle format: 'char' (ID-3fa9 / 6 digits), 'token' (one-token keys and values, "
                        "fastweights.tasks.niah_token); 'auto' picks token for a model trained on it")
    n.add_argument("--frozen-memory", action="store_true",
                   help="memories never write (the paper's frozen-memory check, App. D.2)")
    n.add_argument("--keys", default="heldout", choices=["heldout", "train"],
                   help="token format: keys never used in training needles (default) or the training keys")
    n.set_defaults(func=cmd_niah)

    s = sub.add_parser("stream-eval", help="streaming perplexity along documents: carry / reset / frozen / memory, "
                                           "per-position curves (PNG + JSON)")
    _common(s, several=True)
    s.add_argument("--data", help="documents to score (file, directory, corpus name); default: the test split")
    s.add_argument("--split", default="test", choices=["train", "val", "test"])
    s.add_argument("--seq-len", type=nonneg_int, default=0, help="context length (default: the training seq_len)")
    s.add_argument("--stride", type=positive_int, default=None, help="predictions per call (default seq_len // 2)")
    s.add_argument("--modes", default="carry,reset,frozen", help="comma-separated: carry, reset, frozen, memory, windows")
    s.add_argument("--bin", type=positive_int, default=256, help="predictions per bin of the per-position curves")
    s.add_argument("--max-tokens", type=nonneg_int, default=0, help="stop after this many predictions per run (0: all)")
    s.add_argument("--max-chars", type=nonneg_int, default=0, help="read at most this many characters of the data (0: all)")
    s.add_argument("--label", dest="labels", action="append", help="legend label per --checkpoint")
    s.add_argument("--out", default="runs/stream", help="output prefix: writes PREFIX.json and PREFIX.png")
    _dynamic_args(s)
    s.set_defaults(func=run_stream_eval)

    a = sub.add_parser("adapt-test", help="continual adaptation across domains: NLL change per stage (table, PNG, JSON)")
    _common(a)
    a.add_argument("--domain", action="append", required=True, metavar="NAME=PATH",
                   help="a domain's text (file, directory or corpus name); repeat, in adaptation order")
    a.add_argument("--adapt-tokens", type=positive_int, default=20000, help="adaptation tokens per domain (from its start)")
    a.add_argument("--eval-tokens", type=positive_int, default=5000, help="held-out tokens per domain (from its end)")
    a.add_argument("--seq-len", type=nonneg_int, default=0, help="context length (default: the training seq_len)")
    a.add_argument("--stride", type=positive_int, default=None, help="predictions per call (default seq_len // 2)")
    a.add_argument("--eval-state", default="memory", choices=["memory", "all"],
                   help="score from the post-stage memories only (mixers fresh), or from the whole state")
    a.add_argument("--out", default="runs/adapt", help="output prefix: writes PREFIX.json and PREFIX.png")
    _dynamic_args(a)
    a.set_defaults(func=cmd_adapt_test)

    g = sub.add_parser("fwpkm-gates", help="FwPKM gate value of every token of a text, as a heatmap PNG")
    _common(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="text file (or corpus name) to read")
    src.add_argument("--text", help="the text itself")
    g.add_argument("--max-tokens", type=positive_int, default=1024, help="tokens shown (from the start of the text)")
    g.add_argument("--write-chunk", type=nonneg_int, default=32, help="memory write chunk while reading (paper: 32; 0: trained)")
    g.add_argument("--width", type=positive_int, default=64, help="tokens per row of the picture")
    g.add_argument("--out", default="runs/fwpkm_gates.png", help="PNG path (a .json with the values goes beside it)")
    g.set_defaults(func=cmd_gates)


# ----------------------------------------------------------------------------- shared


def _setup(args):
    if getattr(args, "threads", 0):
        torch.set_num_threads(args.threads)


def _load(path, device: str = "auto"):
    from fastweights.checkpoint import load_checkpoint
    from fastweights.distributed import resolve_device

    return load_checkpoint(Path(path), map_location=str(resolve_device(device)))


def _evaluator(args, model, tok, cfg, ckpt, seq_len: int):
    """A DynamicEvaluator from the ``dynamic*`` attributes of ``args``, or None."""
    rule = getattr(args, "dynamic", None)
    if not rule:
        return None
    from fastweights.adapt.cli import build_evaluator

    ns = SimpleNamespace(dynamic=rule, lr=getattr(args, "dynamic_lr", None), decay=getattr(args, "dynamic_decay", None),
                         eps=None, segment_len=getattr(args, "dynamic_segment_len", 0) or 0, seq_len=seq_len,
                         stats=getattr(args, "dynamic_stats", None), params=getattr(args, "dynamic_params", None),
                         exclude_params=None, sparse_units=0, sparse_layer=None, checkpoint=str(ckpt),
                         tuned=getattr(args, "dynamic_tuned", None))
    ev, info = build_evaluator(ns, model, tok, cfg, Path(ckpt), progress=not getattr(args, "quiet", False))
    return ev, info


def _output_prefix(args, default: str) -> Path:
    """``--out`` as a path prefix (PREFIX.json, PREFIX.png), checked before any work: the outputs of an
    earlier run there are refused unless ``--overwrite``. Without ``--out`` (``eval --stream``), a fresh
    name ``DEFAULT-DATE-TIME``."""
    given = getattr(args, "out", None)
    out = Path(given or time.strftime(f"{default}-%Y%m%d-%H%M%S"))
    if not given:  # a fresh name, also for two runs within one second
        base, n = out, 2
        while out.with_suffix(".json").exists() or out.with_suffix(".png").exists():
            out, n = base.with_name(f"{base.name}-{n}"), n + 1
    taken = [p for p in (out.with_suffix(".json"), out.with_suffix(".png")) if p.exists()]
    if taken and not getattr(args, "overwrite", False):
        raise UserError(f"{taken[0]} exists (an earlier run); pass --overwrite or choose another --out")
    if out.parent.exists() and not out.parent.is_dir():
        raise UserError(f"--out {out}: {out.parent} is not a directory")
    return out


def _describe(cfg) -> str:
    m = cfg.model
    mixers = sorted(set(m.layer_mixers or [m.mixer]))
    parts = ["+".join(mixers)]
    if m.memory:
        parts.append(f"{m.memory}@{','.join(str(i) for i in m.memory_layers)}")
    if m.head != "linear":
        parts.append(f"head {m.head}")
    return " | ".join(parts)


# ----------------------------------------------------------------------------- niah


def cmd_niah(args) -> int:
    from fastweights.tasks.niah import (Haystack, NiahOptions, evaluate_niah, make_samples, parse_depths, plot_niah,
                                        records_to_json, summarize, check_tokenizer)

    from fastweights.tasks import niah_token

    _setup(args)
    out = _output_prefix(args, "runs/niah")
    model, tok, cfg = _load(args.checkpoint, args.device)
    token_format = args.format == "token" or (args.format == "auto" and niah_token.is_token_format(tok))
    if token_format and not niah_token.is_token_format(tok):
        raise UserError("--format token needs a word-level model trained on the token needle format "
                        "(e.g. the niah-token preset); this model's tokenizer lacks its reserved tokens")
    if not token_format:
        check_tokenizer(tok)
    lengths = _ints(args.lengths, "--lengths")
    iters = tuple(sorted(set(_ints(args.iters, "--iters"))))
    depths = parse_depths(args.depths)
    if args.samples < 1:
        raise UserError("--samples must be >= 1")
    if args.depth_bins < 1:
        raise UserError("--depth-bins must be >= 1")
    opts = NiahOptions(iters=iters, write_chunk=args.write_chunk, reread=args.reread, piece=args.piece,
                       context=args.context, carry=args.carry, max_new_tokens=args.max_new_tokens,
                       frozen_memory=args.frozen_memory)
    opts.validate()
    if token_format:  # the default haystack's last tenth: text the token-format training never used
        haystack = niah_token.eval_haystack(args.haystack)
        samples = niah_token.make_samples(haystack, lengths, depths, args.samples, args.seed, keys=args.keys)
        if args.keys == "heldout":  # never trained: drawn from the trained keys' embeddings (see the function)
            niah_token.init_heldout_keys(model, tok, seed=args.seed)
    else:
        haystack = Haystack.load(args.haystack)
        samples = make_samples(haystack, tok, lengths, depths, args.samples, args.seed)
    records = evaluate_niah(model, tok, samples, opts, progress=not args.quiet)
    summary = summarize(records, depths, args.depth_bins)
    meta = {"checkpoint": str(args.checkpoint), "model": _describe(cfg),
            "haystack": haystack.name, "format": "token" if token_format else "char",
            **({"keys": args.keys, "heldout_key_embeddings": "mean + std * N(0, 1) of the trained keys'"
                if args.keys == "heldout" else "trained"} if token_format else {}), "lengths": lengths, "depths": depths, "samples_per_cell": args.samples,
            "seed": args.seed, "options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(opts).items()},
            "train_seq_len": cfg.train.seq_len}
    doc = records_to_json(records, summary, meta)
    write_cli_result(out.with_suffix(".json"), doc, getattr(args, "argv", None),
                     run_probes(cfg) + fingerprinted([probe("task", name="niah")]))
    plot_niah(summary, out.with_suffix(".png"), title=f"NIAH: {Path(args.checkpoint).name} ({_describe(cfg)})")
    for s in samples[: args.show]:
        recs = [r for r in records if r["seed"] == s.seed]
        print(f"--- {s.seed}: context {s.tokens} tokens, target depth {s.target_depth:.2f}")
        print(s.context[-300:].replace("\n", " ") + s.question)
        print("    answer", s.answer, "| model", ", ".join(f"{r['iters']}-iter {r['prediction']!r}" for r in recs))
    if args.json:
        print(json.dumps({k: v for k, v in doc.items() if k != "records"}, indent=2))
        return 0
    print(f"NIAH {Path(args.checkpoint).name} ({_describe(cfg)}), {args.samples} samples per cell, haystack {args.haystack}")
    second = "candidate" if token_format else "digits"  # a one-token answer has no digits to count
    print(f"{'length':>8}  " + "  ".join(f"{n}-iter exact/{second[:5]}" for n in summary["iters"]))
    for L in summary["lengths"]:
        cells = []
        for n in summary["iters"]:
            a = summary["by_iters"][n]["by_length"][L]
            cells.append(f"{a['exact']:>6.2f} / {a[second]:.2f}  ")
        print(f"{L:>8}  " + "  ".join(cells))
    print(f"-> {out.with_suffix('.json')}, {out.with_suffix('.png')}")
    return 0


# ----------------------------------------------------------------------------- stream-eval


def run_stream_eval(args) -> int:
    """``stream-eval`` / ``eval --stream``: see the module docstring for the attributes of ``args``."""
    from fastweights.data import load_corpus, split_corpus
    from fastweights.experiments.streaming import STREAM_MODES, encode_documents, plot_stream, stream_eval

    _setup(args)
    out = _output_prefix(args, "runs/stream")
    ckpts = args.checkpoint if isinstance(args.checkpoint, (list, tuple)) else [args.checkpoint]
    labels = getattr(args, "labels", None) or []
    if labels and len(labels) != len(ckpts):
        raise UserError(f"--label given {len(labels)} times for {len(ckpts)} checkpoints")
    modes = [m.strip() for m in (getattr(args, "modes", None) or "carry,reset,frozen").split(",") if m.strip()]
    bad = [m for m in modes if m not in STREAM_MODES]
    if bad or not modes:
        raise UserError(f"unknown stream mode {bad[0] if bad else ''!r}; choose from {', '.join(STREAM_MODES)}")
    quiet = getattr(args, "quiet", False)
    data = getattr(args, "data", None)
    split = getattr(args, "split", None) or "test"
    runs, measured = [], []
    for k, path in enumerate(ckpts):
        model, tok, cfg = _load(path, getattr(args, "device", "auto"))
        seq_len = getattr(args, "seq_len", 0) or cfg.train.seq_len
        stride = getattr(args, "stride", None)
        if data:
            docs = load_corpus(data, text_field=cfg.data.text_field)
        else:
            docs = split_corpus(load_corpus(cfg.data.corpus, text_field=cfg.data.text_field), cfg.data.split,
                                cfg.data.val_fraction, cfg.data.test_fraction)[split]
        built = _evaluator(args, model, tok, cfg, path, seq_len)
        ev, info = built if built else (None, None)
        measured += run_probes(cfg, tuple(m for m in modes if m in PROBED_MODES), ev.rule if ev is not None else None)
        label = labels[k] if labels else f"{Path(path).name} ({_describe(cfg)})"
        for mode in modes:
            res = stream_eval(model, encode_documents(docs, tok, getattr(args, "max_chars", 0) or 0), mode, seq_len,
                              stride, getattr(args, "bin", 256) or 256, getattr(args, "max_tokens", 0) or 0, ev,
                              progress=not quiet)
            if res.tokens == 0:
                raise UserError("nothing to score: the documents have fewer than two tokens")
            d = res.to_dict()
            d.update(checkpoint=str(path), label=f"{label} {mode}" + (f" +dynamic {ev.rule}" if ev and mode != "frozen" else ""),
                     model=_describe(cfg), seq_len=seq_len, stride=stride or max(1, seq_len // 2),
                     tokenizer=tok.name, not_frozen=_not_frozen(model, mode),
                     dynamic=(ev.metadata() | info) if ev is not None and mode != "frozen" else None)
            runs.append(d)
    doc = {"data": data or f"{cfg.data.corpus}:{split}", "modes": modes, "runs": runs}
    write_cli_result(out.with_suffix(".json"), doc, getattr(args, "argv", None), measured)
    plot_stream(runs, out.with_suffix(".png"), unit="bits" if tok.name in ("char", "byte") else "nats")
    if getattr(args, "json", False):
        print(json.dumps({**doc, "runs": [{k: v for k, v in r.items() if k not in ("curve", "documents", "state_norm")} for r in runs]},
                         indent=2))
        return 0
    w = max(len(r["label"]) for r in runs)
    print(f"{'run':<{w}}  {'tokens':>9}  {'bits/tok':>8}  {'ppl':>9}  {'tok/s':>8}  {'peak RSS MiB':>12}")
    for r in runs:
        print(f"{r['label']:<{w}}  {r['tokens']:>9,}  {r['bits_per_token']:>8.4f}  {r['perplexity']:>9.3f}  "
              f"{(r['tokens_per_s'] or 0):>8,.0f}  {r['rss_mb']['peak_process']:>12.0f}")
    print(f"-> {out.with_suffix('.json')}, {out.with_suffix('.png')}")
    return 0


def _not_frozen(model, mode: str) -> list[str]:
    from fastweights.memory_switches import fast_memories, unfrozen_fast_parts

    if mode != "frozen":
        return []
    parts = unfrozen_fast_parts(model)
    if not fast_memories(model):
        parts.append("no memory with a write step: frozen equals carry")
    return parts


# ----------------------------------------------------------------------------- adapt-test


def cmd_adapt_test(args) -> int:
    from fastweights.data import load_corpus
    from fastweights.experiments.continual_adaptation import adapt_test, format_adapt_table, make_domain, plot_adapt

    _setup(args)
    out = _output_prefix(args, "runs/adapt")
    model, tok, cfg = _load(args.checkpoint, args.device)
    seq_len = args.seq_len or cfg.train.seq_len
    domains = []
    for spec in args.domain:
        if "=" not in spec:
            raise UserError(f"--domain {spec!r} must be NAME=PATH")
        name, path = spec.split("=", 1)
        text = "\n\n".join(d.text for d in load_corpus(path, text_field=cfg.data.text_field))
        domains.append(make_domain(name.strip(), text, tok, args.adapt_tokens, args.eval_tokens))
    if len({d.name for d in domains}) != len(domains):
        raise UserError("--domain names must be distinct")
    built = _evaluator(args, model, tok, cfg, args.checkpoint, seq_len)
    ev, info = built if built else (None, None)
    res = adapt_test(model, domains, seq_len, args.stride, args.eval_state, ev, progress=not args.quiet)
    res.update(checkpoint=str(args.checkpoint), model=_describe(cfg),
               dynamic=(ev.metadata() | info) if ev is not None else None)
    write_cli_result(out.with_suffix(".json"), res, getattr(args, "argv", None),
                     run_probes(cfg, dynamic_rule=ev.rule if ev is not None else None))
    plot_adapt(res, out.with_suffix(".png"), title=f"continual adaptation: {Path(args.checkpoint).name} ({_describe(cfg)})"
               + (f" + dynamic {ev.rule}" if ev else ""))
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(format_adapt_table(res))
    print(f"-> {out.with_suffix('.json')}, {out.with_suffix('.png')}")
    return 0


# ----------------------------------------------------------------------------- fwpkm-gates


def cmd_gates(args) -> int:
    from fastweights.data import load_corpus
    from fastweights.experiments.fwpkm_gates import gate_values, plot_gate_map

    _setup(args)
    out = _output_prefix(args, "runs/fwpkm_gates")
    model, tok, cfg = _load(args.checkpoint, args.device)
    text = args.text if args.text is not None else "\n\n".join(d.text for d in load_corpus(args.data))
    if args.max_tokens < 1 or args.width < 1:
        raise UserError("--max-tokens and --width must be >= 1")
    ids = tok.encode(text)[: args.max_tokens]
    text = tok.decode(list(ids))
    ids, gates = gate_values(model, tok, text, chunk_size=args.write_chunk or None)
    tokens = [tok.decode([int(i)]) for i in ids]
    plot_gate_map(tokens, gates, out, width=args.width,
                  title=f"FwPKM gates, {Path(args.checkpoint).name}, write chunk {args.write_chunk or 'trained'}")
    doc = {"checkpoint": str(args.checkpoint), "tokens": tokens,
           "gates": {str(k): [round(float(x), 5) for x in v] for k, v in gates.items()},
           "mean_gate": {str(k): float(v.mean()) for k, v in gates.items()}}
    write_cli_result(out.with_suffix(".json"), doc, getattr(args, "argv", None), run_probes(cfg))
    if args.json:
        print(json.dumps({k: doc[k] for k in ("checkpoint", "mean_gate")}, indent=2))
    else:
        print("mean gate per FwPKM layer: " + ", ".join(f"layer {k} {v:.3f}" for k, v in doc["mean_gate"].items()))
        print(f"-> {out}, {out.with_suffix('.json')}")
    return 0
