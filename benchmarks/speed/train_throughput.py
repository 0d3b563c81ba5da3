"""Training throughput of our presets' models against a plain nanoGPT-shape Transformer of the same size written
inline here, measured in the same run (forward + backward + AdamW step, random characters).

    python benchmarks/speed/train_throughput.py [--batch 32 --seq-len 128] [--threads 1]

Models, each at the same batch and sequence length: the demo's (preset ``shakespeare-char``: RMSNorm, RoPE,
SwiGLU), the same with every linear on torch's kernel (``FASTWEIGHTS_LINEAR=torch``: the share of the gain that is
the CPU linear of ``fastweights.ops.linear``), the fast weight programmer (``shakespeare-char-fwp-delta-dpfp``) and
FwPKM (``longdocs-fwpkm``'s model), and the nanoGPT shape (learned positions, LayerNorm, GELU MLP, tied embeddings)
as a user would run it (eager, torch's linears). The models take turns in rounds, so that load on a shared machine
hits them alike; each ratio is the median over rounds of (nanoGPT's time / the model's), measured back to back.

Writes benchmarks/results/train_throughput.json. Target: the demo's model >= 1.2x nanoGPT's tokens/s.

Where each step's time goes (``time_shares``): the profiler's share of GEMMs, of attention's fused kernels and of
everything else (norms, activations, rotary, the optimizer), per model. ``ratio_if_only_gemm_and_attention`` is
the ratio over nanoGPT the demo's model would reach if everything but its GEMMs and attention cost nothing: the
bound that no elementwise fusion can pass. When it is below the target, the target needs fewer FLOPs or faster
GEMM and attention kernels than nanoGPT's, not leaner glue.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

from fastweights.evidence.result_files import write_result
from fastweights.cli.script_parser import ScriptParser, exit_status_of
from fastweights.core.threads import use_threads
from fastweights.evidence.script_args import benchmark_threads_flag
from fastweights.evidence.timing import bench_clock, op_shares, timed_rounds, upper_median

from fastweights.core.config import make_config
from fastweights.loops.schedule import make_optimizer
from fastweights.models.lm import LanguageModel


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


MODELS = {  # name -> (preset, FASTWEIGHTS_LINEAR)
    "demo": ("shakespeare-char", "auto"),
    "demo_torch_linear": ("shakespeare-char", "torch"),
    "fwp_delta_dpfp": ("shakespeare-char-fwp-delta-dpfp", "auto"),
    "fwpkm": ("longdocs-fwpkm", "auto"),
}
TARGET = 1.2


def step_fn(model, opt, x, y, ours, route="auto"):
    def step():
        os.environ["FASTWEIGHTS_LINEAR"] = route
        if ours:
            out = model(x, targets=y)
            loss = out.loss if out.aux_loss is None else out.loss + out.aux_loss
        else:
            loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py)."""
    return [spec for preset in dict.fromkeys(p for p, _ in MODELS.values()) for spec in probes.preset_probes(preset)]


def main():
    ap = ScriptParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=65)
    ap.add_argument("--repeat", type=int, default=5, help="timed steps per model per round (median)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    benchmark_threads_flag(ap, note="; 0: torch's default")
    a = ap.parse_args()
    if a.threads:
        use_threads("benchmark", a.threads)
    dev = torch.device(a.device)
    overrides = [f"model.vocab_size={a.vocab}", f"train.batch_size={a.batch}", f"train.seq_len={a.seq_len}"]
    x = torch.randint(0, a.vocab, (a.batch, a.seq_len), device=dev, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, a.vocab, (a.batch, a.seq_len), device=dev, generator=torch.Generator().manual_seed(2))
    models, fns = {}, {}
    for name, (preset, route) in MODELS.items():
        torch.manual_seed(0)
        cfg = make_config(preset, overrides)
        models[name] = LanguageModel(cfg.model).to(dev)
        fns[name] = step_fn(models[name], make_optimizer(models[name], cfg.train), x, y, True, route)
    demo = models["demo"].config
    torch.manual_seed(0)
    models["nanogpt"] = NanoGPT(a.vocab, demo.d_model, demo.n_layers, demo.n_heads, a.seq_len).to(dev)
    fns["nanogpt"] = step_fn(models["nanogpt"], torch.optim.AdamW(models["nanogpt"].parameters(), 1e-3), x, y, False)
    clock, clock_name = bench_clock(dev)
    times = timed_rounds(fns, a.rounds, a.repeat, clock)
    ratios = {k: [n / t for n, t in zip(times["nanogpt"], v)] for k, v in times.items() if k != "nanogpt"}
    os.environ.pop("FASTWEIGHTS_LINEAR", None)
    sec = {k: upper_median(v) for k, v in times.items()}
    tokens = a.batch * a.seq_len
    ratio = {k: upper_median(v) for k, v in ratios.items()}
    shares = {k: op_shares(f) for k, f in fns.items()}
    bound = sec["nanogpt"] / (sec["demo"] * (shares["demo"]["gemm"] + shares["demo"]["attention"]))
    res = {"config": vars(a), "clock": clock_name, "models": {k: list(v) for k, v in MODELS.items()},
           "time_shares": shares, "ratio_if_only_gemm_and_attention": bound,
           "parameters": {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()},
           "tokens_per_s": {k: tokens / s for k, s in sec.items()}, "ratio_per_round": ratios,
           "ratio_over_nanogpt": ratio, "linear_route_speedup": ratio["demo"] / ratio["demo_torch_linear"],
           "target_ratio": TARGET}
    where = f"{a.device}, {torch.get_num_threads()} thread(s), d={demo.d_model}, L={demo.n_layers}"
    res["headline"] = [{"what": f"LM training tokens/s, demo model / nanoGPT-shape ({where})",
                        "value": round(ratio["demo"], 3), "target": f">= {TARGET}"}]
    res["headline"] += [{"what": f"LM training tokens/s, {k} / nanoGPT-shape ({where})", "value": round(v, 3)}
                        for k, v in ratio.items() if k != "demo"]
    res["headline"].append({"what": f"the same, demo model, bound if all but its GEMMs and attention were free ({where})",
                            "value": round(bound, 3)})
    print(res)
    write_result("train_throughput", res)


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
