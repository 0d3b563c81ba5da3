"""Where a training step of the hybrid keeps its memory: peak resident memory of one step (forward, backward, AdamW)
of the GPU queue's hybrid shape, scaled down for a CPU, with the loss through the logits (``F.cross_entropy`` of
the [B, T, V] logits) and without them (``ops.linear_cross_entropy``, what the trainer uses; issue 51, scope 2).

    python benchmarks/speed/train_memory.py [--batch 2 --seq-len 1024 --vocab 32000]

The model: ``benchmarks/gpu/cuda_scale.py``'s hybrid (gated delta rule layers, every 4th layer attention, SwiGLU,
tied 32k vocabulary) at d_model 256 and 4 layers, fp32. Each variant runs in its own process: its peak resident
set size (getrusage) before the step, once the model, optimizer and batch exist, and after it; the difference is
the step's memory (activations, the loss's tensors, gradients, AdamW's moments). The saving is also given in units
of one fp32 [B T, V] tensor, the size of each copy the plain loss keeps (logits, their log-softmax, its gradient).

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

VARIANTS = {"logits": True, "without_logits": False}  # name -> return_logits
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
    """One step in this process: peak RSS (MB) before and after, and the loss."""
    import torch

    from fastweights.models.lm import LanguageModel

    use_threads("benchmark", 1)
    torch.manual_seed(0)
    model = LanguageModel(config(vocab)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (batch, seq_len), generator=g)
    y = torch.randint(0, vocab, (batch, seq_len), generator=g)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = model(x, targets=y, return_logits=VARIANTS[variant])
    out.loss.backward()
    opt.step()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"rss_before_mb": before, "rss_peak_mb": after, "step_mb": after - before, "loss": out.loss.item(),
            "parameters": sum(p.numel() for p in model.parameters())}


def main() -> int:
    ap = ScriptParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
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
        runs[name] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        print(name, runs[name])
    nv_mb = a.batch * a.seq_len * a.vocab * 4 / 2**20
    saved = runs["logits"]["step_mb"] - runs["without_logits"]["step_mb"]
    res = {"config": {"batch": a.batch, "seq_len": a.seq_len, "vocab": a.vocab, **SHAPE, "dtype": "float32"},
           "runs": runs, "fp32_logits_mb": nv_mb, "saved_mb": saved, "saved_in_fp32_logits": saved / nv_mb,
           "step_mb_ratio": runs["logits"]["step_mb"] / runs["without_logits"]["step_mb"],
           "same_loss": abs(runs["logits"]["loss"] - runs["without_logits"]["loss"]) < 1e-4}
    res["headline"] = [
        {"what": f"hybrid training step (d {SHAPE['d_model']}, {SHAPE['n_layers']} layers, vocab {a.vocab}, "
                 f"{a.batch}x{a.seq_len} tokens, fp32, CPU): step memory with the logits / without them",
         "value": round(res["step_mb_ratio"], 3), "unit": "x", "target": ""},
        {"what": "  memory the loss without logits saves, in fp32 [tokens, vocab] tensors",
         "value": round(res["saved_in_fp32_logits"], 2), "unit": "x", "target": ""}]
    write_result("train_memory", res)
    return 0


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
