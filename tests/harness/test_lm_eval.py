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
from fastweights.adapt.setup import DynamicSettings, load_model_and_tokenizer  # noqa: E402
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
