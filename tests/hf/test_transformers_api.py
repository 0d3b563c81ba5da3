"""The Hugging Face wrapper on the transformers API it is installed with: ``HFCausalLM.forward_features``
(the backbone's final hidden state, no logits) agrees with ``forward``, and no path of the wrappers calls
transformers in a way it deprecates (its FutureWarnings and DeprecationWarnings are errors here).
Tiny randomly initialised Llama (rotary) and GPT-2 (learned positions) models; no downloads."""

import warnings

import pytest
import torch

pytest.importorskip("transformers")

from fastweights.hf.transformers_as_ours import HFCausalLM  # noqa: E402
import helpers  # noqa: E402

V = 50


def llama(positions=256, layers=2):
    return helpers.tiny_llama(V, positions, layers)


def gpt2(positions=64):
    return helpers.tiny_gpt2(V, positions)


def ids(n, seed=1, batch=2):
    return torch.randint(0, V, (batch, n), generator=torch.Generator().manual_seed(seed))


def head_logits(lm: HFCausalLM, hidden: torch.Tensor) -> torch.Tensor:
    return hidden @ lm.hf.get_output_embeddings().weight.T


@pytest.mark.parametrize("make", [llama, gpt2])
def test_forward_features_times_the_output_embedding_are_the_logits(make):
    lm = HFCausalLM(make())
    x = ids(20)
    with torch.no_grad():
        out = lm(x)
        hidden, state = lm.forward_features(x)
    assert hidden.shape == (2, 20, 32)
    torch.testing.assert_close(head_logits(lm, hidden), out.logits, rtol=0, atol=1e-10)
    # the same state as forward's (cache, cached ids, next position)
    assert state["pos"] == out.state["pos"] == 20 and torch.equal(state["tokens"], out.state["tokens"])
    for (k1, v1), (k2, v2) in zip(state["kv"], out.state["kv"]):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    # the neural cache's hidden state is the same tensor
    _, h = lm.forward_hidden(x)
    torch.testing.assert_close(h, hidden, rtol=0, atol=1e-12)


@pytest.mark.parametrize("make, cuts", [(llama, (7, 15)), (gpt2, (5, 11))])
def test_forward_features_in_split_calls_equal_one_call_and_forward(make, cuts):
    lm = HFCausalLM(make())
    x = ids(24)
    with torch.no_grad():
        full = head_logits(lm, lm.forward_features(x)[0])
        pieces, fstate, lstate = [], None, None
        for lo, hi in zip((0, *cuts), (*cuts, x.shape[1])):
            h, fstate = lm.forward_features(x[:, lo:hi], fstate)
            out = lm(x[:, lo:hi], lstate)
            lstate = out.state
            torch.testing.assert_close(head_logits(lm, h), out.logits, rtol=0, atol=1e-10)
            pieces.append(h)
    torch.testing.assert_close(head_logits(lm, torch.cat(pieces, 1)), full, rtol=0, atol=1e-10)


@pytest.mark.parametrize("make", [lambda: llama(positions=16), lambda: gpt2(positions=16)])
def test_forward_features_re_encodes_like_forward(make):
    """Past the position limit both re-encode the cache the same way (and forward_features' cache is
    forward's): a stream of 40 tokens on a 16-position model, fed 6 at a time."""
    lm = HFCausalLM(make())
    x = ids(40, batch=1)
    fstate = lstate = None
    with torch.no_grad():
        for lo in range(0, 40, 6):
            h, fstate = lm.forward_features(x[:, lo:lo + 6], fstate)
            out = lm(x[:, lo:lo + 6], lstate)
            lstate = out.state
            torch.testing.assert_close(head_logits(lm, h), out.logits, rtol=0, atol=1e-10)
            assert fstate["pos"] == lstate["pos"] <= 16 and torch.equal(fstate["tokens"], lstate["tokens"])
    assert fstate["pos"] < lo + 6  # it did re-encode


# ----------------------------------------------------------------------------- no deprecated calls


@pytest.fixture
def deprecations_are_errors():
    """transformers' FutureWarnings and DeprecationWarnings raise; its logged deprecations (``warning_once``,
    reset so that an earlier test cannot hide one) fail the test."""
    import logging

    from transformers.utils import logging as hf_logging

    class Collect(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages = []

        def emit(self, record):
            if "deprecat" in record.getMessage().lower():
                self.messages.append(record.getMessage())

    handler = Collect()
    logger = logging.getLogger("transformers")
    hf_logging.warning_once.cache_clear()
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            warnings.simplefilter("error", DeprecationWarning)
            yield
    finally:
        logger.removeHandler(handler)
    assert handler.messages == []


def test_the_fixture_catches_the_deprecated_keyword(deprecations_are_errors):
    """The check can fail: transformers >= 5.24 deprecates ``past_key_values`` (which the wrapper used)."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.24"):
        pytest.skip("past_key_values is not deprecated before transformers 5.24")
    hf = llama()
    with pytest.raises(FutureWarning, match="past_key_values"):
        hf(input_ids=ids(3, batch=1), past_key_values=None, use_cache=True)


@pytest.mark.parametrize("make", [lambda: llama(positions=16), lambda: gpt2(positions=16)])
def test_the_wrapper_calls_transformers_without_deprecations(make, deprecations_are_errors):
    """forward, forward_hidden and forward_features with a carried state and with re-encoding (the stream
    passes the 16 positions) pass the cache by the keyword transformers asks for and read it back so."""
    lm = HFCausalLM(make())
    x = ids(30, batch=1)
    state = None
    with torch.no_grad():
        for lo in range(0, 30, 5):
            out = lm(x[:, lo:lo + 5], state, targets=x[:, lo:lo + 5])
            lm.forward_hidden(x[:, lo:lo + 5], state)
            lm.forward_features(x[:, lo:lo + 5], state)
            state = out.state
    assert state["pos"] < 30  # re-encoded


def test_dynamic_evaluation_of_a_saved_model_without_deprecations(tmp_path, deprecations_are_errors):
    """A saved Llama directory through ``load_hf_model`` and the dynamic evaluator (gradient steps on the
    transformers model, state carried across segments)."""
    from fastweights.adapt.dynamic import DynamicEvaluator
    from fastweights.hf.transformers_as_ours import load_hf_model

    llama().save_pretrained(tmp_path)
    helpers.gpt2_tokenizer(tmp_path).save_pretrained(tmp_path)
    lm, tok = load_hf_model(str(tmp_path))
    assert isinstance(lm, HFCausalLM) and tok.encode("hello").size > 0
    x = ids(40, batch=1)[0]
    ev = DynamicEvaluator(lm, rule="sgd", lr=0.01, segment_len=8)
    static = ev.static(x)
    dynamic, _ = ev.evaluate(x)
    assert static.tokens == dynamic.tokens == 39 and dynamic.nll != static.nll


def test_an_exported_checkpoint_round_trips_without_deprecations(tmp_path, deprecations_are_errors):
    """Ours in to transformers: export-hf's directory loads (AutoModelForCausalLM and load_hf_model), runs
    with its cache, and generates, with no deprecated call on the way."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fastweights.hf.export import export_hf
    from fastweights.hf.transformers_as_ours import load_hf_model

    ck = helpers.untrained_char_checkpoint(tmp_path, "the quick brown fox jumps over the lazy dog\n" * 4,
                                           tmp_path / "ck")
    export_hf(ck, tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    enc = AutoTokenizer.from_pretrained(tmp_path / "hf")(["the quick"], return_tensors="pt")
    with torch.no_grad():
        first = model(**enc, use_cache=True)
        cache = first.cache if "cache" in first.__dataclass_fields__ else first.past_key_values
        model(input_ids=enc["input_ids"][:, -1:], **{"cache" if "cache" in first.__dataclass_fields__
                                                     else "past_key_values": cache})
        new = model.generate(**enc, max_new_tokens=5, do_sample=False)
    assert new.shape == (1, enc["input_ids"].shape[1] + 5)
    lm, _ = load_hf_model(str(tmp_path / "hf"))
    assert not isinstance(lm, HFCausalLM)  # ours, loaded natively
