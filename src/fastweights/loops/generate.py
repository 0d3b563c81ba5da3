"""Sampling with a streaming state: the prompt is read once, then each new token costs one step."""

from __future__ import annotations

from typing import Iterator

import torch

from fastweights.components import TrimsState


@torch.no_grad()
def generate_tokens(model, prompt: list[int], max_tokens: int, temperature: float = 1.0, top_k: int = 0,
                    seed: int | None = None, context: int | None = None) -> Iterator[int]:
    """Yield ``max_tokens`` sampled token ids after ``prompt``.

    temperature 0 is greedy decoding. ``context`` bounds the KV cache of attention layers (default
    unbounded); fast-weight states are carried whole.
    """
    if not prompt:
        raise ValueError("the prompt must contain at least one token")
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    if seed is not None:
        gen.manual_seed(seed)
    was_training = model.training
    model.eval()
    x = torch.tensor([prompt], device=device)
    state = None
    trims = context is not None and isinstance(model, TrimsState)  # a Protocol check: once, not per token
    try:
        for _ in range(max_tokens):
            out = model(x, state)
            state = out.state
            if trims:
                state = model.trim_state(state, context - 1)
            logits = out.logits[0, -1].float()
            nxt = sample_token(logits, temperature, top_k, gen)
            yield nxt
            x = torch.tensor([[nxt]], device=device)
    finally:
        model.train(was_training)


def sample_token(logits: torch.Tensor, temperature: float, top_k: int, gen) -> int:
    """The next token from ``logits`` [V] (fp32): the argmax at temperature 0, else a draw from softmax(logits / T)
    over the ``top_k`` largest (0: all). The largest logit is subtracted before dividing, in float64 (where a tiny
    temperature is not rounded to 0), so a tiny temperature gives the argmax's distribution instead of 0 / 0 or
    inf - inf = NaN (issue 49: ``--temperature 1e-300`` crashed)."""
    if temperature <= 0:
        return int(logits.argmax())
    logits = (logits.double() - logits.max().double()) / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
