"""Neural cache (Grave, Joulin, Usunier, "Improving Neural Language Models with a Continuous Cache",
ICLR 2017, arXiv 1612.04426): the baseline dynamic evaluation is compared against (Krause et al.
2018, eq. 3).

The cache stores pairs (h_i, x_{i+1}) of the last ``window`` positions: the hidden state that
predicted a token and the token that followed. At position t:

    p_cache(w | h_1..t) ∝ sum_{i < t, t - i <= window} 1[x_{i+1} = w] exp(omega * sim(h_t, h_i))
    p(w) = (1 - lambda_c) p_model(w | h_t) + lambda_c p_cache(w)

sim is the dot product (the paper's formula) or, with ``similarity="cosine"``, the cosine (the
``pointer.py`` of ``salesforce/awd-lstm-lm``, where omega is called theta). ``warmup_window=True``
turns the cache on only once more than ``window`` pairs have been seen (``pointer.py``); by default
it is used as soon as one pair exists. omega ("flatness") and lambda_c are tuned on validation text;
no training. h is the input of the output layer (the final normalised hidden state).

``cache_mix_reference`` is the per-position loop written from the equation; ``cache_mix`` computes
a whole chunk at once (one masked score matrix against memory + chunk); a test holds them together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastweights.adapt.stream_state import as_token_stream, carry_state
from fastweights.core import numbers
from fastweights.core.config import setting_field
from fastweights.core.errors import UserError
from fastweights.loops.evaluate import SCORING_SEGMENT_LEN, EvalResult
from fastweights.core.progress import Progress


SIMILARITIES = ("dot", "cosine")


@dataclass(frozen=True)
class CacheSettings:
    """The neural cache's settings, defined once: :class:`NeuralCache`, ``adapt.dynamic_cache.DynamicNeuralCache``
    and :func:`cache_mix` take their defaults from here, and so do ``dynamic eval``'s ``--cache-*`` flags
    (``cli.settings``). The defaults are ``pointer.py``'s (window 500, theta 1.0, lambda 0.1); the paper's text8
    runs kept 3,000 positions; the benchmarks pass their own window (2,000, with flatness and mix tuned for it)."""

    window: int = setting_field(500, "past positions it remembers", type=numbers.positive_int)
    flatness: float = setting_field(1.0, "theta, the flatness of its distribution over remembered positions",
                                    type=numbers.nonneg_float)
    mix: float = setting_field(0.1, "lambda, the weight of the cache in the mixture with the model",
                               type=numbers.fraction)
    similarity: str = setting_field("dot", "how a position's hidden state is compared with the current one",
                                    choices=SIMILARITIES)
    warmup_window: bool = setting_field(False, "use the cache only once more than window pairs were seen")


def _similarity(q: torch.Tensor, k: torch.Tensor, similarity: str) -> torch.Tensor:
    """q [T, d], k [M, d] -> [T, M]."""
    if similarity == "cosine":
        q = q / q.norm(dim=-1, keepdim=True).clamp(min=1e-12)
        k = k / k.norm(dim=-1, keepdim=True).clamp(min=1e-12)
    elif similarity != "dot":
        raise UserError(f"cache similarity must be one of {', '.join(SIMILARITIES)}, got {similarity!r}")
    return q @ k.transpose(0, 1)


def cache_mix_reference(p_model: torch.Tensor, hidden: torch.Tensor, next_tokens: torch.Tensor,
                        mem_hidden: torch.Tensor, mem_tokens: torch.Tensor, seen: int, window: int,
                        flatness: float, mix: float, similarity: str = CacheSettings.similarity,
                        warmup_window: bool = CacheSettings.warmup_window) -> torch.Tensor:
    """Mixed distributions, one position at a time, straight from the equation.

    Args:
        p_model: [T, V] model probabilities at the chunk's positions.
        hidden: [T, d] their hidden states; next_tokens: [T] the token each position predicts.
        mem_hidden, mem_tokens: [M, d], [M] the pairs stored before the chunk (oldest first).
        seen: pairs seen before the chunk in total (>= M; for the warm-up rule).
    Returns [T, V].
    """
    keys = list(zip(mem_hidden, mem_tokens))
    out = []
    for t in range(p_model.shape[0]):
        pairs = keys[-window:] if window > 0 else []
        enabled = len(pairs) > 0 and (not warmup_window or seen + t > window)
        p = p_model[t]
        if enabled:
            h = torch.stack([k for k, _ in pairs])  # [m, d]
            scores = flatness * _similarity(hidden[t][None], h, similarity)[0]  # [m]
            attn = torch.softmax(scores, dim=0)
            p_cache = torch.zeros_like(p)
            for a, (_, w) in zip(attn, pairs):
                p_cache[w] += a
            p = (1 - mix) * p + mix * p_cache
        out.append(p)
        keys.append((hidden[t], next_tokens[t]))
    return torch.stack(out)


def cache_mix(p_model: torch.Tensor, hidden: torch.Tensor, next_tokens: torch.Tensor, mem_hidden: torch.Tensor,
              mem_tokens: torch.Tensor, seen: int, window: int, flatness: float, mix: float,
              similarity: str = CacheSettings.similarity,
              warmup_window: bool = CacheSettings.warmup_window) -> torch.Tensor:
    """Same as :func:`cache_mix_reference` for a whole chunk at once. Shapes as there; returns [T, V]."""
    T, M = p_model.shape[0], mem_hidden.shape[0]
    keys = torch.cat([mem_hidden, hidden])  # [M + T, d]; key j has global index seen - M + j
    tokens = torch.cat([mem_tokens, next_tokens])  # [M + T]
    scores = flatness * _similarity(hidden, keys, similarity)  # [T, M + T]
    q = torch.arange(T, device=p_model.device)[:, None] + seen  # global index of each query
    k = torch.arange(M + T, device=p_model.device)[None, :] + (seen - M)
    valid = (k < q) & (k >= q - window)  # strictly earlier pairs, within the window
    attn = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=1)
    has = valid.any(1)
    if warmup_window:
        has = has & (q[:, 0] > window)
    attn = torch.where(has[:, None], attn, torch.zeros_like(attn))  # rows with no pair: softmax gave NaN
    p_cache = torch.zeros_like(p_model).scatter_add_(1, tokens[None].expand(T, -1), attn.to(p_model.dtype))
    mixed = (1 - mix) * p_model + mix * p_cache
    return torch.where(has[:, None], mixed, p_model)


def forward_hidden(model, tokens: torch.Tensor, state):
    """(logits, state, hidden [B, T, d]): hidden = the input of the output layer.

    Uses ``model.forward_hidden`` when the model has one (the Hugging Face adapter), else a hook on
    ``model.norm`` (our LanguageModel's final RMSNorm).
    """
    if hasattr(model, "forward_hidden"):
        out, hidden = model.forward_hidden(tokens, state)
        return out.logits, out.state, hidden
    norm = getattr(model, "norm", None)
    if norm is None:
        raise UserError(f"the neural cache cannot find the final hidden state of {type(model).__name__}")
    captured = {}
    handle = norm.register_forward_hook(lambda mod, inp, out: captured.__setitem__("h", out))
    try:
        out = model(tokens, state)
    finally:
        handle.remove()
    return out.logits, out.state, captured["h"]


@dataclass
class CacheState:
    model_state: object
    mem_hidden: torch.Tensor  # [M, d], M <= window
    mem_tokens: torch.Tensor  # [M]
    seen: int  # pairs seen in total
    pending: torch.Tensor  # last consumed token, then unscored tokens


class NeuralCache:
    """Score a stream with the model mixed with a continuous cache of its own hidden states.

    Args (defaults: :class:`CacheSettings`):
        window: pairs kept.
        flatness: omega (theta in ``pointer.py``).
        mix: lambda_c.
        similarity: "dot" (paper) or "cosine" (``pointer.py`` variant).
        warmup_window: only use the cache after more than ``window`` pairs.
        segment_len: tokens per model call; context: KV-cache bound (as ``DynamicEvaluator``).
    """

    def __init__(self, model, window: int = CacheSettings.window, flatness: float = CacheSettings.flatness,
                 mix: float = CacheSettings.mix, similarity: str = CacheSettings.similarity,
                 warmup_window: bool = CacheSettings.warmup_window, segment_len: int = SCORING_SEGMENT_LEN,
                 context: int | None = None):
        if window < 1:
            raise UserError(f"cache window must be >= 1, got {window}")
        if not 0 <= mix <= 1:
            raise UserError(f"cache mix (lambda) must be in [0, 1], got {mix}")
        if context is not None and context <= segment_len:
            raise UserError(f"context ({context}) must be longer than the segment length ({segment_len})")
        _similarity(torch.zeros(1, 1), torch.zeros(1, 1), similarity)  # validates the name
        self.model = model
        self.window, self.flatness, self.mix = int(window), float(flatness), float(mix)
        self.similarity, self.warmup_window = similarity, warmup_window
        self.segment_len, self.context = int(segment_len), context
        self.device = next(model.parameters()).device

    def metadata(self) -> dict:
        return {"method": "neural cache (Grave et al. 2017)", "window": self.window, "flatness": self.flatness,
                "mix": self.mix, "similarity": self.similarity, "warmup_window": self.warmup_window,
                "segment_len": self.segment_len, "context": self.context}

    @torch.no_grad()
    def evaluate(self, tokens, state: CacheState | None = None, final: bool = True, keep_token_losses: bool = True,
                 progress: Progress | None = None):
        """Like ``DynamicEvaluator.evaluate``: returns ``(EvalResult, CacheState)``; pieces equal one call."""
        tokens = as_token_stream(tokens)
        seq = torch.cat([state.pending, tokens]) if state is not None else tokens
        if state is None:
            ms, mem_h, mem_y, seen = None, None, torch.zeros(0, dtype=torch.long, device=self.device), 0
        else:
            ms, mem_h, mem_y, seen = state.model_state, state.mem_hidden, state.mem_tokens, state.seen
        was_training = self.model.training
        self.model.eval()
        result = EvalResult(0.0, 0)
        L, n, pos = self.segment_len, seq.numel() - 1, 0
        try:
            while pos < n and (final or n - pos >= L):
                m = min(L, n - pos)
                x = seq[None, pos : pos + m].to(self.device)
                y = seq[pos + 1 : pos + m + 1].to(self.device)
                logits, new_state, hidden = forward_hidden(self.model, x, ms)
                h = hidden[0].float()  # [m, d]
                if mem_h is None:
                    mem_h = h.new_zeros(0, h.shape[1])
                p_model = torch.softmax(logits[0].float(), dim=-1)  # [m, V]
                p = cache_mix(p_model, h, y, mem_h, mem_y, seen, self.window, self.flatness, self.mix,
                              self.similarity, self.warmup_window)
                tok_nll = -torch.log(p.gather(1, y[:, None])[:, 0])
                result.nll += tok_nll.sum().item()
                result.tokens += m
                if keep_token_losses:
                    result.token_losses.extend(tok_nll.tolist())
                mem_h = torch.cat([mem_h, h])[-self.window :]
                mem_y = torch.cat([mem_y, y])[-self.window :]
                seen += m
                ms = carry_state(self.model, new_state, self.context, L)
                pos += m
                if progress is not None:
                    progress.update(m)
        finally:
            self.model.train(was_training)
        if mem_h is None:
            mem_h = torch.zeros(0, 0, device=self.device)
        return result, CacheState(ms, mem_h, mem_y, seen, seq[pos:].clone())

    def evaluate_documents(self, documents, keep_token_losses: bool = False, progress: bool = False) -> EvalResult:
        """Each document from an empty cache and a fresh model state; the summed result."""
        docs = [as_token_stream(d) for d in documents]
        bar = Progress(sum(max(0, d.numel() - 1) for d in docs), "tok", desc="cache", enabled=progress)
        total = EvalResult(0.0, 0)
        for d in docs:
            r, _ = self.evaluate(d, keep_token_losses=keep_token_losses, progress=bar)
            total.add(r)
        bar.close()
        return total
