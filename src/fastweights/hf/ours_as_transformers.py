"""Our model out to Hugging Face: fastweights models as ``transformers`` causal LMs.

    import fastweights.hf.ours_as_transformers        # registers "fastweights" with the Auto classes
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("exported-dir")   # a FastWeightsForCausalLM
    tok = AutoTokenizer.from_pretrained("exported-dir")
    out = model.generate(**tok("ROMEO:", return_tensors="pt"), max_new_tokens=50, do_sample=False)

(``fastweights export-hf CHECKPOINT DIR`` writes such a directory; without this import, pass
``trust_remote_code=True`` to both ``from_pretrained`` calls; plain ``import fastweights`` does not register, to stay
light; see :mod:`fastweights.hf.export`.)

- :class:`FastWeightsConfig` (``model_type = "fastweights"``) carries every field of
  :class:`fastweights.core.config.ModelConfig` (same names, same defaults), so any mixer, head or memory
  in the registry, with its ``options`` tables, round-trips through ``config.json``.
- :class:`FastWeightsForCausalLM` wraps :class:`fastweights.models.lm.LanguageModel` as ``self.model``
  (the state-dict keys are the LanguageModel's with a ``model.`` prefix), so the wrapped model can
  be handed to any fastweights tool unchanged.
- The generation cache is :class:`FastWeightsCache`: it holds the model's explicit state
  ``{"layers": [...], "head": ...}`` (fast-weight matrices, RNN states, KV caches of attention
  layers) and the number of tokens it has read. ``generate()`` feeds the prompt once, then one token
  per step, carrying that state, exactly as :func:`fastweights.loops.generate.generate_tokens` does, so
  greedy decoding gives the same tokens.

Differences from a Transformer-with-KV-cache that a user may meet:

- The state is not a list of keys and values: it cannot be cropped (assisted/speculative decoding is
  refused, as for other stateful models).
- Padding: an ``attention_mask`` with zeros (a left-padded batch of prompts, as ``generate()``, a
  ``pipeline(..., batch_size=8)`` or batched scoring pass it) is handed to the model, whose every part
  leaves padding out of its state and positions (``LanguageModel.forward``), so each row generates and
  scores what it does alone. generate() passes the mask of everything read so far; the model takes the
  columns of the new tokens (``attention_mask[:, -T:]``), the state remembering the rest. A fast memory
  shared by the batch (FwPKM or FwMLP unless ``persistence = "per_sequence"``) refuses rows padded
  differently (one memory for the batch: no row reads it alone).
- Beam search reorders the state along the batch; this needs every state tensor to be per-sequence
  (leading dimension = batch). A memory whose state is not (FwPKM in any persistence mode, whose
  value table is shared or flattened over the batch; FwMLP unless ``persistence = "per_sequence"``)
  is refused with a clear error. Batch generation with a shared memory lets the sequences of the
  batch write into one memory, as in training.
- ``labels`` follow the Hugging Face convention (the same ids as ``input_ids``, shifted inside);
  the returned ``loss`` is the next-token cross-entropy plus the parts' auxiliary loss, the
  objective ``fastweights train`` optimises.
- ``output_attentions`` / ``output_hidden_states`` are not available (most mixers have no
  attention matrix).
- ``config.attention_context`` (set to the training ``seq_len`` by export-hf) bounds what attention
  layers keep in the cache, as ``fastweights generate`` does; 0 keeps everything.

Loading: ``from_pretrained`` builds the model on the CPU (not on the meta device, because the parts
compute values at construction that are not in the weights file, e.g. rotary frequencies) and then
loads the weights over it, as :func:`fastweights.models.loading.load_model` does.

``transformers`` is the optional ``[hf]`` extra; importing this module without it raises a
one-line :class:`~fastweights.core.errors.UserError`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from fastweights.core.config import ModelConfig, from_dict
from fastweights.core.errors import UserError
from fastweights.layers.fast_memory import PerRowState
from fastweights.models.lm import LanguageModel
from fastweights.ops.nll import upcast_logits

try:
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
    from transformers.cache_utils import Cache
    from transformers.modeling_outputs import CausalLMOutputWithPast
except ImportError as e:  # the optional [hf] extra
    raise UserError(f"this needs the optional package 'transformers' ({e}): pip install 'fastweights[hf]'") from None

MODEL_TYPE = "fastweights"
# transformers 5.24 renamed the cache argument and output field ``past_key_values`` -> ``cache`` (the old
# name stays a deprecated alias); generate() passes the new name, so forward takes both
_CACHE_FIELD = "cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"
_DEFAULTS = ModelConfig()  # FastWeightsConfig's defaults are ModelConfig's, never typed twice
_MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig))


class FastWeightsConfig(PretrainedConfig):
    """Hugging Face config of a fastweights language model.

    Fields are those of :class:`fastweights.core.config.ModelConfig` (``vocab_size``, ``d_model``,
    ``n_layers``, ``n_heads``, ``mlp_hidden``, ``mixer``, ``layer_mixers``, ``tie_embeddings``,
    ``dropout``, ``head``, ``memory``, ``memory_layers``, ``short_conv``, ``init_std``,
    ``options``) with the same defaults, plus the usual ``use_cache`` and ``bos/eos/pad_token_id``, and
    ``attention_context``: tokens of context an attention layer keeps in the returned cache
    (its KV cache is cut to the last ``attention_context - 1`` keys after every call, as
    ``fastweights generate`` does with the training ``seq_len``; export-hf sets it so); 0 (default)
    keeps them all. Fast-weight and RNN states are never cut. ``hidden_size``,
    ``num_hidden_layers`` and ``num_attention_heads`` are aliases of ``d_model``, ``n_layers``,
    ``n_heads``.
    """

    model_type = MODEL_TYPE
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {"hidden_size": "d_model", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads"}

    vocab_size: int = _DEFAULTS.vocab_size
    d_model: int = _DEFAULTS.d_model
    n_layers: int = _DEFAULTS.n_layers
    n_heads: int = _DEFAULTS.n_heads
    mlp_hidden: int = _DEFAULTS.mlp_hidden
    mixer: str = _DEFAULTS.mixer
    layer_mixers: list = field(default_factory=list)
    tie_embeddings: bool = _DEFAULTS.tie_embeddings
    dropout: float = _DEFAULTS.dropout
    head: str = _DEFAULTS.head
    memory: str = _DEFAULTS.memory
    memory_layers: list = field(default_factory=list)
    short_conv: int = _DEFAULTS.short_conv
    init_std: float = _DEFAULTS.init_std
    options: dict = field(default_factory=dict)
    use_cache: bool = True
    attention_context: int = 0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def to_model_config(self) -> ModelConfig:
        """The :class:`ModelConfig` these fields describe (checked: UserError on a wrong type)."""
        return from_dict(ModelConfig, {name: getattr(self, name) for name in _MODEL_FIELDS}, prefix="model")

    @classmethod
    def from_model_config(cls, model_config: ModelConfig, **kwargs) -> "FastWeightsConfig":
        """A config for ``model_config``; ``kwargs`` set the Hugging Face fields (e.g. ``eos_token_id``)."""
        return cls(**dataclasses.asdict(model_config), **kwargs)


class FastWeightsCache(Cache):
    """The generation cache of :class:`FastWeightsForCausalLM`: the model's explicit state.

    ``state``: ``{"layers": [...], "head": ...}`` as returned by ``LanguageModel.forward`` (None =
    nothing read yet); ``seen_tokens``: tokens read so far (what ``get_seq_length()`` reports, so
    ``generate()`` knows which part of ``input_ids`` is new); ``batch``: sequences in the state.

    The model updates the cache object it is given in place (as a ``DynamicCache`` is updated), so
    to branch from one prefix twice, pass ``copy.deepcopy(cache)``. ``crop`` is impossible (fast
    weights cannot be rolled back); ``reorder_cache`` (beam search) needs per-sequence states.
    """

    is_compileable = False  # the state is a Python tree of tensors that changes shape (KV caches)
    is_croppable = False

    def __init__(self, state: dict | None = None, seen_tokens: int = 0, batch: int = 0):
        super().__init__(layers=[])  # no per-layer KV objects: the whole state is one tree
        self.state = state
        self.seen_tokens = seen_tokens
        self.batch = batch

    def __repr__(self) -> str:
        return f"FastWeightsCache(seen_tokens={getattr(self, 'seen_tokens', 0)}, batch={getattr(self, 'batch', 0)})"

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1  # no bound: fast weights and RNN states have a constant size

    @property
    def is_linear(self) -> list[bool]:
        # generate() (transformers >= 5.24) cuts input_ids to the tokens the cache has not read only when
        # some cache layer is not "linear"; this cache has no layer objects (the state is one tree), so it
        # answers for one layer that needs the cut
        return [False]

    @property
    def batch_size(self) -> int:
        return self.batch if self.state is not None else -1

    @property
    def is_initialized(self) -> bool:
        return self.state is not None

    def update_state(self, state: dict, new_tokens: int, batch: int) -> None:
        self.state = state
        self.seen_tokens += new_tokens
        self.batch = batch

    def reset(self) -> None:
        self.state, self.seen_tokens, self.batch = None, 0, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a fast-weight state cannot be cropped (the writes of past tokens are not undone)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Select sequences ``beam_idx`` [batch] of the state (beam search)."""
        if beam_idx.numel() != self.batch:
            raise ValueError(f"reorder_cache needs {self.batch} indices, got {beam_idx.numel()}")
        self.state = select_sequences(self.state, beam_idx, self.batch)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("a FastWeightsCache cannot change its batch size; pass the prompt without a cache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("a FastWeightsCache cannot change its batch size; pass the prompt without a cache")


def select_sequences(state, index: torch.Tensor, batch: int):
    """The state tree with every tensor indexed along its leading (batch) dimension by ``index``.

    Raises ValueError when a tensor is not per-sequence (its leading dimension is not ``batch``), e.g.
    the shared memory of FwPKM or of FwMLP in "stream" persistence: such a state cannot follow beams.
    The test is by shape: a part whose shared tensors all happen to have ``batch`` rows passes it.
    """
    # a per-sequence fast memory after a padded call keeps one state per row (layers/fast_memory.PerRowState):
    # its rows are selected as rows
    state = tree_map(lambda s: PerRowState(tuple(s.rows[i] for i in index.tolist()))
                     if isinstance(s, PerRowState) else s, state, is_leaf=lambda s: isinstance(s, PerRowState))
    leaves, spec = tree_flatten(state, is_leaf=lambda s: isinstance(s, PerRowState))
    out = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if leaf.dim() == 0 or leaf.shape[0] != batch:
                raise ValueError(
                    f"the model state holds a tensor of shape {tuple(leaf.shape)} that is shared across the batch "
                    f"of {batch} (not per-sequence), so its sequences cannot be reordered (beam search); use greedy "
                    "or sampled decoding")
            out.append(leaf.index_select(0, index.to(leaf.device)))
        elif isinstance(leaf, PerRowState):
            out.append(leaf)
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            out.append(leaf)  # positions and flags: the same for every sequence of a generate() batch
        else:
            raise TypeError(f"cannot reorder a state part of type {type(leaf).__name__} (not a registered pytree)")
    return tree_unflatten(out, spec)


# Keyword arguments generate() and HF tooling may pass that carry nothing for this model: positions
# are kept by the state itself, and there are no token types.
_IGNORED_INPUTS = ("position_ids", "cache_position", "token_type_ids")


class FastWeightsForCausalLM(PreTrainedModel, GenerationMixin):
    """A fastweights :class:`LanguageModel` (``self.model``) as a Hugging Face causal LM.

    ``forward(input_ids [B, T], attention_mask=None, past_key_values=None, labels=None,
    use_cache=None, logits_to_keep=0) -> CausalLMOutputWithPast(loss, logits [B, T', V],
    past_key_values=FastWeightsCache)``.
    """

    config_class = FastWeightsConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _is_stateful = True  # generate() refuses assisted decoding, which needs to roll the cache back
    accepts_loss_kwargs = False  # the loss is a mean over the call's tokens: Trainer passes no num_items_in_batch

    def __init__(self, config: FastWeightsConfig, language_model: LanguageModel | None = None):
        super().__init__(config)
        model_config = config.to_model_config()
        if language_model is not None and language_model.config != model_config:
            raise ValueError("language_model.config differs from the FastWeightsConfig it is wrapped with")
        self.model = language_model if language_model is not None else LanguageModel(model_config)
        self._remember_derived_buffers()
        self.post_init()

    @classmethod
    def from_language_model(cls, language_model: LanguageModel, **config_kwargs) -> "FastWeightsForCausalLM":
        """Wrap an existing model (its weights are shared, not copied); ``config_kwargs`` as for
        :meth:`FastWeightsConfig.from_model_config` (e.g. ``eos_token_id``)."""
        config = FastWeightsConfig.from_model_config(language_model.config, **config_kwargs)
        model = cls(config, language_model=language_model)
        param = next(language_model.parameters(), None)
        return model.to(param.device) if param is not None else model

    # ------------------------------------------------------------------ construction / loading hooks

    @classmethod
    def get_init_context(cls, *args, **kwargs):
        # Build on the CPU with real values rather than on the meta device: the parts compute
        # non-persistent buffers (rotary frequencies) in their constructors and nowhere else.
        contexts = super().get_init_context(*args, **kwargs)
        return [c for c in contexts if not (isinstance(c, torch.device) and c.type == "meta")]

    def _remember_derived_buffers(self) -> None:
        """Keep a copy of each non-persistent buffer: ``from_pretrained`` replaces them with empty
        memory (they are not in the weights file)."""
        for module in self.modules():
            module._fastweights_buffer_values = {
                n: module._buffers[n].detach().clone()
                for n in module._non_persistent_buffers_set if module._buffers.get(n) is not None
            }

    @torch.no_grad()
    def _restore_derived_buffers(self, module: nn.Module) -> None:
        for name, value in getattr(module, "_fastweights_buffer_values", {}).items():
            buf = module._buffers.get(name)
            if buf is not None:
                buf.copy_(value)

    def _init_weights(self, module: nn.Module) -> None:
        # Parameters were initialised by LanguageModel (its own scheme, e.g. scaled residual
        # projections); only the derived buffers are put back.
        self._restore_derived_buffers(module)

    def tie_weights(self, *args, **kwargs):
        """Re-establish what loading weights replaces: the derived (non-persistent) buffers.
        ``from_pretrained`` calls this last. A tied head needs nothing: it holds the embedding module
        and reads its weight at call time, so a swapped Parameter object is seen."""
        super().tie_weights(*args, **kwargs)
        for module in self.modules():
            self._restore_derived_buffers(module)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the cache is our own state, created by the first forward

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embed = value
        self.tie_weights()

    def get_output_embeddings(self):
        return None  # heads differ (linear, tied, FWL); resizing the vocabulary is not supported

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int = 0,
        inputs_embeds: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        **kwargs,
    ):
        """Logits of ``input_ids`` [B, T] continuing the state in ``past_key_values`` (None = fresh).

        ``attention_mask`` [B, T'] (0 = padding; the last T columns are this call's tokens) leaves padding
        out of the state and the loss. ``labels`` [B, T] (-100 = ignored) give ``loss``; ``logits_to_keep``
        > 0 returns only the last that many positions; ``use_cache`` (default ``config.use_cache``) returns the state as
        ``past_key_values`` (the given cache, updated in place, or a new one).
        """
        if past_key_values is None:
            past_key_values = kwargs.pop("cache", None)  # the name generate() uses from transformers 5.24 on
        unexpected = sorted(k for k, v in kwargs.items() if v is not None and k not in _IGNORED_INPUTS)
        if unexpected:
            raise TypeError(f"FastWeightsForCausalLM.forward got unexpected arguments {unexpected}")
        if output_attentions or output_hidden_states:
            raise ValueError("fastweights models do not return attentions or hidden states")
        if inputs_embeds is not None:
            raise ValueError("fastweights models take input_ids, not inputs_embeds (some heads read the tokens)")
        if input_ids is None:
            raise ValueError("input_ids is required")
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[0] != input_ids.shape[0] \
                    or attention_mask.shape[1] < input_ids.shape[1]:
                raise ValueError(f"attention_mask must be [B, T'] with T' >= T covering input_ids "
                                 f"{tuple(input_ids.shape)}, got {tuple(attention_mask.shape)}")
            # generate() passes the mask of every token read so far: the state remembers the earlier columns
            attention_mask = attention_mask[:, attention_mask.shape[1] - input_ids.shape[1]:]
        use_cache = self.config.use_cache if use_cache is None else use_cache

        cache = past_key_values
        if cache is not None and not isinstance(cache, FastWeightsCache):
            if cache.get_seq_length() != 0:
                raise TypeError(f"past_key_values must be a FastWeightsCache, got a filled {type(cache).__name__}")
            cache = None  # an empty cache of another kind (e.g. made by a caller): start fresh
        state = cache.state if cache is not None else None
        if state is not None and cache.batch != input_ids.shape[0]:
            raise ValueError(f"the cache holds {cache.batch} sequences but input_ids has {input_ids.shape[0]}")

        out = self.model(input_ids, state, attention_mask=attention_mask)
        logits = out.logits  # [B, T, V]

        loss = None
        if labels is not None:
            if attention_mask is not None:
                labels = labels.masked_fill(attention_mask == 0, -100)  # padding is never a target
            # HF convention: position t predicts labels[t + 1]
            loss = F.cross_entropy(upcast_logits(logits[:, :-1]).flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
            if out.aux_loss is not None:
                loss = loss + out.aux_loss
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]

        new_cache = None
        if use_cache:
            state = out.state
            if self.config.attention_context > 0:
                state = self.model.trim_state(state, self.config.attention_context - 1)
            new_cache = cache if cache is not None else FastWeightsCache()
            new_cache.update_state(state, input_ids.shape[1], input_ids.shape[0])

        if return_dict is False:
            return tuple(x for x in (loss, logits, new_cache) if x is not None)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: new_cache})


AutoConfig.register(MODEL_TYPE, FastWeightsConfig, exist_ok=True)
AutoModelForCausalLM.register(FastWeightsConfig, FastWeightsForCausalLM, exist_ok=True)

__all__ = ["FastWeightsConfig", "FastWeightsForCausalLM", "FastWeightsCache", "select_sequences", "MODEL_TYPE"]
