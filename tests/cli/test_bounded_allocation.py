"""Bounded allocation (issue 32 item 5): config.json's shapes are checked against the safetensors header on the
meta device before a model is allocated; user numbers (``task niah --lengths``) pass the RAM estimate before
anything is built; corpora that are not regular files (/dev/zero) are refused. One line, exit 2, nothing written."""

from __future__ import annotations

import json
import shutil
import string
import time

import pytest
import torch

from fastweights.cli import main
from helpers import resign_manifest, stderr_text, untrained_char_checkpoint


def _err_line(capsys) -> str:
    err = stderr_text(capsys)
    return err.splitlines()[-1] if err else ""


@pytest.fixture(scope="module")
def printable_checkpoint(tmp_path_factory):
    """An untrained char checkpoint whose vocabulary holds every printable character (NIAH needles encode)."""
    d = tmp_path_factory.mktemp("printable")
    return untrained_char_checkpoint(d, string.printable * 20, d / "ckpt")


def test_config_shapes_checked_against_the_header_before_allocating(printable_checkpoint, tmp_path, capsys,
                                                                     monkeypatch):
    from fastweights.models.lm import LanguageModel

    d = tmp_path / "ckpt"
    shutil.copytree(printable_checkpoint, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model"]["vocab_size"] = 20_000_000  # 2.7 GB of embeddings if built before the check
    (d / "config.json").write_text(json.dumps(cfg))
    resign_manifest(d)
    built = []
    init = LanguageModel.__init__

    def record(self, *a, **k):
        built.append(str(torch.get_default_device()))
        init(self, *a, **k)

    monkeypatch.setattr(LanguageModel, "__init__", record)
    t0 = time.monotonic()
    assert main(["eval", "--checkpoint", str(d), "--quiet"]) == 2
    line = _err_line(capsys)
    assert "config.json does not match the weights" in line and "20000000" in line
    assert built and all(dev == "meta" for dev in built), built  # never built for real
    assert time.monotonic() - t0 < 10


def test_niah_lengths_checked_by_the_ram_estimate(printable_checkpoint, tmp_path, capsys):
    t0 = time.monotonic()
    assert main(["task", "niah", "--checkpoint", str(printable_checkpoint), "--lengths", "10000000000",
                 "--out", str(tmp_path / "niah"), "--quiet"]) == 2
    line = _err_line(capsys)
    assert "--lengths 10000000000" in line and "GiB" in line and "available" in line
    assert time.monotonic() - t0 < 30 and not list(tmp_path.iterdir())


def test_check_tokens_ram_passes_ordinary_sizes():
    from fastweights.core.config import ModelConfig, RunConfig
    from fastweights.core.errors import UserError
    from fastweights.models.size import TOKEN_BYTES, check_tokens_ram

    cfg = RunConfig(model=ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2))
    assert check_tokens_ram(cfg, 4096, "cpu", "--lengths 4096") >= 4096 * TOKEN_BYTES
    with pytest.raises(UserError, match="choose a smaller number"):
        check_tokens_ram(cfg, 10**15, "cpu", "--lengths")


@pytest.mark.parametrize("argv", [
    ["dynamic", "eval", "--checkpoint", "{ckpt}", "--data", "/dev/zero", "--quiet"],
    ["eval", "--checkpoint", "{ckpt}", "--data", "/dev/zero", "--quiet"],
    ["train", "--preset", "tiny", "--quiet", "--out", "{out}", "--set", "data.corpus=/dev/zero"],
], ids=["dynamic-eval", "eval", "train"])
def test_corpora_that_are_not_regular_files_are_refused(printable_checkpoint, tmp_path, capsys, argv):
    import os

    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    out = tmp_path / "out"
    argv = [a.format(ckpt=printable_checkpoint, out=out) for a in argv]
    assert main(argv) == 2
    assert "not a regular file" in _err_line(capsys)
    assert not out.exists()  # no directory, no .lock left behind


def test_a_deep_model_too_big_is_refused_in_seconds(tmp_path, capsys):
    t0 = time.monotonic()
    out = tmp_path / "deep"
    assert main(["train", "--preset", "tiny", "--quiet", "--out", str(out), "--set", "model.n_layers=100000"]) == 2
    line = _err_line(capsys)
    assert "model.n_layers=100000" in line and "GiB" in line and "--force-ram" in line
    assert time.monotonic() - t0 < 60 and not out.exists()


@pytest.mark.parametrize("mixer", ["attention", "fwp"])
def test_the_extrapolated_estimate_is_the_estimate(mixer, monkeypatch):
    """check_deep_model's extrapolation from one and two layers equals estimate_ram of the deep model itself."""
    import copy

    from fastweights.core.config import load_preset, from_dict, RunConfig
    from fastweights.core.errors import UserError
    from fastweights.models import size

    cfg = from_dict(RunConfig, load_preset("tiny"))
    cfg.model.mixer, cfg.model.n_layers = mixer, size.DEEP + 6
    exact = size.estimate_ram(copy.deepcopy(cfg))["total_bytes"]
    monkeypatch.setattr(size, "available_ram", lambda device: exact - 1)
    with pytest.raises(UserError, match=f"about {exact / 2**30:,.1f} GiB"):
        size.check_deep_model(cfg)
    monkeypatch.setattr(size, "available_ram", lambda device: exact)
    size.check_deep_model(cfg)  # exactly enough: passes
