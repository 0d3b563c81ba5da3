"""One default per setting (issue 38, scope 6; issue 48, scope 1): each default is defined once and read by the
library, the command line and the harness.

- Every parser of ``fastweights`` is walked; every flag whose dest is a field of a workflow's settings dataclass
  (the task configs, the neural cache, the ``fwl-head train`` recipe) takes that field's default and shows it in
  its help. Most of these flags are generated from the dataclass (``cli.settings``); the walk catches one typed by
  hand with its own value.
- The dynamic-evaluation flags, whose defaults are decided at run time (None, 0) where the library's settings
  have them, are checked by name: every option that shows a default for one of these settings (the rule, lr,
  decay, eps, segment length and gradient-statistics batches) shows the library's constant, in its default or in
  its help. An option of one of these names on a command this test does not know fails, so a new command cannot
  bring its own default unseen.
- The library's own signatures (the evaluators, ``DynamicSettings``, ``train_recipe`` / ``train_head``, the
  harness models) read the same constants, and each constant has one definition in ``src/``.
- The recommended SmolLM2 setting is the one ``smollm2_dynamic_eval.json`` chose, and no other page or docstring
  gives SmolLM2 a learning rate.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import shlex
from pathlib import Path

import pytest

from fastweights.adapt import update_rules as ur
from fastweights.adapt.cache import CacheSettings
from fastweights.adapt.dynamic import DynamicEvaluator
from fastweights.adapt.grad_stats import collect_grad_stats
from fastweights.adapt.lowrank import LowRankDynamicEvaluator
from fastweights.adapt.setup import DynamicSettings
from fastweights.adapt.sparse import SparseDynamicEvaluator
from fastweights.cli import build_parser, parse_command_line
from fastweights.cli.settings import flag_dest
from fastweights.hf.fwl_training import RECIPE, FWLHeadRecipe, train_head, train_recipe
from fastweights.tasks.assoc import AssocConfig
from fastweights.tasks.ba_retrieval import BaRetrievalConfig
from fastweights.tasks.niah import NiahOptions

ROOT = Path(__file__).resolve().parents[2]


def _parsers(parser=None):
    parser = parser or build_parser()
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def shown_help(parser, action) -> str:
    return " ".join(parser._get_formatter()._expand_help(action).split()) if action.help else ""


# The workflows' settings and where their flags live: (dataclass, flag prefix) per command. A prefixed dest
# (cache_window) is checked on every command that has it, an unprefixed one (lr) on these commands only.
DYNAMIC = (DynamicSettings, "")  # the dynamic commands' flags of its fields (dynamic stats: the adapted weights')
WORKFLOWS = {"fastweights task assoc": [(AssocConfig, "")],
             "fastweights task ba-retrieval": [(BaRetrievalConfig, "")],
             "fastweights dynamic eval": [(CacheSettings, "cache-"), DYNAMIC],
             "fastweights dynamic tune": [DYNAMIC], "fastweights dynamic timescale": [DYNAMIC],
             "fastweights dynamic generate": [DYNAMIC],
             "fastweights fwl-head train": [(FWLHeadRecipe, "")],
             "fastweights task niah": [(NiahOptions, "")]}


def _workflow_fields(prog: str) -> dict:
    """dest -> (dataclass, field) of the settings a flag of ``prog`` may carry."""
    out = {}
    for workflows in WORKFLOWS.values():
        for cls, prefix in workflows:
            if prefix or (cls, prefix) in WORKFLOWS.get(prog, []):
                out.update({flag_dest(f, prefix): (cls, f) for f in dataclasses.fields(cls)})
    return out


def test_every_flag_of_a_workflow_setting_takes_the_fields_default_and_shows_it():
    checked = {}
    for parser in _parsers():
        fields = _workflow_fields(parser.prog)
        for action in parser._actions:
            if action.dest not in fields or not action.option_strings:
                continue
            cls, f = fields[action.dest]
            flag = "/".join(action.option_strings)
            assert action.default == f.default and type(action.default) is type(f.default), \
                f"{parser.prog} {flag}: default {action.default!r}, {cls.__name__}.{f.name} is {f.default!r}"
            if f.default is None:  # a default found elsewhere (a tuned file, the model): its help says which
                assert "default: " in shown_help(parser, action), f"{parser.prog} {flag}: default not said"
            elif action.nargs != 0 or isinstance(action, argparse.BooleanOptionalAction):  # a value, or --x/--no-x
                assert f"(default: {f.default})" in shown_help(parser, action), f"{parser.prog} {flag}: default not shown"
            checked.setdefault(parser.prog, set()).add(action.dest)
    assert set(checked) >= set(WORKFLOWS), f"commands without their settings' flags: {set(WORKFLOWS) - set(checked)}"
    assert len(checked["fastweights task assoc"]) == 16 and len(checked["fastweights task ba-retrieval"]) == 22
    assert len(checked["fastweights dynamic eval"]) == 19 and len(checked["fastweights dynamic tune"]) == 11 and len(checked["fastweights fwl-head train"]) >= 9


def _options(parser) -> dict:
    return {o: a for a in parser._actions for o in a.option_strings}


def _is_dynamic(parser) -> bool:
    """A command with the dynamic-evaluation flags (``dynamic ...``, ``eval --dynamic``, ``continual --dynamic``)."""
    return "--lr-schedule" in _options(parser)


# What a dynamic-evaluation command must show, per option: (the parser's default, words its help must hold).
# lr and decay default to None (the tuned file, else the library's value, which the help names).
def _dynamic_expectations(prog: str) -> dict:
    seg = [f"{ur.DEFAULT_SEGMENT_LEN} for char/byte", f"{ur.SUBWORD_SEGMENT_LEN} for subword"]
    out = {"--rule": (ur.DEFAULT_RULE, []), "--dynamic": (None, []), "--lr": (None, [f"else {ur.DEFAULT_LR:g})"]),
           "--decay": (None, [f"else {ur.DEFAULT_DECAY:g})"]), "--eps": (ur.DEFAULT_EPS, []), "--segment-len": (0, seg),
           "--lr-schedule": ("constant", [])}
    if prog == "fastweights dynamic tune":
        out["--decays"] = (None, [f"default: {ur.DEFAULT_DECAY:g} x segment length"])
    return out


STATS = {"--batch-size": (ur.DEFAULT_STATS_BATCH_SIZE, []), "--max-batches": (ur.DEFAULT_STATS_BATCHES, []),
         "--segment-len": (0, [f"{ur.DEFAULT_SEGMENT_LEN} for char/byte", f"{ur.SUBWORD_SEGMENT_LEN} for subword"])}
# the names of these settings; on any other command they must be a setting this test knows is another one
WATCHED = {"--rule", "--dynamic", "--lr", "--decay", "--decays", "--eps", "--segment-len", "--windows", "--minutes",
           "--batch-size", "--max-batches"}
# other settings of the same name: training learning rates, a fast-weight task's rule, other budgets and batches
# (the workflows' own flags are checked by the walk above)
OTHER_SETTINGS = {"fastweights demo": {"--minutes"}, "fastweights task assoc": {"--rule", "--lr", "--batch-size"},
                  "fastweights task ba-retrieval": {"--lr", "--batch-size"},
                  "fastweights fwl-head train": {"--windows", "--minutes", "--lr"}}


def _expectations(parser) -> dict:
    if parser.prog == "fastweights dynamic stats":
        return STATS
    if _is_dynamic(parser):
        return _dynamic_expectations(parser.prog)
    return {}


def test_every_shown_default_of_these_settings_is_the_librarys():
    checked = 0
    for parser in _parsers():
        expect = _expectations(parser)
        for option, action in _options(parser).items():
            if option in expect:
                default, words = expect[option]
                assert action.default == default, f"{parser.prog} {option}: default {action.default!r}, the library's {default!r}"
                text = shown_help(parser, action)
                for w in words:
                    assert w in text, f"{parser.prog} {option}: the help does not say {w!r}: {text!r}"
                checked += 1
            elif option in WATCHED:
                assert option in OTHER_SETTINGS.get(parser.prog, ()), \
                    f"{parser.prog} {option} (default {action.default!r}): a setting this test does not know; check it here"
    assert checked >= 35  # six dynamic commands, dynamic stats


def test_unset_flags_resolve_to_the_librarys_settings():
    """Nothing given on the command line: the settings the command hands the library are the library's defaults."""
    from fastweights.cli.dynamic import dynamic_settings

    args = build_parser().parse_args(["dynamic", "eval", "--checkpoint", "x"])
    s = dynamic_settings(args)
    lib = DynamicSettings()
    assert (s.rule, s.lr, s.decay, s.segment_len) == (lib.rule, lib.lr, lib.decay, lib.segment_len)
    assert s.eps == ur.DEFAULT_EPS and ur.parse_schedule(s.lr_schedule) == ur.parse_schedule(lib.lr_schedule)
    stats = build_parser().parse_args(["dynamic", "stats", "--checkpoint", "x"])
    assert (stats.batch_size, stats.max_batches) == (lib.stats_batch_size, lib.stats_batches)
    fwl = build_parser().parse_args(["fwl-head", "train", "--out", "x"])
    assert (fwl.windows, 60.0 * fwl.minutes, fwl.lr, fwl.seed, fwl.variant) == \
        (RECIPE.windows, RECIPE.budget_cpu_s, RECIPE.lr, RECIPE.seed, RECIPE.variant)


def _defaults(fn) -> dict:
    return {k: p.default for k, p in inspect.signature(fn).parameters.items() if p.default is not inspect.Parameter.empty}


@pytest.mark.parametrize("cls", [DynamicEvaluator, SparseDynamicEvaluator, LowRankDynamicEvaluator])
def test_the_evaluators_read_the_same_constants(cls):
    d = _defaults(cls.__init__)
    assert (d["rule"], d["lr"], d["decay"], d["eps"], d["segment_len"]) == \
        (ur.DEFAULT_RULE, ur.DEFAULT_LR, ur.DEFAULT_DECAY, ur.DEFAULT_EPS, ur.DEFAULT_SEGMENT_LEN)


def test_the_library_settings_recipe_and_harness_read_the_same_constants():
    lib = DynamicSettings()
    assert (lib.rule, lib.stats_batch_size, lib.stats_batches) == \
        (ur.DEFAULT_RULE, ur.DEFAULT_STATS_BATCH_SIZE, ur.DEFAULT_STATS_BATCHES)
    assert _defaults(collect_grad_stats)["batch_size"] == ur.DEFAULT_STATS_BATCH_SIZE
    r = _defaults(train_recipe)
    assert (r["variant"], r["budget_cpu_s"], r["windows"], r["window"], r["lr"], r["batch_size"], r["seed"]) == \
        (RECIPE.variant, RECIPE.budget_cpu_s, RECIPE.windows, RECIPE.window, RECIPE.lr, RECIPE.batch_size, RECIPE.seed)
    h = _defaults(train_head)
    assert (h["batch_size"], h["lr"], h["val_windows"], h["seed"], h["save_every_s"]) == \
        (RECIPE.batch_size, RECIPE.lr, RECIPE.val_windows, RECIPE.seed, RECIPE.save_every_s)
    assert RECIPE == FWLHeadRecipe()
    models = pytest.importorskip("fastweights.harness.models")  # lm-eval, the optional [eval] extra
    d = _defaults(models.FastweightsLM.__init__)
    assert (d["segment_len"], d["context"]) == (lib.segment_len, lib.context)  # 0: decided as the command line does


def test_the_recipe_is_what_the_recorded_result_was_made_with():
    rec = json.loads((ROOT / "benchmarks/results/fwl_smollm2.json").read_text())["training"]["fwl"]
    assert (rec["cache_windows"], rec["window"], rec["doc_windows"], rec["batch_size"], rec["lr"], rec["step_lr"],
            rec["block_lr"], rec["trainable_blocks"]) == \
        (RECIPE.windows, RECIPE.window, RECIPE.doc_windows, RECIPE.batch_size, RECIPE.lr, RECIPE.step_lr,
         RECIPE.block_lr, RECIPE.trainable_blocks)  # docs/experiments/fast-weight-layers.md cites these as RECIPE
    assert rec["train_windows"] == RECIPE.windows - RECIPE.val_windows
    assert RECIPE.budget_cpu_s <= rec["cpu_s"] < RECIPE.budget_cpu_s + 60  # stopped at the first step past it
    from fastweights.hf.fwl_head import PRETRAINED_FWL_DEFAULTS

    assert {k: rec["options"][k] for k in PRETRAINED_FWL_DEFAULTS} == PRETRAINED_FWL_DEFAULTS


def test_the_recipe_lr_is_the_one_chosen_on_tuning_text():
    rec = json.loads((ROOT / "benchmarks/results/fwl_head_lr.json").read_text())
    assert rec["chosen_lr"] == RECIPE.lr and RECIPE.lr in [h["lr"] for h in rec["heads"]] and len(rec["heads"]) >= 3


@pytest.mark.parametrize("name", ["DEFAULT_LR", "DEFAULT_DECAY", "DEFAULT_RULE", "DEFAULT_EPS", "DEFAULT_SEGMENT_LEN",
                                  "DEFAULT_STATS_BATCHES", "DEFAULT_STATS_BATCH_SIZE", "PRETRAINED_FWL_DEFAULTS"])
def test_each_constant_is_defined_once(name):
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "src").rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if re.match(rf"\s*{name}\s*=", line)]
    assert len(hits) == 1, hits


def test_the_default_rule_is_not_written_as_a_default_anywhere_else():
    """The rule's name as a default value (``= "rms-global-prior"``, ``default="rms-global-prior"``, ``or
    "rms-global-prior"``) appears only where DEFAULT_RULE is defined."""
    pattern = re.compile(r"""(?:=|\bor)\s*["']rms-global-prior["']""")
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "src").rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if pattern.search(line) and "==" not in line and not line.lstrip().startswith("DEFAULT_RULE")]
    assert not hits, hits


def test_the_op_has_no_segment_length_of_its_own():
    from fastweights.layers.fwl import FWLOptions
    from fastweights.ops import fwl as op

    for fn in (op.fwl_parallel, op.fwl_recurrent_reference):
        assert "segment_len" not in _defaults(fn), fn.__name__  # required: the layer's or a recipe's value is passed
    assert FWLOptions().segment_len == 32  # the layer's one default (the presets and fwl_ptb.json use it)


# ----------------------------------------------------------------------------- the SmolLM2 recommendation

GUIDE = ROOT / "docs" / "dynamic-evaluation.md"
SECTION = "### Recommended setting for SmolLM2"


def _recommended_command() -> list[str]:
    text = GUIDE.read_text()
    section = text[text.index(SECTION):]
    line = re.search(r"^fastweights dynamic eval --hf smollm2-135m .*$", section, re.M).group(0)
    return shlex.split(line)


def test_the_smollm2_recommendation_is_the_measured_choice():
    res = json.loads((ROOT / "benchmarks/results/smollm2_dynamic_eval.json").read_text())
    chosen = res["results"][res["chosen"]]
    args = parse_command_line(_recommended_command()[1:])
    assert (args.rule, args.lr, args.segment_len, args.exclude_params) == \
        (chosen["rule"], chosen["lr"], chosen["segment_len"], chosen["exclude"])
    assert GUIDE.read_text().count(SECTION) == 1


def test_no_other_page_or_docstring_gives_smollm2_a_learning_rate():
    """The recommendation is stated once; other pages link to it (a line naming smollm2-135m with an lr)."""
    lr = re.compile(r"(?:--lr\s+|\blr=)[\d.]")
    section = GUIDE.read_text()[GUIDE.read_text().index(SECTION):]
    section = section[: section.index("<!-- numbers:end -->")]
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "src").rglob("*.py"))]
    hits = []
    for path in files:
        text = path.read_text()
        if path == GUIDE:
            text = text.replace(section, "")
        hits += [f"{path.relative_to(ROOT)}: {line.strip()[:100]}" for line in text.splitlines()
                 if "smollm2-135m" in line and lr.search(line)]
    assert not hits, hits
