"""The switches on a model's fast memories that the long-context tasks and measurements share.

They act on the explicit state of :class:`~fastweights.models.lm.LanguageModel`. Its parts play two
roles, and the tasks and measurements treat them differently:

* **memories** -- block memories with a separate write step (FwPKM, FwMLP: ``layers[i]["memory"]``)
  and the head's fast weights (FWL: ``state["head"]``): knowledge the model writes while it reads;
* **context** -- the mixers' states (``layers[i]["mixer"]``: the KV cache of softmax attention,
  the fast-weight matrix of a fast weight programmer / GDN, the fast-weights RNN's h and A): the
  working context of the current passage.

Here: the memories inside a model (:func:`fast_memories`), their writes switched off or re-chunked
(:func:`memory_writes`, :func:`check_chunk_empty`), the state with the context dropped
(:func:`memory_only_state`) or bounded (:func:`trimmed_state`), and :func:`read_tokens`, the reading primitive that feeds tokens in
pieces while carrying the state (NIAH, the FwPKM gate map).

Mechanisms without a write step cannot be frozen: the mixers (their state is the context itself)
and the FWL head (its fast weights change at every token inside the forward; it has no switch),
which :func:`unfrozen_fast_parts` lists so that results can say so.

A low floor: imports torch, :mod:`fastweights.components` and :mod:`fastweights.core.errors`, nothing
from the models, adaptation, the loops or the command line.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from fastweights.components import FastHead, FastMemory, TrimsState
from fastweights.core.errors import UserError


# ----------------------------------------------------------------------------- state parts and switches


def fast_memories(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Block memories with a write step and a ``frozen`` switch (FwPKM, FwMLP) inside ``model``."""
    return [m for m in model.modules() if isinstance(m, FastMemory)]


def unfrozen_fast_parts(model: torch.nn.Module) -> list[str]:
    """Components whose weights change at test time but that have no freeze switch (the FWL head)."""
    head = getattr(model, "head", None)
    out = []
    if isinstance(head, FastHead):
        out.append(f"head ({type(head).__name__})")
    return out


@contextlib.contextmanager
def memory_writes(model: torch.nn.Module, frozen: bool | None = None, chunk_size: int | None = None):
    """Temporarily switch the memories' writes: ``frozen=True`` reads without writing; ``chunk_size``
    makes them write every ``chunk_size`` tokens (e.g. once per read of a context of that length; start
    from a state whose current chunk is empty, see :func:`check_chunk_empty`).

    ``None`` leaves a setting as it is. The memories' own settings come back on exit, whatever happens.
    The switches are the memories' public ``frozen`` attribute and their ``options.chunk_size``
    (replaced by a copy of the options for the duration).
    """
    mems = fast_memories(model)
    saved = [(m, m.frozen, m.options) for m in mems]
    try:
        for m in mems:
            if frozen is not None:
                m.frozen = frozen
            if chunk_size is not None:
                if chunk_size <= m.options.lookahead:
                    raise UserError(f"memory write chunk {chunk_size} must exceed the lookahead {m.options.lookahead}")
                m.options = dataclasses.replace(m.options, chunk_size=int(chunk_size))
        yield mems
    finally:
        for m, fr, opts in saved:
            m.frozen, m.options = fr, opts


def memory_only_state(state: dict | None) -> dict | None:
    """The state with the mixers' (context) states dropped: memories and the head's fast weights kept."""
    if state is None:
        return None
    layers = [{"memory": s["memory"]} if "memory" in s else {} for s in state["layers"]]
    return {"layers": layers, "head": state.get("head")}


def check_chunk_empty(state) -> None:
    """UserError unless every memory's current chunk is empty (nothing read since its last write), which a
    write-chunk override needs: a chunk already longer than the new size would never close."""
    if state is None:
        return
    for s in state["layers"]:
        mem = s.get("memory")
        if mem is not None and getattr(mem, "n_read", 0):
            raise UserError("a per-read memory write needs a state whose memory chunk is empty; "
                            "use write_chunk='model' to read with the memory's own chunk size")


def trimmed_state(model, state, keep: int | None):
    """``state`` with at most ``keep`` past tokens kept, when ``model`` trims its state (``TrimsState``: a KV
    cache); unchanged when ``keep`` or ``state`` is None or the model keeps no cache."""
    if keep is None or state is None or not isinstance(model, TrimsState):
        return state
    return model.trim_state(state, max(0, keep))


@torch.no_grad()
def read_tokens(model, ids: torch.Tensor, state=None, piece: int = 512, context: int | None = None,
                want_logits: bool = False):
    """Feed ``ids`` ([T]) to ``model`` in calls of ``piece`` tokens, carrying the state.

    ``context``: KV-cache tokens kept between calls (None: unbounded). Returns the state, or
    ``(logits [1, t, V] of the last call, state)`` with ``want_logits``.
    """
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"read_tokens needs a non-empty 1-D token tensor, got shape {tuple(ids.shape)}")
    logits = None
    for a in range(0, ids.numel(), piece):
        out = model(ids[None, a : a + piece], state)
        state = trimmed_state(model, out.state, context)
        logits = out.logits
    return (logits, state) if want_logits else state
