"""Gradient statistics of the RMS update rules: MS_g, collected on training text and kept in a file.

Krause et al. 2018 (arXiv 1709.07432); the rules that divide by it are :mod:`fastweights.adapt.update_rules`
(eqs 6-8):

    MS_g     = (1 / N_b) sum_k (grad L_k)^2    elementwise, over N_b TRAINING batches               (5)

MS_g is collected by :func:`collect_grad_stats` in ``eval()`` mode on training text at a given batch size
and segment length (the batch size is itself a hyper-parameter: larger batches give smaller mean squared
gradients); :func:`accumulate_grad_stats` is its loop, which the sparse and low-rank adaptations call
with their own leaves. :class:`GradStats` holds MS_g with the settings that produced it and writes it
as a safetensors file (:data:`GRAD_STATS_FILE` beside a checkpoint); :data:`UNITS` is what a result file
records of the units.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from fastweights.adapt.parameter_selection import select_parameters
from fastweights.adapt.stream_state import as_token_stream, carry_state, logits_and_state
from fastweights.adapt.update_rules import DEFAULT_SEGMENT_LEN, DEFAULT_STATS_BATCH_SIZE
from fastweights.core.errors import UserError
from fastweights.core.progress import Progress
from fastweights.ops.nll import token_nll

GRAD_STATS_FILE = "grad_stats.safetensors"
UNITS = ("paper equations: MS_g = mean over training batches of the squared gradient of the batch-mean "
         "cross-entropy; step g / (sqrt(MS_g) + eps); RMS_norm = sqrt(MS_g) / (mean over tensors of the "
         "per-tensor mean of sqrt(MS_g)), clipped to 1/lambda; gradients of the segment-mean cross-entropy")


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


def accumulate_grad_stats(forward: Callable, leaves: list[torch.Tensor], names: list[str], train_tokens,
                          batch_size: int, seq_len: int, context: int | None, max_batches: int | None, *,
                          model: torch.nn.Module | None = None, progress: bool) -> GradStats:
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
