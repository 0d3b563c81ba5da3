"""The delta rule's hand-over to flash-linear-attention, checked on a CPU with a stand-in fla (issue 34, scope 1).

``fastweights.testing.fla_standin`` checks fla's input contract (q, k, v, beta in fp16/bf16, g and the state fp32,
[B, T, H, D] / [B, H, K, V] layouts) and computes with the per-step reference. Here: which backend runs
for which inputs (fp32, bf16, fp32 under autocast, gated with and without a gradient where fla refuses
its gated backward), that the ``fwp`` and ``gdn`` layers under autocast hand fla their fp32 features
cast to bf16 and keep their fast weight fp32, that the results agree with the PyTorch form, and that
the choice is logged once.

Issue 42: on Hopper (capability and Triton version injected) ``auto`` trains the ungated rule through fla at
fla's default chunk size (fla 0.6.0's chunk-64 backward measured right by the GPU queue; fla older than 0.6.0,
whose chunk 64 fla issue 984 reports wrong there, is not used at all: ``auto`` says why and takes the PyTorch
form, ``fla`` is a UserError), and takes fla's gated backward wherever fla allows it (Triton < 3.4 or >= 3.7.1,
or its TileLang backend). Tensors already in fla's dtypes reach the kernel without a copy.
"""

import importlib
import logging
import re
import sys
import tomllib
import types

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import ROOT

from fastweights.core.compare import relative_error
from fastweights.core.errors import UserError
from fastweights.layers.fwp import FastWeightProgrammer, FWPOptions
from fastweights.layers.gdn import GatedDeltaNet, GDNOptions
from fastweights.ops.delta_rule import delta_rule
from fastweights.testing import fla_standin

dr = importlib.import_module("fastweights.ops.delta_rule")
fb = importlib.import_module("fastweights.ops.fla_backend")
BF16 = torch.bfloat16


@pytest.fixture
def fla(monkeypatch, tmp_path):
    calls = fla_standin.install(monkeypatch)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the gradient self-check's verdicts
    monkeypatch.setattr(dr, "_fla_refuses", lambda device: False)
    monkeypatch.setattr(dr, "_warned_fallback", False)
    yield calls
    monkeypatch.undo()
    fla_standin.uninstall()


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
    assert relative_error(o, ref_o) < 1e-2 and relative_error(s, ref_s) < 1e-5


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
    monkeypatch.setenv("FASTWEIGHTS_FLA_GATED_BACKWARD", "safe")  # no self-check (tests/ops/test_fla_selfcheck.py)
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
    assert call["output_final_state"] is True  # the layer carries its fast weights on: fla hands the state back
    assert (call["g"] is not None) == (kind != "fwp-delta")
    assert state["S"].dtype == torch.float32 and state["S"].shape == (2, 2, want_k, want_v)
    # the same layer on the PyTorch form (fp32 fast weights throughout) agrees to bf16 precision
    layer.options.backend = "torch"
    y_ref, state_ref, grads_ref = _train_step(layer, x, autocast=True)
    assert len(fla) == 1
    assert relative_error(y, y_ref) < 3e-2 and relative_error(state["S"], state_ref["S"]) < 3e-2
    for name, g in grads.items():
        assert relative_error(g, grads_ref[name]) < 0.1, name


# ----------------------------------------------------------------------------- issue 42: Hopper's reported faults


def test_the_conditions_read_in_fla_0_6():
    # fla's gated-backward guard: Hopper, 3.4.0 <= Triton < 3.7.1, unless its TileLang backend takes over
    assert fb.refuses_gated_backward(9, (3, 6, 0))
    assert fb.refuses_gated_backward(9, (3, 4, 0)) and fb.refuses_gated_backward(9, (3, 7, 0))
    assert not fb.refuses_gated_backward(9, (3, 3, 1))  # fla allows it: so does auto (scope 4)
    assert not fb.refuses_gated_backward(9, (3, 7, 1))
    assert not fb.refuses_gated_backward(8, (3, 6, 0)) and not fb.refuses_gated_backward(10, (3, 6, 0))
    assert not fb.refuses_gated_backward(9, (3, 6, 0), tilelang_takes_it=True)


def test_the_fla_floor_is_the_gpu_extras():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (req,) = [r for r in project["optional-dependencies"]["gpu"] if r.startswith("flash-linear-attention")]
    floor = re.fullmatch(r"flash-linear-attention>=([\d.]+)", req).group(1)
    assert fb._version_tuple(floor) == fb.FLA_MIN_VERSION == (0, 6, 0)


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
    assert fb.fla_refuses_gated_backward(cuda)
    for triton, major in [("3.3.1", 9), ("3.7.1", 9), ("3.6.0", 8)]:
        hopper_triton(triton=triton, major=major)
        assert not fb.fla_refuses_gated_backward(cuda)
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
    """The stand-in runs on CPU tensors: the device check answers for a Hopper GPU with this Triton."""
    monkeypatch.setattr(dr, "_fla_refuses", lambda device: fb.refuses_gated_backward(9, triton))


def _bf16_leaves():
    q, k, v, beta, g, s0 = inputs()
    return [x.to(BF16).requires_grad_() for x in (q, k, v, beta)] + [g.clone().requires_grad_(), s0]


def test_hopper_trains_the_delta_rule_at_flas_default_chunk(fla, monkeypatch, caplog):
    _on_hopper(monkeypatch, (3, 6, 0))
    q, k, v, beta, g, s0 = _bf16_leaves()
    with caplog.at_level(logging.INFO, logger="fastweights.ops.delta_rule"):
        o, _ = delta_rule(q, k, v, beta, initial_state=s0)
        o.float().square().sum().backward()
    (call,) = fla
    assert call["rule"] == "delta" and call["grad"] and call["chunk_size"] == 64  # fla 0.6.0's chunk 64, measured
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k, v, beta))
    (line,) = [r for r in caplog.records if r.name == "fastweights.ops.delta_rule"]
    assert line.levelno == logging.INFO and "-> 'fla'" in line.getMessage()
    ref, _ = delta_rule(*(x.detach().float() for x in (q, k, v, beta)), initial_state=s0, backend="torch")
    assert relative_error(o, ref) < 1e-2


@pytest.fixture
def old_fla(monkeypatch):
    """The stand-in answering to fla 0.5.2, older than the floor (its chunk 64 reported wrong on Hopper)."""
    calls = fla_standin.install(monkeypatch, version="0.5.2")
    monkeypatch.setattr(dr, "_fla_refuses", lambda device: False)
    yield calls
    monkeypatch.undo()
    fla_standin.uninstall()


def test_an_fla_older_than_the_floor_is_not_used(old_fla, caplog):
    q, k, v, beta, _, s0 = _bf16_leaves()
    with caplog.at_level(logging.INFO, logger="fastweights.ops.delta_rule"):
        for _ in range(2):
            o, _ = delta_rule(q, k, v, beta, initial_state=s0)
    assert old_fla == [] and not dr.fla_available()
    (line,) = [r for r in caplog.records if r.name == "fastweights.ops.delta_rule"]
    assert line.levelno == logging.WARNING and "-> 'torch'" in line.getMessage()
    assert "0.5.2 is older than 0.6.0" in line.getMessage() and "issue 984" in line.getMessage()
    ref, _ = delta_rule(q, k, v, beta, initial_state=s0, backend="torch")
    assert torch.equal(o, ref)
    with pytest.raises(UserError, match=r"backend='fla' cannot run: flash-linear-attention 0.5.2 is older than 0.6.0"):
        delta_rule(q, k, v, beta, backend="fla")
    for version, usable in [("0.6.0", True), ("0.6.1.dev0+g1234", True), ("0.5.9", False), ("unknown", False)]:
        sys.modules["fla"].__version__ = version
        fla_standin._clear(fb)
        assert dr.fla_available() == usable and (fb.fla_unusable_reason() is None) == usable, version


class _Copies(TorchDispatchMode):
    """Counts the aten operations that copy a tensor (a cast, clone, contiguous or copy_)."""

    COPYING = ("aten._to_copy", "aten.clone", "aten.copy_", "aten.contiguous")

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name.startswith(self.COPYING):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def _kernel_that_records(seen):
    def kernel(**kw):
        seen.append(kw)
        return torch.zeros_like(kw["v"]), kw["initial_state"]
    return kernel


@pytest.mark.parametrize("gated", [False, True])
def test_tensors_reach_the_kernel_without_copies(fla, monkeypatch, gated):
    seen = []
    monkeypatch.setattr(fb, "_fla_functions", lambda: (_kernel_that_records(seen), _kernel_that_records(seen)))
    q, k, v, beta, g, s0 = inputs()
    low = [x.to(BF16) for x in (q, k, v, beta)]
    with _Copies() as copies:  # already in fla's dtypes: passed as they are
        delta_rule(*low, initial_state=s0, output_final_state=True, log_decay=g if gated else None)
    assert copies.ops == []
    names = ["q", "k", "v", "beta"]
    assert all(seen[0][n] is x for n, x in zip(names, low)) and seen[0]["initial_state"] is s0
    assert not gated or seen[0]["g"] is g
    with _Copies() as copies, torch.autocast("cpu", dtype=BF16):  # fp32 features: one cast each, nothing else
        delta_rule(q, k, v, beta, initial_state=s0, output_final_state=True, log_decay=g if gated else None)
    assert copies.ops == ["aten._to_copy"] * 4 and seen[1]["initial_state"] is s0
    assert all(seen[1][n].dtype == BF16 for n in names) and (not gated or seen[1]["g"] is g)


@pytest.mark.parametrize("triton", [(3, 3, 1), (3, 7, 1)])
def test_auto_takes_fla_gated_backward_wherever_fla_allows_it(fla, monkeypatch, triton):
    _on_hopper(monkeypatch, triton)
    q, k, v, beta, g, s0 = _bf16_leaves()
    o, _ = delta_rule(q, k, v, beta, log_decay=g, initial_state=s0, qk_l2norm=True)
    o.float().square().sum().backward()
    (call,) = fla
    assert call["rule"] == "gated" and call["grad"] and call["chunk_size"] == 64 and g.grad is not None
    # and where fla refuses it (3.4 <= Triton < 3.7.1) and no self-check lifts that, the compiled form, fla untouched
    _on_hopper(monkeypatch, (3, 6, 0))
    monkeypatch.setenv("FASTWEIGHTS_FLA_GATED_BACKWARD", "safe")
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


@pytest.mark.parametrize("bad", ["k", "v", "beta"])
def test_the_stand_in_refuses_each_layout_fla_would(bad):
    """The stand-in holds our calls to fla's layout contract: any one tensor of another layout is refused, so a
    dispatch that mixed up [B, T, H, K] and [B, H, T, K] for one of them fails here as it would in fla."""
    b, t, h, dk = 1, 4, 2, 8
    q = torch.zeros(b, t, h, dk, dtype=torch.bfloat16)
    args = {"k": torch.zeros(b, t, h, dk, dtype=torch.bfloat16), "v": torch.zeros(b, t, h, dk, dtype=torch.bfloat16),
            "beta": torch.zeros(b, t, h, dtype=torch.bfloat16)}
    fla_standin._check(q, args["k"], args["v"], args["beta"], None, None)  # fla's layout: accepted
    args[bad] = args[bad].transpose(1, 2)  # [B, H, T, ...]
    with pytest.raises(fla_standin.Contract, match="layout"):
        fla_standin._check(q, args["k"], args["v"], args["beta"], None, None)


@pytest.mark.parametrize("requested, chosen, unusable, level", [
    ("auto", "compiled", None, logging.WARNING),  # auto avoided fla's refused gated backward: said loudly
    ("compiled", "compiled", None, logging.INFO),  # asked for: nothing to warn about
    ("auto", "torch", "fla is not installed", logging.WARNING),  # fla would take the call but cannot
    ("auto", "torch", None, logging.INFO),  # the PyTorch form is the right one here (fp32)
])
def test_the_choice_is_a_warning_only_where_auto_avoids_fla(monkeypatch, caplog, requested, chosen, unusable, level):
    """Mutation caught (issue 49, seed 7): the compiled form asked for by name warned, and auto's did not."""
    monkeypatch.setattr(fb, "_logged", set())
    with caplog.at_level(logging.INFO, logger=fb.logger.name):
        fb.log_choice_once(requested, chosen, "cuda", BF16, True, True, fla_unusable=unusable)
    (record,) = [r for r in caplog.records if r.name == fb.logger.name]
    assert record.levelno == level, record.getMessage()


def test_the_stand_in_names_each_broken_part_of_flas_input_contract():
    """fla takes q, k, v, beta in fp16/bf16 of one dtype, g and the state fp32: the stand-in refuses each breach by
    name, so a dispatch test that trips it says what was wrong. Mutation caught (issue 49, seed 9): the dtype
    problem's message dropped."""
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(fla_standin.Contract, match=r"^q is torch\.float32, fla takes fp16/bf16$"):
        fla_standin._check(q, q, q, torch.rand(1, 4, 2), None, None)
    q16 = q.to(BF16)
    with pytest.raises(fla_standin.Contract, match=r"^k is torch\.float32, q is torch\.bfloat16$"):
        fla_standin._check(q16, q, q16, torch.rand(1, 4, 2).to(BF16), None, None)
    with pytest.raises(fla_standin.Contract, match=r"^beta is torch\.float32, q is torch\.bfloat16$"):
        fla_standin._check(q16, q16, q16, torch.rand(1, 4, 2), None, None)


@pytest.mark.parametrize("args, message", [
    (("auto", "compiled", "cuda", BF16, True, True),
     "delta_rule: backend='auto' -> 'compiled' for cuda bfloat16 gated, training (fla refuses the gated backward on "
     "this GPU (Hopper, 3.4 <= Triton < 3.7.1, no TileLang) and its gradient self-check did not lift that (the line "
     "before says why): the chunkwise form compiled with torch.compile)"),
    (("auto", "torch", "cpu", torch.float32, False, False),
     "delta_rule: backend='auto' -> 'torch' for cpu float32 ungated, no grad (the chunkwise PyTorch form: fla not "
     "importable (or too old), not on CUDA, or fp32 outside autocast)"),
    (("fla", "fla", "cuda", torch.float16, False, True),
     "delta_rule: backend='fla' -> 'fla' for cuda float16 ungated, training (as requested)"),
])
def test_the_choice_line_names_the_request_the_choice_the_call_and_why(monkeypatch, caplog, args, message):
    monkeypatch.setattr(fb, "_logged", set())
    with caplog.at_level(logging.INFO, logger=fb.logger.name):
        fb.log_choice_once(*args)
    (record,) = [r for r in caplog.records if r.name == fb.logger.name]
    assert record.getMessage() == message


def test_a_chunk_size_reaches_flas_kernel_only_when_given(monkeypatch):
    seen = []
    monkeypatch.setattr(fb, "_fla_functions", lambda: (_kernel_that_records(seen), _kernel_that_records(seen)))
    q, k, v, beta, g, s0 = inputs()
    fb.fla_delta_rule(q, k, v, beta, 0.5, s0, True, None, False)
    fb.fla_delta_rule(q, k, v, beta, 0.5, s0, True, g, True, chunk_size=32)
    assert "chunk_size" not in seen[0] and seen[1]["chunk_size"] == 32  # fla's own default where none is given
    assert seen[0]["scale"] == 0.5 and seen[0]["output_final_state"] and not seen[0]["use_qk_l2norm_in_kernel"]
    assert seen[1]["use_qk_l2norm_in_kernel"] and seen[1]["g"].dtype == torch.float32
