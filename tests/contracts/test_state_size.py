"""The state the memory estimate counts (``model_size.state_floats``) against the state models return, for
every registered component and every variant it declares (``test_variants``). A component declares its
``state_floats`` in its own file; one that declares none is measured by a dry run on the meta device, and
one whose state cannot be measured so is an error, never a silent 0."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch import nn

from fastweights import components as registry
from fastweights.core.config import ModelConfig, make_config
from fastweights.core.errors import UserError
from fastweights.models.size import estimate_ram, state_floats
from fastweights.models.lm import LanguageModel
from helpers import component_fields, registry_restored, variant_cases

V, ROWS, T = 11, 3, 24
CASES = list(variant_cases())


def tensor_floats(tree, skip: str = "") -> int:
    """Floating-point elements in a state, leaving out the fields named ``skip``."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() if tree.is_floating_point() else 0
    if isinstance(tree, dict):
        return sum(tensor_floats(v, skip) for k, v in tree.items() if k != skip)
    if isinstance(tree, (list, tuple)):
        return sum(tensor_floats(v, skip) for v in tree)
    if dataclasses.is_dataclass(tree):
        return sum(tensor_floats(getattr(tree, f.name), skip) for f in dataclasses.fields(tree) if f.name != skip)
    return 0


def training_state(cfg: ModelConfig, rows: int, seq_len: int):
    torch.manual_seed(0)
    model = LanguageModel(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fwl: windows shorter than 3 segments
        return model(torch.randint(0, V, (rows, seq_len))).state


@pytest.mark.parametrize("kind,name,raw", CASES)
def test_the_ram_estimate_counts_the_state_the_model_returns(kind, name, raw):
    """Per sequence ("carried") and per batch ("shared"), within 5% of a training call's state; what a write
    keeps only for the backward pass (a state's ``parts``: FwPKM's row deltas) within "backward"."""
    part = component_fields(kind, name, memory_layer=1)
    cfg = ModelConfig(vocab_size=V, d_model=12, n_layers=2, n_heads=2, options={name: raw}, **part)
    state = training_state(cfg, ROWS, T)
    real = tensor_floats(state, skip="parts")
    est = state_floats(cfg, T)
    assert abs(ROWS * est["carried"] + est["shared"] - real) <= 0.05 * real, (est, real)
    assert tensor_floats(state) - real <= ROWS * est["backward"] + est["backward_shared"], est


def test_a_short_convolution_is_counted_and_the_estimate_adds_up():
    cfg = make_config("tiny", ["model.vocab_size=11", "model.short_conv=4", 'model.mixer="fwp"'])
    est = state_floats(cfg.model, cfg.train.seq_len)
    real = tensor_floats(training_state(cfg.model, ROWS, cfg.train.seq_len))
    assert abs(ROWS * est["carried"] + est["shared"] - real) <= 0.05 * real, (est, real)
    assert est["backward"] > 0  # the chunked kernel keeps a state per chunk for the backward pass
    cfg.train.batch_size = ROWS
    mem = estimate_ram(cfg)
    assert mem["state_bytes"] == 4 * (ROWS * (est["carried"] + est["backward"]) + est["shared"]
                                      + est["backward_shared"])
    assert mem["total_bytes"] == mem["parameter_bytes"] + mem["activation_bytes"] + mem["state_bytes"]


class _HostSync(nn.Module):
    """A mixer with a state, no ``state_floats``, and a host sync the meta device cannot run."""

    def __init__(self, d_model, n_heads):
        super().__init__()

    def forward(self, x, state=None):
        return x, x[:, -1] * float(x.sum().item())


@pytest.fixture
def unmeasurable():
    with registry_restored():
        registry.register_mixer("test_unmeasurable")(_HostSync)
        yield "test_unmeasurable"


def test_a_state_that_cannot_be_measured_is_an_error_not_zero(unmeasurable):
    cfg = ModelConfig(vocab_size=V, d_model=8, n_layers=1, n_heads=2, mixer=unmeasurable)
    with pytest.raises(UserError, match="mixer 'test_unmeasurable' declares no state_floats and its state could "
                                        "not be measured on the meta device"):
        state_floats(cfg, T)
