"""ops.streamed_unembedding.cpu_linear: oneDNN's fp32 GEMM on an x86 CPU (about twice MKL's on an AMD core),
torch's linear elsewhere. Both routes must give F.linear's numbers (fp32 rounding) for the strides the FWL
head passes (a transposed view of the output embedding, vocabulary slices of it, a bias or none), and the
route must be taken exactly where it applies: fp32 on the CPU with oneDNN enabled."""

import types

import pytest
import torch
import torch.nn.functional as F

from fastweights.ops import streamed_unembedding as su

needs_onednn = pytest.mark.skipif(su.ONEDNN_LINEAR is None, reason="no oneDNN linear on this machine or torch build")


def _weights(seed=0, vocab=300, width=24):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(vocab, width, generator=g)  # an output embedding [V, s], as HF stores it
    return emb, torch.randn(vocab, generator=g), torch.randn(7, width, generator=g), g


@pytest.mark.parametrize("layout", ["rows", "transposed_view", "vocab_slice", "slice_of_view"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_cpu_linear_equals_linear(layout, with_bias):
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
    torch.testing.assert_close(su.cpu_linear(x, weight, b), F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def _spy(monkeypatch):
    calls = []
    real = su.ONEDNN_LINEAR

    def spy(*args):
        calls.append(args[0].dtype)
        return real(*args)

    monkeypatch.setattr(su, "ONEDNN_LINEAR", spy)
    return calls


@needs_onednn
def test_oneDNN_route_is_taken_for_fp32_cpu_only(monkeypatch):
    calls = _spy(monkeypatch)
    emb, bias, x, _ = _weights()
    su.cpu_linear(x, emb, bias)
    assert calls == [torch.float32]
    su.cpu_linear(x.double(), emb.double(), bias.double())  # fp64: torch's linear
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)  # the user switched oneDNN off
    su.cpu_linear(x, emb, bias)
    assert calls == [torch.float32]


@needs_onednn
def test_streamed_passes_in_fp32_take_the_oneDNN_route_and_match_fp64(monkeypatch):
    """The FWL's two vocabulary passes in fp32 (oneDNN) against the fp64 formulas, with a non-zero bias c."""
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


@needs_onednn
def test_fwl_scoring_in_fp32_on_the_oneDNN_route_matches_the_fp64_training_path(monkeypatch):
    """The whole no-grad FWL pass (residual head, every tensor fast, segments, a vocabulary of several
    slices) in fp32 through oneDNN against the differentiable path in fp64 (torch's kernels), and the
    vocabulary products really went through oneDNN."""
    from fastweights.ops.fwl import BLOCK_FAST, fwl_parallel

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


def test_cpu_linear_keeps_autograd_where_a_gradient_is_wanted():
    """oneDNN's op has no autograd formula (backward through it gives no gradient, with only a warning): with
    grad enabled and an input that requires it, cpu_linear must be torch's linear, gradients and all."""
    emb, bias, x, _ = _weights()
    for leaf in ("x", "weight", "bias"):
        args = {"x": x.clone(), "weight": emb.clone(), "bias": bias.clone()}
        args[leaf].requires_grad_(True)
        su.cpu_linear(args["x"], args["weight"], args["bias"]).square().sum().backward()
        got = args[leaf].grad
        ref = {k: v.detach().clone().requires_grad_(k == leaf) for k, v in args.items()}
        F.linear(ref["x"], ref["weight"], ref["bias"]).square().sum().backward()
        assert got is not None, leaf
        torch.testing.assert_close(got, ref[leaf].grad, rtol=1e-5, atol=1e-4)


def test_the_oneDNN_op_is_dropped_where_it_is_missing_or_gives_other_numbers(monkeypatch):
    """A private op: a build without it, or one whose op means something else, falls back to torch's linear."""
    class Ops:
        pass

    monkeypatch.setattr(torch.ops, "mkldnn", Ops())  # no _linear_pointwise at all
    assert su._onednn_linear() is None
    wrong = types.SimpleNamespace(default=lambda x, w, b, *rest: F.linear(x, w))  # ignores the bias
    monkeypatch.setattr(torch.ops, "mkldnn", types.SimpleNamespace(_linear_pointwise=wrong))
    assert su._onednn_linear() is None
