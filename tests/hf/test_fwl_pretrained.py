"""A Fast Weight Layer on a pretrained Hugging Face model (issue 31): on a tiny, randomly initialised Llama
built offline, the wrapper starts as the backbone exactly, never lets a later token move an earlier score
(scoring and training), equals itself in pieces with the state carried, trains from cached hidden states
exactly as through the backbone, round-trips its checkpoint, and trains on no text the comparison scores."""


import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from fastweights.core.errors import UserError
from fastweights.hf.fwl_head import (
    PRETRAINED_FWL_DEFAULTS,
    HFCausalLMWithFWL,
    load_fwl_head,
    save_fwl_head,
)
from fastweights.hf.fwl_cache import cache_hidden_states, load_cache
from fastweights.hf.fwl_training import HELD_OUT_NAMES, TRAINING_MIX, train_head
from fastweights.hf.transformers_as_ours import HFCausalLM
from fastweights.layers.fwl import FWLOptions

V = 40


def llama(dtype=torch.float64, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=True)
    return HFCausalLM(LlamaForCausalLM(cfg).to(dtype).eval())


def wrapped(dtype=torch.float64, acting=True, **options):
    """The wrapper on a tiny Llama; ``acting``: a gain and step sizes as after training, so every fast part acts."""
    opts = FWLOptions(**{**PRETRAINED_FWL_DEFAULTS, "segment_len": 6, "chunk_size": 8, **options})
    model = HFCausalLMWithFWL(llama(dtype), opts).to(dtype)
    if acting:
        with torch.no_grad():
            g = torch.Generator().manual_seed(1)
            model.head.ln_weight.copy_(0.5 + 0.1 * torch.randn(model.head.ln_weight.shape, generator=g))
            for a in model.head.step_sizes.values():
                a.fill_(0.2)
    return model.eval()


def ids(n, batch=2, seed=3):
    return torch.randint(0, V, (batch, n), generator=torch.Generator().manual_seed(seed))


#: the exact identity at initialisation: zero LayerNorm gain and zero (linear) step sizes; the recipe's own
#: initialisation (a gain of 0.05, log step sizes) starts near it instead (hf/fwl_head.PRETRAINED_FWL_DEFAULTS)
IDENTITY_INIT = {"ln_gain_init": 0.0, "step_size_log": False, "step_size_init": 0.0}


def test_before_training_the_logits_are_the_backbones():
    model = wrapped(acting=False, **IDENTITY_INIT)
    x = ids(30)
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, model.backbone(x).logits, rtol=0, atol=0)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        n for n, _ in model.named_parameters() if n.startswith("head.")]  # the backbone is frozen by default


def position_losses(model, x, train: bool):
    """Per-position NLL of x[:, 1:] (scoring: the model's forward; training: the head on the features, train mode)."""
    if not train:
        with torch.no_grad():
            logits = model(x).logits
    else:
        with torch.no_grad():
            h, _ = model.backbone.forward_features(x)
        model.train()
        logits, _ = model.head(h, x)
        model.eval()
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten(), reduction="none").view(x.shape[0], -1)


@pytest.mark.parametrize("train", [False, True], ids=["scoring", "training"])
def test_a_later_token_never_moves_an_earlier_score(train):
    model = wrapped()
    x = ids(25)
    base = position_losses(model, x, train)
    for t in (4, 13, 24):
        y = x.clone()
        y[:, t:] = (y[:, t:] + 7) % V
        moved = position_losses(model, y, train)
        # predictions of x_1..x_{t-1} (positions 0..t-2) cannot see x_t or later
        torch.testing.assert_close(moved[:, : t - 1], base[:, : t - 1], rtol=0, atol=1e-12)
        assert (moved[:, t - 1:] - base[:, t - 1:]).abs().max() > 1e-6  # the perturbation is visible after


def test_one_call_equals_pieces_with_the_state_carried():
    model = wrapped()
    x = ids(29)
    with torch.no_grad():
        whole = model(x).logits
        state, parts = None, []
        for a, b in ((0, 5), (5, 6), (6, 19), (19, 29)):
            out = model(x[:, a:b], state)
            parts.append(out.logits)
            state = out.state
    torch.testing.assert_close(torch.cat(parts, 1), whole, rtol=0, atol=1e-10)


def test_training_from_cached_hidden_states_equals_training_through_the_backbone(tmp_path):
    torch.manual_seed(0)
    a = wrapped(torch.float32)
    b = wrapped(torch.float32)
    b.load_state_dict(a.state_dict())
    windows = ids(24, batch=3, seed=5).numpy()
    cache_hidden_states(a.backbone, windows, tmp_path / "cache", dtype="float32", progress=False)
    hidden, tokens, _ = load_cache(tmp_path / "cache")
    with torch.no_grad():
        h, _ = a.backbone.forward_features(torch.from_numpy(windows))
    np.testing.assert_array_equal(hidden, h.numpy())
    np.testing.assert_array_equal(tokens, windows)
    # three steps from the cache (every window in every batch: the order is fixed) ...
    train_head(a, tmp_path / "cache", tmp_path / "run", "tiny", budget_cpu_s=1e9, batch_size=3, val_windows=0,
               max_steps=3, progress=False, lr=1e-3, step_lr=1e-3)  # one learning rate, as the reference below
    # ... and the same steps with the features computed through the backbone inside the model's forward
    opt = torch.optim.AdamW([p for p in b.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0)
    x = torch.from_numpy(windows)
    b.train()
    for _ in range(3):
        loss = F.cross_entropy(b(x).logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in b.parameters() if p.requires_grad], 1.0)
        opt.step()
    for (name, pa), pb in zip(a.head.named_parameters(), b.head.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6, msg=name)
    assert (a.head.ln_weight - wrapped(torch.float32).head.ln_weight).abs().max() > 0  # training moved the head


def test_checkpoint_round_trip_and_resume(tmp_path):
    model = wrapped()
    save_fwl_head(model, tmp_path / "ckpt", "tiny-llama", step=3, trainer_state={"step": 3, "note": "x"})
    loaded, _, ts = load_fwl_head(tmp_path / "ckpt", backbone_loader=lambda name: (llama(), None),
                                  with_trainer_state=True)
    assert ts["step"] == 3 and not loaded.training
    x = ids(17)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=0)
    with pytest.raises(UserError, match="another backbone"):
        load_fwl_head(tmp_path / "ckpt", backbone_loader=lambda name: (llama(seed=1), None))
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"broken")
    with pytest.raises(UserError, match="does not match"):
        load_fwl_head(tmp_path / "ckpt", backbone_loader=lambda name: (llama(), None))


def test_trainable_blocks_and_refusals():
    model = wrapped(acting=False)
    model.set_trainable_blocks(1)
    trainable = {n.split(".")[4] for n, p in model.named_parameters() if p.requires_grad and n.startswith("backbone")}
    assert trainable == {"1"}  # the last of the two decoder blocks
    with pytest.raises(UserError):
        model.set_trainable_blocks(3)
    with pytest.raises(UserError, match="residual"):
        HFCausalLMWithFWL(llama(), FWLOptions())


def test_every_block_or_none_may_be_trainable():
    """K runs over 0..L inclusive: K = L (every decoder block trains with the head) and K = 0 (the head alone)
    are both accepted, and only L + 1 or a negative K refused. Mutation caught: the bound made ``k < len(layers)``
    (K = all blocks refused, issue 49)."""
    model = wrapped(acting=False)
    n_blocks = len(model.layers)
    model.set_trainable_blocks(n_blocks)
    trainable = {n.split(".")[4] for n, p in model.named_parameters() if p.requires_grad and n.startswith("backbone.")
                 and ".layers." in n}
    assert trainable == {str(i) for i in range(n_blocks)} and model.trainable_blocks == n_blocks
    model.set_trainable_blocks(0)
    assert not any(p.requires_grad for n, p in model.named_parameters() if n.startswith("backbone"))
    with pytest.raises(UserError):
        model.set_trainable_blocks(-1)


def test_the_training_mix_holds_none_of_the_compared_texts():
    """No document of the training mix is one the comparison scores, tunes on or takes statistics from, in
    any edition: by name, and by content (a passage of each compared excerpt is nowhere in the mix)."""
    from fastweights.data import load_corpus
    from fastweights.data.excerpts import BUNDLED_EXCERPTS

    compared = [(r.document, r.marker) for r in BUNDLED_EXCERPTS]
    assert {spec.split(":")[1].split("_")[0] for spec, _ in compared} <= {n.split("_")[0] for n in HELD_OUT_NAMES}
    mix_corpora = set(TRAINING_MIX)
    mix_text = []
    for corpus in mix_corpora:
        for doc in load_corpus(corpus):
            if not any(n in doc.name.lower() for n in HELD_OUT_NAMES):
                mix_text.append(doc.text)
    mix_text = "\n".join(mix_text)
    for spec, marker in compared:
        (doc,) = load_corpus(spec)
        start = doc.text.find(marker)
        passage = doc.text[start + 500 : start + 700]
        assert passage and passage not in mix_text, spec


def test_export_round_trip_and_generate(tmp_path):
    from transformers import AutoModelForCausalLM

    from fastweights.hf.fwl_as_transformers import FWLHeadForCausalLM, export_fwl_head

    model = wrapped()
    export_fwl_head(model, None, tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert isinstance(loaded, FWLHeadForCausalLM)
    x = ids(21)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=1e-12)
        # generate() carries the FWL state: greedy equals a loop that feeds one token at a time with the state
        out = loaded.generate(x[:, :9], max_new_tokens=8, do_sample=False, attention_mask=torch.ones(2, 9, dtype=torch.long))
        step = model(x[:, :9])
        state, tokens = step.state, [step.logits[:, -1].argmax(-1)]
        for _ in range(7):
            step = model(tokens[-1][:, None], state)
            state = step.state
            tokens.append(step.logits[:, -1].argmax(-1))
    torch.testing.assert_close(out[:, 9:], torch.stack(tokens, 1), rtol=0, atol=0)
    with pytest.raises(ValueError, match="padding"):
        loaded(x, attention_mask=torch.cat([torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 20, dtype=torch.long)], 1))
