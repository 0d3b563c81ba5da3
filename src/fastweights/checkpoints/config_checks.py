"""Validation of settings: every config field (ranges, divisibility, positive counts, mechanism names
and the keys of every options table); the command line's number types are in :mod:`fastweights.cli.types`
(the size estimate is in :mod:`fastweights.models.size`).

Everything here raises :class:`~fastweights.core.errors.UserError` with a message that names the
setting, so the command line prints one line and exits with status 2 before any file is written.
"""

from __future__ import annotations

import math

from fastweights.core.errors import UserError


def _need(ok: bool, key: str, value, rule: str) -> None:
    if not ok:
        raise UserError(f"{key}={value!r}: {rule}")


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def validate_mechanism_options(m) -> None:
    """Every ``[model.options.NAME]`` table: NAME must be a registered mixer, head or memory, and its keys
    and types must fit that mechanism's options dataclass, whether the model uses it or not (the value
    checks of a mechanism the model builds run when it is built)."""
    from fastweights import components as registry

    if not isinstance(m.options, dict):
        raise UserError(f"model.options={m.options!r}: must be a table of [model.options.NAME] tables")
    registry.load_providers()
    tables = (registry.MIXERS, registry.HEADS, registry.MEMORIES)
    known = sorted({name for table in tables for name in table})
    for name, raw in m.options.items():
        entries = [table[name] for table in tables if name in table]
        if not entries:
            raise UserError(f"model.options.{name}: unknown mechanism {name!r}; options are for one of "
                            f"{', '.join(known)}")
        if not isinstance(raw, dict):
            raise UserError(f"model.options.{name}={raw!r}: must be a table of options "
                            f"(e.g. model.options.{name}.KEY=VALUE)")
        for entry in entries:
            registry.build_options(entry, raw)  # unknown keys and wrong types fail, naming the key
        for key, value in raw.items():  # a NaN step size or decay would train into NaN, blamed on train.lr
            if isinstance(value, float) and not math.isfinite(value):  # (no option takes a list)
                raise UserError(f"model.options.{name}.{key}={value!r}: must be a finite number")


def used_mechanisms(m) -> set[str]:
    """The names of the mixers, head and memory the model of ``m`` builds."""
    used = set(m.layer_mixers or [m.mixer])
    if m.head != "linear":
        used.add(m.head)
    if m.memory and m.memory_layers:
        used.add(m.memory)
    return used


def inert_settings(m) -> list[str]:
    """Settings of ``m`` that are legal but change nothing, each as a sentence: an options table of a mechanism
    the model does not build, and options that a mechanism ignores in its configuration (its class's
    ``inert_options(options)``, e.g. the FWL head's ``test_time_step_size`` without ``test_time_only``)."""
    from fastweights import components as registry

    if not isinstance(m.options, dict):
        return []
    registry.load_providers()
    used = used_mechanisms(m)
    out = []
    for name in sorted(m.options):
        if name not in used:
            out.append(f"model.options.{name} is set but the model builds no {name} (model.mixer={m.mixer!r}, "
                       f"model.head={m.head!r}, model.memory={m.memory!r} at layers {list(m.memory_layers)}): "
                       "these options do nothing")
    for table in (registry.MIXERS, registry.HEADS, registry.MEMORIES):
        for name in sorted(used & set(table)):
            inert = getattr(table[name].cls, "inert_options", None)
            if inert is not None and isinstance(m.options.get(name, {}), dict):
                out += inert(registry.build_options(table[name], m.options.get(name)))
    return out


def validate_model_config(m, need_vocab: bool = False, check_options: bool = True) -> None:
    _need(m.vocab_size >= (1 if need_vocab else 0), "model.vocab_size", m.vocab_size,
          "must be a positive number of symbols" if need_vocab else "must be >= 0 (0: taken from the tokenizer)")
    _need(m.d_model >= 1, "model.d_model", m.d_model, "must be >= 1")
    _need(m.n_layers >= 1, "model.n_layers", m.n_layers, "must be >= 1")
    _need(m.n_heads >= 1, "model.n_heads", m.n_heads, "must be >= 1")
    _need(m.mlp_hidden >= 0, "model.mlp_hidden", m.mlp_hidden, "must be >= 0 (0: 8/3 d_model)")
    _need(_finite(m.dropout) and 0 <= m.dropout < 1, "model.dropout", m.dropout, "must be in [0, 1)")
    _need(_finite(m.init_std) and m.init_std > 0, "model.init_std", m.init_std, "must be a positive number")
    _need(m.short_conv == 0 or m.short_conv >= 2, "model.short_conv", m.short_conv, "must be 0 (none) or >= 2")
    if m.layer_mixers:
        _need(len(m.layer_mixers) == m.n_layers, "model.layer_mixers", m.layer_mixers,
              f"needs one entry per layer (model.n_layers = {m.n_layers})")
    bad = [i for i in m.memory_layers if not 0 <= i < m.n_layers]
    _need(not bad, "model.memory_layers", m.memory_layers, f"must be layer indices in [0, {m.n_layers})")
    from fastweights import components as registry

    def lookup(table, kind: str, key: str, name: str, extra: tuple = ()):
        registry.load_providers()
        if name not in table:
            raise UserError(f"{key}={name!r}: unknown {kind} {name!r}; available: {', '.join([*extra, *sorted(table)])}")
        return table[name]

    if m.memory:  # a memory placed at no layer is still a name that must exist
        lookup(registry.MEMORIES, "memory", "model.memory", m.memory)
    if m.head != "linear":
        lookup(registry.HEADS, "head", "model.head", m.head, extra=("linear",))
    if check_options:
        validate_mechanism_options(m)
    for mixer in sorted(set(m.layer_mixers or [m.mixer])):
        entry = lookup(registry.MIXERS, "mixer", "model.layer_mixers" if m.layer_mixers else "model.mixer", mixer)
        opts = m.options.get(mixer, {}) if isinstance(m.options, dict) else {}
        fields = getattr(entry.options_cls, "__dataclass_fields__", {})
        if "head_dim" in fields and not opts.get("head_dim"):
            _need(m.d_model % m.n_heads == 0, "model.n_heads", m.n_heads,
                  f"must divide model.d_model={m.d_model} ({mixer} heads have d_model / n_heads dimensions; "
                  f"or set model.options.{mixer}.head_dim)")
        if "head_dim" in fields and isinstance(opts.get("head_dim"), int):
            _need(opts["head_dim"] >= 0, f"model.options.{mixer}.head_dim", opts["head_dim"], "must be >= 0")


def validate_data_config(d) -> None:
    from fastweights.data.tokenizers import TOKENIZER_KINDS

    _need(d.tokenizer in TOKENIZER_KINDS, "data.tokenizer", d.tokenizer, f"must be one of {', '.join(TOKENIZER_KINDS)}")
    _need(d.split in ("span", "document"), "data.split", d.split, "must be span or document")
    for key in ("val_fraction", "test_fraction"):
        v = getattr(d, key)
        _need(_finite(v) and 0 < v < 1, f"data.{key}", v, "must be in (0, 1)")
    _need(d.val_fraction + d.test_fraction < 1, "data.val_fraction", d.val_fraction,
          f"plus data.test_fraction={d.test_fraction} must leave something to train on (sum < 1)")
    _need(bool(d.corpus), "data.corpus", d.corpus, "must name a corpus")
    _need(bool(d.text_field), "data.text_field", d.text_field, "must not be empty")


def validate_train_config(t, starting: bool = True) -> None:
    for key in ("seq_len", "batch_size", "grad_accum", "max_steps", "log_every", "eval_tokens"):
        _need(getattr(t, key) >= 1, f"train.{key}", getattr(t, key), "must be >= 1")
    if starting:
        _need(t.eval_tokens >= t.seq_len, "train.eval_tokens", t.eval_tokens,
              f"must be >= train.seq_len={t.seq_len} (validation scores whole windows of seq_len tokens; "
              "fewer would score none)")
    for key in ("warmup_steps", "eval_every", "save_every", "threads"):
        _need(getattr(t, key) >= 0, f"train.{key}", getattr(t, key), "must be >= 0")
    _need(_finite(t.lr) and t.lr > 0, "train.lr", t.lr, "must be a positive number")
    _need(_finite(t.min_lr_ratio) and 0 <= t.min_lr_ratio <= 1, "train.min_lr_ratio", t.min_lr_ratio, "must be in [0, 1]")
    _need(_finite(t.weight_decay) and t.weight_decay >= 0, "train.weight_decay", t.weight_decay, "must be >= 0")
    for key in ("beta1", "beta2"):
        _need(_finite(getattr(t, key)) and 0 <= getattr(t, key) < 1, f"train.{key}", getattr(t, key), "must be in [0, 1)")
    _need(_finite(t.grad_clip) and t.grad_clip >= 0, "train.grad_clip", t.grad_clip, "must be >= 0 (0: no clipping)")
    _need(_finite(t.max_minutes) and t.max_minutes >= 0, "train.max_minutes", t.max_minutes, "must be >= 0 (0: no budget)")
    _need(0 <= t.seed < 2**32, "train.seed", t.seed, "must be in [0, 2**32)")
    _need(t.budget_clock in ("wall", "cpu"), "train.budget_clock", t.budget_clock, "must be wall or cpu")
    _need(t.log in ("jsonl", "tensorboard"), "train.log", t.log, "must be jsonl or tensorboard")
    if t.device != "auto":
        import torch

        try:
            torch.device(t.device)
        except (RuntimeError, ValueError):
            _need(False, "train.device", t.device, "must be auto, cpu, cuda or cuda:N")
    _need(not (t.carry_state and t.grad_accum != 1), "train.grad_accum", t.grad_accum,
          "train.carry_state needs train.grad_accum = 1 (one contiguous window per lane per step)")
    _need(0.0 <= t.carry_reset <= 1.0, "train.carry_reset", t.carry_reset, "must be a probability in [0, 1]")
    _need(t.carry_reset == 0.0 or t.carry_state, "train.carry_reset", t.carry_reset,
          "only applies with train.carry_state = true (there is no carried state to drop)")


def validate_config(cfg, need_vocab: bool = False, saved: bool = False, warn: bool = True) -> None:
    """Check every field of a RunConfig (``fastweights.models.size.meta_model`` then checks the values of the
    options of the mechanisms the model uses by building it on the meta device).

    ``saved``: the config of a checkpoint being read. Rules that only concern starting a run (``train.eval_tokens``
    against ``train.seq_len``) and the options tables of mechanisms the model does not build are then not
    checked, so that checkpoints written by earlier versions keep loading. ``warn``: warn (``UserWarning``, one
    line each on the command line) about settings that are legal but change nothing (:func:`inert_settings`)."""
    validate_model_config(cfg.model, need_vocab, check_options=not saved)
    validate_data_config(cfg.data)
    validate_train_config(cfg.train, starting=not saved)
    if warn and not saved:  # legal settings that do nothing: one warning line each (docs/README.md)
        import warnings

        for sentence in inert_settings(cfg.model):
            warnings.warn(sentence, UserWarning, stacklevel=2)
