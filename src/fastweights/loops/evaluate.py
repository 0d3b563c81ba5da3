"""Scoring text: bits per character/byte or perplexity, streaming long documents with the state carried.

A document is scored in chunks of ``stride`` tokens; the model's state (fast weights, RNN states,
the KV cache) flows from chunk to chunk, so constant-size fast-weight memories see the whole
document. Parts whose state grows with the text (the KV cache of softmax attention) are trimmed
to ``seq_len - stride`` tokens after each chunk, so every query sees between ``seq_len - stride``
and ``seq_len - 1`` earlier tokens: the context lengths the model was trained on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fastweights.components import TrimsState
from fastweights.ops.nll import token_nll
from fastweights.core.progress import Progress

# Tokens per call when a pretrained subword model is scored with the whole text in its KV cache: the segment of
# the SmolLM2 comparisons (dynamic evaluation updates once per segment; the FWL head on SmolLM2 uses it as its
# segment, hf.fwl_head.PRETRAINED_FWL_DEFAULTS, so the two are compared on the same segments), of `fastweights
# eval` on an FWL-head checkpoint and of the neural cache's calls. Shorter segments mean more (and smaller)
# forward calls per token; smollm2_dynamic_eval.json records it with every setting it measured.
SCORING_SEGMENT_LEN = 64


@dataclass
class EvalResult:
    nll: float  # total negative log-likelihood, nats
    tokens: int  # scored tokens
    chars: int = 0  # characters of the scored text, when known
    token_losses: list = field(default_factory=list)  # per-token NLL, when asked for

    @property
    def loss(self) -> float:
        return self.nll / max(1, self.tokens)

    def add(self, other: "EvalResult") -> None:
        """Accumulate another stream's result into this one (totals, characters, per-token losses)."""
        self.nll += other.nll
        self.tokens += other.tokens
        self.chars += other.chars
        self.token_losses.extend(other.token_losses)

    def metrics(self, tokenizer_name: str) -> dict:
        m = {"loss_nats": self.loss, "tokens": self.tokens, "bits_per_token": self.loss / math.log(2),
             "perplexity": math.exp(min(self.loss, 700))}
        if tokenizer_name == "char":
            m["bits_per_char"] = m["bits_per_token"]
        elif tokenizer_name == "byte":
            m["bits_per_byte"] = m["bits_per_token"]
        if self.chars:
            m["chars"] = self.chars
            m["bits_per_char"] = self.nll / math.log(2) / self.chars
        return m


@torch.no_grad()
def score_tokens(model, tokens: torch.Tensor, seq_len: int, stride: int | None = None, state=None,
                 keep_token_losses: bool = False, progress: Progress | None = None):
    """Score ``tokens`` ([T] or [B, T]) left to right; returns (EvalResult, final state).

    The first token is context only: ``T - 1`` predictions are scored. ``stride`` defaults to
    ``seq_len // 2``.
    """
    if tokens.dim() == 1:
        tokens = tokens[None]
    stride = stride or max(1, seq_len // 2)
    if not 0 < stride <= seq_len:
        raise ValueError(f"stride must be in (0, seq_len], got {stride}")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    nll, count, losses = 0.0, 0, []
    T = tokens.shape[1]
    for start in range(0, T - 1, stride):
        end = min(start + stride, T - 1)
        x = tokens[:, start:end].to(device)  # [B, t]
        y = tokens[:, start + 1 : end + 1].to(device)
        out = model(x, state)
        state = out.state
        if isinstance(model, TrimsState):
            state = model.trim_state(state, seq_len - stride)
        tok_nll = token_nll(out.logits, y)  # [B, t]
        nll += tok_nll.sum().item()
        count += tok_nll.numel()
        if keep_token_losses:
            losses.extend(tok_nll.flatten().tolist())
        if progress is not None:
            progress.update(tok_nll.numel())
    model.train(was_training)
    return EvalResult(nll, count, token_losses=losses), state


def evaluate_documents(model, tokenizer, texts: list[str], seq_len: int, stride: int | None = None,
                       progress: bool = True) -> EvalResult:
    """Score each document from a fresh state and sum; bits per character use the scored characters."""
    encoded = [torch.as_tensor(tokenizer.encode(t), dtype=torch.long) for t in texts]
    total = sum(max(0, len(e) - 1) for e in encoded)
    bar = Progress(total, "tok", desc="eval", enabled=progress)
    result = EvalResult(0.0, 0)
    for text, ids in zip(texts, encoded):
        if len(ids) < 2:
            continue
        r, _ = score_tokens(model, ids, seq_len, stride, progress=bar)
        result.nll += r.nll
        result.tokens += r.tokens
        # the first token is never scored; count the characters that were predicted
        result.chars += len(text) - len(tokenizer.decode(ids[:1].tolist()))
    bar.close()
    return result
