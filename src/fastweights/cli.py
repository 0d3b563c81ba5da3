"""Command line: ``fastweights train | eval | generate | demo | data list | task ... | <mechanism commands>``.

Entry points stay thin: each subcommand parses its flags and calls the library. Bad input
(a missing path, an unknown preset, a corrupt checkpoint) prints one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from fastweights.errors import UserError

# Modules that add their own subcommands with register_cli(subparsers), and task modules that add
# `fastweights task NAME` with register_task(task_subparsers). Missing modules are skipped.
COMMAND_MODULES = ["fastweights.adapt.cli", "fastweights.memory_stats", "fastweights.analysis", "fastweights.hf.export",
                   "fastweights.experiments.cli"]
TASK_MODULES = ["fastweights.experiments.assoc_command", "fastweights.tasks.ba_retrieval"]


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit status 2 (argparse's default prints the usage too)
        raise UserError(f"{self.prog}: {message}")


def _import_optional(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and name.startswith(e.name):
            return None
        raise


# ----------------------------------------------------------------------------- train


def _run_config(args):
    from fastweights.config import apply_overrides, from_dict, load_preset, RunConfig

    if args.resume and args.preset is None:
        from fastweights.checkpoint import read_run_config

        d = read_run_config(Path(args.out)).to_dict()
    else:
        d = load_preset(args.preset or "shakespeare-char")
    if args.data:
        d.setdefault("data", {})["corpus"] = args.data
    if getattr(args, "log", None):
        d.setdefault("train", {})["log"] = args.log
    apply_overrides(d, args.set or [])
    return from_dict(RunConfig, d)


def cmd_train(args) -> int:
    from fastweights.train import train

    if args.resume and args.overwrite:
        raise UserError("--resume and --overwrite exclude each other")
    if args.out is None:
        if args.resume:
            raise UserError("--resume needs --out (the run directory to continue)")
        import time

        stem = Path(args.preset).stem if args.preset else "shakespeare-char"
        base = Path("runs") / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
        out, n = base, 2
        while out.exists() or out.is_symlink():  # a new directory, never a reused one (two runs in one second)
            out, n = base.with_name(f"{base.name}-{n}"), n + 1
        args.out = str(out)
    cfg = _run_config(args)
    summary = train(cfg, Path(args.out), resume=args.resume, progress=not args.quiet, fsdp=args.fsdp,
                    overwrite=args.overwrite, force_memory=args.force_memory)
    if summary.get("processes", 1) > 1 and int(__import__("os").environ.get("RANK", "0")) != 0:
        return 0
    print(json.dumps(summary, indent=2) if args.json else
          f"done: {summary['steps']} steps, val {summary['val_bits_per_token']:.4f} bits/token -> {args.out}")
    return 0


def cmd_prepare(args) -> int:
    from fastweights.config import RunConfig, apply_overrides, from_dict
    from fastweights.train import prepare_corpus

    d = {"data": {"corpus": args.data, "tokenizer": args.tokenizer}}
    apply_overrides(d, args.set or [])
    cfg = from_dict(RunConfig, d)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not (out / "prepared.json").exists():
        raise UserError(f"--out {out} exists and is not a prepared-data directory")
    info = prepare_corpus(cfg, out, progress=not args.quiet)
    print(json.dumps(info, indent=2) if args.json else
          f"prepared {sum(info['tokens'].values()):,} {info['tokenizer']} tokens in {out}; train with --data {out}")
    return 0


# ----------------------------------------------------------------------------- eval


def _eval_texts(args, cfg):
    """Documents to score: --data (file/dir/corpus name, all of it) or the checkpoint's --split."""
    from fastweights.adapt.cli import load_texts

    return load_texts(args, cfg, args.split)


def _eval_prepared(model, tokenizer, cfg, args, seq_len):
    """Score a split of a `fastweights prepare` directory straight from its memory map."""
    import numpy as np
    import torch

    from fastweights.evaluate import score_tokens
    from fastweights.progress import Progress
    from fastweights.train import prepare_data

    stream = getattr(prepare_data(cfg, Path(cfg.data.corpus), tokenizer, progress=False), args.split)
    bar = Progress(len(stream) - 1, "tok", desc="eval", enabled=not args.quiet)
    result, _ = score_tokens(model, torch.from_numpy(np.asarray(stream.tokens, dtype=np.int64)), seq_len,
                             args.stride, progress=bar)
    bar.close()
    return result


def cmd_eval(args) -> int:
    from fastweights.checkpoint import load_checkpoint
    from fastweights.evaluate import evaluate_documents
    from fastweights.distributed import resolve_device

    if args.stream:
        from fastweights.experiments.cli import run_stream_eval

        return run_stream_eval(args)
    model, tokenizer, cfg = load_checkpoint(Path(args.checkpoint), map_location=str(resolve_device(args.device)))
    seq_len = args.seq_len or cfg.train.seq_len
    if args.stride is not None and args.stride > seq_len:
        raise UserError(f"--stride {args.stride} must be at most the context length ({seq_len}, --seq-len)")
    if getattr(args, "dynamic", None):
        from fastweights.adapt.cli import run_eval_dynamic

        res = run_eval_dynamic(args, model, tokenizer, cfg, _eval_texts(args, cfg))
        key = next(k for k in ("bits_per_char", "bits_per_byte", "perplexity") if k in res["static"])
        print(json.dumps(res, indent=2) if args.json else
              f"static {res['static'][key]:.4f}  dynamic ({args.dynamic}) {res['dynamic'][key]:.4f} {key} "
              f"({100 * res['relative_improvement']:.1f}% lower)")
        return 0
    if not args.data and (Path(cfg.data.corpus) / "prepared.json").is_file():
        result = _eval_prepared(model, tokenizer, cfg, args, seq_len)
    else:
        texts = _eval_texts(args, cfg)
        _warn_unknown(tokenizer, texts, "the evaluation text")
        result = evaluate_documents(model, tokenizer, texts, seq_len, args.stride, progress=not args.quiet)
    if result.tokens == 0:
        raise UserError("nothing to score: the evaluation text has fewer than two tokens")
    metrics = result.metrics(tokenizer.name)
    metrics.update(checkpoint=str(args.checkpoint), data=args.data or f"{cfg.data.corpus}:{args.split}")
    if args.json:
        print(json.dumps(metrics, indent=2))
    else:
        key = "bits_per_char" if tokenizer.name in ("char",) else ("bits_per_byte" if tokenizer.name == "byte" else "perplexity")
        print(f"{metrics['data']}: {key} {metrics[key]:.4f} ({metrics['tokens']} tokens, loss {metrics['loss_nats']:.4f} nats)")
    return 0


def _warn_unknown(tokenizer, texts, what: str) -> None:
    from fastweights.data.tokenizers import unknown_symbols_warning

    line = unknown_symbols_warning(tokenizer, texts, what)
    if line:
        print(line, file=sys.stderr)


# ----------------------------------------------------------------------------- generate


def cmd_generate(args) -> int:
    from fastweights.checkpoint import load_checkpoint
    from fastweights.generate import generate_tokens
    from fastweights.distributed import resolve_device

    model, tokenizer, cfg = load_checkpoint(Path(args.checkpoint), map_location=str(resolve_device(args.device)))
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
                               context=cfg.train.seq_len):
        ids.append(tok)
        text = tokenizer.decode(ids)  # decode the whole continuation: multi-token characters stay intact
        if not text.endswith("\ufffd"):
            out.write(text[len(shown):])
            out.flush()
            shown = text
    out.write(tokenizer.decode(ids)[len(shown):] + "\n")
    return 0


# ----------------------------------------------------------------------------- demo


def cmd_demo(args) -> int:
    from fastweights.demo import run_demo

    return run_demo(Path(args.out), minutes=args.minutes)


# ----------------------------------------------------------------------------- data


def cmd_data_list(args) -> int:
    """``fastweights data list``: the corpus names a preset or ``--data`` can use, with their sizes and licences."""
    from fastweights.data.bundled import BUNDLED, corpus_rows, format_rows
    from fastweights.data.corpus import CORPORA

    generated = {name: getattr(loader, "__module__", "?") for name, loader in CORPORA.items() if name not in BUNDLED}
    rows = corpus_rows(generated)
    print(json.dumps(rows, indent=2) if args.json else format_rows(rows))
    return 0


# ----------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    from fastweights.data.tokenizers import TOKENIZER_KINDS
    from fastweights.validate import nonneg_float, nonneg_int, positive_float, positive_int, seed

    p = _Parser(prog="fastweights", description="Language models whose weights change with the text they read.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    t = sub.add_parser("train", help="train a model from a preset")
    t.add_argument("--preset", help="preset name (configs/NAME.toml) or path to a .toml file; default shakespeare-char")
    t.add_argument("--data", help="corpus: a registered name, a text file, a directory or a .jsonl file")
    t.add_argument("--out", help="output directory (checkpoint, metrics, plots); default: a new runs/PRESET-DATE-TIME")
    t.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config field")
    t.add_argument("--resume", action="store_true", help="continue the run saved in --out")
    t.add_argument("--overwrite", action="store_true",
                   help="replace the run in --out (its checkpoint, logs and the files derived from its weights)")
    t.add_argument("--force-memory", action="store_true",
                   help="train even when the estimated memory exceeds what the machine has available")
    t.add_argument("--fsdp", action="store_true", help="under torchrun: shard with FSDP2 (fully_shard per block) instead of DDP")
    t.add_argument("--log", choices=["jsonl", "tensorboard"], help="also log to TensorBoard (metrics.jsonl is always written)")
    t.add_argument("--json", action="store_true", help="print the summary as JSON")
    t.add_argument("--quiet", action="store_true", help="no progress line")
    t.set_defaults(func=cmd_train)

    pr = sub.add_parser("prepare", help="tokenise a corpus once into memory-mapped train/val/test files")
    pr.add_argument("--data", required=True, help="corpus: registered name, text file, directory or .jsonl")
    pr.add_argument("--tokenizer", default="gpt2", choices=list(TOKENIZER_KINDS))
    pr.add_argument("--out", required=True, help="directory for the token files (then train with --data DIR)")
    pr.add_argument("--set", action="append", metavar="data.KEY=VALUE", help="override a data field (split, fractions)")
    pr.add_argument("--json", action="store_true")
    pr.add_argument("--quiet", action="store_true")
    pr.set_defaults(func=cmd_prepare)

    e = sub.add_parser("eval", help="score text with a checkpoint (bits per char/byte or perplexity)")
    e.add_argument("--checkpoint", required=True)
    e.add_argument("--data", help="text to score (file, directory, corpus name); default: the checkpoint's test split")
    e.add_argument("--split", default="test", choices=["train", "val", "test"])
    e.add_argument("--seq-len", type=nonneg_int, default=0, help="context length (default: the training seq_len)")
    e.add_argument("--stride", type=positive_int, default=None, help="tokens scored per call (default seq_len // 2)")
    e.add_argument("--device", default="auto")
    e.add_argument("--stream", action="store_true",
                   help="per-position loss curves along long documents, carry vs reset vs frozen fast weights "
                        "with this command's defaults (`fastweights stream-eval` has the options for modes, bins and plots)")
    e.add_argument("--json", action="store_true")
    e.add_argument("--quiet", action="store_true")
    adapt_cli = _import_optional("fastweights.adapt.cli")
    if adapt_cli is not None:
        adapt_cli.add_dynamic_arguments(e)  # --dynamic RULE [--lr --decay --segment-len ...]
    e.set_defaults(func=cmd_eval)

    g = sub.add_parser("generate", help="sample text from a checkpoint")
    g.add_argument("--checkpoint", required=True)
    g.add_argument("--prompt", default="\n")
    g.add_argument("--max-tokens", type=nonneg_int, default=200)
    g.add_argument("--temperature", type=nonneg_float, default=0.8, help="0: greedy")
    g.add_argument("--top-k", type=nonneg_int, default=0, help="0: all tokens")
    g.add_argument("--seed", type=seed, default=0, help="sampling seed, in [0, 2**63 - 1]")
    g.add_argument("--device", default="auto")
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo", help="train a char-level Shakespeare model on the CPU, evaluate it, sample")
    d.add_argument("--out", default="runs/demo")
    d.add_argument("--minutes", type=positive_float, default=5.0, help="training time budget")
    d.set_defaults(func=cmd_demo)

    data = sub.add_parser("data", help="corpora shipped with the package")
    data_sub = data.add_subparsers(dest="data_command", metavar="list", required=True, parser_class=_Parser)
    dl = data_sub.add_parser("list", help="registered corpus names: documents, characters, packed size, licence")
    dl.add_argument("--json", action="store_true", help="print the rows as JSON")
    dl.set_defaults(func=cmd_data_list)

    task = sub.add_parser("task", help="synthetic tasks from the papers")
    task_sub = task.add_subparsers(dest="task", required=True, parser_class=_Parser)
    for name in TASK_MODULES:
        mod = _import_optional(name)
        if mod is not None:
            mod.register_task(task_sub)
    for name in COMMAND_MODULES:
        mod = _import_optional(name)
        if mod is not None:
            mod.register_cli(sub)
    return p


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"  # the command line shows what to change, not which file warned


def main(argv: list[str] | None = None) -> int:
    import warnings

    warnings.formatwarning = _one_line_warning
    try:
        args = build_parser().parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)  # what result files record as the command
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # a training run saves first (fastweights.train.RunInterrupted says which step)
        print(str(e) or "interrupted", file=sys.stderr)
        return getattr(e, "exit_code", 130)
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
