"""Checkpoints: a directory with ``config.json``, ``model.safetensors``, ``tokenizer.json`` and,
for training runs, ``trainer_state.pt``. Every file is written under a temporary name and renamed
into place, so an interrupted save never leaves a half-written file behind.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from fastweights.config import RunConfig, from_dict
from fastweights.errors import UserError


def atomic_write(path: Path, write) -> None:
    """Call ``write(tmp_path)`` then rename the temporary file onto ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}


def save_model(model, directory: Path, run_config: RunConfig | None = None, tokenizer=None,
               state_dict: dict[str, torch.Tensor] | None = None) -> None:
    config = run_config.to_dict() if run_config is not None else {"model": _asdict(model.config)}
    tensors = {k: v.contiguous() for k, v in state_dict.items()} if state_dict is not None else _state_dict(model)
    atomic_write(directory / "model.safetensors", lambda p: save_file(tensors, str(p)))
    if tokenizer is not None:
        tokenizer.save(directory)
    atomic_write(directory / "config.json", lambda p: p.write_text(json.dumps(config, indent=2) + "\n"))


def _asdict(cfg):
    import dataclasses

    return dataclasses.asdict(cfg)


def read_run_config(directory: Path) -> RunConfig:
    directory = Path(directory)
    if not directory.is_dir():
        raise UserError(f"checkpoint {directory} does not exist or is not a directory")
    path = directory / "config.json"
    if not path.is_file():
        raise UserError(f"checkpoint {directory} has no config.json")
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"checkpoint {directory}: corrupt config.json ({e})") from None
    if "model" not in d:
        raise UserError(f"checkpoint {directory}: config.json has no model section")
    return from_dict(RunConfig, d)


def load_model(directory: Path, map_location: str = "cpu"):
    from fastweights.models.lm import LanguageModel

    cfg = read_run_config(directory)
    model = LanguageModel(cfg.model)
    path = Path(directory) / "model.safetensors"
    if not path.is_file():
        raise UserError(f"checkpoint {directory} has no model.safetensors")
    try:
        tensors = load_file(str(path), device=map_location)
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"checkpoint {directory}: corrupt model.safetensors ({e})") from None
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise UserError(
            f"checkpoint {directory} does not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    return model.to(map_location)


def load_checkpoint(directory: Path, map_location: str = "cpu"):
    """(model, tokenizer, run_config) from a checkpoint directory; UserError on anything wrong."""
    from fastweights.data import load_tokenizer

    directory = Path(directory)
    cfg = read_run_config(directory)
    model = load_model(directory, map_location)
    tokenizer = load_tokenizer(directory)
    if tokenizer.vocab_size != cfg.model.vocab_size:
        raise UserError(
            f"checkpoint {directory}: tokenizer has {tokenizer.vocab_size} symbols but the model expects "
            f"{cfg.model.vocab_size}"
        )
    return model, tokenizer, cfg
