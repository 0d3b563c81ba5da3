"""The gradient self-check of flash-linear-attention's gated delta-rule backward (issue 51, scope 1): where fla
refuses that backward by version (fla 0.6 on Hopper with 3.4.0 <= Triton < 3.7.1, fla issue 640; the condition is
:func:`fastweights.ops.fla_backend.refuses_gated_backward`), ``delta_rule(..., backend="auto")`` trains a gated call
through fla anyway when a one-time check on this device says fla's gradients are right there, and through the
compiled chunkwise form (today's path) otherwise.

The check (:func:`run_gated_backward_check`): a small random problem (:data:`CHECK_SHAPE`, at the call's head sizes
K and V and its kernel dtype, fla's default chunk 64, the L2 norm in the kernel as the ``gdn`` layer calls it), fla's
forward and backward with its guard lifted against the project's chunkwise form in fp32 on the same rounded inputs
(autocast and TF32 off), loss ``<o, do> + <final state, dht>`` with random ``do``, ``dht``. It passes when the
relative error ``||fla - ref|| / ||ref||`` of ``o`` and the final state is within :data:`BF16_OUT_TOL` and that of
every input gradient (q, k, v, beta, g, the initial state) within :data:`BF16_GRAD_TOL`: the tolerances of the GPU
queue's ``grad/*`` items, which read them from here.

The verdict is kept per :func:`check_key` (the device's name and compute capability, torch's, Triton's and fla's
versions, K, V, the dtype) in ``fla_gated_backward.json`` in the user's cache folder
(:func:`fastweights.core.files.user_cache_dir`: ``fastweights`` in ``$XDG_CACHE_HOME``, else in the home's
``.cache``), so a
new Triton (or fla, torch, GPU) checks again; a corrupt file or entry is ignored and rewritten. Each process decides
once per device, head sizes, dtype and mode (:func:`fla_gated_backward_allowed`) and logs its decision once, on the
delta rule's logger, with the reason: the check passed (its largest relative error) or failed (the worst error
against its tolerance), the verdict came from the cache file, the check could not run (any error in it: the compiled
form is kept and nothing is stored), or the variable below forced the path.

``FASTWEIGHTS_FLA_GATED_BACKWARD`` (:data:`MODE_ENV`): ``check`` (the default: as above), ``fla`` (take fla's gated
backward without checking), ``safe`` (keep the compiled form without checking); any other value is a UserError.

fla 0.6's refusal is the module flag ``fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1``, read when the gated backward runs
(``chunk_bwd_dqkwg``), not when the forward does: a context manager around the forward would not cover the backward.
So once fla's gated backward is taken (the check passed, or ``fla`` forced), :func:`lift_fla_guard` sets that flag
for the whole process, and the log line says so; it covers every gated backward of fla in the process (fla's own
layers too). The check itself lifts it only while it runs.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import time

import torch
import torch.nn.functional as F

from fastweights.core.compare import relative_error
from fastweights.core.errors import UserError
from fastweights.core.files import merge_into_json_cache, user_cache_dir
from fastweights.ops.delta_rule_chunked import delta_rule_chunk_major
from fastweights.ops.fla_backend import fla_delta_rule, logger
from fastweights.ops.linear_attention import no_autocast

BF16_OUT_TOL = 2e-2  # ||fla - ref|| / ||ref|| of the output and final state, bf16 kernel vs our fp32 reference
BF16_GRAD_TOL = 5e-2  # the same for each input gradient
MODE_ENV = "FASTWEIGHTS_FLA_GATED_BACKWARD"
MODES = ("check", "fla", "safe")
CACHE_FILE = "fla_gated_backward.json"
CHECK_SHAPE = dict(B=2, T=256, H=2)  # four of fla's 64-token chunks, two heads
FLA_GUARD_MODULE, FLA_GUARD_FLAG = "fla.ops.common.chunk_o", "TRITON_ABOVE_3_7_1"  # fla 0.6's gated-backward guard

_DECISIONS: dict[tuple, bool] = {}  # (mode, device, K, V, dtype) -> fla's gated backward taken, once per process


def gated_backward_mode() -> str:
    """``FASTWEIGHTS_FLA_GATED_BACKWARD`` (one of :data:`MODES`, default ``check``); a UserError for any other."""
    mode = os.environ.get(MODE_ENV, "check")
    if mode not in MODES:
        raise UserError(f"{MODE_ENV} must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type  # the CPU stand-in's tests
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} sm_{major}{minor}"


def triton_version_text() -> str:
    """The installed Triton's version (an ImportError where there is none: the check then cannot run)."""
    return importlib.import_module("triton").__version__


def check_key(device: torch.device, dk: int, dv: int, dtype: torch.dtype) -> str:
    """What the verdict depends on: the device and its capability, torch, Triton, fla, K, V and the dtype."""
    fields = {
        "device": _device_name(device),
        "torch": torch.__version__,
        "triton": triton_version_text(),
        "fla": importlib.import_module("fla").__version__,
        "K": dk,
        "V": dv,
        "dtype": str(dtype).replace("torch.", ""),
    }
    return "|".join(f"{name}={value}" for name, value in fields.items())


def _guard_module():
    module = importlib.import_module(FLA_GUARD_MODULE)
    if not hasattr(module, FLA_GUARD_FLAG):
        raise RuntimeError(f"{FLA_GUARD_MODULE} has no {FLA_GUARD_FLAG}: not the guard of fla 0.6 this check lifts")
    return module


def lift_fla_guard() -> bool:
    """Set fla's gated-backward guard flag True for the whole process; returns its value before."""
    module = _guard_module()
    before = getattr(module, FLA_GUARD_FLAG)
    setattr(module, FLA_GUARD_FLAG, True)
    return before


def _check_inputs(device, dk, dv, dtype):
    """The check's random problem, drawn from a private generator (the caller's random stream is not touched):
    the kernel inputs rounded to ``dtype`` and the fp32 ones (g, the initial state, do, dht)."""
    b, t, h = CHECK_SHAPE["B"], CHECK_SHAPE["T"], CHECK_SHAPE["H"]
    gen = torch.Generator().manual_seed(51)
    q = torch.randn(b, t, h, dk, generator=gen)
    k = torch.randn(b, t, h, dk, generator=gen)
    v = torch.randn(b, t, h, dv, generator=gen)
    beta = torch.rand(b, t, h, generator=gen) * 0.9 + 0.05
    g = -torch.rand(b, t, h, generator=gen) * 0.1
    h0 = 0.1 * torch.randn(b, h, dk, dv, generator=gen)
    do = torch.randn(b, t, h, dv, generator=gen)
    dht = torch.randn(b, h, dk, dv, generator=gen)
    low = [x.to(device=device, dtype=dtype) for x in (q, k, v, beta)]
    return low, [x.to(device) for x in (g, h0, do, dht)]


def run_gated_backward_check(device: torch.device, dk: int, dv: int, dtype: torch.dtype) -> dict:
    """fla's gated forward and backward (guard lifted while it runs) against the chunkwise form in fp32 on the same
    rounded inputs: ``{"passed", "rel_err", "tolerance", "worst", "shape", "seconds"}`` (module docstring)."""
    t0 = time.perf_counter()
    low, (g, h0, do, dht) = _check_inputs(device, dk, dv, dtype)
    names = ["q", "k", "v", "beta", "g", "h0"]

    def run(fn, xs):
        leaves = [x.detach().clone().requires_grad_() for x in xs]
        o, ht = fn(*leaves)
        loss = (o.float() * do).sum() + (ht.float() * dht).sum()
        return o.detach(), ht.detach(), dict(zip(names, torch.autograd.grad(loss, leaves)))

    def fla_call(q, k, v, beta, g_, s0):
        return fla_delta_rule(q, k, v, beta, None, s0, True, g_, True)

    def reference(q, k, v, beta, g_, s0):
        q, k = F.normalize(q, dim=-1, eps=1e-6), F.normalize(k, dim=-1, eps=1e-6)
        return delta_rule_chunk_major(q, k, v, beta, dk ** -0.5, s0, g_, 64)

    module = _guard_module()
    before = lift_fla_guard()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        with torch.enable_grad(), no_autocast(device):
            o, ht, grads = run(fla_call, low + [g, h0])
            torch.backends.cuda.matmul.allow_tf32 = False
            ref_o, ref_ht, ref_grads = run(reference, [x.float() for x in low] + [g, h0])
        errs = {"o": relative_error(o, ref_o), "final_state": relative_error(ht, ref_ht)}
        errs.update({f"d{n}": relative_error(grads[n], ref_grads[n]) for n in names})
        tol = {key: BF16_OUT_TOL if key in ("o", "final_state") else BF16_GRAD_TOL for key in errs}
        wrong = sorted(key for key in errs if not errs[key] <= tol[key])  # a NaN is wrong
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        setattr(module, FLA_GUARD_FLAG, before)  # the check leaves the guard as it found it
    worst = max(errs, key=lambda key: errs[key] / tol[key] if errs[key] == errs[key] else float("inf"))
    return {"passed": not wrong, "rel_err": {key: round(x, 6) for key, x in errs.items()}, "tolerance": tol,
            "worst": worst, "wrong": wrong, "shape": dict(CHECK_SHAPE, K=dk, V=dv),
            "seconds": round(time.perf_counter() - t0, 2)}


def _cache_path():
    return user_cache_dir() / CACHE_FILE


def _load_verdict(key: str) -> dict | None:
    """The stored verdict of ``key``, or None (none stored, an unreadable or corrupt file, a malformed entry)."""
    try:
        verdict = json.loads(_cache_path().read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    if not (isinstance(verdict, dict) and isinstance(verdict.get("passed"), bool)):
        return None
    errs, worst = verdict.get("rel_err"), verdict.get("worst")
    ok = isinstance(errs, dict) and all(isinstance(x, (int, float)) for x in errs.values()) \
        and isinstance(worst, str) and worst in errs
    return verdict if ok else None


def _store_verdict(key: str, verdict: dict) -> None:
    """Merge one verdict into the cache file (read, add, atomic replace); an unwritable cache folder keeps the
    decision in this process only."""
    try:
        merge_into_json_cache(_cache_path(), (key,), verdict)
    except OSError as e:
        logger.debug("fla gated-backward verdict not stored (%s)", e)


def _describe(verdict: dict) -> str:
    worst = verdict["worst"]
    return (f"largest relative error {verdict['rel_err'][worst]:.4g} in {worst} against "
            f"{verdict.get('tolerance', {}).get(worst, BF16_GRAD_TOL):g}")


def _decide(mode: str, device: torch.device, dk: int, dv: int, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether to take fla's gated backward, and why (the log line's reason)."""
    lifted = f"fla's guard {FLA_GUARD_MODULE}.{FLA_GUARD_FLAG} set True for the whole process"
    if mode == "safe":
        return False, f"{MODE_ENV}=safe"
    if mode == "fla":
        lift_fla_guard()
        return True, f"{MODE_ENV}=fla, unchecked; {lifted}"
    try:
        key = check_key(device, dk, dv, dtype)
        verdict = _load_verdict(key)
        if verdict is not None:
            source = f"the verdict cached in {_cache_path()}"
        else:
            verdict = run_gated_backward_check(device, dk, dv, dtype)
            _store_verdict(key, verdict)
            source = f"the check on this device ({verdict['seconds']:g} s)"
        if not verdict["passed"]:
            return False, f"{source}: failed, {_describe(verdict)}"
        lift_fla_guard()  # held while every later backward runs, not only around this call's forward
        return True, f"{source}: passed, {_describe(verdict)}; {lifted}"
    except Exception as e:  # anything going wrong in the check keeps today's path
        return False, f"the check could not run ({type(e).__name__}: {e})"


def fla_gated_backward_allowed(device: torch.device, dk: int, dv: int, dtype: torch.dtype) -> bool:
    """Whether ``"auto"`` trains a gated call fla refuses by version through fla's kernel anyway (module docstring):
    decided once per process for each device, head sizes, dtype and mode, and logged once with the reason."""
    mode = gated_backward_mode()
    memo = (mode, str(device), dk, dv, dtype)
    if memo not in _DECISIONS:
        allowed, why = _decide(mode, device, dk, dv, dtype)
        _DECISIONS[memo] = allowed
        logger.log(logging.INFO if mode == "safe" else logging.WARNING,
                   "delta_rule: fla's gated backward, which fla refuses on this device by version, %s for K=%d V=%d "
                   "%s on %s: %s", "TAKEN" if allowed else "not taken (the compiled form)", dk, dv,
                   str(dtype).replace("torch.", ""), device, why)
    return _DECISIONS[memo]
