"""Stateless tensor ops in the flash-linear-attention layout: inputs ``[B, T, H, D]``, states ``[B, H, K, V]``.

Each op's file holds its per-step reference (``*_recurrent`` / ``*_reference``), written straight from
the paper's equation, beside the fast form; the tests hold them together.
"""

from fastweights.ops.delta_rule import delta_rule, delta_rule_recurrent
from fastweights.ops.feature_maps import apply_feature_map, dpfp, elu_plus_one, favor_plus, sum_normalize
from fastweights.ops.linear_attention import gated_rule, gated_rule_recurrent, linear_attention, linear_attention_recurrent
from fastweights.ops.pkm import pkm_read, pkm_topk, pkm_topk_reference

__all__ = [
    "delta_rule", "delta_rule_recurrent", "gated_rule", "gated_rule_recurrent", "linear_attention",
    "linear_attention_recurrent", "apply_feature_map", "dpfp", "elu_plus_one", "favor_plus", "sum_normalize",
    "pkm_read", "pkm_topk", "pkm_topk_reference",
]
