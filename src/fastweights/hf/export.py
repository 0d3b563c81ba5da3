"""``fastweights export-hf CHECKPOINT DIR``: a checkpoint out to a Hugging Face model directory.

    fastweights export-hf runs/demo hf/demo

writes ``config.json`` + ``generation_config.json`` + ``model.safetensors`` (through
``FastWeightsForCausalLM.save_pretrained``; ``attention_context`` = the training ``seq_len``, so
``generate()`` bounds attention layers' context as ``fastweights generate`` does) and ``tokenizer.json`` +
``tokenizer_config.json`` (in the format of the Hugging Face ``tokenizers`` library), every file with the mode
the user's umask gives (0644 under umask 022), so that, offline,

    import fastweights.hf.ours_as_transformers  # registers model_type "fastweights" (~2-4 s: torch, transformers)
    model = AutoModelForCausalLM.from_pretrained("hf/demo")
    tok = AutoTokenizer.from_pretrained("hf/demo")

give the same logits and the same token ids as the checkpoint and its tokenizer, with no prompt and no warning.
Plain ``import fastweights`` does not register (it stays a millisecond import). The directory also holds
``modeling_fastweights.py`` and an ``auto_map`` in ``config.json``, so that without the import both calls load
it with ``trust_remote_code=True`` (the module imports the installed package). ``AutoTokenizer`` needs the one or
the other as much as the model does: transformers (5.24) reads ``config.json`` before ``tokenizer_config.json``,
and nothing a tokenizer file says avoids it; without either it asks ``Do you wish to run the custom code?
[y/N]`` and warns about the model type. The tokenizer alone loads with neither through its class, which reads
only the tokenizer files: ``PreTrainedTokenizerFast.from_pretrained("hf/demo")``.

Tokenizers, each expressed in ``tokenizers`` so that its ids are ours:

- ``char``: a WordLevel model over the characters (id i = character i), every character split off
  on its own by the pre-tokenizer, the unknown symbol ``<unk>`` at the last id (it decodes to
  U+FFFD, as ours). Lone surrogates in the vocabulary (from undecodable bytes) cannot be held by
  ``tokenizers``; they become named placeholders ``<U+DC80>`` that no text maps to.
- ``byte``: a byte-level model (GPT-2's byte-to-character table) with the 256 bytes as ids 0..255 and
  no merges, and no pre-tokenizer split; decoding replaces invalid UTF-8 with U+FFFD, as ours.
- ``gpt2``: ByteLevel BPE with our vocab and merges and the GPT-2 split pattern, saved as transformers' own
  ``GPT2Tokenizer`` (``tokenizer_class`` in ``tokenizer_config.json``) when the vocabulary holds
  ``<|endoftext|>`` (GPT-2's own does). ``<|endoftext|>`` is the EOS/BOS token (so ``generate`` stops there), but
  text that contains the string ``<|endoftext|>`` is encoded as ordinary characters, as ours does
  (``split_special_tokens``).

No class of transformers holds a character vocabulary or bytes as ids 0..255 (ByT5's are shifted by three), so
``char`` and ``byte`` are saved as transformers' generic ``TokenizersBackend`` (the ``tokenizer.json`` of the
``tokenizers`` library); no tokenizer code is ours, so nothing of the tokenizer asks for ``trust_remote_code``.

The HF tokenizers add no BOS/EOS tokens when encoding, like ours. They pad on the left (the side
batched ``generate()`` needs), with ``<unk>`` (char), byte 0 (byte) or ``<|endoftext|>`` (gpt2) as the
padding token (the model config's ``pad_token_id``); padding is masked out of the model's state, so which
token pads does not matter.
"""

from __future__ import annotations

from pathlib import Path

from fastweights.core.errors import UserError

REMOTE_MODULE = "modeling_fastweights"  # the module an export holds for trust_remote_code=True

UNK_TOKEN = "<unk>"
_REPLACEMENT_CHAR = "\ufffd"


def _require_hf():
    try:
        import tokenizers  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        raise UserError(f"export-hf needs the optional package 'transformers' ({e}): pip install 'fastweights[hf]'") \
            from None


def _char_symbol(c: str) -> str:
    """The vocabulary string of character ``c``; lone surrogates cannot be Rust strings."""
    return f"<U+{ord(c):04X}>" if 0xD800 <= ord(c) <= 0xDFFF else c


def hf_tokenizer(tokenizer):
    """Our tokenizer (char, byte or gpt2) as a ``transformers`` fast tokenizer with the same ids.

    Returns transformers' ``GPT2Tokenizer`` for a gpt2 vocabulary with ``<|endoftext|>``, else a
    ``PreTrainedTokenizerFast`` (``TokenizersBackend``); ``save_pretrained(directory)`` writes ``tokenizer.json``
    and ``tokenizer_config.json``, whose ``tokenizer_class`` names that class.
    """
    _require_hf()
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from fastweights.data.tokenizers import bytes_to_unicode

    special: dict = {}
    if tokenizer.name == "char":
        vocab = {_char_symbol(c): i for i, c in enumerate(tokenizer.chars)}
        vocab[UNK_TOKEN] = tokenizer.unk_id
        tk = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
        # every code point is its own pre-token ([\s\S] matches any single character, newlines included)
        tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        # Fuse: tokens are joined without spaces; the unknown symbol reads back as U+FFFD like ours
        tk.decoder = decoders.Sequence([decoders.Replace(UNK_TOKEN, _REPLACEMENT_CHAR), decoders.Fuse()])
        special = {"unk_token": UNK_TOKEN, "pad_token": UNK_TOKEN}
    elif tokenizer.name == "byte":
        byte_symbol = bytes_to_unicode()
        tk = Tokenizer(models.BPE({byte_symbol[b]: b for b in range(256)}, []))  # no merges: one id per byte
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tk.decoder = decoders.ByteLevel()
        special = {"pad_token": byte_symbol[0]}
    elif tokenizer.name == "gpt2":
        merges = sorted(tokenizer.bpe_ranks, key=tokenizer.bpe_ranks.get)  # [(left, right)] in rank order
        if tokenizer.eot_id is not None:  # GPT-2's class: the same BPE, ByteLevel split (GPT2_PATTERN) and decoder
            from transformers import GPT2Tokenizer

            eot = "<|endoftext|>"
            return GPT2Tokenizer(vocab=dict(tokenizer.encoder), merges=merges, unk_token=eot, bos_token=eot,
                                 eos_token=eot, pad_token=eot, add_prefix_space=False, split_special_tokens=True,
                                 clean_up_tokenization_spaces=False, padding_side="left")
        tk = Tokenizer(models.BPE(dict(tokenizer.encoder), merges))
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT2_PATTERN
        tk.decoder = decoders.ByteLevel()
    else:
        raise UserError(f"export-hf: tokenizer kind {tokenizer.name!r} has no Hugging Face form")
    # split_special_tokens: a special token's text inside the input is ordinary text, as in our encode
    return PreTrainedTokenizerFast(tokenizer_object=tk, split_special_tokens=True,
                                   clean_up_tokenization_spaces=False, padding_side="left", **special)


def special_token_ids(tokenizer) -> dict:
    """``bos_token_id`` / ``eos_token_id`` for the model config (GPT-2's end of text; none for char/byte) and
    ``pad_token_id`` (the tokenizer's padding token, see the module docstring)."""
    eot = getattr(tokenizer, "eot_id", None)
    ids = {"bos_token_id": eot, "eos_token_id": eot} if eot is not None else {}
    pad = {"char": getattr(tokenizer, "unk_id", None), "byte": 0, "gpt2": eot}.get(tokenizer.name)
    return {**ids, "pad_token_id": pad} if pad is not None else ids


def export_hf(checkpoint: str | Path, directory: str | Path, force: bool = False) -> list[str]:
    """Write checkpoint ``checkpoint`` as a Hugging Face model directory ``directory``.

    Refuses a non-empty ``directory`` unless ``force`` (and always refuses the checkpoint itself,
    whose own ``config.json`` / ``tokenizer.json`` would be overwritten). Returns the file names written.
    """
    _require_hf()
    from fastweights.models.loading import load_checkpoint
    from fastweights.hf.ours_as_transformers import FastWeightsConfig, FastWeightsForCausalLM

    checkpoint, directory = Path(checkpoint), Path(directory)
    if directory.exists() and checkpoint.exists() and directory.resolve() == checkpoint.resolve():
        raise UserError("export-hf: DIR must differ from the checkpoint directory")
    if directory.exists() and not directory.is_dir():
        raise UserError(f"export-hf: {directory} exists and is not a directory")
    if directory.is_dir() and any(directory.iterdir()) and not force:
        raise UserError(f"export-hf: {directory} is not empty (use --force to write into it)")
    if directory.is_dir():  # --force into a DIR from elsewhere: no file is written through a link in it
        from fastweights.core.files import refuse_links

        for p in sorted(directory.iterdir()):
            refuse_links(directory, p, "the export")
    parent = directory.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"export-hf: cannot create {directory}: {parent} is a file, not a directory")
    model, tokenizer, run_config = load_checkpoint(checkpoint)
    hf_tok = hf_tokenizer(tokenizer)  # before writing anything: an unsupported tokenizer fails here
    # attention layers see the training context when generating, as in `fastweights generate`
    hf_model = FastWeightsForCausalLM.from_language_model(
        model.eval(), attention_context=run_config.train.seq_len, **special_token_ids(tokenizer))
    # without `import fastweights.hf.ours_as_transformers`, transformers does not know the model type "fastweights" and
    # suggests upgrading transformers; with auto_map and this module it asks for trust_remote_code instead,
    # and with trust_remote_code=True it loads the model through the installed fastweights package
    hf_model.config.auto_map, module_source = remote_code(REMOTE_MODULE, FastWeightsConfig, FastWeightsForCausalLM)
    from fastweights.core.files import write_into

    def write(staging: Path) -> None:
        hf_model.save_pretrained(staging)
        hf_tok.save_pretrained(staging)
        (staging / f"{REMOTE_MODULE}.py").write_text(module_source)

    # save_pretrained opens its files by name: it writes into a fresh staging folder, and the files are renamed
    # into DIR only if none of their names there is a symbolic link (a DIR from elsewhere, with --force)
    try:
        write_into(directory, write, "the export")
    except OSError as e:
        raise UserError(f"export-hf: cannot write {directory}: {e.strerror or e}") from None
    return sorted(p.name for p in directory.iterdir())


def remote_code(module: str, config_cls, model_cls) -> tuple[dict, str]:
    """``(auto_map, source)`` that let an exported directory load without importing our package first: the
    ``auto_map`` for its config.json, and the source of ``MODULE.py`` beside it, which imports the installed
    package's ``config_cls`` and ``model_cls`` (registering their model type), so that
    ``from_pretrained(DIR, trust_remote_code=True)`` loads the model through the installed fastweights."""
    config, model, home = config_cls.__name__, model_cls.__name__, config_cls.__module__
    auto_map = {"AutoConfig": f"{module}.{config}", "AutoModelForCausalLM": f"{module}.{model}"}
    source = f'''"""Loads this directory with AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)
(and AutoTokenizer.from_pretrained(DIR, trust_remote_code=True), which reads config.json too).

The model code is the installed fastweights package (pip install 'fastweights[hf]'); importing it
registers the model type "{config_cls.model_type}" (the same as `import {home}`).
"""

from {home} import {config}, {model}

__all__ = ["{config}", "{model}"]
'''
    return auto_map, source

