"""The docs/ pages run as written (docs/*.md, the user's guides, and docs/experiments/*.md, the write-ups).

- every ```python block of docs/*.md runs, each in a fresh namespace, in a temporary working directory;
- every command line in a ```bash block is checked without running it: `fastweights ...` (also after
  `torchrun ... -m fastweights` or `python -m fastweights`) is parsed by the real CLI parser (plugin
  subcommands included), and a `train` line's preset, `--set` overrides and mechanism options build a
  model (on the meta device); `python benchmarks/X.py --flag` names an existing script that defines
  each flag; `make X` names a Makefile target;
- relative links and images resolve, and every results block names result files that give rows.

Tables themselves are checked against the JSON by tests/test_results_table.py (report.py --check).
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch

from fastweights.cli import build_parser
from helpers import benchmark_flags, registry_restored

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md")) + sorted((DOCS / "experiments").glob("*.md"))  # guides, then write-ups
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
MECHANISM_PAGES = {"language-model.md", "fast-weight-programmers.md", "fast-weight-layers.md", "fast-weights-rnn.md",
                   "dynamic-evaluation.md", "product-key-memory.md", "long-context.md", "huggingface-and-scale.md"}


def _blocks(lang: str) -> list[tuple[str, int, str]]:
    out = []
    for page in PAGES:
        found = [m.group(2) for m in FENCE.finditer(page.read_text()) if m.group(1) == lang]
        out.extend((str(page.relative_to(DOCS)), i, code) for i, code in enumerate(found))
    return out


def _commands() -> list[tuple[str, str]]:
    """(page, command) for every command of every bash block: continuation lines joined, comments
    dropped, `a && b` and `a; b` split into their commands."""
    out = []
    for page, _, code in _blocks("bash"):
        for line in code.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True, posix=True)
            cmd: list[str] = []
            for w in words + ["&&"]:
                if w in ("&&", ";", "||"):
                    if cmd:
                        out.append((page, shlex.join(cmd)))
                    cmd = []
                else:
                    cmd.append(w.rstrip(";"))
    return out


PYTHON_BLOCKS = _blocks("python")
COMMANDS = _commands()


def test_every_page_is_there_and_indexed():
    names = {p.name for p in PAGES}
    assert MECHANISM_PAGES | {"README.md"} <= names
    index = (DOCS / "README.md").read_text()
    readme = (ROOT / "README.md").read_text()
    for name in MECHANISM_PAGES:
        assert f"]({name})" in index, f"docs/README.md does not link {name}"
        assert f"](docs/{name})" in readme, f"README.md's Docs section does not link docs/{name}"
    assert readme.index("## Docs") < readme.index("<!-- claims:start")
    assert "](results.md)" in index and "](docs/results.md)" in readme, "docs/results.md (every result) is not linked"
    assert PYTHON_BLOCKS and COMMANDS


@pytest.mark.parametrize("page,index,code", PYTHON_BLOCKS, ids=[f"{p}:{i}" for p, i, _ in PYTHON_BLOCKS])
def test_python_block_runs(page, index, code, tmp_path, monkeypatch):
    if re.search(r"^\s*(from|import) transformers\b", code, re.M) and importlib.util.find_spec("transformers") is None:
        pytest.skip("needs the [hf] extra (transformers)")
    monkeypatch.chdir(tmp_path)  # snippets write runs/..., hf/... relative to the working directory
    # a block that registers a component (docs/architecture.md's running_mean) leaves the registry as it found it:
    # later tests in this process list the available mixers (an ATEN_CPU_CAPABILITY=default CI run met the leak)
    with registry_restored():
        exec(compile(code, f"docs/{page} python block {index}", "exec"), {"__name__": "__docs__"})


def _fastweights_argv(words: list[str]) -> list[str] | None:
    if words[0] in ("fastweights", ".venv/bin/fastweights"):  # on the PATH, or called in make's environment
        return words[1:]
    for i in range(len(words) - 1):
        if words[i] == "-m" and words[i + 1] == "fastweights":
            return words[i + 2 :]
    return None


def _check_train_config(args) -> None:
    """What `fastweights train` would build from these flags: preset, --data, --set, mechanism options."""
    from fastweights.cli.train import _run_config
    from fastweights.models.lm import LanguageModel

    cfg = _run_config(args)
    model_cfg = cfg.model
    if model_cfg.vocab_size <= 0:
        model_cfg.vocab_size = 256  # filled from the tokenizer when training
    with torch.device("meta"):  # validates names, options and sizes without allocating the tables
        LanguageModel(model_cfg)


@pytest.mark.parametrize("page,command", COMMANDS, ids=[f"{p}: {c[:60]}" for p, c in COMMANDS])
def test_command_line_is_valid(page, command):
    words = shlex.split(command)
    while words and (words[0] == "/usr/bin/time" or re.fullmatch(r"[A-Z_]+=\S*", words[0])):
        words = words[1:]  # `time` and environment assignments in front of a command
    argv = _fastweights_argv(words)
    if argv is not None:
        args = build_parser().parse_args(argv)  # a renamed flag or subcommand raises UserError here
        if args.command == "train" and not args.resume:
            _check_train_config(args)
        return
    if words[0] == "python" and words[1].startswith(("benchmarks/", "tools/")):
        script = ROOT / words[1]
        assert script.is_file(), f"{page}: no script {words[1]}"
        for flag in (w.split("=", 1)[0] for w in words[2:] if w.startswith("--")):
            assert flag in benchmark_flags(words[1]), f"{page}: {words[1]} has no option {flag}"
        return
    if words[0] == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M)
        assert all(t in targets for t in words[1:]), f"{page}: no Makefile target in {command!r}"
        return
    if words[:2] == ["pip", "install"]:
        return
    if words[0] == "source":  # the environment make creates
        venv = re.search(r"^VENV := (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
        assert words[1:] == [f"{venv}/bin/activate"], f"{page}: make's environment is {venv}: {command!r}"
        return
    pytest.fail(f"{page}: a command the docs test cannot check: {command!r}")


def test_relative_links_resolve():
    link = re.compile(r"\]\(([^)\s]+)\)")
    for page in [*PAGES, ROOT / "README.md"]:
        for target in link.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#", 1)[0]).resolve()
            assert path.exists(), f"{page.relative_to(ROOT)} links to a missing {target}"


def _anchors(page: Path) -> set[str]:
    """The anchors of a page: its headings as GitHub slugs them, and its ``<a id="...">`` tags."""
    text = FENCE.sub("", page.read_text())
    heads = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", text, re.M)}
    return heads | set(re.findall(r'<a id="([^"]+)"', text))


def test_links_into_docs_pages_name_existing_anchors():
    """A guide links its measured rows as results.md#STEM (anchored by report.py) and sections by heading."""
    link = re.compile(r"\]\(([^)\s#]*\.md)#([^)\s]+)\)")
    for page in [*PAGES, ROOT / "README.md"]:
        for target, anchor in link.findall(page.read_text()):
            path = (page.parent / target).resolve()
            if path.is_relative_to(DOCS.resolve()):
                assert anchor in _anchors(path), f"{page.relative_to(ROOT)} links to a missing {target}#{anchor}"


def test_every_guide_says_what_we_measured_with_links_to_results():
    for name in MECHANISM_PAGES:
        text = (DOCS / name).read_text()
        assert "\n## What we measured\n" in text, f"docs/{name} has no 'What we measured' section"
        section = text.split("\n## What we measured\n", 1)[1].split("\n## ", 1)[0]
        assert "](results.md#" in section or "](language-model.md#" in section, f"docs/{name}: no link to results rows"


def test_results_blocks_name_result_files_with_rows():
    sys.path.insert(0, str(ROOT / "tools"))
    import report

    opening = re.compile(r"<!-- results:start([^>]*)-->")
    for page in PAGES:
        for stems in opening.findall(page.read_text()):
            for stem in stems.split():
                rows = report.table([stem]).splitlines()[2:]
                assert rows, f"{page.relative_to(ROOT)}: benchmarks/results/{stem}.json gives no table rows"


def test_readme_says_how_to_run_the_command_after_make_demo():
    """`make` installs the `fastweights` script into .venv/bin, which is not on the PATH (issue 33): the README
    says so where `make demo` is, before its first bare `fastweights` command."""
    assert re.search(r'^\[project\.scripts\]\s*\nfastweights = ', (ROOT / "pyproject.toml").read_text(), re.M)
    assert re.search(r"^BIN := \$\(VENV\)/bin$", (ROOT / "Makefile").read_text(), re.M) and \
        re.search(r"^VENV := \.venv$", (ROOT / "Makefile").read_text(), re.M)
    readme = (ROOT / "README.md").read_text()
    demo = readme.index("make demo")
    section = readme[demo:readme.index("\n## ", demo)]  # the section that introduces `make demo`
    assert "source .venv/bin/activate" in section and ".venv/bin/fastweights" in section
    first_command = re.search(r"^fastweights ", readme, re.M).start()
    assert readme.index("source .venv/bin/activate") < first_command, "a bare `fastweights` before the README says how"
