"""Fast weight programmer sequence mixer ("fwp"): linear attention and the delta rule as a layer.

Schlag, Irie, Schmidhuber 2021, "Linear Transformers Are Secretly Fast Weight Programmers"
(arXiv 2102.11174). A slow network (the projections) programs, token by token, a fast weight
S in R^{d_dot x d_head} per head (project layout [B, H, K, V]); the layer's output is a read of it:

    q_t, k_t, v_t, beta_t = W_q x_t, W_k x_t, W_v x_t, sigmoid(w_beta^T x_t)    (one bias-free projection)
    phi_q, phi_k = phi(q_t), phi(k_t)        phi in {ELU+1, DPFP-nu, FAVOR+, identity}
    sum normalisation: phi <- phi / sum(phi) (App. A.2; lmtool-fwp applies it to keys and queries)
    update rule, one of
        sum          S_t = S_{t-1} + phi_k v_t^T                                 (linear attention)
        gated        S_t = (1 - beta_t) S_{t-1} + beta_t phi_k v_t^T             (Peng et al. 2021)
        delta        S_t = S_{t-1} + beta_t phi_k (v_t - S_{t-1}^T phi_k)^T      (eq. 24)
        gated_delta  S_t = a_t (I - beta_t phi_k phi_k^T) S_{t-1} + beta_t phi_k v_t^T,
                     log a_t = -exp(A_log) softplus(w_a^T x_t + dt_bias)       (Gated DeltaNet's gate)
    o_t = S_t^T phi_q / sqrt(d_head)          (the read sees this step's write; lmtool's 1/sqrt(d_head))
        or, for the sum rule with normalize=True, S_t^T phi_q / (z_t^T phi_q + eps), z_t = sum_{j<=t} phi_k
    y_t = W_o [o_t over heads]

Defaults: rule "delta" with DPFP nu=1 and sum normalisation. The delta rule is the paper's
contribution and was the better rule in every experiment it reports (synthetic retrieval with
overwrites, WT103 language modelling); DPFP is its deterministic feature map: nu=1 doubles d_dot
(2 * d_head, twice the capacity of ELU+1 at twice the state) without FAVOR+'s sampling noise, and App.
D.3 found that nu=2 did not help language modelling. Sum normalisation keeps |phi|_2 <= 1, so the delta
recurrence is stable (lmtool-fwp: "crucial for stable training").

State (dict, carried across calls; one call equals several with the state carried):
    "S": [B, H, d_dot, d_head] fp32 fast weight; "z": [B, H, d_dot] key sum (sum rule with normalize).

Backends of the delta rules (``backend``, see :mod:`fastweights.ops.fla_backend`): on CUDA under
autocast, or with fp16/bf16 weights, "auto" runs flash-linear-attention's kernels: phi_q, phi_k, beta
and the decay are computed in fp32 (as everywhere here) and q, k, v, beta are cast to the autocast
dtype right before the kernel, the fast weight S staying fp32; where fla refuses the gated backward
(Hopper with 3.4 <= Triton < 3.7.1 and no TileLang) training runs the chunkwise form compiled with torch.compile.

Padding (``attention_mask`` [B, T], 0 = padding): a padded step leaves the state as it was: its key
feature phi_k is zeroed (no write, the normaliser z does not move; the sum rule's S + phi_k v^T and the
delta rule's S + beta phi_k (v - S^T phi_k)^T are then S), its beta is 0 (the gated rule's (1 - beta) S
+ beta ... is S) and its log decay 0 (a decay of 1). The rules have no positions, so nothing else changes;
a padded step's read is ignored.

FAVOR+'s random matrix is a buffer (saved with the model); with ``redraw=True`` it is redrawn at each
training forward (as lmtool-fwp), never at evaluation, so streaming evaluation stays consistent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastweights.components import register_mixer
from fastweights.core.errors import UserError
from fastweights.ops.delta_rule import delta_rule
from fastweights.ops.fla_backend import BACKENDS
from fastweights.ops.feature_maps import (
    FEATURE_MAPS,
    apply_feature_map,
    feature_dim,
    orthogonal_random_features,
    sum_normalize,
)
from fastweights.ops.linear_attention import compute_dtype, gated_rule, linear_attention
from fastweights.ops.linear import Linear

RULES = ("sum", "gated", "delta", "gated_delta")


@dataclass
class FWPOptions:
    """Options of the "fwp" mixer (``[model.options.fwp]``)."""

    rule: str = "delta"  # sum | gated | delta | gated_delta
    feature_map: str = "dpfp"  # elu1 | dpfp | favor | identity
    nu: int = 1  # DPFP order: d_dot = 2 * head_dim * nu
    n_features: int = 16  # FAVOR+ random features m: d_dot = 2 * m (lmtool's default proj_dim)
    redraw: bool = False  # FAVOR+: draw a new random matrix at every training forward
    sum_norm: bool = True  # phi <- phi / sum(phi) for keys and queries
    l2_norm: bool = False  # phi <- phi / |phi|_2 instead (DeltaNet-style; for feature_map="identity")
    normalize: bool = False  # sum rule only: divide the read by z_t^T phi(q_t) (Katharopoulos et al.)
    head_dim: int = 0  # 0 -> d_model // n_heads
    chunk_size: int = 32  # 32 measured fastest on CPU (T = 128..2048); fla ignores it
    backend: str = "auto"  # delta rules: auto | torch | compiled | fla


def gdn_log_decay(a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Gated DeltaNet's (Mamba2-style) log decay ``-exp(A_log) * softplus(a + dt_bias)``, ``[B, T, H]``, in fp32."""
    cd = compute_dtype(a)
    return -torch.exp(a_log.to(cd)) * F.softplus(a.to(cd) + dt_bias.to(cd))


def init_gdn_gate(n_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Initial ``(A_log, dt_bias)`` as flash-linear-attention's GatedDeltaNet: A ~ U(0, 16),
    dt log-uniform in [1e-3, 1e-1] and dt_bias = softplus^{-1}(dt)."""
    a = torch.empty(n_heads).uniform_(0, 16)
    dt = torch.exp(torch.rand(n_heads) * (math.log(0.1) - math.log(0.001)) + math.log(0.001)).clamp_min(1e-4)
    dt_bias = dt + torch.log(-torch.expm1(-dt))  # inverse of softplus
    return torch.log(a), dt_bias


@register_mixer("fwp", FWPOptions)
class FastWeightProgrammer(nn.Module):
    """Fast weight programmer mixer: ``x [B, T, d_model] -> (y [B, T, d_model], state)``.

    Built as ``FastWeightProgrammer(d_model=..., n_heads=..., options=FWPOptions(...))``; see the module
    docstring for the equations and :class:`FWPOptions` for the options.
    """

    # facts for the project's checks and the memory estimate (fastweights.components, "what a component declares")
    test_variants = {f"{rule}-{fm}": {"rule": rule, "feature_map": fm, "chunk_size": 4, **extra}
                     for rule in ("sum", "gated", "delta", "gated_delta")
                     for fm, extra in (("elu1", {}), ("dpfp", {"nu": 2}), ("favor", {"n_features": 5}),
                                       ("identity", {"sum_norm": False, "l2_norm": True}))}
    test_variants["sum-dpfp-normalize"] = {"rule": "sum", "feature_map": "dpfp", "normalize": True, "chunk_size": 4}
    # L2-normalised keys with beta in (0, 1) make the delta update a contraction along each key (DeltaNet);
    # a decay forgets (the gated rules)
    bounded_variants = {"delta-l2": {"rule": "delta", "feature_map": "identity", "sum_norm": False, "l2_norm": True},
                        "gated-delta-l2": {"rule": "gated_delta", "feature_map": "identity", "sum_norm": False,
                                           "l2_norm": True},
                        "gated-delta-dpfp": {"rule": "gated_delta", "feature_map": "dpfp"},
                        "gated-dpfp": {"rule": "gated", "feature_map": "dpfp"}}
    # the sum rule forgets nothing; the delta rule with sum-normalised non-negative features has short keys
    # (|phi(k)|^2 ~ 1 / d_dot), so each write erases little and the state keeps growing along a stream
    growing_variants = {"sum-dpfp": {"rule": "sum", "feature_map": "dpfp"},
                        "delta-dpfp-sum-norm": {"rule": "delta", "feature_map": "dpfp"}}

    @staticmethod
    def state_floats(o, *, d_model, n_heads, seq_len, **_):  # S [H, d_dot, hd] (+ z), and S at each chunk start
        hd = o.head_dim or d_model // n_heads
        d_dot = feature_dim(o.feature_map, hd, nu=o.nu, n_features=o.n_features)
        return {"carried": n_heads * d_dot * hd + (n_heads * d_dot if o.normalize else 0),
                "backward": math.ceil(seq_len / o.chunk_size) * n_heads * d_dot * hd}

    def __init__(self, d_model: int, n_heads: int, options: FWPOptions | None = None):
        super().__init__()
        opt = options or FWPOptions()
        if opt.rule not in RULES:
            raise UserError(f"fwp: unknown rule {opt.rule!r}; choose one of {', '.join(RULES)}")
        if opt.feature_map not in FEATURE_MAPS:
            raise UserError(f"fwp: unknown feature_map {opt.feature_map!r}; choose one of {', '.join(FEATURE_MAPS)}")
        if opt.sum_norm and opt.l2_norm:
            raise UserError("fwp: choose at most one of sum_norm and l2_norm")
        if opt.feature_map == "identity" and opt.sum_norm:
            raise UserError("fwp: feature_map='identity' can be negative, so sum_norm is undefined; use l2_norm=true")
        if opt.rule in ("delta", "gated_delta") and not (opt.sum_norm or opt.l2_norm):
            raise UserError(f"fwp: rule {opt.rule!r} needs normalised keys (sum_norm or l2_norm), else it can diverge")
        if opt.normalize and opt.rule != "sum":
            raise UserError("fwp: normalize=true is defined for rule='sum' only")
        head_dim = opt.head_dim or d_model // n_heads
        if head_dim < 1:
            raise UserError(f"fwp: head_dim must be positive (d_model={d_model}, n_heads={n_heads})")
        if opt.backend not in BACKENDS:
            raise UserError(f"fwp: unknown backend {opt.backend!r}; choose one of {', '.join(BACKENDS)}")
        if opt.nu < 1 or opt.n_features < 1 or opt.chunk_size < 1:
            raise UserError("fwp: nu, n_features and chunk_size must be positive")
        self.options = opt
        self.n_heads = n_heads
        self.head_dim = head_dim
        self.d_dot = feature_dim(opt.feature_map, head_dim, nu=opt.nu, n_features=opt.n_features)
        self.uses_beta = opt.rule != "sum"
        self.uses_decay = opt.rule == "gated_delta"
        # One bias-free projection to q, k, v (and beta, and the decay gate), as lmtool-fwp's qkvb_net.
        self.n_scalars = int(self.uses_beta) + int(self.uses_decay)
        self.qkv = Linear(d_model, n_heads * (3 * head_dim + self.n_scalars), bias=False)
        self.out = Linear(n_heads * head_dim, d_model, bias=False)
        self.out.is_residual_proj = True  # scaled init in LanguageModel, like the attention output
        if self.uses_decay:
            a_log, dt_bias = init_gdn_gate(n_heads)
            self.A_log = nn.Parameter(a_log)
            self.dt_bias = nn.Parameter(dt_bias)
        if opt.feature_map == "favor":
            self.register_buffer("omega", orthogonal_random_features(head_dim, opt.n_features))
        else:
            self.omega = None

    def initial_state(self, batch_size: int, device=None) -> dict:
        """A fresh (all-zero) state for ``batch_size`` sequences."""
        dtype = torch.float64 if self.out.weight.dtype == torch.float64 else torch.float32
        state = {"S": torch.zeros(batch_size, self.n_heads, self.d_dot, self.head_dim, device=device, dtype=dtype)}
        if self.options.normalize:
            state["z"] = torch.zeros(batch_size, self.n_heads, self.d_dot, device=device, dtype=dtype)
        return state

    def _phi(self, x: torch.Tensor) -> torch.Tensor:
        opt = self.options
        x = x.to(compute_dtype(x))  # features in fp32 (fp64 stays fp64)
        phi = apply_feature_map(opt.feature_map, x, nu=opt.nu, omega=self.omega)
        if opt.sum_norm:
            phi = sum_normalize(phi)
        elif opt.l2_norm:
            phi = F.normalize(phi, dim=-1, eps=1e-6)
        return phi

    def forward(self, x: torch.Tensor, state: dict | None = None,
                attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """``x [B, T, d_model]``, ``state`` None (fresh) or the dict returned by the previous call;
        ``attention_mask`` [B, T] (0 = padding, never written; see the module docstring)."""
        opt = self.options
        b, t, _ = x.shape
        h, d = self.n_heads, self.head_dim
        if state is None:
            state = self.initial_state(b, device=x.device)
        if self.omega is not None and opt.redraw and self.training:
            self.omega.copy_(orthogonal_random_features(d, opt.n_features, device=x.device))
        proj = self.qkv(x).view(b, t, h, 3 * d + self.n_scalars)  # [B, T, H, 3d + scalars]
        q, k, v = proj[..., :d], proj[..., d : 2 * d], proj[..., 2 * d : 3 * d]  # [B, T, H, d] each
        phi_q, phi_k = self._phi(q), self._phi(k)  # [B, T, H, d_dot], fp32
        real = None if attention_mask is None else attention_mask.view(b, t, 1)  # [B, T, 1] bool
        if real is not None:
            phi_k = phi_k * real.unsqueeze(-1).to(phi_k.dtype)  # a padded step writes nothing
        s0 = state["S"]
        if opt.rule == "sum":
            if opt.normalize:
                o, s = linear_attention(
                    phi_q, phi_k, v, normalize=True, initial_state=s0, initial_normalizer=state["z"],
                    output_final_state=True, chunk_size=opt.chunk_size,
                )
                new_state = {"S": s, "z": state["z"] + phi_k.sum(1)}
            else:
                o, s = linear_attention(
                    phi_q, phi_k, v, scale=d**-0.5, initial_state=s0, output_final_state=True,
                    chunk_size=opt.chunk_size,
                )
                new_state = {"S": s}
        else:
            beta = torch.sigmoid(proj[..., 3 * d].to(phi_k.dtype))  # [B, T, H]
            if real is not None:
                beta = beta * real.to(beta.dtype)
            if opt.rule == "gated":
                o, s = gated_rule(
                    phi_q, phi_k, v, beta, scale=d**-0.5, initial_state=s0, output_final_state=True,
                    chunk_size=opt.chunk_size,
                )
            else:
                log_decay = None
                if self.uses_decay:
                    log_decay = gdn_log_decay(proj[..., 3 * d + 1], self.A_log, self.dt_bias)  # [B, T, H]
                    if real is not None:
                        log_decay = log_decay * real.to(log_decay.dtype)  # no decay at a padded step
                o, s = delta_rule(
                    phi_q, phi_k, v, beta, scale=d**-0.5, initial_state=s0, output_final_state=True,
                    log_decay=log_decay, chunk_size=opt.chunk_size, backend=opt.backend,
                )
            new_state = {"S": s}
        y = self.out(o.to(x.dtype).reshape(b, t, h * d))  # [B, T, H*d] -> [B, T, d_model]
        return y, new_state
