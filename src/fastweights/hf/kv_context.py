"""The KV cache of a Hugging Face causal LM during (dynamic) evaluation: what stays in context.

Default: the whole stream, up to the model's position limit (``max_positions``). Nothing is evicted
while the stream fits, so static evaluation equals the model's full-context perplexity (one forward
pass over the whole text), which is the only baseline a dynamic-evaluation gain should be measured
against.

When the cache must be bounded (``context`` shorter than the stream, or a stream longer than the
position limit), the first ``sinks`` tokens of the stream are kept and the oldest of the OTHER tokens
are evicted: the cache holds ``first sinks tokens + the most recent ones`` (StreamingLLM, Xiao et al.
2023, "Efficient Streaming Language Models with Attention Sinks", arXiv 2309.17453). Pretrained
transformers put a large share of their attention on the first tokens whatever they are; evicting
them (a plain sliding window) breaks the model at once: on SmolLM2-135M the per-token losses of a
1,024-token sliding window equal full context until the first token is evicted and are far higher
after it, while a 1,024-token cache that keeps the first 4 stays close to full context
(``benchmarks/results/smollm2_dynamic_eval.json``, ``context_check``).

Positions. Cached keys keep the positions they were computed at; new tokens continue from there
(the sinks sit at their true distance). Only when the next call would pass ``max_positions`` -- which
learned absolute positions cannot represent and rotary positions were not trained for -- is the
cache re-encoded at positions ``0..L-1`` under the current weights (no gradient), after shrinking it
to at most half the position limit (sinks + most recent), so that re-encoding happens once per
``max_positions / 2`` tokens rather than once per call. Models with ALiBi biases (no position ids)
never need it. Between two re-encodings the effective context therefore runs from ``max_positions /
2`` up to the bound.

``state = {"kv": ((k, v), ...) [B, heads, L, head_dim] per layer, "tokens": [B, L] cached ids,
"pos": position id of the next token}``; the first ``min(sinks, L)`` cached entries are always the
stream's first tokens (trimming and re-encoding both keep them in front).
"""

from __future__ import annotations

import torch

DEFAULT_SINKS = 4  # StreamingLLM's choice: four initial tokens restore the perplexity of full windows
# model types whose attention uses ALiBi biases instead of position ids: positions never run out
_ALIBI_TYPES = {"bloom", "mpt"}


def needs_reencoding(config) -> bool:
    """True if the model's positions are bounded (learned absolute or rotary), False for ALiBi."""
    return not (getattr(config, "model_type", "") in _ALIBI_TYPES or bool(getattr(config, "alibi", False)))


def keep_indices(length: int, keep: int, sinks: int) -> tuple[int, int]:
    """(first, last): keep cache entries ``[:first]`` and ``[length - last:]`` (``first + last == keep``)."""
    keep = max(0, min(keep, length))
    first = min(sinks, keep)
    return first, keep - first


def trim_with_sinks(state: dict, keep: int, sinks: int) -> dict:
    """Bound a KV-cache state to ``keep`` entries: the first ``sinks`` (the stream's first tokens) and
    the most recent ``keep - sinks``; evicts from the middle. ``sinks = 0`` is a plain sliding window."""
    L = state["tokens"].shape[1]
    if L <= keep:
        return state
    first, last = keep_indices(L, keep, sinks)

    def cut(t: torch.Tensor, dim: int) -> torch.Tensor:
        head = t.narrow(dim, 0, first)
        tail = t.narrow(dim, L - last, last)
        return torch.cat([head, tail], dim) if first else tail

    kv = tuple((cut(k, 2), cut(v, 2)) for k, v in state["kv"])
    return {"kv": kv, "tokens": cut(state["tokens"], 1), "pos": state["pos"]}


def reencode_budget(cached: int, new: int, max_positions: int) -> int:
    """How many cached tokens to keep when re-encoding before ``new`` tokens: at most half the
    position limit (so the next re-encoding is far away) and never more than fit with the new ones."""
    if new > max_positions:
        raise ValueError(f"{new} new tokens exceed the model's {max_positions} positions; feed fewer tokens per call")
    return max(0, min(cached, max_positions // 2, max_positions - new))


def context_metadata(model) -> dict:
    """What the KV-cache policy of an :class:`~fastweights.hf.transformers_as_ours.HFCausalLM` is, for result files."""
    return {"max_positions": model.max_positions, "sinks": model.sinks,
            "eviction": (f"the first {model.sinks} tokens kept, the oldest others evicted" if model.sinks
                         else "sliding window (oldest evicted)"),
            "positions": ("re-encoded at 0.. (sinks + at most max_positions/2 recent tokens) when they run out"
                          if model.reencode else "ALiBi: no position ids")}
