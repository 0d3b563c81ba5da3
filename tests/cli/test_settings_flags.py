"""``fastweights.cli.settings``: flags generated from a settings dataclass (issue 48, scope 1) carry the field's
name, type, default, help and choices, booleans are flags, and the dataclass comes back from the parsed args."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from fastweights.cli import _Parser
from fastweights.cli.settings import add_settings, settings_from
from fastweights.core import numbers
from fastweights.core.config import setting_field
from fastweights.core.errors import UserError


@dataclass(frozen=True)
class Example:
    max_steps: int = setting_field(100, "training steps", type=numbers.positive_int)
    lr: float = setting_field(1e-3, "learning rate")
    rule: str = setting_field("sum", "update rule", choices=("sum", "delta"))
    limit: int | None = setting_field(None, "cap (default: none)")
    tuned: str | None = setting_field(None, "tuned file", metavar="FILE")
    digit_head: bool = setting_field(False, "digit output")
    layer_norm: bool = setting_field(True, "LayerNorm")


def _parser(**kw) -> argparse.ArgumentParser:
    p = _Parser(prog="t")
    add_settings(p, Example, **kw)
    return p


def _actions(p) -> dict:
    return {o: a for a in p._actions for o in a.option_strings}


def test_one_flag_per_field_with_its_default_type_help_and_choices():
    a = _actions(_parser())
    assert {"--max-steps", "--lr", "--rule", "--limit", "--digit-head", "--layer-norm", "--no-layer-norm"} <= set(a)
    assert (a["--max-steps"].default, a["--lr"].default, a["--rule"].default, a["--limit"].default) == \
        (100, 1e-3, "sum", None)
    assert a["--rule"].choices == ("sum", "delta") and a["--max-steps"].help == "training steps"
    help_text = " ".join(_parser().format_help().split())
    assert "training steps (default: 100)" in help_text and "LayerNorm (default: True)" in help_text
    # a field's metavar names its value (mutation caught, issue 49 seed 8: the metavar dropped)
    assert a["--tuned"].metavar == "FILE" and "--tuned FILE" in help_text


def test_the_dataclass_comes_back_from_the_parsed_flags():
    p = _parser()
    assert settings_from(p.parse_args([]), Example) == Example()
    got = settings_from(p.parse_args(["--max-steps", "7", "--lr", "0.5", "--rule", "delta", "--limit", "3",
                                      "--digit-head", "--no-layer-norm"]), Example)
    assert got == Example(max_steps=7, lr=0.5, rule="delta", limit=3, digit_head=True, layer_norm=False)
    assert isinstance(got.limit, int) and isinstance(got.lr, float)
    assert settings_from(p.parse_args([]), Example, lr=2.0).lr == 2.0  # a field the caller sets


def test_prefix_and_exclude():
    p = _parser(prefix="cache-", exclude={"limit"})
    a = _actions(p)
    assert "--cache-max-steps" in a and a["--cache-max-steps"].dest == "cache_max_steps" and "--cache-limit" not in a
    args = p.parse_args(["--cache-rule", "delta"])
    assert settings_from(args, Example, prefix="cache-", exclude={"limit"}) == Example(rule="delta")


@pytest.mark.parametrize("argv, words", [(["--max-steps", "0"], "--max-steps: must be >= 1, got 0"),
                                         (["--lr", "x"], "--lr"), (["--rule", "gated"], "invalid choice")])
def test_bad_input_is_one_line_naming_the_flag(argv, words):
    with pytest.raises(UserError, match=words) as e:
        _parser().parse_args(argv)
    assert "\n" not in str(e.value)


def test_a_setting_without_help_or_default_is_refused():
    @dataclass
    class NoHelp:
        x: int = 1

    @dataclass
    class Factory:
        x: list = field(default_factory=list, metadata={"help": "a list"})

    for cls in (NoHelp, Factory):
        with pytest.raises(TypeError, match=f"{cls.__name__}.x"):
            add_settings(argparse.ArgumentParser(), cls)
    with pytest.raises(TypeError, match="no field"):
        add_settings(argparse.ArgumentParser(), Example, exclude={"nope"})


def test_a_value_that_is_not_a_number_is_named_as_such():
    """The one line a bad number gives says what was expected (mutation caught: the message's words changed)."""
    with pytest.raises(numbers.BadNumber) as raised:
        numbers.nonneg_float("fast")
    assert str(raised.value) == "expected a number, got 'fast'"
    with pytest.raises(numbers.BadNumber) as raised:
        numbers.nonneg_int("1.5")
    assert str(raised.value) == "expected an integer, got '1.5'"
