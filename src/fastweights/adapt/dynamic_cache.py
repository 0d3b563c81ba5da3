"""The neural cache on top of dynamic evaluation: the cache mixes the ADAPTED model's distribution.

Krause et al. (2018) compare dynamic evaluation with the neural cache (Grave et al. 2017,
``adapt.cache``); the two can be combined. For each segment s_i of the stream (``adapt.dynamic``):

    1. the model with the current weights theta^{i-1} gives p_model(. | h_t) and the hidden state
       h_t (the input of the output layer) at each position t of s_i;
    2. the score of x_{t+1} is -log p(x_{t+1}) with
           p(w) = (1 - lambda_c) p_model(w | h_t) + lambda_c p_cache(w),
           p_cache(w) ∝ sum_{i < t, t - i <= window} 1[x_{i+1} = w] exp(omega * sim(h_t, h_i))
       (``adapt.cache.cache_mix``: pairs strictly before t, h_i as computed when position i was
       scored, i.e. under the weights of its own segment);
    3. g_i = gradient of the mean of -log p_model over s_i (the MODEL's loss: the cache has no
       parameters) and theta^i = update(theta^{i-1}, g_i) by the wrapped evaluator's rule and
       learning-rate schedule.

Every score is recorded before any update or cache entry has seen its token. Any
:class:`~fastweights.adapt.dynamic.DynamicEvaluator` can be wrapped (full weights, a parameter
subset, ``adapt.sparse``, ``adapt.lowrank``); an evaluator with ``lr = 0`` gives the plain neural
cache on the static model, ``mix = 0`` gives plain dynamic evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastweights.adapt.cache import SIMILARITIES, CacheSettings, cache_mix, forward_hidden
from fastweights.adapt.dynamic import DynamicEvaluator, DynamicState
from fastweights.adapt.stream_state import as_token_stream
from fastweights.core.errors import UserError
from fastweights.loops.evaluate import EvalResult
from fastweights.ops.nll import log_probs, nll_at
from fastweights.core.progress import Progress


@dataclass
class DynamicCacheState:
    dynamic: DynamicState  # adapted values, model state, unscored tokens, counters
    mem_hidden: torch.Tensor  # [M, d], M <= window
    mem_tokens: torch.Tensor  # [M]
    seen: int  # cache pairs seen in total


class DynamicNeuralCache:
    """Score a stream by dynamic evaluation with a neural cache mixed into the adapted model's output.

    Args:
        evaluator: the dynamic evaluator whose model, rule, schedule, segment length and context are used.
        window, flatness, mix, similarity, warmup_window: the cache's (``adapt.cache.NeuralCache``; defaults:
            ``adapt.cache.CacheSettings``, the same as the cache on the static model's).
    """

    def __init__(self, evaluator: DynamicEvaluator, window: int = CacheSettings.window,
                 flatness: float = CacheSettings.flatness, mix: float = CacheSettings.mix,
                 similarity: str = CacheSettings.similarity, warmup_window: bool = CacheSettings.warmup_window):
        if window < 0 or not 0.0 <= mix <= 1.0 or flatness < 0:
            raise UserError(f"cache needs window >= 0, 0 <= mix <= 1 and flatness >= 0 (got {window}, {mix}, {flatness})")
        if similarity not in SIMILARITIES:
            raise UserError(f"cache similarity must be one of {', '.join(SIMILARITIES)}, got {similarity!r}")
        self.ev = evaluator
        self.window, self.flatness, self.mix = int(window), float(flatness), float(mix)
        self.similarity, self.warmup_window = similarity, bool(warmup_window)

    def metadata(self) -> dict:
        return {**self.ev.metadata(), "cache": {"method": "neural cache (Grave et al. 2017) on the adapted model",
                                                "window": self.window, "flatness": self.flatness, "mix": self.mix,
                                                "similarity": self.similarity, "warmup_window": self.warmup_window,
                                                "update_loss": "the model's own segment-mean NLL (not the mixture)"}}

    def evaluate(self, tokens, state: DynamicCacheState | None = None, final: bool = True,
                 keep_token_losses: bool = True, progress: Progress | None = None):
        """Like ``DynamicEvaluator.evaluate``: returns ``(EvalResult, DynamicCacheState)``; pieces equal one call."""
        ev = self.ev
        tokens = as_token_stream(tokens)
        dyn = state.dynamic if state is not None else None
        seq = torch.cat([dyn.pending, tokens]) if dyn is not None else tokens
        model_state = dyn.model_state if dyn is not None else None
        updates = dyn.updates if dyn is not None else 0
        if state is None:
            mem_h, mem_y, seen = None, torch.zeros(0, dtype=torch.long, device=ev.device), 0
        else:
            mem_h, mem_y, seen = state.mem_hidden, state.mem_tokens, state.seen
            if mem_h.numel() == 0:
                mem_h = None
        result = EvalResult(0.0, 0)
        L, n, pos = ev.segment_len, seq.numel() - 1, 0
        with ev._session(dyn.values if dyn is not None else None) as (_, leaves, deltas, sync, finish):
            while pos < n and (final or n - pos >= L):
                m = min(L, n - pos)
                x = seq[None, pos : pos + m].to(ev.device)
                y = seq[pos + 1 : pos + m + 1].to(ev.device)
                logits, new_state, hidden = forward_hidden(ev.model, x, model_state)
                h = hidden[0].detach().float()  # [m, d]
                if mem_h is None:
                    mem_h = h.new_zeros(0, h.shape[1])
                logp = log_probs(logits[0])  # [m, V]
                with torch.no_grad():
                    p = cache_mix(logp.detach().exp(), h.to(logp.dtype), y, mem_h.to(logp.dtype), mem_y, seen,
                                  self.window, self.flatness, self.mix, self.similarity, self.warmup_window)
                    tok = -torch.log(p.gather(1, y[:, None])[:, 0])
                # 1. score (the mixture), before any update or cache entry has seen the segment, and update
                # the model on its own loss (not the mixture's); then the cache gains the segment's pairs
                model_state = ev._score_and_update(result, tok, keep_token_losses, nll_at(logp, y).mean(),
                                                   leaves, deltas, sync, updates, new_state)
                mem_h = torch.cat([mem_h, h])[-self.window :] if self.window else mem_h[:0]
                mem_y = torch.cat([mem_y, y])[-self.window :] if self.window else mem_y[:0]
                seen += m
                updates += 1
                pos += m
                if progress is not None:
                    progress.update(m)
            values = finish()
        if mem_h is None:
            mem_h = torch.zeros(0, 0, device=ev.device)
        prev = dyn.scored if dyn is not None else 0
        new = DynamicState(values, model_state, seq[pos:].clone(), prev + result.tokens, updates)
        return result, DynamicCacheState(new, mem_h, mem_y, seen)

    def evaluate_documents(self, documents, keep_token_losses: bool = False, progress: bool = False) -> EvalResult:
        """Each document from theta_g, an empty cache and a fresh model state; the summed result."""
        docs = [as_token_stream(d) for d in documents]
        bar = Progress(sum(max(0, d.numel() - 1) for d in docs), "tok", desc="dynamic+cache", enabled=progress)
        total = EvalResult(0.0, 0)
        for d in docs:
            if d.numel() < 2:
                continue
            r, _ = self.evaluate(d, keep_token_losses=keep_token_losses, progress=bar)
            total.add(r)
        bar.close()
        return total
