"""Training steps per second of the fast-weights RNN language model against the LSTM one (issue 21, scope 2).

The presets ``shakespeare-char-fast-rnn`` and ``shakespeare-char-lstm`` (parameters matched to within 0.5%)
are built as ``fastweights train`` builds them (char vocabulary of 66 symbols, the preset's optimizer) and
timed on their own batch and sequence length: one training step is forward, cross-entropy, backward,
gradient clipping and the AdamW step. One thread, this process's CPU time (other jobs on a shared machine
do not count), the models timed alternately round by round, medians reported. Batches are random tokens
(the step's cost does not depend on the text). The fast-weights RNN runs twice: with its compiled step
kernel (the default) and with the torch implementation it falls back to (``backend="torch"``).

Also recorded: forward+backward of one mixer of each kind (where the step's time goes) and the largest
difference between the kernel's and the torch implementation's loss and gradients on one batch.

    python benchmarks/speed/bench_fast_rnn_vs_lstm.py [--rounds 15] [--threads 1]

Writes benchmarks/results/bench_fast_rnn_vs_lstm.json. Target: fast-weights RNN / LSTM steps per second >= 0.8.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time

import torch

from fastweights.evidence.result_files import write_result
from fastweights.cli.script_parser import ScriptParser, exit_status_of
from fastweights.core.threads import use_threads
from fastweights.evidence.script_args import benchmark_threads_flag
from fastweights.evidence.timing import call_seconds

from fastweights.core.config import make_config
from fastweights.ops import fast_rnn
from fastweights.models.lm import LanguageModel
from fastweights.ops.fast_rnn_kernel import step_kernel
from fastweights.loops.schedule import make_optimizer

FAST, LSTM = "shakespeare-char-fast-rnn", "shakespeare-char-lstm"
VOCAB = 66  # the char vocabulary of tinyshakespeare (65 characters + unknown), as the presets count it
TARGET = 0.8


@contextlib.contextmanager
def torch_backend(on: bool):
    """Run the fast-weights RNN without its compiled kernel (the fallback) while ``on``."""
    old = os.environ.get("FASTWEIGHTS_FAST_RNN_KERNEL")
    if on:
        os.environ["FASTWEIGHTS_FAST_RNN_KERNEL"] = "0"
    try:
        yield
    finally:
        if on:
            if old is None:
                os.environ.pop("FASTWEIGHTS_FAST_RNN_KERNEL", None)
            else:
                os.environ["FASTWEIGHTS_FAST_RNN_KERNEL"] = old


def build(preset: str, seed: int = 0):
    cfg = make_config(preset, [f"model.vocab_size={VOCAB}"])
    torch.manual_seed(seed)
    model = LanguageModel(cfg.model)
    opt = make_optimizer(model, cfg.train)
    tc = cfg.train
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (tc.batch_size, tc.seq_len), generator=gen)
    y = torch.randint(0, VOCAB, (tc.batch_size, tc.seq_len), generator=gen)
    clip = tc.grad_clip if tc.grad_clip > 0 else float("inf")

    def step():
        out = model(x, targets=y)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    info = {"parameters": sum(p.numel() for p in model.parameters()), "batch_size": tc.batch_size,
            "seq_len": tc.seq_len, "lr": tc.lr, "grad_clip": tc.grad_clip,
            "mixer": cfg.model.mixer, "mixer_options": cfg.model.options.get(cfg.model.mixer, {})}
    return model, step, info


def summarise(samples: list[float]) -> dict:
    med = statistics.median(samples)
    return {"cpu_ms_median": round(1e3 * med, 2), "cpu_ms_min": round(1e3 * min(samples), 2),
            "cpu_ms_max": round(1e3 * max(samples), 2), "steps_per_s": round(1.0 / med, 3),
            "samples": len(samples)}


def time_alternately(variants: dict, rounds: int, warmup: int) -> dict:
    """{name: (fn, use_torch_backend)} -> {name: summary}, timed round-robin in process CPU time."""
    samples = {name: [] for name in variants}
    for r in range(warmup + rounds):
        for name, (fn, fallback) in variants.items():
            with torch_backend(fallback):
                (dt,) = call_seconds(fn, (time.process_time,))
            if r >= warmup:
                samples[name].append(dt)
    return {name: summarise(s) for name, s in samples.items()}


def agreement(model: LanguageModel) -> dict:
    """Largest |difference| of loss and gradients, compiled kernel vs the torch implementation, one batch."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (4, 64), generator=gen)
    y = torch.randint(0, VOCAB, (4, 64), generator=gen)
    runs = {}
    for fallback in (False, True):
        with torch_backend(fallback):
            model.zero_grad(set_to_none=True)
            loss = model(x, targets=y).loss
            loss.backward()
            runs[fallback] = (float(loss.detach()), [p.grad.clone() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    (lk, gk), (lt, gt) = runs[False], runs[True]
    return {"batch": [4, 64], "dtype": "float32", "abs_loss_diff": abs(lk - lt),
            "max_abs_grad_diff": max(float((a - b).abs().max()) for a, b in zip(gk, gt)),
            "max_abs_grad": max(float(b.abs().max()) for b in gt)}


def mixer_breakdown(fast_model, lstm_model, info: dict, rounds: int) -> dict:
    """Forward+backward of the first mixer of each model alone on a [B, T, d_model] input."""
    d = fast_model.blocks[0].mixer.out_proj.out_features
    x = torch.randn(info["batch_size"], info["seq_len"], d, requires_grad=True)
    fast_mixer, lstm_mixer = fast_model.blocks[0].mixer, lstm_model.blocks[0].mixer

    def run(mixer):
        def fn():
            y, _ = mixer(x)
            y.sum().backward()
        return fn

    res = time_alternately({"fast_rnn_kernel": (run(fast_mixer), False), "fast_rnn_torch": (run(fast_mixer), True),
                            "lstm": (run(lstm_mixer), False)}, rounds, warmup=2)
    rnn = fast_mixer.rnn
    u = torch.randn(info["batch_size"], info["seq_len"], rnn.hidden, requires_grad=True)
    ln = dict(ln_weight=rnn.ln.weight, ln_bias=rnn.ln.bias, lam=rnn.lam, eta=rnn.eta, inner_steps=rnn.inner_steps)

    def recurrence(backward):
        def fn():
            y = fast_rnn.fast_rnn_attention(u, rnn.W, **ln)
            if backward:
                y.sum().backward()
        return fn

    rec = time_alternately({"forward": (recurrence(False), False), "forward_backward": (recurrence(True), False)},
                           rounds, warmup=2)
    return {"input": [info["batch_size"], info["seq_len"], d], "one_mixer_forward_backward": res,
            "fast_rnn_recurrence_only_kernel": rec,
            "note": "one_mixer_forward_backward includes the mixer's input and output projections; "
                    "fast_rnn_recurrence_only_kernel is fast_rnn_attention alone (the compiled kernel)"}


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py)."""
    return probes.preset_probes(FAST) + probes.preset_probes(LSTM)



def main() -> int:
    parser = ScriptParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    benchmark_threads_flag(parser)
    args = parser.parse_args()
    use_threads("benchmark", args.threads)
    if step_kernel() is None:
        print("the fast-RNN step kernel is unavailable here (no C compiler?): both fast-RNN rows use torch")
    fast_model, fast_step, fast_info = build(FAST)
    lstm_model, lstm_step, lstm_info = build(LSTM)
    _, fast_torch_step, _ = build(FAST)
    for key in ("batch_size", "seq_len"):
        assert fast_info[key] == lstm_info[key], f"the presets differ in {key}"
    steps = time_alternately({"fast_rnn": (fast_step, False), "lstm": (lstm_step, False),
                              "fast_rnn_torch_backend": (fast_torch_step, True)}, args.rounds, args.warmup)
    ratio = steps["fast_rnn"]["steps_per_s"] / steps["lstm"]["steps_per_s"]
    ratio_torch = steps["fast_rnn_torch_backend"]["steps_per_s"] / steps["lstm"]["steps_per_s"]
    param_diff = fast_info["parameters"] / lstm_info["parameters"] - 1
    payload = {
        "what": "LM training steps/s on CPU, fast-weights RNN preset vs LSTM preset, matched parameters",
        "step": "forward + cross-entropy + backward + grad clip + AdamW (the preset's train settings), random tokens",
        "clock": "process CPU time, one thread, models alternated round by round, median of the rounds",
        "threads": torch.get_num_threads(),
        "kernel_available": step_kernel() is not None,
        "presets": {FAST: fast_info, LSTM: lstm_info},
        "parameter_difference": f"{100 * param_diff:+.2f}% ({fast_info['parameters']:,} vs {lstm_info['parameters']:,})",
        "results": steps,
        "ratio": {"fast_rnn/lstm steps_per_s": round(ratio, 3),
                  "fast_rnn_torch_backend/lstm steps_per_s": round(ratio_torch, 3),
                  "target": TARGET, "met": ratio >= TARGET},
        "headline": [
            {"what": f"fast-weights RNN LM training steps/s / LSTM LM's, CPU, 1 thread, {FAST} vs {LSTM} "
                     f"({fast_info['parameters']:,} vs {lstm_info['parameters']:,} parameters, "
                     f"B={fast_info['batch_size']} T={fast_info['seq_len']}; process CPU time, median)",
             "value": round(ratio, 3), "unit": "x", "target": f">= {TARGET}"},
            {"what": "  same, the fast-weights RNN without its compiled kernel (the torch fallback)",
             "value": round(ratio_torch, 3), "unit": "x"},
        ],
        "kernel_vs_torch_backend": agreement(fast_model),
        "breakdown": mixer_breakdown(fast_model, lstm_model, fast_info, max(5, args.rounds // 2)),
    }
    write_result("bench_fast_rnn_vs_lstm", payload)
    for name, r in steps.items():
        print(f"{name:24s} {r['cpu_ms_median']:8.1f} ms/step  {r['steps_per_s']:.3f} steps/s")
    print(f"fast_rnn / lstm steps/s: {ratio:.3f} (target {TARGET}); torch backend: {ratio_torch:.3f}; "
          f"parameters {payload['parameter_difference']}")
    return 0


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
