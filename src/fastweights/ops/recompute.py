"""Where an op that recomputes in its backward applies (``ops.swiglu``, ``ops.gated_rms_norm``,
``layers.common.causal_conv1d_silu``): such an op keeps fewer tensors for the backward through its own
``torch.autograd.Function`` or ``torch.utils.checkpoint``, and falls back to its plain form

- where autograd records nothing (grad mode off, or no input requiring grad): there is nothing to keep;
- under ``torch.compile``: its compiler makes its own recompute choices;
- under ``torch.func`` transforms (the model under ``vmap`` in batched dynamic evaluation): a Function without a
  vmap rule fails there, and so do checkpoint's saved-tensor hooks.
"""

from __future__ import annotations

import torch
from torch import Tensor


def recomputes(*tensors: Tensor | None) -> bool:
    """Whether a call on ``tensors`` (None ignored) takes the recomputing form (module docstring)."""
    given = [t for t in tensors if t is not None]
    return (torch.is_grad_enabled() and any(t.requires_grad for t in given) and not torch.compiler.is_compiling()
            and not any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in given))
