"""``fastweights generate`` at a tiny temperature (issue 49, scope 5: ``--temperature 1e-300`` crashed with
"probability tensor contains either inf, nan"): logits / T overflowed to inf - inf. The largest logit is subtracted
first, so the draw is the argmax's: the text equals greedy decoding's, for our models and for dynamic evaluation's
sampler, which shares the function."""

import torch

from fastweights.cli import main
from fastweights.loops.generate import sample_token


def test_a_tiny_temperature_samples_the_argmax():
    logits = torch.tensor([1.0, 3.0, -2.0, 2.9])
    gen = torch.Generator().manual_seed(0)
    assert all(sample_token(logits, 1e-300, 0, gen) == 1 for _ in range(20))
    assert sample_token(logits, 1e-300, 2, gen) == 1 and sample_token(logits, 0.0, 0, gen) == 1
    big = torch.tensor([1e30, -1e30, 0.0])
    assert sample_token(big, 1.0, 0, gen) == 0  # huge logits stay finite after the shift


def test_generate_at_a_tiny_temperature_writes_the_greedy_text(tiny_run, capsys):
    base = ["generate", "--checkpoint", str(tiny_run), "--prompt", "To be", "--max-tokens", "12", "--seed", "3"]
    assert main([*base, "--temperature", "1e-300"]) == 0
    tiny = capsys.readouterr()
    assert "Traceback" not in tiny.err
    assert main([*base, "--temperature", "0"]) == 0
    assert tiny.out == capsys.readouterr().out
