"""Evidence by behaviour (tools/evidence.py and probes.py): a result is stale when
the code it measured behaves differently, found by re-running its probes, never by a list of files."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, TOOLS, stored_results_covering_every_probe_kind

sys.path.insert(0, str(TOOLS))

import evidence  # noqa: E402
import probes  # noqa: E402
import summaries  # noqa: E402


def _result(**over):
    spec = probes.probe("ops", op="delta_rule")
    rec = {"command": "python benchmarks/speed/bench_delta_rule.py", "git": {"commit": "abc"},
           "result_file": "benchmarks/results/r.json", "probes": probes.summarised([spec])}
    rec.update(over)
    return rec


def test_a_probe_is_deterministic_and_sees_a_change_of_behaviour():
    spec = probes.probe("ops", op="gated_delta_rule")
    assert probes.run_probe(spec) == probes.run_probe(spec)
    assert probes.run_probe(spec) != probes.run_probe(probes.probe("ops", op="delta_rule"))


def test_summaries_ignore_rounding_noise_but_not_a_real_difference():
    x = torch.randn(50, dtype=torch.float64)
    stored = summaries.summarise({"y": x, "n": 3, "word": "a"})
    noisy = summaries.summarise({"y": x * (1 + 1e-12 * torch.randn(50, dtype=torch.float64)), "n": 3, "word": "a"})
    assert summaries.differences(stored, noisy) == []
    moved = x.clone()
    moved[7] *= 1 + 1e-5  # one entry of fifty, a little: what a narrow change of behaviour does
    assert summaries.differences(stored, summaries.summarise({"y": moved, "n": 3, "word": "a"})) != []
    assert [d.split(":")[0] for d in summaries.differences(stored, summaries.summarise({"y": x, "n": 4, "word": "a"}))] == ["n"]
    assert summaries.differences(stored, summaries.summarise({"y": x[:49], "n": 3, "word": "a"})) != []  # shape


def test_a_summary_keeps_the_pattern_of_non_finite_values():
    x = torch.randn(6, dtype=torch.float64)
    nan = x.clone()
    nan[2] = float("nan")
    inf = x.clone()
    inf[2] = float("inf")
    lines = [summaries.summary_line(t) for t in (x, nan, inf)]
    assert len(set(lines)) == 3 and "nonfinite" in lines[1]
    assert summaries.differences({"y": lines[1]}, {"y": summaries.summary_line(nan.clone())}) == []


def test_problems_name_what_a_result_lacks(tmp_path):
    def problems(rec, name="r.json"):
        for p in tmp_path.glob("*.json"):
            p.unlink()
        (tmp_path / name).write_text(json.dumps(rec))
        return " ".join(evidence.problems(tmp_path))

    assert problems(_result()) == ""
    assert "no command" in problems(_result(command=""))
    assert "no git commit" in problems(_result(git={}))
    assert "no result_file" in problems(_result(result_file=None))
    assert "a copy" in problems(_result(), name="copy.json")
    assert "no behaviour probes" in problems(_result(probes=[]))
    assert "without kind, args or summary" in problems(_result(probes=[{"kind": "ops", "args": {}, "fingerprint": "ab"}]))


def test_a_result_whose_probe_changed_is_stale_and_listed_with_its_command(tmp_path):
    rec = _result()
    assert evidence.staleness(rec) is None
    y = rec["probes"][0]["summary"]["y"]
    shape, numbers = y.split(": ")
    rec["probes"][0]["summary"]["y"] = shape + ": " + " ".join(str(float(v) * 1.01) for v in numbers.split())
    assert evidence.staleness(rec) is not None  # measured when the operator behaved otherwise
    assert evidence.staleness(rec).startswith("behaviour changed: ops delta_rule: y: moved by 0.0")
    (tmp_path / "r.json").write_text(json.dumps(rec))
    page = evidence.rerun_page(tmp_path)
    assert "`r`" in page and "python benchmarks/speed/bench_delta_rule.py" in page


def test_every_stored_result_records_probes_and_its_file():
    assert evidence.problems() == []


def _stale_results_with(tmp_path, path: str, old: str, new: str, only: tuple[str, ...] = (),
                        capability: str | None = None) -> list[str]:
    """The stored results (``only`` these, if given) that are stale when ``path`` in a copy of the source tree
    has ``old`` replaced by ``new`` (run in a fresh process on the copy, under ``ATEN_CPU_CAPABILITY=capability``
    when given)."""
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    file = src / path
    text = file.read_text()
    assert text.count(old) >= 1, f"{old!r} not in {path}: update the test's edit"
    file.write_text(text.replace(old, new))
    script = ("import json, sys; sys.path.insert(0, 'tools'); import evidence, fastweights;"
              "assert fastweights.__file__.startswith(sys.argv[1]), fastweights.__file__;"
              "only = set(sys.argv[2:]);"
              "print(json.dumps([evidence.result_key(p) for p in evidence.result_paths()"
              " if (not only or evidence.result_key(p) in only) and evidence.staleness(json.loads(p.read_text()))]))")
    env = {**os.environ, "PYTHONPATH": str(src), "PYTHONWARNINGS": "ignore"}
    env.pop("ATEN_CPU_CAPABILITY", None)
    if capability:
        env["ATEN_CPU_CAPABILITY"] = capability
    out = subprocess.run([sys.executable, "-c", script, str(src), *only], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_behaviour_preserving_refactor_leaves_every_result_current(tmp_path):
    # a local variable renamed in a measured layer: no result goes stale. Checked on the results that cover every
    # probe kind and every result of the fwpkm layer: the others run the same probes, and tests/test_results_table.py's
    # report --check re-runs every result's probes on the unedited tree anyway
    fwpkm = [evidence.result_key(p) for p in evidence.result_paths() if "fwpkm" in evidence.result_key(p)]
    sample = sorted(set(stored_results_covering_every_probe_kind()) | set(fwpkm))
    assert "bench_fwpkm_layer" in sample
    stale = _stale_results_with(tmp_path, "fastweights/layers/fwpkm.py", "bound", "init_limit", only=tuple(sample))
    # the results already stale before the edit: those TO_RERUN.md lists (report --check keeps it current)
    already = re.findall(r"^- `([^`]+)`:", evidence.RERUN_PAGE.read_text(), re.M)
    assert stale == [k for k in already if k in sample]


@pytest.mark.slow
@pytest.mark.parametrize("capability", [None, "avx2", "default"])
def test_a_one_character_change_in_an_imported_operator_marks_the_results_that_reach_it(tmp_path, capability):
    # the delta rule reaches ops/linear_attention.py only through an import; its default query scale changes (on
    # the CPU kernels torch picks, and on the AVX2 and the portable ones: tests/evidence/test_kernels.py holds the
    # stored results current under each, and 1e-12 noise stales none)
    if capability == "avx2" and torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("this CPU has no AVX2")
    stale = _stale_results_with(tmp_path, "fastweights/ops/linear_attention.py", "** -0.5", "** -0.4",
                                only=("bench_delta_rule", "bench_fwpkm_layer"), capability=capability)
    assert "bench_delta_rule" in stale
    assert "bench_fwpkm_layer" not in stale  # a result that never reaches the operator stays current
