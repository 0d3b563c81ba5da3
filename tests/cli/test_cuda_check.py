"""benchmarks/gpu/cuda_check.py on the CPU: its dry run (``--device cpu --tiny``) writes the JSON the GPU run
writes, and bad input is one line on stderr with exit status 2 (the GPU run itself is recorded in
benchmarks/results/cuda_check.json)."""

import json
from helpers import HANG_GUARD_S, ROOT, bad_input_exits, run_script


SCRIPT = ROOT / "benchmarks" / "gpu" / "cuda_check.py"


def run(*args, timeout=HANG_GUARD_S):
    return run_script(SCRIPT, *args, timeout=timeout)


def test_cpu_dry_run_writes_every_part(tmp_path):
    r = run("--device", "cpu", "--tiny", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    rec = json.loads((tmp_path / "cuda_check.json").read_text())
    assert rec["command"].endswith("benchmarks/gpu/cuda_check.py --device cpu --tiny")  # --out left out
    assert rec["git"]["commit"] and rec["device"] == "cpu" and rec["tiny"] is True
    comp = rec["components"]
    names = {row["component"] for row in comp["rows"]}
    assert {"mixer/attention", "mixer/fwp", "mixer/gdn", "head/fwl", "memory/fwpkm", "memory/fwmlp"} <= names
    assert comp["checked"] == comp["variants"] == len(names) and comp["passed"] == comp["checked"], comp["failed"]
    for row in comp["rows"]:
        assert row["fp32_cpu_vs_device"]["tensors_compared"] >= 4  # two outputs, two input gradients
        assert len(row["bf16_training"]["losses_bf16"]) == 3
    delta = rec["delta_rule"]
    assert delta["fla_unavailable"] and {run["rule"] for run in delta["runs"]} == {"delta", "gated_delta"}
    for run_ in delta["runs"]:
        assert run_["ours"]["fwd_bwd_s"] > 0 and run_["ours"]["agrees_with_fp32"]
    (train,) = rec["train"]["rows"]
    assert train["finite"] and train["tokens_per_s_median"] > 0 and train["steps"] == 6
    assert rec["headline"][0]["value"] == f"{comp['passed']} of {comp['checked']}"


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    """The first case runs as ``python cuda_check.py`` (``sys.exit(main())``: the real process's exit status and
    stderr); the others call ``main`` in this process, through ``exit_status_of`` (a Python start and torch's
    import saved per case)."""
    (tmp_path / "file").write_text("")
    cases = [["--device", "tpu"], ["--device", "cpu", "--out", str(tmp_path / "file")], ["--bogus"]]
    for args, status, out, err in bad_input_exits("cuda_check", cases, capsys):
        assert status == 2, (args, out, err)
        assert len(err.strip().splitlines()) == 1 and err.startswith("cuda_check: "), err
        assert "Traceback" not in err
        assert not (tmp_path / "cuda_check.json").exists()
