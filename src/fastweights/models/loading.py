"""Checkpoints loaded as a model, a tokenizer and a run configuration.

:func:`load_checkpoint` (model, tokenizer, config), :func:`load_model`, :func:`read_run_config` and
:func:`load_for_resume` build a :class:`~fastweights.models.lm.LanguageModel` and the tokenizer from a
checkpoint directory. How that directory is written and verified (the manifest with every file's size
and SHA-256, the save that a kill cannot tear, the trainer state without pickle) is
:mod:`fastweights.checkpoints.format`, which sits below ``models/`` (so that
``LanguageModel.save_pretrained`` / ``from_pretrained`` use it without an import cycle); import its
names (``save_model``, ``write_checkpoint``, ...) from there.
"""

from __future__ import annotations

import contextlib
import contextvars

import tempfile
from pathlib import Path

from safetensors.torch import load as load_safetensors_bytes

from fastweights.checkpoints.format import (MANIFEST, TRAINER_STATE, Checkpoint, load_model_as, model_from,
                                           open_checkpoint, parse_trainer_state, run_config_from)
from fastweights.core.config import RunConfig
from fastweights.core.errors import UserError
from fastweights.models.lm import LanguageModel


def read_run_config(directory: Path) -> RunConfig:
    return open_checkpoint(directory, run_config_from)


def load_model(directory: Path, map_location: str = "cpu"):
    """The checkpoint's model in eval mode (dropout off), as ``from_pretrained`` in transformers returns it."""
    return load_model_as(LanguageModel, directory, map_location).eval()


def _load_tokenizer_from(ckpt: Checkpoint):
    from fastweights.data import load_tokenizer

    if ckpt.manifest is None:
        return load_tokenizer(ckpt.directory)
    if not ckpt.has("tokenizer.json"):
        raise UserError(f"checkpoint {ckpt.directory} has no tokenizer.json")
    skip = {"model.safetensors", "config.json", TRAINER_STATE}
    with tempfile.TemporaryDirectory() as tmp:  # the verified bytes, so that what is checked is what is read
        for name in ckpt.names():
            if name not in skip:
                (Path(tmp) / name).write_bytes(ckpt.read(name))
        try:
            return load_tokenizer(tmp)
        except UserError as e:  # name the checkpoint, not the temporary directory that is gone by now
            raise UserError(str(e).replace(tmp, str(ckpt.directory))) from None


# Whether a checkpoint without its manifest may be loaded (unverified): off unless a command's
# ``--unverified`` turns it on for the duration of that command (:func:`unverified_checkpoints`).
_ALLOW_UNVERIFIED = contextvars.ContextVar("allow_unverified_checkpoints", default=False)


@contextlib.contextmanager
def unverified_checkpoints(allowed: bool = True):
    """Within the block, a checkpoint directory without its manifest loads with a warning instead of
    being refused (what ``--unverified`` does)."""
    token = _ALLOW_UNVERIFIED.set(bool(allowed))
    try:
        yield
    finally:
        _ALLOW_UNVERIFIED.reset(token)


def _load_all(ckpt: Checkpoint, map_location: str):
    if ckpt.manifest is None:
        if not _ALLOW_UNVERIFIED.get():
            raise UserError(f"checkpoint {ckpt.directory} has no {MANIFEST} (the size and SHA-256 of each file), so "
                            "nothing in it can be verified; if you trust the directory, pass --unverified to load it")
        import sys

        print(f"warning: {ckpt.directory} has no {MANIFEST}: its files are loaded unverified (--unverified)",
              file=sys.stderr)
    cfg = run_config_from(ckpt)
    model = model_from(ckpt, cfg, map_location, LanguageModel).eval()  # scoring and sampling; training sets train()
    tokenizer = _load_tokenizer_from(ckpt)
    if tokenizer.vocab_size != cfg.model.vocab_size:
        raise UserError(
            f"checkpoint {ckpt.directory}: tokenizer has {tokenizer.vocab_size} symbols but the model expects "
            f"{cfg.model.vocab_size}"
        )
    return model, tokenizer, cfg


def load_checkpoint(directory: Path, map_location: str = "cpu"):
    """(model, tokenizer, run_config) from a checkpoint directory, the model in eval mode (dropout off; the
    training loop calls ``train()`` itself, and ``--resume`` rebuilds its model from :func:`load_for_resume`);
    UserError on anything wrong."""
    return open_checkpoint(directory, lambda c: _load_all(c, map_location))


def load_for_resume(directory: Path) -> dict:
    """Everything ``--resume`` needs, from one checkpoint unit: {"config", "tokenizer", "model", "state"}."""
    directory = Path(directory)

    def load(ckpt: Checkpoint) -> dict:
        if ckpt.manifest is None:
            raise UserError(f"--resume: {directory} holds no checkpoint to resume (no {MANIFEST}); "
                            "start a new run there with --overwrite")
        if not ckpt.has(TRAINER_STATE):
            raise UserError(f"--resume: the checkpoint in {directory} has no trainer state (weights only)")
        state = parse_trainer_state(ckpt.read(TRAINER_STATE), f"checkpoint {directory}")
        if ckpt.step is not None and state["step"] != ckpt.step:
            raise UserError(f"checkpoint {directory}: trainer state is at step {state['step']} but "
                            f"{MANIFEST} says {ckpt.step}")
        cfg = run_config_from(ckpt)
        tensors = load_safetensors_bytes(ckpt.read("model.safetensors"))
        return {"config": cfg, "tokenizer": _load_tokenizer_from(ckpt), "model": tensors, "state": state}

    return open_checkpoint(directory, load)
