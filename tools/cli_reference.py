"""Write docs/cli.md, the reference of every ``fastweights`` command and flag, from the parser itself, so the page
cannot drift from the code (each flag's help, default and choices are defined once, where the flag is).

    python tools/cli_reference.py            # rewrite docs/cli.md
    python tools/cli_reference.py --check    # exit 1 if docs/cli.md is not what the parser gives (the tests run it)

The page is built from argparse's actions, not from ``--help``'s text, whose layout changes with the terminal's
width and the Python version.
"""

from __future__ import annotations

import argparse
import html
import sys
from pathlib import Path

from fastweights.cli import build_parser

PAGE = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
HEAD = """# Command-line reference

Every command of `fastweights` and every flag, with its default and what it does: the same words as
`fastweights COMMAND --help`. Generated from the parser by `python tools/cli_reference.py` (a test fails when this
page is out of date); the guides in [docs/](README.md) say when to use which.
"""


def _commands(parser: argparse.ArgumentParser, words: list[str]):
    """(the command's words, its parser), the top level first, then each subcommand in the order it was added."""
    yield words, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, [*words, name])


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _flag(action: argparse.Action) -> str:
    name = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.metavar or action.dest}`"
    if action.choices is not None:
        return f"{name} {{{', '.join(map(str, action.choices))}}}"
    return f"{name} {action.metavar or action.dest.upper()}" if action.nargs != 0 and action.option_strings else name


def _text(block: str | None) -> str:
    """A description or epilog as --help shows it (the parsers keep their line breaks): preformatted text, not a
    fenced block, which the docs' tests would read as commands to run."""
    return f"\n<pre>\n{html.escape(block.strip())}\n</pre>\n" if block and block.strip() else ""


def render() -> str:
    parts = [HEAD]
    for words, parser in _commands(build_parser(), []):
        formatter = parser._get_formatter()  # the command's own: each help ends with its default
        parts.append(f"\n## `{' '.join(['fastweights', *words])}`\n{_text(parser.description)}")
        rows = [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
                and a.help != argparse.SUPPRESS]
        if rows:
            parts.append("\n| flag | what it does |\n| --- | --- |\n")
            parts.extend(f"| {_cell(_flag(a))} | {_cell(formatter._expand_help(a) if a.help else '')} |\n"
                         for a in rows)
        parts.append(_text(parser.epilog))
    return "".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the page is out of date instead of writing it")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if PAGE.read_text() != text:
            print(f"{PAGE} is out of date: run python tools/cli_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
