"""The delta rule's hand-over to flash-linear-attention, checked on a CPU with a stand-in fla (issue 34, scope 1).

``tests/ops/fla_standin.py`` checks fla's input contract (q, k, v, beta in fp16/bf16, g and the state fp32,
[B, T, H, D] / [B, H, K, V] layouts) and computes with the per-step reference. Here: which backend runs
for which inputs (fp32, bf16, fp32 under autocast, gated with and without a gradient where fla refuses
its gated backward), that the ``fwp`` and ``gdn`` layers under autocast hand fla their fp32 features
cast to bf16 and keep their fast weight fp32, that the results agree with the PyTorch form, and that
the choice is logged once.

Issue 42: on Hopper (capability and Triton version injected) ``auto`` trains the ungated rule through fla at
chunk size 32, since fla issue 984 reports chunk 64's backward wrong there (the compiled form where fla is
too old to be asked), and takes fla's gated backward wherever fla allows it (Triton < 3.4 or >= 3.7.1, or
its TileLang backend).
"""

import importlib
import logging
import sys
import types

import pytest
import torch
import torch.nn.functional as F

import fla_standin
from fastweights.layers.fwp import FastWeightProgrammer, FWPOptions
from fastweights.layers.gdn import GatedDeltaNet, GDNOptions
from fastweights.ops.delta_rule import delta_rule

dr = importlib.import_module("fastweights.ops.delta_rule")
fb = importlib.import_module("fastweights.ops.fla_backend")
BF16 = torch.bfloat16


@pytest.fixture
def fla(monkeypatch):
    calls = fla_standin.install(monkeypatch)
    monkeypatch.setattr(dr, "_fla_refuses", lambda device: False)
    monkeypatch.setattr(dr, "_fla_delta_chunk64_wrong", lambda device: False)
    monkeypatch.setattr(dr, "_warned_fallback", False)
    yield calls
    monkeypatch.undo()
    fla_standin.uninstall()


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def inputs(b=2, t=19, h=2, dk=8, dv=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, dk, generator=g)
    k = F.normalize(torch.randn(b, t, h, dk, generator=g), dim=-1)
    v = torch.randn(b, t, h, dv, generator=g)
    beta = torch.rand(b, t, h, generator=g)
    log_decay = -torch.rand(b, t, h, generator=g) * 0.3
    s0 = torch.randn(b, h, dk, dv, generator=g)
    return q, k, v, beta, log_decay, s0


@pytest.mark.parametrize("gated", [False, True])
def test_bf16_inputs_go_to_fla_with_its_dtypes_and_state_layout(fla, gated):
    q, k, v, beta, g, s0 = inputs()
    o, s = delta_rule(q.to(BF16), k.to(BF16), v.to(BF16), beta.to(BF16), initial_state=s0, output_final_state=True,
                      log_decay=g if gated else None)
    (call,) = fla
    assert call["rule"] == ("gated" if gated else "delta")
    assert call["q"].dtype == call["k"].dtype == call["v"].dtype == call["beta"].dtype == BF16
    assert call["initial_state"].dtype == torch.float32 and call["initial_state"].shape == (2, 2, 8, 4)
    assert (call["g"] is None) != gated and (not gated or call["g"].dtype == torch.float32)
    assert o.dtype == BF16 and o.shape == (2, 19, 2, 4)
    assert s.dtype == torch.float32 and s.shape == (2, 2, 8, 4)  # [B, H, K, V], fp32 as fla keeps it
    ref_o, ref_s = delta_rule(*(x.to(BF16).float() for x in (q, k, v, beta)), initial_state=s0, output_final_state=True,
                              log_decay=g if gated else None, backend="torch")
    assert rel_err(o, ref_o) < 1e-2 and rel_err(s, ref_s) < 1e-5


def test_fp32_goes_to_fla_under_autocast_only(fla):
    q, k, v, beta, g, s0 = inputs()
    out, _ = delta_rule(q, k, v, beta)  # fp32 outside autocast: the PyTorch form (fla's kernels would use TF32)
    assert fla == [] and out.dtype == torch.float32
    with torch.autocast("cpu", dtype=BF16):
        o, s = delta_rule(q, k, v, beta, initial_state=s0, output_final_state=True, log_decay=g)
    (call,) = fla
    assert call["q"].dtype == BF16 and call["beta"].dtype == BF16 and call["g"].dtype == torch.float32
    assert call["initial_state"] is s0 or call["initial_state"].dtype == torch.float32
    assert o.dtype == BF16 and s.dtype == torch.float32
    with torch.autocast("cpu", dtype=BF16):
        delta_rule(q, k, v, beta, backend="torch")  # a forced backend is obeyed
    assert len(fla) == 1


def test_gated_training_where_fla_refuses_takes_the_compiled_form(fla, monkeypatch):
    monkeypatch.setattr(dr, "_fla_refuses", lambda device: True)
    monkeypatch.setattr(dr, "COMPILE_OPTIONS", {"backend": "aot_eager"})
    monkeypatch.setattr(dr, "_COMPILED", {})
    q, k, v, beta, g, _ = (x.to(BF16) if x.dtype == torch.float32 and x.dim() == 4 else x for x in inputs())
    leaves = [x.clone().requires_grad_() for x in (q, k, v, beta, g)]
    o, _ = delta_rule(*leaves[:4], log_decay=leaves[4])
    assert fla == [] and len(dr._COMPILED) == 2  # the compiled forward ran, not fla
    o.float().square().sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in leaves)
    with torch.no_grad():  # no backward needed: fla takes the call
        delta_rule(q, k, v, beta, log_decay=g)
    assert len(fla) == 1 and fla[0]["rule"] == "gated"
    delta_rule(*leaves[:4])  # ungated: fla's backward is fine there
    assert len(fla) == 2 and fla[1]["rule"] == "delta" and fla[1]["grad"]


def test_the_choice_is_logged_once(fla, caplog):
    q, k, v, beta, _, _ = inputs()
    with caplog.at_level(logging.INFO, logger="fastweights.ops.delta_rule"):
        for _ in range(3):
            delta_rule(q.to(BF16), k.to(BF16), v.to(BF16), beta.to(BF16))
        for _ in range(2):
            delta_rule(q, k, v, beta)
    lines = [r.getMessage() for r in caplog.records if r.name == "fastweights.ops.delta_rule"]
    assert len(lines) == 2, lines
    assert "-> 'fla'" in lines[0] and "-> 'torch'" in lines[1]


def test_fla_refusing_a_call_falls_back_with_one_warning(fla, monkeypatch):
    def refuse(**kw):
        raise RuntimeError("no kernel for this shape")

    fla_backend = importlib.import_module("fastweights.ops.fla_backend")
    monkeypatch.setattr(fla_backend, "_fla_functions", lambda: (refuse, refuse))
    q, k, v, beta, _, _ = (x.to(BF16) for x in inputs())
    with pytest.warns(UserWarning, match="refused"):
        o, _ = delta_rule(q, k, v, beta)
    ref, _ = delta_rule(q, k, v, beta, backend="torch")
    assert torch.equal(o, ref)
    with pytest.raises(RuntimeError, match="no kernel"):
        delta_rule(q, k, v, beta, backend="fla")  # forced: the error is the user's to see


def _train_step(layer, x, autocast):
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        y, state = layer(x)
    y.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    return y, state, grads


@pytest.mark.parametrize("kind", ["fwp-delta", "fwp-gated_delta", "gdn"])
def test_layers_under_autocast_hand_fla_bf16_features_and_keep_fp32_state(fla, kind):
    torch.manual_seed(0)
    if kind == "gdn":
        layer = GatedDeltaNet(16, 2, GDNOptions(chunk_size=8))
        want_k = want_v = 8
    else:
        rule = kind.split("-")[1]
        layer = FastWeightProgrammer(16, 2, FWPOptions(rule=rule, feature_map="dpfp", chunk_size=8))
        want_k, want_v = 16, 8  # DPFP nu=1 doubles the head dim
    x = torch.randn(2, 21, 16)
    y, state, grads = _train_step(layer, x, autocast=True)
    (call,) = fla
    assert call["q"].dtype == call["k"].dtype == call["v"].dtype == call["beta"].dtype == BF16
    assert call["q"].shape == (2, 21, 2, want_k) and call["v"].shape == (2, 21, 2, want_v)
    assert call["initial_state"].dtype == torch.float32 and call["initial_state"].shape == (2, 2, want_k, want_v)
    assert call["l2norm"] == (kind == "gdn") and call["grad"]
    assert (call["g"] is not None) == (kind != "fwp-delta")
    assert state["S"].dtype == torch.float32 and state["S"].shape == (2, 2, want_k, want_v)
    # the same layer on the PyTorch form (fp32 fast weights throughout) agrees to bf16 precision
    layer.options.backend = "torch"
    y_ref, state_ref, grads_ref = _train_step(layer, x, autocast=True)
    assert len(fla) == 1
    assert rel_err(y, y_ref) < 3e-2 and rel_err(state["S"], state_ref["S"]) < 3e-2
    for name, g in grads.items():
        assert rel_err(g, grads_ref[name]) < 0.1, name


# ----------------------------------------------------------------------------- issue 42: Hopper's reported faults


def test_the_conditions_read_in_fla_0_6():
    # fla's gated-backward guard: Hopper, 3.4.0 <= Triton < 3.7.1, unless its TileLang backend takes over
    assert fb.refuses_gated_backward(9, (3, 6, 0))
    assert fb.refuses_gated_backward(9, (3, 4, 0)) and fb.refuses_gated_backward(9, (3, 7, 0))
    assert not fb.refuses_gated_backward(9, (3, 3, 1))  # fla allows it: so does auto (scope 4)
    assert not fb.refuses_gated_backward(9, (3, 7, 1))
    assert not fb.refuses_gated_backward(8, (3, 6, 0)) and not fb.refuses_gated_backward(10, (3, 6, 0))
    assert not fb.refuses_gated_backward(9, (3, 6, 0), tilelang_takes_it=True)
    # fla issue 984: the ungated backward at chunk 64 on Hopper with Triton >= 3.4
    assert fb.delta_chunk64_reported_wrong(9, (3, 4, 0)) and fb.delta_chunk64_reported_wrong(9, (3, 7, 1))
    assert not fb.delta_chunk64_reported_wrong(9, (3, 3, 0)) and not fb.delta_chunk64_reported_wrong(8, (3, 6, 0))
    assert fb.fla_chunk_size(gated=False, needs_grad=True, chunk64_reported_wrong=True) == 32
    for gated, grad, wrong in [(True, True, True), (False, False, True), (False, True, False)]:
        assert fb.fla_chunk_size(gated, grad, wrong) is None


def test_select_backend_with_the_chunk64_report():
    hopper = dict(device_type="cuda", dtype=BF16, fla_ok=True, fla_delta_chunk64_reported_wrong=True)
    assert dr.select_backend("auto", gated=False, needs_grad=True, **hopper) == "fla"  # at chunk 32
    assert dr.select_backend("auto", gated=False, needs_grad=True, fla_takes_chunk_size=False, **hopper) == "compiled"
    assert dr.select_backend("auto", gated=False, needs_grad=False, fla_takes_chunk_size=False, **hopper) == "fla"
    assert dr.select_backend("fla", gated=False, needs_grad=True, fla_takes_chunk_size=False, **hopper) == "fla"


@pytest.fixture
def hopper_triton(monkeypatch):
    """A CUDA device of capability 9.0 and Triton 3.6.0, as the GPU machines here (torch sees no GPU)."""
    def set_versions(triton="3.6.0", major=9):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
        monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__=triton))
    set_versions()
    return set_versions


def test_the_device_checks_read_capability_and_triton(hopper_triton):
    cuda = torch.device("cuda")
    assert fb.fla_refuses_gated_backward(cuda) and fb.fla_delta_chunk64_reported_wrong(cuda)
    hopper_triton(triton="3.3.1")
    assert not fb.fla_refuses_gated_backward(cuda) and not fb.fla_delta_chunk64_reported_wrong(cuda)
    hopper_triton(triton="3.7.1")
    assert not fb.fla_refuses_gated_backward(cuda) and fb.fla_delta_chunk64_reported_wrong(cuda)
    hopper_triton(triton="3.6.0", major=8)
    assert not fb.fla_refuses_gated_backward(cuda) and not fb.fla_delta_chunk64_reported_wrong(cuda)
    assert not fb.fla_refuses_gated_backward(torch.device("cpu"))


def test_tilelang_lifts_the_gated_refusal(hopper_triton, monkeypatch):
    class Backend:
        @staticmethod
        def is_available():
            return True

        def is_enabled(self):
            return True

    monkeypatch.setitem(sys.modules, "fla.backends", types.SimpleNamespace(_DISPATCH_DISABLED=False))
    monkeypatch.setitem(sys.modules, "fla.ops.common.backends.tilelang",
                        types.SimpleNamespace(CommonTileLangBackend=Backend))
    cuda = torch.device("cuda")
    assert not fb.fla_refuses_gated_backward(cuda)
    monkeypatch.setitem(sys.modules, "fla.backends", types.SimpleNamespace(_DISPATCH_DISABLED=True))
    assert fb.fla_refuses_gated_backward(cuda)  # FLA_DISABLE_BACKEND_DISPATCH=1: fla's guard stands


def _on_hopper(monkeypatch, triton):
    """The stand-in runs on CPU tensors: the device checks answer for a Hopper GPU with this Triton."""
    monkeypatch.setattr(dr, "_fla_refuses", lambda device: fb.refuses_gated_backward(9, triton))
    monkeypatch.setattr(dr, "_fla_delta_chunk64_wrong", lambda device: fb.delta_chunk64_reported_wrong(9, triton))


def _bf16_leaves():
    q, k, v, beta, g, s0 = inputs()
    return [x.to(BF16).requires_grad_() for x in (q, k, v, beta)] + [g.clone().requires_grad_(), s0]


def test_hopper_trains_the_delta_rule_at_chunk_32_and_says_why_once(fla, monkeypatch, caplog):
    _on_hopper(monkeypatch, (3, 6, 0))
    q, k, v, beta, g, s0 = _bf16_leaves()
    with caplog.at_level(logging.INFO, logger="fastweights.ops.delta_rule"):
        for _ in range(2):
            o, _ = delta_rule(q, k, v, beta, initial_state=s0)
            o.float().square().sum().backward()
        with torch.no_grad():  # no backward: fla's default chunk
            delta_rule(q, k, v, beta)
    assert [c["chunk_size"] for c in fla] == [32, 32, 64] and fla[0]["grad"] and not fla[2]["grad"]
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k, v, beta))
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "chunk size 32" in warned[0].getMessage() and "issue 984" in warned[0].getMessage()
    # the result is fla's at chunk 32: the same rule as the PyTorch form, to bf16 precision
    ref, _ = delta_rule(*(x.detach().float() for x in (q, k, v, beta)), initial_state=s0, backend="torch")
    assert rel_err(o, ref) < 1e-2


def test_hopper_with_an_fla_that_takes_no_chunk_size_trains_the_compiled_form(fla, monkeypatch, caplog):
    _on_hopper(monkeypatch, (3, 6, 0))
    monkeypatch.setattr(dr, "_fla_takes_chunk_size", lambda: False)
    monkeypatch.setattr(dr, "COMPILE_OPTIONS", {"backend": "aot_eager"})
    monkeypatch.setattr(dr, "_COMPILED", {})
    q, k, v, beta, _, _ = _bf16_leaves()
    with caplog.at_level(logging.INFO, logger="fastweights.ops.delta_rule"):
        o, _ = delta_rule(q, k, v, beta)
    assert fla == [] and len(dr._COMPILED) == 2
    (line,) = [r.getMessage() for r in caplog.records if r.name == "fastweights.ops.delta_rule"]
    assert "-> 'compiled'" in line and "issue 984" in line and "ungated" in line


@pytest.mark.parametrize("triton", [(3, 3, 1), (3, 7, 1)])
def test_auto_takes_fla_gated_backward_wherever_fla_allows_it(fla, monkeypatch, triton):
    _on_hopper(monkeypatch, triton)
    q, k, v, beta, g, s0 = _bf16_leaves()
    o, _ = delta_rule(q, k, v, beta, log_decay=g, initial_state=s0, qk_l2norm=True)
    o.float().square().sum().backward()
    (call,) = fla
    assert call["rule"] == "gated" and call["grad"] and call["chunk_size"] == 64 and g.grad is not None
    # and where fla refuses it (3.4 <= Triton < 3.7.1), the compiled form, fla untouched
    _on_hopper(monkeypatch, (3, 6, 0))
    monkeypatch.setattr(dr, "COMPILE_OPTIONS", {"backend": "aot_eager"})
    monkeypatch.setattr(dr, "_COMPILED", {})
    delta_rule(q, k, v, beta, log_decay=g, initial_state=s0, qk_l2norm=True)
    assert len(fla) == 1


def test_gdn_layer_trains_on_fla_where_fla_allows_the_gated_backward(fla, monkeypatch):
    _on_hopper(monkeypatch, (3, 7, 1))
    torch.manual_seed(0)
    layer = GatedDeltaNet(16, 2, GDNOptions(chunk_size=8))
    _train_step(layer, torch.randn(2, 21, 16), autocast=True)
    (call,) = fla
    assert call["rule"] == "gated" and call["grad"]
