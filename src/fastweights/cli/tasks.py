"""``fastweights task assoc | ba-retrieval | niah``: the synthetic tasks of the papers (``fastweights.tasks``).

- ``assoc``: associative retrieval of Schlag et al. 2021, section 6.1 (:mod:`fastweights.tasks.assoc`): train
  the retrieval model over a sweep of key counts, print or write the results;
- ``ba-retrieval``: associative retrieval of Ba et al. 2016 (:mod:`fastweights.tasks.ba_retrieval`);
- ``niah``: needle in a haystack with n-iter re-reading (:mod:`fastweights.tasks.niah`, ``niah_token``)::

    fastweights task niah --checkpoint runs/niah-cpu --lengths 1024,2048,4096 --iters 1,2 --samples 20 \\
        --haystack tinyshakespeare --out runs/niah-cpu              # -> runs/niah-cpu/niah.json, niah.png
"""

from __future__ import annotations

import json
from pathlib import Path

import fastweights.tasks.niah  # noqa: F401  (registers the corpus "niah-tinyshakespeare" used by configs/niah-cpu.toml)
import fastweights.tasks.niah_token  # noqa: F401  (registers "niah-token-tinyshakespeare", configs/niah-token.toml)
import fastweights.tasks.niah_multitoken  # noqa: F401  (registers "niah-multitoken-tinyshakespeare")
from fastweights.cli.common import common_flags, describe, load, out_flag, output_prefix, threads_flag
from fastweights.cli.settings import add_settings, settings_from
from fastweights.cli.types import ints, nonneg_int, positive_int, seed
from fastweights.core.errors import UserError
from fastweights.evidence.provenance import write_cli_result
from fastweights.tasks.assoc import AssocConfig, parse_model, plot_capacity, run_sweep
from fastweights.tasks.ba_retrieval import BaRetrievalConfig
from fastweights.tasks.niah import NiahOptions


def cmd_assoc(args) -> int:
    """``fastweights task assoc``: train, print a table (or JSON), write JSON and a plot into --out."""
    models = [parse_model(m) for m in args.model] if args.model else [
        {"rule": args.rule, "feature_map": args.feature_map, "nu": args.nu, "n_features": args.n_features}
    ]
    keys = args.keys if isinstance(args.keys, list) else [args.keys]  # the default: one count; given: parse_keys'
    base = settings_from(args, AssocConfig, keys=keys[0])  # run_sweep sets each count in turn
    out = output_prefix(args, "assoc") if args.out else None
    results = run_sweep(base, keys, models, progress=not args.quiet)
    if out is not None:
        write_cli_result(out.with_suffix(".json"), {"results": results}, args.argv)
        plot_capacity(results, out.with_suffix(".png"))
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else results, indent=2))
    else:
        print(f"{'model':<16} {'S':>5} {'final loss':>11} {'steps':>7} {'stopped':>12} {'sec':>7}")
        for r in results:
            print(f"{r['label']:<16} {r['keys']:>5} {r['final_eval_loss']:>11.4f} {r['steps']:>7} "
                  f"{r['stopped']:>12} {r['seconds']:>7.1f}")
    return 0


def register(top, parser_class) -> None:
    """Add ``fastweights task assoc | ba-retrieval | niah``."""
    task = top.add_parser("task", help="synthetic tasks from the papers: assoc, ba-retrieval, niah")
    sub = task.add_subparsers(dest="task", metavar="assoc|ba-retrieval|niah", required=True, parser_class=parser_class)
    _register_assoc(sub)
    _register_ba_retrieval(sub)
    _register_niah(sub)


def _register_assoc(sub) -> None:
    p = sub.add_parser(
        "assoc", help="synthetic associative retrieval (Schlag et al. 2021, sec. 6.1): capacity of fast weights",
        description="Train the paper's small fast weight model on associative retrieval; report the final eval loss.",
    )
    add_settings(p, AssocConfig, exclude={"max_eval_queries"})
    p.add_argument("--model", action="append", default=[],
                   help="RULE:MAP (e.g. sum:elu1, delta:dpfp1, sum:favor64); repeat for several; overrides --rule etc. "
                        "(default: the one model --rule and --feature-map describe)")
    threads_flag(p, "task")
    p.add_argument("--json", action="store_true", help="print the result(s) as JSON")
    out_flag(p, None, "assoc.json (the results with the command) and assoc.png (final loss against S)", optional=True)
    p.add_argument("--overwrite", action="store_true", help="replace the outputs of an earlier run in --out")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.set_defaults(func=cmd_assoc)


def _register_ba_retrieval(sub) -> None:
    p = sub.add_parser(
        "ba-retrieval",
        help="associative retrieval of Ba et al. 2016 (e.g. c9k8j3f1??c -> 9)",
        description="Train the paper's task network on associative retrieval and report the test error.",
    )
    add_settings(p, BaRetrievalConfig)
    threads_flag(p, "task")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    out_flag(p, None, "ba_retrieval.json", optional=True)
    p.add_argument("--overwrite", action="store_true", help="replace the outputs of an earlier run in --out")
    p.set_defaults(func=cmd_ba_retrieval)


def cmd_ba_retrieval(args) -> int:
    """``fastweights task ba-retrieval``; returns the exit status."""
    from fastweights.tasks.ba_retrieval import run_ba_retrieval

    cfg = settings_from(args, BaRetrievalConfig)
    out = output_prefix(args, "ba_retrieval") if args.out else None
    report = run_ba_retrieval(cfg, log=None if args.json else (lambda line: print(line, flush=True)))
    report["options"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"}
    if out is not None:
        from fastweights.core.files import atomic_write

        atomic_write(out.with_suffix(".json"), lambda p: p.write_text(json.dumps(report, indent=2) + "\n"))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"test error {100 * report['test_error']:.2f}% (best val error {100 * report['val_error']:.2f}% at step "
              f"{report['best_step']}; {report['steps']} steps, {report['train_seconds']:.0f}s)")
    return 0


def _register_niah(sub) -> None:
    n = sub.add_parser("niah", help="needle in a haystack with n-iter re-reading: accuracy by depth x length (PNG + JSON)")
    common_flags(n)
    n.add_argument("--haystack", default="tinyshakespeare",
                   help="haystack text: a file, a directory of .txt files, or a corpus name")
    n.add_argument("--lengths", default="1024,2048,4096", help="context lengths in tokens, comma-separated")
    n.add_argument("--depths", default="uniform", help="'uniform' or target depths in [0, 1], e.g. 0,0.25,0.5,0.75,1")
    n.add_argument("--depth-bins", type=positive_int, default=5, help="rows of the heatmap with --depths uniform")
    n.add_argument("--samples", type=positive_int, default=10, help="samples per length (or per length and depth)")
    n.add_argument("--seed", type=seed, default=0, help="seed of the samples (needles, depths, haystack offsets)")
    add_settings(n, NiahOptions)
    out_flag(n, "runs/niah", "niah.json and niah.png")
    n.add_argument("--show", type=nonneg_int, default=0, help="print the first N prompts with the model's answers")
    n.add_argument("--format", default="auto", choices=["auto", "char", "token", "multitoken"],
                   help="needle format: 'char' (ID-3fa9 / 6 digits), 'token' (one-token keys and values, "
                        "fastweights.tasks.niah_token), 'multitoken' (two-token keys, three-token values, "
                        "fastweights.tasks.niah_multitoken); 'auto' picks the format a model was trained on")
    n.add_argument("--keys", default="heldout", choices=["heldout", "train"],
                   help="token formats: keys (and multitoken values) never used in training needles (heldout) "
                        "or the training ones")
    n.set_defaults(func=cmd_niah)


def cmd_niah(args) -> int:
    from fastweights.core.distributed import resolve_device
    from fastweights.models.size import check_tokens_ram
    from fastweights.tasks.niah import parse_depths, plot_niah, records_to_json
    from fastweights.tasks.niah_run import run_niah

    out = output_prefix(args, "niah")
    model, tok, cfg = load(args.checkpoint, args.device)
    lengths = ints(args.lengths, "--lengths")
    depths = parse_depths(args.depths)
    if args.samples < 1:
        raise UserError("--samples must be >= 1")
    if args.depth_bins < 1:
        raise UserError("--depth-bins must be >= 1")
    check_tokens_ram(cfg, (sum(lengths) + args.max_new_tokens * len(lengths)) * len(depths) * args.samples,
                     resolve_device(args.device), f"--lengths {max(lengths, default=0)} (every sample is kept)")
    opts = settings_from(args, NiahOptions)
    opts.validate()
    run = run_niah(model, tok, args.haystack, lengths, depths, args.samples, args.seed, opts, fmt=args.format,
                   keys=args.keys, depth_bins=args.depth_bins, progress=not args.quiet)
    fmt, samples, records, summary = run.format, run.samples, run.records, run.summary
    meta = {"checkpoint": str(args.checkpoint), "model": describe(cfg),
            "haystack": run.haystack, "format": fmt,
            **({"keys": args.keys} if fmt != "char" else {}),
            **({"heldout_key_embeddings": "mean + std * N(0, 1) of the trained keys'"
                if args.keys == "heldout" else "trained"} if fmt == "token" else {}), "lengths": lengths, "depths": depths, "samples_per_cell": args.samples,
            "seed": args.seed, "options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(opts).items()},
            "train_seq_len": cfg.train.seq_len}
    doc = records_to_json(records, summary, meta)
    write_cli_result(out.with_suffix(".json"), doc, args.argv)
    plot_niah(summary, out.with_suffix(".png"), title=f"NIAH: {Path(args.checkpoint).name} ({describe(cfg)})")
    for s in samples[: args.show]:
        recs = [r for r in records if r["seed"] == s.seed]
        print(f"--- {s.seed}: context {s.tokens} tokens, target depth {s.target_depth:.2f}")
        print(s.context[-300:].replace("\n", " ") + s.question)
        print("    answer", s.answer, "| model", ", ".join(f"{r['iters']}-iter {r['prediction']!r}" for r in recs))
    if args.json:
        print(json.dumps({k: v for k, v in doc.items() if k != "records"}, indent=2))
        return 0
    print(f"NIAH {Path(args.checkpoint).name} ({describe(cfg)}), {args.samples} samples per cell, haystack {args.haystack}")
    from fastweights.tasks.niah_report import format_table

    print(format_table(summary))
    print(f"-> {out.with_suffix('.json')}, {out.with_suffix('.png')}")
    return 0
