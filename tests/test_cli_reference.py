"""docs/cli.md, the reference of every command and flag, is what the parser gives (tools/cli_reference.py wrote
it): a flag's help, default or choices changed in the code and not in the page fails here."""

import pytest

from helpers import import_benchmark

cli_reference = import_benchmark("cli_reference")


def test_the_command_line_reference_is_current():
    page = cli_reference.PAGE.read_text()
    assert page == cli_reference.render(), "docs/cli.md is out of date: run python tools/cli_reference.py"


def test_every_command_and_flag_is_on_the_page():
    import argparse

    from fastweights.cli import build_parser

    page = cli_reference.render()
    for words, parser in cli_reference._commands(build_parser(), []):
        assert f"## `{' '.join(['fastweights', *words])}`" in page
        for action in parser._actions:
            if action.option_strings and action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction):
                assert f"`{action.option_strings[-1]}`" in page, (words, action.option_strings)


def test_check_says_when_the_page_is_stale(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "cli.md"
    stale.write_text("# old\n")
    monkeypatch.setattr(cli_reference, "PAGE", stale)
    assert cli_reference.main(["--check"]) == 1
    assert "out of date" in capsys.readouterr().err
    assert cli_reference.main([]) == 0 and cli_reference.main(["--check"]) == 0
    assert stale.read_text() == cli_reference.render()
    with pytest.raises(SystemExit):
        cli_reference.main(["--nope"])


def test_every_group_of_flags_has_a_title_in_its_commands_help():
    # a group's title is its heading in --help (the page lists flags only): a group without one runs its flags
    # into the section above
    from fastweights.cli import build_parser

    for words, parser in cli_reference._commands(build_parser(), []):
        text = parser.format_help()
        for group in parser._action_groups:
            if group._group_actions:
                assert isinstance(group.title, str) and group.title and f"\n{group.title}:\n" in text, (words, group)
