"""Building blocks shared by the model and the mechanisms: RMSNorm, SwiGLU MLP, rotary embeddings."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * g  (Zhang & Sennrich 2019), computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.float32, torch.float64):
            return _RMSNorm.apply(x, self.weight, self.eps)[0]
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).type_as(x)


class _RMSNorm(torch.autograd.Function):
    """RMSNorm with a hand-written backward (fewer saved tensors and kernels than autograd's).

    y = x r w,  r = (mean(x^2) + eps)^(-1/2)
    dx = r (g w - x r^2 mean(g w x)),   dw = sum over rows of g x r
    """

    generate_vmap_rule = True  # works under torch.func.vmap (batched dynamic evaluation)

    @staticmethod
    def forward(x, weight, eps):
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # [..., 1]
        return x * r * weight, r  # r is returned only so that setup_context can save it

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, _ = inputs
        _, r = output
        ctx.mark_non_differentiable(r)
        ctx.save_for_backward(x, weight, r)

    @staticmethod
    def backward(ctx, g, _g_r):
        x, weight, r = ctx.saved_tensors
        gw = g * weight
        xr = x * r
        dx = r * (gw - xr * (gw * xr).mean(-1, keepdim=True))
        dw = (g * xr).reshape(-1, x.shape[-1]).sum(0)
        return dx, dw, None


def swiglu_hidden(d_model: int, hidden: int = 0) -> int:
    """Default SwiGLU width: 8/3 d (same parameter count as a 4d GELU MLP), rounded up to 32."""
    if hidden:
        return hidden
    return 32 * ((8 * d_model // 3 + 31) // 32)


class SwiGLU(nn.Module):
    """MLP(x) = W_down (silu(W_gate x) * (W_up x))  (Shazeer 2020). Gate and up share one matmul."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.hidden = hidden
        self.gate_up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)
        self.down.is_residual_proj = True  # scaled init, see LanguageModel._init_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # [B, T, 2F] -> 2 x [B, T, F]
        return self.down(F.silu(gate) * up)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al. 2021) for absolute positions [start, start + T).

    Applied to the two halves of each head (the GPT-NeoX / Llama layout). The angles are computed
    for each call's positions only, so streaming a million tokens keeps no table that grows.
    """

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """x: [..., T, D] -> same shape, rotated for positions start..start+T-1."""
        T = x.shape[-2]
        t = torch.arange(start, start + T, device=x.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)  # [T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [T, D]
        return _Rotate.apply(x, emb.cos().to(x.dtype), emb.sin().to(x.dtype))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class _Rotate(torch.autograd.Function):
    """y = x cos + rotate_half(x) sin, with the transposed rotation in backward.

    A hand-written backward: autograd of the composite saves and replays five elementwise ops,
    which cost ~10% of a small Transformer's training step on the CPU.
    """

    generate_vmap_rule = True  # works under torch.func.vmap (batched dynamic evaluation)

    @staticmethod
    def forward(x, cos, sin):
        return x * cos + _rotate_half(x) * sin

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, cos, sin = inputs
        ctx.save_for_backward(cos, sin)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        gs1, gs2 = (g * sin).chunk(2, dim=-1)
        return g * cos + torch.cat([gs2, -gs1], dim=-1), None, None
