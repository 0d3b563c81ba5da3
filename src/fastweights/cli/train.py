"""``fastweights train | prepare | data list | demo | export-hf``: make a model, its data, and share it."""

from __future__ import annotations

import json
from pathlib import Path

from fastweights.cli.common import out_flag
from fastweights.cli.types import nonneg_int, positive_int
from fastweights.core.errors import UserError
from fastweights.experiments.demo import DEMO_STEPS


def register(sub, parser_class) -> None:
    from fastweights.data.tokenizers import TOKENIZER_KINDS

    t = sub.add_parser("train", help="train a model from a preset", epilog=_preset_listing(),
                       description="Train a language model from a preset (listed below); --set changes any setting.")
    t.add_argument("--preset", help="preset name (configs/NAME.toml) or path to a .toml file (default: "
                                    "shakespeare-char; with --resume: the run's own config)")
    t.add_argument("--data", help="corpus: a registered name, a text file, a directory or a .jsonl file (default: the "
                                  "preset's data.corpus)")
    out_flag(t, None, "the checkpoint, metrics and plots")
    t.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                   help="override a config field; repeat for several (default: the preset's values)")
    t.add_argument("--threads", type=nonneg_int, default=None,
                   help="torch CPU threads, the same as --set train.threads=N (0: the cores idle when the run "
                        "starts, docs/language-model.md#threads; default: the preset's train.threads)")
    t.add_argument("--resume", action="store_true", help="continue the run saved in --out")
    t.add_argument("--overwrite", action="store_true",
                   help="replace the run in --out (its checkpoint, logs and the files derived from its weights)")
    t.add_argument("--force-ram", action="store_true",
                   help="train even when the estimated RAM (GPU: device memory) exceeds what the machine has available")
    t.add_argument("--fsdp", action="store_true", help="under torchrun: shard with FSDP2 (fully_shard per block) instead of DDP")
    t.add_argument("--log", choices=["jsonl", "tensorboard"],
                   help="also log to TensorBoard (metrics.jsonl is always written; default: the preset's train.log)")
    t.add_argument("--json", action="store_true", help="print the summary as JSON")
    t.add_argument("--quiet", action="store_true", help="no progress line")
    t.set_defaults(func=cmd_train)

    pr = sub.add_parser("prepare", help="tokenise a corpus once into memory-mapped train/val/test files")
    pr.add_argument("--data", required=True, help="corpus: registered name, text file, directory or .jsonl")
    pr.add_argument("--tokenizer", default="gpt2", choices=list(TOKENIZER_KINDS), help="tokenizer of the token files")
    pr.add_argument("--out", metavar="DIR", required=True,
                    help="directory to write the token files into (created if missing); then train with --data DIR")
    pr.add_argument("--set", action="append", metavar="data.KEY=VALUE",
                    help="override a data field (split, fractions); repeat for several (default: the data section's "
                         "defaults)")
    pr.add_argument("--json", action="store_true", help="print the summary as JSON")
    pr.add_argument("--quiet", action="store_true", help="no progress line")
    pr.set_defaults(func=cmd_prepare)

    d = sub.add_parser("demo", help="train a char-level Shakespeare model on the CPU, evaluate it, sample")
    out_flag(d, "runs/demo", "the checkpoint, its tuned dynamic-evaluation settings, demo.json and the loss curve")
    d.add_argument("--steps", type=positive_int, default=DEMO_STEPS,
                   help="training steps (about five minutes on an idle 2-core machine)")
    d.add_argument("--threads", type=nonneg_int, default=0,
                   help="torch CPU threads for training (0: OMP_NUM_THREADS when set, else the cores idle at start; "
                        "scoring uses one)")
    d.set_defaults(func=cmd_demo)

    data = sub.add_parser("data", help="corpora shipped with the package: list",
                          description="The corpora shipped with the package, by name (--data NAME): `fastweights "
                                      "data list` shows them.")
    data_sub = data.add_subparsers(dest="data_command", metavar="list", required=True, parser_class=parser_class)
    dl = data_sub.add_parser("list", help="registered corpus names: documents, characters, packed size, licence")
    dl.add_argument("--json", action="store_true", help="print the rows as JSON")
    dl.set_defaults(func=cmd_data_list)

    x = sub.add_parser("export-hf", help="write a checkpoint as a Hugging Face model directory",
                       description="Write a checkpoint as a Hugging Face model directory (AutoModelForCausalLM / "
                                   "AutoTokenizer, after `import fastweights.hf.ours_as_transformers`).")
    x.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint directory")
    x.add_argument("dir", metavar="DIR", help="output directory (created; must be empty unless --force)")
    x.add_argument("--force", action="store_true", help="write into a non-empty DIR")
    x.set_defaults(func=cmd_export_hf)


def _preset_listing() -> str:
    """The presets ``--preset`` takes, one line each (``fastweights train --help``)."""
    from fastweights.core.config import preset_descriptions

    presets = preset_descriptions()
    if not presets:
        return "no presets found (--preset takes a path to a .toml file)"
    width = max(map(len, presets)) + 2
    return "presets (--preset NAME; configs/NAME.toml in a checkout, else the copy in the package):\n" + \
        "\n".join(f"  {name:<{width}}{text}".rstrip() for name, text in presets.items())


def _run_config(args):
    from fastweights.core.config import apply_overrides, from_dict, load_preset, RunConfig

    if args.resume and args.preset is None:
        from fastweights.models.loading import read_run_config

        d = read_run_config(Path(args.out)).to_dict()
    else:
        d = load_preset(args.preset or "shakespeare-char")
    if args.data:
        d.setdefault("data", {})["corpus"] = args.data
    if getattr(args, "log", None):
        d.setdefault("train", {})["log"] = args.log
    if getattr(args, "threads", None) is not None:
        d.setdefault("train", {})["threads"] = args.threads
    saved_tokenizer = d.get("data", {}).get("tokenizer") if args.resume and args.preset is None else None
    apply_overrides(d, args.set or [])
    if saved_tokenizer is not None and d.get("data", {}).get("tokenizer") != saved_tokenizer:
        raise UserError(f"--resume: the run in {args.out} was trained with data.tokenizer={saved_tokenizer!r}; a "
                        "resumed run keeps its tokenizer (start a new run for another one)")
    cfg = from_dict(RunConfig, d)
    from fastweights.checkpoints.config_checks import validate_config

    validate_config(cfg, warn=False)  # an invalid setting is the one line printed, with no warning before it
    if cfg.train.warmup_steps > cfg.train.max_steps:
        import sys

        print(f"warning: train.warmup_steps={cfg.train.warmup_steps} > train.max_steps={cfg.train.max_steps}: the "
              f"learning rate never reaches train.lr={cfg.train.lr:g}", file=sys.stderr)
    return cfg


def cmd_train(args) -> int:
    from fastweights.loops.train import train

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
                    overwrite=args.overwrite, force_ram=args.force_ram)
    if summary.get("processes", 1) > 1 and int(__import__("os").environ.get("RANK", "0")) != 0:
        return 0
    per = {"char": "char", "byte": "byte"}.get(summary["tokenizer"], "token")  # as eval says: a char model's bits/char
    print(json.dumps(summary, indent=2) if args.json else
          f"done: {summary['steps']} steps, val {summary['val_bits_per_token']:.4f} bits/{per} -> {args.out}")
    return 0


def cmd_prepare(args) -> int:
    from fastweights.core.config import RunConfig, apply_overrides, from_dict
    from fastweights.loops.train import prepare_corpus

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


def cmd_demo(args) -> int:
    from fastweights.experiments.demo import run_demo

    return run_demo(Path(args.out), steps=args.steps, threads=args.threads)


# ----------------------------------------------------------------------------- data


def cmd_data_list(args) -> int:
    """``fastweights data list``: the corpus names a preset or ``--data`` can use, with their sizes and licences."""
    from fastweights.data.bundled import BUNDLED, corpus_rows, format_rows
    from fastweights.data.corpus import CORPORA

    generated = {name: getattr(loader, "__module__", "?") for name, loader in CORPORA.items() if name not in BUNDLED}
    rows = corpus_rows(generated)
    print(json.dumps(rows, indent=2) if args.json else format_rows(rows))
    return 0


def cmd_export_hf(args) -> int:
    from fastweights.hf.export import export_hf

    files = export_hf(args.checkpoint, args.dir, force=args.force)
    print(f"exported {args.checkpoint} -> {args.dir} ({', '.join(files)})")
    return 0
