"""``experiments.fla_comparison``'s CPU parts (the GPU scripts' shared helpers, moved out of the scripts): the seeded
inputs, the relative error, one-line exception text, our hybrid config of a fla shape, and our side of the kernel
comparison, which must agree with the per-step delta rule."""

import torch

from fastweights.core.compare import relative_error
from fastweights.experiments import fla_comparison as fc
from fastweights.ops.delta_rule import delta_rule_recurrent
from fastweights.testing.device_check import err_text


def test_the_inputs_are_seeded_shaped_and_in_range():
    a = fc.kernel_inputs(2, 5, 3, 4, 6, "cpu", seed=1)
    b = fc.kernel_inputs(2, 5, 3, 4, 6, "cpu", seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], fc.kernel_inputs(2, 5, 3, 4, 6, "cpu", seed=2)[0])
    q, k, v, beta, log_decay = a
    assert q.shape == k.shape == (2, 5, 3, 4) and v.shape == (2, 5, 3, 6) and beta.shape == log_decay.shape == (2, 5, 3)
    assert torch.allclose(k.norm(dim=-1), torch.ones(2, 5, 3)) and 0.05 <= beta.min() and beta.max() <= 0.95
    assert -0.1 <= log_decay.min() and log_decay.max() <= 0
    bf, g, do = fc.delta_inputs(2, 5, 3, 4, "cpu", gated=True)
    assert all(x.dtype == torch.bfloat16 for x in bf) and g.dtype == torch.float32 and do.shape == (2, 5, 3, 4)
    assert fc.delta_inputs(2, 5, 3, 4, "cpu", gated=False)[1] is None


def test_an_exception_is_one_line_naming_where_in_our_code_it_was_raised():
    try:
        relative_error(torch.ones(2), torch.ones(3))
    except RuntimeError as e:
        text = err_text(e)
    assert text.startswith("RuntimeError: The size of tensor a (2) must match") and "\n" not in text
    assert text.endswith(")") and "(at compare.py:" in text
    assert err_text(ValueError()) == "ValueError: "


def test_our_hybrid_has_attention_every_nth_layer_and_the_memory_where_asked():
    cfg = {"vocab": 50, "d_model": 32, "n_layers": 4, "n_heads": 2, "head_dim": 16, "mlp": 64, "attn_every": 2,
           "fwpkm": {"n_subkeys": 4, "d_key": 8, "d_value": 8, "topk": 2}, "fwpkm_layers": [1]}
    plain = fc.our_config(cfg, fwpkm=False)
    assert plain.layer_mixers == ["gdn", "attention", "gdn", "attention"] and plain.memory in ("", None)
    assert plain.options["gdn"] == {"head_dim": 16}
    assert (plain.vocab_size, plain.d_model, plain.n_layers, plain.n_heads, plain.mlp_hidden) == (50, 32, 4, 2, 64)
    memory = fc.our_config(cfg, fwpkm=True)
    assert memory.memory == "fwpkm" and memory.memory_layers == [1] and memory.options["fwpkm"] == cfg["fwpkm"]


def test_our_side_of_the_kernel_comparison_is_the_delta_rule():
    xs, g, do = fc.delta_inputs(1, 12, 2, 4, "cpu", gated=True, seed=3)
    o, grads = fc.run_impl("ours", None, xs, g, do, backward=True)
    q, k, v, beta = (x.float() for x in xs)
    want, _ = delta_rule_recurrent(q, k, v, beta, log_decay=g)
    assert relative_error(o, want) < 2e-2  # bf16 inputs, fp32 arithmetic inside
    assert len(grads) == 5 and all(gr is not None and gr.shape == x.shape for gr, x in zip(grads, [*xs, g]))
    o2, none = fc.run_impl("ours", None, xs, g, do, backward=False)
    assert none is None and torch.equal(o, o2)


def _fake_fla(monkeypatch):
    """Stand-ins for the fla modules the GPU scripts build their peers from, recording the arguments given."""
    import sys
    import types

    seen = {}

    def recorder(key):
        return lambda *a, **k: seen.setdefault(key, k) and k

    layers, models = types.ModuleType("fla.layers"), types.ModuleType("fla.models")
    layers.GatedDeltaNet = recorder("layer")
    models.GatedDeltaNetConfig, models.GatedDeltaNetForCausalLM = recorder("config"), lambda conf: ("model", conf)
    fla = types.ModuleType("fla")
    fla.__version__, fla.layers, fla.models = "0.0-standin", layers, models
    monkeypatch.setitem(sys.modules, "fla", fla)
    monkeypatch.setitem(sys.modules, "fla.layers", layers)
    monkeypatch.setitem(sys.modules, "fla.models", models)
    return seen


CFG = {"vocab": 50, "d_model": 32, "n_layers": 4, "n_heads": 2, "head_dim": 16, "mlp": 64, "attn_every": 2,
       "seq_len": 128}


def test_fla_peers_are_built_at_our_shape(monkeypatch):
    """fla's layer and model (on the GPU runs) get the width, heads, head size, MLP, vocabulary and attention layers
    of the cfg our hybrid is built from (:func:`our_config`), checked here against stand-ins of fla's classes."""
    seen = _fake_fla(monkeypatch)
    fc.fla_gdn_layer(CFG)
    assert seen["layer"] == {"hidden_size": 32, "expand_v": 1.0, "head_dim": 16, "num_heads": 2, "mode": "chunk",
                             "use_short_conv": True, "layer_idx": 0}
    kind, conf = fc.fla_model(CFG)
    assert kind == "model" and conf == {
        "hidden_size": 32, "num_hidden_layers": 4, "num_heads": 2, "head_dim": 16, "expand_v": 1.0,
        "intermediate_size": 64, "vocab_size": 50, "tie_word_embeddings": True, "use_cache": False,
        "max_position_embeddings": 128, "attn": {"layers": [1, 3], "num_heads": 2, "num_kv_heads": 2}}
    ours = fc.our_config({**CFG, "fwpkm": {}, "fwpkm_layers": []}, fwpkm=False)
    assert [i for i, m in enumerate(ours.layer_mixers) if m == "attention"] == conf["attn"]["layers"]


def test_the_installed_versions_are_named_or_their_absence_said(monkeypatch):
    _fake_fla(monkeypatch)
    info = fc.fla_info()
    assert info["fla"] == "0.0-standin" and "tilelang" in info  # None where TileLang is not installed
    assert ("triton" in info) != ("triton_error" in info)
    assert ("fast_weight_product_key_memory" in info) != ("lucidrains_error" in info)


def test_without_flash_attn_fla_attention_gets_an_sdpa_stand_in(monkeypatch):
    """``install_flash_attn_standin``: fla's attention layer calls flash_attn's kernel ([B, T, H, D] in and out);
    without the package a causal SDPA is set into ``fla.layers.attn`` and the run says so; sliding windows refused."""
    import sys
    import types

    import pytest

    _fake_fla(monkeypatch)
    attn = types.ModuleType("fla.layers.attn")
    monkeypatch.setitem(sys.modules, "fla.layers.attn", attn)
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not installed
    said = fc.install_flash_attn_standin()
    assert said == ("flash_attn absent: fla's attention layers ran a stand-in flash_attn_func over "
                    "F.scaled_dot_product_attention")
    q, k, v = (torch.randn(1, 6, 2, 4) for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                            is_causal=True).transpose(1, 2)
    assert torch.allclose(attn.flash_attn_func(q, k, v, causal=True), want)
    with pytest.raises(NotImplementedError, match="no sliding window"):
        attn.flash_attn_func(q, k, v, window_size=(2, 0))
