"""File modes (issue 40, scope 4): every file and folder a command leaves -- a `train` run, an `export-hf`
directory, an FWL head's checkpoint and its `fwl-head export`, gradient statistics -- has the mode the user's
umask gives (0644 / 0755 under umask 022, 0600 / 0700 under 077), as files `open()` and `mkdir` create, the
run's lock and temporary names excepted. safetensors' `save_file` alone writes 0600, and `mkdtemp` 0700."""

import os
import re
import stat
from pathlib import Path

import pytest
import torch

from fastweights import cli
from fastweights.adapt.grad_stats import GradStats
from fastweights.core.files import current_umask, save_safetensors, umask_mode, write_into
from helpers import tiny_training_run

EXCEPTED = re.compile(r"^(\.lock|\..+\.\d+\.tmp|\.ckpt-tmp-.*|\.ckpt-next|\.staging-.*)$")


@pytest.fixture(params=[0o022, 0o077], ids=["umask022", "umask077"])
def umask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def modes(root: Path) -> dict[str, str]:
    """Relative path -> octal mode of ``root`` and everything below it (links not followed), lock and
    temporaries left out."""
    out = {".": oct(stat.S_IMODE(os.lstat(root).st_mode))}
    for p in sorted(root.rglob("*")):
        if any(EXCEPTED.match(part) for part in p.relative_to(root).parts):
            continue
        out[str(p.relative_to(root))] = oct(stat.S_IMODE(os.lstat(p).st_mode))
    return out


def expected(root: Path, mask: int) -> dict[str, str]:
    return {rel: oct((0o777 if (root / rel).is_dir() else 0o666) & ~mask) for rel in modes(root)}


def test_the_umask_is_read_without_changing_it(umask, monkeypatch):
    assert current_umask() == umask and umask_mode() == 0o666 & ~umask and umask_mode(True) == 0o777 & ~umask
    assert os.umask(umask) == umask  # still the one set
    if Path("/proc/self/status").is_file():  # Linux: read there, never set (another thread's file meanwhile)
        monkeypatch.setattr(os, "umask", lambda mask: pytest.fail(f"os.umask({mask:o}) called"))
        assert current_umask() == umask


def test_a_run_and_its_export_have_the_umask_modes(umask, tmp_path):
    run = tiny_training_run(tmp_path / "run", steps=3)
    assert (run / "model.safetensors").is_file() and (run / "trainer_state.safetensors").is_file()
    GradStats(ms={"w": torch.ones(3)}, batches=1, batch_size=1, seq_len=4).save(run / "grad_stats.safetensors")
    assert modes(run) == expected(run, umask)
    export = tmp_path / "exports" / "hf"  # the parent folders export-hf creates are checked too
    assert cli.main(["export-hf", str(run), str(export)]) == 0
    assert (export / "model.safetensors").is_file()
    assert modes(tmp_path / "exports") == expected(tmp_path / "exports", umask)


def test_an_fwl_head_checkpoint_and_its_export_have_the_umask_modes(umask, tmp_path):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from fastweights.hf.fwl_as_transformers import export_fwl_head
    from fastweights.hf.fwl_head import HFCausalLMWithFWL, save_fwl_head
    from fastweights.hf.transformers_as_ours import HFCausalLM

    torch.manual_seed(0)
    backbone = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                            tie_word_embeddings=True)).eval()
    model = HFCausalLMWithFWL(HFCausalLM(backbone))
    save_fwl_head(model, tmp_path / "fwl", "tiny-llama", step=1, trainer_state={"step": 1, "m": torch.zeros(2)})
    assert (tmp_path / "fwl" / "model.safetensors").is_file()
    assert modes(tmp_path / "fwl") == expected(tmp_path / "fwl", umask)
    export_fwl_head(model, None, tmp_path / "fwl-hf")
    assert (tmp_path / "fwl-hf" / "model.safetensors").is_file()
    assert modes(tmp_path / "fwl-hf") == expected(tmp_path / "fwl-hf", umask)


def test_the_helpers_widen_narrow_writers_to_the_umask_never_beyond(umask, tmp_path):
    save_safetensors({"x": torch.zeros(1)}, tmp_path / "a.safetensors")
    assert stat.S_IMODE(os.stat(tmp_path / "a.safetensors").st_mode) == 0o666 & ~umask

    def narrow(staging: Path) -> None:  # a writer that creates owner-only files and folders, like save_file
        (staging / "sub").mkdir(mode=0o700)
        for p in (staging / "w.bin", staging / "sub" / "v.bin"):
            p.write_bytes(b"x")
            p.chmod(0o600)

    write_into(tmp_path / "out", narrow)
    assert modes(tmp_path / "out") == expected(tmp_path / "out", umask)


def test_a_json_cache_entry_is_merged_into_what_the_file_holds(tmp_path):
    """core.files.merge_into_json_cache, the one writer of the per-machine caches (ops.linear, ops.fla_selfcheck):
    other entries are kept, a corrupt file or a non-object entry on the way starts empty there."""
    import json

    from fastweights.core.files import merge_into_json_cache

    path = tmp_path / "cache.json"
    merge_into_json_cache(path, ("machine-a", "k1"), [1])
    merge_into_json_cache(path, ("machine-a", "k2"), [2])
    merge_into_json_cache(path, ("machine-b", "k1"), [3])
    assert json.loads(path.read_text()) == {"machine-a": {"k1": [1], "k2": [2]}, "machine-b": {"k1": [3]}}
    other = tmp_path / "other.json"  # the same entries merged in another order: the same file, byte for byte
    for keys, value in ((("machine-b", "k1"), [3]), (("machine-a", "k2"), [2]), (("machine-a", "k1"), [1])):
        merge_into_json_cache(other, keys, value)
    assert other.read_bytes() == path.read_bytes()
    path.write_text('{"machine-a": 7, "other": 1}')
    merge_into_json_cache(path, ("machine-a", "k1"), [4])
    assert json.loads(path.read_text()) == {"machine-a": {"k1": [4]}, "other": 1}
    path.write_text("not json")
    merge_into_json_cache(path, ("v",), {"passed": True})
    assert json.loads(path.read_text()) == {"v": {"passed": True}}


def test_the_staging_folder_lies_inside_the_named_folder(tmp_path, monkeypatch):
    """``write_into`` stages inside the folder it writes into, so that moving each file in is a rename on one file
    system and nothing is left outside the folder the user named. Mutation caught: ``mkdtemp(dir=None)``."""
    seen = []

    def writer(staging):
        seen.append(Path(staging).resolve())
        (Path(staging) / "a.txt").write_text("x")

    write_into(tmp_path / "out", writer)
    assert seen[0].parent == (tmp_path / "out").resolve() and (tmp_path / "out" / "a.txt").read_text() == "x"
