"""An FWL on a pretrained model, out to Hugging Face: one directory that ``AutoModelForCausalLM`` loads offline.

    import fastweights.hf.fwl_as_transformers          # registers "fastweights-fwl" with the Auto classes
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("exported-dir")    # an FWLHeadForCausalLM
    tok = AutoTokenizer.from_pretrained("exported-dir")             # the backbone's own tokenizer class
    out = model.generate(**tok("Happy families", return_tensors="pt"), max_new_tokens=40, do_sample=False)

:class:`FWLHeadConfig` (``model_type = "fastweights-fwl"``) holds the backbone's own config (a dict with
its ``model_type``, e.g. ``llama``) and the FWL head's options; :class:`FWLHeadForCausalLM` rebuilds the
backbone from that config with ``AutoModelForCausalLM.from_config`` and wraps it with the head
(:class:`fastweights.hf.fwl_head.HFCausalLMWithFWL` as ``self.model``). Generation, the cache and the
loss are those of :class:`fastweights.hf.ours_as_transformers.FastWeightsForCausalLM`: the cache holds the
explicit state (the backbone's KV cache and the head's fast weights), so ``generate()`` carries the FWL
state from token to token. Padding is refused (the backbone's KV-cache state of this wrapper has no mask).

:func:`export_fwl_head` writes such a directory (the backbone's weights included) with the tokenizer, every file
with the mode the user's umask gives. As for ``export-hf`` (:mod:`fastweights.hf.export`), the directory also holds
``modeling_fastweights_fwl.py`` and an ``auto_map``, so that without the import both Auto classes load it with
``trust_remote_code=True``; without either, transformers asks whether to run that code (``AutoTokenizer`` reads
``config.json`` too). Plain ``import fastweights`` does not register.
"""

from __future__ import annotations

import json

from dataclasses import field
from pathlib import Path

from fastweights.core.errors import UserError
from fastweights.hf.export import remote_code
from fastweights.hf.fwl_head import HFCausalLMWithFWL
from fastweights.hf.ours_as_transformers import FastWeightsForCausalLM
from fastweights.hf.transformers_as_ours import HFCausalLM
from fastweights.layers.fwl import FWLOptions

from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel  # noqa: E402

MODEL_TYPE = "fastweights-fwl"


class FWLHeadConfig(PretrainedConfig):
    """``backbone``: the pretrained model's config as a dict (``model_type`` included); ``fwl``: the head's
    :class:`~fastweights.layers.fwl.FWLOptions` as a dict; ``trainable_blocks`` as trained."""

    model_type = MODEL_TYPE
    keys_to_ignore_at_inference = ["past_key_values"]

    backbone: dict = field(default_factory=dict)
    fwl: dict = field(default_factory=dict)
    trainable_blocks: int = 0
    vocab_size: int = 0
    use_cache: bool = True
    attention_context: int = 0  # FastWeightsForCausalLM's field: 0 keeps the whole KV cache
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None


class FWLHeadForCausalLM(FastWeightsForCausalLM):
    """A pretrained causal LM with an FWL head, as a Hugging Face causal LM (forward and generate of
    :class:`~fastweights.hf.ours_as_transformers.FastWeightsForCausalLM`)."""

    config_class = FWLHeadConfig
    _no_split_modules: list = []

    def __init__(self, config: FWLHeadConfig, model: HFCausalLMWithFWL | None = None):
        PreTrainedModel.__init__(self, config)
        if model is None:
            if not config.backbone.get("model_type"):
                raise ValueError("FWLHeadConfig.backbone must be a config dict with its model_type")
            backbone_cfg = AutoConfig.for_model(**config.backbone)
            backbone = AutoModelForCausalLM.from_config(backbone_cfg)
            model = HFCausalLMWithFWL(HFCausalLM(backbone), FWLOptions(**config.fwl), config.trainable_blocks)
        self.model = model
        self._remember_derived_buffers()
        self.post_init()
        # post_init gathers the tied weights of PreTrainedModel children only; the backbone sits one level down
        # (inside HFCausalLMWithFWL), so its tied output layer is added under this model's names: saving then
        # drops the copy and loading ties it back
        inner = getattr(model.backbone.hf, "all_tied_weights_keys", None) or {}
        self.all_tied_weights_keys.update({f"model.backbone.hf.{k}": f"model.backbone.hf.{v}" for k, v in inner.items()})

    def get_input_embeddings(self):
        return self.model.backbone.hf.get_input_embeddings()

    def set_input_embeddings(self, value) -> None:
        raise NotImplementedError("the FWL head shares the backbone's output layer; resizing is not supported")


def export_fwl_head(model: HFCausalLMWithFWL, tokenizer, out_dir: str | Path) -> Path:
    """Write ``model`` (backbone and head) and ``tokenizer`` (a transformers tokenizer, or our HFTokenizer) as a
    Hugging Face directory that ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads offline."""
    out_dir = Path(out_dir)
    import dataclasses

    bb_config = model.backbone.hf.config.to_dict()
    for key in ("architectures", "_name_or_path", "transformers_version", "torch_dtype", "dtype"):
        bb_config.pop(key, None)
    config = FWLHeadConfig(backbone=bb_config, fwl=dataclasses.asdict(model.head.options),
                           trainable_blocks=model.trainable_blocks, vocab_size=model.vocab_size,
                           bos_token_id=bb_config.get("bos_token_id"), eos_token_id=bb_config.get("eos_token_id"),
                           pad_token_id=bb_config.get("pad_token_id"))
    # with trust_remote_code=True, transformers loads the model through the installed package (the module below)
    config.auto_map, module_source = remote_code(REMOTE_MODULE, FWLHeadConfig, FWLHeadForCausalLM)
    wrapper = FWLHeadForCausalLM(config, model=model)
    tok = getattr(tokenizer, "tok", tokenizer)

    def write(staging: Path) -> None:
        wrapper.save_pretrained(staging)
        if tok is not None:
            tok.save_pretrained(staging)
            # a decoder-only model pads on the left (generation continues from the last real token), as
            # export-hf's tokenizers do; the backbone's own tokenizer may say right, and the object passed in is
            # left as it was
            cfg = staging / "tokenizer_config.json"
            if cfg.is_file():
                cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "padding_side": "left"}, indent=2))
        (staging / f"{REMOTE_MODULE}.py").write_text(module_source)

    from fastweights.core.files import write_into

    # into a fresh staging folder, then renamed into out_dir (no write through a link there), with the umask's modes
    try:
        write_into(out_dir, write, "the export")
    except (OSError, RuntimeError, ValueError) as e:
        raise UserError(f"cannot write {out_dir}: {getattr(e, 'strerror', None) or e}") from None
    return out_dir


REMOTE_MODULE = "modeling_fastweights_fwl"  # the module an export holds for trust_remote_code=True


AutoConfig.register(MODEL_TYPE, FWLHeadConfig, exist_ok=True)
AutoModelForCausalLM.register(FWLHeadConfig, FWLHeadForCausalLM, exist_ok=True)
