"""What several test files share: the repository's paths, tiny-model builders, the registry's test cases and
a repetitive token stream. A plain module (``tests/`` is on ``sys.path``, see ``conftest.py``): tests import
from here, never from another test module."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository
PACKAGE = ROOT / "src" / "fastweights"
BENCHMARKS = ROOT / "benchmarks"
DATA = Path(__file__).resolve().parent / "data"  # files the tests read (memory_golden.pt)


import pytest  # noqa: E402
import torch  # noqa: E402

from fastweights import components as registry  # noqa: E402
from fastweights.core.config import ModelConfig  # noqa: E402
from fastweights.models.lm import LanguageModel  # noqa: E402

# ----------------------------------------------------------------------------- tiny language models


def component_fields(kind: str, name: str, memory_layer: int = 0) -> dict:
    """The ModelConfig fields that put registered component ``name`` of ``kind`` into a model."""
    return {"mixer": {"mixer": name}, "head": {"head": name},
            "memory": {"memory": name, "memory_layers": [memory_layer]}}[kind]


def tiny_lm(vocab_size: int, *, seed: int = 0, dtype: torch.dtype | None = None, training: bool = False,
            d_model: int = 16, n_layers: int = 2, n_heads: int = 2, **fields) -> LanguageModel:
    """A small LanguageModel (``fields``: any other ModelConfig field), built right after
    ``torch.manual_seed(seed)``, cast to ``dtype`` if given, in eval mode unless ``training``."""
    torch.manual_seed(seed)
    model = LanguageModel(ModelConfig(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                                      **fields))
    if dtype is not None:
        model = model.to(dtype)
    return model.train(training)


def motif_tokens(n: int, vocab_size: int, seed: int = 1) -> torch.Tensor:
    """A repetitive stream (a short random motif with 20% noise), so adaptation has something to learn."""
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(0, vocab_size, (7,), generator=g)
    seq = motif.repeat(n // 7 + 1)[:n].clone()
    noise = torch.rand(n, generator=g) < 0.2
    seq[noise] = torch.randint(0, vocab_size, (int(noise.sum()),), generator=g)
    return seq


# ----------------------------------------------------------------------------- registered components

D, HEADS, V, T, B = 12, 2, 9, 16, 2  # the registry-wide contracts' layer dimensions
# (kind, name) -> {variant id: options}, as the components declare them (``test_variants``)
VARIANTS = {(kind, e.name): registry.declared(e, "test_variants") for kind, e in registry.registered()}


def variant_cases(known: dict | None = None, key=lambda kind, name, vid: (kind, name)):
    """pytest params ``(kind, name, raw)`` for every registered component and variant, id ``kind-name-variant``;
    ``known`` maps ``key(kind, name, vid)`` to the reason of a strict xfail."""
    for (kind, name), variants in VARIANTS.items():
        for vid, raw in variants.items():
            why = (known or {}).get(key(kind, name, vid))
            marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
            yield pytest.param(kind, name, raw, id=f"{kind}-{name}-{vid}", marks=marks)


def build_component(kind: str, name: str, raw: dict):
    """Component ``name`` with options ``raw`` at the contracts' dimensions, seed 0, fp64, eval mode; a
    ``persistence="official"`` memory keeps its initial tables as ``initial_tables``."""
    entry = registry.lookup(registry.KINDS[kind], kind, name)
    options = registry.build_options(entry, raw)
    torch.manual_seed(0)
    layer = registry.build(kind, entry, options, d_model=D, n_heads=HEADS, vocab_size=V).double().eval()
    if getattr(options, "persistence", None) == "official":
        layer.initial_tables = {k: t.clone() for k, t in layer.state_dict().items()}
    return layer
