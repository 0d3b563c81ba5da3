"""Per-token negative log-likelihood, the one number every scorer here reports.

    nll_t = -log softmax(logits_t)[target_t]        (nats)

Computed in fp32 (fp64 logits stay fp64, for exactness tests), whatever the model's compute dtype.
:func:`log_probs` is the log-softmax in that dtype, for a scorer that also needs the whole
distribution (the neural cache on top of dynamic evaluation mixes it); :func:`nll_at` reads the
targets' entries from it; :func:`token_nll` is the two in one.
"""

from __future__ import annotations

import torch


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """log softmax over the last axis (the vocabulary), in fp32, or fp64 for fp64 logits."""
    return torch.log_softmax(logits if logits.dtype == torch.float64 else logits.float(), dim=-1)


def nll_at(logp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log p(target) per position from log-probabilities ``[..., T, V]`` and targets ``[..., T]`` (int64)."""
    return -logp.gather(-1, targets[..., None])[..., 0]


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log p(target) per position: logits ``[..., T, V]``, targets ``[..., T]`` (int64) -> ``[..., T]``."""
    return nll_at(log_probs(logits), targets)
