"""Loading a model by what its source is (``fastweights.auto.sources``): which kind each source is taken for,
by the flag that names it, and what loading one gives or refuses."""

import pytest

from fastweights.auto.sources import (CHECKPOINT_FLAG, HF_FLAG, SOURCE_KINDS, LoadedModel, load_model_and_tokenizer,
                                      source_kind)
from fastweights.core.errors import UserError
from fastweights.hf.fwl_head import CONFIG_NAME


def test_the_kinds_are_asked_in_their_order():
    assert [k.name for k in SOURCE_KINDS] == ["fwl-head", "checkpoint", "gguf", "transformers"]


def test_each_source_is_taken_for_its_kind(char_checkpoint, tmp_path):
    head = tmp_path / "head"
    head.mkdir()
    (head / CONFIG_NAME).write_text("{}")
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    assert source_kind(str(char_checkpoint), CHECKPOINT_FLAG).name == "checkpoint"
    assert source_kind(str(tmp_path / "missing"), CHECKPOINT_FLAG).name == "checkpoint"  # load_checkpoint says why
    assert source_kind(str(head), CHECKPOINT_FLAG).name == "fwl-head"
    assert source_kind(str(head), HF_FLAG).name == "fwl-head"
    assert source_kind(str(tmp_path / "m.gguf"), HF_FLAG).name == "gguf"
    assert source_kind("SmolLM2-135M", HF_FLAG).name == "gguf"
    assert source_kind(str(hf_dir), HF_FLAG).name == "transformers"
    assert source_kind("gpt2", HF_FLAG).name == "transformers"
    with pytest.raises(UserError, match="--model names no kind of model source"):
        source_kind("gpt2", "--model")


def test_our_checkpoint_loads_with_its_run_config(char_checkpoint):
    loaded = load_model_and_tokenizer(char_checkpoint, device="cpu")
    assert isinstance(loaded, LoadedModel) and loaded.checkpoint == char_checkpoint
    assert loaded.run_config.model.vocab_size == loaded.tokenizer.vocab_size and not loaded.model.training


def test_a_bad_source_is_one_line():
    with pytest.raises(UserError, match=r"^--sinks applies to Hugging Face models \(--hf\)"):
        load_model_and_tokenizer("runs/anything", device="cpu", sinks=4)
    with pytest.raises(UserError, match="^no model to load: give a checkpoint directory"):
        load_model_and_tokenizer(device="cpu")


def test_a_missing_gguf_file_is_refused_by_the_transformers_loader(tmp_path):
    pytest.importorskip("transformers")
    with pytest.raises(UserError, match="GGUF file .* not found"):
        load_model_and_tokenizer(hf=str(tmp_path / "missing.gguf"), device="cpu")
