"""Training loop: AdamW with decay groups, warmup + cosine schedule, clipping, accumulation,
bf16 autocast on CUDA, periodic validation, atomic checkpoints, exact resume and a time budget.

    fastweights train --preset shakespeare-char --out runs/shakespeare

The loop is deliberately plain: the model's ``forward(tokens, targets=...)`` returns the loss,
and every mechanism's own work happens inside the model.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fastweights.checkpoints.format import save_model
from fastweights.core.distributed import (all_finite, all_mean, barrier, close_distributed, full_state,
                                     init_distributed, load_full_state, values_from_rank0, wrap_model)
from fastweights.core.config import RunConfig
from fastweights.core.errors import UserError
from fastweights.core.files import atomic_write, json_text, make_dirs, open_nofollow, save_figure
from fastweights.models.lm import LanguageModel, detach_state
from fastweights.core.progress import Progress
from fastweights.core.threads import busy_machine_warning, use_threads
from fastweights.loops.signals import SetupSignals, StopSignals, agreed_signal
from fastweights.loops.schedule import Schedule, check_optimizer_state, make_optimizer, minutes


def autocast(device: torch.device):
    """bf16 autocast on CUDA; a no-op context on CPU (CPU bf16 matmuls are slower than fp32 here)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def drops_carried_state(seed: int, step: int, probability: float) -> bool:
    """Whether training step ``step`` starts every lane from a fresh state (``train.carry_reset``).

    With ``train.carry_state`` alone a lane's state is carried for a whole pass over the training split
    (thousands of windows) and dropped only when the lanes restart, so the model almost never reads a
    fresh state and learns to depend on a long carried one; validation windows and the start of every
    stream then give it a state it never trained on. Dropping the carried state at a random
    ``probability`` of the steps trains on histories of every length from zero, geometric with mean
    ``1 / probability`` windows. The draw depends only on (seed, step), so a resumed run and every rank
    of a distributed run make the same choice.
    """
    return probability > 0 and random.Random(seed * 1_000_003 + step).random() < probability


@dataclass
class Data:
    tokenizer: object
    train: object  # TokenStream
    val: object
    test: object


PREPARED = "prepared.json"


def prepare_corpus(cfg: RunConfig, out_dir: Path, progress: bool = True) -> dict:
    """``fastweights prepare``: tokenise a corpus of any size once into memory-mapped split files.

    Writes ``{train,val,test}-*.bin`` (+ sidecars), ``tokenizer.json`` and ``prepared.json`` into
    ``out_dir``; ``--data out_dir`` then trains from the memory maps without re-reading the text.
    """
    from fastweights.core.files import refuse_links

    for name in ("tokenizer.json", "vocab.json", "merges.txt", PREPARED):  # before a token is encoded
        refuse_links(Path(out_dir), Path(out_dir) / name, "the prepared data")
    data = _encode_corpus(cfg, Path(out_dir), None, progress, cache=Path(out_dir))
    data.tokenizer.save(out_dir)  # refuses a link at tokenizer.json (and vocab.json, merges.txt) too
    info = {"corpus": cfg.data.corpus, "tokenizer": data.tokenizer.name, "vocab_size": data.tokenizer.vocab_size,
            "split": cfg.data.split, "files": {k: getattr(data, k).path.name for k in ("train", "val", "test")},
            "tokens": {k: len(getattr(data, k)) for k in ("train", "val", "test")}}
    atomic_write(Path(out_dir) / PREPARED, lambda p: p.write_text(json.dumps(info, indent=2) + "\n"), root=Path(out_dir))
    return info


def _open_prepared(directory: Path, tokenizer=None) -> Data:
    from fastweights.data import TokenStream, load_tokenizer

    info = json.loads((directory / PREPARED).read_text())
    saved = load_tokenizer(directory)
    if tokenizer is not None and tokenizer.fingerprint() != saved.fingerprint():
        raise UserError(f"prepared data {directory} was tokenised with a different tokenizer than the checkpoint")
    streams = {k: TokenStream.open(directory / f, saved) for k, f in info["files"].items()}
    return Data(saved, streams["train"], streams["val"], streams["test"])


def prepare_data(cfg: RunConfig, out_dir: Path, tokenizer=None, progress: bool = True) -> Data:
    """Load the corpus, split it, build (or reuse) the tokenizer and encode the splits to memory maps.

    A directory written by ``fastweights prepare`` is opened directly (nothing is re-encoded).
    """
    corpus = Path(cfg.data.corpus)
    if (corpus / PREPARED).is_file():
        data = _open_prepared(corpus, tokenizer)
    else:
        data = _encode_corpus(cfg, out_dir, tokenizer, progress, cache=out_dir / "data")
    need = cfg.train.seq_len + 1
    for name in ("train", "val"):
        if len(getattr(data, name)) < need:
            raise UserError(
                f"corpus {cfg.data.corpus!r}: the {name} split has {len(getattr(data, name))} tokens, fewer than one "
                f"training sequence ({need}); use a larger corpus or a smaller train.seq_len"
            )
    return data


def _encode_corpus(cfg: RunConfig, out_dir: Path, tokenizer, progress: bool, cache: Path) -> Data:
    from fastweights.data import TRAINED_KINDS, build_tokenizer, cached_stream, load_corpus, split_corpus, text_pieces

    # only the char and word tokenizers need valid UTF-8; byte/BPE tokenizers keep invalid bytes exactly
    trained = cfg.data.tokenizer in TRAINED_KINDS  # vocabulary built from the training split
    docs = load_corpus(cfg.data.corpus, text_field=cfg.data.text_field, encoding_check=trained)
    splits = split_corpus(docs, cfg.data.split, cfg.data.val_fraction, cfg.data.test_fraction)
    if tokenizer is None:
        train_text = text_pieces(splits["train"]) if trained else None
        tokenizer = build_tokenizer(cfg.data.tokenizer, train_text=train_text)
    sep = getattr(tokenizer, "eot_id", None)  # GPT-2's <|endoftext|> between documents
    streams = {name: cached_stream(splits[name], tokenizer, cache, name, doc_separator=sep, progress=progress,
                                   root=out_dir)  # nothing below --out through a link (out/data -> elsewhere)
               for name in ("train", "val", "test")}
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


class RunInterrupted(KeyboardInterrupt):
    """SIGINT/SIGTERM stopped a run after a step: its checkpoint was saved; ``exit_code`` is 128 + the signal."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class TrainingDiverged(UserError):
    """The loss, the gradients or the weights stopped being finite; nothing from that step was saved."""


def train(cfg: RunConfig, out_dir: Path, resume: bool = False, progress: bool = True, fsdp: bool = False,
          overwrite: bool = True, force_ram: bool = False) -> dict:
    """Train ``cfg`` into ``out_dir``; returns a summary dict (also written as ``summary.json``).

    Under ``torchrun --nproc_per_node N`` every process joins one data-parallel job: ``train.batch_size``
    is the global batch of one micro-step, each rank takes its slice of the same rows a single process
    would draw, gradients synchronise only on the last micro-step of an accumulation, and rank 0 logs
    and writes checkpoints. A run can be resumed on a different number of processes.

    The directory is locked while the run trains (see :mod:`fastweights.checkpoints.run_dir`). A directory that
    holds another run is replaced when ``overwrite`` (the Python default; ``fastweights train``
    refuses unless ``--overwrite``), else refused; ``resume`` continues it. Settings are validated,
    and the training memory estimated, before anything is written; a run that fails before it starts
    leaves ``out_dir`` as it was. SIGINT/SIGTERM finish the step, save, write the summary and raise
    :class:`RunInterrupted` (one during the final validation or save lets it finish, then raises); before
    the training loop starts (encoding the corpus, ...) they leave ``out_dir`` as it was and raise it too.
    ``model.vocab_size`` 0 is taken from the tokenizer; another value must equal the tokenizer's size.
    A non-finite loss, gradient or weight raises :class:`TrainingDiverged`. ``train.max_minutes`` covers the
    steps, the final validation and the save, and ends the run at the end of its schedule
    (:mod:`fastweights.loops.schedule`).
    """
    from fastweights.models.size import check_deep_model, meta_model
    from fastweights.checkpoints.run_dir import (FOREIGN, Restore, RunLock, check_out_dir, check_run_links,
                                                 describe_run)
    from fastweights.checkpoints.config_checks import validate_config

    out_dir = Path(out_dir)
    tc = cfg.train
    validate_config(cfg)  # every setting, before any file is written
    check_deep_model(cfg, force_ram)  # a deep model too big is refused in seconds, before the meta build
    meta_model(cfg.model)  # and the mechanisms' own options, building nothing
    summary_writer = _tensorboard_writer_class() if tc.log == "tensorboard" else None  # refuse before writing files
    use_threads("training", tc.threads)  # 0: OMP_NUM_THREADS (torchrun's), else the cores idle now
    dist, device = init_distributed(tc.device)
    if tc.batch_size % dist.world:
        raise UserError(f"train.batch_size={tc.batch_size} is not divisible by the {dist.world} processes")
    if tc.compile:
        check_compile(device)  # seconds, before anything is written
    restore = lock = None
    if dist.main:
        check_out_dir(out_dir)
        check_run_links(out_dir, tensorboard=summary_writer is not None)  # before anything is written
        restore = Restore(out_dir)
        lock = RunLock(out_dir)
    setup_signals = SetupSignals()  # SIGTERM before the loop (encoding the corpus, ...) stops the run as Ctrl-C does
    try:
        if lock is not None:
            lock.acquire()
            held = describe_run(out_dir)
            if held is not None and held.startswith(FOREIGN):
                raise UserError(f"--out {out_dir} holds {held}: a run never replaces them, --overwrite neither; "
                                "choose another --out")
            if held is not None and not resume and not overwrite:
                hint = "pass --resume to continue it, --overwrite" if "checkpoint" in held else "it has no checkpoint to " \
                    "resume (a run that diverged or stopped before its first save); pass --overwrite"
                raise UserError(f"--out {out_dir} already holds {held}: {hint} to replace it (its derived files too), "
                                "or choose another --out")
        return _train(cfg, out_dir, resume, progress and dist.main, fsdp, overwrite, force_ram, dist, device,
                      summary_writer, restore)
    except UserError:
        if restore is not None and restore.armed:
            restore.undo()
        raise
    except KeyboardInterrupt as e:
        if isinstance(e, RunInterrupted) or restore is None or not restore.armed:
            raise  # the run had started: it saved (RunInterrupted) or a second signal stopped it at once
        restore.undo()  # interrupted before training started: what this run created goes, as for bad settings
        import signal

        code = getattr(e, "exit_code", 130)
        raise RunInterrupted(f"interrupted by {signal.Signals(code - 128).name} before training started: nothing was "
                             f"saved and {out_dir} is as it was", code) from None
    finally:
        setup_signals.restore()
        if lock is not None:
            lock.release()
        close_distributed(dist)


def _train(cfg, out_dir, resume, progress, fsdp, overwrite, force_ram, dist, device, summary_writer, restore):
    from fastweights.models.loading import load_for_resume
    from fastweights.checkpoints.format import check_weights, finish_pending, remove_stale_temporaries
    from fastweights.checkpoints.run_dir import remove_run, truncate_metrics
    from fastweights.models.size import check_ram

    tc = cfg.train
    # what max_minutes (and the elapsed times logged) count: wall-clock seconds, or this process's CPU
    # seconds, which stay fair when one-thread runs share a busy machine
    clock = time.process_time if tc.budget_clock == "cpu" else time.perf_counter
    torch.manual_seed(tc.seed)
    random.seed(tc.seed)
    np.random.seed(tc.seed)

    tokenizer = saved_unit = None
    if resume:
        if dist.main:  # a save killed after its commit is completed now (a run resumed at its last step saves no more)
            finish_pending(out_dir)
            remove_stale_temporaries(out_dir)
        barrier(dist)
        saved_unit = load_for_resume(out_dir)  # weights, trainer state and tokenizer of one checkpoint
        if saved_unit["state"]["step"] > tc.max_steps:  # it would print "24/5 steps" and train nothing
            raise UserError(f"--resume: the run in {out_dir} is at step {saved_unit['state']['step']}, past "
                            f"train.max_steps={tc.max_steps}; there is nothing to train (raise train.max_steps to "
                            "continue it)")
        saved = saved_unit["config"]
        if saved.model != _with_vocab(cfg.model, saved.model.vocab_size):
            raise UserError(f"--resume: the model config differs from the one saved in {out_dir}")
        tokenizer = saved_unit["tokenizer"]
    if dist.main:  # rank 0 encodes the corpus once; the others then read the cached token files
        if progress:  # the first line at once: reading a large corpus shows nothing else until it is encoded
            print(f"train | preparing the data: {cfg.data.corpus}", file=sys.stderr)
        data = prepare_data(cfg, out_dir, tokenizer, progress)
    barrier(dist)
    if not dist.main:
        data = prepare_data(cfg, out_dir, tokenizer, progress=False)
    if cfg.model.vocab_size and cfg.model.vocab_size != data.tokenizer.vocab_size:
        raise UserError(f"model.vocab_size={cfg.model.vocab_size}: the {data.tokenizer.name} tokenizer of this corpus "
                        f"has {data.tokenizer.vocab_size} symbols; leave model.vocab_size at 0 (taken from the "
                        f"tokenizer) or set it to {data.tokenizer.vocab_size}")
    cfg.model.vocab_size = data.tokenizer.vocab_size
    cfg.data.tokenizer = data.tokenizer.name  # a prepared corpus brings its own tokenizer
    ram = check_ram(cfg, device, dist.world, force_ram)

    model = LanguageModel(cfg.model).to(device)
    wrapped = wrap_model(model, dist, device, fsdp)
    optimizer = make_optimizer(model, tc)
    gen = torch.Generator().manual_seed(tc.seed)
    step, elapsed_before, history = 0, 0.0, []
    carried = None  # train.carry_state: the model state after the previous step's windows, detached
    if resume:
        ts = saved_unit["state"]
        check_weights(model, saved_unit["model"], f"checkpoint {out_dir}")
        try:
            load_full_state(model, optimizer, saved_unit["model"], ts["optimizer"])
            _set_rng_state(ts["rng"], gen)
            check_optimizer_state(optimizer)
        except (KeyError, ValueError, TypeError, RuntimeError, IndexError) as e:
            raise UserError(f"checkpoint {out_dir}: the trainer state does not fit this model "
                            f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        step, elapsed_before, history = ts["step"], ts["elapsed"], ts["history"]
        # the lanes' carried state (one process only; with several, each rank held its own slice's)
        carried = ts.get("carried_state") if ts.get("world_size") == dist.world == 1 else None
        if carried is not None:
            from torch.utils._pytree import tree_map

            carried = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, carried)
    if dist.main:
        if resume:
            # records past the checkpoint are redone, and so is a validation written after it (the final one)
            truncate_metrics(out_dir / "metrics.jsonl", step, validated=any(h["step"] == step for h in history))
        elif overwrite:
            remove_run(out_dir)  # the replaced run's files and what was derived from its weights
    if restore is not None:
        restore.armed = False  # from here on the directory holds this run
    fwd = torch.compile(wrapped) if tc.compile else wrapped

    tb = None
    if dist.main and summary_writer is not None:
        make_dirs(out_dir, out_dir / "tensorboard", "the TensorBoard events")  # never through a link
        tb = summary_writer(str(out_dir / "tensorboard"), purge_step=step + 1 if resume else None)
    log = None
    log_path = out_dir / "metrics.jsonl"
    if dist.main:
        out_dir.mkdir(parents=True, exist_ok=True)
        log = os.fdopen(open_nofollow(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, "metrics", root=out_dir), "a")

    def write_log(rec: dict) -> None:
        if log is not None:
            log.write(json_text(rec, indent=None) + "\n")  # a diverged loss: null, not NaN
            log.flush()
        if tb is not None:
            for k, v in rec.items():
                if k != "step" and isinstance(v, (int, float)):
                    tb.add_scalar(k, v, rec["step"])

    saved_step = step if resume else None

    def save() -> None:
        nonlocal saved_step
        model_sd, optim_sd = full_state(model, optimizer)  # collective under FSDP: every rank calls it
        if dist.main:
            ts = {"step": step, "optimizer": optim_sd, "rng": _rng_state(gen),
                  "elapsed": elapsed_before + (clock() - t0), "history": history, "world_size": dist.world,
                  "carried_state": carried if dist.world == 1 else None, "schedule": schedule.state()}
            save_model(model, out_dir, cfg, data.tokenizer, state_dict=model_sd, trainer_state=ts, step=step)
        saved_step = step
        barrier(dist)

    def validate() -> float:
        # every rank scores the same windows (cheap next to training, and FSDP needs all ranks in forward)
        val = estimate_loss(wrapped, data.val, tc.seq_len, tc.eval_tokens, tc.batch_size, device)
        rec = {"step": step, "val_loss": val, "val_bits": val / math.log(2),
               "elapsed": elapsed_before + clock() - t0}
        history.append(rec)
        write_log(rec)
        return val

    def diverged(what: str) -> TrainingDiverged:
        held = f"the checkpoint of step {saved_step}" if saved_step is not None else "no checkpoint"
        return TrainingDiverged(f"training diverged at step {step + 1} ({what}); nothing of it was saved: {out_dir} "
                                f"holds {held}; lower train.lr={tc.lr:g} or raise train.warmup_steps")

    def timed(work) -> float:
        """``work()``'s seconds on the budget's clock."""
        started = clock()
        work()
        return clock() - started

    micro = tc.batch_size // dist.world  # rows of the global micro-batch on this rank
    tokens_per_step = tc.batch_size * tc.seq_len * tc.grad_accum
    budget = tc.max_minutes * 60 if tc.max_minutes > 0 else math.inf
    if progress and clock is time.process_time and math.isfinite(budget):  # CPU-minutes on a busy machine: say so
        warning = busy_machine_warning(torch.get_num_threads(), budget)
        if warning:
            print(warning, file=sys.stderr)
    val_windows = min(len(data.val) - 1, tc.eval_tokens) // tc.seq_len
    # the learning rate of every step, and (with a budget) the step after which the run stops in time for its
    # final validation and save
    schedule = Schedule(tc, budget, val_batches=-(-val_windows // tc.batch_size), micro_rows=micro,
                        n_params=model.num_parameters(), state=saved_unit["state"].get("schedule") if resume else None,
                        step=step)
    bar = Progress(tc.max_steps, "steps", desc="train", enabled=progress, loss_unit="nats",
                   time_limit=schedule.training_time() - elapsed_before if schedule.timed else None, clock=clock,
                   initial=step)  # a resumed run's steps: counted, not in the rate
    bar.show()  # the total at once: the first step may take long (a large model, a busy machine, compilation)
    t0 = clock()
    wrapped.train()
    last_loss = float("nan")
    stopped_by_budget = False
    params = [p for p in model.parameters() if p.requires_grad]
    stop = StopSignals()
    interrupted = False
    try:
        while step < tc.max_steps:
            elapsed = elapsed_before + clock() - t0
            out_of_time = schedule.out_of_time(elapsed)
            lr = 0.0 if out_of_time else schedule.lr(step, elapsed)
            # rank 0's decisions and learning rate on every rank (each rank's clock reads its own time)
            out_of_time, interrupted, lr = values_from_rank0([out_of_time, stop.signum is not None, lr], dist, device)
            if interrupted:
                break
            if out_of_time:
                stopped_by_budget = True
                break
            for g in optimizer.param_groups:
                g["lr"] = lr * g["lr_scale"]
            t_step, c_step = time.perf_counter(), clock()
            loss_sum = 0.0
            for i in range(tc.grad_accum):
                if tc.carry_state:  # truncated BPTT: row i continues its lane where the last step stopped
                    x, y, restart = data.train.get_lane_batch(tc.batch_size, tc.seq_len, step)
                    if restart or drops_carried_state(tc.seed, step, tc.carry_reset):
                        carried = None
                else:
                    x, y = data.train.get_batch(tc.batch_size, tc.seq_len, gen)  # the global batch, same on every rank
                x = x[dist.rank * micro : (dist.rank + 1) * micro].to(device, non_blocking=True)
                y = y[dist.rank * micro : (dist.rank + 1) * micro].to(device, non_blocking=True)
                sync = i == tc.grad_accum - 1
                ctx = wrapped.no_sync() if (not sync and hasattr(wrapped, "no_sync")) else contextlib.nullcontext()
                if fsdp and dist.world > 1:
                    wrapped.set_requires_gradient_sync(sync)
                with ctx, autocast(device):
                    # the loss only (no [B, T, V] logits kept: ops.linear_cross_entropy for a linear head);
                    # carried stays None without carry_state
                    out = fwd(x, state=carried, targets=y, return_logits=False)
                    loss = out.loss if out.aux_loss is None else out.loss + out.aux_loss
                    (loss / tc.grad_accum).backward()
                loss_sum += out.loss.item()
                if tc.carry_state:  # bounded (a KV cache keeps seq_len tokens) and cut from this step's graph
                    carried = model.trim_state(detach_state(out.state), tc.seq_len)
            last_loss = all_mean(loss_sum / tc.grad_accum, dist, device)
            if not math.isfinite(last_loss):
                raise diverged(f"loss {last_loss}")
            grad_norm = torch.nn.utils.clip_grad_norm_(params, tc.grad_clip if tc.grad_clip > 0 else math.inf)
            if not math.isfinite(float(grad_norm)):
                raise diverged(f"gradient norm {float(grad_norm)}")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if not all_finite(params, dist, device):
                raise diverged("non-finite weights after the optimizer step")
            step += 1
            schedule.record_step(clock() - c_step)
            tok_s = tokens_per_step / max(1e-9, time.perf_counter() - t_step)
            if schedule.timed:  # the total and the ETA from whichever limit binds
                projected = schedule.projected_steps(step, elapsed_before + clock() - t0)
                bar.total, bar.approximate = (tc.max_steps, False) if projected is None else (projected, True)
                bar.until_time_limit = projected is not None
                bar.desc = "train" if projected is None else f"train (time budget {minutes(budget)})"
                bar.time_limit = schedule.training_time() - elapsed_before
            bar.update(1, loss=last_loss, lr=lr, **{"tok/s": f"{tok_s:,.0f}"})
            if step % tc.log_every == 0 or step == 1:
                write_log({"step": step, "loss": last_loss, "lr": lr, "tokens_per_s": tok_s,
                           "elapsed": elapsed_before + clock() - t0})
            if tc.eval_every and step % tc.eval_every == 0 and step < tc.max_steps:
                schedule.record_validation(timed(validate))
                schedule.record_save(timed(save))
            elif tc.save_every and step % tc.save_every == 0:
                schedule.record_save(timed(save))
        if stopped_by_budget:
            bar.total, bar.approximate = step, False
        bar.close()
        if not interrupted:
            if progress and not (history and history[-1]["step"] == step):
                print(f"train | final validation ({val_windows * tc.seq_len:,} tokens) and save", file=sys.stderr)
            val = history[-1]["val_loss"] if history and history[-1]["step"] == step else validate()
        else:
            val = next((h["val_loss"] for h in reversed(history) if h["step"] == step), float("nan"))
        if saved_step != step:
            save()
        # a signal that came during the final validation or save lets both finish and is still reported
        signum = agreed_signal(stop, dist, device)
    finally:
        stop.restore()
        if log is not None:
            log.close()
        if tb is not None:
            tb.close()
    summary = {"steps": step, "train_loss": last_loss, "val_loss": val, "val_bits_per_token": val / math.log(2),
               "elapsed_s": elapsed_before + clock() - t0, "stopped_by_time_budget": stopped_by_budget,
               "threads": torch.get_num_threads(),
               "parameters": model.num_parameters(), "tokenizer": data.tokenizer.name, "device": str(device),
               "processes": dist.world, "budget_clock": tc.budget_clock,
               "budget_s": budget if schedule.timed else None,
               "estimated_ram_bytes": ram["total_bytes"]}
    if signum is not None:
        import signal

        summary["interrupted_by"] = signal.Signals(signum).name
    if dist.main:
        atomic_write(out_dir / "summary.json", lambda p: p.write_text(json_text(summary) + "\n"),  # NaN: null
                     root=out_dir, what="the run summary")
        plot_loss_curve(log_path, out_dir / "loss_curve.png", root=out_dir)
    if signum is not None:
        import signal

        finished = step >= tc.max_steps or stopped_by_budget
        raise RunInterrupted(f"interrupted by {signal.Signals(signum).name}: {out_dir} holds the checkpoint of step "
                             f"{step}" + ("; training had finished (the final validation and save completed)"
                                          if finished else "; continue with --resume"), 128 + signum)
    return summary


def check_compile(device) -> None:
    """``train.compile``: compile a two-operation function on ``device`` before anything is written, so that a
    machine whose compiler cannot build Inductor's kernels (no C++ compiler, missing headers) is refused in one
    line in seconds instead of failing inside the first step after minutes of compiler errors."""
    import logging

    loggers = [logging.getLogger(n) for n in ("torch._inductor", "torch._dynamo")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:  # their error logs would repeat the compiler's output on stderr
        lg.setLevel(logging.CRITICAL)
    try:
        x = torch.arange(8, dtype=torch.float32, device=device)
        torch.compile(lambda t: (t * 2 + 1).sin().sum(), dynamic=False)(x).item()
    except Exception as e:  # noqa: BLE001 - whatever the backend raises, the setting cannot be used here
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise UserError(f"train.compile=true: torch.compile cannot build kernels on {device} here ({first[:160]}); "
                        "set train.compile=false, or install a working compiler") from None
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _tensorboard_writer_class():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UserError("train.log = 'tensorboard' needs the tensorboard package (pip install tensorboard)") from None
    return SummaryWriter


def _with_vocab(model_cfg, vocab_size):
    import dataclasses

    return dataclasses.replace(model_cfg, vocab_size=vocab_size)


def plot_loss_curve(metrics_path: Path, png_path: Path, root: Path | None = None) -> None:
    """Training and validation loss (bits per token) against step, from metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train_pts, val_pts = [], []
    for line in metrics_path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:  # a line torn by a kill
            continue
        if rec.get("loss") is not None:  # null: a loss that was not finite
            train_pts.append((rec["step"], rec["loss"] / math.log(2)))
        if rec.get("val_bits") is not None:
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
    save_figure(fig, png_path, dpi=120, root=root)
