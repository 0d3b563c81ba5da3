"""benchmarks/gpu/gpu_queue.py, the GPU queue of issue 42, on the CPU: its dry run (``--device cpu --tiny``, the
stand-in fla of fastweights.testing.fla_standin) runs every item in the order of value and writes each item's JSON with
its command, an item made to fail is recorded and the rest still run, and the end names what is still pending
on a GPU; ``--list`` and the minute plan; the gradient check catching a wrong kernel (the stand-in imitating
fla issue 984); a device run's summary unpacked into result files; bad input is one line with exit status 2."""

import json
from pathlib import Path

import pytest
import torch
from helpers import GPU_QUEUE_FAIL, HANG_GUARD_S, ROOT, bad_input_exits, gpu_queue_dry_run, import_benchmark, run_script

from fastweights.experiments.fla_comparison import BackendLog
from fastweights.testing import fla_standin

SCRIPT = ROOT / "benchmarks" / "gpu" / "gpu_queue.py"
FAIL = GPU_QUEUE_FAIL


def run(*args, timeout=HANG_GUARD_S):
    return run_script(SCRIPT, *args, timeout=timeout)


@pytest.fixture(scope="module")
def gq():
    return import_benchmark("gpu_queue")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    r = gpu_queue_dry_run(tmp_path_factory)  # --device cpu --tiny --all --fail FAIL, once per pytest run
    assert r["returncode"] == 0, r["stderr"][-3000:]
    out = Path(r["out"])
    return out, r["stdout"], json.loads((out / "gpu_queue.json").read_text())


def test_the_dry_run_runs_every_item_in_the_order_of_value(dry_run, gq):
    out, stdout, summary = dry_run
    ids = [i.id for i in gq.ITEMS]
    assert summary["order"] == ids and list(summary["items"]) == ids and "incomplete" not in summary
    scopes = [i.scope for i in gq.ITEMS]
    assert scopes[:4] == [2, 2, 2, 2] and scopes == sorted(scopes)  # gradients first, the FWL recipe last
    assert ids[1:4] == ["grad/delta_c32", "grad/delta_c64", "grad/gated_c64"]
    assert summary["tiny"] is True and summary["device_type"] == "cpu" and summary["git"]["commit"]
    assert any("stand-in" in n for n in summary["notes"])  # fla is absent here: the stand-in ran in its place
    assert stdout.index("grad/delta_c32:") < stdout.index("like/hybrid:") < stdout.index("fwl/smollm2_recipe:")


def test_each_item_has_its_own_json_with_its_command(dry_run, gq):
    out, _, summary = dry_run
    files = sorted(p.name for p in out.glob("gpu_queue_*.json"))
    first = [i for i in gq.ITEMS][:gq.MAX_ITEM_FILES]  # a device run returns 8 files: 7 items + the summary
    assert files == sorted(f"gpu_queue_{i.slug}.json" for i in first)
    for item in first:
        rec = json.loads((out / f"gpu_queue_{item.slug}.json").read_text())
        assert rec["item"] == item.id and rec["status"] in ("ok", "partial", "error"), rec
        assert rec["command"].endswith(f"benchmarks/gpu/gpu_queue.py --device cpu --tiny --items {item.id}")
        assert rec["item_wall_s"] >= 0 and rec["estimate_minutes"] == item.minutes and rec["git"]["commit"]
        assert rec == {**summary["items"][item.id], "result_file": rec["result_file"]}
    for item in gq.ITEMS[gq.MAX_ITEM_FILES:]:  # the rest in the summary, for --unpack
        assert summary["items"][item.id]["status"] in ("ok", "partial", "not_written")


def test_gradient_checks_record_each_tensor(dry_run):
    items = dry_run[2]["items"]
    for key, gated, chunk in [("grad/delta_c32", False, 32), ("grad/delta_c64", False, 64),
                              ("grad/gated_c64", True, 64)]:
        res = items[key]["result"]
        want = {"o", "final_state", "dq", "dk", "dv", "dbeta", "dh0"} | ({"dg"} if gated else set())
        assert set(res["rel_err"]) == want and res["chunk_size"] == chunk, res
        assert res["right"] and res["wrong"] == [] and res["fwd_bwd"]["seconds_median"] > 0
    dispatch = items["grad/dispatch"]["result"]
    assert dispatch["auto_bf16"] == dict.fromkeys(["ungated_training", "ungated_no_grad", "gated_training",
                                                   "gated_no_grad"], "fla")  # the stand-in: fla allows all here
    assert dispatch["facts"]["fla_unusable"] is None and dispatch["facts"]["fla_min_version"] == "0.6.0"
    op = items["like/delta_op_T8192"]
    assert op["status"] == "error"  # made to fail; the same item at T=2048 ran: ours fed bf16 and fp32 leaves
    parts = items["like/delta_op_T2048"]["result"]["parts"]
    assert parts["delta_op_auto_bf16"]["seconds_median"] > 0 and parts["delta_op_auto"]["seconds_median"] > 0
    assert set(items["like/delta_op_T2048"]["result"]["ratios"]) == {"delta_op_auto_bf16_over_raw_fla",
                                                                      "delta_op_auto_over_raw_fla"}


def test_a_failure_keeps_the_rest_and_the_end_names_what_is_pending(dry_run, gq):
    _, stdout, summary = dry_run
    items = summary["items"]
    assert items[FAIL]["status"] == "error" and "injected" in items[FAIL]["error"]
    after = [i.id for i in gq.ITEMS][[i.id for i in gq.ITEMS].index(FAIL) + 1:]
    assert all(items[i]["status"] in ("ok", "partial", "not_written") for i in after)
    assert items["like/gdn_chunk64_vs_32"]["status"] == "ok"
    assert "error" in items["like/hybrid"]["result"]["parts"]["fla_gdn_hybrid"]  # fla's model: not in the stand-in
    assert items["fwl/smollm2_recipe"]["status"] == "ok"  # the recipe's own dry run (--tiny)
    assert items["fwl/smollm2_recipe"]["result"]["recipe"]["complete"] is True
    pending = summary["pending"]
    assert list(pending) == [i.id for i in gq.ITEMS]  # a dry run measures nothing for a GPU
    assert "injected" in pending[FAIL] and pending["fwl/smollm2_recipe"] == "dry run: not a GPU measurement"
    assert pending["grad/delta_c64"] == "dry run: not a GPU measurement"
    tail = stdout[stdout.index("still pending on a GPU:"):]
    assert all(f"  {i.id}: " in tail for i in gq.ITEMS)


def test_list_and_the_minute_plan(gq):
    r = run("--list", "--minutes", "5")
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("  pending")]
    pending = [i for i in gq.ITEMS if not gq.done(i)]  # items measured on a GPU (benchmarks/results/) are done
    assert [line.split()[1] for line in lines] == [i.id for i in pending]
    done = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("  done")]
    assert done == [i.id for i in gq.ITEMS if gq.done(i)] and set(done).isdisjoint(i.id for i in pending)
    # greedy by estimate, in order: an item that does not fit is skipped and a later, smaller one may still fit
    assert [ok for _, ok in gq.plan(gq.ITEMS, 5)[:4]] == [True, True, True, False]  # 0.3 + 2.5 + 2.0; 2.5 no
    planned = gq.plan(pending, 5)
    used = sum(item.minutes for item, ok in planned if ok)
    assert used <= 5 and all(item.minutes + used > 5 for item, ok in planned if not ok)
    assert ["fits" in line for line in lines] == [ok for _, ok in planned]
    small = [gq.Item("a", 2, 3.0, "", None), gq.Item("b", 2, 4.0, "", None), gq.Item("c", 3, 1.0, "", None)]
    assert [ok for _, ok in gq.plan(small, 4.5)] == [True, False, True]


def test_the_gradient_check_catches_a_wrong_kernel(gq, monkeypatch):
    fla_standin.install(monkeypatch)
    monkeypatch.setattr(fla_standin, "WRONG_CHUNK64", True)  # fla issue 984: dk, dbeta wrong at chunk 64
    try:
        ctx = gq.Ctx(torch.device("cpu"), True, dict(gq.cs.TINY, kernel_lengths=gq.TINY_LENGTHS), True, False,
                     BackendLog())
        wrong = gq.grad_check(ctx, False, None)
        assert wrong["wrong"] == ["dbeta", "dk"] and not wrong["right"] and wrong["rel_err"]["dk"] > 0.3
        right = gq.grad_check(ctx, False, 32)
        assert right["right"] and right["chunk_size"] == 32
    finally:
        monkeypatch.undo()
        fla_standin.uninstall()


def test_done_items_leave_the_queue_and_a_summary_unpacks(gq, tmp_path, monkeypatch):
    monkeypatch.setattr(gq, "RESULTS", tmp_path)
    item = gq.ITEMS[1]
    summary = {"items": {item.id: {"item": item.id, "status": "ok", "device_type": "cuda", "tiny": False},
                         "fwl/smollm2_recipe": {"status": "not_written"}}}
    (tmp_path / "s.json").write_text(json.dumps(summary))
    assert not gq.done(item)
    assert gq.unpack(str(tmp_path / "s.json")) == 0
    assert sorted(p.name for p in tmp_path.glob("gpu_queue_*.json")) == [f"gpu_queue_{item.slug}.json"]
    assert gq.done(item) and not gq.done(gq.ITEMS[2])
    (tmp_path / f"gpu_queue_{gq.ITEMS[2].slug}.json").write_text(json.dumps({"status": "ok", "tiny": True,
                                                                              "device_type": "cpu"}))
    assert not gq.done(gq.ITEMS[2])  # a dry run is not a measurement


def test_bad_input_is_one_line_and_exit_2(tmp_path, gq, capsys):
    """The first case runs as ``python gpu_queue.py`` (``sys.exit(main())``: the real process's exit status and
    stderr); the others call ``main`` in this process, through ``exit_status_of`` (a Python start and torch's
    import saved per case)."""
    cases = [[*args, "--out", str(tmp_path)] for args in (
        ["--device", "tpu", "--tiny"], ["--device", "cpu"], ["--device", "cpu", "--tiny", "--minutes", "0"],
        ["--device", "cpu", "--tiny", "--items", "nope/*"], ["--bogus"])]
    for args, status, out, err in bad_input_exits("gpu_queue", cases, capsys):
        assert status == 2, (args, out, err)
        assert len(err.strip().splitlines()) == 1 and err.startswith("gpu_queue: "), err
        assert "Traceback" not in err
        assert not list(tmp_path.iterdir())


def test_unpack_refuses_a_dry_run_and_unknown_items_and_writes_into_the_scripts_checkout(gq, tmp_path, monkeypatch,
                                                                                        capsys):
    """Issue 52: --unpack took a CPU dry run and unknown item ids as GPU results, and wrote into the installed
    package's checkout instead of the script's."""
    assert gq.RESULTS == ROOT / "benchmarks" / "results"  # the checkout of the script itself
    monkeypatch.setattr(gq, "RESULTS", tmp_path / "results")
    item = gq.ITEMS[1]
    cases = {"dry": {"items": {item.id: {"status": "ok", "device_type": "cpu", "tiny": True}}},
             "tiny_cuda": {"items": {item.id: {"status": "ok", "device_type": "cuda", "tiny": True}}},
             "unknown": {"items": {"no/such_item": {"status": "ok", "device_type": "cuda", "tiny": False},
                                   item.id: {"status": "ok", "device_type": "cuda", "tiny": False}}},
             "garbled": [1, 2]}
    for name, summary in cases.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(summary))
        assert gq.unpack(str(tmp_path / f"{name}.json")) == 2, name
        err = capsys.readouterr().err.strip()
        assert err.startswith("gpu_queue: --unpack") and len(err.splitlines()) == 1
    assert not (tmp_path / "results").exists()
