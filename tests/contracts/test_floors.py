"""The floor map of the package: every module imports only its own floor and the floors below.

Lowest first. A new package must be placed here (an unplaced one fails), which is the point: where a
module may reach is decided once, not discovered by an import cycle later.
"""

import ast
from pathlib import Path
from helpers import PACKAGE

FLOORS = [
    ("core",),  # errors, files, progress, config, devices
    ("ops",),  # the operators: linear attention, delta rule, FWL, PKM, NLL, the fast-RNN kernel
    ("components",),  # the component contract and registry
    ("layers", "testing"),  # the mechanisms: one file each; what the tests and the benchmarks both run
    ("data",),  # corpora, tokenizers, token streams
    ("checkpoints",),  # the on-disk format, run directories, config checks
    ("models",),  # the language model, its size, loading a checkpoint
    ("loops", "hf", "tasks"),  # train / evaluate / generate, the Hugging Face bridges, the synthetic tasks
    ("auto",),  # a model loaded by what its source is: our checkpoint, an FWL head, a transformers model, a GGUF
    ("adapt",),  # dynamic evaluation and continual adaptation
    ("experiments", "harness"),  # streaming, NIAH runs, analyses, the demo; the lm-evaluation-harness models
    ("evidence",),  # provenance and result writing (the behaviour probes are tools/probes.py)
    ("cli",),  # the command line: nothing below imports it
    ("__main__",),
]
ROOT_MODULES = {"__init__", "__main__", "components"}


def floor_of(parts: tuple[str, ...]) -> int:
    top = parts[0] if parts else "core"  # the package's __init__ holds only the version and UserError
    for i, names in enumerate(FLOORS):
        if top in names:
            return i
    raise AssertionError(f"fastweights.{'.'.join(parts)} is on no floor: add its package to FLOORS")


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).with_suffix("").parts
        yield (rel[:-1] if rel[-1] == "__init__" else rel), path


def imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("fastweights"):
            target = tuple(node.module.split(".")[1:])
            if target:
                yield target
            else:  # from fastweights import X
                yield from ((a.name,) for a in node.names if a.name != "__version__")
        elif isinstance(node, ast.Import):
            yield from (tuple(a.name.split(".")[1:]) for a in node.names if a.name.startswith("fastweights."))


def test_every_module_imports_only_its_floor_and_below():
    problems = []
    for parts, path in modules():
        own = floor_of(parts)
        for target in imports(path):
            if floor_of(target) > own:
                problems.append(f"{'.'.join(parts) or '__init__'} (floor {own}) imports {'.'.join(target)} "
                                f"(floor {floor_of(target)})")
    assert not problems, "\n".join(problems)


def test_the_package_root_holds_at_most_six_modules():
    root = {p.stem for p in PACKAGE.glob("*.py")}
    assert root == ROOT_MODULES, f"root modules {sorted(root)}: put new ones in the package of their floor"


def test_an_import_from_a_higher_floor_is_caught(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("from fastweights.cli import main\nfrom fastweights import components\n")
    targets = list(imports(bad))
    assert targets == [("cli",), ("components",)]
    assert floor_of(("cli",)) > floor_of(("ops",))  # an ops module importing cli would be reported


def test_the_benchmarks_stay_a_thin_layer_over_the_library():
    """Issue 48: ``benchmarks/`` holds at most a quarter of the Python lines of ``src/`` and ``benchmarks/``
    together; what scripts share lives in the library, beside the code it measures."""
    root = Path(__file__).resolve().parents[2]

    def lines(folder: str) -> int:
        return sum(len(p.read_text().splitlines()) for p in (root / folder).rglob("*.py"))

    bench, src = lines("benchmarks"), lines("src")
    assert bench <= 0.25 * (bench + src), f"benchmarks/ is {bench / (bench + src):.1%} of the Python lines"
