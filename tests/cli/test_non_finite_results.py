"""No nan result (issue 32 item 4): every command that prints a loss or perplexity refuses a non-finite one in
one line naming the cause (for dynamic evaluation the rule and learning rate), exit 2, and writes no result file."""

from __future__ import annotations

import math

import pytest

from fastweights.cli import main
from helpers import stderr_text
from fastweights.core.errors import UserError, non_finite_score, refuse_non_finite

DIVERGE = ["--lr", "1e30", "--quiet"]


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    path = tmp_path_factory.mktemp("diverge") / "doc.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    return str(path)


def _one_line(capsys) -> str:
    err = stderr_text(capsys)
    assert err.count("\n") == 0, err
    return err


@pytest.mark.parametrize("argv", [
    ["dynamic", "eval", "--rule", "sgd"],
    ["eval", "--dynamic", "sgd"],
], ids=["dynamic-eval", "eval-dynamic"])
def test_diverged_dynamic_evaluation_is_refused(tiny_run, doc, capsys, argv):
    assert main([*argv, "--checkpoint", str(tiny_run), "--data", doc, *DIVERGE]) == 2
    line = _one_line(capsys)
    assert "nan" in line and "rule sgd" in line and "learning rate 1e+30" in line


def test_diverged_stream_and_continual_write_nothing(tiny_run, doc, tmp_path, capsys):
    out = tmp_path / "stream"
    assert main(["eval", "--stream", "--checkpoint", str(tiny_run), "--data", doc, "--modes", "carry",
                 "--dynamic", "sgd", "--out", str(out), *DIVERGE]) == 2
    assert "rule sgd" in _one_line(capsys) and not list(tmp_path.iterdir())
    assert main(["continual", "--checkpoint", str(tiny_run), "--domain", f"a={doc}", "--domain", f"b={doc}",
                 "--adapt-tokens", "300", "--eval-tokens", "100", "--dynamic", "sgd", "--out", str(tmp_path / "c"),
                 *DIVERGE]) == 2
    assert "rule sgd" in _one_line(capsys) and not list(tmp_path.iterdir())


def test_a_finite_learning_rate_still_reports(tiny_run, doc, capsys):
    assert main(["dynamic", "eval", "--rule", "sgd", "--lr", "1e-3", "--checkpoint", str(tiny_run), "--data", doc,
                 "--quiet"]) == 0
    assert "nats/token" in capsys.readouterr().out


def test_refuse_non_finite_finds_nested_scores_and_skips_curves():
    assert non_finite_score({"static": {"loss_nats": 1.0}, "curve": [math.nan]}) is None
    assert non_finite_score({"runs": [{"perplexity": math.inf}]}) == ("runs[0].perplexity", math.inf)
    assert non_finite_score({"nll": [[1.0, math.nan]]})[0] == "nll"
    with pytest.raises(UserError, match="dynamic.bits_per_char is nan.*because"):
        refuse_non_finite({"dynamic": {"bits_per_char": math.nan}}, "because")
