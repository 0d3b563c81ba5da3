"""Loading, gradient statistics and evaluator building behind the dynamic-evaluation commands (``adapt.cli``).

:func:`build_evaluator` maps parsed arguments to a ``DynamicEvaluator`` (full weights, ``--params``),
a ``SparseDynamicEvaluator`` (``--sparse-units``) or a ``LowRankDynamicEvaluator`` (``--lowrank-rank``),
with the learning-rate schedule of ``--lr-schedule``, lr and decay from the command line or a named
tuned file, and, for the RMS rules, gradient statistics of the same kind: ``--stats FILE`` or the
checkpoint's file for that kind (``grad_stats.safetensors``, ``grad_stats_sparse_l{L}_u{H}...``,
``grad_stats_lowrank_r{R}[_{hash of the projections' globs}]...``), collected on the checkpoint's
training split when missing. Statistics of another kind (full-weight ones for a low-rank run, another
rank, other projections) are refused.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from fastweights.errors import UserError

DEFAULT_STATS_BATCHES = 500
LOWRANK_SEED = 0  # the fixed random factors B of --lowrank-rank (LowRankDynamicEvaluator's default seed)


# ----------------------------------------------------------------------------- loading


def load_model_and_tokenizer(args):
    """(model, tokenizer, run_config or None, checkpoint dir or None) from --checkpoint or --hf."""
    from fastweights.distributed import resolve_device

    device = str(resolve_device(getattr(args, "device", "auto")))
    if getattr(args, "hf", None):
        from fastweights.hf.transformers_as_ours import load_hf_model

        sinks = getattr(args, "sinks", None)
        model, tok = load_hf_model(args.hf, device=device, **({} if sinks is None else {"sinks": sinks}))
        return model, tok, None, None
    if getattr(args, "sinks", None) is not None:
        raise UserError("--sinks applies to Hugging Face models (--hf); a checkpoint's context is its seq_len window")
    from fastweights.checkpoint import load_checkpoint

    model, tok, cfg = load_checkpoint(Path(args.checkpoint), map_location=device)
    return model, tok, cfg, Path(args.checkpoint)


def load_texts(args, cfg, split: str, max_chars: int = 0) -> list[str]:
    """--data (all of it) or the checkpoint corpus' ``split``; the first ``max_chars`` characters."""
    from fastweights.data import load_corpus, split_corpus

    if getattr(args, "data", None):
        docs = load_corpus(args.data, text_field=cfg.data.text_field if cfg else "text")
        texts = [d.text for d in docs]
    elif cfg is not None:
        docs = load_corpus(cfg.data.corpus, text_field=cfg.data.text_field)
        texts = [d.text for d in split_corpus(docs, cfg.data.split, cfg.data.val_fraction, cfg.data.test_fraction)[split]]
    else:
        raise UserError("--data is required with --hf")
    if max_chars and max_chars > 0:
        out, left = [], max_chars
        for t in texts:
            if left <= 0:
                break
            out.append(t[:left])
            left -= len(out[-1])
        texts = out
    texts = [t for t in texts if t]
    if not texts:
        raise UserError("the text to score is empty")
    return texts


def encode_texts(tokenizer, texts: list[str], bos: bool = False) -> tuple[list[torch.Tensor], int]:
    """Token tensors and the number of scored characters (the first token is context unless ``bos``)."""
    docs, chars = [], 0
    bos_id = getattr(tokenizer, "bos_id", None)
    if bos and bos_id is None:
        raise UserError("--bos: this tokenizer has no BOS token")
    for t in texts:
        ids = torch.as_tensor(tokenizer.encode(t), dtype=torch.long)
        if bos:
            ids = torch.cat([torch.tensor([bos_id]), ids])
            chars += len(t)
        elif len(ids) >= 2:
            chars += len(t) - len(tokenizer.decode(ids[:1].tolist()))
        if len(ids) >= 2:
            docs.append(ids)
    if not docs:
        raise UserError("nothing to score: every document has fewer than two tokens")
    return docs, chars


def default_segment_len(tokenizer) -> int:
    from fastweights.adapt.update_rules import DEFAULT_SEGMENT_LEN

    # the paper's segments: 20 characters, 5 words (Krause et al. 2018); subword (GPT-2) models: 128 tokens,
    # as Transformer dynamic evaluation used
    name = getattr(tokenizer, "name", "")
    return DEFAULT_SEGMENT_LEN if name in ("char", "byte") else 5 if name == "word" else 128


def default_context(model, cfg) -> int | None:
    if cfg is not None:
        return cfg.train.seq_len
    return getattr(model, "default_context", None)


# ----------------------------------------------------------------------------- what is adapted, its statistics


def adaptation_spec(args, model) -> tuple | None:
    """What is adapted instead of the full weights: ``("sparse", layer, units)``, ``("lowrank", rank,
    modules)`` (modules: the comma-joined globs) or None (the weights --params / --exclude-params select)."""
    units = getattr(args, "sparse_units", 0) or 0
    rank = getattr(args, "lowrank_rank", 0) or 0
    modules = getattr(args, "lowrank_params", None)
    if modules and rank <= 0:
        raise UserError("--lowrank-params needs --lowrank-rank N (N >= 1)")
    if rank > 0:
        if units > 0:
            raise UserError("--lowrank-rank and --sparse-units exclude each other: adapt low-rank MLP deltas or "
                            "one sparse matrix, not both")
        if getattr(args, "params", None) or getattr(args, "exclude_params", None):
            raise UserError("--params / --exclude-params select full weights; with --lowrank-rank choose the "
                            "adapted projections with --lowrank-params GLOBS")
        from fastweights.adapt.lowrank import DEFAULT_MODULES
        from fastweights.adapt.update_rules import _patterns

        return "lowrank", rank, ",".join(_patterns(modules) or [DEFAULT_MODULES])
    if units <= 0:
        return None
    from fastweights.adapt.sparse import decoder_layers

    n = len(decoder_layers(model))
    layer = getattr(args, "sparse_layer", None)
    layer = n // 2 if layer is None else layer
    if not -n <= layer < n:
        raise UserError(f"--sparse-layer {layer} out of range for {n} blocks")
    return "sparse", layer % n, units


def _stats_path(args, ckpt: Path | None, spec: tuple | None) -> Path | None:
    if getattr(args, "stats", None):
        return Path(args.stats)
    if ckpt is None:
        return None
    if spec is None:
        from fastweights.adapt.update_rules import GRAD_STATS_FILE

        return ckpt / GRAD_STATS_FILE
    if spec[0] == "sparse":
        return ckpt / f"grad_stats_sparse_l{spec[1]}_u{spec[2]}.safetensors"
    from fastweights.adapt.lowrank import DEFAULT_MODULES

    tag = "" if spec[2] == DEFAULT_MODULES else "_" + hashlib.sha256(spec[2].encode()).hexdigest()[:8]
    return ckpt / f"grad_stats_lowrank_r{spec[1]}{tag}.safetensors"


def _stats_kind(extra: dict) -> tuple | None:
    """The adaptation a statistics file was collected for (its ``GradStats.extra``), as :func:`adaptation_spec`
    gives it (low-rank: with the seed of the fixed factors appended)."""
    if "lowrank_rank" in extra:
        return "lowrank", extra["lowrank_rank"], extra.get("lowrank_modules"), extra.get("lowrank_seed", 0)
    if "sparse_layer" in extra:
        return "sparse", extra["sparse_layer"], len(extra.get("sparse_units") or [])
    return None


def _describe_kind(kind: tuple | None) -> str:
    if kind is None:
        return "full-weight statistics"
    if kind[0] == "sparse":
        return f"sparse statistics (layer {kind[1]}, {kind[2]} units)"
    return f"low-rank statistics (rank {kind[1]}, projections {kind[2]!r}, seed {kind[3]})"


def _check_stats_kind(stats, path: Path, spec: tuple | None) -> None:
    want = spec + (LOWRANK_SEED,) if spec is not None and spec[0] == "lowrank" else spec
    have = _stats_kind(stats.extra)
    if have == want:
        return
    flags = ("" if spec is None else f" --sparse-units {spec[2]} --sparse-layer {spec[1]}" if spec[0] == "sparse"
             else f" --lowrank-rank {spec[1]} --lowrank-params '{spec[2]}'")
    raise UserError(f"gradient statistics {path} are {_describe_kind(have)}; this run needs {_describe_kind(want)}: "
                    f"collect them with `fastweights collect-grad-stats ...{flags}`")


def _weights_fingerprint(ckpt: Path | None) -> str | None:
    from fastweights.checkpoint_format import weights_fingerprint

    return weights_fingerprint(ckpt) if ckpt is not None else None


def _collect_stats(model, tokenizer, cfg, args, segment_len, context, spec, path: Path | None, progress: bool,
                   ckpt: Path | None = None):
    """Collect MS_g (of what ``spec`` adapts) on the checkpoint's (or --data's) training text; save it to ``path``."""
    from fastweights.adapt.update_rules import collect_grad_stats
    from fastweights.adapt.lowrank import collect_lowrank_grad_stats
    from fastweights.adapt.sparse import collect_sparse_grad_stats

    texts = load_texts(SimpleNamespace(data=getattr(args, "train_data", None)), cfg, "train")
    ids = torch.cat([torch.as_tensor(tokenizer.encode(t), dtype=torch.long) for t in texts])
    common = dict(batch_size=getattr(args, "batch_size", 100), seq_len=getattr(args, "stats_seq_len", 0) or segment_len,
                  max_batches=getattr(args, "max_batches", DEFAULT_STATS_BATCHES) or None, context=context,
                  progress=progress)
    if spec is None:
        stats = collect_grad_stats(model, ids, include=getattr(args, "params", None),
                                   exclude=getattr(args, "exclude_params", None), **common)
    elif spec[0] == "sparse":
        stats = collect_sparse_grad_stats(model, ids, spec[1], spec[2], **common)
    else:
        stats = collect_lowrank_grad_stats(model, ids, spec[2], spec[1], seed=LOWRANK_SEED, **common)
    fingerprint = _weights_fingerprint(ckpt)
    if fingerprint is not None:
        stats.extra["weights_sha256"] = fingerprint
    if path is not None:
        stats.save(path)
    return stats


# ----------------------------------------------------------------------------- the evaluator


def _schedule_name(spec: str | None) -> str | None:
    """The evaluator's name for a schedule spec (as its metadata records it), None for constant."""
    from fastweights.adapt.update_rules import parse_schedule

    kind, span = parse_schedule(spec)
    return None if kind == "constant" else f"{kind}:{span:g}"


def _tuned_values(args, ckpt, rule: str, segment_len: int, spec: tuple | None) -> tuple[dict, str]:
    """lr and decay from the tuned file ``--tuned`` names (refused when tuned for another setting), else the defaults."""
    from fastweights.adapt.update_rules import DEFAULT_DECAY, DEFAULT_LR
    from fastweights.adapt.tune import TUNED_FILE, load_tuned
    from fastweights.checkpoint_format import check_derived_file

    # a tuned file is used only when named (--tuned): one left in a checkpoint never changes a run silently
    tuned_path = getattr(args, "tuned", None)
    if not tuned_path:
        if ckpt is not None and (ckpt / TUNED_FILE).is_file():
            print(f"note: {ckpt / TUNED_FILE} is not used unless named with --tuned", file=sys.stderr)
        return ({"lr": DEFAULT_LR, "decay": DEFAULT_DECAY},
                "default of dynamiceval.py (untuned: tune-dynamic --save FILE, then --tuned FILE)")
    tuned = load_tuned(tuned_path)
    if tuned is None:
        raise UserError(f"--tuned {tuned_path}: no such file")
    check_derived_file(tuned.get("weights_sha256"), ckpt, Path(tuned_path),
                       f"tune again with `fastweights tune-dynamic --checkpoint {ckpt} --save FILE`")
    settings = tuned["settings"]
    want = {"rule": rule, "segment_len": segment_len,
            "sparse_units": spec[2] if spec is not None and spec[0] == "sparse" else None,
            "lowrank_rank": spec[1] if spec is not None and spec[0] == "lowrank" else None,
            "lr_schedule": _schedule_name(getattr(args, "lr_schedule", None)) or "constant"}
    have = {"rule": tuned.get("rule"), **{k: settings.get(k) for k in want if k != "rule"}}
    have["lr_schedule"] = have["lr_schedule"] or "constant"  # the metadata leaves the constant schedule out
    diff = [f"{k} {have[k]} (this run: {want[k]})" for k in want if have[k] != want[k]]
    if diff:
        raise UserError(f"--tuned {tuned_path} was tuned for another setting: {', '.join(diff)}")
    return {"lr": tuned["best"]["lr"], "decay": tuned["best"]["decay"]}, f"tuned file {tuned_path}"


def _grad_stats(args, model, tokenizer, cfg, ckpt, rule, segment_len, context, spec, progress):
    """The RMS rules' statistics for what ``spec`` adapts: loaded (and checked), or collected for a checkpoint."""
    from fastweights.adapt.update_rules import GradStats
    from fastweights.checkpoint_format import check_derived_file

    path = _stats_path(args, ckpt, spec)
    if path is not None and path.is_file():
        stats = GradStats.load(path)
        check_derived_file(stats.extra.get("weights_sha256"), ckpt, path,
                           f"collect them again with `fastweights collect-grad-stats --checkpoint {ckpt}`")
        _check_stats_kind(stats, path, spec)
        return stats
    if getattr(args, "stats", None):
        raise UserError(f"gradient statistics {args.stats} not found")
    if cfg is not None:
        print(f"collecting gradient statistics on the training split -> {path}", file=sys.stderr)
        return _collect_stats(model, tokenizer, cfg, args, segment_len, context, spec, path, progress, ckpt)
    raise UserError(f"rule {rule} needs gradient statistics: run `fastweights collect-grad-stats --hf ... "
                    "--data TEXT --out FILE` (any generic text of the language will do, e.g. --data novels) "
                    "and pass --stats FILE, or use --rule sgd")


def build_evaluator(args, model, tokenizer, cfg, ckpt: Path | None, lr: float | None = None,
                    decay: float | None = None, progress: bool = False):
    """A DynamicEvaluator (Sparse-, LowRank-) from parsed arguments; returns (evaluator, info).

    Reads (all optional) dynamic or rule, lr, decay, tuned, eps, segment_len, seq_len, stats, params,
    exclude_params, sparse_units, sparse_layer, lowrank_rank, lowrank_params, lr_schedule, checkpoint."""
    from fastweights.adapt.dynamic import DynamicEvaluator
    from fastweights.adapt.update_rules import DEFAULT_EPS, PRIOR_RULES, canonical_rule
    from fastweights.adapt.lowrank import LowRankDynamicEvaluator
    from fastweights.adapt.sparse import SparseDynamicEvaluator

    rule = canonical_rule(getattr(args, "dynamic", None) or getattr(args, "rule", None) or "rms-global-prior")
    schedule = getattr(args, "lr_schedule", None)
    _schedule_name(schedule)  # a bad spec fails before any work
    segment_len = getattr(args, "segment_len", 0) or default_segment_len(tokenizer)
    context = getattr(args, "seq_len", 0) or default_context(model, cfg)
    spec = adaptation_spec(args, model)
    lr = lr if lr is not None else getattr(args, "lr", None)
    decay = decay if decay is not None else getattr(args, "decay", None)
    sources = {"lr": "command line" if lr is not None else None, "decay": "command line" if decay is not None else None}
    if lr is None or decay is None:
        fallback, where = _tuned_values(args, ckpt, rule, segment_len, spec)
        if lr is None:
            lr, sources["lr"] = fallback["lr"], where
        if decay is None:
            decay, sources["decay"] = fallback["decay"], where
    info = {"lr_source": sources["lr"], **({"decay_source": sources["decay"]} if rule in PRIOR_RULES else {})}
    stats = None
    if rule.startswith("rms"):
        stats = _grad_stats(args, model, tokenizer, cfg, ckpt, rule, segment_len, context, spec, progress)
    eps = getattr(args, "eps", None)
    kw = dict(rule=rule, lr=lr, decay=decay, eps=DEFAULT_EPS if eps is None else eps, segment_len=segment_len,
              context=context, grad_stats=stats, lr_schedule=schedule)
    if spec is None:
        ev = DynamicEvaluator(model, include=getattr(args, "params", None),
                              exclude=getattr(args, "exclude_params", None), **kw)
    elif spec[0] == "sparse":
        ev = SparseDynamicEvaluator(model, layer=spec[1], units=spec[2], **kw)
    else:
        ev = LowRankDynamicEvaluator(model, rank=spec[1], modules=spec[2], seed=LOWRANK_SEED, **kw)
    return ev, info


def evaluator_like(ev, lr: float, decay: float):
    """An evaluator like ``ev`` (same kind, adapted tensors, rule, schedule, statistics) with another lr and decay."""
    from fastweights.adapt.lowrank import LowRankDynamicEvaluator
    from fastweights.adapt.sparse import SparseDynamicEvaluator

    kw = dict(model=ev.model, rule=ev.rule, lr=lr, decay=decay, eps=ev.update_rule.eps, segment_len=ev.segment_len,
              context=ev.context, grad_stats=ev.grad_stats, lr_schedule=ev.lr_schedule)
    if isinstance(ev, SparseDynamicEvaluator):
        kw.update(layer=ev.adaptation.layer, units=ev.adaptation.index.tolist())
    elif isinstance(ev, LowRankDynamicEvaluator):
        m = ev.metadata()
        kw.update(modules=m["lowrank_modules"], rank=m["lowrank_rank"], seed=m["lowrank_seed"])
    else:
        names = set(ev.names)
        kw["include"] = lambda name, p: name in names
    return type(ev)(**kw)
