"""Mutation testing of a change (``make mutants``): mutmut 3 mutates only the lines the change touches and runs
the tests that reach them; every surviving mutant is killed by a new test or accepted, with its reason, in
``tests/mutants/accepted.toml``.

    make mutants                                   # the change since BASE (default: origin/main's merge base)
    make mutants BASE=1e50585                      # since a commit
    python tools/mutants.py --base 1e50585 --out benchmarks/results/mutants.json

What it does (mutmut 3.8, pinned in the dev extra; its own docs: https://mutmut.readthedocs.io):

1. The committed tree at HEAD goes into a temporary worktree (the checkout is never touched), with a
   ``[tool.mutmut]`` section naming the changed files under ``src/`` (``only_mutate``) and the test files that
   import their modules (``pytest_add_cli_args_test_selection``; ``--tests`` names others).
2. mutmut writes every mutant of those files; the ones whose mutated line is not a line the change added or
   modified (``git diff -U0 BASE HEAD``) are left out.
3. ``mutmut run`` on the rest, on one core (``--max-children``): it first records which of the selected tests
   reach which function, then runs, per mutant, only those tests.
   With ``--sample N`` (a large change: mutmut's first step alone, every selected test run once under its
   call-recording trampolines, took hours of one core on 11,000 mutants), N mutants drawn at random are each
   applied to a worktree as the lines they change and tested until the first failure (``pytest -x``),
   ``--max-children`` worktrees at once: first the test functions that ran the mutated line, then, unless one
   failed, the test files that import the mutant's module. Which test ran which line (and how long each test
   took, so that a line run by hundreds of tests is tried on the quickest that fit in half the timeout) comes
   from one run of the whole suite under coverage.py with a context per test function (kept in the user's cache for this
   commit): a test that reaches the module only through the command line in its own process, or through a
   package that re-exports it, is found there and not by its imports (the sample of 2026-11-29 counted such
   mutants as survivors). A line run only in a subprocess has no test function: the imports decide.
4. Each mutant's status (killed, survived, no tests, timeout, ...) and, for a survivor, its one-line diff; a
   survivor matching an entry of the accepted file (its function glob and, when given, the mutated line's
   text, ``line``, or a regular expression the mutated line matches, ``line_matches``) is ``accepted`` with that
   entry's reason. The score is killed / (mutants - accepted - no tests - not applied).

Writes the JSON (``--out``, default: printed only) with the command, the base, per-file counts and every
survivor; exit status 1 when an unaccepted survivor is left, 2 on bad input.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from fastweights.cli.script_parser import ScriptParser, exit_status_of

REPO = Path(__file__).resolve().parents[1]
ACCEPTED = REPO / "tests" / "mutants" / "accepted.toml"
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped", 36: "timeout",
          -24: "timeout", 37: "caught by type check", None: "not checked"}  # mutmut.stats.status_by_exit_code
# mutmut's generation step, as ``mutmut run`` does it (mutmut 3.8.1's internal functions: the pin keeps them)
GENERATE = ("import os; from mutmut.__main__ import create_mutants; "
            "from mutmut.utils.file_utils import copy_also_copy_files, copy_src_dir; "
            "os.makedirs('mutants', exist_ok=True); copy_src_dir(); copy_also_copy_files(); create_mutants(1)")


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def default_base() -> str:
    """The last tag, else origin/main's merge base with HEAD."""
    for args in (["describe", "--tags", "--abbrev=0"], ["merge-base", "HEAD", "origin/main"]):
        try:
            return git(*args).strip()
        except subprocess.CalledProcessError:
            continue
    raise SystemExit("error: no tag and no origin/main here: give --base REV")


def changed_lines(base: str) -> dict[str, set[int]]:
    """src/ Python file -> the line numbers (at HEAD) the change since ``base`` added or modified."""
    out: dict[str, set[int]] = {}
    current = None
    for line in git("diff", "-U0", "--no-color", base, "HEAD", "--", "src").splitlines():
        if line.startswith("+++ "):
            path = line[4:].removeprefix("b/")
            current = path if path.endswith(".py") and path != "/dev/null" else None
        elif line.startswith("@@") and current:
            m = re.match(r"@@ -\S+ \+(\d+)(?:,(\d+))? @@", line)
            start, count = int(m.group(1)), int(m.group(2) or 1)
            out.setdefault(current, set()).update(range(start, start + count))
    return {f: lines for f, lines in out.items() if lines}


def _module(file: str) -> str:
    """``fastweights.a.b`` of ``src/fastweights/a/b.py`` (a package's ``__init__.py``: the package)."""
    return file.removeprefix("src/").removesuffix(".py").replace("/", ".").removesuffix(".__init__")


def _naming(module: str) -> re.Pattern:
    """Python text that imports ``module`` (``fastweights.a.b``, ``from fastweights.a import b``)."""
    package, _, name = module.rpartition(".")
    return re.compile(rf"\b{re.escape(module)}\b|from {re.escape(package)} import [^\n]*\b{re.escape(name)}\b")


def tests_for(files: list[str]) -> list[str]:
    """The test files that import one of ``files``' modules. A module no test imports by name (reached through
    its package or the command line) takes the tests of the nearest modules under src/ that import it."""
    texts = {str(p.relative_to(REPO)): p.read_text() for p in sorted((REPO / "tests").rglob("test_*.py"))}
    sources = {_module(str(p.relative_to(REPO))): p.read_text() for p in sorted((REPO / "src").rglob("*.py"))}
    found = set()
    for f in files:
        level, seen = {_module(f)}, set()
        while level:
            hits = {t for t, text in texts.items() if any(_naming(m).search(text) for m in level)}
            if hits:
                found |= hits
                break
            seen |= level
            level = {m for m, text in sources.items() if m not in seen and any(_naming(x).search(text) for x in level)}
    return sorted(found)


def coverage_map(tree: Path, tests: list[str], files: list[str]) -> tuple[dict[str, dict[int, list[str]]], dict]:
    """(file (``src/...``) -> line -> the test functions (pytest node ids ``path::function``, every
    parametrisation) that ran the line in pytest's process; node id -> its seconds in that run, setup and
    teardown included), from one run of ``tests`` in ``tree`` under coverage.py with a context per test function.
    Cached per commit in the user's cache folder."""
    from fastweights.core.files import user_cache_dir

    head = git("rev-parse", "HEAD", cwd=tree).strip()
    key = hashlib.sha256(json.dumps([head, sorted(tests), sorted(files)]).encode()).hexdigest()[:16]
    cache = user_cache_dir() / "mutants" / f"coverage-{key}.json"
    if cache.is_file():
        stored = json.loads(cache.read_text())
        return ({f: {int(line): ids for line, ids in lines.items()} for f, lines in stored["lines"].items()},
                stored["seconds"])
    rc, data, report = tree / ".mutants-coveragerc", tree / ".mutants-coverage", tree / ".mutants-coverage.json"
    rc.write_text("[run]\ndynamic_context = test_function\ninclude =\n"
                  + "".join(f"    {tree / f}\n" for f in files))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree / "src"), "PYTHONDONTWRITEBYTECODE": "1",
           "COVERAGE_FILE": str(data)}
    done = subprocess.run([sys.executable, "-m", "coverage", "run", f"--rcfile={rc}", "-m", "pytest", "-q", "-p",
                           "no:cacheprovider", "-p", "no:xdist", "-p", "no:randomly", "--durations=0",
                           "--durations-min=0", *tests], cwd=tree, env=env, capture_output=True, text=True)
    subprocess.run([sys.executable, "-m", "coverage", "json", f"--rcfile={rc}", "--show-contexts", "-o",
                    str(report)], cwd=tree, env=env, check=True, capture_output=True)  # failing tests count too
    test_files = [str(p.relative_to(tree)) for p in sorted((tree / "tests").rglob("test_*.py"))]
    found, seconds = tests_by_line(json.loads(report.read_text()), tree, test_files), test_seconds(done.stdout)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"lines": found, "seconds": seconds}))
    return found, seconds


def test_seconds(durations: str) -> dict[str, float]:
    """pytest's ``--durations=0`` report as seconds per test function (``path::function``: its parametrisations,
    setup, call and teardown summed)."""
    out: dict[str, float] = {}
    for m in re.finditer(r"^(\d+(?:\.\d+)?)s (?:setup|call|teardown)\s+(\S+)$", durations, re.M):
        node = re.sub(r"\[.*\]$", "", m.group(2))
        out[node] = out.get(node, 0.0) + float(m.group(1))
    return out


def quickest(tests: list[str], seconds: dict[str, float], budget_s: float) -> list[str]:
    """``tests`` ordered by their seconds in the coverage run, as many as fit in ``budget_s`` (at least one): a line
    that every command runs (a parser's help) is covered by hundreds of tests, whose whole run would pass any
    timeout for a mutant no test can see."""
    chosen, spent = [], 0.0
    for t in sorted(tests, key=lambda t: (seconds.get(t, float("inf")), t)):
        spent += seconds.get(t, budget_s)
        if chosen and spent > budget_s:
            break
        chosen.append(t)
    return chosen


def tests_by_line(report: dict, tree: Path, test_files: list[str]) -> dict[str, dict[int, list[str]]]:
    """:func:`coverage_map` of a ``coverage json --show-contexts`` report: each context (``module.function`` or
    ``module.Class.method``, the module a test file's stem or dotted path) as a node id of ``test_files``;
    the empty context (imports, subprocesses, fixtures) dropped."""
    by_module = {}
    for t in test_files:
        by_module[Path(t).stem] = t
        by_module[t.removesuffix(".py").replace("/", ".")] = t

    def node(context: str) -> str | None:
        parts = context.split(".")
        for k in range(len(parts) - 1, 0, -1):
            if ".".join(parts[:k]) in by_module:
                return "::".join([by_module[".".join(parts[:k])], *parts[k:]])
        return None

    out: dict[str, dict[int, list[str]]] = {}
    for path, data in report["files"].items():
        file = Path(path)
        file = str(file.resolve().relative_to(tree.resolve())) if file.is_absolute() else str(file)
        for line, contexts in data.get("contexts", {}).items():
            ids = sorted({n for c in contexts if c and (n := node(c))})
            if ids:
                out.setdefault(file, {})[int(line)] = ids
    return out


def mutmut_settings(files: list[str], tests: list[str]) -> dict:
    """mutmut's ``[tool.mutmut]`` for a whole run (``make mutants`` without ``--sample``): it mutates ``files`` and
    runs ``tests`` in a copy of src/ and tests/ of its own, into which ``also_copy`` brings what the tests read
    beside them (the scripts of benchmarks/ and tools/, the docs, the package's data)."""
    return {"source_paths": ["src/"], "only_mutate": files, "pytest_add_cli_args_test_selection": tests,
            "pytest_add_cli_args": ["-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:randomly"],
            "also_copy": ["benchmarks", "tools", "docs", "README.md", "Makefile", *package_data()]}


def generate_in(tree: Path, settings: dict) -> None:
    """mutmut's mutants written into ``tree/mutants``: ``settings`` appended as the tree's ``[tool.mutmut]``, then
    mutmut's generation step (:data:`GENERATE`), on one thread."""
    with open(tree / "pyproject.toml", "a") as f:
        f.write("\n[tool.mutmut]\n" + "\n".join(f"{k} = {json.dumps(v)}" for k, v in settings.items()) + "\n")
    subprocess.run([sys.executable, "-c", GENERATE], cwd=tree, env={**os.environ, "OMP_NUM_THREADS": "1"},
                   check=True, capture_output=True)


def package_data() -> list[str]:
    """The package's files that are not Python (presets, corpora, ...): mutmut copies only the .py files of src/."""
    return sorted({str(Path(p)) for p in git("ls-files", "src").splitlines() if not p.endswith(".py")})


def mutant_lines(tmp: Path, files: list[str], edits: dict | None = None) -> dict[str, tuple[str, int, str, str]]:
    """mutant name -> (file, line at HEAD, the original line, the mutated line), from mutmut's generated files
    (each function's copies ``x_f__mutmut_N`` beside its ``x_f__mutmut_orig``, their spans in ``.spans``).
    ``edits``, when given, receives per mutant the lines it changes as one span: [(first line at HEAD, the
    generated original lines, the generated mutated lines)], each side its lines joined by newlines (a statement
    over several lines that a mutant replaces by one, ``x = None``, changes their number), the function's name on
    a mutated ``def`` line (a default argument) the file's, not mutmut's."""
    result = {}
    for f in files:
        generated = tmp / "mutants" / f
        spans_file = generated.with_name(generated.name + ".spans")
        if not spans_file.is_file():
            continue
        spans = json.loads(spans_file.read_text())["spans"]
        lines = generated.read_text().splitlines()
        source = (tmp / f).read_text().splitlines()
        module = f.removeprefix("src/").removesuffix(".py").replace("/", ".")  # mutmut's names keep __init__
        for orig_name, (a0, b0) in spans.items():
            if not orig_name.endswith("__mutmut_orig"):
                continue
            # mutmut names a function's copies x_f__mutmut_*, a method's xǁClassǁf__mutmut_*: the file says f
            source_name = re.sub(r"^x(?:ǁ[^ǁ]*ǁ|_)", "", orig_name.removesuffix("__mutmut_orig"))
            orig = lines[a0 - 1:b0]
            body = [i for i, text in enumerate(orig) if text.strip()]  # where the function's text sits in the source
            at = _find_block(source, [orig[i] for i in body[1:]])  # the def line's name differs: match below it
            stem = orig_name.removesuffix("orig")
            for name, (a, b) in spans.items():
                if not name.startswith(stem) or name == orig_name:
                    continue
                mutant = [text.replace(name, orig_name) for text in lines[a - 1:b]]  # the def line: its name
                k = next((i for i, (x, y) in enumerate(zip(orig, mutant)) if x != y), None)
                if k is None or at is None:
                    continue
                line = at + (k - body[1]) + 1  # 1-based, in the file at HEAD
                named = [text.replace(orig_name, source_name) for text in (orig[k], mutant[k])]
                result[f"{module}.{name}"] = (f, line, named[0].strip(), named[1].strip())
                if edits is not None:  # the changed span, for applying the mutant as a patch
                    same_tail = 0  # lines equal at both ends are not the mutant's
                    while same_tail < min(len(orig), len(mutant)) - k - 1 and orig[-1 - same_tail] == mutant[-1 - same_tail]:
                        same_tail += 1
                    old, new = (
                        "\n".join(text.replace(orig_name, source_name) for text in side[k:len(side) - same_tail])
                        for side in (orig, mutant))
                    edits[f"{module}.{name}"] = [(line, old, new)]
    return result


def _find_block(source: list[str], block: list[str]) -> int | None:
    """Index in ``source`` of the first line of ``block`` (blank lines ignored on both sides), or None."""
    want = [x for x in block if x.strip()]
    if not want:
        return None
    for i, text in enumerate(source):
        if text == want[0]:
            j, ok = i, True
            for w in want[1:]:
                j += 1
                while j < len(source) and not source[j].strip():
                    j += 1
                if j >= len(source) or source[j] != w:
                    ok = False
                    break
            if ok:
                return i
    return None


def patched(source: str, edits: list[tuple[int, str, str]]) -> str | None:
    """``source`` with a mutant's ``edits`` applied, each (first line, original lines, mutated lines; lines joined
    by newlines) re-indented by the offset between mutmut's copy and the file's lines; None when a line is not the
    one mutmut mutated. An edit that changes the number of lines moves the lines below it: :func:`mutant_lines`
    gives each mutant one span."""
    lines = source.split("\n")
    for line, original, mutated in edits:
        old, new = original.split("\n"), mutated.split("\n")
        here = lines[line - 1:line - 1 + len(old)] if line >= 1 else []
        if len(here) != len(old) or any(h.strip() != o.strip() for h, o in zip(here, old)):
            return None
        shift = (len(here[0]) - len(here[0].lstrip())) - (len(old[0]) - len(old[0].lstrip()))
        lines[line - 1:line - 1 + len(old)] = [
            " " * max(len(m) - len(m.lstrip()) + shift, 0) + m.lstrip() if m.strip() else m for m in new]
    return "\n".join(lines)


def run_patched(tree: Path, file: str, edits: list | None, tests: list[str], timeout: float) -> str:
    """One mutant's status in the worktree ``tree``: applied to ``file`` as a patch, ``tests`` run until the first
    failure (killed), all passing (survived), none collected (no tests), past ``timeout`` seconds (timeout)."""
    path = tree / file
    original = path.read_text()
    text = patched(original, edits) if edits else None
    if text is None:
        return "not applied"
    if not tests:
        return "no tests"
    path.write_text(text)
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree / "src"), "PYTHONDONTWRITEBYTECODE": "1"}
        done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                               "-p", "no:randomly", *tests], cwd=tree, env=env, capture_output=True, timeout=timeout)
        if done.returncode == 4 and b"ERROR collecting" in done.stdout:
            return "killed"  # a test module no longer imports, so pytest finds none of its node ids (exit 4)
        return {0: "survived", 5: "no tests", 4: "error"}.get(done.returncode, "killed")  # 1: failed, 2: import
    except subprocess.TimeoutExpired:
        return "timeout"
    finally:
        path.write_text(original)


def run_sample(chosen: list[str], where: dict, edits: dict, trees: list[Path], tests: list[str] | None,
               timeout: float, by_line: dict | None = None, seconds: dict | None = None) -> dict[str, str]:
    """Each mutant's :func:`run_patched` status, ``len(trees)`` at a time (a worktree each); its tests: ``tests``,
    else the test functions that ran its line (``by_line``, :func:`coverage_map`; the quickest that fit in half
    the timeout by their ``seconds`` there) and, when none of them fails, the rest of the test files that import
    its module."""
    import queue
    from concurrent.futures import ThreadPoolExecutor

    free = queue.Queue()
    for t in trees:
        free.put(t)

    def one(name: str) -> str:
        tree = free.get()
        try:
            f, line = where[name][:2]
            if tests is not None:
                return run_patched(tree, f, edits.get(name), tests, timeout)
            covering = quickest((by_line or {}).get(f, {}).get(line, []), seconds or {}, timeout / 2)
            first = run_patched(tree, f, edits.get(name), covering, timeout) if covering else "no tests"
            if first in ("killed", "timeout", "not applied"):
                return first
            importers = tests_for([f])
            # the tests already run in the first stage are not run again (a survivor's whole importers' run is
            # the slow part of a sample)
            again = [x for t in covering for x in ("--deselect", t)] if importers else []
            second = run_patched(tree, f, edits.get(name), importers + again, timeout)
            return "survived" if second == "no tests" and first == "survived" else second
        finally:
            free.put(tree)

    out = {}
    with ThreadPoolExecutor(len(trees)) as pool:
        for i, (name, status) in enumerate(zip(chosen, pool.map(one, chosen)), 1):
            out[name] = status
            print(f"{i}/{len(chosen)} {status:>11}  {name}", flush=True)
    return out


def accepted_reason(entries: list[dict], name: str, mutated: str) -> str | None:
    import fnmatch

    for e in entries:
        if fnmatch.fnmatch(name, e["mutant"]) and ("line" not in e or e["line"] == mutated) and (
                "line_matches" not in e or re.search(e["line_matches"], mutated)):
            return e["reason"]
    return None


def accepted_entries() -> list[dict]:
    """The entries of the accepted list (:data:`ACCEPTED`; none when it is missing)."""
    return tomllib.loads(ACCEPTED.read_text()).get("accepted", []) if ACCEPTED.is_file() else []


def tally(names: list[str], where: dict, statuses: dict) -> tuple[list[dict], dict[str, int]]:
    """The mutants ``names`` not killed, each with its file, line, original and mutated line and status (a survivor
    an entry of the accepted list matches: "accepted" with the entry's reason), and the count of each status."""
    entries = accepted_entries()
    rows, counts = [], {}
    for name in names:
        f, line, original, mutated = where[name]
        status = statuses.get(name, "not checked")
        reason = accepted_reason(entries, name, mutated) if status == "survived" else None
        status = "accepted" if reason else status
        counts[status] = counts.get(status, 0) + 1
        if status != "killed":
            rows.append({"mutant": name, "file": f, "line": line, "original": original, "mutated": mutated,
                         "status": status, **({"reason": reason} if reason else {})})
    return rows, counts


def wilson(p: float, n: int, z: float = 1.96) -> list[float]:
    """The Wilson score interval of a proportion ``p`` measured on ``n`` trials (95% for z = 1.96)."""
    if n == 0:
        return [0.0, 1.0]
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return [(centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)]


def main(argv: list[str] | None = None) -> int:
    ap = ScriptParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="the change is HEAD against this revision (default: the last tag, else "
                                   "origin/main's merge base)")
    ap.add_argument("--tests", help="test files or folders to run, comma-separated (default: those importing the "
                                    "changed modules)")
    ap.add_argument("--max-children", type=int, default=1, help="mutants tested at once (one core: 1)")
    ap.add_argument("--sample", type=int, help="test this many of the change's mutants, drawn at random (a large "
                                               "change's score estimated; default: every mutant)")
    ap.add_argument("--seed", type=int, default=0, help="the draw's seed, with --sample")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one sampled mutant's tests may take")
    ap.add_argument("--out", help="write the JSON here (default: print the summary only)")
    args = ap.parse_args(argv)
    if args.sample is not None and args.sample < 1:
        ap.error(f"--sample {args.sample}: must be at least 1")
    if shutil.which("mutmut") is None and not (Path(sys.executable).parent / "mutmut").exists():
        print("error: mutmut is not installed: pip install -e '.[dev]'", file=sys.stderr)
        return 2
    try:
        base = args.base or default_base()
        git("rev-parse", "--verify", base + "^{commit}")
    except subprocess.CalledProcessError:
        print(f"error: --base {args.base}: not a commit here", file=sys.stderr)
        return 2
    lines_by_file = changed_lines(base)
    files = sorted(lines_by_file)
    if not files:
        print(f"no Python line under src/ changed since {base}: nothing to mutate")
        return 0
    tests = args.tests.split(",") if args.tests else tests_for(files)
    mutmut = str(Path(sys.executable).parent / "mutmut") if (Path(sys.executable).parent / "mutmut").exists() \
        else "mutmut"
    started = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="fastweights-mutants-"))
    try:
        git("worktree", "add", "--detach", str(tmp / "tree"), "HEAD")
        tree = tmp / "tree"
        generate_in(tree, mutmut_settings(files, tests))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        edits: dict = {}
        where = mutant_lines(tree, files, edits)
        chosen = sorted(n for n, (f, line, _, _) in where.items() if line in lines_by_file[f])
        generated = len(chosen)
        if args.sample is not None and args.sample < generated:
            chosen = sorted(random.Random(args.seed).sample(chosen, args.sample))
        print(f"{len(chosen)} of {generated} mutants on the {sum(map(len, lines_by_file.values()))} changed lines of {len(files)} "
              f"files since {base} ({len(where)} in those files); tests: {len(tests)} files", flush=True)
        statuses = {}
        if chosen and args.sample is None:
            done = subprocess.run([mutmut, "run", "--max-children", str(args.max_children), *chosen], cwd=tree,
                                  env=env, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"error: mutmut run failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
            codes = {}
            for f in files:
                meta = tree / "mutants" / (f + ".meta")
                if meta.is_file():
                    codes.update(json.loads(meta.read_text())["exit_code_by_key"])
            statuses = {name: STATUS.get(codes.get(name), "suspicious") for name in chosen}
        elif chosen:  # a sample: each mutant as a patch, in worktrees of its own per worker
            trees = [tree]
            for k in range(1, args.max_children):
                git("worktree", "add", "--detach", str(tmp / f"tree{k}"), "HEAD")
                trees.append(tmp / f"tree{k}")
            by_line = seconds = None
            if not args.tests:
                print("which test runs which changed line: the whole suite once under coverage, one core (cached "
                      "for this commit)", flush=True)
                by_line, seconds = coverage_map(tree, ["tests"], files)
            statuses = run_sample(chosen, where, edits, trees, args.tests.split(",") if args.tests else None,
                                  args.timeout, by_line, seconds)
    finally:
        for worktree in sorted(tmp.glob("tree*")):
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    rows, counts = tally(chosen, where, statuses)
    judged = sum(v for k, v in counts.items() if k not in ("accepted", "no tests", "not applied"))
    score = counts.get("killed", 0) / judged if judged else 1.0
    summary = {"base": base, "files": {f: len(lines_by_file[f]) for f in files}, "tests": tests,
               "mutants": len(chosen), "generated": generated, "counts": counts, "score": score,
               "elapsed_s": time.time() - started, "not_killed": rows}
    if len(chosen) < generated:  # a sample: the score's 95% interval (Wilson), as the draw alone makes it vary
        summary |= {"sample": {"size": len(chosen), "seed": args.seed}, "score_interval_95": wilson(score, judged)}
    for r in rows:
        print(f"{r['status']:>12}  {r['file']}:{r['line']}  {r['original']}  ->  {r['mutated']}")
    interval = summary.get("score_interval_95")
    print(f"score {score:.3f}" + (f" (95% interval {interval[0]:.3f}-{interval[1]:.3f}, a sample of {len(chosen)} "
                                  f"of {generated})" if interval else "") + ": "
          + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    if args.out:
        from fastweights.evidence.result_files import write_json
        from fastweights.evidence.provenance import provenance

        write_json(Path(args.out), {**provenance(REPO, sys.argv), **summary})
    return 1 if counts.get("survived") else 0


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
