"""Static and dynamic evaluation of texts side by side under one protocol (:func:`evaluate_static_and_dynamic`,
behind ``fastweights dynamic eval`` and ``fastweights eval --dynamic RULE``), and the demo's tuned run
(:func:`demo_dynamic`, ``make demo``)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from fastweights.adapt.cache import CacheSettings, NeuralCache
from fastweights.adapt.setup import (DynamicSettings, build_evaluator, encode_texts, evaluator_from, load_texts,
                                     resolve_setup, weights_fingerprint)
from fastweights.adapt.tune import TUNE_CHARS
from fastweights.core.errors import UserError, refuse_non_finite


@dataclass
class ComparisonOptions:
    """How :func:`evaluate_static_and_dynamic` reads the documents and what it reports besides static and dynamic.

    reset "per_document": every document starts from the trained weights ("never": the adaptation carries
    over); batch_docs > 1: that many documents at once, each with its own weights; bos: prepend the
    tokenizer's BOS token; per_token: a path for every prediction's losses (``adapt.per_token``; with
    cache_on_dynamic each document also has its "dynamic_cache" losses, summing to "dynamic_cache_nll");
    cache: the neural cache baseline on the static model; cache_on_dynamic: the neural cache on the
    dynamically adapted model; neural_cache: both caches' settings."""

    reset: str = "per_document"
    batch_docs: int = 1
    bos: bool = False
    per_token: str | None = None
    cache: bool = False
    cache_on_dynamic: bool = False
    neural_cache: CacheSettings = field(default_factory=CacheSettings)


def scores_not_finite_because(evaluator=None, lr_flag: str = "--lr") -> str:
    """Why a score came out NaN or infinite, for :func:`fastweights.core.errors.refuse_non_finite`: with an
    ``evaluator`` adapting the weights, dynamic evaluation diverged with its rule and learning rate (``lr_flag``:
    how the front end names the learning rate, ``--lr`` or ``lr=``); without one, the model overflows."""
    if evaluator is None:
        return "the model's scores overflow on this text"
    meta = evaluator.metadata()
    return (f"dynamic evaluation diverged with rule {meta.get('rule')}, learning rate "
            f"{meta.get('lr', float('nan')):.3g} (try a smaller {lr_flag})")


def _metrics(result, tokenizer, chars: int) -> dict:
    result.chars = chars
    return {"nll": result.nll} | result.metrics(getattr(tokenizer, "name", ""))  # nll: total, in nats


def headline_key(tokenizer) -> str:
    name = getattr(tokenizer, "name", "")
    return "bits_per_char" if name == "char" else ("bits_per_byte" if name == "byte" else "perplexity")



def _score_documents(evaluate, docs, reset: str, keep: bool, bar, start):
    """Documents one after the other through ``evaluate`` (an evaluator's or a DynamicNeuralCache's): the
    summed result and each document's token losses. ``reset="never"`` carries the adapted values and the
    schedule's update count into the next document (``start(state, doc)`` builds its start state)."""
    from fastweights.loops.evaluate import EvalResult

    total, losses, state = EvalResult(0.0, 0), [], None
    for d in docs:
        r, st = evaluate(d, start(state, d) if state is not None else None, keep_token_losses=keep, progress=bar)
        losses.append(r.token_losses)
        total.add(r)
        if reset == "never":
            state = st
    bar.close()
    return total, losses


def _carried(ev):
    """``start`` for :func:`_score_documents` with --reset never: the adaptation (values, update count) carries
    over, the model state (and the cache's memory) starts fresh at every document."""
    from fastweights.adapt.dynamic import DynamicState
    from fastweights.adapt.dynamic_cache import DynamicCacheState

    def start(st, d):
        dyn = st.dynamic if isinstance(st, DynamicCacheState) else st
        new = DynamicState(dyn.values, None, d[:0], 0, dyn.updates)
        if not isinstance(st, DynamicCacheState):
            return new
        return DynamicCacheState(new, torch.zeros(0, 0, device=ev.device),
                                 torch.zeros(0, dtype=torch.long, device=ev.device), 0)
    return start


def evaluate_static_and_dynamic(settings: DynamicSettings, model, tokenizer, cfg, texts: list[str],
                                ckpt: Path | None = None, options: ComparisonOptions | None = None,
                                progress: bool = True) -> dict:
    """Static and dynamic evaluation of ``texts`` under one protocol; returns a JSON-ready dict.

    ``settings``: the evaluator (:class:`~fastweights.adapt.setup.DynamicSettings`; ``ckpt`` the checkpoint
    directory its default statistics and tuned file belong to, None for Hugging Face models); ``options``:
    :class:`ComparisonOptions`. ``cfg`` is the checkpoint's RunConfig (None for Hugging Face models).
    Static and dynamic use the same segments (stride = segment_len) and context.

    Returns {"static": metrics, "dynamic": metrics, ["cache": metrics], ["dynamic_cache": metrics],
    "relative_improvement", "settings": the evaluator's metadata, "documents", "reset"}; metrics as
    ``EvalResult.metrics`` plus "nll" (total nats); the cache rows add their "settings".
    """
    from fastweights.loops.evaluate import EvalResult
    from fastweights.core.progress import Progress

    opt = options or ComparisonOptions()
    ev, info = build_evaluator(settings, model, tokenizer, cfg, ckpt, progress=progress)
    docs, chars = encode_texts(tokenizer, texts, opt.bos)
    total = sum(d.numel() - 1 for d in docs)
    keep = bool(opt.per_token)
    losses = {}  # row -> per-document token losses, only with per_token
    passes = ["static", "dynamic"] + ["cache"] * opt.cache + ["dynamic+cache"] * opt.cache_on_dynamic

    def pass_bar(name: str) -> Progress:  # one line per pass, each with its total and ETA, "pass k/n" in front
        return Progress(total, "tok", desc=f"dynamic eval pass {passes.index(name) + 1}/{len(passes)}: {name}",
                        enabled=progress)

    bar = pass_bar("static")
    static = EvalResult(0.0, 0)
    losses["static"] = []
    for d in docs:
        r = ev.static(d, keep_token_losses=keep, progress=bar)
        losses["static"].append(r.token_losses)
        static.add(r)
    bar.close()
    reset = opt.reset or "per_document"
    batch_docs = max(1, opt.batch_docs or 1)
    if batch_docs > 1 and reset != "per_document":
        raise UserError("--batch-docs needs --reset per_document (each document has its own weights)")
    bar = pass_bar("dynamic")
    if batch_docs > 1:
        dynamic, losses["dynamic"] = EvalResult(0.0, 0), []
        for i in range(0, len(docs), batch_docs):
            try:
                batch = ev.evaluate_batch(docs[i : i + batch_docs], keep_token_losses=keep, progress=bar)
            except RuntimeError as e:
                if "functorch" not in str(e):
                    raise
                raise UserError(f"--batch-docs: {str(e).splitlines()[0]}") from None
            for r in batch:
                losses["dynamic"].append(r.token_losses)
                dynamic.add(r)
        bar.close()
    else:
        dynamic, losses["dynamic"] = _score_documents(ev.evaluate, docs, reset, keep, bar, _carried(ev))
    out = {"static": _metrics(static, tokenizer, chars), "dynamic": _metrics(dynamic, tokenizer, chars)}
    if opt.cache:

        cache = NeuralCache(model, **asdict(opt.neural_cache), segment_len=ev.segment_len, context=ev.context)
        bar = pass_bar("cache")
        with bar.adopting():  # the cache's own bar counts toward this pass's line
            r = cache.evaluate_documents(docs, progress=False)
        bar.close()
        out["cache"] = _metrics(r, tokenizer, chars) | {"settings": cache.metadata()}
    if opt.cache_on_dynamic:
        from fastweights.adapt.dynamic_cache import DynamicNeuralCache

        both = DynamicNeuralCache(ev, **asdict(opt.neural_cache))
        bar = pass_bar("dynamic+cache")
        r, losses["dynamic_cache"] = _score_documents(both.evaluate, docs, reset, keep, bar, _carried(ev))
        out["dynamic_cache"] = _metrics(r, tokenizer, chars) | {
            "relative_improvement": 1 - r.loss / static.loss if static.loss > 0 else 0.0,
            "settings": both.metadata()["cache"]}
    out["relative_improvement"] = 1 - dynamic.loss / static.loss if static.loss > 0 else 0.0
    out["settings"] = ev.metadata() | info
    out["documents"] = len(docs)
    out["reset"] = reset
    refuse_non_finite({"static": out["static"]}, "the model's scores overflow on this text (static evaluation)")
    refuse_non_finite(out, scores_not_finite_because(ev))
    if keep:
        out["per_token_file"] = str(_write_per_token(opt.per_token, docs, losses, out))
    return out


def _write_per_token(path, docs, losses: dict, result: dict) -> Path:
    """``adapt.per_token``'s file; with the cache on dynamic evaluation, each document's "dynamic_cache"
    losses too (summing to "dynamic_cache_nll", the row's total NLL)."""
    from fastweights.adapt.per_token import per_token_record
    from fastweights.core.files import atomic_write

    rec = per_token_record(docs, losses["static"], losses["dynamic"], result)
    if "dynamic_cache" in losses:
        for doc, row in zip(rec["documents"], losses["dynamic_cache"]):
            doc["dynamic_cache"] = row
        rec["dynamic_cache_nll"] = sum(sum(row) for row in losses["dynamic_cache"])
    path = Path(path)
    atomic_write(path, lambda p: p.write_text(json.dumps(rec) + "\n"))
    return path



def demo_dynamic(checkpoint: str | Path, tune_chars: int = TUNE_CHARS, test_chars: int = 20000, stats_batches: int = 100,
                 verbose: bool = True, progress: bool | None = None) -> dict:
    """Static vs dynamic evaluation of a freshly trained checkpoint, for ``make demo``.

    Collects MS_g on the checkpoint's training split (``stats_batches`` batches of 100 x 20),
    searches lr and decay on the first ``tune_chars`` characters of its validation split (saved as
    ``dynamic_tuned.json`` and named to the scoring run), then scores the first ``test_chars`` characters of its test split both
    ways. Returns the dict of :func:`evaluate_static_and_dynamic` plus the search result; prints two lines
    when ``verbose``; ``progress`` (default: ``verbose``): progress lines on stderr for the statistics, the
    search and the two passes (about a minute of ``make demo``).
    """
    from fastweights.adapt.tune import TUNED_FILE, save_tuned, tune_dynamic
    from fastweights.models.loading import load_checkpoint

    ckpt = Path(checkpoint)
    model, tok, cfg = load_checkpoint(ckpt)
    settings = DynamicSettings(stats_batches=stats_batches)  # the default rule
    progress = verbose if progress is None else progress
    setup = resolve_setup(settings, model, tok, cfg, ckpt, lr=0.0, decay=0.0, progress=progress)
    docs, _ = encode_texts(tok, load_texts(None, cfg, "val", tune_chars))
    search = tune_dynamic(lambda lr, decay: evaluator_from(replace(setup, lr=lr, decay=decay), model), docs,
                          progress=progress)
    settings.tuned = str(save_tuned(search, ckpt / TUNED_FILE, weights_sha256=weights_fingerprint(ckpt)))
    res = evaluate_static_and_dynamic(settings, model, tok, cfg, load_texts(None, cfg, "test", test_chars), ckpt,
                                      progress=progress)
    res["search"] = search
    if verbose:
        key = headline_key(tok)
        b = search["best"]
        print(f"   dynamic evaluation ({setup.rule}, lr {b['lr']:.3g}, decay {b['decay']:.3g}, tuned on "
              f"{search['tokens']:,} validation characters)")
        gain = res["relative_improvement"]
        change = f"{100 * gain:.1f}% lower" if gain >= 0 else f"{-100 * gain:.1f}% higher (worse)"
        print(f"   test ({res['static']['tokens']:,} characters): static {res['static'][key]:.3f}, dynamic "
              f"{res['dynamic'][key]:.3f} {key.replace('_', ' ')} ({change})")
    return res
