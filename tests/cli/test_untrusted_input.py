"""Run directories and model directories as untrusted input (issue 32): nothing in ``--out`` is written through a
symbolic link, Hugging Face directories run no code and hold no pickles or non-finite weights, an unknown hub name
without network fails fast, and user numbers are checked before anything is allocated. Each case: one line, exit 2,
no traceback, nothing written outside the directories named."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from fastweights.cli import main
from helpers import resign_manifest, tiny_gpt2_dir, tiny_training_run

SHORT = ["--preset", "tiny", "--quiet", "--set", "train.max_steps=4", "--set", "train.eval_every=0"]

@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_training_run(tmp_path_factory.mktemp("untrusted") / "run", steps=4)


def _err_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    return err.splitlines()[-1] if err else ""


def _copy(run, tmp_path, name):
    dst = tmp_path / name
    shutil.copytree(run, dst)
    return dst


@pytest.mark.parametrize("name", [".lock", "metrics.jsonl"])
def test_resume_never_writes_through_a_symlink(run, tmp_path, capsys, name):
    out = _copy(run, tmp_path, "linked")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (out / name).unlink(missing_ok=True)
    (out / name).symlink_to(victim)
    rc = main(["train", *SHORT, "--set", "train.max_steps=6", "--out", str(out), "--resume"])
    line = _err_line(capsys)
    assert rc == 2 and "symbolic link" in line and name in line
    assert victim.read_text() == "precious\n"
    # a dangling link is not followed either (it would create the file it points to)
    victim.unlink()
    assert main(["train", *SHORT, "--set", "train.max_steps=6", "--out", str(out), "--resume"]) == 2
    assert "symbolic link" in _err_line(capsys) and not victim.exists()


def test_atomic_write_replaces_a_planted_temporary_link(tmp_path):
    from fastweights.core.files import atomic_write

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / f".summary.json.{os.getpid()}.tmp").symlink_to(victim)
    atomic_write(tmp_path / "summary.json", lambda p: p.write_text(json.dumps({"a": 1})))
    assert victim.read_text() == "precious\n" and json.loads((tmp_path / "summary.json").read_text()) == {"a": 1}


# ----------------------------------------------------------------------------- Hugging Face model directories


def _hf_eval(directory, doc, capsys, *extra):
    rc = main(["dynamic", "eval", "--hf", str(directory), "--data", str(doc), "--rule", "sgd", "--lr", "1e-3",
               "--segment-len", "8", "--quiet", *extra])
    return rc, _err_line(capsys)


@pytest.fixture
def doc(tmp_path):
    """A short document; transformers' warnings are silenced meanwhile (its log handler keeps the stderr of the
    test that first imported it, which capsys has closed since: '--- Logging error ---' would be printed)."""
    transformers = pytest.importorskip("transformers")
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    path = tmp_path / "doc.txt"
    path.write_text("The cat sat on the mat. The dog sat on the log. " * 3)
    yield path
    transformers.logging.set_verbosity(level)


def test_hf_pickled_weights_refused_in_one_line(tmp_path, doc, capsys):
    pytest.importorskip("transformers")
    model, tok, d = tiny_gpt2_dir(tmp_path)
    import torch

    model.save_pretrained(d)
    tok.save_pretrained(d)
    for f in d.glob("*.safetensors"):
        f.unlink()
    torch.save(model.state_dict(), d / "pytorch_model.bin")
    assert (d / "pytorch_model.bin").is_file() and not list(d.glob("*.safetensors"))
    rc, line = _hf_eval(d, doc, capsys)
    assert rc == 2 and "pickled" in line and "pytorch_model.bin" in line


def test_hf_non_finite_weights_refused(tmp_path, doc, capsys):
    pytest.importorskip("transformers")
    import torch

    model, tok, d = tiny_gpt2_dir(tmp_path)
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight[0, 0] = float("nan")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    rc, line = _hf_eval(d, doc, capsys)
    assert rc == 2 and "NaN or inf" in line and "c_fc" in line


def test_hf_remote_code_never_runs(tmp_path, doc, capsys):
    """A directory whose config.json names its own Python (auto_map): refused, the module never imported,
    no question asked (stdin is not read: pytest would fail a read)."""
    pytest.importorskip("transformers")
    model, tok, d = tiny_gpt2_dir(tmp_path)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    marker = tmp_path / "code-ran"
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="evil_remote", architectures=["EvilForCausalLM"],
               auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilForCausalLM"})
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    rc, line = _hf_eval(d, doc, capsys)
    assert rc == 2 and "custom code" in line
    assert not marker.exists()


def test_export_hf_loads_through_our_classes_without_remote_code(tiny_run, tmp_path, doc, capsys, monkeypatch):
    pytest.importorskip("transformers")
    import transformers.dynamic_module_utils as dmu

    def refuse(*a, **k):
        raise AssertionError("remote code loaded")

    monkeypatch.setattr(dmu, "get_class_from_dynamic_module", refuse)
    out = tmp_path / "hf"
    assert main(["export-hf", str(tiny_run), str(out)]) == 0
    capsys.readouterr()
    rc = main(["dynamic", "eval", "--hf", str(out), "--data", str(doc), "--rule", "sgd", "--lr", "1e-3",
               "--segment-len", "8", "--quiet", "--json"])
    assert rc == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["dynamic"]["perplexity"] > 0


def test_hf_unknown_hub_name_offline_fails_fast(doc, capsys, monkeypatch):
    pytest.importorskip("transformers")
    import time

    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    t0 = time.monotonic()
    rc, line = _hf_eval("no-such-org/no-such-model", doc, capsys)
    assert rc == 2 and "not in the Hugging Face cache" in line and time.monotonic() - t0 < 20


# ----------------------------------------------------------------------------- tokenizer.json


@pytest.fixture(scope="module")
def gpt2_checkpoint(tmp_path_factory):
    import torch

    from fastweights.checkpoints.format import save_model
    from fastweights.core.config import ModelConfig, RunConfig
    from fastweights.data.tokenizers import build_tokenizer
    from fastweights.models.lm import LanguageModel

    tok = build_tokenizer("gpt2", "hello world")
    cfg = RunConfig(model=ModelConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=1, n_heads=2))
    cfg.data.tokenizer = "gpt2"
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("gpt2") / "ckpt"
    save_model(LanguageModel(cfg.model), d, cfg, tok)
    return d


@pytest.mark.parametrize("vocab", ["/etc/passwd", "../../../../etc/passwd", "sub/vocab.json"])
def test_tokenizer_files_outside_the_checkpoint_are_refused(gpt2_checkpoint, tmp_path, capsys, vocab):
    d = tmp_path / "ckpt"
    shutil.copytree(gpt2_checkpoint, d)
    meta = json.loads((d / "tokenizer.json").read_text())
    meta["files"] = {"vocab": vocab, "merges": "merges.txt"}
    (d / "tokenizer.json").write_text(json.dumps(meta))
    resign_manifest(d)
    assert main(["generate", "--checkpoint", str(d), "--prompt", "hi", "--max-tokens", "1"]) == 2
    line = _err_line(capsys)
    assert "not a file beside tokenizer.json" in line and str(d) in line


def test_a_malformed_tokenizer_json_is_reported_under_the_checkpoint(gpt2_checkpoint, tmp_path, capsys):
    d = tmp_path / "ckpt"
    shutil.copytree(gpt2_checkpoint, d)
    (d / "tokenizer.json").write_text("{ not json")
    resign_manifest(d)
    assert main(["generate", "--checkpoint", str(d), "--prompt", "hi", "--max-tokens", "1"]) == 2
    line = _err_line(capsys)
    assert f"{d}/tokenizer.json is corrupt" in line and "/tmp/tmp" not in line.replace(str(d), "")
