"""A stand-in for flash-linear-attention's two delta-rule kernels, so that the dispatch to fla can be tested
on a CPU (issue 34): ``install(monkeypatch)`` puts modules ``fla.ops.delta_rule`` and
``fla.ops.gated_delta_rule`` into ``sys.modules`` and lets the backend choice treat CPU tensors as
fla's device.

Each stand-in kernel checks fla's input contract (``fastweights.ops.fla_backend``'s docstring):

    q, k [B, T, H, K], v [B, T, H, V], beta [B, T, H]: one dtype, fp16 or bf16
    g [B, T, H] fp32;  initial_state [B, H, K, V] fp32 (or None)

records the call, and computes with the project's per-step reference in fp32 (differentiable), returning
``o`` in the inputs' dtype and the final state in fp32, as fla does. ``chunk_size`` is taken as fla 0.6 takes
it (a keyword, 16, 32 or 64, default 64; anything else a ValueError) and recorded. ``WRONG_CHUNK64 = True``
imitates fla issue 984 (fla < 0.6.0 on Hopper): the ungated rule's gradients of k and beta come out halved at
chunk size 64 (for the tests of the GPU queue's gradient check). ``install(..., version=...)`` makes it answer to
another fla version (an fla older than the dispatch's floor).

fla 0.6's refusal of the gated backward (issue 51): the module ``fla.ops.common.chunk_o`` holds fla's flags
``IS_NVIDIA_HOPPER``, ``TRITON_ABOVE_3_4_0``, ``TRITON_ABOVE_3_7_1`` (all False: no refusal), and the gated kernel's
backward raises, when it runs, where ``IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1``, as fla's
``chunk_bwd_dqkwg`` does; :func:`refuse_gated_backward` sets the flags so (a Hopper GPU with Triton 3.6.0).
``WRONG_GATED = True`` makes the gated rule's gradients of k and g come out halved (what fla issue 640 reports).
"""

from __future__ import annotations

import importlib
import sys
import types

import torch
import torch.nn.functional as F

from fastweights.ops.delta_rule import delta_rule_recurrent

LOW = (torch.float16, torch.bfloat16)
VERSION = "0.6.0+standin"  # the fla version the stand-in answers to (its chunk_size keyword is 0.6's)
WRONG_CHUNK64 = False
WRONG_GATED = False
GUARD_MODULE = "fla.ops.common.chunk_o"


class Contract(AssertionError):
    pass


def _check(q, k, v, beta, g, initial_state):
    b, t, h, dk = q.shape
    problems = []
    if q.dtype not in LOW:
        problems.append(f"q is {q.dtype}, fla takes fp16/bf16")
    for name, x in (("k", k), ("v", v), ("beta", beta)):
        if x.dtype != q.dtype:
            problems.append(f"{name} is {x.dtype}, q is {q.dtype}")
    if k.shape != q.shape or v.shape[:3] != (b, t, h) or beta.shape != (b, t, h):
        problems.append(f"layout: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} beta {tuple(beta.shape)}")
    if g is not None and (g.dtype != torch.float32 or g.shape != (b, t, h)):
        problems.append(f"g must be fp32 [B, T, H], got {g.dtype} {tuple(g.shape)}")
    if initial_state is not None and (initial_state.dtype != torch.float32
                                      or initial_state.shape != (b, h, dk, v.shape[-1])):
        problems.append(f"initial_state must be fp32 [B, H, K, V], got {initial_state.dtype} "
                        f"{tuple(initial_state.shape)}")
    if problems:
        raise Contract("; ".join(problems))


def _halve_grad(x):
    if x.requires_grad:
        x.register_hook(lambda grad: grad * 0.5)
    return x


class _GatedBackwardGuard(torch.autograd.Function):
    """Identity on the gated kernel's output whose backward refuses as fla 0.6's ``chunk_bwd_dqkwg`` does: reading
    ``chunk_o``'s flags when the backward runs."""

    @staticmethod
    def forward(ctx, o):
        return o.view_as(o)

    @staticmethod
    def backward(ctx, grad):
        flags = sys.modules[GUARD_MODULE]
        if flags.IS_NVIDIA_HOPPER and flags.TRITON_ABOVE_3_4_0 and not flags.TRITON_ABOVE_3_7_1:
            raise RuntimeError("stand-in of fla 0.6's guard: the gated backward (chunk_bwd_dqkwg) is refused on Hopper "
                               "with 3.4.0 <= Triton < 3.7.1 (fla issue 640)")
        return grad


def _run(rule, q, k, v, beta, g, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, **extra):
    _check(q, k, v, beta, g, initial_state)
    chunk_size = extra.pop("chunk_size", 64)
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"`chunk_size` must be 16, 32, or 64, got {chunk_size}.")
    CALLS.append({"rule": rule, "q": q, "k": k, "v": v, "beta": beta, "g": g, "initial_state": initial_state,
                  "scale": scale, "output_final_state": output_final_state, "l2norm": use_qk_l2norm_in_kernel,
                  "chunk_size": chunk_size, "extra": extra, "grad": torch.is_grad_enabled() and q.requires_grad})
    qf, kf = q.float(), k.float()
    if WRONG_CHUNK64 and rule == "delta" and chunk_size == 64 and torch.is_grad_enabled():
        kf, beta = _halve_grad(kf * 1), _halve_grad(beta * 1)
    if WRONG_GATED and rule == "gated" and torch.is_grad_enabled():
        kf, g = _halve_grad(kf * 1), _halve_grad(g * 1)
    if use_qk_l2norm_in_kernel:
        qf, kf = F.normalize(qf, dim=-1, eps=1e-6), F.normalize(kf, dim=-1, eps=1e-6)
    o, final = delta_rule_recurrent(qf, kf, v.float(), beta.float(), scale=scale, initial_state=initial_state,
                                    output_final_state=output_final_state, log_decay=g)
    o = o.to(q.dtype)
    if rule == "gated" and torch.is_grad_enabled():
        o = _GatedBackwardGuard.apply(o)
    return o, final


def chunk_delta_rule(*, q, k, v, beta, scale=None, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, **extra):
    return _run("delta", q, k, v, beta, None, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                **extra)


def chunk_gated_delta_rule(*, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, **extra):
    return _run("gated", q, k, v, beta, g, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                **extra)


CALLS: list[dict] = []


def install(monkeypatch, version: str = VERSION) -> list[dict]:
    """Make ``fla`` importable as this stand-in (answering to ``version``) and CPU tensors fla's device; returns
    the call log. ``monkeypatch``: pytest's fixture, or anything with its ``setitem`` / ``setattr`` (the GPU
    queue's dry run)."""
    fla_backend = importlib.import_module("fastweights.ops.fla_backend")
    names = ("fla", "fla.ops", "fla.ops.delta_rule", "fla.ops.gated_delta_rule", "fla.ops.common", GUARD_MODULE)
    mods = {name: types.ModuleType(name) for name in names}
    mods["fla"].__version__ = version
    guard = mods[GUARD_MODULE]
    guard.IS_NVIDIA_HOPPER = guard.TRITON_ABOVE_3_4_0 = guard.TRITON_ABOVE_3_7_1 = False
    mods["fla.ops.delta_rule"].chunk_delta_rule = chunk_delta_rule
    mods["fla.ops.gated_delta_rule"].chunk_gated_delta_rule = chunk_gated_delta_rule
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    _clear(fla_backend)
    monkeypatch.setattr(fla_backend, "FLA_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(fla_backend, "_logged", set())
    monkeypatch.setattr(importlib.import_module("fastweights.ops.fla_selfcheck"), "_DECISIONS", {})
    CALLS.clear()
    return CALLS


def refuse_gated_backward(monkeypatch, triton: str = "3.6.0") -> None:
    """Set the stand-in's ``chunk_o`` flags as fla 0.6 sets them on a Hopper GPU with this Triton (3.6.0: refused),
    and make the self-check's cache key read that Triton version (not a ``triton`` module in ``sys.modules``, which
    torch's compiler would take for Triton itself)."""
    guard = sys.modules[GUARD_MODULE]
    version = tuple(int(x) for x in triton.split("."))
    monkeypatch.setattr(guard, "IS_NVIDIA_HOPPER", True)
    monkeypatch.setattr(guard, "TRITON_ABOVE_3_4_0", version >= (3, 4, 0))
    monkeypatch.setattr(guard, "TRITON_ABOVE_3_7_1", version >= (3, 7, 1))
    monkeypatch.setattr(importlib.import_module("fastweights.ops.fla_selfcheck"), "triton_version_text", lambda: triton)


def uninstall() -> None:
    """Forget the stand-in once monkeypatch has restored ``sys.modules`` (fla's import is cached)."""
    _clear(importlib.import_module("fastweights.ops.fla_backend"))


def _clear(fla_backend) -> None:
    """fla_backend caches fla's import and the reason it cannot be used: forget both."""
    fla_backend._fla_functions.cache_clear()
    fla_backend.fla_unusable_reason.cache_clear()
