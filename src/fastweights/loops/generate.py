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
            if temperature <= 0:
                nxt = int(logits.argmax())
            else:
                logits = logits / temperature
                if top_k:
                    kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                nxt = int(torch.multinomial(probs, 1, generator=gen))
            yield nxt
            x = torch.tensor([[nxt]], device=device)
    finally:
        model.train(was_training)
