"""The mutant bars (``tests/mutants/*_bar.json``) can still be re-applied: each mutant's original line occurs
exactly once in its file and differs from the mutant, and each test it names exists. Only that: applying the
mutants and running their tests is ``python tools/mutation_check.py --bar FILE``, outside the default
suite (once per mutant). A code change that moves a bar's line fails here, so the bar is updated with it rather
than found stale when it is next run."""

import ast
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BARS = sorted(Path(__file__).parent.glob("*_bar.json"))


def test_there_is_a_bar():
    assert BARS


def _test_names(path: Path) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}


@pytest.mark.parametrize("bar", BARS, ids=lambda p: p.name)
def test_every_mutant_of_the_bar_applies_and_names_existing_tests(bar):
    mutants = json.loads(bar.read_text())
    assert isinstance(mutants, list) and mutants
    for m in mutants:
        text = (ROOT / m["file"]).read_text()
        assert text.count(m["original"]) == 1, (m["file"], m["original"])
        assert m["mutant"] != m["original"] and m["tests"], m
        for node in m["tests"]:
            file, _, name = node.partition("::")
            assert name and name.split("[")[0] in _test_names(ROOT / file), node
