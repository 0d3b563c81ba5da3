"""layers.common.causal_conv1d_silu: silu of the causal convolution, its output recomputed in the backward, equals
the plain form (values, new cache, gradients, second derivatives; with padding too) and keeps one [B, T, D] tensor
less; the gdn layer computes its q, k and v with it."""

import torch

from fastweights.layers.common import causal_conv1d, causal_conv1d_silu


def plain(x, w, cache, mask=None):
    """The expectation from the primitives (not the module's own plain form, which the fast form calls)."""
    y, c = causal_conv1d(x, w, cache, mask)
    return torch.nn.functional.silu(y), c


def inputs(b=2, t=7, d=6, width=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, d, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(d, 1, width, generator=g, dtype=torch.float64, requires_grad=True)
    cache = torch.randn(b, width - 1, d, generator=g, dtype=torch.float64)
    return x, w, cache


def test_values_cache_and_gradients_equal_the_plain_form():
    """Mutation caught: the recomputed path returning the convolution without silu, or a fresh cache."""
    x, w, cache = inputs()
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, :3] = False  # a left-padded row
    up = torch.randn(2, 7, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for m in (None, mask):
        (y, c), (y_ref, c_ref) = causal_conv1d_silu(x, w, cache, m), plain(x, w, cache, m)
        torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(c, c_ref, rtol=0, atol=0)
        for a, b in zip(torch.autograd.grad((y * up).sum(), (x, w)), torch.autograd.grad((y_ref * up).sum(), (x, w))):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_without_gradients_padding_and_cache_are_kept():
    """No gradient recorded: the plain form, padding skipped and the cache carried as with gradients. Mutation
    caught: the mask or the cache dropped on the path without gradients."""
    x, w, cache = inputs()
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[0, :2] = False
    with torch.no_grad():
        (y, c), (y_ref, c_ref) = causal_conv1d_silu(x, w, cache, mask), plain(x, w, cache, mask)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(c, c_ref, rtol=0, atol=0)


def test_second_derivatives():
    x, w, cache = inputs(b=1, t=5, d=3)
    fn = lambda x, w: causal_conv1d_silu(x, w, cache)[0]  # noqa: E731
    assert torch.autograd.gradgradcheck(fn, (x, w))


def test_the_gdn_layer_keeps_one_conv_sized_tensor_less():
    """The layer's saved bytes drop by one [B, T, 2HK + HV] tensor against the plain form. Mutation caught: the
    layer on the plain form (causal_conv1d, then silu)."""
    import fastweights.layers.gdn as gdn

    torch.manual_seed(0)
    layer = gdn.GatedDeltaNet(32, 2)
    x = torch.randn(2, 16, 32, requires_grad=True)

    def saved():
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y, _ = layer(x)
        return sum(seen.values()), y

    ours, y = saved()
    real = gdn.causal_conv1d_silu
    try:
        gdn.causal_conv1d_silu = plain
        theirs, y_plain = saved()
    finally:
        gdn.causal_conv1d_silu = real
    torch.testing.assert_close(y, y_plain, rtol=0, atol=0)
    # plain: the padded copy [B, W-1+T, D] and the convolution's output [B, T, D]; here: x [B, T, D] and the cache
    assert theirs - ours == 2 * 16 * layer.qkv_dim * 4


def test_under_vmap_with_gradients_it_is_the_plain_form():
    """Batched dynamic evaluation runs a model under torch.func.vmap with its parameters' deltas requiring grad;
    checkpoint's saved-tensor hooks cannot run there, so the plain form does. Mutation caught: the functorch check
    dropped from ops.recompute.recomputes (vmap fails inside functorch)."""
    x, w, cache = inputs()
    y = torch.func.vmap(lambda xx, cc: causal_conv1d_silu(xx[None], w, cc[None])[0][0])(x, cache)
    y_ref = torch.func.vmap(lambda xx, cc: plain(xx[None], w, cc[None])[0][0])(x, cache)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    (g,) = torch.autograd.grad(y.sum(), w)
    (g_ref,) = torch.autograd.grad(y_ref.sum(), w)
    torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-12)
