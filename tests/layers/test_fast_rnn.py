"""Fast-weights RNN (Ba et al. 2016): the two read forms, the write order, LayerNorm, state carry, gradients.

The attention form has two implementations with hand-written backward passes, the compiled step kernel
("kernel") and torch ops ("torch"); both are checked against autograd through the explicit-A reference.
"""

import pytest
import torch

from fastweights.core.errors import UserError
from fastweights.layers.fast_rnn import (
    FastRNNMixer,
    FastRNNOptions,
    FastRNNState,
    FastWeightRNN,
)
from fastweights.ops.fast_rnn import fast_rnn_attention, fast_rnn_reference, fold_history
from fastweights.components import MIXERS, build_options, lookup
from fastweights.ops.fast_rnn_kernel import step_kernel
from helpers import assert_lm_pieces_equal_one_call, in_pieces, tiny_lm

BACKENDS = [
    "torch",
    pytest.param("kernel", marks=pytest.mark.skipif(step_kernel() is None, reason="no C compiler for the step kernel")),
]


def _inputs(dtype, B=3, T=6, H=5, L=4, carry=True, ln=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(B, T, H, generator=g, dtype=dtype, requires_grad=True)
    W = (0.3 * torch.randn(H, H, generator=g, dtype=dtype)).requires_grad_()
    ln_w = (1 + 0.1 * torch.randn(H, generator=g, dtype=dtype)).requires_grad_() if ln else None
    ln_b = (0.1 * torch.randn(H, generator=g, dtype=dtype)).requires_grad_() if ln else None
    h0 = torch.rand(B, H, generator=g, dtype=dtype, requires_grad=True)
    A0 = hist = None
    if carry:
        A0 = torch.randn(B, H, H, generator=g, dtype=dtype)
        A0 = (0.1 * (A0 + A0.transpose(1, 2))).requires_grad_()
        hist = torch.rand(B, L, H, generator=g, dtype=dtype, requires_grad=True)
    return u, W, ln_w, ln_b, h0, A0, hist


def _both_forms(u, W, ln_w, ln_b, h0, A0, hist, backend="auto", **kw):
    """(outputs, input grads) of the attention form and of the explicit-A reference, same loss."""
    inputs = [x for x in (u, W, ln_w, ln_b, h0, A0, hist) if x is not None]
    y_att = fast_rnn_attention(u, W, h0, A0, hist, ln_weight=ln_w, ln_bias=ln_b, backend=backend, **kw)
    y_ref, A_ref = fast_rnn_reference(
        u, W, h0, fold_history(A0, hist, kw["lam"], kw["eta"]), ln_weight=ln_w, ln_bias=ln_b, **kw
    )
    probe = torch.randn(y_att.shape, generator=torch.Generator().manual_seed(1), dtype=u.dtype)
    g_att = torch.autograd.grad((y_att * probe).sum(), inputs)
    g_ref = torch.autograd.grad((y_ref * probe).sum(), inputs)
    return y_att, y_ref, g_att, g_ref, A_ref


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("inner_steps", [1, 2])
@pytest.mark.parametrize("ln_preliminary", [True, False])
@pytest.mark.parametrize("carry", [False, True])
def test_read_forms_agree_fp64(inner_steps, ln_preliminary, carry, backend):
    args = _inputs(torch.float64, carry=carry)
    kw = dict(lam=0.9, eta=0.5, inner_steps=inner_steps, ln_preliminary=ln_preliminary)
    y_att, y_ref, g_att, g_ref, A_ref = _both_forms(*args, backend=backend, **kw)
    torch.testing.assert_close(y_att, y_ref, rtol=0, atol=1e-10)
    for a, r in zip(g_att, g_ref):
        torch.testing.assert_close(a, r, rtol=0, atol=1e-10)
    # the memory after the call, rebuilt from the attention form's outputs, equals the explicit A_T
    A0, hist = args[5], args[6]
    written = y_att if hist is None else torch.cat([hist, y_att], 1)
    torch.testing.assert_close(fold_history(A0, written, 0.9, 0.5), A_ref, rtol=0, atol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("inner_steps", [1, 2])
def test_read_forms_agree_fp32(inner_steps, backend):
    args = _inputs(torch.float32, B=4, T=12, H=16, L=3)
    y_att, y_ref, g_att, g_ref, _ = _both_forms(*args, backend=backend, lam=0.95, eta=0.5, inner_steps=inner_steps)
    torch.testing.assert_close(y_att, y_ref, rtol=0, atol=1e-5)
    # gradients: fp32 rounding through 12 steps of the recurrence; the C kernel is compiled for the host CPU,
    # whose vector width changes the summation order (one element of 192 was 1.3e-5 / 1.0e-4 relative off on
    # a Xeon where the previous rtol 1e-5 had passed elsewhere); the fp64 test above holds the forms to 1e-10
    for a, r in zip(g_att, g_ref):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_read_forms_agree_without_layer_norm(backend):
    u, W, _, _, h0, A0, hist = _inputs(torch.float64, ln=False)
    with torch.no_grad():  # small inputs: without LN the Hebbian feedback grows fast
        u.mul_(0.3), h0.mul_(0.3), hist.mul_(0.3), A0.mul_(0.3)
    y_att, y_ref, g_att, g_ref, _ = _both_forms(
        u, W, None, None, h0, A0, hist, backend=backend, lam=0.9, eta=0.5, inner_steps=2
    )
    torch.testing.assert_close(y_att, y_ref, rtol=1e-10, atol=1e-10)
    for a, r in zip(g_att, g_ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("form", ["attention", "matrix"])
def test_write_order_hand_example(form):
    # No LN, W = 0, S = 1, lam = 0.9, eta = 0.5, u_1 = [1, 2], u_2 = [3, -1]:
    #   t=1: memory empty      -> h_1 = relu(u_1) = [1, 2]
    #   t=2: h^(0) = relu(u_2) = [3, 0]; read = eta (h_1 . h^(0)) h_1 = 0.5 * 3 * [1, 2] = [1.5, 3]
    #        h_2 = relu(u_2 + read) = [4.5, 2]
    #   A_2 = lam eta h_1 h_1^T + eta h_2 h_2^T
    # Writing h^(0) of step 2 before reading ("early") or lagging the write by one step ("late")
    # gives h_2 = [7.5, 0] or [3, 0] instead.
    u = torch.tensor([[[1.0, 2.0], [3.0, -1.0]]], dtype=torch.float64)
    W = torch.zeros(2, 2, dtype=torch.float64)
    kw = dict(lam=0.9, eta=0.5, inner_steps=1)
    if form == "attention":
        hs = fast_rnn_attention(u, W, **kw)
        A = fold_history(None, hs, 0.9, 0.5)
    else:
        hs, A = fast_rnn_reference(u, W, **kw)
    torch.testing.assert_close(hs[0], torch.tensor([[1.0, 2.0], [4.5, 2.0]], dtype=torch.float64))
    h1, h2 = torch.tensor([1.0, 2.0]), torch.tensor([4.5, 2.0])
    expected_A = 0.9 * 0.5 * torch.outer(h1, h1) + 0.5 * torch.outer(h2, h2)
    torch.testing.assert_close(A[0], expected_A.double())


def test_zero_fast_weights_is_the_ln_rnn_and_inner_steps_are_idempotent():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 6)
    plain = FastWeightRNN(6, 8, fast_weights=False)
    outs = []
    for S in (1, 3):
        rnn = FastWeightRNN(6, 8, lam=0.0, eta=0.0, inner_steps=S, read_mode="attention")
        rnn.load_state_dict(plain.state_dict())
        outs.append(rnn(x)[0])
    with torch.no_grad():  # the LN-RNN written out: h_t = relu(LN(W h_{t-1} + C x_t))
        h, expected = torch.zeros(2, 8), []
        for t in range(7):
            h = torch.relu(plain.ln(h @ plain.W.T + plain.in_proj(x[:, t])))
            expected.append(h)
    expected = torch.stack(expected, 1)
    torch.testing.assert_close(plain(x)[0], expected)
    for y in outs:
        torch.testing.assert_close(y, expected)


@pytest.mark.parametrize("form", ["attention", "matrix"])
def test_layer_norm_is_per_example(form):
    torch.manual_seed(0)
    rnn = FastWeightRNN(5, 6, read_mode=form)
    x = torch.randn(4, 5, 5)
    y = rnn(x)[0]
    x2 = x.clone()
    x2[1:] = 100 * torch.randn(3, 5, 5)  # change every other batch row
    torch.testing.assert_close(rnn(x2)[0][0], y[0])
    perm = torch.tensor([2, 0, 3, 1])
    torch.testing.assert_close(rnn(x[perm])[0], y[perm])


@pytest.mark.parametrize(
    "options",
    [
        dict(read_mode="attention"),
        dict(read_mode="matrix"),
        dict(read_mode="attention", inner_steps=2, ln_preliminary=False),
        dict(fast_weights=False),
    ],
)
def test_state_carry_equals_one_call(options):
    torch.manual_seed(0)
    rnn = FastWeightRNN(4, 5, **options).double()  # hidden 5 < T: the attention form folds its history
    x = torch.randn(2, 13, 4, dtype=torch.float64)
    y_full, s_full = rnn(x)
    y, state = in_pieces(rnn, x, (1, 3, 7))  # then 2
    torch.testing.assert_close(y, y_full, rtol=0, atol=1e-10)
    torch.testing.assert_close(state.h, s_full.h, rtol=0, atol=1e-10)
    if options.get("fast_weights", True):
        A_full = fold_history(s_full.A, s_full.history, rnn.lam, rnn.eta)
        A_carry = fold_history(state.A, state.history, rnn.lam, rnn.eta)
        torch.testing.assert_close(A_carry, A_full, rtol=0, atol=1e-10)


def test_states_of_the_two_modes_are_interchangeable():
    torch.manual_seed(0)
    att = FastWeightRNN(4, 6, read_mode="attention").double()
    mat = FastWeightRNN(4, 6, read_mode="matrix").double()
    mat.load_state_dict(att.state_dict())
    x = torch.randn(3, 9, 4, dtype=torch.float64)
    y_full = mat(x)[0]
    y1, s = att(x[:, :4])
    y2, s = mat(x[:, 4:7], s)
    y3, _ = att(x[:, 7:], s)
    torch.testing.assert_close(torch.cat([y1, y2, y3], 1), y_full, rtol=0, atol=1e-10)


def test_fresh_state_resets_memory():
    torch.manual_seed(0)
    rnn = FastWeightRNN(3, 4)
    x = torch.randn(2, 5, 3)
    y_first, state = rnn(x)
    y_continued, _ = rnn(x, state)
    y_fresh, _ = rnn(x)
    torch.testing.assert_close(y_fresh, y_first)
    assert not torch.allclose(y_continued, y_first)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_through_the_fast_weights(backend):
    # H = 4, T = 5 in fp64, carried A_0 and history, two inner steps: every input's gradient
    u, W, ln_w, ln_b, h0, A0, hist = _inputs(torch.float64, B=2, T=5, H=4, L=2)

    def f(u, W, ln_w, ln_b, h0, A0, hist):
        return fast_rnn_attention(
            u, W, h0, A0, hist, lam=0.9, eta=0.5, inner_steps=2, ln_weight=ln_w, ln_bias=ln_b, backend=backend
        )

    assert torch.autograd.gradcheck(f, (u, W, ln_w, ln_b, h0, A0, hist))


def test_gradient_reaches_slow_weights_through_A():
    # with a fast term, dL/dW and dL/dC differ from the LN-RNN's: the gradient flows through A
    torch.manual_seed(0)
    x = torch.randn(2, 6, 3)
    fast = FastWeightRNN(3, 4)
    plain = FastWeightRNN(3, 4, fast_weights=False)
    plain.load_state_dict(fast.state_dict())
    for rnn in (fast, plain):
        rnn(x)[0][:, -1].sum().backward()
    assert not torch.allclose(fast.W.grad, plain.W.grad)
    assert not torch.allclose(fast.in_proj.weight.grad, plain.in_proj.weight.grad)


def test_bf16_autocast_keeps_fast_weights_in_fp32():
    torch.manual_seed(0)
    mixer = FastRNNMixer(8, 2, FastRNNOptions(hidden=6))
    x = torch.randn(2, 5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, state = mixer(x)
        _, state = mixer(x, state)
    assert y.shape == (2, 5, 8)
    assert state.h.dtype == torch.float32 and state.history.dtype == torch.float32


def test_mixer_from_registry():
    entry = lookup(MIXERS, "mixer", "fast_rnn")
    options = build_options(entry, {"hidden": 12, "inner_steps": 2, "read_mode": "matrix"})
    mixer = entry.cls(d_model=8, n_heads=2, options=options)
    x = torch.randn(3, 4, 8)
    y, state = mixer(x)
    assert y.shape == x.shape
    assert isinstance(state, FastRNNState) and state.A.shape == (3, 12, 12)
    n_params = sum(p.numel() for p in mixer.parameters())
    assert n_params == 8 * 12 + 12 + 12 * 12 + 2 * 12 + 12 * 8
    with pytest.raises(UserError):
        build_options(entry, {"hiddden": 3})


@pytest.mark.parametrize(
    "kwargs", [dict(hidden=0), dict(lam=1.5), dict(eta=-1.0), dict(inner_steps=0), dict(read_mode="fast")]
)
def test_bad_options_raise_user_error(kwargs):
    args = dict(input_size=3, hidden=4) | kwargs
    with pytest.raises(UserError):
        FastWeightRNN(**args)


def test_auto_read_mode():
    rnn = FastWeightRNN(3, 8)
    assert rnn.resolve_read_mode(64, grad=True) == rnn.resolve_read_mode(64, grad=False) == "attention"
    assert rnn.resolve_read_mode(1, grad=True) == "attention"
    assert rnn.resolve_read_mode(1, grad=False) == "matrix"  # generation: one token per call
    assert FastWeightRNN(3, 8, read_mode="matrix").resolve_read_mode(16, grad=True) == "matrix"
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3)
    with torch.no_grad():
        y_full, _ = rnn(x)
        state, ys = None, []
        for t in range(5):  # token by token: auto switches to the matrix read and back
            y, state = rnn(x[:, t : t + 1], state)
            ys.append(y)
        assert state.history is None and state.A.shape == (2, 8, 8)
    torch.testing.assert_close(torch.cat(ys, 1), y_full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("read_mode", ["attention", "matrix"])
def test_language_model_state_carry(read_mode):
    model = tiny_lm(11, mixer="fast_rnn", options={"fast_rnn": {"hidden": 6, "read_mode": read_mode}},
                    dtype=torch.float64, training=True)
    assert_lm_pieces_equal_one_call(model, torch.randint(0, 11, (2, 15)), cuts=(7,))
    torch.testing.assert_close(model.blocks[0].mixer.rnn.W, 0.05 * torch.eye(6, dtype=torch.float64))  # LM init keeps it


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("carry", [False, True])
def test_long_sequences_and_uneven_batches_fp64(backend, carry):
    # T = 70 crosses the kernel's 32-step chunks of the backward pass; B = 6 is one group of four examples
    # and one of two; H = 20 is not a whole number of vectors (the kernel pads rows to 32)
    args = _inputs(torch.float64, B=6, T=70, H=20, L=7, carry=carry)
    y_att, y_ref, g_att, g_ref, _ = _both_forms(*args, backend=backend, lam=0.95, eta=0.5, inner_steps=1)
    torch.testing.assert_close(y_att, y_ref, rtol=0, atol=1e-10)
    for a, r in zip(g_att, g_ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_module_pieces_with_carried_state_match_the_reference_fp64(backend, monkeypatch):
    # The layer as training runs it: the state carried across calls (not detached), the history folded into A
    # once it holds `hidden` states, so later calls read a carried A_0 and history. Outputs and the gradients of
    # every parameter and of the input, from pieces, equal autograd through the explicit-A loop in one call.
    if backend == "torch":
        monkeypatch.setenv("FASTWEIGHTS_FAST_RNN_KERNEL", "0")
    torch.manual_seed(0)
    rnn = FastWeightRNN(5, 6, lam=0.9, eta=0.5, read_mode="attention").double()
    x = torch.randn(5, 17, 5, dtype=torch.float64, requires_grad=True)
    probe = torch.randn(5, 17, 6, dtype=torch.float64)
    state, pieces = None, []
    for a, b in [(0, 4), (4, 5), (5, 13), (13, 17)]:
        y, state = rnn(x[:, a:b], state)
        pieces.append(y)
    y_pieces = torch.cat(pieces, 1)
    wrt = [x, *rnn.parameters()]
    g_pieces = torch.autograd.grad((y_pieces * probe).sum(), wrt)
    y_ref, A_ref = fast_rnn_reference(rnn.in_proj(x), rnn.W, lam=0.9, eta=0.5, ln_weight=rnn.ln.weight,
                                      ln_bias=rnn.ln.bias)
    g_ref = torch.autograd.grad((y_ref * probe).sum(), wrt)
    torch.testing.assert_close(y_pieces, y_ref, rtol=0, atol=1e-10)
    for a, r in zip(g_pieces, g_ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(fold_history(state.A, state.history, 0.9, 0.5), A_ref, rtol=0, atol=1e-10)


def test_backend_choice_and_fallback(monkeypatch):
    u, W, ln_w, ln_b, h0, _, _ = _inputs(torch.float32, carry=False)
    kw = dict(lam=0.9, eta=0.5, ln_weight=ln_w, ln_bias=ln_b)
    y_torch = fast_rnn_attention(u, W, h0, backend="torch", **kw)
    with pytest.raises(ValueError):
        fast_rnn_attention(u, W, h0, backend="fast", **kw)
    with pytest.raises(ValueError):  # the kernel takes fp32/fp64 only
        fast_rnn_attention(u.bfloat16(), W.bfloat16(), h0.bfloat16(), backend="kernel", lam=0.9, eta=0.5)
    with pytest.raises(TypeError):  # the recurrence's keywords are checked
        fast_rnn_attention(u, W, h0, lam=0.9, eta=0.5, inner_step=2)
    # bf16 with "auto" runs the torch implementation
    assert fast_rnn_attention(u.bfloat16(), W.bfloat16(), h0.bfloat16(), lam=0.9, eta=0.5).dtype == torch.bfloat16
    monkeypatch.setenv("FASTWEIGHTS_FAST_RNN_KERNEL", "0")  # switched off: "auto" is torch, "kernel" refuses
    torch.testing.assert_close(fast_rnn_attention(u, W, h0, **kw), y_torch, rtol=0, atol=0)
    with pytest.raises(ValueError):
        fast_rnn_attention(u, W, h0, backend="kernel", **kw)


@pytest.mark.skipif(step_kernel() is None, reason="no C compiler for the step kernel")
def test_kernel_backward_twice_with_retained_graph():
    u, W, ln_w, ln_b, h0, A0, hist = _inputs(torch.float64, B=3, T=9, H=7, L=2)
    y = fast_rnn_attention(u, W, h0, A0, hist, lam=0.9, eta=0.5, ln_weight=ln_w, ln_bias=ln_b, backend="kernel")
    g1 = torch.autograd.grad(y.square().sum(), [u, W, A0], retain_graph=True)
    g2 = torch.autograd.grad(y.square().sum(), [u, W, A0])
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _read_over_input(eta: float) -> float:
    """fastweights.experiments.fast_rnn_read's measure, recorded by benchmarks/quality/fast_rnn_sweep.py (mean
    |A_{t-1} h_t^(0)| over mean |W h_{t-1} + C x_t|, the two terms one LayerNorm adds before the ReLU) in the
    shakespeare-char-fast-rnn preset's first layer at init."""
    from fastweights.core.config import make_config
    from fastweights.experiments.fast_rnn_read import read_over_input
    from fastweights.models.lm import LanguageModel

    cfg = make_config("shakespeare-char-fast-rnn", ["model.vocab_size=66", f"model.options.fast_rnn.eta={eta}"])
    torch.manual_seed(0)
    model = LanguageModel(cfg.model).double().eval()
    return read_over_input(model, torch.randint(0, 66, (1, 128), generator=torch.Generator().manual_seed(0)))[0]


def test_the_presets_fast_weight_read_does_not_drown_the_input():
    # Ba et al.'s eta 0.5 at 158 units: the read is hundreds of times the input term, so after the LayerNorm
    # the state follows the memory alone (the measured reason the preset trained to bigram loss; issue 21)
    assert _read_over_input(0.5) > 100
    assert _read_over_input(0.0005) < 2  # the preset's eta: the read informs, the input still drives


def test_decay_weights_below_the_normal_range_are_zero():
    # subnormal weights cost time in every read (lam 0.5 trained 1.3x slower per step); they weigh nothing
    from fastweights.ops.fast_rnn_kernel import decay_weights

    for dtype in (torch.float32, torch.float64):
        rev = decay_weights(2000, 0.5, 0.5, torch.empty(0, dtype=dtype))
        tiny = torch.finfo(dtype).tiny
        assert not ((rev > 0) & (rev < tiny)).any() and rev[-1] == 0.5 and rev[0] == 0.0
        exact = 0.5 * 0.5 ** torch.arange(1999, -1, -1, dtype=torch.float64)
        kept = exact >= tiny
        assert torch.equal(rev[kept].double(), exact[kept].to(dtype).double())


def test_read_over_input_is_the_mean_over_every_step_after_the_first():
    # the measure against a closed form written apart from its loop: A_{t-1} = sum_{s<t} eta lam^(t-1-s) h_s h_s^T,
    # the read |A_{t-1} relu(LN(b_t))| and the input |b_t|, b_t = C x_t + c + W h_{t-1}, averaged over t = 1..T-1
    from fastweights.experiments.fast_rnn_read import read_over_input
    from fastweights.layers.fast_rnn import FastWeightRNN

    torch.manual_seed(0)
    rnn = FastWeightRNN(3, 5, lam=0.8, eta=0.7).double()
    with torch.no_grad():
        rnn.W.copy_(0.3 * torch.randn(5, 5, dtype=torch.float64))
        rnn.ln.weight.copy_(1 + 0.2 * torch.randn(5, dtype=torch.float64))
        rnn.ln.bias.copy_(0.3 * torch.randn(5, dtype=torch.float64))
    x = torch.randn(1, 7, 3, dtype=torch.float64)
    with torch.no_grad():
        u, h = rnn.in_proj(x)[0], rnn(x)[0][0]
        T = h.shape[0]
        t, s = torch.arange(T)[:, None], torch.arange(T)[None, :]
        decay = torch.where(s < t, 0.7 * 0.8 ** (t - 1 - s).clamp(min=0).double(), torch.zeros((), dtype=torch.float64))
        A = torch.einsum("ts,si,sj->tij", decay, h, h)[1:]  # A_{t-1} for t = 1..T-1
        b = u[1:] + h[:-1] @ rnn.W.T
        h0 = torch.relu(torch.nn.functional.layer_norm(b, (5,), rnn.ln.weight, rnn.ln.bias))
        reads = torch.einsum("tij,tj->ti", A, h0).norm(dim=-1)
    expected = float(reads.mean() / b.norm(dim=-1).mean())
    (ratio,) = read_over_input(rnn, x)
    assert ratio == pytest.approx(expected, rel=1e-12)
