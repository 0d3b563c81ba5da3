"""The token stream dynamic evaluation reads, and the model state it carries along it.

:func:`as_token_stream` makes a text's tokens one 1-D stream; :func:`logits_and_state` reads a model's
output as the pair ``(logits, state)`` the loops call ``forward`` for; :func:`carry_state` hands the
state to the next segment detached (no gradient reaches back into the memory) and, for a model that
keeps a KV cache, bounded to ``context - segment_len`` tokens. The evaluators, the neural cache and the
gradient statistics share them.
"""

from __future__ import annotations

import torch


def as_token_stream(tokens) -> torch.Tensor:
    """``tokens`` ([T] or [1, T]) as one 1-D stream of token ids; ValueError for any other shape."""
    t = torch.as_tensor(tokens)
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1:
        raise ValueError(f"expected a 1-D token sequence, got shape {tuple(t.shape)}")
    return t.long()


def carry_state(model, state, context: int | None, segment_len: int):
    """Detach the model state (no gradient into the memory) and bound a growing KV cache."""
    from fastweights.models.lm import detach_state

    state = detach_state(state)
    if context is not None and hasattr(model, "trim_state"):
        state = model.trim_state(state, max(0, context - segment_len))
    return state


def logits_and_state(out):
    """A model output's ``(logits, state)``, the pair the loops' ``forward(x, state)`` returns."""
    return out.logits, out.state
