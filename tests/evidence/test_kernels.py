"""Stored results hold on any CPU: their probes, recomputed under every set of CPU kernels this machine can
run (``ATEN_CPU_CAPABILITY`` default, avx2, and avx512 where the CPU has it), leave every result current;
rounding noise far above fp64's leaves every result current; a change of behaviour does not (issue 38)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, TOOLS
from helpers import stored_results_covering_every_probe_kind as sample_results

sys.path.insert(0, str(TOOLS))

import evidence  # noqa: E402
import probes  # noqa: E402
import summaries  # noqa: E402


def capabilities() -> list[str]:
    """The ATEN_CPU_CAPABILITY values this CPU runs: torch picks the best by default, and any lower one on request."""
    order = ["default", "avx2", "avx512"]
    native = torch.backends.cpu.get_cpu_capability().lower()
    return order[: order.index(native) + 1] if native in order else ["default"]


def other_capabilities() -> list[str]:
    """The capabilities this CPU runs other than the one this process runs under: that one is checked for every
    stored result, not a sample, by ``report.py --check`` (tests/test_results_table.py), which fails on any stale one."""
    running = torch.backends.cpu.get_cpu_capability().lower()
    return [c for c in capabilities() if c != running]


_STALE = ("import json, sys; sys.path.insert(0, 'tools'); import evidence, torch;"
          "only = set(sys.argv[1:]);"
          "print(torch.backends.cpu.get_cpu_capability(), json.dumps([evidence.result_key(p) for p in evidence.result_paths()"
          " if evidence.result_key(p) in only and evidence.staleness(json.loads(p.read_text()))]))")


@pytest.mark.parametrize("capability", other_capabilities())
def test_stored_results_are_current_under_every_cpu_kernel(capability):
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-c", _STALE, *sample_results()], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    ran_as, stale = out.stdout.strip().splitlines()[-1].split(" ", 1)
    assert ran_as == capability.upper()  # the kernels asked for are the ones that ran
    assert json.loads(stale) == []


def test_relative_noise_of_1e_12_on_every_probe_output_stales_nothing(monkeypatch):
    gen = torch.Generator().manual_seed(0)

    def noisy(fn):
        def run(**args):
            out = fn(**args)
            return {k: v * (1 + 1e-12 * torch.randn(v.shape, generator=gen, dtype=torch.float64))
                    if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in out.items()}
        return run

    for kind, fn in list(probes.KINDS.items()):
        monkeypatch.setitem(probes.KINDS, kind, noisy(fn))
    checked = 0
    for key in sample_results():
        rec = json.loads((evidence.RESULTS / f"{key}.json").read_text())
        for p in rec["probes"]:
            now = probes.run_probe({"kind": p["kind"], "args": p["args"]})
            assert summaries.differences(p["summary"], now) == [], (key, p["kind"])
            checked += 1
    assert checked >= 10


def test_a_noise_far_above_rounding_is_seen():
    # the tolerance is not so loose that a relative change of 1e-6 in one output passes
    spec = probes.probe("ops", op="delta_rule")
    stored = probes.run_probe(spec)
    out = dict(stored)
    shape, numbers = out["y"].split(": ")
    out["y"] = shape + ": " + " ".join(repr(float(v) * (1 + 1e-6)) for v in numbers.split())
    assert summaries.differences(stored, out) != []
