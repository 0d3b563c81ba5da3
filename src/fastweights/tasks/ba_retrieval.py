"""Associative retrieval task of Ba et al. 2016 ("Using Fast Weights to Attend to the Recent Past",
arXiv 1610.06258, section 4.1), its small task network, training loop and CLI.

A sequence lists K key-value pairs, then ``??``, then one of the keys; the answer is that key's value::

    c9k8j3f1??c -> 9        j0a5s5z2??a -> 5

* keys: K distinct lowercase letters (drawn without replacement); values: digits 0-9 (may repeat);
  the query key is drawn uniformly from the K keys.
* vocabulary: 26 letters + 10 digits + ``?`` = 37 tokens; length T = 2K + 3 (11 for K = 4).
* loss and metric: cross-entropy and error on the final step only (a 37-way output, or a 10-way
  digit head with ``digit_head``).
* splits: 100,000 train / 10,000 validation / 20,000 test from one seeded generator; validation and
  test contain no sequence of an earlier split (nor repeats of their own).

Task network (paper): a learned 100-d embedding, one recurrent layer of R units, the final hidden
state through a 100-unit ReLU layer, then the softmax. Recurrent layers: the fast-weights RNN
(:class:`~fastweights.layers.fast_rnn.FastWeightRNN`), an LSTM, or an IRNN (ReLU RNN with identity
recurrent weights and zero biases, Le et al. 2015). The paper's table (R = 20): fast weights 1.81%
test error, LSTM 60.81%, IRNN 62.11% (unverified against the PDF).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastweights.core import numbers
from fastweights.core.config import setting_field
from fastweights.core.errors import UserError
from fastweights.layers.fast_rnn import FastRNNOptions, FastWeightRNN
from fastweights.layers.lstm import LSTMLayer
from fastweights.ops.linear import Linear

VOCAB = "abcdefghijklmnopqrstuvwxyz0123456789?"  # token id = index
NUM_LETTERS = 26
DIGIT0 = 26  # token id of "0"
QUERY_MARK = 36  # token id of "?"
SPLIT_SIZES = {"train": 100_000, "val": 10_000, "test": 20_000}
MODELS = ("fast-rnn", "lstm", "irnn")


@dataclass
class BaRetrievalConfig:
    """One run of the task: data, network and training (defaults: the paper's setting, R = 20, K = 4; the
    fast-weights RNN's own, ``FastRNNOptions``, for lam, eta, inner_steps, layer_norm and fast_weights).
    ``fastweights task ba-retrieval``'s flags are generated from these fields (``cli.settings``) and
    :func:`train_retrieval` takes its defaults from them."""

    model: str = setting_field("fast-rnn", "recurrent layer", choices=MODELS)
    hidden: int = setting_field(20, "recurrent units R", type=numbers.positive_int)
    keys: int = setting_field(4, "key-value pairs K per sequence", type=numbers.positive_int)
    steps: int = setting_field(45_000, "maximum Adam updates", type=numbers.positive_int)
    max_minutes: float = setting_field(0.0, "wall-clock limit of training (0 = none)", type=numbers.nonneg_float)
    target_val_error: float = setting_field(0.01, "stop once the validation error is at most this fraction",
                                            type=numbers.fraction)
    batch_size: int = setting_field(128, "sequences per update", type=numbers.positive_int)
    lr: float = setting_field(1e-3, "Adam learning rate", type=numbers.positive_float)
    decay_fraction: float = setting_field(0.2, "decay the learning rate linearly to 0 over this final fraction of "
                                               "--steps", type=numbers.fraction)
    grad_clip: float = setting_field(5.0, "gradient-norm clip (0 = off)", type=numbers.nonneg_float)
    eval_every: int = setting_field(500, "steps between validation passes", type=numbers.positive_int)
    seed: int = setting_field(0, "initialisation and batch-order seed", type=numbers.seed)
    data_seed: int = setting_field(1234, "seed of the generated splits", type=numbers.seed)
    train_size: int = setting_field(SPLIT_SIZES["train"], "generated training sequences", type=numbers.positive_int)
    val_size: int = setting_field(SPLIT_SIZES["val"], "generated validation sequences", type=numbers.positive_int)
    test_size: int = setting_field(SPLIT_SIZES["test"], "generated test sequences", type=numbers.positive_int)
    digit_head: bool = setting_field(False, "10-way digit output instead of the 37-token vocabulary")
    lam: float = setting_field(FastRNNOptions.lam, "fast-rnn: decay lambda of the fast weights",
                               type=numbers.fraction)
    eta: float = setting_field(FastRNNOptions.eta, "fast-rnn: eta, the fast weights' own write strength (a model "
                               "constant, not trained, unlike --lr)", type=numbers.nonneg_float)
    inner_steps: int = setting_field(FastRNNOptions.inner_steps, "fast-rnn: inner-loop steps S",
                                     type=numbers.positive_int)
    layer_norm: bool = setting_field(FastRNNOptions.layer_norm, "fast-rnn: LayerNorm before every ReLU (off: the "
                                     "ablation)")
    fast_weights: bool = setting_field(FastRNNOptions.fast_weights, "fast-rnn: the fast weights (off: the LN-RNN "
                                       "ablation)")

    def split_sizes(self) -> dict[str, int]:
        return {"train": self.train_size, "val": self.val_size, "test": self.test_size}

    def fast_rnn(self) -> dict:
        """The keyword arguments of :class:`FastWeightRNN` this run sets (``RetrievalNet(fast_rnn=...)``)."""
        return dict(lam=self.lam, eta=self.eta, inner_steps=self.inner_steps, layer_norm=self.layer_norm,
                    fast_weights=self.fast_weights)


# ----------------------------------------------------------------------------- data


def generate(n: int, num_keys: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Draw ``n`` retrieval sequences.

    Returns tokens int64 [n, 2K+3] and targets int64 [n] (the token id of the queried value).
    """
    if not 1 <= num_keys <= NUM_LETTERS:
        raise UserError(f"ba-retrieval: keys must be in 1..{NUM_LETTERS}, got {num_keys}")
    K = num_keys
    keys = np.argsort(rng.random((n, NUM_LETTERS)), axis=1)[:, :K]  # K distinct letters per row, [n, K]
    values = rng.integers(0, 10, size=(n, K))  # digits, repeats allowed
    query = rng.integers(0, K, size=n)  # which pair is asked for
    tokens = np.empty((n, 2 * K + 3), dtype=np.int64)
    tokens[:, 0 : 2 * K : 2] = keys
    tokens[:, 1 : 2 * K : 2] = DIGIT0 + values
    tokens[:, 2 * K] = tokens[:, 2 * K + 1] = QUERY_MARK
    rows = np.arange(n)
    tokens[:, 2 * K + 2] = keys[rows, query]
    return tokens, DIGIT0 + values[rows, query]


def make_splits(
    seed: int = 0, num_keys: int = 4, sizes: dict[str, int] | None = None
) -> dict[str, tuple[Tensor, Tensor]]:
    """Seeded train/val/test splits (default 100k/10k/20k); val and test share no sequence with
    any earlier split and hold no repeats. Returns {split: (tokens [n, 2K+3], targets [n])}."""
    sizes = dict(SPLIT_SIZES if sizes is None else sizes)
    if not 1 <= num_keys <= NUM_LETTERS:
        raise UserError(f"ba-retrieval: keys must be in 1..{NUM_LETTERS}, got {num_keys}")
    distinct = math.perm(NUM_LETTERS, num_keys) * 10**num_keys * num_keys  # key orders x values x query
    held_out = sum(sizes.values()) - next(iter(sizes.values()), 0)
    if held_out > distinct // 2:
        raise UserError(
            f"ba-retrieval: {held_out} held-out sequences requested but only {distinct} distinct ones exist with {num_keys} keys"
        )
    rng = np.random.default_rng(seed)
    seen: set[bytes] = set()
    out = {}
    for i, (name, n) in enumerate(sizes.items()):
        if i == 0:  # the training split may repeat a sequence, as independent draws do
            x, y = generate(n, num_keys, rng)
            seen.update(row.tobytes() for row in x)
            out[name] = (torch.from_numpy(x), torch.from_numpy(y))
            continue
        xs, ys, have, tries = [], [], 0, 0
        while have < n:
            tries += 1
            if tries > 1000:  # the training split already covers nearly every sequence
                raise UserError(f"ba-retrieval: cannot draw {n} new distinct sequences with {num_keys} keys")
            x, y = generate(n - have, num_keys, rng)
            keep = []
            for j, row in enumerate(x):
                key = row.tobytes()
                if key not in seen:
                    seen.add(key)
                    keep.append(j)
            xs.append(x[keep])
            ys.append(y[keep])
            have += len(keep)
        out[name] = (torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys)))
    return out


def decode(tokens) -> str:
    """Token ids -> text, e.g. ``c9k8j3f1??c``."""
    return "".join(VOCAB[int(t)] for t in tokens)


# ----------------------------------------------------------------------------- model


class IRNN(nn.Module):
    """ReLU RNN with identity recurrent weights and zero biases (Le, Jaitly & Hinton 2015) on the state protocol."""

    def __init__(self, input_size: int, hidden: int):
        super().__init__()
        self.hidden = hidden
        self.rnn = nn.RNN(input_size, hidden, nonlinearity="relu", batch_first=True)
        with torch.no_grad():
            self.rnn.weight_hh_l0.copy_(torch.eye(hidden))
            self.rnn.bias_hh_l0.zero_()
            self.rnn.bias_ih_l0.zero_()

    def forward(self, x: Tensor, state: Tensor | None = None) -> tuple[Tensor, Tensor]:
        hs, h = self.rnn(x, None if state is None else state.unsqueeze(0).contiguous())
        return hs, h.squeeze(0)


class RetrievalNet(nn.Module):
    """The paper's task network: embedding (100) -> recurrent layer (R) -> ReLU layer (100) -> logits.

    Args:
        model: "fast-rnn", "lstm" or "irnn".
        hidden: R, the recurrent units.
        digit_head: 10-way output over the digits instead of the 37-token vocabulary.
        embed, mlp: widths of the embedding and of the ReLU layer (100, 100).
        fast_rnn: extra keyword arguments of :class:`FastWeightRNN` (lam, eta, inner_steps, ...).

    forward(tokens [B, T]) -> logits [B, 37] (or [B, 10]) for the final step.
    """

    def __init__(
        self,
        model: str,
        hidden: int,
        digit_head: bool = False,
        embed: int = 100,
        mlp: int = 100,
        fast_rnn: dict | None = None,
    ):
        super().__init__()
        if model not in MODELS:
            raise UserError(f"ba-retrieval: unknown model {model!r}; choose one of {', '.join(MODELS)}")
        if hidden < 1:
            raise UserError(f"ba-retrieval: hidden must be >= 1, got {hidden}")
        self.embed = nn.Embedding(len(VOCAB), embed)
        if model == "fast-rnn":
            self.rnn = FastWeightRNN(embed, hidden, **(fast_rnn or {}))
        elif model == "lstm":
            self.rnn = LSTMLayer(embed, hidden)
        else:
            self.rnn = IRNN(embed, hidden)
        self.hidden_layer = Linear(hidden, mlp)
        self.out = Linear(mlp, 10 if digit_head else len(VOCAB))
        self.digit_head = digit_head

    def forward(self, tokens: Tensor) -> Tensor:
        hs, _ = self.rnn(self.embed(tokens))
        return self.out(torch.relu(self.hidden_layer(hs[:, -1])))

    def target_ids(self, targets: Tensor) -> Tensor:
        """Targets (token ids) in this network's output space."""
        return targets - DIGIT0 if self.digit_head else targets


@torch.no_grad()
def error_rate(net: RetrievalNet, tokens: Tensor, targets: Tensor, batch: int = 2500) -> float:
    """Fraction of sequences whose arg-max answer is wrong."""
    was_training = net.training
    net.eval()
    wrong = 0
    for i in range(0, len(tokens), batch):
        pred = net(tokens[i : i + batch]).argmax(-1)
        wrong += int((pred != net.target_ids(targets[i : i + batch])).sum())
    net.train(was_training)
    return wrong / len(tokens)


def train_retrieval(
    net: RetrievalNet,
    splits: dict[str, tuple[Tensor, Tensor]],
    *,
    steps: int = BaRetrievalConfig.steps,
    max_minutes: float = BaRetrievalConfig.max_minutes,
    batch_size: int = BaRetrievalConfig.batch_size,
    lr: float = BaRetrievalConfig.lr,
    decay_fraction: float = BaRetrievalConfig.decay_fraction,
    grad_clip: float = BaRetrievalConfig.grad_clip,
    eval_every: int = BaRetrievalConfig.eval_every,
    target_val_error: float = BaRetrievalConfig.target_val_error,
    seed: int = BaRetrievalConfig.seed,
    log=None,
) -> dict:
    """Adam on the final-step cross-entropy; keeps the parameters with the best validation error.

    The learning rate is ``lr``, then decays linearly to 0 over the last ``decay_fraction`` of
    ``steps`` (0 = constant; 1 = linear decay over the whole run).

    Stops after ``steps`` updates, after ``max_minutes`` of training (0 = no limit), or as soon as
    the validation error is at most ``target_val_error`` (checked every ``eval_every`` steps).
    Returns a dict with the budget used, the best validation error, the test error at those
    parameters, and the validation curve.
    """
    torch.manual_seed(seed)
    x_train, y_train = splits["train"]
    y_train = net.target_ids(y_train)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    decay_steps = int(round(decay_fraction * steps))
    decay_start = steps - decay_steps
    sched = None
    if decay_steps > 0:
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda i: 1.0 if i < decay_start else max(0.0, (steps - i) / decay_steps)
        )
    order = torch.randperm(len(x_train))
    cursor, step, seen = 0, 0, 0
    best = (math.inf, 0, None)  # (val error, step, state_dict)
    curve = []
    start = time.perf_counter()
    running = None
    while step < steps:
        if cursor + batch_size > len(order):  # a new epoch in a new order
            order, cursor = torch.randperm(len(x_train)), 0
        idx = order[cursor : cursor + batch_size]
        cursor += batch_size
        loss = F.cross_entropy(net(x_train[idx]), y_train[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip > 0:
            nn.utils.clip_grad_norm_(net.parameters(), grad_clip)
        opt.step()
        if sched is not None:
            sched.step()
        step += 1
        seen += len(idx)
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        out_of_time = max_minutes > 0 and time.perf_counter() - start > 60 * max_minutes
        if step % eval_every == 0 or step == steps or out_of_time:
            val_err = error_rate(net, *splits["val"])
            elapsed = time.perf_counter() - start
            curve.append({"step": step, "seconds": round(elapsed, 2), "train_loss": round(running, 5), "val_error": val_err})
            if log:
                eta = elapsed / step * (steps - step)
                log(f"step {step:6d}/{steps}  {elapsed:7.1f}s  {step / elapsed:6.1f} steps/s  ETA {eta:6.0f}s  "
                    f"loss {running:.4f}  val error {100 * val_err:6.2f}%")
            if val_err < best[0]:
                best = (val_err, step, {k: v.detach().clone() for k, v in net.state_dict().items()})
            if val_err <= target_val_error or out_of_time:
                break
    train_seconds = time.perf_counter() - start
    if best[2] is not None:
        net.load_state_dict(best[2])
    return {
        "steps": step,
        "examples_seen": seen,
        "train_seconds": round(train_seconds, 2),
        "best_step": best[1],
        "val_error": best[0],
        "test_error": error_rate(net, *splits["test"]),
        "curve": curve,
    }


def run_ba_retrieval(cfg: BaRetrievalConfig, log=None) -> dict:
    """One run of the task as ``cfg`` sets it: the generated splits, the network, :func:`train_retrieval`; returns
    the report (settings, parameters, the training result and the test accuracy). ``log``: a line printer for
    the network's size and an example, then the training's progress."""
    sizes = cfg.split_sizes()
    splits = make_splits(cfg.data_seed, cfg.keys, sizes)
    torch.manual_seed(cfg.seed)
    fast = cfg.fast_rnn()
    net = RetrievalNet(cfg.model, cfg.hidden, digit_head=cfg.digit_head,
                       fast_rnn=fast if cfg.model == "fast-rnn" else None)
    parameters = sum(p.numel() for p in net.parameters())
    if log:
        log(f"{cfg.model} R={cfg.hidden} K={cfg.keys}: {parameters} parameters; "
            f"example {decode(splits['train'][0][0])} -> {VOCAB[int(splits['train'][1][0])]}")
    result = train_retrieval(net, splits, steps=cfg.steps, max_minutes=cfg.max_minutes, batch_size=cfg.batch_size,
                             lr=cfg.lr, decay_fraction=cfg.decay_fraction, grad_clip=cfg.grad_clip,
                             eval_every=cfg.eval_every, target_val_error=cfg.target_val_error, seed=cfg.seed, log=log)
    return {
        "task": "ba-retrieval", "model": cfg.model, "hidden": cfg.hidden, "keys": cfg.keys, "seed": cfg.seed,
        "data_seed": cfg.data_seed, "split_sizes": sizes, "parameters": parameters, "batch_size": cfg.batch_size,
        "lr": cfg.lr, "threads": torch.get_num_threads(),
        **({"fast_rnn": fast} if cfg.model == "fast-rnn" else {}),
        **result,
        "test_accuracy": 1.0 - result["test_error"],
    }
