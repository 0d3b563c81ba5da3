"""The checkpoint format: one directory written and read as a unit.

A checkpoint directory holds ``config.json``, ``model.safetensors``, ``tokenizer.json`` and, for
training runs, ``trainer_state.safetensors`` (optimizer, RNG streams, step and history: tensors as
safetensors, the rest as JSON in its metadata; no pickle), plus the manifest ``checkpoint.json``
that names every file with its size and SHA-256 and the training step.

Writing (:func:`write_checkpoint`, used by every save): all files go into a temporary sibling
``.ckpt-tmp-<pid>/`` and are fsynced with their manifest; the directory is renamed to
``.ckpt-next/`` (the commit point: from then on the new checkpoint is complete on disk); then each
file is renamed into place and the manifest last. A save cut short before the commit leaves the
previous checkpoint untouched (the temporary directory is removed by the next save); one cut short
after it is completed by the next reader or writer (:func:`finish_pending`).

Reading (:func:`open_checkpoint`, behind :func:`load_checkpoint` and ``--resume``): the manifest
(or a committed ``.ckpt-next/``) says which bytes belong to the checkpoint; a file whose size or
SHA-256 differs is refused, naming it. Weights must match config.json's shapes and be finite.
A directory without a manifest is read as it is by this class; the loaders refuse it unless the
command was given ``--unverified`` (:func:`fastweights.models.loading.unverified_checkpoints`), and it
cannot be resumed.

This module knows no model class, so that ``models/lm.py`` (``LanguageModel.save_pretrained`` /
``from_pretrained``) can use it from below; the loaders that build a ``LanguageModel`` and the
tokenizer (:func:`fastweights.models.loading.load_checkpoint`, ``load_model``, ``load_for_resume``) are in
``checkpoint.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors_bytes

from fastweights.core.config import RunConfig, from_dict
from fastweights.core.errors import UserError
from fastweights.core.files import fsync_dir, fsync_file, pid_alive, refuse_links, save_safetensors

MANIFEST = "checkpoint.json"
PENDING = ".ckpt-next"
TMP_PREFIX = ".ckpt-tmp-"
FORMAT = "fastweights-checkpoint"
TRAINER_STATE = "trainer_state.safetensors"
_STATE_FORMAT = "fastweights-trainer-state"


# ----------------------------------------------------------------------------- low-level writing


def remove_stale_temporaries(directory: Path) -> None:
    """Remove temporary files and directories that killed processes left in ``directory``."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for p in directory.iterdir():
        name = p.name
        pid = None
        if name.startswith(TMP_PREFIX):
            pid = name[len(TMP_PREFIX):]
        elif name.startswith(".") and name.endswith(".tmp"):
            parts = name[:-4].rsplit(".", 1)  # .NAME.PID.tmp, or the old pid-less .NAME.tmp
            pid = parts[1] if len(parts) == 2 and parts[1].isdigit() else "0"
        if pid is None or not pid.isdigit():
            continue
        if int(pid) == os.getpid() or (int(pid) != 0 and pid_alive(int(pid))):
            continue  # our own, or a live process's work in progress
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _test_pause(point: str) -> None:
    """TEST HOOK (fault-injection tests only): sleep FASTWEIGHTS_TEST_SAVE_PAUSE seconds at each
    phase of a checkpoint save, widening the windows in which a kill lands inside a save."""
    pause = os.environ.get("FASTWEIGHTS_TEST_SAVE_PAUSE")
    if pause:
        time.sleep(float(pause))


def _sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# ----------------------------------------------------------------------------- the checkpoint writer


def write_checkpoint(directory: Path, write_files, step: int | None = None) -> dict:
    """Write a checkpoint as one unit: ``write_files(tmp_dir)`` writes every file; returns the manifest."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    finish_pending(directory)
    remove_stale_temporaries(directory)
    tmp = directory / f"{TMP_PREFIX}{os.getpid()}"
    for name in (PENDING, MANIFEST):
        refuse_links(directory, directory / name, "a checkpoint")
    if os.path.islink(tmp):  # a link planted at our staging name is removed, never followed
        os.unlink(tmp)
    elif tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        write_files(tmp)
        files = {}
        for p in sorted(tmp.iterdir()):
            if not p.is_file() or p.name == MANIFEST:
                raise RuntimeError(f"checkpoint writer produced an unexpected entry {p.name}")
            refuse_links(directory, directory / p.name, "a checkpoint")  # before the commit: nothing half-written
            fsync_file(p)
            files[p.name] = {"size": p.stat().st_size, "sha256": _sha256_file(p)}
            _test_pause("file")
        manifest = {"format": FORMAT, "version": 1, "step": step, "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        fsync_file(tmp / MANIFEST)
        fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _test_pause("before commit")
    os.rename(tmp, directory / PENDING)  # the commit point: the new checkpoint is complete on disk
    fsync_dir(directory)
    _test_pause("committed")
    finish_pending(directory)
    return manifest


def finish_pending(directory: Path) -> bool:
    """Complete a save that was committed (``.ckpt-next/`` exists) but not yet swapped into place."""
    directory = Path(directory)
    pending = directory / PENDING
    refuse_links(directory, pending, "a checkpoint")  # files are moved out of it: never from elsewhere
    if not pending.is_dir():
        return False
    mpath = pending / MANIFEST
    if mpath.is_file():
        new = _parse_manifest(mpath)
        old_path = directory / MANIFEST
        old = _parse_manifest(old_path) if old_path.is_file() else None
        for name in new["files"]:
            if (pending / name).exists():
                os.replace(pending / name, directory / name)
                _test_pause("swap")
        os.replace(mpath, directory / MANIFEST)
        fsync_dir(directory)
        stale = set(old["files"]) - set(new["files"]) if old else set()
        for name in stale - {MANIFEST}:
            (directory / name).unlink(missing_ok=True)
    shutil.rmtree(pending, ignore_errors=True)
    fsync_dir(directory)
    return True


def _parse_manifest(path: Path) -> dict:
    try:
        m = json.loads(path.read_text())
        if m.get("format") != FORMAT or not isinstance(m.get("files"), dict):
            raise ValueError("not a fastweights checkpoint manifest")
        for name, f in m["files"].items():
            if "/" in name or "\\" in name or name.startswith(".") or not isinstance(f.get("size"), int) \
                    or not isinstance(f.get("sha256"), str):
                raise ValueError(f"bad entry {name!r}")
        if m.get("step") is not None and not isinstance(m["step"], int):
            raise ValueError("bad step")
    except (OSError, ValueError, AttributeError, TypeError) as e:
        raise UserError(f"checkpoint {path.parent}: corrupt {path.name} ({e})") from None
    return m


def _state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}


def save_model(model, directory: Path, run_config: RunConfig | None = None, tokenizer=None,
               state_dict: dict[str, torch.Tensor] | None = None, trainer_state: dict | None = None,
               step: int | None = None) -> dict:
    """Write a checkpoint (weights, config, tokenizer, optional trainer state) as one unit."""
    import dataclasses

    config = run_config.to_dict() if run_config is not None else {"model": dataclasses.asdict(model.config)}
    tensors = {k: v.contiguous() for k, v in state_dict.items()} if state_dict is not None else _state_dict(model)
    bad = next((k for k, v in tensors.items() if v.is_floating_point() and not torch.isfinite(v).all()), None)
    if bad is not None:
        raise UserError(f"refusing to save non-finite weights (tensor {bad} holds NaN or inf)")

    def write(tmp: Path) -> None:
        save_safetensors(tensors, tmp / "model.safetensors")  # with the umask's mode (save_file: 0600)
        if tokenizer is not None:
            tokenizer.save(tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if trainer_state is not None:
            save_trainer_state(trainer_state, tmp / TRAINER_STATE)

    return write_checkpoint(Path(directory), write, step=step)


# ----------------------------------------------------------------------------- trainer state without pickle


def _encode(obj, tensors: dict):
    if isinstance(obj, torch.Tensor):
        name = str(len(tensors))
        tensors[name] = obj.detach().cpu().clone().contiguous()
        return {"$tensor": name}
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in "biuf":
            raise TypeError(f"cannot save a numpy array of dtype {obj.dtype}")
        return {"$ndarray": obj.dtype.str, "shape": list(obj.shape), "data": obj.ravel().tolist()}
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, tuple):
        return {"$tuple": [_encode(x, tensors) for x in obj]}
    if isinstance(obj, list):
        return [_encode(x, tensors) for x in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in obj):
            return {k: _encode(v, tensors) for k, v in obj.items()}
        return {"$dict": [[_encode(k, tensors), _encode(v, tensors)] for k, v in obj.items()]}
    raise TypeError(f"cannot save a {type(obj).__name__} in the trainer state")


def _decode(obj, tensors: dict):
    if isinstance(obj, list):
        return [_decode(x, tensors) for x in obj]
    if not isinstance(obj, dict):
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        raise ValueError(f"unexpected value {obj!r}")
    if "$tensor" in obj:
        return tensors[obj["$tensor"]]
    if "$tuple" in obj:
        return tuple(_decode(x, tensors) for x in obj["$tuple"])
    if "$dict" in obj:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["$dict"]}
    if "$ndarray" in obj:
        dtype = np.dtype(obj["$ndarray"])
        if dtype.kind not in "biuf":
            raise ValueError(f"array dtype {dtype} is not allowed")
        return np.array(obj["data"], dtype=dtype).reshape(obj["shape"])
    return {k: _decode(v, tensors) for k, v in obj.items()}


def save_trainer_state(state: dict, path: Path) -> None:
    tensors: dict[str, torch.Tensor] = {}
    meta = {"format": _STATE_FORMAT, "version": "1", "state": json.dumps(_encode(state, tensors))}
    save_safetensors(tensors, path, metadata=meta)


def parse_trainer_state(data: bytes, where: str) -> dict:
    """The dict saved by :func:`save_trainer_state`, from the file's bytes (no code is run)."""
    try:
        tensors = load_safetensors_bytes(data)
        header_len = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8 : 8 + header_len]).get("__metadata__") or {}
        if meta.get("format") != _STATE_FORMAT:
            raise ValueError("not a fastweights trainer state")
        state = _decode(json.loads(meta["state"]), tensors)
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            raise ValueError("no step")
    except (SafetensorError, ValueError, KeyError, TypeError, IndexError) as e:
        raise UserError(f"{where}: corrupt trainer state ({e})") from None
    return state


# ----------------------------------------------------------------------------- reading


class Checkpoint:
    """A verified view of a checkpoint directory: :meth:`read` returns a file's bytes once they match
    the manifest (size and SHA-256); a directory without a manifest is read as it is."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        d = self.directory
        if not d.is_dir():
            raise UserError(f"checkpoint {d} does not exist or is not a directory")
        self.manifest: dict | None = None
        self.bases = [d]
        if (d / PENDING / MANIFEST).is_file():  # a committed save not yet swapped into place
            self.manifest = _parse_manifest(d / PENDING / MANIFEST)
            self.bases = [d / PENDING, d]
        elif (d / MANIFEST).is_file():
            self.manifest = _parse_manifest(d / MANIFEST)

    @property
    def step(self) -> int | None:
        return self.manifest.get("step") if self.manifest else None

    def names(self) -> list[str]:
        if self.manifest:
            return list(self.manifest["files"])
        return sorted(p.name for p in self.directory.iterdir() if p.is_file() and not p.name.startswith("."))

    def has(self, name: str) -> bool:
        if self.manifest is not None:
            return name in self.manifest["files"]
        return (self.directory / name).is_file()

    def read(self, name: str) -> bytes:
        if self.manifest is not None and name not in self.manifest["files"]:
            raise UserError(f"checkpoint {self.directory} has no {name} ({MANIFEST} does not list it)")
        path = next((b / name for b in self.bases if (b / name).is_file()), None)
        if path is None:
            raise UserError(f"checkpoint {self.directory} has no {name}")
        try:
            data = path.read_bytes()
        except OSError as e:
            raise UserError(f"checkpoint {self.directory}: cannot read {name} ({e.strerror})") from None
        if self.manifest is not None:
            want = self.manifest["files"][name]
            if len(data) != want["size"] or hashlib.sha256(data).hexdigest() != want["sha256"]:
                raise _Mismatch(f"checkpoint {self.directory}: {name} does not match {MANIFEST} "
                                f"({len(data)} bytes, {MANIFEST} records {want['size']} and another SHA-256): "
                                "the file was changed or replaced after the checkpoint was written")
        return data

    def fingerprint(self) -> str:
        """SHA-256 of the weights file: what derived files (gradient statistics, tuned settings) record."""
        if self.manifest is not None and "model.safetensors" in self.manifest["files"]:
            return self.manifest["files"]["model.safetensors"]["sha256"]
        return hashlib.sha256(self.read("model.safetensors")).hexdigest()


class _Mismatch(UserError):
    pass


def open_checkpoint(directory: Path, load, attempts: int = 40):
    """``load(Checkpoint)``, retried while a save is in progress: any refusal met while the manifest changed
    since the read began, or while a staging directory exists, is read again (a reader never fails because a
    save swapped files under it); a refusal of an unchanged, idle checkpoint is final."""
    for attempt in range(attempts):
        before = _save_marker(Path(directory))
        try:
            return load(Checkpoint(directory))
        except UserError:
            if attempt == attempts - 1 or (_save_marker(Path(directory)) == before
                                           and not _being_written(Path(directory))):
                raise
            time.sleep(min(0.02 * (attempt + 1), 0.25))


def _save_marker(directory: Path):
    """What changes when a save commits: the manifest's identity (a save replaces the file) and the staging."""
    try:
        st = os.lstat(directory / MANIFEST)
        manifest = (st.st_ino, st.st_mtime_ns, st.st_size)
    except OSError:
        manifest = None
    return manifest, _being_written(directory)


def _being_written(directory: Path) -> bool:
    """A committed save is being swapped into place (staging under ``.ckpt-tmp-*`` touches no file a reader opens)."""
    return (directory / PENDING).exists()


def weights_fingerprint(directory: Path) -> str:
    """SHA-256 of a checkpoint's weights: recorded in the files derived from them (statistics, tuned settings)."""
    return open_checkpoint(directory, lambda c: c.fingerprint())


def check_derived_file(recorded: str | None, checkpoint: Path | None, path: Path, remedy: str) -> None:
    """Refuse a file derived from other weights than the checkpoint's (files without a record are older: accepted)."""
    if recorded is None or checkpoint is None:
        return
    if recorded != weights_fingerprint(checkpoint):
        raise UserError(f"{path} was made from other weights than those now in {checkpoint} (the model was "
                        f"retrained or replaced); delete it, or {remedy}")


def run_config_from(ckpt: Checkpoint) -> RunConfig:
    """The validated run configuration of a checkpoint's ``config.json``."""
    from fastweights.checkpoints.config_checks import validate_config

    if not ckpt.has("config.json"):
        raise UserError(f"checkpoint {ckpt.directory} has no config.json")
    try:
        d = json.loads(ckpt.read("config.json"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"checkpoint {ckpt.directory}: corrupt config.json ({e})") from None
    if not isinstance(d, dict) or "model" not in d:
        raise UserError(f"checkpoint {ckpt.directory}: config.json has no model section")
    try:
        cfg = from_dict(RunConfig, d)
        validate_config(cfg, need_vocab=True, saved=True)
    except UserError as e:
        raise UserError(f"checkpoint {ckpt.directory}: config.json: {e}") from None
    return cfg


def check_shapes(expected: dict, got: dict, where: str) -> None:
    """Refuse tensor shapes ``got`` (name -> shape, from model.safetensors) that do not fit ``expected`` (the model
    of config.json), one line naming the first mismatching tensor."""
    for name, shape in expected.items():
        if name not in got:
            raise UserError(f"{where}: model.safetensors has no tensor {name} (shape {list(shape)}) that the "
                            "model of config.json needs; config.json does not match the weights")
        if tuple(got[name]) != tuple(shape):
            raise UserError(f"{where}: tensor {name} has shape {list(got[name])} in model.safetensors "
                            f"but the model of config.json needs {list(shape)}; config.json does not match the weights")
    extra = [k for k in got if k not in expected]
    if extra:
        raise UserError(f"{where}: model.safetensors has a tensor {extra[0]} (shape {list(got[extra[0]])}) "
                        "that the model of config.json does not have; config.json does not match the weights")


def check_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Refuse weights that do not fit ``model`` (one line naming the first mismatching tensor) or are not finite."""
    expected = model.state_dict()
    check_shapes({k: tuple(v.shape) for k, v in expected.items()},
                 {k: tuple(v.shape) for k, v in tensors.items()}, where)
    for name in expected:  # in the model's order, so the line names the same tensor on every run
        t = tensors[name]
        if expected[name].is_floating_point() and not t.is_floating_point():  # copied in, 0.7 would read as 0
            raise UserError(f"{where}: tensor {name} is {str(t.dtype).removeprefix('torch.')} in model.safetensors "
                            f"where the model holds {str(expected[name].dtype).removeprefix('torch.')}; these "
                            "weights are not this model's (an integer tensor loses every fraction)")
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise UserError(f"{where}: tensor {name} holds NaN or inf values; these weights are unusable "
                            "(saved from a diverged run?)")


def _header_shapes(data: bytes) -> dict:
    """Tensor name -> shape from a safetensors file's header (nothing allocated); ValueError when malformed."""
    n = int.from_bytes(data[:8], "little")
    if len(data) < 8 or n > len(data) - 8:
        raise ValueError("header longer than the file")
    header = json.loads(data[8 : 8 + n])
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def check_depth(cfg: RunConfig, shapes: dict, where: str) -> None:
    """config.json's ``model.n_layers`` against the blocks model.safetensors holds (``blocks.<i>.`` tensors), before
    anything is built: issue 52's n_layers=1e6 hung the loader in the meta build."""
    n_layers = getattr(cfg.model, "n_layers", None)
    blocks = {int(k.split(".")[1]) for k in shapes if k.startswith("blocks.") and k.split(".")[1].isdigit()}
    if isinstance(n_layers, int) and blocks and n_layers != len(blocks):
        raise UserError(f"{where}: config.json says model.n_layers={n_layers} but model.safetensors holds "
                        f"{len(blocks)} blocks; config.json does not match the weights")


def _meta_shapes(cfg: RunConfig, model_cls) -> dict | None:
    """The state-dict shapes of the model config.json describes, built on the meta device (nothing allocated;
    the global RNG untouched); None when a class cannot be built there (then the weights are checked after)."""
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            return {k: tuple(v.shape) for k, v in model_cls(cfg.model).state_dict().items()}
    except Exception:  # noqa: BLE001 - the real build below reports a config that builds nothing
        return None


def model_from(ckpt: Checkpoint, cfg: RunConfig, map_location: str, model_cls):
    """``model_cls(cfg.model)`` with the checkpoint's weights, checked against its shapes and finite."""
    if not ckpt.has("model.safetensors"):
        raise UserError(f"checkpoint {ckpt.directory} has no model.safetensors")
    data = ckpt.read("model.safetensors")
    try:
        shapes = _header_shapes(data)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"checkpoint {ckpt.directory}: corrupt model.safetensors ({e})") from None
    check_depth(cfg, shapes, f"checkpoint {ckpt.directory}")  # first: a meta build of 10^6 blocks alone takes hours
    expected = _meta_shapes(cfg, model_cls)  # config.json against the weights before the model is allocated
    if expected is not None:
        check_shapes(expected, shapes, f"checkpoint {ckpt.directory}")
    try:
        model = model_cls(cfg.model)
    except UserError as e:
        raise UserError(f"checkpoint {ckpt.directory}: config.json: {e}") from None
    except (ValueError, TypeError, AssertionError, ZeroDivisionError, RuntimeError, KeyError) as e:
        raise UserError(f"checkpoint {ckpt.directory}: config.json describes no buildable model "
                        f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    try:
        tensors = load_safetensors_bytes(data)
    except (SafetensorError, ValueError) as e:
        raise UserError(f"checkpoint {ckpt.directory}: corrupt model.safetensors ({e})") from None
    check_weights(model, tensors, f"checkpoint {ckpt.directory}")
    model.load_state_dict(tensors, strict=False)
    return model.to(map_location)


def load_model_as(model_cls, directory: Path, map_location: str = "cpu"):
    """The model of a checkpoint directory, built as ``model_cls(config.model)`` with its verified weights."""
    return open_checkpoint(directory, lambda c: model_from(c, run_config_from(c), map_location, model_cls))
