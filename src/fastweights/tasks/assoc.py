"""Synthetic associative retrieval of Schlag, Irie, Schmidhuber 2021 (arXiv 2102.11174, section 6.1).

Measures the capacity of a fast weight programmer's memory: how many key-value associations one fast
weight matrix stores and retrieves, for each update rule and feature map.

Data (as ``ischlag/fast-weight-transformers/synthetic/associativeRetrievalDataset.py``): S keys
("a", "b", ..., "aa", ...) and S values (the same strings in upper case), a vocabulary of 2S
symbols. A sample is L (key, value) pairs and one query key; the query picks a sequence *position*
uniformly and the target is the value at that key's **last** occurrence.

    setting 1 (capacity):   L = S, keys and values are permutations (each key once)
    setting 2 (overwrites): L = 2S, keys and values drawn with replacement (repeats force updates)

Evaluation (``get_all_queries``): one fresh sequence of length S in *both* settings (the reference
code uses len(keys); reproduced here), queried with each of its distinct keys (at most 200), loss
averaged over query batches of ``batch_size`` and over ``eval_sequences`` sequences.

Model (``PrefixSumLinearAttentionModel``): key embedding E [2S, e], e = int(1.1 * 2S), N(0, 1); values
are fixed one-hot vectors of size S used directly as V; hidden size d = 64:

    k_t = W_k [onehot(v_t); E k_t],   q = W_q E q,   beta_t = sigmoid(w_b^T [onehot(v_t); E k_t])
    sum:    W = sum_t onehot(v_t) phi(k_t)^T,        y = W phi(q) / (z^T phi(q) + 1e-6),  z = sum_t phi(k_t)
    delta:  W_t = W_{t-1} + beta_t (v_t - W_{t-1} k^_t) k^_t^T,  k^ = phi(k) / sum phi(k);
            y = W phi(q) / (sum phi(q) + 1e-6)
    gated:  as delta with Peng et al.'s rule W_t = (1 - beta_t) W_{t-1} + beta_t v_t k^_t^T

d_dot = 64 for ELU+1, 2m for FAVOR+ (redrawn at every forward, as the reference), 128 nu for DPFP-nu.
The fast weights are computed with :mod:`fastweights.ops` (chunked forms).

Training: loss 0.5 |onehot(y) - y_hat|^2 summed over the S outputs, averaged over the batch; Adam lr
1e-3, batch 32, at most 100k steps, seed 1; evaluation every 100 steps on 20 fresh sequences; stop when
the eval loss is <= 0.001 or after more than 10 evaluations in a row without improvement. The metric
is the final eval loss as a function of S (paper figure 2 for setting 1, figure 5 for setting 2).
``max_minutes`` adds a wall-clock budget so that sweeps stay affordable on a CPU.

    fastweights task assoc --setting 1 --rule delta --feature-map dpfp --nu 1 --keys 60 --json
    fastweights task assoc --setting 1 --keys 20:100:20 --model sum:elu1 --model sum:dpfp1 \\
        --plot capacity.png --out capacity.json
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from fastweights.core import numbers
from fastweights.core.config import setting_field
from fastweights.core.errors import UserError
from fastweights.ops.delta_rule import delta_rule
from fastweights.ops.feature_maps import apply_feature_map, feature_dim, orthogonal_random_features, sum_normalize
from fastweights.ops.linear_attention import gated_rule, linear_attention
from fastweights.ops.linear import Linear

RULES = ("sum", "gated", "delta")
FEATURE_MAPS = ("elu1", "dpfp", "favor")
MAX_D_DOT = 65_536  # feature width of a fast weight memory (d_dot x hidden floats per sequence), at most


# ----------------------------------------------------------------------------- vocabulary and data


def symbol(index: int, upper: bool = False) -> str:
    """Name of key (or value, ``upper=True``) number ``index`` >= 0: a, b, ..., z, aa, ab, ..."""
    n = index + 1  # bijective base 26, as int_to_lex in the reference code
    letters = []
    while n > 0:
        n, rem = divmod(n - 1, 26)
        letters.append(chr(ord("a") + rem))
    name = "".join(reversed(letters))
    return name.upper() if upper else name


def vocabulary(n_keys: int) -> list[str]:
    """The 2S symbols: keys (lower case) then values (upper case)."""
    return [symbol(i) for i in range(n_keys)] + [symbol(i, upper=True) for i in range(n_keys)]


class AssocData:
    """Sampler of retrieval problems with ``n_keys`` keys/values; ``setting`` 1 or 2.

    Keys and values are returned as indices in ``[0, S)`` (key i is token i, value j is token S + j).
    """

    def __init__(self, n_keys: int, setting: int, rng: np.random.Generator):
        if setting not in (1, 2):
            raise UserError(f"assoc: setting must be 1 or 2, got {setting}")
        if n_keys < 1:
            raise UserError(f"assoc: the number of keys must be >= 1, got {n_keys}")
        self.n_keys = n_keys
        self.setting = setting
        self.replace = setting == 2
        self.seq_len = 2 * n_keys if self.replace else n_keys
        self.rng = rng

    def _pairs(self, rows: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        s = self.n_keys
        if self.replace:
            return self.rng.integers(0, s, (rows, length)), self.rng.integers(0, s, (rows, length))
        # without replacement: a random permutation per row (length <= S)
        keys = np.argsort(self.rng.random((rows, s)), axis=1)[:, :length]
        values = np.argsort(self.rng.random((rows, s)), axis=1)[:, :length]
        return keys, values

    @staticmethod
    def _last_value(keys: np.ndarray, values: np.ndarray, query: np.ndarray) -> np.ndarray:
        """Value at the last occurrence of ``query[b, j]`` in ``keys[b]``; shapes [B, L], [B, L], [B, Q]."""
        hit = keys[:, None, :] == query[:, :, None]  # [B, Q, L]
        last = keys.shape[1] - 1 - np.argmax(hit[:, :, ::-1], axis=2)  # [B, Q]
        return np.take_along_axis(values, last, axis=1)

    def batch(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        """Training batch: keys, values ``[B, L]``, query ``[B, 1]``, target value ``[B, 1]`` (int64)."""
        keys, values = self._pairs(batch_size, self.seq_len)
        pos = self.rng.integers(0, self.seq_len, batch_size)  # the query picks a position uniformly
        query = keys[np.arange(batch_size), pos][:, None]
        target = self._last_value(keys, values, query)
        return tuple(torch.from_numpy(np.ascontiguousarray(a)).long() for a in (keys, values, query, target))

    def eval_sequence(self, max_queries: int = 200) -> tuple[torch.Tensor, ...]:
        """One evaluation sequence of length S, queried with each distinct key (sorted, at most ``max_queries``).

        Returns keys, values ``[1, S]``, queries and targets ``[1, Q]``.
        """
        keys, values = self._pairs(1, self.n_keys)
        query = np.unique(keys[0])[:max_queries][None, :]
        target = self._last_value(keys, values, query)
        return tuple(torch.from_numpy(np.ascontiguousarray(a)).long() for a in (keys, values, query, target))


# ----------------------------------------------------------------------------- model


class AssocModel(nn.Module):
    """The paper's small retrieval model (one fast weight matrix, no layers around it).

    ``forward(keys [B, L], values [B, L], queries [B, Q]) -> y_hat [B, Q, S]``.
    """

    def __init__(self, n_keys: int, rule: str = "sum", feature_map: str = "elu1", nu: int = 1,
                 n_features: int = 64, hidden: int = 64, chunk_size: int = 64):
        super().__init__()
        if rule not in RULES:
            raise UserError(f"assoc: unknown rule {rule!r}; choose one of {', '.join(RULES)}")
        if feature_map not in FEATURE_MAPS:
            raise UserError(f"assoc: unknown feature map {feature_map!r}; choose one of {', '.join(FEATURE_MAPS)}")
        self.n_keys, self.rule, self.feature_map = n_keys, rule, feature_map
        self.nu, self.n_features, self.hidden, self.chunk_size = nu, n_features, hidden, chunk_size
        self.d_dot = feature_dim(feature_map, hidden, nu=nu, n_features=n_features)
        embed = int(2 * n_keys * 1.1)
        self.register_buffer("value_onehot", torch.eye(n_keys))  # fixed, untrained value vectors
        self.key_embedding = nn.Embedding(2 * n_keys, embed)  # rows S..2S-1 (values) are never looked up
        self.w_k = Linear(embed + n_keys, hidden)
        self.w_q = Linear(embed, hidden)
        self.w_b = Linear(embed + n_keys, 1)
        nn.init.normal_(self.key_embedding.weight, 0.0, 1.0)
        bound = 1 / math.sqrt(hidden)
        nn.init.uniform_(self.w_k.weight, -bound, bound)
        nn.init.uniform_(self.w_q.weight, -bound, bound)

    def _phi(self, x: torch.Tensor, omega: torch.Tensor | None) -> torch.Tensor:
        return apply_feature_map(self.feature_map, x, nu=self.nu, omega=omega)

    def forward(self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        v = self.value_onehot[values]  # [B, L, S]
        x = torch.cat([v, self.key_embedding(keys)], dim=-1)  # [B, L, S + e]
        k = self.w_k(x)  # [B, L, d]
        q = self.w_q(self.key_embedding(queries))  # [B, Q, d]
        # FAVOR+: a new random matrix at every forward, as the reference code.
        omega = orthogonal_random_features(self.hidden, self.n_features, device=k.device) \
            if self.feature_map == "favor" else None
        phi_k, phi_q = self._phi(k, omega), self._phi(q, omega)  # [B, L, d_dot], [B, Q, d_dot]
        if self.rule == "sum":
            # One head: [B, L, 1, d_dot] layout for the op; only the final fast weight is read.
            _, fast = linear_attention(phi_k.unsqueeze(2), phi_k.unsqueeze(2), v.unsqueeze(2), scale=1.0,
                                       output_final_state=True, chunk_size=self.chunk_size)
            z = phi_k.sum(1)  # [B, d_dot]
            read = torch.einsum("bkv,bqk->bqv", fast[:, 0], phi_q)  # [B, Q, S]
            return read / ((phi_q * z[:, None]).sum(-1, keepdim=True) + 1e-6)
        beta = torch.sigmoid(self.w_b(x)).squeeze(-1)  # [B, L]
        k_hat = sum_normalize(phi_k).unsqueeze(2)  # [B, L, 1, d_dot]
        op_args = dict(scale=1.0, output_final_state=True, chunk_size=self.chunk_size)
        if self.rule == "delta":
            _, fast = delta_rule(k_hat, k_hat, v.unsqueeze(2), beta.unsqueeze(-1), **op_args)
        else:
            _, fast = gated_rule(k_hat, k_hat, v.unsqueeze(2), beta.unsqueeze(-1), **op_args)
        q_hat = phi_q / (phi_q.sum(-1, keepdim=True) + 1e-6)  # [B, Q, d_dot]
        return torch.einsum("bkv,bqk->bqv", fast[:, 0], q_hat)  # [B, Q, S]


def retrieval_loss(y_hat: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``0.5 * |onehot(target) - y_hat|^2`` summed over the S outputs; ``[B, Q, S], [B, Q] -> [B, Q]``."""
    return 0.5 * (F.one_hot(target, y_hat.shape[-1]).to(y_hat.dtype) - y_hat).pow(2).sum(-1)


# ----------------------------------------------------------------------------- training


def parse_keys(text: str) -> list[int]:
    """``"60"``, ``"20,40,60"`` or ``"20:100:20"`` (inclusive end, as the reference's --begin/--end/--step): the
    type of ``--keys`` (its messages follow argparse's ``argument --keys:``)."""
    try:
        if ":" in text:
            parts = [int(p) for p in text.split(":")]
            if len(parts) != 3 or parts[2] < 1:
                raise ValueError
            values = list(range(parts[0], parts[1] + 1, parts[2]))
        else:
            values = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise UserError(f"must look like 60, 20,40,60 or 20:100:20, got {text!r}") from None
    if not values or min(values) < 1:
        raise UserError(f"must list positive integers, got {text!r}")
    return values


@dataclass
class AssocConfig:
    """One training run of the retrieval task (defaults: the paper's); ``fastweights task assoc``'s flags are
    generated from these fields (``cli.settings``)."""

    setting: int = setting_field(1, "1: S unique keys, length S; 2: keys with replacement, length 2S (overwrites)",
                                 choices=(1, 2))
    keys: int = setting_field(20, "number of keys S; on the command line a sweep: 60, 20,40,60 or 20:100:20",
                              type=parse_keys)
    rule: str = setting_field("sum", "fast weight update rule", choices=RULES)
    feature_map: str = setting_field("elu1", "feature map of keys and queries", choices=FEATURE_MAPS)
    nu: int = setting_field(1, "DPFP order (d_dot = 128 nu)", type=numbers.positive_int)
    n_features: int = setting_field(64, "FAVOR+ random features m (d_dot = 2m)", type=numbers.positive_int)
    hidden: int = setting_field(64, "model width", type=numbers.positive_int)
    batch_size: int = setting_field(32, "sequences per training step", type=numbers.positive_int)
    lr: float = setting_field(1e-3, "Adam learning rate", type=numbers.positive_float)
    max_steps: int = setting_field(100_000, "training steps per run at most", type=numbers.positive_int)
    max_minutes: float = setting_field(0.0, "wall-clock budget per run (0 = none)", type=numbers.nonneg_float)
    eval_every: int = setting_field(100, "steps between evaluations", type=numbers.positive_int)
    eval_sequences: int = setting_field(20, "batches of sequences per evaluation", type=numbers.positive_int)
    max_eval_queries: int = setting_field(200, "queries per evaluation sequence at most", type=numbers.positive_int)
    stop_loss: float = setting_field(0.001, "stop a run once its eval loss (nats) is below this",
                                     type=numbers.nonneg_float)
    patience: int = setting_field(10, "stop a run after more than this many evaluations without improvement",
                                  type=numbers.nonneg_int)
    seed: int = setting_field(1, "initialisation and data seed", type=numbers.seed)

    def label(self) -> str:
        fm = {"dpfp": f"dpfp{self.nu}", "favor": f"favor{self.n_features}"}.get(self.feature_map, self.feature_map)
        return f"{self.rule}/{fm}"


def evaluate(model: AssocModel, data: AssocData, cfg: AssocConfig) -> float:
    """Mean eval loss over ``cfg.eval_sequences`` fresh sequences, averaged per query batch as the reference."""
    losses = []
    model.eval()
    with torch.no_grad():
        for _ in range(cfg.eval_sequences):
            keys, values, queries, targets = data.eval_sequence(cfg.max_eval_queries)
            per_query = retrieval_loss(model(keys, values, queries), targets)[0]  # [Q]
            losses.extend(piece.mean().item() for piece in per_query.split(cfg.batch_size))
    model.train()
    return float(np.mean(losses))


def train_assoc(cfg: AssocConfig, progress: bool = True) -> dict:
    """Train one model on one problem size; returns a JSON-ready summary with the eval history."""
    for name in ("keys", "batch_size", "max_steps", "eval_every", "eval_sequences", "hidden", "nu", "n_features"):
        if getattr(cfg, name) < 1:
            raise UserError(f"assoc: {name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    d_dot = feature_dim(cfg.feature_map, cfg.hidden, nu=cfg.nu, n_features=cfg.n_features)
    if d_dot > MAX_D_DOT:  # a d_dot x hidden fast weight memory per sequence: --nu 1e9 was killed at 13.5 GB
        raise UserError(f"assoc: d_dot = {d_dot:,} ({cfg.feature_map}); at most {MAX_D_DOT:,}")
    torch.manual_seed(cfg.seed)
    data = AssocData(cfg.keys, cfg.setting, np.random.default_rng(cfg.seed))
    model = AssocModel(cfg.keys, cfg.rule, cfg.feature_map, cfg.nu, cfg.n_features, cfg.hidden)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    history: list[list[float]] = []
    best, strikes, stopped, step = math.inf, 0, "max_steps", 0
    start = time.perf_counter()
    bar = None
    if progress:
        from fastweights.core.progress import Progress

        bar = Progress(cfg.max_steps, unit="step", desc=f"assoc S={cfg.keys} {cfg.label()}", loss_unit="squared error")
    for step in range(1, cfg.max_steps + 1):
        keys, values, query, target = data.batch(cfg.batch_size)
        loss = retrieval_loss(model(keys, values, query), target).mean()
        if not torch.isfinite(loss):
            stopped = "nan"
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if bar is not None:
            bar.update(1, loss=loss.item())
        if step % cfg.eval_every == 0:
            eval_loss = evaluate(model, data, cfg)
            history.append([step, eval_loss])
            if bar is not None:
                bar.update(0, eval=eval_loss)
            if eval_loss < best:
                best, strikes = eval_loss, 0
            else:
                strikes += 1
            if eval_loss <= cfg.stop_loss:
                stopped = "solved"
                break
            if strikes > cfg.patience:
                stopped = "plateau"
                break
            if cfg.max_minutes and time.perf_counter() - start > 60 * cfg.max_minutes:
                stopped = "time_budget"
                break
    if bar is not None:
        bar.close()
    if not history or history[-1][0] != step:
        if stopped != "nan":  # always end on an evaluation, so "final" is measured, not stale
            history.append([step, evaluate(model, data, cfg)])
            best = min(best, history[-1][1])
    final = history[-1][1] if history else math.nan
    if stopped == "nan" or not math.isfinite(final):
        final, stopped = math.nan, "nan"
    return {
        **dataclasses.asdict(cfg),
        "label": cfg.label(),
        "seq_len": data.seq_len,
        "d_dot": model.d_dot,
        "final_eval_loss": final,
        "best_eval_loss": best if math.isfinite(best) else math.nan,
        "steps": step,
        "stopped": stopped,
        "seconds": round(time.perf_counter() - start, 2),
        "history": history,
    }


def plot_capacity(results: list[dict], path: Path, title: str | None = None) -> None:
    """Final eval loss against the number of keys S, one line per rule/feature map; PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastweights.core.files import save_figure

    fig, ax = plt.subplots(figsize=(6, 4))
    for label in dict.fromkeys(r["label"] for r in results):
        rows = sorted((r["keys"], r["final_eval_loss"]) for r in results if r["label"] == label)
        ax.plot([s for s, _ in rows], [max(v, 1e-5) for _, v in rows], marker="o", label=label)
    settings = {r["setting"] for r in results}
    if settings == {2}:
        ax.set_yscale("log")  # as the paper's figure 5
    ax.set_xlabel("number of unique keys S")
    ax.set_ylabel("final eval loss")
    ax.set_title(title or f"associative retrieval, setting {'/'.join(map(str, sorted(settings)))}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


# ----------------------------------------------------------------------------- CLI


def parse_model(text: str) -> dict:
    """``RULE:MAP`` with MAP elu1 | dpfpN | favorM, e.g. ``sum:elu1``, ``delta:dpfp2``, ``sum:favor64``."""
    rule, _, fmap = text.partition(":")
    out = {"rule": rule}
    if fmap == "elu1":
        out["feature_map"] = "elu1"
    elif fmap.startswith("dpfp") and fmap[4:].isdigit():
        out.update(feature_map="dpfp", nu=int(fmap[4:]))
    elif fmap.startswith("favor") and fmap[5:].isdigit():
        out.update(feature_map="favor", n_features=int(fmap[5:]))
    else:
        raise UserError(f"assoc: --model must be RULE:MAP with MAP elu1, dpfpN or favorM, got {text!r}")
    if rule not in RULES:
        raise UserError(f"assoc: unknown rule {rule!r} in --model {text!r}; choose one of {', '.join(RULES)}")
    return out


def run_sweep(base: AssocConfig, keys: list[int], models: list[dict], progress: bool = True) -> list[dict]:
    """Train every model on every number of keys; returns the summaries in order."""
    results = []
    for model in models:
        for s in keys:
            results.append(train_assoc(dataclasses.replace(base, keys=s, **model), progress=progress))
    return results
