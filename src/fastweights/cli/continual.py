"""``fastweights continual``: continual adaptation across domains (``adapt.continual``): the NLL on every
domain after each adaptation stage.

    fastweights continual --checkpoint runs/a --domain shakespeare=shakespeare-heldout --domain spanish=don-quijote \\
        --out runs/adapt                                            # -> runs/adapt/adapt.json, adapt.png
"""

from __future__ import annotations

import json
from pathlib import Path

from fastweights.cli.common import common_flags, describe, load, out_flag, output_prefix
from fastweights.adapt.evaluate import scores_not_finite_because
from fastweights.cli.types import nonneg_int, positive_int
from fastweights.core.errors import UserError, refuse_non_finite
from fastweights.evidence.provenance import write_cli_result


def register(sub) -> None:
    a = sub.add_parser("continual", help="continual adaptation across domains: NLL on every domain after each stage")
    common_flags(a)
    a.add_argument("--domain", action="append", required=True, metavar="NAME=PATH",
                   help="a domain's text (file, directory or corpus name); repeat, in adaptation order")
    a.add_argument("--adapt-tokens", type=positive_int, default=20000, help="adaptation tokens per domain (from its start)")
    a.add_argument("--eval-tokens", type=positive_int, default=5000, help="held-out tokens per domain (from its end)")
    a.add_argument("--context", dest="seq_len", metavar="TOKENS", type=nonneg_int, default=0,
                   help="attention context in tokens (0: the training seq_len)")
    a.add_argument("--stride", type=positive_int, default=None, help="predictions per call (default: half the context)")
    a.add_argument("--eval-state", default="memory", choices=["memory", "all"],
                   help="score from the post-stage memories only (mixers fresh), or from the whole state")
    out_flag(a, "runs/adapt", "adapt.json and adapt.png")
    from fastweights.cli.dynamic import add_dynamic_arguments

    add_dynamic_arguments(a.add_argument_group("dynamic evaluation on top (see `fastweights dynamic eval`)"), reset=False)
    a.set_defaults(func=cmd_continual)


def cmd_continual(args) -> int:
    from fastweights.data import load_corpus
    from fastweights.adapt.continual import adapt_test, format_adapt_table, make_domain, plot_adapt

    out = output_prefix(args, "adapt")
    model, tok, cfg = load(args.checkpoint, args.device)
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
    ev, info = None, None
    if args.dynamic:
        from fastweights.adapt.setup import build_evaluator
        from fastweights.cli.dynamic import dynamic_settings

        ev, info = build_evaluator(dynamic_settings(args, context=seq_len), model, tok, cfg, Path(args.checkpoint),
                                   progress=not args.quiet)
    res = adapt_test(model, domains, seq_len, args.stride, args.eval_state, ev, progress=not args.quiet)
    refuse_non_finite(res, scores_not_finite_because(ev))
    res.update(checkpoint=str(args.checkpoint), model=describe(cfg),
               dynamic=(ev.metadata() | info) if ev is not None else None)
    from fastweights.models.memory_switches import fast_memories

    if ev is None and args.eval_state == "memory" and not fast_memories(model):  # (issue 49: a table of +0.0000)
        res["note"] = ("the model has no fast memory and --dynamic is not set: with --eval-state memory nothing read "
                       "in a stage reaches the scores, so every change is 0 (add --dynamic RULE, or --eval-state all)")
    write_cli_result(out.with_suffix(".json"), res, args.argv)
    plot_adapt(res, out.with_suffix(".png"), title=f"continual adaptation: {Path(args.checkpoint).name} ({describe(cfg)})"
               + (f" + dynamic {ev.rule}" if ev else ""))
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(format_adapt_table(res))
    if "note" in res:
        print(f"note: {res['note']}")
    print(f"-> {out.with_suffix('.json')}, {out.with_suffix('.png')}")
    return 0
