"""Training-step time of the fast-weights RNN against a plain per-step loop with an explicit A.

Measures, in one run and on one thread, a full training step (forward, MSE loss, backward, Adam)
of one fast-weights RNN layer (input 128 -> H units) at B=32, T=128, H=128:

* ``plain_loop``: the model written as a straightforward per-step loop, autograd through an
  explicit A [B, H, H] (``A @ h`` read, ``lam A + eta h h^T`` write, C applied per step);
* ``plain_loop_rowread``: the same loop with the read written as the row product h^T A^T, which is
  much faster on CPU (a stronger baseline);
* ``ours_attention`` / ``ours_matrix`` / ``ours_auto``: :class:`FastWeightRNN` with each read mode.

It also times forward+backward of the two read modes over T/H ratios (to choose ``auto``) and
token-by-token generation. Variants are interleaved round by round; the medians are reported, in
wall-clock and in process CPU time. Output: benchmarks/results/bench_fast_rnn.json.

    python benchmarks/speed/bench_fast_rnn.py [--rounds 7] [--tiny]
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from fastweights.evidence.result_files import command_line, provenance
from fastweights.cli.script_parser import ScriptParser, exit_status_of
from fastweights.core.threads import use_threads
from fastweights.evidence.script_args import benchmark_threads_flag
from fastweights.evidence.timing import WALL_AND_CPU, call_seconds, interleaved_samples

from fastweights.layers.fast_rnn import FastWeightRNN

LAM, ETA = 0.95, 0.5


def plain_loop(rnn: FastWeightRNN, x: torch.Tensor, row_read: bool) -> torch.Tensor:
    """The fast-weights RNN (S = 1, LN) as one would first write it: explicit A, autograd, per-step C."""
    B, T, _ = x.shape
    H = rnn.hidden
    h = x.new_zeros(B, H)
    A = x.new_zeros(B, H, H)
    outs = []
    for t in range(T):
        b = h @ rnn.W.T + rnn.in_proj(x[:, t])
        h0 = torch.relu(rnn.ln(b))
        read = (h0.unsqueeze(1) @ A.transpose(1, 2)).squeeze(1) if row_read else (A @ h0.unsqueeze(-1)).squeeze(-1)
        h = torch.relu(rnn.ln(b + read))
        A = LAM * A + ETA * h.unsqueeze(-1) * h.unsqueeze(-2)
        outs.append(h)
    return torch.stack(outs, 1)


def summarise(samples: list[tuple[float, float]]) -> dict:
    wall = [s[0] for s in samples]
    cpu = [s[1] for s in samples]
    return {
        "wall_ms_median": round(1e3 * statistics.median(wall), 3),
        "wall_ms_min": round(1e3 * min(wall), 3),
        "cpu_ms_median": round(1e3 * statistics.median(cpu), 3),
        "cpu_ms_min": round(1e3 * min(cpu), 3),
        "samples": len(samples),
    }


def training_step_comparison(B: int, T: int, H: int, rounds: int) -> dict:
    torch.manual_seed(0)
    rnn = FastWeightRNN(H, H, lam=LAM, eta=ETA)
    x = torch.randn(B, T, H)
    target = torch.randn(B, T, H)
    opt = torch.optim.Adam(rnn.parameters(), lr=1e-4)

    def forward_of(name):
        if name.startswith("plain_loop"):
            return lambda: plain_loop(rnn, x, row_read=name == "plain_loop_rowread")
        rnn.read_mode = name.removeprefix("ours_")
        return lambda: rnn(x)[0]

    names = ["plain_loop", "plain_loop_rowread", "ours_attention", "ours_matrix", "ours_auto"]

    # same parameters, same answer: outputs and gradients of every variant against the plain loop
    agreement = {}
    grads = {}
    for name in names:
        opt.zero_grad(set_to_none=True)
        y = forward_of(name)()
        F.mse_loss(y, target).backward()
        grads[name] = (y.detach(), [p.grad.clone() for p in rnn.parameters()])
    y_ref, g_ref = grads["plain_loop"]
    for name in names[1:]:
        y, g = grads[name]
        agreement[name] = {
            "max_abs_output_diff": float((y - y_ref).abs().max()),
            "max_abs_grad_diff": max(float((a - b).abs().max()) for a, b in zip(g, g_ref)),
        }

    def step(name):
        fwd = forward_of(name)

        def run():
            opt.zero_grad(set_to_none=True)
            F.mse_loss(fwd(), target).backward()
            opt.step()

        return run

    samples = {name: [] for name in names}
    for name in names:  # warm-up
        step(name)()
    for _ in range(rounds):
        for name in names:
            samples[name].append(call_seconds(step(name), WALL_AND_CPU))
    results = {name: summarise(s) for name, s in samples.items()}
    ratios = {}
    for base in ("plain_loop", "plain_loop_rowread"):
        for ours in ("ours_attention", "ours_auto", "ours_matrix"):
            for clock in ("wall", "cpu"):
                key = f"{base}/{ours} ({clock} median)"
                ratios[key] = round(results[base][f"{clock}_ms_median"] / results[ours][f"{clock}_ms_median"], 3)
    rnn.read_mode = "auto"
    return {
        "shape": {"B": B, "T": T, "H": H, "input": H, "inner_steps": 1, "lam": LAM, "eta": ETA, "layer_norm": True},
        "auto_picks": rnn.resolve_read_mode(T, grad=True),
        "step": "forward + MSE loss + backward + Adam",
        "results": results,
        "speedup": ratios,
        "agreement_with_plain_loop": agreement,
    }


def read_mode_sweep(B: int, H: int, ratios: list[float], rounds: int) -> list[dict]:
    """Forward+backward time of the two read modes as T / H grows (to place ``auto``); the
    attention form folds its history into A every H steps."""
    torch.manual_seed(0)
    rnn = FastWeightRNN(H, H, lam=LAM, eta=ETA)
    rows = []
    for ratio in ratios:
        T = max(1, int(round(ratio * H)))
        x = torch.randn(B, T, H)

        def run(mode):
            rnn.read_mode = mode
            rnn.zero_grad(set_to_none=True)
            rnn(x)[0].square().mean().backward()

        samples = interleaved_samples({mode: (lambda m=mode: run(m)) for mode in ("attention", "matrix")}, rounds)
        res = {mode: summarise(s) for mode, s in samples.items()}
        rows.append(
            {
                "B": B,
                "T": T,
                "H": H,
                "attention": res["attention"],
                "matrix": res["matrix"],
                "matrix/attention (cpu median)": round(
                    res["matrix"]["cpu_ms_median"] / res["attention"]["cpu_ms_median"], 3
                ),
            }
        )
    rnn.read_mode = "auto"
    return rows


@torch.no_grad()
def generation_comparison(B: int, H: int, tokens: int, rounds: int) -> dict:
    """Token-by-token streaming (T = 1 per call, state carried), no gradients."""
    torch.manual_seed(0)
    rnn = FastWeightRNN(H, H, lam=LAM, eta=ETA)
    x = torch.randn(B, tokens, H)

    def run(mode):
        rnn.read_mode = mode
        state = None
        for t in range(tokens):
            _, state = rnn(x[:, t : t + 1], state)

    samples = interleaved_samples({mode: (lambda m=mode: run(m)) for mode in ("attention", "matrix", "auto")}, rounds)
    res = {mode: summarise(s) for mode, s in samples.items()}
    for mode in res:
        res[mode]["cpu_ms_per_token_median"] = round(res[mode]["cpu_ms_median"] / tokens, 4)
    res["shape"] = {"B": B, "H": H, "tokens": tokens}
    rnn.read_mode = "auto"
    res["auto_picks"] = rnn.resolve_read_mode(1, grad=False)
    res["matrix/attention (cpu median)"] = round(res["matrix"]["cpu_ms_median"] / res["attention"]["cpu_ms_median"], 3)
    return res


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "note": "shared machine (other jobs ran at the same time): absolute times are noisy; "
        "compare the ratios, measured in the same run with interleaved rounds",
    }


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py)."""
    return [probes.probe("layer", role="mixer", name="fast_rnn")]



def main() -> int:
    parser = ScriptParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    benchmark_threads_flag(parser)
    parser.add_argument("--tiny", action="store_true", help="the dry run: tiny shapes, for a smoke run")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results" / "bench_fast_rnn.json")
    args = parser.parse_args()
    use_threads("benchmark", args.threads)
    if args.tiny:
        main_shape, sweep, gen = (4, 16, 16), (4, 16, [0.5, 2.0]), (2, 16, 8)
    else:
        main_shape, sweep, gen = (32, 128, 128), (8, 64, [0.25, 1.0, 4.0, 16.0]), (8, 128, 128)
    report = {
        **provenance(),  # command, date, git commit and dirty flag
        "command": command_line(program="python"),
        "machine": machine(),
        "training_step": training_step_comparison(*main_shape, rounds=args.rounds),
        "read_mode_sweep": read_mode_sweep(sweep[0], sweep[1], sweep[2], rounds=max(3, args.rounds // 2)),
        "generation": generation_comparison(*gen, rounds=max(3, args.rounds // 2)),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    ts = report["training_step"]
    print(json.dumps({"speedup": ts["speedup"], "auto_picks": ts["auto_picks"]}, indent=2))
    for row in report["read_mode_sweep"]:
        print(f"T={row['T']:5d} H={row['H']}: matrix/attention {row['matrix/attention (cpu median)']}")
    print("generation matrix/attention", report["generation"]["matrix/attention (cpu median)"])
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
