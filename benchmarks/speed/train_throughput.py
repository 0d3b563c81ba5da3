"""Training throughput of our LanguageModel against a plain nanoGPT-shape Transformer of the same
size written inline here, measured in the same run (forward + backward + AdamW step).

    python benchmarks/speed/train_throughput.py [--d-model 128 --layers 4 --batch 32 --seq-len 128] [--threads 1]

Writes benchmarks/results/train_throughput.json. Target: ours / baseline >= 0.9.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from fastweights.evidence.result_files import write_result
from fastweights.evidence.timing import bench_clock, timeit

from fastweights.core.config import ModelConfig
from fastweights.models.lm import LanguageModel
from fastweights.evidence import probes


class NanoBlock(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class NanoGPT(nn.Module):
    """The nanoGPT shape: learned positions, LayerNorm, GELU MLP, tied embeddings."""

    def __init__(self, vocab, d, layers, heads, block):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.ModuleList(NanoBlock(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = F.linear(self.ln(x), self.wte.weight)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def step_fn(model, opt, x, y, ours):
    def step():
        loss = model(x, targets=y).loss if ours else model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def probe_specs() -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see src/fastweights/evidence/result_files.py)."""
    return probes.preset_probes("shakespeare-char")



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=65)
    ap.add_argument("--repeat", type=int, default=5, help="timed steps per model per round (median)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default); one thread keeps "
                    "the ratio steady when other jobs share the CPU")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    dev = torch.device(a.device)
    ours = LanguageModel(ModelConfig(vocab_size=a.vocab, d_model=a.d_model, n_layers=a.layers, n_heads=a.heads)).to(dev)
    base = NanoGPT(a.vocab, a.d_model, a.layers, a.heads, a.seq_len).to(dev)
    x = torch.randint(0, a.vocab, (a.batch, a.seq_len), device=dev)
    y = torch.randint(0, a.vocab, (a.batch, a.seq_len), device=dev)
    fns = {"ours": step_fn(ours, torch.optim.AdamW(ours.parameters(), 1e-3), x, y, True),
           "nanogpt": step_fn(base, torch.optim.AdamW(base.parameters(), 1e-3), x, y, False)}
    # interleave the two in rounds so that load on a shared machine hits both alike; the ratio is the
    # median over rounds of (baseline time / our time) measured back to back
    clock, clock_name = bench_clock(dev)
    times = {k: [] for k in fns}
    ratios = []
    for _ in range(a.rounds):
        for k, f in fns.items():
            times[k].append(timeit(f, warmup=1, repeat=a.repeat, clock=clock))
        ratios.append(times["nanogpt"][-1] / times["ours"][-1])
    sec = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    tokens = a.batch * a.seq_len
    res = {"config": vars(a), "clock": clock_name,
           "parameters": {"ours": sum(p.numel() for p in ours.parameters()), "nanogpt": sum(p.numel() for p in base.parameters())},
           "tokens_per_s": {k: tokens / s for k, s in sec.items()}, "ratio_per_round": ratios,
           "ratio_ours_over_nanogpt": sorted(ratios)[len(ratios) // 2], "target_ratio": 0.9}
    res["headline"] = [{"what": f"LM training tokens/s, ours / nanoGPT-shape ({a.device}, {torch.get_num_threads()} thread(s), d={a.d_model}, L={a.layers})",
                        "value": round(res["ratio_ours_over_nanogpt"], 3), "target": ">= 0.9"}]
    print(res)
    write_result("train_throughput", res)


if __name__ == "__main__":
    main()
