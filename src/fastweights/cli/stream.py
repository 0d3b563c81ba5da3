"""``fastweights eval --stream``: per-position loss curves along long documents, with the fast weights
carried, reset or frozen (``experiments.streaming``), for one or several checkpoints on the same text.

    fastweights eval --stream --checkpoint runs/a --checkpoint runs/b --data long-docs \\
        --modes carry,reset,frozen --out runs/stream               # -> runs/stream/stream.json, stream.png

``--dynamic RULE`` (with ``--lr`` etc.) puts dynamic evaluation on top of the checkpoint (see
``fastweights dynamic eval``).
"""

from __future__ import annotations

import json
from pathlib import Path

from fastweights.adapt.evaluate import scores_not_finite_because
from fastweights.cli.common import describe, load, output_prefix
from fastweights.cli.types import nonneg_int, positive_int
from fastweights.core.errors import UserError, refuse_non_finite
from fastweights.evidence.provenance import write_cli_result


def add_stream_arguments(p) -> None:
    """The options of ``eval --stream`` (``eval`` has --checkpoint, --data, --split, --context, --stride, --device,
    --threads, --json and --quiet already)."""
    from fastweights.cli.common import out_flag

    g = p.add_argument_group("streaming (--stream)")
    g.add_argument("--modes", default="carry,reset,frozen", help="comma-separated: carry, reset, frozen, memory, windows")
    g.add_argument("--bin", type=positive_int, default=256, help="predictions per bin of the per-position curves")
    g.add_argument("--max-tokens", type=nonneg_int, default=0, help="stop after this many predictions per run (0: all)")
    g.add_argument("--max-chars", type=nonneg_int, default=0, help="read at most this many characters of the data (0: all)")
    g.add_argument("--label", dest="labels", action="append",
                   help="legend label per --checkpoint (default: the directory's name and its mechanisms)")
    out_flag(g, None, "stream.json and stream.png")
    g.add_argument("--overwrite", action="store_true", help="replace the outputs of an earlier run in --out")


def _evaluator(args, model, tok, cfg, ckpt, seq_len: int):
    """(evaluator, info) of ``--dynamic RULE``, or None."""
    if not getattr(args, "dynamic", None):
        return None
    from fastweights.adapt.setup import build_evaluator
    from fastweights.cli.dynamic import dynamic_settings

    return build_evaluator(dynamic_settings(args, context=seq_len), model, tok, cfg, Path(ckpt),
                           progress=not getattr(args, "quiet", False))


def run_stream_eval(args) -> int:
    """``eval --stream``: one run per checkpoint and mode over the same documents; writes OUT.json and OUT.png."""
    from fastweights.data import load_corpus, split_corpus
    from fastweights.experiments.streaming import STREAM_MODES, encode_documents, plot_stream, stream_eval

    out = output_prefix(args, "stream")
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
    runs = []
    for k, path in enumerate(ckpts):
        model, tok, cfg = load(path, getattr(args, "device", "auto"))
        seq_len = getattr(args, "seq_len", 0) or cfg.train.seq_len
        stride = getattr(args, "stride", None)
        if data:
            docs = load_corpus(data, text_field=cfg.data.text_field)
        else:
            docs = split_corpus(load_corpus(cfg.data.corpus, text_field=cfg.data.text_field), cfg.data.split,
                                cfg.data.val_fraction, cfg.data.test_fraction)[split]
        built = _evaluator(args, model, tok, cfg, path, seq_len)
        ev, info = built if built else (None, None)
        label = labels[k] if labels else f"{Path(path).name} ({describe(cfg)})"
        for i, mode in enumerate(modes):
            run = k * len(modes) + i + 1
            res = stream_eval(model, encode_documents(docs, tok, getattr(args, "max_chars", 0) or 0), mode, seq_len,
                              stride, getattr(args, "bin", 256) or 256, getattr(args, "max_tokens", 0) or 0, ev,
                              progress=not quiet, desc=f"stream {mode}: run {run}/{len(ckpts) * len(modes)}")
            if res.tokens == 0:
                raise UserError("nothing to score: the documents have fewer than two tokens")
            d = res.to_dict()
            d.update(checkpoint=str(path), label=f"{label} {mode}" + (f" +dynamic {ev.rule}" if ev and mode != "frozen" else ""),
                     model=describe(cfg), seq_len=seq_len, stride=stride or max(1, seq_len // 2),
                     tokenizer=tok.name, not_frozen=_not_frozen(model, mode),
                     dynamic=(ev.metadata() | info) if ev is not None and mode != "frozen" else None)
            runs.append(d)
        _mark_equal_modes(runs[-len(modes):])
    doc = {"data": data or f"{cfg.data.corpus}:{split}", "modes": modes, "runs": runs}
    refuse_non_finite(doc, scores_not_finite_because(ev))
    write_cli_result(out.with_suffix(".json"), doc, args.argv)
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
    for r in runs:
        if r.get("equals"):
            print(f"note: {r['label']} equals {r['equals']}: {r['why_equal']}")
    print(f"-> {out.with_suffix('.json')}, {out.with_suffix('.png')}")
    return 0


# why a mode scores exactly as carry does, when it does
_WHY_EQUAL = {"reset": "the text is one document, and reset clears the state only between documents",
              "frozen": "the model has no fast memory with a write step to freeze"}


def _mark_equal_modes(runs: list[dict]) -> None:
    """Mark the runs of one checkpoint that score exactly as its carry run (``equals``, ``why_equal``, and the
    label, so the plot's legend says why a line lies under another)."""
    carry = next((r for r in runs if r["mode"] == "carry"), None)
    if carry is None:
        return
    for r in runs:
        if r is carry or r["mode"] not in _WHY_EQUAL:
            continue
        if [d["loss"] for d in r["documents"]] == [d["loss"] for d in carry["documents"]]:
            r.update(equals="carry", why_equal=_WHY_EQUAL[r["mode"]])
            r["label"] += " (= carry)"


def _not_frozen(model, mode: str) -> list[str]:
    from fastweights.models.memory_switches import fast_memories, unfrozen_fast_parts

    if mode != "frozen":
        return []
    parts = unfrozen_fast_parts(model)
    if not fast_memories(model):
        parts.append("no memory with a write step: frozen equals carry")
    return parts
