"""The fla stand-in itself (fastweights.testing.fla_standin): the dispatch's and the GPU queue's tests on a CPU trust
it to refuse what fla refuses, to record what it was called with, to compute what the reference computes, and to
get its gradients wrong exactly as the fla bugs it imitates. Each of those, checked here (issue 49: the module's
mutants run against the tests that use it left these parts unchecked)."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from fastweights.ops.delta_rule import delta_rule_recurrent
from fastweights.testing import fla_standin as fs

BF16 = torch.bfloat16


def inputs(b=1, t=5, h=2, dk=4, dv=3, dtype=BF16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, t, h, dk, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(b, t, h, dv, generator=g).to(dtype)
    beta = torch.rand(b, t, h, generator=g).to(dtype)
    log_decay = -torch.rand(b, t, h, generator=g) * 0.2
    s0 = torch.randn(b, h, dk, dv, generator=g) * 0.1
    return q, k, v, beta, log_decay, s0


@pytest.fixture
def fla(monkeypatch):
    calls = fs.install(monkeypatch)
    yield calls
    monkeypatch.undo()
    fs.uninstall()


def test_install_puts_fla_and_its_guard_flags_in_place(fla):
    """Every module fla's callers import, the version answered to, the refusal flags all False (no refusal)."""
    for name in ("fla", "fla.ops", "fla.ops.delta_rule", "fla.ops.gated_delta_rule", "fla.ops.common",
                 fs.GUARD_MODULE):
        assert name in sys.modules, name
    assert sys.modules["fla"].__version__ == fs.VERSION
    guard = sys.modules[fs.GUARD_MODULE]
    assert (guard.IS_NVIDIA_HOPPER, guard.TRITON_ABOVE_3_4_0, guard.TRITON_ABOVE_3_7_1) == (False, False, False)
    from fastweights.ops import fla_backend

    assert fla_backend.FLA_DEVICE_TYPES == ("cuda", "cpu")


@pytest.mark.parametrize("change, message", [
    (lambda x: {**x, "q": x["q"].float(), "k": x["k"].float(), "v": x["v"].float(), "beta": x["beta"].float()},
     "q is torch.float32, fla takes fp16/bf16"),
    (lambda x: {**x, "v": x["v"].half()}, "v is torch.float16, q is torch.bfloat16"),
    (lambda x: {**x, "beta": x["beta"].half()}, "beta is torch.float16, q is torch.bfloat16"),
    (lambda x: {**x, "g": x["g"].to(BF16)}, "g must be fp32 [B, T, H], got torch.bfloat16 (1, 5, 2)"),
    (lambda x: {**x, "g": x["g"][:, :4]}, "g must be fp32 [B, T, H], got torch.float32 (1, 4, 2)"),
    (lambda x: {**x, "initial_state": x["initial_state"].double()},
     "initial_state must be fp32 [B, H, K, V], got torch.float64 (1, 2, 4, 3)"),
    (lambda x: {**x, "initial_state": x["initial_state"][..., :2]},
     "initial_state must be fp32 [B, H, K, V], got torch.float32 (1, 2, 4, 2)"),
], ids=["fp32", "v-dtype", "beta-dtype", "g-dtype", "g-shape", "s0-dtype", "s0-shape"])
def test_each_broken_contract_is_refused_with_what_is_wrong(fla, change, message):
    q, k, v, beta, g, s0 = inputs()
    x = change({"q": q, "k": k, "v": v, "beta": beta, "g": g, "initial_state": s0})
    with pytest.raises(fs.Contract) as e:
        sys.modules["fla.ops.gated_delta_rule"].chunk_gated_delta_rule(**x)
    assert str(e.value) == message
    assert fla == []  # refused before it is recorded


def test_several_broken_contracts_are_said_together(fla):
    q, k, v, beta, g, s0 = inputs()
    with pytest.raises(fs.Contract) as e:
        sys.modules["fla.ops.delta_rule"].chunk_delta_rule(q=q, k=k.half(), v=v.half(), beta=beta)
    assert str(e.value) == "k is torch.float16, q is torch.bfloat16; v is torch.float16, q is torch.bfloat16"


@pytest.mark.parametrize("chunk", [15, 33, 128])
def test_a_chunk_size_fla_does_not_take_is_a_value_error(fla, chunk):
    q, k, v, beta, _, _ = inputs()
    with pytest.raises(ValueError) as e:
        sys.modules["fla.ops.delta_rule"].chunk_delta_rule(q=q, k=k, v=v, beta=beta, chunk_size=chunk)
    assert str(e.value) == f"`chunk_size` must be 16, 32, or 64, got {chunk}."


@pytest.mark.parametrize("rule", ["delta", "gated"])
def test_a_call_is_recorded_and_computes_the_reference(fla, rule):
    q, k, v, beta, g, s0 = inputs()
    kw = dict(q=q, k=k, v=v, beta=beta, scale=0.5, initial_state=s0, output_final_state=True,
              use_qk_l2norm_in_kernel=True, chunk_size=32, other="x")
    if rule == "gated":
        o, final = sys.modules["fla.ops.gated_delta_rule"].chunk_gated_delta_rule(g=g, **kw)
    else:
        o, final = sys.modules["fla.ops.delta_rule"].chunk_delta_rule(**kw)
    (call,) = fla
    assert call["rule"] == rule and call["chunk_size"] == 32 and call["extra"] == {"other": "x"}
    assert call["scale"] == 0.5 and call["output_final_state"] is True and call["l2norm"] is True
    assert call["q"] is q and call["k"] is k and call["v"] is v and call["beta"] is beta
    assert call["initial_state"] is s0 and (call["g"] is g if rule == "gated" else call["g"] is None)
    assert call["grad"] is False  # no input requires grad
    want_o, want_final = delta_rule_recurrent(
        F.normalize(q.float(), dim=-1, eps=1e-6), F.normalize(k.float(), dim=-1, eps=1e-6), v.float(), beta.float(),
        scale=0.5, initial_state=s0, output_final_state=True, log_decay=g if rule == "gated" else None)
    assert o.dtype == BF16 and final.dtype == torch.float32
    torch.testing.assert_close(o, want_o.to(BF16), rtol=0, atol=0)
    torch.testing.assert_close(final, want_final, rtol=0, atol=0)
    fla.clear()
    sys.modules["fla.ops.delta_rule"].chunk_delta_rule(q=q, k=k, v=v, beta=beta)  # fla's defaults
    sys.modules["fla.ops.gated_delta_rule"].chunk_gated_delta_rule(q=q, k=k, v=v, beta=beta, g=g)
    for call in fla:
        assert call["chunk_size"] == 64 and call["l2norm"] is False and call["scale"] is None
        assert call["initial_state"] is None and call["output_final_state"] is False
    for chunk in (16, 32):  # the other two sizes fla takes
        sys.modules["fla.ops.delta_rule"].chunk_delta_rule(q=q, k=k, v=v, beta=beta, chunk_size=chunk)
    assert [c["chunk_size"] for c in fla[2:]] == [16, 32]


def test_the_recorded_grad_flag_is_whether_a_gradient_will_flow(fla):
    q, k, v, beta, _, _ = inputs()
    call = sys.modules["fla.ops.delta_rule"].chunk_delta_rule
    call(q=q.requires_grad_(), k=k, v=v, beta=beta)
    with torch.no_grad():
        call(q=q, k=k, v=v, beta=beta)
    call(q=q.detach(), k=k, v=v, beta=beta)
    assert [c["grad"] for c in fla] == [True, False, False]


def _grads(rule, **call_kw):
    q, k, v, beta, g, s0 = inputs()
    leaves = {"q": q, "k": k, "v": v, "beta": beta, **({"g": g} if rule == "gated" else {})}
    leaves = {n: x.detach().requires_grad_() for n, x in leaves.items()}
    fn = (sys.modules["fla.ops.gated_delta_rule"].chunk_gated_delta_rule if rule == "gated"
          else sys.modules["fla.ops.delta_rule"].chunk_delta_rule)
    o, _ = fn(**leaves, **call_kw)
    o.float().square().sum().backward()
    return {n: x.grad.float() for n, x in leaves.items()}


def test_wrong_chunk64_halves_the_ungated_rules_k_and_beta_gradients_at_chunk_64_only(fla, monkeypatch):
    right = _grads("delta")
    monkeypatch.setattr(fs, "WRONG_CHUNK64", True)
    wrong = _grads("delta")
    for name in ("q", "v"):
        torch.testing.assert_close(wrong[name], right[name])
    for name in ("k", "beta"):
        torch.testing.assert_close(wrong[name], right[name] * 0.5, rtol=2e-2, atol=1e-2)
        assert not torch.allclose(wrong[name], right[name], rtol=1e-2, atol=1e-3)
    at_32 = _grads("delta", chunk_size=32)  # another chunk size: right
    torch.testing.assert_close(at_32["k"], right["k"])
    gated = _grads("gated")  # the gated rule: not this bug
    monkeypatch.setattr(fs, "WRONG_CHUNK64", False)
    torch.testing.assert_close(gated["k"], _grads("gated")["k"])


def test_wrong_gated_halves_the_gated_rules_k_and_g_gradients(fla, monkeypatch):
    right, right_delta = _grads("gated"), _grads("delta")
    monkeypatch.setattr(fs, "WRONG_GATED", True)
    wrong = _grads("gated")
    for name in ("q", "v", "beta"):
        torch.testing.assert_close(wrong[name], right[name])
    for name in ("k", "g"):
        torch.testing.assert_close(wrong[name], right[name] * 0.5, rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(_grads("delta")["k"], right_delta["k"])  # the ungated rule: untouched


def test_the_gated_backward_is_refused_only_where_fla_refuses_it(fla, monkeypatch):
    _grads("gated")  # no refusal by default
    fs.refuse_gated_backward(monkeypatch, triton="3.6.0")
    with pytest.raises(RuntimeError, match="the gated backward .* is refused on Hopper"):
        _grads("gated")
    _grads("delta")  # the ungated rule has no such guard
    q, k, v, beta, g, _ = inputs()
    with torch.no_grad():  # no backward: the forward runs
        sys.modules["fla.ops.gated_delta_rule"].chunk_gated_delta_rule(q=q, k=k, v=v, beta=beta, g=g)
    fs.refuse_gated_backward(monkeypatch, triton="3.7.1")
    _grads("gated")
