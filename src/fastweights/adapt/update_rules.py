"""Update rules of dynamic evaluation, their defaults and learning-rate schedules.

Krause, Kahembwe, Murray, Renals, "Dynamic Evaluation of Neural Sequence Models", ICML 2018
(arXiv 1709.07432). The evaluation loop that applies them is :mod:`fastweights.adapt.dynamic`; the
gradient statistics MS_g of the RMS rules are :mod:`fastweights.adapt.grad_stats` (paper eq. 5), what
is adapted :mod:`fastweights.adapt.parameter_selection`.

Update rules (paper eqs 4-8), in the paper's units:

    sgd               theta^i = theta^{i-1} - eta g_i
    sgd-global-prior  theta^i = theta^{i-1} - eta g_i + lambda (theta_g - theta^{i-1})                     (4)
    rms               theta^i = theta^{i-1} - eta g_i / (sqrt(MS_g) + eps)                                 (6, lambda = 0)
    rms-prior         theta^i = theta^{i-1} - eta g_i / (sqrt(MS_g) + eps) + lambda (theta_g - theta^{i-1}) (6)
    rms-global-prior  theta^i = theta^{i-1} - eta g_i / (sqrt(MS_g) + eps)
                                + lambda (theta_g - theta^{i-1}) * RMS_norm                                (8, default)

    RMS_norm = sqrt(MS_g) / avg(sqrt(MS_g)),   clipped elementwise to <= 1 / lambda                 (7)

MS_g is the mean squared gradient on TRAINING batches (eq. 5, :mod:`fastweights.adapt.grad_stats`).
``avg`` is the mean over the adapted parameter tensors of each tensor's mean (the convention of
``dynamiceval.py``, not a mean over all elements); the clip is recomputed for every setting (the
official grid search clipped in place). The spec names ``sgd_prior``, ``rms_prior`` and
``rms_rmsprior`` are accepted as aliases.

Learning-rate schedules within the stream (``lr_schedule``): the step of update i (i = 0, 1, ...
counted from the start of the stream) uses eta_i = eta * f(i) in place of eta (the prior's decay
is not scheduled):

    constant    f(i) = 1                                   (default; the paper's protocol)
    warmup:W    f(i) = min(1, (i + 1) / W)                 (linear ramp over the first W updates)
    rsqrt:S     f(i) = 1 / sqrt(1 + i / S)                 (large steps first, decaying like 1/sqrt(i))

``constant`` runs exactly the same operations as before schedules existed (bit-identical results).

Defaults, defined here once and read by the evaluators, ``adapt.setup``, the command line and the
harness: the rule :data:`DEFAULT_RULE` (eq. 8), lr :data:`DEFAULT_LR` (1e-5, measured on a demo model;
``dynamiceval.py``'s 5e-5, tuned for AWD-LSTM on PTB at segment 5, made it worse), decay (lambda)
:data:`DEFAULT_DECAY` 0.002 and eps :data:`DEFAULT_EPS` 2e-5 (``dynamiceval.py``'s); segment 20 is the
paper's character-level setting; the statistics' batches (:data:`DEFAULT_STATS_BATCH_SIZE`,
:data:`DEFAULT_STATS_BATCHES`). Learning rate matters most and must be tuned on validation text
(``adapt.tune``); ``lr = 0`` reproduces static evaluation exactly.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from fastweights.core.errors import UserError

RULES = ("sgd", "sgd-global-prior", "rms", "rms-prior", "rms-global-prior")
PRIOR_RULES = ("sgd-global-prior", "rms-prior", "rms-global-prior")  # the rules that decay towards theta_g
RULE_ALIASES = {"sgd_prior": "sgd-global-prior", "rms_prior": "rms-prior", "rms_rmsprior": "rms-global-prior",
                "sgd-prior": "sgd-global-prior", "rms-rms-prior": "rms-global-prior"}
DEFAULT_RULE = "rms-global-prior"  # paper eq. 8, the paper's best rule
# The learning rate and decay of dynamic evaluation when none is given and no tuned file applies (the evaluators'
# defaults, the command line's and the harness's). dynamiceval.py's lr 5e-5 (decay 0.002) made the 5-minute demo
# model 5.48% worse on a held-out play (issue 33). Measured on a demo-like checkpoint (shakespeare-char, 750 steps,
# validation 2.31 bits/char), rms-global-prior with the 30-batch statistics `make demo` collects, segment 20, the
# first 20,000 characters of each held-out play, bits/char against static (decay 0.002 unless named): Hamlet /
# Macbeth / Othello / Julius Caesar: lr 5e-5: 6.0% / 3.8% / 4.7% / 119% higher (worse); 3e-5: 2.4% / 7.8% / 4.2% /
# 7.8% lower; 2e-5: 6.5 / 12.4 / 8.8 / 10.2% lower; 1e-5: 9.9 / 14.7 / 12.6 / 17.2% lower (the best of the grid on
# every play); 5e-6: 9.5 / 14.6 / 12.3 / 16.6% lower; 1e-5 at decay 0.008: 9.5 / 14.2 / 11.9 / 16.5% lower.
# `dynamic tune` on 3,000 validation characters of that checkpoint also chose 1e-5.
DEFAULT_LR = 1e-5
DEFAULT_DECAY = 0.002  # dynamiceval.py --lamb
DEFAULT_EPS = 2e-5  # dynamiceval.py --epsilon
# segments when none is given: the paper's (Krause et al. 2018) 20 characters (char and byte models) and 5 words;
# subword (GPT-2-like) models: 128 tokens, as the authors' Transformer dynamic evaluation used
DEFAULT_SEGMENT_LEN = 20
WORD_SEGMENT_LEN = 5
SUBWORD_SEGMENT_LEN = 128
DEFAULT_STATS_BATCH_SIZE = 100  # MS_g: parallel streams per batch (dynamiceval.py's batch size)
DEFAULT_STATS_BATCHES = 500  # MS_g: batches averaged when collected on first use (`dynamic stats --max-batches`)


def canonical_rule(rule: str) -> str:
    """The canonical rule name for ``rule`` (aliases accepted); UserError if unknown."""
    name = RULE_ALIASES.get(rule, rule)
    if name not in RULES:
        raise UserError(f"unknown dynamic-evaluation rule {rule!r}; choose from {', '.join(RULES)}")
    return name


def rule_needs_stats(rule: str) -> bool:
    return canonical_rule(rule).startswith("rms")


SCHEDULES = ("constant", "warmup", "rsqrt")


def parse_schedule(spec: str | None) -> tuple[str, float]:
    """("constant" | "warmup" | "rsqrt", span) from ``None``, ``"constant"``, ``"warmup:W"`` or ``"rsqrt:S"``."""
    if spec is None or spec == "constant":
        return "constant", 0.0
    kind, _, span = str(spec).partition(":")
    try:
        value = float(span)
    except ValueError:
        value = float("nan")
    if kind not in SCHEDULES or kind == "constant" or not value > 0 or not math.isfinite(value):
        raise UserError(f"learning-rate schedule {spec!r}: use constant, warmup:W or rsqrt:S (W, S > 0 updates)")
    return kind, value


def schedule_factor(schedule: tuple[str, float], i: int) -> float:
    """f(i), the factor on the learning rate of update i (0-based) of the stream (module docstring)."""
    kind, span = schedule
    if kind == "warmup":
        return min(1.0, (i + 1) / span)
    if kind == "rsqrt":
        return 1.0 / math.sqrt(1.0 + i / span)
    return 1.0


# ----------------------------------------------------------------------------- update rules


class UpdateRule:
    """One of :data:`RULES` with its hyper-parameters, applied to deltas delta = theta - theta_g.

    In delta form the rules of the module docstring all read, elementwise and in place,

        delta <- delta * (1 - decay_scale) - lr * step_scale * g

    which is theta^i = theta^{i-1} - lr step_scale g + decay_scale (theta_g - theta^{i-1}), with
    step_scale = 1 (sgd rules) or 1 / (sqrt(MS_g) + eps) (rms rules) and decay_scale = 0 (no
    prior), lambda (uniform prior) or min(lambda * RMS_norm, 1) (eq. 8; the 1/lambda clip keeps
    every decay rate <= 1). Working on deltas keeps ``lr = 0`` exact (delta stays 0, theta = theta_g
    bit for bit) and costs two passes over the adapted values. The per-element factors
    ``keep = 1 - decay_scale`` and ``coef = lr * step_scale`` are precomputed; a leading batch
    dimension of the deltas (one per document) broadcasts against them.
    """

    def __init__(self, rule: str, lr: float, decay: float, eps: float, ms: list[torch.Tensor] | None = None):
        self.rule = canonical_rule(rule)
        if lr < 0 or decay < 0 or eps < 0:
            raise UserError(f"lr, decay and eps must be >= 0 (got lr={lr}, decay={decay}, eps={eps})")
        if self.rule in ("sgd-global-prior", "rms-prior") and decay > 1:
            raise UserError(f"decay (lambda) must be <= 1 for rule {self.rule}, got {decay}")
        self.lr, self.decay, self.eps = float(lr), float(decay), float(eps)
        rms = self.rule.startswith("rms")
        if rms and ms is None:
            raise UserError(f"rule {self.rule} needs gradient statistics (MS_g) collected on training data: "
                            "run `fastweights dynamic stats` or use rule sgd / sgd-global-prior")
        # coef = lr * step_scale: a number (sgd rules) or one tensor per parameter (rms rules)
        # (computed in fp64, then stored in the dtype of the deltas by .to())
        self.coef: list | float = [self.lr / (m.double().sqrt() + self.eps) for m in ms] if rms else self.lr
        # keep = 1 - decay_scale: None (no prior), a number (uniform prior) or tensors (RMS prior)
        self.keep: list | float | None = None
        if self.rule in ("sgd-global-prior", "rms-prior"):
            self.keep = 1.0 - self.decay
        elif self.rule == "rms-global-prior" and self.decay > 0:
            roots = [m.double().sqrt() for m in ms]
            avg = torch.stack([r.mean() for r in roots]).mean()  # mean over tensors of per-tensor means
            # lambda * RMS_norm with RMS_norm clipped at 1/lambda
            scales = [(self.decay * r / avg).clamp(max=1.0) if avg > 0 else torch.zeros_like(r) for r in roots]
            self.keep = [1.0 - sc for sc in scales]

    def to(self, device, dtype: torch.dtype = torch.float32) -> "UpdateRule":
        if isinstance(self.coef, list):
            self.coef = [c.to(device, dtype) for c in self.coef]
        if isinstance(self.keep, list):
            self.keep = [k.to(device, dtype) for k in self.keep]
        return self

    @torch.no_grad()
    def apply(self, deltas: list[torch.Tensor], grads: Sequence[torch.Tensor | None], scale: float = 1.0) -> None:
        """Update ``deltas`` in place from the gradients of the segment just scored (None: no gradient).

        ``scale``: the learning-rate schedule's factor f(i) for this update (1: the plain rule)."""
        for i, (d, g) in enumerate(zip(deltas, grads)):
            if self.keep is not None:  # the prior: theta^{i-1} - theta_g decays toward 0
                d.mul_(self.keep[i] if isinstance(self.keep, list) else self.keep)
            if g is None:
                continue
            g = g.to(d.dtype)
            if isinstance(self.coef, list):
                d.addcmul_(self.coef[i], g, value=-1.0 * scale)
            else:
                d.add_(g, alpha=-self.coef * scale)
