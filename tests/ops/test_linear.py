"""ops.linear: one CPU linear whose three products each run on the fastest of torch's fp32 GEMM and oneDNN's (in two
operand orders), as measured on the machine. Held here: the autograd formula against F.linear (fp64, and double backward), oneDNN's
products against F.linear in fp32 for every layout our layers and the FWL head pass, the route taken exactly where
it applies, the choice measured and never slower (a stand-in slower kernel loses), and the choice kept per machine
and thread count in the cache file (a second process computes with the same kernels)."""

import json
import platform
import re
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fastweights.ops import linear as lin
from fastweights.ops import streamed_unembedding as su

needs_onednn = pytest.mark.skipif(not lin.onednn_available(), reason="no oneDNN linear on this machine or build")


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Every test with its own cache folder and no choices in memory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(lin, "_CHOICES", {})
    monkeypatch.delenv("FASTWEIGHTS_LINEAR", raising=False)


def _spy(monkeypatch, name="onednn"):
    """Count the calls of the kernel ``name`` (by the dtype of their first argument)."""
    calls = []
    real = lin.KERNELS[name]
    monkeypatch.setitem(lin.KERNELS, name, lambda a, w, b: calls.append(a.dtype) or real(a, w, b))
    return calls


def _leaves(shape_x, n, dtype=torch.float32, bias=True, seed=0, weight_t=False):
    g = torch.Generator().manual_seed(seed)
    k = shape_x[-1]
    x = torch.randn(*shape_x, generator=g, dtype=dtype).requires_grad_()
    w = torch.randn(k, n, generator=g, dtype=dtype).T if weight_t else torch.randn(n, k, generator=g, dtype=dtype)
    b = torch.randn(n, generator=g, dtype=dtype) if bias else None
    w.requires_grad_()
    if b is not None:
        b.requires_grad_()
    return x, w, b


def _grads(fn, x, w, b):
    leaves = [t for t in (x, w, b) if t is not None]
    for t in leaves:
        t.grad = None
    y = fn(x, w, b)
    (y * torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype)).square().sum().backward()
    return [y.detach()] + [t.grad.clone() for t in leaves]


@pytest.mark.parametrize("kernels", [("torch",) * 3, ("onednn", "torch", "onednn"), ("torch", "onednn", "torch")])
def test_the_autograd_formula_equals_F_linear_in_fp64(kernels):
    """The Function's backward (dx = g W, dW = g^T x, db = sum g) against F.linear's, fp64, whatever kernel each
    product is said to run on (oneDNN has no fp64: the stand-in is torch's kernel under oneDNN's name)."""
    kernels_fp64 = {"torch": lin._torch_kernel, "onednn": lambda a, w, b: F.linear(a, w, b)}
    x, w, b = _leaves((37, 19), 23, torch.float64)
    old = dict(lin.KERNELS)
    lin.KERNELS.update(kernels_fp64)
    try:
        got = _grads(lambda x, w, b: lin._Linear.apply(x, w, b, kernels), x, w, b)
        assert torch.autograd.gradcheck(lambda x, w, b: lin._Linear.apply(x, w, b, kernels), (x, w, b))
    finally:
        lin.KERNELS.update(old)
    want = _grads(F.linear, x, w, b)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


@needs_onednn
def test_double_backward_through_the_oneDNN_route(monkeypatch):
    """create_graph (the FWL's second-order gradients): the gradient is itself differentiable, and its
    gradient is F.linear's."""
    monkeypatch.setenv("FASTWEIGHTS_LINEAR", "onednn")
    calls = _spy(monkeypatch)

    def second(fn):
        x, w, b = _leaves((64, 32), 48, seed=2)
        y = fn(x, w, b)
        (gx,) = torch.autograd.grad(y.sin().sum(), x, create_graph=True)
        gx.square().sum().backward()
        return [gx.detach(), w.grad, b.grad, x.grad]

    got = second(lin.linear)
    assert calls  # the forward went through oneDNN
    for a, e in zip(got, second(F.linear)):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


SHAPES = {  # the shape classes our layers pass: [B, T, d] projections, [M, d] heads, odd sizes, one row
    "projection_3d": ((4, 16, 64), 192, True, False),
    "mlp_down_no_bias": ((2, 32, 160), 64, False, False),
    "lm_head_odd_vocab": ((3, 20, 48), 65, False, False),
    "one_row": ((1, 256), 512, True, False),
    "weight_stored_transposed": ((40, 96), 80, True, True),
}


@needs_onednn
@pytest.mark.parametrize("kernel", ["onednn", "onednn_transposed"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_oneDNN_products_equal_F_linear_in_fp32(name, kernel, monkeypatch):
    """Both oneDNN forms (``a w^T`` and ``(w a^T)^T``), every product."""
    shape, n, bias, weight_t = SHAPES[name]
    monkeypatch.setattr(lin, "kernels_for", lambda *a: [kernel] * 3)
    monkeypatch.setattr(lin, "MIN_WORK", 0)
    calls = _spy(monkeypatch, kernel)
    x, w, b = _leaves(shape, n, bias=bias, weight_t=weight_t, seed=7)
    got = _grads(lin.linear, x, w, b)
    assert len(calls) == 3  # forward, input grad, weight grad
    for a, e in zip(got, _grads(F.linear, x, w, b)):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


def _weights(seed=0, vocab=300, width=24):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(vocab, width, generator=g)  # an output embedding [V, s], as HF stores it
    return emb, torch.randn(vocab, generator=g), torch.randn(7, width, generator=g), g


@needs_onednn
@pytest.mark.parametrize("layout", ["rows", "transposed_view", "vocab_slice", "slice_of_view"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_no_grad_oneDNN_equals_F_linear_for_the_FWL_heads_strides(layout, with_bias, monkeypatch):
    monkeypatch.setenv("FASTWEIGHTS_LINEAR", "onednn")
    monkeypatch.setattr(lin, "MIN_WORK", 0)
    calls = _spy(monkeypatch)
    emb, bias, x, g = _weights()
    if layout == "rows":  # x emb^T: the logits
        weight, b = emb, bias
    elif layout == "transposed_view":  # e emb: the inner gradient's second product, weight = emb^T (a view)
        x, weight, b = torch.randn(7, emb.shape[0], generator=g), emb.T, bias[: emb.shape[1]]
    elif layout == "vocab_slice":
        weight, b = emb[40:140], bias[40:140]
    else:  # E = emb^T [s, V] sliced along the vocabulary, then transposed back: what the streamed loop passes
        weight, b = emb.T[:, 40:140].T, bias[40:140]
    b = b if with_bias else None
    with torch.no_grad():
        torch.testing.assert_close(lin.linear(x, weight, b), F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    assert calls == [torch.float32]


@needs_onednn
def test_the_route_is_taken_exactly_where_it_applies(monkeypatch):
    monkeypatch.setenv("FASTWEIGHTS_LINEAR", "onednn")
    monkeypatch.setattr(lin, "MIN_WORK", 0)
    calls = _spy(monkeypatch)
    x, w, b = (t.detach() for t in _leaves((8, 32), 16))
    lin.linear(x, w, b)
    assert calls == [torch.float32]
    lin.linear(x.double(), w.double(), b.double())  # fp64
    lin.linear(x.bfloat16(), w.bfloat16(), b.bfloat16())  # bf16
    lin.linear(x.T.contiguous().T, w, b)  # an input that is not contiguous
    lin.linear(x, torch.randn(16, 64)[:, ::2], None)  # a weight with no unit stride
    for other in (b.double(), b.half()):  # a bias the kernels cannot take beside an x and weight they can
        with pytest.raises(RuntimeError, match="dtype"):  # F.linear's own error (oneDNN's would be another)
            lin.linear(x, w, other)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lin.linear(x, w, b)
    torch.func.vmap(lambda xx: lin.linear(xx, w, b))(x.view(2, 4, 32))
    torch.func.grad(lambda xx: lin.linear(xx, w, b).sum())(x)
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)  # the user switched oneDNN off
    lin.linear(x, w, b)
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", True)
    is_compiling = torch.compiler.is_compiling
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # traced by torch.compile: its own linear
    lin.linear(x, w, b)
    monkeypatch.setattr(torch.compiler, "is_compiling", is_compiling)
    monkeypatch.setenv("FASTWEIGHTS_LINEAR", "torch")
    lin.linear(x, w, b)
    assert calls == [torch.float32]


@needs_onednn
def test_a_call_whose_products_are_all_torchs_is_F_linear_itself(monkeypatch):
    """Nothing slower where torch's kernel wins: no Python Function between the call and torch's autograd."""
    monkeypatch.setattr(lin, "kernels_for", lambda *a: ["torch", "torch", "torch"])
    monkeypatch.setattr(lin._Linear, "apply", lambda *a: pytest.fail("the Function was used"))
    x, w, b = _leaves((64, 32), 48)
    y = lin.linear(x, w, b)
    assert y.grad_fn.name() == F.linear(x, w, b).grad_fn.name()
    # the input grad alone on oneDNN: an input that needs no gradient does not need the Function either
    monkeypatch.setattr(lin, "kernels_for", lambda *a: ["torch", "onednn", "torch"])
    lin.linear(x.detach(), w, b)
    # ... and an input that needs one does, its weight frozen (mutation caught: the weight's kernel read for x's)
    used = []
    monkeypatch.setattr(lin._Linear, "apply", lambda x2, w2, b2, k: used.append(k) or torch.zeros(len(x2), len(w2)))
    lin.linear(x, w.detach(), b.detach())
    assert used == [("torch", "onednn", "torch")]


@needs_onednn
def test_under_no_grad_only_the_forward_kernel_counts_whatever_requires_grad(monkeypatch):
    """Scoring with parameters (the FWL head's, a model's under ``torch.no_grad()``): the tensors require grad but
    no gradient is computed, so the call is the forward's kernel alone, never the Python Function: ``F.linear``
    itself where the forward is torch's (the backward products' oneDNN choice is irrelevant), oneDNN's kernel
    directly where it is oneDNN's. Mutation caught: ``wants_grad`` ignoring ``torch.is_grad_enabled()`` (issue 49)."""
    monkeypatch.setattr(lin._Linear, "apply", lambda *a: pytest.fail("the Function was used under no_grad"))
    calls, torch_calls = _spy(monkeypatch), _spy(monkeypatch, "torch")  # F.linear itself is neither
    x, w, b = _leaves((64, 32), 48)
    with torch.no_grad():
        monkeypatch.setattr(lin, "kernels_for", lambda *a: ["torch", "onednn", "onednn"])
        torch.testing.assert_close(lin.linear(x, w, b), F.linear(x, w, b))
        assert calls == [] and torch_calls == []  # (mutation caught: the weight's kernel counted under no_grad)
        monkeypatch.setattr(lin, "kernels_for", lambda *a: ["onednn", "torch", "torch"])
        torch.testing.assert_close(lin.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        assert calls == [torch.float32]
    # with grad enabled but nothing requiring it (plain tensors, no bias): the same, the forward's kernel alone
    x, w = x.detach(), w.detach()
    torch.testing.assert_close(lin.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert calls == [torch.float32] * 2


def test_a_call_is_classed_by_its_rows_and_its_weights_layout(monkeypatch):
    """``call_kernels`` asks for the kernels of ``x``'s rows (1-D x: one row) and the weight's layout: row-major
    (a row slice of one too) is not transposed, the transpose of a row-major matrix (a column slice too) is, other
    strides and a 1-D weight are ``F.linear``'s (mutations caught: the layouts swapped, the layout or the route
    not handed on, a 1-D x refused)."""
    asked = []
    monkeypatch.setattr(lin, "kernels_for", lambda *a: asked.append(a) or ["onednn"] * 3)
    x = torch.randn(6, 8)
    for w, transposed in ((torch.randn(4, 8), False), (torch.randn(5, 8)[1:], False),
                          (torch.randn(8, 4).T, True), (torch.randn(8, 6)[:, 1:5].T, True)):
        assert lin.call_kernels(x, w) == ["onednn"] * 3 and asked.pop() == (6, 8, 4, transposed, "auto")
    assert lin.call_kernels(x[0], torch.randn(4, 8)) == ["onednn"] * 3 and asked.pop() == (1, 8, 4, False, "auto")
    assert lin.call_kernels(x, torch.randn(4, 16)[:, ::2]) is None and not asked  # no unit stride
    monkeypatch.setenv("FASTWEIGHTS_LINEAR", "onednn")
    lin.call_kernels(x, torch.randn(4, 8))
    assert asked.pop()[-1] == "onednn"


def test_tiny_calls_are_not_measured(monkeypatch):
    monkeypatch.setattr(lin, "measure", lambda *a, **k: pytest.fail("measured"))
    assert lin.kernels_for(4, 8, 8, False) == ["torch"] * 3


@needs_onednn
def test_a_call_of_MIN_WORK_is_measured_and_the_choice_logged(monkeypatch, caplog):
    """The work bound is ``m k n < MIN_WORK`` (a call of exactly MIN_WORK is measured: mutation caught, ``<=``);
    the forced route names each of the three products; a measured choice is logged at INFO with its shape class
    and the kernel per product."""
    assert lin.kernels_for(4, 8, 8, False, route="onednn") == ["onednn"] * 3
    times = {p: {"torch": 2.0, "onednn": 1.0} for p in lin.PRODUCTS}
    monkeypatch.setattr(lin, "measure", lambda *a, **k: times)
    monkeypatch.setattr(lin, "_store_choice", lambda *a: None)
    with caplog.at_level("INFO", logger=lin.__name__):
        assert lin.kernels_for(4, 8, lin.MIN_WORK // 32, False) == ["onednn"] * 3
    assert caplog.messages == [f"linear 4x8x{lin.MIN_WORK // 32}: {{'forward': 'onednn', 'input_grad': 'onednn', "
                               "'weight_grad': 'onednn'} (measured on this machine)"]


def test_the_choice_takes_oneDNN_only_where_it_is_clearly_faster():
    t = {"forward": {"torch": 1.0, "onednn": 0.5}, "input_grad": {"torch": 1.0, "onednn": 0.95},
         "weight_grad": {"torch": 0.5, "onednn": 1.0}}
    assert lin.choose(t) == ["onednn", "torch", "torch"]
    t["weight_grad"].update(onednn=0.4, onednn_transposed=0.3)  # the fastest of three, clearly ahead of torch's
    t["forward"]["onednn_transposed"] = t["input_grad"]["onednn_transposed"] = float("inf")
    assert lin.choose(t) == ["onednn", "torch", "onednn_transposed"]
    # torch's taking exactly MARGIN times as long is "clearly" enough (mutation caught: ``>``)
    assert lin.choose({p: {"torch": lin.MARGIN * 0.5, "onednn": 0.5} for p in lin.PRODUCTS}) == ["onednn"] * 3


def test_the_transposed_form_hands_oneDNN_the_operands_swapped(monkeypatch):
    """``(w a^T)^T``: oneDNN reads ``w`` row by row (the form's point: the weight gradient's ``g^T`` is not copied
    first), and the result is laid out as ``a w^T``'s."""
    seen = []
    monkeypatch.setattr(lin, "_onednn_kernel", lambda a, w, b: seen.append((a.shape, w.shape, b)) or a @ w.T)
    a, w = torch.randn(5, 3), torch.randn(7, 3)
    y = lin.KERNELS["onednn_transposed"](a, w, torch.ones(7))
    assert seen == [((7, 3), (5, 3), None)] and y.is_contiguous()
    torch.testing.assert_close(y, a @ w.T + 1)


def test_a_choice_made_among_other_kernels_is_made_again(monkeypatch):
    """The stored choices are keyed on the kernels chosen among: a file written before a kernel was added (here,
    the set without the transposed oneDNN form) does not stand for this version's choice."""
    now = lin._machine_key()
    monkeypatch.delitem(lin.KERNELS, "onednn_transposed")
    assert lin._machine_key() != now


def _slow_kernel(a, w, b):
    for _ in range(3):
        y = F.linear(a, w, b)
    return y


def test_a_slower_kernel_is_never_chosen():
    """On a machine where torch's default is the fastest, nothing is slower: a stand-in kernel doing the work
    three times, and one that gives other numbers, both lose to torch's at every product."""
    assert lin.choose(lin.measure(256, 128, 128, False, kernels={"torch": lin._torch_kernel,
                                                                   "onednn": _slow_kernel})) == ["torch"] * 3
    wrong = {"torch": lin._torch_kernel, "onednn": lambda a, w, b: torch.zeros(a.shape[0], w.shape[0])}
    times = lin.measure(256, 128, 128, False, kernels=wrong)
    assert all(times[p]["onednn"] == float("inf") for p in lin.PRODUCTS)


@needs_onednn
def test_the_choice_is_measured_once_and_kept_per_machine_and_thread_count(monkeypatch):
    measured = []
    real = lin.measure

    def counting(*args, **kw):
        measured.append(args)
        return real(*args, **kw)

    monkeypatch.setattr(lin, "measure", counting)
    first = lin.kernels_for(200, 128, 96, False)
    assert lin.kernels_for(256, 128, 96, False) == first  # the same class (M rounded up to 256)
    assert measured == [(256, 128, 96, False)]
    lin.kernels_for(200, 128, 96, True)  # the weight stored transposed: another class
    assert len(measured) == 2
    # a new process (no choices in memory) reads the file and measures nothing
    monkeypatch.setattr(lin, "_CHOICES", {})
    assert lin.kernels_for(256, 128, 96, False) == first
    assert len(measured) == 2
    torch.set_num_threads(2)  # another thread count: measured again
    lin.kernels_for(256, 128, 96, False)
    assert len(measured) == 3


def test_a_calls_rows_are_classed_by_the_power_of_two_at_or_above_them():
    """A scoring loop's ragged last segment (M = 3 or 5 rows) shares a class with the full segments above it, and a
    full power of two is its own class (mutations caught: ``m - 2``, a floor of 1 making M = 1 a class of 2)."""
    assert [lin._rows_class(m) for m in (1, 2, 3, 4, 5, 64, 65)] == [1, 2, 4, 4, 8, 64, 128]
    assert lin.shape_key(3, 8, 16, False) == "4x8x16"


@needs_onednn
def test_a_stored_choice_is_what_a_second_process_computes_with(monkeypatch):
    """The kernels a run used are the ones its resume uses: a stored choice is followed, not re-measured."""
    key = lin.shape_key(256, 128, 96, False)
    assert lin.shape_key(256, 128, 96, True) == key + "T" and not key.endswith("T") and key.endswith("x128x96")
    lin._store_choice(lin._machine_key(), key, ["onednn", "onednn", "torch"])
    monkeypatch.setattr(lin, "measure", lambda *a, **k: pytest.fail("measured"))
    assert lin.kernels_for(256, 128, 96, False) == ["onednn", "onednn", "torch"]


@needs_onednn
def test_a_broken_or_unwritable_cache_measures_again_and_still_computes(tmp_path, monkeypatch, caplog):
    path = lin._cache_path()
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert len(lin.kernels_for(256, 128, 96, False)) == 3
    # an entry naming a kernel this version does not have (another version's file, a hand edit): measured again
    path.write_text(json.dumps({lin._machine_key(): {lin.shape_key(256, 128, 64, False): ["bogus", "torch", "torch"]}}))
    monkeypatch.setattr(lin, "_CHOICES", {})
    assert set(lin.kernels_for(256, 128, 64, False)) <= set(lin.KERNELS)
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))  # a file where the folder should be
    monkeypatch.setattr(lin, "_CHOICES", {})
    x, w, b = (t.detach() for t in _leaves((256, 128), 96))
    with caplog.at_level("DEBUG", logger=lin.__name__):
        torch.testing.assert_close(lin.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    # why nothing was stored, for a user who turns on debug logging: the message and the OS's error
    [record] = [r for r in caplog.records if "not stored" in r.getMessage()]
    assert re.fullmatch(r"linear kernel choices not stored \(\[Errno \d+\] .+\)", record.getMessage())


def test_a_kernels_time_is_the_best_of_its_calls_within_the_budget(monkeypatch):
    """One warm-up call, then at least 3 timed calls, more while the budget lasts, at most ``most`` (mutation
    caught: the time spent starting at 1 s, which left every kernel timed on 3 calls). On a stand-in clock where
    every call takes 1 ms, so that a busy machine's pause cannot end the loop early."""
    clock = iter(range(10**6))
    monkeypatch.setattr(lin.time, "perf_counter", lambda: next(clock) * 1e-3)  # each reading 1 ms after the last
    calls = []
    assert lin._best_time(lambda: calls.append(1), budget_s=0.0105, most=20) == pytest.approx(1e-3)
    assert len(calls) == 1 + 11  # the warm-up, then calls until 11 ms are spent
    calls.clear()
    lin._best_time(lambda: calls.append(1), budget_s=1.0, most=20)
    assert len(calls) == 1 + 20  # at most ``most``
    calls.clear()
    lin._best_time(lambda: calls.append(1), budget_s=0.0, most=20)
    assert len(calls) == 1 + 3  # at least 3


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64") or not torch.backends.mkldnn.is_available(),
                    reason="oneDNN's linear is an x86 CPU build's")
def test_the_oneDNN_op_of_this_torch_passes_its_check():
    """The torch the project pins has the private op, and the check at first use accepts it (a kernel that dropped
    its bias would fail the check and silently leave every product on torch's: the tests above would still pass)."""
    lin.onednn_available.cache_clear()
    assert lin.onednn_available()
    x, w, b = torch.randn(5, 4), torch.randn(3, 4), torch.randn(3)
    with torch.no_grad():
        torch.testing.assert_close(lin.KERNELS["onednn"](x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_the_oneDNN_op_is_dropped_where_it_is_missing_or_gives_other_numbers(monkeypatch):
    """A private op: a build without it, or one whose op means something else, leaves every product on torch's."""
    monkeypatch.setattr(torch.ops, "mkldnn", types.SimpleNamespace())  # no _linear_pointwise at all
    lin.onednn_available.cache_clear()
    try:
        assert not lin.onednn_available()
        wrong = types.SimpleNamespace(default=lambda x, w, b, *rest: F.linear(x, w))  # ignores the bias
        monkeypatch.setattr(torch.ops, "mkldnn", types.SimpleNamespace(_linear_pointwise=wrong))
        lin.onednn_available.cache_clear()
        assert not lin.onednn_available()
        bad_signature = types.SimpleNamespace(default=lambda x, w: F.linear(x, w))  # TypeError
        monkeypatch.setattr(torch.ops, "mkldnn", types.SimpleNamespace(_linear_pointwise=bad_signature))
        lin.onednn_available.cache_clear()
        assert not lin.onednn_available()
        assert lin.kernels_for(4096, 256, 256, False) == ["torch"] * 3
    finally:
        monkeypatch.undo()
        lin.onednn_available.cache_clear()


def test_Linear_is_nn_Linear_with_the_same_state_dict():
    torch.manual_seed(0)
    ours = lin.Linear(12, 7)
    torch.manual_seed(0)
    theirs = nn.Linear(12, 7)
    assert isinstance(ours, nn.Linear)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    for k in theirs.state_dict():
        torch.testing.assert_close(ours.state_dict()[k], theirs.state_dict()[k], rtol=0, atol=0)
    x = torch.randn(3, 12)
    torch.testing.assert_close(ours(x), theirs(x))  # the bias added (mutation caught: forward without it)


@needs_onednn
def test_fast_linears_lends_the_route_for_the_block_only(monkeypatch):
    monkeypatch.setenv("FASTWEIGHTS_LINEAR", "onednn")
    monkeypatch.setattr(lin, "MIN_WORK", 0)
    calls = _spy(monkeypatch)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    hooked = model[2]
    hooked.forward = lambda x: F.linear(x, hooked.weight, hooked.bias)  # replaced on the instance: left alone
    x = torch.randn(5, 16)
    want = model(x)
    with lin.fast_linears(model):
        torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
    assert len(calls) == 1  # the first layer only
    assert "forward" not in vars(model[0]) and "forward" in vars(hooked)
    with pytest.raises(RuntimeError), lin.fast_linears(model):
        raise RuntimeError("an error inside the block")
    assert "forward" not in vars(model[0])
    model(x)
    assert len(calls) == 1


# ------------------------------------------------------------------- the FWL head's vocabulary products


@needs_onednn
def test_streamed_passes_in_fp32_take_the_oneDNN_route_and_match_fp64(monkeypatch):
    """The FWL's two vocabulary passes in fp32 (oneDNN) against the fp64 formulas, with a non-zero bias c."""
    monkeypatch.setenv("FASTWEIGHTS_LINEAR", "onednn")
    monkeypatch.setattr(lin, "MIN_WORK", 0)
    calls = _spy(monkeypatch)
    emb, c, y, g = _weights(seed=3, vocab=2500)
    E = emb.T  # [s, V], a view as the head passes it
    labels = torch.randint(0, 2500, (7,), generator=g)
    scale = torch.rand(7, generator=g) + 0.5
    logits64 = y.double() @ E.double() + c.double()
    direct = scale.double()[:, None] * ((torch.softmax(logits64, -1) - F.one_hot(labels, 2500).double()) @ E.double().T)
    torch.testing.assert_close(su.unembedding_grad_streamed(y, E, c, labels, scale).double(), direct,
                               rtol=1e-4, atol=1e-5)
    n_grad = len(calls)
    assert n_grad == 2 * 3  # two products per slice of 1,024 columns, three slices
    torch.testing.assert_close(su.unembedding_no_grad(y, E, c).double(), logits64, rtol=1e-5, atol=1e-4)
    assert len(calls) == n_grad + 1  # one GEMM for the whole logits


def test_no_grad_logits_in_slices_where_torchs_kernel_is_chosen(monkeypatch):
    monkeypatch.setenv("FASTWEIGHTS_LINEAR", "torch")
    emb, c, y, _ = _weights(seed=4, vocab=2500)
    torch.testing.assert_close(su.unembedding_no_grad(y, emb.T, c), F.linear(y, emb, c), rtol=1e-5, atol=1e-4)


@needs_onednn
def test_fwl_scoring_in_fp32_on_the_oneDNN_route_matches_the_fp64_training_path(monkeypatch):
    """The whole no-grad FWL pass (residual head, every tensor fast, segments, a vocabulary of several
    slices) in fp32 through oneDNN against the differentiable path in fp64 (torch's kernels), and the
    vocabulary products really went through oneDNN."""
    from fastweights.ops.fwl import BLOCK_FAST, fwl_parallel

    monkeypatch.setenv("FASTWEIGHTS_LINEAR", "onednn")
    monkeypatch.setattr(lin, "MIN_WORK", 0)
    calls = _spy(monkeypatch)
    g = torch.Generator().manual_seed(5)
    s, v, b, t = 8, 2300, 2, 13

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    params = {"U": r(s, 4 * s, scale=0.3), "a": r(4 * s, scale=0.1), "W": r(4 * s, s, scale=0.3), "b": r(s, scale=0.1),
              "ln_weight": 0.5 + r(s, scale=0.1), "ln_bias": r(s, scale=0.1), "E": r(s, v), "c": r(v, scale=0.2)}
    h, labels = r(b, t, s), torch.randint(0, v, (b, t), generator=g)
    weights = torch.ones(b, t, dtype=torch.float64)
    weights[:, -1] = 0
    steps = {n: torch.tensor(0.05 + 0.05 * i, dtype=torch.float64) for i, n in enumerate(BLOCK_FAST)}
    decays = {n: torch.tensor(0.7, dtype=torch.float64) for n in BLOCK_FAST}
    kw = dict(segment_len=5, start=3, decays=decays, residual=True, logits_from=1)
    want, _ = fwl_parallel(h, labels, weights, {n: p.requires_grad_(True) for n, p in params.items()}, steps, **kw)

    def f32(d):
        return {n: x.detach().float() for n, x in d.items()}

    with torch.no_grad():
        got, _ = fwl_parallel(h.float(), labels, weights.float(), f32(params), f32(steps), **{**kw, "decays": f32(decays)})
    torch.testing.assert_close(got.double(), want.detach(), rtol=1e-4, atol=1e-4)
    assert len(calls) >= 2 * 3 + 1  # the inner gradient's two products per slice, and the fast logits


@needs_onednn
def test_a_training_run_on_the_oneDNN_route_follows_torchs(monkeypatch):
    """Five AdamW steps of a small LM with every product forced onto oneDNN give torch's losses to fp32 rounding."""
    from fastweights.core.config import ModelConfig
    from fastweights.models.lm import LanguageModel

    def losses(route):
        monkeypatch.setenv("FASTWEIGHTS_LINEAR", route)
        torch.manual_seed(0)
        model = LanguageModel(ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=2))
        opt = torch.optim.AdamW(model.parameters(), 1e-2)
        x = torch.randint(0, 40, (4, 17), generator=torch.Generator().manual_seed(1))
        out = []
        for _ in range(5):
            loss = model(x[:, :-1], targets=x[:, 1:]).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.item())
        return out

    calls = _spy(monkeypatch)
    on_onednn = losses("onednn")
    assert calls
    assert on_onednn == pytest.approx(losses("torch"), rel=1e-4)


@needs_onednn
def test_a_call_reads_no_file_once_the_choice_is_known(monkeypatch):
    """The machine's key (the CPU read from /proc/cpuinfo) and the stored choices are read once per process, not
    at every call: a per-call read cost more than the products of a small model's step."""
    import builtins

    x, w, b = _leaves((256, 128), 96)
    lin.linear(x, w, b).sum().backward()  # measured, stored, the machine's key computed
    opened = []
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda *a, **k: opened.append(a[0]) or real_open(*a, **k))
    monkeypatch.setattr(type(lin._cache_path()), "read_text", lambda *a, **k: opened.append("cache") or "{}")
    for _ in range(5):
        lin.linear(x, w, b).sum().backward()
    assert opened == []


def test_a_misspelt_route_is_one_clear_error_and_exit_2(tmp_path):
    """FASTWEIGHTS_LINEAR=onedn (a typo) is said, not silently measured: the command exits 2 with one line."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "FASTWEIGHTS_LINEAR": "onedn"}
    r = subprocess.run([sys.executable, "-m", "fastweights", "train", "--preset", "tiny", "--quiet", "--out",
                        str(tmp_path / "run")], capture_output=True, text=True, env=env)
    assert r.returncode == 2, r.stderr
    assert r.stderr == "error: FASTWEIGHTS_LINEAR must be one of auto, torch, onednn, got 'onedn'\n"
    assert not (tmp_path / "run").exists()  # said before anything is written


@needs_onednn
def test_oneDNN_backward_takes_an_expanded_or_transposed_upstream_gradient(monkeypatch):
    """The gradient autograd hands the Function need not be contiguous: ``y.sum()``'s is an expanded view of zero
    strides, and a transposed one can come from a later op."""
    monkeypatch.setenv("FASTWEIGHTS_LINEAR", "onednn")
    calls = _spy(monkeypatch)
    for upstream in (None, torch.randn(48, 64, generator=torch.Generator().manual_seed(3)).T):
        got, want = [], []
        for fn, out in ((lin.linear, got), (F.linear, want)):
            x, w, b = _leaves((64, 32), 48, seed=4)
            y = fn(x, w, b)
            y.sum().backward() if upstream is None else y.backward(upstream)
            out += [x.grad, w.grad, b.grad]
        for a, e in zip(got, want):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    assert len(calls) == 6  # forward, input grad and weight grad, twice


def test_fast_linears_walks_a_models_modules_once(monkeypatch):
    """The lent forwards are found on the first block and reused (a generation step calls the backbone once per
    token: walking every module each time cost a millisecond)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with lin.fast_linears(model):
        assert "forward" in vars(model[0])
    monkeypatch.setattr(model, "modules", lambda: pytest.fail("the modules were walked again"))
    with lin.fast_linears(model):
        assert "forward" in vars(model[0]) and "forward" in vars(model[2])
    assert "forward" not in vars(model[0])


def test_linear_grads_runs_each_product_on_its_own_kernel_and_only_the_products_asked_for(monkeypatch):
    """``linear_grads`` (the fused loss's backward) takes the input gradient on the kernel chosen for that product
    and the weight gradient on the one chosen for that, and computes neither when not asked. Mutations caught: the
    kernels' indices swapped, a product computed although ``need_x`` / ``need_w`` is False."""
    calls = []

    def kernel(name):
        return lambda a, b, bias: calls.append((name, tuple(a.shape), tuple(b.shape))) or F.linear(a, b, bias)

    monkeypatch.setattr(lin, "KERNELS", {"fwd": kernel("fwd"), "dx": kernel("dx"), "dw": kernel("dw")})
    monkeypatch.setattr(lin, "call_kernels", lambda x, w, b=None: ("fwd", "dx", "dw"))
    x, w, g = torch.randn(5, 3), torch.randn(4, 3), torch.randn(5, 4)
    dx, dw = lin.linear_grads(x, w, g)
    assert calls == [("dx", (5, 4), (3, 4)), ("dw", (4, 5), (3, 5))]  # g W on dx's kernel, g^T x on dw's
    torch.testing.assert_close(dx, g @ w)
    torch.testing.assert_close(dw, g.T @ x)
    calls.clear()
    assert lin.linear_grads(x, w, g, need_w=False)[1] is None and [c[0] for c in calls] == ["dx"]
    calls.clear()
    assert lin.linear_grads(x, w, g, need_x=False)[0] is None and [c[0] for c in calls] == ["dw"]


def test_the_torch_route_gives_torchs_kernel_for_every_product(monkeypatch):
    """``kernels_for(..., route="torch")`` (FASTWEIGHTS_LINEAR=torch) measures nothing and takes torch's kernel for
    all three products, whatever oneDNN could do (mutation caught: the route's name misspelt in the test)."""
    monkeypatch.setattr(lin, "onednn_available", lambda: True)
    monkeypatch.setattr(lin, "_load_choices", lambda machine: {})
    monkeypatch.setattr(lin, "measure", lambda *a, **k: pytest.fail("measured on the torch route"))
    assert lin.kernels_for(4096, 512, 512, False, route="torch") == ["torch"] * 3


def test_a_kernel_is_timed_as_often_as_its_budget_allows_and_at_least_three_times():
    """The choice compares best times: a quick product is timed up to ``most`` times within the budget (fewer
    would let one slow call decide), a slow one still three times; a warm-up call comes first."""
    calls = []
    assert lin._best_time(lambda: calls.append(1), budget_s=60.0, most=7) >= 0.0
    assert len(calls) == 1 + 7
    calls.clear()
    lin._best_time(lambda: calls.append(1), budget_s=0.0, most=7)
    assert len(calls) == 1 + 3
