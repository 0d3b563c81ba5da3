"""Gated DeltaNet sequence mixer ("gdn").

S. Yang, J. Kautz, A. Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule",
ICLR 2025 (arXiv 2412.06464); layer layout as flash-linear-attention's ``fla/layers/gated_deltanet.py``.
Per head, with the state S in R^{K x V} ([B, H, K, V]):

    q, k, v   = SiLU(ShortConv(W_q x)), SiLU(ShortConv(W_k x)), SiLU(ShortConv(W_v x))
                (causal depthwise convolution of width conv_size; without it, SiLU(W x))
    q, k      <- q / |q|_2, k / |k|_2                  (L2 normalisation keeps the recurrence stable)
    beta_t    = sigmoid(w_b^T x_t)
    g_t       = -exp(A_log) * softplus(w_a^T x_t + dt_bias)      (log decay, a_t = exp(g_t) in (0, 1])
    S_t       = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,     o_t = S_t^T q_t / sqrt(K)
    y         = W_o [RMSNorm(o_t) * SiLU(W_g x_t)]   (per-head RMSNorm; with use_gate=False, RMSNorm only)

The recurrence is :func:`fastweights.ops.delta_rule.delta_rule` with ``log_decay=g``: the chunkwise WY
form, or on CUDA under autocast (or with fp16/bf16 weights) flash-linear-attention's kernel, handed q,
k, v, beta in the autocast dtype (beta and g computed in fp32, g passed in fp32) and the fp32 state,
as :mod:`fastweights.ops.fla_backend` describes; where fla refuses the gated backward (Hopper with
3.4 <= Triton < 3.7.1 and no TileLang) training runs the chunkwise form compiled with torch.compile.

Padding (``attention_mask`` [B, T], 0 = padding): a padded step has beta = 0 and log decay 0, so
S_t = 1 (I - 0) S_{t-1} + 0 = S_{t-1} (no write, no decay); the short convolution skips padding (a real
token's window spans the real inputs before it, ``layers.common.causal_conv1d``); a padded step's output
is ignored.

State (dict): "S" [B, H, K, V] fp32 fast weight, and with the short convolution "conv"
[B, conv_size - 1, 2 H K + H V], the last inputs of the convolution, so that one call equals several.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastweights.components import register_mixer
from fastweights.core.errors import UserError
from fastweights.layers.common import causal_conv1d_silu
from fastweights.layers.fwp import gdn_log_decay, init_gdn_gate
from fastweights.ops.delta_rule import delta_rule
from fastweights.ops.fla_backend import BACKENDS
from fastweights.ops.gated_rms_norm import gated_rms_norm
from fastweights.ops.linear_attention import compute_dtype
from fastweights.ops.linear import Linear


@dataclass
class GDNOptions:
    """Options of the "gdn" mixer (``[model.options.gdn]``)."""

    head_dim: int = 0  # key/query dim per head K; 0 -> d_model // n_heads
    expand_v: float = 1.0  # value dim per head V = head_dim * expand_v (fla's default is 2 at 256-dim heads)
    use_short_conv: bool = True
    conv_size: int = 4
    use_gate: bool = True  # output gate SiLU(W_g x) after the RMSNorm
    norm_eps: float = 1e-5
    chunk_size: int = 32  # 32 measured fastest on CPU (T = 128..2048); fla ignores it
    backend: str = "auto"  # auto | torch | compiled | fla


@register_mixer("gdn", GDNOptions)
class GatedDeltaNet(nn.Module):
    """Gated DeltaNet mixer: ``x [B, T, d_model] -> (y [B, T, d_model], state)``."""

    # facts for the project's checks and the memory estimate (fastweights.components, "what a component declares")
    test_variants = {"conv-gate": {"chunk_size": 4, "backend": "torch"},
                     "plain": {"chunk_size": 4, "backend": "torch", "use_short_conv": False, "use_gate": False,
                               "expand_v": 2.0}}
    bounded_variants = {"default": {"backend": "torch"}}
    compute_dtype_state = ("conv",)  # the short convolution's last inputs; the fast weight S stays fp32

    @staticmethod
    def state_floats(o, *, d_model, n_heads, seq_len, **_):  # S [H, hk, hv], conv inputs; S at each chunk start
        hk = o.head_dim or d_model // n_heads
        hv = int(round(hk * o.expand_v))
        conv = (o.conv_size - 1) * n_heads * (2 * hk + hv) if o.use_short_conv else 0
        return {"carried": n_heads * hk * hv + conv, "backward": -(-seq_len // o.chunk_size) * n_heads * hk * hv}

    def __init__(self, d_model: int, n_heads: int, options: GDNOptions | None = None):
        super().__init__()
        opt = options or GDNOptions()
        head_k = opt.head_dim or d_model // n_heads
        head_v = int(round(head_k * opt.expand_v))
        if head_k < 1 or head_v < 1 or abs(head_k * opt.expand_v - head_v) > 1e-6:
            raise UserError(f"gdn: head_dim={head_k} with expand_v={opt.expand_v} must give positive integer dims")
        if opt.backend not in BACKENDS:
            raise UserError(f"gdn: unknown backend {opt.backend!r}; choose one of {', '.join(BACKENDS)}")
        if opt.use_short_conv and opt.conv_size < 1:
            raise UserError("gdn: conv_size must be >= 1")
        self.options = opt
        self.n_heads = n_heads
        self.head_k, self.head_v = head_k, head_v
        self.key_dim, self.value_dim = n_heads * head_k, n_heads * head_v
        self.qkv_dim = 2 * self.key_dim + self.value_dim
        self.qkv = Linear(d_model, self.qkv_dim, bias=False)  # q, k, v projections, concatenated
        self.a_proj = Linear(d_model, n_heads, bias=False)
        self.b_proj = Linear(d_model, n_heads, bias=False)
        a_log, dt_bias = init_gdn_gate(n_heads)
        self.A_log = nn.Parameter(a_log)
        self.dt_bias = nn.Parameter(dt_bias)
        if opt.use_short_conv:
            # Depthwise causal convolution over q, k and v together (identical to three separate ones).
            self.conv_weight = nn.Parameter(torch.empty(self.qkv_dim, 1, opt.conv_size))
            nn.init.kaiming_uniform_(self.conv_weight, a=5**0.5)  # nn.Conv1d's default init
        if opt.use_gate:
            self.g_proj = Linear(d_model, self.value_dim, bias=False)
        self.norm_weight = nn.Parameter(torch.ones(head_v))
        self.out = Linear(self.value_dim, d_model, bias=False)
        self.out.is_residual_proj = True  # scaled init in LanguageModel, like the attention output

    def initial_state(self, batch_size: int, device=None) -> dict:
        """A fresh state: zero fast weight and (with the short convolution) zero convolution inputs."""
        dtype = torch.float64 if self.out.weight.dtype == torch.float64 else torch.float32
        state = {"S": torch.zeros(batch_size, self.n_heads, self.head_k, self.head_v, device=device, dtype=dtype)}
        if self.options.use_short_conv:
            width = self.options.conv_size - 1
            state["conv"] = torch.zeros(batch_size, width, self.qkv_dim, device=device, dtype=dtype)
        return state

    def forward(self, x: torch.Tensor, state: dict | None = None,
                attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """``x [B, T, d_model]``, ``state`` None (fresh) or the dict returned by the previous call;
        ``attention_mask`` [B, T] (0 = padding, never written; see the module docstring)."""
        opt = self.options
        b, t, _ = x.shape
        h = self.n_heads
        if state is None:
            state = self.initial_state(b, device=x.device)
        qkv = self.qkv(x)  # [B, T, 2HK + HV]
        new_state = {}
        if opt.use_short_conv:  # a masked call skips padding: each real token's window spans real inputs only
            qkv, new_state["conv"] = causal_conv1d_silu(qkv, self.conv_weight, state["conv"], attention_mask)
        else:
            qkv = F.silu(qkv)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(b, t, h, self.head_k)  # [B, T, H, K]
        k = k.reshape(b, t, h, self.head_k)  # [B, T, H, K]
        v = v.reshape(b, t, h, self.head_v)  # [B, T, H, V]
        beta = torch.sigmoid(self.b_proj(x).to(compute_dtype(x)))  # [B, T, H]
        log_decay = gdn_log_decay(self.a_proj(x), self.A_log, self.dt_bias)  # [B, T, H]
        if attention_mask is not None:  # a padded step: no write (beta 0), no decay (log decay 0)
            real = attention_mask.view(b, t, 1)
            beta, log_decay = beta * real.to(beta.dtype), log_decay * real.to(log_decay.dtype)
        # q and k are L2-normalised inside the op (in fp32, or inside fla's kernel on CUDA).
        o, new_state["S"] = delta_rule(
            q, k, v, beta, initial_state=state["S"], output_final_state=True, log_decay=log_decay,
            chunk_size=opt.chunk_size, backend=opt.backend, qk_l2norm=True,
        )
        o = o.to(compute_dtype(x))  # norm and gate in fp32 (fp64 stays)
        if opt.use_gate:  # per-head RMSNorm and output gate, keeping o and the gate for the backward
            o = gated_rms_norm(o, self.g_proj(x).to(o.dtype).view(b, t, h, self.head_v), self.norm_weight,
                               opt.norm_eps)
        else:
            o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + opt.norm_eps) * self.norm_weight
        y = self.out(o.to(x.dtype).reshape(b, t, self.value_dim))  # [B, T, H*V] -> [B, T, d_model]
        return y, new_state
