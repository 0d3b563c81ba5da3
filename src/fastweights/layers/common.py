"""Building blocks shared by the model and the mechanisms: RMSNorm, SwiGLU MLP, rotary embeddings, short causal
convolution, and what padding (an ``attention_mask``, issue 33) needs: each row's real positions, a
convolution that skips padding, and running a part row by row on each row's real tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from fastweights.ops.linear import Linear
from fastweights.ops.recompute import recomputes
from fastweights.ops.swiglu import swiglu


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
        self.gate_up = Linear(d_model, 2 * hidden, bias=False)
        self.down = Linear(hidden, d_model, bias=False)
        self.down.is_residual_proj = True  # scaled init, see LanguageModel._init_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # swiglu keeps [B, T, 2F] for its backward and recomputes silu(gate) there: one [B, T, F] tensor less
        # than autograd's plain form keeps (fastweights.ops.swiglu)
        return self.down(swiglu(self.gate_up(x)))


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
        self.base = base
        self.register_buffer("inv_freq", self.frequencies(head_dim, base, torch.float32), persistent=False)

    @staticmethod
    def frequencies(head_dim: int, base: float, dtype: torch.dtype, device=None) -> torch.Tensor:
        """The rotation frequencies ``base ** (-2i / head_dim)``, i = 0 .. head_dim/2 - 1, computed in ``dtype``."""
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=dtype, device=device) / head_dim))

    def forward(self, x: torch.Tensor, start: int | torch.Tensor) -> torch.Tensor:
        """x: [..., T, D] -> same shape, rotated for positions start..start+T-1; or, with ``start`` a tensor of
        positions [B, T] (each row's own, as under padding), x [B, H, T, D] rotated for those."""
        T, D = x.shape[-2], x.shape[-1]
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32  # no complex bf16
        # fp64 inputs get fp64 angles (frequencies included): no fp32 rounding, whose last bits differ between
        # CPU kernels (the behaviour probes run fp64); every other dtype keeps the fp32 angles it was trained with
        inv_freq = self.inv_freq if compute == torch.float32 else self.frequencies(D, self.base, torch.float64, x.device)
        if isinstance(start, torch.Tensor):  # per-row positions [B, T]
            t = start.to(device=x.device, dtype=inv_freq.dtype)
            angles = (t.unsqueeze(-1) * inv_freq).to(compute).unsqueeze(1)  # [B, 1, T, D/2]
        else:
            t = torch.arange(start, start + T, device=x.device, dtype=inv_freq.dtype)
            angles = torch.outer(t, inv_freq).to(compute)  # [T, D/2]
        rotation = torch.polar(torch.ones_like(angles), angles)  # complex64 / complex128
        xc = x.to(compute)
        if xc.stride(-1) != 1 or any(s % 2 for s in xc.stride()[:-1]):
            xc = xc.contiguous()
        z = torch.view_as_complex(xc.unflatten(-1, (D // 2, 2)))  # [..., T, D/2] complex
        return torch.view_as_real(z * rotation).flatten(-2).to(x.dtype)  # [..., T, D/2, 2] -> [..., T, D]


def real_positions(mask: torch.Tensor, start) -> torch.Tensor:
    """Each real token's position in its row's stream, ``[B, T]`` long: ``start`` (an int or ``[B]``, the
    row's tokens before this call) plus the real tokens before it in the call; a padded position gets the
    position of the next real token (it is never read)."""
    before = torch.cumsum(mask.long(), 1) - mask.long()
    start = torch.as_tensor(start, device=mask.device).long()
    return before + (start.view(-1, 1) if start.dim() else start)


def compact_real(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's real entries moved to the end of the row, in order, padding (zeroed) in front:
    ``(x' [B, T, ...], index [B, T])`` with ``x'[b, j] = x[b, index[b, j]]``. For a left-padded row this is the
    row itself with its padding zeroed. The real token at ``i`` lands at ``T - n_b + (real tokens before
    i)``; :func:`uncompact` puts values of those slots back at the real positions."""
    order = torch.argsort(mask.to(torch.int8), dim=1, stable=True)  # padding first, then the real ones in order
    keep = mask.gather(1, order)
    idx = order.view(*order.shape, *([1] * (x.dim() - 2))).expand_as(x)
    return x.gather(1, idx) * keep.view(*keep.shape, *([1] * (x.dim() - 2))).to(x.dtype), order


def uncompact(y: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`compact_real`'s move: ``out[b, order[b, j]] = y[b, j]``."""
    idx = order.view(*order.shape, *([1] * (y.dim() - 2))).expand_as(y)
    return torch.empty_like(y).scatter(1, idx, y)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, cache: torch.Tensor | None,
                  mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise convolution ``y_t = sum_{i<W} weight[:, 0, W-1-i] * x_{t-i}`` of ``x [B, T, D]``.

    ``weight [D, 1, W]``; ``cache [B, W-1, D]`` holds the W - 1 inputs before ``x`` (None: zeros, the
    start of a sequence). Returns ``(y [B, T, D], new cache [B, W-1, D])``, so one call equals several.

    ``mask`` [B, T] (True = real token; None = all real): the window of a real token spans the W - 1 real
    inputs before it (the cache, then the row's earlier real tokens), as if the padding were not there; the
    new cache holds the last real inputs. Done by moving each row's real inputs to the end of the row
    (:func:`compact_real`), so a left-padded row is convolved as it stands; outputs at padding are zero.
    """
    width = weight.shape[-1]
    if cache is None:
        cache = x.new_zeros(x.shape[0], width - 1, x.shape[2])
    if mask is not None:
        # padding moved in front of the cache: it slides out of every real token's window (zeros in front
        # of a fresh cache's zeros are what an unpadded row starts with)
        xc, order = compact_real(x, mask)
        pad = (~mask).sum(1)  # [B]
        ext = torch.cat([cache.to(x.dtype), xc], dim=1)  # [B, W-1+T, D]: cache, zeroed padding, real inputs
        T, n = x.shape[1], width - 1
        j = torch.arange(n + T, device=x.device).unsqueeze(0)  # [1, W-1+T]
        # the padding (at n..n+pad) goes in front: position j reads ext[j - pad] past the padding, zeros before
        src = torch.where(j < pad.unsqueeze(1), j, torch.where(j < n + pad.unsqueeze(1), j - pad.unsqueeze(1), j))
        ext = ext.gather(1, src.unsqueeze(-1).expand(-1, -1, x.shape[2]))
        ext = ext * (j >= pad.unsqueeze(1)).unsqueeze(-1).to(ext.dtype)
        y = F.conv1d(ext.transpose(1, 2), weight.to(x.dtype), groups=x.shape[2]).transpose(1, 2)
        y = uncompact(y, order) * mask.unsqueeze(-1).to(y.dtype)
        return y, ext[:, ext.shape[1] - n :]
    ext = torch.cat([cache.to(x.dtype), x], dim=1)  # [B, W-1+T, D]
    y = F.conv1d(ext.transpose(1, 2), weight.to(x.dtype), groups=x.shape[2])  # [B, D, T]
    return y.transpose(1, 2), ext[:, ext.shape[1] - (width - 1) :]


def causal_conv1d_silu_reference(x: torch.Tensor, weight: torch.Tensor, cache: torch.Tensor | None,
                                 mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(silu(y), new cache)`` of :func:`causal_conv1d`, through autograd's own ops (the plain form)."""
    y, new_cache = causal_conv1d(x, weight, cache, mask)
    return F.silu(y), new_cache


def causal_conv1d_silu(x: torch.Tensor, weight: torch.Tensor, cache: torch.Tensor | None,
                       mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(silu(y), new cache)`` of :func:`causal_conv1d` (the gated delta rule's q, k and v). With gradients the
    convolution is run again in the backward (``torch.utils.checkpoint``), so autograd keeps its input ``x`` alone,
    not also the padded copy the convolution reads and the output silu reads: two [B, T, D] tensors become one
    (depthwise, ``W`` taps: a few multiply-adds per value, against the projection's ``d_model``)."""
    if recomputes(x, weight, cache):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(causal_conv1d_silu_reference, x, weight, cache, mask, use_reentrant=False)
    return causal_conv1d_silu_reference(x, weight, cache, mask)


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

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [B, T, D]`` -> (the conv's output ``[B, T, D]`` to add to the stream, new cache); padding
        (``attention_mask`` 0) is skipped, see :func:`causal_conv1d`."""
        return causal_conv1d(x, self.weight, cache, attention_mask)


def per_row(run, x: torch.Tensor, mask: torch.Tensor, states: list) -> tuple[torch.Tensor, list]:
    """``run(x_b [1, n_b, C], state_b) -> (y_b [1, n_b, C'], state_b')`` on each row's real tokens alone (``mask``
    [B, T], True = real): ``(y [B, T, C'] with zeros at padding, [state_b', ...])``. The exact way to pad a part
    whose positions or chunks cannot be shifted per row in one batched call (a row without real tokens
    keeps its state)."""
    ys, new_states = None, []
    for b in range(x.shape[0]):
        real = mask[b].nonzero().squeeze(1)
        if real.numel() == 0:
            new_states.append(states[b])
            continue
        y_b, s_b = run(x[b:b + 1, real], states[b])
        if ys is None:
            ys = y_b.new_zeros(x.shape[0], x.shape[1], *y_b.shape[2:])
        ys[b, real] = y_b[0]
        new_states.append(s_b)
    return (x.new_zeros(x.shape) if ys is None else ys), new_states
