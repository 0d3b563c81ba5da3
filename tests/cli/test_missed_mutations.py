"""Tests for the five one-line bugs an independent mutation audit found the suite missed (issue 32), and the
message of ``train.grad_accum=0``. Each test fails on its mutant (checked by applying the mutant to a scratch copy
of ``src/``: see tools/mutation_check.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from fastweights.cli import main
from fastweights.core.errors import UserError
from helpers import signal_at_step

TINY = ["--preset", "tiny", "--quiet"]


def _err_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    return err.splitlines()[-1] if err else ""


# ----------------------------------------------------------------------------- stream_eval carry + dynamic


def test_stream_carry_passes_the_adapted_state_to_the_next_document():
    """carry mode with dynamic evaluation: the second document starts from the first one's adapted weights and
    model state, so it scores differently from reset mode (mutant: carry hands None to the next document)."""
    from helpers import motif_tokens, tiny_lm

    from fastweights.adapt.dynamic import DynamicEvaluator
    from fastweights.experiments.streaming import stream_eval

    model = tiny_lm(9)
    docs = [motif_tokens(120, 9, seed=s).numpy() for s in (1, 2)]

    def run(mode):
        ev = DynamicEvaluator(model, rule="sgd", lr=0.3, segment_len=8, context=24)
        return stream_eval(model, [(f"d{i}", iter([d])) for i, d in enumerate(docs)], mode, seq_len=24, stride=8,
                           bin_width=16, evaluator=ev)

    carry, reset = run("carry"), run("reset")
    assert carry.documents[0]["loss"] == pytest.approx(reset.documents[0]["loss"], rel=1e-6)  # same start
    assert abs(carry.documents[1]["loss"] - reset.documents[1]["loss"]) > 1e-4  # the carried adaptation counts


# ----------------------------------------------------------------------------- memory_only_state and the FWL head


def test_memory_only_state_keeps_the_fwl_heads_state():
    from helpers import tiny_lm

    from fastweights.models.memory_switches import memory_only_state

    model = tiny_lm(9, head="fwl")
    state = model(torch.randint(0, 9, (1, 12)), None).state
    assert state.get("head") is not None, "an FWL head carries fast weights"
    kept = memory_only_state(state)
    assert kept["head"] is state["head"]  # mutant: dropped, so "memory" mode equals "windows"
    assert all("mixer" not in s for s in kept["layers"])


# ----------------------------------------------------------------------------- FastWeightRNN(eps=...)


@pytest.mark.parametrize("read_mode", ["matrix", "attention"])
def test_fast_weight_rnn_uses_its_eps(read_mode):
    from fastweights.layers.fast_rnn import FastWeightRNN

    x = torch.randn(2, 7, 6, generator=torch.Generator().manual_seed(0))

    def out(eps):
        torch.manual_seed(0)
        rnn = FastWeightRNN(6, 8, read_mode=read_mode, eps=eps)
        assert rnn.eps == eps
        return rnn(x)[0]

    small, large = out(1e-5), out(10.0)
    assert not torch.allclose(small, large, atol=1e-4)  # mutant: eps ignored, both use 1e-5
    assert torch.allclose(out(10.0), large)


# ----------------------------------------------------------------------------- the torch RNG on resume


def test_resume_with_dropout_is_bit_exact(tmp_path, capsys):
    """With dropout the masks come from torch's global RNG: resume must restore it (mutant: not restored)."""
    args = [*TINY, "--set", "train.max_steps=10", "--set", "train.eval_every=0", "--set", "train.log_every=1",
            "--set", "model.dropout=0.2"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert main(["train", *args, "--out", str(straight)]) == 0
    with signal_at_step(stopped / "metrics.jsonl", 3):  # log_every=1: the third line is step 3
        assert main(["train", *args, "--out", str(stopped)]) == 130
    k = json.loads((stopped / "checkpoint.json").read_text())["step"]
    assert 3 <= k < 10
    assert main(["train", "--resume", "--quiet", "--out", str(stopped)]) == 0
    a, b = load_file(str(straight / "model.safetensors")), load_file(str(stopped / "model.safetensors"))
    assert all(torch.equal(a[n], b[n]) for n in a), f"resumed at step {k}: weights differ from the straight run"
    capsys.readouterr()


# ----------------------------------------------------------------------------- DynamicEvaluator's context guard


def test_dynamic_evaluator_refuses_a_context_equal_to_the_segment():
    from helpers import tiny_lm

    from fastweights.adapt.dynamic import DynamicEvaluator

    model = tiny_lm(9)
    with pytest.raises(UserError, match="must be longer than the segment length"):
        DynamicEvaluator(model, rule="sgd", lr=0.1, segment_len=16, context=16)
    DynamicEvaluator(model, rule="sgd", lr=0.1, segment_len=16, context=17)  # one more token is fine


# ----------------------------------------------------------------------------- train.grad_accum=0


def test_grad_accum_zero_is_refused_with_its_message(tmp_path, capsys):
    out = tmp_path / "g"
    assert main(["train", *TINY, "--out", str(out), "--set", "train.grad_accum=0"]) == 2
    line = _err_line(capsys)
    assert "train.grad_accum" in line and "must be >= 1" in line and "ZeroDivision" not in line
    assert not out.exists()


