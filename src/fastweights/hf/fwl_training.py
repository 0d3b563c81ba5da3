"""Training a Fast Weight Layer on a pretrained model: on a CPU from hidden states cached on disk
(:func:`train_head`), or online through the whole model (:func:`train_head_online`, a GPU's form), one recipe.

K. Clark et al., "Meta-Learning Fast Weight Language Models", EMNLP 2022 (arXiv 2212.02475), section 3: FWLs
added on top of the pretrained Transformer-XL and fine-tuned on consecutive chunks of text, "keeping a running
fast weight update Delta theta from the tokens in previous chunks and [not backpropagating] into this update".

The backbone's lower N - K blocks are frozen and run once (:mod:`fastweights.hf.fwl_cache`: the input h_in of
block N - K of every window of the training text, and the static model's loss of every window); the top K
blocks (``trainable_blocks``, default 0), their final norm and the head train. A step reads one window of each
of B parallel streams (``batch_size``); stream b is at window j of its document x^(b) and carries the head's
state S_b (the running update Delta_k and the segment's gradients, the last hidden state) from window j - 1:

    h_b      = top_blocks(h_in[x^(b)_j], K)                       (the window read by the backbone alone)
    logits_b, S_b' = head(h_b, x^(b)_j, S_b)                      (logits'_t = (h_t + f_{theta'_t}(h_t)) E + c)
    loss     = 1/B sum_b mean_t CE(logits_b[t], x^(b)_j[t+1])     (nats; second-order MAML through the inner
                                                                    gradients, :mod:`fastweights.layers.fwl`)
    S_b     <- stopgrad(S_b')                                     (carried, not backpropagated into)

and at the end of a document the stream starts another (drawn from a seeded permutation of the documents)
with a fresh state. The backbone sees each window alone (a fresh KV cache: the windows' hidden states are
cached independently); only the head's running update crosses windows. ``test_time_only`` heads train on
the slow logits (Table 2) and carry nothing. AdamW with two learning rates: ``step_lr`` for the step sizes
and segment decays (``head.step_sizes.*``, ``head.decay_logits.*``), ``lr`` for every other trained tensor.
Every step logs ``loss_nats``, the static model's loss on the same windows ``static_nats`` (from the cache)
and ``gain_nats = static_nats - loss_nats``.

Training text (``data``): any corpus spec :func:`fastweights.data.load_corpus` takes, each document giving up
to ``doc_windows`` consecutive windows; by default :data:`TRAINING_MIX`, English long documents of the
bundled corpora with every document the comparison scores or tunes on (:data:`HELD_OUT_NAMES`) left out
(by name here, by content in tests/hf/test_fwl_training_data.py). User data holding such a document is
trained on, with one warning.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from fastweights.core.errors import UserError
from fastweights.core.progress import Progress
from fastweights.hf.fwl_cache import CACHE_META, read_meta, backbone_digest, cache_hidden_states, load_cache

#: documents the comparison scores, tunes on or takes gradient statistics from (benchmarks/smollm2_*):
#: never in the default training text, in any edition (a document whose name contains one is left out)
HELD_OUT_NAMES = ("anna_karenina", "hamlet", "don_quijote", "crime_and_punishment", "macbeth", "war_and_peace")
#: the default training text: English long documents of the bundled corpora, taken round-robin across them
#: (State of the Union addresses, Shakespeare's plays but the held-out ones, the books of the World English
#: Bible); the bundled novels are all compared texts, so none is here
TRAINING_MIX = ("state-of-the-union", "shakespeare-train", "bible-en")


@dataclass(frozen=True)
class FWLHeadRecipe:
    """The default recipe of ``fastweights fwl-head train``, defined once: :func:`train_recipe` and
    :func:`train_head` take their defaults from :data:`RECIPE`, and so do the command's flags (``--windows``,
    ``--doc-windows``, ``--minutes`` = ``budget_cpu_s`` / 60, ``--streams`` = ``batch_size``, ``--lr``,
    ``--step-lr``, ``--block-lr``, ``--trainable-blocks``, ``--seed``, ``--variant``). The head's own options
    are ``fastweights.hf.fwl_head.PRETRAINED_FWL_DEFAULTS``.

    ``benchmarks/results/fwl_smollm2.json`` (``training.fwl``) records the run of these values that the
    comparison scored (a test holds the two together): 96 windows of 1,024 tokens (92 trained, 4 held out),
    documents of up to 8 consecutive windows, one stream, lr 3e-4, step_lr 1e-2, 1,200 CPU-seconds."""

    windows: int = 96  # windows of the training text cached in all (the last val_windows held out)
    window: int = 1024  # tokens per window
    doc_windows: int = 8  # consecutive windows a document gives at most (8 x 1,024 tokens carried in one stream)
    budget_cpu_s: float = 1200.0  # training budget in process CPU-seconds (the cache comes on top)
    batch_size: int = 1  # parallel streams (documents), one window of each per step
    # AdamW learning rate of the head's weights: at 1e-3 the slow head drifted toward the training mix (its slow part
    # 2.2% worse than static on the scored texts); of 1e-4, 3e-4 and 1e-3, 3e-4 has the lowest loss on the tuning
    # texts and the largest gain on the held-out windows (benchmarks/results/fwl_head_lr.json)
    lr: float = 3e-4
    # AdamW learning rate of trained backbone blocks (--trainable-blocks): pretrained weights take a far smaller one
    # than a fresh head (at 1e-3 two of SmolLM2's blocks lost 0.95 nats a window within 4 steps, a hand-run
    # measurement, not a stored result)
    block_lr: float = 1e-5
    step_lr: float = 1e-2  # AdamW learning rate of the step sizes and segment decays (head.step_sizes/decay_logits)
    trainable_blocks: int = 0  # top backbone blocks trained with the head (0: the backbone frozen)
    val_windows: int = 4  # the last cached windows, held out for the validation losses
    seed: int = 0  # document order (and the head's initialisation in train_recipe)
    variant: str = "fwl"  # one of VARIANTS
    save_every_s: float = 300.0  # checkpoint interval in CPU-seconds
    # the online form (train_head_online, a GPU): a linear warm-up of every rate over its first steps, then a
    # linear decay to this fraction of it by the end of the budget (the cached form trains at constant rates)
    warmup_steps: int = 20
    final_lr_fraction: float = 0.1


RECIPE = FWLHeadRecipe()


def held_out(name: str) -> bool:
    """Whether a document called ``name`` is one the comparison scores or tunes on (:data:`HELD_OUT_NAMES`)."""
    return any(n in name.lower() for n in HELD_OUT_NAMES)


def round_robin(iterators: list):
    """The items of each iterator in turn (the first item of each, then the second, ...), one that runs out
    dropping out: the default training text takes its corpora this way."""
    while iterators:
        alive = []
        for it in iterators:
            item = next(it, None)
            if item is not None:
                alive.append(it)
                yield item
        iterators = alive


class TrainingText(NamedTuple):
    """Windows of a training text: ``tokens [n, window]`` int64 in document order, ``sources`` (one
    ``"CORPUS:DOCUMENT#i"`` per window), ``doc_windows`` (consecutive windows per document, summing to n)."""

    tokens: np.ndarray
    sources: list
    doc_windows: list


def training_windows(tokenizer, window: int, data: str | None = None, max_windows: int | None = None,
                     doc_windows: int = RECIPE.doc_windows) -> TrainingText:
    """Runs of ``doc_windows`` consecutive windows of the documents of ``data`` (a corpus spec as
    :func:`fastweights.data.load_corpus` takes; None: :data:`TRAINING_MIX`, its corpora taken round-robin,
    held-out documents left out), up to ``max_windows`` in all: the first run of every document, then, while the
    windows are not filled, the second run of every document that has one, and so on (one long file gives as many
    runs as it holds, not one: issue 49). Each run is a document of the result (``doc_windows``: its windows);
    documents shorter than one window give none; ``max_windows`` None takes the first run of each. Documents are
    tokenized only as far as the windows need. User data holding a held-out document gives one warning (its
    results on that text would not be held out)."""
    from fastweights.data import load_corpus

    def docs_of(spec: str, leave_out: bool):
        for doc in load_corpus(spec):
            if leave_out and held_out(doc.name):
                continue
            yield spec, doc

    if data is None:
        docs = list(round_robin([docs_of(corpus, True) for corpus in TRAINING_MIX]))
    else:
        docs = list(docs_of(data, False))
        inside = sorted({n for _, d in docs for n in HELD_OUT_NAMES if n in d.name.lower()})
        if inside:
            warnings.warn(f"fwl-head train --data {data}: the training text holds documents the FWL comparison "
                          f"scores or tunes on ({', '.join(inside)}): results on them are not on held-out text",
                          stacklevel=2)
    rows, sources, counts = [], [], []
    live = list(range(len(docs)))  # documents that may hold another run
    encoded: dict[int, tuple[int, object]] = {}  # document -> (characters encoded, their ids), for its later runs
    run = 0
    while live and (max_windows is None and run == 0 or max_windows is not None and len(rows) < max_windows):
        more = []
        for d in live:
            if max_windows is not None and len(rows) >= max_windows:
                break
            spec, doc = docs[d]
            first = run * doc_windows  # this run's first window in the document
            want = doc_windows if max_windows is None else min(doc_windows, max_windows - len(rows))
            # enough characters (>= 1 a token): this run's in the first pass, every later run's from the second on
            chars = (first + (want if run == 0 else max_windows - len(rows)) + 1) * window * 8
            if d not in encoded or encoded[d][0] < min(chars, len(doc.text)):
                encoded[d] = (chars, tokenizer.encode(doc.text[:chars]))
            ids = encoded[d][1]
            got = min(want, len(ids) // window - first)
            for i in range(first, first + max(got, 0)):
                rows.append(np.asarray(ids[i * window:(i + 1) * window], dtype=np.int64))
                sources.append(f"{spec}:{doc.name}#{i}")
            if got > 0:
                counts.append(got)
            if got == doc_windows and len(ids) // window > first + got:
                more.append(d)
        live, run = more, run + 1
    if not rows:
        raise UserError(f"the training text ({data or 'the default mix'}) holds no document of {window} tokens or more")
    return TrainingText(np.stack(rows), sources, counts)


def stream_loss(head, h: torch.Tensor, tokens: torch.Tensor, state=None) -> tuple[torch.Tensor, object]:
    """``(loss, new state)``: the mean next-token cross-entropy (nats) of the head's logits over ``tokens [B, W]``
    (W - 1 predictions each) continuing ``state`` (None: fresh), and the head's state after the window."""
    logits, new_state = head(h, tokens, state)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()), new_state


def window_loss(head, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) of the head's logits over ``tokens [B, W]``, fresh state."""
    return stream_loss(head, h, tokens)[0]


def detached(state):
    """``state`` with every tensor cut from the graph (carried to the next window as a constant)."""
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, state)


def param_groups(model, lr: float, step_lr: float, block_lr: float = RECIPE.block_lr) -> list[dict]:
    """AdamW's groups: the head's weights at ``lr``, its step sizes and segment decays (``head.step_sizes.*``,
    ``head.decay_logits.*``) at ``step_lr``, trained backbone blocks at ``block_lr``; named ``head``, ``fast``
    and ``blocks``."""
    head, step, blocks = [], [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            if name.startswith(("head.step_sizes.", "head.decay_logits.")):
                step.append(p)
            else:
                (head if name.startswith("head.") else blocks).append(p)
    return [{"params": head, "lr": lr, "name": "head"}, {"params": step, "lr": step_lr, "name": "fast"},
            {"params": blocks, "lr": block_lr, "name": "blocks"}]


def head_optimizer(model, lr: float, step_lr: float, block_lr: float) -> torch.optim.AdamW:
    """The AdamW of both trainers (the cached and the online form): :func:`param_groups`, each group's rate also
    kept as ``base_lr`` for a schedule to scale, and no weight decay (the recipe's: the head starts as the
    identity's neighbour and the step sizes are scalars; decay would pull both toward zero)."""
    groups = [{**g, "base_lr": g["lr"]} for g in param_groups(model, lr, step_lr, block_lr)]
    return torch.optim.AdamW(groups, weight_decay=0.0)


def optimizer_step(loss: torch.Tensor, optimizer, params: list, step: int) -> None:
    """One AdamW step of either form on ``loss``: refused when it is not finite, gradients clipped to norm 1."""
    if not torch.isfinite(loss):
        raise UserError(f"fwl head training diverged at step {step} (loss {loss.item()}); lower the learning rate")
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()


def documents(doc_windows: list, upto: int) -> list[tuple[int, int]]:
    """``(first window, end)`` of each document's windows below window ``upto`` (the training windows)."""
    out, start = [], 0
    for count in doc_windows:
        end = min(start + count, upto)
        if end > start:
            out.append((start, end))
        start += count
    return out


def train_head(model, cache_dir: str | Path, out_dir: str | Path, backbone_name: str, *, budget_cpu_s: float,
               batch_size: int = RECIPE.batch_size, lr: float = RECIPE.lr, step_lr: float = RECIPE.step_lr,
               block_lr: float = RECIPE.block_lr, val_windows: int = RECIPE.val_windows, seed: int = RECIPE.seed,
               save_every_s: float = RECIPE.save_every_s, resume: bool = True, progress: bool = True,
               max_steps: int | None = None) -> dict:
    """Train ``model.head`` (an :class:`~fastweights.hf.fwl_head.HFCausalLMWithFWL`'s) and its trainable
    backbone blocks (``model.trainable_blocks``, which must be the cache's) on the cache in ``cache_dir``, as
    ``batch_size`` streams of consecutive windows with the head's state carried (module docstring), for
    ``budget_cpu_s`` seconds of process CPU time (``max_steps`` stops earlier). Checkpoints to ``out_dir``
    (library format, atomic) every ``save_every_s`` and at the end, and resumes from it bit-exactly: the
    trained tensors and the head's buffers, AdamW, the document order (the generator and the rest of the
    current permutation), each stream's document, window and carried head state, the CPU seconds spent, the
    history. SIGINT/SIGTERM finish the step, save, and raise :class:`~fastweights.loops.train.RunInterrupted`
    saying how to continue. The last ``val_windows`` cached windows are held out (read as streams too). Returns
    the training summary; ``history``: one ``{step, cpu_s, loss_nats, static_nats, gain_nats, windows}`` per
    step."""
    import dataclasses
    import signal

    from fastweights.hf.fwl_head import load_fwl_head, save_fwl_head, top_blocks
    from fastweights.loops.signals import StopSignals
    from fastweights.loops.train import RunInterrupted

    hidden, tokens, meta = load_cache(cache_dir)
    k = model.trainable_blocks
    if meta["trainable_blocks"] != k:
        raise UserError(f"hidden-state cache {cache_dir} holds the input of the top {meta['trainable_blocks']} "
                        f"blocks, the model trains {k}: cache it for {k} trainable blocks")
    n_train = meta["windows"] - val_windows
    docs = documents(meta["doc_windows"], n_train)
    if not docs:  # no training window (n_train < 1), or no document among them
        raise UserError(f"the cache holds {meta['windows']} windows: none left for training after {val_windows} "
                        "held out")
    static = meta["static_nats"]
    head, backbone = model.head, model.backbone
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = head_optimizer(model, lr, step_lr, block_lr)
    step, used_cpu, gen, history = 0, 0.0, torch.Generator().manual_seed(seed), []
    order = torch.empty(0, dtype=torch.long)  # the rest of the current permutation of the training documents
    streams: list[dict | None] = [None] * batch_size  # {"next": window, "end": its document's end, "state"}
    out_dir = Path(out_dir)
    if resume and (out_dir / "checkpoint.json").is_file():
        loaded, _, ts = load_fwl_head(out_dir, backbone_loader=lambda _name: (backbone, None), with_trainer_state=True)
        if dataclasses.asdict(loaded.head.options) != dataclasses.asdict(head.options) or loaded.trainable_blocks != k:
            raise UserError(f"--out {out_dir} holds a head with other options or trainable blocks (another --variant "
                            "or --trainable-blocks?); choose another --out, or the settings it was trained with")
        model.load_state_dict(loaded.state_dict(), strict=False)
        if ts is not None:
            optimizer.load_state_dict(ts["optimizer"])
            step, used_cpu, history = ts["step"], float(ts["cpu_s"]), list(ts["history"])
            gen.set_state(ts["rng"])
            order, streams = ts["order"], list(ts["streams"])  # int64, as saved (safetensors keeps the dtype)
            fits = len(streams) == batch_size and all(
                s is None or 0 <= s["next"] <= s["end"] <= n_train for s in streams) and (
                not order.numel() or (order.min() >= 0 and order.max() < len(docs)))
            if not fits:
                raise UserError(f"--out {out_dir}: its streams and document order do not fit this cache of {n_train} "
                                f"training windows and batch size {batch_size} (another --windows, --data or "
                                "--batch-size?); choose another --out")

    def save():
        ts = {"step": step, "optimizer": optimizer.state_dict(), "cpu_s": used_cpu, "rng": gen.get_state(),
              "order": order.clone(), "streams": streams, "history": history}
        save_fwl_head(model, out_dir, backbone_name, step=step, trainer_state=ts)

    model.train()
    if progress and budget_cpu_s - used_cpu > 0:  # CPU-minutes on a busy machine take longer: say so at the start
        from fastweights.core.threads import busy_machine_warning

        warning = busy_machine_warning(torch.get_num_threads(), budget_cpu_s - used_cpu)
        if warning:
            print(warning, file=sys.stderr)
    bar = Progress(budget_cpu_s, "CPU-sec", desc="train fwl head", enabled=progress, time_limit=budget_cpu_s - used_cpu,
                   clock=time.process_time, initial=used_cpu)  # a resumed run's CPU seconds: not in the rate
    # the budget clock continues from the CPU seconds a resumed run had spent
    start, last_save = time.process_time() - used_cpu, time.process_time()
    stop = StopSignals()  # SIGINT/SIGTERM: finish the step, save, say how to continue
    try:
        while used_cpu < budget_cpu_s and (max_steps is None or step < max_steps) and stop.signum is None:
            for b, s in enumerate(streams):
                if s is None or s["next"] == s["end"]:  # a document ends: another, with a fresh state
                    if not order.numel():
                        order = torch.randperm(len(docs), generator=gen)
                    first, end = docs[int(order[0])]
                    order = order[1:]
                    streams[b] = {"next": first, "end": end, "state": None}
            idx = [s["next"] for s in streams]
            h_in = torch.from_numpy(np.asarray(hidden[idx], dtype=np.float32)).to(head.ln_weight.dtype)
            x = torch.from_numpy(tokens[idx])
            h = top_blocks(backbone, h_in, k)
            losses = []
            for b, s in enumerate(streams):
                loss_b, new_state = stream_loss(head, h[b:b + 1], x[b:b + 1], s["state"])
                losses.append(loss_b)
                s["state"] = detached(new_state)
            loss = torch.stack(losses).mean()
            optimizer_step(loss, optimizer, params, step)
            for s in streams:
                s["next"] += 1
            step += 1
            now = time.process_time()
            ref = float(np.mean([static[i] for i in idx]))
            history.append({"step": step, "cpu_s": now - start, "loss_nats": loss.item(),
                            "static_nats": ref, "gain_nats": ref - loss.item(), "windows": idx})
            bar.update(now - start - used_cpu, gain_nats=ref - loss.item())
            used_cpu = now - start
            if now - last_save >= save_every_s:
                save()
                last_save = now
        bar.close()
        save()
    finally:
        stop.restore()
    if stop.signum is not None:
        name = signal.Signals(stop.signum).name
        raise RunInterrupted(f"interrupted by {name}: {out_dir} holds the checkpoint of step {step}; continue with "
                             "the same `fastweights fwl-head train` command (it resumes from there)", 128 + stop.signum)
    model.eval()
    val = validation_losses(model, hidden, tokens, meta, n_train) if val_windows else None
    return {"steps": step, "cpu_s": used_cpu, "batch_size": batch_size, "lr": lr, "step_lr": step_lr,
            "block_lr": block_lr, "window": meta["window"], "trainable_blocks": k, "train_windows": n_train,
            "train_documents": len(docs), "tokens_seen": step * batch_size * meta["window"], "history": history,
            "validation": val}


@torch.no_grad()
def validation_losses(model, hidden, tokens, meta: dict, first: int) -> dict:
    """Mean loss (nats per token) of the cached windows from ``first`` on, read as streams (the head's state
    carried through each document, fresh at its start): the head's, the static model's (``static_nats`` of the
    cache) and the gain ``static - head``. A ``test_time_only`` head is judged on what it trains, its slow
    logits (``update: "off"``): its update's step size is chosen later on tuning text, and the default one can
    diverge on trained blocks (fwl_top_blocks.json)."""
    from fastweights.hf.fwl_head import top_blocks

    slow = model.head.options.test_time_only
    was_training = model.head.training
    model.head.train(slow)  # in training mode a test-time-only head gives its slow logits
    losses, state = [], None
    starts = set(np.cumsum([0] + meta["doc_windows"]).tolist())
    try:
        for i in range(first, meta["windows"]):
            if i in starts or i == first:
                state = None
            h_in = torch.from_numpy(np.asarray(hidden[i : i + 1], dtype=np.float32)).to(model.head.ln_weight.dtype)
            h = top_blocks(model.backbone, h_in, model.trainable_blocks)
            loss, state = stream_loss(model.head, h, torch.from_numpy(tokens[i : i + 1]), state)
            losses.append(loss.item())
    finally:
        model.head.train(was_training)
    fwl, ref = float(np.mean(losses)), float(np.mean(meta["static_nats"][first:]))
    return {"loss_nats": fwl, "static_nats": ref, "gain_nats": ref - fwl, "windows": len(losses),
            "update": "off" if slow else "on"}


#: the head options of each variant of the comparison (the paper's Table 2 rows)
VARIANTS = {
    "fwl": {},
    "test-time-only": {"test_time_only": True},
    "bias-only": {"bias_only": True},
}


def train_recipe(hf: str, out_dir: str | Path, *, variant: str = RECIPE.variant,
                 budget_cpu_s: float = RECIPE.budget_cpu_s, windows: int = RECIPE.windows, window: int = RECIPE.window,
                 doc_windows: int = RECIPE.doc_windows, data: str | None = None, cache_dir: str | Path | None = None,
                 lr: float = RECIPE.lr, step_lr: float = RECIPE.step_lr, block_lr: float = RECIPE.block_lr,
                 batch_size: int = RECIPE.batch_size, trainable_blocks: int = RECIPE.trainable_blocks, seed: int = RECIPE.seed, progress: bool = True,
                 max_steps: int | None = None) -> dict:
    """The recipe (:class:`FWLHeadRecipe`), end to end: load ``hf`` (e.g. ``"smollm2-135m"``), wrap it with an FWL
    head of the given variant and ``trainable_blocks`` trained backbone blocks, cache ``windows`` windows of the
    training text (``data``, default :data:`TRAINING_MIX`; :func:`training_windows`) in ``cache_dir`` (default
    ``out_dir/../hidden-cache``, shared between variants; reused when its key matches), train for
    ``budget_cpu_s`` CPU seconds (:func:`train_head`, resuming a checkpoint in ``out_dir``; ``max_steps`` stops
    earlier) and write ``out_dir/training.json``. Returns its summary (``cache_windows_computed``: windows the
    backbone ran on in this call, 0 when the cache was reused). SIGTERM while the cache is built stops as Ctrl-C
    does (the cache keeps the windows done, and the same call continues it)."""
    import dataclasses
    import signal

    from fastweights.checkpoints.run_dir import RunLock
    from fastweights.core.files import atomic_write
    from fastweights.hf.fwl_head import PRETRAINED_FWL_DEFAULTS, HFCausalLMWithFWL, llama_base
    from fastweights.hf.transformers_as_ours import HFCausalLM, load_hf_model
    from fastweights.layers.fwl import FWLOptions
    from fastweights.loops.signals import SetupSignals
    from fastweights.loops.train import RunInterrupted

    if variant not in VARIANTS:
        raise UserError(f"unknown FWL variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    out_dir = Path(out_dir)
    if cache_dir is None:  # the default, which the user did not name: a link planted there is refused (issue 52)
        from fastweights.core.files import refuse_links

        cache_dir = refuse_links(out_dir.parent, out_dir.parent / "hidden-cache", "the shared hidden-state cache")
    cache_dir = Path(cache_dir)
    torch.manual_seed(seed)
    backbone, tokenizer = load_hf_model(hf)
    if not isinstance(backbone, HFCausalLM):
        what = ("already has an FWL head (a `fwl-head export` directory)" if hasattr(backbone, "head")
                and hasattr(backbone, "backbone") else "is a fastweights model (an `export-hf` directory), not a "
                "pretrained transformers model: train an FWL head on it with `fastweights train --set model.head=fwl`")
        raise UserError(f"fwl-head train --hf {hf}: {what}; the FWL head goes on a transformers causal LM "
                        "(a model directory, a .gguf file or smollm2-135m)")
    if window > backbone.max_positions:
        raise UserError(f"{hf} reads at most {backbone.max_positions} positions: windows of {window} tokens do not fit")
    if window < 2:  # one token predicts nothing: such a cache was written and then refused by every later run
        raise UserError(f"--window {window}: a window needs at least 2 tokens (it predicts window - 1 of them)")
    options = FWLOptions(**{**PRETRAINED_FWL_DEFAULTS, **VARIANTS[variant]})
    model = HFCausalLMWithFWL(backbone, options, trainable_blocks=trainable_blocks)
    if trainable_blocks:
        llama_base(backbone, trainable_blocks)  # other architectures: one line, before anything is cached
    text = training_windows(tokenizer, window, data, max_windows=windows, doc_windows=doc_windows)
    if progress:  # what it trains on, before the minutes of caching (issue 49: one file silently gave 4 windows)
        n_docs = len({s.rsplit("#", 1)[0] for s in text.sources})
        print(f"training text: {len(text.tokens)} windows of {window} tokens ({len(text.tokens) * window:,} tokens, the "
              f"last {RECIPE.val_windows} held out) in {len(text.doc_windows)} streams of at most {doc_windows} windows "
              f"from {n_docs} document(s) of {data or 'the default mix'}", file=sys.stderr)
    t0 = time.process_time()
    setup_signals = SetupSignals()  # SIGTERM while caching: stop as Ctrl-C does (the cache resumes)
    try:
        with RunLock(cache_dir):  # the variants share it: one builds it at a time
            meta = cache_hidden_states(backbone, text.tokens, cache_dir, text.sources, backbone_digest(backbone),
                                       progress, doc_windows=text.doc_windows,
                                       data=data or "mix:" + "+".join(TRAINING_MIX), trainable_blocks=trainable_blocks)
    except KeyboardInterrupt as e:
        code = getattr(e, "exit_code", 130)
        done = read_meta(cache_dir)["done"] if (cache_dir / CACHE_META).is_file() else 0
        raise RunInterrupted(f"interrupted by {signal.Signals(code - 128).name} while caching hidden states: "
                             f"{cache_dir} holds {done} of {len(text.tokens)} windows and nothing was trained; the same "
                             "`fastweights fwl-head train` command continues", code) from None
    finally:
        setup_signals.restore()
    cache_cpu = time.process_time() - t0
    # one run per --out (issue 52: two runs on one --out both exited 0, one result lost), taken once the cache is
    # ready, so a refused cache leaves --out as it was
    with RunLock(out_dir):
        summary = train_head(model, cache_dir, out_dir, hf, budget_cpu_s=budget_cpu_s, batch_size=batch_size, lr=lr,
                             step_lr=step_lr, block_lr=block_lr, seed=seed, progress=progress, max_steps=max_steps)
        summary.update({"hf": hf, "variant": variant, "options": dataclasses.asdict(options),
                        "cache_dir": str(cache_dir), "data": meta["data"], "cache_windows": meta["windows"],
                        "doc_windows": doc_windows, "cache_windows_computed": meta["computed_this_call"],
                        "cache_cpu_s_this_call": cache_cpu,
                        "training_sources": sorted({s.split(":")[0] for s in meta["sources"]}),
                        "torch_threads": torch.get_num_threads()})
        atomic_write(out_dir / "training.json", lambda p: p.write_text(json.dumps(summary, indent=1)), root=out_dir,
                     what="the training summary")
    return summary


# ----------------------------------------------------------------------------- the online form (no cache)


def stream_windows(model, tokens: torch.Tensor, window: int, amp=contextlib.nullcontext):
    """Yields ``(j, ModelOutput)`` for consecutive windows j of ``tokens [B, T + 1]`` read by the whole model
    (``HFCausalLMWithFWL``): inputs ``tokens[:, a:b]``, targets ``tokens[:, a + 1:b + 1]``, ``b - a <= window``;
    the state (the head's running update and the KV cache) is carried, detached, from each window to the next
    (the caller may step the optimizer in between). ``amp``: a context factory each window runs under."""
    state, last = None, tokens.shape[1] - 1
    for j, a in enumerate(range(0, last, window)):
        b = min(a + window, last)
        with amp():
            out = model(tokens[:, a:b], state, tokens[:, a + 1:b + 1])
        yield j, out
        state = detached(out.state)


def online_lr_scale(step: int, elapsed: float, budget_s: float, max_steps: int, warmup_steps: int,
                    final_lr_fraction: float) -> float:
    """The factor on every rate at step ``step`` (0-based) of :func:`train_head_online`: a linear warm-up over
    ``warmup_steps``, then a linear decay to ``final_lr_fraction`` over whichever limit ends the run first, the
    ``budget_s`` seconds (``elapsed`` of them spent) or the ``max_steps`` steps (0: none), so that a run its
    steps end (a dry run with an unbounded budget) decays as one its clock ends does."""
    progress = elapsed / budget_s
    if max_steps:
        progress = max(progress, step / max_steps)
    return min(1.0, (step + 1) / warmup_steps) * (1.0 - (1.0 - final_lr_fraction) * min(1.0, progress))


def train_head_online(model, streams, *, batch: int, window: int, windows_per_stream: int, budget_s: float,
                      clock=time.perf_counter, amp=contextlib.nullcontext, lr: float = RECIPE.lr,
                      step_lr: float = RECIPE.step_lr, block_lr: float = RECIPE.block_lr,
                      warmup_steps: int = RECIPE.warmup_steps, final_lr_fraction: float = RECIPE.final_lr_fraction,
                      max_steps: int = 0, log=None) -> dict:
    """The FWL head (and its trainable blocks) trained on the whole model, no cache: where the backbone runs fast
    (a GPU) and its top blocks train with the head, as the paper trains. ``streams`` yields ``(ids [T + 1],
    source)`` with T = ``window * windows_per_stream``; each step takes ``batch`` of them and reads their windows
    in order (:func:`stream_windows`), one AdamW step per window with the state carried, detached, across the
    windows of a stream, the rates of :func:`param_groups` warmed up and decayed (the recipe's
    ``warmup_steps``, ``final_lr_fraction``) over ``budget_s`` seconds of ``clock`` or ``max_steps`` steps
    (:func:`online_lr_scale`). Returns the history (each step's rate factor in it), the loss by window over the
    second half, and what was trained on."""
    from collections import Counter

    optimizer = head_optimizer(model, lr, step_lr, block_lr)
    groups = [g for g in optimizer.param_groups if g["params"]]
    params = [p for g in groups for p in g["params"]]
    history, sources, step, tokens_seen = [], Counter(), 0, 0
    model.train()
    start = last_log = clock()

    def out_of_time() -> bool:
        return bool(max_steps and step >= max_steps) or clock() - start >= budget_s

    while not out_of_time():
        taken = [next(streams) for _ in range(batch)]
        sources.update(s for _, s in taken)
        device = next(model.parameters()).device
        tokens = torch.stack([ids for ids, _ in taken]).to(device)
        for j, out in stream_windows(model, tokens, window, amp):
            scale = online_lr_scale(step, clock() - start, budget_s, max_steps, warmup_steps, final_lr_fraction)
            for g in optimizer.param_groups:
                g["lr"] = g["base_lr"] * scale
            loss = out.loss
            optimizer_step(loss, optimizer, params, step)
            step += 1
            tokens_seen += out.logits.shape[0] * out.logits.shape[1]
            now = clock()
            history.append([step, now - start, j, loss.item(), scale])
            if log is not None and (now - last_log >= 15 or step == 1):
                log(f"train: step {step}, window {j + 1}/{windows_per_stream}, loss {loss.item():.4f} nats, "
                    f"{tokens_seen / max(now - start, 1e-9):,.0f} tok/s, {now - start:.0f}/{budget_s:.0f} s")
                last_log = now
            if out_of_time():
                break
    seconds = clock() - start
    model.eval()
    half = history[len(history) // 2:]  # the loss by window index over the second half of training
    by_window = {j: [h[3] for h in half if h[2] == j] for j in range(windows_per_stream)}
    head = model.head
    return {"steps": step, "seconds": seconds, "tokens": tokens_seen, "tokens_per_s": tokens_seen / max(seconds, 1e-9),
            "history": history, "history_columns": ["step", "seconds", "window_index", "loss_nats", "lr_scale"],
            "loss_by_window_second_half": {j: sum(v) / len(v) for j, v in by_window.items() if v},
            "streams": sum(sources.values()), "documents": sorted(set(sources)),
            "corpora": dict(Counter(s.split(":")[0] for s in sources.elements())),
            "rates": {g["name"]: g["base_lr"] for g in groups},
            "schedule": {"warmup_steps": warmup_steps, "final_lr_fraction": final_lr_fraction},
            "learned_step_sizes": {n: float(a.detach()) for n, a in head.current_step_sizes().items()},
            "learned_decays": {n: float(g.detach()) for n, g in head.decays().items()}}
