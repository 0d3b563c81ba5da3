"""Where a training step of the hybrid keeps its memory: peak resident memory of one step (forward, backward, AdamW)
of the GPU queue's hybrid shape, scaled down for a CPU, with the loss through the logits (``F.cross_entropy`` of
the [B, T, V] logits) and without them (``ops.linear_cross_entropy``, what the trainer uses), with the MLP's
plain SwiGLU instead of ``ops.swiglu`` (which recomputes silu(gate) in the backward), with the gdn layer's
plain norm and gate instead of ``ops.gated_rms_norm``, and with its convolution's output kept for the silu
(``layers.common.causal_conv1d_silu_reference``) instead of recomputed (``causal_conv1d_silu``); and the
tensors autograd keeps for the backward, by the part of the model that keeps them (issue 51, scope 2).

    python benchmarks/speed/train_memory.py [--batch 2 --seq-len 1024 --vocab 32000]

The model: ``benchmarks/gpu/cuda_scale.py``'s hybrid (gated delta rule layers, every 4th layer attention, SwiGLU,
tied 32k vocabulary) at d_model 256 and 4 layers, fp32. Each variant runs in its own process: its peak resident
set size (getrusage) before the step, once the model, optimizer and batch exist, and after it; the difference is
the step's memory (activations, the loss's tensors, gradients, AdamW's moments). The saving is also given in units
of one fp32 [B T, V] tensor, the size of each copy the plain loss keeps (logits, their log-softmax, its gradient).
The saved tensors (``torch.autograd.graph.saved_tensors_hooks``, each storage counted once, parameters left out)
are attributed to the innermost of the embedding, each block's mixer (by kind; its projections apart from what it
computes inline), MLP and norms, and the loss.
Step time: the fastest of :data:`STEPS` steps, CPU seconds, one thread. Each variant runs in ``--repeats``
processes: the step memory is the median process's (resident memory moves by tens of MB between processes of
the same variant, so only the loss's saving is larger than that noise; the MLP's and the norm's are read from
the saved tensors), the step time the fastest.

Writes benchmarks/results/train_memory.json.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys

from fastweights.cli.script_parser import ScriptParser, exit_status_of
from fastweights.core.threads import use_threads
from fastweights.evidence.result_files import write_result
from fastweights.evidence.script_args import benchmark_threads_flag
from fastweights.evidence.timing import upper_median
from fastweights.testing.memory_use import saved_by_part

# name -> (return_logits, the plain forms swapped in: (module, name there, plain form in fastweights.ops.X or
# fastweights.layers.X))
VARIANTS = {"logits": (True, ()), "without_logits": (False, ()),
            "plain_swiglu": (False, (("fastweights.layers.common", "swiglu", "swiglu.swiglu_reference"),)),
            "plain_gdn_norm": (False, (("fastweights.layers.gdn", "gated_rms_norm",
                                        "gated_rms_norm.gated_rms_norm_reference"),)),
            "plain_conv_silu": (False, (("fastweights.layers.gdn", "causal_conv1d_silu",
                                         "layers.common.causal_conv1d_silu_reference"),))}
STEPS = 3
GDN = "mixer:GatedDeltaNet"  # what the gated delta rule layers keep in their own ops
SHAPE = dict(d_model=256, n_layers=4, n_heads=4, head_dim=64, mlp=768, attn_every=4)


def config(vocab: int):
    from fastweights.core.config import ModelConfig

    mixers = ["attention" if (i + 1) % SHAPE["attn_every"] == 0 else "gdn" for i in range(SHAPE["n_layers"])]
    options = {"gdn": {"head_dim": SHAPE["head_dim"]}, "attention": {"head_dim": SHAPE["head_dim"]}}
    return ModelConfig(vocab_size=vocab, d_model=SHAPE["d_model"], n_layers=SHAPE["n_layers"],
                       n_heads=SHAPE["n_heads"], mlp_hidden=SHAPE["mlp"], layer_mixers=mixers, options=options)


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code measured: the hybrid model (its training loss and gradients)."""
    import dataclasses

    return probes.model_probes(dataclasses.asdict(config(32000)))


def child(variant: str, batch: int, seq_len: int, vocab: int) -> dict:
    """Steps in this process: peak RSS (MB) before and after the first, the saved tensors by part, the loss, the
    fastest step's CPU seconds."""
    import time

    import torch

    import importlib

    from fastweights.evidence.timing import samples
    from fastweights.models.lm import LanguageModel

    use_threads("benchmark", 1)
    return_logits, plain_forms = VARIANTS[variant]
    for module, name, plain in plain_forms:  # a baseline only this script builds
        where, _, fn = plain.rpartition(".")
        where = f"fastweights.{where}" if where.startswith("layers.") else f"fastweights.ops.{where}"
        setattr(importlib.import_module(module), name, getattr(importlib.import_module(where), fn))
    torch.manual_seed(0)
    model = LanguageModel(config(vocab)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (batch, seq_len), generator=g)
    y = torch.randint(0, vocab, (batch, seq_len), generator=g)
    losses = []

    def step():
        opt.zero_grad(set_to_none=True)
        out = model(x, targets=y, return_logits=return_logits)
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    step()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    times = [s for (s,) in samples(step, STEPS, clocks=(time.process_time,))]
    saved = saved_by_part(model, step)
    return {"rss_before_mb": before, "rss_peak_mb": after, "step_mb": after - before, "loss": losses[0],
            "step_cpu_s": min(times), "saved_mb_by_part": saved, "saved_mb": sum(saved.values()),
            "parameters": sum(p.numel() for p in model.parameters())}


def main() -> int:
    ap = ScriptParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=5, help="processes per variant")
    ap.add_argument("--child", choices=sorted(VARIANTS), help=argparse_suppress())
    benchmark_threads_flag(ap)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.batch, a.seq_len, a.vocab)))
        return 0
    runs = {}
    for name in VARIANTS:
        cmd = [sys.executable, __file__, "--child", name, "--batch", str(a.batch), "--seq-len", str(a.seq_len),
               "--vocab", str(a.vocab)]
        each = [json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
                for _ in range(a.repeats)]
        # resident memory varies by tens of MB between processes (the allocator): the median process's; the
        # fastest step; the saved tensors and the loss are the same in every process
        runs[name] = {**each[0], "step_mb": upper_median([r["step_mb"] for r in each]),
                      "step_mb_each": [r["step_mb"] for r in each],
                      "step_cpu_s": min(r["step_cpu_s"] for r in each)}
        print(name, runs[name])
    nv_mb = a.batch * a.seq_len * a.vocab * 4 / 2**20
    saved = runs["logits"]["step_mb"] - runs["without_logits"]["step_mb"]
    ours, plain = runs["without_logits"], runs["plain_swiglu"]
    f_wide_mb = a.batch * a.seq_len * SHAPE["mlp"] * 4 / 2**20 * SHAPE["n_layers"]  # one [B T, F] fp32 per MLP
    res = {"config": {"batch": a.batch, "seq_len": a.seq_len, "vocab": a.vocab, **SHAPE, "dtype": "float32"},
           "runs": runs, "fp32_logits_mb": nv_mb, "saved_mb": saved, "saved_in_fp32_logits": saved / nv_mb,
           "step_mb_ratio": runs["logits"]["step_mb"] / runs["without_logits"]["step_mb"],
           "same_loss": abs(runs["logits"]["loss"] - runs["without_logits"]["loss"]) < 1e-4,
           "swiglu": {"mlp_saved_mb": {"plain": plain["saved_mb_by_part"]["mlp"], "ours": ours["saved_mb_by_part"]["mlp"]},
                      "one_f_wide_tensor_per_layer_mb": f_wide_mb,
                      "saved_mb_ratio": ours["saved_mb"] / plain["saved_mb"],
                      "step_time_ratio": ours["step_cpu_s"] / plain["step_cpu_s"],
                      "same_loss": ours["loss"] == plain["loss"]},
           "gdn_norm": {"gdn_saved_mb": {"plain": runs["plain_gdn_norm"]["saved_mb_by_part"][GDN],
                                         "ours": ours["saved_mb_by_part"][GDN]},
                        "saved_mb_ratio": ours["saved_mb"] / runs["plain_gdn_norm"]["saved_mb"],
                        "step_time_ratio": ours["step_cpu_s"] / runs["plain_gdn_norm"]["step_cpu_s"],
                        "loss_difference": abs(ours["loss"] - runs["plain_gdn_norm"]["loss"])},
           "conv_silu": {"gdn_saved_mb": {"plain": runs["plain_conv_silu"]["saved_mb_by_part"][GDN],
                                          "ours": ours["saved_mb_by_part"][GDN]},
                         "saved_mb_ratio": ours["saved_mb"] / runs["plain_conv_silu"]["saved_mb"],
                         "step_time_ratio": ours["step_cpu_s"] / runs["plain_conv_silu"]["step_cpu_s"],
                         "loss_difference": abs(ours["loss"] - runs["plain_conv_silu"]["loss"])}}
    res["headline"] = [
        {"what": f"hybrid training step (d {SHAPE['d_model']}, {SHAPE['n_layers']} layers, vocab {a.vocab}, "
                 f"{a.batch}x{a.seq_len} tokens, fp32, CPU): step memory with the logits / without them",
         "value": round(res["step_mb_ratio"], 3), "unit": "x", "target": ""},
        {"what": "  memory the loss without logits saves, in fp32 [tokens, vocab] tensors",
         "value": round(res["saved_in_fp32_logits"], 2), "unit": "x", "target": ""},
        {"what": "  tensors kept for the backward, SwiGLU recomputing silu(gate) / the plain form",
         "value": round(res["swiglu"]["saved_mb_ratio"], 3), "unit": "x", "target": "< 1"},
        {"what": "  step time, SwiGLU recomputing silu(gate) / the plain form", "unit": "x", "target": "",
         "value": round(res["swiglu"]["step_time_ratio"], 3)},
        {"what": "  tensors kept for the backward, gdn's norm and gate keeping o and the gate / the plain form",
         "value": round(res["gdn_norm"]["saved_mb_ratio"], 3), "unit": "x", "target": "< 1"},
        {"what": "  step time, gdn's norm and gate recomputing / the plain form", "unit": "x", "target": "",
         "value": round(res["gdn_norm"]["step_time_ratio"], 3)},
        {"what": "  tensors kept for the backward, gdn's convolution recomputed before its silu / the plain form",
         "value": round(res["conv_silu"]["saved_mb_ratio"], 3), "unit": "x", "target": "< 1"},
        {"what": "  step time, gdn's convolution recomputed / the plain form", "unit": "x", "target": "",
         "value": round(res["conv_silu"]["step_time_ratio"], 3)}]
    write_result("train_memory", res)
    return 0


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
