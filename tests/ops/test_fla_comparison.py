"""``experiments.fla_comparison``'s CPU parts (the GPU scripts' shared helpers, moved out of the scripts): the seeded
inputs, the relative error, one-line exception text, our hybrid config of a fla shape, and our side of the kernel
comparison, which must agree with the per-step delta rule."""

import torch

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


def test_rel_norm_is_the_relative_error_in_fp64():
    ref = torch.tensor([3.0, 4.0])
    assert fc.rel_norm(ref, ref) == 0.0
    assert abs(fc.rel_norm(torch.tensor([3.0, 4.5]), ref) - 0.1) < 1e-12
    assert fc.rel_norm(torch.ones(2), torch.zeros(2)) > 1e20  # a zero reference: huge, not a division by zero


def test_an_exception_is_one_line_naming_where_in_our_code_it_was_raised():
    try:
        fc.rel_norm(torch.ones(2), torch.ones(3))
    except RuntimeError as e:
        text = err_text(e)
    assert text.startswith("RuntimeError: The size of tensor a (2) must match") and "\n" not in text
    assert text.endswith(")") and "(at fla_comparison.py:" in text
    assert err_text(ValueError()) == "ValueError: "


def test_our_hybrid_has_attention_every_nth_layer_and_the_memory_where_asked():
    cfg = {"vocab": 50, "d_model": 32, "n_layers": 4, "n_heads": 2, "head_dim": 16, "mlp": 64, "attn_every": 2,
           "fwpkm": {"n_subkeys": 4, "d_key": 8, "d_value": 8, "topk": 2}, "fwpkm_layers": [1]}
    plain = fc.our_config(cfg, fwpkm=False)
    assert plain.layer_mixers == ["gdn", "attention", "gdn", "attention"] and plain.memory in ("", None)
    assert plain.options["gdn"] == {"head_dim": 16} and (plain.d_model, plain.mlp_hidden) == (32, 64)
    memory = fc.our_config(cfg, fwpkm=True)
    assert memory.memory == "fwpkm" and memory.memory_layers == [1] and memory.options["fwpkm"] == cfg["fwpkm"]


def test_our_side_of_the_kernel_comparison_is_the_delta_rule():
    xs, g, do = fc.delta_inputs(1, 12, 2, 4, "cpu", gated=True, seed=3)
    o, grads = fc.run_impl("ours", None, xs, g, do, backward=True)
    q, k, v, beta = (x.float() for x in xs)
    want, _ = delta_rule_recurrent(q, k, v, beta, log_decay=g)
    assert fc.rel_norm(o, want) < 2e-2  # bf16 inputs, fp32 arithmetic inside
    assert len(grads) == 5 and all(gr is not None and gr.shape == x.shape for gr, x in zip(grads, [*xs, g]))
    o2, none = fc.run_impl("ours", None, xs, g, do, backward=False)
    assert none is None and torch.equal(o, o2)
