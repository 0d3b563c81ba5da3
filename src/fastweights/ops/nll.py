"""Per-token negative log-likelihood, the one number every scorer here reports.

    nll_t = -log softmax(logits_t)[target_t]        (nats)

Computed in fp32 or wider: bf16/fp16 logits go to fp32, fp32 and fp64 logits keep their dtype
(:func:`upcast_logits`; the behaviour probes run fp64 end to end, so no fp32 rounding reaches a loss or
a gradient there). :func:`log_probs` is the log-softmax in that dtype, for a scorer that also needs the whole
distribution (the neural cache on top of dynamic evaluation mixes it); :func:`nll_at` reads the
targets' entries from it; :func:`token_nll` is the two in one.
"""

from __future__ import annotations

import torch


def upcast_logits(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` in the dtype every loss and log-probability here is computed in: fp32 for bf16/fp16,
    unchanged for fp32 and fp64."""
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """log softmax over the last axis (the vocabulary), in the dtype of :func:`upcast_logits`."""
    return torch.log_softmax(upcast_logits(logits), dim=-1)


def nll_at(logp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log p(target) per position from log-probabilities ``[..., T, V]`` and targets ``[..., T]`` (int64)."""
    return -logp.gather(-1, targets[..., None])[..., 0]


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log p(target) per position: logits ``[..., T, V]``, targets ``[..., T]`` (int64) -> ``[..., T]``."""
    return nll_at(log_probs(logits), targets)
