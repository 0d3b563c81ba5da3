"""Setting up dynamic evaluation: its texts, gradient statistics, and the evaluator a :class:`DynamicSettings`
describes (the ``fastweights dynamic ...`` commands map their flags to one; the model comes from
:func:`fastweights.auto.sources.load_model_and_tokenizer`).

The setup flows one way. :func:`resolve_setup` resolves a :class:`DynamicSettings` once, in one pass, into a
:class:`DynamicSetup` (every value the evaluator needs, nothing left to look up): the rule and the
learning-rate schedule ``lr_schedule`` (checked first), the segment length and context, what is adapted, lr
and decay (given, else from a named tuned file or the checkpoint's own, else the library's defaults of
:mod:`fastweights.adapt.update_rules`), eps, and for the RMS rules gradient statistics of the same kind: the
``stats`` file or the checkpoint's file for that kind (``grad_stats.safetensors``,
``grad_stats_sparse_l{L}_u{H}...``, ``grad_stats_lowrank_r{R}[_{hash of the projections' globs}]...``),
collected on the checkpoint's training split when missing (statistics of another kind, another rank or other
projections are refused). :func:`evaluator_from` then builds a ``DynamicEvaluator`` (full weights,
``params``), a ``SparseDynamicEvaluator`` (``sparse_units``) or a ``LowRankDynamicEvaluator``
(``lowrank_rank``) from that value; :func:`build_evaluator` is the two in a row.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fastweights.adapt.grad_stats import GRAD_STATS_FILE, GradStats, collect_grad_stats
from fastweights.adapt.parameter_selection import glob_patterns
from fastweights.adapt.update_rules import (DEFAULT_DECAY, DEFAULT_EPS, DEFAULT_LR, DEFAULT_RULE, DEFAULT_SEGMENT_LEN,
                                           DEFAULT_STATS_BATCH_SIZE, DEFAULT_STATS_BATCHES, PRIOR_RULES, RULES,
                                           SUBWORD_SEGMENT_LEN, WORD_SEGMENT_LEN, canonical_rule, parse_schedule)
from fastweights.core import numbers
from fastweights.core.errors import UserError

LOWRANK_SEED = 0  # the fixed random factors B of --lowrank-rank (LowRankDynamicEvaluator's default seed)


def schedule_spec(text: str) -> str:
    """``text`` when it is a schedule :func:`~fastweights.adapt.update_rules.parse_schedule` reads (the parser of
    ``--lr-schedule``), else ``UserError``."""
    parse_schedule(text)
    return text


def _setting(default, help: str, **metadata):
    """A field of :class:`DynamicSettings`: its default, its help and, for the command line, its parser
    (``type``) and ``metavar`` (``cli.settings.add_settings`` makes the flag of it)."""
    return field(default=default, metadata={"help": help, **metadata})


@dataclass
class DynamicSettings:
    """What dynamic evaluation adapts and how (the flags of ``fastweights dynamic ...`` and ``--dynamic RULE``,
    generated from these fields by ``cli.settings.add_settings``; the harness' model arguments).

    lr / decay None: from the ``tuned`` file when named, else from the checkpoint's own tuned file when it was
    made for these weights and this setting (not with ``no_tuned``), else the library's defaults; segment_len 0:
    :func:`default_segment_len`; context 0: the training seq_len (Hugging Face models: the model's own); stats
    None: the checkpoint's file of the kind adapted, collected on ``stats_data`` (None: the checkpoint's training
    split) in ``stats_batches`` batches of ``stats_batch_size`` x ``stats_seq_len`` (0: segment_len) targets when
    missing. ``sparse_units`` and ``lowrank_rank`` (0: off) adapt one sparse matrix or low-rank deltas instead of
    the weights ``params`` / ``exclude_params`` select."""

    rule: str = _setting(DEFAULT_RULE, f"update rule: {', '.join(RULES)}")
    lr: float | None = _setting(None, "learning rate eta of the updates (default: the checkpoint's tuned file when "
                                      f"one was made for it, else {DEFAULT_LR:g})", type=numbers.nonneg_float)
    decay: float | None = _setting(None, "decay lambda towards the trained weights (prior rules; default: the tuned "
                                         f"file, else {DEFAULT_DECAY:g})", type=numbers.nonneg_float)
    tuned: str | None = _setting(None, "lr and decay from this `dynamic tune --save` file (default: the checkpoint's "
                                       "dynamic_tuned.json when it was tuned for this checkpoint and setting)",
                                 metavar="FILE")
    no_tuned: bool = _setting(False, "do not use the checkpoint's tuned file: the default lr and decay unless given")
    eps: float = _setting(DEFAULT_EPS, "epsilon of the RMS rules", type=numbers.positive_float)
    lr_schedule: str = _setting("constant", "learning rate within the stream: constant, warmup:W (linear ramp over "
                                            "the first W updates) or rsqrt:S (lr / sqrt(1 + i / S) at update i)",
                                type=schedule_spec, metavar="SPEC")
    segment_len: int = _setting(0, f"predictions per update (0: {DEFAULT_SEGMENT_LEN} for char/byte models, "
                                   f"{SUBWORD_SEGMENT_LEN} for subword models)", type=numbers.nonneg_int)
    context: int = _setting(0, "attention context in tokens (0: the training seq_len; Hugging Face models: the "
                               "whole stream up to the model's position limit)", type=numbers.nonneg_int)
    stats: str | None = _setting(None, "gradient statistics file (default: grad_stats*.safetensors in the "
                                       "checkpoint, collected on its training split when missing)")
    params: str | None = _setting(None, "adapt only parameters matching these globs, comma-separated, e.g. "
                                        "'blocks.3.*' (default: every parameter)")
    exclude_params: str | None = _setting(None, "do not adapt parameters matching these globs, e.g. 'embed.*' "
                                                "(default: none excluded)")
    sparse_units: int = _setting(0, "sparse dynamic evaluation: adapt an HxH matrix on the first H units of one "
                                    "block's output (0: off)", type=numbers.nonneg_int)
    sparse_layer: int | None = _setting(None, "block for sparse adaptation (default: the middle one)", type=int)
    lowrank_rank: int = _setting(0, "low-rank dynamic evaluation: adapt rank-N deltas W + A B of the projections "
                                    "--lowrank-params selects (A from zero, B fixed random; 0: off)",
                                 type=numbers.nonneg_int)
    lowrank_params: str | None = _setting(None, "module globs of the low-rank projections, comma-separated "
                                                "(default: '*mlp.*', the MLPs)", metavar="GLOBS")
    stats_data: str | None = _setting(None, "text the missing gradient statistics are collected on (default: the "
                                            "checkpoint's training split)")
    stats_batch_size: int = _setting(DEFAULT_STATS_BATCH_SIZE, "streams per batch of the gradient statistics",
                                     type=numbers.positive_int)
    stats_batches: int = _setting(DEFAULT_STATS_BATCHES, "batches the gradient statistics average (0: the whole "
                                                         "text)", type=numbers.nonneg_int)
    stats_seq_len: int = _setting(0, "targets per stream and batch of the gradient statistics (0: segment_len)",
                                  type=numbers.nonneg_int)


def dynamic_presets() -> list[str]:
    """The names of the shipped dynamic-evaluation settings (``configs/dynamic/NAME.toml`` in the package)."""
    return sorted(p.stem for p in _presets_dir().glob("*.toml"))


def dynamic_preset(name: str) -> dict:
    """The fields of :class:`DynamicSettings` a shipped setting names (``configs/dynamic/NAME.toml``), each checked
    by its field's parser: the defaults ``--preset NAME`` gives the flags (a flag given on the command line wins),
    the harness' ``preset=NAME``, and the benchmarks'."""
    import dataclasses
    import tomllib

    path = _presets_dir() / f"{name}.toml"
    if not path.is_file():
        raise UserError(f"no dynamic-evaluation preset {name!r}; shipped: {', '.join(dynamic_presets()) or 'none'}")
    values = tomllib.loads(path.read_text())
    known = {f.name: f for f in dataclasses.fields(DynamicSettings)}
    for key, value in values.items():
        if key not in known:
            raise UserError(f"preset {name}: {key} is not a dynamic-evaluation setting ({', '.join(known)})")
        parse = known[key].metadata.get("type", str)
        try:
            if isinstance(value, bool):
                raise UserError(f"got {str(value).lower()}, a boolean")
            if parse(str(value)) != value:  # e.g. a number in quotes: TOML's string, not the setting's type
                raise UserError(f"got {value!r} ({type(value).__name__}); write {key} = {parse(str(value))!r}")
        except (numbers.BadNumber, UserError, ValueError) as e:
            raise UserError(f"preset {name}: {key} = {value!r}: {e}") from None
    return values


def _presets_dir() -> Path:
    from importlib import resources

    return Path(str(resources.files("fastweights") / "configs" / "dynamic"))


# ----------------------------------------------------------------------------- texts


def load_texts(data: str | None, cfg, split: str, max_chars: int = 0) -> list[str]:
    """``data`` (a file, directory or corpus name: all of it) or the checkpoint corpus' ``split``; the first
    ``max_chars`` characters."""
    from fastweights.data import first_chars, load_corpus, split_corpus

    if data:
        docs = load_corpus(data, text_field=cfg.data.text_field if cfg else "text")
        texts = [d.text for d in docs]
    elif cfg is not None:
        docs = load_corpus(cfg.data.corpus, text_field=cfg.data.text_field)
        texts = [d.text for d in split_corpus(docs, cfg.data.split, cfg.data.val_fraction, cfg.data.test_fraction)[split]]
    else:
        raise UserError("--data is required with --hf")
    texts = [t for t in first_chars(texts, max_chars) if t]
    if not texts:
        raise UserError("the text to score is empty")
    return texts


def with_bos(tokenizer, ids: torch.Tensor) -> torch.Tensor:
    """``ids`` after the tokenizer's BOS token, so that its first token is scored too (``--bos``)."""
    bos_id = getattr(tokenizer, "bos_id", None)
    if bos_id is None:
        raise UserError("--bos: this tokenizer has no BOS token")
    return torch.cat([torch.tensor([bos_id], dtype=ids.dtype), ids])


def encode_texts(tokenizer, texts: list[str], bos: bool = False) -> tuple[list[torch.Tensor], int]:
    """Token tensors and the number of scored characters (the first token is context unless ``bos``)."""
    docs, chars = [], 0
    for t in texts:
        ids = torch.as_tensor(tokenizer.encode(t), dtype=torch.long)
        if bos:
            ids = with_bos(tokenizer, ids)
            chars += len(t)
        elif len(ids) >= 2:
            chars += len(t) - len(tokenizer.decode(ids[:1].tolist()))
        if len(ids) >= 2:
            docs.append(ids)
    if not docs:
        raise UserError("nothing to score: every document has fewer than two tokens")
    return docs, chars


HF_STATS_CONTEXT = 1024  # the gradient statistics' default KV-cache bound for Hugging Face models (x batch streams)


def stats_context(context: int, model, cfg) -> int:
    """The attention context of gradient statistics: ``context``, else the model's (:func:`default_context`), at
    most :data:`HF_STATS_CONTEXT` for a Hugging Face model (whole-stream caches for each of the batch's streams
    would not fit in memory)."""
    if context:
        return context
    own = default_context(model, cfg)
    return own if cfg is not None else min(own or HF_STATS_CONTEXT, HF_STATS_CONTEXT)


def default_segment_len(tokenizer) -> int:
    """Predictions per update when none is given: ``update_rules.DEFAULT_SEGMENT_LEN`` for char/byte models,
    ``WORD_SEGMENT_LEN`` for word-level ones, ``SUBWORD_SEGMENT_LEN`` for subword ones."""
    name = getattr(tokenizer, "name", "")
    return DEFAULT_SEGMENT_LEN if name in ("char", "byte") else WORD_SEGMENT_LEN if name == "word" else SUBWORD_SEGMENT_LEN


def default_context(model, cfg) -> int | None:
    if cfg is not None:
        return cfg.train.seq_len
    return getattr(model, "default_context", None)


# ----------------------------------------------------------------------------- what is adapted, its statistics


def adaptation_spec(settings: DynamicSettings, model) -> tuple | None:
    """What is adapted instead of the full weights: ``("sparse", layer, units)``, ``("lowrank", rank,
    modules)`` (modules: the comma-joined globs) or None (the weights --params / --exclude-params select)."""
    units = settings.sparse_units or 0
    rank = settings.lowrank_rank or 0
    modules = settings.lowrank_params
    if modules and rank <= 0:
        raise UserError("--lowrank-params needs --lowrank-rank N (N >= 1)")
    if rank > 0:
        if units > 0:
            raise UserError("--lowrank-rank and --sparse-units exclude each other: adapt low-rank MLP deltas or "
                            "one sparse matrix, not both")
        if settings.params or settings.exclude_params:
            raise UserError("--params / --exclude-params select full weights; with --lowrank-rank choose the "
                            "adapted projections with --lowrank-params GLOBS")
        from fastweights.adapt.lowrank import DEFAULT_MODULES

        return "lowrank", rank, ",".join(glob_patterns(modules) or [DEFAULT_MODULES])
    if units <= 0:
        return None
    from fastweights.adapt.sparse import decoder_layers

    n = len(decoder_layers(model))
    layer = settings.sparse_layer
    layer = n // 2 if layer is None else layer
    if not -n <= layer < n:
        raise UserError(f"--sparse-layer {layer} out of range for {n} blocks")
    return "sparse", layer % n, units


def stats_path(stats: str | None, ckpt: Path | None, spec: tuple | None) -> Path | None:
    """The statistics file: ``stats`` when given, else the checkpoint's file for what ``spec`` adapts."""
    if stats:
        return Path(stats)
    if ckpt is None:
        return None
    if spec is None:
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
                    f"collect them with `fastweights dynamic stats ...{flags}`")


def weights_fingerprint(ckpt: Path | None) -> str | None:
    from fastweights.checkpoints.format import weights_fingerprint

    return weights_fingerprint(ckpt) if ckpt is not None else None


def collect_stats(model, tokenizer, cfg, settings: DynamicSettings, segment_len, context, spec, path: Path | None,
                  progress: bool, ckpt: Path | None = None):
    """Collect MS_g (of what ``spec`` adapts) on the checkpoint's (or --data's) training text; save it to ``path``."""
    from fastweights.adapt.lowrank import collect_lowrank_grad_stats
    from fastweights.adapt.sparse import collect_sparse_grad_stats

    texts = load_texts(settings.stats_data, cfg, "train")
    ids = torch.cat([torch.as_tensor(tokenizer.encode(t), dtype=torch.long) for t in texts])
    common = dict(batch_size=settings.stats_batch_size, seq_len=settings.stats_seq_len or segment_len,
                  max_batches=settings.stats_batches or None, context=context, progress=progress)
    if spec is None:
        stats = collect_grad_stats(model, ids, include=settings.params, exclude=settings.exclude_params, **common)
    elif spec[0] == "sparse":
        stats = collect_sparse_grad_stats(model, ids, spec[1], spec[2], **common)
    else:
        stats = collect_lowrank_grad_stats(model, ids, spec[2], spec[1], seed=LOWRANK_SEED, **common)
    fingerprint = weights_fingerprint(ckpt)
    if fingerprint is not None:
        stats.extra["weights_sha256"] = fingerprint
    if path is not None:
        stats.save(path)
    return stats


# ----------------------------------------------------------------------------- the setup, resolved once


@dataclass(frozen=True)
class DynamicSetup:
    """Everything an evaluator is built from, resolved once by :func:`resolve_setup` (no default, file or
    statistic left to look up): the canonical rule; lr, decay and eps; the schedule spec (checked) and its
    name in tuned files and metadata (None: constant); segments and context; what is adapted (``adapted``:
    None for the weights ``params`` / ``exclude_params`` select, ``("sparse", layer, units)`` or
    ``("lowrank", rank, modules)``); the RMS rules' statistics (None for the SGD rules); where lr and decay
    came from."""

    rule: str
    lr: float
    decay: float
    eps: float
    lr_schedule: str
    schedule_name: str | None
    segment_len: int
    context: int | None
    adapted: tuple | None
    params: str | None
    exclude_params: str | None
    stats: GradStats | None
    lr_source: str
    decay_source: str

    def info(self) -> dict:
        """Where lr (and, for the prior rules, decay) came from, as result files record it."""
        return {"lr_source": self.lr_source, **({"decay_source": self.decay_source} if self.rule in PRIOR_RULES else {})}


def _schedule_name(spec: str | None) -> str | None:
    """The evaluator's name for a schedule spec (as its metadata records it), None for constant."""
    kind, span = parse_schedule(spec)
    return None if kind == "constant" else f"{kind}:{span:g}"


def _tuned_mismatch(tuned: dict, rule: str, segment_len: int, schedule_name: str | None, spec: tuple | None) -> list[str]:
    """How the setting a tuned file was tuned for differs from this run's (empty: the same)."""
    saved = tuned["settings"]
    want = {"rule": rule, "segment_len": segment_len,
            "sparse_units": spec[2] if spec is not None and spec[0] == "sparse" else None,
            "lowrank_rank": spec[1] if spec is not None and spec[0] == "lowrank" else None,
            "lr_schedule": schedule_name or "constant"}
    have = {"rule": tuned.get("rule"), **{k: saved.get(k) for k in want if k != "rule"}}
    have["lr_schedule"] = have["lr_schedule"] or "constant"  # the metadata leaves the constant schedule out
    return [f"{k} {have[k]} (this run: {want[k]})" for k in want if have[k] != want[k]]


def _tuned_values(settings: DynamicSettings, ckpt, rule: str, segment_len: int, schedule_name: str | None,
                  spec: tuple | None) -> tuple[dict, str]:
    """lr and decay, and where they came from: the tuned file ``--tuned`` names (refused when made for other
    weights or another setting); else the checkpoint's own tuned file (``dynamic_tuned.json``, written by
    ``make demo`` and ``dynamic tune``) when it records this checkpoint's weights and this setting, unless
    ``no_tuned``; else the library's untuned defaults (``update_rules.DEFAULT_LR`` and ``DEFAULT_DECAY``)."""
    from fastweights.adapt.tune import TUNED_FILE, load_tuned
    from fastweights.checkpoints.format import check_derived_file

    default = ({"lr": DEFAULT_LR, "decay": DEFAULT_DECAY},
               "untuned default; `fastweights dynamic tune --checkpoint DIR` tunes them" if ckpt is not None
               else "untuned default")
    tuned_path = settings.tuned
    if not tuned_path:
        own = ckpt / TUNED_FILE if ckpt is not None else None
        if own is None or not own.is_file() or settings.no_tuned:
            return default
        tuned = load_tuned(own)
        if tuned.get("weights_sha256") != weights_fingerprint(ckpt):  # made for this checkpoint, or not used
            why = ("it does not record which weights it was tuned for" if tuned.get("weights_sha256") is None else
                   "it was tuned for other weights (the model was retrained or replaced)")
            print(f"note: {own} is not used: {why}; tune again with `fastweights dynamic tune --checkpoint {ckpt}`",
                  file=sys.stderr)
            return default
        diff = _tuned_mismatch(tuned, rule, segment_len, schedule_name, spec)
        if diff:
            print(f"note: {own} is not used: it was tuned for another setting: {', '.join(diff)}", file=sys.stderr)
            return default
        return ({"lr": tuned["best"]["lr"], "decay": tuned["best"]["decay"]},
                f"tuned file {own}, made for this checkpoint; --no-tuned ignores it")
    if settings.no_tuned:
        raise UserError("--tuned FILE and --no-tuned exclude each other")
    tuned = load_tuned(tuned_path)
    if tuned is None:
        raise UserError(f"--tuned {tuned_path}: no such file")
    check_derived_file(tuned.get("weights_sha256"), ckpt, Path(tuned_path),
                       f"tune again with `fastweights dynamic tune --checkpoint {ckpt} --save FILE`")
    diff = _tuned_mismatch(tuned, rule, segment_len, schedule_name, spec)
    if diff:
        raise UserError(f"--tuned {tuned_path} was tuned for another setting: {', '.join(diff)}")
    return {"lr": tuned["best"]["lr"], "decay": tuned["best"]["decay"]}, f"tuned file {tuned_path}"


def _grad_stats(settings: DynamicSettings, model, tokenizer, cfg, ckpt, rule, segment_len, context, spec, progress):
    """The RMS rules' statistics for what ``spec`` adapts: loaded (and checked), or collected for a checkpoint."""
    from fastweights.checkpoints.format import check_derived_file

    path = stats_path(settings.stats, ckpt, spec)
    if path is not None and path.is_file():
        stats = GradStats.load(path)
        check_derived_file(stats.extra.get("weights_sha256"), ckpt, path,
                           f"collect them again with `fastweights dynamic stats --checkpoint {ckpt}`")
        _check_stats_kind(stats, path, spec)
        return stats
    if settings.stats:
        raise UserError(f"gradient statistics {settings.stats} not found")
    if cfg is not None:
        print(f"collecting gradient statistics on the training split -> {path}", file=sys.stderr)
        return collect_stats(model, tokenizer, cfg, settings, segment_len, context, spec, path, progress, ckpt)
    raise UserError(f"rule {rule} needs gradient statistics: run `fastweights dynamic stats --hf ... "
                    "--data TEXT --save FILE` (any generic text of the language will do, e.g. --data novels) "
                    "and pass --stats FILE, or use --rule sgd")


def resolve_setup(settings: DynamicSettings, model, tokenizer, cfg, ckpt: Path | None, lr: float | None = None,
                  decay: float | None = None, progress: bool = False) -> DynamicSetup:
    """``settings`` resolved once into a :class:`DynamicSetup`, in this order: the rule and the schedule
    (checked before any work), segments and context, what is adapted, lr and decay (``lr`` / ``decay`` given
    here take precedence over the settings'; then a tuned file; then the defaults), eps, and the RMS rules'
    statistics (loaded, or collected for a checkpoint: the one step that costs time)."""
    rule = canonical_rule(settings.rule or DEFAULT_RULE)
    schedule = settings.lr_schedule or "constant"
    schedule_name = _schedule_name(schedule)  # a bad spec fails before any work
    segment_len = settings.segment_len or default_segment_len(tokenizer)
    context = settings.context or default_context(model, cfg)
    spec = adaptation_spec(settings, model)
    lr = lr if lr is not None else settings.lr
    decay = decay if decay is not None else settings.decay
    lr_source = "command line" if lr is not None else None
    decay_source = "command line" if decay is not None else None
    if lr is None or decay is None:
        fallback, where = _tuned_values(settings, ckpt, rule, segment_len, schedule_name, spec)
        if lr is None:
            lr, lr_source = fallback["lr"], where
        if decay is None:
            decay, decay_source = fallback["decay"], where
    stats = None
    if rule.startswith("rms"):
        stats = _grad_stats(settings, model, tokenizer, cfg, ckpt, rule, segment_len, context, spec, progress)
    return DynamicSetup(rule=rule, lr=lr, decay=decay, eps=settings.eps,
                        lr_schedule=schedule, schedule_name=schedule_name, segment_len=segment_len, context=context,
                        adapted=spec, params=settings.params, exclude_params=settings.exclude_params, stats=stats,
                        lr_source=lr_source, decay_source=decay_source)


def evaluator_from(setup: DynamicSetup, model):
    """The DynamicEvaluator (Sparse-, LowRank-) of a resolved :class:`DynamicSetup`, in one step."""
    from fastweights.adapt.dynamic import DynamicEvaluator
    from fastweights.adapt.lowrank import LowRankDynamicEvaluator
    from fastweights.adapt.sparse import SparseDynamicEvaluator

    kw = dict(rule=setup.rule, lr=setup.lr, decay=setup.decay, eps=setup.eps, segment_len=setup.segment_len,
              context=setup.context, grad_stats=setup.stats, lr_schedule=setup.lr_schedule)
    spec = setup.adapted
    if spec is None:
        return DynamicEvaluator(model, include=setup.params, exclude=setup.exclude_params, **kw)
    if spec[0] == "sparse":
        return SparseDynamicEvaluator(model, layer=spec[1], units=spec[2], **kw)
    return LowRankDynamicEvaluator(model, rank=spec[1], modules=spec[2], seed=LOWRANK_SEED, **kw)


def build_evaluator(settings: DynamicSettings, model, tokenizer, cfg, ckpt: Path | None, lr: float | None = None,
                    decay: float | None = None, progress: bool = False):
    """The DynamicEvaluator (Sparse-, LowRank-) ``settings`` describe: :func:`resolve_setup`, then
    :func:`evaluator_from`. Returns (evaluator, info: where lr and decay came from). ``lr`` / ``decay`` given
    here take precedence over the settings'."""
    setup = resolve_setup(settings, model, tokenizer, cfg, ckpt, lr=lr, decay=decay, progress=progress)
    return evaluator_from(setup, model), setup.info()
