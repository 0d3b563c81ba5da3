"""Neural cache (Grave et al. 2017): the chunked form against the per-step reference, the static
limit, state carry, and that it helps on repeated text."""

import pytest
import torch

from fastweights.adapt.cache import NeuralCache, cache_mix, cache_mix_reference
from fastweights.core.errors import UserError
from fastweights.loops.evaluate import score_tokens
from helpers import tiny_lm

V = 11


def tiny_model(**options):
    return tiny_lm(V, options=options)


@pytest.mark.parametrize("similarity", ["dot", "cosine"])
@pytest.mark.parametrize("window", [1, 3, 6, 50])
@pytest.mark.parametrize("warmup", [False, True])
def test_chunked_equals_reference(similarity, window, warmup):
    g = torch.Generator().manual_seed(0)
    T, M, d = 9, 4, 5
    p = torch.softmax(torch.randn(T, V, generator=g, dtype=torch.float64), -1)
    h = torch.randn(T, d, generator=g, dtype=torch.float64)
    y = torch.randint(0, V, (T,), generator=g)
    mh = torch.randn(M, d, generator=g, dtype=torch.float64)
    my = torch.randint(0, V, (M,), generator=g)
    ref = cache_mix_reference(p, h, y, mh, my, 5, window, 0.7, 0.3, similarity, warmup)
    out = cache_mix(p, h, y, mh, my, 5, window, 0.7, 0.3, similarity, warmup)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.sum(-1), torch.ones(T, dtype=torch.float64))
    if not warmup:
        assert not torch.allclose(out, p)  # the cache did something


def test_cache_raises_only_symbols_it_has_seen():
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(1, V, generator=g), -1)
    mh, my = torch.randn(3, 4, generator=g), torch.tensor([2, 2, 5])
    out = cache_mix(p, torch.randn(1, 4, generator=g), torch.tensor([0]), mh, my, 3, 10, 1.0, 0.25)
    unseen = [w for w in range(V) if w not in (2, 5)]
    torch.testing.assert_close(out[0, unseen], 0.75 * p[0, unseen])
    assert (out[0, [2, 5]] > 0.75 * p[0, [2, 5]]).all()


def test_mix_zero_is_static_and_pieces_equal_one_call():
    model = tiny_model()
    x = torch.randint(0, V, (120,), generator=torch.Generator().manual_seed(3))
    r, _ = NeuralCache(model, window=30, mix=0.0, segment_len=10, context=40).evaluate(x)
    static, _ = score_tokens(model, x, 40, 10, keep_token_losses=True)
    torch.testing.assert_close(torch.tensor(r.token_losses), torch.tensor(static.token_losses), rtol=1e-5, atol=1e-6)
    cache = NeuralCache(model, window=30, mix=0.3, segment_len=10, context=40)
    whole, _ = cache.evaluate(x)
    a, st = cache.evaluate(x[:37], final=False)
    b, st = cache.evaluate(x[37:], st)
    assert a.token_losses + b.token_losses == whole.token_losses
    assert st.mem_hidden.shape[0] == 30 and st.seen == 119


def test_cache_helps_on_repeated_text():
    """A random sequence read twice: with a short attention window, the second time identical
    contexts give identical hidden states, and a sharp cache copies the token that followed them."""
    model = tiny_model(attention={"window": 4})
    half = torch.randint(0, V, (60,), generator=torch.Generator().manual_seed(4))
    x = torch.cat([half, half])
    static, _ = score_tokens(model, x, 200, 20, keep_token_losses=True)
    cached, _ = NeuralCache(model, window=200, flatness=1000.0, mix=0.5, similarity="cosine", segment_len=20).evaluate(x)
    s2 = sum(static.token_losses[70:])
    c2 = sum(cached.token_losses[70:])
    assert c2 < 0.5 * s2


def test_bad_settings():
    model = tiny_model()
    with pytest.raises(UserError):
        NeuralCache(model, window=0)
    with pytest.raises(UserError):
        NeuralCache(model, mix=1.5)
    with pytest.raises(UserError):
        NeuralCache(model, similarity="l2")
