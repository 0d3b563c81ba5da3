"""Regenerate the results and claims tables of the README and docs/*.md from benchmarks/results/*.json, so
no number is typed by hand.

    python tools/report.py            # summarise new results' probes, rewrite every table
    python tools/report.py --check    # exit 1 if any page is out of date (used by the tests)

Run after a benchmark or a ``fastweights`` command wrote a result into benchmarks/results/: a result is written
with its provenance only, and this adds the summaries of its behaviour probes (``evidence.stamp``) while the code
is still the code that wrote it.

A results table (``<!-- results:start -->`` ... ``<!-- results:end -->``) lists every result file
(docs/results.md holds that full list); a docs page lists only the files it names:
``<!-- results:start fwl_quality bench_fwl -->``.

A result file contributes rows through its ``headline`` list:
``{"what": "...", "value": 1.23, "unit": "bits/char", "target": ">= 0.9"}`` (unit and target optional).

The claims table (``<!-- claims:start -->`` ... ``<!-- claims:end -->``, in the README; issue 21) puts each
paper's headline claims (``results/claims.toml``) beside the closest result we have, with a verdict computed from the value
and the claim's rule.

Pages: README.md, docs/*.md and docs/experiments/*.md (one write-up per benchmark).

``--check`` also fails (issues 22, 30) on
  * a cited number that disagrees with its source: ``0.805 <!-- src: bench_fwpkm_model ratio -->`` (the shown
    digits must be the JSON value rounded to them; key paths as in ``results/extract.toml``), on any page;
  * a decimal number without a source inside ``<!-- numbers:start -->`` ... ``<!-- numbers:end -->``;
  * a citation marker in the prose of a user's-guide page (docs/*.md but results.md) outside a numbers region:
    markers live in the generated tables, the README's claims table, numbers regions and the measurement write-ups
    (docs/results.md, docs/experiments/*.md); a user's guide links to those (``marker_in_prose_problems``);
  * the evidence rules of ``evidence.py``: a JSON without its command, git commit, ``result_file`` or
    behaviour probes; and a results/TO_RERUN.md (the stale results, generated here) out of date.
A stale result (its probes changed) is no error: the tables mark it and TO_RERUN.md lists it.
"""

from __future__ import annotations

import json
import math
import operator
import re
import sys
import tomllib
from pathlib import Path
from typing import NamedTuple

import evidence  # tools/evidence.py, the script's folder (on sys.path when run)

from fastweights.cli.script_parser import ScriptParser, exit_status_of

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
START, END = "<!-- results:start", "<!-- results:end -->"
CLAIMS_START, CLAIMS_END = "<!-- claims:start -->", "<!-- claims:end -->"
# the equal-compute leaderboard (issue 21): markdown_table below, of results/leaderboard.json
BOARD_START, BOARD_END = "<!-- leaderboard:start -->", "<!-- leaderboard:end -->"
# Pages that must hold a block, so that deleting one does not pass the check silently.
REQUIRED = {"README.md": CLAIMS_START, "docs/results.md": START + " -->"}


# Rows for result files that carry no ``headline`` list, as data beside the results: results/extract.toml.
EXTRACT_FILE = RESULTS / "extract.toml"


def extract_rows() -> list[tuple[str, str, str, str, str]]:
    """``(stem, what, key path, unit, target)`` of every row of ``results/extract.toml``, in its order."""
    return [(r["stem"], r["what"], r["key"], r["unit"], r["target"])
            for r in tomllib.loads(EXTRACT_FILE.read_text())["row"]]


class Claim(NamedTuple):
    """One headline claim of a paper beside the closest result we have (a row of the claims table).

    ``key`` is one key path into ``benchmarks/results/STEM.json`` (as in ``results/extract.toml``), or ``{label: key path}``
    for values shown side by side ("base 181.2 vs FWL 154.5 ppl"), ours last. ``rule`` is what the last
    value must satisfy for the claim to hold: ``"OP NUMBER"`` or ``"OP [FACTOR *] LABEL"`` (against another
    value of the row), OP one of < <= > >=; a number is in the JSON's units (a fraction when unit is "%").
    """

    claim: str  # the claim in words, with where our setting differs from the paper's
    paper: str  # the paper's number and where it is in the paper
    stem: str
    key: str | dict[str, str]
    unit: str  # "%": the JSON holds a fraction, shown times 100
    rule: str


CLAIMS_FILE = RESULTS / "claims.toml"  # the claims, as data beside the results they cite


def claims() -> list[Claim]:
    """The claims of ``results/claims.toml``, in its order."""
    return [Claim(**c) for c in tomllib.loads(CLAIMS_FILE.read_text())["claim"]]


def _get(rec: dict, key_path: str):
    node = rec
    for part in key_path.split("/"):
        node = node[int(part)] if isinstance(node, list) else node[part.replace("|", "/")]  # "|": a "/" in a key
    return node


def _fmt(v) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int) or float(v).is_integer() and abs(v) >= 100:
        return f"{int(v):,}"
    if 0.9 <= abs(v) < 1.1 and v != round(v):
        return f"{v:.4f}"  # ratios near 1: three significant figures would print 1.0023 as "1"
    return f"{v:.3g}" if abs(v) < 10 else f"{v:,.1f}"


def table(stems: list[str] | None = None) -> str:
    """Rows from every result file (the first row of each anchored as STEM), or from the named ones (file stems)
    in that order."""
    rows = ["| result | value | target | source (command in the JSON) |", "|---|---|---|---|"]
    if stems:
        missing = [s for s in stems if not (RESULTS / f"{s}.json").exists()]
        if missing:
            raise SystemExit(f"no result file benchmarks/results/{missing[0]}.json")
    for path in [RESULTS / f"{s}.json" for s in stems] if stems else sorted(RESULTS.glob("*.json")):
        rec = json.loads(path.read_text())
        heads = rec.get("headline") or [{"what": what, "value": _get(rec, key), "unit": unit, "target": target}
                                         for stem, what, key, unit, target in extract_rows() if stem == path.stem]
        for i, h in enumerate(heads):
            if isinstance(h["value"], float) and not math.isfinite(h["value"]):  # "nan ppl" is never a result
                raise SystemExit(f"error: {path.relative_to(ROOT)}: {h['what'].strip()!r} is {h['value']}, not a "
                                 "result: re-run it or drop the row")
            value = _fmt(h["value"]) + (f" {h['unit']}" if h.get("unit") else "")
            mark = evidence.status(path)
            source = f"`{path.relative_to(ROOT)}`" + (f" ({mark})" if mark else "")
            if not stems and i == 0:  # the full table (docs/results.md): pages link a file's rows as results.md#STEM
                source = f'<a id="{path.stem}"></a>{source}'
            rows.append(f"| {h['what']} | {value} | {h.get('target', '')} | {source} |")
    return "\n".join(rows)


def render(page: str, name: str) -> str:
    """Rewrite each ``<!-- results:start [stems] -->`` ... ``<!-- results:end -->`` block of a page."""
    if START not in page:
        raise SystemExit(f"{name} has no {START} ... {END} markers")
    out, rest = page.split(START, 1)
    while True:
        opening, rest = rest.split("-->", 1)
        if END not in rest:
            raise SystemExit(f"{name}: {START}{opening}--> has no {END}")
        _, rest = rest.split(END, 1)
        out += f"{START}{opening}-->\n{table(opening.split())}\n{END}"
        if START not in rest:
            return out + rest
        between, rest = rest.split(START, 1)
        out += between


def _num(v, unit: str) -> str:
    return _fmt(v * 100) + "%" if unit == "%" else _fmt(v)


def _shown(values: dict[str, float], unit: str) -> str:
    """One value ("0.951 x"), or labelled values side by side ("base 181.2 vs FWL 154.5 ppl")."""
    text = " vs ".join(f"{label} {_num(v, unit)}".strip() for label, v in values.items())
    return text + (f" {unit}" if unit and unit != "%" else "")


RULE = re.compile(r"(<=|>=|<|>)\s*(?:(\d+(?:\.\d+)?)\s*\*\s*)?(.+)")
OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}


def verdict(values: dict[str, float], rule: str, unit: str = "") -> str:
    """"holds" when the last value satisfies the rule, else "does not hold: ..." saying how it misses."""
    m = RULE.fullmatch(rule.strip())
    if not m:
        raise ValueError(f"a claim's rule must read 'OP NUMBER' or 'OP [FACTOR *] LABEL': {rule!r}")
    op, factor, target = m.group(1), m.group(2), m.group(3).strip()
    label, value = list(values.items())[-1]
    if target in values:
        bound = float(values[target]) * float(factor or 1)
        against = (f"{factor} x " if factor else "") + f"{target} {_num(values[target], unit)}"
    elif factor is None and re.fullmatch(r"-?\d+(?:\.\d+)?", target):
        bound = float(target)
        against = _num(bound, unit)
    else:
        raise ValueError(f"{rule!r}: {target!r} is neither a number nor a label of the row ({', '.join(values)})")
    if OPS[op](float(value), bound):
        return "holds"
    return f"does not hold: {f'{label} ' if label else ''}{_num(value, unit)} is not {op} {against}"


def claims_table() -> str:
    """The claims table: each claim of :func:`claims` with our value, its verdict and its source."""
    rows = ["| claim | paper | ours | verdict | source |", "|---|---|---|---|---|"]
    for c in claims():
        path = RESULTS / f"{c.stem}.json"
        if not path.exists():
            raise SystemExit(f"claim {c.claim[:40]!r}...: no result file benchmarks/results/{c.stem}.json")
        rec = json.loads(path.read_text())
        keys = c.key if isinstance(c.key, dict) else {"": c.key}
        values = {label: _get(rec, key) for label, key in keys.items()}
        mark = evidence.status(path)
        said = verdict(values, c.rule, c.unit) + (f"; {mark}" if mark else "")
        rows.append(f"| {c.claim} | {c.paper} | {_shown(values, c.unit)} | {said} | `{path.relative_to(ROOT)}` |")
    return "\n".join(rows)


def render_claims(page: str, name: str) -> str:
    """Rewrite each ``<!-- claims:start -->`` ... ``<!-- claims:end -->`` block of a page."""
    if CLAIMS_START not in page:
        raise SystemExit(f"{name} has no {CLAIMS_START} ... {CLAIMS_END} markers")
    out, table_text = [], None
    for i, part in enumerate(page.split(CLAIMS_START)):
        if i == 0:
            out.append(part)
            continue
        if CLAIMS_END not in part:
            raise SystemExit(f"{name}: {CLAIMS_START} has no {CLAIMS_END}")
        table_text = table_text or claims_table()
        out.append(f"\n{table_text}\n{CLAIMS_END}" + part.split(CLAIMS_END, 1)[1])
    return CLAIMS_START.join(out)


def markdown_table(rec: dict) -> str:
    """The README's leaderboard from benchmarks/quality/leaderboard.py's JSON (rendered between ``<!-- leaderboard:start -->``
    and ``<!-- leaderboard:end -->``): one row per entry, best streamed score first, marked rows footnoted.
    Here, not in leaderboard.py, so that a change of presentation leaves the measured JSON current."""
    p = rec["protocol"]
    params = [t["parameters"] / 1e6 for t in rec["table"]]
    lines = [f"Char-level, {min(params):.2f}-{max(params):.2f}M parameters, {p['cpu_minutes_per_model']:g} "
             "CPU-minutes of training each on "
             f"`{p['train_corpus']}` (one thread), scored on {len(p['heldout'])} held-out plays "
             f"({len(p['heldout']) * p['chars_per_play']:,} characters). bits/char: lower is better. "
             "\"streamed\": one stream, state carried; \"windows\": state reset every 128 characters.", ""]
    if rec["missing"]:
        lines += [f"**Incomplete:** not yet measured: {', '.join(rec['missing'])} (and then 3 seeds for the "
                  "best three).", ""]
    elif not rec["complete"]:
        pending = [t["entry"] for t in rec["table"] if t["entry"] in rec["top_entries_for_seeds"] and len(t["seeds"]) < 3]
        lines += [f"**Incomplete:** the best three need 3 seeds each; pending: {', '.join(pending)}.", ""]
    dynamic = [t["entry"] for t in rec["table"] if "dynamic" in t]
    lines += ["Columns: **streamed** and **windows** in bits/char, lower is better (after \"±\": the standard "
              "deviation over seeds). **streamed - windows**: below zero, carrying the state helps (the row uses more than the last "
              "128 characters); above zero, streaming hurts, and \"(> 0.05)\" marks a row that streams more than 0.05 "
              "bits/char worse (its reason below, when known)."
              + (f" The {', '.join(f'`{e}`' for e in dynamic)} row adapts a trained model: its \"windows\" is that "
                 "static model's score, not adapted, so its \"streamed - windows\" is what adapting to the text (and "
                 "carrying the cache) gains; its training columns are the static model's." if dynamic else "")
              + " **params**: parameters. **train tok/s** and **score tok/s**: tokens per CPU-second on one thread (the "
              "process's CPU time, so time spent waiting for a busy machine's cores is not counted; higher is faster); "
              "\"score\" is the streamed pass" + (", dynamic evaluation's weight updates included" if dynamic else "")
              + ". **train RSS MB**: peak resident memory of the training process, lower is better. **seeds**: training "
              "seeds the row averages.", ""]
    lines += ["| # | mechanism | streamed | windows | streamed - windows | params | train tok/s | score tok/s "
              "| train RSS MB | seeds |", "|---|---|---|---|---|---|---|---|---|---|"]
    limits: dict[str, int] = {}  # a marked row's reason -> its footnote number
    for t in rec["table"]:
        sd = f" ± {t['streamed_std']:.3f}" if t["streamed_std"] is not None else ""
        gap = f"{t['streamed_minus_windows_bits']:+.3f}" + ("" if t["streams_within_0_05"] else " (> 0.05)")
        if "streaming_limit" in t:
            gap += f" [{limits.setdefault(t['streaming_limit'], len(limits) + 1)}]"
        lines.append(f"| {t['rank']} | {t['mechanism']} (`{t['entry']}`) | {t['streamed_bits_per_char']:.3f}{sd} "
                     f"| {t['windows_bits_per_char']:.3f} | {gap} | {t['parameters'] / 1e6:.2f}M "
                     f"| {t['train_tokens_per_cpu_s']:,.0f} | {t['score_tokens_per_cpu_s']:,.0f} "
                     f"| {t['train_max_rss_mb']:,.0f} | {len(t['seeds'])} |")
    for why, i in limits.items():  # each footnote its own paragraph
        lines += ["", f"[{i}] {why}."]
    return "\n".join(lines)


def render_board(page: str, name: str) -> str:
    """Rewrite the ``<!-- leaderboard:start -->`` ... ``<!-- leaderboard:end -->`` block of a page."""
    path = RESULTS / "leaderboard.json"
    if not path.exists():
        raise SystemExit(f"{name} has a leaderboard block but there is no benchmarks/results/leaderboard.json")
    head, rest = page.split(BOARD_START, 1)
    if BOARD_END not in rest:
        raise SystemExit(f"{name}: {BOARD_START} has no {BOARD_END}")
    mark = evidence.status(path)
    text = markdown_table(json.loads(path.read_text())) + (f"\n\n({mark})" if mark else "")
    return f"{head}{BOARD_START}\n{text}\n{BOARD_END}{rest.split(BOARD_END, 1)[1]}"


def render_page(page: str, name: str) -> str:
    """The page with every results, claims and leaderboard block regenerated."""
    if START in page:
        page = render(page, name)
    if CLAIMS_START in page:
        page = render_claims(page, name)
    if BOARD_START in page:
        page = render_board(page, name)
    return page


# a cited number: the digits shown (a "-" right after a digit is a range's dash, not a sign), its unit ("%":
# the JSON holds the fraction), the JSON file's stem and the key path into it
CITE = re.compile(r"((?:(?<![\w.])-)?\d[\d,]*(?:\.\d+)?)(\s?[a-zA-Z%/*]*)\s*<!-- src: (\S+) (.+?) -->")
NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*\.\d+")  # a measured number has decimals; counts like "12-layer" do not
REGION = re.compile(r"<!-- numbers:start -->(.*?)<!-- numbers:end -->", re.S)


def cited_number_problems(page: str, name: str) -> list[str]:
    """Cited prose numbers that disagree with their JSON, and uncited numbers in numbers regions."""
    out = []
    for m in CITE.finditer(page):
        shown, stem, key = m.group(1), m.group(3), m.group(4)
        path = RESULTS / f"{stem}.json"
        try:
            value = float(_get(json.loads(path.read_text()), key))
        except (OSError, KeyError, IndexError, ValueError, TypeError) as e:
            out.append(f"{name}: {shown} cites {stem} {key}, which cannot be read ({type(e).__name__})")
            continue
        if not math.isfinite(value):
            out.append(f"{name}: {shown} cites {stem} {key} = {value}, not a result")
            continue
        digits = len(shown.split(".")[1]) if "." in shown else 0
        scale = 100.0 if m.group(2).strip().startswith("%") else 1.0
        if round(value * scale, digits) != float(shown.replace(",", "")):
            out.append(f"{name}: {shown}{m.group(2).strip()} cites {stem} {key} = {value}")
    for region in REGION.finditer(page):
        bare = CITE.sub("", region.group(1))
        bare = re.sub(r"<!--.*?-->|`[^`]*`|[\w./-]+\.(?:json|py|md|png|toml)\b", "", bare, flags=re.S)
        for m in NUMBER.finditer(bare):
            out.append(f"{name}: the number {m.group(0)} in a numbers region cites no source")
    return out


# Where citation markers live (issue 30). Markers are required in the generated tables (their source column), in
# the README's claims table and in numbers regions (above: there every decimal must cite its key). The measurement
# write-ups (docs/results.md and docs/experiments/*.md) may also cite numbers in their prose; every marker anywhere
# is checked against its JSON (cited_number_problems). The user's-guide pages (every other page of docs/) carry no
# markers in prose: they state a measured number by linking to its row of docs/results.md or to an experiments
# page, or inside a numbers region; a marker in their prose outside one is a problem (marker_in_prose_problems).
GUIDE_PAGES = "docs/*.md"
WRITEUPS = {"docs/results.md"}  # and docs/experiments/*.md, which GUIDE_PAGES does not match
_NOT_SCANNED = re.compile(r"^[ \t]*```.*?^[ \t]*```[ \t]*$|`[^`\n]*`", re.S | re.M)  # fenced and inline code


def marker_in_prose_problems(page: str, name: str) -> list[str]:
    """Citation markers in the prose of a user's-guide page, outside numbers regions and code."""
    def blank(m: re.Match) -> str:
        return re.sub(r"[^\n]", " ", m.group(0))  # keep line numbers

    text = _NOT_SCANNED.sub(blank, REGION.sub(blank, page))
    return [f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(1)} cites {m.group(3)} in the prose of a "
            "user's-guide page: link its row of docs/results.md or an experiments page, move it to docs/experiments/, "
            "or put it in a <!-- numbers:start --> ... <!-- numbers:end --> region" for m in CITE.finditer(text)]


def prose_problems(root: Path = ROOT) -> list[str]:
    """marker_in_prose_problems of every user's-guide page (GUIDE_PAGES but WRITEUPS)."""
    problems = []
    for path in sorted(root.glob(GUIDE_PAGES)):
        name = str(path.relative_to(root))
        if name not in WRITEUPS:
            problems += marker_in_prose_problems(path.read_text(), name)
    return problems


def update_cited(page: str) -> str:
    """Rewrite every cited prose number to its JSON value, at the precision the page shows it (after a re-run)."""
    def repl(m: re.Match) -> str:
        shown, stem, key = m.group(1), m.group(3), m.group(4)
        try:
            value = float(_get(json.loads((RESULTS / f"{stem}.json").read_text()), key))
        except (OSError, KeyError, IndexError, ValueError, TypeError):
            return m.group(0)  # --check names it
        digits = len(shown.split(".")[1]) if "." in shown else 0
        value *= 100.0 if m.group(2).strip().startswith("%") else 1.0
        new = f"{value:,.{digits}f}" if "," in shown else f"{value:.{digits}f}"
        return new + m.group(0)[len(shown):]
    return CITE.sub(repl, page)


def pages() -> list[Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "docs" / "experiments").glob("*.md"))


def main() -> int:
    ap = ScriptParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--update-cited", action="store_true",
                    help="rewrite cited prose numbers (<!-- src: STEM KEY -->) to their JSON values, then render")
    args = ap.parse_args()
    if args.update_cited:
        for path in pages():
            old = path.read_text()
            new = update_cited(old)
            if new != old:
                path.write_text(new)
                print(f"updated cited numbers in {path.relative_to(ROOT)}")
    for name, marker in REQUIRED.items():
        if not (ROOT / name).is_file() or marker not in (ROOT / name).read_text():
            raise SystemExit(f"{name} must hold a {marker} block")
    if not args.check:
        for why in evidence.stamp_new():
            print(f"not summarised: {why}", file=sys.stderr)
    stale = []
    rerun = evidence.rerun_page()
    if not evidence.RERUN_PAGE.exists() or evidence.RERUN_PAGE.read_text() != rerun:
        stale.append(evidence.RERUN_PAGE)
        if not args.check:
            evidence.RERUN_PAGE.write_text(rerun)
            print(f"updated {evidence.RERUN_PAGE.relative_to(ROOT)}")
    for path in pages():
        old = path.read_text()
        if START not in old and CLAIMS_START not in old and BOARD_START not in old:
            continue  # a docs page without a results, claims or leaderboard table
        new = render_page(old, str(path.relative_to(ROOT)))
        if new != old:
            stale.append(path)
            if not args.check:
                path.write_text(new)
                print(f"updated {path.relative_to(ROOT)}")
    problems = []
    if args.check:
        for path in pages():
            problems += cited_number_problems(path.read_text(), str(path.relative_to(ROOT)))
        problems += prose_problems() + evidence.problems()
        for p in problems:
            print(p, file=sys.stderr)
    if args.check and stale:
        names = ", ".join(str(p.relative_to(ROOT)) for p in stale)
        print(f"results or claims tables out of date in {names}: run python tools/report.py", file=sys.stderr)
    return 1 if args.check and (stale or problems) else 0


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
