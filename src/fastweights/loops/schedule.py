"""The optimizer of a training run (AdamW with decay groups), its learning-rate schedule, and the time budget
that may end it (``train.max_minutes``).

Without a time budget the schedule is a function of the step: linear warmup over ``warmup_steps`` to
``lr``, then a cosine decay to ``lr * min_lr_ratio`` at ``max_steps`` (:func:`lr_at`).

With one, whichever limit binds ends the run at a clean point of the schedule:

- the budget covers the training steps **and** what follows them: the final validation, the final save,
  the summary and the loss curve. A step is started only when it and that finishing work are expected
  to fit (their times measured as the run goes: the median of the last step times, the periodic
  validations and saves; estimated from the step time until one has happened);
- warmup ends after ``warmup_steps`` steps or after :data:`WARMUP_SHARE` of the training time, whichever
  comes first (a run whose budget fits only a few dozen steps still warms up and then decays);
- the decay then follows whichever is further along, the steps towards ``max_steps`` or the time towards
  the end of the training time, both counted from the end of warmup, so the learning rate is continuous
  (nothing jumps when the time starts to bind) and reaches ``lr * min_lr_ratio`` when the budget ends;
- the decay never goes back (a later, larger estimate of the finishing work shortens the training time,
  and the learning rate keeps the lowest value reached).

:meth:`Schedule.projected_steps` says how many steps the run will take when the budget binds, so that the
progress line shows that total (``~``) and an ETA from it.
"""

from __future__ import annotations

import math
from collections import deque
from statistics import median

import torch

WARMUP_SHARE = 0.25  # under a time budget warmup takes at most this share of the training time
FORWARD_SHARE = 0.5  # a validation batch's cost against a training micro-step (forward + backward), until measured
FINISH_S = 1.0  # summary.json and loss_curve.png after the final save
SAVE_BYTES_PER_PARAM = 16  # weights and AdamW's two moments (fp32), with room
SAVE_BYTES_PER_S = 100e6  # a save's estimated speed until one has been timed


def minutes(seconds: float) -> str:
    """``5:00``, ``1:02:03``: a budget in words."""
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def make_optimizer(model: torch.nn.Module, cfg) -> torch.optim.AdamW:
    """Weight decay on matrices (dim >= 2) only; norms, biases and scalar step sizes are not decayed.

    Parameters may carry ``lr_scale`` (e.g. a PKM value table trained with its own learning rate).
    """
    groups: dict[tuple, list] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decay = cfg.weight_decay if p.dim() >= 2 and not getattr(p, "no_weight_decay", False) else 0.0
        scale = getattr(p, "lr_scale", 1.0)
        groups.setdefault((decay, scale), []).append(p)
    param_groups = [{"params": ps, "weight_decay": d, "lr_scale": s} for (d, s), ps in groups.items()]
    fused = next(model.parameters()).is_cuda
    return torch.optim.AdamW(param_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=fused or None)


def check_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Raise ValueError unless every tensor of the optimizer's per-parameter state (AdamW's moments) has its
    parameter's shape and finite values (the scalar ``step`` aside): a trainer state edited or made for another
    model would otherwise fail inside the first ``optimizer.step()`` with a shape error, or poison the weights."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, v in optimizer.state.get(p, {}).items():
                if not isinstance(v, torch.Tensor) or v.dim() == 0:
                    continue
                if tuple(v.shape) != tuple(p.shape):
                    raise ValueError(f"optimizer {key} has shape {list(v.shape)}, its parameter {list(p.shape)}")
                if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                    raise ValueError(f"optimizer {key} holds NaN or inf values")


def cosine(cfg, progress: float) -> float:
    """The decay part of the schedule at ``progress`` in [0, 1]: ``lr`` at 0, ``lr * min_lr_ratio`` at 1."""
    progress = min(1.0, max(0.0, progress))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def lr_at(step: int, cfg) -> float:
    """The schedule without a time budget: linear warmup to cfg.lr, then cosine decay to cfg.lr * min_lr_ratio
    at cfg.max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cosine(cfg, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))


class Schedule:
    """Learning rate per step and the time budget's stop, for one run (``tc``: its TrainConfig).

    ``budget_s``: the time budget in seconds of the run's clock (``math.inf``: none). ``val_batches``: the
    batches of one validation; ``micro_rows``: rows of a training micro-step on this process (a validation
    batch has ``tc.batch_size``); ``n_params``: for the first estimate of a save. ``state``: what
    :meth:`state` returned when the run was saved (``--resume``), or None; ``step``: the step it resumes at.

    Elapsed times given to its methods are the run's (``elapsed`` in the checkpoint included). Every
    process of a distributed run keeps one; rank 0's decisions are the ones used.
    """

    def __init__(self, tc, budget_s: float, val_batches: int = 0, micro_rows: int = 1, n_params: int = 0,
                 state: dict | None = None, step: int = 0):
        self.tc, self.budget = tc, budget_s
        self.val_batches, self.micro_rows = val_batches, max(1, micro_rows)
        self.save_guess = 0.5 + SAVE_BYTES_PER_PARAM * n_params / SAVE_BYTES_PER_S
        state = state if isinstance(state, dict) else {}
        end, warm, done = (state.get("warmup_end_step"), state.get("warmup_progress", 0.0),
                           state.get("decay_progress", 0.0))
        if not (end is None or type(end) is int) or not all(type(v) in (int, float) and math.isfinite(v)
                                                            for v in (warm, done)):
            state, end, warm, done = {}, None, 0.0, 0.0  # not written by this class: as if resumed without it
        self.warmup_end = end  # the first step of the decay (None: still warming up)
        self.warm = min(1.0, max(0.0, float(warm)))  # how far warmup has come (of lr)
        self.progress = min(1.0, max(0.0, float(done)))  # how far the decay has come
        if "warmup_end_step" not in state and step >= tc.warmup_steps:  # resumed from a checkpoint without it
            self.warmup_end = tc.warmup_steps
        self.first_step: float | None = None  # the process's first step (allocation, compilation: not the pace)
        self.step_times: deque[float] = deque(maxlen=9)  # the steps after it, the last nine
        self.val_s: float | None = None  # measured at a periodic validation
        self.save_s: float | None = None  # measured at a periodic save

    @property
    def timed(self) -> bool:
        return math.isfinite(self.budget)

    # ------------------------------------------------------------------ measurements

    def record_step(self, seconds: float) -> None:
        if self.first_step is None:
            self.first_step = max(0.0, seconds)
        else:
            self.step_times.append(max(0.0, seconds))

    def record_validation(self, seconds: float) -> None:
        self.val_s = max(0.0, seconds)

    def record_save(self, seconds: float) -> None:
        self.save_s = max(0.0, seconds)

    def step_estimate(self, first: bool = True) -> float | None:
        """Seconds of the next step: the median of the last few after the process's first one; that first
        one alone while it is all there is (``first=False``: None then), None before it."""
        if self.step_times:
            return median(self.step_times)
        return self.first_step if first else None

    def validation_estimate(self) -> float:
        """Seconds of one validation: measured at the last periodic one, else from the step time."""
        if self.val_s is not None:
            return self.val_s
        step = self.step_estimate() or 0.0
        return self.val_batches * step / max(1, self.tc.grad_accum) * self.tc.batch_size / self.micro_rows * FORWARD_SHARE

    def save_estimate(self) -> float:
        return self.save_s if self.save_s is not None else self.save_guess

    def reserve(self) -> float:
        """Seconds the final validation, save, summary and plot are expected to take."""
        return self.validation_estimate() + self.save_estimate() + FINISH_S

    def training_time(self) -> float:
        """Seconds of the budget left to training steps (the budget less :meth:`reserve`); inf without one."""
        return self.budget - self.reserve() if self.timed else math.inf

    # ------------------------------------------------------------------ decisions

    def out_of_time(self, elapsed: float) -> bool:
        """Whether the budget ends the run before a step that would start at ``elapsed``: the budget is spent,
        or the step and the finishing work after it would not fit. Until a step after the process's first
        has been timed (its first may be slow), only a spent budget stops it."""
        if not self.timed:
            return False
        if elapsed >= self.budget:
            return True
        step = self.step_estimate(first=False)
        return step is not None and elapsed + step > self.training_time()

    def projected_steps(self, step: int, elapsed: float, first: bool = True) -> int | None:
        """The step count the run will end at when the time budget binds: ``step`` (the steps done) and the
        steps of the current pace, with their share of the periodic validations and saves, that fit in the
        training time left after ``elapsed``. None when ``max_steps`` ends the run first, and before a step
        is timed (``first=False``: before a step after the process's first)."""
        est = self.step_estimate(first)
        if not self.timed or est is None:
            return None
        tc = self.tc
        per_step = est
        if tc.eval_every:
            per_step += (self.validation_estimate() + self.save_estimate()) / tc.eval_every
        elif tc.save_every:
            per_step += self.save_estimate() / tc.save_every
        left = self.training_time() - elapsed
        total = step + (max(0, math.floor(left / per_step)) if per_step > 0 else tc.max_steps)
        return total if total < tc.max_steps else None

    def lr(self, step: int, elapsed: float) -> float:
        """The learning rate of step ``step`` (0-based) starting at ``elapsed``; call it once per step, in order
        (it records how far warmup and the decay have come).

        Where the budget binds, the rest of the schedule is laid over the steps it is projected to allow (N,
        re-estimated at every step): each step moves warmup by at least what is left of it over the steps
        left until ``WARMUP_SHARE * N``, and the decay by at least what is left of it over the steps left
        until N, so the rate is continuous whatever the estimate does, never turns back, and the last step
        is at the end of the decay. The time of periodic validations does not move the rate."""
        tc = self.tc
        total = self.projected_steps(step, elapsed, first=False)
        if self.warmup_end is None:
            by_steps = (step + 1) / tc.warmup_steps if tc.warmup_steps > 0 else 1.0
            warm = by_steps
            if total:
                warm = max(warm, self.warm + (1 - self.warm) / max(1.0, WARMUP_SHARE * total - step))
            if warm >= 1.0:  # the last warmup step: lr itself; the decay starts at the next one (lr_at's)
                self.warmup_end, self.warm = (tc.warmup_steps if by_steps >= 1.0 else step + 1), 1.0
                return tc.lr
            self.warm = warm
            return tc.lr * (step + 1) / tc.warmup_steps if warm == by_steps else tc.lr * warm
        progress = max(self.progress, (step - self.warmup_end) / max(1, tc.max_steps - self.warmup_end))
        if total:
            progress = max(progress, self.progress + (1 - self.progress) / max(1, total - step))
        self.progress = min(1.0, progress)
        return cosine(tc, self.progress)

    def state(self) -> dict:
        """What a checkpoint keeps so that ``--resume`` continues the same schedule."""
        return {"warmup_end_step": self.warmup_end, "warmup_progress": self.warm, "decay_progress": self.progress}
