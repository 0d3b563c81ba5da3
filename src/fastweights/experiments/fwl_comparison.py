"""A Fast Weight Layer head on a pretrained model against dynamic evaluation of the same model: the texts, scoring
through one evaluator loop, the FWL's gain split into its slow and fast parts, the FWL paper's comparators (every
setting chosen on tuning text), and where each gains (Figure 2). The rows of ``benchmarks/quality/fwl_smollm2.py``,
``fwl_in_domain.py``, ``fwl_top_blocks.py`` and ``smollm2_fast_dynamic.py``.

Clark et al. 2022, "Meta-Learning Fast Weight Language Models" (arXiv 2212.02475), section 3 and Table 2;
dynamic evaluation: Krause et al. 2019 (arXiv 1904.08378).

Scoring (:func:`score`): every row goes through ``DynamicEvaluator``'s loop on the same token ids, segments of
``segment_len`` predictions, the whole text in the KV cache. Static rows (``lr`` 0: the pretrained model, and
every FWL row, whose adaptation is inside the head) use its static pass; the dynamic rows its
score-then-update loop. Time is process CPU seconds around the loop alone.

The gain split (issue 41, scope 3). The FWL head scores

    logits'_t = (h_t + f_{theta'_t}(h_t)) E + c,   theta'_t = theta - alpha . (Delta_k + sum_{s<t in k} g_s)

With every step size alpha = 0, theta'_t = theta: the head's *slow part*, what its trained slow weights give
alone. Its *fast part* is the rest: relative perplexity reduction against static of the full head minus that
of the slow part (so slow + fast = full, per text and in the mean), and the same in nats per token.
``fastweights.layers.fwl.scaled_step_sizes`` multiplies the step sizes the head uses by one factor without
touching its parameters (however they are parameterised: learned, log-parameterised, or the test-time-only
head's global step), and restores them on exit; factor 0 is ``layers.fwl.slow_part``, a factor chosen on
tuning text the ``fwl_step_scaled`` diagnosis.

Comparators (scope 4), each with its learning rate (and rank) chosen on the tuning texts by :func:`search_lr`
(the loss of ``evaluate_documents`` over the tuning texts, each its own document):

- ``dynamic``: the setting ``smollm2_dynamic_eval.json`` chose on tuning text (its rule and parameter subset),
  its lr re-chosen here on the longer tuning texts from :data:`DYNAMIC_LR_FACTORS` x its lr;
- ``dynamic_top_blocks``: the same rule on the last :data:`TOP_BLOCKS` decoder blocks and the final norm only
  (the paper's "dynamic evaluation of a few layers"), lr from :data:`TOP_BLOCKS_LR_FACTORS` x the chosen lr;
- ``dynamic_lowrank``: the same rule on rank-r deltas W + A B of every MLP projection (``adapt.lowrank``), lr
  from :data:`LOWRANK_LR_FACTORS` x the chosen lr at rank ``LOWRANK_RANKS[1]``, then the other ranks at that lr.

MS_g of the RMS rules: on the statistics text (neither scored nor tuned on), all weights but the excluded ones
(the tied embedding), which covers the top-blocks subset; the low-rank A's their own per rank.

The texts (:data:`TEXTS`): bundled excerpts (``fastweights.data.excerpts``), each with its role: scored, tuning
(``validation``) or statistics.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from fastweights.adapt.dynamic import DynamicEvaluator
from fastweights.adapt.lowrank import LowRankDynamicEvaluator, collect_lowrank_grad_stats
from fastweights.adapt.tune import point_status
from fastweights.adapt.grad_stats import collect_grad_stats
from fastweights.core.errors import UserError
from fastweights.data.excerpts import ExcerptSpec, bundled_excerpt, token_excerpt
from fastweights.layers.fwl import scaled_step_sizes, slow_part
from fastweights.loops.evaluate import SCORING_SEGMENT_LEN

DYNAMIC_LR_FACTORS = (0.5, 1.0, 2.0)  # x the chosen setting's lr (smollm2_dynamic_eval.json, chosen on 2 x 1,024)
TOP_BLOCKS = 2  # decoder blocks of the "few layers" row (plus the final norm)
# x the chosen lr (the last 6 blocks' best was 1.56x there; the last 2's was <= 0.37x on 2 x 256 tuning tokens in a
# trial run with the grid 1.5, 3, 6 extended twice downwards)
TOP_BLOCKS_LR_FACTORS = (0.5, 1.0, 2.0, 4.0)
LOWRANK_RANKS = (8, 16, 32)  # the middle one first, with the lr grid; the others at its best lr
LOWRANK_LR_FACTORS = (15.8, 31.6, 63.2)  # x the chosen lr (rank 16's best was 31.6x there)
LR_EXTENSIONS = 2  # grid points added past an edge that is best, at most
STEP_SCALES = (0.0, 0.125, 0.25, 0.5, 1.0, 2.0)  # factors on the FWL's learned step sizes
TEST_TIME_STEPS = (0.0, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2)  # the test-time-only head's global step size, x3 grid
PARTS = {"mlp": "MLPs", "all": "every linear map"}  # what of the last blocks top_linears names: ".mlp.*" or ".*"
STATS = {"batch_size": 4, "max_batches": 16, "context": 1024}  # MS_g: 16 batches of 4 x segment_len targets
LN2 = math.log(2)
#: (excerpt, English): the bundled excerpts (War and Peace scored here) and a statistics text of the training mix's corpora
TEXTS = (
    (bundled_excerpt("anna_karenina"), True),
    (bundled_excerpt("hamlet"), True),
    (bundled_excerpt("war_and_peace_ch2")._replace(role="scored"), True),
    (bundled_excerpt("don_quijote"), False),
    (bundled_excerpt("crime_and_punishment_part3"), True),
    (bundled_excerpt("macbeth_act3"), True),
    (ExcerptSpec("state_of_the_union_1946", "State of the Union 1946", "Truman, State of the Union address, 1946",
                 "state-of-the-union:1946-Truman.txt", "", "statistics"), True),
)
STATS_TOKENS = STATS["batch_size"] * STATS["max_batches"] * SCORING_SEGMENT_LEN  # MS_g's targets, one segment a row


def cpu() -> float:
    """This process's CPU seconds (every row is timed on them, one thread)."""
    return time.process_time()


def static_evaluator(model, segment_len: int) -> DynamicEvaluator:
    """The evaluator of a row without test-time updates of the weights (lr 0: its static pass)."""
    return DynamicEvaluator(model, rule="sgd", lr=0.0, segment_len=segment_len, context=model.default_context)


def score(ev: DynamicEvaluator, ids: torch.Tensor) -> dict:
    """``ids`` [T] through ``ev``'s loop: per-token losses (nats, [T - 1]) of ``ids[1:]``, their mean, the
    perplexity, and the process CPU seconds and tokens per CPU-second of the loop."""
    c = cpu()
    if ev.update_rule.lr == 0.0:
        r = ev.static(ids)  # each keeps the per-token losses by default
    else:
        r, _ = ev.evaluate(ids)
    seconds = max(cpu() - c, 1e-9)
    losses = torch.tensor(r.token_losses, dtype=torch.float64)
    return {"losses": losses, "cpu_s": seconds, "loss_nats": losses.mean().item(),
            "perplexity": math.exp(losses.mean().item()), "tokens_per_cpu_s": losses.numel() / seconds}


def score_texts(ev: DynamicEvaluator, texts: dict[str, torch.Tensor]) -> dict[str, dict]:
    """:func:`score` of each text (name -> ids [T])."""
    return {k: score(ev, ids) for k, ids in texts.items()}


# ----------------------------------------------------------------------------- the FWL's slow and fast parts


def gain_split(static: dict, full: dict, slow: dict) -> dict:
    """Per text (the keys of ``full``) and in the mean: the relative perplexity reduction against ``static`` of
    the full head, of its slow part and their difference (the fast part), and the fast part in nats per token
    (slow loss - full loss; positive = the fast update helps). Arguments: text -> :func:`score` result."""
    per = {}
    for k in full:
        s, f, sl = static[k]["perplexity"], full[k]["perplexity"], slow[k]["perplexity"]
        per[k] = {"full_perplexity": f, "slow_perplexity": sl, "static_perplexity": s,
                  "full_reduction": 1 - f / s, "slow_reduction": 1 - sl / s, "fast_reduction": (sl - f) / s,
                  "fast_nats_per_token": slow[k]["loss_nats"] - full[k]["loss_nats"]}
    mean = {f"mean_{m}": sum(p[m] for p in per.values()) / len(per)
            for m in ("full_reduction", "slow_reduction", "fast_reduction", "fast_nats_per_token")}
    return {"per_text": per, **mean}


@torch.no_grad()
def head_loss_on(model, hidden_and_ids, piece: int = 512) -> float:
    """Mean loss (nats) of ``model.head`` on precomputed backbone hidden states ``[(h [1, T, d], ids [T])]``,
    each text read in pieces of ``piece`` positions with the head's state carried (equal to one call, without
    [T, vocab] logits at once)."""
    total, n = 0.0, 0
    for h, ids in hidden_and_ids:
        state = None
        for a in range(0, ids.numel() - 1, piece):
            b = min(a + piece, ids.numel() - 1)
            logits, state = model.head(h[:, a:b], ids[None, a:b], state)
            total += torch.nn.functional.cross_entropy(logits[0], ids[a + 1:b + 1], reduction="sum").item()
        n += ids.numel() - 1
    return total / n


def tuning_hidden(lm, tuning: list[torch.Tensor]) -> list:
    """``[(h [1, T, d], ids)]``: the backbone's final hidden states of each tuning text, one pass each."""
    with torch.no_grad():
        return [(lm.forward_features(ids[None])[0], ids) for ids in tuning]


def best_point(losses: dict, baseline: float, name: str, allowed=(), log=print) -> tuple[float, dict]:
    """The point of ``losses`` (point -> tuning loss, nats) to choose: the lowest among those below ``baseline``
    (the loss without adaptation) or in ``allowed`` (a grid's own no-adaptation point), never one that
    ``adapt.tune.point_status`` calls ``diverged`` (not finite, or more than its margin above the baseline). Each
    point that is not below the baseline is logged. Returns (best, point -> status); none to choose: a
    UserError (one line, exit 2)."""
    status = {k: point_status(v, baseline) for k, v in losses.items()}
    for k, st in status.items():
        if st != "ok" and k not in allowed:
            log(f"   {name} {k:g}: {st} ({losses[k]:.4f} nats against {baseline:.4f} without adaptation)")
    usable = [k for k in losses if status[k] == "ok" or (k in allowed and status[k] != "diverged")]
    if not usable:
        raise UserError(f"{name}: no point of the grid beats {baseline:.4f} nats per token without adaptation on the "
                        "tuning texts (" + ", ".join(f"{k:g}: {v:.4f}" for k, v in losses.items()) + ")")
    return min(usable, key=losses.get), {f"{k:g}": v for k, v in status.items()}


def tune_test_time_step(model, hidden_and_ids, grid=TEST_TIME_STEPS) -> dict:
    """The test-time-only head's global step size on the tuning texts: ``grid``, extended x3 while its largest
    value is best; set on the head."""
    grid, results = sorted({0.0, *grid}), {}  # step 0: the head's slow part, the baseline
    while True:
        for step in grid:
            if step not in results:
                model.head.options.test_time_step_size = step
                results[step] = head_loss_on(model, hidden_and_ids)
        finite = {k: v for k, v in results.items() if math.isfinite(v)}
        lowest = min(finite, key=finite.get) if finite else 0.0
        if lowest != max(results) or lowest >= 10.0:  # extend x3 while the largest step is the lowest loss
            break
        grid.append(lowest * 3)
    best, status = best_point(results, results[0.0], "test-time step", allowed=(0.0,))
    model.head.options.test_time_step_size = best
    return {"grid_nats": {f"{k:g}": v for k, v in sorted(results.items())}, "status": status, "best": best}


def tune_step_scale(model, hidden_and_ids, grid=STEP_SCALES) -> dict:
    """One factor on every step size the FWL head uses, chosen on the tuning texts (not set: score the row
    under ``scaled_step_sizes(model.head, best)``)."""
    results = {}
    for scale in sorted({0.0, *grid}):  # scale 0: the head's slow part, the baseline
        with scaled_step_sizes(model.head, scale):
            results[scale] = head_loss_on(model, hidden_and_ids)
    best, status = best_point(results, results[0.0], "step scale", allowed=(0.0,))
    return {"grid_nats": {f"{k:g}": v for k, v in results.items()}, "status": status, "best": best,
            "learned_step_sizes": {k: float(v.detach()) for k, v in model.head.current_step_sizes().items()}}


def fwl_rows(heads: dict, scored: dict, tuning: list[torch.Tensor], segment_len: int, log=print) -> tuple[dict, dict]:
    """The FWL rows: for each head (row name -> ``HFCausalLMWithFWL``; ``fwl`` the recipe's, and any of
    ``fwl_test_time_only``, ``fwl_bias_only``) the full head and its slow part (``<row>_slow_part``), and for
    ``fwl`` the step-scaled diagnosis (its slow part is ``fwl``'s). Settings chosen on the ``tuning`` texts:
    the test-time-only step size (set on that head), the step scale. Returns (rows: name -> text -> score,
    tuned)."""
    rows, tuned, hidden_of = {}, {}, {}

    def hidden(model) -> list:  # the tuning texts' hidden states of the head's own backbone (its top blocks
        if id(model.backbone) not in hidden_of:  # are the trained ones when it trained some)
            hidden_of[id(model.backbone)] = tuning_hidden(model.backbone, tuning)
        return hidden_of[id(model.backbone)]

    if "fwl_test_time_only" in heads:
        tuned["fwl_test_time_only"] = tune_test_time_step(heads["fwl_test_time_only"], hidden(heads["fwl_test_time_only"]))
        log(f"test-time-only step size: {tuned['fwl_test_time_only']['best']:g}")
    for row, model in heads.items():
        ev = static_evaluator(model, segment_len)
        rows[row] = score_texts(ev, scored)
        with slow_part(model.head):
            rows[f"{row}_slow_part"] = score_texts(ev, scored)
        log(f"{row}: " + ", ".join(f"{k} {r['perplexity']:.3f} (slow part {rows[f'{row}_slow_part'][k]['perplexity']:.3f})"
                                   for k, r in rows[row].items()))
    if "fwl" in heads:
        tuned["fwl_step_scale"] = tune_step_scale(heads["fwl"], hidden(heads["fwl"]))
        log(f"FWL step-size scale chosen on tuning text: {tuned['fwl_step_scale']['best']:g}")
        with scaled_step_sizes(heads["fwl"].head, tuned["fwl_step_scale"]["best"]):
            rows["fwl_step_scaled"] = score_texts(static_evaluator(heads["fwl"], segment_len), scored)
    return rows, tuned


# ----------------------------------------------------------------------------- the paper's comparators


def top_blocks_row(lm, k: int, setting: dict, scored: dict, tuning: list[torch.Tensor], stats, segment_len: int,
                   log=print, static: float | None = None) -> tuple[dict, dict]:
    """``dynamic_top_blocks``: ``setting``'s rule (``rule``; ``lr_there`` the lr its grid multiplies) on the last
    ``k`` decoder blocks and the final norm of ``lm``, lr from :data:`TOP_BLOCKS_LR_FACTORS` chosen on ``tuning``.
    ``stats``: MS_g of the RMS rules (``collect_grad_stats`` over weights that cover the blocks), or a statistics
    text's ids [T] to collect it from; ``static``: :func:`static_tuning_loss` of ``lm`` when known. Returns
    (text -> score, the setting and its search)."""
    rule, lr0 = setting["rule"], float(setting["lr_there"])
    if isinstance(stats, torch.Tensor):
        stats = collect_grad_stats(lm, stats, include=top_blocks_include(lm, k), seq_len=segment_len, **STATS) \
            if rule.startswith("rms") else None
    top = top_blocks_include(lm, k)

    def make(lr):
        return DynamicEvaluator(lm, rule=rule, lr=lr, segment_len=segment_len, context=lm.default_context,
                                include=top, exclude=None, grad_stats=stats)

    if static is None:
        static = static_tuning_loss(lm, tuning, segment_len)
    search = search_lr(make, tuning, [lr0 * f for f in TOP_BLOCKS_LR_FACTORS], static, log, f"top {k} blocks")
    tuned = {"rule": rule, "include": top, "blocks": k, "lr_search": search, "lr": search["best"]}
    return score_texts(make(search["best"]), scored), tuned


def tuning_loss(ev: DynamicEvaluator, tuning: list[torch.Tensor]) -> float:
    """Mean loss (nats per prediction) of ``ev`` over the tuning texts, each its own document (inf if it diverged)."""
    r = ev.evaluate_documents(tuning)
    return r.nll / r.tokens if math.isfinite(r.nll) else math.inf


def static_tuning_loss(model, tuning: list[torch.Tensor], segment_len: int) -> float:
    """Mean loss (nats per prediction) of ``model`` without adaptation over the tuning texts, each its own
    document: the baseline of :func:`search_lr`."""
    ev = static_evaluator(model, segment_len)
    results = [ev.static(ids, keep_token_losses=False) for ids in tuning]
    return sum(r.nll for r in results) / sum(r.tokens for r in results)


def search_lr(make: Callable[[float], DynamicEvaluator], tuning: list[torch.Tensor], grid, static: float,
              log=print, name: str = "", known: dict | None = None) -> dict:
    """The lr of ``make(lr)`` with the lowest :func:`tuning_loss` below ``static`` (:func:`static_tuning_loss`;
    :func:`best_point`: a diverged lr is never chosen, a grid with none below static is a UserError): the
    ascending geometric ``grid``, extended by its own ratio past an edge that is best, at most
    :data:`LR_EXTENSIONS` times. Returns ``{"grid_nats": {lr: loss}, "status": {lr: point_status}, "static_nats",
    "best": lr, "best_at_edge": whether it is still the smallest or largest lr tried, "cpu_s"}``. ``known``: lr ->
    tuning loss already measured with the same ``make`` (not run again)."""
    c, losses = cpu(), {float(f"{k:.3g}"): v for k, v in (known or {}).items()}

    def run(lr: float) -> None:
        lr = float(f"{lr:.3g}")
        if lr not in losses:
            losses[lr] = tuning_loss(make(lr), tuning)
            log(f"   {name} lr {lr:.3g}: tuning loss {losses[lr]:.4f}")

    for lr in grid:
        run(lr)
    ratio = grid[1] / grid[0] if len(grid) > 1 else 2.0
    for _ in range(LR_EXTENSIONS):
        finite = {k: v for k, v in losses.items() if math.isfinite(v)}
        if not finite:
            break
        best, lrs = min(finite, key=finite.get), sorted(losses)
        if best == lrs[-1]:
            run(best * ratio)
        elif best == lrs[0]:
            run(best / ratio)
        else:
            break
    best, status = best_point(losses, static, f"{name} lr".strip(), log=log)
    return {"grid_nats": {f"{k:.3g}": v for k, v in sorted(losses.items())}, "status": status,
            "static_nats": static, "best": best, "best_at_edge": best in (min(losses), max(losses)),
            "cpu_s": cpu() - c}


def top_linears(lm, k: int, parts: str = "mlp") -> str:
    """Glob patterns (comma-separated) of the linear maps of the last ``k`` decoder blocks of ``lm``: their MLP
    projections (``parts="mlp"``) or all of them (``"all"``: attention too; low-rank adaptation takes only the
    linear modules a pattern matches)."""
    names = {id(m): n for n, m in lm.named_modules()}
    blocks = list(lm.layers)
    if not 1 <= k <= len(blocks):
        raise UserError(f"top blocks must be in 1..{len(blocks)}, got {k}")
    if parts not in PARTS:
        raise UserError(f"parts must be one of {', '.join(PARTS)}, got {parts!r}")
    return ",".join(f"{names[id(b)]}{'.mlp.*' if parts == 'mlp' else '.*'}" for b in blocks[len(blocks) - k:])


def tuning_rate(ev: DynamicEvaluator, tuning: list[torch.Tensor]) -> tuple[float, float]:
    """(tuning loss, predictions per process CPU-second) of ``ev`` over the tuning texts."""
    c = cpu()
    if ev.update_rule.lr:
        loss = tuning_loss(ev, tuning)
    else:  # the static pass
        loss = static_tuning_loss(ev.model, tuning, ev.segment_len)
    return loss, sum(t.numel() - 1 for t in tuning) / max(cpu() - c, 1e-9)


def top_blocks_include(lm, k: int = TOP_BLOCKS) -> str:
    """Glob patterns (comma-separated) of the last ``k`` decoder blocks and the final norm of ``lm`` (an
    ``HFCausalLM``), as ``select_parameters`` names them."""
    names = {id(m): n for n, m in lm.named_modules()}
    blocks = list(lm.layers)
    if not 1 <= k <= len(blocks):
        raise UserError(f"top blocks must be in 1..{len(blocks)}, got {k}")
    base = lm.hf.base_model
    norm = getattr(base, "norm", None) or getattr(base, "ln_f", None)
    if norm is None:
        raise UserError(f"{type(base).__name__}: no final norm (norm or ln_f) found")
    return ",".join(f"{names[id(m)]}.*" for m in [*blocks[len(blocks) - k:], norm])


def dynamic_rows(lm, scored: dict, tuning: list[torch.Tensor], stats_ids: torch.Tensor, chosen: dict,
                 segment_len: int, log=print) -> tuple[dict, dict]:
    """The dynamic-evaluation rows (``dynamic``, ``dynamic_top_blocks``, ``dynamic_lowrank``; the module
    docstring) on ``lm``: ``chosen`` is the setting chosen on tuning text (``rule``, ``lr``, ``include``,
    ``exclude``). Returns (rows: name -> text -> score, tuned: name -> the settings and their searches)."""
    L, rule, lr0 = segment_len, chosen["rule"], float(chosen["lr"])
    rms = rule.startswith("rms")
    ctx = lm.default_context
    stats_kw = {"seq_len": L, **STATS}
    c = cpu()
    stats = collect_grad_stats(lm, stats_ids, exclude=chosen["exclude"], **stats_kw) if rms else None
    stats_s = cpu() - c
    rows, tuned = {}, {}

    def full(include, exclude):
        return lambda lr: DynamicEvaluator(lm, rule=rule, lr=lr, segment_len=L, context=ctx, include=include,
                                           exclude=exclude, grad_stats=stats)

    make = full(chosen["include"], chosen["exclude"])
    static = static_tuning_loss(lm, tuning, L)
    search = search_lr(make, tuning, [lr0 * f for f in DYNAMIC_LR_FACTORS], static, log, "dynamic")
    tuned["dynamic"] = {"rule": rule, "include": chosen["include"], "exclude": chosen["exclude"],
                        "ms_g_cpu_s": stats_s, "lr_search": search, "lr": search["best"]}
    rows["dynamic"] = score_texts(make(search["best"]), scored)

    rows["dynamic_top_blocks"], tuned["dynamic_top_blocks"] = top_blocks_row(
        lm, TOP_BLOCKS, {"rule": rule, "lr_there": lr0}, scored, tuning, stats, L, log, static)

    lr_stats: dict[int, tuple] = {}

    def lowrank(rank):
        if rank not in lr_stats:
            c = cpu()
            s = collect_lowrank_grad_stats(lm, stats_ids, rank=rank, **stats_kw) if rms else None
            lr_stats[rank] = (s, cpu() - c)
        return lambda lr: LowRankDynamicEvaluator(lm, rule=rule, lr=lr, segment_len=L, context=ctx, rank=rank,
                                                  grad_stats=lr_stats[rank][0])

    mid = LOWRANK_RANKS[len(LOWRANK_RANKS) // 2]
    search = search_lr(lowrank(mid), tuning, [lr0 * f for f in LOWRANK_LR_FACTORS], static, log, f"low-rank {mid}")
    by_rank = {mid: (search["grid_nats"][f"{search['best']:.3g}"], search["best"])}
    for rank in LOWRANK_RANKS:
        if rank not in by_rank:
            by_rank[rank] = (tuning_loss(lowrank(rank)(search["best"]), tuning), search["best"])
            log(f"   low-rank {rank} lr {search['best']:.3g}: tuning loss {by_rank[rank][0]:.4f}")
    rank, _ = best_point({r: v[0] for r, v in by_rank.items()}, static, "low-rank rank", log=log)
    tuned["dynamic_lowrank"] = {"rule": rule, "rank": rank, "lr": search["best"], "lr_search": search,
                                "lr_search_rank": mid, "rank_nats": {str(r): v[0] for r, v in sorted(by_rank.items())},
                                "ms_g_cpu_s": {str(r): v[1] for r, v in sorted(lr_stats.items())}}
    rows["dynamic_lowrank"] = score_texts(lowrank(rank)(search["best"]), scored)
    for name in rows:
        log(f"{name}: " + ", ".join(f"{k} {r['perplexity']:.3f}" for k, r in rows[name].items()))
    return rows, tuned


# ----------------------------------------------------------------------------- the texts and the summaries


def load_texts(tok, tokens: int, val_tokens: int) -> dict:
    """key -> (ids [n + 1], info) of every text of :data:`TEXTS`: ``tokens`` predictions per scored text,
    ``val_tokens`` per tuning text, :data:`STATS_TOKENS` for the statistics text."""
    sizes = {"scored": tokens, "validation": val_tokens, "statistics": STATS_TOKENS}
    out = {}
    for spec, english in TEXTS:
        ids, info = token_excerpt(tok, spec, sizes[spec.role])
        out[spec.key] = (ids, {**info, "english": english})
    return out


def split_roles(texts: dict) -> tuple[dict, list, torch.Tensor, set]:
    """:func:`load_texts`' texts by role: (scored: key -> ids, the tuning texts' ids, the statistics text's ids, the
    keys of the English scored texts)."""
    by_role = lambda role: {k: ids for k, (ids, info) in texts.items() if info["role"] == role}  # noqa: E731
    scored = by_role("scored")
    (stats_ids,) = by_role("statistics").values()
    return scored, list(by_role("validation").values()), stats_ids, {k for k in scored if texts[k][1]["english"]}


def summarise(rows: dict, english: set[str]) -> dict:
    """row -> {per_text: {text: perplexity, loss, CPU s, tokens per CPU-s, relative perplexity reduction and
    throughput ratio against ``rows["static"]``}, the means of the two over the texts and over ``english``}."""
    static = rows["static"]
    results = {}
    for row, per in rows.items():
        per_text = {}
        for k, r in per.items():
            per_text[k] = {"perplexity": r["perplexity"], "loss_nats": r["loss_nats"], "cpu_s": r["cpu_s"],
                           "tokens_per_cpu_s": r["tokens_per_cpu_s"],
                           "relative_perplexity_reduction": 1 - r["perplexity"] / static[k]["perplexity"],
                           "throughput_ratio_to_static": r["tokens_per_cpu_s"] / static[k]["tokens_per_cpu_s"]}
        eng = [p for k, p in per_text.items() if k in english]
        results[row] = {"per_text": per_text,
                        "mean_relative_perplexity_reduction": float(np.mean(
                            [p["relative_perplexity_reduction"] for p in per_text.values()])),
                        "mean_relative_perplexity_reduction_english": float(np.mean(
                            [p["relative_perplexity_reduction"] for p in eng])) if eng else None,
                        "mean_throughput_ratio_to_static": float(np.mean(
                            [p["throughput_ratio_to_static"] for p in per_text.values()]))}
    return results


# ----------------------------------------------------------------------------- where each row gains (Figure 2)


def frequency_bins(ids: torch.Tensor, counts: Counter) -> list[str]:
    """The bin of each token of ``ids`` by how often it occurs in the training mix (``counts``): unseen, 1-9, ...,
    1000+."""
    edges = [(0, 0, "unseen"), (1, 9, "1-9"), (10, 99, "10-99"), (100, 999, "100-999"), (1000, None, "1000+")]
    out = []
    for t in ids.tolist():
        c = counts.get(t, 0)
        out.append(next(name for lo, hi, name in edges if c >= lo and (hi is None or c <= hi)))
    return out


def figure2(per_text: dict, rows: dict, methods: list[str], counts: Counter) -> dict:
    """NLL improvement over static (bits per token, positive = better) by position, by training-mix frequency
    of the target token and for first occurrences vs repeats, pooled over the scored texts."""
    out = {m: {"position": {}, "frequency": {}, "repeat": {}} for m in methods}
    pos_edges = [0, 64, 256, 1024, 2048, 4096]
    for m in methods:
        gains, pos, freq, rep = [], [], [], []
        for k, ids in per_text.items():
            g = ((rows["static"][k]["losses"] - rows[m][k]["losses"]) / LN2).tolist()
            targets = ids[1:]
            seen, first = set(), []
            for t in ids[:1].tolist():
                seen.add(t)
            for t in targets.tolist():
                first.append(t not in seen)
                seen.add(t)
            gains += g
            pos += list(range(len(g)))
            freq += frequency_bins(targets, counts)
            rep += ["first occurrence" if f else "repeat" for f in first]
        gains_t = np.asarray(gains)
        for a, b in zip(pos_edges, pos_edges[1:]):
            sel = [(a <= p < b) for p in pos]
            if any(sel):
                out[m]["position"][f"{a}-{b}"] = {"bits": float(gains_t[sel].mean()), "tokens": int(sum(sel))}
        for name in ("unseen", "1-9", "10-99", "100-999", "1000+"):
            sel = [f == name for f in freq]
            if any(sel):
                out[m]["frequency"][name] = {"bits": float(gains_t[sel].mean()), "tokens": int(sum(sel))}
        for name in ("first occurrence", "repeat"):
            sel = [r == name for r in rep]
            if any(sel):
                out[m]["repeat"][name] = {"bits": float(gains_t[sel].mean()), "tokens": int(sum(sel))}
    return out


def plot(fig2: dict, labels: dict, path: Path, texts: str) -> None:
    """Figure 2's three panels for the methods of ``fig2`` (their legend ``labels``), of the ``texts`` named."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    styles = {"dynamic": ("tab:blue", "o", "-"), "fwl": ("tab:orange", "s", "--"),
              "fwl_test_time_only": ("tab:green", "^", ":"), "fwl_bias_only": ("tab:purple", "D", "-."),
              "fwl_slow_part": ("tab:red", "v", ":"), "fwl_step_scaled": ("tab:brown", "P", "-.")}
    for ax, (panel, title) in zip(axes, (("position", "by position in the text (tokens)"),
                                         ("frequency", "by frequency of the target in the training mix"),
                                         ("repeat", "first occurrence vs repeat in the text"))):
        for m, data in fig2.items():
            names = list(data[panel])
            colour, marker, ls = styles[m]
            ax.plot(range(len(names)), [data[panel][n]["bits"] for n in names], color=colour, marker=marker,
                    linestyle=ls, label=labels[m])
            ax.set_xticks(range(len(names)), names, rotation=20)
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("NLL improvement over static (bits/token)")
    fig.suptitle(f"SmolLM2-135M: where the FWL and dynamic evaluation gain ({texts}; above 0 = better than "
                 "static)", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 1))  # the bottom strip holds the legend, below every panel
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=len(names), fontsize=9, frameon=False)
    fig.savefig(path, dpi=110)
    plt.close(fig)
