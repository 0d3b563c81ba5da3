"""ops/nll.py: losses are computed in fp32 or wider, and fp64 stays fp64 (the behaviour probes' exactness)."""

import torch
import torch.nn.functional as F
from torch.testing import assert_close

from fastweights.core.config import ModelConfig
from fastweights.models.lm import LanguageModel
from fastweights.ops.nll import log_probs, token_nll, upcast_logits


def test_low_precision_logits_go_to_fp32_and_wider_ones_keep_their_dtype():
    x = torch.randn(3, 5)
    assert upcast_logits(x.bfloat16()).dtype == torch.float32
    assert upcast_logits(x.half()).dtype == torch.float32
    assert upcast_logits(x).dtype == torch.float32
    assert upcast_logits(x.double()).dtype == torch.float64
    assert log_probs(x.double()).dtype == torch.float64


def test_token_nll_is_minus_log_softmax_at_the_target():
    logits = torch.randn(2, 7, 11, dtype=torch.float64)
    targets = torch.randint(0, 11, (2, 7))
    expected = F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1), reduction="none").reshape(2, 7)
    assert_close(token_nll(logits, targets), expected, rtol=0, atol=1e-14)


def test_an_fp64_models_loss_carries_no_fp32_rounding():
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(vocab_size=17, d_model=16, n_layers=1, n_heads=2)).double()
    x = torch.randint(0, 17, (2, 9))
    out = model(x[:, :-1], targets=x[:, 1:])
    assert out.loss.dtype == torch.float64
    exact = F.cross_entropy(out.logits.flatten(0, 1), x[:, 1:].flatten())
    assert (out.loss - exact).abs().item() < 1e-14  # fp32 rounding would leave ~1e-7
