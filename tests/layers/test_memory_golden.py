"""FwPKM and FwMLP reproduce stored outputs and gradients exactly (fp64), so that a refactor of their
files is shown to change no number.

The published long-context results (``niah_token.json``, ``stream_memory.json``) were measured with
these layers; re-running them costs CPU-hours. ``tests/data/memory_golden.pt`` holds, for every
option set those benchmarks use (the ``niah-token`` preset's memory with its ablations, the stream
benchmark's memory, and the FwMLP baseline) on a small size, the outputs of two calls with the state
carried, and the gradients of a fixed function of the outputs with respect to the input and every
parameter, written by the code the results were measured with. A change in behaviour fails here;
a change meant to alter behaviour regenerates the file (``PYTHONPATH=tests python
tests/layers/test_memory_golden.py --write``) in the same commit, and then the benchmarks it covers are stale by their own rule.
"""

from __future__ import annotations

import sys

import pytest
import torch

from fastweights.layers.fwmlp import FwMLP, FwMLPOptions
from fastweights.layers.fwpkm import FwPKM, FwPKMOptions
from helpers import DATA

GOLDEN = DATA / "memory_golden.pt"
D_MODEL, BATCH, T1, T2 = 8, 2, 20, 14  # two calls: 20 then 14 tokens (chunk 8: boundaries inside both calls)
SMALL = dict(n_subkeys=6, d_key=8, d_value=8, topk=3, chunk_size=8)
# option sets of the published runs (niah_token: the preset and its ablations; stream_memory: the default
# persistence), at a small size
VARIANTS = {
    "fwpkm-niah": ("fwpkm", dict(SMALL, persistence="per_sequence")),
    "fwpkm-niah-no-lookahead": ("fwpkm", dict(SMALL, persistence="per_sequence", lookahead=0)),
    "fwpkm-niah-frozen": ("fwpkm", dict(SMALL, persistence="per_sequence", frozen=True)),
    "fwpkm-niah-no-addressing": ("fwpkm", dict(SMALL, persistence="per_sequence", key_update="mse")),
    "fwpkm-niah-keys-fixed": ("fwpkm", dict(SMALL, persistence="per_sequence", key_update="none")),
    "fwpkm-niah-top-all": ("fwpkm", dict(SMALL, persistence="per_sequence", topk=6)),
    "fwpkm-stream": ("fwpkm", dict(SMALL)),
    "fwpkm-official": ("fwpkm", dict(SMALL, persistence="official")),
    "fwpkm-dot-literal-drop": ("fwpkm", dict(SMALL, score="dot", update_scale="literal", boundary="drop")),
    "fwmlp-niah": ("fwmlp", dict(d_key=8, d_value=8, hidden=16, chunk_size=8, persistence="per_sequence")),
    "fwmlp-stream": ("fwmlp", dict(d_key=8, d_value=8, hidden=16, chunk_size=8)),
}


def run_variant(kind: str, options: dict) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    # built in fp64 from the first weight: an fp32 initialisation carries the last bits of the CPU's vectorised
    # normal_ kernel, which differ between ATEN_CPU_CAPABILITY default, avx2 and avx512
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        layer = FwPKM(D_MODEL, FwPKMOptions(**options)) if kind == "fwpkm" else FwMLP(D_MODEL, FwMLPOptions(**options))
    finally:
        torch.set_default_dtype(dtype)
    x = torch.randn(BATCH, T1 + T2, D_MODEL, dtype=torch.float64, requires_grad=True)
    w = torch.randn(BATCH, T1 + T2, D_MODEL, dtype=torch.float64)
    y1, state = layer(x[:, :T1])
    y2, _ = layer(x[:, T1:], state)
    y = torch.cat([y1, y2], 1)  # [B, T1 + T2, d]
    loss = (y * w).sum() + (y ** 2).sum()
    names = [n for n, p in layer.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [x] + [dict(layer.named_parameters())[n] for n in names], allow_unused=True)
    out = {"y": y.detach(), "grad_x": grads[0]}
    for n, g in zip(names, grads[1:]):
        out[f"grad.{n}"] = torch.zeros(()) if g is None else g
    return out


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_outputs_and_gradients_match_the_stored_ones(variant):
    golden = torch.load(GOLDEN, weights_only=True)[variant]
    got = run_variant(*VARIANTS[variant])
    assert sorted(got) == sorted(golden), "the layer's parameters changed"
    for key, want in golden.items():
        torch.testing.assert_close(got[key], want, rtol=1e-9, atol=1e-11, msg=lambda m: f"{variant} {key}: {m}")


def test_every_variant_responds_to_its_input():
    # the stored numbers are not trivially zero: a golden file of zeros would pass any refactor
    golden = torch.load(GOLDEN, weights_only=True)
    for variant, tensors in golden.items():
        assert tensors["y"].abs().max() > 1e-3, variant
        assert tensors["grad_x"].abs().max() > 1e-3, variant


if __name__ == "__main__" and "--write" in sys.argv:
    GOLDEN.parent.mkdir(exist_ok=True)
    torch.save({name: run_variant(*spec) for name, spec in VARIANTS.items()}, GOLDEN)
    print(f"wrote {GOLDEN}")
