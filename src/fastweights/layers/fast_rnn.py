"""Fast-weights RNN of Ba, Hinton, Mnih, Leibo & Ionescu, "Using Fast Weights to Attend to the Recent
Past" (NIPS 2016, arXiv 1610.06258).

A ReLU RNN whose hidden state also reads a per-sequence fast weight matrix A, a decaying Hebbian
memory of its own recent hidden states. Tokens x_1..x_T, h_0 = 0, A_0 = 0; for t = 1..T::

    b_t       = W h_{t-1} + C x_t                          boundary term (slow weights W, C)
    h_t^(0)   = f( LN(b_t) )                               preliminary (LN only if ln_preliminary)
    h_t^(s+1) = f( LN(b_t + A_{t-1} h_t^(s)) ),  s = 0..S-1 inner loop: same A_{t-1}, same b_t
    h_t       = h_t^(S)
    A_t       = lam A_{t-1} + eta h_t h_t^T                 write after the inner loop

f = ReLU; LN = layer normalisation of each example over its H units (learned gain and bias,
eps 1e-5). Defaults lam = 0.95, eta = 0.5, S = 1, W initialised to 0.05 I.

Write order (project decision): the read at step t sees only the completed states h_1..h_{t-1};
h_t is written after its own inner loop. At t = 1 the fast term is 0; at t = 2 it is
eta (h_1^T h_2^(s)) h_1. (Public implementations write the preliminary state before reading, or
lag by one step; both are different models.)

Two read forms of the same model (``read`` option): ``matrix``, the explicit A updated every step, and
``attention``, which never materialises A. Their functional forms, the reference written from the
equations above and the hand-written backward passes are in :mod:`fastweights.ops.fast_rnn`; this file
holds the module: state, options and the mixer.

Padding (``attention_mask`` [B, T], 0 = padding): a padded call runs each row's real tokens alone from
that row's state (``layers.common.per_row``), so a padded step neither moves h nor is written into A nor
counts in the decay lam^(t-s); its output is zero. The rows' histories then have different lengths, so each
is folded into its A (the same memory, :func:`~fastweights.ops.fast_rnn.fold_history`) to make one state.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

from fastweights.components import register_mixer
from fastweights.core.errors import UserError
from fastweights.layers.common import per_row
from fastweights.ops.fast_rnn import fast_rnn_attention, fast_rnn_reference, fold_history
from fastweights.ops.linear_attention import no_autocast
from fastweights.ops.linear import Linear

READ_MODES = ("auto", "matrix", "attention")


# ----------------------------------------------------------------------------- module


class FastRNNState(NamedTuple):
    """State of :class:`FastWeightRNN` between calls.

    h: last hidden state [B, H]. A: fast matrix [B, H, H] summarising every written state older
    than ``history`` (None = zero). history: the most recent written states not yet folded into A,
    oldest first, [B, L, H] (None = none). The matrix read keeps history None; the attention read
    keeps up to ``hidden`` states there and folds them into A when full.
    """

    h: Tensor
    A: Tensor | None
    history: Tensor | None


class FastWeightRNN(nn.Module):
    """Fast-weights RNN layer on the state protocol: ``hs, state = rnn(x, state=None)``.

    Args:
        input_size: features of x.
        hidden: H, the number of hidden units.
        lam, eta: fast-weight decay and learning rate (0.95, 0.5).
        inner_steps: S >= 1 inner-loop reads per step (1).
        layer_norm: LayerNorm before every ReLU (True).
        ln_preliminary: LayerNorm on the preliminary vector h^(0) as well (True).
        fast_weights: False gives the plain (LN-)RNN h_t = f(LN(W h_{t-1} + C x_t)) (True).
        read_mode: "matrix", "attention", or "auto": the matrix for single-step calls without
            autograd (token-by-token generation), attention otherwise; the choices measured faster
            in benchmarks/speed/bench_fast_rnn.py (training at T/H from 1/4 to 16, generation at T = 1).
        eps: LayerNorm epsilon (1e-5).

    forward(x [B, T, input_size], state: FastRNNState | None) -> (hs [B, T, H], FastRNNState).
    """

    def __init__(
        self,
        input_size: int,
        hidden: int,
        lam: float = 0.95,
        eta: float = 0.5,
        inner_steps: int = 1,
        layer_norm: bool = True,
        ln_preliminary: bool = True,
        fast_weights: bool = True,
        read_mode: str = "auto",
        eps: float = 1e-5,
    ):
        super().__init__()
        if hidden < 1:
            raise UserError(f"fast_rnn: hidden must be >= 1, got {hidden}")
        if not 0.0 <= lam <= 1.0:
            raise UserError(f"fast_rnn: lam must be in [0, 1], got {lam}")
        if eta < 0:
            raise UserError(f"fast_rnn: eta must be >= 0, got {eta}")
        if inner_steps < 1:
            raise UserError(f"fast_rnn: inner_steps must be >= 1, got {inner_steps}")
        if read_mode not in READ_MODES:
            raise UserError(f"fast_rnn: read_mode must be one of {', '.join(READ_MODES)}, got {read_mode!r}")
        self.hidden, self.lam, self.eta, self.inner_steps = hidden, lam, eta, inner_steps
        self.ln_preliminary, self.fast_weights, self.read_mode, self.eps = ln_preliminary, fast_weights, read_mode, eps
        self.in_proj = Linear(input_size, hidden)  # C (and its bias)
        self.W = nn.Parameter(0.05 * torch.eye(hidden))  # slow recurrent weights, 0.05 I as in the paper
        self.ln = nn.LayerNorm(hidden, eps=eps) if layer_norm else None

    def resolve_read_mode(self, T: int, grad: bool | None = None) -> str:
        """The read form used for a call of T steps (``grad``: autograd on; default: as now)."""
        if self.read_mode != "auto":
            return self.read_mode
        grad = torch.is_grad_enabled() if grad is None else grad
        return "matrix" if T == 1 and not grad else "attention"

    def forward(self, x: Tensor, state: FastRNNState | None = None) -> tuple[Tensor, FastRNNState]:
        B, T, _ = x.shape
        u = self.in_proj(x)  # C x_t + c for every step at once, [B, T, H]
        with no_autocast(x.device):
            dtype = torch.float64 if u.dtype == torch.float64 else torch.float32  # fp32 accumulation under autocast
            u, W = u.to(dtype), self.W.to(dtype)
            ln_w = None if self.ln is None else self.ln.weight.to(dtype)
            ln_b = None if self.ln is None else self.ln.bias.to(dtype)
            h, A, hist = (None, None, None) if state is None else state
            common = dict(ln_weight=ln_w, ln_bias=ln_b, eps=self.eps)
            if not self.fast_weights:  # plain (LN-)RNN: no reads, no memory
                hs = fast_rnn_attention(u, W, h, lam=0.0, eta=0.0, inner_steps=0, ln_preliminary=True, **common)
                return hs, FastRNNState(hs[:, -1], None, None)
            fast = dict(lam=self.lam, eta=self.eta, inner_steps=self.inner_steps, ln_preliminary=self.ln_preliminary)
            if self.resolve_read_mode(T) == "matrix":
                A = fold_history(A, hist, self.lam, self.eta)
                hs, A = fast_rnn_reference(u, W, h, A, **fast, **common)
                return hs, FastRNNState(hs[:, -1], A, None)
            # attention read in pieces, folding the history into A whenever it holds `hidden` states
            window = self.hidden
            pieces, start = [], 0
            while start < T:
                stored = 0 if hist is None else hist.shape[1]
                if stored >= window:
                    A, hist, stored = fold_history(A, hist, self.lam, self.eta), None, 0
                length = min(T - start, window - stored)
                piece = fast_rnn_attention(u[:, start : start + length], W, h, A, hist, **fast, **common)
                hist = piece if hist is None else torch.cat([hist, piece], 1)
                h = piece[:, -1]
                pieces.append(piece)
                start += length
            hs = pieces[0] if len(pieces) == 1 else torch.cat(pieces, 1)
            return hs, FastRNNState(h, A, hist)


@dataclass
class FastRNNOptions:
    """Options of the ``fast_rnn`` mixer (TOML table ``[model.options.fast_rnn]``)."""

    hidden: int = 0  # hidden units H; 0 = d_model
    lam: float = 0.95  # fast-weight decay lambda
    eta: float = 0.5  # fast-weight learning rate eta
    inner_steps: int = 1  # S inner-loop reads per step
    layer_norm: bool = True  # LayerNorm before every ReLU
    ln_preliminary: bool = True  # LayerNorm on the preliminary vector h^(0)
    fast_weights: bool = True  # False = the plain LN-RNN ablation
    read_mode: str = "auto"  # auto | matrix | attention


@register_mixer("fast_rnn", FastRNNOptions)
class FastRNNMixer(nn.Module):
    """The fast-weights RNN as a sequence mixer: x [B, T, d_model] -> C -> RNN (H units) -> y [B, T, d_model].

    ``n_heads`` is accepted for the mixer interface and unused: the model has one hidden vector.
    Parameters: C (d_model x H + H), W (H x H), LN (2H), output projection (H x d_model).
    """

    # facts for the project's checks and the memory estimate (fastweights.components, "what a component declares")
    test_variants = {"matrix": {"read_mode": "matrix", "hidden": 8},
                     "attention-2steps": {"read_mode": "attention", "hidden": 8, "inner_steps": 2},
                     "no-ln-preliminary": {"read_mode": "matrix", "hidden": 8, "ln_preliminary": False},
                     "ln-rnn": {"hidden": 8, "fast_weights": False}}
    bounded_variants = {"default": {"hidden": 32}, "preset-eta": {"hidden": 32, "eta": 0.0005},  # a decay forgets
                        "ln-rnn": {"hidden": 32, "fast_weights": False}}

    @staticmethod
    def state_floats(o, *, d_model, seq_len, **_):  # h, and the fast matrix A folded from up to `hidden` states
        hidden, T = o.hidden or d_model, seq_len
        if not o.fast_weights:
            return {"carried": hidden}
        if o.read_mode == "matrix":
            return {"carried": hidden + hidden * hidden}
        if T <= hidden:  # the attention read keeps the states of the call, folding them into A per `hidden`
            return {"carried": hidden + T * hidden}
        return {"carried": hidden + hidden * hidden + ((T - 1) % hidden + 1) * hidden}

    def __init__(self, d_model: int, n_heads: int, options: FastRNNOptions | None = None):
        super().__init__()
        o = asdict(options or FastRNNOptions())
        self.rnn = FastWeightRNN(d_model, o.pop("hidden") or d_model, **o)  # the other options are its arguments
        self.out_proj = Linear(self.rnn.hidden, d_model, bias=False)
        self.out_proj.is_residual_proj = True  # scaled init in LanguageModel, like the attention output

    def forward(self, x: Tensor, state: FastRNNState | None = None,
                attention_mask: Tensor | None = None) -> tuple[Tensor, FastRNNState]:
        if attention_mask is not None:
            hs, state = self._padded(x, state, attention_mask)
        else:
            hs, state = self.rnn(x, state)
        return self.out_proj(hs.to(x.dtype)), state

    def _padded(self, x: Tensor, state: FastRNNState | None, mask: Tensor) -> tuple[Tensor, FastRNNState | None]:
        """Each row's real tokens alone (see the module docstring); the rows' states joined, histories folded."""
        rnn = self.rnn

        def row(s: FastRNNState | None, b: int) -> FastRNNState | None:
            return None if s is None else FastRNNState(*(None if t is None else t[b:b + 1] for t in s))

        hs, rows = per_row(rnn, x, mask, [row(state, b) for b in range(x.shape[0])])
        if all(r is None for r in rows):
            return hs, None
        ref = next(r for r in rows if r is not None).h
        h = torch.cat([ref.new_zeros(1, rnn.hidden) if r is None else r.h for r in rows])
        if not rnn.fast_weights:
            return hs, FastRNNState(h, None, None)
        with no_autocast(x.device):  # the fast matrix stays fp32 (fp64), as the RNN keeps it
            As = [None if r is None else fold_history(r.A, r.history, rnn.lam, rnn.eta) for r in rows]
        if all(a is None for a in As):
            return hs, FastRNNState(h, None, None)
        zero = ref.new_zeros(1, rnn.hidden, rnn.hidden)
        return hs, FastRNNState(h, torch.cat([zero if a is None else a for a in As]), None)
