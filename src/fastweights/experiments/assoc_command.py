"""``fastweights task assoc``: the command line of :mod:`fastweights.tasks.assoc` (Schlag et al. 2021,
section 6.1): train the retrieval model over a sweep of key counts, print or write the results."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from fastweights.errors import UserError
from fastweights.experiments.probes import fingerprinted, probe
from fastweights.provenance import write_cli_result
from fastweights.tasks.assoc import FEATURE_MAPS, RULES, AssocConfig, parse_keys, parse_model, plot_capacity, run_sweep
from fastweights.validate import nonneg_float, nonneg_int, positive_float, positive_int, seed


def run(args: argparse.Namespace) -> int:
    """``fastweights task assoc``: train, print a table (or JSON), optionally write JSON and a plot."""
    if args.threads:
        torch.set_num_threads(args.threads)
    models = [parse_model(m) for m in args.model] if args.model else [
        {"rule": args.rule, "feature_map": args.feature_map, "nu": args.nu, "n_features": args.n_features}
    ]
    for m in models:
        if m["rule"] not in RULES:
            raise UserError(f"assoc: unknown rule {m['rule']!r}; choose one of {', '.join(RULES)}")
    base = AssocConfig(
        setting=args.setting, hidden=args.hidden, batch_size=args.batch_size, lr=args.lr,
        max_steps=args.max_steps, max_minutes=args.max_minutes, eval_every=args.eval_every,
        eval_sequences=args.eval_sequences, stop_loss=args.stop_loss, patience=args.patience, seed=args.seed,
    )
    results = run_sweep(base, parse_keys(args.keys), models, progress=not args.quiet)
    if args.out:
        measured = fingerprinted([probe("assoc_model", setting=args.setting, **m) for m in models]
                                 + [probe("task", name="assoc")])
        write_cli_result(Path(args.out), {"results": results}, getattr(args, "argv", None), measured)
    if args.plot:
        plot_capacity(results, Path(args.plot))
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else results, indent=2))
    else:
        print(f"{'model':<16} {'S':>5} {'final loss':>11} {'steps':>7} {'stopped':>12} {'sec':>7}")
        for r in results:
            print(f"{r['label']:<16} {r['keys']:>5} {r['final_eval_loss']:>11.4f} {r['steps']:>7} "
                  f"{r['stopped']:>12} {r['seconds']:>7.1f}")
    return 0


def register_task(task_subparsers) -> None:
    """Add ``assoc`` to the ``fastweights task`` command group."""
    p = task_subparsers.add_parser(
        "assoc", help="synthetic associative retrieval (Schlag et al. 2021, sec. 6.1): capacity of fast weights",
        description="Train the paper's small fast weight model on associative retrieval; report the final eval loss.",
    )
    p.add_argument("--setting", type=int, choices=(1, 2), default=1,
                   help="1: S unique keys, length S; 2: keys with replacement, length 2S (overwrites)")
    p.add_argument("--keys", default="20", help="number of keys S: 60, 20,40,60 or 20:100:20 (default 20)")
    p.add_argument("--rule", choices=RULES, default="sum")
    p.add_argument("--feature-map", choices=FEATURE_MAPS, default="elu1")
    p.add_argument("--nu", type=positive_int, default=1, help="DPFP order (d_dot = 128 nu)")
    p.add_argument("--n-features", type=positive_int, default=64, help="FAVOR+ random features m (d_dot = 2m)")
    p.add_argument("--model", action="append", default=[],
                   help="RULE:MAP (e.g. sum:elu1, delta:dpfp1, sum:favor64); repeat for several; overrides --rule etc.")
    p.add_argument("--hidden", type=positive_int, default=64)
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.add_argument("--lr", type=positive_float, default=1e-3)
    p.add_argument("--max-steps", type=positive_int, default=100_000)
    p.add_argument("--max-minutes", type=nonneg_float, default=0.0, help="wall-clock budget per run (0 = none)")
    p.add_argument("--eval-every", type=positive_int, default=100)
    p.add_argument("--eval-sequences", type=positive_int, default=20)
    p.add_argument("--stop-loss", type=nonneg_float, default=0.001)
    p.add_argument("--patience", type=nonneg_int, default=10)
    p.add_argument("--seed", type=seed, default=1)
    p.add_argument("--threads", type=nonneg_int, default=1, help="torch CPU threads (default 1; 0 = torch's default)")
    p.add_argument("--json", action="store_true", help="print the result(s) as JSON")
    p.add_argument("--out", help="write the results (with the command) as JSON to this path")
    p.add_argument("--plot", help="write the capacity plot (final loss vs S) as PNG to this path")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.set_defaults(func=run)
