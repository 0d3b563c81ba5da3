"""Summaries of a probe's outputs, and their comparison with one tolerance.

A probe (``probes.py`` beside this file) returns a dict of named outputs: tensors (logits, losses,
gradients), numbers, strings. A stored result keeps, for each output, a short summary line:

    floating tensor   "2x48x96: N S P1 P2"     N = ||t||_2, S = <t, 1>/sqrt(n), Pk = <t, r_k>/sqrt(n)
    anything else     "exact <sha256[:16]>"     integers, booleans, strings, JSON values

where ``r_k`` are fixed +-1 vectors drawn from integer seeds (exact on every machine; no floating-point
random number generator, whose vectorised kernels differ between CPUs, is involved). Every number of a
float line is bounded by N (Cauchy-Schwarz), so two summaries of the same output agree when every
number differs by at most ``RELATIVE_TOLERANCE * max(N_stored, N_now)``.

A behaviour change of one character (a different scale, a dropped term) moves a whole output, so it moves
N or a projection by far more than the tolerance; float rounding -- another CPU's kernels, another
summation order -- moves them by about 1e-13 of N in fp64 and never past it. A tensor that is not all
finite keeps the pattern of its non-finite entries exactly and the summary of the rest.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import torch

# The tolerance, relative to an output's norm. Measured: the fp64 probes of every stored result differ
# between this project's CPU kernels (ATEN_CPU_CAPABILITY=default, avx2, avx512) by at most 1.2e-13 of an
# output's norm (2026-11-28, after every probe path was made fp64 end to end). 1e-9 leaves four orders of
# magnitude above that noise, and lies far below what a change of behaviour moves (a query scale 0.5 ->
# 0.4 moves the delta-rule outputs by about 1e-1 of their norm). Changing it changes what "current" means
# for every stored result: measure the noise again first (tests/evidence/test_kernels.py).
RELATIVE_TOLERANCE = 1e-9
PROJECTIONS = 2  # random +-1 projections per tensor, besides the sum
_SIGNIFICANT = 15  # digits written: the stored rounding (1e-15 of N) stays far below the tolerance


def _signs(n: int, k: int) -> np.ndarray:
    """The k-th fixed +-1 vector of length n (integers from a seeded PCG64 stream: the same everywhere)."""
    return np.random.default_rng(1000 + k).integers(0, 2, n, dtype=np.int8).astype(np.float64) * 2.0 - 1.0


def _float_line(t: np.ndarray) -> str:
    flat = t.reshape(-1)
    n = max(flat.size, 1)
    values = [float(np.linalg.norm(flat)), float(flat.sum()) / np.sqrt(n)]
    values += [float(flat @ _signs(flat.size, k)) / np.sqrt(n) for k in range(PROJECTIONS)]
    return " ".join(f"{v:.{_SIGNIFICANT}g}" for v in values)


def _exact(value: Any) -> str:
    return "exact " + hashlib.sha256(value).hexdigest()[:16]


def summary_line(value: Any) -> str:
    """The summary of one output (see the module docstring)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        value = value.to(torch.float64).numpy() if value.is_floating_point() else value.numpy()
    if isinstance(value, (float, np.floating)):
        value = np.asarray(value, dtype=np.float64)
    if isinstance(value, np.ndarray):
        shape = "x".join(map(str, value.shape)) or "scalar"
        if not np.issubdtype(value.dtype, np.floating):
            return _exact(shape.encode() + np.ascontiguousarray(value.astype(np.int64)).tobytes())
        value = value.astype(np.float64)
        finite = np.isfinite(value)
        if not finite.all():
            pattern = np.where(finite, 0, np.where(np.isnan(value), 1, np.sign(value) + 2)).astype(np.int8)
            shape += " nonfinite " + hashlib.sha256(pattern.tobytes()).hexdigest()[:16]
            value = np.where(finite, value, 0.0)
        return f"{shape}: {_float_line(value)}"
    return _exact(json.dumps(value, sort_keys=True, default=str).encode())


def summarise(outputs: dict[str, Any]) -> dict[str, str]:
    """``{name: summary line}`` of a probe's outputs (keys sorted)."""
    return {key: summary_line(outputs[key]) for key in sorted(outputs)}


def _parse(line: str) -> tuple[str, list[float] | None]:
    if line.startswith("exact "):
        return line, None
    head, _, numbers = line.rpartition(": ")
    return head, [float(v) for v in numbers.split()]


def differences(stored: dict[str, str], now: dict[str, str], rtol: float = RELATIVE_TOLERANCE) -> list[str]:
    """The outputs whose summaries disagree beyond ``rtol`` (each as ``name: why``); empty when they agree."""
    out = []
    for key in sorted(set(stored) | set(now)):
        if key not in now or key not in stored:
            out.append(f"{key}: {'gone' if key not in now else 'new'}")
            continue
        (head_a, a), (head_b, b) = _parse(stored[key]), _parse(now[key])
        if head_a != head_b or (a is None) != (b is None):
            out.append(f"{key}: {stored[key][:40]} -> {now[key][:40]}")
        elif a is not None:
            scale = max(abs(a[0]), abs(b[0]))
            worst = max(abs(x - y) for x, y in zip(a, b)) if len(a) == len(b) else float("inf")
            if worst > rtol * scale:
                out.append(f"{key}: moved by {worst / scale if scale else worst:.2g} of its norm")
    return out
