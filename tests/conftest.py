"""Test-wide settings and shared fixtures (builders live in helpers.py).

One torch thread: the tests use tiny tensors, where a second OpenMP thread only adds
synchronisation, and on a busy machine spinning threads can slow tiny matmuls a hundredfold.
"""

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")  # for subprocesses the tests start
# The library's per-machine cache (the CPU linear's kernel choices, the compiled fast-RNN kernel) in a folder of the
# tests', shared by their processes: a choice measured under the suite's load is never kept for the user's own runs
os.environ["XDG_CACHE_HOME"] = str(Path(tempfile.gettempdir()) / f"fastweights-tests-cache-{os.getuid()}")
torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import helpers` from every folder of tests/


def pytest_runtest_logreport(report):
    """A failing test's name on stderr the moment it fails (issue 49: under ``-q`` a suite killed by a time limit on a
    busy machine lost every failure's name with the summary it never printed). With xdist this runs in the
    controller, which receives every worker's reports."""
    if report.failed and not hasattr(report, "wasxfail") and "PYTEST_XDIST_WORKER" not in os.environ:
        sys.stderr.write(f"\nFAILED {report.nodeid} ({report.when})\n")
        sys.stderr.flush()


@pytest.fixture(autouse=True)
def one_thread():
    """Every test starts on one thread, whatever an earlier test set (a training run's train.threads, say)."""
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def recorded_lines_counted_from_zero():
    """helpers.assert_recorded_line keys each line by how many the test checked before: the count starts at 0 for
    every run of a test, also when one process runs it twice (mutmut's clean and stats runs, a rerun plugin)."""
    import helpers

    helpers._RECORDED_LINE_CALLS.clear()


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """One trained run of the ``tiny`` preset (20 steps), shared by the command-line tests: read it, or copy
    it before changing anything in it."""
    from fastweights.cli import main

    out = tmp_path_factory.mktemp("tiny-run") / "run"
    assert main(["train", "--preset", "tiny", "--quiet", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def char_checkpoint(tmp_path_factory):
    """An untrained tiny char-level checkpoint (2 layers, d_model 16) with its corpus and a ``doc.txt``
    beside it; a fresh copy per module, which may write into it (statistics, tuned settings)."""
    from helpers import untrained_char_checkpoint

    d = untrained_char_checkpoint(tmp_path_factory.mktemp("ckpt"), "the cat sat on the mat. the dog sat on the log. " * 40)
    (d / "doc.txt").write_text("the cat sat on the log. the dog sat on the mat. " * 3)
    return d
