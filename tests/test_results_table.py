"""The results tables (docs/results.md lists every result, docs pages the ones they name) and the README's
claims table are generated from benchmarks/results/*.json and must be up to date."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_results_and_claims_tables_match_json():
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "report.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_every_result_records_its_command():
    for path in (ROOT / "benchmarks" / "results").glob("*.json"):
        rec = json.loads(path.read_text())
        assert rec.get("command"), f"{path.name} does not say which command produced it"


def test_docs_block_lists_only_the_files_it_names():
    sys.path.insert(0, str(ROOT / "tools"))
    import report

    page = "intro\n<!-- results:start demo -->\nstale\n<!-- results:end -->\nmiddle\n<!-- results:start train_throughput demo -->\n<!-- results:end -->\nend\n"
    out = report.render(page, "page.md")
    first, second = out.split("middle")
    assert "benchmarks/results/demo.json" in first and "train_throughput.json" not in first and "stale" not in first
    assert second.index("train_throughput.json") < second.index("demo.json")  # in the order named
    assert out.startswith("intro\n") and out.endswith("end\n")
    assert report.render(out, "page.md") == out  # idempotent


def _report():
    sys.path.insert(0, str(ROOT / "tools"))
    import report

    return report


def _stored(report, stem: str, key: str):
    return report._get(json.loads((ROOT / "benchmarks" / "results" / f"{stem}.json").read_text()), key)


def test_check_fails_on_a_cited_number_that_disagrees_or_a_number_without_source():
    report = _report()
    stem, path = "bench_delta_rule", "speed/delta/speedup_fwd_bwd/C64_wall_median"
    value = _stored(report, stem, path)
    good = f"a speed-up of {value:.1f}x <!-- src: {stem} {path} --> here"
    assert report.cited_number_problems(good, "p.md") == []
    wrong = f"a speed-up of {value + 1:.1f}x <!-- src: {stem} {path} --> here"
    assert "cites" in report.cited_number_problems(wrong, "p.md")[0]
    assert "cannot be read" in report.cited_number_problems(f"1.5 <!-- src: {stem} no/such/key -->", "p.md")[0]
    region = f"<!-- numbers:start -->\n{good}, and 2.58 typed by hand\n<!-- numbers:end -->"
    problems = report.cited_number_problems(region, "p.md")
    assert len(problems) == 1 and "2.58" in problems[0]
    assert report.cited_number_problems("x 1 <!-- src: no_such_file a -->", "p.md")


def test_cited_percentages_ranges_and_file_names():
    report = _report()
    stem, key = "smollm2_dynamic_eval_context", "context_check/hamlet/bounded_2048_sinks/ratio_to_one_pass"
    ratio = _stored(report, stem, key)
    # a percentage shows the JSON's value times 100
    good = f"costs {100 * ratio:.1f}% <!-- src: {stem} {key} -->"
    assert report.cited_number_problems(good, "p.md") == []
    assert report.cited_number_problems(f"costs {ratio:.3f}% <!-- src: {stem} {key} -->", "p.md")
    assert report.update_cited(f"costs 1.0% <!-- src: {stem} {key} -->").startswith(f"costs {100 * ratio:.1f}%")
    # in a range "A-B" the dash is not B's sign
    assert report.cited_number_problems(f"0.5-{ratio:.3f} <!-- src: {stem} {key} -->", "p.md") == []
    # a decimal beside a file name in parentheses is still a number without a source
    region = "<!-- numbers:start -->\n(see stream_memory.json: 2.58 typed by hand)\n<!-- numbers:end -->"
    problems = report.cited_number_problems(region, "p.md")
    assert len(problems) == 1 and "2.58" in problems[0]


def test_check_fails_on_a_table_that_disagrees_with_its_json():
    report = _report()
    page = "x\n<!-- results:start mutation_check -->\n<!-- results:end -->\n"
    good = report.render(page, "p.md")
    assert report.render(good, "p.md") == good
    row = next(line for line in good.splitlines() if "mutation_check.json" in line)
    tampered = good.replace(row, row.replace(" of ", " of 1"))
    assert tampered != good and report.render(tampered, "p.md") == good  # --check compares exactly this


def test_readme_claims_block_is_the_generated_one():
    report = _report()
    readme = (ROOT / "README.md").read_text()
    assert readme.count(report.CLAIMS_START) == 1 and report.CLAIMS_END in readme
    assert report.render_claims(readme, "README.md") == readme, "run python tools/report.py"
    block = readme.split(report.CLAIMS_START, 1)[1].split(report.CLAIMS_END, 1)[0]
    rows = block.strip().splitlines()
    assert rows[0] == "| claim | paper | ours | verdict | source |" and len(rows) == 2 + len(report.claims())
    for claim, row in zip(report.claims(), rows[2:]):
        assert row.startswith(f"| {claim.claim} | {claim.paper} |") and f"benchmarks/results/{claim.stem}.json" in row
    # a hand edit of a value is what --check catches: the rendered page differs from the page
    row = rows[2]
    tampered = readme.replace(row, row.replace(" holds", " does not hold", 1))
    assert tampered != readme and report.render_claims(tampered, "README.md") == readme


def test_full_results_list_lives_in_docs_results_md():
    report = _report()
    page = (ROOT / "docs" / "results.md").read_text()
    assert f"{report.START} -->" in page  # the block without stems: every result file
    block = page.split(report.START, 1)[1].split(report.END, 1)[0]
    for path in (ROOT / "benchmarks" / "results").glob("*.json"):
        if report.table([path.stem]).splitlines()[2:]:  # a file that gives rows (a headline list or a row of results/extract.toml)
            assert f"`benchmarks/results/{path.name}`" in block, f"docs/results.md does not list {path.name}"
    readme = (ROOT / "README.md").read_text()
    assert report.START not in readme and "](docs/results.md)" in readme


def test_a_claims_verdict_follows_its_rule():
    report = _report()
    assert report.verdict({"": 0.04}, "<= 0.05", "%") == "holds"
    missed = report.verdict({"": 0.128}, "<= 0.05", "%")
    assert missed == "does not hold: 12.8% is not <= 5%"
    assert report.verdict({"": 0.951}, ">= 0.85") == "holds"
    assert report.verdict({"": 0.80}, ">= 0.85").startswith("does not hold")
    # against another value of the row, with or without a factor
    assert report.verdict({"base": 181.2, "FWL": 154.5}, "< base") == "holds"
    assert report.verdict({"base": 150.0, "FWL": 154.5}, "< base") == "does not hold: FWL 154.5 is not < base 150"
    assert report.verdict({"dynamic eval": 155.5, "FWL": 157.0}, "<= 1.02 * dynamic eval") == "holds"
    assert report.verdict({"dynamic eval": 155.5, "FWL": 160.0}, "<= 1.02 * dynamic eval").startswith("does not hold")
    for bad in ("about 0.05", "< 2 * 0.05", "< nobody"):
        with pytest.raises(ValueError):
            report.verdict({"base": 1.0, "ours": 0.5}, bad)



def test_a_users_guide_page_carries_no_citation_marker_in_prose():
    report = _report()
    stem, key = "bench_delta_rule", "speed/delta/speedup_fwd_bwd/C64_wall_median"
    value = report._get(json.loads((ROOT / "benchmarks" / "results" / f"{stem}.json").read_text()), key)
    cited = f"{value:.1f}x <!-- src: {stem} {key} -->"
    # in the prose of a user's guide: fails, naming the line (the number itself is right)
    prose = f"# Title\n\nIntro.\n\nThe chunked form is {cited} faster than the loop.\n"
    problems = report.marker_in_prose_problems(prose, "p.md")
    assert len(problems) == 1 and problems[0].startswith(f"p.md:5: {value:.1f} cites {stem}")
    assert report.cited_number_problems(prose, "p.md") == []
    # inside a numbers region, or in code (a page quoting the syntax), it is allowed
    region = f"Intro.\n<!-- numbers:start -->\nThe chunked form is {cited} faster.\n<!-- numbers:end -->\n"
    assert report.marker_in_prose_problems(region, "p.md") == []
    assert report.marker_in_prose_problems(f"Cite as `1.5 <!-- src: {stem} {key} -->`.\n", "p.md") == []
    # a number without a marker in a user's guide is not checked (paper values, option values, links to results)
    assert report.marker_in_prose_problems("The paper reports 16.6; we set lr 0.5 (see results.md).", "p.md") == []


def test_markers_are_allowed_only_where_the_rule_says(tmp_path):
    report = _report()
    stem, key = "bench_delta_rule", "speed/delta/speedup_fwd_bwd/C64_wall_median"
    value = report._get(json.loads((ROOT / "benchmarks" / "results" / f"{stem}.json").read_text()), key)
    line = f"It is {value:.1f}x <!-- src: {stem} {key} --> faster.\n"
    (tmp_path / "docs" / "experiments").mkdir(parents=True)
    for name in ("docs/guide.md", "docs/results.md", "docs/experiments/bench.md"):
        (tmp_path / name).write_text(line)
    # the write-ups (results.md, experiments/) may cite in prose; a guide may not
    assert [p.split(":")[0] for p in report.prose_problems(tmp_path)] == ["docs/guide.md"]


def test_every_users_guide_page_keeps_markers_out_of_its_prose():
    report = _report()
    problems = report.prose_problems()
    assert problems == [], "\n".join(problems)
    # the measurement write-ups are pages of report.py (rendered and checked)
    assert all(p in report.pages() for p in (ROOT / "docs" / "experiments").glob("*.md"))


def test_a_non_finite_value_is_never_rendered_or_cited_as_a_result(tmp_path, monkeypatch):
    """Issue 52: report.py rendered "nan ppl" into the README and --check passed."""
    report = _report()
    rec = {"command": "python x.py", "headline": [{"what": "x: perplexity", "value": float("nan"), "unit": "ppl"}],
           "score": float("inf")}
    (tmp_path / "bad.json").write_text(json.dumps(rec))
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    monkeypatch.setattr(report, "ROOT", tmp_path.parent)
    with pytest.raises(SystemExit, match="not a result"):
        report.table(["bad"])
    assert "not a result" in report.cited_number_problems("3.2 <!-- src: bad score -->", "p.md")[0]
