"""``fwl-head train --trainable-blocks K`` (issue 41): the cache holds the input of block N - K, each step runs the
top K blocks and the final norm (``hf.fwl_head.top_blocks``, the model's own rotary embedding and causal mask) and
trains them with the head; the acceptance run ``fwl-head train --data FILE --trainable-blocks 2 --minutes 1`` on a
tiny offline 4-block Llama: resume bit-exact, the cache reused, the export loaded by ``AutoModelForCausalLM`` scoring
as the library's model. Each test names the one-line bug it catches."""

import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from fastweights import cli  # noqa: E402
from fastweights.core.errors import UserError  # noqa: E402
from fastweights.hf.fwl_cache import cache_hidden_states, load_cache  # noqa: E402
from fastweights.hf.fwl_head import HFCausalLMWithFWL, blocks_input, top_blocks  # noqa: E402
from fastweights.hf.transformers_as_ours import load_hf_model  # noqa: E402
from helpers import tiny_gpt2, tiny_llama_dir  # noqa: E402

WINDOW = 96


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama-4"), n_layers=4)


def tokens(n=2, t=40, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 1000, size=(n, t)).astype(np.int64))


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_the_top_blocks_of_the_cached_input_give_the_full_models_hidden_states(llama_dir, tmp_path, attention):
    """For every K, the top K blocks + final norm applied to the input of block N - K equal the backbone's own
    final hidden states (fp32); and so they do from a float32 cache of that input. With eager attention the mask
    is the one built here (sdpa without a mask is causal by itself). Mutations caught: no causal mask, positions
    not from 0, the rotary embedding left out, the final norm left out, the cache storing another block's input."""
    backbone, _ = load_hf_model(str(llama_dir))
    backbone.hf.config._attn_implementation = attention
    x = tokens()
    with torch.no_grad():
        want = backbone.forward_features(x)[0]
        for k in range(5):
            torch.testing.assert_close(top_blocks(backbone, blocks_input(backbone, x, k), k), want, msg=f"K={k}")
        cache_hidden_states(backbone, x.numpy(), tmp_path / "c", progress=False, dtype="float32", trainable_blocks=2)
        hidden, _, _ = load_cache(tmp_path / "c")
        torch.testing.assert_close(top_blocks(backbone, torch.from_numpy(np.array(hidden)), 2), want)


def test_a_cache_of_another_k_is_rebuilt_never_reused(llama_dir, tmp_path):
    """The cache key holds K (issue 50): a cache of block N's input (K = 0) asked for K = 2 is computed again and
    then holds block 2's input, and asked for K = 2 again it is reused. Mutation caught: K left out of the key (a
    K = 2 run would train its top blocks on the final hidden states)."""
    backbone, _ = load_hf_model(str(llama_dir))
    x = tokens(2, WINDOW)
    with torch.no_grad():
        first = cache_hidden_states(backbone, x.numpy(), tmp_path / "c", progress=False, dtype="float32")
        assert first["computed_this_call"] == 2 and first["trainable_blocks"] == 0
        again = cache_hidden_states(backbone, x.numpy(), tmp_path / "c", progress=False, dtype="float32",
                                    trainable_blocks=2)
        assert again["computed_this_call"] == 2 and again["trainable_blocks"] == 2
        hidden, _, _ = load_cache(tmp_path / "c")
        torch.testing.assert_close(torch.from_numpy(np.array(hidden)), blocks_input(backbone, x, 2))
        same = cache_hidden_states(backbone, x.numpy(), tmp_path / "c", progress=False, dtype="float32",
                                   trainable_blocks=2)
        assert same["computed_this_call"] == 0


def test_other_architectures_are_refused_in_one_line():
    from fastweights.hf.transformers_as_ours import HFCausalLM

    gpt2 = HFCausalLM(tiny_gpt2(50, 32, dtype=torch.float32))
    with pytest.raises(UserError) as e:
        blocks_input(gpt2, tokens(1, 8) % 50, 1)
    assert "Llama-family" in str(e.value) and "'gpt2'" in str(e.value) and "\n" not in str(e.value)
    assert blocks_input(gpt2, tokens(1, 8) % 50, 0).shape[:2] == (1, 8)  # K = 0: any architecture


def test_a_step_trains_the_top_blocks_and_the_head_only(llama_dir, tmp_path):
    """K = 2 of 4: one step moves blocks 2 and 3 and the head; blocks 0 and 1, the embedding and the final norm
    stay as they were. Mutation caught: the top blocks run without a gradient (trained blocks never move)."""
    from fastweights.hf.fwl_training import train_head

    backbone, _ = load_hf_model(str(llama_dir))
    model = HFCausalLMWithFWL(backbone, trainable_blocks=2)
    cache_hidden_states(backbone, tokens(3, WINDOW).numpy(), tmp_path / "c", progress=False, trainable_blocks=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_head(model, tmp_path / "c", tmp_path / "run", "tiny", budget_cpu_s=1e9, val_windows=0, max_steps=1,
               progress=False)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    blocks = {n.split(".")[4] for n in moved if ".layers." in n}
    assert blocks == {"2", "3"}
    assert {n for n in moved if n.startswith("backbone.") and ".layers." not in n} == set()
    assert any(n.startswith("head.") for n in moved)
    # a model of another K is refused on this cache
    with pytest.raises(UserError, match="top 2 blocks, the model trains 1"):
        train_head(HFCausalLMWithFWL(backbone, trainable_blocks=1), tmp_path / "c", tmp_path / "other", "tiny",
                   budget_cpu_s=1e9, val_windows=0, max_steps=1, progress=False)


def test_the_acceptance_run_resumes_reuses_its_cache_and_exports(llama_dir, tmp_path, capsys):
    """`fwl-head train --hf DIR --data FILE --trainable-blocks 2 --minutes 1`: 4 steps straight, and 2 steps then the
    same command to 4 (bit-exact: the trained blocks, the head, AdamW, the carried state), the second and third
    runs reusing the first one's cache (nothing computed, hidden.npy untouched); `fwl-head export` of the checkpoint
    loads with AutoModelForCausalLM (trust_remote_code) and scores as the library's model, with the trained blocks.
    Mutations caught: the trained blocks left out of the checkpoint or the export; resume not restoring them."""
    from transformers import AutoModelForCausalLM

    from fastweights.data import load_corpus
    from fastweights.hf.fwl_head import load_fwl_head

    data = tmp_path / "speech.txt"
    data.write_text(load_corpus("state-of-the-union:1946-Truman.txt")[0].text[:12000])
    cache = tmp_path / "cache"
    args = ["fwl-head", "train", "--hf", str(llama_dir), "--data", str(data), "--trainable-blocks", "2", "--minutes",
            "1", "--window", str(WINDOW), "--windows", "7", "--cache", str(cache), "--quiet"]
    assert cli.main([*args, "--out", str(tmp_path / "straight"), "--max-steps", "4"]) == 0
    summary = json.loads((tmp_path / "straight" / "training.json").read_text())
    assert summary["cache_windows_computed"] == 7 and summary["trainable_blocks"] == 2 and summary["steps"] == 4
    assert summary["data"] == str(data) and summary["train_windows"] == 3
    stamp = (cache / "hidden.npy").stat().st_mtime_ns
    for steps in (2, 4):
        assert cli.main([*args, "--out", str(tmp_path / "run"), "--max-steps", str(steps)]) == 0
        summary = json.loads((tmp_path / "run" / "training.json").read_text())
        assert summary["steps"] == steps and summary["cache_windows_computed"] == 0
    assert (cache / "hidden.npy").stat().st_mtime_ns == stamp
    for name in ("model.safetensors", "trainer_state.safetensors"):
        a, b = load_file(str(tmp_path / "straight" / name)), load_file(str(tmp_path / "run" / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    weights = load_file(str(tmp_path / "run" / "model.safetensors"))
    assert {k.split(".")[4] for k in weights if ".layers." in k} == {"2", "3"}
    capsys.readouterr()
    assert cli.main(["fwl-head", "export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    model, _ = load_fwl_head(tmp_path / "run")
    original, _ = load_hf_model(str(llama_dir))
    w = "backbone.hf.model.layers.3.mlp.up_proj.weight"
    assert torch.equal(exported.model.state_dict()[w], weights[w])
    assert not torch.equal(original.hf.state_dict()[w.removeprefix("backbone.hf.")], weights[w])  # it was trained
    x = tokens(1, 50)
    with torch.no_grad():
        torch.testing.assert_close(exported(x).logits, model(x).logits, rtol=0, atol=0)
