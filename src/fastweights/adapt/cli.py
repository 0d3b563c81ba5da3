"""Command line for dynamic evaluation: ``fastweights dynamic-eval | tune-dynamic | collect-grad-stats |
timescale | dynamic-generate``.

    fastweights collect-grad-stats --checkpoint runs/demo            # MS_g on the training split
    fastweights tune-dynamic --checkpoint runs/demo --save runs/demo/dynamic_tuned.json  # lr x decay on validation
    fastweights dynamic-eval --checkpoint runs/demo --data play.txt --tuned runs/demo/dynamic_tuned.json
    fastweights dynamic-eval --hf gpt2-dir --data doc.txt --rule sgd --lr 1e-4
    fastweights timescale --checkpoint runs/demo --data spanish.txt --out runs/timescale

Each model source is either ``--checkpoint DIR`` (ours) or ``--hf NAME_OR_PATH`` (a ``transformers``
causal LM: a directory, a ``.gguf`` file, a hub name, or ``smollm2-135m``). With a checkpoint,
gradient statistics live next to it (``grad_stats.safetensors``) and are used by default; missing
statistics are collected from the checkpoint's training split on first use. Tuned settings are
written only where ``tune-dynamic --save`` says and used only when named (``--tuned FILE``).
Hugging Face models keep the whole stream in context by default (``hf.kv_context``).

Besides full dynamic evaluation: ``--sparse-units`` (paper section 6), ``--lowrank-rank`` (low-rank MLP
deltas, ``adapt.lowrank``; excludes ``--sparse-units``), ``--lr-schedule`` (within the stream), and
``dynamic-eval --cache-on-dynamic`` (the neural cache on the adapted model, ``adapt.dynamic_cache``).

``run_eval_dynamic(args, model, tokenizer, cfg, texts)`` is the function behind ``dynamic-eval``
(and behind ``fastweights eval --dynamic RULE``); see its docstring for the attributes it reads.
Loading, gradient statistics and ``build_evaluator`` live in ``adapt.cli_evaluator`` (imported here).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import torch

from fastweights.adapt.cli_evaluator import (DEFAULT_STATS_BATCHES, _collect_stats, _stats_path, _weights_fingerprint,
                                             adaptation_spec, build_evaluator, default_context, default_segment_len,
                                             encode_texts, evaluator_like, load_model_and_tokenizer, load_texts)
from fastweights.errors import UserError
from fastweights.validate import fraction, nonneg_float, nonneg_int, positive_float, positive_int, seed

__all__ = ["add_dynamic_arguments", "build_evaluator", "demo_dynamic", "encode_texts", "load_model_and_tokenizer",
           "load_texts", "register_cli", "run_eval_dynamic"]

HF_STATS_CONTEXT = 1024  # collect-grad-stats' default KV-cache bound for Hugging Face models (x --batch-size streams)


# ----------------------------------------------------------------------------- shared arguments


def _model_args(p, data_help: str) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="checkpoint directory of a fastweights model")
    src.add_argument("--hf", metavar="NAME_OR_PATH",
                     help="Hugging Face causal LM: a directory, a .gguf file, a hub name, or smollm2-135m")
    p.add_argument("--data", help=data_help)
    p.add_argument("--max-chars", type=nonneg_int, default=0, help="use only the first N characters of the text (0: all)")
    p.add_argument("--bos", action="store_true",
                   help="prepend the tokenizer's BOS token so the first token is scored too (Hugging Face models)")
    p.add_argument("--sinks", type=nonneg_int, default=None,
                   help="Hugging Face models: first tokens a bounded KV cache never evicts (attention sinks; default 4, "
                        "0: plain sliding window)")
    p.add_argument("--device", default="auto")
    p.add_argument("--quiet", action="store_true", help="no progress line")


def _schedule(text: str) -> str:
    """argparse type of --lr-schedule: constant, warmup:W or rsqrt:S."""
    from fastweights.adapt.update_rules import parse_schedule

    try:
        parse_schedule(text)
    except UserError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _lowrank_args(p) -> None:
    p.add_argument("--lowrank-rank", type=nonneg_int, default=0,
                   help="low-rank dynamic evaluation: adapt rank-N deltas W + A B of the projections --lowrank-params "
                        "selects (A from zero, B fixed random; 0: off)")
    p.add_argument("--lowrank-params", metavar="GLOBS",
                   help="module globs of the low-rank projections, comma-separated (default '*mlp.*': the MLPs)")


def _rule_args(p, with_lr: bool = True, rule_flag: str = "--rule", with_context: bool = True) -> None:
    from fastweights.adapt.update_rules import DEFAULT_EPS, RULES

    if rule_flag == "--rule":
        p.add_argument("--rule", default="rms-global-prior", help=f"update rule: {', '.join(RULES)}")
    else:
        p.add_argument(rule_flag, metavar="RULE", default=None,
                       help=f"also evaluate dynamically with this update rule ({', '.join(RULES)})")
    if with_lr:
        p.add_argument("--lr", type=nonneg_float, default=None, help="learning rate eta (default: tuned file, else 5e-5)")
        p.add_argument("--decay", type=nonneg_float, default=None, help="prior decay lambda (default: tuned file, else 0.002)")
        p.add_argument("--tuned", metavar="FILE",
                       help="lr and decay from this tune-dynamic --save file (a tuned file is used only when named)")
    p.add_argument("--eps", type=positive_float, default=DEFAULT_EPS, help="epsilon of the RMS rules")
    p.add_argument("--lr-schedule", type=_schedule, default="constant", metavar="SPEC",
                   help="learning rate within the stream: constant (default), warmup:W (linear ramp over the first W "
                        "updates) or rsqrt:S (lr / sqrt(1 + i / S) at update i)")
    p.add_argument("--segment-len", type=nonneg_int, default=0,
                   help="predictions per update (default 20 for char/byte models, 128 for subword models)")
    if with_context:
        p.add_argument("--context", "--seq-len", dest="seq_len", type=nonneg_int, default=0,
                       help="attention context in tokens (default: the training seq_len; Hugging Face models: the "
                            "whole stream up to the model's position limit)")
    p.add_argument("--stats", help="gradient statistics file (default: grad_stats*.safetensors in the checkpoint)")
    p.add_argument("--params", help="adapt only parameters matching these globs, comma-separated (e.g. 'blocks.3.*')")
    p.add_argument("--exclude-params", help="do not adapt parameters matching these globs (e.g. 'embed.*')")
    p.add_argument("--sparse-units", type=nonneg_int, default=0,
                   help="sparse dynamic evaluation: adapt an HxH matrix on the first H units of one block's output")
    p.add_argument("--sparse-layer", type=int, default=None, help="block for sparse adaptation (default: the middle one)")
    _lowrank_args(p)


def add_dynamic_arguments(parser) -> None:
    """Add ``--dynamic RULE`` and the dynamic-evaluation options to another command's parser.

    For ``fastweights eval``: it already has ``--seq-len`` (the context), so that flag is not added.
    The parsed namespace then suits :func:`run_eval_dynamic` (``args.dynamic`` None: not asked for).
    """
    _rule_args(parser, rule_flag="--dynamic", with_context=False)
    parser.add_argument("--reset", default="per_document", choices=["per_document", "never"],
                        help="dynamic evaluation: start each document from the trained weights, or carry the adaptation")


def register_cli(sub) -> None:
    d = sub.add_parser("dynamic-eval", help="score text statically and with dynamic evaluation, side by side")
    _model_args(d, "text to score (file, directory, corpus name); default: the checkpoint's test split")
    d.add_argument("--split", default="test", choices=["train", "val", "test"])
    _rule_args(d)
    d.add_argument("--reset", default="per_document", choices=["per_document", "never"],
                   help="start every document from the trained weights, or carry the adaptation across documents")
    d.add_argument("--batch-docs", type=positive_int, default=1,
                   help="evaluate this many documents at once, each with its own adapted weights")
    d.add_argument("--cache", action="store_true", help="also report the neural cache baseline (Grave et al. 2017)")
    d.add_argument("--cache-window", type=positive_int, default=500)
    d.add_argument("--cache-flatness", type=nonneg_float, default=1.0)
    d.add_argument("--cache-mix", type=fraction, default=0.1)
    d.add_argument("--cache-similarity", default="dot", choices=["dot", "cosine"])
    d.add_argument("--cache-on-dynamic", action="store_true",
                   help="also report the neural cache on top of dynamic evaluation (the --cache-* settings; "
                        "documents one at a time)")
    d.add_argument("--json", action="store_true")
    d.add_argument("--per-token", metavar="PATH",
                   help="write every prediction's static and dynamic (and dynamic+cache) loss (nats) as JSON to PATH")
    d.set_defaults(func=cmd_dynamic_eval)

    t = sub.add_parser("tune-dynamic", help="grid-search the dynamic-evaluation lr and decay on validation text")
    _model_args(t, "validation text (default: the checkpoint's validation split)")
    _rule_args(t, with_lr=False)
    t.add_argument("--lrs", help="comma-separated learning rates: search this grid (default: automatic search)")
    t.add_argument("--decays", help="comma-separated decays (with --lrs: the grid's decays)")
    t.add_argument("--official-grid", action="store_true",
                   help="dynamiceval.py's grid (6 lrs x 4 decays, scaled by segment/5) instead of the search")
    t.add_argument("--tune-chars", type=nonneg_int, default=20000,
                   help="characters of validation text to tune on (a small subset suffices; 0: all)")
    t.add_argument("--save", metavar="FILE",
                   help="write the result here (not written without it); dynamic-eval --tuned FILE uses it")
    t.add_argument("--json", action="store_true")
    t.set_defaults(func=cmd_tune_dynamic)

    c = sub.add_parser("collect-grad-stats", help="mean squared gradients on training text, for the RMS rules")
    _model_args(c, "TRAINING text (default: the checkpoint's training split; required with --hf)")
    c.add_argument("--batch-size", type=positive_int, default=100, help="parallel streams per batch (dynamiceval.py: 100)")
    c.add_argument("--seq-len", type=nonneg_int, default=0, help="targets per stream per batch (default: the segment length)")
    c.add_argument("--context", type=nonneg_int, default=0,
                   help=f"attention context in tokens (default: the training seq_len; Hugging Face models: "
                        f"{HF_STATS_CONTEXT}, the first tokens kept)")
    c.add_argument("--max-batches", type=nonneg_int, default=DEFAULT_STATS_BATCHES, help="0: the whole text")
    c.add_argument("--params")
    c.add_argument("--exclude-params")
    c.add_argument("--sparse-units", type=nonneg_int, default=0)
    c.add_argument("--sparse-layer", type=int, default=None)
    _lowrank_args(c)
    c.add_argument("--out", help="output file (default: next to the checkpoint)")
    c.set_defaults(func=cmd_collect_grad_stats)

    s = sub.add_parser("timescale", help="loss against position, static vs dynamic (the paper's Figure 2): PNG + JSON")
    _model_args(s, "text to analyse (default: the checkpoint's test split)")
    _rule_args(s)
    s.add_argument("--doc-len", type=positive_int, default=10000, help="tokens per sequence (the paper: 10,000 characters)")
    s.add_argument("--max-docs", type=positive_int, default=20, help="sequences to average over")
    s.add_argument("--window", type=positive_int, default=100, help="positions averaged per point")
    s.add_argument("--out", default="runs/timescale", help="output prefix: writes PREFIX.png and PREFIX.json")
    s.set_defaults(func=cmd_timescale)

    g = sub.add_parser("dynamic-generate", help="sample while adapting: read a text, then generate and update")
    _model_args(g, "text to read (and adapt on) before sampling")
    _rule_args(g)
    g.add_argument("--prompt", default="", help="text appended after --data as the prompt")
    g.add_argument("--max-tokens", type=nonneg_int, default=300)
    g.add_argument("--temperature", type=nonneg_float, default=0.8)
    g.add_argument("--top-k", type=nonneg_int, default=0)
    g.add_argument("--seed", type=seed, default=0)
    g.add_argument("--static-too", action="store_true", help="also sample from the static model for comparison")
    g.set_defaults(func=cmd_dynamic_generate)


def _metrics(result, tokenizer, chars: int) -> dict:
    result.chars = chars
    return {"nll": result.nll} | result.metrics(getattr(tokenizer, "name", ""))  # nll: total, in nats


def _headline_key(tokenizer) -> str:
    name = getattr(tokenizer, "name", "")
    return "bits_per_char" if name == "char" else ("bits_per_byte" if name == "byte" else "perplexity")


# ----------------------------------------------------------------------------- commands


def _score_documents(evaluate, docs, reset: str, keep: bool, bar, start):
    """Documents one after the other through ``evaluate`` (an evaluator's or a DynamicNeuralCache's): the
    summed result and each document's token losses. ``reset="never"`` carries the adapted values and the
    schedule's update count into the next document (``start(state, doc)`` builds its start state)."""
    from fastweights.evaluate import EvalResult

    total, losses, state = EvalResult(0.0, 0), [], None
    for d in docs:
        r, st = evaluate(d, start(state, d) if state is not None else None, keep_token_losses=keep, progress=bar)
        losses.append(r.token_losses)
        total.add(r)
        if reset == "never":
            state = st
    bar.close()
    return total, losses


def _carried(ev):
    """``start`` for :func:`_score_documents` with --reset never: the adaptation (values, update count) carries
    over, the model state (and the cache's memory) starts fresh at every document."""
    from fastweights.adapt.dynamic import DynamicState
    from fastweights.adapt.dynamic_cache import DynamicCacheState

    def start(st, d):
        dyn = st.dynamic if isinstance(st, DynamicCacheState) else st
        new = DynamicState(dyn.values, None, d[:0], 0, dyn.updates)
        if not isinstance(st, DynamicCacheState):
            return new
        return DynamicCacheState(new, torch.zeros(0, 0, device=ev.device),
                                 torch.zeros(0, dtype=torch.long, device=ev.device), 0)
    return start


def _cache_settings(args) -> dict:
    return dict(window=getattr(args, "cache_window", 500), flatness=getattr(args, "cache_flatness", 1.0),
                mix=getattr(args, "cache_mix", 0.1), similarity=getattr(args, "cache_similarity", "dot"))


def run_eval_dynamic(args, model, tokenizer, cfg, texts: list[str]) -> dict:
    """Static and dynamic evaluation of ``texts`` under one protocol; returns a JSON-ready dict.

    Reads these attributes of ``args`` (all optional; missing ones take the defaults shown):
        dynamic or rule ("rms-global-prior"), lr / decay (None: from the file ``tuned`` names, which
        must match the rule, segment length, schedule and adapted kind, else 5e-5 / 0.002), eps (2e-5),
        lr_schedule ("constant"), segment_len (0: 20 for char/byte tokenizers, else 128), seq_len (0:
        ``cfg.train.seq_len``, or the HF adapter's default context), stats (None: the checkpoint's
        statistics file for what is adapted, collected from the training split when missing),
        checkpoint (dir, for those defaults), params / exclude_params (globs), sparse_units /
        sparse_layer (0: off), lowrank_rank / lowrank_params (0: off; low-rank MLP deltas),
        reset ("per_document"), batch_docs (1), bos (False), quiet (False), tuned (None: no tuned file),
        per_token (None, or a path: every prediction's losses written there, see ``adapt.per_token``;
        with cache_on_dynamic each document also has its "dynamic_cache" losses, summing to
        "dynamic_cache_nll"), cache (the neural cache baseline on the static model), cache_on_dynamic
        (the neural cache on the dynamically adapted model), cache_window / cache_flatness / cache_mix /
        cache_similarity (the settings of both).
    ``cfg`` is the checkpoint's RunConfig (None for Hugging Face models). Static and dynamic use the
    same segments (stride = segment_len) and context, so ``args.stride`` is not used.

    Returns {"static": metrics, "dynamic": metrics, ["cache": metrics], ["dynamic_cache": metrics],
    "relative_improvement", "settings": the evaluator's metadata, "documents", "reset"}; metrics as
    ``EvalResult.metrics`` plus "nll" (total nats); the cache rows add their "settings".
    """
    from fastweights.evaluate import EvalResult
    from fastweights.progress import Progress

    progress = not getattr(args, "quiet", False)
    ckpt = Path(args.checkpoint) if getattr(args, "checkpoint", None) else None
    ev, info = build_evaluator(args, model, tokenizer, cfg, ckpt, progress=progress)
    docs, chars = encode_texts(tokenizer, texts, getattr(args, "bos", False))
    total = sum(d.numel() - 1 for d in docs)
    keep = bool(getattr(args, "per_token", None))
    losses = {}  # row -> per-document token losses, only with per_token
    bar = Progress(total, "tok", desc="static", enabled=progress)
    static = EvalResult(0.0, 0)
    losses["static"] = []
    for d in docs:
        r = ev.static(d, keep_token_losses=keep, progress=bar)
        losses["static"].append(r.token_losses)
        static.add(r)
    bar.close()
    reset = getattr(args, "reset", "per_document") or "per_document"
    batch_docs = max(1, getattr(args, "batch_docs", 1) or 1)
    if batch_docs > 1 and reset != "per_document":
        raise UserError("--batch-docs needs --reset per_document (each document has its own weights)")
    bar = Progress(total, "tok", desc="dynamic", enabled=progress)
    if batch_docs > 1:
        dynamic, losses["dynamic"] = EvalResult(0.0, 0), []
        for i in range(0, len(docs), batch_docs):
            try:
                batch = ev.evaluate_batch(docs[i : i + batch_docs], keep_token_losses=keep, progress=bar)
            except RuntimeError as e:
                if "functorch" not in str(e):
                    raise
                raise UserError(f"--batch-docs: {str(e).splitlines()[0]}") from None
            for r in batch:
                losses["dynamic"].append(r.token_losses)
                dynamic.add(r)
        bar.close()
    else:
        dynamic, losses["dynamic"] = _score_documents(ev.evaluate, docs, reset, keep, bar, _carried(ev))
    out = {"static": _metrics(static, tokenizer, chars), "dynamic": _metrics(dynamic, tokenizer, chars)}
    if getattr(args, "cache", False):
        from fastweights.adapt.cache import NeuralCache

        cache = NeuralCache(model, **_cache_settings(args), segment_len=ev.segment_len, context=ev.context)
        r = cache.evaluate_documents(docs, progress=progress)
        out["cache"] = _metrics(r, tokenizer, chars) | {"settings": cache.metadata()}
    if getattr(args, "cache_on_dynamic", False):
        from fastweights.adapt.dynamic_cache import DynamicNeuralCache

        both = DynamicNeuralCache(ev, **_cache_settings(args))
        bar = Progress(total, "tok", desc="dynamic+cache", enabled=progress)
        r, losses["dynamic_cache"] = _score_documents(both.evaluate, docs, reset, keep, bar, _carried(ev))
        out["dynamic_cache"] = _metrics(r, tokenizer, chars) | {
            "relative_improvement": 1 - r.loss / static.loss if static.loss > 0 else 0.0,
            "settings": both.metadata()["cache"]}
    out["relative_improvement"] = 1 - dynamic.loss / static.loss if static.loss > 0 else 0.0
    out["settings"] = ev.metadata() | info
    out["documents"] = len(docs)
    out["reset"] = reset
    if keep:
        out["per_token_file"] = str(_write_per_token(args.per_token, docs, losses, out))
    return out


def _write_per_token(path, docs, losses: dict, result: dict) -> Path:
    """``adapt.per_token``'s file; with the cache on dynamic evaluation, each document's "dynamic_cache"
    losses too (summing to "dynamic_cache_nll", the row's total NLL)."""
    from fastweights.adapt.per_token import per_token_record
    from fastweights.files import atomic_write

    rec = per_token_record(docs, losses["static"], losses["dynamic"], result)
    if "dynamic_cache" in losses:
        for doc, row in zip(rec["documents"], losses["dynamic_cache"]):
            doc["dynamic_cache"] = row
        rec["dynamic_cache_nll"] = sum(sum(row) for row in losses["dynamic_cache"])
    path = Path(path)
    atomic_write(path, lambda p: p.write_text(json.dumps(rec) + "\n"))
    return path


def cmd_dynamic_eval(args) -> int:
    model, tok, cfg, _ = load_model_and_tokenizer(args)
    texts = load_texts(args, cfg, args.split, args.max_chars)
    res = run_eval_dynamic(args, model, tok, cfg, texts)
    res["data"] = args.data or f"{cfg.data.corpus}:{args.split}"
    res["model"] = args.checkpoint or f"hf:{args.hf}"
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    key = _headline_key(tok)
    s = res["settings"]
    from fastweights.adapt.update_rules import PRIOR_RULES

    has_prior = s["rule"] in PRIOR_RULES  # sgd and rms have no decay towards the trained weights
    decay = f"decay {s['decay']:.3g}, " if has_prior else ""
    sched = f"schedule {s['lr_schedule']}, " if "lr_schedule" in s else ""
    lowrank = (f"rank-{s['lowrank_rank']} deltas on {s['lowrank_projections']} projections ({s['lowrank_modules']}), "
               if "lowrank_rank" in s else "")
    sources = f"lr: {s['lr_source']}" + (f"; decay: {s['decay_source']}" if has_prior else "")
    print(f"{res['data']}: {res['static']['tokens']} tokens, {res['documents']} document(s); rule {s['rule']}, "
          f"lr {s['lr']:.3g}, {decay}{sched}{lowrank}segment {s['segment_len']}, context {s['context']} ({sources})")
    rows = [(name, label) for name, label in (("static", "static"), ("dynamic", "dynamic"), ("cache", "cache"),
                                              ("dynamic_cache", "dynamic+cache")) if name in res]
    width = max(len(label) for _, label in rows)
    static_loss = res["static"]["loss_nats"]
    for name, label in rows:
        gain = 1 - res[name]["loss_nats"] / static_loss if static_loss > 0 else 0.0
        lower = f", {100 * gain:.2f}% lower" if name != "static" else ""
        print(f"  {label:<{width}}: {key} {res[name][key]:.4f}  (loss {res[name]['loss_nats']:.4f} nats/token{lower})")
    if "per_token_file" in res:
        print(f"  per-token losses -> {res['per_token_file']}")
    return 0


def _floats(text: str | None, what: str) -> list[float] | None:
    if not text:
        return None
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{what}: expected comma-separated numbers, got {text!r}") from None
    if not vals:
        raise UserError(f"{what}: empty list")
    return vals


def cmd_tune_dynamic(args) -> int:
    from fastweights.adapt.tune import format_table, official_grid, save_tuned, tune_dynamic

    model, tok, cfg, ckpt = load_model_and_tokenizer(args)
    texts = load_texts(args, cfg, "val", args.tune_chars)
    docs, _ = encode_texts(tok, texts, args.bos)
    first, _ = build_evaluator(args, model, tok, cfg, ckpt, lr=0.0, decay=0.0, progress=not args.quiet)
    lrs, decays = _floats(args.lrs, "--lrs"), _floats(args.decays, "--decays")
    if args.official_grid:
        lrs, decays = official_grid(first.segment_len)
    res = tune_dynamic(lambda lr, decay: evaluator_like(first, lr, decay), docs, lrs, decays, progress=not args.quiet)
    path = args.save
    if path:
        save_tuned(res, path, weights_sha256=_weights_fingerprint(ckpt))
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(format_table(res))
        print(f"saved to {path} (use it with dynamic-eval --tuned {path})" if path else
              "not saved (pass --save FILE to keep it for dynamic-eval --tuned FILE)")
    return 0


def cmd_collect_grad_stats(args) -> int:
    model, tok, cfg, ckpt = load_model_and_tokenizer(args)
    if args.hf and not args.data:
        raise UserError("--data (training text) is required with --hf")
    if args.batch_size < 1:
        raise UserError("--batch-size must be >= 1")
    segment_len = args.seq_len or default_segment_len(tok)
    context = args.context or default_context(model, cfg)
    if cfg is None and not args.context:  # HF: whole-stream caches for --batch-size streams would not fit in memory
        context = min(context, HF_STATS_CONTEXT)
    spec = adaptation_spec(args, model)
    out = Path(args.out) if args.out else _stats_path(SimpleNamespace(stats=None), ckpt, spec)
    if out is None:
        raise UserError("--out is required with --hf")
    ns = SimpleNamespace(train_data=args.data, batch_size=args.batch_size, max_batches=args.max_batches,
                         stats_seq_len=segment_len, params=args.params, exclude_params=args.exclude_params)
    stats = _collect_stats(model, tok, cfg, ns, segment_len, context, spec, out, not args.quiet, ckpt)
    print(f"gradient statistics of {len(stats.ms)} tensors over {stats.batches} batches of "
          f"{stats.batch_size} x {stats.seq_len} tokens -> {out}")
    return 0


def cmd_timescale(args) -> int:
    from fastweights.adapt.timescale import plot_timescale, timescale_analysis
    from fastweights.files import atomic_write

    if args.doc_len < 2 or args.max_docs < 1 or args.window < 1:
        raise UserError("--doc-len must be >= 2, --max-docs and --window >= 1")
    model, tok, cfg, ckpt = load_model_and_tokenizer(args)
    texts = load_texts(args, cfg, "test", args.max_chars)
    ids = torch.cat([torch.as_tensor(tok.encode(t), dtype=torch.long) for t in texts])
    n = min(args.max_docs, ids.numel() // args.doc_len)
    if n == 0:
        raise UserError(f"the text has {ids.numel()} tokens, fewer than one sequence of --doc-len {args.doc_len}")
    docs = [ids[i * args.doc_len : (i + 1) * args.doc_len] for i in range(n)]  # consecutive sequences
    if args.bos:  # each sequence starts with BOS, so its first token is scored too
        if getattr(tok, "bos_id", None) is None:
            raise UserError("--bos: this tokenizer has no BOS token")
        docs = [torch.cat([torch.tensor([tok.bos_id]), d]) for d in docs]
    ev, info = build_evaluator(args, model, tok, cfg, ckpt, progress=not args.quiet)
    res = timescale_analysis(ev, docs, args.window, progress=not args.quiet)
    res["settings"] = ev.metadata() | info
    res["data"] = args.data or f"{cfg.data.corpus}:test"
    res["unit"] = "bits per token" + (" (= per character)" if tok.name == "char" else "")
    prefix = Path(args.out)
    png = plot_timescale(res, prefix.with_suffix(".png"), title=f"{res['data']}: {n} sequences of {args.doc_len} tokens")
    res["png"] = str(png)
    atomic_write(prefix.with_suffix(".json"), lambda p: p.write_text(json.dumps(res, indent=2) + "\n"))
    print(f"static {res['static_mean_bits']:.4f}, dynamic {res['dynamic_mean_bits']:.4f} bits/token over {n} "
          f"sequences of {args.doc_len}; wrote {png} and {prefix.with_suffix('.json')}")
    return 0


def cmd_dynamic_generate(args) -> int:
    from fastweights.generate import generate_tokens

    model, tok, cfg, ckpt = load_model_and_tokenizer(args)
    text = ("".join(load_texts(args, cfg, "test", args.max_chars)) if args.data else "") + args.prompt
    if not text:
        raise UserError("give --data and/or --prompt to read before sampling")
    ids = torch.as_tensor(tok.encode(text), dtype=torch.long)
    ev, _ = build_evaluator(args, model, tok, cfg, ckpt, progress=not args.quiet)
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


def demo_dynamic(checkpoint: str | Path, tune_chars: int = 5000, test_chars: int = 20000, stats_batches: int = 100,
                 verbose: bool = True) -> dict:
    """Static vs dynamic evaluation of a freshly trained checkpoint, for ``make demo``.

    Collects MS_g on the checkpoint's training split (``stats_batches`` batches of 100 x 20),
    searches lr and decay on the first ``tune_chars`` characters of its validation split (saved as
    ``dynamic_tuned.json`` and named to the scoring run), then scores the first ``test_chars`` characters of its test split both
    ways. Returns the dict of :func:`run_eval_dynamic` plus the search result; prints two lines
    when ``verbose``.
    """
    from fastweights.adapt.tune import TUNED_FILE, save_tuned, tune_dynamic
    from fastweights.checkpoint import load_checkpoint

    ckpt = Path(checkpoint)
    model, tok, cfg = load_checkpoint(ckpt)
    args = SimpleNamespace(checkpoint=str(ckpt), rule="rms-global-prior", quiet=True, max_batches=stats_batches)
    first, _ = build_evaluator(args, model, tok, cfg, ckpt, lr=0.0, decay=0.0)
    docs, _ = encode_texts(tok, load_texts(SimpleNamespace(data=None), cfg, "val", tune_chars))
    search = tune_dynamic(lambda lr, decay: evaluator_like(first, lr, decay), docs)
    args.tuned = str(save_tuned(search, ckpt / TUNED_FILE, weights_sha256=_weights_fingerprint(ckpt)))
    res = run_eval_dynamic(args, model, tok, cfg, load_texts(SimpleNamespace(data=None), cfg, "test", test_chars))
    res["search"] = search
    if verbose:
        key = _headline_key(tok)
        b = search["best"]
        print(f"   dynamic evaluation (rms-global-prior, lr {b['lr']:.3g}, decay {b['decay']:.3g}, tuned on "
              f"{search['tokens']:,} validation characters)")
        print(f"   test ({res['static']['tokens']:,} characters): static {res['static'][key]:.3f}, dynamic "
              f"{res['dynamic'][key]:.3f} {key.replace('_', ' ')} ({100 * res['relative_improvement']:.1f}% lower)")
    return res
