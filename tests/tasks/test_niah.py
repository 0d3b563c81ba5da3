"""NIAH: the generator (format, determinism, collisions, depths), scoring, the n-iter reading protocol
(one memory write per read, none while answering, the question never leaks) and the command."""

import json
import re

import pytest
import torch
from torch import nn

from fastweights.core.config import DataConfig, RunConfig, TrainConfig
from fastweights.data import CharTokenizer
from fastweights.core.errors import UserError
from fastweights.models.lm import ModelOutput
from fastweights.tasks.niah import (Haystack, NiahOptions, check_tokenizer, evaluate_niah, evaluate_sample, make_sample,
                                    make_samples, parse_depths, plot_niah, score_answer, summarize, training_text)
from fastweights.tasks.niah_report import format_table
from helpers import assert_json_shape, tiny_lm

HEX, DIGITS = "0123456789abcdef", "0123456789"


@pytest.fixture(scope="module")
def hay():
    return Haystack.load()  # the bundled tinyshakespeare


@pytest.fixture(scope="module")
def tok(hay):
    # the char vocabulary of Shakespeare plus the needle alphabet (Shakespeare alone has no digits)
    return CharTokenizer.from_text(hay.text[:200000] + HEX + DIGITS + "ID-")


def fwpkm_model(tok, seed=0, **fw):
    opts = dict(n_subkeys=6, d_key=8, d_value=8, topk=2, chunk_size=16)
    return tiny_lm(tok.vocab_size, seed=seed, memory="fwpkm", memory_layers=[1], options={"fwpkm": {**opts, **fw}})


# ----------------------------------------------------------------------------- generator


def test_needles_have_the_paper_format_and_never_collide(hay, tok):
    for i in range(6):
        s = make_sample(hay, tok, 400, None, seed=3, index=i)
        assert len(s.needles) == 5 and 0 <= s.target < 5
        keys = [n.key for n in s.needles]
        values = [n.value for n in s.needles]
        assert len(set(keys)) == 5 and len(set(values)) == 5
        for n in s.needles:
            assert re.fullmatch(r"ID-[0-9a-f]{4}", n.key) and re.fullmatch(r"[0-9]{6}", n.value)
            text = f"The secret number for {n.key} is {n.value}."
            assert s.context.count(text) == 1 and s.context[n.offset:].startswith(text)
            assert s.context.count(n.key) == 1  # the key occurs only in its needle
        assert s.answer == s.needles[s.target].value and s.answer not in s.question
        assert s.question == f" The secret number for {s.needles[s.target].key} is"
        assert 0.9 * 400 <= s.tokens <= 400 and s.tokens == len(tok.encode(s.context))


def test_generator_is_deterministic_by_seed(hay, tok):
    a = make_samples(hay, tok, [300, 500], [0.0, 0.5], samples=2, seed=7)
    b = make_samples(hay, tok, [300, 500], [0.0, 0.5], samples=2, seed=7)
    c = make_samples(hay, tok, [300, 500], [0.0, 0.5], samples=2, seed=8)
    assert a == b and len(a) == 8
    assert [s.context for s in a] != [s.context for s in c]
    assert len({s.context for s in a}) == 8  # every cell and index differs


def test_fixed_depths_place_the_target(hay, tok):
    for depth in (0.0, 0.5, 1.0):
        s = make_sample(hay, tok, 600, depth, seed=1, index=2)
        assert s.depth == depth and abs(s.target_depth - depth) < 0.12
    first = make_sample(hay, tok, 600, 0.0, seed=1, index=0)
    assert first.context.startswith("The secret number for " + first.needles[first.target].key)


def test_bad_inputs_are_user_errors(hay, tok):
    no_digits = CharTokenizer.from_text(hay.text[:5000].replace("3", ""))
    with pytest.raises(UserError, match="cannot encode"):
        check_tokenizer(no_digits)
    with pytest.raises(UserError, match="too short"):
        make_sample(hay, tok, 100, None)
    with pytest.raises(UserError):
        parse_depths("0.5,2")
    with pytest.raises(UserError):
        Haystack("x" * 10)
    assert parse_depths("uniform") == "uniform" and parse_depths("0,0.5") == [0.0, 0.5]
    with pytest.raises(UserError):
        NiahOptions(iters=(0,)).validate()


class AnswerKey:
    """The three fields score_answer reads from a sample."""

    def __init__(self, answer, candidates, format="char"):
        self.answer, self.candidates, self.format = answer, candidates, format


def test_score_answer():
    s = AnswerKey(answer="123456", candidates=["123456", "999999"])
    assert score_answer(" 123456.", s) == {"prediction": "123456", "format": "char", "exact": 1.0, "digits": 1.0,
                                           "candidate": 1.0}
    r = score_answer("123956", s)
    assert r["exact"] == 0.0 and r["digits"] == pytest.approx(5 / 6) and r["candidate"] == 0.0
    assert score_answer("999999", s)["candidate"] == 1.0 and score_answer("", s)["digits"] == 0.0


def test_token_format_reports_no_digits():
    # a one-token answer has no digits: "<v17>" for "<v23>" shares 3 of 5 characters, which is no accuracy
    s = AnswerKey(answer="<v23>", candidates=["<v23>", "<v17>"], format="token")
    assert score_answer("<v17>", s) == {"prediction": "<v17>", "format": "token", "exact": 0.0, "candidate": 1.0}
    recs = [score_answer(p, s) | {"iters": 1, "length": 512, "depth": 0.5} for p in ("<v23>", "<v17>")]
    summary = summarize(recs, [0.5])
    assert summary["format"] == "token" and summary["metrics"] == ["exact", "candidate"]
    assert "digits" not in json.dumps(summary)
    table = format_table(summary)
    assert "1-iter exact / candidate" in table.splitlines()[0] and "0.50 / 1.00" in table


def test_training_text_asks_every_needle_after_its_window(hay):
    text = training_text(hay, 20000, seed=2)
    assert len(text) == 20000 and text == training_text(hay, 20000, seed=2)
    first = re.split(r"(?<=[0-9]{6}\.)\n\n", text)[0]  # one record: a window with needles, then the questions
    planted = re.findall(r"The secret number for (ID-[0-9a-f]{4}) is ([0-9]{6})\.", first)
    keys = {k for k, _ in planted}
    assert keys and all(planted.count(p) == 2 for p in planted)  # once in the window, once asked


# ----------------------------------------------------------------------------- reading protocol


class Spy(nn.Module):
    """Wraps a model and records every call: the tokens given and the argmax at the last position."""

    def __init__(self, model):
        super().__init__()
        self.model, self.calls = model, []

    def forward(self, tokens, state=None):
        out = self.model(tokens, state)
        self.calls.append((tokens[0].tolist(), int(out.logits[0, -1].argmax())))
        return out


def test_each_read_writes_once_and_answering_never_writes(hay, tok):
    model = fwpkm_model(tok)
    s = make_sample(hay, tok, 300, 0.5, seed=0, index=0)
    spy = Spy(model)
    records, state = evaluate_sample(spy, tok, s, NiahOptions(iters=(1, 2, 3), piece=1000))
    assert [r["iters"] for r in records] == [1, 2, 3]
    mem = state["layers"][1]["memory"]
    assert mem.writes == 3 and mem.n_read == 0  # one write per read; the question and answer wrote nothing
    ctx, q = tok.encode(s.context).tolist(), tok.encode(s.question).tolist()
    # the question never leaks: each read is followed by the question and the model's own greedy tokens only
    calls = spy.calls
    starts = [i for i, (toks, _) in enumerate(calls) if toks == ctx]
    assert len(starts) == 3 and starts[0] == 0
    for a, b in zip(starts, starts[1:] + [len(calls)]):
        assert calls[a + 1][0] == q
        for prev, cur in zip(calls[a + 1 : b - 1], calls[a + 2 : b]):
            assert cur[0] == [prev[1]]  # a single token: the argmax of the previous call
    assert model.blocks[1].memory.frozen is False and model.blocks[1].memory.options.chunk_size == 16  # restored


def test_the_question_of_n_reads_sees_the_memory_of_n_minus_1_reads(hay, tok):
    """The paper's protocol: the last read is context + question in one call, so the question reads the
    memory before that read's write (1 read: the fresh memory) and the KV cache of every read."""
    model = fwpkm_model(tok)
    s = make_sample(hay, tok, 300, 0.5, seed=0, index=0)
    q = tok.encode(s.question).tolist()
    seen = []

    class StateSpy(Spy):
        def forward(self, tokens, state=None):
            if tokens[0].tolist() == q:
                mem = state["layers"][1].get("memory")
                seen.append((0 if mem is None else mem.writes, state["layers"][1]["mixer"]["k"].shape[-2]))
            return super().forward(tokens, state)

    records, state = evaluate_sample(StateSpy(model), tok, s, NiahOptions(iters=(1, 2, 3), piece=1000))
    n_ctx = len(tok.encode(s.context))
    assert seen == [(0, n_ctx), (1, 2 * n_ctx), (2, 3 * n_ctx)]
    assert state["layers"][1]["memory"].writes == 3  # each read's write still happens, after its outputs


def test_answers_reproduce_a_hand_written_n_iter_loop(hay, tok):
    model = fwpkm_model(tok, seed=1)
    s = make_sample(hay, tok, 250, None, seed=4, index=1)
    records, _ = evaluate_sample(model, tok, s, NiahOptions(iters=(2,), piece=100, max_new_tokens=8))
    layer = model.blocks[1].memory
    ctx = torch.as_tensor(tok.encode(s.context))
    q = torch.as_tensor(tok.encode(s.question))
    layer.options = type(layer.options)(**{**vars(layer.options), "chunk_size": ctx.numel()})
    with torch.no_grad():
        first = model(ctx[None]).state
        state = model(ctx[None], first).state
        assert state["layers"][1]["memory"].writes == 2
        # the paper's 2-iter: context + question in one call whose outputs precede its write, so the
        # question sees the KV cache of both reads and the memory written by the first read only
        state["layers"][1]["memory"] = first["layers"][1]["memory"]
        layer.frozen = True
        out = model(q[None], state)
        gen = []
        for _ in range(8):
            gen.append(int(out.logits[0, -1].argmax()))
            if len(tok.decode(gen).lstrip()) >= 6:
                break
            out = model(torch.tensor([[gen[-1]]]), out.state)
    assert records[0]["prediction"] == tok.decode(gen).strip()[:6]


class InductionOracle(nn.Module):
    """A 'model' whose state is every token it has read and which predicts, at the last position of each
    call, the token that followed the longest earlier match of the current suffix (up to 40 tokens): a
    perfect retriever of needles (NIAH only reads the last position's logits)."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, tokens, state=None):
        seen = (state["layers"][0]["mixer"] if state else "") + "".join(chr(t + 32) for t in tokens[0].tolist())
        logits = torch.zeros(1, tokens.shape[1], self.vocab)
        for k in range(min(40, len(seen) - 1), 0, -1):
            j = seen.rfind(seen[-k:], 0, len(seen) - 1)  # an earlier match, followed by at least one token
            if j >= 0:
                logits[0, -1, ord(seen[j + k]) - 32] = 1.0
                break
        return ModelOutput(logits, None, {"layers": [{"mixer": seen}], "head": None})


def test_a_perfect_retriever_scores_one_and_the_metrics_aggregate(hay, tok, tmp_path):
    samples = make_samples(hay, tok, [300, 450], "uniform", samples=3, seed=5)
    recs = evaluate_niah(InductionOracle(tok.vocab_size), tok, samples, NiahOptions(iters=(1, 2), piece=128))
    assert len(recs) == 12 and all(r["exact"] == 1.0 and r["digits"] == 1.0 for r in recs)
    summary = summarize(recs, "uniform", depth_bins=4)
    assert summary["iters"] == [1, 2] and summary["lengths"] == [300, 450]
    assert summary["by_iters"][2]["overall"] == {"samples": 6, "exact": 1.0, "digits": 1.0, "candidate": 1.0}
    assert sum(c["samples"] for c in summary["cells"] if c["iters"] == 1) == 6
    assert plot_niah(summary, tmp_path / "n.png").stat().st_size > 1000


def test_fresh_state_per_sample_unless_carried(hay, tok):
    model = fwpkm_model(tok, seed=2)
    a, b = make_samples(hay, tok, [250], "uniform", samples=2, seed=9)
    opts = NiahOptions(iters=(1,), piece=128, max_new_tokens=6)
    alone = evaluate_niah(model, tok, [b], opts)
    both = evaluate_niah(model, tok, [a, b], opts)
    assert both[1] == alone[0]
    _, state_a = evaluate_sample(model, tok, a, opts)
    _, state_b = evaluate_sample(model, tok, b, opts, state_a)
    assert state_a["layers"][1]["memory"].writes == 1 and state_b["layers"][1]["memory"].writes == 2


# ----------------------------------------------------------------------------- command


def test_niah_command_writes_json_and_png(hay, tok, tmp_path, capsys):
    from fastweights import cli
    from fastweights.checkpoints.format import save_model

    ckpt = tmp_path / "ckpt"
    model = fwpkm_model(tok)
    cfg = RunConfig(model=model.config, data=DataConfig(), train=TrainConfig(seq_len=64))
    save_model(model, ckpt, cfg, tok)
    out = tmp_path / "niah"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        argv = ["task", "niah", "--checkpoint", str(ckpt), "--lengths", "250", "--samples", "2", "--iters", "1,2",
                "--depths", "0,1", "--out", str(out), "--quiet", "--piece", "128"]
        assert cli.main(argv) == 0
        doc = json.loads((out / "niah.json").read_text())
        assert_json_shape(doc, "task_niah")
        assert (out / "niah.png").stat().st_size > 1000
        assert doc["summary"]["iters"] == [1, 2] and len(doc["records"]) == 2 * 2 * 2
        assert set(doc["summary"]["by_iters"]) == {"1", "2"} and doc["command"].startswith("fastweights")
        assert cli.main([*argv[:-3], "--depths", "2"]) == 2  # a user error: one line, exit status 2
        assert "error:" in capsys.readouterr().err


def test_run_niah_picks_the_format_itself_by_default(tok, hay):
    """A library call without ``fmt``: "auto", which for a character-level model is the character format (seed-14
    mutation draw: the command line always passes --format, so the default was never used)."""
    from fastweights.tasks.niah_run import run_niah

    run = run_niah(tiny_lm(tok.vocab_size), tok, "tinyshakespeare", [300], "uniform", samples=1, seed=0,
                   opts=NiahOptions())
    assert run.format == "char" and len(run.samples) == 1 and len(run.records) == 1


def test_run_niah_hands_its_progress_flag_to_the_evaluation(tok, monkeypatch):
    """The samples' progress bar is the one the caller asked for (seed-15 mutation draw: the flag dropped)."""
    from fastweights.tasks import niah_run

    asked = []
    monkeypatch.setattr(niah_run, "evaluate_niah", lambda *a, progress=False: asked.append(progress) or [])
    monkeypatch.setattr(niah_run, "summarize", lambda *a: {})
    for progress in (True, False):
        niah_run.run_niah(tiny_lm(tok.vocab_size), tok, "tinyshakespeare", [300], "uniform", samples=1, seed=0,
                          opts=NiahOptions(), fmt="char", progress=progress)
    assert asked == [True, False]
