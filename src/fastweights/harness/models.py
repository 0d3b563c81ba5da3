"""The harness models ``fastweights`` and ``fastweights-dynamic`` (registered with lm-eval on import).

See :mod:`fastweights.harness` for what each request type does. Model arguments (``--model_args
k=v,...``):

    checkpoint=DIR | hf=NAME   the model (one of them)
    device=auto                cpu, cuda, ... (auto: CUDA where there is a GPU, else the CPU; lm-eval's
                               ``--device`` sets it too, and ``python -m fastweights.harness`` passes auto, not
                               lm-eval's default cuda:0, when ``--device`` is not given)
    threads=0                  torch CPU threads (0: OMP_NUM_THREADS when set, else one: docs/language-model.md#threads)
    segment_len=0              predictions per segment (0: the library's default for the tokenizer,
                               ``fastweights.adapt.setup.default_segment_len``)
    context=0                  tokens of context (0: the checkpoint's training seq_len; Hugging Face
                               models: the whole document up to the model's position limit)
    bos=false                  prepend the tokenizer's BOS token to every document, scoring its first token
    sinks=                     Hugging Face models: first tokens a bounded KV cache keeps
  fastweights-dynamic only (``fastweights dynamic eval``'s flags):
    rule=                      sgd, rms, rms-global-prior, ... (default: the library's,
                               ``fastweights.adapt.update_rules.DEFAULT_RULE``; ``fastweights dynamic eval --help``)
    lr=, decay=                learning rate and prior decay (default: a tuned file made for the checkpoint,
                               else the library's defaults); tuned=FILE; no_tuned=true
    preset=NAME                a shipped setting as the defaults of the others (``--preset`` of the command
                               line; preset=smollm2-135m: docs/dynamic-evaluation.md, "Recommended setting for
                               SmolLM2")
    eps=, lr_schedule=         the RMS rules' epsilon; constant, warmup:W or rsqrt:S
    stats=FILE                 gradient statistics of the RMS rules (a checkpoint's own are used or collected)
    params=, exclude_params=   globs of the adapted parameters (';' between globs: ',' separates model args)
    sparse_units=, sparse_layer=, lowrank_rank=, lowrank_params=   sparse or low-rank adaptation

Each argument is checked as the command line checks its flag (the same rule and message, one line and exit
status 2 through ``python -m fastweights.harness``), and a score that is not a finite number is refused, as
``fastweights dynamic eval`` refuses it; a model that cannot be read (a missing checkpoint) is reported before a
device the machine lacks. Requests are processed one at a time, in the order given: lm-eval's ``--batch_size``
is accepted, and a warning says it is ignored when it asks for anything but 1. Each request type prints a
progress line on stderr (``fastweights.core.progress``: tokens of ``loglikelihood_rolling``, requests of
``loglikelihood`` and ``generate_until``, with the total and an ETA; lm-eval's ``disable_tqdm`` turns it off).
"""

from __future__ import annotations

import math
import warnings

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from fastweights.adapt.evaluate import scores_not_finite_because
from fastweights.adapt.setup import (DynamicSettings, build_evaluator, default_context, default_segment_len,
                                     dynamic_preset)
from fastweights.auto.sources import load_model_and_tokenizer
from fastweights.core.distributed import resolve_device
from fastweights.core.errors import UserError, refuse_worse_than_uniform
from fastweights.core.numbers import BadNumber
from fastweights.core.progress import Progress
from fastweights.core.threads import use_threads
from fastweights.data.tokenizers import vocab_size_of
from fastweights.loops.evaluate import EvalResult, score_tokens
from fastweights.loops.generate import generate_tokens
from fastweights.ops.nll import log_probs

_SETTING_FIELDS = {f for f in DynamicSettings.__dataclass_fields__}
_HARNESS_ARGS = {"batch_size", "max_batch_size"}  # lm-eval passes them to every model; requests run one at a time
BATCH_IGNORED = ("{name}: --batch_size {size} is ignored: requests are scored one at a time, in the order given "
                 "(results do not depend on it)")


def _flag_types() -> dict:
    """Model argument -> (the flag of ``fastweights dynamic eval`` it mirrors, its parser): the harness' own and
    every :class:`DynamicSettings` field's (the parser its field declares, as the command line's flags use it)."""
    from dataclasses import fields

    from fastweights.core.numbers import nonneg_int

    stats_flags = {"stats_batch_size": "--batch-size of dynamic stats", "stats_batches": "--max-batches of dynamic "
                   "stats", "stats_seq_len": "--segment-len of dynamic stats"}
    settings = {f.name: (stats_flags.get(f.name, "--" + f.name.replace("_", "-")), f.metadata["type"])
                for f in fields(DynamicSettings) if "type" in f.metadata}
    return {"threads": ("--threads", nonneg_int), "sinks": ("--sinks", nonneg_int), **settings}


def _checked(name: str, args: dict) -> dict:
    """``args`` (lm-eval's parsed ``--model_args``, numbers already converted) checked and converted as the
    command line converts its flags: UserError naming the argument and the flag's rule, e.g.
    ``segment_len=-5: must be >= 0, got -5`` (the command line: ``argument --segment-len: must be >= 0, got -5``)."""
    out = dict(args)
    for key, (flag, kind) in _flag_types().items():
        if out.get(key) is None:
            continue
        value = out[key]
        if isinstance(value, float) and value.is_integer() and kind is not float and "float" not in kind.__name__:
            value = int(value)  # lm-eval reads "-5" as -5.0
        text = str(value)
        try:
            if isinstance(value, bool):
                raise BadNumber(f"expected a number, got {text!r}")
            if kind is int:
                try:
                    out[key] = int(text)
                except ValueError:
                    raise BadNumber(f"expected an integer, got {text!r}") from None
            else:
                out[key] = kind(text)
        except (BadNumber, UserError) as e:
            raise UserError(f"--model {name}: model argument {key}={text} ({flag} of the command line): {e}") from None
    for key in ("bos", "no_tuned"):
        value = out.get(key)
        if value is None or isinstance(value, bool):
            continue
        text = str(value).strip().lower()
        if text not in ("true", "false", "1", "0"):
            raise UserError(f"--model {name}: model argument {key}={value} must be true or false")
        out[key] = text in ("true", "1")
    return out


STATIC_ONLY = ("fastweights-dynamic: dynamic evaluation adapts the weights along one stream as it scores it, and "
               "applies to loglikelihood_rolling (perplexity) requests; loglikelihood and generate_until requests "
               "are answered with the trained weights, exactly as --model fastweights answers them")


class FastweightsLM(LM):
    """``--model fastweights``: a checkpoint or a Hugging Face causal LM, scored as it is (see the module docstring)."""

    dynamic = False

    def __init__(self, checkpoint: str | None = None, hf: str | None = None, device: str | None = None,
                 threads: int = 0, segment_len: int = 0, context: int = 0, bos: bool = False, sinks: int | None = None,
                 **kwargs):
        super().__init__()
        if (checkpoint is None) == (hf is None):
            raise UserError("give exactly one of checkpoint=DIR and hf=NAME in --model_args")
        unknown = sorted(k for k in kwargs if k not in _HARNESS_ARGS
                         and not (self.dynamic and (k in _SETTING_FIELDS or k == "preset")))
        if unknown:
            raise UserError(f"unknown model argument(s) for --model {self.name}: {', '.join(unknown)}")
        if kwargs.get("preset") is not None:  # a shipped setting; the model arguments given win (0: not given)
            preset = dynamic_preset(str(kwargs.pop("preset")))
            segment_len = segment_len or preset.get("segment_len", 0)
            context = context or preset.get("context", 0)
            kwargs = {**{k: v for k, v in preset.items() if k not in ("segment_len", "context")}, **kwargs}
        given = _checked(self.name, {"threads": threads, "segment_len": segment_len, "context": context, "bos": bos,
                                     "sinks": sinks, **kwargs})
        threads, segment_len, context, bos, sinks = (given.pop(k) for k in ("threads", "segment_len", "context", "bos",
                                                                            "sinks"))
        kwargs = given
        size = kwargs.pop("batch_size", None)
        kwargs.pop("max_batch_size", None)
        if size is not None and str(size).strip() != "1":
            warnings.warn(BATCH_IGNORED.format(name=self.name, size=size), stacklevel=2)
        use_threads("scoring", int(threads or 0))
        hf = str(hf) if hf is not None else None
        try:
            resolve_device(device or "auto")
        except UserError:
            # what to score is checked before where: a missing checkpoint or an unknown model is the error to
            # report, not a device this machine lacks (the model is read on the CPU only to find that error)
            load_model_and_tokenizer(checkpoint, hf, "cpu", sinks)
            raise
        self.model, self.tokenizer, self.cfg, self.ckpt = load_model_and_tokenizer(checkpoint, hf, device or "auto",
                                                                                   sinks)
        self.model.eval()
        self._device = next(self.model.parameters()).device
        self.segment_len = int(segment_len) or default_segment_len(self.tokenizer)
        self.context = int(context) or default_context(self.model, self.cfg)
        if self.context is not None and self.context <= self.segment_len:  # as dynamic eval's static row refuses it
            raise UserError(f"context ({self.context}) must be longer than the segment length ({self.segment_len})")
        self.bos = bool(bos)
        self.bos_id = getattr(self.tokenizer, "bos_id", None)
        if self.bos and self.bos_id is None:
            raise UserError("bos=true: this tokenizer has no BOS token")
        self.evaluator = None
        if self.dynamic:
            self.settings = self._settings(kwargs)
            self.evaluator, self.sources = build_evaluator(self.settings, self.model, self.tokenizer, self.cfg,
                                                           self.ckpt)
        self._warned = False

    name = "fastweights"

    def _settings(self, kwargs: dict) -> DynamicSettings:
        fields = {k: v for k, v in kwargs.items() if k in _SETTING_FIELDS}
        for k in ("params", "exclude_params", "lowrank_params"):
            if isinstance(fields.get(k), str):
                fields[k] = fields[k].replace(";", ",")
        if "rule" in fields:
            fields["rule"] = str(fields["rule"])
        return DynamicSettings(segment_len=self.segment_len, context=self.context or 0, **fields)

    # -- what the harness records about the model ------------------------------------------------

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name", "fastweights")

    def config(self) -> dict:
        """The scoring protocol (and for fastweights-dynamic the evaluator's settings), for result files."""
        out = {"model": str(self.ckpt) if self.ckpt is not None else self.tokenizer_name, "dynamic": self.dynamic,
               "segment_len": self.segment_len, "context": self.context, "bos": self.bos,
               "first_token": "scored after BOS" if self.bos else "context only (not scored)"}
        if self.evaluator is not None:
            out["settings"] = self.evaluator.metadata() | self.sources
        return out

    # -- documents ------------------------------------------------------------------------------

    def encode_document(self, text: str) -> torch.Tensor:
        """A document's ids as the library scores them (``adapt.setup.encode_texts``): BOS first with ``bos``."""
        ids = torch.as_tensor(self.tokenizer.encode(text), dtype=torch.long)
        if self.bos:
            ids = torch.cat([torch.tensor([self.bos_id]), ids])
        return ids

    def score_document(self, ids: torch.Tensor, keep_token_losses: bool = False,
                       progress: Progress | None = None) -> EvalResult:
        """Score ``ids[1:]`` given the document so far, from the trained weights and an empty state: the total NLL
        (nats) and, with ``keep_token_losses``, each prediction's; ``progress`` counts the scored tokens."""
        if ids.numel() < 2:
            return EvalResult(0.0, 0)
        if self.evaluator is not None:  # score each segment, then update on it; a fresh state per document
            result, _ = self.evaluator.evaluate(ids, None, final=True, keep_token_losses=keep_token_losses,
                                                progress=progress)
            return result
        # DynamicEvaluator.static's protocol (segments of segment_len, `context` tokens of context)
        seq_len = self.context if self.context is not None else ids.numel() + self.segment_len
        with torch.no_grad():
            result, _ = score_tokens(self.model, ids, seq_len, self.segment_len, keep_token_losses=keep_token_losses,
                                     progress=progress)
        return result

    def token_losses(self, text: str) -> list[float]:
        """Each prediction's NLL (nats) in ``text`` as ``loglikelihood_rolling`` scores it (for leak checks)."""
        return self.score_document(self.encode_document(text), keep_token_losses=True).token_losses

    def _progress(self, total: int, unit: str, what: str, disable: bool) -> Progress:
        """The progress line of one request type (stderr; lm-eval's ``disable_tqdm`` turns it off)."""
        return Progress(total, unit, desc=f"{self.name}: {what}", enabled=not disable)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood (nats), scored on its own (see :mod:`fastweights.harness`); a
        progress line counts the scored tokens of all documents."""
        docs = [(req.args[0], self.encode_document(req.args[0])) for req in requests]
        bar = self._progress(sum(max(0, ids.numel() - 1) for _, ids in docs), "tok",
                             f"loglikelihood_rolling, {len(docs):,} document(s)", disable_tqdm)
        out, scored = [], 0
        for text, ids in docs:
            ll = -self.score_document(ids, progress=bar).nll
            self._refuse_non_finite(ll, "loglikelihood_rolling")
            out.append(ll)
            scored += max(0, ids.numel() - 1)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), ll)
        bar.close()
        self._refuse_worse_than_uniform(-sum(out), scored, "loglikelihood_rolling")
        return out

    def _refuse_worse_than_uniform(self, nll: float, tokens: int, what: str) -> None:
        """Scores whose mean over the call is far worse than a uniform guess are no result (issue 52), as ``eval``
        refuses them."""
        if tokens:
            refuse_worse_than_uniform(nll / tokens, vocab_size_of(self.tokenizer), f"{self.name} {what}")

    def _refuse_non_finite(self, ll: float, what: str) -> None:
        """A log-likelihood that is NaN or infinite is no score: refused in one line, as ``dynamic eval`` does."""
        if not math.isfinite(ll):
            raise UserError(f"{what}: a log-likelihood is {ll}, not a number to report: "
                            f"{scores_not_finite_because(self.evaluator, 'lr=')}")

    # -- (context, continuation) pairs and generation: the trained weights ------------------------

    def _say_static(self) -> None:
        if self.dynamic and not self._warned:
            warnings.warn(STATIC_ONLY, stacklevel=3)
            self._warned = True

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context and continuation ids: the whole string encoded once and split where the context's own
        encoding ends (trailing spaces of the context move to the continuation), as lm-eval's models do."""
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        whole = [int(i) for i in self.tokenizer.encode(context + continuation)]
        ctx = [int(i) for i in self.tokenizer.encode(context)] if context else []
        if whole[: len(ctx)] != ctx:  # the tokenizer merged across the boundary: encode the parts apart
            return ctx, [int(i) for i in self.tokenizer.encode(continuation)]
        return ctx, whole[len(ctx):]

    def _window(self) -> int | None:
        return self.context

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """log P(continuation | context) and whether greedy decoding gives the continuation, with the trained
        weights; one forward pass over at most ``context`` tokens (the oldest context tokens cut first)."""
        self._say_static()
        bar = self._progress(len(requests), "requests", "loglikelihood", disable_tqdm)
        out, scored = [], 0
        for req in requests:
            context, continuation = req.args
            ctx, cont = self._encode_pair(context, continuation)
            if not cont:
                out.append((0.0, True))
                bar.update(1)
                continue
            if not ctx:
                if self.bos_id is None:
                    raise UserError("loglikelihood with an empty context needs a BOS token to condition on; "
                                    "this tokenizer has none")
                ctx = [self.bos_id]
            whole = ctx + cont
            window = self._window()
            if window is not None:
                whole = whole[-(window + 1):]
            x = torch.tensor([whole[:-1]], device=self._device)
            y = torch.tensor(whole[-len(cont):], device=self._device)
            with torch.no_grad():
                logits = self.model(x).logits[0, -len(cont):]
            logp = log_probs(logits)
            ll = float(logp.gather(-1, y[:, None]).sum())
            greedy = bool((logp.argmax(-1) == y).all())
            self._refuse_non_finite(ll, "loglikelihood")
            out.append((ll, greedy))
            scored += len(cont)
            self.cache_hook.add_partial("loglikelihood", (context, continuation), (ll, greedy))
            bar.update(1)
        bar.close()
        self._refuse_worse_than_uniform(-sum(ll for ll, _ in out), scored, "loglikelihood")
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or, with ``do_sample``, sampled) continuation of each context with the trained weights, cut
        at the first of ``until`` and at ``max_gen_toks`` tokens (default 256)."""
        self._say_static()
        bar = self._progress(len(requests), "requests", "generate_until", disable_tqdm)
        out = []
        for req in requests:
            context, gen_kwargs = req.args
            kw = dict(gen_kwargs or {})
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kw.get("max_gen_toks", 256))
            temperature = float(kw.get("temperature", 0.0)) if kw.get("do_sample") else 0.0
            prompt = [int(i) for i in self.tokenizer.encode(context)] or ([self.bos_id] if self.bos_id is not None
                                                                           else [])
            if not prompt:
                raise UserError("generate_until with an empty context needs a BOS token; this tokenizer has none")
            if self.context is not None:
                prompt = prompt[-self.context:]
            ids: list[int] = []
            text = ""
            for t in generate_tokens(self.model, prompt, max_new, temperature=temperature,
                                     seed=kw.get("seed"), context=self.context):
                ids.append(t)
                text = self.tokenizer.decode(ids)
                if any(s in text for s in until):
                    break
            for s in until:
                text = text.split(s)[0] if s else text
            out.append(text)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            bar.update(1)
        bar.close()
        return out


@register_model("fastweights")
class FastweightsStatic(FastweightsLM):
    """``--model fastweights --model_args checkpoint=DIR`` (or ``hf=NAME``): the model as it is."""

    dynamic = False
    name = "fastweights"


@register_model("fastweights-dynamic")
class FastweightsDynamic(FastweightsLM):
    """``--model fastweights-dynamic --model_args checkpoint=DIR|hf=NAME,rule=...,lr=...``: dynamic evaluation
    on ``loglikelihood_rolling``; ``loglikelihood`` and ``generate_until`` with the trained weights (a warning
    says so once)."""

    dynamic = True
    name = "fastweights-dynamic"
