"""Streaming perplexity (carry / reset / frozen / memory, per-position curves in constant memory),
continual adaptation, the FwPKM gate map, and their commands, on tiny untrained models."""

import json

import numpy as np
import pytest
import torch

from fastweights.adapt.dynamic import DynamicEvaluator
from fastweights.core.config import DataConfig, ModelConfig, RunConfig, TrainConfig
from fastweights.data import CharTokenizer, Document
from fastweights.core.errors import UserError
from fastweights.loops.evaluate import score_tokens
from fastweights.adapt.continual import adapt_test, format_adapt_table, make_domain, plot_adapt
from fastweights.experiments.fwpkm_gates import gate_values, plot_gate_map
from fastweights.experiments.streaming import PositionCurve, encode_documents, plot_stream, state_norms, stream_eval
from fastweights.models.memory_switches import memory_only_state, memory_writes
from fastweights.models.lm import LanguageModel
from helpers import assert_json_shape, tiny_lm

V = 29
FWPKM = dict(n_subkeys=6, d_key=8, d_value=8, topk=2, chunk_size=8)


def model(kind="attention", seed=0, **kw):
    fields = {"fwpkm": dict(memory="fwpkm", memory_layers=[1], options={"fwpkm": {**FWPKM, **kw}}),
              "fwp": dict(mixer="fwp"), "fwl": dict(head="fwl")}.get(kind, {})
    return tiny_lm(V, seed=seed, **fields)


def ids(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    # a repetitive stream, so that carried memory has something to help with
    base = torch.randint(0, V, (max(8, n // 5),), generator=g)
    return base.repeat(n // base.numel() + 1)[:n]


def docs(*arrays, blocks=1):
    """(name, blocks) documents; ``blocks`` > 1 cuts each document into that many blocks."""
    out = []
    for i, a in enumerate(arrays):
        a = a.numpy()
        out.append((f"d{i}", [b for b in np.array_split(a, blocks) if b.size]))
    return out


# ----------------------------------------------------------------------------- curves


def test_position_curve_windowed_and_cumulative():
    c = PositionCurve(bin_width=2)
    c.add(0, [1.0, 3.0, 5.0])  # document 1: predictions 0, 1, 2
    c.add(0, [3.0])  # document 2: prediction 0
    c.add(1, [7.0, 9.0])  # document 2: predictions 1, 2
    d = c.to_dict()
    assert d["position"] == [2, 4] and d["count"] == [4, 2]
    assert d["windowed"] == [pytest.approx(14 / 4), pytest.approx(14 / 2)]
    assert d["cumulative"] == [pytest.approx(14 / 4), pytest.approx(28 / 6)]
    big = PositionCurve(bin_width=1000)
    for k in range(20):
        big.add(k * 1000, np.ones(1000))  # 20,000 predictions held as 20 sums
    assert big.sums.size <= 32 and big.to_dict()["count"] == [1000] * 20


# ----------------------------------------------------------------------------- streaming


@pytest.mark.parametrize("kind", ["attention", "fwpkm", "fwl"])
def test_carry_on_one_document_equals_score_tokens_and_blocks_do_not_matter(kind):
    m = model(kind)
    x = ids(150)
    ref, _ = score_tokens(m, x, seq_len=32, stride=16)
    one = stream_eval(m, docs(x), "carry", seq_len=32, stride=16, bin_width=10)
    cut = stream_eval(m, docs(x, blocks=4), "carry", seq_len=32, stride=16, bin_width=10)
    assert one.tokens == cut.tokens == 149
    assert one.nll == pytest.approx(ref.nll, rel=1e-6) and cut.nll == pytest.approx(ref.nll, rel=1e-5)


def test_reset_scores_each_document_alone_and_carry_does_not():
    m = model("fwpkm")
    a, b = ids(90, seed=2), ids(70, seed=3)
    reset = stream_eval(m, docs(a, b), "reset", seq_len=32, stride=16)
    carry = stream_eval(m, docs(a, b), "carry", seq_len=32, stride=16)
    alone, _ = score_tokens(m, b, seq_len=32, stride=16)
    assert reset.documents[1]["tokens"] == 69
    assert reset.documents[1]["loss"] * 69 == pytest.approx(alone.nll, rel=1e-5)
    assert carry.documents[0]["loss"] == pytest.approx(reset.documents[0]["loss"], rel=1e-6)
    assert abs(carry.documents[1]["loss"] - reset.documents[1]["loss"]) > 1e-6  # the memory carried


def test_frozen_never_writes_and_is_carry_for_models_without_memory():
    m = model("fwpkm")
    x = ids(120)
    frozen = stream_eval(m, docs(x), "frozen", seq_len=32, stride=16)
    with memory_writes(m, frozen=True):
        ref, state = score_tokens(m, x, seq_len=32, stride=16)
    assert state["layers"][1]["memory"].writes == 0
    assert frozen.nll == pytest.approx(ref.nll, rel=1e-6)
    assert stream_eval(m, docs(x), "carry", seq_len=32, stride=16).nll != pytest.approx(frozen.nll, rel=1e-6)
    assert m.blocks[1].memory.frozen is False  # the switch is restored
    a = model("attention")
    assert stream_eval(a, docs(x), "frozen", 32, 16).nll == stream_eval(a, docs(x), "carry", 32, 16).nll


def test_memory_mode_resets_context_per_segment_and_keeps_memories():
    a = model("attention")
    x = ids(100)
    res = stream_eval(a, docs(x), "memory", seq_len=32, stride=12)
    # without memories: every segment of 32 predictions is scored from a fresh state
    ref = sum(score_tokens(a, x[s: s + 33], seq_len=10**6, stride=10**6)[0].nll for s in range(0, 99, 32))
    assert res.tokens == 99 and res.nll == pytest.approx(ref, rel=1e-5)
    f = model("fwpkm")
    mem = stream_eval(f, docs(x), "memory", seq_len=32, stride=12)
    fresh = sum(score_tokens(f, x[s: s + 33], seq_len=10**6, stride=10**6)[0].nll for s in range(0, 99, 32))
    assert abs(mem.nll - fresh) > 1e-6  # the FwPKM tables carried over the segment boundaries
    st = f(x[None, :20]).state
    kept = memory_only_state(st)
    assert kept["layers"][1]["memory"] is st["layers"][1]["memory"] and "mixer" not in kept["layers"][0]


@pytest.mark.parametrize("kind", ["attention", "fwpkm", "fwl"])
def test_windows_mode_scores_independent_windows_with_every_state_fresh(kind):
    m = model(kind)
    x = ids(100)
    res = stream_eval(m, docs(x), "windows", seq_len=32, stride=12)
    fresh = sum(score_tokens(m, x[s: s + 33], seq_len=10**6, stride=10**6)[0].nll for s in range(0, 99, 32))
    assert res.tokens == 99 and res.nll == pytest.approx(fresh, rel=1e-5)  # memories and head reset too
    if kind != "attention":  # where the memory / head carries over, "memory" mode differs from fresh windows
        assert abs(stream_eval(m, docs(x), "memory", seq_len=32, stride=12).nll - fresh) > 1e-6


def test_max_tokens_and_documents_from_text():
    tok = CharTokenizer.from_text("abcdefgh ")
    texts = [Document("a", "abc defg " * 40), Document("b", "hgf edcba " * 30)]
    blocks = list(encode_documents(texts, tok))
    assert [n for n, _ in blocks] == ["a", "b"]
    m = model("attention")
    m2 = LanguageModel(ModelConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=2, n_heads=2)).eval()
    res = stream_eval(m2, encode_documents(texts, tok), "carry", seq_len=32, max_tokens=500)
    assert res.tokens == 500 and res.documents[1]["tokens"] == 500 - 359
    short = list(encode_documents(texts, tok, max_chars=100))
    assert sum(b.size for _, bl in short for b in bl) == 100
    with pytest.raises(UserError):
        stream_eval(m, docs(ids(20)), "sideways", 32)


def test_dynamic_on_top_with_lr_zero_is_static():
    m = model("attention")
    x = ids(120)
    ev = DynamicEvaluator(m, rule="sgd", lr=0.0, segment_len=8, context=32)
    dyn = stream_eval(m, docs(x, blocks=3), "reset", seq_len=32, evaluator=ev)
    static = ev.static(x, keep_token_losses=False)
    assert dyn.tokens == static.tokens == 119 and dyn.nll == pytest.approx(static.nll, rel=1e-5)
    ev2 = DynamicEvaluator(m, rule="sgd", lr=0.05, segment_len=8, context=32)
    moved = stream_eval(m, docs(x), "carry", seq_len=32, evaluator=ev2)
    assert moved.tokens == 119 and moved.nll != pytest.approx(static.nll, rel=1e-6)
    with pytest.raises(UserError, match="memory"):
        stream_eval(m, docs(x), "memory", 32, evaluator=ev)


def test_stream_plot(tmp_path):
    m = model("attention")
    runs = [{"label": mode, **{k: v for k, v in stream_eval(m, docs(ids(80)), mode, 32, bin_width=8).to_dict().items()
                               if k in ("curve", "state_norm")}} for mode in ("carry", "reset")]
    assert plot_stream(runs, tmp_path / "s.png").stat().st_size > 1000


def test_state_norms_along_the_stream_are_those_of_the_carried_state():
    m = model("attention")
    x = ids(120)
    res = stream_eval(m, docs(x), "carry", seq_len=32, stride=16, bin_width=16)
    sn = res.state_norm.to_dict()
    assert sn["count"] == [1] * 8 and len(sn["per_layer"]) == len(m.blocks)  # one call per bin of 16, 119 predictions
    # the last bin's norms are those of the state one direct pass leaves after the same calls
    state = None
    for a in range(0, 119, 16):
        with torch.no_grad():
            state = m(x[None, a : min(a + 16, 119)], state).state
        state = m.trim_state(state, 16)
    assert [v[-1] for v in sn["per_layer"]] == pytest.approx(state_norms(state), rel=1e-6)
    assert sn["max"][-1] == pytest.approx(max(state_norms(state)), rel=1e-6) and sn["max"][-1] > 0
    # a state that doubles doubles its norm
    doubled = {**state, "layers": [torch.utils._pytree.tree_map(
        lambda t: t * 2 if isinstance(t, torch.Tensor) and t.is_floating_point() else t, s) for s in state["layers"]]}
    assert state_norms(doubled) == pytest.approx([2 * v for v in state_norms(state)], rel=1e-6)


# ----------------------------------------------------------------------------- continual adaptation


def _domains(tok=None):
    tok = tok or CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz ")
    a = make_domain("aa", "abc abd abe " * 40, tok, 200, 60)
    b = make_domain("bb", "xyz xyw xyv " * 40, tok, 200, 60)
    return tok, [a, b]


def test_domains_are_disjoint_and_sized():
    tok = CharTokenizer.from_text("0123456789")
    text = "".join(str(i % 10) for i in range(500))
    d = make_domain("n", text, tok, 300, 100)
    assert d.adapt.tolist() == tok.encode(text[:301]).tolist() and d.eval.tolist() == tok.encode(text[-101:]).tolist()
    with pytest.raises(UserError, match="too short"):
        make_domain("n", text, tok, 400, 100)


def test_adapt_test_memories_adapt_attention_does_not_and_weights_stay():
    tok, domains = _domains()
    torch.manual_seed(0)
    f = LanguageModel(ModelConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=2, n_heads=2, memory="fwpkm",
                                  memory_layers=[1], options={"fwpkm": FWPKM})).eval()
    before = {k: v.clone() for k, v in f.state_dict().items()}
    res = adapt_test(f, domains, seq_len=32)
    assert res["stages"] == ["before", "after aa", "after bb"] and len(res["nll"]) == 3
    assert res["delta"][0] == [0.0, 0.0] and any(abs(v) > 1e-6 for v in res["delta"][1])
    assert res == adapt_test(f, domains, seq_len=32)  # scoring restores the post-stage state: repeatable
    assert all(torch.equal(before[k], v) for k, v in f.state_dict().items())
    torch.manual_seed(0)
    a = LanguageModel(ModelConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=2, n_heads=2)).eval()
    flat = adapt_test(a, domains, seq_len=32)  # no memory: the fresh-context scores cannot change
    assert all(v == 0.0 for row in flat["delta"] for v in row)
    assert "aa" in format_adapt_table(res)


def test_adapt_test_with_dynamic_evaluation(tmp_path):
    tok, domains = _domains()
    torch.manual_seed(0)
    a = LanguageModel(ModelConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=2, n_heads=2)).eval()
    before = {k: v.clone() for k, v in a.state_dict().items()}
    ev = DynamicEvaluator(a, rule="sgd", lr=0.1, segment_len=8, context=32)
    res = adapt_test(a, domains, seq_len=32, evaluator=ev)
    assert res["delta"][1][0] < 0  # adapting on domain aa lowers its held-out NLL
    assert all(torch.equal(before[k], v) for k, v in a.state_dict().items())
    assert plot_adapt(res, tmp_path / "a.png").stat().st_size > 1000


# ----------------------------------------------------------------------------- gates


def test_gate_values_are_the_layers_gates(tmp_path):
    tok = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz .\n")
    torch.manual_seed(0)
    f = LanguageModel(ModelConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=2, n_heads=2, memory="fwpkm",
                                  memory_layers=[0, 1], options={"fwpkm": FWPKM})).eval()
    text = "the cat sat on the mat. the dog sat on the log.\n" * 3
    ids_, gates = gate_values(f, tok, text, chunk_size=8, piece=20)
    assert sorted(gates) == [0, 1] and all(g.shape == (len(text),) and ((g > 0) & (g < 1)).all() for g in gates.values())
    # the gate of layer 0 is a function of the token embeddings alone: recompute it directly
    h = f.blocks[0].memory_norm(f.embed(torch.as_tensor(ids_)[None]))
    _, _, g0 = f.blocks[0].memory.io.inputs(h)
    np.testing.assert_allclose(gates[0], g0[0].detach().numpy(), rtol=1e-5, atol=1e-6)
    assert f.blocks[0].memory.record_reads is False and f.blocks[0].memory.gate_log == []
    assert plot_gate_map([tok.decode([int(i)]) for i in ids_], gates, tmp_path / "g.png", width=32).stat().st_size > 1000
    with pytest.raises(UserError, match="no FwPKM"):
        gate_values(model("attention"), tok, "abc")


# ----------------------------------------------------------------------------- commands


def _cli(argv):
    from fastweights import cli

    return cli.main(argv)


def test_commands_end_to_end(tmp_path, capsys):
    from fastweights.checkpoints.format import save_model

    text = "the cat sat on the mat. the dog sat on the log. " * 30
    (tmp_path / "a.txt").write_text(text)
    (tmp_path / "b.txt").write_text("a bad lad had a sad dad. " * 50)
    tok = CharTokenizer.from_text(text + "abdlh")
    ckpt = tmp_path / "fwpkm"
    torch.manual_seed(0)
    f = LanguageModel(ModelConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=2, n_heads=2, memory="fwpkm",
                                  memory_layers=[1], options={"fwpkm": FWPKM}))
    save_model(f, ckpt, RunConfig(model=f.config, data=DataConfig(corpus=str(tmp_path / "a.txt")),
                                  train=TrainConfig(seq_len=32)), tok)
    out = tmp_path / "stream"
    assert _cli(["eval", "--stream", "--checkpoint", str(ckpt), "--data", str(tmp_path / "a.txt"), "--modes",
                 "carry,frozen,memory", "--bin", "100", "--out", str(out), "--quiet"]) == 0
    doc = json.loads((out / "stream.json").read_text())
    assert_json_shape(doc, "eval_stream")
    assert [r["mode"] for r in doc["runs"]] == ["carry", "frozen", "memory"] and (out / "stream.png").is_file()
    assert doc["runs"][0]["tokens"] == len(text) - 1 and doc["runs"][0]["rss_mb"]["peak_process"] > 0
    assert _cli(["eval", "--stream", "--checkpoint", str(ckpt), "--modes", "nope", "--quiet"]) == 2

    out = tmp_path / "adapt"
    assert _cli(["continual", "--checkpoint", str(ckpt), "--domain", f"cats={tmp_path / 'a.txt'}", "--domain",
                 f"lads={tmp_path / 'b.txt'}", "--adapt-tokens", "300", "--eval-tokens", "100", "--out", str(out),
                 "--quiet"]) == 0
    res = json.loads((out / "adapt.json").read_text())
    assert_json_shape(res, "continual")
    assert res["domains"] == ["cats", "lads"] and len(res["delta"]) == 3 and (out / "adapt.png").is_file()
    # the provenance every result records: the command as given to the CLI (not pytest's), the commit, the machine
    assert res["command"].startswith("fastweights continual --checkpoint") and res["command"].endswith("--quiet")
    assert res["git"]["commit"] and res["machine"]["cores"] >= 1
    assert "after lads" in capsys.readouterr().out
    assert _cli(["continual", "--checkpoint", str(ckpt), "--domain", "nameless", "--quiet"]) == 2

    out = tmp_path / "gates"
    assert _cli(["inspect", "gates", "--checkpoint", str(ckpt), "--text", "the cat sat on the log.", "--out", str(out)]) == 0
    gates = json.loads((out / "gates.json").read_text())
    assert_json_shape(gates, "inspect_gates")
    assert (out / "gates.png").is_file() and "1" in gates["gates"]
    assert gates["command"] == f"fastweights inspect gates --checkpoint {ckpt} --text 'the cat sat on the log.' --out {out}"
