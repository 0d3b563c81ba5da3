"""loops.schedule on its own: the budget in words, the optimizer's groups, the optimizer-state check, the cosine and
the step schedule's edges, and the Schedule's start (fresh, resumed, resumed from a state it did not write). The time
budget's decisions are tested through the trainer in tests/cli/test_time_budget.py; each test here names the
mutations it caught (issue 49: every mutant of the module run against that file)."""

from __future__ import annotations

import math
import types

import pytest
import torch
from torch import nn

from fastweights.core.config import TrainConfig
from fastweights.loops import schedule as sc


def cfg(**kw) -> TrainConfig:
    return TrainConfig(**{"lr": 3e-3, "min_lr_ratio": 0.1, **kw})


@pytest.mark.parametrize("seconds, words", [(0, "0:00"), (59.6, "1:00"), (61, "1:01"), (599, "9:59"), (3599, "59:59"),
                                            (3600, "1:00:00"), (3660, "1:01:00"), (3723, "1:02:03"), (36061, "10:01:01")])
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
    c = cfg(weight_decay=0.2, beta1=0.8, beta2=0.95, lr=2e-3)  # not AdamW's default lr
    opt = sc.make_optimizer(model, c)
    groups = {(g["weight_decay"], g["lr_scale"]): [tuple(p.shape) for p in g["params"]] for g in opt.param_groups}
    assert groups == {(0.2, 1.0): [(3, 2)], (0.0, 1.0): [(3,), (4, 2)], (0.2, 4.0): [(5, 2)]}
    assert all(g["lr"] == 2e-3 and g["betas"] == (0.8, 0.95) for g in opt.param_groups)
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


def test_the_optimizer_asks_for_the_fused_kernel_for_a_cuda_model():
    """A stand-in model whose first parameter says it is on CUDA (torch's fused AdamW also runs on the CPU, so the
    optimizer can be built here): fused=True is asked for."""

    class OnCuda(nn.Linear):
        def parameters(self, recurse=True):
            yield types.SimpleNamespace(is_cuda=True)

    opt = sc.make_optimizer(OnCuda(3, 2), cfg())
    assert opt.defaults["fused"] is True


def test_a_resumed_state_is_clamped_checked_and_completed():
    tc = cfg(warmup_steps=10)
    s = sc.Schedule(tc, math.inf, state={"warmup_end_step": 10, "warmup_progress": 1.5, "decay_progress": 2.0}, step=20)
    assert (s.warm, s.progress) == (1.0, 1.0)  # clamped to [0, 1]
    s = sc.Schedule(tc, math.inf, state={"warmup_end_step": 10, "decay_progress": "half"}, step=20)
    assert (s.warmup_end, s.warm, s.progress) == (10, 0.0, 0.0)  # not this class's: as if resumed without a state
    s = sc.Schedule(tc, math.inf, state={"warmup_end_step": None}, step=20)
    assert s.warmup_end is None  # the state says warmup has not ended: kept
    s = sc.Schedule(tc, math.inf, state={}, step=10)  # a checkpoint without the key, at the first decay step
    assert s.warmup_end == 10


def test_the_estimates_of_the_finishing_work():
    tc = cfg(batch_size=8)
    s = sc.Schedule(tc, 100.0, val_batches=3, n_params=0)
    assert s.validation_estimate() == 0.0  # no step timed yet: nothing to scale
    s.record_save(0.2)
    s.record_validation(2.0)
    assert s.save_estimate() == 0.2 and s.reserve() == pytest.approx(2.0 + 0.2 + sc.FINISH_S)
    assert s.training_time() == pytest.approx(100.0 - 3.2)
    assert sc.Schedule(tc, math.inf).training_time() == math.inf


def _timed(budget=20.0, **kw):
    """A schedule of 1-second steps with no validation and no periodic save (reserve: 0.5 s save + FINISH_S)."""
    tc = cfg(**{"lr": 1.0, "min_lr_ratio": 0.1, "warmup_steps": 100, "max_steps": 1000, "eval_every": 0,
                "save_every": 0, **kw})
    return tc, sc.Schedule(tc, budget)


def test_projected_steps_count_the_steps_that_fit_with_their_share_of_the_saves():
    tc, s = _timed(save_every=4)
    assert s.projected_steps(0, 0.0) is None  # nothing timed
    s.record_step(5.0)  # the process's first step: slow, counted only when asked for (first=True)
    assert s.projected_steps(1, 5.0, first=False) is None
    assert s.projected_steps(1, 5.0) == 1 + math.floor((20.0 - 1.5 - 5.0) / (5.0 + 0.5 / 4))
    s.record_step(1.0)
    s.record_save(2.0)  # reserve 2 + 1; a save every 4 steps: 0.5 s a step
    assert s.projected_steps(2, 6.0) == 2 + math.floor((20.0 - 3.0 - 6.0) / 1.5)
    assert s.projected_steps(2, 19.0) == 2  # past the training time: no more steps, not fewer
    tc, s = _timed()
    s.record_step(0.0)
    s.record_step(0.0)  # steps that take no time: the budget does not bind
    assert s.projected_steps(2, 1.0) is None


def test_when_time_binds_warmup_ends_early_and_the_decay_ends_at_the_last_step():
    """1-second steps in a 20-second budget (18.5 s of training): 18 steps are projected from the second timed
    step on. Warmup (100 steps by count) ends by time at step 4, whose rate is lr itself; the decay starts at the
    next step and falls at every step to lr * min_lr_ratio at the last one (step 17), its progress 1 exactly."""
    tc, s = _timed()
    rates = []
    for step in range(18):
        rates.append(s.lr(step, float(step)))
        s.record_step(1.0)
    assert rates[:2] == pytest.approx([0.01, 0.02]) and rates[4] == 1.0 and s.warmup_end == 5
    assert rates[5] == pytest.approx(sc.cosine(tc, 1 / 13))
    decay = rates[5:]
    assert all(a > b for a, b in zip(decay, decay[1:])) and decay[-1] == pytest.approx(0.1) and decay[-2] > 0.1001
    assert s.state() == {"warmup_end_step": 5, "warmup_progress": 1.0, "decay_progress": 1.0}


def test_untimed_the_schedule_is_lr_at_and_no_warmup_is_lr_at_once():
    tc = cfg(lr=1.0, min_lr_ratio=0.1, warmup_steps=2, max_steps=3)
    s = sc.Schedule(tc, math.inf)
    assert [s.lr(k, 0.0) for k in range(4)] == pytest.approx([sc.lr_at(k, tc) for k in range(4)])
    tc = cfg(lr=1.0, warmup_steps=0, max_steps=10)
    s = sc.Schedule(tc, math.inf)
    assert s.lr(0, 0.0) == 1.0 and s.warmup_end == 0
