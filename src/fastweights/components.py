"""The component contract: what a mixer, head or memory is, and the registry that names them.

This is the ground floor of the house (it imports nothing of fastweights above ``errors`` and
``config``): ``layers/`` register their classes here, ``models/`` build them from here by name.

Every component follows the explicit-state protocol::

    y, state = component(x, state=None)        # mixers, memories: x [B, T, C] -> y [B, T, C]
    logits, state = head(h, tokens, state)     # heads: h [B, T, C], tokens [B, T] -> logits [B, T, V]

``state=None`` means fresh; passing the returned state back continues the sequence exactly, so one call
over a text equals the same text in pieces.

Padding (issue 33): every registered mixer, memory and head also takes ``attention_mask`` [B, T] as a
keyword, ``part(x, state, attention_mask=mask)``: a bool tensor, True = a real token, False = padding; the
model passes it only when some entry is False (:func:`call_part`), so a call without padding runs the code it
always ran. A masked position is never written into any fast weight, memory, KV cache or recurrent state,
moves no normaliser and no position counter, and its output is ignored: each row's real tokens get exactly
what they get alone (``tests/contracts/test_padding.py``). Each component's file says how it does so.

What else a component may offer is declared below as Protocols and checked with ``isinstance`` (never by
probing attribute names):

    Memory        ``placement`` = "before_mixer" | "replace_mlp" (where the block puts it)
    FastMemory    a memory written while it reads (FwPKM, FwMLP): ``frozen`` switches writes off,
                  ``options.chunk_size`` / ``options.lookahead`` say when it writes
    SlotMemory    a product-key memory (PKM, FwPKM): ``n_slots``; with ``record_reads`` set, each
                  forward appends its slot ids and weights to ``read_log``
    GatedMemory   a memory whose output is gated (FwPKM): gates appended to ``gate_log`` while
                  ``record_reads``; ``tracer`` (None = off) receives every write
    FastHead      a head whose weights change as it reads (FWL): ``fast_names``
    AuxLoss       ``aux_loss``: a training loss the part adds after each forward (None = none)
    TrimsState    ``trim_state(state, keep)``: bound a state that grows with the sequence (a KV cache)

A mechanism registers itself in its own file under ``fastweights/layers/``::

    @dataclass
    class FWPOptions:
        rule: str = "delta"

    @register_mixer("fwp", FWPOptions)
    class FastWeightProgrammer(nn.Module):
        def __init__(self, d_model: int, n_heads: int, options: FWPOptions): ...
        def forward(self, x, state=None): ...  # x [B, T, C] -> (y [B, T, C], state)

Every module of ``fastweights.layers`` is imported the first time a name is looked up, so a new file
there is found with no list to edit, and a module that fails to import fails loudly, naming itself.

What the project's checks and the memory estimate need to know of a component it declares on its class,
in its own file (see ``FACTS``; each has a default, so a component that declares nothing is still checked):

    test_variants        {id: options} run by every registry-wide check (causality, pieces == one call,
                         the meta device, bf16 autocast, the memory estimate against the state it returns)
    tiny_options         options that make it small in a whole test model (defaults are the papers' sizes)
    bounded_variants     {id: options} whose carried state stays bounded along a stream far past the
                         training length; ``growing_variants``: those known to keep growing
    compute_dtype_state  state fields that may follow the autocast dtype (caches of activations, never
                         fast weights; "" is the whole state)
    state_floats(options, *, d_model, n_heads, vocab_size, seq_len) -> {"carried", "shared", "backward",
                         "backward_shared"}: floats of state in one training call (``models.size``); without
                         it the state is measured by a dry run on the meta device (``state_floats`` below)
Configs pick components by name; options come from ``[model.options.<name>]`` and are validated by the
options dataclass. Mixers are built as ``cls(d_model=..., n_heads=..., options=...)``, memories as
``cls(d_model=..., options=...)``, heads as ``cls(d_model=..., vocab_size=..., options=...)``.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

from torch import Tensor

from fastweights.core.errors import UserError

# ----------------------------------------------------------------------------- the contract


@runtime_checkable
class Mixer(Protocol):
    """Token mixing inside a block: ``forward(x [B, T, C], state=None) -> (y [B, T, C], state)``."""

    def forward(self, x: Tensor, state: Any = None) -> tuple[Tensor, Any]: ...


@runtime_checkable
class Head(Protocol):
    """Output head: ``forward(h [B, T, C], tokens [B, T] | None, state=None) -> (logits [B, T, V], state)``."""

    def forward(self, h: Tensor, tokens: Tensor | None = None, state: Any = None) -> tuple[Tensor, Any]: ...


@runtime_checkable
class Memory(Protocol):
    """A block part placed "before_mixer" (its own residual branch) or "replace_mlp"."""

    placement: str

    def forward(self, x: Tensor, state: Any = None) -> tuple[Tensor, Any]: ...


@runtime_checkable
class FastMemory(Memory, Protocol):
    """A memory written while it reads (FwPKM, FwMLP): ``frozen`` reads without writing; its options
    carry ``chunk_size`` (tokens per write) and ``lookahead`` (how far ahead its targets look)."""

    frozen: bool
    options: Any


@runtime_checkable
class SlotMemory(Memory, Protocol):
    """A product-key memory (PKM, FwPKM): ``n_slots`` rows; ``read_log`` collects reads while ``record_reads``."""

    n_slots: int
    read_log: list
    record_reads: bool


@runtime_checkable
class GatedMemory(Memory, Protocol):
    """A gated memory (FwPKM): ``gate_log`` collects gates while ``record_reads``; ``tracer`` sees writes."""

    gate_log: list
    tracer: Any


@runtime_checkable
class FastHead(Head, Protocol):
    """A head whose weights change as it reads (the FWL head): ``fast_names`` lists its fast tensors."""

    fast_names: Any


@runtime_checkable
class AuxLoss(Protocol):
    """A part that adds a training loss; ``aux_loss`` is set by each forward (None = nothing to add)."""

    aux_loss: Tensor | None


@runtime_checkable
class TrimsState(Protocol):
    """A part whose state grows with the sequence and can be bounded to the last ``keep`` tokens."""

    def trim_state(self, state: Any, keep: int) -> Any: ...


PLACEMENTS = ("before_mixer", "replace_mlp")

# ----------------------------------------------------------------------------- the registry

MIXERS: dict[str, "Entry"] = {}
HEADS: dict[str, "Entry"] = {}
MEMORIES: dict[str, "Entry"] = {}
PACKAGE = "fastweights.layers"  # every module under it is scanned for components
_loaded = False


@dataclass
class Entry:
    name: str
    cls: type
    options_cls: type | None


def _register(table: dict, kind: str, name: str, options_cls: type | None) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        if name in table and table[name].cls is not cls:
            raise ValueError(f"{kind} {name!r} registered twice ({table[name].cls.__module__} and {cls.__module__})")
        table[name] = Entry(name, cls, options_cls)
        return cls

    return deco


def register_mixer(name: str, options_cls: type | None = None):
    return _register(MIXERS, "mixer", name, options_cls)


def register_head(name: str, options_cls: type | None = None):
    return _register(HEADS, "head", name, options_cls)


def register_memory(name: str, options_cls: type | None = None):
    return _register(MEMORIES, "memory", name, options_cls)


def load_providers(rescan: bool = False) -> None:
    """Import every module of ``fastweights.layers`` (once; ``rescan`` looks again, e.g. after a module
    was added to the package's path). An import error propagates: a broken file is never silently skipped."""
    global _loaded
    if _loaded and not rescan:
        return
    package = importlib.import_module(PACKAGE)
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        importlib.import_module(f"{PACKAGE}.{info.name}")
    _loaded = True


def lookup(table: dict, kind: str, name: str) -> Entry:
    load_providers()
    if name not in table:
        raise UserError(f"unknown {kind} {name!r}; available: {', '.join(sorted(table))}")
    return table[name]


def build_options(entry: Entry, raw: dict[str, Any] | None):
    """Options dataclass for ``entry`` from a dict, failing clearly on unknown keys or types."""
    from fastweights.core.config import from_dict

    if entry.options_cls is None:
        if raw:
            raise UserError(f"{entry.name!r} takes no options, got {sorted(raw)}")
        return None
    return from_dict(entry.options_cls, raw or {}, prefix=f"model.options.{entry.name}")


# ----------------------------------------------------------------------------- what a component declares

KINDS = {"mixer": MIXERS, "head": HEADS, "memory": MEMORIES}
STATE_KEYS = ("carried", "shared", "backward", "backward_shared")
# the facts a component may declare as class attributes, with the value a component that declares none gets
FACTS: dict[str, Any] = {"test_variants": {"default": {}}, "tiny_options": {}, "growing_variants": {},
                         "compute_dtype_state": ()}


def declared(entry: Entry, fact: str):
    """A declared fact of ``entry``'s class, or its default (``bounded_variants``: the tiny options)."""
    if fact == "bounded_variants":
        return getattr(entry.cls, fact, {"default": declared(entry, "tiny_options")})
    return getattr(entry.cls, fact, FACTS[fact])


def registered() -> list[tuple[str, Entry]]:
    """(kind, entry) of every registered component, kinds in ``KINDS`` order, names sorted."""
    load_providers()
    return [(kind, table[name]) for kind, table in KINDS.items() for name in sorted(table)]


def build(kind: str, entry: Entry, options, *, d_model: int, n_heads: int, vocab_size: int):
    """The component ``entry`` built as a model builds it (``options``: its options dataclass or None)."""
    kwargs = {"mixer": {"n_heads": n_heads}, "head": {"vocab_size": vocab_size}, "memory": {}}[kind]
    kwargs = {"d_model": d_model, **kwargs, **({} if options is None else {"options": options})}
    return entry.cls(**kwargs)


def call_part(part, *args, attention_mask: Tensor | None = None):
    """``part(*args)``, with ``attention_mask=`` passed only when given: a part written before masks existed (a
    user's toy mixer) still runs unpadded batches, and one given padding it cannot take fails naming itself."""
    if attention_mask is None:
        return part(*args)
    try:
        import inspect

        params = inspect.signature(part.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - a builtin forward
        params = {}
    if "attention_mask" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        raise UserError(f"{type(part).__name__} does not take an attention_mask, so it cannot read a padded batch; "
                        "use prompts of equal length")
    return part(*args, attention_mask=attention_mask)


def state_floats(kind: str, name: str, raw: dict | None, *, d_model: int, n_heads: int, vocab_size: int,
                 seq_len: int) -> dict[str, int]:
    """Floats of ``name``'s state in one training call of ``seq_len`` tokens (keys ``STATE_KEYS``): its
    declared ``state_floats``, or measured on the meta device from the states of calls on one and two
    sequences (per sequence: "carried"; once per batch: "shared"; what only the backward pass keeps is not
    measurable so, and counted 0). A state that cannot be measured is an error, never 0."""
    import torch

    entry = lookup(KINDS[kind], kind, name)
    options = build_options(entry, raw)
    dims = {"d_model": d_model, "n_heads": n_heads, "vocab_size": vocab_size}
    if hasattr(entry.cls, "state_floats"):
        got = entry.cls.state_floats(options, seq_len=seq_len, **dims)
        if set(got) - set(STATE_KEYS):  # a misspelt key would otherwise count as 0
            raise ValueError(f"{kind} {name!r}: state_floats returned {sorted(set(got) - set(STATE_KEYS))}, "
                             f"not among {STATE_KEYS}")
        return {k: int(got.get(k, 0)) for k in STATE_KEYS}
    try:
        with torch.device("meta"):
            part = build(kind, entry, options, **dims)
            floats = []
            for rows in (1, 2):
                x = torch.empty(rows, seq_len, d_model)
                out = part(x, torch.zeros(rows, seq_len, dtype=torch.long)) if kind == "head" else part(x)
                floats.append(_floats(out[1]))
    except Exception as e:  # noqa: BLE001 - any failure: the state is unknown, which must not read as 0
        raise UserError(f"{kind} {name!r} declares no state_floats and its state could not be measured on the "
                        f"meta device ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); declare "
                        "state_floats on its class") from None
    return {"carried": floats[1] - floats[0], "shared": 2 * floats[0] - floats[1], "backward": 0,
            "backward_shared": 0}


def _floats(state) -> int:
    from torch.utils._pytree import tree_leaves

    return sum(t.numel() for t in tree_leaves(state) if hasattr(t, "is_floating_point") and t.is_floating_point())
