"""Dynamic evaluation: adapt a trained language model to the text it is scoring by gradient descent.

Krause, Kahembwe, Murray, Renals, "Dynamic Evaluation of Neural Sequence Models", ICML 2018
(arXiv 1709.07432); the Transformer variant from the same authors' arXiv 1904.08378.

Protocol (paper section 3, ``dynamiceval.py``). A stream x_1..x_T is cut into segments s_1..s_M of
``segment_len`` predictions. Starting from the trained weights theta_g, for i = 1..M:

    1. score s_i with theta^{i-1}, adding -log P(s_i | theta^{i-1}, carried state) to the total;
    2. g_i = gradient of the MEAN cross-entropy over s_i's targets (as the official code does),
       back-propagated to the start of s_i only: the model state (KV cache, recurrent/fast-weight
       state) is carried forward but detached, and memories computed under older weights are not
       recomputed (the Transformer-XL protocol);
    3. theta^i = update(theta^{i-1}, g_i).

Every token is scored before any update has seen it, which is what keeps the log-likelihood valid.
The loop below enforces it structurally: the update receives only the gradient of a segment whose
scores are already recorded. A short last segment is scored and updated on like the others.
The first token of a fresh stream is context only (T - 1 predictions), as in ``evaluate.py``.

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

Defaults: lr 5e-5, decay (lambda) 0.002, eps 2e-5 are ``dynamiceval.py``'s (tuned for AWD-LSTM on
PTB at segment 5); segment 20 is the paper's character-level setting. Learning rate matters most
and must be tuned on validation text (``adapt.tune``); ``lr = 0`` reproduces static evaluation
exactly.

State (the DESIGN's "adapted parameters, a copy or a delta per sequence"): ``evaluate(tokens,
state)`` returns a :class:`DynamicState` holding the adapted values, the model state and the
tokens not yet scored, so scoring a stream in several calls equals scoring it in one.
:meth:`DynamicEvaluator.evaluate_batch` scores several documents at once, each with its own weights
theta_g + delta_b, through ``torch.func.functional_call`` under ``torch.func.vmap``.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from fastweights.errors import UserError
from fastweights.evaluate import EvalResult, score_tokens
from fastweights.progress import Progress

RULES = ("sgd", "sgd-global-prior", "rms", "rms-prior", "rms-global-prior")
PRIOR_RULES = ("sgd-global-prior", "rms-prior", "rms-global-prior")  # the rules that decay towards theta_g
RULE_ALIASES = {"sgd_prior": "sgd-global-prior", "rms_prior": "rms-prior", "rms_rmsprior": "rms-global-prior",
                "sgd-prior": "sgd-global-prior", "rms-rms-prior": "rms-global-prior"}
DEFAULT_LR = 5e-5  # dynamiceval.py --lr
DEFAULT_DECAY = 0.002  # dynamiceval.py --lamb
DEFAULT_EPS = 2e-5  # dynamiceval.py --epsilon
DEFAULT_SEGMENT_LEN = 20  # the paper's character-level segment length (word level: 5)
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
        from safetensors.torch import save_file

        from fastweights.checkpoint import atomic_write

        path = Path(path)
        meta = {"format": "fastweights-grad-stats", "units": "MS_g (mean squared gradient, paper eq. 5)",
                "settings": json.dumps(self.metadata())}
        tensors = {k: v.detach().float().contiguous().cpu() for k, v in self.ms.items()}
        atomic_write(path, lambda p: save_file(tensors, str(p), metadata=meta))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "GradStats":
        """Read a file written by :meth:`save`; UserError when missing or not a statistics file."""
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        if not path.is_file():
            raise UserError(f"gradient statistics {path} not found; create them with `fastweights collect-grad-stats`")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                ms = {k: f.get_tensor(k) for k in f.keys()}
        except (SafetensorError, OSError, ValueError) as e:
            raise UserError(f"gradient statistics {path}: unreadable ({e})") from None
        if meta.get("format") != "fastweights-grad-stats":
            raise UserError(f"{path} is not a gradient-statistics file (written by `fastweights collect-grad-stats`)")
        s = json.loads(meta.get("settings", "{}"))
        extra = {k: v for k, v in s.items() if k not in ("batches", "batch_size", "seq_len", "context")}
        return cls(ms, s.get("batches", 0), s.get("batch_size", 0), s.get("seq_len", 0), s.get("context"), extra)


def _as_1d(tokens) -> torch.Tensor:
    t = torch.as_tensor(tokens)
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1:
        raise ValueError(f"expected a 1-D token sequence, got shape {tuple(t.shape)}")
    return t.long()


def _carry(model, state, context: int | None, segment_len: int):
    """Detach the model state (no gradient into the memory) and bound a growing KV cache."""
    from fastweights.models.lm import detach_state

    state = detach_state(state)
    if context is not None and hasattr(model, "trim_state"):
        state = model.trim_state(state, max(0, context - segment_len))
    return state


def _token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log p(target) per position, in fp32 (fp64 for fp64 logits): [..., T, V], [..., T] -> [..., T]."""
    logp = torch.log_softmax(logits if logits.dtype == torch.float64 else logits.float(), dim=-1)
    return -logp.gather(-1, targets[..., None])[..., 0]


def accumulate_grad_stats(forward: Callable, leaves: list[torch.Tensor], names: list[str], train_tokens,
                          batch_size: int, seq_len: int, context: int | None, max_batches: int | None,
                          model=None, progress: bool = False) -> GradStats:
    """MS_g for ``leaves`` from training text (the generic loop behind :func:`collect_grad_stats`).

    ``train_tokens`` ([N]) is cut into ``batch_size`` contiguous streams (``dynamiceval.py``'s
    batchify); each step scores ``seq_len`` targets of every stream with ``forward(x [B, t], state)
    -> (logits, state)``, the state carried and detached, and accumulates the squared gradient of
    the batch-mean cross-entropy with respect to ``leaves``.
    """
    tokens = _as_1d(torch.as_tensor(train_tokens))
    per_stream = tokens.numel() // batch_size
    if per_stream < 2:
        raise UserError(f"the training text has {tokens.numel()} tokens, too few for {batch_size} streams; "
                        "lower --batch-size")
    streams = tokens[: per_stream * batch_size].view(batch_size, per_stream)  # [B, N/B], stream b = a contiguous slice
    steps = math.ceil((per_stream - 1) / seq_len)
    if max_batches:
        steps = min(steps, max_batches)
    device = leaves[0].device
    sums = [torch.zeros_like(p, dtype=torch.float32) for p in leaves]
    state = None
    bar = Progress(steps, "batches", desc="grad-stats", enabled=progress)
    for i in range(steps):
        a = i * seq_len
        b = min(a + seq_len, per_stream - 1)
        x = streams[:, a:b].to(device)
        y = streams[:, a + 1 : b + 1].to(device)
        logits, new_state = forward(x, state)
        loss = _token_nll(logits, y).mean()
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        for s, g in zip(sums, grads):
            if g is not None:
                s.add_(g.float().square())
        state = _carry(model, new_state, context, seq_len) if model is not None else new_state
        bar.update(1, loss=loss.item())
    bar.close()
    ms = {n: s / steps for n, s in zip(names, sums)}
    return GradStats(ms, steps, batch_size, seq_len, context)


def collect_grad_stats(model: torch.nn.Module, train_tokens, batch_size: int = 100, seq_len: int = DEFAULT_SEGMENT_LEN,
                       max_batches: int | None = None, context: int | None = None,
                       include=None, exclude=None, progress: bool = False) -> GradStats:
    """MS_g (paper eq. 5) of the selected parameters on training tokens, in ``eval()`` mode.

    Args:
        train_tokens: [N] token ids of TRAINING text (never the evaluation text).
        batch_size: parallel streams per batch (``dynamiceval.py`` default 100).
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
        stats = accumulate_grad_stats(lambda x, s: _logits_state(model(x, s)), leaves, names, train_tokens,
                                      batch_size, seq_len, context, max_batches, model=model, progress=progress)
    finally:
        for n, p in model.named_parameters():
            p.requires_grad_(flags[n])
        model.train(was_training)
    return stats


def _logits_state(out):
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
                            "run `fastweights collect-grad-stats` or use rule sgd / sgd-global-prior")
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


# ----------------------------------------------------------------------------- the evaluator


@dataclass
class DynamicState:
    """What a stream needs to continue: adaptation, model state, unscored tokens.

    ``values``: the deltas theta - theta_g of the adapted tensors, fp32 (fp64 for fp64 models), in
    the evaluator's order (for sparse dynamic evaluation: the adaptation matrix M itself).
    ``pending``: the last token already consumed as a target (the context of the next prediction)
    followed by tokens not yet scored. ``scored``: predictions made so far. ``updates``: updates
    made so far (the index of the next one in the learning-rate schedule).
    """

    values: list[torch.Tensor]
    model_state: object
    pending: torch.Tensor
    scored: int = 0
    updates: int = 0


class DynamicEvaluator:
    """Dynamic evaluation of ``model`` (ours, or a Hugging Face causal LM through ``adapt.hf``).

    ``model(tokens [B, T], state) -> output with .logits [B, T, V] and .state`` is all it needs;
    an optional ``model.trim_state(state, keep)`` bounds a KV cache.

    Args:
        rule: one of :data:`RULES` (default ``"rms-global-prior"``, paper eq. 8).
        lr, decay, eps: eta, lambda, epsilon of the rules (paper units, see the module docstring).
        segment_len: predictions per segment (n); one update per segment.
        context: attention context in tokens; after each segment the KV cache keeps
            ``context - segment_len`` tokens (None: unbounded). Use the training ``seq_len``.
        include, exclude: parameter filter (:func:`select_parameters`), e.g. ``exclude="embed.*"``.
        grad_stats: :class:`GradStats` (or a path to one); required by the rms rules.
        lr_schedule: ``"constant"`` (default), ``"warmup:W"`` or ``"rsqrt:S"`` (module docstring).
    """

    def __init__(self, model: torch.nn.Module, rule: str = "rms-global-prior", lr: float = DEFAULT_LR,
                 decay: float = DEFAULT_DECAY, eps: float = DEFAULT_EPS, segment_len: int = DEFAULT_SEGMENT_LEN,
                 context: int | None = None, include=None, exclude=None, grad_stats: GradStats | str | Path | None = None,
                 lr_schedule: str | None = None):
        if segment_len < 1:
            raise UserError(f"segment length must be >= 1, got {segment_len}")
        if context is not None and context <= segment_len:
            raise UserError(f"context ({context}) must be longer than the segment length ({segment_len})")
        self.model = model
        self.segment_len = int(segment_len)
        self.context = context
        self.schedule = parse_schedule(lr_schedule)
        self.lr_schedule = "constant" if self.schedule[0] == "constant" else f"{self.schedule[0]}:{self.schedule[1]:g}"
        if isinstance(grad_stats, (str, Path)):
            grad_stats = GradStats.load(grad_stats)
        self.grad_stats = grad_stats
        self.device = next(model.parameters()).device
        self._setup(include, exclude)
        ms = self._stats_for(grad_stats) if canonical_rule(rule).startswith("rms") else None
        self.update_rule = UpdateRule(rule, lr, decay, eps, ms).to(self.device, self.theta_g[0].dtype)
        self.rule = self.update_rule.rule

    # -- what is adapted (overridden by the sparse evaluator) ----------------------------------

    def _setup(self, include, exclude) -> None:
        self.params = select_parameters(self.model, include, exclude)
        self.names = list(self.params)
        # theta_g in fp32 (fp64 for fp64 models): the anchor of the priors and what the model is
        # restored to after each call
        self.theta_g = [p.detach().to(_master_dtype(p)).clone() for p in self.params.values()]

    def _stats_for(self, stats: GradStats | None) -> list[torch.Tensor]:
        if stats is None:
            raise UserError("rule needs gradient statistics: pass grad_stats (see `fastweights collect-grad-stats`)")
        missing = [n for n in self.names if n not in stats.ms]
        if missing:
            raise UserError(f"the gradient statistics lack {len(missing)} adapted parameter(s), e.g. {missing[0]!r}; "
                            "collect them with the same parameter filter")
        for n, p in zip(self.names, self.theta_g):
            if tuple(stats.ms[n].shape) != tuple(p.shape):
                raise UserError(f"gradient statistics for {n!r} have shape {tuple(stats.ms[n].shape)}, "
                                f"the parameter {tuple(p.shape)}: they belong to another model")
        return [stats.ms[n].to(self.device) for n in self.names]

    @property
    def num_adapted(self) -> int:
        return sum(t.numel() for t in self.theta_g)

    def metadata(self) -> dict:
        """Everything that defines the protocol, for result files (pitfall 5: conventions drift).

        Settings the rule does not use are left out: ``decay`` for rules without a prior, ``eps``
        and ``grad_stats`` for rules without RMS scaling."""
        u, rms = self.update_rule, self.rule.startswith("rms")
        return {"rule": self.rule, "lr": u.lr, **({"decay": u.decay} if self.rule in PRIOR_RULES else {}),
                **({"eps": u.eps} if rms else {}), "segment_len": self.segment_len, "context": self.context,
                **(self.model.context_info() if hasattr(self.model, "context_info") else {}),
                **({"lr_schedule": self.lr_schedule} if self.lr_schedule != "constant" else {}),
                "adapted_parameters": self.num_adapted, "adapted_tensors": len(self.names),
                "units": UNITS, "loss_for_update": "mean cross-entropy over the segment's targets",
                "first_token": "context only (not scored)",
                **({"grad_stats": self.grad_stats.metadata() if self.grad_stats is not None else None} if rms else {})}

    # -- single stream, weights adapted in place ----------------------------------------------

    @contextlib.contextmanager
    def _session(self, deltas: list[torch.Tensor] | None):
        """Set the adapted parameters to theta_g + ``deltas`` (None: zeros) for one call; restore theta_g after.

        Yields (forward, leaves, deltas, sync, finish): ``forward(x, state) -> (logits, state)``,
        the tensors to differentiate, the deltas the update rule changes in place, ``sync()`` which
        writes theta_g + delta into the model after an update, and ``finish()`` which returns
        copies of the deltas for the next state.
        """
        model = self.model
        was_training = model.training
        model.eval()
        flags = {n: p.requires_grad for n, p in model.named_parameters()}
        params = list(self.params.values())
        deltas = [d.clone() for d in deltas] if deltas is not None else self._zero_values()
        try:
            for n, p in model.named_parameters():
                p.requires_grad_(n in self.params)  # no backward work for frozen parameters

            def sync():
                with torch.no_grad():
                    for p, g, d in zip(params, self.theta_g, deltas):
                        if p.dtype == g.dtype:
                            torch.add(g, d, out=p.data)  # one pass, no temporary
                        else:
                            p.copy_(g + d)

            def forward(x, state):
                return _logits_state(model(x, state))

            sync()
            yield forward, params, deltas, sync, (lambda: [d.detach().clone() for d in deltas])
        finally:
            with torch.no_grad():
                for p, g in zip(params, self.theta_g):
                    p.copy_(g)
            for n, p in model.named_parameters():
                p.requires_grad_(flags[n])
            model.train(was_training)

    def _zero_values(self, batch: int | None = None) -> list[torch.Tensor]:
        """Deltas of zero (theta = theta_g), optionally with a leading batch dimension."""
        lead = () if batch is None else (batch,)
        return [torch.zeros((*lead, *g.shape), dtype=g.dtype, device=self.device) for g in self.theta_g]

    def evaluate(self, tokens, state: DynamicState | None = None, final: bool = True,
                 keep_token_losses: bool = True, progress: Progress | None = None):
        """Dynamically evaluate one stream; returns ``(EvalResult, DynamicState)``.

        tokens: [T] ids. With ``state`` the stream continues where the previous call stopped (the
        adapted weights, the model state and any unscored tail are carried). ``final=False`` keeps
        an incomplete last segment unscored in the state, so that evaluating a stream in pieces
        equals one call; ``final=True`` scores it (and updates on it). ``EvalResult.nll`` is the
        total NLL in nats, ``tokens`` the number of predictions, ``token_losses`` their NLLs.
        """
        tokens = _as_1d(tokens)
        seq = torch.cat([state.pending, tokens]) if state is not None else tokens
        model_state = state.model_state if state is not None else None
        values = state.values if state is not None else None
        updates = state.updates if state is not None else 0
        result = EvalResult(0.0, 0)
        L, n = self.segment_len, seq.numel() - 1
        pos = 0
        with self._session(values) as (forward, leaves, deltas, sync, finish):
            while pos < n and (final or n - pos >= L):
                m = min(L, n - pos)
                x = seq[None, pos : pos + m].to(self.device)  # [1, m]
                y = seq[None, pos + 1 : pos + m + 1].to(self.device)
                logits, new_state = forward(x, model_state)
                tok_nll = _token_nll(logits, y)  # [1, m]
                # 1. score: record the segment's losses before any update has seen its tokens
                scored = tok_nll.detach()
                result.nll += scored.sum().item()
                result.tokens += m
                if keep_token_losses:
                    result.token_losses.extend(scored.flatten().tolist())
                # 2-3. gradient of the segment-mean NLL (back to the segment start only), then update
                grads = torch.autograd.grad(tok_nll.mean(), leaves, allow_unused=True)
                self.update_rule.apply(deltas, grads, schedule_factor(self.schedule, updates))
                updates += 1
                sync()
                model_state = _carry(self.model, new_state, self.context, L)
                pos += m
                if progress is not None:
                    progress.update(m)
            new_values = finish()
        prev = state.scored if state is not None else 0
        return result, DynamicState(new_values, model_state, seq[pos:].clone(), prev + result.tokens, updates)

    @torch.no_grad()
    def static(self, tokens, keep_token_losses: bool = True, progress: Progress | None = None) -> EvalResult:
        """Static evaluation under the same protocol (segments of ``segment_len``, same context bound)."""
        tokens = _as_1d(tokens)
        seq_len = self.context if self.context is not None else tokens.numel() + self.segment_len
        result, _ = score_tokens(self.model, tokens, seq_len, self.segment_len,
                                 keep_token_losses=keep_token_losses, progress=progress)
        return result

    def evaluate_documents(self, documents: Iterable, reset: str = "per_document",
                           keep_token_losses: bool = False, progress: bool = False) -> EvalResult:
        """Score several documents (each [T] ids) one after the other; returns the summed result.

        ``reset="per_document"`` starts every document from theta_g; ``"never"`` carries the adapted
        weights from one document to the next (the model state, e.g. the KV cache, is always fresh
        at a document start). Use "never" only for contiguous benchmarks (pitfall 4).
        """
        if reset not in ("per_document", "never"):
            raise UserError(f"reset must be per_document or never, got {reset!r}")
        docs = [_as_1d(d) for d in documents]
        bar = Progress(sum(max(0, d.numel() - 1) for d in docs), "tok", desc="dynamic", enabled=progress)
        total = EvalResult(0.0, 0)
        values, updates = None, 0
        for d in docs:
            if d.numel() < 2:
                continue
            start = None if values is None else DynamicState(values, None, d[:0], 0, updates)
            r, st = self.evaluate(d, start, final=True, keep_token_losses=keep_token_losses, progress=bar)
            total.nll += r.nll
            total.tokens += r.tokens
            total.token_losses.extend(r.token_losses)
            if reset == "never":  # one stream: the schedule continues too
                values, updates = st.values, st.updates
        bar.close()
        return total

    # -- many documents at once, one delta per document ----------------------------------------

    @contextlib.contextmanager
    def _batched_forward(self):
        """Yields forward(values [B, ...] each, x [B, t], state) -> (logits [B, t, V], state).

        Document b runs with theta_g + values[b] through ``functional_call`` under ``vmap``. Model
        state tensors must carry the batch as their first dimension (the [B, H, K, V] convention);
        non-tensor leaves (positions) are the same for every document.
        """
        from torch.func import functional_call, vmap

        model = self.model
        was_training = model.training
        model.eval()
        base = {n: p.detach() for n, p in self.params.items()}
        tied = _list_held_parameters(model, self.params)
        holder = {}

        def one(deltas, x, state_leaves, spec):
            params = {n: base[n] + d.to(base[n].dtype) for n, d in zip(self.names, deltas)}
            state = None
            if spec is not None:  # per-document leaves lost their batch dim: give it back as size 1
                it = iter(state_leaves)
                leaves = [next(it)[None] if k else v for k, v in zip(holder["in_kinds"], holder["in_static"])]
                state = tree_unflatten(leaves, spec)
            saved = [(mod, i, mod.tied[i]) for mod, i, _ in tied]
            try:
                for mod, i, name in tied:  # parameters a module holds in a plain list (a tied head)
                    mod.tied[i] = params[name]
                out = functional_call(model, params, (x[None], state))
            finally:
                for mod, i, t in saved:
                    mod.tied[i] = t
            leaves, out_spec = tree_flatten(out.state)
            holder["out_spec"] = out_spec
            holder["out_kinds"] = [isinstance(v, torch.Tensor) for v in leaves]
            holder["out_static"] = [None if isinstance(v, torch.Tensor) else v for v in leaves]
            return out.logits[0], [v[0] for v in leaves if isinstance(v, torch.Tensor)]

        def forward(values, x, state):
            if state is None:
                spec, tensors = None, []
            else:
                leaves, spec = tree_flatten(state)
                holder["in_kinds"] = [isinstance(v, torch.Tensor) for v in leaves]
                holder["in_static"] = [None if isinstance(v, torch.Tensor) else v for v in leaves]
                tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
            try:
                logits, out_tensors = vmap(lambda d, xx, st: one(d, xx, st, spec))(values, x, tensors)
            except RuntimeError as e:
                if "setup_context" not in str(e):
                    raise
                raise RuntimeError("batched dynamic evaluation runs the model under torch.func.vmap, and one of its "
                                   "torch.autograd.Functions does not support functorch (it needs setup_context and "
                                   "generate_vmap_rule = True); evaluate documents one at a time, or use sparse "
                                   "dynamic evaluation") from e
            it = iter(out_tensors)
            leaves = [next(it) if k else v for k, v in zip(holder["out_kinds"], holder["out_static"])]
            return logits, tree_unflatten(leaves, holder["out_spec"])

        try:
            with warnings.catch_warnings():
                # functorch has no batching rule for CPU flash attention and loops over the batch
                warnings.filterwarnings("ignore", message=".*performance drop because we have not yet implemented the batching rule.*")
                yield forward
        finally:
            model.train(was_training)

    def evaluate_batch(self, documents: Sequence, keep_token_losses: bool = False,
                       progress: Progress | None = None) -> list[EvalResult]:
        """Dynamically evaluate several documents at once, each with its own adapted weights.

        Equivalent to ``evaluate(doc)`` for each document from a fresh state (reset per document),
        but documents share every forward and backward call: document b runs with
        theta_g + delta_b (one fp32 delta per document and adapted tensor, no model copies).
        Shorter documents are padded; padded targets are neither scored nor part of any update.
        """
        docs = [_as_1d(d) for d in documents]
        if not docs:
            return []
        B, L = len(docs), self.segment_len
        lengths = torch.tensor([d.numel() for d in docs])
        T = int(lengths.max())
        tokens = torch.zeros(B, T, dtype=torch.long)
        for b, d in enumerate(docs):
            tokens[b, : d.numel()] = d
        results = [EvalResult(0.0, 0) for _ in docs]
        values = self._zero_values(B)
        state = None
        with self._batched_forward() as forward:
            for pos in range(0, T - 1, L):
                m = min(L, T - 1 - pos)
                x = tokens[:, pos : pos + m].to(self.device)  # [B, m]
                y = tokens[:, pos + 1 : pos + m + 1].to(self.device)
                valid = (pos + 1 + torch.arange(m))[None, :] < lengths[:, None]  # [B, m] real targets
                valid = valid.to(self.device)
                leaves = [v.requires_grad_(True) for v in values]
                logits, new_state = forward(leaves, x, state)
                tok_nll = _token_nll(logits, y)  # [B, m]
                scored = tok_nll.detach()
                for b in range(B):  # score first
                    s = scored[b][valid[b]]
                    results[b].nll += s.sum().item()
                    results[b].tokens += s.numel()
                    if keep_token_losses:
                        results[b].token_losses.extend(s.tolist())
                count = valid.sum(1).clamp(min=1)
                # each document's loss is the mean over its own targets; their sum keeps gradients separate
                loss = ((tok_nll * valid).sum(1) / count).sum()
                grads = torch.autograd.grad(loss, leaves, allow_unused=True)
                for v in values:
                    v.requires_grad_(False)
                self.update_rule.apply(values, grads, schedule_factor(self.schedule, pos // L))
                state = _carry(self.model, new_state, self.context, L)
                if progress is not None:
                    progress.update(int(valid.sum()))
        return results

    # -- generation -----------------------------------------------------------------------------

    def generate(self, prompt, max_tokens: int, temperature: float = 1.0, top_k: int = 0, seed: int | None = None,
                 state: DynamicState | None = None, adapt_on_prompt: bool = True):
        """Sample ``max_tokens`` ids, adapting on the prompt and on the generated text.

        Paper section 3: a segment of ``segment_len`` tokens is sampled with fixed weights, then the
        weights are updated on it (the mean NLL of the sampled segment), and sampling continues.
        Returns ``(ids, state)``; ``state`` can continue scoring or sampling.
        """
        prompt = _as_1d(prompt)
        if prompt.numel() == 0 and state is None:
            raise UserError("generation needs a non-empty prompt")
        if adapt_on_prompt:
            _, state = self.evaluate(prompt, state, final=True, keep_token_losses=False)
        else:
            seq = torch.cat([state.pending, prompt]) if state is not None else prompt
            state = DynamicState(state.values if state else self._zero_values(),
                                 state.model_state if state else None, seq, state.scored if state else 0,
                                 state.updates if state else 0)
            # read the prompt without adapting: a static pass that leaves only the last token pending
            with torch.no_grad(), self._session(state.values) as (forward, *_):
                ms = state.model_state
                for a in range(0, seq.numel() - 1, self.segment_len):
                    b = min(a + self.segment_len, seq.numel() - 1)
                    _, ms = forward(seq[None, a:b].to(self.device), ms)
                    ms = _carry(self.model, ms, self.context, self.segment_len)
            state = DynamicState(state.values, ms, seq[-1:].clone(), state.scored, state.updates)
        gen = torch.Generator(device=self.device)
        if seed is not None:
            gen.manual_seed(seed)
        out: list[int] = []
        while len(out) < max_tokens:
            m = min(self.segment_len, max_tokens - len(out))
            segment = self._sample_segment(state, m, temperature, top_k, gen)
            out.extend(segment)
            # update on the generated segment: it is now text the model has "read"
            _, state = self.evaluate(torch.tensor(segment), state, final=True, keep_token_losses=False)
        return out, state

    @torch.no_grad()
    def _sample_segment(self, state: DynamicState, m: int, temperature: float, top_k: int, gen) -> list[int]:
        with self._session(state.values) as (forward, *_):
            ms = state.model_state
            pending = state.pending.to(self.device)
            if pending.numel() > 1:  # unscored tokens (final=False) become context first
                _, ms = forward(pending[None, :-1], ms)
            x = pending[None, -1:]
            ids = []
            for _ in range(m):
                logits, ms = forward(x, ms)
                if self.context is not None and hasattr(self.model, "trim_state"):
                    ms = self.model.trim_state(ms, self.context - 1)
                nxt = _sample(logits[0, -1].float(), temperature, top_k, gen)
                ids.append(nxt)
                x = torch.tensor([[nxt]], device=self.device)
        return ids


def _sample(logits: torch.Tensor, temperature: float, top_k: int, gen) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))


def _master_dtype(p: torch.Tensor) -> torch.dtype:
    """Adapted values accumulate in fp32 (fp64 when the model itself is fp64)."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def _list_held_parameters(model: torch.nn.Module, params: dict) -> list[tuple]:
    """(module, index, name) for adapted parameters a module keeps in a plain list ``tied``.

    ``LinearHead`` holds a tied embedding that way so it is not registered twice;
    ``functional_call`` does not see it, so the batched forward substitutes it by hand.
    """
    by_id = {id(p): n for n, p in params.items()}
    found = []
    for mod in model.modules():
        held = getattr(mod, "tied", None)
        if isinstance(held, list):
            for i, t in enumerate(held):
                if id(t) in by_id:
                    found.append((mod, i, by_id[id(t)]))
    return found


# ----------------------------------------------------------------------------- time scales


def loss_by_position(per_doc_losses: list[list[float]], window: int = 100) -> dict:
    """Mean loss at each position across documents, averaged over non-overlapping windows.

    Returns {"position": window end positions, "loss": mean nats per window, "docs": documents
    covering each window}; windows are kept while at least one document covers them (not cumulative,
    as in the paper's Figure 2).
    """
    if not per_doc_losses:
        return {"position": [], "loss": [], "docs": []}
    T = max(len(d) for d in per_doc_losses)
    sums = torch.zeros(T, dtype=torch.float64)
    counts = torch.zeros(T, dtype=torch.float64)
    for d in per_doc_losses:
        sums[: len(d)] += torch.tensor(d, dtype=torch.float64)
        counts[: len(d)] += 1
    pos, loss, docs = [], [], []
    for a in range(0, T, window):
        b = min(a + window, T)
        c = counts[a:b]
        if c.sum() == 0:
            continue
        pos.append(b)
        loss.append(float(sums[a:b].sum() / c.sum()))
        docs.append(int(c.min()))
    return {"position": pos, "loss": loss, "docs": docs}


def timescale_analysis(evaluator: DynamicEvaluator, documents: Sequence, window: int = 100,
                       progress: bool = False) -> dict:
    """Static and dynamic loss against position (paper Figure 2), averaged over ``documents``.

    Each document is evaluated from theta_g and a fresh state. Returns {"window", "documents",
    "position", "static_bits", "dynamic_bits", "advantage_bits"} (bits per token per window).
    """
    docs = [_as_1d(d) for d in documents if len(d) > 1]
    if not docs:
        raise UserError("timescale analysis needs at least one document of two or more tokens")
    bar = Progress(2 * sum(d.numel() - 1 for d in docs), "tok", desc="timescale", enabled=progress)
    static, dynamic = [], []
    for d in docs:
        static.append(evaluator.static(d, progress=bar).token_losses)
        dynamic.append(evaluator.evaluate(d, progress=bar)[0].token_losses)
    bar.close()
    s, dyn = loss_by_position(static, window), loss_by_position(dynamic, window)
    ln2 = math.log(2)
    sb = [v / ln2 for v in s["loss"]]
    db = [v / ln2 for v in dyn["loss"]]
    return {"window": window, "documents": len(docs), "position": s["position"], "docs_per_window": s["docs"],
            "static_bits": sb, "dynamic_bits": db, "advantage_bits": [a - b for a, b in zip(sb, db)],
            "static_mean_bits": sum(sum(d) for d in static) / sum(len(d) for d in static) / ln2,
            "dynamic_mean_bits": sum(sum(d) for d in dynamic) / sum(len(d) for d in dynamic) / ln2}


def plot_timescale(result: dict, path: str | Path, title: str = "") -> Path:
    """PNG of static and dynamic bits per token against position, and their difference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastweights.checkpoint import atomic_write

    path = Path(path)
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    ax.plot(result["position"], result["static_bits"], label="static")
    ax.plot(result["position"], result["dynamic_bits"], label="dynamic")
    ax.set_ylabel(f"bits per token (window {result['window']})")
    ax.set_title(title or f"loss against position, {result['documents']} documents")
    ax.legend()
    ax.grid(alpha=0.3)
    ax2.plot(result["position"], result["advantage_bits"], color="C2")
    ax2.axhline(0, color="k", lw=0.5)
    ax2.set_xlabel("tokens processed")
    ax2.set_ylabel("static - dynamic")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    atomic_write(path, lambda p: fig.savefig(p, dpi=120, format="png"))
    plt.close(fig)
    return path
