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


def test_kernel_inputs_are_seeded_delta_rule_inputs_with_unit_keys():
    q, k, v, beta, ld = fc.kernel_inputs(2, 5, 3, 4, 6, "cpu", seed=1)
    assert [tuple(x.shape) for x in (q, k, v, beta, ld)] == [(2, 5, 3, 4), (2, 5, 3, 4), (2, 5, 3, 6), (2, 5, 3),
                                                             (2, 5, 3)]
    torch.testing.assert_close(k.norm(dim=-1), torch.ones(2, 5, 3))
    assert 0.05 <= beta.min() and beta.max() <= 0.95 and -0.1 <= ld.min() and ld.max() <= 0
    assert all(torch.equal(a, b) for a, b in zip(fc.kernel_inputs(2, 5, 3, 4, 6, "cpu", seed=1), (q, k, v, beta, ld)))
    assert not torch.equal(fc.kernel_inputs(2, 5, 3, 4, 6, "cpu", seed=2)[0], q)
    assert q.std() > 0.5 and v.std() > 0.5  # standard normal, not uniform


def test_the_raw_fla_step_and_ours_run_fla_with_state_in_and_out(monkeypatch):
    """On the fla stand-in (fla 0.6's call contract): the raw step calls fla's chunk kernel in bf16 with a zero
    state in and the final state out (gated: with the L2 norm in the kernel and the fp32 gate); our op's step runs
    the same rule through fla under bf16 autocast, with the gradients reaching every leaf."""
    from fastweights.testing import fla_standin

    calls = fla_standin.install(monkeypatch)
    try:
        xs = fc.kernel_inputs(1, 8, 2, 4, 4, "cpu")
        for gated in (False, True):
            calls.clear()
            fc.raw_fla_step(gated, xs, torch.device("cpu"))()
            (c,) = calls
            assert c["rule"] == ("gated" if gated else "delta") and c["l2norm"] is gated and c["output_final_state"]
            assert c["q"].dtype == c["k"].dtype == c["v"].dtype == c["beta"].dtype == torch.bfloat16 and c["grad"]
            assert torch.equal(c["initial_state"], torch.zeros(1, 2, 4, 4))
            assert (c["g"] is not None) is gated and (not gated or c["g"].dtype == torch.float32)
            torch.testing.assert_close(c["q"].float(), xs[0], atol=0.02, rtol=0.02)
            # the loss is the output's alone: the final state joins the graph with weight 0
            q, k, v, beta = (c[n].detach().requires_grad_() for n in ("q", "k", "v", "beta"))
            run = fla_standin.chunk_gated_delta_rule if gated else fla_standin.chunk_delta_rule
            kw = {"g": c["g"].detach(), "use_qk_l2norm_in_kernel": True} if gated else {}
            o, _ = run(q=q, k=k, v=v, beta=beta, initial_state=c["initial_state"], **kw)
            o.float().square().mean().backward()
            torch.testing.assert_close(c["q"].grad, q.grad)
            torch.testing.assert_close(c["k"].grad, k.grad)  # the state depends on k, not q
        for gated in (False, True):
            for leaves in (torch.float32, torch.bfloat16):
                calls.clear()
                fc.our_op_step(gated, xs, "fla", torch.device("cpu"), leaves=leaves)()
                (c,) = calls
                assert c["rule"] == ("gated" if gated else "delta") and c["output_final_state"] and c["grad"]
                assert c["q"].dtype == torch.bfloat16 and torch.equal(c["initial_state"], torch.zeros(1, 2, 4, 4))
                assert c["l2norm"] is gated and (c["g"] is not None) is gated
        assert not any(x.requires_grad for x in xs)  # the leaves are copies: the caller's inputs stay as they were
    finally:
        fla_standin.uninstall()


def test_our_op_step_gives_every_leaf_a_gradient_on_the_torch_backend(monkeypatch):
    seen = {}
    real = fc.delta_rule

    def spy(q, k, v, beta, **kw):
        seen.update(kw, leaves=[q, k, v, beta], autocast=torch.is_autocast_enabled("cpu"))
        return real(q, k, v, beta, **kw)

    monkeypatch.setattr(fc, "delta_rule", spy)
    xs = fc.kernel_inputs(1, 6, 2, 4, 4, "cpu")
    fc.our_op_step(True, xs, "torch", torch.device("cpu"), leaves=torch.float64)()
    assert seen["backend"] == "torch" and seen["qk_l2norm"] is True and seen["output_final_state"] is True
    assert seen["autocast"] and torch.equal(seen["log_decay"].detach(), xs[4])
    assert torch.equal(seen["initial_state"], torch.zeros(1, 2, 4, 4))
    assert all(x.dtype == torch.float64 and x.grad is not None for x in seen["leaves"])
    assert seen["log_decay"].grad is not None and seen["log_decay"].dtype == torch.float32
    assert torch.equal(seen["leaves"][0].detach(), xs[0].double())
    # the loss is the output's alone: the final state joins the graph with weight 0
    leaves = [x.detach().requires_grad_() for x in seen["leaves"]]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, _ = real(*leaves, log_decay=xs[4], initial_state=seen["initial_state"], backend="torch", qk_l2norm=True)
    o.float().square().mean().backward()
    torch.testing.assert_close(seen["leaves"][1].grad, leaves[1].grad)
    fc.our_op_step(False, xs, "torch", torch.device("cpu"))()
    assert seen["log_decay"] is None and seen["qk_l2norm"] is False and seen["leaves"][0].dtype == torch.float32


def test_layer_step_runs_forward_and_backward_with_or_without_autocast():
    seen = []

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            seen.append(torch.is_autocast_enabled("cpu"))
            return (x * self.w, "state")

    layer, x = Layer(), torch.full((2, 3), 2.0)
    fc.layer_step(layer, x, torch.device("cpu"))()
    torch.testing.assert_close(layer.w.grad, torch.full((3,), 8 / 3))  # d mean over 6 of (2w)^2 / dw_j = 2 x 8 w / 6
    fc.layer_step(layer, x, torch.device("cpu"), autocast=False)()
    assert seen == [True, False]
    plain = torch.nn.Linear(3, 2)  # a layer returning a tensor: all of it is the output
    rows = torch.arange(12.0).reshape(4, 3)
    fc.layer_step(plain, rows, torch.device("cpu"), autocast=False)()
    y = plain(rows)
    torch.testing.assert_close(plain.bias.grad, 2 * y.detach().mean(0) / 2)


def test_run_impl_calls_fla_with_its_own_argument_order():
    seen = []

    def delta(q, k, v, beta):
        seen.append(("delta", q, k, v, beta))
        return q * 2, None

    def gated(q, k, v, g, beta):
        seen.append(("gated", q, k, v, g, beta))
        return q * 3 + g[..., None], None

    xs, g, do = fc.delta_inputs(1, 4, 2, 3, "cpu", gated=True)
    o, grads = fc.run_impl("fla", {"delta": delta, "gated": gated}, xs, None, do, backward=False)
    assert grads is None and torch.equal(o, xs[0] * 2) and all(torch.equal(a, b) for a, b in zip(seen[0][1:], xs))
    o, grads = fc.run_impl("fla", {"delta": delta, "gated": gated}, xs, g, do, backward=True)
    assert seen[1][0] == "gated" and torch.equal(seen[1][4], g) and torch.equal(seen[1][5], xs[3])
    assert all(torch.equal(seen[1][i], xs[i - 1]) for i in (1, 2, 3))
    assert len(grads) == 5 and grads[1] is None and grads[0].dtype == torch.bfloat16
    torch.testing.assert_close(grads[0].float(), 3 * do, atol=0.05, rtol=0.01)
    torch.testing.assert_close(grads[4], do.sum(-1))  # d <q * 3 + g, do> / dg
    assert not xs[0].requires_grad  # the caller's inputs are not made leaves
    o, grads = fc.run_impl("fla", {"delta": delta, "gated": gated}, xs, None, do, backward=True)
    assert len(grads) == 4  # no gate, no gate gradient


def test_fla_candidates_name_each_chunk_size_and_call_fla_with_it():
    import types

    seen = []
    mods = {"delta": types.SimpleNamespace(delta_rule_chunkwise=lambda q, k, v, beta, chunk_size: (
                seen.append(("delta", q, k, v, beta, chunk_size)) or "o-delta", None)),
            "gated": types.SimpleNamespace(naive_chunk_gated_delta_rule=lambda q, k, v, g, beta, chunk_size: (
                seen.append(("gated", q, k, v, g, beta, chunk_size)) or "o-gated", None))}
    plain = fc.fla_candidates(mods, gated=False)
    assert list(plain) == [f"{n}_C{c}" for c in (16, 32, 64) for n in ("delta_rule_chunkwise", "naive_chunk_gated_delta_rule")]
    assert plain["delta_rule_chunkwise_C32"][0]("q", "k", "v", "b", "g") == "o-delta"
    assert seen[-1] == ("delta", "q", "k", "v", "b", 32)
    assert plain["naive_chunk_gated_delta_rule_C64"][0]("q", "k", "v", "b", "g") == "o-gated"
    assert seen[-1] == ("gated", "q", "k", "v", "g", "b", 64)
    gated = fc.fla_candidates(mods, gated=True)
    assert list(gated) == [f"naive_chunk_gated_delta_rule_C{c}" for c in (16, 32, 64)]
    assert [wants for _, wants in plain.values()] == [True, False] * 3
    assert all(wants is False for _, wants in gated.values())
    gated["naive_chunk_gated_delta_rule_C16"][0]("q", "k", "v", "b", "g")
    assert seen[-1][-1] == 16


def test_load_fla_cpu_reads_fla_s_two_naive_files_or_says_why_not(monkeypatch, tmp_path):
    import hashlib
    import importlib.metadata
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert fc.load_fla_cpu() == (None, {"reason": "flash-linear-attention (fla-core) is not importable"})
    root = tmp_path / "fla"
    for rel, body in (("ops/delta_rule/naive.py", "def delta_rule_chunkwise():\n    return 1\n"),
                      ("ops/gated_delta_rule/naive.py", "def naive_chunk_gated_delta_rule():\n    return 2\n")):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(body)
    spec = importlib.machinery.ModuleSpec("fla", None, is_package=True)
    spec.submodule_search_locations = [str(root)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec if name == "fla" else None)

    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", no_dist)
    mods, info = fc.load_fla_cpu()
    assert mods["delta"].delta_rule_chunkwise() == 1 and mods["gated"].naive_chunk_gated_delta_rule() == 2
    assert info == {"version": "unknown", "files": {
        f"fla/{rel}": hashlib.sha256((root / rel).read_bytes()).hexdigest()
        for rel in ("ops/delta_rule/naive.py", "ops/gated_delta_rule/naive.py")}}
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.6.1" if name == "fla-core" else "?")
    assert fc.load_fla_cpu()[1]["version"] == "0.6.1"
    (root / "ops/gated_delta_rule/naive.py").write_text("import no_such_module_here\n")
    assert fc.load_fla_cpu() == (None, {"reason": "fla/ops/gated_delta_rule/naive.py does not load: "
                                                  "ModuleNotFoundError: No module named 'no_such_module_here'"})
    spec.submodule_search_locations = []
    assert fc.load_fla_cpu()[0] is None


FWPKM_CFG = {"d_model": 16, "seq_len": 12, "fwpkm": {"heads": 2, "chunk_size": 4, "n_subkeys": 3, "d_key": 8,
                                                    "d_value": 16, "topk": 2}}


def test_the_fwpkm_layer_step_builds_ours_or_lucidrains_at_the_same_options(monkeypatch):
    import sys
    import types

    from fastweights.layers.fwpkm import FwPKM, FwPKMOptions

    asked = []  # what fwpkm_layer_step hands layer_step: the layer, its input, autocast
    real = fc.layer_step
    monkeypatch.setattr(fc, "layer_step", lambda layer, x, device, autocast=True: asked.append((layer, x, autocast))
                        or real(layer, x, device, autocast))
    step, n = fc.fwpkm_layer_step("ours", FWPKM_CFG, 2, torch.device("cpu"))
    torch.manual_seed(0)
    want = FwPKM(16, FwPKMOptions(**FWPKM_CFG["fwpkm"]))
    assert n == sum(p.numel() for p in want.parameters())
    step()
    ((built, x, autocast),) = asked
    assert autocast is False and isinstance(built, FwPKM) and all(torch.equal(a, b) for a, b in zip(built.state_dict().values(),
                                                                              want.state_dict().values()))
    assert x.shape == (2, 12, 16) and x.grad is not None
    assert torch.equal(x.detach(), torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(3)))
    seen = {}

    class Lucid(torch.nn.Module):
        def __init__(self, dim, **kw):
            super().__init__()
            seen.update(kw, dim=dim)
            self.w = torch.nn.Parameter(torch.ones(7))

        def forward(self, x):
            seen["autocast"] = torch.is_autocast_enabled("cpu")
            return x * self.w.sum()

    monkeypatch.setitem(sys.modules, "fast_weight_product_key_memory", types.SimpleNamespace(fwPKM=Lucid))
    step, n = fc.fwpkm_layer_step("lucidrains", FWPKM_CFG, 2, torch.device("cpu"))
    step()
    assert n == 7 and seen == {"dim": 16, "heads": 2, "chunk_size": 4, "num_memories": 9, "dim_queries_keys": 8,
                               "dim_values": 16, "topk": 2, "learning_rate": 1.0, "autocast": False}


def test_fla_info_names_each_version_or_the_import_error(monkeypatch):
    import importlib.metadata
    import sys
    import types

    versions = {"tilelang": "0.1.5", "fast-weight-product-key-memory": "0.0.9"}
    monkeypatch.setattr(importlib.metadata, "version", lambda name: versions[name])
    monkeypatch.setitem(sys.modules, "fla", types.SimpleNamespace(__version__="0.6.1"))
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="3.6.0"))
    monkeypatch.setitem(sys.modules, "fast_weight_product_key_memory", types.ModuleType("fast_weight_product_key_memory"))
    assert fc.fla_info() == {"fla": "0.6.1", "triton": "3.6.0", "tilelang": "0.1.5", "fast_weight_product_key_memory": "0.0.9"}
    monkeypatch.setitem(sys.modules, "fla", types.SimpleNamespace())  # no __version__
    assert fc.fla_info()["fla"] == "?"
    for name in ("fla", "triton", "fast_weight_product_key_memory"):
        monkeypatch.setitem(sys.modules, name, None)  # not importable
    versions.clear()
    info = fc.fla_info()
    assert list(info) == ["fla_error", "triton_error", "tilelang", "lucidrains_error"] and info["tilelang"] is None
    assert info["fla_error"].startswith("ModuleNotFoundError: import of fla halted; None in sys.modules")
    assert info["triton_error"].startswith("ModuleNotFoundError: import of triton halted")
    assert info["lucidrains_error"].startswith("ModuleNotFoundError: import of fast_weight_product_key_memory halted")


def test_every_attn_every_th_layer_is_attention_in_ours_and_in_fla_s(monkeypatch):
    cfg = {**CFG, "n_layers": 6, "attn_every": 3}
    ours = fc.our_config(cfg, fwpkm=False)
    assert ours.layer_mixers == ["gdn", "gdn", "attention"] * 2
    assert ours.options == {"gdn": {"head_dim": 16}, "attention": {"head_dim": 16}}
    _fake_fla(monkeypatch)
    assert fc.fla_model(cfg)[1]["attn"]["layers"] == [2, 5]


def test_the_fla_stand_in_outside_pytest_is_installed_and_undone(monkeypatch):
    import sys

    from fastweights.testing import fla_standin

    made = []

    class Patcher(fc._Patcher):
        def __init__(self):
            super().__init__()
            made.append(self)

    monkeypatch.setattr(fc, "_Patcher", Patcher)
    before = sys.modules.get("fla")
    said = fc.install_fla_standin()
    try:
        assert said == ("fla absent: the stand-in fastweights.testing.fla_standin (fla 0.6's call contract, our "
                        "per-step reference in fp32) ran in its place; fla's layers and models are absent from it")
        assert sys.modules["fla"].__version__ == fla_standin.VERSION
    finally:
        for undo, key, value in reversed(made[0].undo_list):
            undo(key, value)
        fla_standin.uninstall()
    assert sys.modules.get("fla") is before


def test_the_patcher_undoes_what_it_set():
    import types

    p, d, o = fc._Patcher(), {"a": 1}, types.SimpleNamespace(x=1)
    p.setitem(d, "a", 2)
    p.setitem(d, "b", 3)
    p.setattr(o, "x", 5)
    assert d == {"a": 2, "b": 3} and o.x == 5
    for undo, key, value in reversed(p.undo_list):
        undo(key, value)
    assert d == {"a": 1} and o.x == 1


def test_the_flash_attn_stand_in_is_causal_by_default_and_says_why_fla_is_missing(monkeypatch):
    import sys
    import types

    import pytest

    _fake_fla(monkeypatch)
    attn = types.ModuleType("fla.layers.attn")
    monkeypatch.setitem(sys.modules, "fla.layers.attn", attn)
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    fc.install_flash_attn_standin()
    q, k, v = (torch.randn(1, 5, 2, 4) for _ in range(3))
    causal = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                              is_causal=True).transpose(1, 2)
    torch.testing.assert_close(attn.flash_attn_func(q, k, v), causal)
    with pytest.raises(NotImplementedError) as e:
        attn.flash_attn_func(q, k, v, window_size=(4, 0))
    assert str(e.value) == "stand-in flash_attn_func: no sliding window"
    monkeypatch.setitem(sys.modules, "fla.layers.attn", None)
    said = fc.install_flash_attn_standin()
    assert said.startswith("fla's attention layer not importable: ModuleNotFoundError: import of fla.layers.attn "
                           "halted; None in sys.modules (at fla_comparison.py:")
