"""Hugging Face in both directions, one module per direction (nothing is imported here, so that the
package loads without the optional ``transformers``):

- :mod:`fastweights.hf.ours_as_transformers`: our model out to Hugging Face, a ``LanguageModel`` as a
  ``transformers`` ``PreTrainedModel`` (``FastWeightsForCausalLM``), registered with the Auto classes
  when imported;
- :mod:`fastweights.hf.export`: ``fastweights export-hf``, a checkpoint written out as a Hugging Face
  directory with its tokenizer;
- :mod:`fastweights.hf.transformers_as_ours`: a Hugging Face causal LM brought in to our model protocol,
  so dynamic evaluation and the neural cache wrap it (``HFCausalLM``, ``load_hf_model``), with
  :mod:`fastweights.hf.kv_context`, what its KV cache keeps in context.
"""
