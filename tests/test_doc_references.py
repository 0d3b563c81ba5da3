"""Every path, module, command and flag that README.md and docs/**/*.md name exists (issue 38, scope 7).

Read: the inline code spans and the lines of fenced code blocks (continuation lines joined) of README.md,
docs/*.md and docs/experiments/*.md, generated blocks included (tools/report.py writes them; a stale
name there is fixed by fixing the generator or the result and regenerating). Links are checked by
tests/test_docs.py, and the bash blocks' command lines are parsed whole there; this file also checks inline
spans and the other code blocks, where a command is often written with placeholders (DIR, NAME, `a|b`).

Checked, each failure reported as ``page:line: what is wrong`` (all of them at once):

- paths: a token with a slash that starts with ``src/``, ``fastweights/``, ``benchmarks/``, ``tests/``,
  ``configs/`` or ``docs/`` exists in the repository; one that starts with a subpackage of fastweights
  (``ops/fwl.py``, ``layers/``) and ends in a file suffix or ``/`` exists in the package (or beside the
  page); a bare ``name.py`` / ``name.c`` is the name of a file under src/, benchmarks/ or tests/; a glob
  matches a file.
- dotted names: ``fastweights.a.b.Name`` resolves to a module under src/ and a name it defines (the module
  read with ``ast``, not imported); so does a name that starts with a module's own name (``components.lookup``,
  ``adapt.dynamic.DynamicEvaluator``); ``model.x`` / ``data.x`` / ``train.x`` is a field of the run config
  (``model.options.NAME`` a registered component); ``Class.attr`` of a class of ours is an attribute of it.
- commands: ``fastweights SUB [SUBSUB]`` (also ``python -m fastweights``, ``.venv/bin/fastweights``,
  ``a|b`` alternatives) walks the real parser (``fastweights.cli.build_parser``), and each ``--flag`` after
  it is one that the subcommand accepts; a ``--set key=value`` key is a config field.
  ``python -m fastweights.harness`` and ``lm-eval`` walk lm-eval's own parser (when lm-eval is installed);
  ``python benchmarks/X.py --flag`` names a script that defines the flag; ``make X`` a Makefile target.
- a ``--flag`` that follows no command (prose: "`--force-ram` skips the check") is a flag of some command
  of ours, of lm-eval's parser, or of a benchmark script.
- the floor table of docs/architecture.md is the floor map of tests/contracts/test_floors.py, row by row,
  and README's Layout lists every package and root module of src/fastweights, lowest floor first.

Not checked, and why (the exemptions, kept short):

- paths under ``runs/``, ``data/`` and other folders a user creates, and the word after an output flag
  (``--out``, ``--output_path``): output of a command, not part of the repository; a path after ``COMMIT:``
  (``eb1108e:benchmarks/results/niah_cpu.json``): a file of that commit, not of the tree;
- placeholders: a path part written NAME, STEM, X, DIR or FILE or in ``<...>``; a command word in capitals
  (``COMMAND``);
- ``NOT_OURS``: names in the docs' examples that are variables or keys of a result file, not modules;
  other libraries' modules and classes (``torch.compile``, ``AutoTokenizer.from_pretrained``) are not ours
  to check;
- the flags of ``pip``, ``pytest``, ``torchrun`` (before ``-m fastweights``), ``git`` and ``tensorboard``:
  other programs, whose parsers are not ours to walk; a lone word with one dash (``-log P`` in an equation,
  the ``-fwp-sum-dpfp`` of a preset's name): prose, not a flag; a dotted name ending in a file suffix
  (``metrics.jsonl``): a file name;
- weaker than it could be: a lone ``--flag`` is only checked to belong to some command, ``--model_args``
  keys of the harness not at all, and a ``--set`` key only up to its section's field (test_docs builds a
  model from each bash block's ``--set``, which checks a mechanism's own options).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import re
import shlex
from pathlib import Path

import pytest

from helpers import benchmark_flags

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "fastweights"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "docs" / "experiments").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)

REPO_ROOTS = ("src", "fastweights", "benchmarks", "tools", "tests", "configs", "docs")  # path tokens checked from the repo root
FILE_SUFFIX = re.compile(r"\.(py|c|toml|yaml|json|jsonl|md|png|pt|gz|txt|safetensors|bin|gguf)$")
PLACEHOLDERS = {"NAME", "STEM", "X", "DIR", "FILE"}
OUTPUT_FLAGS = {"--out", "--output_path", "-o"}  # what follows is a folder the command creates
NOT_OURS = {  # roots of dotted names that are no module of ours, so nothing to resolve
    "self", "out", "cfg", "options", "nn", "section",  # variables and placeholders of the docs' examples
    "machine", "results", "git",  # keys of a result file (machine.load_average_1m, git.commit)
}
OTHER_PROGRAMS = {"pip", "pytest", "torchrun", "git", "tensorboard"}  # their flags are not ours to check


# ----------------------------------------------------------------------------- what the pages name


@dataclasses.dataclass(frozen=True)
class Span:
    page: str  # relative to the repository
    line: int
    text: str
    code: bool  # a line of a fenced block (else an inline span)
    lang: str = ""

    def where(self) -> str:
        return f"{self.page}:{self.line}"


def spans_of(text: str, page: str) -> list[Span]:
    out = []
    for m in FENCE.finditer(text):
        first = text.count("\n", 0, m.start(2)) + 1
        lines = m.group(2).split("\n")
        i = 0
        while i < len(lines):
            start, line = i, lines[i]
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1] + " " + lines[i].strip()
            if line.strip():
                out.append(Span(page, first + start, line, True, m.group(1)))
            i += 1
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)  # line numbers kept
    for m in re.finditer(r"`([^`\n]+)`", prose):
        out.append(Span(page, prose.count("\n", 0, m.start()) + 1, m.group(1), False))
    return out


@functools.cache
def all_spans() -> tuple[Span, ...]:
    return tuple(s for p in PAGES for s in spans_of(p.read_text(), str(p.relative_to(ROOT))))


def words_of(text: str) -> list[str]:
    """Shell words, a trailing comment dropped; a span that is not valid shell splits on spaces."""
    try:
        return shlex.split(text, comments=True)
    except ValueError:
        return text.split("#", 1)[0].split()


# ----------------------------------------------------------------------------- paths


@functools.cache
def subpackages() -> frozenset[str]:
    return frozenset(p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("__"))


@functools.cache
def file_names() -> frozenset[str]:
    return frozenset(p.name for top in ("src", "benchmarks", "tools", "tests") for p in (ROOT / top).rglob("*") if p.is_file())


PATH = re.compile(r"(?<![\w./:-])((?:[\w*<>-]+/)+(?:[\w*.<>-]|\{[\w.,]+\})*)")  # not after `COMMIT:`
BRACES = re.compile(r"\{([\w.,]+)\}")
BARE_FILE = re.compile(r"(?<![\w./-])([\w-]+\.(?:py|c))\b(?![./])")


def path_problem(token: str, page: str) -> str | None:
    """None when ``token`` exists (or is not a repository path); else why it does not."""
    braces = BRACES.search(token)
    if braces:  # results/x.{json,png}: each
        return next(filter(None, (path_problem(token[:braces.start()] + alt + token[braces.end():], page)
                                  for alt in braces.group(1).split(","))), None)
    parts = token.rstrip("/").split("/")
    if any(PLACEHOLDERS & set(re.split(r"[_.-]", p)) or "<" in p for p in parts):
        return None
    top = parts[0]
    if top in REPO_ROOTS:
        bases = [PACKAGE.parent] if top == "fastweights" else [ROOT]
    elif top in subpackages() and (FILE_SUFFIX.search(token) or token.endswith("/")):
        bases = [PACKAGE, (ROOT / page).parent]  # ops/fwl.py; experiments/gpu.md from docs/
    else:
        return None  # runs/..., data/big, a hub name: not a path of the repository
    rel = token.rstrip("/")
    if any(any(b.glob(rel)) if "*" in rel else (b / rel).exists() for b in bases):
        return None
    where = f" (looked in {', '.join(str(b.relative_to(ROOT)) or '.' for b in bases)})" if top not in REPO_ROOTS else ""
    return f"`{token}` does not exist{where}{moved_hint(Path(rel).name)}"


def moved_hint(name: str) -> str:
    """Where a file of that name is now, if anywhere (a moved module: the page should name the new path)."""
    found = [str(p.relative_to(ROOT)) for top in ("src", "benchmarks", "tools", "tests", "docs", "configs")
             for p in (ROOT / top).rglob(name)] if name and "*" not in name else []
    return f"; a file of that name: {', '.join(sorted(found)[:3])}" if found else ""


def path_problems(spans) -> list[str]:
    problems = []
    for s in spans:
        text = s.text
        skip = {w for a, w in zip(words_of(text), words_of(text)[1:]) if a in OUTPUT_FLAGS}
        for token in PATH.findall(text):
            token = token.rstrip(".,;:")
            if token in skip or token.startswith("/"):
                continue
            why = path_problem(token, s.page)
            if why:
                problems.append(f"{s.where()}: {why}")
        if s.lang != "python":
            for name in BARE_FILE.findall(text):
                if name not in file_names():
                    problems.append(f"{s.where()}: `{name}`: no file of that name under src/, benchmarks/ or tests/")
    return problems


# ----------------------------------------------------------------------------- dotted names


@functools.cache
def module_files() -> dict[str, Path]:
    """'fastweights.a.b' -> its file, for every module and package under src/fastweights."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


@functools.cache
def top_names(path: Path) -> dict[str, ast.AST | None]:
    """Names a module defines at its top level (a class maps to its node, to look inside it)."""
    names: dict[str, ast.AST | None] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node if isinstance(node, ast.ClassDef) else None
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        names[n.id] = None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                names[(a.asname or a.name).split(".")[0]] = None
    return names


def class_has(node: ast.ClassDef, attr: str) -> bool:
    for item in ast.walk(node):
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and item.name == attr:
            return True
        if isinstance(item, ast.Name) and item.id == attr and isinstance(item.ctx, ast.Store):
            return True
        if isinstance(item, ast.Attribute) and item.attr == attr and isinstance(item.ctx, ast.Store):
            return True  # self.attr = ...
    return False


@functools.cache
def classes() -> dict[str, list[ast.ClassDef]]:
    out: dict[str, list[ast.ClassDef]] = {}
    for path in module_files().values():
        for name, node in top_names(path).items():
            if node is not None:
                out.setdefault(name, []).append(node)
    return out


def resolves(dotted: str) -> bool:
    """``fastweights.a.b[.Name[.attr]]``: the longest module prefix, then names it defines."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        if module in module_files():
            rest = parts[cut:]
            if not rest:
                return True
            names = top_names(module_files()[module])
            if rest[0] not in names and "__getattr__" not in names:
                return False
            node = names.get(rest[0])
            return len(rest) == 1 or node is None or class_has(node, rest[1])
    return False


@functools.cache
def config_fields() -> dict[str, type]:
    from fastweights.core.config import RunConfig

    return {f.name: f.type for f in dataclasses.fields(RunConfig)}


def config_key_ok(key: str) -> bool:
    """``train.max_steps``, ``model.options.fwp.rule``: a field of the run config's section (the mechanism's own
    options are the mechanism's to check; test_docs builds a model from every bash block's ``--set``)."""
    from fastweights import components
    from fastweights.core import config

    parts = key.split(".")
    section = {"model": config.ModelConfig, "data": config.DataConfig, "train": config.TrainConfig}.get(parts[0])
    if section is None or len(parts) < 2:
        return False
    if parts[1] not in {f.name for f in dataclasses.fields(section)}:
        return False
    if parts[:2] == ["model", "options"] and len(parts) > 2:
        name = parts[2]
        known = {entry.name for _, entry in components.registered()}
        return name in PLACEHOLDERS or name.startswith("<") or name in known
    return len(parts) == 2 or parts[1] == "options"


DOTTED = re.compile(r"(?<![\w./:=<-])([A-Za-z_]\w*(?:\.[A-Za-z_<>]\w*>?)+)(?![\w/<-])")


def dotted_problem(name: str) -> str | None:
    if FILE_SUFFIX.search(name):
        return None  # a file name
    parts = name.split(".")
    root = parts[0]
    if root == "fastweights":
        if resolves(name):
            return None
        moved = sorted(m for m in module_files() if m.split(".")[-1] in parts[1:] and not name.startswith(m + "."))
        return f"`{name}`: no such module or name under src/fastweights" + (f"; modules of that name: "
                                                                           f"{', '.join(moved[:3])}" if moved else "")
    if root in ("model", "data", "train") and config_key_ok(name):
        return None
    own = [m for m in module_files() if m.split(".")[-1] == root]
    if own:
        if any(resolves(m + name[len(root):]) for m in own):
            return None
        return f"`{name}`: {', '.join(sorted(own))} define no `{'.'.join(parts[1:])}`"
    if root in ("model", "data", "train"):
        return f"`{name}`: not a field of the run config ([{root}] has no `{parts[1]}`)"
    if root[0].isupper():  # a class: ours is checked, another library's is not
        nodes = classes().get(root)
        if nodes is None or any(class_has(n, parts[1]) for n in nodes):
            return None
        return f"`{name}`: class {root} has no attribute `{parts[1]}`"
    if root in NOT_OURS:
        return None
    import importlib.util

    if importlib.util.find_spec(root) is not None:
        return None  # torch.func.vmap, sys.path: another library's
    return f"`{name}`: `{root}` is no module of fastweights (nor a config section)"


def dotted_problems(spans) -> list[str]:
    problems = []
    for s in spans:
        if s.code:
            continue  # python blocks run in test_docs; shell lines name modules only after -m (checked as commands)
        for name in DOTTED.findall(s.text):
            why = dotted_problem(name.rstrip("."))
            if why:
                problems.append(f"{s.where()}: {why}")
    return problems


# ----------------------------------------------------------------------------- commands and flags


@functools.cache
def our_parser() -> argparse.ArgumentParser:
    from fastweights.cli import build_parser

    return build_parser()


@functools.cache
def lm_eval_parser() -> argparse.ArgumentParser | None:
    try:
        from lm_eval._cli.harness import HarnessCLI
    except ImportError:  # the [eval] extra is not installed: its command lines go unchecked
        return None
    return HarnessCLI()._parser


def subparsers_of(parser: argparse.ArgumentParser):
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def walk_parsers(parser: argparse.ArgumentParser):
    yield parser
    sub = subparsers_of(parser)
    for child in (sub.choices.values() if sub else ()):
        yield from walk_parsers(child)


@functools.cache
def any_flag() -> frozenset[str]:
    """Every flag of every command of ours, of lm-eval's parser and of every benchmark script."""
    flags = {f for p in walk_parsers(our_parser()) for f in p._option_string_actions}
    if lm_eval_parser() is not None:
        flags |= {f for p in walk_parsers(lm_eval_parser()) for f in p._option_string_actions}
    for script in [*(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "tools").glob("*.py")]:
        flags |= benchmark_flags(str(script.relative_to(ROOT)))
    return frozenset(flags)


def close(flag: str, flags) -> str:
    near = difflib.get_close_matches(flag, [f for f in flags if f.startswith("--")], n=3, cutoff=0.6)
    return f" (did you mean {', '.join(f'`{f}`' for f in near)}?)" if near else ""


ENDS = {";", "&&", "||", "|", ">", "2>", "<", "2>&1"}
PREFIXES = {"-m", "time", "/usr/bin/time", "nice", "exec"}  # what may stand before a command's name


def is_flag(word: str) -> bool:
    return bool(re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", word))


def flag_words(words: list[str]) -> list[str]:
    """The flags among ``words``, brackets of optional ones and `a|b` alternatives undone."""
    out = []
    for w in words:
        for alt in w.strip("[](),").split("|"):
            if is_flag(alt):
                out.append(alt.split("=", 1)[0])
    return out


def walk_command(prog: str, parser: argparse.ArgumentParser, words: list[str], legacy_run: bool = False) -> list[str]:
    """Problems of one command: its subcommands, then its flags (and --set keys)."""
    problems, path = [], [prog]
    i = 0
    sub = subparsers_of(parser)
    if legacy_run and sub and words and words[0] not in sub.choices and words[0].startswith("-"):
        words = ["run", *words]  # lm-eval inserts `run` when no subcommand is given
    while sub is not None and i < len(words) and not words[i].startswith("-"):
        alts = words[i].split("|")
        if any(a.isupper() or a in ("...", "…") or a.startswith("<") for a in alts):
            return problems  # COMMAND: a placeholder
        bad = [a for a in alts if a not in sub.choices]
        if bad:
            return [f"`{' '.join(path)} {bad[0]}` is no command (`{' '.join(path)}` has: {', '.join(sub.choices)})"]
        if len(alts) > 1:
            return problems  # `dynamic eval|tune|stats`: flags after it would belong to several commands
        parser, sub = sub.choices[alts[0]], subparsers_of(sub.choices[alts[0]])
        path.append(alts[0])
        i += 1
    accepted = parser._option_string_actions
    rest = words[i:]
    for j, flag in enumerate(flag_words(rest)):
        if flag not in accepted:
            problems.append(f"`{' '.join(path)}` has no option `{flag}`{close(flag, accepted)}")
    for a, b in zip(rest, rest[1:] + [""]):
        key = a.split("=", 1)[1] if a.startswith("--set=") else (b if a == "--set" else None)
        if key and prog == "fastweights":
            key = key.split("=", 1)[0]
            if "." in key and not re.search(r"[A-Z<]", key) and not config_key_ok(key):  # `key=` a placeholder
                problems.append(f"`{' '.join(path)} --set {key}=...`: {key} is no field of the run config")
    return problems


def command_problems(spans) -> list[str]:
    """Problems of every command line: ours, lm-eval's, the benchmark scripts', make's; and lone flags."""
    problems = []
    makefile = (ROOT / "Makefile").read_text()
    for s in spans:
        if s.lang == "python":
            continue
        words = words_of(s.text)
        claimed: set[int] = set()  # indices of words that belong to a recognised command
        starts = []
        for i, w in enumerate(words):
            prev = words[i - 1] if i else ""
            if w in ("fastweights", ".venv/bin/fastweights") and (i == 0 or prev in ENDS or prev in PREFIXES or
                                                                  re.fullmatch(r"[A-Z_]+=\S*", prev)):
                starts.append((i + 1, "fastweights", our_parser(), False))
            elif w == "fastweights.harness" and prev == "-m" or w in ("lm-eval", "lm_eval") and i == 0:
                if lm_eval_parser() is not None:
                    starts.append((i + 1, "lm-eval", lm_eval_parser(), True))
                else:
                    claimed.update(range(i, len(words)))
            elif w == "python" and i + 1 < len(words) and words[i + 1].startswith("benchmarks/"):
                end = next((k for k in range(i + 2, len(words)) if words[k] in ENDS), len(words))
                script = words[i + 1]
                for flag in flag_words(words[i + 2:end]):
                    if (ROOT / script).is_file() and flag not in benchmark_flags(script):
                        problems.append(f"{s.where()}: `{script}` has no option `{flag}`")
                claimed.update(range(i, end))
            elif w == "make" and (i == 0 or prev in ENDS) and i + 1 < len(words):
                end = next((k for k in range(i + 1, len(words)) if words[k] in ENDS), len(words))
                for target in words[i + 1:end]:
                    if target.startswith("-") or re.fullmatch(r"[A-Z_]+=\S*", target):  # a flag, a VAR=value
                        continue
                    if not re.search(rf"^{re.escape(target)}:", makefile, re.M):
                        problems.append(f"{s.where()}: `make {target}`: no such Makefile target")
                claimed.update(range(i, end))
            elif w in OTHER_PROGRAMS and (i == 0 or prev in ENDS):
                end = next((k for k in range(i + 1, len(words)) if words[k] in ENDS), len(words))
                if w == "torchrun" and "-m" in words[i:end]:
                    end = words.index("-m", i)  # its own flags; what follows -m is checked as that command
                claimed.update(range(i, end))
        for first, prog, parser, legacy in starts:
            end = next((k for k in range(first, len(words)) if words[k] in ENDS), len(words))
            problems.extend(f"{s.where()}: {p}" for p in walk_command(prog, parser, words[first:end], legacy))
            claimed.update(range(first - 1, end))
        lone = [w for i, w in enumerate(words) if i not in claimed]
        for flag in flag_words(lone):
            if flag.startswith("--") and flag not in any_flag():  # `-log P`, `-fwp-sum-dpfp`: prose
                problems.append(f"{s.where()}: `{flag}` is an option of no command (ours, lm-eval's or a "
                                f"benchmark script's){close(flag, any_flag())}")
    return problems


# ----------------------------------------------------------------------------- the floors


def floor_map() -> list[tuple[str, ...]]:
    """FLOORS of tests/contracts/test_floors.py, read as data (a test module is not imported by another)."""
    tree = ast.parse((ROOT / "tests" / "contracts" / "test_floors.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "FLOORS"
                                                                           for t in n.targets))
    return [tuple(names) for names in ast.literal_eval(node.value)]


def entry_name(name: str) -> str:
    return name.rstrip("/").removesuffix(".py")


def entry_text(name: str) -> str:
    """How a page writes a floor's package or root module: `core/`, `components.py`."""
    return f"{name}/" if (PACKAGE / name).is_dir() else f"{name}.py"


def architecture_floor_rows() -> list[tuple[int, tuple[str, ...]]]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("\n## Floors\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| ([^|]+) \|", section, re.M)
    return [(int(n), tuple(entry_name(x) for x in re.findall(r"`([^`]+)`", names))) for n, names in rows]


def readme_layout() -> list[tuple[int, str]]:
    """(indent, first word) of each line of README's Layout block."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"^## Layout\n.*?^```\n(.*?)^```", text, re.S | re.M).group(1)
    return [(len(line) - len(line.lstrip()), line.split()[0]) for line in block.splitlines() if line.strip()]


# ----------------------------------------------------------------------------- the tests


def _report(problems: list[str], what: str) -> None:
    if problems:
        pytest.fail(f"{len(problems)} {what} in README.md and docs/ that do not exist:\n" + "\n".join(problems),
                    pytrace=False)


def test_every_path_named_exists():
    _report(path_problems(all_spans()), "paths")


def test_every_module_and_name_named_exists():
    _report(dotted_problems(all_spans()), "modules, names or config keys")


def test_every_command_and_flag_named_exists():
    _report(command_problems(all_spans()), "commands or flags")


def test_the_architecture_page_floor_table_is_the_floor_map():
    want = [(i, names) for i, names in enumerate(floor_map())]
    got = architecture_floor_rows()
    rows = "\n".join(f"| {i} | {', '.join(f'`{entry_text(n)}`' for n in names)} | ... |" for i, names in want)
    assert got == want, ("docs/architecture.md's floor table differs from FLOORS in tests/contracts/test_floors.py; "
                         f"its rows should be:\n{rows}")


def test_readme_layout_lists_the_package_lowest_floor_first():
    lines = readme_layout()
    assert lines[0] == (0, "src/fastweights/"), lines[0]
    inside = [entry_name(w) for indent, w in lines[1:] if indent > 0]
    top = [w for indent, w in lines[1:] if indent == 0]
    package = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
               if (p.suffix == ".py" or p.is_dir()) and p.name not in ("__init__.py", "__pycache__")}
    assert set(inside) == package, (f"README's Layout lists {sorted(set(inside) - package)} that src/fastweights does "
                                    f"not have and leaves out {sorted(package - set(inside))}")
    floor = {n: i for i, names in enumerate(floor_map()) for n in names}
    on_floors = [n for n in inside if n in floor]
    assert on_floors == sorted(on_floors, key=floor.__getitem__), \
        f"README's Layout is not in floor order (tests/contracts/test_floors.py): {on_floors}"
    missing = [w for w in top if not (ROOT / w).exists()]
    assert not missing, f"README's Layout names {missing}, which the repository does not have"


# ----------------------------------------------------------------------------- the checks catch what they should


def _problems(text: str) -> list[str]:
    spans = spans_of(text, "docs/mutant.md")
    return path_problems(spans) + dotted_problems(spans) + command_problems(spans)


@pytest.mark.parametrize("text", [
    "refuses a run whose estimate exceeds the memory (`--force-memory` tries anyway)",  # the old flag's name
    "`fastweights train --preset tiny --force-memory`",
    "```bash\nfastweights train --preset tiny \\\n  --force-memory\n```",
    "`fastweights dynamic evaluate --checkpoint DIR`",
    "`fastweights dynamic eval|tuning`",
    "`fastweights train --set train.max_stepz=3`",
    "`cli.py` parses flags",
    "`src/fastweights/experiments/probe.py`",
    "see `tests/evidence/test_nothing.py`",
    "`validate.validate_config` refuses bad settings",
    "`fastweights.adapt.dynamic.DynamicEvaluatorr`",
    "`train.max_stepz`",
    "`python tools/report.py --chek`",
    "`python -m fastweights.harness --model fastweights --model_argz checkpoint=runs/demo`",
    "`make demos`",
])
def test_a_stale_reference_is_reported_with_its_line(text):
    problems = _problems("# A page\n\n" + text)
    line = 4 if text.startswith("```") else 3  # a code block's first line follows its fence
    assert problems and all(p.startswith(f"docs/mutant.md:{line}: ") for p in problems), problems


@pytest.mark.parametrize("text", [
    "`--force-ram` tries anyway; `fastweights train --preset tiny --force-ram --set train.max_steps=3`",
    "`fastweights dynamic eval|tune|stats`, `fastweights task niah --checkpoint DIR [--iters 1,2]`",
    "`fastweights train --out runs/new/thing` and `--out data/mine`",
    "`src/fastweights/layers/NAME.py`, `configs/NAME.toml`, `benchmarks/*/*.py`, `ops/fwl.py`, `memory_switches.py`",
    "`fastweights.models.lm.LanguageModel.trim_state`, `components.lookup`, `model.options.fwp`, `torch.compile`",
    "```bash\ntorchrun --standalone --nproc_per_node 2 -m fastweights train --preset tiny\npytest -n 0 -x tests\n```",
])
def test_a_current_reference_is_not_reported(text):
    assert _problems(text) == []
