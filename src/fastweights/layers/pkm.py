"""Product Key Memory (PKM), Lample et al. 2019, "Large Memory Layers with Product Keys", arXiv 1907.05242.

A slow (ordinary, trained) sparse memory used in place of a block's MLP.  Per token x_t and head h::

    q_h   = RMSNorm(Linear^q(x_t))_h                          in R^{d_k}  (RMSNorm instead of the
                                                                            paper's BatchNorm, as FwPKM)
    s_h,I = product-key top-k of q_h over N = n^2 slots        (dot-product scores, eqs 6-7 of FwPKM)
    w_h   = softmax(s_h)                                       over the k slots of head h
    m_t   = sum_h sum_{i in I_h} w_h,i V[i]                    (all heads share the value table)
    y_t   = Linear^o(m_t * silu(Linear^s(x_t)))                ("swilu" output of the FwPKM code)

Defaults follow the static PKM of Zhao & Jones 2026 (App. C): 4 heads x top-32, 512^2 slots,
d_k = d_v = 512.  Only 2n sub-key scores and H k^2 candidates are computed per token, never N scores.

The value table can train with its own learning rate: the parameter carries ``lr_scale``
(``values_lr_scale``, multiplying the trainer's schedule) and ``no_weight_decay`` (when
``values_weight_decay`` is False), which the trainer's optimiser groups honour.  The defaults
(scale 1, decayed) are what the released FwPKM code's optimiser does with its PKM values.  The
gradient of the table is the dense embedding gradient (``[N, d_v]``).

Padding (``attention_mask``): nothing to do. The memory is slow (trained, never written while reading) and
reads each position alone, its RMSNorm normalising each query by itself; a padded position's output is
ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fastweights.components import register_memory
from fastweights.core.errors import UserError
from fastweights.ops.pkm import pkm_read, pkm_search, softmax_short
from fastweights.ops.linear import Linear


@dataclass
class PKMOptions:
    """Options of :class:`PKM`.

    ``n_subkeys`` n (N = n^2 slots), ``d_key`` d_k per head, ``d_value`` d_v, ``heads`` H, ``topk`` k,
    ``score`` "dot" (Lample) or "idw"; ``query_norm`` RMSNorm on the query; ``swilu`` gate the read
    with silu(Linear(x)) before the output projection (else a plain projection);
    ``values_lr_scale`` the value table's learning rate relative to the trainer's,
    ``values_weight_decay`` whether the trainer's weight decay applies to it.
    """

    n_subkeys: int = 512
    d_key: int = 512
    d_value: int = 512
    heads: int = 4
    topk: int = 32
    score: str = "dot"
    idw_eps: float = 1e-3
    query_norm: bool = True
    swilu: bool = True
    values_lr_scale: float = 1.0
    values_weight_decay: bool = True


@register_memory("pkm", PKMOptions)
class PKM(nn.Module):
    """Slow product-key memory, a drop-in replacement for a block's MLP.

    ``y, state = layer(x, state=None)`` with x, y ``[B, T, d_model]``; the layer keeps no state
    (``state`` is returned unchanged).  Set ``record_reads = True`` to append each call's slot ids
    and weights (``[B, T, H k]``) to ``read_log`` for :mod:`fastweights.experiments.addressing`
    (``fastweights inspect addressing``).
    """

    placement = "replace_mlp"

    # facts for the project's checks and the memory estimate (fastweights.components, "what a component declares")
    test_variants = {"dot": {"n_subkeys": 4, "d_key": 4, "d_value": 6, "heads": 2, "topk": 3},
                     "idw": {"n_subkeys": 4, "d_key": 4, "d_value": 6, "heads": 1, "topk": 2, "score": "idw"}}
    tiny_options = {"n_subkeys": 4, "d_key": 8, "d_value": 8, "heads": 1, "topk": 2}
    bounded_variants: dict = {}  # no state to bound

    @staticmethod
    def state_floats(o, **_):  # positionwise: no state
        return {}

    def __init__(self, d_model: int, options: PKMOptions | None = None):
        super().__init__()
        o = options or PKMOptions()
        if o.d_key % 2 or o.d_key < 2:
            raise UserError(f"pkm: d_key must be even and >= 2, got {o.d_key}")
        if not 1 <= o.topk <= o.n_subkeys:
            raise UserError(f"pkm: topk must be in [1, n_subkeys={o.n_subkeys}], got {o.topk}")
        if o.score not in ("dot", "idw"):
            raise UserError(f"pkm: score must be 'dot' or 'idw', got {o.score!r}")
        if o.values_lr_scale < 0:
            raise UserError(f"pkm: values_lr_scale must be >= 0, got {o.values_lr_scale}")
        self.options = o
        self.d_model = d_model
        self.n_slots = o.n_subkeys**2
        self.query_proj = Linear(d_model, o.heads * o.d_key)
        self.query_norm = nn.RMSNorm(o.heads * o.d_key, eps=1e-6) if o.query_norm else nn.Identity()
        half = o.d_key // 2
        self.keys1 = nn.Parameter(torch.empty(o.heads, o.n_subkeys, half))
        self.keys2 = nn.Parameter(torch.empty(o.heads, o.n_subkeys, half))
        self.values = nn.Parameter(torch.empty(self.n_slots, o.d_value))
        # read by the trainer's optimiser grouping: the table's own learning rate and decay
        self.values.lr_scale = o.values_lr_scale
        self.values.no_weight_decay = not o.values_weight_decay
        if o.swilu:
            self.swilu_proj = Linear(d_model, o.d_value)
            self.value_proj = Linear(o.d_value, d_model)
        elif o.d_value != d_model:
            self.swilu_proj = None
            self.value_proj = Linear(o.d_value, d_model)
        else:
            self.swilu_proj = None
            self.value_proj = None
        self.reset_parameters()
        self.aux_loss: torch.Tensor | None = None
        self.record_reads = False
        self.read_log: list[dict[str, torch.Tensor]] = []

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialisation of the released code: keys U(+-1/sqrt(d_k)), values N(0, d_v^-1/2),
        query Xavier-uniform, projections N(0, d_model^-1/2)."""
        o = self.options
        bound = 1.0 / math.sqrt(o.d_key)
        self.keys1.uniform_(-bound, bound)
        self.keys2.uniform_(-bound, bound)
        self.values.normal_(0.0, o.d_value**-0.5)
        nn.init.xavier_uniform_(self.query_proj.weight)
        for lin in (self.swilu_proj, self.value_proj):
            if lin is not None:
                nn.init.normal_(lin.weight, 0.0, self.d_model**-0.5)

    def forward(self, x: torch.Tensor, state=None, attention_mask=None) -> tuple[torch.Tensor, None]:
        """x ``[B, T, d_model]`` -> (y ``[B, T, d_model]``, state unchanged); ``attention_mask`` changes
        nothing (each position is read alone)."""
        o = self.options
        B, T, _ = x.shape
        q = self.query_norm(self.query_proj(x)).view(B, T, o.heads, o.d_key)  # [B, T, H, d_k]
        dt = torch.float64 if q.dtype == torch.float64 else torch.float32  # scores in fp32 at least
        res = pkm_search(q.to(dt), self.keys1.to(dt), self.keys2.to(dt), o.topk, o.score, o.idw_eps)
        w = softmax_short(res.scores)  # [B, T, H, k], per head as in Lample et al.
        idx = res.indices.reshape(B, T, o.heads * o.topk)  # [B, T, H*k]: heads summed together
        w = w.reshape(B, T, o.heads * o.topk)
        if self.record_reads:
            self.read_log.append({"indices": idx.detach().cpu(), "weights": w.detach().cpu()})
        mem = pkm_read(self.values, idx, w)  # [B, T, d_v]
        if self.swilu_proj is not None:
            mem = mem * F.silu(self.swilu_proj(x)).to(mem.dtype)
        y = self.value_proj(mem.to(x.dtype)) if self.value_proj is not None else mem.to(x.dtype)
        self.aux_loss = None
        return y, state
