"""Building blocks shared by the model and the mechanisms: RMSNorm, SwiGLU MLP, rotary embeddings, short causal convolution."""

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

    y = x̂ w,  x̂ = x r,  r = (mean(x^2) + eps)^(-1/2)
    dx = r (g w - x̂ mean(g w x̂)),   dw = sum over rows of g x̂
    """

    generate_vmap_rule = True  # works under torch.func.vmap (batched dynamic evaluation)

    @staticmethod
    def forward(x, weight, eps):
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # [..., 1]
        x_hat = x * r
        return x_hat * weight, x_hat, r  # x_hat and r are returned only so setup_context can save them

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, weight, _ = inputs
        _, x_hat, r = output
        ctx.mark_non_differentiable(x_hat, r)
        ctx.save_for_backward(x_hat, weight, r)

    @staticmethod
    def backward(ctx, g, _g_x_hat, _g_r):
        x_hat, weight, r = ctx.saved_tensors
        gw = g * weight
        mean_gw_xhat = torch.linalg.vecdot(gw, x_hat).unsqueeze(-1) / x_hat.shape[-1]  # fused multiply-reduce
        dx = gw.sub_(x_hat * mean_gw_xhat).mul_(r)
        dw = (g * x_hat).reshape(-1, x_hat.shape[-1]).sum(0)
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

    Each pair (x_2j, x_2j+1) of a head is read as the complex number z_j = x_2j + i x_2j+1 and
    rotated: z_j <- z_j exp(i t theta_j), theta_j = base^(-2j/D) (the interleaved RoFormer / GPT-J
    layout). One complex multiply forward and one backward, where the half-split layout costs five
    elementwise kernels each way (~10% of a small Transformer's CPU training step). The angles are
    computed for each call's positions only, so streaming a million tokens keeps no table that grows.
    """

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """x: [..., T, D] -> same shape, rotated for positions start..start+T-1."""
        T, D = x.shape[-2], x.shape[-1]
        t = torch.arange(start, start + T, device=x.device, dtype=torch.float32)
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32  # no complex bf16
        angles = torch.outer(t, self.inv_freq).to(compute)  # [T, D/2]
        rotation = torch.polar(torch.ones_like(angles), angles)  # complex64 / complex128
        xc = x.to(compute)
        if xc.stride(-1) != 1 or any(s % 2 for s in xc.stride()[:-1]):
            xc = xc.contiguous()
        z = torch.view_as_complex(xc.unflatten(-1, (D // 2, 2)))  # [..., T, D/2] complex
        return torch.view_as_real(z * rotation).flatten(-2).to(x.dtype)  # [..., T, D/2, 2] -> [..., T, D]


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, cache: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise convolution ``y_t = sum_{i<W} weight[:, 0, W-1-i] * x_{t-i}`` of ``x [B, T, D]``.

    ``weight [D, 1, W]``; ``cache [B, W-1, D]`` holds the W - 1 inputs before ``x`` (None: zeros, the
    start of a sequence). Returns ``(y [B, T, D], new cache [B, W-1, D])``, so one call equals several.
    """
    width = weight.shape[-1]
    if cache is None:
        cache = x.new_zeros(x.shape[0], width - 1, x.shape[2])
    ext = torch.cat([cache.to(x.dtype), x], dim=1)  # [B, W-1+T, D]
    y = F.conv1d(ext.transpose(1, 2), weight.to(x.dtype), groups=x.shape[2])  # [B, D, T]
    return y.transpose(1, 2), ext[:, ext.shape[1] - (width - 1) :]


class ShortConv(nn.Module):
    """Residual token mixing over the last ``width`` tokens: ``x_t <- x_t + sum_{i<W} w_i * x_{t-i}`` per channel.

    The short convolution of Mamba / Gated DeltaNet, placed on the residual stream at the start of each
    block (Allen-Zhu's "Canon layers", 2025). It hands every position a summary of the few tokens before
    it, the previous-token step that attention otherwise has to learn before it can match a multi-token
    key (an induction head, a needle's "ID-3fa9 is"). State: the last W - 1 inputs, ``[B, W-1, D]``.
    """

    def __init__(self, d_model: int, width: int):
        super().__init__()
        if width < 2:
            raise ValueError(f"short convolution width must be >= 2, got {width}")
        self.weight = nn.Parameter(torch.empty(d_model, 1, width))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)  # nn.Conv1d's default init

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [B, T, D]`` -> (the conv's output ``[B, T, D]`` to add to the stream, new cache)."""
        return causal_conv1d(x, self.weight, cache)
