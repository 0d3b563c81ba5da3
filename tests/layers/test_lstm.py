"""LSTM layer and mixer on the state protocol."""

import pytest
import torch

from fastweights.core.errors import UserError
from fastweights.layers.lstm import LSTMLayer, LSTMMixer, LSTMOptions, LSTMState
from fastweights.components import MIXERS, build_options, lookup
from helpers import assert_lm_pieces_equal_one_call, tiny_lm


def test_matches_the_lstm_equations():
    torch.manual_seed(0)
    layer = LSTMLayer(3, 5).double()
    x = torch.randn(2, 4, 3, dtype=torch.float64)
    m = layer.lstm
    h = c = torch.zeros(2, 5, dtype=torch.float64)
    hs = []
    for t in range(4):  # gates in PyTorch's order i, f, g, o
        i, f, g, o = (x[:, t] @ m.weight_ih_l0.T + m.bias_ih_l0 + h @ m.weight_hh_l0.T + m.bias_hh_l0).chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        hs.append(h)
    y, state = layer(x)
    torch.testing.assert_close(y, torch.stack(hs, 1))
    assert isinstance(state, LSTMState) and state.h.shape == (2, 5) and state.c.shape == (2, 5)


def test_mixer_from_registry():
    entry = lookup(MIXERS, "mixer", "lstm")
    mixer = entry.cls(d_model=8, n_heads=2, options=build_options(entry, {"hidden": 12}))
    x = torch.randn(2, 5, 8)
    y, state = mixer(x)
    assert y.shape == x.shape and state.h.shape == (2, 12)
    assert sum(p.numel() for p in mixer.parameters()) == 4 * 12 * (8 + 12 + 2) + 12 * 8
    assert LSTMMixer(8, 2, LSTMOptions()).rnn.hidden == 8  # hidden 0 = d_model


def test_batch_rows_are_independent():
    torch.manual_seed(0)
    lstm = LSTMLayer(3, 4)
    x = torch.randn(3, 6, 3)
    x2 = x.clone()
    x2[1:] = torch.randn(2, 6, 3)
    torch.testing.assert_close(lstm(x2)[0][0], lstm(x)[0][0])


def test_bad_hidden_raises_user_error():
    with pytest.raises(UserError):
        LSTMLayer(3, 0)


def test_language_model_state_carry():
    model = tiny_lm(11, mixer="lstm", options={"lstm": {"hidden": 10}}, dtype=torch.float64, training=True)
    assert_lm_pieces_equal_one_call(model, torch.randint(0, 11, (2, 12)), cuts=(5,))


def test_eval_mode_backward_runs_the_accelerator_lstm_in_training_mode():
    """cuDNN refuses the backward of an RNN run in eval mode (seen on an H100, benchmarks/gpu/cuda_check.py), and
    dynamic evaluation backpropagates in eval mode: off the CPU (``meta`` stands in for CUDA here) a forward
    that needs gradients runs nn.LSTM in training mode, which with one layer (no dropout) changes nothing
    else, and leaves it in eval mode; no_grad and CPU calls keep eval mode."""
    seen = []
    with torch.device("meta"):
        lstm = LSTMLayer(3, 4).eval()
        x = torch.empty(2, 5, 3, requires_grad=True)
    lstm.lstm.register_forward_pre_hook(lambda m, args: seen.append(m.training))
    y, state = lstm(x, lstm(x)[1])
    (y.sum() + state.c.sum()).backward()
    assert seen == [True, True] and not lstm.training and not lstm.lstm.training
    with torch.no_grad():
        lstm(x)
    on_cpu = LSTMLayer(3, 4).eval()
    on_cpu.lstm.register_forward_pre_hook(lambda m, args: seen.append(m.training))
    on_cpu(torch.randn(2, 5, 3, requires_grad=True))[0].sum().backward()
    assert seen[2:] == [False, False] and not lstm.lstm.training
