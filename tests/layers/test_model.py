"""LanguageModel and the attention mixer: state carry, causality, overfitting, save/load."""

import pytest
import torch

from fastweights.core.config import ModelConfig
from fastweights.layers.attention import AttentionOptions, CausalSelfAttention
from fastweights.models.lm import LanguageModel
from helpers import assert_lm_pieces_equal_one_call


def tiny_config(**kw):
    base = dict(vocab_size=37, d_model=32, n_layers=2, n_heads=4)
    base.update(kw)
    return ModelConfig(**base)


def test_sliding_window_matches_masked_reference():
    torch.manual_seed(0)
    W = 4
    attn = CausalSelfAttention(16, 2, AttentionOptions(window=W)).double()
    x = torch.randn(1, 12, 16, dtype=torch.float64)
    y, _ = attn(x)
    # reference straight from the module docstring's equation, one position at a time and without the
    # module's forward: o_t = sum_{t-W < s <= t} softmax_s(q_t . k_s / sqrt(d)) v_s
    H, D = 2, 8
    q, k, v = attn.qkv(x).view(1, 12, 3, H, D).permute(2, 0, 3, 1, 4)  # [B, H, T, D] each
    q, k = attn.rope(q, 0), attn.rope(k, 0)
    for t in range(12):
        lo = max(0, t - W + 1)
        w = torch.softmax(q[:, :, t : t + 1] @ k[:, :, lo : t + 1].transpose(-1, -2) / D**0.5, -1)  # [B, H, 1, s]
        o = (w @ v[:, :, lo : t + 1]).transpose(1, 2).reshape(1, H * D)
        torch.testing.assert_close(y[:, t], attn.out(o), rtol=1e-10, atol=1e-10)
    full_attn = CausalSelfAttention(16, 2, AttentionOptions(window=0)).double()
    full_attn.load_state_dict(attn.state_dict())
    full, _ = full_attn(x)
    torch.testing.assert_close(full[:, :W], y[:, :W], rtol=1e-10, atol=1e-10)
    assert not torch.allclose(full[:, W:], y[:, W:])  # the window does cut something


@pytest.mark.parametrize("window,short_conv", [(0, 0), (6, 0), (0, 5)])
def test_model_pieces_equal_one_call(window, short_conv):
    torch.manual_seed(0)
    cfg = tiny_config(options={"attention": {"window": window}}, short_conv=short_conv)
    model = LanguageModel(cfg).double().eval()
    assert_lm_pieces_equal_one_call(model, torch.randint(0, 37, (2, 20)), cuts=(7, 13), atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("short_conv", [0, 4])
def test_causality(short_conv):
    torch.manual_seed(0)
    model = LanguageModel(tiny_config(short_conv=short_conv)).double().eval()
    tokens = torch.randint(0, 37, (1, 16))
    t = 9
    perturbed = tokens.clone()
    perturbed[:, t:] = torch.randint(0, 37, (1, 16 - t))
    a, b = model(tokens).logits, model(perturbed).logits
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-12)
    assert not torch.allclose(a[:, t:], b[:, t:])


def test_short_conv_matches_its_equation():
    """ShortConv against y_t = sum_{i<W} w[W-1-i] x_{t-i} written as a loop (inputs before t = 0 are zeros)."""
    from fastweights.layers.common import ShortConv

    torch.manual_seed(0)
    conv = ShortConv(6, 3).double()
    x = torch.randn(2, 9, 6, dtype=torch.float64)
    y, cache = conv(x)
    w = conv.weight[:, 0]  # [D, W]
    ref = torch.zeros_like(x)
    for t in range(9):
        for i in range(3):
            if t - i >= 0:
                ref[:, t] += w[:, 2 - i] * x[:, t - i]
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cache, x[:, -2:])
    ys, cache = [], None  # pieces shorter than the W - 1 = 2 cached inputs included
    for a, b in [(0, 1), (1, 2), (2, 5), (5, 9)]:
        y_piece, cache = conv(x[:, a:b], cache)
        ys.append(y_piece)
    torch.testing.assert_close(torch.cat(ys, 1), ref, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="width"):
        ShortConv(6, 1)


def test_short_conv_bad_width_is_a_user_error():
    from fastweights.core.errors import UserError

    with pytest.raises(UserError, match="short_conv"):
        LanguageModel(tiny_config(short_conv=1))


def test_tiny_model_overfits_one_batch():
    torch.manual_seed(0)
    model = LanguageModel(tiny_config())
    x = torch.randint(0, 37, (4, 24))
    y = torch.roll(x, -1, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(150):
        loss = model(x, targets=y).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1, loss.item()


def test_save_load_round_trip(tmp_path):
    torch.manual_seed(0)
    model = LanguageModel(tiny_config(tie_embeddings=False)).eval()
    model.save_pretrained(tmp_path)
    loaded = LanguageModel.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 37, (2, 11))
    assert torch.equal(model(tokens).logits, loaded(tokens).logits)


def test_hybrid_layer_mixers_and_bad_config():
    from fastweights.core.errors import UserError

    with pytest.raises(UserError, match="layer_mixers"):
        LanguageModel(tiny_config(layer_mixers=["attention"]))
    with pytest.raises(UserError, match="unknown mixer"):
        LanguageModel(tiny_config(mixer="nope"))
    with pytest.raises(UserError, match="unknown config key"):
        LanguageModel(tiny_config(options={"attention": {"windw": 3}}))
