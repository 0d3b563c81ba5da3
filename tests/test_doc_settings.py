"""Settings stated in the docs' prose are cited from the code that defines them (issue 48), as measured numbers
are cited from their results (``<!-- src: ... -->``, tools/report.py):

    `decay` 0.002 <!-- setting: fastweights.adapt.update_rules.DEFAULT_DECAY -->

- every ``<!-- setting: NAME -->`` marker follows the number it cites, and that number is the value of NAME:
  a module's constant, a class or dataclass attribute (a field's default), an attribute of an object
  (``RECIPE.block_lr``), a key of a dict (``PRETRAINED_FWL_DEFAULTS.ln_gain_init``), a parameter's default
  (``FastWeightRNN.lam``: the signature of the class or function) or a value of a shipped config
  (``configs/X.toml:model.options.fast_rnn.eta``);
- a sentence of a user's-guide page (README.md, docs/*.md but results.md) that says "default" and puts a number
  right after a named setting (```lr` 1e-5``, ```lam = 0.95```, ``--sinks`` (default 4)) cites each such
  number. The measurement write-ups (docs/results.md, docs/experiments/) state the settings a run used, which
  are not defaults, and are not scanned.

Not checked (kept short): numbers in tables (generated or about runs), in code blocks (commands are examples),
and a default stated without "default" in its sentence.
"""

from __future__ import annotations

import importlib
import inspect
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GUIDE = [ROOT / "README.md", *(p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "results.md")]
PAGES = [*GUIDE, ROOT / "docs" / "results.md", *sorted((ROOT / "docs" / "experiments").glob("*.md"))]
NUM = r"-?\d[\d,]*(?:\.\d+)?(?:e-?\d+)?"
MARKER = re.compile(rf"({NUM})`?\)?\s*<!-- setting: ([\w./:-]+) -->")
FENCE = re.compile(r"^```[^\n]*\n.*?^```[ \t]*$", re.S | re.M)
# a number right after a named setting (`lr` 1e-5, `lam = 0.95`) or after "default" ((default 4))
NAMED = re.compile(rf"`[\w.-]+`:?\s\(?(?:default:?\s)?({NUM})(?![\w.])|`[\w.]+ ?= ?({NUM})`"
                   rf"|\bdefault:?\s({NUM})(?![\w.])")


def resolve(name: str):
    """The value NAME stands for: ``FILE.toml:key.path`` a value of a shipped config; else the longest importable
    module prefix, then attributes, a last part that is no attribute being a parameter of the callable before it,
    whose default is taken."""
    if ".toml:" in name:
        file, _, keys = name.partition(":")
        value = tomllib.loads((ROOT / file).read_text())
        for key in keys.split("."):
            value = value[key]
        return value
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
            break
        except ModuleNotFoundError:
            continue
    else:
        raise LookupError(f"{name}: no module")
    for i, part in enumerate(parts[k:], k):
        if isinstance(obj, dict) and part in obj:
            obj = obj[part]
        elif hasattr(obj, part):
            obj = getattr(obj, part)
        elif callable(obj) and i == len(parts) - 1 and part in inspect.signature(obj).parameters:
            default = inspect.signature(obj).parameters[part].default
            if default is inspect.Parameter.empty:
                raise LookupError(f"{name}: parameter {part} has no default")
            return default
        else:
            raise LookupError(f"{name}: no attribute {part}")
    return obj


def shown_equals(shown: str, value) -> bool:
    """Whether the number shown is ``value`` exactly (a setting is shown as it is written, not rounded)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return float(shown.replace(",", "")) == value


def marker_problems(text: str, page: str) -> list[str]:
    out = []
    for m in MARKER.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        try:
            value = resolve(m.group(2))
        except (LookupError, ValueError, TypeError, OSError) as e:
            out.append(f"{page}:{line}: {m.group(2)} cannot be read ({e})")
            continue
        if not shown_equals(m.group(1), value):
            out.append(f"{page}:{line}: {m.group(1)} cites {m.group(2)} = {value!r}")
    return out


def uncited_defaults(text: str, page: str) -> list[str]:
    """Numbers right after a named setting, in a prose sentence that says "default", without a marker."""
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    prose = "\n".join("" if line.lstrip().startswith("|") else line for line in prose.split("\n"))  # tables
    out = []
    for sentence in re.finditer(r"(?:[^.!?]|\.(?=\d|\w)|<!--.*?-->)+", prose, re.S):
        if "default" not in sentence.group(0).lower():
            continue
        for m in NAMED.finditer(sentence.group(0)):
            end = sentence.start() + m.end()
            if not re.match(r"`?\)?\s*<!-- setting: ", prose[end:end + 20]):
                line = prose.count("\n", 0, sentence.start() + m.start()) + 1
                out.append(f"{page}:{line}: {m.group(0)!r} states a default without <!-- setting: NAME -->")
    return out


def test_every_cited_setting_is_the_value_of_what_it_cites():
    problems = [p for page in PAGES for p in marker_problems(page.read_text(), str(page.relative_to(ROOT)))]
    assert problems == []


def test_no_guide_page_states_a_default_number_without_citing_it():
    problems = [p for page in GUIDE for p in uncited_defaults(page.read_text(), str(page.relative_to(ROOT)))]
    assert problems == []


def test_the_checks_catch_a_drifted_number_an_unreadable_name_and_an_uncited_default():
    good = "`decay` 0.002 <!-- setting: fastweights.adapt.update_rules.DEFAULT_DECAY -->"
    assert marker_problems(good, "p.md") == [] and uncited_defaults(f"The default: {good}.", "p.md") == []
    assert marker_problems(good.replace("0.002", "0.003"), "p.md")
    assert "cannot be read" in marker_problems("1 <!-- setting: fastweights.adapt.update_rules.NOPE -->", "p.md")[0]
    assert marker_problems("0.95 <!-- setting: fastweights.layers.fast_rnn.FastWeightRNN.lam -->", "p.md") == []
    assert marker_problems("0.5 <!-- setting: fastweights.layers.fast_rnn.FastWeightRNN.lam -->", "p.md")
    assert marker_problems("1e-5 <!-- setting: fastweights.hf.fwl_training.RECIPE.block_lr -->", "p.md") == []
    assert marker_problems("0.05 <!-- setting: fastweights.hf.fwl_head.PRETRAINED_FWL_DEFAULTS.ln_gain_init -->",
                           "p.md") == []
    assert marker_problems("5e-4 <!-- setting: configs/shakespeare-char-fast-rnn.toml:model.options.fast_rnn.eta -->",
                           "p.md") == []
    assert marker_problems("0.5 <!-- setting: configs/shakespeare-char-fast-rnn.toml:model.options.fast_rnn.eta -->",
                           "p.md")
    for uncited in ("By default `lr` 1e-5 is used.", "Defaults `lam = 0.95`, `eta = 0.5`.",
                    "the first `--sinks` tokens (default 4) are kept by default."):
        assert uncited_defaults(uncited, "p.md"), uncited
    assert uncited_defaults("`lr` 1e-5 is used.", "p.md") == []  # no "default" in the sentence: not a default
    assert uncited_defaults("By default:\n\n```\nfastweights eval --lr 1e-5\n```\n", "p.md") == []  # a command


@pytest.mark.parametrize("shown,value,same", [("0.002", 0.002, True), ("2e-5", 2e-5, True), ("1,024", 1024, True),
                                              ("4", 4, True), ("4", 4.5, False), ("0.95", 0.951, False),
                                              ("1", True, False)])
def test_a_shown_number_equals_its_value_to_the_digits_shown(shown, value, same):
    assert shown_equals(shown, value) is same
