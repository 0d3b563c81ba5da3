"""Truncated BPTT (train.carry_state): contiguous lanes, the state carried between steps, exact resume."""

import json

import numpy as np
import pytest
import torch

from fastweights.cli import main
from fastweights.data.streams import TokenStream
from fastweights.models.lm import LanguageModel
from fastweights.loops.train import drops_carried_state

TINY = ["--preset", "tiny", "--quiet", "--set", "train.eval_every=0", "--set", "train.carry_state=true"]


def _stream(n=103):
    s = TokenStream.__new__(TokenStream)
    s.tokens = np.arange(n, dtype=np.uint16)
    return s


def test_lane_batches_continue_where_the_last_step_stopped():
    s = _stream()  # 102 predictions, 3 lanes of 34 tokens, 4 windows of 8 per lane
    x0, y0, restart0 = s.get_lane_batch(3, 8, 0)
    x1, y1, restart1 = s.get_lane_batch(3, 8, 1)
    assert restart0 and not restart1
    assert torch.equal(x0[:, 0], torch.tensor([0, 34, 68]))
    assert torch.equal(y0, x0 + 1) and torch.equal(x1[:, 0], y0[:, -1])  # row i picks up its own lane
    _, _, restart4 = s.get_lane_batch(3, 8, 4)
    assert restart4  # after 4 windows every lane starts again
    with pytest.raises(Exception, match="lanes"):
        s.get_lane_batch(20, 8, 0)


def test_training_feeds_each_step_the_previous_state(tmp_path, monkeypatch):
    seen = []
    forward = LanguageModel.forward

    def spy(self, tokens, state=None, targets=None, **kw):
        if self.training:
            seen.append(None if state is None else state["layers"][0]["mixer"]["pos"])
        return forward(self, tokens, state=state, targets=targets, **kw)

    monkeypatch.setattr(LanguageModel, "forward", spy)
    assert main(["train", *TINY, "--out", str(tmp_path / "r"), "--set", "train.max_steps=3"]) == 0
    seq = json.loads((tmp_path / "r" / "config.json").read_text())["train"]["seq_len"]
    assert seen == [None, seq, 2 * seq]  # the KV cache state arrives with the absolute position carried on


def test_carry_state_resume_equals_straight_run(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = [*TINY, "--set", "train.max_steps=6", "--set", "train.save_every=3"]
    assert main(["train", *common, "--out", str(straight)]) == 0
    assert main(["train", *common, "--out", str(resumed), "--set", "train.max_steps=3"]) == 0
    assert main(["train", "--resume", "--quiet", "--out", str(resumed), "--set", "train.max_steps=6"]) == 0
    a = json.loads((straight / "summary.json").read_text())
    b = json.loads((resumed / "summary.json").read_text())
    assert b["steps"] == 6 and a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6)


def test_carry_state_with_accumulation_is_refused(tmp_path, capsys):
    out = tmp_path / "x"
    assert main(["train", *TINY, "--out", str(out), "--set", "train.grad_accum=2"]) == 2
    assert "carry_state" in capsys.readouterr().err and not out.exists()


def test_carry_reset_draws_are_seeded_and_at_the_asked_rate():
    draws = [drops_carried_state(7, step, 0.25) for step in range(4000)]
    assert draws == [drops_carried_state(7, step, 0.25) for step in range(4000)]  # (seed, step) only: resumable
    assert 0.22 < sum(draws) / len(draws) < 0.28
    assert draws != [drops_carried_state(8, step, 0.25) for step in range(4000)]
    assert not any(drops_carried_state(7, step, 0.0) for step in range(100))
    assert all(drops_carried_state(7, step, 1.0) for step in range(100))


@pytest.mark.parametrize("p", [0.5, 1.0])
def test_carry_reset_drops_the_state_on_the_drawn_steps(tmp_path, monkeypatch, p):
    seen = []
    forward = LanguageModel.forward

    def spy(self, tokens, state=None, targets=None, **kw):
        if self.training:
            seen.append(state is None)
        return forward(self, tokens, state=state, targets=targets, **kw)

    monkeypatch.setattr(LanguageModel, "forward", spy)
    args = ["train", *TINY, "--out", str(tmp_path / "r"), "--set", "train.max_steps=12", "--set", f"train.carry_reset={p}"]
    assert main(args) == 0
    seed = json.loads((tmp_path / "r" / "config.json").read_text())["train"]["seed"]
    expected = [step == 0 or drops_carried_state(seed, step, p) for step in range(12)]
    assert seen == expected
    assert any(expected[1:]) and (p == 1.0 or not all(expected))  # the pattern tested has both kinds of step
