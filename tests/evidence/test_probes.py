"""The probes themselves (tools/probes.py): they leave the caller's random state and default dtype
as they were, and each runs the code path it names (the model probe's second call carries the first call's
state), so a stored summary means what it says (issue 39: mutants the stored summaries alone would catch)."""

import sys

import pytest
import torch
from torch.testing import assert_close

from helpers import TOOLS

sys.path.insert(0, str(TOOLS))

import probes  # noqa: E402


def test_a_probe_leaves_the_callers_random_state_threads_and_dtype_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    threads = torch.get_num_threads()
    probes.run_probe(probes.probe("ops", op="delta_rule"))
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.get_num_threads() == threads and torch.get_default_dtype() == torch.float32


def test_a_probe_is_the_same_whatever_random_state_the_caller_left():
    spec = probes.probe("layer", role="mixer", name="attention")
    torch.manual_seed(1)
    a = probes.run_probe(spec)
    torch.manual_seed(2)
    torch.randn(10)
    assert probes.run_probe(spec) == a


@pytest.mark.parametrize("overrides", [[], ["model.mixer=\"fwp\""], ["model.head=\"fwl\""]])
def test_the_model_probe_carries_the_state_into_its_second_call(overrides):
    # its two calls with the state carried equal one call over the whole text: a probe whose second call
    # started fresh (state=None) would differ here, before any stored summary is consulted
    config = probes.preset_model_config("tiny", overrides)
    with probes._deterministic():
        out = probes.KINDS["model"](config=config)
    assert out["logits"].dtype == torch.float64
    assert_close(out["logits"], out["full_logits"], rtol=1e-10, atol=1e-10)
