"""benchmarks/quality/leaderboard.py (issue 21): its README table, its provenance across commits, its bad input."""

import math
import json

import pytest
import subprocess
import sys

from helpers import BENCHMARKS, ROOT, TOOLS, benchmark_script

from fastweights.cli.script_parser import exit_status_of

sys.path[:0] = [str(benchmark_script("leaderboard").parent), str(TOOLS)]

import leaderboard  # noqa: E402
from fastweights.evidence.row_provenance import measured_commits, measured_probes  # noqa: E402
from fastweights.experiments.leaderboard import ABLATIONS, ENTRIES, top_entries  # noqa: E402
import probes  # noqa: E402
import report  # noqa: E402


def _row(name, seed, commit, streamed, windows):
    return {"entry": name, "seed": seed, "git": {"commit": commit}, "steps": 10, "parameters": 816_768,
            "train_tokens_per_cpu_s": 1000.0, "train_max_rss_mb": 700.0, "score_max_rss_mb": 400.0,
            "val_bits_per_char": windows, "streamed": {"bits_per_char": streamed, "tokens_per_cpu_s": 5000.0},
            "windows": {"bits_per_char": windows, "tokens_per_cpu_s": 6000.0},
            "probes": [{"kind": "model", "args": {"entry": name}, "summary": {"y": "exact 0123456789abcdef"}}]}


def test_rows_from_two_commits_record_the_oldest_and_keep_every_rows_probes():
    log = subprocess.run(["git", "-C", str(ROOT), "rev-list", "--max-count=2", "HEAD"], capture_output=True,
                         text=True, check=True).stdout.split()
    new, old = log[0], log[1]
    a, b = _row("attention", 0, old, 2.0, 2.1), _row("fast-rnn", 0, new, 2.3, 2.2)
    a["probes"] = [{"kind": "model", "args": {"x": 1}, "summary": {"y": "exact aa"}}]
    b["probes"] = [{"kind": "model", "args": {"x": 2}, "summary": {"y": "exact bb"}}, a["probes"][0]]
    rows = {"attention": [a], "fast-rnn": [b]}
    assert measured_commits(rows)["commit"] == old  # everything counts from the oldest run
    from fastweights.evidence.result_files import git_state

    assert measured_commits(rows) == {"commit": old, "dirty": False, "dirty_paths": [],
                                      "aggregated_at": git_state().get("commit")}
    b["git"]["dirty_paths"] = ["benchmarks/results/leaderboard.json", "src/fastweights/x.py"]  # results: not code
    assert measured_commits(rows)["dirty_paths"] == ["src/fastweights/x.py"] and measured_commits(rows)["dirty"]
    del b["git"]["dirty_paths"]
    assert measured_probes(rows) == [a["probes"][0], b["probes"][0]]  # each probe once
    del b["probes"]
    with pytest.raises(SystemExit, match="records no probes"):
        measured_probes(rows)


def test_each_entry_probes_its_own_model():
    specs = {name: leaderboard.entry_probe_specs(probes, name) for name in ENTRIES}
    assert specs["gdn"] != specs["attention"] and specs["fwl"] != specs["attention"]
    assert specs["fwl-carry"] == specs["fwl"]  # a training setting: the same model
    assert any(s["kind"] == "dynamic" for s in specs["dynamic-eval"])


def test_a_row_gets_its_probes_from_the_tools_as_the_stored_rows_hold_them():
    import summaries

    stored = {json.dumps([p["kind"], p["args"]], sort_keys=True): p["summary"]
              for p in json.loads((BENCHMARKS / "results" / "leaderboard.json").read_text())["probes"]}
    now = leaderboard.row_probes("lstm")  # tools/evidence.py summarise, in a process of its own
    assert len(now) == 3  # the model, streamed carried and in windows
    for p in now:
        assert summaries.differences(stored[json.dumps([p["kind"], p["args"]], sort_keys=True)], p["summary"]) == []


def test_markdown_table_ranks_by_streamed_score_and_flags_a_collapse():
    rec = {"protocol": {"cpu_minutes_per_model": 20, "train_corpus": "shakespeare-train", "chars_per_play": 32768,
                        "heldout": ["a", "b", "c", "d"]},
           "complete": False, "missing": ["gdn"], "top_entries_for_seeds": [],
           "table": [{"rank": 1, "entry": "attention", "mechanism": "softmax attention", "streamed_bits_per_char": 2.0,
                      "streamed_std": None, "windows_bits_per_char": 2.01, "streamed_minus_windows_bits": -0.01,
                      "streams_within_0_05": True, "parameters": 816768, "train_tokens_per_cpu_s": 9000.0,
                      "score_tokens_per_cpu_s": 7000.0, "train_max_rss_mb": 700.0, "seeds": [0]},
                     {"rank": 2, "entry": "fwp-delta", "mechanism": "delta", "streamed_bits_per_char": 7.5,
                      "streamed_std": 0.01, "windows_bits_per_char": 2.5, "streamed_minus_windows_bits": 5.0,
                      "streams_within_0_05": False, "parameters": 818816, "train_tokens_per_cpu_s": 5000.0,
                      "score_tokens_per_cpu_s": 3000.0, "train_max_rss_mb": 710.0, "seeds": [0, 1, 2]}]}
    text = report.markdown_table(rec)
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert rows[1].startswith("| 1 | softmax attention (`attention`) | 2.000 | 2.010 | -0.010 |")
    assert "| +5.000 (> 0.05) |" in rows[2] and "7.500 ± 0.010" in rows[2] and rows[2].endswith("| 3 |")
    assert "not yet measured: gdn (and then 3 seeds" in text


def test_bad_arguments_exit_2_with_one_line(monkeypatch, capsys):
    """The first case runs as ``python leaderboard.py`` (``sys.exit(exit_status_of(main))``: the real process's exit
    status and stderr); the others call ``main`` in this process, through ``exit_status_of``, where nothing may be
    trained or aggregated."""

    def never(*_a, **_kw):
        raise AssertionError("bad arguments trained or aggregated")

    monkeypatch.setattr(leaderboard, "entry_row", never)
    monkeypatch.setattr(leaderboard, "aggregate", never)
    for i, argv in enumerate((["--entries", "nope"], ["--seeds", "x"], ["--minutes", "0"])):
        if i == 0:
            r = subprocess.run([sys.executable, str(benchmark_script("leaderboard")), *argv],
                               capture_output=True, text=True)
            status, err = r.returncode, r.stderr
        else:
            capsys.readouterr()
            status = exit_status_of(lambda: leaderboard.main(argv))
            err = capsys.readouterr().err
        assert status == 2 and err.count("\n") == 1 and err.startswith("error:"), err


def test_readme_opens_its_results_with_the_generated_leaderboard():
    import report

    readme = (ROOT / "README.md").read_text()
    results = readme.split("## Results", 1)[1]
    assert results.index(report.BOARD_START) < results.index(report.CLAIMS_START)  # the board first, then claims
    assert report.render_board(readme, "README.md") == readme, "run python tools/report.py"


def test_a_collapse_with_a_known_reason_is_marked_with_its_footnote():
    rec = {"protocol": {"cpu_minutes_per_model": 20, "train_corpus": "shakespeare-train", "chars_per_play": 32768,
                        "heldout": ["a"]}, "complete": True, "missing": [], "top_entries_for_seeds": [],
           "table": [{"rank": 1, "entry": "fwp-delta", "mechanism": "delta", "streamed_bits_per_char": 7.5,
                      "streamed_std": None, "windows_bits_per_char": 2.5, "streamed_minus_windows_bits": 5.0,
                      "streams_within_0_05": False, "streaming_limit": "it never forgets", "parameters": 818816,
                      "train_tokens_per_cpu_s": 5000.0, "score_tokens_per_cpu_s": 3000.0, "train_max_rss_mb": 710.0,
                      "seeds": [0]}]}
    text = report.markdown_table(rec)
    assert "| +5.000 (> 0.05) [1] |" in text and text.endswith("|\n\n[1] it never forgets.")


def test_finished_rows_keep_committed_rows_unless_rerun_or_remeasured_differently(tmp_path, monkeypatch):
    """Run directories are not shipped: a fresh clone that trains one entry keeps the committed rows of the
    others, a row under --runs replaces the committed one, and a row of a preset since changed is dropped."""
    results, out = tmp_path / "results", tmp_path / "runs"
    results.mkdir()
    monkeypatch.setattr(leaderboard, "RESULTS", results)
    att, lstm = ENTRIES["attention"], ENTRIES["lstm"]
    (results / "leaderboard.json").write_text(json.dumps({
        "table": [{"entry": "attention", "preset": att[1], "overrides": att[2]},
                  {"entry": "lstm", "preset": "an-older-preset", "overrides": lstm[2]}],
        "rows": {"attention": [_row("attention", 0, "a", 2.0, 2.1), _row("attention", 1, "a", 2.2, 2.3)],
                 "lstm": [_row("lstm", 0, "a", 2.0, 2.1)]}}))
    fresh = _row("attention", 1, "b", 1.9, 2.0)
    (out / "attention" / "seed1").mkdir(parents=True)
    (out / "attention" / "seed1" / "row.json").write_text(json.dumps(fresh))
    rows = leaderboard.finished_rows(out)
    assert list(rows) == ["attention"]  # lstm's committed row measured another preset
    assert [r["seed"] for r in rows["attention"]] == [0, 1] and rows["attention"][1] == fresh


def test_results_rewritten_by_a_parallel_run_are_not_dirty_code():
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    clean, results_only, code = (_row("lstm", 0, head, 2.0, 2.1) for _ in range(3))
    results_only["git"]["dirty_paths"] = ["benchmarks/results/leaderboard.json"]
    code["git"]["dirty_paths"] = ["src/fastweights/layers/lstm.py"]
    assert not measured_commits({"lstm": [clean, results_only]})["dirty"]
    git = measured_commits({"lstm": [clean, code]})
    assert git["dirty"] and git["dirty_paths"] == ["src/fastweights/layers/lstm.py"]


def test_aggregate_writes_seed_means_by_entry_and_the_checks(tmp_path, monkeypatch):
    import argparse

    import fastweights.evidence.result_files as result_files

    results, out = tmp_path / "results", tmp_path / "runs"
    results.mkdir()
    monkeypatch.setattr(leaderboard, "RESULTS", results)
    monkeypatch.setattr(result_files, "RESULTS", results)
    curve = {"bin_width": 1024, "position": [1024], "windowed": [1.4], "cumulative": [1.4], "count": [1024]}
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    for name, seed, streamed, windows in (("attention", 0, 2.0, 2.1), ("attention", 1, 2.2, 2.3),
                                          ("lstm", 0, 1.9, 2.0), ("fast-rnn", 0, 2.05, 2.0)):
        row = _row(name, seed, head, streamed, windows)
        for mode in ("streamed", "windows"):
            row[mode]["curve"] = curve
        (out / name / f"seed{seed}").mkdir(parents=True)
        (out / name / f"seed{seed}" / "row.json").write_text(json.dumps(row))
    leaderboard.aggregate(out, argparse.Namespace(top_seeds=0, minutes=20.0, chars_per_play=32768))
    rec = json.loads((results / "leaderboard.json").read_text())
    att = rec["by_entry"]["attention"]
    assert att["seeds"] == [0, 1] and abs(att["streamed_bits_per_char"] - 2.1) < 1e-12
    assert abs(att["streamed_std"] - 0.1414213562) < 1e-6 and att["rank"] == 3
    assert [t["entry"] for t in rec["table"]] == ["lstm", "fast-rnn", "attention"]
    assert abs(rec["checks"]["fast_rnn_minus_lstm_streamed_bits"] - 0.15) < 1e-12
    assert not rec["complete"] and "swa" in rec["missing"] and (results / "leaderboard.png").exists()


def test_top_entries_rank_mechanisms_not_their_ablations():
    def row(bits):
        return {"seed": 0, "streamed": {"bits_per_char": bits}}

    rows = {"lstm": [row(2.0)], "fwl-lanes": [row(2.01)], "fwl": [row(2.02)], "swa": [row(2.03)], "gdn": [row(2.1)]}
    assert top_entries(rows, 3) == ["lstm", "fwl", "swa"]
    assert set(ABLATIONS) <= set(ENTRIES)
    assert all(base in ENTRIES and base not in ABLATIONS for base in ABLATIONS.values())


def test_the_oldest_of_two_commits_whichever_a_set_yields_first(monkeypatch):
    from fastweights.evidence import row_provenance

    log = subprocess.run(["git", "-C", str(ROOT), "rev-list", "--max-count=12", "HEAD"], capture_output=True,
                         text=True, check=True).stdout.split()
    # a pair whose set yields the newer commit first: the oldest must still come back
    pair = next((new, old) for i, new in enumerate(log) for old in log[i + 1:] if next(iter({new, old})) == new)
    assert row_provenance._oldest(set(pair)) == pair[1]
    assert row_provenance._oldest({None, "", pair[0]}) == pair[0]  # rows without a commit do not count
    assert row_provenance._oldest({None, ""}) is None and row_provenance._oldest(set()) is None
    # one commit needs no git
    monkeypatch.setattr(row_provenance.subprocess, "run", lambda *a, **k: pytest.fail("git was run"))
    assert row_provenance._oldest({pair[0]}) == pair[0]


def test_measured_commits_lists_at_most_twenty_dirty_paths():
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    row = _row("lstm", 0, head, 2.0, 2.1)
    row["git"]["dirty_paths"] = [f"src/fastweights/m{i:02d}.py" for i in range(25)]
    git = measured_commits({"lstm": [row]})
    assert git["dirty_paths"] == [f"src/fastweights/m{i:02d}.py" for i in range(20)] and git["dirty"]


def test_a_probe_recorded_by_two_rows_in_another_key_order_is_kept_once():
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    a, b = _row("lstm", 0, head, 2.0, 2.1), _row("lstm", 1, head, 2.0, 2.1)
    a["probes"] = [{"kind": "model", "args": {"x": 1, "y": 2}, "summary": {"z": "exact aa"}}]
    b["probes"] = [{"summary": {"z": "exact aa"}, "args": {"y": 2, "x": 1}, "kind": "model"}]
    assert measured_probes({"lstm": [a, b]}) == a["probes"]
    del b["probes"]
    with pytest.raises(SystemExit) as e:
        measured_probes({"lstm": [a, b]})
    assert str(e.value) == ("error: the lstm seed 1 row records no probes (scored before rows recorded them): delete "
                            "its row.json and run again to score it")


def _scored(name, seed, stream_bits, window_bits, **over):
    row = _row(name, seed, "c" * 40 if seed else "", stream_bits, window_bits)
    row.update(over)
    return row


def test_the_table_ranks_entries_by_their_seeds_mean_streamed_score_with_every_column():
    from fastweights.experiments import leaderboard as lb

    rows = {
        "attention": [_scored("attention", 0, 2.0, 1.9, parameters=1000), _scored("attention", 1, 2.2, 2.1, parameters=2000,
                      steps=30, train_tokens_per_cpu_s=3000.0, train_max_rss_mb=900.0, score_max_rss_mb=100.0,
                      val_bits_per_char=2.5, streamed={"bits_per_char": 2.2, "tokens_per_cpu_s": 7000.0})],
        "fwp-delta": [_scored("fwp-delta", 0, 2.5, 2.3, parameters=1500)],  # streams 0.2 worse: a known limit
        "fwp-gated-delta": [_scored("fwp-gated-delta", 0, 1.5, 1.6, parameters=500)],
        "lstm": [_scored("lstm", 0, 3.0, 2.99)],
        "fast-rnn": [_scored("fast-rnn", 0, 2.8, 2.5)],  # 0.3 worse, no known limit: no reason given
        "dynamic-eval": [_scored("dynamic-eval", 0, 1.8, 1.8, dynamic={"lr": 1e-5})],
        "swa": [_scored("swa", 0, 3.5, 3.5)],
        "fwp-sum": [_scored("fwp-sum", 0, 1.05, 1.0)],  # exactly 0.05 worse streamed: within, no reason needed
    }
    assert 1.0 + 0.05 == 1.05
    table, checks = lb.leaderboard_table(rows)
    assert [t["entry"] for t in table] == ["fwp-sum", "fwp-gated-delta", "dynamic-eval", "attention", "fwp-delta",
                                           "fast-rnn", "lstm", "swa"]
    assert [t["rank"] for t in table] == [1, 2, 3, 4, 5, 6, 7, 8]
    att = next(t for t in table if t["entry"] == "attention")
    assert att == {
        "entry": "attention", "mechanism": "softmax attention (baseline)", "preset": "shakespeare-char", "overrides": [],
        "seeds": [0, 1], "streamed_bits_per_char": pytest.approx(2.1), "streamed_std": pytest.approx(0.1414213562),
        "windows_bits_per_char": pytest.approx(2.0), "windows_std": pytest.approx(0.1414213562),
        "streamed_minus_windows_bits": pytest.approx(0.1), "streams_within_0_05": False,
        "val_bits_per_char": pytest.approx((1.9 + 2.5) / 2), "parameters": 1000, "parameters_vs_attention": 1.0,
        "train_steps": 20.0, "train_tokens_per_cpu_s": 2000.0, "score_tokens_per_cpu_s": 6000.0,
        "train_max_rss_mb": 900.0, "score_max_rss_mb": 400.0, "commits": ["", "c" * 40], "rank": 4}
    by = {t["entry"]: t for t in table}
    assert by["fwp-delta"]["streaming_limit"] == lb.STREAMING_LIMITS["fwp-delta"]
    assert "streaming_limit" not in by["fast-rnn"] and "streaming_limit" not in by["fwp-gated-delta"]
    assert by["lstm"]["streams_within_0_05"] is True and by["lstm"]["streamed_std"] is None
    assert by["fwp-delta"]["parameters_vs_attention"] == 1.5 and by["fwp-gated-delta"]["parameters_vs_attention"] == 0.5
    assert by["dynamic-eval"]["preset"] == "shakespeare-char" and by["dynamic-eval"]["dynamic"] == {"lr": 1e-5}
    assert by["swa"]["preset"] == "shakespeare-char" and by["swa"]["overrides"] == ["model.options.attention.window=64"]
    assert by["fwp-sum"]["streams_within_0_05"] is True and "streaming_limit" not in by["fwp-sum"]
    assert "dynamic" not in by["attention"]
    assert checks == {"fwp_delta_minus_attention_streamed_bits": pytest.approx(0.4),
                      "fwp_gated_delta_minus_attention_streamed_bits": pytest.approx(-0.6),
                      "fast_rnn_minus_lstm_streamed_bits": pytest.approx(-0.2)}
    # without the attention baseline: no parameter ratio, no check against it
    table, checks = lb.leaderboard_table({k: v for k, v in rows.items() if k != "attention"})
    assert all(t["parameters_vs_attention"] is None for t in table) and list(checks) == ["fast_rnn_minus_lstm_streamed_bits"]
    assert lb.leaderboard_table({"lstm": rows["lstm"]})[1] == {}


def test_the_best_entries_by_their_best_seed_leave_the_ablations_out():
    from fastweights.experiments import leaderboard as lb

    rows = {"attention": [_scored("attention", 0, 2.0, 2.0), _scored("attention", 1, 1.2, 2.0)],
            "lstm": [_scored("lstm", 0, 1.5, 1.5)], "ln-rnn": [_scored("ln-rnn", 0, 0.5, 0.5)],
            "fast-rnn": [_scored("fast-rnn", 0, 1.8, 1.8)]}
    assert lb.top_entries(rows, 2) == ["attention", "lstm"] and lb.top_entries(rows, 5) == ["attention", "lstm", "fast-rnn"]
    assert lb._mean_std([1.0, 3.0]) == (2.0, pytest.approx(2 ** 0.5)) and lb._mean_std([4.0]) == (4.0, None)
    styles = lb.row_styles(["a", "b", "c", "d", "e", "f"])
    assert styles["a"] == {"color": lb.ROW_COLOURS[0], "ls": "-"} and styles["f"] == {"color": lb.ROW_COLOURS[5], "ls": "-"}
    assert styles["b"]["ls"] == "--" and len({s["color"] for s in styles.values()}) == 6
    assert len(lb.row_styles([str(i) for i in range(len(lb.ROW_COLOURS))])) == len(lb.ROW_COLOURS)  # all may be used
    with pytest.raises(ValueError) as e:
        lb.row_styles([str(i) for i in range(len(lb.ROW_COLOURS) + 1)])
    assert str(e.value) == f"{len(lb.ROW_COLOURS) + 1} rows but {len(lb.ROW_COLOURS)} distinct colours: add colours to ROW_COLOURS"
    assert lb._bits([math.log(2), None, 2 * math.log(2)]) == [pytest.approx(1.0), None, pytest.approx(2.0)]
    assert lb._xy([1, 2, 3, 4], [0.5, None, 0.0, None]) == ([1, 3], [0.5, 0.0])


def test_the_heldout_documents_are_each_plays_first_characters():
    """The leaderboard scores the first ``chars`` characters of each held-out play, encoded (the text sliced, not
    dropped: seed-14 mutation draw)."""
    from fastweights.data import build_tokenizer, load_corpus
    from fastweights.experiments.leaderboard import HELDOUT, heldout_documents

    tok = build_tokenizer("byte", "")
    docs = heldout_documents(tok, 300)
    for (name, blocks), play in zip(docs, HELDOUT):
        ids = [int(i) for block in blocks for i in block]
        want = load_corpus(f"shakespeare-heldout:{play}")[0]
        assert name == want.name and ids == [int(i) for i in tok.encode(want.text[:300])]
    assert len(list(docs)) == len(HELDOUT)
