"""benchmarks/gpu/cuda_scale.py on the CPU: its dry run (``--device cpu --tiny``) measures our side of every part and
records what cannot run here (fla's Triton kernels, lucidrains' package when absent) as error strings, the JSON
carrying provenance and the exact command; bad input is one line on stderr with exit status 2 (the GPU runs
are benchmarks/results/cuda_scale.json and cuda_scale_kernels.json)."""

import json
import shlex
from helpers import HANG_GUARD_S, ROOT, bad_input_exits, run_script


SCRIPT = ROOT / "benchmarks" / "gpu" / "cuda_scale.py"
ITEMS = "models/ours_hybrid*,kernels/T32/*,fwpkm_layer/*_B1"


def run(*args, timeout=HANG_GUARD_S):
    return run_script(SCRIPT, *args, timeout=timeout)


def test_cpu_dry_run_measures_our_side_and_records_the_rest(tmp_path):
    out = tmp_path / "scale.json"
    r = run("--device", "cpu", "--tiny", "--items", ITEMS, "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    rec = json.loads(out.read_text())
    assert "incomplete" not in rec and rec["tiny"] is True and rec["device"] == "cpu"
    assert rec["command"].endswith(f"benchmarks/gpu/cuda_scale.py --device cpu --tiny --items {shlex.quote(ITEMS)}")  # no --out
    assert rec["git"]["commit"] and "machine" in rec
    assert rec["items_planned"][:2] == ["models/ours_hybrid", "models/ours_hybrid_fwpkm"]
    for key in ("ours_hybrid", "ours_hybrid_fwpkm"):
        m = rec["models"][key]
        assert m["tokens_per_s"] > 0 and m["finite"] and m["parameters"] > 0, m
    assert rec["models"]["ours_hybrid_fwpkm"]["fast_weight_buffer_bytes"] > 0
    kernels = rec["kernels"]
    for kind in ("delta_op_auto", "delta_op_torch", "layer_fwp", "gated_op_auto", "gated_op_compiled",
                 "gated_op_torch", "layer_gdn"):
        assert kernels[f"T32/{kind}"]["seconds_median"] > 0, kind
    assert "error" in kernels["T32/delta_raw_fla"]  # fla's Triton kernels do not run on a CPU
    assert rec["fwpkm_layer"]["ours_B1"]["seconds_median"] > 0
    assert "seconds_median" in rec["fwpkm_layer"]["lucidrains_B1"] or "error" in rec["fwpkm_layer"]["lucidrains_B1"]
    assert rec["ratios"]["fwpkm_hybrid_tokens_per_s_over_backbone"] > 0
    assert any("'auto' -> 'torch'" in line for line in rec["backend_log"])  # the choice, logged once


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    """The first case runs as ``python cuda_scale.py`` (``sys.exit(main())``: the real process's exit status and
    stderr); the others call ``main`` in this process, through ``exit_status_of`` (a Python start and torch's
    import saved per case)."""
    cases = [[*args, "--out", str(tmp_path / "x.json")] for args in (["--device", "tpu"], ["--budget-s", "0"],
                                                                      ["--bogus"])]
    for args, status, out, err in bad_input_exits("cuda_scale", cases, capsys):
        assert status == 2, (args, out, err)
        assert len(err.strip().splitlines()) == 1 and err.startswith("cuda_scale: "), err
        assert "Traceback" not in err
        assert not (tmp_path / "x.json").exists()
