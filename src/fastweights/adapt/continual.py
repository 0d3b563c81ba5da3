"""Continual adaptation across domains (``fastweights continual``; the FwPKM paper's continual-learning protocol).

The model reads the adaptation text of domain 1, 2, ... in sequence with memory writes on (or with
dynamic evaluation updating the slow weights); after every stage the held-out text of *every* domain
is scored from a copy of the post-stage state with updates off, so later stages continue from the
post-stage state untouched. Stage 0 is the model before any adaptation. The table reports the NLL
per (stage, domain) and its change from stage 0.

Mechanisms without a write step cannot be frozen while scoring (the mixers, the FWL head); the
result lists them (:func:`~fastweights.models.memory_switches.unfrozen_fast_parts`) so that it can say so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from fastweights.core.errors import UserError
from fastweights.models.memory_switches import memory_only_state, memory_writes, trimmed_state, unfrozen_fast_parts
from fastweights.core.progress import Progress


# ----------------------------------------------------------------------------- continual adaptation


@dataclass
class Domain:
    """A domain of the continual-adaptation test: disjoint adaptation and evaluation token ids."""

    name: str
    adapt: torch.Tensor  # [A + 1] ids (A predictions)
    eval: torch.Tensor  # [E + 1] ids, taken from the end of the text


def make_domain(name: str, text: str, tokenizer, adapt_tokens: int, eval_tokens: int) -> Domain:
    """Adaptation ids from the start of ``text``, evaluation ids from its end; their characters never overlap."""
    if adapt_tokens < 1 or eval_tokens < 1:
        raise UserError("adapt and eval token counts must be >= 1")

    def take(n_tokens: int, from_end: bool) -> np.ndarray:
        """Ids of the shortest doubling of a text span (from the start or the end) holding n_tokens + 1."""
        n_chars = 4 * (n_tokens + 1) + 256
        while True:
            piece = text[-n_chars:] if from_end else text[:n_chars]
            ids = np.asarray(tokenizer.encode(piece), dtype=np.int64)
            if ids.size >= n_tokens + 1 or n_chars >= len(text):
                return ids
            n_chars *= 2

    head = take(adapt_tokens, False)
    tail = take(eval_tokens, True)
    too_short = head.size < adapt_tokens + 1 or tail.size < eval_tokens + 1
    if not too_short:  # the characters the two id ranges cover must not overlap
        adapt_chars = len(tokenizer.decode(head[: adapt_tokens + 1].tolist()))
        eval_chars = len(tokenizer.decode(tail[-(eval_tokens + 1):].tolist()))
        too_short = adapt_chars + eval_chars > len(text)
    if too_short:
        raise UserError(f"domain {name!r} is too short for --adapt-tokens {adapt_tokens} and --eval-tokens "
                        f"{eval_tokens} without overlap ({len(text)} characters)")
    return Domain(name, torch.from_numpy(head[: adapt_tokens + 1].copy()), torch.from_numpy(tail[-(eval_tokens + 1):].copy()))


def _score(model, ids: torch.Tensor, state, seq_len: int, stride: int, evaluator=None, values=None,
           progress: Progress | None = None) -> float:
    """Mean NLL of ``ids`` from ``state`` with updates off (memories frozen, adapted weights fixed)."""
    from fastweights.loops.evaluate import score_tokens

    device = next(model.parameters()).device
    with memory_writes(model, frozen=True):
        if evaluator is not None:
            with evaluator._session(values):
                r, _ = score_tokens(model, ids.to(device), seq_len, stride, state=state, progress=progress)
        else:
            r, _ = score_tokens(model, ids.to(device), seq_len, stride, state=state, progress=progress)
    return r.loss


def adapt_test(model, domains: Sequence[Domain], seq_len: int, stride: int | None = None,
               eval_state: str = "memory", evaluator=None, progress: bool = False) -> dict:
    """The continual-adaptation protocol (module docstring); returns a JSON-ready dict.

    Args:
        model: the model; its slow weights never change (dynamic evaluation adapts a copy's deltas).
        domains: in adaptation order.
        seq_len, stride: the streaming protocol of adaptation and scoring (as :func:`stream_eval`).
        eval_state: "memory" (scores start from the post-stage memories with fresh mixer states) or
            "all" (from the whole post-stage state, the KV cache trimmed to ``seq_len - stride``).
        evaluator: a DynamicEvaluator: adaptation also updates the slow weights (score-then-update);
            scoring uses the post-stage weights without updates.

    Returns ``{"domains", "stages", "nll": [[stage][domain]], "delta": nll - stage 0, "adapt_nll": per stage,
    "mean_delta"}`` (nats per token).
    """
    from fastweights.adapt.dynamic import DynamicState
    from fastweights.loops.evaluate import score_tokens

    if eval_state not in ("memory", "all"):
        raise UserError(f"eval_state must be 'memory' or 'all', got {eval_state!r}")
    if not domains:
        raise UserError("continual adaptation needs at least one domain")
    stride = stride or max(1, seq_len // 2)
    keep = seq_len - stride
    n_adapt = sum(d.adapt.numel() - 1 for d in domains)
    n_eval = sum(d.eval.numel() - 1 for d in domains) * (len(domains) + 1)
    # counted as the model scores them (every call), so the line moves within a domain too
    bar = Progress(n_adapt + n_eval, "tok", desc=f"continual: {len(domains)} adaptation stages, "
                   f"{len(domains) + 1} evaluations", enabled=progress)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()

    def evaluate_all(state, values):
        start = memory_only_state(state) if eval_state == "memory" else trimmed_state(model, state, keep)
        row = []
        for d in domains:
            row.append(_score(model, d.eval, start, seq_len, stride, evaluator, values, progress=bar))
        return row

    nll = []
    adapt_nll = []
    try:
        nll.append(evaluate_all(None, None))
        state, dstate = None, None
        for d in domains:
            if evaluator is None:
                r, state = score_tokens(model, d.adapt.to(device), seq_len, stride, state=state, progress=bar)
                values = None
            else:
                start = None if dstate is None else DynamicState(dstate.values, dstate.model_state,
                                                                 torch.zeros(0, dtype=torch.long), 0)
                r, dstate = evaluator.evaluate(d.adapt, start, final=True, keep_token_losses=False, progress=bar)
                state, values = dstate.model_state, dstate.values
            adapt_nll.append(r.loss)
            nll.append(evaluate_all(state, values))
    finally:
        model.train(was_training)
        bar.close()
    base = nll[0]
    delta = [[v - b for v, b in zip(row, base)] for row in nll]
    return {"domains": [d.name for d in domains], "stages": ["before"] + [f"after {d.name}" for d in domains],
            "nll": nll, "delta": delta, "adapt_nll": adapt_nll,
            "mean_delta": [sum(r) / len(r) for r in delta],
            "tokens": {d.name: {"adapt": d.adapt.numel() - 1, "eval": d.eval.numel() - 1} for d in domains},
            "eval_state": eval_state, "seq_len": seq_len, "stride": stride,
            "not_frozen": unfrozen_fast_parts(model)}


def format_adapt_table(result: dict) -> str:
    """The NLL-change table as text: one row per stage, one column per domain (nats/token vs stage 0)."""
    names = result["domains"]
    w = max(8, *(len(n) for n in names))
    head = f"{'stage':<{max(len(s) for s in result['stages'])}}  " + "  ".join(f"{n:>{w}}" for n in names) + f"  {'mean':>8}"
    lines = [head, "-" * len(head)]
    sw = max(len(s) for s in result["stages"])
    for i, stage in enumerate(result["stages"]):
        if i == 0:
            cells = "  ".join(f"{v:>{w}.4f}" for v in result["nll"][0])
            lines.append(f"{stage:<{sw}}  {cells}  {sum(result['nll'][0]) / len(names):>8.4f}")
        else:
            cells = "  ".join(f"{v:>+{w}.4f}" for v in result["delta"][i])
            lines.append(f"{stage:<{sw}}  {cells}  {result['mean_delta'][i]:>+8.4f}")
    lines.append("(first row: NLL in nats/token before adaptation; others: change from it)")
    return "\n".join(lines)


def plot_adapt(result: dict, path: str | Path, title: str = "") -> Path:
    """PNG: change of each domain's NLL after each adaptation stage (the continual-learning plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastweights.core.files import save_figure

    stages = result["stages"]
    fig, ax = plt.subplots(figsize=(1.4 * len(stages) + 3, 4))
    for j, name in enumerate(result["domains"]):
        ax.plot(range(len(stages)), [row[j] for row in result["delta"]], marker="o", label=name)
    ax.plot(range(len(stages)), result["mean_delta"], color="k", ls="--", lw=1, label="mean")
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xticks(range(len(stages)), stages, rotation=20, ha="right")
    ax.set_ylabel("NLL change vs before (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "continual adaptation: held-out NLL after each stage")
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)

