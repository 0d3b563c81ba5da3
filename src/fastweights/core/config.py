"""Typed configuration: dataclasses, TOML presets and ``--set section.key=value`` overrides.

A run is described by a :class:`RunConfig` with three sections, ``model``, ``data`` and ``train``.
Presets are TOML files in ``configs/`` (shipped inside the package as well); any field can be
overridden from the command line::

    fastweights train --preset tiny --set train.max_steps=50 --set model.d_model=64

Unknown keys and values of the wrong type raise :class:`~fastweights.core.errors.UserError` naming the
offending key.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from fastweights.core.errors import UserError



def setting_field(default, help: str, **rules):
    """A field of a workflow's settings dataclass with its default and help, written once: the command line's
    flags are generated from such fields (``fastweights.cli.settings``). ``rules``: ``type`` (a parser of the
    text, e.g. ``fastweights.core.numbers.positive_int``) and ``choices``."""
    return field(default=default, metadata={"help": help, **rules})

@dataclass
class ModelConfig:
    vocab_size: int = 0  # filled from the tokenizer when 0
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_hidden: int = 0  # SwiGLU hidden width; 0 -> 8/3 * d_model rounded up to a multiple of 32
    mixer: str = "attention"  # default mixer of every layer
    layer_mixers: list[str] = field(default_factory=list)  # per-layer override, e.g. ["attention", "fwp"]
    tie_embeddings: bool = True
    dropout: float = 0.0
    head: str = "linear"  # output head: "linear" or a registered head such as "fwl"
    memory: str = ""  # block memory (e.g. "pkm", "fwpkm", "fwmlp") at the layers in memory_layers
    memory_layers: list[int] = field(default_factory=list)
    short_conv: int = 0  # width of a residual causal convolution at the start of every block (0: none)
    init_std: float = 0.02
    options: dict[str, dict] = field(default_factory=dict)  # [model.options.<mechanism>] tables

    def mixer_of(self, layer: int) -> str:
        return self.layer_mixers[layer] if self.layer_mixers else self.mixer


@dataclass
class DataConfig:
    corpus: str = "tinyshakespeare"  # registered corpus name, a file, or a directory
    tokenizer: str = "char"  # char | byte | word | gpt2
    split: str = "span"  # span (contiguous 90/5/5 of the stream) | document
    val_fraction: float = 0.05
    test_fraction: float = 0.05
    text_field: str = "text"  # for JSONL corpora


@dataclass
class TrainConfig:
    seq_len: int = 128
    batch_size: int = 32
    grad_accum: int = 1
    carry_state: bool = False  # truncated BPTT: rows read contiguous lanes, the model state carried (detached)
    carry_reset: float = 0.0  # with carry_state: probability that a step drops the carried state (every lane starts fresh)
    max_steps: int = 1000
    max_minutes: float = 0.0  # time budget of the steps, final validation and save included (loops/schedule.py); 0 = none
    budget_clock: str = "wall"  # wall | cpu (this process's CPU time: fair for 1-thread runs on a shared machine)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    eval_every: int = 200
    eval_tokens: int = 32768
    log_every: int = 10
    save_every: int = 0  # 0 = only at the end (and at each eval)
    seed: int = 1337
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    compile: bool = False
    threads: int = 0  # torch intra-op threads; 0 = the cores idle when the run starts (core/threads.py)
    log: str = "jsonl"  # jsonl (always written) | tensorboard (also writes TensorBoard events)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        return from_dict(cls, d)


# ----------------------------------------------------------------------------- typed conversion


def _check_value(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        for arg in typing.get_args(tp):
            if arg is type(None) and value is None:
                return None
            try:
                return _check_value(arg, value, key)
            except UserError:
                continue
        raise UserError(f"{key}: expected {tp}, got {value!r}")
    if origin is list:
        if not isinstance(value, list):
            raise UserError(f"{key}: expected a list, got {value!r}")
        (arg,) = typing.get_args(tp) or (Any,)
        return [_check_value(arg, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise UserError(f"{key}: expected a table, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise UserError(f"{key}: expected a table, got {value!r}")
        return from_dict(tp, value, prefix=key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise UserError(f"{key}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise UserError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise UserError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise UserError(f"{key}: expected a string, got {value!r}")
    return value


def from_dict(cls: type, d: dict, prefix: str = "") -> Any:
    """Build dataclass ``cls`` from ``d``; unknown keys and wrong types raise UserError."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise UserError(f"unknown config key {where}{unknown[0]} (valid: {', '.join(sorted(names))})")
    kwargs = {k: _check_value(hints[k], v, f"{prefix}.{k}" if prefix else k) for k, v in d.items()}
    return cls(**kwargs)


# ----------------------------------------------------------------------------- presets & overrides


def preset_dirs() -> list[Path]:
    """Where presets are looked up: ./configs (a checkout) then the copy shipped in the package."""
    dirs = [Path.cwd() / "configs"]
    try:
        dirs.append(Path(str(resources.files("fastweights") / "configs")))
    except Exception:  # pragma: no cover
        pass
    return dirs


def list_presets() -> list[str]:
    names = set()
    for d in preset_dirs():
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.toml"))
    return sorted(names)


def preset_descriptions(width: int = 100) -> dict[str, str]:
    """Every preset's name and a one-line description from the comment that opens its TOML file ("" when it
    has none): its first sentence without parentheses, shortened to the words before its first colon or
    comma when longer than ``width`` characters. A name found in several folders is described as
    :func:`load_preset` reads it (./configs first)."""
    out: dict[str, str] = {}
    for d in preset_dirs():
        if not d.is_dir():
            continue
        for path in sorted(d.glob("*.toml")):
            if path.stem not in out:
                try:
                    out[path.stem] = _first_sentence(path.read_text(errors="replace"), width)
                except OSError:
                    out[path.stem] = ""
    return dict(sorted(out.items()))


def _first_sentence(text: str, width: int) -> str:
    import re

    lines = []
    for line in text.splitlines():
        if not line.startswith("#") or not line.strip("# "):
            if lines or line.strip():
                break  # the opening comment's first paragraph only
            continue
        lines.append(line.lstrip("#").strip())
    words = re.sub(r"\s*\([^()]*\)", "", " ".join(lines))  # "(issue 7, benchmarks/...)" and the like
    sentence = re.split(r"(?<=\.)\s+(?=[A-Z])", words, maxsplit=1)[0].strip().rstrip(".")
    if len(sentence) <= width:
        return sentence
    head = sentence.split(": ", 1)[0]
    if len(head) < 20:
        head = sentence
    while len(head) > width and ", " in head:
        head = head.rsplit(", ", 1)[0]
    return head if len(head) <= width else head[: width - 3].rsplit(" ", 1)[0] + "..."


def load_preset(name: str) -> dict:
    path = Path(name)
    if not (path.suffix == ".toml" and path.is_file()):
        path = next((d / f"{name}.toml" for d in preset_dirs() if (d / f"{name}.toml").is_file()), None)
        if path is None:
            raise UserError(f"unknown preset {name!r}; available: {', '.join(list_presets())}")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"preset {path}: invalid TOML: {e}") from None


def parse_value(text: str) -> Any:
    """Parse an override value as TOML (numbers, booleans, lists, quoted strings), else a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(d: dict, overrides: list[str]) -> dict:
    """Apply ``section.key=value`` overrides to a nested dict (in place) and return it."""
    for item in overrides:
        if "=" not in item:
            raise UserError(f"override {item!r} is not of the form section.key=value")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) < 2 or not all(parts):
            raise UserError(f"override {item!r}: key must be section.key (e.g. train.lr=1e-3)")
        node = d
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise UserError(f"override {item!r}: {p} is not a section")
        node[parts[-1]] = parse_value(text.strip())
    return d


def make_config(preset: str | None = None, overrides: list[str] | None = None) -> RunConfig:
    d = load_preset(preset) if preset else {}
    apply_overrides(d, overrides or [])
    return from_dict(RunConfig, d)


def save_json(obj: Any, path: Path) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
