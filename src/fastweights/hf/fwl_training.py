"""Training a Fast Weight Layer on a frozen pretrained model, on a CPU: hidden states cached once on disk.

The FWL paper fine-tunes the whole Transformer-XL with the head (section 3). On a CPU the backbone's
forward pass is the cost that matters (SmolLM2-135M: about 500 tokens/s on one thread), so the default
recipe freezes it: the final hidden states of the training text are computed once, stored memory-mapped
(float16, ``[windows, window, d_model]``), and the head trains for as many passes as the budget allows at
the cost of the head alone (dominated by its passes through the 49,152-way unembedding).

Training objective (second-order MAML with one inner step, the paper's): the mean cross-entropy of the
*fast* logits ``logits'_t = (h_t + f_{theta'_t}(h_t)) E + c`` over each cached window, differentiated
through the inner gradients (:mod:`fastweights.layers.fwl`). ``test_time_only`` heads train on the slow
logits instead (Table 2). Training text: bundled public-domain corpora that share no document with the
texts the comparison scores or tunes on (:data:`HELD_OUT_NAMES`, checked by a test).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fastweights.core.errors import UserError
from fastweights.core.progress import Progress

#: documents the comparison scores, tunes on or takes gradient statistics from (benchmarks/smollm2_*):
#: never training text, in any edition (a name containing one of these is skipped)
HELD_OUT_NAMES = ("anna_karenina", "hamlet", "don_quijote", "crime_and_punishment", "macbeth", "war_and_peace")
#: the default training mix: (corpus, windows per document): Shakespeare's plays but the held-out ones,
#: State of the Union addresses (modern prose), the Spanish Bible (Spanish, for the Spanish text)
TRAINING_MIX = (("shakespeare-train", 1), ("state-of-the-union", 1), ("bible-es", 1))
CACHE_META = "cache.json"


@dataclass(frozen=True)
class FWLHeadRecipe:
    """The default recipe of ``fastweights fwl-head train``, defined once: :func:`train_recipe` and
    :func:`train_head` take their defaults from :data:`RECIPE`, and so do the command's flags (``--windows``,
    ``--minutes`` = ``budget_cpu_s`` / 60, ``--lr``, ``--seed``, ``--variant``). The head's own options
    (residual, zero step sizes, 64-token segments) are ``fastweights.hf.fwl_head.PRETRAINED_FWL_DEFAULTS``.

    The values are the ones the recorded result was made with: ``benchmarks/results/fwl_smollm2.json``
    (``training.fwl``, the FWL row) records ``cache_windows`` 96 (``train_windows`` 92 plus ``val_windows`` 4
    held out), ``window`` 1024, ``batch_size`` 1, ``lr`` 0.001 and ``cpu_s`` 1204 for a budget of 1,200
    CPU-seconds (``--minutes 20``; the test-time-only and bias-only rows were trained with ``--minutes 5``).
    The former defaults of ``train_recipe`` (128 windows, 1,800 s) and ``train_head`` (batch 2) made no
    recorded result."""

    windows: int = 96  # windows of the training mix cached (the last val_windows held out)
    window: int = 1024  # tokens per window
    budget_cpu_s: float = 1200.0  # training budget in process CPU-seconds (the cache comes on top)
    batch_size: int = 1  # windows per step
    lr: float = 1e-3  # AdamW learning rate of every tensor of the head
    val_windows: int = 4  # the last cached windows, held out for the validation losses
    seed: int = 0  # window order (and the head's initialisation in train_recipe)
    variant: str = "fwl"  # one of VARIANTS
    save_every_s: float = 300.0  # checkpoint interval in CPU-seconds


RECIPE = FWLHeadRecipe()


def training_windows(tokenizer, window: int, mix=TRAINING_MIX, max_windows: int | None = None) -> tuple[np.ndarray, list]:
    """``(tokens [n, window] int64, sources)``: the first windows of each document of the mix, interleaved
    across corpora (so a smaller ``max_windows`` keeps the mix). Held-out documents are skipped. Documents are
    tokenized only as far as ``max_windows`` needs."""
    from fastweights.data import load_corpus

    def rows_of(corpus: str, per_doc: int):
        for doc in load_corpus(corpus):
            if any(name in doc.name.lower() for name in HELD_OUT_NAMES):
                continue
            text = doc.text[: per_doc * window * 8]  # enough characters for per_doc windows (>= 1 char a token)
            ids = tokenizer.encode(text)
            for i in range(min(per_doc, len(ids) // window)):
                yield ids[i * window:(i + 1) * window], f"{corpus}:{doc.name}#{i}"

    # round-robin over the corpora (row i of each in turn), a corpus that runs out dropping out
    streams = [rows_of(corpus, per_doc) for corpus, per_doc in mix]
    out = []
    while streams and (max_windows is None or len(out) < max_windows):
        alive = []
        for rows in streams:
            row = next(rows, None)
            if row is None:
                continue
            alive.append(rows)
            out.append(row)
        streams = alive
    if max_windows is not None:
        out = out[:max_windows]
    if not out:
        raise UserError("the training mix holds no window of the requested length")
    return np.stack([np.asarray(r[0], dtype=np.int64) for r in out]), [r[1] for r in out]


@torch.no_grad()
def cache_hidden_states(backbone, tokens: np.ndarray, directory: str | Path, sources: list | None = None,
                        fingerprint: str = "", progress: bool = True, dtype: str = "float16") -> dict:
    """Run the frozen backbone over each window (independently, no carried context) and store its final
    hidden states, memory-mapped in ``directory`` (``hidden.npy``, ``tokens.npy``; ``dtype`` float16 halves
    the disk, float32 keeps them exact). The cache is keyed by everything that changes its contents: the
    tokens (SHA-256), the backbone (``fingerprint``: :func:`backbone_digest`, every weight) and the dtype; a
    cache made for another key is rebuilt, a partial one of the same key resumed, and what is reused is
    checked first (:func:`open_hidden`). Files are written refusing a symbolic link below ``directory``.
    Returns the cache's metadata."""
    from fastweights.core.files import atomic_write, make_dirs, refuse_links

    directory = Path(directory)
    make_dirs(directory, directory, "the hidden-state cache")
    if dtype not in ("float16", "float32"):
        raise UserError(f"hidden-state cache dtype must be float16 or float32, got {dtype!r}")
    n, window = tokens.shape
    width = backbone.hf.get_output_embeddings().weight.shape[1]
    meta_path = directory / CACHE_META
    digest = _digest(tokens)
    key = {"tokens_sha": digest, "backbone": fingerprint, "dtype": dtype}
    meta = _read_meta(directory) if meta_path.is_file() else None
    if meta is not None and any(meta.get(k) != v for k, v in key.items()):
        meta = None  # made for other tokens, another backbone or another dtype: rebuilt

    def write_meta(m: dict) -> None:
        atomic_write(meta_path, lambda p: p.write_text(json.dumps(m)), root=directory, what="the cache's metadata")

    if meta is None:
        meta = {**key, "windows": n, "window": window, "d_model": width, "done": 0, "sources": sources}
        if meta_path.is_file():
            meta_path.unlink()  # no metadata claims the files while they are rebuilt

        def save_tokens(p: Path) -> None:
            with open(p, "wb") as f:
                np.save(f, tokens)

        atomic_write(directory / "tokens.npy", save_tokens, root=directory, what="the cached tokens")
        hidden_path = refuse_links(directory, directory / "hidden.npy", "the cached hidden states")
        if hidden_path.exists():
            hidden_path.unlink()
        np.lib.format.open_memmap(hidden_path, mode="w+", dtype=np.dtype(dtype), shape=(n, window, width))
        write_meta(meta)
    hidden = open_hidden(directory, meta, mode="r+", check_finite_upto=meta["done"])
    bar = Progress(n * window, "tok", desc="cache hidden states", enabled=progress)
    bar.update(meta["done"] * window)
    was_training = backbone.training
    backbone.eval()
    cast = getattr(torch, dtype)
    for i in range(meta["done"], n):
        h, _ = backbone.forward_features(torch.from_numpy(tokens[i : i + 1]))
        h = h[0].to(cast)
        if not torch.isfinite(h).all():
            raise UserError(f"the backbone's hidden states of window {i} are not finite in {dtype}"
                            + (" (they exceed float16's range)" if dtype == "float16" else "")
                            + f"; nothing past window {meta['done']} was cached in {directory}")
        hidden[i] = h.numpy()
        if (i + 1) % 8 == 0 or i + 1 == n:  # the memmap first, then the count that says it is there
            hidden.flush()
            meta["done"] = i + 1
            write_meta(meta)
        bar.update(window)
    bar.close()
    backbone.train(was_training)
    return meta


_META_KEYS = {"tokens_sha": str, "backbone": str, "dtype": str, "windows": int, "window": int, "d_model": int,
              "done": int}


def _read_meta(directory: Path) -> dict:
    """The cache's metadata, checked (one-line UserError when it is unreadable)."""
    path = directory / CACHE_META
    try:
        meta = json.loads(path.read_text())
        if not isinstance(meta, dict):
            raise ValueError("not an object")
        for k, kind in _META_KEYS.items():
            if not isinstance(meta.get(k), kind) or isinstance(meta.get(k), bool):
                raise ValueError(f"{k} missing or not {kind.__name__}")
        if meta["dtype"] not in ("float16", "float32") or not 0 <= meta["done"] <= meta["windows"]:
            raise ValueError("dtype or done out of range")
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise UserError(f"hidden-state cache {directory}: {CACHE_META} is unreadable ({e}); delete {directory} "
                        "to rebuild it") from None
    return meta


def open_hidden(directory: Path, meta: dict, mode: str = "r", check_finite_upto: int = 0) -> np.ndarray:
    """``hidden.npy`` of a cache, memory-mapped, checked against its metadata: a plain float16/float32 array of
    shape [windows, window, d_model] (an object array, another dtype or shape, a truncated file: one line), its
    first ``check_finite_upto`` windows finite (NaN or inf there: one line naming the window)."""
    path = directory / "hidden.npy"
    shape = (meta["windows"], meta["window"], meta["d_model"])
    why = None
    try:
        hidden = np.load(path, mmap_mode=mode, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        hidden, why = None, str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if hidden is not None and (hidden.dtype != np.dtype(meta["dtype"]) or hidden.shape != shape):
        why = f"it holds {hidden.dtype} {tuple(hidden.shape)}, the metadata says {meta['dtype']} {shape}"
    if why is not None:
        raise UserError(f"hidden-state cache {directory}: hidden.npy is not the cache its {CACHE_META} describes "
                        f"({why}); delete {directory} to rebuild it")
    for i in range(check_finite_upto):
        if not np.isfinite(hidden[i]).all():
            raise UserError(f"hidden-state cache {directory}: window {i} of hidden.npy holds NaN or infinite values "
                            f"(the file is corrupt); delete {directory} to rebuild it")
    return hidden


def load_cache(directory: str | Path) -> tuple[np.ndarray, np.ndarray, dict]:
    """``(hidden [windows, window, d_model] memory-mapped, tokens [windows, window], metadata)`` of a complete
    cache, every file checked against the metadata (the tokens' SHA-256, the hidden states' dtype, shape and
    finiteness): one line naming what is wrong otherwise."""
    directory = Path(directory)
    if not (directory / CACHE_META).is_file():
        raise UserError(f"hidden-state cache {directory} holds no {CACHE_META}: not a cache")
    meta = _read_meta(directory)
    if meta["done"] < meta["windows"]:
        raise UserError(f"hidden-state cache {directory} is incomplete ({meta['done']} of {meta['windows']} windows)")
    try:
        tokens = np.load(directory / "tokens.npy", allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise UserError(f"hidden-state cache {directory}: tokens.npy is unreadable ({str(e).splitlines()[0]}); "
                        f"delete {directory} to rebuild it") from None
    if tokens.dtype != np.int64 or tokens.shape != (meta["windows"], meta["window"]) or _digest(tokens) != meta["tokens_sha"]:
        raise UserError(f"hidden-state cache {directory}: tokens.npy is not the tokens its {CACHE_META} was made for; "
                        f"delete {directory} to rebuild it")
    return open_hidden(directory, meta, check_finite_upto=meta["windows"]), tokens, meta


def window_loss(head, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) of the head's logits over ``tokens [B, W]`` (W - 1 predictions each)."""
    logits, _ = head(h, tokens)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def train_head(model, cache_dir: str | Path, out_dir: str | Path, backbone_name: str, *, budget_cpu_s: float,
               batch_size: int = RECIPE.batch_size, lr: float = RECIPE.lr, val_windows: int = RECIPE.val_windows,
               seed: int = RECIPE.seed, save_every_s: float = RECIPE.save_every_s, resume: bool = True,
               progress: bool = True, max_steps: int | None = None) -> dict:
    """Train ``model.head`` (an :class:`~fastweights.hf.fwl_head.HFCausalLMWithFWL`'s) on cached hidden states
    for ``budget_cpu_s`` seconds of process CPU time; checkpoints to ``out_dir`` (library format, atomic) every
    ``save_every_s`` and at the end, and resumes from it bit-exactly (the head and its buffers, AdamW, the
    window order: the generator and the rest of the current permutation, the CPU seconds spent, the history;
    ``max_steps`` stops earlier). SIGINT/SIGTERM finish the step, save, and raise
    :class:`~fastweights.loops.train.RunInterrupted` saying how to continue. The last ``val_windows`` cached
    windows are held out: their loss with the head and with the pretrained logits alone is reported. Returns the
    training summary."""
    import dataclasses
    import signal

    from fastweights.hf.fwl_head import load_fwl_head, save_fwl_head
    from fastweights.loops.signals import StopSignals
    from fastweights.loops.train import RunInterrupted

    hidden, tokens, meta = load_cache(cache_dir)
    n_train = meta["windows"] - val_windows
    if n_train < batch_size:
        raise UserError(f"the cache holds {meta['windows']} windows: too few for {val_windows} held out and "
                        f"batches of {batch_size}")
    head = model.head
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    step, used_cpu, gen, history = 0, 0.0, torch.Generator().manual_seed(seed), []
    order = torch.empty(0, dtype=torch.long)  # the rest of the current permutation of the training windows
    out_dir = Path(out_dir)
    if resume and (out_dir / "checkpoint.json").is_file():
        loaded, _, ts = load_fwl_head(out_dir, backbone_loader=lambda _name: (model.backbone, None),
                                      with_trainer_state=True)
        if dataclasses.asdict(loaded.head.options) != dataclasses.asdict(head.options):
            raise UserError(f"--out {out_dir} holds a head with other options (another --variant?); choose another "
                            "--out, or the variant it was trained as")
        model.load_state_dict(loaded.state_dict(), strict=False)
        if ts is not None:
            optimizer.load_state_dict(ts["optimizer"])
            step, used_cpu, history = ts["step"], float(ts["cpu_s"]), list(ts["history"])
            gen.set_state(ts["rng"])
            if "order" in ts:
                order = ts["order"].to(torch.long)
                if order.numel() and (order.min() < 0 or order.max() >= n_train):
                    raise UserError(f"--out {out_dir}: its window order does not fit this cache of {n_train} "
                                    "training windows (another --windows?); choose another --out")

    def batch(idx):
        h = torch.from_numpy(np.asarray(hidden[idx], dtype=np.float32))
        return h, torch.from_numpy(tokens[idx])

    def save():
        ts = {"step": step, "optimizer": optimizer.state_dict(), "cpu_s": used_cpu, "rng": gen.get_state(),
              "order": order.clone(), "history": history}
        save_fwl_head(model, out_dir, backbone_name, step=step, trainer_state=ts)

    model.train()
    bar = Progress(budget_cpu_s, "CPU-sec", desc="train fwl head", enabled=progress, time_limit=budget_cpu_s,
                   clock=time.process_time)
    bar.update(used_cpu)
    # the budget clock continues from the CPU seconds a resumed run had spent
    start, last_save = time.process_time() - used_cpu, time.process_time()
    stop = StopSignals()  # SIGINT/SIGTERM: finish the step, save, say how to continue
    try:
        while used_cpu < budget_cpu_s and (max_steps is None or step < max_steps) and stop.signum is None:
            if order.numel() < batch_size:
                order = torch.randperm(n_train, generator=gen)
            idx, order = order[:batch_size].sort().values.numpy(), order[batch_size:]
            h, x = batch(idx)
            loss = window_loss(head, h, x)
            if not torch.isfinite(loss):
                raise UserError(f"fwl head training diverged at step {step} (loss {loss.item()}); lower the learning "
                                "rate")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            step += 1
            now = time.process_time()
            history.append([step, round(now - start, 2), loss.item() / math.log(2), [int(i) for i in idx]])
            bar.update(now - start - used_cpu, loss_bits=loss.item() / math.log(2))
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
    val = validation_losses(model, hidden, tokens, range(n_train, meta["windows"])) if val_windows else None
    return {"steps": step, "cpu_s": used_cpu, "batch_size": batch_size, "lr": lr, "window": meta["window"],
            "train_windows": n_train, "tokens_seen": step * batch_size * meta["window"], "history": history,
            "validation": val}


@torch.no_grad()
def validation_losses(model, hidden, tokens, rows) -> dict:
    """Mean loss (bits per token) of held-out cached windows: the pretrained logits vs the head's."""
    pre, fwl = [], []
    out_layer = model.backbone.hf.get_output_embeddings()
    for i in rows:
        h = torch.from_numpy(np.asarray(hidden[i : i + 1], dtype=np.float32))
        x = torch.from_numpy(tokens[i : i + 1])
        pre.append(F.cross_entropy(out_layer(h)[:, :-1].flatten(0, 1), x[:, 1:].flatten()).item())
        fwl.append(window_loss(model.head, h, x).item())
    return {"pretrained_bits": float(np.mean(pre)) / math.log(2), "fwl_bits": float(np.mean(fwl)) / math.log(2),
            "windows": len(pre)}


def _digest(a: np.ndarray) -> str:
    import hashlib

    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def backbone_digest(backbone) -> str:
    """SHA-256 of every weight of the backbone (names, dtypes, shapes and bytes): the hidden states depend on all
    of them and on their precision, not only on the output layer ``fwl_head.backbone_fingerprint`` looks at."""
    from fastweights.hf.fwl_head import tensors_digest

    return tensors_digest(sorted(backbone.hf.state_dict().items()))


#: the head options of each variant of the comparison (the paper's Table 2 rows)
VARIANTS = {
    "fwl": {},
    "test-time-only": {"test_time_only": True},
    "bias-only": {"bias_only": True},
}


def train_recipe(hf: str, out_dir: str | Path, *, variant: str = RECIPE.variant,
                 budget_cpu_s: float = RECIPE.budget_cpu_s, windows: int = RECIPE.windows, window: int = RECIPE.window,
                 cache_dir: str | Path | None = None, lr: float = RECIPE.lr, batch_size: int = RECIPE.batch_size,
                 seed: int = RECIPE.seed, progress: bool = True, max_steps: int | None = None) -> dict:
    """The default recipe (:class:`FWLHeadRecipe`), end to end: load ``hf`` (e.g. ``"smollm2-135m"``), wrap it with an FWL head of the
    given variant, cache the hidden states of ``windows`` windows of the training mix (shared between variants
    through ``cache_dir``, default ``out_dir/../hidden-cache``), train for ``budget_cpu_s`` CPU seconds
    (resuming a checkpoint in ``out_dir``; ``max_steps`` stops earlier) and write ``out_dir/training.json``.
    Returns its summary. SIGTERM while the cache is built stops as Ctrl-C does (the cache keeps the windows
    done, and the same call continues it); during training see :func:`train_head`."""
    import dataclasses

    from fastweights.core.files import atomic_write
    from fastweights.hf.fwl_head import (
        PRETRAINED_FWL_DEFAULTS,
        HFCausalLMWithFWL,
    )
    from fastweights.hf.transformers_as_ours import HFCausalLM, load_hf_model
    from fastweights.layers.fwl import FWLOptions
    from fastweights.loops.signals import SetupSignals
    from fastweights.loops.train import RunInterrupted

    if variant not in VARIANTS:
        raise UserError(f"unknown FWL variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    out_dir = Path(out_dir)
    cache_dir = Path(cache_dir) if cache_dir is not None else out_dir.parent / "hidden-cache"
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
    options = FWLOptions(**{**PRETRAINED_FWL_DEFAULTS, **VARIANTS[variant]})
    model = HFCausalLMWithFWL(backbone, options)
    tokens, sources = training_windows(tokenizer, window, max_windows=windows)
    t0 = time.process_time()
    setup_signals = SetupSignals()  # SIGTERM while caching: stop as Ctrl-C does (the cache resumes)
    try:
        meta = cache_hidden_states(backbone, tokens, cache_dir, sources, backbone_digest(backbone), progress)
    except KeyboardInterrupt as e:
        import signal

        code = getattr(e, "exit_code", 130)
        done = _read_meta(cache_dir)["done"] if (cache_dir / CACHE_META).is_file() else 0
        raise RunInterrupted(f"interrupted by {signal.Signals(code - 128).name} while caching hidden states: "
                             f"{cache_dir} holds {done} of {len(tokens)} windows and nothing was trained; the same "
                             "`fastweights fwl-head train` command continues", code) from None
    finally:
        setup_signals.restore()
    cache_cpu = time.process_time() - t0
    summary = train_head(model, cache_dir, out_dir, hf, budget_cpu_s=budget_cpu_s, batch_size=batch_size, lr=lr,
                         seed=seed, progress=progress, max_steps=max_steps)
    summary.update({"hf": hf, "variant": variant, "options": dataclasses.asdict(options), "cache_dir": str(cache_dir),
                    "cache_windows": meta["windows"], "cache_cpu_s_this_call": cache_cpu,
                    "training_sources": sorted({s.split(":")[0] for s in meta["sources"]}),
                    "torch_threads": torch.get_num_threads()})
    atomic_write(out_dir / "training.json", lambda p: p.write_text(json.dumps(summary, indent=1)), root=out_dir,
                 what="the training summary")
    return summary
