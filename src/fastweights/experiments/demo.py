"""`make demo`: train a char-level Transformer on Shakespeare on the CPU for a fixed number of steps,
evaluate it on held-out text, adapt it to that text with dynamic evaluation, plot the loss curve and print a
sample.

The same command gives the same model on any machine (the same steps from the same seed; the thread count
moves the last bits only): the steps, not a clock, end the training, so a busy or slow machine takes longer
instead of training less. :data:`DEMO_STEPS` were chosen to fit about five minutes on an idle 2-core machine
with two threads; before training, eight steps are timed, and a machine that would take much longer than
that is told so with its own estimate.

An interrupted demo continues where it stopped: run it again on the same ``--out``. A folder holding this
demo's run (the same preset and steps) resumes its training from the last checkpoint, then runs the later
stages (evaluation, dynamic evaluation, the sample: deterministic, a minute), so the model and ``demo.json``'s
scores are those of an uninterrupted demo. A folder holding any other run is refused, never replaced.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch

from fastweights.core.config import make_config
from fastweights.core.files import atomic_write
from fastweights.core.threads import use_threads

PRESET = "shakespeare-char"
# The rate the demo's own timed steps showed on this project's idle 2-core machine (two threads,
# OMP_WAIT_POLICY=PASSIVE as the command sets it): benchmarks/results/demo.json, demo.timed_steps_per_s (5.63;
# the whole training, its evaluations included, ran at 4.7 steps/s there). DEMO_STEPS is about five minutes of it.
DEMO_STEPS_PER_S = 5.6
DEMO_STEPS = 1500
WARMUP_STEPS = 3
SLOW_FACTOR = 1.5  # warn when the timed steps promise a training this much longer than on that machine


def timed_steps_per_s(cfg, steps: int = 8) -> float:
    """Training steps a second of the demo's model at its batch size on this machine now (random tokens; the
    first :data:`WARMUP_STEPS`, which allocate and start the thread pool, are not timed: measured, the first
    few steps of a fresh process run several times slower)."""
    from fastweights.loops.schedule import make_optimizer
    from fastweights.models.lm import LanguageModel

    torch.manual_seed(0)
    model_cfg = make_config(PRESET, ["model.vocab_size=65"]).model
    model = LanguageModel(model_cfg)
    opt = make_optimizer(model, cfg.train)
    x = torch.randint(0, 65, (cfg.train.batch_size, cfg.train.seq_len + 1))
    t0 = None
    for i in range(steps + WARMUP_STEPS):
        if i == WARMUP_STEPS:
            t0 = time.perf_counter()
        loss = model(x[:, :-1], targets=x[:, 1:]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return steps / (time.perf_counter() - t0)


def slow_machine_warning(steps: int, rate: float) -> str | None:
    """What to tell a user whose machine, at ``rate`` steps a second now, would take much longer than the idle
    2-core machine the demo was sized on; None when it would not."""
    here, there = steps / rate / 60, steps / DEMO_STEPS_PER_S / 60
    if here <= SLOW_FACTOR * there:
        return None
    return (f"warning: this machine trains the demo at {rate:.1f} steps/s now: about {here:.0f} minutes for "
            f"{steps:,} steps, where an idle 2-core machine takes {there:.0f}; it is busy or slower, and the model "
            "will be the same, only later")


def demo_run_step(out: Path, cfg) -> int | None:
    """The step of the demo's own checkpoint in ``out`` (its preset's model, data and training settings, the
    thread count aside), None when ``out`` holds no run; a UserError when it holds another run."""
    from dataclasses import replace

    from fastweights.checkpoints.run_dir import checkpoint_step, describe_run
    from fastweights.core.errors import UserError
    from fastweights.models.loading import read_run_config

    held = describe_run(out)
    if held is None:
        return None
    try:
        saved = read_run_config(out)
    except UserError:
        saved = None
    same = saved is not None and replace(saved.train, threads=0) == replace(cfg.train, threads=0) and \
        saved.data == cfg.data and saved.model == replace(cfg.model, vocab_size=saved.model.vocab_size)
    step = checkpoint_step(out)
    if not same or not isinstance(step, int) or isinstance(step, bool):  # a manifest without a step: not resumable
        raise UserError(f"--out {out} already holds {held}, not this demo's run: the demo never replaces a run; "
                        "choose another --out")
    return step


def run_demo(out: Path, steps: int = DEMO_STEPS, threads: int = 0) -> int:
    from fastweights.adapt.evaluate import demo_dynamic
    from fastweights.data import load_corpus, split_corpus
    from fastweights.loops.evaluate import evaluate_documents
    from fastweights.loops.generate import generate_tokens
    from fastweights.loops.train import RunInterrupted, train
    from fastweights.models.loading import load_checkpoint

    threads = use_threads("training", threads)  # decided once: train() below is given the count
    cfg = make_config(PRESET, [f"train.max_steps={steps}", "train.max_minutes=0", f"train.threads={threads}"])
    done = demo_run_step(out, cfg)  # this demo's checkpoint in out: continue it (None: a new run)
    rate = timed_steps_per_s(cfg)
    left = steps - (done or 0)
    what = f"continuing the demo in {out} from step {done:,}: {left:,} steps" if done is not None else \
        f"training a char-level Transformer on tinyshakespeare for {steps:,} steps"
    print(f"== {what} on {threads} CPU thread{'s' if threads > 1 else ''} (about {left / rate / 60:.0f} minutes "
          "here)")
    warning = slow_machine_warning(left, rate)
    if warning:
        print(warning, file=sys.stderr)
    try:
        summary = train(cfg, out, resume=done is not None)
    except RunInterrupted as e:  # saved: the same command continues it (the demo has no --resume)
        raise RunInterrupted(str(e).replace("continue with --resume", "run the demo again with the same --out "
                                            "to continue"), e.exit_code) from None
    print(f"   {summary['steps']:,} steps in {summary['elapsed_s']:.0f} s, {summary['parameters']:,} parameters; "
          f"validation {summary['val_bits_per_token']:.3f} bits/char")

    use_threads("scoring")  # scoring and sampling (core/threads.py)
    model, tokenizer, cfg = load_checkpoint(out)
    splits = split_corpus(load_corpus(cfg.data.corpus), cfg.data.split, cfg.data.val_fraction, cfg.data.test_fraction)
    print("== held-out evaluation (test split, state carried across chunks)")
    res = evaluate_documents(model, tokenizer, [d.text for d in splits["test"]], cfg.train.seq_len, progress=False)
    test_bpc = res.loss / math.log(2)
    print(f"   test: {test_bpc:.3f} bits/char over {res.tokens:,} characters")

    print("== dynamic evaluation: the model keeps learning from the test text it scores")
    dyn = demo_dynamic(out, tune_chars=3000, test_chars=10000, stats_batches=30)

    print("== sample (temperature 0.8)")
    prompt = [int(t) for t in tokenizer.encode("ROMEO:\n")]
    ids = list(generate_tokens(model, prompt, 300, temperature=0.8, seed=0, context=cfg.train.seq_len))
    print("ROMEO:\n" + tokenizer.decode(ids))

    result = {"val_bits_per_char": summary["val_bits_per_token"], "test_bits_per_char": test_bpc,
              "train_steps": summary["steps"], "train_seconds": summary["elapsed_s"], "train_threads": threads,
              "timed_steps_per_s": rate, "parameters": summary["parameters"],
              "loss_curve": str(out / "loss_curve.png"),
              "dynamic_eval": {"static": dyn["static"], "dynamic": dyn["dynamic"],
                               "relative_improvement": dyn["relative_improvement"], "tuned": dyn["search"]["best"]}}
    atomic_write(out / "demo.json", lambda p: p.write_text(json.dumps(result, indent=2) + "\n"), root=out)
    print(f"== loss curve: {out / 'loss_curve.png'}; results: {out / 'demo.json'}")
    return 0
