"""tools/mutants.py (``make mutants``): which lines a change touched, where each mutmut mutant sits
in the file at HEAD, and which survivors the accepted list covers. The mutmut run itself is the tool's own
job (minutes); these are its pure parts, on made-up inputs. tools/module_mutants.py: one small module's run."""

import json
import subprocess
import sys
from pathlib import Path

from helpers import import_benchmark

REPO = Path(__file__).resolve().parents[2]

mutants = import_benchmark("mutants")


def test_a_function_block_is_found_whatever_blank_lines_lie_between():
    source = ["import x", "", "def f(a):", "    '''doc'''", "", "    return a + 1", "", "def g():", "    pass"]
    assert mutants._find_block(source, ["    '''doc'''", "    return a + 1"]) == 3
    assert mutants._find_block(source, ["    '''doc'''", "", "    return a + 1"]) == 3
    assert mutants._find_block(source, ["    return a + 2"]) is None


def test_each_mutant_is_placed_on_its_line_of_the_source(tmp_path):
    source = ["import math", "", "", "def f(a):", "    '''doc'''", "", "    b = a + 1", "    return b * 2", ""]
    generated = ["import math", "", "",
                 "def x_f__mutmut_orig(a):", "    '''doc'''", "", "    b = a + 1", "    return b * 2", "",
                 "def x_f__mutmut_1(a):", "    '''doc'''", "", "    b = a - 1", "    return b * 2", "",
                 "def x_f__mutmut_2(a):", "    '''doc'''", "", "    b = a + 1", "    return b / 2", ""]
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "mod.py").write_text("\n".join(source))
    out = tmp_path / "mutants" / "src" / "pkg"
    out.mkdir(parents=True)
    (out / "mod.py").write_text("\n".join(generated))
    spans = {"x_f__mutmut_orig": [4, 9], "x_f__mutmut_1": [10, 15], "x_f__mutmut_2": [16, 21]}
    (out / "mod.py.spans").write_text(json.dumps({"version": 1, "spans": spans}))
    where = mutants.mutant_lines(tmp_path, ["src/pkg/mod.py"])
    assert where == {"pkg.mod.x_f__mutmut_1": ("src/pkg/mod.py", 7, "b = a + 1", "b = a - 1"),
                     "pkg.mod.x_f__mutmut_2": ("src/pkg/mod.py", 8, "return b * 2", "return b / 2")}


def test_a_default_argument_or_a_statement_over_several_lines_is_applied_as_mutmut_wrote_it(tmp_path):
    """Two kinds of mutant each draw counted as 'not applied' (2-5 of 100, outside the score): a mutated default
    argument sits on the ``def`` line, where mutmut's copy has its own name (a method's: ``xǁClassǁf``), and a
    statement over several lines replaced by one (``x = None``) changes the number of lines."""
    source = ["class A:", "    def f(self, a, b=2):", "        c = g(a,", "              b)", "        return c", "",
              "def h(a, scale=1.0):", "    return a * scale", ""]
    generated = ["class A:", "    def xǁAǁf__mutmut_orig(self, a, b=2):", "        c = g(a,", "              b)",
                 "        return c", "", "    def xǁAǁf__mutmut_1(self, a, b=3):", "        c = g(a,", "              b)",
                 "        return c", "", "    def xǁAǁf__mutmut_2(self, a, b=2):", "        c = None", "        return c",
                 "", "def x_h__mutmut_orig(a, scale=1.0):", "    return a * scale", "",
                 "def x_h__mutmut_1(a, scale=2.0):", "    return a * scale", ""]
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "mod.py").write_text("\n".join(source))
    out = tmp_path / "mutants" / "src" / "pkg"
    out.mkdir(parents=True)
    (out / "mod.py").write_text("\n".join(generated))
    spans = {"xǁAǁf__mutmut_orig": [2, 5], "xǁAǁf__mutmut_1": [7, 10], "xǁAǁf__mutmut_2": [12, 14],
             "x_h__mutmut_orig": [16, 17], "x_h__mutmut_1": [19, 20]}
    (out / "mod.py.spans").write_text(json.dumps({"version": 1, "spans": spans}))
    edits: dict = {}
    where = mutants.mutant_lines(tmp_path, ["src/pkg/mod.py"], edits)
    assert where == {"pkg.mod.xǁAǁf__mutmut_1": ("src/pkg/mod.py", 2, "def f(self, a, b=2):", "def f(self, a, b=3):"),
                     "pkg.mod.xǁAǁf__mutmut_2": ("src/pkg/mod.py", 3, "c = g(a,", "c = None"),
                     "pkg.mod.x_h__mutmut_1": ("src/pkg/mod.py", 7, "def h(a, scale=1.0):", "def h(a, scale=2.0):")}
    text = "\n".join(source)
    applied = {name.split(".")[-1]: mutants.patched(text, e) for name, e in edits.items()}
    assert applied["xǁAǁf__mutmut_1"] == text.replace("def f(self, a, b=2):", "def f(self, a, b=3):")
    assert applied["xǁAǁf__mutmut_2"] == text.replace("c = g(a,\n              b)", "c = None")
    assert applied["x_h__mutmut_1"] == text.replace("scale=1.0", "scale=2.0")


def test_changed_lines_are_the_lines_the_change_added_or_modified(monkeypatch):
    diff = "\n".join(["diff --git a/src/p/a.py b/src/p/a.py", "--- a/src/p/a.py", "+++ b/src/p/a.py",
                      "@@ -3,0 +4,2 @@", "+x", "+y", "@@ -10 +12 @@", "-old", "+new", "@@ -20,2 +21,0 @@",
                      "diff --git a/src/p/b.txt b/src/p/b.txt", "--- a/src/p/b.txt", "+++ b/src/p/b.txt",
                      "@@ -1 +1 @@", "-a", "+b"])
    monkeypatch.setattr(mutants, "git", lambda *args, **kw: diff)
    assert mutants.changed_lines("BASE") == {"src/p/a.py": {4, 5, 12}}


def test_a_survivor_is_accepted_only_by_an_entry_that_matches_it():
    entries = [{"mutant": "m.x_show__*", "reason": "display"},
               {"mutant": "m.x_f__*", "line": "return b / 2", "reason": "equivalent"}]
    assert mutants.accepted_reason(entries, "m.x_show__mutmut_3", "anything") == "display"
    assert mutants.accepted_reason(entries, "m.x_f__mutmut_2", "return b / 2") == "equivalent"
    assert mutants.accepted_reason(entries, "m.x_f__mutmut_1", "b = a - 1") is None
    assert mutants.accepted_reason(entries, "m.x_g__mutmut_1", "return b / 2") is None
    by_pattern = [{"mutant": "m.x_f__*", "line_matches": r"^if recomputes\(", "reason": "route only"}]
    assert mutants.accepted_reason(by_pattern, "m.x_f__mutmut_4", "if recomputes(None, w):") == "route only"
    assert mutants.accepted_reason(by_pattern, "m.x_f__mutmut_5", "return recomputes(x)") is None


def test_a_sampled_score_carries_its_wilson_interval():
    low, high = mutants.wilson(0.9, 100)
    assert abs(low - 0.8256) < 1e-3 and abs(high - 0.9448) < 1e-3  # the textbook values for 90 of 100
    assert mutants.wilson(1.0, 10)[1] == 1.0 and mutants.wilson(0.5, 0) == [0.0, 1.0]


def test_a_sample_of_no_mutants_is_one_line_and_exit_2(capsys):
    assert mutants.exit_status_of(lambda: mutants.main(["--sample", "0"])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--sample 0" in err[0]


def test_a_sampled_mutant_is_applied_as_the_lines_it_changes_reindented():
    source = "class A:\n    def f(self, a):\n        b = a + 1\n        return b * 2\n"
    # mutmut's copy of a method sits at module level: its lines are indented one level less than the file's
    edits = [(3, "    b = a + 1", "    b = a - 1"), (4, "    return b * 2", "    return b / 2")]
    assert mutants.patched(source, edits) == "class A:\n    def f(self, a):\n        b = a - 1\n        return b / 2\n"
    assert mutants.patched(source, [(3, "    b = a + 2", "    b = a - 2")]) is None  # not the line mutmut saw
    assert mutants.patched(source, [(9, "x", "y")]) is None


def test_a_sampled_mutant_is_killed_by_a_failing_test_and_the_file_is_restored(tmp_path):
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "tests").mkdir()
    module = tmp_path / "src" / "pkg" / "mod.py"
    module.write_text("def f(a):\n    return a + 1\n")
    (tmp_path / "tests" / "test_mod.py").write_text("from pkg.mod import f\n\n\ndef test_f():\n    assert f(1) == 2\n")
    run = lambda edits: mutants.run_patched(tmp_path, "src/pkg/mod.py", edits, ["tests/test_mod.py"], 120)  # noqa: E731
    assert run([(2, "    return a + 1", "    return a - 1")]) == "killed"
    assert module.read_text() == "def f(a):\n    return a + 1\n"
    assert run([(2, "    return a + 1", "    return 1 + a")]) == "survived"  # an equivalent mutant
    assert run([(2, "    return a + 2", "    return a - 1")]) == "not applied"
    assert run(None) == "not applied"  # no placed lines
    assert mutants.run_patched(tmp_path, "src/pkg/mod.py", [(2, "    return a + 1", "    return a - 1")], [], 120) \
        == "no tests"


def test_a_mutant_that_breaks_the_import_of_a_named_test_module_is_killed(tmp_path):
    """A mutant of code that a test module runs when it is imported (a parser built at module level) makes that
    module fail to collect, and pytest then answers the module's node ids with "found no collectors" and exit 4, not
    1 (sample of 2026-11-30: two such mutants of cli/settings.py counted as survivors)."""
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "tests").mkdir()
    (tmp_path / "src" / "pkg" / "mod.py").write_text("def f(a):\n    return a + 1\n")
    (tmp_path / "tests" / "test_built.py").write_text("from pkg.mod import f\n\nBUILT = f(1)\n\n\ndef test_built():\n"
                                                      "    assert BUILT == 2\n")
    (tmp_path / "tests" / "test_other.py").write_text("def test_other():\n    pass\n")
    tests = ["tests/test_built.py::test_built", "tests/test_other.py::test_other"]
    edit = [(2, "    return a + 1", "    return a - '1'")]
    assert mutants.run_patched(tmp_path, "src/pkg/mod.py", edit, tests, 120) == "killed"
    # a node id that names no test, with the code as it is, stays what it is: a usage error, not a kill
    assert mutants.run_patched(tmp_path, "src/pkg/mod.py", [(2, "    return a + 1", "    return 1 + a")],
                               ["tests/test_other.py::test_missing"], 120) == "error"


def test_a_packages_init_is_tested_by_the_tests_that_import_the_package():
    """``src/fastweights/cli/__init__.py`` is the module ``fastweights.cli`` (mutation run of 2026-11-29: its
    mutants had 'no tests', as no test names ``fastweights.cli.__init__``)."""
    found = mutants.tests_for(["src/fastweights/cli/__init__.py"])
    assert "tests/cli/test_cli.py" in found


def test_a_module_no_test_names_takes_the_tests_of_the_modules_that_import_it():
    """data/splits.py is imported by tests only through its package, and cli/stream.py only through the command
    line: their mutants had 'no tests' (mutation run of 2026-11-29)."""
    splits = mutants.tests_for(["src/fastweights/data/splits.py"])
    assert splits and "tests/text/test_data.py" in splits
    assert mutants.tests_for(["src/fastweights/cli/stream.py"])
    assert mutants.tests_for(["src/fastweights/ops/linear.py"]) == sorted(
        set(mutants.tests_for(["src/fastweights/ops/linear.py"])))  # named directly: its own tests only
    assert "tests/ops/test_linear.py" in mutants.tests_for(["src/fastweights/ops/linear.py"])


def test_coverage_contexts_become_the_node_ids_of_the_tests_that_ran_each_line(tmp_path):
    report = {"files": {
        str(tmp_path / "src" / "pkg" / "mod.py"): {"contexts": {
            "2": ["", "test_mod.test_f", "tests.cli.test_cli.TestCli.test_g"],
            "3": [""],  # run at import or in a subprocess only: no test function
            "4": ["test_unknown.test_h"]}}}}
    found = mutants.tests_by_line(report, tmp_path, ["tests/test_mod.py", "tests/cli/test_cli.py"])
    assert found == {"src/pkg/mod.py": {2: ["tests/cli/test_cli.py::TestCli::test_g", "tests/test_mod.py::test_f"]}}


def test_a_sampled_mutant_is_tried_on_the_tests_that_ran_its_line_then_on_the_importers(tmp_path, monkeypatch):
    """The sample of 2026-11-29 counted mutants as survivors that a test reaching their module through the command
    line kills: the tests that ran the line (coverage) come first, the importers only when those all pass."""
    calls = []

    def fake_run(tree, file, edits, tests, timeout):
        calls.append(list(tests))
        return {"tests/test_cli.py::test_cli": "killed"}.get(tests[0], "survived") if tests else "no tests"

    monkeypatch.setattr(mutants, "run_patched", fake_run)
    monkeypatch.setattr(mutants, "tests_for", lambda files: [] if files == ["src/pkg/cli.py"] else ["tests/test_mod.py"])
    where = {"m.x_f__mutmut_1": ("src/pkg/mod.py", 2, "a", "b"), "m.x_f__mutmut_2": ("src/pkg/mod.py", 3, "a", "b"),
             "m.x_g__mutmut_1": ("src/pkg/cli.py", 5, "a", "b")}
    by_line = {"src/pkg/mod.py": {2: ["tests/test_cli.py::test_cli"]}, "src/pkg/cli.py": {5: ["tests/t.py::test_t"]}}
    out = mutants.run_sample(list(where), where, {}, [tmp_path], None, 60, by_line)
    # a mutant that the tests running its line let live survives though no test imports its module
    assert out == {"m.x_f__mutmut_1": "killed", "m.x_f__mutmut_2": "survived", "m.x_g__mutmut_1": "survived"}
    assert calls == [["tests/test_cli.py::test_cli"], ["tests/test_mod.py"], ["tests/t.py::test_t"], []]


def test_the_coverage_map_of_a_small_tree_names_the_test_functions_behind_each_line(tmp_path, monkeypatch):
    import subprocess

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tree = tmp_path / "tree"
    (tree / "src" / "pkg").mkdir(parents=True)
    (tree / "tests").mkdir()
    (tree / "src" / "pkg" / "__init__.py").write_text("")
    (tree / "src" / "pkg" / "mod.py").write_text("def f(a):\n    if a:\n        return 1\n    return 2\n")
    (tree / "tests" / "test_mod.py").write_text(
        "from pkg import mod\n\n\ndef test_one():\n    assert mod.f(1) == 1\n\n\n"
        "class TestTwo:\n    def test_two(self):\n        assert mod.f(0) == 2\n")
    for args in (["init", "-q"], ["add", "."], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "t"]):
        subprocess.run(["git", *args], cwd=tree, check=True, capture_output=True)
    found, seconds = mutants.coverage_map(tree, ["tests"], ["src/pkg/mod.py"])
    assert set(seconds) == {"tests/test_mod.py::test_one", "tests/test_mod.py::TestTwo::test_two"}
    assert found["src/pkg/mod.py"][3] == ["tests/test_mod.py::test_one"]
    assert found["src/pkg/mod.py"][4] == ["tests/test_mod.py::TestTwo::test_two"]
    assert sorted(found["src/pkg/mod.py"][2]) == ["tests/test_mod.py::TestTwo::test_two", "tests/test_mod.py::test_one"]
    assert 1 not in found["src/pkg/mod.py"]  # the def line runs at import, in no test
    assert list((tmp_path / "cache" / "fastweights" / "mutants").glob("coverage-*.json"))  # kept for this commit


def test_durations_become_seconds_per_test_function_and_a_crowded_line_takes_the_quickest():
    report = ("============ slowest durations ============\n"
              "2.50s call     tests/a.py::test_x[1]\n0.50s setup    tests/a.py::test_x[2]\n"
              "1.00s call     tests/a.py::test_x[2]\n0.01s teardown tests/b.py::TestB::test_y\n"
              "(12 durations < 0.005s hidden.)\n")
    seconds = mutants.test_seconds(report)
    assert seconds == {"tests/a.py::test_x": 4.0, "tests/b.py::TestB::test_y": 0.01}
    many = {f"tests/c.py::test_{i}": float(i) for i in range(1, 11)}
    assert mutants.quickest(list(many)[::-1], many, 6.0) == ["tests/c.py::test_1", "tests/c.py::test_2",
                                                             "tests/c.py::test_3"]  # 1 + 2 + 3 <= 6 < 1 + 2 + 3 + 4
    assert mutants.quickest(["tests/c.py::test_9"], many, 1.0) == ["tests/c.py::test_9"]  # at least one
    assert mutants.quickest([], many, 1.0) == []


def test_the_second_stage_does_not_run_the_first_stages_tests_again(tmp_path, monkeypatch):
    """A survivor of the covering tests goes on to its module's importers without those tests (deselected): a
    survivor's importers' run is the slow part of a sample. With no importer, nothing runs (a bare --deselect
    would collect the whole suite)."""
    calls = []
    monkeypatch.setattr(mutants, "run_patched",
                        lambda tree, file, edits, tests, timeout: calls.append(list(tests)) or "survived")
    monkeypatch.setattr(mutants, "tests_for", lambda files: ["tests/test_mod.py"])
    where = {"m.x_f__mutmut_1": ("src/pkg/mod.py", 2, "a", "b")}
    by_line = {"src/pkg/mod.py": {2: ["tests/test_mod.py::test_f", "tests/test_cli.py::test_g"]}}
    seconds = {"tests/test_mod.py::test_f": 1.0, "tests/test_cli.py::test_g": 2.0}
    out = mutants.run_sample(list(where), where, {}, [tmp_path], None, 60, by_line, seconds)
    assert out == {"m.x_f__mutmut_1": "survived"}
    assert calls == [["tests/test_mod.py::test_f", "tests/test_cli.py::test_g"],  # quickest first
                     ["tests/test_mod.py", "--deselect", "tests/test_mod.py::test_f", "--deselect",
                      "tests/test_cli.py::test_g"]]


def test_a_whole_run_copies_every_folder_and_file_the_tests_read_beside_src_and_tests():
    """mutmut runs the tests in a copy of src/ and tests/ of its own: whatever else a test reads as
    ``ROOT / "NAME"`` must be in ``also_copy``, or every test that reads it fails there for every mutant (a
    mutant killed by a missing file). Caught: tools/ left out when the tools moved out of benchmarks/."""
    import re

    from helpers import ROOT

    named = {m for p in (ROOT / "tests").rglob("*.py") for m in re.findall(r'ROOT / "([\w.-]+)"', p.read_text())}
    tracked = {n for n in named if (ROOT / n).exists()} - {"src", "tests", "pyproject.toml"}
    copied = set(mutants.mutmut_settings(["src/fastweights/core/config.py"], ["tests/cli"])["also_copy"])
    assert tracked and tracked <= copied, sorted(tracked - copied)


def test_the_module_runner_kills_what_its_tests_catch_and_lists_the_rest(tmp_path):
    """``tools/module_mutants.py`` on core/compare.py against a deliberately weak test (relative_error of equal
    tensors is 0): a mutant that makes it non-zero is killed, one it cannot see survives, the JSON says which, and
    the exit status is 1 (the module and the checkout are left as they were)."""
    weak = tmp_path / "test_weak.py"
    weak.write_text("import torch\n\nfrom fastweights.core.compare import relative_error\n\n\n"
                    "def test_equal():\n    assert relative_error(torch.ones(2), torch.ones(2)) == 0\n")
    before = (REPO / "src/fastweights/core/compare.py").read_text()
    r = subprocess.run([sys.executable, str(REPO / "tools/module_mutants.py"), "src/fastweights/core/compare.py",
                        "--tests", str(weak), "--out", "m.json"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    assert not (REPO / "m.json").exists()  # a relative --out is the caller's folder's, not the checkout's
    data = json.loads((tmp_path / "m.json").read_text())
    statuses = {row["mutated"]: row["status"] for row in data["not_killed"]}
    assert "return float((a - ref).norm() / ref.norm().clamp_min(1.0))" in statuses  # |0| / 1 is still 0
    assert "return float((a + ref).norm() / ref.norm().clamp_min(1e-30))" not in statuses  # 2 / 1.41: killed
    assert set(statuses.values()) == {"survived"} and data["counts"]["killed"] >= 1
    assert data["mutants"] == sum(data["counts"].values())
    assert (REPO / "src/fastweights/core/compare.py").read_text() == before


COMPARE = "src/fastweights/core/compare.py"  # the module the module-runner tests mutate


def _return_line() -> tuple[int, str]:
    """(line number, text) of core/compare.py's ``relative_error`` return: the line the tests below mutate."""
    lines = (REPO / COMPARE).read_text().splitlines()
    at = next(i for i, text in enumerate(lines, 1) if text.strip().startswith("return float((a - ref).norm()"))
    return at, lines[at - 1]


def _statuses_in_a_process(mutated: dict[str, str], tests: list[str], prelude: str = "", after: str = "",
                           **options) -> subprocess.CompletedProcess:
    """``module_mutants.statuses`` with compare.py's return line replaced by each of ``mutated`` (name -> the
    line), run in a fresh process in the checkout (``prelude`` before it, ``after`` after it)."""
    at, original = _return_line()
    where = {k: (COMPARE, at, original.strip(), m.strip()) for k, m in mutated.items()}
    edits = {k: [(at, original, m)] for k, m in mutated.items()}
    given = "".join(f", {k}={v!r}" for k, v in options.items())
    code = ("import sys; from pathlib import Path; sys.path.insert(0, 'tools'); sys.path.insert(0, 'tests'); "
            f"{prelude}import module_mutants as m; "
            f"print(m.statuses({COMPARE!r}, {list(mutated)!r}, {where!r}, {edits!r}, {tests!r}{given}));{after}")
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)


def test_a_file_a_mutant_writes_into_the_checkout_is_removed_and_said():
    """A mutant whose code writes a file where the tests run (a path turned into None became a file named 'None'
    in the checkout, and a commit took it in): removed after that mutant's run, and the removal reported."""
    _, original = _return_line()
    mutated = original.replace("return ", 'return open("stray-module-mutants.txt", "w").close() or ', 1)
    try:
        r = _statuses_in_a_process({"stray": mutated}, ["tests/core/test_compare.py"])
        assert r.returncode == 0, r.stderr
        assert "removed stray-module-mutants.txt" in r.stdout and "{'stray': 'survived'}" in r.stdout
        assert not (REPO / "stray-module-mutants.txt").exists()
    finally:
        (REPO / "stray-module-mutants.txt").unlink(missing_ok=True)


def test_the_module_runner_reaches_names_imported_elsewhere_and_puts_them_back(tmp_path):
    """A test that calls the mutated function through another module's import (fla_selfcheck's relative_error)
    sees the mutant, and sees the original again once that mutant's run is over: the first mutant (always 1.0)
    is killed, the second (an equivalent clamp) survives, and the other module holds the original at the end."""
    check = tmp_path / "test_through_import.py"
    check.write_text("import torch\n\nfrom fastweights.ops import fla_selfcheck\n\n\n"
                     "def test_equal():\n    assert fla_selfcheck.relative_error(torch.ones(2), torch.ones(2)) == 0\n")
    _, original = _return_line()
    mutated = {"always_one": original.replace("return float(", "return 1.0 + 0 * float(", 1),
               "clamp": original.replace("1e-30", "1e-31")}
    r = _statuses_in_a_process(mutated, [str(check)], after=(
        "from fastweights.ops import fla_selfcheck; from fastweights.core import compare; "
        "print(fla_selfcheck.relative_error is compare.relative_error)"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-2:] == ["{'always_one': 'killed', 'clamp': 'survived'}", "True"], r.stdout


def test_a_mutant_that_never_ends_is_a_timeout_not_a_kill():
    """The alarm that ends a mutant's run fires inside a test, where pytest would report it as that test's
    failure: a mutant looping forever is a timeout (the draw's subprocess runner says the same), never killed."""
    _, original = _return_line()
    mutated = original.replace("return ", "while True:\n        pass\n    return ", 1)
    r = _statuses_in_a_process({"loop": mutated}, ["tests/core/test_compare.py"], timeout_s=3)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "{'loop': 'timeout'}", r.stdout


def test_a_survivor_on_the_accepted_list_is_reported_as_accepted_on_its_line(tmp_path):
    """The per-mutant line says ``accepted`` for a survivor an entry of the accepted list matches (the status it
    returns stays ``survived``: the tally gives the reason), ``survived`` for one no entry matches."""
    accepted = tmp_path / "accepted.toml"
    accepted.write_text('[[accepted]]\nmutant = "fastweights.core.compare.x_relative_error__mutmut_*"\n'
                        'line_matches = "1e-31"\nreason = "equivalent"\n')
    _, original = _return_line()
    names = {"fastweights.core.compare.x_relative_error__mutmut_1": original.replace("1e-30", "1e-31"),
             "fastweights.core.compare.x_relative_error__mutmut_2": original.replace("1e-30", "1e-29")}
    r = _statuses_in_a_process(names, ["tests/core/test_compare.py"],
                               prelude=f"import mutants; mutants.ACCEPTED = Path({str(accepted)!r}); ")
    assert r.returncode == 0, r.stderr
    shown = [line.split()[0] for line in r.stdout.strip().splitlines()[:2]]
    assert shown == ["accepted", "survived"], r.stdout
    assert r.stdout.strip().splitlines()[-1] == str({k: "survived" for k in names})
