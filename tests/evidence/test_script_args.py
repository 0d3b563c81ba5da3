"""The benchmark scripts' command line, defined once (``fastweights.cli.script_parser``, issue 48): one parser
whose bad input is a ``UserError`` (one line, exit 2), one dry-run flag name (``--tiny``) and one output flag name
(``--out``)."""

import re

import pytest

from fastweights.core.errors import UserError
from fastweights.cli.script_parser import ScriptParser
from helpers import ROOT


def test_a_bad_argument_is_a_user_error_with_argparses_message():
    parser = ScriptParser(prog="x.py")
    parser.add_argument("--repeat", type=int, default=1)
    with pytest.raises(UserError, match="invalid int value: 'two'"):
        parser.parse_args(["--repeat", "two"])
    with pytest.raises(UserError, match="unrecognized arguments: --bogus"):
        parser.parse_args(["--bogus"])


def test_no_benchmark_has_a_parser_class_or_flag_names_of_its_own():
    found = {}
    for path in sorted([*(ROOT / "benchmarks").glob("*/*.py"), *(ROOT / "tools").glob("*.py")]):
        text = path.read_text()
        own = re.findall(r"class \w+\(argparse\.ArgumentParser\)|class BadInput\b|[\"']--(?:quick|out-dir)[\"']", text)
        if own:
            found[path.relative_to(ROOT).as_posix()] = own
    assert not found, f"use fastweights.cli.script_parser.ScriptParser, --tiny and --out: {found}"
