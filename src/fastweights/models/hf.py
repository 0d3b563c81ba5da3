"""Old name of :mod:`fastweights.hf.ours_as_transformers` (our model as a Hugging Face causal LM).

Kept because user code and the ``modeling_fastweights.py`` of directories exported before the move
(loaded with ``trust_remote_code=True``) import it: importing it registers the model type
"fastweights" with the Auto classes, and every name is the same object as in the new module.
"""

from fastweights.hf.ours_as_transformers import (  # noqa: F401  (re-exported)
    _CACHE_FIELD, MODEL_TYPE, FastWeightsCache, FastWeightsConfig, FastWeightsForCausalLM, select_sequences)

__all__ = ["FastWeightsConfig", "FastWeightsForCausalLM", "FastWeightsCache", "select_sequences", "MODEL_TYPE"]
