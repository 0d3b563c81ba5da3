"""Old name of :mod:`fastweights.hf.kv_context` (what a Hugging Face model's KV cache keeps in context
during dynamic evaluation); every name is the same object as in the new module."""

from fastweights.hf.kv_context import (  # noqa: F401  (re-exported)
    DEFAULT_SINKS, context_metadata, keep_indices, needs_reencoding, reencode_budget, trim_with_sinks)
