"""Every option of every command explains itself in ``--help`` (issue 33, scope 5).

The rule, per parser of ``fastweights`` (the top level, every command and every subcommand, as
:func:`fastweights.cli.build_parser` builds them), per argument except ``-h/--help`` and the
subcommand choosers:

- its help text is non-empty;
- it shows a default, unless a default is meaningless: a flag (an option that takes no value:
  ``store_true``, ``store_false``, ``store_const``, ``count``) and a required argument (a positional,
  ``required=True``, or a member of a required mutually exclusive group) have none to show. Otherwise
  a default that is not None is shown as ``(default: VALUE)`` in the help the parser prints, with
  VALUE the parser's own default (so the shown value cannot drift from the real one); a default of
  None (or an empty text or list) means "decided at run time", and the help must then say in words what happens, with the word
  ``default`` (e.g. "default: the checkpoint's test split").
"""

from __future__ import annotations

import argparse

import pytest

from fastweights.experiments.demo import DEMO_STEPS

from fastweights.cli import build_parser

FLAG_ACTIONS = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction,
                argparse._CountAction, argparse._AppendConstAction)


def _parsers(parser=None, prog=None):
    """(prog, parser) of the top level and of every command and subcommand."""
    parser = parser or build_parser()
    yield parser.prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub)


def _arguments():
    for prog, parser in _parsers():
        required_groups = {id(a) for g in parser._mutually_exclusive_groups if g.required for a in g._group_actions}
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction, argparse._VersionAction)):
                continue
            name = "/".join(action.option_strings) or action.dest
            yield pytest.param(parser, action, id(action) in required_groups, id=f"{prog} {name}")


ARGUMENTS = list(_arguments())


def test_the_walk_finds_every_command():
    progs = {prog for prog, _ in _parsers()}
    for prog in ("fastweights train", "fastweights eval", "fastweights generate", "fastweights dynamic eval",
                 "fastweights dynamic tune", "fastweights task niah", "fastweights inspect addressing",
                 "fastweights continual", "fastweights demo", "fastweights export-hf", "fastweights data list"):
        assert prog in progs
    assert len(ARGUMENTS) > 200  # every option of every command, not a few


def shown_help(parser, action) -> str:
    """The help of ``action`` as ``parser --help`` prints it (defaults expanded), on one line."""
    formatter = parser._get_formatter()
    return " ".join(formatter._expand_help(action).split()) if action.help else ""


@pytest.mark.parametrize("parser, action, in_required_group", ARGUMENTS)
def test_every_option_has_help_and_shows_its_default(parser, action, in_required_group):
    text = shown_help(parser, action)
    assert action.help not in (None, argparse.SUPPRESS) and text.strip(), "no help text"
    if isinstance(action, FLAG_ACTIONS) or action.required or in_required_group:
        assert "(default: " not in text, f"a flag or a required argument shows a default: {text!r}"
        return
    if action.default in (None, "", []):
        assert "default" in text.lower(), f"default None and the help does not say what happens without it: {text!r}"
    else:
        value = ",".join(map(str, action.default)) if isinstance(action.default, list) else str(action.default)
        assert any(f"(default: {v})" in text for v in (value, action.default, repr(action.default))), \
            f"default {action.default!r} not shown: {text!r}"
        assert text.lower().count("default") == 1, f"the default is given twice (by hand and shown): {text!r}"


def test_printed_help_shows_defaults():
    """What a user sees: `fastweights task niah --help` prints the defaults the issue found missing."""
    parser = dict(_parsers())
    text = " ".join(parser["fastweights task niah"].format_help().split())
    assert "(default: 1024,2048,4096)" in text and "(default: 10)" in text
    assert "(default: 300)" in " ".join(parser["fastweights dynamic generate"].format_help().split())
    assert f"(default: {DEMO_STEPS})" in " ".join(parser["fastweights demo"].format_help().split())


def test_one_name_per_idea():
    """The same idea has the same flag: a learning rate is --lr, an attention context --context; no command
    keeps an older spelling of either."""
    retired = {"--seq-len", "--dynamic-lr", "--learning-rate"}
    for prog, parser in _parsers():
        for action in parser._actions:
            assert not retired & set(action.option_strings), f"{prog}: {action.option_strings}"
            if "--lr" in action.option_strings:
                assert "learning rate" in action.help
            if "--context" in action.option_strings:
                assert "context" in action.help


def test_out_is_a_directory_everywhere():
    """--out has one meaning: the directory a command writes into."""
    for prog, parser in _parsers():
        for action in parser._actions:
            if "--out" in action.option_strings:
                assert action.metavar == "DIR", f"{prog} --out: {action.metavar}"
                assert "directory" in action.help, f"{prog} --out: {action.help}"


def test_every_command_says_what_it_does():
    """`fastweights SUB --help` opens with a description for every command and subcommand (issue 40: `train` and
    `generate` had none), a sentence that starts with a capital."""
    for prog, parser in _parsers():
        text = (parser.description or "").strip()
        assert text and text[0].isupper(), f"{prog} --help has no description"
        printed = parser.format_help()
        assert text.splitlines()[0] in printed, prog
    for name in ("fastweights train", "fastweights generate"):
        assert dict(_parsers())[name].format_help().split("\n\n")[1].strip(), name  # the line after the usage


def test_train_help_lists_every_preset_with_its_description(tmp_path, monkeypatch):
    from fastweights.core.config import list_presets, preset_descriptions

    text = dict(_parsers())["fastweights train"].format_help()
    listing = text.split("presets (")[1]
    rows = {line.split()[0]: line for line in listing.splitlines()[1:] if line.startswith("  ")}
    assert set(rows) == set(list_presets()) and "shakespeare-char" in rows and "tiny" in rows
    described = preset_descriptions()
    for name, line in rows.items():  # one line each, the description from the TOML's opening comment
        assert described[name] in line and "\n" not in described[name]
    assert described["tiny"] == "A model small enough for tests: seconds on a CPU"
    # a preset of one's own (./configs) is listed with the first sentence of its comment, shortened when long
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "mine.toml").write_text(
        "# My preset (a note): " + "very " * 40 + "long, and more. Second sentence.\n\n[train]\nmax_steps = 1\n")
    (tmp_path / "configs" / "bare.toml").write_text("[train]\nmax_steps = 1\n")
    (tmp_path / "configs" / "wrapped.toml").write_text("# A sentence the comment\n# wraps, on GPT-X. Not this.\n[train]\n")
    (tmp_path / "configs" / "latin1.toml").write_bytes(b"# Caf\xe9 preset.\n[train]\nmax_steps = 1\n")  # not UTF-8
    monkeypatch.chdir(tmp_path)
    described = preset_descriptions()
    assert described["latin1"].startswith("Caf") and described["latin1"].endswith("preset")  # listed, not a crash
    mine = described["mine"]
    assert mine.startswith("My preset: very very") and mine.endswith("...") and len(mine) <= 100, mine
    assert described["bare"] == ""
    assert described["wrapped"] == "A sentence the comment wraps, on GPT-X"  # lines joined by a space; one "." cut
    assert "  mine " in dict(_parsers())["fastweights train"].format_help()


def test_a_preset_that_cannot_be_read_is_listed_without_a_description(tmp_path, monkeypatch):
    """The listing under ``train --help`` never fails on one unreadable preset: it is listed, described by ""."""
    from pathlib import Path

    from fastweights.core.config import preset_descriptions

    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "locked.toml").write_text("# Locked preset.\n[train]\nmax_steps = 1\n")
    monkeypatch.chdir(tmp_path)
    read_text = Path.read_text

    def refuse(self, *a, **k):
        if self.name == "locked.toml":
            raise PermissionError(13, "Permission denied", str(self))
        return read_text(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", refuse)
    described = preset_descriptions()
    assert described["locked"] == "" and described["tiny"]  # the others keep theirs
