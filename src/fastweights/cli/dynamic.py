"""``fastweights dynamic eval | tune | stats | timescale | generate``: dynamic evaluation (Krause et al. 2018).

    fastweights dynamic stats --checkpoint runs/demo               # MS_g on the training split
    fastweights dynamic tune --checkpoint runs/demo                # lr x decay on validation -> runs/demo/dynamic_tuned.json
    fastweights dynamic eval --checkpoint runs/demo --data play.txt  # uses runs/demo/dynamic_tuned.json
    fastweights dynamic eval --hf gpt2-dir --data doc.txt --rule sgd --lr 1e-4
    fastweights dynamic timescale --checkpoint runs/demo --data spanish.txt --out runs/timescale

Each model source is either ``--checkpoint DIR`` (ours) or ``--hf NAME_OR_PATH`` (a ``transformers``
causal LM: a directory, a ``.gguf`` file, a hub name, or ``smollm2-135m``). With a checkpoint,
gradient statistics live next to it (``grad_stats.safetensors``) and are used by default; missing
statistics are collected from the checkpoint's training split on first use. Tuned settings
(``dynamic tune``, ``make demo``) are written into the checkpoint as ``dynamic_tuned.json`` (or where
``--save FILE`` says) and used by ``dynamic eval`` when they record the checkpoint's weights and the
run's setting (its first line names the file; ``--no-tuned`` refuses it, ``--tuned FILE`` names another).
Hugging Face models keep the whole stream in context by default (``hf.kv_context``).

Besides full dynamic evaluation: ``--sparse-units`` (paper section 6), ``--lowrank-rank`` (low-rank MLP
deltas, ``adapt.lowrank``; excludes ``--sparse-units``), ``--lr-schedule`` (within the stream), and
``dynamic eval --cache-on-dynamic`` (the neural cache on the adapted model, ``adapt.dynamic_cache``).

Each command maps its flags to an :class:`~fastweights.adapt.setup.DynamicSettings` once
(:func:`dynamic_settings`) and calls the library (``adapt.setup``, ``adapt.evaluate``).
"""

from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path

import torch

from fastweights.adapt.cache import CacheSettings
from fastweights.adapt.evaluate import ComparisonOptions, evaluate_static_and_dynamic, headline_key
from fastweights.adapt.setup import (HF_STATS_CONTEXT, DynamicSettings, adaptation_spec, build_evaluator,
                                     collect_stats, default_segment_len, dynamic_preset, dynamic_presets,
                                     encode_texts, evaluator_from, load_texts, resolve_setup, stats_context,
                                     stats_path, weights_fingerprint, with_bos)
from fastweights.adapt.tune import TUNE_CHARS
from fastweights.adapt.update_rules import (DEFAULT_DECAY, DEFAULT_RULE, DEFAULT_SEGMENT_LEN,
                                           DEFAULT_STATS_BATCH_SIZE, DEFAULT_STATS_BATCHES, RULES, SUBWORD_SEGMENT_LEN)
from fastweights.auto.sources import load_model_and_tokenizer
from fastweights.cli.common import change, output_prefix
from fastweights.cli.settings import add_settings, settings_from
from fastweights.cli.types import floats, nonneg_float, nonneg_int, positive_int, seed
from fastweights.core.errors import UserError
from fastweights.hf.kv_context import DEFAULT_SINKS

CACHE_PREFIX = "cache-"  # --cache-window, --cache-flatness, --cache-mix, --cache-similarity
CACHE_NOT_ON_THE_COMMAND_LINE = {"warmup_window"}  # pointer.py's variant: the library's only (no flag added for it)


# ----------------------------------------------------------------------------- shared arguments


def _model_args(p, data_help: str) -> None:
    from fastweights.cli.common import device_flag, threads_flag

    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="checkpoint directory of a fastweights model")
    src.add_argument("--hf", metavar="NAME_OR_PATH",
                     help="Hugging Face causal LM: a directory, a .gguf file, a hub name, or smollm2-135m")
    p.add_argument("--data", help=data_help)
    p.add_argument("--max-chars", type=nonneg_int, default=0, help="use only the first N characters of the text (0: all)")
    p.add_argument("--bos", action="store_true",
                   help="prepend the tokenizer's BOS token so the first token is scored too (Hugging Face models)")
    p.add_argument("--sinks", type=nonneg_int, default=None,
                   help="Hugging Face models: first tokens a bounded KV cache never evicts (attention sinks; default: "
                        f"{DEFAULT_SINKS}; 0: plain sliding window)")
    device_flag(p)
    threads_flag(p)
    p.add_argument("--quiet", action="store_true", help="no progress line")


# the settings each kind of command takes as flags, generated from DynamicSettings' fields (their defaults and help)
ADAPTED = ("params", "exclude_params", "sparse_units", "sparse_layer", "lowrank_rank", "lowrank_params")
STEP_SIZES = ("lr", "decay", "tuned", "no_tuned")
RULE = ("eps", "lr_schedule", "segment_len", "stats")


def _settings_flags(p, names: tuple[str, ...]) -> None:
    """One flag per named field of :class:`DynamicSettings` (``--lowrank-rank`` for ``lowrank_rank``)."""
    add_settings(p, DynamicSettings, exclude=[f.name for f in fields(DynamicSettings) if f.name not in names])


def _preset_flag(p, dests: dict[str, str | None] | None = None) -> None:
    """``--preset NAME``: a shipped setting (``adapt.setup.dynamic_preset``) becomes the defaults of this command's
    flags, so that a flag given on the command line wins (``cli.main`` parses again with them). ``dests``: the
    flag a setting sets where it is not the field's own (None: no flag here)."""
    p.add_argument("--preset", dest="dynamic_preset", metavar="NAME", default=None,
                   help=f"a shipped setting as the defaults of the flags below ({', '.join(dynamic_presets())}; a flag "
                        "given wins; default: none)")

    def apply(name: str) -> None:
        flags = {a.dest for a in p._actions}
        values = dynamic_preset(name)
        dest = {k: (dests or {}).get(k, k) for k in values}
        p.set_defaults(**{dest[k]: v for k, v in values.items() if dest[k] in flags})

    p.set_defaults(apply_dynamic_preset=apply)


def _rule_args(p, with_lr: bool = True, rule_flag: str = "--rule", with_context: bool = True) -> None:
    if rule_flag == "--rule":
        _preset_flag(p, {"context": "seq_len"})
        _settings_flags(p, ("rule",))
    else:
        p.add_argument(rule_flag, metavar="RULE", default=None,
                       help=f"also evaluate dynamically with this update rule ({', '.join(RULES)}; default: off)")
    _settings_flags(p, (STEP_SIZES if with_lr else ()) + RULE + ADAPTED)
    if with_context:  # dest seq_len, as every command's --context; its default and help are the field's
        context = next(f for f in fields(DynamicSettings) if f.name == "context")
        p.add_argument("--context", dest="seq_len", metavar="TOKENS", type=nonneg_int, default=context.default,
                       help=context.metadata["help"])


def dynamic_settings(args, rule: str | None = None, context: int | None = None) -> DynamicSettings:
    """The parsed dynamic-evaluation flags as :class:`DynamicSettings` (``--dynamic RULE`` or ``--rule``;
    the context: ``context`` when given, else ``--context`` / ``--seq-len``). A field whose flag the command
    does not have keeps its default."""
    rule = rule or getattr(args, "dynamic", None) or getattr(args, "rule", None) or DEFAULT_RULE
    context = context if context is not None else getattr(args, "seq_len", 0) or 0
    preset = dynamic_preset(args.dynamic_preset) if getattr(args, "dynamic_preset", None) else {}
    unflagged = {k: v for k, v in preset.items() if k not in ("rule", "context") and not hasattr(args, k)}
    return settings_from(args, DynamicSettings, exclude=("rule", "context"), rule=rule, context=context, **unflagged)


def comparison_options(args) -> ComparisonOptions:
    """The parsed flags of ``dynamic eval`` (or ``eval --dynamic``) as :class:`ComparisonOptions`."""
    from dataclasses import fields

    given = {f.name: getattr(args, f.name) for f in fields(ComparisonOptions) if hasattr(args, f.name)}
    cache = settings_from(args, CacheSettings, prefix=CACHE_PREFIX, exclude=CACHE_NOT_ON_THE_COMMAND_LINE)
    return ComparisonOptions(**given, neural_cache=cache)


def _load(args):
    return load_model_and_tokenizer(getattr(args, "checkpoint", None), getattr(args, "hf", None),
                                    getattr(args, "device", "auto"), getattr(args, "sinks", None))


def add_dynamic_arguments(parser, reset: bool = True) -> None:
    """Add ``--dynamic RULE`` and the dynamic-evaluation options to another command's parser.

    For ``fastweights eval`` and ``fastweights continual``: they already have ``--seq-len`` (the context),
    so that flag is not added; ``--reset`` only where ``reset`` (``eval``). ``args.dynamic`` None: not asked for.
    """
    _rule_args(parser, rule_flag="--dynamic", with_context=False)
    if reset:
        parser.add_argument("--reset", default="per_document", choices=["per_document", "never"],
                            help="dynamic evaluation: start each document from the trained weights, or carry the "
                                 "adaptation")


def register(top, parser_class) -> None:
    """Add ``fastweights dynamic eval | tune | stats | timescale | generate``."""
    from fastweights.cli.common import out_flag

    group = top.add_parser("dynamic", help="dynamic evaluation, the slow weights learning from the text: eval, tune, "
                                           "stats, timescale, generate")
    sub = group.add_subparsers(dest="dynamic_command", metavar="eval|tune|stats|timescale|generate", required=True,
                               parser_class=parser_class)
    d = sub.add_parser("eval", help="score text statically and with dynamic evaluation, side by side")
    _model_args(d, "text to score (file, directory, corpus name); default: the checkpoint's test split")
    d.add_argument("--split", default="test", choices=["train", "val", "test"],
                   help="split of the checkpoint's corpus to score when --data is not given")
    _rule_args(d)
    d.add_argument("--reset", default="per_document", choices=["per_document", "never"],
                   help="start every document from the trained weights, or carry the adaptation across documents")
    d.add_argument("--batch-docs", type=positive_int, default=1,
                   help="evaluate this many documents at once, each with its own adapted weights")
    cache = d.add_argument_group("neural cache (Grave et al. 2017)")
    cache.add_argument("--cache", action="store_true", help="also report the neural cache baseline")
    cache.add_argument("--cache-on-dynamic", action="store_true",
                       help="also report the neural cache on top of dynamic evaluation (the --cache-* settings; "
                            "documents one at a time)")
    add_settings(cache, CacheSettings, prefix=CACHE_PREFIX, exclude=CACHE_NOT_ON_THE_COMMAND_LINE)
    d.add_argument("--json", action="store_true", help="print the result as JSON")
    d.add_argument("--per-token", metavar="PATH",
                   help="write every prediction's static and dynamic (and dynamic+cache) loss (nats) as JSON to PATH "
                        "(default: not written)")
    d.set_defaults(func=cmd_dynamic_eval)

    t = sub.add_parser("tune", help="grid-search the dynamic-evaluation lr and decay on validation text")
    _model_args(t, "validation text (default: the checkpoint's validation split)")
    _rule_args(t, with_lr=False)
    t.add_argument("--lrs", help="comma-separated learning rates: search this grid (default: automatic search)")
    t.add_argument("--decays", help=f"comma-separated decays (with --lrs: the grid's decays; default: {DEFAULT_DECAY:g} "
                                    "x segment length / 5)")
    t.add_argument("--official-grid", action="store_true",
                   help="the paper's grid (6 lrs x 4 decays, scaled by segment length / 5) instead of the search")
    t.add_argument("--tune-chars", type=nonneg_int, default=TUNE_CHARS,
                   help="characters of validation text to tune on (a small subset suffices; 0: all)")
    t.add_argument("--save", metavar="FILE",
                   help="write the result to FILE, which dynamic eval --tuned FILE reads (default: "
                        "dynamic_tuned.json in the checkpoint, which dynamic eval then uses by itself; not written "
                        "for --hf)")
    t.add_argument("--json", action="store_true", help="print the result as JSON")
    t.set_defaults(func=cmd_tune_dynamic)

    c = sub.add_parser("stats", help="mean squared gradients on training text, for the RMS rules")
    _model_args(c, "TRAINING text (default: the checkpoint's training split; required with --hf)")
    _preset_flag(c, {"stats_batch_size": "batch_size", "stats_batches": "max_batches", "stats_seq_len": "segment_len",
                     "segment_len": None, "context": None})
    c.add_argument("--batch-size", type=positive_int, default=DEFAULT_STATS_BATCH_SIZE,
                   help="parallel streams per batch (the paper code's)")
    c.add_argument("--segment-len", type=nonneg_int, default=0,
                   help=f"targets per stream per batch (0: the segment length of dynamic eval, {DEFAULT_SEGMENT_LEN} for "
                        f"char/byte models, {SUBWORD_SEGMENT_LEN} for subword models)")
    c.add_argument("--context", type=nonneg_int, default=0,
                   help=f"attention context in tokens (0: the training seq_len; Hugging Face models: "
                        f"{HF_STATS_CONTEXT}, the first tokens kept)")
    c.add_argument("--max-batches", type=nonneg_int, default=DEFAULT_STATS_BATCHES, help="batches to average (0: the whole text)")
    _settings_flags(c, ADAPTED)
    c.add_argument("--save", metavar="FILE",
                   help="write the statistics to FILE, which --stats FILE reads (default: the checkpoint's "
                        "grad_stats*.safetensors, which dynamic eval then uses by itself; required with --hf)")
    c.set_defaults(func=cmd_collect_grad_stats)

    s = sub.add_parser("timescale", help="loss against position, static vs dynamic (the paper's Figure 2): PNG + JSON")
    _model_args(s, "text to analyse (default: the checkpoint's test split)")
    _rule_args(s)
    s.add_argument("--doc-len", type=positive_int, default=10000, help="tokens per sequence (the paper: 10,000 characters)")
    s.add_argument("--max-docs", type=positive_int, default=20, help="sequences to average over")
    s.add_argument("--window", type=positive_int, default=100, help="positions averaged per point")
    out_flag(s, "runs/timescale", "timescale.png and timescale.json")
    s.add_argument("--overwrite", action="store_true", help="replace the outputs of an earlier run in --out")
    s.set_defaults(func=cmd_timescale)

    g = sub.add_parser("generate", help="sample while adapting: read a text, then generate and update")
    _model_args(g, "text to read (and adapt on) before sampling (default: none, only --prompt)")
    _rule_args(g)
    g.add_argument("--prompt", default="", help="text appended after --data as the prompt (default: none)")
    g.add_argument("--max-tokens", type=nonneg_int, default=300, help="tokens to sample")
    g.add_argument("--temperature", type=nonneg_float, default=0.8, help="sampling temperature (0: greedy)")
    g.add_argument("--top-k", type=nonneg_int, default=0, help="sample among the k most likely tokens (0: all tokens)")
    g.add_argument("--seed", type=seed, default=0, help="sampling seed, in [0, 2**63 - 1]")
    g.add_argument("--static-too", action="store_true", help="also sample from the static model for comparison")
    g.set_defaults(func=cmd_dynamic_generate)


def _data_file(args) -> Path | None:
    """``--data`` when it names a file (an input no output may replace)."""
    return Path(args.data) if getattr(args, "data", None) and Path(args.data).is_file() else None


def cmd_dynamic_eval(args) -> int:
    if args.per_token:  # before any work: a path that is an input or someone else's file is refused in seconds
        from fastweights.adapt.per_token import is_per_token_file
        from fastweights.core.files import check_output_file

        check_output_file(args.per_token, is_per_token_file, "--per-token", inputs=[_data_file(args), args.tuned,
                                                                                     args.stats])
    model, tok, cfg, ckpt = _load(args)
    texts = load_texts(args.data, cfg, args.split, args.max_chars)
    res = evaluate_static_and_dynamic(dynamic_settings(args), model, tok, cfg, texts, ckpt, comparison_options(args),
                                      progress=not args.quiet)
    res["data"] = args.data or f"{cfg.data.corpus}:{args.split}"
    res["model"] = args.checkpoint or f"hf:{args.hf}"
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    key = headline_key(tok)
    s = res["settings"]
    from fastweights.adapt.update_rules import PRIOR_RULES

    has_prior = s["rule"] in PRIOR_RULES  # sgd and rms have no decay towards the trained weights
    decay = f"decay {s['decay']:.3g}, " if has_prior else ""
    sched = f"schedule {s['lr_schedule']}, " if "lr_schedule" in s else ""
    lowrank = (f"rank-{s['lowrank_rank']} deltas on {s['lowrank_projections']} projections ({s['lowrank_modules']}), "
               if "lowrank_rank" in s else "")
    same = not has_prior or s["decay_source"] == s["lr_source"]
    sources = (f"{'lr and decay' if has_prior else 'lr'}: {s['lr_source']}" if same else
               f"lr: {s['lr_source']}; decay: {s['decay_source']}")
    print(f"{res['data']}: {res['static']['tokens']} tokens, {res['documents']} document(s); rule {s['rule']}, "
          f"lr {s['lr']:.3g}, {decay}{sched}{lowrank}segment {s['segment_len']}, context {s['context']} ({sources})")
    rows = [(name, label) for name, label in (("static", "static"), ("dynamic", "dynamic"), ("cache", "cache"),
                                              ("dynamic_cache", "dynamic+cache")) if name in res]
    width = max(len(label) for _, label in rows)
    static_loss = res["static"]["loss_nats"]
    for name, label in rows:
        versus = f", {change(res[name]['loss_nats'], static_loss, 'static')}" if name != "static" else ""
        print(f"  {label:<{width}}: {key} {res[name][key]:.4f}  (loss {res[name]['loss_nats']:.4f} nats/token{versus})")
    if "per_token_file" in res:
        print(f"  per-token losses -> {res['per_token_file']}")
    return 0


def cmd_tune_dynamic(args) -> int:
    from fastweights.adapt.tune import (TUNED_FILE, format_table, is_tuned_file, official_grid, points_file_of,
                                        save_tuned, tune_dynamic)
    from fastweights.core.files import check_output_file

    if args.save:
        check_output_file(args.save, is_tuned_file, "--save", inputs=[_data_file(args), args.stats])
    model, tok, cfg, ckpt = _load(args)
    texts = load_texts(args.data, cfg, "val", args.tune_chars)
    docs, _ = encode_texts(tok, texts, args.bos)
    setup = resolve_setup(dynamic_settings(args), model, tok, cfg, ckpt, lr=0.0, decay=0.0, progress=not args.quiet)
    lrs, decays = floats(args.lrs, "--lrs"), floats(args.decays, "--decays")
    if args.official_grid:
        lrs, decays = official_grid(setup.segment_len)
    path = args.save or (ckpt / TUNED_FILE if ckpt is not None else None)
    res = tune_dynamic(lambda lr, decay: evaluator_from(replace(setup, lr=lr, decay=decay), model), docs, lrs, decays,
                       progress=not args.quiet, points_file=points_file_of(path) if path else None)
    if path:
        save_tuned(res, path, weights_sha256=weights_fingerprint(ckpt))
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(format_table(res))
        print(("not saved (pass --save FILE to keep it for dynamic eval --tuned FILE)" if not path else
               f"saved to {path}: dynamic eval --checkpoint {ckpt} uses it" if not args.save else
               f"saved to {path} (use it with dynamic eval --tuned {path})"))
    return 0


def cmd_collect_grad_stats(args) -> int:
    if args.save:
        from fastweights.adapt.grad_stats import GradStats
        from fastweights.core.files import check_output_file

        check_output_file(args.save, GradStats.is_stats_file, "--save", inputs=[_data_file(args)])
    model, tok, cfg, ckpt = _load(args)
    if args.hf and not args.data:
        raise UserError("--data (training text) is required with --hf")
    if args.batch_size < 1:
        raise UserError("--batch-size must be >= 1")
    segment_len = args.segment_len or default_segment_len(tok)
    context = stats_context(args.context, model, cfg)
    settings = replace(dynamic_settings(args), stats_data=args.data, stats_batch_size=args.batch_size,
                       stats_batches=args.max_batches, stats_seq_len=segment_len)
    spec = adaptation_spec(settings, model)
    out = Path(args.save) if args.save else stats_path(None, ckpt, spec)
    if out is None:
        raise UserError("--save FILE is required with --hf (there is no checkpoint to keep the statistics in)")
    stats = collect_stats(model, tok, cfg, settings, segment_len, context, spec, out, not args.quiet, ckpt)
    print(f"gradient statistics of {len(stats.ms)} tensors over {stats.batches} batches of "
          f"{stats.batch_size} x {stats.seq_len} tokens -> {out}")
    return 0


def cmd_timescale(args) -> int:
    from fastweights.adapt.timescale import plot_timescale, timescale_analysis
    from fastweights.core.files import atomic_write

    if args.doc_len < 2 or args.max_docs < 1 or args.window < 1:
        raise UserError("--doc-len must be >= 2, --max-docs and --window >= 1")
    output_prefix(args, "timescale")  # an earlier run's outputs are refused before any work
    model, tok, cfg, ckpt = _load(args)
    texts = load_texts(args.data, cfg, "test", args.max_chars)
    ids = torch.cat([torch.as_tensor(tok.encode(t), dtype=torch.long) for t in texts])
    n = min(args.max_docs, ids.numel() // args.doc_len)
    if n == 0:
        raise UserError(f"the text has {ids.numel()} tokens, fewer than one sequence of --doc-len {args.doc_len}")
    docs = [ids[i * args.doc_len : (i + 1) * args.doc_len] for i in range(n)]  # consecutive sequences
    if args.bos:  # each sequence starts with BOS, so its first token is scored too
        docs = [with_bos(tok, d) for d in docs]
    ev, info = build_evaluator(dynamic_settings(args), model, tok, cfg, ckpt, progress=not args.quiet)
    res = timescale_analysis(ev, docs, args.window, progress=not args.quiet)
    res["settings"] = ev.metadata() | info
    res["data"] = args.data or f"{cfg.data.corpus}:test"
    res["unit"] = "bits per token" + (" (= per character)" if tok.name == "char" else "")
    prefix = output_prefix(args, "timescale")
    png = plot_timescale(res, prefix.with_suffix(".png"), title=f"{res['data']}: {n} sequences of {args.doc_len} tokens")
    res["png"] = str(png)
    atomic_write(prefix.with_suffix(".json"), lambda p: p.write_text(json.dumps(res, indent=2) + "\n"))
    print(f"static {res['static_mean_bits']:.4f}, dynamic {res['dynamic_mean_bits']:.4f} bits/token over {n} "
          f"sequences of {args.doc_len}; wrote {png} and {prefix.with_suffix('.json')}")
    return 0


def cmd_dynamic_generate(args) -> int:
    from fastweights.loops.generate import generate_tokens

    model, tok, cfg, ckpt = _load(args)
    text = ("".join(load_texts(args.data, cfg, "test", args.max_chars)) if args.data else "") + args.prompt
    if not text:
        raise UserError("give --data and/or --prompt to read before sampling")
    ids = torch.as_tensor(tok.encode(text), dtype=torch.long)
    ev, _ = build_evaluator(dynamic_settings(args), model, tok, cfg, ckpt, progress=not args.quiet)
    out, _ = ev.generate(ids, args.max_tokens, args.temperature, args.top_k, args.seed)
    print("== dynamic (adapted on the text, still updating while sampling)")
    print(tok.decode(out))
    if args.static_too:
        ctx = ev.context or (ids.numel() + args.max_tokens + 1)
        static = list(generate_tokens(model, ids[-(ctx - 1):].tolist(), args.max_tokens, args.temperature, args.top_k,
                                      args.seed, context=ctx))
        print("== static")
        print(tok.decode(static))
    return 0


