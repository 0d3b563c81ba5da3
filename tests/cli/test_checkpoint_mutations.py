"""Two one-line bugs in the checkpoint readers that the issue-39 mutation audit found the suite missed, each test
shown failing on its mutant: the load retry ignoring a save in progress (deterministic here: the save happens at a
chosen point of the read, and completes while the reader waits, instead of racing 150 loads against a saver), and
a trainer state whose step differs from ``checkpoint.json`` accepted on resume."""

from __future__ import annotations

import types

import pytest
import torch

from fastweights.checkpoints import format as fmt
from fastweights.checkpoints.format import PENDING, open_checkpoint, save_model
from fastweights.core.config import ModelConfig, RunConfig
from fastweights.core.errors import UserError
from fastweights.data import CharTokenizer
from fastweights.models.lm import LanguageModel
from fastweights.models.loading import load_checkpoint, load_for_resume


def _setup(tmp_path):
    tok = CharTokenizer.from_text("the cat sat on the mat. ")
    cfg = RunConfig()
    cfg.model = ModelConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=1, n_heads=2)
    return tok, cfg


def _model(cfg, seed):
    torch.manual_seed(seed)
    return LanguageModel(cfg.model)


def test_a_save_that_swaps_a_file_under_a_reader_is_read_again(tmp_path, monkeypatch):
    """A save commits and swaps ``model.safetensors`` after the reader read the old manifest: the read fails
    against that manifest while ``.ckpt-next/`` exists, so the reader waits and reads again, getting the new
    checkpoint whole (mutant: the retry ignores the save in progress and the load fails)."""
    tok, cfg = _setup(tmp_path)
    d, staged = tmp_path / "run", tmp_path / "staged"
    save_model(_model(cfg, 0), d, cfg, tok, step=1)
    new = _model(cfg, 1)
    save_model(new, staged, cfg, tok, step=2)
    real_read, swapped = fmt.Checkpoint.read, []

    def read(self, name):
        if name == "model.safetensors" and not swapped:  # the save commits and swaps this file now
            swapped.append(1)
            (staged).rename(d / PENDING)
            (d / PENDING / "model.safetensors").replace(d / "model.safetensors")
        return real_read(self, name)

    waits = []

    def sleep(seconds):  # the save completes while the reader waits
        waits.append(seconds)
        fmt.finish_pending(d)

    monkeypatch.setattr(fmt.Checkpoint, "read", read)
    monkeypatch.setattr(fmt, "time", types.SimpleNamespace(sleep=sleep))
    model, _, _ = load_checkpoint(d)
    assert swapped and len(waits) == 1
    for k, v in new.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_a_refusal_while_a_save_is_being_swapped_is_not_final(tmp_path, monkeypatch):
    """The same with ``.ckpt-next/`` already there when the read began (the manifest unchanged in between): a
    save in progress alone makes a refusal worth another read; an idle checkpoint's refusal is final at once."""
    tok, cfg = _setup(tmp_path)
    d = tmp_path / "run"
    save_model(_model(cfg, 0), d, cfg, tok, step=1)
    (d / PENDING).mkdir()  # a committed save being swapped into place
    calls, waits = [], []

    def load(ckpt):
        calls.append(1)
        if len(calls) == 1:
            raise UserError("model.safetensors does not match checkpoint.json")
        return "read"

    def sleep(seconds):
        waits.append(seconds)
        (d / PENDING).rmdir()  # the save finished

    monkeypatch.setattr(fmt, "time", types.SimpleNamespace(sleep=sleep))
    assert open_checkpoint(d, load) == "read" and len(calls) == 2 and len(waits) == 1

    calls.clear()

    def always(ckpt):
        calls.append(1)
        raise UserError("broken")

    with pytest.raises(UserError, match="broken"):
        open_checkpoint(d, always)
    assert len(calls) == 1  # idle: refused at once, no retry


def test_a_trainer_state_at_another_step_than_the_manifest_is_refused(tmp_path):
    """``--resume`` reads the step from the trainer state; ``checkpoint.json`` records the step too, and a trainer
    state that disagrees (spliced from another save) is refused (mutant: the comparison dropped)."""
    tok, cfg = _setup(tmp_path)
    d = tmp_path / "run"
    state = {"step": 5, "optimizer": {}, "rng": {}, "elapsed": 0.0, "history": []}
    save_model(_model(cfg, 0), d, cfg, tok, trainer_state=state, step=4)
    with pytest.raises(UserError, match="trainer state is at step 5 but checkpoint.json says 4"):
        load_for_resume(d)
    save_model(_model(cfg, 0), d, cfg, tok, trainer_state={**state, "step": 4}, step=4)
    assert load_for_resume(d)["state"]["step"] == 4


def test_integer_weights_are_refused_naming_both_dtypes():
    """An integer tensor where the model holds floats would lose every fraction: refused in one line that names
    the two dtypes as torch prints them without its prefix (mutation caught: removesuffix for removeprefix)."""
    model = torch.nn.Linear(2, 2)
    tensors = {"weight": torch.zeros(2, 2, dtype=torch.int64), "bias": torch.zeros(2)}
    with pytest.raises(UserError) as raised:
        fmt.check_weights(model, tensors, "run")
    assert str(raised.value).startswith("run: tensor weight is int64 in model.safetensors where the model holds "
                                        "float32;"), raised.value
