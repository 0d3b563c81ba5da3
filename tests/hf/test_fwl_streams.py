"""Training the FWL head on streams of consecutive windows (``hf.fwl_training``, issue 41): the head's running
update carried across a document's windows (equal to one call over the document), saved with the checkpoint and
restored bit-exactly on resume; step sizes and decays at their own learning rate; the history in nats beside the
static model's loss on the same windows; and a hidden-state cache rebuilt when any field of its key changes. Each
test names the one-line bug it catches (shown failing on that mutant when written)."""

import dataclasses
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from fastweights.hf.fwl_cache import KEY_FIELDS, cache_hidden_states, load_cache  # noqa: E402
from fastweights.hf.fwl_head import PRETRAINED_FWL_DEFAULTS, HFCausalLMWithFWL, blocks_input  # noqa: E402
from fastweights.core.errors import UserError  # noqa: E402
from fastweights.hf.fwl_training import (  # noqa: E402
    documents,
    param_groups,
    stream_loss,
    train_head,
    validation_losses,
)
from fastweights.layers.fwl import FWLOptions  # noqa: E402
from helpers import tiny_llama_dir  # noqa: E402

W = 24  # tokens per window: 3 segments of 8


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama-4"), n_layers=4)


def acting_model(llama_dir, trainable_blocks=0):
    """The tiny 4-block Llama with an FWL head (seed 0) whose fast update acts (non-zero step sizes and gain)."""
    from fastweights.hf.transformers_as_ours import load_hf_model

    backbone, _ = load_hf_model(str(llama_dir))
    torch.manual_seed(0)
    options = FWLOptions(**{**PRETRAINED_FWL_DEFAULTS, "segment_len": 8, "step_size_init": 0.05})
    model = HFCausalLMWithFWL(backbone, options, trainable_blocks=trainable_blocks)
    with torch.no_grad():
        model.head.ln_weight.fill_(0.5)
    return model


def windows(n=7, seed=0):
    return np.random.default_rng(seed).integers(0, 1000, size=(n, W)).astype(np.int64)


def build_cache(model, d, tokens, doc_windows, **kw):
    return cache_hidden_states(model.backbone, tokens, d, fingerprint="bb", progress=False, dtype="float32",
                               doc_windows=doc_windows, trainable_blocks=model.trainable_blocks, **kw)


# ----------------------------------------------------------------------------- the carried state


def test_a_stream_carries_the_head_state_through_its_document(llama_dir, tmp_path):
    """lr = step_lr = 0 (the head fixed): each step's loss is the mean loss of that window's positions in ONE
    call of the head over the whole document's cached hidden states, and the first step of a document starts
    fresh. Mutations caught: the state not carried to the stream's next window; a stream keeping the previous
    document's state when it starts another."""
    model = acting_model(llama_dir)
    tokens = windows(7)
    build_cache(model, tmp_path / "c", tokens, [3, 4])  # two documents; val_windows=0
    summary = train_head(model, tmp_path / "c", tmp_path / "run", "tiny", budget_cpu_s=1e9, lr=0.0, step_lr=0.0,
                         val_windows=0, max_steps=7, progress=False)
    hidden, _, meta = load_cache(tmp_path / "c")
    model.train()
    want = {}
    with torch.no_grad():
        for first, end in ((0, 3), (3, 7)):
            h = torch.from_numpy(np.asarray(hidden[first:end])).reshape(1, -1, hidden.shape[-1])
            x = torch.from_numpy(tokens[first:end]).reshape(1, -1)
            logits, _ = model.head(h, x)
            nll = F.cross_entropy(logits[0, :-1], x[0, 1:], reduction="none")
            for j in range(first, end):  # the W - 1 predictions inside window j
                a = (j - first) * W
                want[j] = nll[a:a + W - 1].mean().item()
    seen = [(h["windows"][0], h["loss_nats"]) for h in summary["history"]]
    assert sorted(j for j, _ in seen) == list(range(7))  # each document read once, in order
    for j, loss in seen:
        assert loss == pytest.approx(want[j], abs=1e-5), j
    # the carried state matters: window 1 read with a fresh state scores differently
    with torch.no_grad():
        fresh = model.head(torch.from_numpy(np.asarray(hidden[1:2])), torch.from_numpy(tokens[1:2]))[0]
    assert abs(F.cross_entropy(fresh[0, :-1], torch.from_numpy(tokens[1, 1:])).item() - want[1]) > 1e-4


def test_resume_restores_each_streams_carried_state(llama_dir, tmp_path):
    """2 streams over documents of 3 windows: 2 steps, then resumed to 6, equals 6 straight bit for bit (weights,
    AdamW, streams), and the checkpoint at step 2 holds the streams' carried states (mid-document). Mutation
    caught: the carried state not saved or not restored on resume (the streams would restart fresh)."""
    tokens = windows(9)
    build_cache(acting_model(llama_dir), tmp_path / "c", tokens, [3, 3, 3])
    kw = dict(budget_cpu_s=1e9, batch_size=2, val_windows=0, progress=False, lr=1e-2, step_lr=1e-2)
    train_head(acting_model(llama_dir), tmp_path / "c", tmp_path / "straight", "tiny", max_steps=6, **kw)
    train_head(acting_model(llama_dir), tmp_path / "c", tmp_path / "run", "tiny", max_steps=2, **kw)
    ts = load_file(str(tmp_path / "run" / "trainer_state.safetensors"))
    assert len(ts) > 10  # AdamW's moments and the two streams' carried tensors
    from fastweights.hf.fwl_head import load_fwl_head

    model = acting_model(llama_dir)
    _, _, state = load_fwl_head(tmp_path / "run", backbone_loader=lambda _n: (model.backbone, None),
                                with_trainer_state=True)
    assert all(s["state"] is not None and s["state"]["pos"] == 2 * W for s in state["streams"])
    train_head(model, tmp_path / "c", tmp_path / "run", "tiny", max_steps=6, **kw)
    for name in ("model.safetensors", "trainer_state.safetensors"):
        a, b = load_file(str(tmp_path / "straight" / name)), load_file(str(tmp_path / "run" / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


# ----------------------------------------------------------------------------- held-out windows


def test_a_document_starting_at_the_first_held_out_window_is_not_a_training_document(llama_dir, tmp_path):
    """``documents`` keeps only the documents with a window below the held-out ones: one that starts exactly at
    the first held-out window is dropped, not kept empty. An empty document ``(n_train, n_train)`` drawn by a stream
    would have it read window n_train, and on, the validation windows. Held on ``documents`` itself and on a run of
    one stream over documents [3, 3] with the second held out: every trained window is below 3. Mutation caught:
    ``end >= start`` for ``end > start`` (issue 49)."""
    assert documents([3, 3], 3) == [(0, 3)]
    assert documents([3, 2, 3], 5) == [(0, 3), (3, 5)]
    assert documents([3, 2, 3], 4) == [(0, 3), (3, 4)]  # a document cut by the held-out boundary keeps its part
    model = acting_model(llama_dir)
    build_cache(model, tmp_path / "c", windows(6), [3, 3])
    out = train_head(model, tmp_path / "c", tmp_path / "run", "tiny", budget_cpu_s=1e9, lr=0.0, step_lr=0.0,
                     val_windows=3, max_steps=6, progress=False)
    assert out["train_documents"] == 1
    assert sorted({j for h in out["history"] for j in h["windows"]}) == [0, 1, 2]


def test_validation_reads_each_held_out_document_from_a_fresh_state(llama_dir, tmp_path):
    """The validation loss of held-out documents [2, 2] (after 2 training windows) is the mean over their windows
    of each document read as one stream from a fresh head state: the state carried within a document, never from
    one held-out document into the next (the carried state changes the loss here, so the check has teeth).
    Mutation caught: the state reset only at the first held-out window (issue 49)."""
    model = acting_model(llama_dir).eval()
    build_cache(model, tmp_path / "c", windows(6), [2, 2, 2])
    hidden, tokens, meta = load_cache(tmp_path / "c")

    def read(spans):
        losses = []
        with torch.no_grad():
            for first, end in spans:
                state = None
                for i in range(first, end):
                    loss, state = stream_loss(model.head, torch.from_numpy(np.asarray(hidden[i:i + 1])),
                                              torch.from_numpy(tokens[i:i + 1]), state)
                    losses.append(loss.item())
        return float(np.mean(losses))

    val = validation_losses(model, hidden, tokens, meta, 2)
    assert val["windows"] == 4
    assert val["loss_nats"] == pytest.approx(read([(2, 4), (4, 6)]), abs=1e-6)
    assert abs(read([(2, 6)]) - read([(2, 4), (4, 6)])) > 1e-4  # carried across the documents: another loss


def test_validation_judges_a_test_time_only_head_on_its_slow_logits(llama_dir, tmp_path):
    """A test-time-only head trains its slow logits and gets its update's step size where it scores, so the
    held-out loss is the slow one (the head's own training mode), not the update at the default step, which
    diverged on trained blocks (fwl_top_blocks.json); the head's mode is restored. Mutation caught: the head
    validated in eval mode, the update on (the loss differs by > 1e-3 here)."""
    from fastweights.hf.fwl_head import top_blocks

    backbone_model = acting_model(llama_dir)
    options = FWLOptions(**{**PRETRAINED_FWL_DEFAULTS, "segment_len": 8, "test_time_only": True,
                            "test_time_step_size": 1.0})
    model = HFCausalLMWithFWL(backbone_model.backbone, options).eval()
    with torch.no_grad():
        model.head.ln_weight.fill_(0.5)
    build_cache(model, tmp_path / "c", windows(6), [3, 3])
    hidden, tokens, meta = load_cache(tmp_path / "c")
    val = validation_losses(model, hidden, tokens, meta, 3)
    assert not model.head.training and val["update"] == "off"
    with torch.no_grad():
        h = top_blocks(model.backbone, torch.from_numpy(np.asarray(hidden[3:6])), 0)
        slow = model.head.slow_forward(h)
        nats = F.cross_entropy(slow[:, :-1].flatten(0, 1), torch.from_numpy(tokens[3:6, 1:]).flatten()).item()
        updated = stream_loss(model.head, h[:1], torch.from_numpy(tokens[3:4]))[0].item()
        slow_first = F.cross_entropy(slow[0, :-1], torch.from_numpy(tokens[3, 1:])).item()
    assert val["loss_nats"] == pytest.approx(nats, abs=1e-5)
    assert abs(updated - slow_first) > 1e-3  # the update at step 1.0 moves the loss: the check has teeth


def test_resume_refuses_streams_past_this_caches_training_windows(llama_dir, tmp_path):
    """A run saved while its streams read windows 0-5 of documents [3, 3] (nothing held out), resumed with the last
    3 windows held out: a stream's document ends past the 3 training windows, so the resume is refused in one
    line (accepted, that stream would go on training on the held-out windows). Mutation caught: the check
    ``s["end"] <= n_train`` dropped (issue 49)."""
    build_cache(acting_model(llama_dir), tmp_path / "c", windows(6), [3, 3])
    kw = dict(budget_cpu_s=1e9, batch_size=2, progress=False, lr=1e-2, step_lr=1e-2)
    train_head(acting_model(llama_dir), tmp_path / "c", tmp_path / "run", "tiny", max_steps=1, val_windows=0, **kw)
    with pytest.raises(UserError, match="do not fit this cache of 3 training windows") as e:
        train_head(acting_model(llama_dir), tmp_path / "c", tmp_path / "run", "tiny", max_steps=2, val_windows=3,
                   **kw)
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- learning rates, history


def test_step_sizes_and_decays_get_their_own_learning_rate(llama_dir, tmp_path):
    """One AdamW step (its first update is lr x sign(gradient)): the step sizes and decays move by step_lr, the
    head's weights by lr. Mutation caught: one parameter group for every tensor (step_lr not passed on)."""
    model = acting_model(llama_dir)
    groups = param_groups(model, 1e-6, 1e-2)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)].split(".")[1] for p in groups[1]["params"]} == {"step_sizes", "decay_logits"}
    build_cache(model, tmp_path / "c", windows(3), [3])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_head(model, tmp_path / "c", tmp_path / "run", "tiny", budget_cpu_s=1e9, lr=1e-6, step_lr=1e-2,
               val_windows=0, max_steps=1, progress=False)
    moved = {n: (p.detach() - before[n]).abs().max().item() for n, p in model.named_parameters()}
    fast = [n for n in moved if n.startswith(("head.step_sizes.", "head.decay_logits."))]
    assert fast and max(moved[n] for n in fast) == pytest.approx(1e-2, rel=1e-3)
    assert max(moved[n] for n in moved if n.startswith("head.") and n not in fast) <= 2e-6


def test_trained_backbone_blocks_get_their_own_learning_rate(llama_dir, tmp_path):
    """With a trained block, one AdamW step (lr x sign(gradient)) moves it by block_lr and the head's weights by
    lr. Mutation caught: the blocks in the head's group, or block_lr not passed on to the optimizer."""
    model = acting_model(llama_dir, trainable_blocks=1)
    build_cache(model, tmp_path / "c", windows(3), [3])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_head(model, tmp_path / "c", tmp_path / "run", "tiny", budget_cpu_s=1e9, lr=1e-2, step_lr=1e-2,
               block_lr=3e-5, val_windows=0, max_steps=1, progress=False)
    moved = {n: (p.detach() - before[n]).abs().max().item() for n, p in model.named_parameters()}
    block = [n for n in moved if n.startswith("backbone.") and moved[n] > 0]
    assert block and all(".layers.3." in n for n in block)
    assert max(moved[n] for n in block) == pytest.approx(3e-5, rel=1e-2)
    assert max(moved[n] for n in moved if n.startswith("head.")) == pytest.approx(1e-2, rel=1e-2)


def test_the_history_is_in_nats_beside_the_static_loss_of_the_same_windows(llama_dir, tmp_path):
    """At an identity initialisation (zero step sizes and gain) the head adds nothing: the first step's loss_nats equals
    static_nats, and both equal the backbone's own cross-entropy of that window in nats; gain_nats is their
    difference. Mutations caught: the loss logged in bits; the static loss of another window."""
    from fastweights.hf.transformers_as_ours import load_hf_model

    backbone, _ = load_hf_model(str(llama_dir))
    identity = {"ln_gain_init": 0.0, "step_size_log": False, "step_size_init": 0.0}
    model = HFCausalLMWithFWL(backbone, FWLOptions(**{**PRETRAINED_FWL_DEFAULTS, **identity}))
    tokens = windows(4)
    build_cache(model, tmp_path / "c", tokens, [2, 2])
    out = train_head(model, tmp_path / "c", tmp_path / "run", "tiny", budget_cpu_s=1e9, val_windows=0, max_steps=1,
                     progress=False)
    (h,) = out["history"]
    (j,) = h["windows"]
    with torch.no_grad():
        x = torch.from_numpy(tokens[j:j + 1])
        want = F.cross_entropy(backbone(x).logits[0, :-1].float(), x[0, 1:]).item()
    assert h["loss_nats"] == pytest.approx(want, abs=1e-5) and h["static_nats"] == pytest.approx(want, abs=1e-5)
    assert h["gain_nats"] == h["static_nats"] - h["loss_nats"]


# ----------------------------------------------------------------------------- the cache key


CHANGES = {  # one field of the key changed at a time (the base: float32, data "a", documents [2, 1], K = 0)
    "tokens_sha": {"tokens": windows(3, seed=1)},
    "data": {"data": "b"},
    "window": {"tokens": windows(3)[:, :W - 8]},
    "doc_windows": {"doc_windows": [1, 2]},
    "trainable_blocks": {"trainable_blocks": 2},
    "backbone": {"fingerprint": "another"},
    "dtype": {"dtype": "float16"},
}


def test_every_key_field_is_tested():
    assert set(CHANGES) == set(KEY_FIELDS)


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_a_changed_key_field_rebuilds_the_cache(llama_dir, tmp_path, field):
    """The same cache twice is reused (nothing computed); one field changed rebuilds it, with the contents of the
    new key (K = 2: the input of block 2 of 4). Mutation caught: that field missing from the key."""
    from fastweights.hf.transformers_as_ours import load_hf_model

    backbone, _ = load_hf_model(str(llama_dir))
    base = {"tokens": windows(3), "data": "a", "doc_windows": [2, 1], "trainable_blocks": 0, "fingerprint": "bb",
            "dtype": "float32"}

    def make(kw):
        return cache_hidden_states(backbone, kw["tokens"], tmp_path / "c", fingerprint=kw["fingerprint"],
                                   progress=False, dtype=kw["dtype"], doc_windows=kw["doc_windows"], data=kw["data"],
                                   trainable_blocks=kw["trainable_blocks"])

    assert make(base)["computed_this_call"] == 3
    assert make(base)["computed_this_call"] == 0
    new = {**base, **CHANGES[field]}
    meta = make(new)
    assert meta["computed_this_call"] == 3
    hidden, tokens, meta = load_cache(tmp_path / "c")
    assert np.array_equal(tokens, new["tokens"]) and meta["data"] == new["data"]
    with torch.no_grad():
        want = blocks_input(backbone, torch.from_numpy(new["tokens"]), new["trainable_blocks"])
    np.testing.assert_allclose(np.asarray(hidden, dtype=np.float32), want.to(getattr(torch, new["dtype"])).float(),
                               rtol=0, atol=0)


def test_optimizer_step_clips_to_norm_one_and_refuses_a_non_finite_loss():
    """Both FWL-head trainers step through ``optimizer_step``. Mutation caught: another clip norm; the divergence
    message without its step and advice."""
    from fastweights.hf.fwl_training import optimizer_step

    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    opt = torch.optim.SGD([p], lr=1.0)
    optimizer_step((100 * torch.arange(1.0, 5.0, dtype=torch.float64) * p).sum(), opt, [p], 0)
    assert (-p.detach()).norm().item() == pytest.approx(1.0)  # the gradient, clipped to norm 1, times lr 1
    with pytest.raises(UserError, match=r"diverged at step 7 \(loss nan\); lower the learning rate"):
        optimizer_step(p.sum() * float("nan"), opt, [p], 7)


def test_a_parameter_the_loss_does_not_reach_is_left_as_it_was():
    """A step whose loss does not reach a parameter (a test-time-only head's step sizes, a block the window does
    not use) leaves it bit-identical: its gradient is None, not zeros, so AdamW neither decays it nor moves it by
    its momentum. Mutation caught: ``zero_grad(set_to_none=False)``."""
    from fastweights.hf.fwl_training import optimizer_step

    used, unused = (torch.nn.Parameter(torch.ones(3, dtype=torch.float64)) for _ in range(2))
    opt = torch.optim.AdamW([used, unused], lr=0.1, weight_decay=0.5)
    optimizer_step((used * unused).sum(), opt, [used, unused], 0)  # both reached: both move, momentum kept
    before = unused.detach().clone()
    for step in (1, 2):
        optimizer_step(used.square().sum(), opt, [used, unused], step)
    assert torch.equal(unused.detach(), before)


def test_a_float64_head_trains_on_the_float32_cache_in_its_own_precision(llama_dir, tmp_path):
    """The cached hidden states (float32 on disk) are read at the head's dtype: a float64 head with no trainable
    blocks (which would upcast them) trains, its loss the float64 loss of the first window. Mutation caught (issue
    49, seed 7): the windows left at float32."""
    from fastweights.hf.fwl_head import top_blocks

    model = acting_model(llama_dir, trainable_blocks=0).double()
    tokens = windows(4)
    build_cache(model, tmp_path / "c", tokens, [4])
    summary = train_head(model, tmp_path / "c", tmp_path / "run", "tiny", budget_cpu_s=1e9, lr=0.0, step_lr=0.0,
                         block_lr=0.0, batch_size=1, val_windows=0, max_steps=1, progress=False)
    hidden, _, _ = load_cache(tmp_path / "c")
    model.train()
    with torch.no_grad():
        h = top_blocks(model.backbone, torch.from_numpy(np.asarray(hidden[:1])).double(), 0)
        x = torch.from_numpy(tokens[:1])
        logits, _ = model.head(h, x)
        want = F.cross_entropy(logits[0, :-1], x[0, 1:]).item()
    assert next(model.head.parameters()).dtype == torch.float64
    assert summary["history"][0]["loss_nats"] == pytest.approx(want, rel=1e-12)


def test_resume_refuses_a_document_order_outside_this_caches_documents(llama_dir, tmp_path, monkeypatch):
    """The saved permutation of the training documents must name documents of this cache: an index past the last
    one (a state made for a cache with more documents) is refused in one line, not an IndexError mid-training.
    Mutation caught (issue 49, seed 8): the range check's two bounds joined by ``or``. An order within range,
    document 0 included, resumes."""
    import fastweights.hf.fwl_head as fwl_head

    build_cache(acting_model(llama_dir), tmp_path / "c", windows(6), [2, 2, 2])
    kw = dict(budget_cpu_s=1e9, batch_size=1, progress=False, lr=1e-2, step_lr=1e-2, val_windows=0)
    train_head(acting_model(llama_dir), tmp_path / "c", tmp_path / "run", "tiny", max_steps=1, **kw)
    real = fwl_head.load_fwl_head
    for order in ([0, 3], [-1, 1]):
        def saved_with(*a, order=order, **k):
            loaded, tok, ts = real(*a, **k)
            return loaded, tok, {**ts, "order": torch.tensor(order)}

        monkeypatch.setattr(fwl_head, "load_fwl_head", saved_with)
        with pytest.raises(UserError, match="its streams and document order do not fit this cache of 6 training"):
            train_head(acting_model(llama_dir), tmp_path / "c", tmp_path / "run", "tiny", max_steps=2, **kw)
    # an order that still holds document 0 (a permutation part-way through) fits: the run goes on from it
    # (mutation caught, issue 49 seed 13: the lower bound raised to 1)
    def saved_with_document_0(*a, **k):
        loaded, tok, ts = real(*a, **k)
        return loaded, tok, {**ts, "order": torch.tensor([2, 0])}

    monkeypatch.setattr(fwl_head, "load_fwl_head", saved_with_document_0)
    summary = train_head(acting_model(llama_dir), tmp_path / "c", tmp_path / "run", "tiny", max_steps=2, **kw)
    assert summary["steps"] == 2


def test_resume_refuses_a_head_trained_with_other_options(llama_dir, tmp_path):
    """The same trainable blocks (so the same cache), another head option: refused in one line. Mutation caught
    (issue 49, seed 8): the check asking for both the options and the blocks to differ."""
    build_cache(acting_model(llama_dir), tmp_path / "c", windows(3), [3])
    kw = dict(budget_cpu_s=1e9, batch_size=1, progress=False, val_windows=0)
    train_head(acting_model(llama_dir), tmp_path / "c", tmp_path / "run", "tiny", max_steps=1, **kw)
    other = acting_model(llama_dir)
    other.head.options = dataclasses.replace(other.head.options, segment_len=4)
    with pytest.raises(UserError, match=re.escape(
            "holds a head with other options or trainable blocks (another --variant or --trainable-blocks?); choose "
            "another --out, or the settings it was trained with")):
        train_head(other, tmp_path / "c", tmp_path / "run", "tiny", max_steps=2, **kw)


def test_a_resumed_runs_eta_is_bounded_by_the_budget_it_has_left(llama_dir, tmp_path, monkeypatch):
    """The progress bar's time limit is the budget less the CPU seconds the run had spent (seed 18: `+ used_cpu`
    survived, a resumed run's ETA allowed past its budget)."""
    from fastweights.core.progress import Progress
    from fastweights.hf import fwl_training

    limits = []

    def recording(*args, **kw):
        limits.append((kw["time_limit"], kw["initial"]))
        return Progress(*args, **kw)

    monkeypatch.setattr(fwl_training, "Progress", recording)
    build_cache(acting_model(llama_dir), tmp_path / "c", windows(3), [3])
    kw = dict(budget_cpu_s=1e6, batch_size=1, progress=False, val_windows=0)
    train_head(acting_model(llama_dir), tmp_path / "c", tmp_path / "run", "tiny", max_steps=1, **kw)
    train_head(acting_model(llama_dir), tmp_path / "c", tmp_path / "run", "tiny", max_steps=2, **kw)
    (first, none), (second, used) = limits
    assert none == 0 and first == 1e6 and used > 0 and second == 1e6 - used
