"""LSTM (Hochreiter & Schmidhuber 1997) on the state protocol, the recurrent baseline of the fast-weights RNN.

    i_t, f_t, o_t = sigmoid(W_k x_t + U_k h_{t-1} + b_k)  for k = i, f, o    (input, forget, output gates)
    g_t = tanh(W_g x_t + U_g h_{t-1} + b_g)
    c_t = f_t * c_{t-1} + i_t * g_t
    h_t = o_t * tanh(c_t)

The recurrence is PyTorch's ``nn.LSTM`` (cuDNN on CUDA, its C++ kernel on CPU); this
file only adapts it to ``y, state = layer(x, state=None)`` with a batch-first state.

Padding (``attention_mask`` [B, T], 0 = padding): ``nn.LSTM`` has no per-step mask, so a padded call runs
each row's real tokens alone from that row's state (``layers.common.per_row``): a padded step neither
moves h and c nor is read; its output is zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

from fastweights.components import register_mixer
from fastweights.core.errors import UserError
from fastweights.layers.common import per_row
from fastweights.ops.linear import Linear


class LSTMState(NamedTuple):
    """Hidden and cell state after the last step, each [B, H]."""

    h: Tensor
    c: Tensor


class LSTMLayer(nn.Module):
    """One LSTM layer: ``hs, state = lstm(x, state=None)``.

    Args:
        input_size: features of x.
        hidden: H, the number of hidden units.

    forward(x [B, T, input_size], state: LSTMState | None) -> (hs [B, T, H], LSTMState).
    """

    def __init__(self, input_size: int, hidden: int):
        super().__init__()
        if hidden < 1:
            raise UserError(f"lstm: hidden must be >= 1, got {hidden}")
        self.hidden = hidden
        self.lstm = nn.LSTM(input_size, hidden, batch_first=True)

    def forward(self, x: Tensor, state: LSTMState | None = None) -> tuple[Tensor, LSTMState]:
        # nn.LSTM keeps its state as [num_layers, B, H]; ours is batch-first [B, H]
        hx = None if state is None else (state.h.unsqueeze(0).contiguous(), state.c.unsqueeze(0).contiguous())
        if x.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
            # oneDNN has a bf16 LSTM only on CPUs with bf16 instructions; elsewhere it fails ("could not create
            # a primitive descriptor for the LSTM forward"). Run it in fp32, as autocast does for the ops it keeps.
            with torch.autocast("cpu", enabled=False):
                hs, (h, c) = self.lstm(x.float(), None if hx is None else tuple(t.float() for t in hx))
        elif self.lstm.training or x.device.type == "cpu" or not torch.is_grad_enabled():
            hs, (h, c) = self.lstm(x, hx)
        else:
            # cuDNN's RNN backward refuses a forward run in eval mode ("cudnn RNN backward can only be called
            # in training mode"), and dynamic evaluation backpropagates through a model in eval mode. With one
            # layer nn.LSTM has no dropout, so its training flag changes nothing else: run it in that mode.
            self.lstm.train()
            try:
                hs, (h, c) = self.lstm(x, hx)
            finally:
                self.lstm.eval()
        return hs, LSTMState(h.squeeze(0), c.squeeze(0))


@dataclass
class LSTMOptions:
    """Options of the ``lstm`` mixer (TOML table ``[model.options.lstm]``)."""

    hidden: int = 0  # hidden units H; 0 = d_model


@register_mixer("lstm", LSTMOptions)
class LSTMMixer(nn.Module):
    """An LSTM as a sequence mixer: x [B, T, d_model] -> LSTM (H units) -> y [B, T, d_model].

    ``n_heads`` is accepted for the mixer interface and unused. Parameters: LSTM
    4H (d_model + H + 2), output projection H x d_model.
    """

    # facts for the project's checks and the memory estimate (fastweights.components, "what a component declares")
    test_variants = {"default": {"hidden": 8}}
    bounded_variants = {"default": {"hidden": 16}}
    compute_dtype_state = ("",)  # PyTorch's fused nn.LSTM runs its cell in the autocast dtype

    @staticmethod
    def state_floats(o, *, d_model, **_):  # h and c
        return {"carried": 2 * (o.hidden or d_model)}

    def __init__(self, d_model: int, n_heads: int, options: LSTMOptions | None = None):
        super().__init__()
        o = options or LSTMOptions()
        self.rnn = LSTMLayer(d_model, o.hidden or d_model)
        self.out_proj = Linear(self.rnn.hidden, d_model, bias=False)
        self.out_proj.is_residual_proj = True  # scaled init in LanguageModel, like the attention output

    def forward(self, x: Tensor, state: LSTMState | None = None,
                attention_mask: Tensor | None = None) -> tuple[Tensor, LSTMState]:
        if attention_mask is not None:
            rows = [None if state is None else LSTMState(state.h[b:b + 1], state.c[b:b + 1])
                    for b in range(x.shape[0])]
            hs, rows = per_row(self.rnn, x, attention_mask, rows)
            zero = x.new_zeros(1, self.rnn.hidden)
            state = LSTMState(*(torch.cat([zero if r is None else r[i] for r in rows]) for i in range(2)))
            return self.out_proj(hs.to(x.dtype)), state
        hs, state = self.rnn(x, state)
        return self.out_proj(hs), state
