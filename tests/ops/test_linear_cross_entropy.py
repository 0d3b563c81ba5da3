"""ops.linear_cross_entropy (issue 51, scope 2) against the plain form F.cross_entropy(F.linear(h, W)): the loss and
both gradients in fp64 to 1e-12 and in fp32 to its rounding, for any chunk size, ignored rows, tied weights and
no-grad calls; and the language model's loss without logits equal to its loss with them."""

import pytest
import torch

from fastweights.core.config import make_config
from fastweights.models.lm import LanguageModel
from fastweights.ops.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference


def problem(n=37, d=16, v=50, dtype=torch.float64, seed=0, ignored=5):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=dtype, requires_grad=True)
    w = (0.3 * torch.randn(v, d, generator=g, dtype=dtype)).requires_grad_()
    y = torch.randint(0, v, (n,), generator=g)
    y[torch.randperm(n, generator=g)[:ignored]] = -100
    return h, w, y


def loss_and_grads(fn, h, w, y, **kw):
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(h, w, y, **kw)
    (3.0 * loss).backward()  # an incoming gradient other than 1
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk_elements", [1, 50 * 3, 50 * 36, 50 * 37, 1 << 23])  # 1 row, 3 rows, 36+1, all, all
def test_equals_the_plain_form_in_fp64_for_any_chunk(chunk_elements):
    h, w, y = problem()
    want = loss_and_grads(linear_cross_entropy_reference, h, w, y)
    got = loss_and_grads(linear_cross_entropy, h, w, y, chunk_elements=chunk_elements)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_equals_the_plain_form_in_fp32():
    h, w, y = problem(n=300, d=64, v=1000, dtype=torch.float32, ignored=20)
    want = loss_and_grads(linear_cross_entropy_reference, h, w, y)
    got = loss_and_grads(linear_cross_entropy, h, w, y, chunk_elements=1000 * 64)
    assert got[0].dtype == torch.float32
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6)


def test_only_the_inputs_that_need_a_gradient_get_one_and_no_grad_gives_the_loss():
    h, w, y = problem()
    want = linear_cross_entropy_reference(h, w, y).detach()
    hd = h.detach().clone().requires_grad_()
    loss = linear_cross_entropy(hd, w.detach(), y, chunk_elements=100)
    loss.backward()
    torch.testing.assert_close(loss.detach(), want, rtol=1e-12, atol=0)
    want_h = torch.autograd.grad(linear_cross_entropy_reference(h, w.detach(), y), h)[0]
    torch.testing.assert_close(hd.grad, want_h, rtol=1e-12, atol=1e-14)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, y, chunk_elements=100), want, rtol=1e-12, atol=0)


def test_a_later_row_moves_no_earlier_rows_gradient_and_double_backward_is_refused():
    """Each row's loss and dL/dh depend on its own h and target only (the op cannot leak across positions); the
    backward is once-differentiable (second-order training keeps the plain form)."""
    h, w, y = problem(ignored=0)
    _, gh, _ = loss_and_grads(linear_cross_entropy, h, w, y, chunk_elements=150)
    h2, y2 = h.detach().clone(), y.clone()
    h2[30:] += 1.0
    y2[30:] = (y2[30:] + 1) % 50
    _, gh2, _ = loss_and_grads(linear_cross_entropy, h2, w, y2, chunk_elements=150)
    torch.testing.assert_close(gh2[:30], gh[:30], rtol=1e-12, atol=1e-15)
    hh = h.detach().clone().requires_grad_()
    (g,) = torch.autograd.grad(linear_cross_entropy(hh, w, y), hh, create_graph=True)
    with pytest.raises(RuntimeError):
        g.sum().backward()


@pytest.mark.parametrize("tied", [True, False])
def test_the_model_loss_without_logits_is_the_loss_with_them(tied):
    """LanguageModel(return_logits=False): no logits, the same loss and the same gradient of every parameter (the
    tied embedding's included) as the default path, in fp64."""
    cfg = make_config("shakespeare-char", ["model.vocab_size=40", "model.d_model=32", "model.n_layers=2",
                                           "model.n_heads=2", f"model.tie_embeddings={str(tied).lower()}"]).model
    torch.manual_seed(0)
    model = LanguageModel(cfg).double()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 40, (3, 12), generator=g), torch.randint(0, 40, (3, 12), generator=g)
    mask = torch.ones(3, 12, dtype=torch.bool)
    mask[1, :4] = False  # a left-padded row: its padded targets are not counted either way
    results = []
    for return_logits in (True, False):
        model.zero_grad(set_to_none=True)
        out = model(x, targets=y, attention_mask=mask, return_logits=return_logits)
        out.loss.backward()
        results.append((out, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (full, grads), (fused, fused_grads) = results
    assert fused.logits is None and full.logits is not None
    torch.testing.assert_close(fused.loss, full.loss, rtol=1e-12, atol=0)
    for n in grads:
        torch.testing.assert_close(fused_grads[n], grads[n], rtol=1e-10, atol=1e-13, msg=n)


def test_training_steps_take_the_loss_without_logits(tmp_path, monkeypatch):
    """The trainer reads the loss only, so its steps go through the fused loss (mutant caught: the training step
    calling the model without return_logits=False, keeping the [B, T, V] logits)."""
    from helpers import tiny_training_run

    import fastweights.models.lm as lm

    calls = []
    real = lm.linear_cross_entropy
    monkeypatch.setattr(lm, "linear_cross_entropy", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    tiny_training_run(tmp_path / "run", steps=2)
    assert len(calls) == 2


def test_the_gradient_products_take_the_machines_chosen_kernels(monkeypatch):
    """dL/dh and dL/dW go through ops.linear.linear_grads (the kernels measured on the machine, as the plain form's
    backward); with oneDNN forced where the build has it, the fp32 gradients still equal the plain form's."""
    import fastweights.ops.linear_cross_entropy as lce
    from fastweights.ops.linear import onednn_available

    calls = []
    real = lce.linear_grads
    monkeypatch.setattr(lce, "linear_grads", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    if onednn_available():
        monkeypatch.setenv("FASTWEIGHTS_LINEAR", "onednn")
    h, w, y = problem(n=300, d=64, v=1000, dtype=torch.float32, ignored=20)
    got = loss_and_grads(linear_cross_entropy, h, w, y, chunk_elements=1000 * 100)  # 3 chunks
    assert len(calls) == 2 * 3  # dL/dh and dL/dW of each chunk
    monkeypatch.setenv("FASTWEIGHTS_LINEAR", "torch")
    want = loss_and_grads(linear_cross_entropy_reference, h, w, y)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6)


def test_bf16_inputs_give_the_loss_in_the_plain_forms_dtype():
    """The loss is summed in the upcast logits' dtype (fp32 for bf16 inputs), with and without gradients, as the
    plain form gives it, also with no rows. Mutation caught: the running total started in the inputs' dtype (bf16)."""
    from fastweights.ops.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference

    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g).bfloat16()
    w = torch.randn(50, 16, generator=g).bfloat16()
    y = torch.randint(0, 50, (37,), generator=g)
    ref = linear_cross_entropy_reference(h, w, y)
    for grad in (False, True):
        loss = linear_cross_entropy(h.clone().requires_grad_(grad), w, y, chunk_elements=200)
        assert loss.dtype == ref.dtype == torch.float32
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
        empty = linear_cross_entropy(h[:0].clone().requires_grad_(grad), w, y[:0])  # no rows: nan, in fp32 too
        assert empty.dtype == torch.float32 and empty.isnan()


def test_the_weight_gradient_of_bf16_inputs_is_formed_in_the_loss_dtype(monkeypatch):
    """dL/dW is accumulated in the loss dtype (fp32 for bf16 inputs): its product gets h and W in fp32, so its
    kernel is chosen for fp32 operands (a bf16 weight would send it to torch's bf16 path); dL/dh stays in h's."""
    import fastweights.ops.linear_cross_entropy as lce

    seen = []
    real = lce.linear_grads
    monkeypatch.setattr(lce, "linear_grads", lambda x, w, g, **kw: seen.append((kw, x.dtype, w.dtype, g.dtype))
                        or real(x, w, g, **kw))
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(12, 8, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(20, 8, generator=gen).bfloat16().requires_grad_()
    lce.linear_cross_entropy(h, w, torch.randint(0, 20, (12,), generator=gen)).backward()
    f32, bf16 = torch.float32, torch.bfloat16
    assert ({"need_x": False}, f32, f32, f32) in seen and ({"need_w": False}, bf16, bf16, bf16) in seen
    assert w.grad.dtype == bf16 and h.grad.dtype == bf16


def test_the_reference_leaves_out_the_targets_it_is_told_to_ignore():
    torch.manual_seed(0)
    h, w = torch.randn(9, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    targets = torch.tensor([3, 1, 3, 0, 5, 3, 2, 4, 1])
    kept = targets != 3
    expected = torch.nn.functional.cross_entropy(h[kept] @ w.T, targets[kept])
    torch.testing.assert_close(linear_cross_entropy_reference(h, w, targets, ignore_index=3), expected)
