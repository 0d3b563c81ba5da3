"""benchmarks/speed/train_memory.py (issue 51, scope 2): the saved tensors are attributed to the part of the model
that keeps them, the hooks that attribute them leave the step's numbers alone, the plain-SwiGLU baseline keeps
one [tokens, F] tensor per MLP more than the model's own gate, the plain gdn norm three [tokens, V] tensors per
gdn layer more, and the plain convolution-then-silu one [tokens, 2HK + HV] more."""

import pytest

from helpers import import_benchmark

bench = import_benchmark("train_memory")


def child(variant, *args):
    """``bench.child`` in this process, with the plain forms it swaps in put back after (the script runs each
    variant in a process of its own)."""
    import fastweights.layers.common as common
    import fastweights.layers.gdn as gdn

    kept = common.swiglu, gdn.gated_rms_norm, gdn.causal_conv1d_silu
    try:
        return bench.child(variant, *args)
    finally:
        common.swiglu, gdn.gated_rms_norm, gdn.causal_conv1d_silu = kept


def test_the_mlps_saved_tensors_are_its_input_gate_and_up_and_product():
    """Per MLP and token the model keeps x [d], gu [2F] and h [F] (fp32), the plain form silu(gate) [F] more; the
    loss is the same, with and without the attributing hooks. Mutations caught: a hook that returns a value
    (replaces the module's output), the baseline built with the model's own gate."""
    batch, seq, vocab = 1, 32, 300
    s = bench.SHAPE
    ours, plain, plain_norm, plain_conv = (child(v, batch, seq, vocab) for v in (
        "without_logits", "plain_swiglu", "plain_gdn_norm", "plain_conv_silu"))
    per_token = 4 * s["n_layers"] * batch * seq / 2**20  # MB of one fp32 value per token and layer
    assert ours["saved_mb_by_part"]["mlp"] == pytest.approx(per_token * (s["d_model"] + 3 * s["mlp"]))
    assert plain["saved_mb_by_part"]["mlp"] - ours["saved_mb_by_part"]["mlp"] == pytest.approx(per_token * s["mlp"])
    assert ours["loss"] == plain["loss"]
    gdn_layers = sum(1 for i in range(s["n_layers"]) if (i + 1) % s["attn_every"])
    per_token_gdn = 4 * gdn_layers * batch * seq / 2**20
    value_dim = s["n_heads"] * s["head_dim"]  # per gdn layer n, n w, silu(gate) [tokens, V] and r [tokens, H]
    assert plain_norm["saved_mb_by_part"][bench.GDN] - ours["saved_mb_by_part"][bench.GDN] == pytest.approx(
        per_token_gdn * (3 * value_dim + s["n_heads"]))
    qkv_dim = 3 * value_dim  # q, k and v: the convolution's output, kept for its silu by the plain form
    assert plain_conv["saved_mb_by_part"][bench.GDN] - ours["saved_mb_by_part"][bench.GDN] == pytest.approx(
        per_token_gdn * qkv_dim)
    assert ours["loss"] == plain_conv["loss"]
    assert sum(ours["saved_mb_by_part"].values()) == pytest.approx(ours["saved_mb"])
    assert {"mlp", "norms", "loss and head", "mixer:GatedDeltaNet", "mixer:CausalSelfAttention"} <= set(
        ours["saved_mb_by_part"])
