"""The supported transformers range, tested at both ends: tests/hf in a throwaway venv per version.

    nice -n 10 python tools/transformers_range.py            # the lower bound and the newest release
    python tools/transformers_range.py --versions 5.23.0      # given versions only

The range is the requirement of ``[project.optional-dependencies] hf`` in pyproject.toml (e.g.
``transformers>=5.23,<6``). Its lower bound is the oldest release the registry has that satisfies it,
its upper end the newest release the registry has (``pip index versions transformers``); a newest
release outside the stated range is tested too, and reported as outside it.

The tested code is the commit the repository is at (``git archive HEAD``, unpacked in a temporary
folder; ``--working-tree``: the working tree's tracked and untracked, not ignored, files instead), so
that the result names exactly what it tested, edits made while it runs do not mix in, and the installs
write nothing into the repository. For each version: a fresh venv there, ``pip install
torch==<the torch of this interpreter>`` first and alone (the local CPU build, as ``make`` does), then
``pip install -e '.[dev,hf]' transformers==VERSION`` of the snapshot, then ``python -m pytest tests/hf``
there on one thread (``OMP_NUM_THREADS=1``, no xdist), with a JUnit XML report for the counts. The
temporary folder is deleted afterwards; nothing of the project's own .venv is used or changed.

Writes benchmarks/results/transformers_range.json (``--name NAME``: NAME.json): the requirement, the
registry's versions tested, and per version the pytest counts (passed, failed, errors, skipped), the failing
test ids, the exit code, the installed torch / huggingface_hub / tokenizers versions and the seconds it took.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

from fastweights.evidence.result_files import REPO, git_state, write_result
from fastweights.cli.script_parser import ScriptParser, exit_status_of


TESTS = "tests/hf"


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py): the Hugging Face
    wrapper under dynamic evaluation (the code tests/hf exercises against each transformers release)."""
    return [probes.probe("hf_dynamic", rule="sgd")]


def requirement() -> str:
    """The transformers requirement of the ``hf`` extra, e.g. ``transformers>=5.23,<6``."""
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    reqs = [r for r in data["project"]["optional-dependencies"]["hf"] if r.replace(" ", "").startswith("transformers")]
    if len(reqs) != 1:
        raise SystemExit(f"pyproject.toml's hf extra names transformers {len(reqs)} times, expected once")
    return reqs[0].replace(" ", "")


def registry_versions(python: str) -> list[str]:
    """transformers' releases in the package registry, newest first (``pip index versions``)."""
    out = subprocess.run([python, "-m", "pip", "index", "versions", "transformers"], capture_output=True, text=True,
                         check=True).stdout
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("Available versions:"))
    return [v.strip() for v in line.split(":", 1)[1].split(",") if v.strip()]


def snapshot(dest: Path, working_tree: bool = False) -> Path:
    """The code to test, at ``dest``: the commit HEAD, or the working tree's tracked and untracked, not ignored,
    files."""
    import io
    import shutil
    import tarfile

    dest.mkdir(parents=True)
    if not working_tree:
        data = subprocess.run(["git", "archive", "--format=tar", "HEAD"], cwd=REPO, capture_output=True,
                              check=True).stdout
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(dest, filter="data")
        return dest
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def run(cmd: list[str], cwd: Path, env: dict, log) -> int:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    return subprocess.run(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode


def junit_counts(path: Path) -> dict:
    """passed / failed / errors / skipped and the failing test ids from pytest's JUnit XML."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    total = sum(int(s.get("tests", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) for s in suites)
    errors = sum(int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    bad = [f"{c.get('classname')}::{c.get('name')}" for c in root.iter("testcase")
           if c.find("failure") is not None or c.find("error") is not None]
    return {"passed": total - failed - errors - skipped, "failed": failed, "errors": errors, "skipped": skipped,
            "failing": bad}


def test_version(version: str, torch_version: str, tree: Path, workdir: Path, timeout: float) -> dict:
    """Install transformers==version with the project snapshot ``tree`` in a fresh venv under ``workdir`` and run
    tests/hf there."""
    venv = workdir / f"venv-{version}"
    py = str(venv / "bin" / "python")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    log_path = workdir / f"log-{version}.txt"
    t0 = time.perf_counter()
    record: dict = {"version": version}
    with open(log_path, "w") as log:
        steps = [[sys.executable, "-m", "venv", str(venv)],
                 [py, "-m", "pip", "install", "-q", f"torch=={torch_version}"],
                 [py, "-m", "pip", "install", "-q", "-e", ".[dev,hf]", f"transformers=={version}"]]
        for cmd in steps:
            rc = run(cmd, tree, env, log)
            if rc:
                record.update(install_failed=" ".join(cmd[2:] if cmd[0] == py else cmd), returncode=rc)
                break
        else:
            show = subprocess.run([py, "-c", "import importlib.metadata as m; print(' '.join(m.version(p) for p in "
                                   "('transformers', 'torch', 'huggingface_hub', 'tokenizers')))"],
                                  capture_output=True, text=True, env=env).stdout.split()
            record["installed"] = dict(zip(("transformers", "torch", "huggingface_hub", "tokenizers"), show))
            junit = workdir / f"junit-{version}.xml"
            cmd = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", f"--timeout={int(timeout)}",
                   f"--junitxml={junit}", TESTS]
            rc = run(cmd, tree, env, log)
            record["returncode"] = rc
            record["pytest"] = " ".join(["python", *cmd[1:-2], TESTS])
            if junit.is_file():
                record.update(junit_counts(junit))
    record["seconds"] = round(time.perf_counter() - t0, 1)
    tail = log_path.read_text().splitlines()[-15:]
    # the throwaway folder is written TMP: a result names no path outside the repository
    record["log_tail"] = [line.replace(str(log_path.parent), "TMP") for line in tail]
    return record


def main() -> int:
    ap = ScriptParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", nargs="*", default=None,
                    help="transformers versions to test (default: the range's lower bound and the newest release)")
    ap.add_argument("--timeout", type=float, default=600, help="per-test timeout in seconds (default: %(default)s)")
    ap.add_argument("--working-tree", action="store_true",
                    help="test the working tree as it is instead of the commit HEAD")
    ap.add_argument("--name", default="transformers_range",
                    help="result name under benchmarks/results (default: %(default)s)")
    args = ap.parse_args()

    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    import torch

    req = requirement()
    spec = SpecifierSet(re.sub(r"^transformers", "", req))
    available = registry_versions(sys.executable)
    releases = sorted((v for v in available if not Version(v).is_prerelease), key=Version)
    in_range = [v for v in releases if v in spec]
    if not in_range:
        raise SystemExit(f"no release in the registry satisfies {req}")
    roles = {in_range[0]: "lower bound", releases[-1]: "newest release in the registry"}
    versions = args.versions or list(roles)
    torch_version = torch.__version__.split("+")[0]
    results = []
    with tempfile.TemporaryDirectory(prefix="transformers-range-") as tmp:
        tree = snapshot(Path(tmp) / "tree", args.working_tree)
        for v in versions:
            print(f"transformers {v}: installing and running {TESTS} ...", flush=True)
            rec = test_version(v, torch_version, tree, Path(tmp), args.timeout)
            rec["role"] = roles.get(v, "given")
            rec["in_range"] = v in spec
            print(f"  {rec.get('passed', 0)} passed, {rec.get('failed', 0)} failed, {rec.get('errors', 0)} errors, "
                  f"{rec.get('skipped', 0)} skipped, exit {rec.get('returncode')} ({rec['seconds']} s)", flush=True)
            results.append(rec)
    ok = all(r.get("returncode") == 0 for r in results)
    headline = [{"what": f"tests/hf with transformers {r['version']} ({r['role']} of {req}): failed tests",
                 "value": r.get("failed", 0) + r.get("errors", 0) if "passed" in r else "not run",
                 "target": "0" + (f" (of {r['passed'] + r['failed'] + r['errors']} run)" if "passed" in r else "")}
                for r in results]
    write_result(args.name, {
        "headline": headline,
        "requirement": req, "registry_newest": releases[-1], "registry_lowest_in_range": in_range[0],
        "tests": TESTS, "tested": "working tree" if args.working_tree else f"commit {git_state().get('commit')}",
        "setup": "fresh venv per version: pip install torch==<this torch>, then "
                                 "pip install -e '.[dev,hf]' transformers==VERSION; OMP_NUM_THREADS=1",
        "all_passed": ok, "versions": results})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
