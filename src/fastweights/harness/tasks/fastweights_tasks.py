"""Functions the local task YAMLs name (``!function fastweights_tasks.NAME``): lm-eval imports this file by path."""

import re

from fastweights.harness.corpora import load  # noqa: F401  (custom_dataset)


def doc_to_target(doc: dict) -> str:
    """The document's text, exactly (no template rendering)."""
    return doc["text"]


def process_results(doc: dict, results) -> dict:
    """Word and byte perplexity and bits per byte from the document's log-likelihood (as lm-eval's wikitext)."""
    (loglikelihood,) = results
    words = len(re.split(r"\s+", doc["text"].strip()))
    n_bytes = len(doc["text"].encode("utf-8"))
    return {"word_perplexity": (loglikelihood, words), "byte_perplexity": (loglikelihood, n_bytes),
            "bits_per_byte": (loglikelihood, n_bytes)}
