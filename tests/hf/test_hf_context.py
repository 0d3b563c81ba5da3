"""The KV cache of Hugging Face models (hf.kv_context): the whole stream by default, the first
tokens (attention sinks) kept when bounded, positions re-encoded only when they run out.
Tiny randomly initialised Llama (rotary) and GPT-2 (learned positions) models; no downloads."""

import pytest
import torch

pytest.importorskip("transformers")

from fastweights.adapt.dynamic import DynamicEvaluator  # noqa: E402
from fastweights.loops.evaluate import score_tokens  # noqa: E402
from fastweights.hf.kv_context import keep_indices, reencode_budget, trim_with_sinks  # noqa: E402
from fastweights.hf.transformers_as_ours import HFCausalLM  # noqa: E402
import helpers  # noqa: E402

V = 50


def tiny_llama(positions=256, layers=2):
    return helpers.tiny_llama(V, positions, layers)


def tiny_gpt2(positions=64, layers=2):
    return helpers.tiny_gpt2(V, positions, layers)


def ids(n, seed=1):
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed))


def ref_losses(hf, x, position_ids):
    """-log p of x[1:] given x[:-1] in one forward pass at the given positions."""
    logits = hf(input_ids=x[None, :-1], position_ids=torch.as_tensor(position_ids)[None]).logits[0]
    return -torch.log_softmax(logits, -1).gather(-1, x[1:, None])[:, 0]


def test_default_context_is_the_whole_stream():
    hf = tiny_llama()
    lm = HFCausalLM(hf)
    assert lm.default_context == 256 and lm.sinks == 4 and lm.reencode
    x = ids(200)
    full = ref_losses(hf, x, list(range(199))).mean().item()  # one forward pass over the whole stream
    ev = DynamicEvaluator(lm, rule="sgd", lr=0.0, segment_len=16, context=lm.default_context)
    assert ev.static(x).loss == pytest.approx(full, rel=1e-6)
    assert ev.evaluate(x)[0].loss == pytest.approx(full, rel=1e-6)
    assert ev.metadata()["sinks"] == 4 and ev.metadata()["max_positions"] == 256 and "decay" not in ev.metadata()


def test_sink_eviction_equals_full_context_while_the_stream_fits():
    hf = tiny_llama()
    x = ids(120)
    full, _ = score_tokens(HFCausalLM(hf), x, seq_len=256, stride=16, keep_token_losses=True)
    for sinks in (0, 4):  # a bound the stream never reaches evicts nothing, whatever the policy
        r, state = score_tokens(HFCausalLM(hf, sinks=sinks), x, seq_len=136, stride=16, keep_token_losses=True)
        assert r.token_losses == full.token_losses and state["tokens"].shape[1] == 119
    bounded, _ = score_tokens(HFCausalLM(hf), x, seq_len=48, stride=16, keep_token_losses=True)
    assert bounded.token_losses[:48] == full.token_losses[:48] and bounded.token_losses != full.token_losses


def test_bounded_cache_keeps_the_first_tokens_at_their_positions():
    """One layer (keys depend on the token only): chunk 8 scores exactly as one forward pass over
    the 4 sinks at positions 0..3 and the 28 most recent tokens at their true positions."""
    hf = tiny_llama(layers=1)
    lm = HFCausalLM(hf)
    x = ids(200)
    r, _ = score_tokens(lm, x, seq_len=48, stride=16, keep_token_losses=True)
    window = torch.cat([x[:4], x[100:145]])
    ref = ref_losses(hf, window, list(range(4)) + list(range(100, 144)))[-16:]
    torch.testing.assert_close(torch.tensor(r.token_losses[128:144], dtype=torch.float64), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2])
def test_the_first_tokens_are_never_dropped(make):
    """Through eviction and through re-encoding when the positions run out (64 here)."""
    lm = HFCausalLM(make(positions=64))
    x = ids(400)
    state, pos_seen = None, []
    for start in range(0, 399, 16):
        out = lm(x[None, start : start + 16], state)
        state = lm.trim_state(out.state, 32)
        assert torch.equal(state["tokens"][0, :4], x[:4])
        end = start + 16
        assert torch.equal(state["tokens"][0, 4:], x[max(4, end - 28) : end])
        assert state["kv"][0][0].shape[2] == state["tokens"].shape[1] == min(end, 32)
        pos_seen.append(state["pos"])
    assert max(pos_seen) <= 64 and min(pos_seen[4:]) < 64  # re-encoded (positions restart), never past the limit


def test_reencoding_scores_sinks_plus_window_as_a_fresh_run():
    """GPT-2 (learned positions, 64): with context 32 and chunks of 16, the cache is re-encoded before
    chunks 4, 7, 10, ...; such a chunk scores exactly as a fresh run on 4 sinks + 12 recent + itself."""
    hf = tiny_gpt2()
    r, _ = score_tokens(HFCausalLM(hf), ids(200), seq_len=32, stride=16, keep_token_losses=True)
    x = ids(200)
    for c in (4, 7, 10):
        s = 16 * c
        window = torch.cat([x[:4], x[s - 12 : s + 17]])
        ref = ref_losses(hf, window, list(range(32)))[-16:]
        torch.testing.assert_close(torch.tensor(r.token_losses[s : s + 16], dtype=torch.float64), ref,
                                   rtol=1e-6, atol=1e-6)


def test_trim_helpers():
    assert keep_indices(100, 10, 4) == (4, 6) and keep_indices(100, 2, 4) == (2, 0) and keep_indices(5, 10, 4) == (4, 1)
    st = {"kv": ((torch.arange(10.0).view(1, 1, 10, 1),) * 2,), "tokens": torch.arange(10)[None], "pos": 10}
    t = trim_with_sinks(st, 5, 2)
    assert t["tokens"].tolist() == [[0, 1, 7, 8, 9]] and t["kv"][0][0].flatten().tolist() == [0, 1, 7, 8, 9]
    assert trim_with_sinks(st, 5, 0)["tokens"].tolist() == [[5, 6, 7, 8, 9]] and trim_with_sinks(st, 20, 2) is st
    assert reencode_budget(1000, 16, 64) == 32 and reencode_budget(10, 16, 64) == 10 and reencode_budget(50, 40, 64) == 24
    with pytest.raises(ValueError):
        reencode_budget(0, 65, 64)
    with pytest.raises(ValueError):
        HFCausalLM(tiny_gpt2(), sinks=-1)


def test_a_wrapped_backbone_computes_its_linears_through_ops_linear_for_the_call_only(monkeypatch):
    """dynamic eval --hf, the harness and fwl-head score through HFCausalLM: every nn.Linear of the backbone (the
    output layer too) goes through ops.linear during the call, with the same logits, and is its own again after
    it (also after an error inside). Mutants caught: the block not entered; the forwards not put back."""
    from fastweights.ops import linear as lin

    hf = tiny_llama()
    hf.float()
    lm = HFCausalLM(hf)
    x = ids(20, seed=3)[None]
    want = hf(input_ids=x).logits
    monkeypatch.setenv("FASTWEIGHTS_LINEAR", "onednn")
    if not lin.onednn_available():
        pytest.skip("no oneDNN linear on this machine or build")
    calls = []
    real = lin.KERNELS["onednn"]
    monkeypatch.setitem(lin.KERNELS, "onednn", lambda a, w, b: calls.append(1) or real(a, w, b))
    out, _ = lm.forward_features(x)
    assert calls
    n_linears = sum(isinstance(m, torch.nn.Linear) for m in hf.modules())
    calls.clear()
    torch.testing.assert_close(lm(x).logits, want, rtol=1e-4, atol=1e-5)
    assert len(calls) == n_linears  # every linear, the output layer among them
    assert not any("forward" in vars(m) for m in hf.modules())
    calls.clear()
    hf(input_ids=x)  # called directly, outside the wrapper: torch's own
    assert not calls
