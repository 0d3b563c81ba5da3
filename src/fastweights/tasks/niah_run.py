"""One needle-in-a-haystack evaluation of a trained model (``fastweights task niah``): the samples of the needle
format the model was trained on (or the one asked), the reads of :func:`fastweights.tasks.niah.evaluate_niah`,
the summary by depth and length, and the run's description.

Formats: ``char`` (the paper's 4-character key and 6-digit value, :mod:`fastweights.tasks.niah`), ``token``
(one-token keys and values, :mod:`fastweights.tasks.niah_token`) and ``multitoken`` (two-token keys, three-token
values, :mod:`fastweights.tasks.niah_multitoken`). The token formats read the default haystack's last tenth, text
their training never used.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastweights.core.errors import UserError
from fastweights.tasks import niah_multitoken, niah_token
from fastweights.tasks.niah import (Haystack, NiahOptions, check_tokenizer, evaluate_niah, make_samples,
                                    summarize)


def needle_format(asked: str, tok) -> str:
    """The needle format to use: ``asked`` ("auto" picks the token format a word-level model was trained on, else
    "char"); UserError when a token format is asked of a model whose tokenizer lacks its reserved tokens."""
    trained = {"token": niah_token.is_token_format(tok), "multitoken": niah_multitoken.is_multitoken_format(tok)}
    if asked == "auto":
        return next((f for f, yes in trained.items() if yes), "char")
    if asked in trained and not trained[asked]:
        raise UserError(f"--format {asked} needs a word-level model trained on that needle format (the niah-{asked} "
                        "preset); this model's tokenizer lacks its reserved tokens")
    return asked


@dataclass
class NiahRun:
    """What :func:`run_niah` returns: the samples, one record per sample and read count, the summary, the
    format used and the haystack's name."""

    samples: list
    records: list
    summary: dict
    format: str
    haystack: str


def run_niah(model, tok, haystack: str, lengths: list[int], depths, samples: int, seed: int, opts: NiahOptions,
             fmt: str = "auto", keys: str = "heldout", depth_bins: int = 5, progress: bool = False) -> NiahRun:
    """The samples of format ``fmt`` (``needle_format``) at each length and depth (``samples`` per cell, seeded),
    read as ``opts`` sets (``evaluate_niah``), and their summary (``depths`` "uniform": ``depth_bins`` rows). ``keys`` (token formats): needles with keys never
    used in training ("heldout"; a one-token format's held-out keys get embeddings drawn from the trained keys')
    or the training ones."""
    fmt = needle_format(fmt, tok)
    if fmt == "char":
        check_tokenizer(tok)
        text = Haystack.load(haystack)
        made = make_samples(text, tok, lengths, depths, samples, seed)
    else:
        text = niah_token.eval_haystack(haystack)
        builder = niah_token if fmt == "token" else niah_multitoken
        made = builder.make_samples(text, lengths, depths, samples, seed, keys=keys)
        if fmt == "token" and keys == "heldout":  # never trained: drawn from the trained keys' embeddings
            niah_token.init_heldout_keys(model, tok, seed=seed)
    records = evaluate_niah(model, tok, made, opts, progress=progress)
    return NiahRun(made, records, summarize(records, depths, depth_bins), fmt, text.name)
