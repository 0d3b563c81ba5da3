"""The component contract (``fastweights.components``, issue 20): a new mechanism is one new file.

A toy mixer written into a new module of ``fastweights.layers`` (here: a temporary directory added to
the package's path) is found by name with no other edit: configs build it, the memory estimate counts its
state (measured on the meta device: it declares nothing), the registry-wide causality, pieces, bounded
state and device checks run on it, and a Hugging Face export round-trips it. A module
that fails to import fails the scan, naming itself. The import graph keeps its floors.
"""

import ast
import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

import fastweights.layers
from fastweights import components
from fastweights.core.config import ModelConfig
from fastweights.models.lm import LanguageModel
from helpers import PACKAGE, ROOT, registry_restored

TESTS = ROOT / "tests"

TOY = '''
"""A toy mixer: the running mean of the inputs so far, projected (y_t = W mean_{s<=t} x_s)."""
from dataclasses import dataclass

import torch
from torch import nn

from fastweights.components import register_mixer


@dataclass
class ToyOptions:
    scale: float = 1.0


@register_mixer("toy_running_mean", ToyOptions)
class ToyRunningMean(nn.Module):
    def __init__(self, d_model, n_heads, options=None):
        super().__init__()
        self.scale = (options or ToyOptions()).scale
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x, state=None):  # x [B, T, C]; state: (mean so far [B, C], count)
        mean, count = (torch.zeros_like(x[:, 0]), 0) if state is None else state
        sums = count * mean.unsqueeze(1) + x.cumsum(1)  # [B, T, C]
        n = count + torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype).view(1, -1, 1)
        means = sums / n
        return self.scale * self.proj(means), (means[:, -1], count + x.shape[1])
'''


@pytest.fixture
def layers_dir(tmp_path):
    """A directory on ``fastweights.layers.__path__``: a module written there is a module of the package."""
    paths = fastweights.layers.__path__
    paths.append(str(tmp_path))
    modules = set(sys.modules)
    with registry_restored():  # the built-ins loaded first, the toy components gone after
        yield tmp_path
    paths.remove(str(tmp_path))
    for name in set(sys.modules) - modules:
        if name.startswith("fastweights.layers."):
            del sys.modules[name]
    importlib.invalidate_caches()
    components.load_providers(rescan=True)  # a scan interrupted by a broken module is completed


def test_a_new_module_is_a_new_mixer_with_no_other_edit(layers_dir, tmp_path_factory):
    (layers_dir / "toy_running_mean.py").write_text(TOY)
    importlib.invalidate_caches()
    components.load_providers(rescan=True)
    assert "toy_running_mean" in components.MIXERS
    # by name in a config, beside a built-in mixer, with its options table validated
    cfg = ModelConfig(vocab_size=11, d_model=8, n_layers=2, n_heads=2, layer_mixers=["toy_running_mean", "attention"],
                      options={"toy_running_mean": {"scale": 0.5}})
    torch.manual_seed(0)
    model = LanguageModel(cfg).eval()
    x = torch.randint(0, 11, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(x)
        first = model(x[:, :4])
        second = model(x[:, 4:], first.state)
    torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), full.logits, rtol=1e-5, atol=1e-6)
    # its state counted by the memory estimate, not 0 (measured on the meta device: it declares no state_floats)
    from fastweights.models.size import state_floats

    assert state_floats(ModelConfig(vocab_size=11, d_model=8, n_layers=1, n_heads=2, mixer="toy_running_mean"),
                        9)["carried"] == 8  # the mean [C] per sequence (the count is not a float)
    # the registry-wide checks, run on it as on every component: the estimate against the state it returns,
    # causality, pieces == one call, a bounded state along a stream, the meta device, bf16 autocast and the
    # Hugging Face export; their files, run by pytest in a fresh process whose fastweights.layers holds the
    # toy module, enumerate it from the registry with no edit, as they enumerate every built-in component
    checks = ["contracts/test_state_size.py::test_the_ram_estimate_counts_the_state_the_model_returns",
              "contracts/test_stream_stability.py::test_bounded_designs_keep_their_state_at_twenty_times_the_training_length",
              "contracts/test_registry_causality.py::test_causal_and_responsive_at_every_cut",
              "contracts/test_registry_causality.py::test_pieces_equal_one_call_and_the_state_continues",
              "contracts/test_device_contract.py::test_forward_backward_on_the_meta_device",
              "contracts/test_device_contract.py::test_bf16_autocast_trains_with_fp32_fast_weights"]
    if importlib.util.find_spec("transformers") is not None:  # a Hugging Face export round-trips it (the [hf] extra)
        checks.append("hf/test_hf_model.py::test_save_load_identical_logits_and_cache")
    files = sorted({str(TESTS / c.split("::")[0]) for c in checks})
    code = ("import sys, pytest, fastweights.layers\n"
            "fastweights.layers.__path__.append(sys.argv[1])\n"
            "sys.exit(pytest.main(['-p', 'no:cacheprovider', '-rA', '-k', 'toy_running_mean', *sys.argv[2:]]))")
    proc = subprocess.run([sys.executable, "-c", code, str(layers_dir), *files], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "COLUMNS": "1000"})  # whole node ids
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    passed = re.findall(r"^PASSED tests/(\S+?)\[(\S+)\]", proc.stdout, re.M)
    for check in checks:
        assert any(test == check and "toy_running_mean" in case for test, case in passed), (check, proc.stdout[-3000:])


def test_a_broken_layer_module_fails_the_scan_naming_itself(layers_dir):
    (layers_dir / "broken_mixer.py").write_text("import a_module_that_does_not_exist\n")
    importlib.invalidate_caches()
    with pytest.raises(ModuleNotFoundError, match="a_module_that_does_not_exist"):
        components.load_providers(rescan=True)


def test_registry_components_satisfy_their_protocols():
    components.load_providers()
    torch.manual_seed(0)
    lm = LanguageModel(ModelConfig(vocab_size=11, d_model=8, n_layers=1, n_heads=2, memory="fwmlp", memory_layers=[0],
                                   options={"fwmlp": {"d_key": 4, "d_value": 4, "hidden": 8, "chunk_size": 4}}))
    assert isinstance(lm, components.TrimsState)
    memory = lm.blocks[0].memory
    assert isinstance(memory, components.Memory) and isinstance(memory, components.FastMemory)
    assert not isinstance(memory, components.SlotMemory)  # no slots: memory-stats must not pick it
    assert isinstance(lm.blocks[0].mixer, components.TrimsState)  # attention bounds its KV cache


@pytest.mark.parametrize("kind,name", [(k, e.name) for k, e in components.registered()])
def test_what_a_component_declares_is_well_formed(kind, name):
    """Every declared option set builds (unknown keys fail here, naming the component), the dtype exceptions are
    field names, and a declared state size uses the estimate's keys (``components`` "what a component declares")."""
    entry = components.lookup(components.KINDS[kind], kind, name)
    assert components.declared(entry, "test_variants"), f"{name}: no test variants"
    sets = [components.declared(entry, "tiny_options")]
    for fact in ("test_variants", "bounded_variants", "growing_variants"):
        sets += list(components.declared(entry, fact).values())
    for raw in sets:
        components.build_options(entry, raw)
    assert all(isinstance(f, str) for f in components.declared(entry, "compute_dtype_state"))
    got = components.state_floats(kind, name, components.declared(entry, "tiny_options"), d_model=16, n_heads=2,
                                  vocab_size=11, seq_len=32)
    assert all(v >= 0 for v in got.values()), got  # a key it does not know raises


# ----------------------------------------------------------------------------- floors of the import graph

SRC = PACKAGE
LOW = ("fastweights.ops", "fastweights.layers", "fastweights.components", "fastweights.models.memory_switches",
       "fastweights.core.files", "fastweights.checkpoints.format")
HIGH = ("fastweights.models", "fastweights.adapt", "fastweights.loops.train", "fastweights.loops.evaluate", "fastweights.loops.generate",
        "fastweights.cli", "fastweights.models.loading", "fastweights.tasks", "fastweights.experiments")
# What is left of the debt issue 20 names; each entry must still be true (so the list can only shrink).
KNOWN_UPWARD: dict = {}  # (import, imported) -> why it is still there
KNOWN_CYCLES: dict = {}  # frozenset of modules -> why the cycle is still there


def import_graph() -> dict[str, set[str]]:
    mods = {}
    for p in SRC.rglob("*.py"):
        parts = p.relative_to(SRC.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    edges = {m: set() for m in mods}
    for m, p in mods.items():
        package = m if p.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != m and mods[t].name != "__init__.py":
                    edges[m].add(t)
    return edges


def test_low_floors_import_nothing_from_above():
    edges = import_graph()
    upward = {(m, t) for m, ts in edges.items() if m.startswith(LOW) for t in ts if t.startswith(HIGH)}
    assert upward <= set(KNOWN_UPWARD), f"imports from a higher floor: {sorted(upward - set(KNOWN_UPWARD))}"
    assert set(KNOWN_UPWARD) <= upward, f"fixed, remove from KNOWN_UPWARD: {sorted(set(KNOWN_UPWARD) - upward)}"


def test_no_import_cycles():
    edges = import_graph()
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(frozenset(comp))

    for v in edges:
        if v not in index:
            visit(v)
    assert set(cycles) <= set(KNOWN_CYCLES), f"import cycles: {[sorted(c) for c in cycles if c not in KNOWN_CYCLES]}"
    assert set(KNOWN_CYCLES) <= set(cycles), "a known cycle is gone: remove it from KNOWN_CYCLES"



def test_the_mechanisms_a_model_uses_are_its_mixers_head_and_memory():
    """What a checkpoint's mechanism check looks up: every mixer, a head other than the plain linear one, and a
    memory placed in at least one layer (seed-16 mutation draw: the memory's name left out)."""
    import types

    from fastweights.checkpoints.config_checks import used_mechanisms

    model = types.SimpleNamespace(layer_mixers=None, mixer="attention", head="linear", memory="fwpkm",
                                  memory_layers=[1])
    assert used_mechanisms(model) == {"attention", "fwpkm"}
    model.layer_mixers, model.head, model.memory_layers = ["attention", "fwp"], "fwl", []
    assert used_mechanisms(model) == {"attention", "fwp", "fwl"}  # a memory in no layer is not used
