"""Fast Weight Layers (Clark et al. 2022): the paper-faithful one-SGD-step equivalence, causality, the
generation (streaming) form, the segment recurrence, second-order gradients, and training through the
head. Every test names its inner-loss normaliser Z."""

import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F

from fastweights.core.config import ModelConfig
from fastweights.core.errors import UserError
from fastweights.layers.fwl import FastWeightLayer, FWLOptions, tune_test_time_step_size
from fastweights.models.lm import LanguageModel
from fastweights.ops.fwl import (
    BLOCK_FAST,
    fwl_parallel,
    fwl_recurrent_reference,
    slow_pass,
    upstream_grads,
    upstream_grads_autograd,
)

from helpers import assert_lm_pieces_equal_one_call, in_pieces, tiny_lm

DT = torch.float64


def random_params(d=6, s=4, v=7, seed=0, dtype=DT):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=dtype) * scale

    return {"U": r(d, 4 * s, scale=0.5), "a": r(4 * s, scale=0.2), "W": r(4 * s, s, scale=0.5), "b": r(s, scale=0.2),
            "ln_weight": 1 + r(s, scale=0.2), "ln_bias": r(s, scale=0.2), "E": r(s, v), "c": r(v, scale=0.2)}


def random_steps(names, seed=1, dtype=DT):
    g = torch.Generator().manual_seed(seed)
    # unequal step sizes, so a tensor moved by the wrong alpha is caught
    return {n: (0.05 + 0.3 * torch.rand((), generator=g)).to(dtype) for n in names}


def random_inputs(b=2, t=9, d=6, v=7, seed=2, dtype=DT):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(b, t, d, generator=g, dtype=dtype)
    labels = torch.randint(0, v, (b, t), generator=g)
    w = torch.ones(b, t, dtype=dtype)
    w[0, 2] = 0  # a padded position
    w[1, 5] = 0
    w[:, -1] = 0  # the last position's label would wrap around
    return h, labels, w


_SGD_CACHE = {}


def cached_sgd_reference(key, *args):
    """The reference does not depend on the chunking: compute it once per (fast set, Z)."""
    if key not in _SGD_CACHE:
        _SGD_CACHE[key] = sgd_step_reference(*args)
    return _SGD_CACHE[key]


def sgd_step_reference(h, labels, w, params, steps, z_norm, eps=1e-5):
    """Literally the paper's definition: for each (b, j), one SGD step on the summed loss of the
    positions s < j of row b, each fast tensor moved by its own step size, then a slow forward at j."""
    b, t, _ = h.shape
    out = torch.empty(b, t, params["E"].shape[1], dtype=h.dtype)
    fast = list(steps)
    for row in range(b):
        for j in range(t):
            moved = dict(params)
            if j > 0:
                leaves = {n: params[n].clone().requires_grad_(True) for n in fast}
                theta = {**params, **leaves}
                logits = slow_pass(h[row : row + 1, :j], theta, eps).logits[0]  # [j, V]
                ce = F.cross_entropy(logits, labels[row, :j], reduction="none")
                loss = (w[row, :j] * ce).sum() / z_norm
                grads = torch.autograd.grad(loss, [leaves[n] for n in fast])
                for n, gr in zip(fast, grads):
                    moved[n] = params[n] - steps[n] * gr
            out[row, j] = slow_pass(h[row, j].view(1, 1, -1), moved, eps).logits[0, 0]
    return out


FAST_SETS = {
    "all (TF)": BLOCK_FAST,
    "slow biases (Jax)": ("U", "W", "ln_weight", "ln_bias"),
    "bias only": ("c",),
}


@pytest.mark.parametrize("fast", list(FAST_SETS))
@pytest.mark.parametrize("chunk", [9, 3, 4])  # one chunk (quadratic), chunks dividing T, chunks needing padding
@pytest.mark.parametrize("z_name", ["none (Z=1)", "batch_tokens (Z=sum w)"])
def test_one_sgd_step_equivalence(fast, chunk, z_name):
    params = random_params()
    steps = random_steps(FAST_SETS[fast])
    h, labels, w = random_inputs()
    z_norm = 1.0 if z_name.startswith("none") else w.sum()
    out, _ = fwl_parallel(h, labels, w, params, steps, z_norm=z_norm, chunk_size=chunk, segment_len=0)
    slow = slow_pass(h, params).logits
    ref = cached_sgd_reference((fast, z_name), h, labels, w, params, steps, z_norm)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    # the update does something: outputs after the first position differ from the slow head
    assert (out[:, 2:] - slow[:, 2:]).abs().max() > 1e-3
    torch.testing.assert_close(out[:, 0], slow[:, 0], rtol=0, atol=1e-12)  # position 0 has no earlier loss


@pytest.mark.parametrize("fast", list(FAST_SETS))
def test_the_op_with_the_autograd_upstream_equals_the_hand_written_one(fast):
    """``fwl_parallel(upstream="autograd")`` (the inner gradients by autograd, the reference) gives the
    hand-written backward's logits and second-order gradients, fp64. Mutation caught (issue 49, seed 7): the
    reference's name refused."""
    def run(upstream):
        params = {n: p.requires_grad_(True) for n, p in random_params().items()}
        h, labels, w = random_inputs()
        out, _ = fwl_parallel(h, labels, w, params, random_steps(FAST_SETS[fast]), chunk_size=4, segment_len=0,
                              upstream=upstream)
        (out * torch.linspace(-1, 1, out.shape[-1], dtype=DT)).square().sum().backward()
        return [out.detach()] + [params[n].grad for n in sorted(params)]

    for got, want in zip(run("autograd"), run("manual")):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="upstream must be 'manual' or 'autograd'"):
        run("autograds")


@pytest.mark.parametrize("fast", list(FAST_SETS))
@torch.no_grad()
def test_first_order_scoring_equals_scoring(fast):
    """Without autograd there is no second-order term to drop: ``first_order`` scores as the full form does,
    whatever depth the fast tensors reach (the no-grad path's upstream factors are None past it). Mutation caught
    (issue 49, seed 7): the factors past the depth set to another empty value, which first_order's detach of
    every factor then tripped over."""
    params, steps = random_params(), random_steps(FAST_SETS[fast])
    h, labels, w = random_inputs()
    first, _ = fwl_parallel(h, labels, w, params, steps, chunk_size=4, segment_len=0, first_order=True)
    full, _ = fwl_parallel(h, labels, w, params, steps, chunk_size=4, segment_len=0)
    torch.testing.assert_close(first, full, rtol=0, atol=0)


def test_scoring_takes_the_slow_block_path_and_training_the_full_slow_pass(monkeypatch):
    """Without autograd the slow logits are never formed (``slow_block``: the scoring path's saving); with it,
    the full ``slow_pass``. Mutation caught (issue 49, seed 9): scoring on the full slow pass (the same numbers,
    the cost the path exists to save)."""
    import fastweights.ops.fwl as fwl_ops

    calls = []
    for name in ("slow_block", "slow_pass"):
        real = getattr(fwl_ops, name)
        monkeypatch.setattr(fwl_ops, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    params, steps = random_params(), random_steps(FAST_SETS["all (TF)"])
    h, labels, w = random_inputs()
    with torch.no_grad():
        fwl_ops.fwl_parallel(h, labels, w, params, steps, chunk_size=4, segment_len=0)
    assert calls == ["slow_block"]
    calls.clear()
    fwl_ops.fwl_parallel(h, labels, w, params, steps, chunk_size=4, segment_len=0)
    assert calls[0] == "slow_pass"  # (which builds on slow_block itself)


def test_zero_step_is_slow_head():
    params = random_params()
    h, labels, w = random_inputs()
    steps = {n: torch.zeros((), dtype=DT) for n in BLOCK_FAST}
    out, _ = fwl_parallel(h, labels, w, params, steps, chunk_size=4, segment_len=0)
    torch.testing.assert_close(out, slow_pass(h, params).logits, rtol=0, atol=1e-14)
    head = FastWeightLayer(6, 7, FWLOptions(hidden=4)).double()
    with torch.no_grad():
        for a in head.step_sizes.values():
            a.zero_()
    tokens = torch.randint(0, 7, (2, 9))
    logits, _ = head(h, tokens)
    torch.testing.assert_close(logits, head.slow_forward(h), rtol=0, atol=1e-14)


def test_hand_written_backward_equals_autograd():
    params = {n: p.requires_grad_(True) for n, p in random_params().items()}
    h, labels, w = random_inputs()
    sp = slow_pass(h, params)
    manual = upstream_grads(sp, params, labels, w, 3.0)
    auto = upstream_grads_autograd(h, params, labels, w, 3.0)
    for a, b in zip(manual, auto):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # and their derivatives (the second-order terms) agree too
    probe = torch.randn_like(manual.g1)
    d1 = torch.autograd.grad((manual.g1 * probe).sum(), list(params.values()), allow_unused=True)
    d2 = torch.autograd.grad((auto.g1 * probe).sum(), list(params.values()), allow_unused=True)
    for a, b in zip(d1, d2):
        if a is None or b is None:
            assert a is None and b is None or (a if a is not None else b).abs().max() == 0
            continue
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("segment_len,start", [(4, 0), (4, 1), (3, 5)])
def test_segments_equal_documented_recurrence(segment_len, start):
    params = random_params()
    steps = random_steps(BLOCK_FAST)
    decays = {n: torch.tensor(0.3 + 0.1 * i, dtype=DT) for i, n in enumerate(BLOCK_FAST)}
    h, labels, w = random_inputs(t=13)
    out, _ = fwl_parallel(h, labels, w, params, steps, z_norm=1.0, chunk_size=2, segment_len=segment_len,
                             start=start, decays=decays)
    ref = fwl_recurrent_reference(h, labels, w, params, steps, z_norm=1.0, segment_len=segment_len, start=start,
                                  decays=decays)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    # with gamma = 1 the segmented forward equals one unsegmented pass
    ones = {n: torch.ones((), dtype=DT) for n in BLOCK_FAST}
    seg1, _ = fwl_parallel(h, labels, w, params, steps, segment_len=segment_len, start=start, decays=ones)
    plain, _ = fwl_parallel(h, labels, w, params, steps, segment_len=0)
    torch.testing.assert_close(seg1, plain, rtol=0, atol=1e-10)
    assert (out - plain).abs().max() > 1e-4  # the decay matters


def make_head(dtype=DT, **kw):
    torch.manual_seed(0)
    opts = FWLOptions(hidden=4, init_std=0.5, **kw)
    head = FastWeightLayer(6, 7, opts).to(dtype)
    with torch.no_grad():
        for i, a in enumerate(head.step_sizes.values()):
            a.fill_(0.05 + 0.03 * i)
        for i, r in enumerate(head.decay_logits.values()):
            r.fill_(0.2 * i - 0.5)  # gamma != 1
    return head


@pytest.mark.parametrize("segment_len", [0, 4])
@pytest.mark.parametrize("split", [[1, 1, 1, 1], [3, 5], [4, 4, 9], [1, 2, 7, 1]])
def test_streaming_pieces_equal_one_call(segment_len, split):
    """One call over a text equals any split into calls with the state carried (one-token calls are the
    generation form); Z = 1 (inner_loss_norm = "none")."""
    head = make_head(segment_len=segment_len, chunk_size=3)
    g = torch.Generator().manual_seed(3)
    t = sum(split) + 2
    h = torch.randn(2, t, 6, generator=g, dtype=DT)
    tokens = torch.randint(0, 7, (2, t), generator=g)
    full, _ = head(h, tokens)
    y, state = in_pieces(head, h, split, tokens)  # then the last 2
    torch.testing.assert_close(y, full, rtol=0, atol=1e-10)
    assert state["pos"] == t


def test_module_equals_sgd_reference():
    """The head fed tokens: position t's label is tokens[t + 1]; Z = 1."""
    head = make_head(segment_len=0)
    h, _, _ = random_inputs()
    tokens = torch.randint(0, 7, (2, 9), generator=torch.Generator().manual_seed(5))
    logits, _ = head(h, tokens)
    labels = torch.cat([tokens[:, 1:], tokens[:, :1]], 1)  # the last label is a dummy with weight 0
    w = torch.ones(2, 9, dtype=DT)
    w[:, -1] = 0
    params = {n: p.detach() for n, p in head.params().items()}
    steps = {n: a.detach() for n, a in head.step_sizes.items()}
    ref = sgd_step_reference(h, labels, w, params, steps, 1.0)
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-10)


def test_second_order_gradcheck():
    """Outer-loss gradients w.r.t. h, the slow weights and the step sizes match finite differences (fp64)."""
    d, s, v = 3, 2, 4
    params = random_params(d, s, v, seed=7)
    steps = random_steps(BLOCK_FAST, seed=8)
    g = torch.Generator().manual_seed(9)
    h = torch.randn(1, 5, d, generator=g, dtype=DT)
    labels = torch.randint(0, v, (1, 5), generator=g)
    w = torch.ones(1, 5, dtype=DT)
    w[:, -1] = 0
    names_p, names_s = list(params), list(steps)

    def fn(h, *flat):
        p = dict(zip(names_p, flat[: len(names_p)]))
        a = dict(zip(names_s, flat[len(names_p):]))
        return fwl_parallel(h, labels, w, p, a, z_norm=1.0, chunk_size=2, segment_len=0)[0]

    inputs = (h, *params.values(), *steps.values())
    inputs = tuple(x.clone().requires_grad_(True) for x in inputs)
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6, rtol=1e-5)


def test_first_order_differs_from_second_order():
    """Dropping the second-order terms changes the outer gradient (so a silently first-order
    implementation is caught), while the outputs are the same; Z = 1."""
    params = {n: p.requires_grad_(True) for n, p in random_params().items()}
    steps = {n: a.requires_grad_(True) for n, a in random_steps(BLOCK_FAST).items()}
    h, labels, w = random_inputs()
    leaves = [*params.values(), *steps.values()]
    results = []
    for first_order in (False, True):
        out, _ = fwl_parallel(h, labels, w, params, steps, segment_len=0, first_order=first_order)
        loss = F.cross_entropy(out.flatten(0, 1), labels.flatten())
        results.append((out.detach(), torch.autograd.grad(loss, leaves)))
    (o2, g2), (o1, g1) = results
    torch.testing.assert_close(o1, o2, rtol=0, atol=1e-14)
    assert max((a - b).abs().max().item() for a, b in zip(g1, g2)) > 1e-6


@pytest.mark.parametrize("stopgrad", [True, False])
def test_no_gradient_crosses_a_segment(stopgrad):
    head = make_head(segment_len=4, stopgrad_segments=stopgrad)
    g = torch.Generator().manual_seed(6)
    h = torch.randn(1, 8, 6, generator=g, dtype=DT, requires_grad=True)
    tokens = torch.randint(0, 7, (1, 8), generator=g)
    logits, _ = head(h, tokens)
    (grad,) = torch.autograd.grad(logits[:, 4:].sum(), h)  # outputs of segment 1 w.r.t. the inputs of segment 0
    if stopgrad:
        assert grad[:, :4].abs().max() == 0
    else:
        assert grad[:, :4].abs().max() > 1e-6


@pytest.mark.parametrize("norm", ["none", "fixed", "batch_tokens"])
def test_batch_independence(norm):
    head = make_head(segment_len=0, inner_loss_norm=norm, inner_loss_z=7.0)
    head.train()
    g = torch.Generator().manual_seed(8)
    h = torch.randn(2, 6, 6, generator=g, dtype=DT)
    tokens = torch.randint(0, 7, (2, 6), generator=g)
    a, _ = head(h, tokens)
    h2, t2 = h.clone(), tokens.clone()
    h2[1] += 1.0
    t2[1] = (t2[1] + 1) % 7
    b, _ = head(h2, t2)
    if norm == "batch_tokens":  # the official Z counts the whole batch, coupling the rows through Z (training)
        assert head.z_count == 2 and head.z_train == 10.0  # 2 rows x 5 labelled positions
        h3 = h[:1]
        c, _ = head(h3, tokens[:1])  # a batch of one: a different Z
        assert (c[0] - a[0]).abs().max() > 1e-8
        head.eval()  # eval uses the running mean of the training Z: rows are independent again
        a, _ = head(h, tokens)
        b, _ = head(h3, tokens[:1])
        torch.testing.assert_close(a[:1], b, rtol=0, atol=1e-12)
    else:
        torch.testing.assert_close(a[0], b[0], rtol=0, atol=1e-12)


def test_fp32_close_to_fp64():
    head = make_head(segment_len=4)
    head32 = make_head(dtype=torch.float32, segment_len=4)
    g = torch.Generator().manual_seed(10)
    h = torch.randn(2, 11, 6, generator=g, dtype=DT)
    tokens = torch.randint(0, 7, (2, 11), generator=g)
    a, _ = head(h, tokens)
    b, _ = head32(h.float(), tokens)
    assert b.dtype == torch.float32
    torch.testing.assert_close(b.double(), a, rtol=1e-4, atol=1e-4)


def test_fast_parameters_and_options():
    head = FastWeightLayer(8, 5, FWLOptions(hidden=3))
    names = [n for n, _, _ in head.fast_parameters()]
    assert names == list(BLOCK_FAST)
    for n, p, a in head.fast_parameters():
        assert p is getattr(head, n) and float(a.detach()) == pytest.approx(0.01)
    assert head.U.shape == (8, 12) and head.W.shape == (12, 3) and head.E.shape == (3, 5)
    assert [n for n, _, _ in FastWeightLayer(8, 5, FWLOptions(fast_biases=False)).fast_parameters()] == [
        "U", "W", "ln_weight", "ln_bias"]
    assert [n for n, _, _ in FastWeightLayer(8, 5, FWLOptions(bias_only=True)).fast_parameters()] == ["c"]
    for bad in ({"inner_loss_norm": "tokens"}, {"segment_len": -1}, {"decay_init": 1.0}, {"hidden": -2}):
        with pytest.raises(UserError):
            FastWeightLayer(8, 5, dataclasses.replace(FWLOptions(), **bad))
    with pytest.raises(UserError):  # unknown option keys fail through the registry
        LanguageModel(ModelConfig(vocab_size=11, d_model=8, n_layers=1, n_heads=2, head="fwl",
                                  options={"fwl": {"step_size": 0.1}}))


def test_test_time_only_mode():
    """Trained as the slow head (no state); in eval mode one global step size moves every fast tensor."""
    head = make_head(segment_len=0, test_time_only=True, test_time_step_size=0.07)
    assert len(head.step_sizes) == 0
    g = torch.Generator().manual_seed(11)
    h = torch.randn(2, 7, 6, generator=g, dtype=DT)
    tokens = torch.randint(0, 7, (2, 7), generator=g)
    head.train()
    y, state = head(h, tokens)
    assert state is None
    torch.testing.assert_close(y, head.slow_forward(h), rtol=0, atol=0)
    head.eval()
    y, state = head(h, tokens)
    labels = torch.cat([tokens[:, 1:], tokens[:, :1]], 1)
    w = torch.ones(2, 7, dtype=DT)
    w[:, -1] = 0
    params = {n: p.detach() for n, p in head.params().items()}
    ref = sgd_step_reference(h, labels, w, params, {n: torch.tensor(0.07, dtype=DT) for n in BLOCK_FAST}, 1.0)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-10)



@pytest.mark.parametrize("decay_init", [0.9, 0.5, 0.25])
def test_a_new_heads_segment_decays_start_at_decay_init(decay_init):
    """gamma = sigmoid(rho) of each fast tensor starts at ``decay_init``: rho is initialised as logit(gamma), not
    log(gamma) (which would start a 0.9 decay at 0.47). Mutation caught: ``math.log(opt.decay_init)`` (issue 49)."""
    head = FastWeightLayer(6, 7, FWLOptions(hidden=4, segment_len=4, decay_init=decay_init))
    decays = head.decays()
    assert decays and all(float(g.detach()) == pytest.approx(decay_init, abs=1e-6) for g in decays.values())


def test_tuning_the_test_time_step_size_weighs_every_window_once():
    """The tuned loss of a step size is the mean over the windows: with 3 windows in batches of 2 the last
    batch holds one window and counts once, so each grid value equals the mean of the windows' own losses (the
    model run on one window at a time), and the best is the grid's lowest, set on the head. Mutation caught: a
    short last batch weighed as a full one (``out.loss.item() * batch_size``, issue 49)."""
    model = fwl_model(segment_len=0, test_time_only=True)
    tokens = torch.randint(0, 11, (3 * 6 + 1,), generator=torch.Generator().manual_seed(7))
    x, y = tokens[:-1].view(3, 6), tokens[1:].view(3, 6)
    grid = [0.0, 0.5, 2.0]
    want = {}
    model.eval()
    for step in grid:
        model.head.options.test_time_step_size = step
        with torch.no_grad():
            want[step] = sum(model(x[i:i + 1], targets=y[i:i + 1]).loss.item() for i in range(3)) / 3
    assert len(set(want.values())) == 3  # the step size matters here, so the weighting does too
    out = tune_test_time_step_size(model, tokens, 6, grid, batch_size=2)
    assert out["grid"] == pytest.approx(want, rel=1e-12)
    assert out["best"] == min(want, key=want.get) == model.head.options.test_time_step_size


def test_the_test_time_step_search_never_chooses_a_diverged_step():
    """Issue 49, scope 4: a step whose loss is not finite is marked and never best (``min`` over a NaN first in the
    grid returned the NaN's step), and a grid that diverged everywhere is refused, the head left as it was."""
    model = fwl_model(segment_len=0, test_time_only=True)
    tokens = torch.randint(0, 11, (3 * 6 + 1,), generator=torch.Generator().manual_seed(7))
    out = tune_test_time_step_size(model, tokens, 6, [float("inf"), 0.0, 0.5], batch_size=2)
    assert out["status"] == {float("inf"): "diverged", 0.0: "ok", 0.5: "ok"}
    assert out["best"] in (0.0, 0.5) and out["best"] == model.head.options.test_time_step_size
    model.head.options.test_time_step_size = 0.25
    with pytest.raises(UserError, match="non-finite"):
        tune_test_time_step_size(model, tokens, 6, [float("inf")], batch_size=2)
    assert model.head.options.test_time_step_size == 0.25


# ----------------------------------------------------------------------------- in the language model


def fwl_model(**opts):
    return tiny_lm(11, n_layers=1, head="fwl", options={"fwl": {"segment_len": 5, "chunk_size": 4, **opts}},
                   dtype=DT)


def test_model_generation_form_equals_parallel():
    """Token-by-token calls (sample, take the gradient for the sampled token, update, continue) reproduce
    the parallel logits; Z = 1."""
    model = fwl_model()
    tokens = torch.randint(0, 11, (2, 13), generator=torch.Generator().manual_seed(1))
    assert_lm_pieces_equal_one_call(model, tokens, cuts=range(3, 13))


@pytest.mark.parametrize("chunk_size", [4, 14])  # chunked path (chunk < T) and the default block (chunk >= T)
def test_model_causality(chunk_size):
    model = fwl_model(chunk_size=chunk_size)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 11, (1, 14), generator=g)
    base = model(tokens).logits
    for t in (1, 5, 9):
        t2 = tokens.clone()
        t2[:, t:] = torch.randint(0, 11, (1, 14 - t), generator=g)
        out = model(t2).logits
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-12)


def test_model_trains_second_order(tmp_path):
    """A tiny model with head = "fwl" trains through fastweights.loops.train (second-order by default): the
    loss is finite, the step sizes and decays move, and the checkpoint reloads to the same logits."""
    from fastweights.core.config import make_config
    from fastweights.models.loading import load_checkpoint
    from fastweights.loops.train import train

    cfg = make_config("tiny", ["model.head=\"fwl\"", "model.options.fwl.segment_len=8", "train.max_steps=4",
                               "train.eval_every=0", "train.eval_tokens=512", "train.device=\"cpu\"",
                               "train.batch_size=4", "train.threads=1", "train.warmup_steps=1"])
    summary = train(cfg, tmp_path, progress=False)
    assert summary["steps"] == 4 and summary["val_loss"] == summary["val_loss"]  # finite, not NaN
    model, tok, _ = load_checkpoint(tmp_path)
    steps = {n: float(a.detach()) for n, a in model.head.step_sizes.items()}
    assert all(abs(a - 0.01) > 1e-5 for a in steps.values()), steps
    assert any(abs(float(torch.sigmoid(r.detach())) - 0.9) > 1e-6 for r in model.head.decay_logits.values())
    x = torch.randint(0, tok.vocab_size, (1, 20))
    model2, _, _ = load_checkpoint(tmp_path)
    torch.testing.assert_close(model.eval()(x).logits, model2.eval()(x).logits)


def test_outer_gradient_reaches_backbone_and_step_sizes():
    model = fwl_model()
    model.train()
    tokens = torch.randint(0, 11, (2, 10), generator=torch.Generator().manual_seed(3))
    out = model(tokens[:, :-1], targets=tokens[:, 1:])
    out.loss.backward()
    assert all(a.grad is not None and a.grad.abs() > 0 for a in model.head.step_sizes.values())
    assert model.embed.weight.grad.abs().max() > 0


@pytest.mark.parametrize("stopgrad", [True, False])
def test_masked_block_equals_chunked_op_with_gradients(stopgrad):
    """Short calls use one masked block, long ones the chunked op piece by piece: same outputs and
    gradients (the decays included), with a carried state; Z = 1."""
    params = {n: p.requires_grad_(True) for n, p in random_params().items()}
    steps = {n: a.requires_grad_(True) for n, a in random_steps(BLOCK_FAST).items()}
    decays = {n: torch.tensor(0.4 + 0.08 * i, dtype=DT, requires_grad=True) for i, n in enumerate(BLOCK_FAST)}
    h, labels, w = random_inputs(t=14)
    h.requires_grad_(True)
    g = torch.Generator().manual_seed(12)
    state = {"base": {n: torch.randn(2, *params[n].shape, generator=g, dtype=DT) for n in BLOCK_FAST},
             "carry": {n: torch.randn(2, *params[n].shape, generator=g, dtype=DT) for n in BLOCK_FAST}}
    leaves = [h, *params.values(), *steps.values(), *decays.values()]
    results = []
    for chunk in (14, 3):  # 14 >= N: masked block; 3 < N: the op
        out, _ = fwl_parallel(h, labels, w, params, steps, chunk_size=chunk, segment_len=4, start=2,
                                 decays=decays, state=state, stopgrad_segments=stopgrad)
        loss = (out * torch.linspace(-1, 1, out.numel(), dtype=DT).view_as(out)).sum()
        results.append((out.detach(), torch.autograd.grad(loss, leaves)))
    (o1, g1), (o2, g2) = results
    torch.testing.assert_close(o1, o2, rtol=0, atol=1e-10)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    assert any(gr.abs() > 0 for gr in g1[-len(decays):])  # the decays are trained


@pytest.mark.parametrize("t, trained", [(6, False), (7, True)])
def test_segment_decays_train_only_from_the_third_segment(t, trained):
    # Delta_2 = gamma Delta_1 + S_1 is the first place gamma enters: windows of fewer than three segments
    # leave the decays without gradient, and training warns about it
    model = fwl_model(segment_len=3)
    model.train()
    tokens = torch.randint(0, 11, (2, t + 1), generator=torch.Generator().manual_seed(4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(tokens[:, :-1], targets=tokens[:, 1:])
    out.loss.backward()
    grads = [r.grad for r in model.head.decay_logits.values()]
    assert any(g is not None and g.abs().max() > 0 for g in grads) == trained
    assert any("segment decays get no gradient" in str(w.message) for w in caught) == (not trained)


@pytest.mark.parametrize("segment_len,start", [(0, 0), (4, 1)])
def test_residual_branch_equals_reference(segment_len, start):
    """(h + f(h)) E + c, the head of a pretrained model: the parallel form equals the per-step weights, and
    the hand-written backward equals autograd (the formulas are unchanged: h does not depend on theta)."""
    params = random_params(d=4, s=4)
    steps = random_steps(BLOCK_FAST)
    decays = {n: torch.tensor(0.5, dtype=DT) for n in BLOCK_FAST}
    h, labels, w = random_inputs(t=11, d=4)
    out, _ = fwl_parallel(h, labels, w, params, steps, chunk_size=3, segment_len=segment_len, start=start,
                          decays=decays, residual=True)
    slow = slow_pass(h, params, residual=True).logits
    ref = fwl_recurrent_reference(h, labels, w, params, steps, segment_len=segment_len, start=start, decays=decays,
                                  residual=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(slow - slow_pass(h, params).logits, h @ params["E"], rtol=0, atol=1e-10)
    sp = slow_pass(h, params, residual=True)
    manual = upstream_grads(sp, params, labels, w, 2.0)
    auto = upstream_grads_autograd(h, params, labels, w, 2.0, residual=True)
    for a, b in zip(manual, auto):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_residual_head_on_a_shared_unembedding_starts_as_the_identity():
    g = torch.Generator().manual_seed(3)
    out_layer = torch.nn.Linear(6, 9, bias=True).double()
    # zero gain and zero step sizes: the branch and its update are both zero, the logits the pretrained ones
    head = FastWeightLayer(6, 9, FWLOptions(residual=True, segment_len=4, step_size_init=0.0),
                           unembedding=out_layer).double()
    assert not any(p is out_layer.weight or p is out_layer.bias for p in head.parameters())
    assert not any(k.startswith(("E", "c", "_shared")) for k in head.state_dict())
    h = torch.randn(2, 10, 6, generator=g, dtype=DT)
    tokens = torch.randint(0, 9, (2, 10), generator=g)
    logits, _ = head(h, tokens)
    torch.testing.assert_close(logits, out_layer(h), rtol=0, atol=1e-12)
    with torch.no_grad():  # a step size moves the LN gain and bias even at gain 0 (their gradients do not vanish)
        head.step_sizes["ln_bias"].fill_(0.3)
    logits, _ = head(h, tokens)
    torch.testing.assert_close(logits[:, 0], out_layer(h)[:, 0], rtol=0, atol=1e-12)
    assert (logits - out_layer(h))[:, 1:].abs().max() > 1e-4
    assert [n for n, _, _ in FastWeightLayer(6, 9, FWLOptions(residual=True, bias_only=True),
                                             unembedding=out_layer).fast_parameters()] == ["c"]
    with pytest.raises(UserError):
        FastWeightLayer(6, 9, FWLOptions(residual=True, hidden=3))
    with pytest.raises(UserError):
        FastWeightLayer(6, 8, FWLOptions(residual=True), unembedding=out_layer)
