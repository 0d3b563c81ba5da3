"""Old name of :mod:`fastweights.hf.transformers_as_ours` (a Hugging Face causal LM on our model
protocol, for dynamic evaluation); every name is the same object as in the new module."""

from fastweights.hf.transformers_as_ours import (  # noqa: F401  (re-exported)
    SMOLLM2_ALIASES, SMOLLM2_INSTALL, HFCausalLM, HFTokenizer, load_hf_model, require, smollm2_gguf)
