"""fastweights models in EleutherAI's lm-evaluation-harness (``lm-eval``, the optional extra ``[eval]``).

Two registered harness models:

``fastweights``
    A language model scored as it is (static): a fastweights checkpoint (``checkpoint=DIR``) or a
    Hugging Face causal LM (``hf=NAME``: a directory, a ``.gguf`` file, a hub name or ``smollm2-135m``).
``fastweights-dynamic``
    The same models under dynamic evaluation (Krause et al. 2018; :mod:`fastweights.adapt.dynamic`):
    ``rule``, ``lr``, ``decay``, ``stats`` (the RMS rules' gradient statistics), ``segment_len`` ... as
    model arguments, the flags of ``fastweights dynamic eval``.

Run them through ``python -m fastweights.harness``, which registers both models and this package's
local tasks, then hands its arguments to lm-eval's own command line (``lm-eval run ...``)::

    python -m fastweights.harness --model fastweights-dynamic \\
        --model_args checkpoint=runs/demo --tasks fastweights_heldout_plays

(the checkpoint's tuned lr and decay when ``dynamic tune`` made them, else the library's defaults; the
measured setting for SmolLM2 is stated once, in docs/dynamic-evaluation.md, "Recommended setting for SmolLM2")

The device is ``auto`` (CUDA where there is a GPU, else the CPU) unless ``--device`` names one, and scoring
prints a progress line with a total and an ETA on stderr.

(``lm_eval --model fastweights ...`` alone does not know the models: lm-eval 0.4.13 discovers no
third-party models, so they must be registered in the same process; from Python,
``import fastweights.harness.models`` registers them and ``TASKS`` is the ``--include_path`` /
``TaskManager(include_path=...)`` of the local tasks.)

What each request type does (``fastweights.harness.models``):

* ``loglikelihood_rolling`` (perplexity tasks): every document is scored on its own, from the
  trained weights and an empty state. Static: the library's scorer (``fastweights eval``'s), segments
  of ``segment_len`` with the model state carried and ``context`` tokens of context, exactly as the
  static row of ``fastweights dynamic eval``. Dynamic: ``DynamicEvaluator.evaluate`` on the document:
  each segment scored, then the weights updated on it; reset between documents (each request starts
  from the trained weights). Equal to ``fastweights dynamic eval``'s rows on the same text.
  The first token of a document is context only, as everywhere in the library (``bos=true``
  prepends the tokenizer's BOS token and scores it too).
* ``loglikelihood`` and ``generate_until`` (multiple-choice and generation tasks): the trained
  weights, for both models. Dynamic evaluation adapts along one stream as it scores it; these
  requests are many short independent (context, continuation) pairs, and ``fastweights-dynamic``
  answers them exactly as ``fastweights`` does, saying so once in a warning.

Local tasks (offline, data from the corpora shipped in the package; ``lm-eval ls tasks
--include_path`` lists them): ``fastweights_heldout_plays`` (four Shakespeare plays no preset trains
on, 2,000 characters of each from ``ACT I``) and ``fastweights_novels`` (the three bundled novels,
2,500 characters of each from the start); metrics word and byte perplexity and bits per byte.
Hub tasks (``wikitext`` ...) work where their data is in the local cache or reachable.
"""

from __future__ import annotations

from pathlib import Path

TASKS = Path(__file__).resolve().parent / "tasks"  # lm-eval's --include_path for the local tasks
MODEL_NAMES = ("fastweights", "fastweights-dynamic")
INSTALL = "pip install 'fastweights[eval]' (lm-eval==0.4.13)"


def register() -> None:
    """Register the harness models with lm-eval (a one-line UserError when lm-eval is missing)."""
    from fastweights.hf.transformers_as_ours import require

    require("lm_eval", INSTALL)
    import fastweights.harness.models  # noqa: F401  (registers on import)
