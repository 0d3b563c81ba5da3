"""The decoder-only language model every mechanism plugs into.

    tokens -> embedding -> N x Block -> RMSNorm -> head -> logits

    Block(x) = x + conv(x)               (optional short causal convolution, ``model.short_conv``)
             = x + memory(norm(x))       (optional, memories placed "before_mixer", e.g. FwPKM)
             = x + mixer(norm(x))        (softmax attention, fast weight programmer, RNN, ...)
             = x + mlp(norm(x))          (SwiGLU, or a memory placed "replace_mlp", e.g. PKM)

Every part follows the explicit-state protocol ``y, state = part(x, state)``; the model's state
is ``{"layers": [{"conv": ..., "mixer": ..., "memory": ...}, ...], "head": ...}`` so that

    model(tokens[:, :t]) then model(tokens[:, t:], state)  ==  model(tokens)

Blocks take their parts as modules (built from the config by name through the registry), so a
hybrid is one config line: ``layer_mixers = ["attention", "fwp", "attention", "fwp"]``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fastweights.checkpoints.format import load_model_as, save_model
from fastweights.core.config import ModelConfig, from_dict
from fastweights.core.errors import UserError
from fastweights.layers.common import RMSNorm, ShortConv, SwiGLU, swiglu_hidden
from fastweights.ops.linear import linear
from fastweights.ops.linear_cross_entropy import linear_cross_entropy
from fastweights.ops.nll import upcast_logits
from fastweights.components import (
    HEADS,
    MEMORIES,
    MIXERS,
    PLACEMENTS,
    AuxLoss,
    Memory,
    TrimsState,
    build_options,
    call_part,
    lookup,
)


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [B, T, V]
    loss: torch.Tensor | None  # mean next-token cross-entropy (nats) when targets are given
    state: dict  # pass back in to continue the sequence
    aux_loss: torch.Tensor | None = None  # sum of auxiliary training losses of the parts (e.g. addressing loss)


class Block(nn.Module):
    """Pre-norm residual block; its parts are injected."""

    def __init__(self, d_model: int, mixer: nn.Module, mlp: nn.Module, memory: nn.Module | None = None,
                 short_conv: nn.Module | None = None):
        super().__init__()
        self.short_conv = short_conv
        self.mixer_norm = RMSNorm(d_model)
        self.mixer = mixer
        self.mlp_norm = RMSNorm(d_model)
        self.mlp = mlp
        self.memory = memory
        if memory is not None and not (isinstance(memory, Memory) and memory.placement in PLACEMENTS):
            raise ValueError(f"memory {type(memory).__name__} must set placement to one of {PLACEMENTS}")
        self.memory_placement = memory.placement if memory is not None else None
        self.memory_norm = RMSNorm(d_model) if self.memory_placement == "before_mixer" else None

    def forward(self, x: torch.Tensor, state: dict | None = None, attention_mask: torch.Tensor | None = None):
        """``attention_mask`` [B, T] bool (True = real token) or None (no padding): handed to every part that
        carries state (the short convolution, the memory, the mixer); the MLP reads each position alone."""
        state = state or {}
        new_state = {}
        mask = attention_mask
        if self.short_conv is not None:
            y, new_state["conv"] = call_part(self.short_conv, x, state.get("conv"), attention_mask=mask)
            x = x + y
        if self.memory_placement == "before_mixer":
            y, new_state["memory"] = call_part(self.memory, self.memory_norm(x), state.get("memory"),
                                               attention_mask=mask)
            x = x + y
        y, new_state["mixer"] = call_part(self.mixer, self.mixer_norm(x), state.get("mixer"), attention_mask=mask)
        x = x + y
        if self.memory_placement == "replace_mlp":
            y, new_state["memory"] = call_part(self.memory, self.mlp_norm(x), state.get("memory"),
                                               attention_mask=mask)
        else:
            y = self.mlp(self.mlp_norm(x))
        return x + y, new_state


class LinearHead(nn.Module):
    """logits = h W^T; W may be the (tied) token embedding's weight."""

    def __init__(self, d_model: int, vocab_size: int, tied_to: nn.Embedding | None = None):
        super().__init__()
        if tied_to is None:
            self.weight = nn.Parameter(torch.empty(vocab_size, d_model))
        # a list, so the embedding is not registered twice; its weight is read at call time because
        # wrappers such as FSDP replace parameters after construction
        self.tied_to = [tied_to] if tied_to is not None else None

    def output_weight(self) -> torch.Tensor:
        """W [V, d]: the tied embedding's weight, read at call time, or the head's own."""
        return self.tied_to[0].weight if self.tied_to is not None else self.weight

    def forward(self, h: torch.Tensor, tokens: torch.Tensor | None = None, state=None, attention_mask=None):
        # position by position: padding changes nothing here
        return linear(h, self.output_weight()), None


def _layer_state(state: dict | None, i: int):
    return state["layers"][i] if state is not None else None


class LanguageModel(nn.Module):
    """Decoder-only LM assembled from a :class:`ModelConfig`.

    ``forward(tokens [B, T], state=None, targets=None, attention_mask=None, return_logits=True) ->
    ModelOutput(logits [B, T, V], loss, state)``

    ``return_logits=False`` with targets (training, which reads the loss only): no logits (``None``) and, for the
    linear head, the loss of ``ops.linear_cross_entropy``, which never holds the [B, T, V] logits (their fp32
    copies are most of a large-vocabulary step's memory); equal to the default path's loss and gradients.

    ``attention_mask`` [B, T] (1 / True = real token, 0 = padding, e.g. a left-padded batch of prompts):
    every part is handed it (``components.call_part``), and a masked position is written into no state,
    moves no position and no normaliser, and its logits are meaningless; the real positions of each row
    get the logits, and the returned state the continuation, that the row's real tokens get alone
    (``tests/contracts/test_padding.py``). Targets at masked positions are ignored in the loss. A mask
    without zeros is the same as none (the unpadded code runs).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.vocab_size <= 0:
            raise UserError("model.vocab_size must be set (it is filled from the tokenizer by the trainer)")
        if config.layer_mixers and len(config.layer_mixers) != config.n_layers:
            raise UserError(
                f"model.layer_mixers has {len(config.layer_mixers)} entries but model.n_layers = {config.n_layers}"
            )
        if config.short_conv < 0 or config.short_conv == 1:
            raise UserError(f"model.short_conv must be 0 (none) or a width >= 2, got {config.short_conv}")
        bad = [i for i in config.memory_layers if not 0 <= i < config.n_layers]
        if bad:
            raise UserError(f"model.memory_layers {bad} out of range for {config.n_layers} layers")
        if config.memory_layers and not config.memory:
            raise UserError("model.memory_layers is set but model.memory names no memory")
        self.config = config
        d = config.d_model
        self.embed = nn.Embedding(config.vocab_size, d)
        self.drop = nn.Dropout(config.dropout)
        blocks = []
        for i in range(config.n_layers):
            mixer = self._build(MIXERS, "mixer", config.mixer_of(i), d_model=d, n_heads=config.n_heads)
            memory = None
            if i in config.memory_layers:
                memory = self._build(MEMORIES, "memory", config.memory, d_model=d)
            mlp = SwiGLU(d, swiglu_hidden(d, config.mlp_hidden))
            if memory is not None and memory.placement == "replace_mlp":
                mlp = nn.Identity()
            conv = ShortConv(d, config.short_conv) if config.short_conv else None
            blocks.append(Block(d, mixer, mlp, memory, conv))
        self.blocks = nn.ModuleList(blocks)
        self.norm = RMSNorm(d)
        tied = self.embed if config.tie_embeddings else None
        if config.head == "linear":
            self.head = LinearHead(d, config.vocab_size, tied)
        else:
            self.head = self._build(HEADS, "head", config.head, d_model=d, vocab_size=config.vocab_size)
        self.apply(self._init_weights)
        # parts that report an auxiliary training loss (components.AuxLoss: ``aux_loss`` set in __init__);
        # found once here rather than by walking every module on each forward call
        self._aux_parts = [m for m in self.modules() if m is not self and isinstance(m, AuxLoss)]
        if not config.tie_embeddings and config.head == "linear":
            nn.init.normal_(self.head.weight, std=config.init_std)

    def _build(self, table, kind, name, **kwargs):
        entry = lookup(table, kind, name)
        options = build_options(entry, self.config.options.get(name))
        return entry.cls(**kwargs, options=options) if options is not None else entry.cls(**kwargs)

    def _init_weights(self, module: nn.Module):
        std = self.config.init_std
        if isinstance(module, nn.Linear):
            if getattr(module, "is_residual_proj", False):
                std = std / math.sqrt(2 * self.config.n_layers)  # GPT-2: keep the residual stream's variance flat
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)

    def num_parameters(self, exclude_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if exclude_embedding else n

    def forward(self, tokens: torch.Tensor, state: dict | None = None, targets: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, return_logits: bool = True) -> ModelOutput:
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [B, T], got shape {tuple(tokens.shape)}")
        mask = padding_mask(attention_mask, tokens.shape)
        x = self.drop(self.embed(tokens))  # [B, T, C]
        layer_states = []
        for i, block in enumerate(self.blocks):
            x, s = block(x, _layer_state(state, i), attention_mask=mask)
            layer_states.append(s)
        h = self.norm(x)
        if targets is not None and mask is not None:
            targets = targets.masked_fill(~mask, -100)
        if not return_logits and targets is not None and isinstance(self.head, LinearHead):
            # the linear head's loss without its logits: the head itself is h W^T, and it keeps no state
            loss = linear_cross_entropy(h, self.head.output_weight(), targets, ignore_index=-100)
            logits, head_state = None, None
        else:
            logits, head_state = call_part(self.head, h, tokens, state["head"] if state is not None else None,
                                           attention_mask=mask)
            loss = None
            if targets is not None:
                loss = F.cross_entropy(upcast_logits(logits).flatten(0, 1), targets.flatten(), ignore_index=-100)
        aux = [m.aux_loss for m in self._aux_parts if m.aux_loss is not None]
        aux_loss = torch.stack(aux).sum() if aux else None
        return ModelOutput(logits, loss, {"layers": layer_states, "head": head_state}, aux_loss)

    def trim_state(self, state: dict, keep: int) -> dict:
        """Bound the context of parts whose state grows with the sequence (a KV cache) to ``keep`` tokens.

        Parts with a constant-size state (fast weight matrices, RNN states) are left as they are, so
        streaming evaluation carries them over the whole document.
        """
        layers = []
        for block, s in zip(self.blocks, state["layers"]):
            s = dict(s)
            if isinstance(block.mixer, TrimsState):
                s["mixer"] = block.mixer.trim_state(s["mixer"], keep)
            layers.append(s)
        return {**state, "layers": layers}

    # ------------------------------------------------------------------ save / load

    def save_pretrained(self, directory: str | Path) -> None:
        """Write ``config.json`` and ``model.safetensors`` into ``directory`` (created if needed)."""
        save_model(self, Path(directory))

    @classmethod
    def from_pretrained(cls, directory: str | Path, map_location: str = "cpu") -> "LanguageModel":
        return load_model_as(LanguageModel, Path(directory), map_location=map_location)


def padding_mask(attention_mask: torch.Tensor | None, shape) -> torch.Tensor | None:
    """``attention_mask`` [B, T] (1 / True = real token) as a bool tensor, or None when it has no zero (no
    padding: the unpadded code runs, bit for bit)."""
    if attention_mask is None:
        return None
    if tuple(attention_mask.shape) != tuple(shape):
        raise ValueError(f"attention_mask must be [B, T] = {tuple(shape)}, got {tuple(attention_mask.shape)}")
    mask = attention_mask.bool()
    return None if bool(mask.all()) else mask


def model_config_from_json(path: Path) -> ModelConfig:
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read model config {path}: {e}") from None
    return from_dict(ModelConfig, d.get("model", d), prefix="model")


def detach_state(state):
    """Cut the autograd graph of a state (truncated BPTT across segments); non-tensors pass through."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, state)
