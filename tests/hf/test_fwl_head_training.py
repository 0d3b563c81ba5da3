"""Training an FWL head on a pretrained model (``fastweights fwl-head train``, ``hf.fwl_training``), held to what
``fastweights train`` promises (issue 39): SIGINT/SIGTERM save the step and say how to continue, and the run resumes
bit-exactly (the head and its buffers, AdamW, the document order, each stream's window and carried head state, the
CPU budget spent); the hidden-state cache is keyed by every field that changes its contents, and checked when it is
reused. A tiny offline Llama with
the bundled GPT-2 tokenizer; every test here also guards a mutation that no earlier test caught (named in each)."""

import json
import re
import signal

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from fastweights import cli  # noqa: E402
from fastweights.core.errors import UserError  # noqa: E402
from fastweights.hf import fwl_training  # noqa: E402
from fastweights.hf.fwl_cache import cache_hidden_states, load_cache  # noqa: E402
from fastweights.hf.fwl_training import train_recipe  # noqa: E402
from helpers import tiny_llama_dir  # noqa: E402

WINDOW = 192  # three 64-token segments: the segment decays get a gradient


@pytest.fixture(scope="module")
def backbone_dir(tmp_path_factory):
    """A tiny Llama (vocabulary of the bundled GPT-2 tokenizer) saved as a local model directory."""
    return tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("fwl-cache") / "hidden"


def _recipe(backbone_dir, out, cache, steps, **kw):
    """8 windows of the default mix in documents of at most 3 windows (3 + 3 + 2), the last 4 held out: training
    streams read documents of 3 and 1 windows."""
    return train_recipe(str(backbone_dir), out, windows=8, window=WINDOW, doc_windows=3, cache_dir=cache,
                        max_steps=steps, budget_cpu_s=kw.pop("budget_cpu_s", 1e9), progress=False, **kw)


def _weights(d):
    return load_file(str(d / "model.safetensors"))


def _bit_equal(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- resume


def test_resume_is_bit_exact_and_restores_the_window_order(backbone_dir, cache, tmp_path):
    """1 step, then resumed to 9 (2 training documents of 3 and 1 windows: the order crosses into later
    permutations): the same weights, buffers and optimizer as 9 straight, the same windows in the same order.
    Mutations caught: the document-order generator not restored on resume (the second permutation would repeat
    the first), the rest of the current permutation not saved."""
    out = tmp_path / "straight"
    want = _recipe(backbone_dir, out, cache, 9)
    first = _recipe(backbone_dir, tmp_path / "run", cache, 1)
    assert first["steps"] == 1
    got = _recipe(backbone_dir, tmp_path / "run", cache, 9)
    assert got["steps"] == 9
    assert [h["windows"] for h in got["history"]] == [h["windows"] for h in want["history"]]
    assert sorted({w for h in want["history"] for w in h["windows"]}) == [0, 1, 2, 3]
    assert _bit_equal(_weights(out), _weights(tmp_path / "run"))
    a, b = load_file(str(out / "trainer_state.safetensors")), load_file(str(tmp_path / "run" / "trainer_state.safetensors"))
    assert _bit_equal({k: v for k, v in a.items()}, {k: v for k, v in b.items()})  # AdamW's moments, the generator


def test_resume_continues_the_cpu_budget_clock(backbone_dir, cache, tmp_path):
    """A resumed run counts the CPU seconds spent before: with a budget just above them it takes one more step.
    Mutation caught: the budget clock restarted on resume (it would train to max_steps)."""
    first = _recipe(backbone_dir, tmp_path / "run", cache, 2)
    spent = first["cpu_s"]
    again = _recipe(backbone_dir, tmp_path / "run", cache, 8, budget_cpu_s=spent + 1e-6)
    assert again["steps"] == 3 and again["cpu_s"] > spent
    assert [h["step"] for h in again["history"]] == [1, 2, 3]
    assert again["history"][2]["cpu_s"] >= again["history"][1]["cpu_s"]  # the clock of the history continues too


@pytest.mark.filterwarnings("ignore:fwl. training windows")
def test_the_head_buffers_are_saved_and_restored(backbone_dir, tmp_path):
    """z_train and z_count (inner_loss_norm = batch_tokens: the running mean of the training Z that eval mode
    normalises by) are in the checkpoint and come back on load, so the loaded head scores as the saved one.
    Mutation caught: the head's buffers left out of the checkpoint."""
    from fastweights.hf.fwl_head import PRETRAINED_FWL_DEFAULTS, HFCausalLMWithFWL, load_fwl_head, save_fwl_head
    from fastweights.hf.transformers_as_ours import load_hf_model
    from fastweights.layers.fwl import FWLOptions

    backbone, tok = load_hf_model(str(backbone_dir))
    options = FWLOptions(**{**PRETRAINED_FWL_DEFAULTS, "inner_loss_norm": "batch_tokens", "step_size_init": 0.5,
                            "segment_len": 4})
    model = HFCausalLMWithFWL(backbone, options).train()
    with torch.no_grad():
        model.head.ln_weight.fill_(1.0)  # a non-zero branch, so that Z shows in the logits
    x = torch.as_tensor(tok.encode("Happy families are all alike; every unhappy family is unhappy in its own way."))
    for n in (7, 12):
        model(x[None, :n])  # two training calls: Z's running mean over 6 and 11 labels
    assert float(model.head.z_count) == 2 and float(model.head.z_train) != 0
    save_fwl_head(model, tmp_path / "head", str(backbone_dir))
    saved = _weights(tmp_path / "head")
    assert torch.equal(saved["head.z_count"], model.head.z_count) and torch.equal(saved["head.z_train"],
                                                                                  model.head.z_train)
    loaded, _ = load_fwl_head(tmp_path / "head")
    assert torch.equal(loaded.head.z_count, model.head.z_count) and torch.equal(loaded.head.z_train, model.head.z_train)
    model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(x[None]).logits, model(x[None]).logits)


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_saves_the_step_and_resume_is_bit_exact(backbone_dir, signum, code, tmp_path, monkeypatch, capsys):
    """`fwl-head train` (batch 1, 7 windows: 3 for training, 4 held out): 4 steps straight vs a signal during step 2 (the step
    finishes, is saved, the command says how to continue and exits 128 + signal) and the same command again."""
    args = ["fwl-head", "train", "--hf", str(backbone_dir), "--windows", "7", "--window", str(WINDOW), "--cache",
            str(tmp_path / "cache"), "--quiet"]
    assert cli.main([*args, "--out", str(tmp_path / "straight"), "--max-steps", "4"]) == 0
    calls = []
    loss = fwl_training.stream_loss

    def signal_in_step_2(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            signal.raise_signal(signum)
        return loss(*a, **k)

    monkeypatch.setattr(fwl_training, "stream_loss", signal_in_step_2)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    capsys.readouterr()
    assert cli.main([*args, "--out", str(tmp_path / "stopped"), "--max-steps", "4"]) == code
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers  # restored
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"interrupted by {signal.Signals(signum).name}: {tmp_path / 'stopped'} holds the checkpoint of "
                       "step 2; continue with the same `fastweights fwl-head train` command (it resumes from there)")
    assert json.loads((tmp_path / "stopped" / "checkpoint.json").read_text())["step"] == 2
    monkeypatch.setattr(fwl_training, "stream_loss", loss)
    assert cli.main([*args, "--out", str(tmp_path / "stopped"), "--max-steps", "4"]) == 0
    assert _bit_equal(_weights(tmp_path / "straight"), _weights(tmp_path / "stopped"))


@pytest.mark.filterwarnings("ignore:fwl. training windows")
def test_the_carried_state_is_detached(backbone_dir):
    """With trainable backbone blocks the hidden states carry a gradient; the head's carried state must not
    (the next call's backward would run into a graph already freed). Mutation caught: the state's h not detached."""
    from fastweights.hf.fwl_head import HFCausalLMWithFWL
    from fastweights.hf.transformers_as_ours import load_hf_model

    backbone, tok = load_hf_model(str(backbone_dir))
    model = HFCausalLMWithFWL(backbone, trainable_blocks=1).train()
    x = torch.as_tensor(tok.encode("Happy families are all alike; every unhappy family is unhappy in its own way. "
                                   "Everything was in confusion in the house."))
    assert x.numel() >= 17
    a, b = x[None, :8], x[None, 8:16]
    out = model(a, targets=x[None, 1:9])
    h = out.state["fwl"]["h"]
    assert not h.requires_grad and h.grad_fn is None
    # the head's state carried into a second call whose backward runs after the first one's
    hidden, _ = backbone.forward_features(a)
    assert hidden.requires_grad
    logits, state = model.head(hidden, a)
    torch.nn.functional.cross_entropy(logits[0, :-1], a[0, 1:]).backward()
    hidden2, _ = backbone.forward_features(b)
    logits2, _ = model.head(hidden2, b, state)
    torch.nn.functional.cross_entropy(logits2[0, :-1], b[0, 1:]).backward()  # not "backward through the graph a
    # second time"


# ----------------------------------------------------------------------------- the hidden-state cache


def _tokens(n=3, window=16, seed=0):
    return np.random.default_rng(seed).integers(0, 1000, size=(n, window)).astype(np.int64)


@pytest.fixture(scope="module")
def backbone(backbone_dir):
    from fastweights.hf.transformers_as_ours import load_hf_model

    return load_hf_model(str(backbone_dir))[0]


def test_the_backbone_digest_covers_every_weight(backbone):
    """The cache's backbone key changes with any weight, not only the output layer the head's fingerprint reads."""
    from fastweights.hf.fwl_cache import backbone_digest

    before = backbone_digest(backbone)
    w = backbone.layers[0].mlp.up_proj.weight
    old = w[0, 0].item()
    with torch.no_grad():
        w[0, 0] = old + 1.0
        try:
            assert backbone_digest(backbone) != before
        finally:
            w[0, 0] = old
    assert backbone_digest(backbone) == before


def test_the_head_checkpoints_backbone_fingerprint_is_exact(backbone):
    """The identity a head checkpoint keeps of its backbone is a digest of the output layer's bytes, not float
    statistics printed to nine digits (those come out of a reduction whose last bits differ between CPUs, and
    stay the same for another model whose output rows swap two entries)."""
    from fastweights.hf.fwl_head import backbone_fingerprint

    w = backbone.hf.get_output_embeddings().weight
    before = backbone_fingerprint(backbone)
    a, b = w[1, 3].item(), w[2, 3].item()
    with torch.no_grad():
        w[1, 3], w[2, 3] = b, a  # sum, sum of squares and first column unchanged: another model all the same
        try:
            assert backbone_fingerprint(backbone) != before
        finally:
            w[1, 3], w[2, 3] = a, b
    assert backbone_fingerprint(backbone) == before


@pytest.mark.parametrize("damage, needle", [
    ("object", "hidden.npy is not the cache"),
    ("float64", "holds float64"),
    ("nan", "window 1 of hidden.npy holds NaN or infinite values"),
    ("truncated", "hidden.npy is not the cache"),
    ("tokens", "tokens.npy is not the tokens"),
    ("meta", "cache.json is unreadable"),
])
def test_a_damaged_cache_is_refused_in_one_line(backbone, tmp_path, damage, needle):
    d = tmp_path / "cache"
    cache_hidden_states(backbone, _tokens(), d, fingerprint="bb", progress=False)
    if damage == "object":
        np.save(d / "hidden.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    elif damage == "float64":
        np.save(d / "hidden.npy", np.zeros((3, 16, 16)))
    elif damage == "nan":
        h = np.load(d / "hidden.npy", mmap_mode="r+")
        h[1, 3, 2] = np.nan
        h.flush()
        del h
    elif damage == "truncated":
        data = (d / "hidden.npy").read_bytes()
        (d / "hidden.npy").write_bytes(data[: len(data) // 2])
    elif damage == "tokens":
        np.save(d / "tokens.npy", _tokens(seed=5))
    else:
        (d / "cache.json").write_text('{"done": "all"}')
    with pytest.raises(UserError) as e:
        load_cache(d)
    assert needle in str(e.value) and "\n" not in str(e.value) and f"delete {d}" in str(e.value)


def test_a_cache_cut_short_is_refused_for_training_in_one_line_saying_how_far_it_got(backbone, tmp_path):
    """Mutation caught (issue 49, seed 7): the refusal's message dropped."""
    d = tmp_path / "cache"
    cache_hidden_states(backbone, _tokens(), d, fingerprint="bb", progress=False)
    meta = json.loads((d / "cache.json").read_text())
    (d / "cache.json").write_text(json.dumps({**meta, "done": 1, "static_nats": meta["static_nats"][:1]}))
    with pytest.raises(UserError, match=rf"^hidden-state cache {re.escape(str(d))} is incomplete "
                                        rf"\(1 of {meta['windows']} windows\)$"):
        load_cache(d)


def test_a_partial_cache_is_resumed_only_if_its_windows_on_disk_are_finite(backbone, tmp_path):
    """A cache cut short after 2 of 3 windows (its metadata saying 2 done) is resumed where it stopped, the
    windows on disk reused without recomputing them; when one of those holds NaN (a file damaged while the run
    was stopped), the resume is refused in one line naming the window, rather than adding the last window to a
    cache whose training would read NaN. Mutation caught: the resume opening hidden.npy without checking the
    windows already done (issue 49)."""
    d = tmp_path / "cache"
    cache_hidden_states(backbone, _tokens(), d, fingerprint="bb", progress=False)
    meta = json.loads((d / "cache.json").read_text())
    meta["done"], meta["static_nats"] = 2, meta["static_nats"][:2]  # as if stopped after the second window
    (d / "cache.json").write_text(json.dumps(meta))
    assert cache_hidden_states(backbone, _tokens(), d, fingerprint="bb", progress=False)["computed_this_call"] == 1
    (d / "cache.json").write_text(json.dumps(meta))
    h = np.load(d / "hidden.npy", mmap_mode="r+")
    h[1, 3, 2] = np.nan
    h.flush()
    del h
    with pytest.raises(UserError) as e:
        cache_hidden_states(backbone, _tokens(), d, fingerprint="bb", progress=False)
    assert "window 1 of hidden.npy holds NaN or infinite values" in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------- export


def test_the_export_keeps_the_trainable_blocks(backbone_dir, tmp_path):
    """`fwl-head export` records how many backbone blocks were trained, and loading the directory restores it.
    Mutation caught: the export writing trainable_blocks=0."""
    from transformers import AutoModelForCausalLM

    from fastweights.hf.fwl_as_transformers import export_fwl_head
    from fastweights.hf.fwl_head import HFCausalLMWithFWL
    from fastweights.hf.transformers_as_ours import load_hf_model

    backbone, tok = load_hf_model(str(backbone_dir))
    model = HFCausalLMWithFWL(backbone, trainable_blocks=1)
    export_fwl_head(model, tok, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["trainable_blocks"] == 1
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.config.trainable_blocks == 1 and loaded.model.trainable_blocks == 1
