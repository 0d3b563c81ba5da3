"""How loud the fast-weights RNN's memory read is against its input (Ba et al. 2016; issue 21): per fast-weights
layer, the mean size of the read ``A_{t-1} h_t^(0)`` over that of the input term ``W h_{t-1} + C x_t``, the two terms
one LayerNorm adds before the ReLU. At Ba et al.'s eta 0.5 the read is hundreds of times the input, so after the
LayerNorm the state follows the memory alone (why the preset first trained to bigram loss). Recorded by
``benchmarks/quality/fast_rnn_sweep.py``; held to the preset's eta by ``tests/layers/test_fast_rnn.py``."""

from __future__ import annotations


def read_over_input(model, tokens) -> list[float]:
    """Per fast-weights layer: mean |A_{t-1} h_t^(0)| / mean |W h_{t-1} + C x_t| over one window (fp64)."""
    import torch

    from fastweights.layers.fast_rnn import FastWeightRNN

    ratios = []

    def hook(mod, inp, out):
        if not mod.fast_weights:
            return
        u = mod.in_proj(inp[0]).double()[0]  # [T, H]: C x_t + c
        hs = out[0].double()[0]  # [T, H]: the states h_t the layer wrote
        W = mod.W.double()
        A = torch.zeros(W.shape, dtype=torch.float64)
        reads, inputs = [], []
        for t in range(1, hs.shape[0]):
            A = mod.lam * A + mod.eta * torch.outer(hs[t - 1], hs[t - 1])  # A_{t-1} holds h_1..h_{t-1}
            b = u[t] + W @ hs[t - 1]
            h0 = torch.relu(torch.nn.functional.layer_norm(b, b.shape, mod.ln.weight.double(), mod.ln.bias.double()))
            reads.append((A @ h0).norm())
            inputs.append(b.norm())
        ratios.append(float(torch.stack(reads).mean() / torch.stack(inputs).mean()))

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, FastWeightRNN)]
    with torch.no_grad():
        model(tokens)
    for h in handles:
        h.remove()
    return ratios
