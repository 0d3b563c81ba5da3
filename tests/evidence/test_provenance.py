"""What result files record (fastweights.evidence.provenance), and the benchmark scripts that record it: each is
run as ``python benchmarks/KIND/X.py`` and imports the installed package (``fastweights.evidence.result_files``
writes its result) and, at most, a sibling script of its folder, without changing ``sys.path`` and without importing
anything from ``tests/`` (issues 20, 38, 48)."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fastweights.evidence.provenance as provenance_module
from fastweights.evidence.provenance import cli_provenance, command_line, git_state, provenance, repo_relative
from helpers import HANG_GUARD_S, ROOT

# ``sys.path`` changed in a script's source, its own code or code it hands to a child process as text:
# ``sys.path.insert(...)``, ``.append``, ``.extend``, ``.remove``, ``.pop``, ``.clear``, ``sys.path = ...``,
# ``sys.path += ...``, ``sys.path[...] = ...``
SYS_PATH_CHANGE = re.compile(r"sys\.path\s*(\.\s*(insert|append|extend|remove|pop|clear)\s*\(|\+?=(?!=)|\[[^\]]*\]\s*=(?!=))")


def sys_path_changes(source: str) -> list[str]:
    """The lines of ``source`` that change ``sys.path``."""
    return [line.strip() for line in source.splitlines() if SYS_PATH_CHANGE.search(line)]


def names_of_test_modules(root: Path = ROOT) -> set[str]:
    """The names under which a module of tests/ is imported once tests/ or one of its folders is on sys.path."""
    return {"tests"} | {p.stem for p in (root / "tests").rglob("*.py")}


def imports_from_tests(source: str, names: set[str]) -> list[str]:
    """The imports in ``source`` (at any depth: inside functions too) of a module of tests/."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in names:
            found.append(node.module)
    return found


def test_command_line_makes_paths_inside_the_repository_relative():
    argv = [str(ROOT / "tools" / "report.py"), "--out", str(ROOT / "runs" / "x"), f"--data={ROOT}/a b.txt",
            "/elsewhere/file", "plain"]
    assert command_line(ROOT, argv, program="python") == \
        "python tools/report.py --out runs/x '--data=a b.txt' /elsewhere/file plain"
    assert repo_relative("/elsewhere/file", ROOT) == "/elsewhere/file" and repo_relative("rel/path", ROOT) == "rel/path"


def test_provenance_records_the_commit_and_the_machine():
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert git_state(ROOT)["commit"] == head
    rec = provenance(ROOT, ["benchmarks/x.py"])
    assert rec["command"].endswith(" benchmarks/x.py") and rec["git"]["commit"] == head
    assert rec["machine"]["cpu_capability"] in ("DEFAULT", "AVX2", "AVX512") and rec["machine"]["blas"]
    assert rec["machine"]["torch_threads"] >= 1 and set(rec) == {"command", "date", "git", "machine"}
    assert git_state(Path("/"))["commit"] is None  # not a checkout


def test_a_scripts_result_records_the_command_it_is_given_and_says_where_it_went(tmp_path, capsys):
    """result_files (what benchmark scripts call): the command recorded is the argv handed in, not this
    process's (pytest's), and writing a result prints its path."""
    import json

    from fastweights.evidence import result_files

    rec = result_files.provenance([str(ROOT / "benchmarks" / "x.py"), "--seed", "3"])
    assert rec["command"].endswith(" benchmarks/x.py --seed 3"), rec["command"]
    assert result_files.command_line([str(ROOT / "tools" / "y.py"), "--a"], program="python") == "python tools/y.py --a"
    # a device run's output flag is left out, in both of its spellings, and nothing else is
    for argv in (["--device", "cpu", "--out", "o.json", "--tiny"], ["--device", "cpu", "--out=o.json", "--tiny"]):
        assert result_files.command_line_without(argv, "--out").endswith(" --device cpu --tiny"), argv
    path = result_files.write_json(tmp_path / "new" / "folders" / "r.json", {"a": 1})  # its folders made
    assert capsys.readouterr().out == f"wrote {path}\n"
    assert json.loads(path.read_text()) == {"a": 1, "result_file": str(path.resolve())}


def test_the_code_hash_changes_with_the_code_and_not_with_results(tmp_path):
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], capture_output=True, check=True)

    git("init", "-q")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "m.py").write_text("x = 1\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    clean = git_state(tmp_path)
    assert clean["code"] == provenance_module.clean_code(clean["commit"])  # a named commit's code, as a copy of it
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "r.json").write_text("{}")  # a result written: no code changed
    (tmp_path / "README.md").write_text("notes\n")
    assert git_state(tmp_path)["code"] == clean["code"]
    (tmp_path / ".gitignore").write_text("*.pyc\n")
    git("add", ".gitignore")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "ignore")
    clean = git_state(tmp_path)
    (tmp_path / "src" / "m.cpython-311.pyc").write_bytes(b"\0")  # an ignored file among the code: not code
    assert git_state(tmp_path)["code"] == clean["code"]
    (tmp_path / "src" / "new.py").write_text("y = 2\n")  # an untracked module
    assert git_state(tmp_path)["code"] != clean["code"]
    (tmp_path / "src" / "new.py").unlink()
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "report.py").write_text("z = 3\n")  # the repository's tools are code too
    assert git_state(tmp_path)["code"] != clean["code"]
    (tmp_path / "tools" / "report.py").unlink()
    (tmp_path / "src" / "m.py").write_text("x = 2\n")  # a tracked change
    assert git_state(tmp_path)["code"] != clean["code"]


def test_a_fastweights_command_records_the_checkout_it_runs_from(monkeypatch):
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    rec = cli_provenance(["continual", "--out", str(ROOT / "benchmarks" / "results" / "x")])
    assert rec["command"] == "fastweights continual --out benchmarks/results/x" and rec["git"]["commit"] == head
    # an installed copy (not a source checkout): no commit, the installed version instead
    monkeypatch.setattr(provenance_module, "package_checkout", lambda: None)
    rec = cli_provenance(["task", "niah", "--out", "/elsewhere/x"])
    assert rec["git"]["commit"] is None and "version" in rec["git"] and rec["command"] == "fastweights task niah --out /elsewhere/x"


def test_benchmark_scripts_import_without_sys_path_changes():
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "benchmarks/*.py", "tools/*.py"], capture_output=True,
                             text=True).stdout.split()
    scripts = [ROOT / p for p in tracked if (ROOT / p).exists()]  # a deleted script awaits its commit
    assert len(scripts) > 20
    folders = {p.parent.relative_to(ROOT).as_posix() for p in scripts}
    assert folders == {"benchmarks/speed", "benchmarks/quality", "benchmarks/gpu", "tools"}, folders
    changing = {p.relative_to(ROOT).as_posix(): lines for p in scripts if (lines := sys_path_changes(p.read_text()))}
    assert not changing, f"benchmark scripts that change sys.path (the script's folder is on it already): {changing}"
    names = names_of_test_modules()
    from_tests = {p.relative_to(ROOT).as_posix(): found for p in scripts
                  if (found := imports_from_tests(p.read_text(), names))}
    assert not from_tests, (f"benchmark scripts that import from tests/ (what both need belongs in the library, "
                            f"fastweights.testing, or in a module of benchmarks/): {from_tests}")
    # as `python benchmarks/KIND/X.py` does: the script's folder first on sys.path, nothing else added
    code = ("import importlib, sys\nsys.path.insert(0, sys.argv[1])\n"
            "for name in sys.argv[2:]:\n    importlib.import_module(name)\n")
    for folder in sorted(folders):
        names = [p.stem for p in scripts if p.parent == ROOT / folder]
        r = subprocess.run([sys.executable, "-c", code, str(ROOT / folder), *names],
                           capture_output=True, text=True, timeout=HANG_GUARD_S, cwd="/")
        assert r.returncode == 0, f"{folder}: {r.stderr[-2000:]}"


@pytest.mark.parametrize("line", [
    "sys.path.insert(0, folder)", "sys.path.append(str(STANDIN))", "sys.path .extend(x)", "sys.path.remove(folder)",
    "sys.path = [root]", "sys.path += [root]", 'sys.path[:0] = [os.path.join(root, "benchmarks")]'])
def test_a_change_of_sys_path_is_found(line):
    assert sys_path_changes(f"import sys\n{line}\n") == [line]


def test_reading_sys_path_and_prose_about_it_are_not_changes():
    assert sys_path_changes("if folder not in sys.path:\n    pass\nx = sys.path[0]\nok = sys.path == y\n"
                            "# its folder comes first on sys.path when run\n") == []


def test_an_import_from_tests_is_found_at_any_depth():
    source = "import helpers\ndef f():\n    import test_floors\n    from tests.helpers import ROOT\nimport torch\n"
    assert imports_from_tests(source, names_of_test_modules()) == ["helpers", "test_floors", "tests.helpers"]


def test_the_blas_recorded_is_the_one_torchs_build_names():
    """Mutation caught: the build's BLAS_INFO not read (every result would record 'unknown')."""
    import re

    import torch

    from fastweights.evidence.provenance import blas

    name = re.search(r"BLAS_INFO=([^,\s]+)", torch.__config__.show())
    assert name is not None and blas().split(" ")[0] == name.group(1)


def test_the_blas_version_is_the_builds_line_without_its_list_dash(monkeypatch):
    """torch's build config lists the library as ``  - Intel(R) oneAPI Math Kernel Library Version ...``: the
    record keeps the line without its indentation and dash. Mutations caught (issue 49, seed 9): the dash kept, or
    stripped with other characters."""
    import torch

    from fastweights.evidence.provenance import blas

    config = ("PyTorch built with:\n  - Intel(R) oneAPI Math Kernel Library Version 2024.2-Product Build 20240605 "
              "for Intel(R) 64 architecture applications\n  - BLAS_INFO=mkl, LAPACK_INFO=mkl,\n")
    monkeypatch.setattr(torch.__config__, "show", lambda: config)
    assert blas() == ("mkl (Intel(R) oneAPI Math Kernel Library Version 2024.2-Product Build 20240605 for Intel(R) 64 "
                      "architecture applications)")


@pytest.mark.parametrize("config, want", [
    ("PyTorch built with:\n  - OpenBLAS 0.3.27 SKYLAKEX\n  - BLAS_INFO=open, LAPACK_INFO=open,\n",
     "open (OpenBLAS 0.3.27 SKYLAKEX)"),  # an OpenBLAS target name: only the dash and spaces are stripped
    ("PyTorch built with:\n  - BLAS_INFO=accelerate,\n", "accelerate"),  # no version line: the name alone
    ("PyTorch built with:\n  - nothing about BLAS\n", "unknown"),
], ids=["openblas", "no-version", "no-blas"])
def test_the_blas_of_other_builds(monkeypatch, config, want):
    import torch

    from fastweights.evidence.provenance import blas

    monkeypatch.setattr(torch.__config__, "show", lambda: config)
    assert blas() == want


def test_the_command_line_is_this_processs_unless_given(monkeypatch):
    """Without ``argv``: sys.argv, its script made relative; a first word that is no file (``-c``) and a flag whose
    value is no path are kept as they are; a flag's value is what follows its first '=' (a path may hold '=')."""
    monkeypatch.setattr(sys, "argv", [str(ROOT / "tools" / "report.py"), "--check"])
    assert command_line(ROOT, program="python") == "python tools/report.py --check"
    assert command_line(ROOT, ["-c", f"--set=a={ROOT}/x"], program="python") == f"python -c --set=a={ROOT}/x"
    assert command_line(ROOT, [f"--out={ROOT}/runs/a=b"], program="python") == "python --out=runs/a=b"
    assert command_line(ROOT, [], program="python") == "python"


def test_the_machine_record_on_stand_ins(monkeypatch):
    """Every field under its name, from its source: the processor's name, else the architecture; the first of the
    load averages; the GPU's name when CUDA is there; no load average where the system has none."""
    import os
    import platform

    import torch

    from fastweights.evidence import provenance as pv

    monkeypatch.setattr(platform, "python_version", lambda: "3.99.0")
    monkeypatch.setattr(platform, "processor", lambda: "")  # many Linux builds report nothing here
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(os, "cpu_count", lambda: 7)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.5, 2.5, 3.5))
    monkeypatch.setattr(pv, "blas", lambda: "mkl (v)")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "H200")
    assert pv.machine() == {"python": "3.99.0", "torch": torch.__version__, "cpu": "x86_64",
                            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "blas": "mkl (v)", "cores": 7,
                            "torch_threads": torch.get_num_threads(), "load_average_1m": 1.5, "gpu": "H200"}
    monkeypatch.setattr(platform, "processor", lambda: "AMD EPYC")
    monkeypatch.delattr(os, "getloadavg")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    record = pv.machine()
    assert record["cpu"] == "AMD EPYC" and record["load_average_1m"] is None and "gpu" not in record


def test_dirty_paths_and_the_code_hash_follow_every_kind_of_change(tmp_path):
    """dirty: a tracked change (staged or not), not an untracked file, each path named; the code hash: a staged
    change counts, two different binary changes differ, a tracked file outside the code (README) does not;
    outside a checkout: no commit, no dirty flag."""
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], capture_output=True, check=True)

    git("init", "-q")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "m.py").write_text("x = 1\n")
    (tmp_path / "src" / "w.bin").write_bytes(b"\0\1\2")
    (tmp_path / "README.md").write_text("notes\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    clean = git_state(tmp_path)
    assert clean["dirty"] is False and clean["dirty_paths"] == []
    (tmp_path / "src" / "untracked.txt").write_text("u\n")
    assert git_state(tmp_path)["dirty"] is False  # untracked files do not make the tree dirty
    (tmp_path / "src" / "untracked.txt").unlink()
    (tmp_path / "README.md").write_text("more notes\n")
    readme = git_state(tmp_path)
    assert readme["dirty"] is True and readme["dirty_paths"] == ["README.md"] and readme["code"] == clean["code"]
    (tmp_path / "src" / "m.py").write_text("x = 2\n")
    git("add", "src/m.py")  # staged: still a difference from the commit
    staged = git_state(tmp_path)
    assert staged["code"] != clean["code"] and sorted(staged["dirty_paths"]) == ["README.md", "src/m.py"]
    codes = []
    for content in (b"\0\1\3", b"\0\1\4"):
        (tmp_path / "src" / "w.bin").write_bytes(content)
        codes.append(git_state(tmp_path)["code"])
    assert codes[0] != codes[1]  # two binary changes: two code hashes
    assert git_state(tmp_path / "src" / "nowhere") == {"commit": None, "dirty": None}
