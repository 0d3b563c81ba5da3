"""loops.schedule on its own: the budget in words, the optimizer's groups, the optimizer-state check, the cosine and
the step schedule's edges, and the Schedule's start (fresh, resumed, resumed from a state it did not write). The time
budget's decisions are tested through the trainer in tests/cli/test_time_budget.py; each test here names the
mutations it caught (issue 49: every mutant of the module run against that file)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fastweights.core.config import TrainConfig
from fastweights.loops import schedule as sc


def cfg(**kw) -> TrainConfig:
    return TrainConfig(**{"lr": 3e-3, "min_lr_ratio": 0.1, **kw})


@pytest.mark.parametrize("seconds, words", [(0, "0:00"), (59.6, "1:00"), (61, "1:01"), (599, "9:59"), (3599, "59:59"),
                                            (3600, "1:00:00"), (3723, "1:02:03"), (36061, "10:01:01")])
def test_minutes_writes_a_budget_as_m_ss_or_h_mm_ss(seconds, words):
    assert sc.minutes(seconds) == words


def test_the_optimizer_decays_matrices_only_and_groups_by_lr_scale():
    """Frozen parameters (the first one here) are left out, not the end of the walk; matrices are decayed unless
    marked ``no_weight_decay``; a parameter's ``lr_scale`` makes its own group; lr and betas are the config's; on
    the CPU the fused kernel is not asked for."""
    model = nn.Module()
    model.frozen = nn.Parameter(torch.zeros(2, 2), requires_grad=False)
    model.w = nn.Parameter(torch.zeros(3, 2))
    model.b = nn.Parameter(torch.zeros(3))
    model.table = nn.Parameter(torch.zeros(4, 2))
    model.table.no_weight_decay = True
    model.values = nn.Parameter(torch.zeros(5, 2))
    model.values.lr_scale = 4.0
    c = cfg(weight_decay=0.2, beta1=0.8, beta2=0.95, lr=1e-3)
    opt = sc.make_optimizer(model, c)
    groups = {(g["weight_decay"], g["lr_scale"]): [tuple(p.shape) for p in g["params"]] for g in opt.param_groups}
    assert groups == {(0.2, 1.0): [(3, 2)], (0.0, 1.0): [(3,), (4, 2)], (0.2, 4.0): [(5, 2)]}
    assert all(g["lr"] == 1e-3 and g["betas"] == (0.8, 0.95) for g in opt.param_groups)
    assert opt.defaults["fused"] is None


def _stepped():
    """An AdamW after one step: its state per parameter is step (a 0-d tensor, first), exp_avg, exp_avg_sq."""
    model = nn.Linear(3, 2)
    model.unused = nn.Parameter(torch.zeros(4))  # no gradient: no state
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    return model, opt


def test_the_optimizer_state_check_reads_every_moment_of_every_parameter():
    model, opt = _stepped()
    sc.check_optimizer_state(opt)  # a parameter without state and the 0-d step pass
    opt.state[model.bias]["note"] = 1.5  # a non-tensor entry (another optimizer's bookkeeping) passes
    sc.check_optimizer_state(opt)
    opt.state[model.bias]["exp_avg"] = torch.zeros(3)  # after the 0-d step: the walk goes on past it
    with pytest.raises(ValueError) as e:
        sc.check_optimizer_state(opt)
    assert str(e.value) == "optimizer exp_avg has shape [3], its parameter [2]"
    opt.state[model.bias]["exp_avg"] = torch.zeros(2)
    opt.state[model.weight]["exp_avg_sq"][0, 0] = float("nan")
    with pytest.raises(ValueError) as e:
        sc.check_optimizer_state(opt)
    assert str(e.value) == "optimizer exp_avg_sq holds NaN or inf values"


def test_the_cosine_is_clamped_to_its_ends():
    c = cfg(lr=1.0, min_lr_ratio=0.1)
    assert sc.cosine(c, 0.0) == 1.0 and sc.cosine(c, 1.0) == pytest.approx(0.1)
    assert sc.cosine(c, 1.5) == pytest.approx(0.1) and sc.cosine(c, -0.5) == 1.0
    assert sc.cosine(c, 0.5) == pytest.approx(0.55)


def test_the_step_schedule_decays_over_a_single_step():
    """max_steps one past warmup: the decay starts at lr at the last warmup's next step and ends there one step
    later (the denominator is at least 1, not 2)."""
    c = cfg(lr=1.0, min_lr_ratio=0.1, warmup_steps=2, max_steps=3)
    assert [sc.lr_at(s, c) for s in range(4)] == pytest.approx([0.5, 1.0, 1.0, 0.1])


def test_a_fresh_schedule_is_warming_up_and_estimates_its_first_save():
    tc = cfg(warmup_steps=1, batch_size=8, grad_accum=1)
    s = sc.Schedule(tc, math.inf)
    assert s.warmup_end is None and s.warm == 0.0 and s.progress == 0.0  # step 0 by default, even with 1 warmup step
    assert s.save_estimate() == 0.5  # no parameters: the fixed cost
    big = sc.Schedule(tc, 60.0, n_params=10_000_000)
    assert big.save_estimate() == pytest.approx(0.5 + sc.SAVE_BYTES_PER_PARAM * 1e7 / sc.SAVE_BYTES_PER_S)
    # a validation batch against a micro-step of 2 rows (of 8): four micro-steps' rows, at FORWARD_SHARE each
    v = sc.Schedule(tc, 60.0, val_batches=3, micro_rows=2)
    v.record_step(1.0)
    assert v.validation_estimate() == pytest.approx(3 * 1.0 * 8 / 2 * sc.FORWARD_SHARE)
    one = sc.Schedule(tc, 60.0, val_batches=3, micro_rows=0)  # rows at least 1
    one.record_step(1.0)
    assert one.validation_estimate() == pytest.approx(3 * 8 * sc.FORWARD_SHARE)


def test_a_resumed_state_missing_its_progress_keeps_its_warmup_end():
    """A state with the warmup's end but no progress (an older checkpoint's): the progress starts at 0, the end is
    kept (a default that failed the type check would drop the whole state)."""
    tc = cfg(warmup_steps=10)
    s = sc.Schedule(tc, math.inf, state={"warmup_end_step": 10}, step=12)
    assert s.warmup_end == 10 and s.warm == 0.0 and s.progress == 0.0
    s = sc.Schedule(tc, math.inf, state={"warmup_end_step": None, "decay_progress": 0.3}, step=5)
    assert s.warmup_end is None and s.warm == 0.0 and s.progress == 0.3
