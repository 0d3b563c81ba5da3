"""``fastweights eval`` (plain, ``--stream``, ``--dynamic RULE``) and ``fastweights generate``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fastweights.cli.dynamic import add_dynamic_arguments
from fastweights.cli.stream import add_stream_arguments, run_stream_eval
from fastweights.cli.types import nonneg_float, nonneg_int, positive_int, seed
from fastweights.data.tokenizers import vocab_size_of
from fastweights.core.errors import UserError, refuse_non_finite, refuse_worse_than_uniform
from fastweights.loops.evaluate import SCORING_SEGMENT_LEN

STREAM_ONLY = ("modes", "bin", "max_tokens", "max_chars", "labels", "out", "overwrite")
SPLIT_HELP = "split of the checkpoint's corpus to score when --data is not given"
CONTEXT_HELP = "attention context in tokens (0: the training seq_len)"


def register(sub) -> None:
    from fastweights.cli.common import device_flag, threads_flag

    e = sub.add_parser("eval", help="score text with a checkpoint (bits per char/byte or perplexity)")
    e.add_argument("--checkpoint", action="append", required=True,
                   help="checkpoint directory (with --stream: repeat to compare models on the same text)")
    e.add_argument("--data", help="text to score (file, directory, corpus name); default: the checkpoint's test split")
    e.add_argument("--split", default="test", choices=["train", "val", "test"], help=SPLIT_HELP)
    e.add_argument("--context", dest="seq_len", metavar="TOKENS", type=nonneg_int, default=0, help=CONTEXT_HELP)
    e.add_argument("--stride", type=positive_int, default=None,
                   help=f"tokens scored per call (default: half the context; {SCORING_SEGMENT_LEN} for a checkpoint of "
                        "`fwl-head train`)")
    device_flag(e)
    threads_flag(e)
    e.add_argument("--stream", action="store_true",
                   help="per-position loss curves along long documents: fast weights carried, reset or frozen "
                        "(--modes), PNG + JSON")
    e.add_argument("--json", action="store_true", help="print the result as JSON")
    e.add_argument("--quiet", action="store_true", help="no progress line")
    add_stream_arguments(e)  # --modes --bin --out ... (with --stream)
    add_dynamic_arguments(e.add_argument_group("dynamic evaluation (--dynamic RULE; see `fastweights dynamic eval`)"))
    e.set_defaults(func=cmd_eval)

    g = sub.add_parser("generate", help="sample text from a checkpoint")
    g.add_argument("--checkpoint", required=True, help="checkpoint directory")
    g.add_argument("--prompt", default="\n", help="text the sample continues (default: %(default)r)")
    g.add_argument("--max-tokens", type=nonneg_int, default=200, help="tokens to sample")
    g.add_argument("--temperature", type=nonneg_float, default=0.8, help="sampling temperature (0: greedy)")
    g.add_argument("--top-k", type=nonneg_int, default=0, help="sample among the k most likely tokens (0: all tokens)")
    g.add_argument("--seed", type=seed, default=0, help="sampling seed, in [0, 2**63 - 1]")
    device_flag(g)
    threads_flag(g)
    g.set_defaults(func=cmd_generate)


def _eval_texts(args, cfg):
    """Documents to score: --data (file/dir/corpus name, all of it) or the checkpoint's --split."""
    from fastweights.adapt.setup import load_texts

    return load_texts(args.data, cfg, args.split)


def _eval_prepared(model, tokenizer, cfg, args, seq_len):
    """Score a split of a `fastweights prepare` directory straight from its memory map."""
    import numpy as np
    import torch

    from fastweights.loops.evaluate import score_tokens
    from fastweights.core.progress import Progress
    from fastweights.loops.train import prepare_data

    stream = getattr(prepare_data(cfg, Path(cfg.data.corpus), tokenizer, progress=False), args.split)
    bar = Progress(len(stream) - 1, "tok", desc="eval", enabled=not args.quiet)
    result, _ = score_tokens(model, torch.from_numpy(np.asarray(stream.tokens, dtype=np.int64)), seq_len,
                             args.stride, progress=bar)
    bar.close()
    return result


def cmd_eval(args) -> int:
    from fastweights.models.loading import load_checkpoint
    from fastweights.loops.evaluate import evaluate_documents
    from fastweights.core.distributed import resolve_device

    if args.stream:
        return run_stream_eval(args)
    if len(args.checkpoint) > 1:
        raise UserError("--checkpoint is given more than once: several checkpoints need --stream")
    args.checkpoint = args.checkpoint[0]
    given = [f"--{k.replace('_', '-')}" for k in STREAM_ONLY if getattr(args, k) not in (None, False, 0, "carry,reset,frozen", 256)]
    if given:
        raise UserError(f"{given[0].replace('--labels', '--label')} applies to --stream")
    from fastweights.hf.fwl_head import is_fwl_head_checkpoint

    if is_fwl_head_checkpoint(args.checkpoint):
        return _eval_pretrained_with_head(args)
    model, tokenizer, cfg = load_checkpoint(Path(args.checkpoint), map_location=str(resolve_device(args.device)))
    seq_len = args.seq_len or cfg.train.seq_len
    if args.stride is not None and args.stride > seq_len:
        raise UserError(f"--stride {args.stride} must be at most the context length ({seq_len}, --context)")
    if args.dynamic:
        from fastweights.adapt.evaluate import evaluate_static_and_dynamic
        from fastweights.cli.dynamic import comparison_options, dynamic_settings

        res = evaluate_static_and_dynamic(dynamic_settings(args), model, tokenizer, cfg, _eval_texts(args, cfg),
                                          Path(args.checkpoint), comparison_options(args), progress=not args.quiet)
        from fastweights.cli.common import change

        key = next(k for k in ("bits_per_char", "bits_per_byte", "perplexity") if k in res["static"])
        s = res["settings"]
        print(json.dumps(res, indent=2) if args.json else
              f"static {res['static'][key]:.4f}  dynamic ({args.dynamic}, lr {s['lr']:.3g}: {s['lr_source']}) "
              f"{res['dynamic'][key]:.4f} {key} ({change(res['dynamic']['loss_nats'], res['static']['loss_nats'], 'static')})")
        return 0
    if not args.data and (Path(cfg.data.corpus) / "prepared.json").is_file():
        result = _eval_prepared(model, tokenizer, cfg, args, seq_len)
    else:
        texts = _eval_texts(args, cfg)
        _warn_unknown(tokenizer, texts, "the evaluation text")
        result = evaluate_documents(model, tokenizer, texts, seq_len, args.stride, progress=not args.quiet)
    metrics = _checked_metrics(result, tokenizer, args.checkpoint, args.data or f"{cfg.data.corpus}:{args.split}")
    if args.json:
        print(json.dumps(metrics, indent=2))
    else:
        key = "bits_per_char" if tokenizer.name in ("char",) else ("bits_per_byte" if tokenizer.name == "byte" else "perplexity")
        print(f"{metrics['data']}: {key} {metrics[key]:.4f} ({metrics['tokens']} tokens, loss {metrics['loss_nats']:.4f} nats)")
    return 0


def _eval_pretrained_with_head(args) -> int:
    """``eval`` of a checkpoint of ``fwl-head train`` (a pretrained model with an FWL head): each text of
    ``--data`` streamed in calls of ``--stride`` tokens (default: ``loops.evaluate.SCORING_SEGMENT_LEN``) with the
    KV cache and the fast weights carried, the whole text in context up to the model's position limit (or
    ``--context``)."""
    from fastweights.adapt.dynamic import DynamicEvaluator
    from fastweights.adapt.setup import encode_texts, load_texts
    from fastweights.auto.sources import load_model_and_tokenizer
    from fastweights.loops.evaluate import EvalResult

    if args.dynamic:
        raise UserError("--dynamic with an FWL head on a pretrained model: use `fastweights dynamic eval --checkpoint "
                        f"{args.checkpoint}`")
    if not args.data:
        raise UserError("--data is required for an FWL head on a pretrained model (its checkpoint names no corpus)")
    model, tokenizer, _, _ = load_model_and_tokenizer(args.checkpoint, device=args.device)
    texts = load_texts(args.data, None, "test")
    _warn_unknown(tokenizer, texts, "the evaluation text")
    ids, chars = encode_texts(tokenizer, texts)
    ev = DynamicEvaluator(model, rule="sgd", lr=0.0, segment_len=args.stride or SCORING_SEGMENT_LEN,
                          context=args.seq_len or model.default_context)
    result = EvalResult(0.0, 0, chars)
    for x in ids:
        result.add(ev.static(x, keep_token_losses=False))
    metrics = _checked_metrics(result, tokenizer, args.checkpoint, args.data)
    if args.json:
        print(json.dumps(metrics, indent=2))
    else:
        print(f"{args.data}: perplexity {metrics['perplexity']:.4f}, bits_per_char {metrics['bits_per_char']:.4f} "
              f"({metrics['tokens']} tokens, loss {metrics['loss_nats']:.4f} nats)")
    return 0


def _checked_metrics(result, tokenizer, checkpoint, data: str) -> dict:
    """``eval``'s metrics of a scored text, with the checkpoint and data named; one line (a ``UserError``) for a text
    with nothing to score, scores that overflow, or a model worse than a uniform guess."""
    if result.tokens == 0:
        raise UserError("nothing to score: the evaluation text has fewer than two tokens")
    metrics = result.metrics(tokenizer.name)
    refuse_non_finite(metrics, "the model's scores overflow on this text")
    refuse_worse_than_uniform(metrics["loss_nats"], vocab_size_of(tokenizer), "eval")
    return {**metrics, "checkpoint": str(checkpoint), "data": data}


def _warn_unknown(tokenizer, texts, what: str) -> None:
    from fastweights.data.tokenizers import unknown_symbols_warning

    line = unknown_symbols_warning(tokenizer, texts, what)
    if line:
        print(line, file=sys.stderr)


# ----------------------------------------------------------------------------- generate


def cmd_generate(args) -> int:
    from fastweights.auto.sources import load_model_and_tokenizer
    from fastweights.loops.generate import generate_tokens

    # our checkpoint: its training window; a pretrained model with an FWL head: the KV cache and fast weights
    model, tokenizer, cfg, _ = load_model_and_tokenizer(args.checkpoint, device=args.device)
    context = cfg.train.seq_len if cfg is not None else model.default_context
    _warn_unknown(tokenizer, [args.prompt], "the prompt")
    prompt = tokenizer.encode(args.prompt)
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise UserError("--prompt must not be empty")
    if args.max_tokens < 0:
        raise UserError("--max-tokens must be >= 0")
    out = sys.stdout
    out.write(args.prompt)
    ids: list[int] = []
    shown = ""
    for tok in generate_tokens(model, prompt, args.max_tokens, args.temperature, args.top_k, args.seed,
                               context=context):
        ids.append(tok)
        text = tokenizer.decode(ids)  # decode the whole continuation: multi-token characters stay intact
        if not text.endswith("\ufffd"):
            out.write(text[len(shown):])
            out.flush()
            shown = text
    out.write(tokenizer.decode(ids)[len(shown):] + "\n")
    return 0
