"""Fast Weight Layers: the ``fwl`` head, a gradient-updated output head (module, options, tuning).

K. Clark, K. Guu, M.-W. Chang, P. Pasupat, G. Hinton, M. Norouzi, "Meta-Learning Fast Weight Language
Models", EMNLP 2022 (arXiv 2212.02475); the official layer is google-research/google-research ``fwl/``.

The operator (the block f_theta(h) = LayerNorm(ReLU(h U + a)^2 W + b) and unembedding, the slow pass with
its hand-written backward, the fast pass as strictly causal linear attention, the segment recurrence and
the per-step reference) is :mod:`fastweights.ops.fwl`; this file holds the head that owns the weights,
the step sizes, the decays and the state.

Fast tensors are U, a, W, b and the LayerNorm gain and bias (as ``fwl/tf/fwl.py``), each with its own
learned step size alpha initialised to 0.01; E and c stay slow. ``fast_biases=False`` keeps a and b slow
(the Jax port's variant); ``bias_only=True`` makes only the output bias c fast (the paper's Table 2
ablation: logits'_t = logits_t - alpha_c sum_{s<t} e_s).

Training differentiates through the g's (second-order MAML with one inner step, the paper's default);
``first_order=True`` treats each inner gradient (keys and values) as a constant. ``test_time_only=True``
trains the head with the slow loss L_t and applies the update only in eval mode, with one global step
size (``test_time_step_size``, tuned on validation data with :func:`tune_test_time_step_size`).

Inner-loss normalisation Z (project choice, see the spec's pitfall): ``inner_loss_norm = "none"``
(default) uses Z = 1, the paper's summed loss of eq. (1): the per-token step is alpha, whatever the
batch size, the sequence length or the way a text is cut into calls. ``"fixed"`` uses Z =
``inner_loss_z``. ``"batch_tokens"`` is the official code's Z = sum of w over the batch while training
(it couples the rows of a batch and depends on B and T); it keeps the running mean of the training Z in a
buffer and uses that fixed value in eval mode and generation.

On a pretrained model (``residual=True``, built with the model's output layer as ``unembedding``) the
head is a residual branch before that shared, slow unembedding: logits = (h + f_theta(h)) E + c. With the
LayerNorm gain at 0 (``ln_gain_init`` None, the residual default) the logits start exactly as the pretrained
model's, but the inner gradients of U, a, W, b carry the gain as a factor, so they and their step sizes get
no gradient at first and their fast effect grows as alpha g^2; a small non-zero ``ln_gain_init`` starts near
the identity instead (``fastweights.hf.fwl_head`` says which the recipe takes and why).
``step_size_log`` learns log(alpha) rather than alpha.

Segments (the recurrence is in :mod:`fastweights.ops.fwl`): segments of ``segment_len`` absolute
positions (0 = one endless segment), one learned decay gamma = sigmoid(rho) per fast tensor (initialised
to 0.9), no gradient into earlier segments with ``stopgrad_segments``. One call over a text equals any
split of it into calls with the state carried.

State (the explicit-state protocol): ``{"pos", "h", "base", "carry", "writes", "writes_start"}``: the
number of positions seen; the last position's hidden state (its label, the next call's first token, is
not known yet, so its gradient is computed at the start of the next call); per fast tensor the running
deltas Delta_k ("base") and Delta_k + the gradients of the current segment so far ("carry"), of the
tensor's shape with a leading batch dimension, as they stood at the first position of the previous call;
and that call's per-position gradient factors ("writes": key and value of each rank-one write), which the
next call folds in first. Folding lazily costs nothing when no call follows (training, window scoring).
Generation (sample, take the gradient for the sampled token, update, continue) is this same forward
called one token at a time.

Calls of at most ``chunk_size`` positions are one exact masked block; longer calls go through the
chunked linear-attention op (memory linear in T). All fast-weight arithmetic runs in fp32 (fp64 for fp64
inputs) with autocast off; logits come back in fp32.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from fastweights.components import register_head
from fastweights.core.errors import UserError
from fastweights.layers.fast_memory import PerRowState
from fastweights.ops.fwl import BLOCK_FAST, fold_deltas, fwl_parallel, segment_pieces, slow_pass
from fastweights.ops.linear_attention import no_autocast

INNER_LOSS_NORMS = ("none", "fixed", "batch_tokens")


@dataclass
class FWLOptions:
    """Options of the ``fwl`` head (``[model.options.fwl]``)."""

    hidden: int = 0  # s, the block width; 0 -> d_model (the spec's project default)
    expansion: int = 4  # first layer width = expansion * s (4 in the paper and the official code)
    step_size_init: float = 0.01  # initial alpha of every fast tensor (both official codebases)
    # learn log(alpha) instead of alpha: a step size then moves by a factor per optimizer step, not by the
    # learning rate (alpha ~ 1e-2 under Adam at lr 1e-3 would otherwise swing by 10% a step); needs alpha > 0
    step_size_log: bool = False
    fast_biases: bool = True  # a, b fast (TF code); False keeps them slow (the Jax port)
    bias_only: bool = False  # Table 2 ablation: only the output bias c is fast
    first_order: bool = False  # inner gradients as constants (first-order MAML)
    test_time_only: bool = False  # Table 2 ablation: slow training, fast update only in eval mode
    test_time_step_size: float = 0.01  # the global alpha of test_time_only (tune it on validation data)
    inner_loss_norm: str = "none"  # none (Z = 1) | fixed (Z = inner_loss_z) | batch_tokens (official)
    inner_loss_z: float = 1.0  # Z of inner_loss_norm = "fixed"
    # decay the running update every segment_len positions; 0 = never. The layer's one default (the op,
    # ops.fwl.fwl_parallel, takes it from here); a recipe may set its own (hf.fwl_head.PRETRAINED_FWL_DEFAULTS)
    segment_len: int = 32
    decay_init: float = 0.9  # initial gamma of every fast tensor (unstated in the paper; project choice)
    stopgrad_segments: bool = True  # no gradient into earlier segments (the paper's recipe)
    chunk_size: int = 256  # calls up to this long: one exact masked block; longer: the chunked op with this chunk
    ln_eps: float = 1e-5  # LayerNorm epsilon, the same in the slow, hand-written backward and fast passes
    init_std: float = 0.05  # kernels ~ init_std * N(0, 1) as fwl/tf/fwl.py; biases 0, LN gain 1
    residual: bool = False  # logits = (h + f(h)) E + c: a branch on a pretrained model's last hidden state
    # initial LayerNorm gain; None: 1, or 0 with residual (the branch and its update start at exactly zero, so
    # the head is the identity, but every other fast tensor's inner gradient is then zero too: see hf/fwl_head.py)
    ln_gain_init: float | None = None


# ----------------------------------------------------------------------------- the head


@register_head("fwl", FWLOptions)
class FastWeightLayer(nn.Module):
    """Fast Weight Layer head: ``logits, state = head(h [B, T, d_model], tokens [B, T], state)``.

    Built as ``FastWeightLayer(d_model, vocab_size, options)``; the block width s is ``options.hidden``
    (default d_model). ``tokens`` are the inputs of this call; the label of position t is tokens[t + 1],
    and that of the last position is the next call's first token (kept pending in the state).
    """

    # facts for the project's checks and the memory estimate (fastweights.components, "what a component declares")
    test_variants = {"default-path": {"hidden": 4, "segment_len": 5, "chunk_size": 64, "step_size_init": 0.3},
                     "chunked-path": {"hidden": 4, "segment_len": 5, "chunk_size": 4, "step_size_init": 0.3},
                     "no-segments": {"hidden": 4, "segment_len": 0, "chunk_size": 64, "step_size_init": 0.3},
                     "slow-biases": {"hidden": 4, "segment_len": 5, "fast_biases": False, "step_size_init": 0.3},
                     "bias-only": {"hidden": 4, "bias_only": True, "step_size_init": 0.3},
                     "residual": {"residual": True, "segment_len": 5, "chunk_size": 64, "step_size_init": 0.3},
                     "residual-gain-log-steps": {"residual": True, "segment_len": 5, "chunk_size": 64,
                                                 "step_size_init": 0.3, "step_size_log": True, "ln_gain_init": 0.5}}
    tiny_options = {"segment_len": 4, "chunk_size": 8}
    bounded_variants = {"default": {"hidden": 16}}

    @staticmethod
    def state_floats(o, *, d_model, vocab_size, seq_len, **_):  # the last input, each position's update factors
        if o.bias_only:
            return {"carried": d_model + seq_len * vocab_size}
        s, e = o.hidden or d_model, o.expansion
        # U [d, e s], W [e s, s], the LayerNorm's gain and bias, and the fast biases a [e s], b [s]
        per_position = d_model + 2 * e * s + s + 2 * s + ((e + 1) * s if o.fast_biases else 0)
        return {"carried": d_model + seq_len * per_position}

    @staticmethod
    def inert_options(o: FWLOptions) -> list[str]:
        """Options set away from their defaults that change nothing in this configuration (warned at config time)."""
        d = FWLOptions()
        out = []
        if o.test_time_step_size != d.test_time_step_size and not o.test_time_only:
            out.append(f"model.options.fwl.test_time_step_size={o.test_time_step_size:g} does nothing without "
                       "model.options.fwl.test_time_only = true (the learned step sizes are used)")
        if o.step_size_init != d.step_size_init and o.test_time_only:
            out.append(f"model.options.fwl.step_size_init={o.step_size_init:g} does nothing with test_time_only = "
                       "true (the step is model.options.fwl.test_time_step_size)")
        if o.inner_loss_z != d.inner_loss_z and o.inner_loss_norm != "fixed":
            out.append(f"model.options.fwl.inner_loss_z={o.inner_loss_z:g} does nothing without "
                       "model.options.fwl.inner_loss_norm = \"fixed\"")
        return out

    def __init__(self, d_model: int, vocab_size: int, options: FWLOptions | None = None,
                 unembedding: nn.Module | None = None):
        super().__init__()
        opt = options or FWLOptions()
        _validate(opt)
        self.options = opt
        s = opt.hidden or d_model
        if opt.residual and s != d_model:
            raise UserError(f"model.options.fwl.residual adds the block's output to its input, so hidden must be 0 "
                            f"or d_model ({d_model}), got {opt.hidden}")
        wide = opt.expansion * s
        std = opt.init_std
        self.U = nn.Parameter(torch.randn(d_model, wide) * std)
        self.a = nn.Parameter(torch.zeros(wide))
        self.W = nn.Parameter(torch.randn(wide, s) * std)
        self.b = nn.Parameter(torch.zeros(s))
        gain = opt.ln_gain_init if opt.ln_gain_init is not None else (0.0 if opt.residual else 1.0)
        self.ln_weight = nn.Parameter(torch.full((s,), float(gain)))
        self.ln_bias = nn.Parameter(torch.zeros(s))
        if unembedding is None:
            self.E = nn.Parameter(torch.randn(s, vocab_size) * std)  # unembedding, not tied to the input embedding
            self.c = nn.Parameter(torch.zeros(vocab_size))
            self._shared_unembedding = None
        else:
            # a pretrained model's output layer (weight [V, s], bias [V] or None), shared and slow: kept out of
            # the head's parameters and state dict (its owner, the backbone, saves and moves it)
            if tuple(unembedding.weight.shape) != (vocab_size, s):
                raise UserError(f"fwl: the unembedding is {tuple(unembedding.weight.shape)}, expected ({vocab_size}, {s})")
            object.__setattr__(self, "_shared_unembedding", unembedding)
            self.register_buffer("zero_bias", torch.zeros(vocab_size), persistent=False)
        if opt.bias_only:
            self.fast_names = ("c",)
        else:
            self.fast_names = tuple(n for n in BLOCK_FAST if opt.fast_biases or n not in ("a", "b"))
        # one learned step size per fast tensor (not created for test_time_only: its step is a global constant)
        self.step_sizes = nn.ParameterDict()
        if not opt.test_time_only:
            init = math.log(opt.step_size_init) if opt.step_size_log else float(opt.step_size_init)
            for n in self.fast_names:
                self.step_sizes[n] = nn.Parameter(torch.tensor(init))
        self.decay_logits = nn.ParameterDict()
        if opt.segment_len > 0:
            rho = math.log(opt.decay_init / (1.0 - opt.decay_init))  # sigmoid(rho) = decay_init
            for n in self.fast_names:
                self.decay_logits[n] = nn.Parameter(torch.tensor(rho))
        # running mean of the training Z, for inner_loss_norm = "batch_tokens" (used in eval mode)
        self.register_buffer("z_train", torch.zeros(()))
        self.register_buffer("z_count", torch.zeros(()))

    # ------------------------------------------------------------------ parameters

    def unembedding(self) -> tuple[Tensor, Tensor]:
        """``(E [s, V], c [V])``: the head's own output layer, or the shared pretrained one (E a transposed view)."""
        if self._shared_unembedding is None:
            return self.E, self.c
        lin = self._shared_unembedding
        return lin.weight.T, (self.zero_bias if lin.bias is None else lin.bias)

    def params(self, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        p = {n: getattr(self, n) for n in BLOCK_FAST}
        p["E"], p["c"] = self.unembedding()
        return p if dtype is None else {n: t.to(dtype) for n, t in p.items()}

    def current_step_sizes(self) -> dict[str, Tensor]:
        """alpha per fast tensor: the learned ones (exp of the parameter with ``step_size_log``), or the global
        test-time step."""
        if self.options.test_time_only:
            return {n: self.ln_bias.new_tensor(self.options.test_time_step_size) for n in self.fast_names}
        if self.options.step_size_log:
            return {n: p.exp() for n, p in self.step_sizes.items()}
        return dict(self.step_sizes.items())

    def fast_parameters(self) -> Iterator[tuple[str, nn.Parameter, Tensor]]:
        """Yield ``(name, parameter, step_size)`` for each fast tensor."""
        steps, params = self.current_step_sizes(), self.params()
        for n in self.fast_names:
            yield n, params[n], steps[n]

    def decays(self) -> dict[str, Tensor]:
        """gamma per fast tensor (segment decay), sigmoid of the learned logits."""
        return {n: torch.sigmoid(r) for n, r in self.decay_logits.items()}

    def slow_forward(self, h: Tensor) -> Tensor:
        """Logits ``[B, T, V]`` with the slow weights alone."""
        with no_autocast(h.device):
            cd = torch.float64 if h.dtype == torch.float64 else torch.float32
            return slow_pass(h.to(cd), self.params(cd), self.options.ln_eps, self.options.residual).logits

    def extra_repr(self) -> str:
        o = self.options
        return (f"d_in={self.U.shape[0]}, hidden={self.W.shape[1]}, vocab={self.unembedding()[0].shape[1]}, "
                f"fast={','.join(self.fast_names)}, segment_len={o.segment_len}, inner_loss_norm={o.inner_loss_norm}")

    # ------------------------------------------------------------------ forward

    def _z_norm(self, weights: Tensor):
        o = self.options
        if o.inner_loss_norm == "none":
            return 1.0
        if o.inner_loss_norm == "fixed":
            return o.inner_loss_z
        z = weights.sum().clamp_min(1e-8)  # batch_tokens: the official normaliser
        if self.training:
            with torch.no_grad():  # running mean of the training Z
                self.z_count += 1
                self.z_train += (z.to(self.z_train.dtype) - self.z_train) / self.z_count
            return z
        return self.z_train.to(weights.dtype) if self.z_count > 0 else z

    def forward(self, h: Tensor, tokens: Tensor | None = None, state: dict | PerRowState | None = None,
                attention_mask: Tensor | None = None):
        """``h [B, T, d_in]``, ``tokens [B, T]`` (this call's inputs) -> ``(logits [B, T, V], state)``.

        ``attention_mask`` [B, T] (0 / False = padding): each row's real tokens are read alone, as that row
        without padding (its positions, segment boundaries and inner-loss labels count real tokens only; a
        padded position gets zero logits and is no label and no write); the state is then a
        :class:`~fastweights.layers.fast_memory.PerRowState`, continued row by row."""
        if tokens is None:
            raise UserError("the fwl head needs the input tokens (its inner loss predicts tokens[t + 1])")
        if h.dim() != 3 or tokens.shape != h.shape[:2]:
            raise ValueError(f"fwl: h must be [B, T, C] and tokens [B, T], got {tuple(h.shape)}, {tuple(tokens.shape)}")
        if attention_mask is not None or isinstance(state, PerRowState):
            return self._padded_forward(h, tokens, state, attention_mask)
        o = self.options
        if o.test_time_only and self.training:
            # trained with the slow loss L_t; the slow head is position-wise, so no state is needed
            return self.slow_forward(h), None
        bsz, t = tokens.shape
        if self.training and state is None and 3 <= t <= 2 * o.segment_len and torch.is_grad_enabled():
            # gamma first multiplies a delta in the third segment (Delta_2 = gamma Delta_1 + S_1), so a shorter
            # window never trains it, and a long stream then carries a running update it never saw
            warnings.warn(f"fwl: training windows of {t} tokens hold fewer than 3 segments of segment_len "
                          f"{o.segment_len}, so the segment decays get no gradient; set "
                          f"model.options.fwl.segment_len <= {t // 3}", stacklevel=1)  # here, not torch's module call
        with no_autocast(h.device):
            cd = torch.float64 if h.dtype == torch.float64 else torch.float32
            h = h.to(cd)
            decays = {n: g.to(cd) for n, g in self.decays().items()} if o.segment_len > 0 else None
            pos, deltas = 0, None
            if state is not None:
                pos = state["pos"]
                if state["h"].shape[0] != bsz:
                    raise ValueError(f"fwl: state holds {state['h'].shape[0]} sequences, got a batch of {bsz}")
                deltas = self._fold(state, decays)
            # prepend the last position of the previous call: its label is this call's first token
            h_all = h if state is None else torch.cat([state["h"].to(cd).unsqueeze(1), h], 1)  # [B, N, C]
            offset = h_all.shape[1] - t
            labels = tokens[:, 1 - offset :]  # labels of h_all[:, :-1]
            labels = torch.cat([labels, labels.new_zeros(bsz, 1)], 1)  # [B, N]; the last has no label yet
            weights = torch.ones(bsz, h_all.shape[1], dtype=cd, device=h.device)
            weights[:, -1] = 0
            logits, writes = fwl_parallel(
                h_all, labels, weights, self.params(cd),
                {n: a.to(cd) for n, a in self.current_step_sizes().items()},
                z_norm=self._z_norm(weights), eps=o.ln_eps, chunk_size=o.chunk_size,
                segment_len=o.segment_len, start=pos - offset, decays=decays, state=deltas,
                stopgrad_segments=o.stopgrad_segments, first_order=o.first_order, residual=o.residual,
                logits_from=offset,  # the carried position was scored by the previous call
            )
        # The deltas are folded lazily: the state keeps this call's gradient factors ("writes") and the
        # next call adds them (costing K x V per position only when there is a next call).
        new_state = {
            "pos": pos + t,
            "h": h[:, -1].detach(),
            "base": {} if deltas is None else deltas["base"],
            "carry": {} if deltas is None else deltas["carry"],
            "writes": writes,
            "writes_start": pos - offset,
        }
        return logits, new_state

    def _padded_forward(self, h: Tensor, tokens: Tensor, state, mask: Tensor | None):
        """Each row's real tokens alone (segments and labels are positions of the real text, which a shifted,
        batched call cannot give every row at once): ``(logits [B, T, V], PerRowState)``."""
        bsz, t = tokens.shape
        mask = torch.ones(bsz, t, dtype=torch.bool, device=h.device) if mask is None else mask.bool()
        if state is None:
            rows = [None] * bsz
        elif isinstance(state, PerRowState):
            if state.batch != bsz:
                raise ValueError(f"fwl: state holds {state.batch} sequences, got a batch of {bsz}")
            rows = list(state.rows)
        else:  # a batched state (read unpadded so far): each row's own part
            rows = [tree_map(lambda x, b=b: x[b:b + 1] if isinstance(x, Tensor) else x, state) for b in range(bsz)]
        logits, new_rows = None, []
        for b in range(bsz):
            real = mask[b].nonzero().squeeze(1)
            if real.numel() == 0:
                new_rows.append(rows[b])
                continue
            lb, sb = self(h[b:b + 1, real], tokens[b:b + 1, real], rows[b])
            if logits is None:
                logits = lb.new_zeros(bsz, t, lb.shape[-1])
            logits[b, real] = lb[0]
            new_rows.append(sb)
        if logits is None:  # nothing real in the whole call
            logits = h.new_zeros(bsz, t, self.unembedding()[0].shape[1], dtype=torch.float32)
        return logits, PerRowState(tuple(new_rows))

    @torch.no_grad()
    def _fold(self, state: dict, decays: dict | None) -> dict:
        """Running deltas at the last position of the previous call: the carried deltas plus the
        gradients that call computed (its writes), with the segment decays applied."""
        n_prev = state["pos"] - state["writes_start"]
        pieces = segment_pieces(state["writes_start"], n_prev, self.options.segment_len)
        base, carry = {}, {}
        for name, (k, v) in state["writes"].items():
            b, c = fold_deltas(state["base"].get(name), state["carry"].get(name), k, v, pieces,
                               None if decays is None else decays[name].detach())
            if b is not None:
                base[name] = b
            carry[name] = c
        return {"base": base, "carry": carry}


def _validate(o: FWLOptions) -> None:
    if o.hidden < 0:
        raise UserError(f"model.options.fwl.hidden must be >= 0 (0 = d_model), got {o.hidden}")
    if o.expansion < 1:
        raise UserError(f"model.options.fwl.expansion must be >= 1, got {o.expansion}")
    if o.inner_loss_norm not in INNER_LOSS_NORMS:
        raise UserError(f"model.options.fwl.inner_loss_norm must be one of {', '.join(INNER_LOSS_NORMS)}, "
                        f"got {o.inner_loss_norm!r}")
    if o.inner_loss_norm == "fixed" and not o.inner_loss_z > 0:
        raise UserError(f"model.options.fwl.inner_loss_z must be > 0, got {o.inner_loss_z}")
    if o.segment_len < 0:
        raise UserError(f"model.options.fwl.segment_len must be >= 0 (0 = no segments), got {o.segment_len}")
    if not 0.0 < o.decay_init < 1.0:
        raise UserError(f"model.options.fwl.decay_init must be in (0, 1), got {o.decay_init}")
    if o.chunk_size < 1:
        raise UserError(f"model.options.fwl.chunk_size must be >= 1, got {o.chunk_size}")
    if not o.ln_eps > 0:
        raise UserError(f"model.options.fwl.ln_eps must be > 0, got {o.ln_eps}")
    if o.step_size_log and not o.test_time_only and not o.step_size_init > 0:
        raise UserError(f"model.options.fwl.step_size_log learns log(alpha): step_size_init must be > 0, got "
                        f"{o.step_size_init}")


# ----------------------------------------------------------------------------- test-time-only tuning


@torch.no_grad()
def tune_test_time_step_size(model, tokens: Tensor, seq_len: int, grid: list[float], batch_size: int = 16) -> dict:
    """Pick the global step size of a ``test_time_only`` FWL head on held-out tokens.

    Scores ``tokens`` ([N] ids) in independent windows of ``seq_len`` for each value in ``grid``
    (0 included gives the slow head), sets the best one on the head and returns
    ``{"grid": {step: mean loss nats}, "status": {step: "ok" | "diverged"}, "best": step}``. A step whose loss is
    not finite is ``diverged`` and never chosen (``min`` over a NaN picks whatever comes first); a grid where every
    step diverged is a UserError and leaves the head's step size as it was.
    """
    head = model.head
    if not isinstance(head, FastWeightLayer) or not head.options.test_time_only:
        raise UserError("tune_test_time_step_size needs a model whose head is fwl with test_time_only = true")
    n = (tokens.numel() - 1) // seq_len
    if n == 0:
        raise UserError(f"need more than {seq_len} tokens to tune the test-time step size")
    x = tokens[: n * seq_len].view(n, seq_len)  # [n, T]
    y = tokens[1 : n * seq_len + 1].view(n, seq_len)
    device = next(model.parameters()).device
    was_training = model.training
    before = head.options.test_time_step_size
    model.eval()
    results = {}
    for step in grid:
        head.options.test_time_step_size = float(step)
        total = 0.0
        for i in range(0, n, batch_size):
            out = model(x[i : i + batch_size].to(device), targets=y[i : i + batch_size].to(device))
            total += out.loss.item() * min(batch_size, n - i)
        results[float(step)] = total / n
    model.train(was_training)
    status = {k: "ok" if math.isfinite(v) else "diverged" for k, v in results.items()}
    finite = {k: v for k, v in results.items() if status[k] == "ok"}
    if not finite:
        head.options.test_time_step_size = before
        raise UserError(f"tune_test_time_step_size: every step size of the grid {list(results)} gave a non-finite "
                        "loss; nothing set")
    best = min(finite, key=finite.get)
    head.options.test_time_step_size = best
    return {"grid": results, "status": status, "best": best}


# ----------------------------------------------------------------------------- the slow and fast parts


@contextlib.contextmanager
def scaled_step_sizes(head: FastWeightLayer, factor: float):
    """Within the block, the FWL ``head`` uses ``factor`` x the step sizes it would use (its parameters are not
    touched, so learned, log-parameterised and test-time steps alike): its ``current_step_sizes`` is replaced on
    the instance and put back on exit, even on an error."""
    own = vars(head).get("current_step_sizes")  # an earlier replacement (nested blocks), else the class method
    original = head.current_step_sizes
    head.current_step_sizes = lambda: {n: a * factor for n, a in original().items()}
    try:
        yield head
    finally:
        if own is not None:
            head.current_step_sizes = own
        else:
            del head.current_step_sizes


def slow_part(head: FastWeightLayer):
    """The head with every step size 0 (theta'_t = theta: its trained slow weights alone), restored after; the
    full head minus this is the fast update's part of a gain."""
    return scaled_step_sizes(head, 0.0)
