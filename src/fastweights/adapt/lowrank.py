"""Low-rank dynamic evaluation: adapt a rank-r delta on each MLP projection instead of the weights.

Every selected linear map y = W x (+ b) of the model (by default the MLP projections: gate/up/down
of a SwiGLU block, ``mlp.*``) becomes

    y = (W + A B) x (+ b) = W x (+ b) + A (B x),      A: [out, r], B: [r, in]

with A initialised to ZERO, so the starting model is the pretrained one bit for bit, and B a fixed
random projection (Gaussian, std 1 / sqrt(in), drawn from ``seed``). Only the A's are dynamically
evaluated, by the same protocol and update rules as full dynamic evaluation (``adapt.dynamic``:
score a segment, then theta^i = update(theta^{i-1}, g_i) with theta = the A's, theta_g = 0); MS_g
for the RMS rules is collected the same way as for the full weights, on generic text at A = 0
(:func:`collect_lowrank_grad_stats`). The base weights are frozen.

This is LoRA's parametrisation (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models",
arXiv 2106.09685: W + B A with one factor zero-initialised) with the random factor frozen, as in
LoRA-FA (Zhang et al., arXiv 2308.03303). Freezing B keeps the delta linear in what is adapted, and
keeps MS_g meaningful: at A = 0 the gradient of a trainable B would be exactly zero (dL/dB = A^T
dL/dy x^T), so its MS_g would be 0 and the RMS step 1 / (sqrt(MS_g) + eps) would blow up. The
delta lives in the row space of B: rank r, r (out) parameters per projection instead of out x in.

Implementation: forward hooks on the selected modules add ``(x B^T) A^T`` to their output (A of
shape [out, r], or [docs, out, r] for :meth:`evaluate_batch`, one delta per document, no weight
copies). ``nn.Linear`` and the transformers ``Conv1D`` (GPT-2: weight [in, out]) are supported.
"""

from __future__ import annotations

import contextlib
import fnmatch
from typing import Sequence

import torch
from torch import nn

from fastweights.adapt.dynamic import DynamicEvaluator
from fastweights.adapt.grad_stats import GradStats, accumulate_grad_stats
from fastweights.adapt.parameter_selection import frozen_weights, glob_patterns
from fastweights.adapt.stream_state import logits_and_state
from fastweights.adapt.update_rules import (DEFAULT_DECAY, DEFAULT_EPS, DEFAULT_LR, DEFAULT_RULE, DEFAULT_SEGMENT_LEN,
                                            DEFAULT_STATS_BATCH_SIZE)
from fastweights.core.errors import UserError

DEFAULT_MODULES = "*mlp.*"  # the MLP projections (ours: blocks.i.mlp.gate_up/down; Llama: mlp.gate/up/down_proj)
DEFAULT_RANK = 8


def _in_out(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) features of a linear map, or None when ``module`` is not one."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):  # transformers' GPT-2 linear: x @ W, W [in, out]
        return int(module.weight.shape[0]), int(module.nf)
    return None


def lowrank_name(module_name: str) -> str:
    return f"lowrank.{module_name}.A"


class LowRankAdaptation:
    """The hooks y += A (B x) on every linear map of ``model`` whose name matches ``modules``.

    Args:
        modules: glob patterns on module names (a list or comma-separated), default the MLP projections.
        rank: r. seed: the random generator of the fixed factors B.
    ``names`` / ``shapes``: the A's, in order. Use ``with adaptation.attached(As):`` with As a list
    of [out, r] (shared by the batch) or [docs, out, r] tensors.
    """

    def __init__(self, model: nn.Module, modules: Sequence[str] | str | None = DEFAULT_MODULES, rank: int = DEFAULT_RANK,
                 seed: int = 0):
        if rank < 1:
            raise UserError(f"low-rank rank must be >= 1, got {rank}")
        pats = glob_patterns(modules) or [DEFAULT_MODULES]
        p0 = next(model.parameters())
        dtype = torch.float64 if p0.dtype == torch.float64 else torch.float32
        gen = torch.Generator().manual_seed(seed)
        self.modules: list[nn.Module] = []
        self.names: list[str] = []
        self.shapes: list[tuple[int, int]] = []
        self.B: list[torch.Tensor] = []
        matched = [(name, mod, io) for name, mod in model.named_modules()
                   if (io := _in_out(mod)) is not None and any(fnmatch.fnmatchcase(name, p) for p in pats)]
        if not matched:
            raise UserError(f"low-rank adaptation: no linear module matches {modules!r}; module names look like "
                            f"{next((n for n, _ in model.named_modules() if n), '?')!r}")
        # a rank above min(in, out) of every adapted projection adds nothing (A B has at most that rank): refused
        # before the fixed factors B [rank, in] are allocated
        widest = max(min(io) for _, _, io in matched)
        if rank > widest:
            raise UserError(f"--lowrank-rank {rank} exceeds the model's dimensions: the adapted projections "
                            f"({matched[0][0]}, ...) have rank at most {widest}; choose 1..{widest}")
        for name, mod, (fan_in, fan_out) in matched:
            self.modules.append(mod)
            self.names.append(lowrank_name(name))
            self.shapes.append((fan_out, rank))
            self.B.append((torch.randn(rank, fan_in, generator=gen, dtype=torch.float64) / fan_in ** 0.5)
                          .to(device=p0.device, dtype=dtype))
        self.rank = rank
        self.A: list[torch.Tensor] | None = None
        self.dtype = dtype

    def _hook(self, i: int):
        def hook(module, inputs, output):
            x = inputs[0]  # [B, T, in]
            A = self.A[i]
            z = x @ self.B[i].to(x.dtype).transpose(0, 1)  # [B, T, r]
            if A.dim() == 3:  # one A per sequence
                delta = torch.einsum("btr,bor->bto", z, A.to(x.dtype))
            else:
                delta = z @ A.to(x.dtype).transpose(0, 1)
            return output + delta.to(output.dtype)
        return hook

    @contextlib.contextmanager
    def attached(self, As: Sequence[torch.Tensor]):
        self.A = list(As)
        handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(self.modules)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
            self.A = None

    def zeros(self, requires_grad: bool = False) -> list[torch.Tensor]:
        dev = self.B[0].device
        return [torch.zeros(s, dtype=self.dtype, device=dev, requires_grad=requires_grad) for s in self.shapes]


def collect_lowrank_grad_stats(model: nn.Module, train_tokens, modules=DEFAULT_MODULES, rank: int = DEFAULT_RANK,
                               seed: int = 0, batch_size: int = DEFAULT_STATS_BATCH_SIZE,
                               seq_len: int = DEFAULT_SEGMENT_LEN,
                               max_batches: int | None = None, context: int | None = None,
                               progress: bool = False) -> GradStats:
    """MS_g of the A's at A = 0 on training tokens (see ``collect_grad_stats``); same ``modules``,
    ``rank`` and ``seed`` as the evaluator (the B's must match)."""
    adaptation = LowRankAdaptation(model, modules, rank, seed)
    As = adaptation.zeros(requires_grad=True)
    with frozen_weights(model), adaptation.attached(As):
        stats = accumulate_grad_stats(lambda x, s: logits_and_state(model(x, s)), As, adaptation.names, train_tokens,
                                      batch_size, seq_len, context, max_batches, model=model, progress=progress)
    stats.extra.update(lowrank_rank=rank, lowrank_seed=seed, lowrank_modules=",".join(glob_patterns(modules) or []))
    return stats


class LowRankDynamicEvaluator(DynamicEvaluator):
    """Dynamic evaluation of rank-r deltas A B on the selected linear maps (API of :class:`DynamicEvaluator`).

    Args: as :class:`DynamicEvaluator` (no include/exclude), plus ``modules`` (glob patterns on module
    names, default the MLP projections), ``rank`` and ``seed`` (the fixed B's). The state's
    ``values`` are the A's (theta_g = 0: the deltas are the A's themselves).
    """

    def __init__(self, model: nn.Module, rule: str = DEFAULT_RULE, lr: float = DEFAULT_LR,
                 decay: float = DEFAULT_DECAY, eps: float = DEFAULT_EPS, segment_len: int = DEFAULT_SEGMENT_LEN,
                 context: int | None = None, modules=DEFAULT_MODULES, rank: int = DEFAULT_RANK, seed: int = 0,
                 grad_stats: GradStats | str | None = None, lr_schedule: str | None = None):
        self._lowrank = (modules, rank, seed)
        super().__init__(model, rule, lr, decay, eps, segment_len, context, grad_stats=grad_stats,
                         lr_schedule=lr_schedule)

    def _setup(self, include, exclude) -> None:
        self.adaptation = LowRankAdaptation(self.model, *self._lowrank)
        self.names = list(self.adaptation.names)
        self.theta_g = self.adaptation.zeros()  # A starts at 0
        self.params = {}

    def metadata(self) -> dict:
        modules, rank, seed = self._lowrank
        return {**super().metadata(), "lowrank_modules": ",".join(glob_patterns(modules) or []), "lowrank_rank": rank,
                "lowrank_seed": seed, "lowrank_projections": len(self.names)}

    @contextlib.contextmanager
    def _session(self, values):
        src = values if values is not None else self.theta_g
        As = [a.clone().requires_grad_(True) for a in src]

        def forward(x, state):
            return logits_and_state(self.model(x, state))

        with frozen_weights(self.model), self.adaptation.attached(As):
            yield forward, As, As, (lambda: None), (lambda: [a.detach().clone() for a in As])

    @contextlib.contextmanager
    def _batched_forward(self):
        def forward(values, x, state):
            self.adaptation.A = list(values)  # [docs, out, r] each: one delta per document
            return logits_and_state(self.model(x, state))

        with frozen_weights(self.model), self.adaptation.attached(self.theta_g):
            yield forward
