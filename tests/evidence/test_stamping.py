"""Behaviour probes live in the repository's tools (tools/probes.py), not in the package (issue 48
scope 3): importing ``fastweights`` or any of its commands imports no probe code, a command's result file carries
no probes, and the tools summarise a new result's probes afterwards (``evidence.stamp``, run by ``report.py``),
only while the checkout's code is the code that wrote it."""

import json
import subprocess
import sys

from helpers import HANG_GUARD_S, BENCHMARKS, ROOT, TOOLS

sys.path.insert(0, str(TOOLS))

import evidence  # noqa: E402
import probes  # noqa: E402
import summaries  # noqa: E402

from fastweights.cli import main  # noqa: E402
from fastweights.evidence.provenance import git_state  # noqa: E402

_IMPORT_ALL = """
import importlib, json, pkgutil, sys
import fastweights, fastweights.cli
for m in pkgutil.walk_packages(fastweights.cli.__path__, "fastweights.cli."):
    importlib.import_module(m.name)
tools = sys.argv[1]
print(fastweights.__file__)
print(json.dumps(sorted(n for n, m in sys.modules.items() if n in ("probes", "summaries", "evidence")
                        or n.startswith("fastweights.evidence.probes") or n.startswith("fastweights.evidence.summaries")
                        or (getattr(m, "__file__", None) or "").startswith(tools))))
"""


def test_importing_the_package_and_every_command_imports_no_probe_code():
    out = subprocess.run([sys.executable, "-c", _IMPORT_ALL, str(TOOLS)], cwd=ROOT, capture_output=True,
                         text=True, timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stderr[-2000:]
    package, imported = out.stdout.strip().splitlines()[-2:]
    assert package.startswith(str(ROOT / "src")), package  # this checkout's package
    assert json.loads(imported) == []
    assert not list((ROOT / "src").rglob("probes.py")) and not list((ROOT / "src").rglob("summaries.py"))


def test_a_command_writes_no_probes_and_the_tools_summarise_them_afterwards(char_checkpoint, tmp_path):
    out = tmp_path / "adapt"
    doc = char_checkpoint / "doc.txt"
    assert main(["continual", "--checkpoint", str(char_checkpoint), "--domain", f"a={doc}", "--domain", f"b={doc}",
                 "--adapt-tokens", "40", "--eval-tokens", "40", "--dynamic", "sgd", "--quiet", "--out", str(out)]) == 0
    path = out / "adapt.json"
    rec = json.loads(path.read_text())
    assert "probes" not in rec and rec["git"]["code"] == git_state(ROOT)["code"]
    assert evidence.stamp(path) is None
    stamped = json.loads(path.read_text())
    assert {k: v for k, v in stamped.items() if k != "probes"} == rec  # nothing else changes
    config = json.loads((char_checkpoint / "config.json").read_text())["model"]
    assert stamped["probes"] == probes.summarised(probes.checkpoint_probes(config, dynamic_rule="sgd"))
    assert evidence.staleness(stamped) is None


def test_the_probes_of_other_commands_come_from_what_they_recorded(char_checkpoint, tmp_path):
    doc = char_checkpoint / "doc.txt"
    assert main(["eval", "--stream", "--checkpoint", str(char_checkpoint), "--data", str(doc), "--modes", "frozen,carry",
                 "--dynamic", "sgd", "--quiet", "--out", str(tmp_path / "stream")]) == 0
    assert main(["task", "assoc", "--setting", "2", "--keys", "4", "--model", "delta:dpfp1", "--max-steps", "5",
                 "--eval-every", "5", "--eval-sequences", "2", "--quiet", "--out", str(tmp_path / "assoc")]) == 0
    stream, assoc = tmp_path / "stream" / "stream.json", tmp_path / "assoc" / "assoc.json"
    assert "probes" not in json.loads(stream.read_text()) and "probes" not in json.loads(assoc.read_text())
    assert evidence.stamp_new(tmp_path) == []
    config = json.loads((char_checkpoint / "config.json").read_text())["model"]
    # frozen is no probed mode; the rule comes from the run that used it
    assert json.loads(stream.read_text())["probes"] == probes.summarised(
        probes.checkpoint_probes(config, ("carry",), "sgd"))
    assert [(p["kind"], p["args"]) for p in json.loads(assoc.read_text())["probes"]] == [
        ("assoc_model", {"feature_map": "dpfp", "n_features": json.loads(assoc.read_text())["results"][0]["n_features"],
                         "nu": 1, "rule": "delta", "setting": 2}), ("task", {"name": "assoc"})]


def test_a_result_written_by_other_code_is_not_summarised(tmp_path):
    stored = json.loads((BENCHMARKS / "results" / "bench_delta_rule.json").read_text())
    rec = {k: v for k, v in stored.items() if k != "probes"}
    rec["git"] = {**git_state(ROOT), "code": "0" * 16}  # the code changed after it was written
    path = tmp_path / "bench_delta_rule.json"
    path.write_text(json.dumps(rec))
    assert "re-run it" in evidence.stamp(path)
    assert json.loads(path.read_text()) == rec
    assert evidence.stamp_new(tmp_path) and "no behaviour probes" in evidence.problems(tmp_path)[0]


def test_a_benchmark_result_is_summarised_from_its_scripts_probe_specs(tmp_path):
    stored = json.loads((BENCHMARKS / "results" / "gpu_queue_grad_delta_c32.json").read_text())
    rec = {k: v for k, v in stored.items() if k != "probes"}  # a script that imports a sibling's probe_specs
    rec["git"] = git_state(ROOT)
    path = tmp_path / "gpu_queue_grad_delta_c32.json"
    path.write_text(json.dumps(rec))
    assert evidence.stamp_new(tmp_path) == []
    now = json.loads(path.read_text())["probes"]
    assert [(p["kind"], p["args"]) for p in now] == [(p["kind"], p["args"]) for p in stored["probes"]]
    assert all(summaries.differences(a["summary"], b["summary"]) == [] for a, b in zip(stored["probes"], now))
