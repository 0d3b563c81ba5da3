"""No pickle is read anywhere in the repository (issue 49, scope 3): a run folder, a parts file or a downloaded
model directory can hold a planted pickle, which runs code when it is loaded. Every file the code reads back is
safetensors or JSON; ``transformers_as_ours`` refuses pickled model weights instead of loading them."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# a call that unpickles: torch.load with weights_only=False, pickle/dill/joblib loads, numpy's load with
# allow_pickle=True (tests that plant a pickle write one: np.save(..., allow_pickle=True), pickle.dump)
UNPICKLING = re.compile(r"weights_only\s*=\s*False|\b(?:pickle|cPickle|dill|joblib)\.loads?\(|\bUnpickler\("
                        r"|np\.load\(.*allow_pickle\s*=\s*True")
ALLOWED: set[str] = set()  # "path:line" of an accepted use, with its reason beside it; none today


def python_files():
    for top in ("src", "benchmarks", "tools", "tests", ".ci"):
        yield from (p for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts)


def test_nothing_in_the_repository_unpickles():
    found = [f"{p.relative_to(ROOT)}:{i}" for p in python_files() if p.name != Path(__file__).name
             for i, line in enumerate(p.read_text().splitlines(), 1) if UNPICKLING.search(line)]
    assert [f for f in found if f not in ALLOWED] == []


def test_every_torch_load_asks_for_weights_only():
    calls = [f"{p.relative_to(ROOT)}:{i}" for p in python_files() if p.name != Path(__file__).name
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if "torch.load(" in line and "weights_only=True" not in line]
    assert calls == []
