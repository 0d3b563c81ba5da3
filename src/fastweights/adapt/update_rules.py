"""Update rules of dynamic evaluation, their gradient statistics and learning-rate schedules.

Krause, Kahembwe, Murray, Renals, "Dynamic Evaluation of Neural Sequence Models", ICML 2018
(arXiv 1709.07432). The evaluation loop that applies them is :mod:`fastweights.adapt.dynamic`.

Update rules (paper eqs 4-8), in the paper's units:

    sgd               theta^i = theta^{i-1} - eta g_i
    sgd-global-prior  theta^i = theta^{i-1} - eta g_i + lambda (theta_g - theta^{i-1})                     (4)
    rms               theta^i = theta^{i-1} - eta g_i / (sqrt(MS_g) + eps)                                 (6, lambda = 0)
    rms-prior         theta^i = theta^{i-1} - eta g_i / (sqrt(MS_g) + eps) + lambda (theta_g - theta^{i-1}) (6)
    rms-global-prior  theta^i = theta^{i-1} - eta g_i / (sqrt(MS_g) + eps)
                                + lambda (theta_g - theta^{i-1}) * RMS_norm                                (8, default)

    MS_g     = (1 / N_b) sum_k (grad L_k)^2    elementwise, over N_b TRAINING batches               (5)
    RMS_norm = sqrt(MS_g) / avg(sqrt(MS_g)),   clipped elementwise to <= 1 / lambda                 (7)

``avg`` is the mean over the adapted parameter tensors of each tensor's mean (the convention of
``dynamiceval.py``, not a mean over all elements); the clip is recomputed for every setting (the
official grid search clipped in place). MS_g is collected by :func:`collect_grad_stats` in
``eval()`` mode on training text at a given batch size and segment length (the batch size is itself
a hyper-parameter: larger batches give smaller mean squared gradients). The spec names
``sgd_prior``, ``rms_prior`` and ``rms_rmsprior`` are accepted as aliases.

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
paper's character-level setting. Learning rate matters most and must be tuned on validation text
(``adapt.tune``); ``lr = 0`` reproduces static evaluation exactly.
"""

from __future__ import annotations

import fnmatch
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from fastweights.core.errors import UserError
from fastweights.ops.nll import token_nll
from fastweights.core.progress import Progress

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
GRAD_STATS_FILE = "grad_stats.safetensors"
UNITS = ("paper equations: MS_g = mean over training batches of the squared gradient of the batch-mean "
         "cross-entropy; step g / (sqrt(MS_g) + eps); RMS_norm = sqrt(MS_g) / (mean over tensors of the "
         "per-tensor mean of sqrt(MS_g)), clipped to 1/lambda; gradients of the segment-mean cross-entropy")


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


# ----------------------------------------------------------------------------- parameter selection


def select_parameters(model: torch.nn.Module, include: Sequence[str] | str | Callable | None = None,
                      exclude: Sequence[str] | str | None = None) -> dict[str, torch.nn.Parameter]:
    """The parameters dynamic evaluation adapts, by name.

    ``include``: None (every parameter), glob patterns on parameter names (a list, or one string
    with comma-separated patterns, e.g. ``"blocks.2.*,blocks.3.*"`` to adapt the top two blocks of
    a 4-block model), or a callable ``(name, parameter) -> bool``. ``exclude``: glob patterns removed
    afterwards (e.g. ``"embed.*"`` to freeze the embedding). Tied parameters appear once, under
    their first name. Raises UserError when nothing is selected.
    """
    inc = _patterns(include) if not callable(include) else None
    exc = _patterns(exclude) or []
    out = {}
    for name, p in model.named_parameters():
        if callable(include):
            keep = include(name, p)
        else:
            keep = inc is None or any(fnmatch.fnmatchcase(name, pat) for pat in inc)
        if keep and not any(fnmatch.fnmatchcase(name, pat) for pat in exc):
            out[name] = p
    if not out:
        raise UserError(f"the parameter filter (include {include!r}, exclude {exclude!r}) selects no parameters; "
                        f"names look like {next(iter(n for n, _ in model.named_parameters()), '?')!r}")
    return out


def _patterns(spec) -> list[str] | None:
    if spec is None:
        return None
    if isinstance(spec, str):
        spec = [s for s in (x.strip() for x in spec.split(",")) if s]
        return spec or None
    return list(spec) or None


# ----------------------------------------------------------------------------- gradient statistics


@dataclass
class GradStats:
    """MS_g (paper eq. 5) per adapted tensor, with the settings that produced it.

    ``ms[name]`` has the parameter's shape: the mean over ``batches`` training batches of the squared
    gradient of the batch-mean cross-entropy (batch ``batch_size`` x ``seq_len`` targets).
    """

    ms: dict[str, torch.Tensor]
    batches: int
    batch_size: int
    seq_len: int
    context: int | None = None
    extra: dict = field(default_factory=dict)

    def metadata(self) -> dict:
        return {"batches": self.batches, "batch_size": self.batch_size, "seq_len": self.seq_len,
                "context": self.context, **self.extra}

    def save(self, path: str | Path) -> Path:
        """Write a safetensors file (tensors by parameter name, settings in its metadata)."""
        from fastweights.core.files import atomic_write, save_safetensors

        path = Path(path)
        meta = {"format": "fastweights-grad-stats", "units": "MS_g (mean squared gradient, paper eq. 5)",
                "settings": json.dumps(self.metadata())}
        tensors = {k: v.detach().float().contiguous().cpu() for k, v in self.ms.items()}
        atomic_write(path, lambda p: save_safetensors(tensors, p, metadata=meta))
        return path

    @staticmethod
    def is_stats_file(path: str | Path) -> bool:
        """Whether ``path`` is a file :meth:`save` wrote (its metadata only: nothing loaded)."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                return (f.metadata() or {}).get("format") == "fastweights-grad-stats"
        except (SafetensorError, OSError, ValueError):
            return False

    @classmethod
    def load(cls, path: str | Path) -> "GradStats":
        """Read a file written by :meth:`save`; UserError when missing or not a statistics file."""
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        if not path.is_file():
            raise UserError(f"gradient statistics {path} not found; create them with `fastweights dynamic stats`")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                ms = {k: f.get_tensor(k) for k in f.keys()}
        except (SafetensorError, OSError, ValueError) as e:
            raise UserError(f"gradient statistics {path}: unreadable ({e})") from None
        if meta.get("format") != "fastweights-grad-stats":
            raise UserError(f"{path} is not a gradient-statistics file (written by `fastweights dynamic stats`)")
        s = json.loads(meta.get("settings", "{}"))
        extra = {k: v for k, v in s.items() if k not in ("batches", "batch_size", "seq_len", "context")}
        return cls(ms, s.get("batches", 0), s.get("batch_size", 0), s.get("seq_len", 0), s.get("context"), extra)


def as_token_stream(tokens) -> torch.Tensor:
    t = torch.as_tensor(tokens)
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1:
        raise ValueError(f"expected a 1-D token sequence, got shape {tuple(t.shape)}")
    return t.long()


def carry_state(model, state, context: int | None, segment_len: int):
    """Detach the model state (no gradient into the memory) and bound a growing KV cache."""
    from fastweights.models.lm import detach_state

    state = detach_state(state)
    if context is not None and hasattr(model, "trim_state"):
        state = model.trim_state(state, max(0, context - segment_len))
    return state


def accumulate_grad_stats(forward: Callable, leaves: list[torch.Tensor], names: list[str], train_tokens,
                          batch_size: int, seq_len: int, context: int | None, max_batches: int | None,
                          model=None, progress: bool = False) -> GradStats:
    """MS_g for ``leaves`` from training text (the generic loop behind :func:`collect_grad_stats`).

    ``train_tokens`` ([N]) is cut into ``batch_size`` contiguous streams (``dynamiceval.py``'s
    batchify); each step scores ``seq_len`` targets of every stream with ``forward(x [B, t], state)
    -> (logits, state)``, the state carried and detached, and accumulates the squared gradient of
    the batch-mean cross-entropy with respect to ``leaves``.
    """
    tokens = as_token_stream(torch.as_tensor(train_tokens))
    per_stream = tokens.numel() // batch_size
    if per_stream < 2:
        raise UserError(f"the training text has {tokens.numel()} tokens, too few for {batch_size} streams; "
                        "lower --batch-size")
    if context and seq_len > context:  # issue 52: --segment-len 1e18 scored whole streams at once, 7 GB
        raise UserError(f"segment length {seq_len:,} is longer than the attention context ({context:,} tokens)")
    # a segment past a stream's end is the whole stream, and is recorded as what it was (the 1e18 was recorded)
    seq_len = min(seq_len, per_stream - 1)
    streams = tokens[: per_stream * batch_size].view(batch_size, per_stream)  # [B, N/B], stream b = a contiguous slice
    steps = math.ceil((per_stream - 1) / seq_len)
    if max_batches:
        steps = min(steps, max_batches)
    device = leaves[0].device
    # fp32 sums (fp64 for fp64 parameters: no fp32 rounding in an fp64 model's statistics)
    sums = [torch.zeros_like(p, dtype=torch.float64 if p.dtype == torch.float64 else torch.float32) for p in leaves]
    state = None
    bar = Progress(steps, "batches", desc="gradient statistics (MS_g)", enabled=progress, loss_unit="nats")
    for i in range(steps):
        a = i * seq_len
        b = min(a + seq_len, per_stream - 1)
        x = streams[:, a:b].to(device)
        y = streams[:, a + 1 : b + 1].to(device)
        logits, new_state = forward(x, state)
        loss = token_nll(logits, y).mean()
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        for s, g in zip(sums, grads):
            if g is not None:
                s.add_(g.to(s.dtype).square())
        state = carry_state(model, new_state, context, seq_len) if model is not None else new_state
        bar.update(1, loss=loss.item())
    bar.close()
    ms = {n: s / steps for n, s in zip(names, sums)}
    return GradStats(ms, steps, batch_size, seq_len, context)


def collect_grad_stats(model: torch.nn.Module, train_tokens, batch_size: int = DEFAULT_STATS_BATCH_SIZE,
                       seq_len: int = DEFAULT_SEGMENT_LEN,
                       max_batches: int | None = None, context: int | None = None,
                       include=None, exclude=None, progress: bool = False) -> GradStats:
    """MS_g (paper eq. 5) of the selected parameters on training tokens, in ``eval()`` mode.

    Args:
        train_tokens: [N] token ids of TRAINING text (never the evaluation text).
        batch_size: parallel streams per batch (:data:`DEFAULT_STATS_BATCH_SIZE`, ``dynamiceval.py``'s 100).
        seq_len: targets per stream per batch; use the evaluation segment length.
        max_batches: stop after this many batches (default: the whole text).
        context: KV-cache bound in tokens (the training ``seq_len``), as in evaluation.
        include, exclude: the parameter filter of :func:`select_parameters`.
    Returns :class:`GradStats`; ``.save(path)`` writes it (conventionally next to the checkpoint,
    ``grad_stats.safetensors``).
    """
    params = select_parameters(model, include, exclude)
    names, leaves = list(params), list(params.values())
    was_training = model.training
    model.eval()
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    try:
        for n, p in model.named_parameters():
            p.requires_grad_(n in params)
        stats = accumulate_grad_stats(lambda x, s: logits_and_state(model(x, s)), leaves, names, train_tokens,
                                      batch_size, seq_len, context, max_batches, model=model, progress=progress)
    finally:
        for n, p in model.named_parameters():
            p.requires_grad_(flags[n])
        model.train(was_training)
    return stats


def logits_and_state(out):
    return out.logits, out.state


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
