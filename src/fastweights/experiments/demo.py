"""`make demo`: train a char-level Transformer on Shakespeare within a time budget on the CPU,
evaluate it on held-out text, plot the loss curve and print a sample."""

from __future__ import annotations

import json
import math
from pathlib import Path

from fastweights.core.config import make_config


def run_demo(out: Path, minutes: float = 5.0) -> int:
    from fastweights.models.loading import load_checkpoint
    from fastweights.data import load_corpus, split_corpus
    from fastweights.loops.evaluate import evaluate_documents
    from fastweights.loops.generate import generate_tokens
    from fastweights.loops.train import train

    cfg = make_config("shakespeare-char", [f"train.max_minutes={minutes}"])
    print(f"== training a char-level Transformer on tinyshakespeare for up to {minutes:g} minutes (CPU)")
    summary = train(cfg, out)
    print(f"   {summary['steps']} steps in {summary['elapsed_s']:.0f} s, {summary['parameters']:,} parameters; "
          f"validation {summary['val_bits_per_token']:.3f} bits/char")

    model, tokenizer, cfg = load_checkpoint(out)
    splits = split_corpus(load_corpus(cfg.data.corpus), cfg.data.split, cfg.data.val_fraction, cfg.data.test_fraction)
    print("== held-out evaluation (test split, state carried across chunks)")
    res = evaluate_documents(model, tokenizer, [d.text for d in splits["test"]], cfg.train.seq_len, progress=False)
    test_bpc = res.loss / math.log(2)
    print(f"   test: {test_bpc:.3f} bits/char over {res.tokens:,} characters")

    print("== dynamic evaluation: the model keeps learning from the test text it scores")
    from fastweights.adapt.evaluate import demo_dynamic

    dyn = demo_dynamic(out, tune_chars=3000, test_chars=10000, stats_batches=30)  # ~1 min on 2 cores

    print("== sample (temperature 0.8)")
    prompt = [int(t) for t in tokenizer.encode("ROMEO:\n")]
    ids = list(generate_tokens(model, prompt, 300, temperature=0.8, seed=0, context=cfg.train.seq_len))
    print("ROMEO:\n" + tokenizer.decode(ids))

    result = {"val_bits_per_char": summary["val_bits_per_token"], "test_bits_per_char": test_bpc,
              "train_steps": summary["steps"], "train_seconds": summary["elapsed_s"],
              "parameters": summary["parameters"], "loss_curve": str(out / "loss_curve.png"),
              "dynamic_eval": {"static": dyn["static"], "dynamic": dyn["dynamic"],
                               "relative_improvement": dyn["relative_improvement"], "tuned": dyn["search"]["best"]}}
    from fastweights.core.files import atomic_write

    atomic_write(out / "demo.json", lambda p: p.write_text(json.dumps(result, indent=2) + "\n"), root=out)
    print(f"== loss curve: {out / 'loss_curve.png'}; results: {out / 'demo.json'}")
    return 0
