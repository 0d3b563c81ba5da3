"""Sparse dynamic evaluation: adapt only a small matrix acting on a few hidden units.

Krause et al., "Dynamic Evaluation of Neural Sequence Models", ICML 2018, section 6 (eq. 9). An
adaptation matrix M (H x H, initialised to zero) transforms a chosen subset S of H hidden units:

    h'_t[S] = h_t[S] + M h_t[S]        (the other units pass unchanged)

h' replaces h everywhere downstream. Only M is dynamically evaluated, with the base weights frozen,
using the same protocol and update rules as full dynamic evaluation (``adapt.dynamic``); MS_g for M
is collected from training gradients at M = 0 (:func:`collect_sparse_grad_stats`). The paper
adapted 500 of an mLSTM's 2800 units (250k parameters, 0.5% of the model).

Here h is the output of one decoder block (the residual stream after block ``layer``; for a
Transformer this changes what every later block computes and what later tokens attend to), and S
is the first ``units`` units unless an index list is given. Each sequence has its own M
([B, H, H]), so many documents are adapted in one ordinary batched forward, with no weight copies.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch
from torch import nn

from fastweights.adapt.dynamic import DynamicEvaluator
from fastweights.adapt.grad_stats import GradStats, accumulate_grad_stats
from fastweights.adapt.parameter_selection import frozen_weights
from fastweights.adapt.stream_state import logits_and_state
from fastweights.adapt.update_rules import (DEFAULT_DECAY, DEFAULT_EPS, DEFAULT_LR, DEFAULT_RULE, DEFAULT_SEGMENT_LEN,
                                            DEFAULT_STATS_BATCH_SIZE)
from fastweights.core.errors import UserError


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The blocks of ``model``: ``model.blocks`` (ours) or ``model.layers`` (the Hugging Face adapter)."""
    for attr in ("blocks", "layers"):
        layers = getattr(model, attr, None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise UserError(f"sparse dynamic evaluation needs a model with .blocks or .layers, got {type(model).__name__}")


class SparseAdaptation:
    """The hook h' = h + M h on units ``index`` of the output of ``decoder_layers(model)[layer]``.

    Args:
        model: our LanguageModel or an ``hf.transformers_as_ours.HFCausalLM``.
        layer: block index (negative counts from the end).
        units: H (the first H units) or an explicit list of unit indices.
    Use ``with adaptation.attached(M):`` where M is [H, H] (shared by the batch) or [B, H, H].
    """

    def __init__(self, model: nn.Module, layer: int, units: int | Sequence[int]):
        layers = decoder_layers(model)
        if not -len(layers) <= layer < len(layers):
            raise UserError(f"sparse layer {layer} out of range for a model with {len(layers)} blocks")
        self.layer = layer % len(layers)
        self.module = layers[self.layer]
        width = _hidden_width(model)
        if isinstance(units, int):
            if not 0 < units <= width:
                raise UserError(f"sparse units must be in 1..{width}, got {units}")
            index = torch.arange(units)
        else:
            index = torch.as_tensor(list(units), dtype=torch.long)
            if index.numel() == 0 or index.unique().numel() != index.numel() or index.min() < 0 or index.max() >= width:
                raise UserError(f"sparse unit indices must be distinct and in 0..{width - 1}")
        self.index = index.to(next(model.parameters()).device)
        self.units = int(index.numel())
        self.M: torch.Tensor | None = None

    def _hook(self, module, inputs, output):
        h = output[0] if isinstance(output, tuple) else output  # [B, T, d]
        sub = h.index_select(-1, self.index)  # [B, T, H]
        M = self.M.to(sub.dtype)
        if M.dim() == 3:  # one M per sequence: (M_b h_t)_k = sum_j M_b[k, j] h_t[j]
            delta = torch.einsum("btj,bkj->btk", sub, M)
        else:
            delta = sub @ M.transpose(0, 1)
        h = h.index_add(-1, self.index, delta)  # h'[S] = h[S] + M h[S]
        return (h, *output[1:]) if isinstance(output, tuple) else h

    @contextlib.contextmanager
    def attached(self, M: torch.Tensor):
        self.M = M
        handle = self.module.register_forward_hook(self._hook)
        try:
            yield self
        finally:
            handle.remove()
            self.M = None


def _hidden_width(model: nn.Module) -> int:
    cfg = getattr(model, "config", None)
    d = getattr(cfg, "d_model", None)
    if d is None and hasattr(model, "hf"):
        d = getattr(model.hf.config, "hidden_size", None) or getattr(model.hf.config, "n_embd", None)
    if d is None:
        raise UserError(f"cannot tell the hidden width of {type(model).__name__}")
    return int(d)


def sparse_name(layer: int) -> str:
    return f"sparse.{layer}.M"


def collect_sparse_grad_stats(model: nn.Module, train_tokens, layer: int, units: int | Sequence[int],
                              batch_size: int = DEFAULT_STATS_BATCH_SIZE, seq_len: int = DEFAULT_SEGMENT_LEN,
                              max_batches: int | None = None,
                              context: int | None = None, progress: bool = False) -> GradStats:
    """MS_g of the adaptation matrix M at M = 0 on training tokens (see ``collect_grad_stats``)."""
    adaptation = SparseAdaptation(model, layer, units)
    dtype = torch.float64 if next(model.parameters()).dtype == torch.float64 else torch.float32
    M = torch.zeros(adaptation.units, adaptation.units, dtype=dtype, device=adaptation.index.device, requires_grad=True)
    with frozen_weights(model), adaptation.attached(M):
        stats = accumulate_grad_stats(lambda x, s: logits_and_state(model(x, s)), [M], [sparse_name(adaptation.layer)],
                                      train_tokens, batch_size, seq_len, context, max_batches, model=model,
                                      progress=progress)
    stats.extra.update(sparse_layer=adaptation.layer, sparse_units=adaptation.index.tolist())
    return stats


class SparseDynamicEvaluator(DynamicEvaluator):
    """Dynamic evaluation of the sparse adaptation matrix only (same API as :class:`DynamicEvaluator`).

    Args: as :class:`DynamicEvaluator`, plus ``layer`` (block whose output is adapted, default the
    middle one) and ``units`` (H or a list of unit indices, default half the width). The state's
    ``values`` is ``[M]``; ``evaluate_batch`` runs the documents as one ordinary batch, M [B, H, H].
    """

    def __init__(self, model: nn.Module, rule: str = DEFAULT_RULE, lr: float = DEFAULT_LR,
                 decay: float = DEFAULT_DECAY, eps: float = DEFAULT_EPS, segment_len: int = DEFAULT_SEGMENT_LEN,
                 context: int | None = None, layer: int | None = None, units: int | Sequence[int] | None = None,
                 grad_stats: GradStats | str | None = None, lr_schedule: str | None = None):
        n_layers = len(decoder_layers(model))
        self._layer = n_layers // 2 if layer is None else layer
        self._units = _hidden_width(model) // 2 if units is None else units
        super().__init__(model, rule, lr, decay, eps, segment_len, context, grad_stats=grad_stats,
                         lr_schedule=lr_schedule)

    def _setup(self, include, exclude) -> None:
        self.adaptation = SparseAdaptation(self.model, self._layer, self._units)
        H = self.adaptation.units
        dtype = torch.float64 if next(self.model.parameters()).dtype == torch.float64 else torch.float32
        self.names = [sparse_name(self.adaptation.layer)]
        self.theta_g = [torch.zeros(H, H, dtype=dtype, device=self.device)]  # M starts at 0
        self.params = {}

    def metadata(self) -> dict:
        return {**super().metadata(), "sparse_layer": self.adaptation.layer, "sparse_units": self.adaptation.units}

    @contextlib.contextmanager
    def _session(self, values):
        M = (values[0] if values is not None else self.theta_g[0]).clone().requires_grad_(True)

        def forward(x, state):
            return logits_and_state(self.model(x, state))

        with frozen_weights(self.model), self.adaptation.attached(M):
            yield forward, [M], [M], (lambda: None), (lambda: [M.detach().clone()])

    @contextlib.contextmanager
    def _batched_forward(self):
        def forward(values, x, state):
            self.adaptation.M = values[0]  # [B, H, H]: one matrix per document
            return logits_and_state(self.model(x, state))

        with frozen_weights(self.model), self.adaptation.attached(self.theta_g[0]):
            yield forward
