"""Per-token negative log-likelihood, the one number every scorer here reports.

    nll_t = -log softmax(logits_t)[target_t]        (nats)

Computed in fp32 (fp64 logits stay fp64, for exactness tests), whatever the model's compute dtype.
"""

from __future__ import annotations

import torch


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log p(target) per position: logits ``[..., T, V]``, targets ``[..., T]`` (int64) -> ``[..., T]``."""
    logp = torch.log_softmax(logits if logits.dtype == torch.float64 else logits.float(), dim=-1)
    return -logp.gather(-1, targets[..., None])[..., 0]
