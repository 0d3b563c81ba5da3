"""Fast-weight MLP (FwMLP): the dense baseline of Zhao & Jones 2026 (arXiv 2601.00671, App. C).

FwPKM with its product-key memory replaced by a SwiGLU MLP whose three matrices and biases are fast
weights (the paper's 512 -> 2304 -> 512).  Inputs, gate and output are FwPKM's (eqs 8-10, 12)::

    v_hat_t = W_d (u_t * silu(a_t)) + b_d,   u_t = W_u q_t + b_u,   a_t = W_g q_t + b_g

After each chunk of C tokens, with lookahead L (query t paired with the value of token t + L)::

    L_mem = mean_{t, features} (v_hat_t - v_{t+L})^2        (mean over pairs and features, no 1/2)
    W <- W - eta * clip(dL_mem/dW)                           (eta = 0.1; plain SGD on all six tensors)

No per-row aggregation, no addressing loss and no gate weighting (App. C).  The released class clips
gradients to +-1 by default, but the released FwMLP configs turn the clip off; here
``grad_clip = 0`` (off) is the default and any positive value clips elementwise.

The gradient is written out by hand (backpropagation through the SwiGLU, cached activations), so
the update is an ordinary differentiable expression: training backpropagates through every inner
update without nested autograd.  Chunking, the boundary carry, persistence modes and the state
protocol are those both fast memories follow (``layers/fast_memory.py``); the slow reference the tests
hold this layer to is :func:`fastweights.layers.fast_memory_reference.fwmlp_memory_reference`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from fastweights.components import register_memory
from fastweights.layers.fast_memory import (FastMemoryIO, FastMemoryOptions, PerRowState, call_state, fast_dtype,
                                            padded_forward, piece_sizes, state_pytree, validate_options)
from fastweights.ops.linear_attention import no_autocast

PARAM_NAMES = ("w_up", "b_up", "w_gate", "b_gate", "w_down", "b_down")


@dataclass
class FwMLPOptions(FastMemoryOptions):
    """Options of :class:`FwMLP` (defaults: the paper's FwMLP baseline; the shared ones are in
    ``FastMemoryOptions``).

    ``d_key`` fast-MLP input width (the query), ``d_value`` its output, ``hidden`` its hidden width,
    ``chunk_size`` C, ``lr`` eta, ``grad_clip`` (0 = off), ``lookahead``, ``boundary``
    "carry"/"drop", ``value_norm``, ``gating``, ``gate_weighted_loss`` (off in the paper),
    ``gate_form``, ``persistence``, ``second_order``, ``frozen``: as for FwPKM (``layers/fast_memory.py``).
    """

    hidden: int = 2304
    lr: float = 0.1
    grad_clip: float = 0.0
    gate_weighted_loss: bool = False


@state_pytree
@dataclass
class _Acts:
    """Cached activations of R tokens: x [B, R, d_in], u/a [B, R, hidden], y [B, R, d_out]."""

    x: torch.Tensor
    u: torch.Tensor
    a: torch.Tensor
    y: torch.Tensor

    def fields(self):
        return (self.x, self.u, self.a, self.y)

    @staticmethod
    def cat(p: "_Acts | None", q: "_Acts") -> "_Acts":
        if p is None:
            return q
        return _Acts(*(torch.cat([s, t], 1) for s, t in zip(p.fields(), q.fields())))


@state_pytree
@dataclass
class FwMLPState:
    """Fast MLP weights (dict of the six tensors, each with a leading axis Bk = 1 shared or B per
    sequence) and the queue of tokens not yet written (as :class:`FwPKMState`)."""

    weights: dict[str, torch.Tensor]
    batch: int
    per_sequence: bool
    pending_v: torch.Tensor
    pending_g: torch.Tensor
    pending_x: torch.Tensor
    n_stale: int = 0
    acts: _Acts | None = None
    n_read: int = 0
    position: int = 0
    writes: int = 0

    def row(self, b: int) -> "FwMLPState":
        """Sequence ``b`` of a per-sequence state, as a state of batch 1 (a padded call runs rows alone)."""
        one = slice(b, b + 1)
        acts = None if self.acts is None else _Acts(*(t[one] for t in self.acts.fields()))
        return replace(self, weights={k: w[one] for k, w in self.weights.items()}, batch=1,
                       pending_v=self.pending_v[one], pending_g=self.pending_g[one],
                       pending_x=self.pending_x[one], acts=acts)

    def detach(self) -> "FwMLPState":
        """The same state cut from the autograd graph."""
        acts = None if self.acts is None else _Acts(*(t.detach() for t in self.acts.fields()))
        return replace(self, weights={k: w.detach() for k, w in self.weights.items()},
                       pending_v=self.pending_v.detach(), pending_g=self.pending_g.detach(),
                       pending_x=self.pending_x.detach(), acts=acts)


def swiglu_forward(weights: dict[str, torch.Tensor], x: torch.Tensor) -> _Acts:
    """Fast SwiGLU on x ``[B, R, d_in]`` with weights of leading axis 1 or B -> cached activations."""
    u = torch.matmul(x, weights["w_up"].transpose(-1, -2)) + weights["b_up"].unsqueeze(-2)  # [B, R, hidden]
    a = torch.matmul(x, weights["w_gate"].transpose(-1, -2)) + weights["b_gate"].unsqueeze(-2)
    h = u * F.silu(a)
    y = torch.matmul(h, weights["w_down"].transpose(-1, -2)) + weights["b_down"].unsqueeze(-2)  # [B, R, d_out]
    return _Acts(x, u, a, y)


@register_memory("fwmlp", FwMLPOptions)
class FwMLP(nn.Module):
    """Fast-weight SwiGLU MLP, inserted before a block's mixer; same protocol as FwPKM.

    ``y, state = layer(x, state=None)``; ``aux_loss`` is always None; ``last_stats`` holds the last
    write's mean memorisation loss and the mean gate.
    """

    placement = "before_mixer"

    # facts for the project's checks and the memory estimate (fastweights.components, "what a component declares");
    # a test variant's id starts with its persistence
    test_variants = {vid: {"d_key": 4, "d_value": 6, "hidden": 5, "chunk_size": 4, "lr": 0.5,
                           "persistence": vid.split("-")[0], **extra}
                     for vid, extra in (("stream", {}), ("per_sequence", {"lookahead": 0}),
                                        ("stream-clip-drop", {"grad_clip": 0.05, "boundary": "drop"}), ("official", {}),
                                        ("stream-gate-mean8", {"gate_form": "mean8"}),
                                        ("stream-gate-weighted", {"gate_weighted_loss": True}))}
    tiny_options = {"d_key": 8, "d_value": 8, "hidden": 16, "chunk_size": 4}
    bounded_variants = {"default": {"d_key": 16, "d_value": 16, "hidden": 32, "chunk_size": 16}}

    @staticmethod
    def state_floats(o, *, seq_len, **_):  # the weights up, gate, down; each second-order write makes new ones
        table = o.hidden * (2 * o.d_key + o.d_value) + 2 * o.hidden + o.d_value
        writes = math.ceil(seq_len / o.chunk_size) if o.second_order and not o.frozen else 0
        if o.persistence == "per_sequence":
            return {"carried": table, "backward": writes * table}
        return {"shared": table, "backward_shared": writes * table}

    def __init__(self, d_model: int, options: FwMLPOptions | None = None):
        super().__init__()
        o = options or FwMLPOptions()
        _validate(o)
        self.options = o
        self.io = FastMemoryIO(d_model, o.d_key, o.d_value, value_norm=o.value_norm, gating=o.gating,
                               gate_form=o.gate_form, norm_eps=o.norm_eps)
        shapes = {"w_up": (o.hidden, o.d_key), "b_up": (o.hidden,), "w_gate": (o.hidden, o.d_key),
                  "b_gate": (o.hidden,), "w_down": (o.d_value, o.hidden), "b_down": (o.d_value,)}
        for name in PARAM_NAMES:
            self.register_buffer(name, torch.empty(shapes[name]))
        self.reset_memory()
        self.frozen = o.frozen
        self.aux_loss: torch.Tensor | None = None
        self.last_stats: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def reset_memory(self) -> None:
        """Initial fast weights of the released code: W ~ N(0, fan_in^-1/2), biases 0."""
        o = self.options
        self.w_up.normal_(0.0, 1.0 / math.sqrt(o.d_key))
        self.w_gate.normal_(0.0, 1.0 / math.sqrt(o.d_key))
        self.w_down.normal_(0.0, 1.0 / math.sqrt(o.hidden))
        for name in ("b_up", "b_gate", "b_down"):
            getattr(self, name).zero_()

    def init_state(self, batch: int, device: torch.device | None = None,
                   dtype: torch.dtype | None = None) -> FwMLPState:
        """A fresh state for ``batch`` sequences from the layer's current fast weights."""
        device = device or self.w_up.device
        dtype = dtype or fast_dtype(self.w_up)
        per_seq = self.options.persistence == "per_sequence"
        weights = {}
        for name in PARAM_NAMES:
            w = getattr(self, name).to(device=device, dtype=dtype).unsqueeze(0)
            weights[name] = w.expand(batch, *w.shape[1:]) if per_seq else w
        o = self.options
        f = dict(device=device, dtype=dtype)
        return FwMLPState(weights=weights, batch=batch, per_sequence=per_seq,
                          pending_v=torch.zeros(batch, 0, o.d_value, **f), pending_g=torch.zeros(batch, 0, **f),
                          pending_x=torch.zeros(batch, 0, o.d_key, **f))

    def forward(self, x: torch.Tensor, state: FwMLPState | PerRowState | None = None,
                attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, FwMLPState | PerRowState]:
        """x ``[B, T, d_model]`` -> (y ``[B, T, d_model]``, state); ``attention_mask`` [B, T] (0 = padding, never
        written, chunks count real tokens only: ``layers.fast_memory.padded_forward``)."""
        if attention_mask is not None or isinstance(state, PerRowState):
            return padded_forward(self, x, state, attention_mask)
        q, v, g = self.io.inputs(x)
        g_loss = g if (self.options.gating and self.options.gate_weighted_loss) else torch.ones_like(g)
        v_hat, state = self.memory(q, v, g_loss, state)
        y = self.io.output(v_hat, v, g)
        self.aux_loss = None
        self.last_stats["gate_mean"] = g.detach().float().mean()
        if self.options.persistence == "official":
            state = self._persist(state)
        return y, state

    def memory(self, q: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               state: FwMLPState | None = None) -> tuple[torch.Tensor, FwMLPState]:
        """Fast core: q ``[B, T, d_key]``, v ``[B, T, d_value]``, g ``[B, T]`` -> (v_hat ``[B, T, d_value]``, state)."""
        B, T = q.shape[:2]
        dtype, st = call_state(self, q, state)
        C = self.options.chunk_size
        outs = []
        with no_autocast(q.device):
            q, v, g = q.to(dtype), v.to(dtype), g.to(dtype)
            t = 0
            for take in piece_sizes(T, st.n_read, C, self.frozen):
                sl = slice(t, t + take)
                acts = swiglu_forward(st.weights, q[:, sl])
                outs.append(acts.y)
                if self.frozen:
                    st = replace(st, position=st.position + take)
                else:
                    st = replace(st, pending_x=torch.cat([st.pending_x, q[:, sl]], 1),
                                 pending_v=torch.cat([st.pending_v, v[:, sl]], 1),
                                 pending_g=torch.cat([st.pending_g, g[:, sl]], 1),
                                 acts=_Acts.cat(st.acts, acts), n_read=st.n_read + take,
                                 position=st.position + take)
                    if st.n_read == C:
                        st = self._write(st)
                t += take
        v_hat = torch.cat(outs, dim=1) if outs else q.new_zeros(B, 0, self.options.d_value)
        return v_hat, st

    def _write(self, st: FwMLPState) -> FwMLPState:
        o = self.options
        L = o.lookahead
        acts = st.acts
        if st.n_stale:
            stale = swiglu_forward(st.weights, st.pending_x[:, : st.n_stale])
            acts = _Acts.cat(stale, acts) if acts is not None else stale
        P = st.pending_x.shape[1]
        n_pairs = P - L
        weights = st.weights
        if n_pairs > 0:
            with torch.set_grad_enabled(torch.is_grad_enabled() and o.second_order):
                head = _Acts(*(t[:, :n_pairs] for t in acts.fields()))
                err = head.y - st.pending_v[:, L: L + n_pairs]  # [B, P', d_out]
                gate = st.pending_g[:, :n_pairs].unsqueeze(-1)
                count = n_pairs * (1 if st.per_sequence else st.batch) * o.d_value
                self.last_stats["mem_loss"] = (gate * err.pow(2)).mean().detach()
                dy = 2.0 * gate * err / count  # d/dy of mean_{pairs, features} g (y - v)^2
                grads = fast_mlp_grads(st.weights, head, dy, st.per_sequence)
                if o.grad_clip > 0:
                    grads = {k: g.clamp(-o.grad_clip, o.grad_clip) for k, g in grads.items()}
                weights = {k: st.weights[k] - o.lr * grads[k] for k in PARAM_NAMES}
        carry = o.carried()
        return replace(st, weights=weights, pending_x=st.pending_x[:, P - carry:],
                       pending_v=st.pending_v[:, P - carry:], pending_g=st.pending_g[:, P - carry:],
                       n_stale=carry, acts=None, n_read=0, writes=st.writes + 1)

    @torch.no_grad()
    def _persist(self, st: FwMLPState) -> FwMLPState:
        """``persistence="official"``: write the final fast weights back into the module."""
        for name in PARAM_NAMES:
            # a fresh tensor: the old one may be saved for this forward's backward
            self._buffers[name] = st.weights[name][0].detach().to(getattr(self, name).dtype).clone()
        return replace(st, weights={k: getattr(self, k).unsqueeze(0).to(st.weights[k].dtype) for k in PARAM_NAMES})


def fast_mlp_grads(weights: dict[str, torch.Tensor], acts: _Acts, dy: torch.Tensor,
                   per_sequence: bool) -> dict[str, torch.Tensor]:
    """dL/dW of the fast SwiGLU by hand, given dL/dy ``[B, R, d_out]`` and cached activations.

    Returns each gradient with a leading axis B (per sequence) or 1 (one shared MLP: the batch
    is summed).  Plain differentiable ops, so training can backpropagate through the update.
    """
    sig = torch.sigmoid(acts.a)
    silu = acts.a * sig
    h = acts.u * silu  # [B, R, hidden]
    dh = torch.matmul(dy, weights["w_down"])  # [B, R, hidden]
    du = dh * silu
    da = dh * acts.u * sig * (1.0 + acts.a * (1.0 - sig))  # silu'(a) = s (1 + a (1 - s))

    def outer(grad_out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:  # [B, R, o] x [B, R, i] -> [Bk, o, i]
        if per_sequence:
            return torch.matmul(grad_out.transpose(1, 2), inp)
        return torch.matmul(grad_out.flatten(0, 1).t(), inp.flatten(0, 1)).unsqueeze(0)

    def bias(grad_out: torch.Tensor) -> torch.Tensor:  # [B, R, o] -> [Bk, o]
        return grad_out.sum(1) if per_sequence else grad_out.sum((0, 1)).unsqueeze(0)

    return {"w_up": outer(du, acts.x), "b_up": bias(du), "w_gate": outer(da, acts.x), "b_gate": bias(da),
            "w_down": outer(dy, h), "b_down": bias(dy)}


def _validate(o: FwMLPOptions) -> None:
    validate_options("fwmlp", o, [
        (o.d_key >= 1 and o.hidden >= 1, "d_key and hidden must be >= 1"),
        (o.d_value >= 2, f"d_value must be >= 2, got {o.d_value}"),
        (o.grad_clip >= 0, f"grad_clip must be >= 0, got {o.grad_clip}"),
    ])
