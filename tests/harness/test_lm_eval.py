"""The lm-evaluation-harness models (fastweights.harness): the harness's rolling log-likelihood on a shipped
local task equals ``fastweights dynamic eval``'s (static and dynamic), and no document's score leaks:
not from its own later tokens, not from its own token, not from other documents. A tiny untrained char
checkpoint; offline (the task's text comes from the corpora in the package)."""

import math

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.evaluator import simple_evaluate  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from fastweights.adapt.evaluate import evaluate_static_and_dynamic  # noqa: E402
from fastweights.adapt.setup import DynamicSettings  # noqa: E402
from fastweights.auto.sources import load_model_and_tokenizer  # noqa: E402
from fastweights.harness import TASKS  # noqa: E402
from fastweights.harness.corpora import documents  # noqa: E402
from fastweights.harness.models import FastweightsDynamic, FastweightsStatic  # noqa: E402
import helpers  # noqa: E402

TASK = "fastweights_heldout_plays"
PLAYS = ["hamlet_gut.txt", "julius_caesar_gut.txt", "macbeth_gut.txt", "othello_gut.txt"]
LIMIT = 2  # documents of the task the end-to-end runs score (the first two plays)
DYNAMIC = {"rule": "sgd", "lr": 0.03}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """An untrained char checkpoint whose vocabulary covers the task's text."""
    d = tmp_path_factory.mktemp("harness")
    text = "".join(doc["text"] for doc in documents("shakespeare-heldout", PLAYS, 2000, "ACT I"))
    return helpers.untrained_char_checkpoint(d, text)


def harness_loglikelihoods(model: str, model_args: dict) -> list[tuple[str, float]]:
    """(document text, log-likelihood) of the first LIMIT documents of TASK, through lm-eval's evaluator."""
    out = simple_evaluate(model=model, model_args=model_args, tasks=[TASK], limit=LIMIT, log_samples=True,
                          bootstrap_iters=0, task_manager=TaskManager(include_path=str(TASKS), include_defaults=False))
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    return [(s["doc"]["text"], float(s["filtered_resps"][0])) for s in samples]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_harness_equals_fastweights_dynamic_eval_static_and_dynamic(checkpoint):
    import fastweights.harness.models  # noqa: F401  (registers the models)

    static = harness_loglikelihoods("fastweights", {"checkpoint": str(checkpoint)})
    dynamic = harness_loglikelihoods("fastweights-dynamic", {"checkpoint": str(checkpoint), **DYNAMIC})
    texts = [t for t, _ in static]
    # the task's documents, unchanged: the excerpts the YAML names, in order
    assert texts == [d["text"] for d in documents("shakespeare-heldout", PLAYS, 2000, "ACT I")][:LIMIT]
    assert [t for t, _ in dynamic] == texts
    # `fastweights dynamic eval --checkpoint CK --rule sgd --lr 0.03` on the same texts (its engine)
    model, tok, cfg, ckpt = load_model_and_tokenizer(checkpoint, device="cpu")
    ref = evaluate_static_and_dynamic(DynamicSettings(**DYNAMIC), model, tok, cfg, texts, ckpt, progress=False)
    assert abs(sum(ll for _, ll in static) + ref["static"]["nll"]) < 1e-6
    assert abs(sum(ll for _, ll in dynamic) + ref["dynamic"]["nll"]) < 1e-6
    assert abs(ref["dynamic"]["nll"] - ref["static"]["nll"]) > 1.0  # the adaptation did something


def rolling(lm, texts: list[str]) -> list[float]:
    return lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)])


@pytest.fixture(scope="module")
def dynamic_lm(checkpoint):
    return FastweightsDynamic(checkpoint=str(checkpoint), device="cpu", **DYNAMIC)


def test_a_document_does_not_depend_on_other_documents(dynamic_lm):
    """Reset between documents: a document scores the same alone, first, or after others."""
    a, b = (d["text"][:300] for d in documents("shakespeare-heldout", PLAYS[:2], 2000, "ACT I"))
    alone = rolling(dynamic_lm, [a])[0]
    after = rolling(dynamic_lm, [b, a, b])
    assert after[1] == alone and after[0] == after[2]
    static = FastweightsStatic(checkpoint=dynamic_lm.ckpt, device="cpu")
    assert rolling(static, [a])[0] != alone  # adapted within the document


def test_a_document_does_not_depend_on_its_own_later_tokens(dynamic_lm):
    """Each prediction of a document scores the same when the document is cut right after it (whatever the
    cut: mid-segment or at a segment boundary, after updates)."""
    text = documents("shakespeare-heldout", ["macbeth_gut.txt"], 400, "ACT I")[0]["text"]
    full = dynamic_lm.token_losses(text)
    assert len(full) == len(text) - 1
    L = dynamic_lm.segment_len
    for k in (7, L + 1, 2 * L + 1, 3 * L + 9, 10 * L):
        cut = dynamic_lm.token_losses(text[:k])
        assert len(cut) == k - 1
        torch.testing.assert_close(torch.tensor(cut), torch.tensor(full[: k - 1]), rtol=0, atol=1e-5)
    changed = text[:200] + text[200:][::-1]  # the same first 200 characters, the rest different
    torch.testing.assert_close(torch.tensor(dynamic_lm.token_losses(changed)[:199]), torch.tensor(full[:199]),
                               rtol=0, atol=1e-5)


def test_a_token_is_scored_before_any_update_sees_it(dynamic_lm):
    """p(x_j | x_<j) summed over every value of x_j is 1 (an update that saw x_j first would raise its own
    probability), inside a segment after three updates."""
    tok = dynamic_lm.tokenizer
    text = documents("shakespeare-heldout", ["othello_gut.txt"], 200, "ACT I")[0]["text"]
    x = torch.as_tensor(tok.encode(text), dtype=torch.long)
    L = dynamic_lm.segment_len
    for j in (3 * L + 5,):
        total = 0.0
        for c in range(tok.vocab_size):
            y = x[: j + 1].clone()
            y[j] = c
            losses = dynamic_lm.score_document(y, keep_token_losses=True).token_losses
            total += math.exp(-losses[j - 1])
        assert abs(total - 1) < 1e-4, total


def test_loglikelihood_and_generation_use_the_trained_weights_and_say_so(dynamic_lm):
    static = FastweightsStatic(checkpoint=dynamic_lm.ckpt, device="cpu")
    reqs = [Instance("loglikelihood", {}, ("To be, or not", " to be"), 0)]
    with pytest.warns(UserWarning, match="trained weights"):
        dyn = dynamic_lm.loglikelihood(reqs)
    assert dyn == static.loglikelihood(reqs)
    ll, greedy = dyn[0]
    assert ll < 0 and isinstance(greedy, bool)
    gen = [Instance("generate_until", {}, ("ACT I", {"until": ["\n"], "max_gen_toks": 12}), 0)]
    text = static.generate_until(gen)[0]
    assert "\n" not in text and len(text) <= 12
    assert dynamic_lm.generate_until(gen) == [text]


def test_model_arguments_are_checked(checkpoint):
    from fastweights.core.errors import UserError

    with pytest.raises(UserError, match="exactly one"):
        FastweightsStatic()
    with pytest.raises(UserError, match="unknown model argument"):
        FastweightsStatic(checkpoint=str(checkpoint), rule="sgd")


def test_the_documented_command_lines_parse_and_name_what_exists():
    """docs/lm-eval-harness.md's `python -m fastweights.harness` lines: lm-eval's parser accepts them, the models
    are ours, every model argument is one the model takes, every task is a local one."""
    import inspect
    import shlex

    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import simple_parse_args_string

    from fastweights.harness import MODEL_NAMES
    from fastweights.harness.models import _SETTING_FIELDS, FastweightsLM

    lines = [ln for ln in (helpers.ROOT / "docs" / "lm-eval-harness.md").read_text().splitlines()
             if ln.startswith("python -m fastweights.harness ")]
    assert len(lines) >= 3
    local = {p.stem for p in TASKS.glob("*.yaml")}
    takes = set(inspect.signature(FastweightsLM.__init__).parameters) - {"self", "kwargs"}
    parser = HarnessCLI()._parser
    for line in lines:
        argv = shlex.split(line)[3:]
        if argv[0] == "ls":
            parser.parse_args(argv)
            continue
        args = parser.parse_args(["run", *argv])
        assert args.model in MODEL_NAMES, line
        model_args = args.model_args
        keys = set(model_args if isinstance(model_args, dict) else simple_parse_args_string(model_args))
        allowed = takes | (_SETTING_FIELDS if args.model == "fastweights-dynamic" else set())
        assert keys <= allowed, (line, keys - allowed)
        tasks = args.tasks if isinstance(args.tasks, list) else args.tasks.split(",")
        assert set(tasks) <= local, line


# ----------------------------------------------------------------------------- the command line's promises (issue 39)


@pytest.mark.parametrize("args, needle", [
    ({"segment_len": -5.0}, "segment_len=-5 (--segment-len of the command line): must be >= 0, got -5"),
    ({"segment_len": 2.5}, "segment_len=2.5"),
    ({"context": -1}, "must be >= 0, got -1"),
    ({"threads": -2}, "must be >= 0, got -2"),
    ({"context": 4, "segment_len": 8}, "context (4) must be longer than the segment length (8)"),
    ({"bos": "maybe"}, "bos=maybe must be true or false"),
])
def test_static_model_arguments_are_checked_as_the_command_line_checks_them(checkpoint, args, needle):
    from fastweights.core.errors import UserError

    with pytest.raises(UserError) as e:
        FastweightsStatic(checkpoint=str(checkpoint), device="cpu", **args)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("args, needle", [
    ({"lr": float("nan")}, "lr=nan (--lr of the command line): must be a finite number >= 0, got nan"),
    ({"lr": -1.0}, "must be a finite number >= 0, got -1.0"),
    ({"decay": float("inf")}, "decay=inf"),
    ({"eps": 0}, "eps=0 (--eps of the command line): must be a finite number > 0, got 0"),
    ({"lowrank_rank": -3}, "must be >= 0, got -3"),
    ({"lr_schedule": "sometimes"}, "lr_schedule=sometimes"),
    ({"stats_batch_size": 0}, "stats_batch_size=0 (--batch-size of dynamic stats of the command line): must be >= 1"),
    ({"stats_batches": -1}, "stats_batches=-1 (--max-batches of dynamic stats of the command line): must be >= 0"),
    ({"stats_seq_len": -1}, "stats_seq_len=-1 (--segment-len of dynamic stats of the command line): must be >= "),
    ({"no_tuned": "maybe"}, "model argument no_tuned=maybe must be true or false"),  # seed-16 mutation draw
    ({"bos": "2"}, "model argument bos=2 must be true or false"),
])
def test_dynamic_model_arguments_are_checked_as_the_command_line_checks_them(checkpoint, args, needle):
    from fastweights.core.errors import UserError

    with pytest.raises(UserError) as e:
        FastweightsDynamic(checkpoint=str(checkpoint), device="cpu", **{**DYNAMIC, **args})
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_diverged_score_is_refused_not_reported(checkpoint):
    """lr=1e30: dynamic eval refuses the NaN it produces (exit 2); so does the harness model."""
    from fastweights.core.errors import UserError

    lm = FastweightsDynamic(checkpoint=str(checkpoint), device="cpu", rule="sgd", lr=1e30)
    text = documents("shakespeare-heldout", PLAYS[:1], 2000, "ACT I")[0]["text"][:400]
    with pytest.raises(UserError, match="not a number to report: dynamic evaluation diverged with rule sgd, "
                                        "learning rate 1e\\+30 \\(try a smaller lr=\\)$"):  # the harness's name
        rolling(lm, [text])


def test_a_non_finite_loglikelihood_is_refused(checkpoint, monkeypatch):
    """loglikelihood (multiple-choice) requests refuse a NaN score as loglikelihood_rolling does."""
    from fastweights.core.errors import UserError

    lm = FastweightsStatic(checkpoint=str(checkpoint), device="cpu")
    forward = lm.model.forward

    def nan_logits(*a, **k):
        out = forward(*a, **k)
        out.logits[..., 0] = float("nan")
        return out

    monkeypatch.setattr(lm.model, "forward", nan_logits)
    with pytest.raises(UserError, match="loglikelihood: a log-likelihood is nan, not a number to report"):
        lm.loglikelihood([Instance("loglikelihood", {}, ("To be, or not", " to be"), 0)])


def test_a_batch_size_other_than_one_is_said_to_be_ignored(checkpoint, recwarn):
    FastweightsStatic(checkpoint=str(checkpoint), device="cpu", batch_size=1)
    assert not [w for w in recwarn if "batch_size" in str(w.message)]
    for size in (0, 8, "auto"):
        with pytest.warns(UserWarning, match=f"--batch_size {size} is ignored: requests are scored one at a time"):
            FastweightsStatic(checkpoint=str(checkpoint), device="cpu", batch_size=size)


def test_a_request_longer_than_the_context_reads_exactly_context_tokens(checkpoint):
    """A (context, continuation) pair longer than the context: the oldest tokens are cut so that exactly
    ``context`` tokens are read (not one fewer), and the score is the model's on those tokens."""
    lm = FastweightsStatic(checkpoint=str(checkpoint), device="cpu")
    window = lm.context
    text = documents("shakespeare-heldout", PLAYS[:1], 2000, "ACT I")[0]["text"]
    context, continuation = text[: 3 * window], text[3 * window: 3 * window + 5]
    ctx, cont = lm._encode_pair(context, continuation)
    whole = (ctx + cont)[-(window + 1):]
    seen = []
    forward = lm.model.forward

    def spy(x, *a, **k):
        seen.append(x.shape[1])
        return forward(x, *a, **k)

    lm.model.forward = spy
    try:
        (ll, _), = lm.loglikelihood([Instance("loglikelihood", {}, (context, continuation), 0)])
    finally:
        del lm.model.forward
    assert seen == [window]
    with torch.no_grad():
        logits = lm.model(torch.tensor([whole[:-1]])).logits[0, -len(cont):]
    want = float(torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(cont)[:, None]).sum())
    assert ll == pytest.approx(want, rel=1e-6, abs=1e-6)


def test_a_contexts_trailing_spaces_move_to_the_continuation(checkpoint):
    """lm-eval's tasks end a context with a space ("Question: ... Answer: ", "word"): those spaces are cut from the
    context and scored as the start of the continuation, never dropped, so ("To be, ", "or") is
    ("To be,", " or") in ids and in log-likelihood, the whole text encoded once. Mutation caught: the spaces cut
    from the context without being put before the continuation (issue 49)."""
    lm = FastweightsStatic(checkpoint=str(checkpoint), device="cpu")
    tok = lm.tokenizer
    ctx, cont = lm._encode_pair("To be,  ", "or")
    assert (ctx, cont) == lm._encode_pair("To be,", "  or")
    assert tok.decode(ctx) == "To be," and tok.decode(cont) == "  or"
    (a, _), (b, _) = lm.loglikelihood([Instance("loglikelihood", {}, ("To be,  ", "or"), 0),
                                       Instance("loglikelihood", {}, ("To be,", "  or"), 1)])
    assert a == b


def test_greedy_means_every_continuation_token_is_the_argmax(checkpoint):
    """The greedy flag of loglikelihood: True only when greedy decoding gives every token of the continuation
    (a continuation whose first token is the argmax and whose second is not is not greedy)."""
    lm = FastweightsStatic(checkpoint=str(checkpoint), device="cpu")
    tok = lm.tokenizer
    context = "To be, or not to b"
    ids = [int(i) for i in tok.encode(context)]
    with torch.no_grad():
        first = int(lm.model(torch.tensor([ids])).logits[0, -1].argmax())
        nxt = lm.model(torch.tensor([ids + [first]])).logits[0, -1]
    # the most likely second token that is not the argmax (and no whitespace, which _encode_pair would move)
    second = next(int(t) for t in nxt.argsort(descending=True)[1:] if tok.decode([int(t)]).strip())
    c1, c2, best = tok.decode([first]), tok.decode([second]), tok.decode([int(nxt.argmax())])
    assert c1.strip()
    reqs = [Instance("loglikelihood", {}, (context, c1), 0), Instance("loglikelihood", {}, (context, c1 + c2), 1),
            Instance("loglikelihood", {}, (context, c1 + best), 2)]
    (_, g1), (_, g12), (_, g_both) = lm.loglikelihood(reqs)
    assert g1 is True and g12 is False and g_both is True


def test_scores_far_worse_than_a_uniform_guess_are_refused(checkpoint, monkeypatch):
    """Issue 52: FWL heads reported 77-205 nats/token through the harness (uniform: 5.5) as results. A call whose mean
    loss is over twice a uniform guess's is refused in one line, for both request kinds; a sound model is not."""
    from fastweights.core.errors import UserError

    lm = FastweightsStatic(checkpoint=str(checkpoint), device="cpu")
    text = documents("shakespeare-heldout", PLAYS[:1], 2000, "ACT I")[0]["text"][:300]
    pairs = [Instance("loglikelihood", {}, ("To be, or not", " to be"), 0)]
    assert rolling(lm, [text])[0] < 0 and lm.loglikelihood(pairs)[0][0] < 0
    forward = lm.model.forward

    def confident_and_wrong(*a, **k):
        out = forward(*a, **k)
        out.logits = -1e3 * out.logits
        return out

    monkeypatch.setattr(lm.model, "forward", confident_and_wrong)
    for call, what in ((lambda: rolling(lm, [text]), "loglikelihood_rolling"), (lambda: lm.loglikelihood(pairs),
                                                                                 "loglikelihood")):
        with pytest.raises(UserError, match="x a uniform guess over the") as e:
            call()
        assert "\n" not in str(e.value) and str(e.value).startswith(f"fastweights {what}: "), e.value


@pytest.mark.parametrize("tasks, include, local_only", [
    (["--tasks", "fastweights_heldout_plays"], None, True),
    (["--tasks=fastweights_heldout_plays,fastweights_novels"], None, True),  # every local task, the = form
    (["--tasks", "fastweights_heldout_plays,hellaswag"], None, False),  # one of lm-eval's: the full index
    (["--tasks", "no_such_task"], None, False),  # lm-eval reports the misspelling from its full index
    (["--tasks", "fastweights_heldout_plays"], "elsewhere", False),  # the user's own include path
    ([], None, False),  # no --tasks (a subcommand)
])
def test_lm_evals_own_tasks_are_indexed_only_when_a_task_needs_them(tasks, include, local_only):
    """The documented commands name only the package's tasks: lm-eval's 14,000 task files are not read then."""
    import lm_eval.tasks

    from fastweights.harness.__main__ import _only_local_tasks_when_they_suffice

    args = ["--model", "fastweights", *tasks, "--include_path", include or str(TASKS)]
    full = lm_eval.tasks.TaskManager
    with _only_local_tasks_when_they_suffice(args, TASKS):
        inside = lm_eval.tasks.TaskManager
        if local_only:
            names = inside(include_path=str(TASKS)).all_tasks
            assert set(names) == {"fastweights_heldout_plays", "fastweights_novels"}  # none of lm-eval's
        else:
            assert inside is full
    assert lm_eval.tasks.TaskManager is full  # restored


def test_the_full_task_index_is_restored_when_the_run_fails():
    import lm_eval.tasks

    from fastweights.harness.__main__ import _only_local_tasks_when_they_suffice

    full = lm_eval.tasks.TaskManager
    with pytest.raises(RuntimeError), _only_local_tasks_when_they_suffice(
            ["--tasks", "fastweights_novels", "--include_path", str(TASKS)], TASKS):
        raise RuntimeError("the run failed")
    assert lm_eval.tasks.TaskManager is full


def test_a_preset_gives_the_dynamic_models_defaults_and_a_model_argument_wins(checkpoint, tmp_path, monkeypatch):
    """``preset=NAME``: the shipped setting of ``--preset NAME`` (here a stand-in folder of presets); the model
    arguments given win, segment_len included (0: not given). The static model has no such argument."""
    from fastweights.adapt import setup as adapt_setup
    from fastweights.core.errors import UserError

    (tmp_path / "small.toml").write_text('rule = "sgd"\nlr = 0.01\nsegment_len = 8\ncontext = 24\nstats_batches = 3\n')
    monkeypatch.setattr(adapt_setup, "_presets_dir", lambda: tmp_path)
    lm = FastweightsDynamic(checkpoint=str(checkpoint), preset="small")
    assert (lm.settings.rule, lm.settings.lr, lm.segment_len, lm.settings.stats_batches) == ("sgd", 0.01, 8, 3)
    assert lm.context == lm.settings.context == 24
    lm = FastweightsDynamic(checkpoint=str(checkpoint), preset="small", lr=0.02, segment_len=16, context=32)
    assert (lm.settings.lr, lm.segment_len, lm.settings.segment_len, lm.context) == (0.02, 16, 16, 32)
    with pytest.raises(UserError, match="no dynamic-evaluation preset 'large'"):
        FastweightsDynamic(checkpoint=str(checkpoint), preset="large")
    with pytest.raises(UserError, match="unknown model argument"):
        FastweightsStatic(checkpoint=str(checkpoint), preset="small")


def test_a_harness_run_keeps_each_documents_loglikelihood_in_document_order(monkeypatch):
    """``harness.runs.harness_run`` on a stand-in of lm-eval's simple_evaluate: the task's metrics of the "none"
    filter without their standard errors, and each logged document's text and log-likelihood sorted by doc id."""
    import sys
    import types

    from fastweights.harness.runs import harness_run

    asked = {}

    def simple_evaluate(**kw):
        asked.update(kw)
        return {"results": {"wiki": {"word_perplexity,none": 31.5, "word_perplexity_stderr,none": "N/A",
                                     "bits_per_byte,none": 0.9, "bits_per_byte,other": 2.0, "alias": "wiki"}},
                "samples": {"wiki": [{"doc_id": 1, "doc": {"name": "b", "text": "B"}, "filtered_resps": ["-7.5"]},
                                     {"doc_id": 0, "doc": {"name": "a", "text": "A"}, "filtered_resps": [-3.25]}]}}

    evaluator = types.ModuleType("lm_eval.evaluator")
    evaluator.simple_evaluate = simple_evaluate
    monkeypatch.setitem(sys.modules, "lm_eval", types.ModuleType("lm_eval"))
    monkeypatch.setitem(sys.modules, "lm_eval.evaluator", evaluator)
    out = harness_run("fastweights", {"pretrained": "x"}, "tasks", "wiki")
    assert asked == {"model": "fastweights", "model_args": {"pretrained": "x"}, "tasks": ["wiki"], "log_samples": True,
                     "bootstrap_iters": 0, "task_manager": "tasks"}
    assert out["metrics"] == {"word_perplexity": 31.5, "bits_per_byte": 0.9}
    assert out["documents"] == [{"name": "a", "text": "A", "loglikelihood": -3.25},
                                {"name": "b", "text": "B", "loglikelihood": -7.5}]
    assert 0 <= out["cpu_s"] < 60 and list(out) == ["metrics", "cpu_s", "documents"]


def test_sinks_reach_a_hugging_face_model_loaded_on_its_device(tmp_path):
    # sinks= is handed to the load that scores (the device's), not only to the CPU probe that finds a bad source
    pytest.importorskip("transformers")
    model, tok, d = helpers.tiny_gpt2_dir(tmp_path, positions=256)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    assert FastweightsStatic(hf=str(d), device="cpu", sinks=2).model.sinks == 2
    assert FastweightsStatic(hf=str(d), device="cpu").model.sinks == 4  # the default when not given
