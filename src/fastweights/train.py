"""Training loop: AdamW with decay groups, warmup + cosine schedule, clipping, accumulation,
bf16 autocast on CUDA, periodic validation, atomic checkpoints, exact resume and a time budget.

    fastweights train --preset shakespeare-char --out runs/shakespeare

The loop is deliberately plain: the model's ``forward(tokens, targets=...)`` returns the loss,
and every mechanism's own work happens inside the model.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fastweights.checkpoint import atomic_write, save_model
from fastweights.config import RunConfig
from fastweights.errors import UserError
from fastweights.models.lm import LanguageModel
from fastweights.progress import Progress


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device {name!r} requested but CUDA is not available")
    try:
        return torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r}") from None


def autocast(device: torch.device):
    """bf16 autocast on CUDA; a no-op context on CPU (CPU bf16 matmuls are slower than fp32 here)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def lr_at(step: int, cfg, time_fraction: float = 0.0) -> float:
    """Linear warmup to cfg.lr, then cosine decay to cfg.lr * min_lr_ratio.

    The decay ends at max_steps, or when the time budget runs out if that comes first
    (``time_fraction`` = elapsed / budget), so a time-budgeted run still anneals.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, max(progress, time_fraction))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module, cfg) -> torch.optim.AdamW:
    """Weight decay on matrices (dim >= 2) only; norms, biases and scalar step sizes are not decayed.

    Parameters may carry ``lr_scale`` (e.g. a PKM value table trained with its own learning rate).
    """
    groups: dict[tuple, list] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decay = cfg.weight_decay if p.dim() >= 2 and not getattr(p, "no_weight_decay", False) else 0.0
        scale = getattr(p, "lr_scale", 1.0)
        groups.setdefault((decay, scale), []).append(p)
    param_groups = [{"params": ps, "weight_decay": d, "lr_scale": s} for (d, s), ps in groups.items()]
    fused = next(model.parameters()).is_cuda
    return torch.optim.AdamW(param_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=fused or None)


@dataclass
class Data:
    tokenizer: object
    train: object  # TokenStream
    val: object
    test: object


def prepare_data(cfg: RunConfig, out_dir: Path, tokenizer=None, progress: bool = True) -> Data:
    """Load the corpus, split it, build (or reuse) the tokenizer and encode the splits to memory maps."""
    from fastweights.data import build_tokenizer, cached_stream, load_corpus, split_corpus, text_pieces

    # only the char tokenizer needs valid UTF-8; byte/BPE tokenizers keep invalid bytes exactly
    docs = load_corpus(cfg.data.corpus, text_field=cfg.data.text_field, encoding_check=cfg.data.tokenizer == "char")
    splits = split_corpus(docs, cfg.data.split, cfg.data.val_fraction, cfg.data.test_fraction)
    if tokenizer is None:
        train_text = text_pieces(splits["train"]) if cfg.data.tokenizer == "char" else None
        tokenizer = build_tokenizer(cfg.data.tokenizer, train_text=train_text)
    cache = out_dir / "data"
    sep = getattr(tokenizer, "eot_id", None)  # GPT-2's <|endoftext|> between documents
    streams = {name: cached_stream(splits[name], tokenizer, cache, name, doc_separator=sep, progress=progress)
               for name in ("train", "val", "test")}
    need = cfg.train.seq_len + 1
    for name in ("train", "val"):
        if len(streams[name]) < need:
            raise UserError(
                f"corpus {cfg.data.corpus!r}: the {name} split has {len(streams[name])} tokens, fewer than one "
                f"training sequence ({need}); use a larger corpus or a smaller train.seq_len"
            )
    return Data(tokenizer, streams["train"], streams["val"], streams["test"])


@torch.no_grad()
def estimate_loss(model, stream, seq_len: int, max_tokens: int, batch_size: int, device) -> float:
    """Mean next-token loss (nats) over the first ``max_tokens`` of ``stream`` in independent windows."""
    model.eval()
    n = min(len(stream) - 1, max_tokens) // seq_len
    if n == 0:
        model.train()
        return float("nan")
    tokens = torch.from_numpy(np.asarray(stream.tokens[: n * seq_len + 1], dtype=np.int64))
    x = tokens[:-1].view(n, seq_len)  # [n, T]
    y = tokens[1:].view(n, seq_len)
    total = 0.0
    for i in range(0, n, batch_size):
        xb, yb = x[i : i + batch_size].to(device), y[i : i + batch_size].to(device)
        with autocast(device):
            total += model(xb, targets=yb).loss.float().item() * xb.shape[0]
    model.train()
    return total / n


def _rng_state(gen: torch.Generator) -> dict:
    return {"torch": torch.get_rng_state(), "batches": gen.get_state(), "python": random.getstate(),
            "numpy": np.random.get_state()}


def _set_rng_state(s: dict, gen: torch.Generator) -> None:
    torch.set_rng_state(s["torch"])
    gen.set_state(s["batches"])
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])


def train(cfg: RunConfig, out_dir: Path, resume: bool = False, progress: bool = True) -> dict:
    """Train ``cfg`` into ``out_dir``; returns a summary dict (also written as ``summary.json``)."""
    out_dir = Path(out_dir)
    tc = cfg.train
    if tc.threads:
        torch.set_num_threads(tc.threads)
    device = resolve_device(tc.device)
    torch.manual_seed(tc.seed)
    random.seed(tc.seed)
    np.random.seed(tc.seed)

    tokenizer = None
    state_path = out_dir / "trainer_state.pt"
    if resume:
        if not state_path.is_file():
            raise UserError(f"--resume: no trainer_state.pt in {out_dir}")
        from fastweights.checkpoint import read_run_config
        from fastweights.data import load_tokenizer

        saved = read_run_config(out_dir)
        if saved.model != _with_vocab(cfg.model, saved.model.vocab_size):
            raise UserError(f"--resume: the model config differs from the one saved in {out_dir}")
        tokenizer = load_tokenizer(out_dir)
    fresh_dir = not out_dir.exists()
    try:
        data = prepare_data(cfg, out_dir, tokenizer, progress)
    except UserError:
        if fresh_dir and out_dir.exists():  # leave nothing half-made behind
            shutil.rmtree(out_dir)
        raise
    cfg.model.vocab_size = data.tokenizer.vocab_size

    model = LanguageModel(cfg.model).to(device)
    optimizer = make_optimizer(model, tc)
    gen = torch.Generator().manual_seed(tc.seed)
    step, elapsed_before, history = 0, 0.0, []
    if resume:
        from fastweights.checkpoint import load_model

        model.load_state_dict(load_model(out_dir, map_location=str(device)).state_dict())
        ts = torch.load(state_path, map_location="cpu", weights_only=False)
        optimizer.load_state_dict(ts["optimizer"])
        _set_rng_state(ts["rng"], gen)
        step, elapsed_before, history = ts["step"], ts["elapsed"], ts["history"]
    fwd = torch.compile(model) if tc.compile else model

    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "metrics.jsonl"
    if not resume and log_path.exists():
        log_path.unlink()
    log = log_path.open("a")

    def save(final: bool = False):
        save_model(model, out_dir, cfg, data.tokenizer)
        ts = {"step": step, "optimizer": optimizer.state_dict(), "rng": _rng_state(gen),
              "elapsed": elapsed_before + (time.perf_counter() - t0), "history": history}
        atomic_write(state_path, lambda p: torch.save(ts, p))

    def validate():
        val = estimate_loss(model, data.val, tc.seq_len, tc.eval_tokens, tc.batch_size, device)
        rec = {"step": step, "val_loss": val, "val_bits": val / math.log(2),
               "elapsed": elapsed_before + time.perf_counter() - t0}
        history.append(rec)
        log.write(json.dumps(rec) + "\n")
        log.flush()
        return val

    tokens_per_step = tc.batch_size * tc.seq_len * tc.grad_accum
    budget = tc.max_minutes * 60 if tc.max_minutes > 0 else math.inf
    bar = Progress(tc.max_steps, "steps", desc="train", enabled=progress)
    bar.n = step
    t0 = time.perf_counter()
    model.train()
    last_loss = float("nan")
    stopped_by_budget = False
    while step < tc.max_steps:
        elapsed = elapsed_before + time.perf_counter() - t0
        if elapsed >= budget:
            stopped_by_budget = True
            break
        lr = lr_at(step, tc, elapsed / budget)
        for g in optimizer.param_groups:
            g["lr"] = lr * g["lr_scale"]
        t_step = time.perf_counter()
        loss_sum = 0.0
        for _ in range(tc.grad_accum):
            x, y = data.train.get_batch(tc.batch_size, tc.seq_len, gen)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast(device):
                out = fwd(x, targets=y)
                loss = out.loss if out.aux_loss is None else out.loss + out.aux_loss
            (loss / tc.grad_accum).backward()
            loss_sum += out.loss.item()
        if tc.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        last_loss = loss_sum / tc.grad_accum
        if not math.isfinite(last_loss):
            raise RuntimeError(f"training diverged at step {step} (loss {last_loss}); lower train.lr")
        tok_s = tokens_per_step / (time.perf_counter() - t_step)
        bar.update(1, loss=last_loss, lr=lr, **{"tok/s": f"{tok_s:,.0f}"})
        if step % tc.log_every == 0 or step == 1:
            log.write(json.dumps({"step": step, "loss": last_loss, "lr": lr, "tokens_per_s": tok_s,
                                  "elapsed": elapsed_before + time.perf_counter() - t0}) + "\n")
            log.flush()
        if tc.eval_every and step % tc.eval_every == 0 and step < tc.max_steps:
            validate()
            save()
        elif tc.save_every and step % tc.save_every == 0:
            save()
    bar.close()
    val = validate()
    save(final=True)
    log.close()
    summary = {"steps": step, "train_loss": last_loss, "val_loss": val, "val_bits_per_token": val / math.log(2),
               "elapsed_s": elapsed_before + time.perf_counter() - t0, "stopped_by_time_budget": stopped_by_budget,
               "parameters": model.num_parameters(), "tokenizer": data.tokenizer.name, "device": str(device)}
    atomic_write(out_dir / "summary.json", lambda p: p.write_text(json.dumps(summary, indent=2) + "\n"))
    plot_loss_curve(log_path, out_dir / "loss_curve.png")
    return summary


def _with_vocab(model_cfg, vocab_size):
    import dataclasses

    return dataclasses.replace(model_cfg, vocab_size=vocab_size)


def plot_loss_curve(metrics_path: Path, png_path: Path) -> None:
    """Training and validation loss (bits per token) against step, from metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train_pts, val_pts = [], []
    for line in metrics_path.read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            train_pts.append((rec["step"], rec["loss"] / math.log(2)))
        if "val_loss" in rec:
            val_pts.append((rec["step"], rec["val_bits"]))
    fig, ax = plt.subplots(figsize=(6, 4))
    if train_pts:
        ax.plot(*zip(*train_pts), label="train", alpha=0.7)
    if val_pts:
        ax.plot(*zip(*val_pts), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per token")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_write(png_path, lambda p: fig.savefig(p, dpi=120, format="png"))
    plt.close(fig)
