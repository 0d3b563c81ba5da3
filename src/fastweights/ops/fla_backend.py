"""flash-linear-attention (fla) as a backend of :func:`fastweights.ops.delta_rule.delta_rule`.

The contract with fla's ``chunk_delta_rule`` / ``chunk_gated_delta_rule`` (the same equations as the
project's delta rule, S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = scale S_t^T q_t):

    q, k [B, T, H, K], v [B, T, H, V], beta [B, T, H]   in the kernel dtype (fp16 or bf16)
    g [B, T, H]                                          log decay, fp32
    initial_state, final state [B, H, K, V]              fp32 (fla keeps its state in fp32)
    o [B, T, H, V]                                       in the kernel dtype

The kernel dtype (:func:`kernel_dtype`) is the inputs' own dtype when they are fp16/bf16, and under
autocast the autocast dtype for fp32 inputs: the layers compute their feature maps, gates and
normalisations in fp32 (exactness, and the fast weight stays fp32) and the cast to the kernel dtype
happens here, right before the kernel, as fla's own layers hand it the bf16 outputs of autocast's
matmuls. Inputs already in the kernel dtype, and g and the state already fp32, reach the kernel as they
are (no copy). Outside autocast fp32 inputs stay on the PyTorch form, whose fp32 arithmetic fla's Triton
kernels (TF32 products) would not reproduce.

fla older than ``FLA_MIN_VERSION`` (0.6.0, the floor of the ``gpu`` extra in pyproject.toml) counts as
absent: ``"auto"`` takes the PyTorch form and says why once, ``"fla"`` is a UserError. Older fla's ungated
backward is reported wrong in ``dk`` and ``dbeta`` at its default chunk size 64 on Hopper with Triton >= 3.4
(fla issue 984); fla 0.6.0 carries the fix (its pull request 988: that kernel limited to 2 warps on Hopper),
and the GPU queue measured it right here (``benchmarks/results/gpu_queue_grad_delta_c64.json``: H200,
Triton 3.6.0, fla 0.6.0, B=4, T=8192, H=12, K=128, V=64, fp32 reference: relative error 0.006 in dk and 0.005
in dbeta against a tolerance of 0.05, as right as chunk 32). So the ungated rule runs at fla's default chunk
size wherever fla runs, and the gated rule's refusal below is fla 0.6.0's own condition.

Choice (:func:`select_backend`, a pure function tested on the CPU): ``"auto"`` takes fla when it is
importable (and >= 0.6.0), the tensors are on CUDA and the kernel dtype is fp16/bf16, with one exception:
fla refuses its own gated backward (``chunk_bwd_dqkwg``) on Hopper (sm_90) with 3.4.0 <= Triton < 3.7.1
(wrong results, fla issue 640) unless its TileLang backend takes that function over (``tilelang``
importable with a usable nvcc). There ``"auto"`` trains a gated call through ``"compiled"``, the project's
chunkwise form compiled with ``torch.compile``; wherever fla allows the gated backward (another GPU,
Triton < 3.4 or >= 3.7.1, or TileLang), ``"auto"`` takes it (:func:`refuses_gated_backward`). Where fla refuses
it, ``"auto"`` does not take fla's word for every shape either way: a one-time gradient check on the device
(:mod:`fastweights.ops.fla_selfcheck`: a small random problem at the call's head sizes and dtype, fla's forward and
backward against the chunkwise form in fp32, the GPU queue's ``grad/*`` tolerances) decides, its verdict cached per
device, torch, Triton and fla version under the user's cache folder; passing, fla's guard is lifted for the whole
process (the log line says so); failing, or any error in it, keeps the compiled form.
``FASTWEIGHTS_FLA_GATED_BACKWARD=check|fla|safe`` (default ``check``) forces either path (``fla``: fla's backward
unchecked; ``safe``: the compiled form). ``backend="fla"`` is fla as it is, its guard included. Why: the GPU queue
found the bypassed kernel right at our shape (H200, Triton 3.6.0, B=4/16, H=12, K=V=64, L2 norm in the kernel: every
relative error below 0.006 against 0.05, at T=8192 and T=2048; ``gpu_queue_grad_gated_c64*.json``), and the price of
the compiled form there: the ``gdn`` layer trains at 6.2x fla's ``GatedDeltaNet`` layer on it, and at 1.05x on fla's
kernel (``gpu_queue_like_gdn_layer_T8192.json``).

Each distinct choice is logged once per process (logger ``fastweights.ops.delta_rule``), not per call.
"""

from __future__ import annotations

import functools
import importlib
import logging

import torch

from fastweights.core.errors import UserError

BACKENDS = ("auto", "torch", "compiled", "fla")
LOW_PRECISION = (torch.float16, torch.bfloat16)
FLA_DEVICE_TYPES = ("cuda",)  # device types fla's Triton kernels run on (tests add "cpu" with a stand-in fla)
FLA_MIN_VERSION = (0, 6, 0)  # the gpu extra's floor in pyproject.toml (tests/ops/test_fla_dispatch.py holds them equal)

logger = logging.getLogger("fastweights.ops.delta_rule")
_logged: set[tuple] = set()


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _fla_too_old(fla) -> str | None:
    """Why the imported ``fla`` module is not used (older than FLA_MIN_VERSION), or None."""
    found = getattr(fla, "__version__", "unknown")
    if _version_tuple(found) >= FLA_MIN_VERSION:
        return None
    need = ".".join(map(str, FLA_MIN_VERSION))
    return (f"flash-linear-attention {found} is older than {need}, whose ungated backward is reported wrong at chunk "
            f"64 on Hopper (fla issue 984): pip install 'flash-linear-attention>={need}'")


@functools.lru_cache(maxsize=1)
def _fla_functions():
    """fla's chunk kernels, or None when flash-linear-attention (or Triton) cannot be imported or fla is older
    than FLA_MIN_VERSION (:func:`fla_unusable_reason` says which)."""
    try:
        if _fla_too_old(importlib.import_module("fla")):
            return None
        delta = importlib.import_module("fla.ops.delta_rule")
        gated = importlib.import_module("fla.ops.gated_delta_rule")
        return delta.chunk_delta_rule, gated.chunk_gated_delta_rule
    except Exception:  # ImportError, or Triton failing to initialise without a GPU
        return None


def fla_available() -> bool:
    """Whether flash-linear-attention's delta-rule kernels (fla >= FLA_MIN_VERSION) can be imported."""
    return _fla_functions() is not None


@functools.lru_cache(maxsize=1)
def fla_unusable_reason() -> str | None:
    """None when fla's kernels can be used; else why not, in one line (not importable, or too old)."""
    if _fla_functions() is not None:
        return None
    try:
        fla = importlib.import_module("fla")
    except Exception:
        return "flash-linear-attention and triton (pip install flash-linear-attention) cannot be imported here"
    return _fla_too_old(fla) or "flash-linear-attention's delta-rule kernels (or triton) cannot be imported here"


HOPPER = 9  # compute capability major of the H100 / H200
GATED_BWD_BAD_TRITON = ((3, 4, 0), (3, 7, 1))  # fla 0.6's guard in chunk_bwd_dqkwg: [from, to) on Hopper (#640)


def refuses_gated_backward(capability_major: int | None, triton_version: tuple[int, ...],
                           tilelang_takes_it: bool = False) -> bool:
    """Whether fla 0.6 refuses the gated delta-rule backward: on Hopper with 3.4.0 <= Triton < 3.7.1, unless
    its TileLang backend takes ``chunk_bwd_dqkwg`` over (fla's own condition, ``fla/ops/common/chunk_o.py``)."""
    low, high = GATED_BWD_BAD_TRITON
    return capability_major == HOPPER and low <= tuple(triton_version) < high and not tilelang_takes_it


def _capability_major(device: torch.device) -> int | None:
    return torch.cuda.get_device_capability(device)[0]


def _triton_version() -> tuple[int, ...]:
    import triton

    return _version_tuple(triton.__version__)


def _tilelang_takes_gated_backward() -> bool:
    """fla's own answer: its TileLang backend of ``chunk_bwd_dqkwg`` is installed, usable and enabled, and
    fla's backend dispatch is on. False when it cannot be asked."""
    try:
        backends = importlib.import_module("fla.backends")
        tilelang = importlib.import_module("fla.ops.common.backends.tilelang")
        backend = tilelang.CommonTileLangBackend
        return (not getattr(backends, "_DISPATCH_DISABLED", False)) and bool(backend.is_available()) \
            and bool(backend().is_enabled())
    except Exception:
        return False


def fla_refuses_gated_backward(device: torch.device) -> bool:
    """:func:`refuses_gated_backward` for ``device`` (True when it cannot tell: do not risk it)."""
    if device.type != "cuda":
        return False
    try:
        return refuses_gated_backward(_capability_major(device), _triton_version(), _tilelang_takes_gated_backward())
    except Exception:
        return True


def kernel_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype fla's kernels run ``x`` in: fp16/bf16 stay; fp32 under autocast on ``x``'s device
    becomes the autocast dtype (when that is fp16/bf16); anything else stays as it is."""
    if x.dtype in LOW_PRECISION or x.dtype != torch.float32:
        return x.dtype
    dev = x.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
        if dtype in LOW_PRECISION:
            return dtype
    return x.dtype


def select_backend(
    backend: str,
    *,
    device_type: str,
    dtype: torch.dtype,
    gated: bool,
    needs_grad: bool,
    fla_ok: bool,
    fla_refuses_gated_backward: bool = False,
    fla_unusable: str | None = None,
) -> str:
    """Decide "torch", "compiled" or "fla" for a delta-rule call (``dtype``: the kernel dtype).

    ``"torch"`` / ``"compiled"`` force the PyTorch form (eager / ``torch.compile``); ``"fla"`` forces
    flash-linear-attention and raises UserError when it cannot be used (``fla_unusable``: why, for the
    message) or the tensors are not on CUDA; ``"auto"`` picks fla for CUDA fp16/bf16 (or autocast) with fla
    usable, except the compiled form for a gated call that needs a gradient where fla refuses the gated
    backward; else torch.
    """
    if backend not in BACKENDS:
        raise UserError(f"delta_rule: unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend in ("torch", "compiled"):
        return backend
    if backend == "fla":
        if not fla_ok:
            raise UserError(f"delta_rule: backend='fla' cannot run: "
                            f"{fla_unusable or 'flash-linear-attention cannot be imported here'}")
        if device_type not in FLA_DEVICE_TYPES:
            raise UserError(f"delta_rule: backend='fla' runs on CUDA tensors only, got {device_type} tensors")
        return "fla"
    if not (fla_ok and device_type in FLA_DEVICE_TYPES and dtype in LOW_PRECISION):
        return "torch"
    if gated and needs_grad and fla_refuses_gated_backward:
        return "compiled"
    return "fla"


_WHY = {
    "fla": "flash-linear-attention's kernels",
    "torch": "the chunkwise PyTorch form: fla not importable (or too old), not on CUDA, or fp32 outside autocast",
}


def log_choice_once(requested: str, chosen: str, device_type: str, dtype: torch.dtype, gated: bool,
                    needs_grad: bool, fla_unusable: str | None = None) -> None:
    """Log each distinct backend decision once per process: a warning where ``"auto"`` avoids fla on a call
    fla would take (its gated backward refused, or ``fla_unusable``: why fla cannot be used here)."""
    key = (requested, chosen, device_type, dtype, gated, needs_grad, fla_unusable)
    if key in _logged:
        return
    _logged.add(key)
    fla_missing = (requested == "auto" and chosen == "torch" and fla_unusable is not None
                   and device_type in FLA_DEVICE_TYPES and dtype in LOW_PRECISION)
    if chosen == requested:
        why = "as requested"
    elif chosen == "compiled":
        why = ("fla refuses the gated backward on this GPU (Hopper, 3.4 <= Triton < 3.7.1, no TileLang) and its "
               "gradient self-check did not lift that (the line before says why): the chunkwise form compiled with "
               "torch.compile")
    elif fla_missing:
        why = f"the chunkwise PyTorch form: {fla_unusable}"
    else:
        why = _WHY[chosen]
    level = logging.WARNING if chosen == "compiled" and requested != "compiled" or fla_missing else logging.INFO
    logger.log(level, "delta_rule: backend=%r -> %r for %s %s %s, %s (%s)", requested, chosen, device_type,
               str(dtype).replace("torch.", ""), "gated" if gated else "ungated",
               "training" if needs_grad else "no grad", why)


def fla_delta_rule(q, k, v, beta, scale, initial_state, output_final_state, log_decay, qk_l2norm,
                   chunk_size: int | None = None):
    """Call fla's kernel with the contract of the module docstring: q, k, v, beta cast to the kernel
    dtype, g and the state fp32 (each passed as it is when already so: no copy); ``chunk_size`` passed on
    only when given (fla's default is 64, which the dispatch leaves; the GPU queue's gradient checks ask
    for others). Returns ``(o in the kernel dtype, final state fp32 or None)``."""
    chunk_delta, chunk_gated = _fla_functions()
    dtype = kernel_dtype(q)
    q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))
    common = dict(
        scale=scale,
        initial_state=None if initial_state is None else initial_state.float(),
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=qk_l2norm,
    )
    if chunk_size is not None:
        common["chunk_size"] = chunk_size
    if log_decay is None:
        return chunk_delta(q=q, k=k, v=v, beta=beta, **common)
    return chunk_gated(q=q, k=k, v=v, g=log_decay.float(), beta=beta, **common)
