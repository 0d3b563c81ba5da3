"""Dynamic evaluation: adapt a trained language model to the text it is scoring by gradient descent.

Krause, Kahembwe, Murray, Renals, "Dynamic Evaluation of Neural Sequence Models", ICML 2018
(arXiv 1709.07432); the Transformer variant from the same authors' arXiv 1904.08378.

Protocol (paper section 3, ``dynamiceval.py``). A stream x_1..x_T is cut into segments s_1..s_M of
``segment_len`` predictions. Starting from the trained weights theta_g, for i = 1..M:

    1. score s_i with theta^{i-1}, adding -log P(s_i | theta^{i-1}, carried state) to the total;
    2. g_i = gradient of the MEAN cross-entropy over s_i's targets (as the official code does),
       back-propagated to the start of s_i only: the model state (KV cache, recurrent/fast-weight
       state) is carried forward but detached, and memories computed under older weights are not
       recomputed (the Transformer-XL protocol);
    3. theta^i = update(theta^{i-1}, g_i).

Every token is scored before any update has seen it, which is what keeps the log-likelihood valid.
The loop below enforces it structurally: the update receives only the gradient of a segment whose
scores are already recorded. A short last segment is scored and updated on like the others.
The first token of a fresh stream is context only (T - 1 predictions), as in ``evaluate.py``.

Update rules, their equations (paper eqs 4-8) and the learning-rate schedules live in
:mod:`fastweights.adapt.update_rules`; MS_g (eq. 5) in :mod:`fastweights.adapt.grad_stats`; which parameters
are adapted in :mod:`fastweights.adapt.parameter_selection`; the carried state in
:mod:`fastweights.adapt.stream_state`; the loss-against-position analysis (paper Figure 2) in
:mod:`fastweights.adapt.timescale`.

State (the DESIGN's "adapted parameters, a copy or a delta per sequence"): ``evaluate(tokens,
state)`` returns a :class:`DynamicState` holding the adapted values, the model state and the
tokens not yet scored, so scoring a stream in several calls equals scoring it in one.
:meth:`DynamicEvaluator.evaluate_batch` scores several documents at once, each with its own weights
theta_g + delta_b, through ``torch.func.functional_call`` under ``torch.func.vmap``.
"""


from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from fastweights.adapt.grad_stats import UNITS, GradStats
from fastweights.adapt.parameter_selection import select_parameters
from fastweights.adapt.stream_state import as_token_stream, carry_state, logits_and_state
from fastweights.adapt.update_rules import (DEFAULT_DECAY, DEFAULT_EPS, DEFAULT_LR, DEFAULT_RULE, DEFAULT_SEGMENT_LEN,
                                           PRIOR_RULES, UpdateRule, canonical_rule, parse_schedule, schedule_factor)
from fastweights.core.errors import UserError
from fastweights.loops.evaluate import EvalResult, score_tokens
from fastweights.loops.generate import sample_token
from fastweights.ops.nll import token_nll
from fastweights.core.progress import Progress


# ----------------------------------------------------------------------------- the evaluator


@dataclass
class DynamicState:
    """What a stream needs to continue: adaptation, model state, unscored tokens.

    ``values``: the deltas theta - theta_g of the adapted tensors, fp32 (fp64 for fp64 models), in
    the evaluator's order (for sparse dynamic evaluation: the adaptation matrix M itself).
    ``pending``: the last token already consumed as a target (the context of the next prediction)
    followed by tokens not yet scored. ``scored``: predictions made so far. ``updates``: updates
    made so far (the index of the next one in the learning-rate schedule).
    """

    values: list[torch.Tensor]
    model_state: object
    pending: torch.Tensor
    scored: int = 0
    updates: int = 0


class DynamicEvaluator:
    """Dynamic evaluation of ``model`` (ours, or a Hugging Face causal LM through ``hf.transformers_as_ours``).

    ``model(tokens [B, T], state) -> output with .logits [B, T, V] and .state`` is all it needs;
    an optional ``model.trim_state(state, keep)`` bounds a KV cache.

    Args:
        rule: one of :data:`~fastweights.adapt.update_rules.RULES` (default :data:`~fastweights.adapt.update_rules.DEFAULT_RULE`, paper eq. 8).
        lr, decay, eps: eta, lambda, epsilon of the rules (paper units, see the module docstring; defaults
            :data:`~fastweights.adapt.update_rules.DEFAULT_LR`, ``DEFAULT_DECAY``, ``DEFAULT_EPS``).
        segment_len: predictions per segment (n); one update per segment.
        context: attention context in tokens; after each segment the KV cache keeps
            ``context - segment_len`` tokens (None: unbounded). Use the training ``seq_len``.
        include, exclude: parameter filter (:func:`select_parameters`), e.g. ``exclude="embed.*"``.
        grad_stats: :class:`GradStats` (or a path to one); required by the rms rules.
        lr_schedule: ``"constant"`` (default), ``"warmup:W"`` or ``"rsqrt:S"`` (module docstring).
    """

    def __init__(self, model: torch.nn.Module, rule: str = DEFAULT_RULE, lr: float = DEFAULT_LR,
                 decay: float = DEFAULT_DECAY, eps: float = DEFAULT_EPS, segment_len: int = DEFAULT_SEGMENT_LEN,
                 context: int | None = None, include=None, exclude=None, grad_stats: GradStats | str | Path | None = None,
                 lr_schedule: str | None = None):
        if segment_len < 1:
            raise UserError(f"segment length must be >= 1, got {segment_len}")
        if context is not None and context <= segment_len:
            raise UserError(f"context ({context}) must be longer than the segment length ({segment_len})")
        self.model = model
        self.segment_len = int(segment_len)
        self.context = context
        self.schedule = parse_schedule(lr_schedule)
        self.lr_schedule = "constant" if self.schedule[0] == "constant" else f"{self.schedule[0]}:{self.schedule[1]:g}"
        if isinstance(grad_stats, (str, Path)):
            grad_stats = GradStats.load(grad_stats)
        self.grad_stats = grad_stats
        self.device = next(model.parameters()).device
        self._setup(include, exclude)
        ms = self._stats_for(grad_stats) if canonical_rule(rule).startswith("rms") else None
        self.update_rule = UpdateRule(rule, lr, decay, eps, ms).to(self.device, self.theta_g[0].dtype)
        self.rule = self.update_rule.rule

    # -- what is adapted (overridden by the sparse evaluator) ----------------------------------

    def _setup(self, include, exclude) -> None:
        self.params = select_parameters(self.model, include, exclude)
        self.names = list(self.params)
        # theta_g in fp32 (fp64 for fp64 models): the anchor of the priors and what the model is
        # restored to after each call
        self.theta_g = [p.detach().to(_master_dtype(p)).clone() for p in self.params.values()]

    def _stats_for(self, stats: GradStats | None) -> list[torch.Tensor]:
        if stats is None:
            raise UserError("rule needs gradient statistics: pass grad_stats (see `fastweights dynamic stats`)")
        missing = [n for n in self.names if n not in stats.ms]
        if missing:
            raise UserError(f"the gradient statistics lack {len(missing)} adapted parameter(s), e.g. {missing[0]!r}; "
                            "collect them with the same parameter filter")
        for n, p in zip(self.names, self.theta_g):
            if tuple(stats.ms[n].shape) != tuple(p.shape):
                raise UserError(f"gradient statistics for {n!r} have shape {tuple(stats.ms[n].shape)}, "
                                f"the parameter {tuple(p.shape)}: they belong to another model")
        return [stats.ms[n].to(self.device) for n in self.names]

    @property
    def num_adapted(self) -> int:
        return sum(t.numel() for t in self.theta_g)

    def metadata(self) -> dict:
        """Everything that defines the protocol, for result files (pitfall 5: conventions drift).

        Settings the rule does not use are left out: ``decay`` for rules without a prior, ``eps``
        and ``grad_stats`` for rules without RMS scaling."""
        u, rms = self.update_rule, self.rule.startswith("rms")
        return {"rule": self.rule, "lr": u.lr, **({"decay": u.decay} if self.rule in PRIOR_RULES else {}),
                **({"eps": u.eps} if rms else {}), "segment_len": self.segment_len, "context": self.context,
                **(self.model.context_info() if hasattr(self.model, "context_info") else {}),
                **({"lr_schedule": self.lr_schedule} if self.lr_schedule != "constant" else {}),
                "adapted_parameters": self.num_adapted, "adapted_tensors": len(self.names),
                "units": UNITS, "loss_for_update": "mean cross-entropy over the segment's targets",
                "first_token": "context only (not scored)",
                **({"grad_stats": self.grad_stats.metadata() if self.grad_stats is not None else None} if rms else {})}

    # -- single stream, weights adapted in place ----------------------------------------------

    @contextlib.contextmanager
    def _session(self, deltas: list[torch.Tensor] | None):
        """Set the adapted parameters to theta_g + ``deltas`` (None: zeros) for one call; restore theta_g after.

        Yields (forward, leaves, deltas, sync, finish): ``forward(x, state) -> (logits, state)``,
        the tensors to differentiate, the deltas the update rule changes in place, ``sync()`` which
        writes theta_g + delta into the model after an update, and ``finish()`` which returns
        copies of the deltas for the next state.
        """
        model = self.model
        was_training = model.training
        model.eval()
        flags = {n: p.requires_grad for n, p in model.named_parameters()}
        params = list(self.params.values())
        deltas = [d.clone() for d in deltas] if deltas is not None else self._zero_values()
        try:
            for n, p in model.named_parameters():
                p.requires_grad_(n in self.params)  # no backward work for frozen parameters

            def sync():
                with torch.no_grad():
                    for p, g, d in zip(params, self.theta_g, deltas):
                        if p.dtype == g.dtype:
                            torch.add(g, d, out=p.data)  # one pass, no temporary
                        else:
                            p.copy_(g + d)

            def forward(x, state):
                return logits_and_state(model(x, state))

            sync()
            yield forward, params, deltas, sync, (lambda: [d.detach().clone() for d in deltas])
        finally:
            with torch.no_grad():
                for p, g in zip(params, self.theta_g):
                    p.copy_(g)
            for n, p in model.named_parameters():
                p.requires_grad_(flags[n])
            model.train(was_training)

    def _zero_values(self, batch: int | None = None) -> list[torch.Tensor]:
        """Deltas of zero (theta = theta_g), optionally with a leading batch dimension."""
        lead = () if batch is None else (batch,)
        return [torch.zeros((*lead, *g.shape), dtype=g.dtype, device=self.device) for g in self.theta_g]

    def evaluate(self, tokens, state: DynamicState | None = None, final: bool = True,
                 keep_token_losses: bool = True, progress: Progress | None = None):
        """Dynamically evaluate one stream; returns ``(EvalResult, DynamicState)``.

        tokens: [T] ids. With ``state`` the stream continues where the previous call stopped (the
        adapted weights, the model state and any unscored tail are carried). ``final=False`` keeps
        an incomplete last segment unscored in the state, so that evaluating a stream in pieces
        equals one call; ``final=True`` scores it (and updates on it). ``EvalResult.nll`` is the
        total NLL in nats, ``tokens`` the number of predictions, ``token_losses`` their NLLs.
        """
        tokens = as_token_stream(tokens)
        seq = torch.cat([state.pending, tokens]) if state is not None else tokens
        model_state = state.model_state if state is not None else None
        values = state.values if state is not None else None
        updates = state.updates if state is not None else 0
        result = EvalResult(0.0, 0)
        L, n = self.segment_len, seq.numel() - 1
        pos = 0
        with self._session(values) as (forward, leaves, deltas, sync, finish):
            while pos < n and (final or n - pos >= L):
                m = min(L, n - pos)
                x = seq[None, pos : pos + m].to(self.device)  # [1, m]
                y = seq[None, pos + 1 : pos + m + 1].to(self.device)
                logits, new_state = forward(x, model_state)
                tok_nll = token_nll(logits, y)  # [1, m]
                # 1. score: record the segment's losses before any update has seen its tokens
                scored = tok_nll.detach()
                # 2-3. then update on the segment-mean NLL
                model_state = self._score_and_update(result, scored, keep_token_losses, tok_nll.mean(),
                                                     leaves, deltas, sync, updates, new_state)
                updates += 1
                pos += m
                if progress is not None:
                    progress.update(m)
            new_values = finish()
        prev = state.scored if state is not None else 0
        return result, DynamicState(new_values, model_state, seq[pos:].clone(), prev + result.tokens, updates)

    def _score_and_update(self, result: EvalResult, scored: torch.Tensor, keep_token_losses: bool,
                          segment_loss: torch.Tensor, leaves, deltas, sync, update_index: int, new_state):
        """Steps 1-3 of the loop for one segment; returns the model state to carry.

        1. The segment's detached token losses ``scored`` are added to ``result`` before any update
        has seen its tokens. 2-3. The gradient of ``segment_loss`` (the segment-mean NLL) reaches back to the segment start
        only; the rule updates ``deltas`` with the schedule's factor for update ``update_index``;
        ``sync`` writes them into the model; the new model state is carried detached (and bounded).
        """
        result.nll += scored.sum().item()
        result.tokens += scored.numel()
        if keep_token_losses:
            result.token_losses.extend(scored.flatten().tolist())
        grads = torch.autograd.grad(segment_loss, leaves, allow_unused=True)
        self.update_rule.apply(deltas, grads, schedule_factor(self.schedule, update_index))
        sync()
        return carry_state(self.model, new_state, self.context, self.segment_len)

    @torch.no_grad()
    def static(self, tokens, keep_token_losses: bool = True, progress: Progress | None = None) -> EvalResult:
        """Static evaluation under the same protocol (segments of ``segment_len``, same context bound)."""
        tokens = as_token_stream(tokens)
        seq_len = self.context if self.context is not None else tokens.numel() + self.segment_len
        result, _ = score_tokens(self.model, tokens, seq_len, self.segment_len,
                                 keep_token_losses=keep_token_losses, progress=progress)
        return result

    def evaluate_documents(self, documents: Iterable, reset: str = "per_document",
                           keep_token_losses: bool = False, progress: bool = False) -> EvalResult:
        """Score several documents (each [T] ids) one after the other; returns the summed result.

        ``reset="per_document"`` starts every document from theta_g; ``"never"`` carries the adapted
        weights from one document to the next (the model state, e.g. the KV cache, is always fresh
        at a document start). Use "never" only for contiguous benchmarks (pitfall 4).
        """
        if reset not in ("per_document", "never"):
            raise UserError(f"reset must be per_document or never, got {reset!r}")
        docs = [as_token_stream(d) for d in documents]
        bar = Progress(sum(max(0, d.numel() - 1) for d in docs), "tok", desc="dynamic", enabled=progress)
        total = EvalResult(0.0, 0)
        values, updates = None, 0
        for d in docs:
            if d.numel() < 2:
                continue
            start = None if values is None else DynamicState(values, None, d[:0], 0, updates)
            r, st = self.evaluate(d, start, final=True, keep_token_losses=keep_token_losses, progress=bar)
            total.add(r)
            if reset == "never":  # one stream: the schedule continues too
                values, updates = st.values, st.updates
        bar.close()
        return total

    # -- many documents at once, one delta per document ----------------------------------------

    @contextlib.contextmanager
    def _batched_forward(self):
        """Yields forward(values [B, ...] each, x [B, t], state) -> (logits [B, t, V], state).

        Document b runs with theta_g + values[b] through ``functional_call`` under ``vmap``. Model
        state tensors must carry the batch as their first dimension (the [B, H, K, V] convention);
        non-tensor leaves (positions) are the same for every document.
        """
        from torch.func import functional_call, vmap

        model = self.model
        was_training = model.training
        model.eval()
        base = {n: p.detach() for n, p in self.params.items()}
        tied = _list_held_parameters(model, self.params)
        holder = {}

        def one(deltas, x, state_leaves, spec):
            params = {n: base[n] + d.to(base[n].dtype) for n, d in zip(self.names, deltas)}
            state = None
            if spec is not None:  # per-document leaves lost their batch dim: give it back as size 1
                it = iter(state_leaves)
                leaves = [next(it)[None] if k else v for k, v in zip(holder["in_kinds"], holder["in_static"])]
                state = tree_unflatten(leaves, spec)
            saved = [(mod, i, mod.tied[i]) for mod, i, _ in tied]
            try:
                for mod, i, name in tied:  # parameters a module holds in a plain list (a tied head)
                    mod.tied[i] = params[name]
                out = functional_call(model, params, (x[None], state))
            finally:
                for mod, i, t in saved:
                    mod.tied[i] = t
            leaves, out_spec = tree_flatten(out.state)
            holder["out_spec"] = out_spec
            holder["out_kinds"] = [isinstance(v, torch.Tensor) for v in leaves]
            holder["out_static"] = [None if isinstance(v, torch.Tensor) else v for v in leaves]
            return out.logits[0], [v[0] for v in leaves if isinstance(v, torch.Tensor)]

        def forward(values, x, state):
            if state is None:
                spec, tensors = None, []
            else:
                leaves, spec = tree_flatten(state)
                holder["in_kinds"] = [isinstance(v, torch.Tensor) for v in leaves]
                holder["in_static"] = [None if isinstance(v, torch.Tensor) else v for v in leaves]
                tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
            try:
                logits, out_tensors = vmap(lambda d, xx, st: one(d, xx, st, spec))(values, x, tensors)
            except RuntimeError as e:
                if "setup_context" not in str(e):
                    raise
                raise RuntimeError("batched dynamic evaluation runs the model under torch.func.vmap, and one of its "
                                   "torch.autograd.Functions does not support functorch (it needs setup_context and "
                                   "generate_vmap_rule = True); evaluate documents one at a time, or use sparse "
                                   "dynamic evaluation") from e
            it = iter(out_tensors)
            leaves = [next(it) if k else v for k, v in zip(holder["out_kinds"], holder["out_static"])]
            return logits, tree_unflatten(leaves, holder["out_spec"])

        try:
            with warnings.catch_warnings():
                # functorch has no batching rule for CPU flash attention and loops over the batch
                warnings.filterwarnings("ignore", message=".*performance drop because we have not yet implemented the batching rule.*")
                yield forward
        finally:
            model.train(was_training)

    def evaluate_batch(self, documents: Sequence, keep_token_losses: bool = False,
                       progress: Progress | None = None) -> list[EvalResult]:
        """Dynamically evaluate several documents at once, each with its own adapted weights.

        Equivalent to ``evaluate(doc)`` for each document from a fresh state (reset per document),
        but documents share every forward and backward call: document b runs with
        theta_g + delta_b (one fp32 delta per document and adapted tensor, no model copies).
        Shorter documents are padded; padded targets are neither scored nor part of any update.
        """
        docs = [as_token_stream(d) for d in documents]
        if not docs:
            return []
        B, L = len(docs), self.segment_len
        lengths = torch.tensor([d.numel() for d in docs])
        T = int(lengths.max())
        tokens = torch.zeros(B, T, dtype=torch.long)
        for b, d in enumerate(docs):
            tokens[b, : d.numel()] = d
        results = [EvalResult(0.0, 0) for _ in docs]
        values = self._zero_values(B)
        state = None
        with self._batched_forward() as forward:
            for pos in range(0, T - 1, L):
                m = min(L, T - 1 - pos)
                x = tokens[:, pos : pos + m].to(self.device)  # [B, m]
                y = tokens[:, pos + 1 : pos + m + 1].to(self.device)
                valid = (pos + 1 + torch.arange(m))[None, :] < lengths[:, None]  # [B, m] real targets
                valid = valid.to(self.device)
                leaves = [v.requires_grad_(True) for v in values]
                logits, new_state = forward(leaves, x, state)
                tok_nll = token_nll(logits, y)  # [B, m]
                scored = tok_nll.detach()
                for b in range(B):  # score first
                    s = scored[b][valid[b]]
                    results[b].nll += s.sum().item()
                    results[b].tokens += s.numel()
                    if keep_token_losses:
                        results[b].token_losses.extend(s.tolist())
                count = valid.sum(1).clamp(min=1)
                # each document's loss is the mean over its own targets; their sum keeps gradients separate
                loss = ((tok_nll * valid).sum(1) / count).sum()
                grads = torch.autograd.grad(loss, leaves, allow_unused=True)
                for v in values:
                    v.requires_grad_(False)
                self.update_rule.apply(values, grads, schedule_factor(self.schedule, pos // L))
                state = carry_state(self.model, new_state, self.context, L)
                if progress is not None:
                    progress.update(int(valid.sum()))
        return results

    # -- generation -----------------------------------------------------------------------------

    def generate(self, prompt, max_tokens: int, temperature: float = 1.0, top_k: int = 0, seed: int | None = None,
                 state: DynamicState | None = None, adapt_on_prompt: bool = True):
        """Sample ``max_tokens`` ids, adapting on the prompt and on the generated text.

        Paper section 3: a segment of ``segment_len`` tokens is sampled with fixed weights, then the
        weights are updated on it (the mean NLL of the sampled segment), and sampling continues.
        Returns ``(ids, state)``; ``state`` can continue scoring or sampling.
        """
        prompt = as_token_stream(prompt)
        if prompt.numel() == 0 and state is None:
            raise UserError("generation needs a non-empty prompt")
        if adapt_on_prompt:
            _, state = self.evaluate(prompt, state, final=True, keep_token_losses=False)
        else:
            seq = torch.cat([state.pending, prompt]) if state is not None else prompt
            state = DynamicState(state.values if state else self._zero_values(),
                                 state.model_state if state else None, seq, state.scored if state else 0,
                                 state.updates if state else 0)
            # read the prompt without adapting: a static pass that leaves only the last token pending
            with torch.no_grad(), self._session(state.values) as (forward, *_):
                ms = state.model_state
                for a in range(0, seq.numel() - 1, self.segment_len):
                    b = min(a + self.segment_len, seq.numel() - 1)
                    _, ms = forward(seq[None, a:b].to(self.device), ms)
                    ms = carry_state(self.model, ms, self.context, self.segment_len)
            state = DynamicState(state.values, ms, seq[-1:].clone(), state.scored, state.updates)
        gen = torch.Generator(device=self.device)
        if seed is not None:
            gen.manual_seed(seed)
        out: list[int] = []
        while len(out) < max_tokens:
            m = min(self.segment_len, max_tokens - len(out))
            segment = self._sample_segment(state, m, temperature, top_k, gen)
            out.extend(segment)
            # update on the generated segment: it is now text the model has "read"
            _, state = self.evaluate(torch.tensor(segment), state, final=True, keep_token_losses=False)
        return out, state

    @torch.no_grad()
    def _sample_segment(self, state: DynamicState, m: int, temperature: float, top_k: int, gen) -> list[int]:
        with self._session(state.values) as (forward, *_):
            ms = state.model_state
            pending = state.pending.to(self.device)
            if pending.numel() > 1:  # unscored tokens (final=False) become context first
                _, ms = forward(pending[None, :-1], ms)
            x = pending[None, -1:]
            ids = []
            for _ in range(m):
                logits, ms = forward(x, ms)
                if self.context is not None and hasattr(self.model, "trim_state"):
                    ms = self.model.trim_state(ms, self.context - 1)
                nxt = sample_token(logits[0, -1].float(), temperature, top_k, gen)
                ids.append(nxt)
                x = torch.tensor([[nxt]], device=self.device)
        return ids


def _master_dtype(p: torch.Tensor) -> torch.dtype:
    """Adapted values accumulate in fp32 (fp64 when the model itself is fp64)."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def _list_held_parameters(model: torch.nn.Module, params: dict) -> list[tuple]:
    """(module, index, name) for adapted parameters a module keeps in a plain list ``tied``.

    ``LinearHead`` holds a tied embedding that way so it is not registered twice;
    ``functional_call`` does not see it, so the batched forward substitutes it by hand.
    """
    by_id = {id(p): n for n, p in params.items()}
    found = []
    for mod in model.modules():
        held = getattr(mod, "tied", None)
        if isinstance(held, list):
            for i, t in enumerate(held):
                if id(t) in by_id:
                    found.append((mod, i, by_id[id(t)]))
    return found

