"""Old name of :mod:`fastweights.hf.export` (``fastweights export-hf``: a checkpoint out to a Hugging
Face directory); every name is the same object as in the new module."""

from fastweights.hf.export import (  # noqa: F401  (re-exported)
    UNK_TOKEN, cmd_export_hf, export_hf, hf_tokenizer, register_cli, special_token_ids)
