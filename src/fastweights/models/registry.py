"""Registries of sequence mixers, output heads and block memories, looked up by name from configs.

A mechanism registers itself in its own file::

    @dataclass
    class FWPOptions:
        rule: str = "delta"

    @register_mixer("fwp", FWPOptions)
    class FastWeightProgrammer(nn.Module):
        def __init__(self, d_model: int, n_heads: int, options: FWPOptions): ...
        def forward(self, x, state=None):  # x [B, T, C] -> (y [B, T, C], state)

The model config picks mixers per layer by name, and options come from the TOML table
``[model.options.<name>]`` (or ``--set model.options.<name>.<key>=value``); the options
dataclass validates keys and types.

Mixers are built as ``cls(d_model=..., n_heads=..., options=...)``; memories (block parts placed
before the mixer or replacing the MLP) as ``cls(d_model=..., options=...)``; heads as
``cls(d_model=..., vocab_size=..., options=...)``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

MIXERS: dict[str, "Entry"] = {}
HEADS: dict[str, "Entry"] = {}
MEMORIES: dict[str, "Entry"] = {}

# Modules that register components; imported lazily the first time a name is looked up,
# so that `import fastweights` stays cheap and a broken optional module names itself.
_PROVIDERS = [
    "fastweights.layers.attention",
    "fastweights.layers.fwp",
    "fastweights.layers.fast_rnn",
    "fastweights.layers.lstm",
    "fastweights.layers.gdn",
    "fastweights.layers.fwl",
    "fastweights.layers.pkm",
    "fastweights.layers.fwpkm",
    "fastweights.layers.fwmlp",
]
_loaded = False


@dataclass
class Entry:
    name: str
    cls: type
    options_cls: type | None


def _register(table: dict, kind: str, name: str, options_cls: type | None) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        if name in table and table[name].cls is not cls:
            raise ValueError(f"{kind} {name!r} registered twice")
        table[name] = Entry(name, cls, options_cls)
        return cls

    return deco


def register_mixer(name: str, options_cls: type | None = None):
    return _register(MIXERS, "mixer", name, options_cls)


def register_head(name: str, options_cls: type | None = None):
    return _register(HEADS, "head", name, options_cls)


def register_memory(name: str, options_cls: type | None = None):
    return _register(MEMORIES, "memory", name, options_cls)


def load_providers() -> None:
    global _loaded
    if _loaded:
        return
    for mod in _PROVIDERS:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:  # a mechanism not written yet is simply not offered
            if e.name != mod:
                raise
    _loaded = True


def lookup(table: dict, kind: str, name: str) -> Entry:
    load_providers()
    if name not in table:
        from fastweights.errors import UserError

        raise UserError(f"unknown {kind} {name!r}; available: {', '.join(sorted(table))}")
    return table[name]


def build_options(entry: Entry, raw: dict[str, Any] | None):
    """Options dataclass for ``entry`` from a dict, failing clearly on unknown keys or types."""
    from fastweights.config import from_dict

    if entry.options_cls is None:
        if raw:
            from fastweights.errors import UserError

            raise UserError(f"{entry.name!r} takes no options, got {sorted(raw)}")
        return None
    return from_dict(entry.options_cls, raw or {}, prefix=f"model.options.{entry.name}")
