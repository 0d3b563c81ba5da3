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
matmuls. Outside autocast fp32 inputs stay on the PyTorch form, whose fp32 arithmetic fla's Triton
kernels (TF32 products) would not reproduce.

Choice (:func:`select_backend`, a pure function tested on the CPU): ``"auto"`` takes fla when it is
importable, the tensors are on CUDA and the kernel dtype is fp16/bf16, with two exceptions on Hopper (sm_90),
both read in fla 0.6.0's source:

- fla refuses its own gated backward (``chunk_bwd_dqkwg``) on Hopper with 3.4.0 <= Triton < 3.7.1 (wrong
  results, fla issue 640) unless its TileLang backend takes that function over (``tilelang`` importable with
  a usable nvcc). There ``"auto"`` trains a gated call through ``"compiled"``, the project's chunkwise form
  compiled with ``torch.compile``; wherever fla allows the gated backward (another GPU, Triton < 3.4 or
  >= 3.7.1, or TileLang), ``"auto"`` takes it (:func:`refuses_gated_backward`).
- fla issue 984 reports the ungated delta rule's backward (``prepare_wy_repr_bwd``) wrong in ``dk`` and
  ``dbeta`` at chunk size 64 on Hopper with Triton >= 3.4, and right at 16 and 32. Until the GPU queue's
  gradient check (``benchmarks/gpu/gpu_queue.py``, item ``grad/delta_c64``) has measured it here, ``"auto"``
  trains an ungated call there through fla at chunk size 32 (fla >= 0.5.2 takes ``chunk_size`` in 16, 32,
  64), or through ``"compiled"`` where fla is older (:func:`delta_chunk64_reported_wrong`,
  :func:`fla_chunk_size`). fla 0.6.0 already restricts that kernel to 2 warps on Hopper (its pull request
  988, the fix of issue 984); the avoidance stays until a measurement here shows chunk 64 right.

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

logger = logging.getLogger("fastweights.ops.delta_rule")
_logged: set[tuple] = set()


@functools.lru_cache(maxsize=1)
def _fla_functions():
    """fla's chunk kernels, or None when flash-linear-attention (or Triton) cannot be imported."""
    try:
        delta = importlib.import_module("fla.ops.delta_rule")
        gated = importlib.import_module("fla.ops.gated_delta_rule")
        return delta.chunk_delta_rule, gated.chunk_gated_delta_rule
    except Exception:  # ImportError, or Triton failing to initialise without a GPU
        return None


def fla_available() -> bool:
    """Whether flash-linear-attention's delta-rule kernels can be imported."""
    return _fla_functions() is not None


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


HOPPER = 9  # compute capability major of the H100 / H200
GATED_BWD_BAD_TRITON = ((3, 4, 0), (3, 7, 1))  # fla 0.6's guard in chunk_bwd_dqkwg: [from, to) on Hopper (#640)
DELTA_CHUNK64_BAD_TRITON = (3, 4, 0)  # fla issue 984: Hopper with Triton >= 3.4, chunk 64 wrong, 16 / 32 right
SAFE_DELTA_CHUNK = 32  # a chunk size fla issue 984 reports right
FLA_CHUNK_SIZE_FROM = (0, 5, 2)  # chunk_delta_rule(..., chunk_size=16|32|64): read in fla 0.5.2's and 0.6.0's source


def refuses_gated_backward(capability_major: int | None, triton_version: tuple[int, ...],
                           tilelang_takes_it: bool = False) -> bool:
    """Whether fla 0.6 refuses the gated delta-rule backward: on Hopper with 3.4.0 <= Triton < 3.7.1, unless
    its TileLang backend takes ``chunk_bwd_dqkwg`` over (fla's own condition, ``fla/ops/common/chunk_o.py``)."""
    low, high = GATED_BWD_BAD_TRITON
    return capability_major == HOPPER and low <= tuple(triton_version) < high and not tilelang_takes_it


def delta_chunk64_reported_wrong(capability_major: int | None, triton_version: tuple[int, ...]) -> bool:
    """Whether fla's ungated delta-rule backward at chunk size 64 is reported wrong here (fla issue 984:
    Hopper with Triton >= 3.4; not yet measured by this project's GPU queue)."""
    return capability_major == HOPPER and tuple(triton_version) >= DELTA_CHUNK64_BAD_TRITON


def fla_chunk_size(gated: bool, needs_grad: bool, chunk64_reported_wrong: bool) -> int | None:
    """The chunk size to ask of fla's kernel: ``SAFE_DELTA_CHUNK`` for an ungated call that trains where
    chunk 64 is reported wrong, else None (fla's default, 64). Decided at the forward: fla saves its
    chunk-sized matrices for the backward."""
    return SAFE_DELTA_CHUNK if (not gated and needs_grad and chunk64_reported_wrong) else None


def _capability_major(device: torch.device) -> int | None:
    return torch.cuda.get_device_capability(device)[0]


def _triton_version() -> tuple[int, ...]:
    import triton

    return _version_tuple(triton.__version__)


def _tilelang_takes_gated_backward() -> bool:
    """fla's own answer: its TileLang backend of ``chunk_bwd_dqkwg`` is installed, usable and enabled, and
    fla's backend dispatch is on. False when it cannot be asked (fla < 0.6 has no such backend)."""
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


def fla_delta_chunk64_reported_wrong(device: torch.device) -> bool:
    """:func:`delta_chunk64_reported_wrong` for ``device`` (True when it cannot tell)."""
    if device.type != "cuda":
        return False
    try:
        return delta_chunk64_reported_wrong(_capability_major(device), _triton_version())
    except Exception:
        return True


def fla_takes_chunk_size() -> bool:
    """Whether the installed fla's ``chunk_delta_rule`` takes ``chunk_size`` (fla >= 0.5.2)."""
    try:
        fla = importlib.import_module("fla")
        return _version_tuple(getattr(fla, "__version__", "0")) >= FLA_CHUNK_SIZE_FROM
    except Exception:
        return False


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
    fla_delta_chunk64_reported_wrong: bool = False,
    fla_takes_chunk_size: bool = True,
) -> str:
    """Decide "torch", "compiled" or "fla" for a delta-rule call (``dtype``: the kernel dtype).

    ``"torch"`` / ``"compiled"`` force the PyTorch form (eager / ``torch.compile``); ``"fla"`` forces
    flash-linear-attention and raises UserError when it is not importable or the tensors are not on
    CUDA; ``"auto"`` picks fla for CUDA fp16/bf16 (or autocast) with fla importable, except the compiled
    form for a call that needs a gradient where fla's backward is refused or reported wrong and cannot be
    avoided: a gated call where fla refuses the gated backward, an ungated one where chunk 64 is reported
    wrong and fla cannot be asked for another chunk size (see :func:`fla_chunk_size`); else torch.
    """
    if backend not in BACKENDS:
        raise UserError(f"delta_rule: unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend in ("torch", "compiled"):
        return backend
    if backend == "fla":
        if not fla_ok:
            raise UserError(
                "delta_rule: backend='fla' needs flash-linear-attention and triton "
                "(pip install flash-linear-attention), which cannot be imported here"
            )
        if device_type not in FLA_DEVICE_TYPES:
            raise UserError(f"delta_rule: backend='fla' runs on CUDA tensors only, got {device_type} tensors")
        return "fla"
    if not (fla_ok and device_type in FLA_DEVICE_TYPES and dtype in LOW_PRECISION):
        return "torch"
    if gated and needs_grad and fla_refuses_gated_backward:
        return "compiled"
    if not gated and needs_grad and fla_delta_chunk64_reported_wrong and not fla_takes_chunk_size:
        return "compiled"
    return "fla"


_WHY = {
    "fla": "flash-linear-attention's kernels",
    "torch": "the chunkwise PyTorch form: fla not importable, not on CUDA, or fp32 outside autocast",
}


def log_choice_once(requested: str, chosen: str, device_type: str, dtype: torch.dtype, gated: bool,
                    needs_grad: bool, fla_chunk: int | None = None) -> None:
    """Log each distinct backend decision once per process (``fla_chunk``: the chunk size asked of fla,
    None for its default)."""
    key = (requested, chosen, device_type, dtype, gated, needs_grad, fla_chunk)
    if key in _logged:
        return
    _logged.add(key)
    avoided = fla_chunk is not None or (chosen == "compiled" and requested != "compiled")
    if chosen == "fla" and fla_chunk is not None:
        why = (f"flash-linear-attention's kernel at chunk size {fla_chunk}: fla issue 984 reports its delta-rule "
               "backward wrong in dk and dbeta at chunk 64 on Hopper with Triton >= 3.4, not yet measured here")
    elif chosen == requested:
        why = "as requested"
    elif chosen == "compiled" and gated:
        why = ("fla refuses the gated backward on this GPU (Hopper, 3.4 <= Triton < 3.7.1, no TileLang): the "
               "chunkwise form compiled with torch.compile")
    elif chosen == "compiled":
        why = ("fla issue 984 reports fla's delta-rule backward wrong at chunk 64 on this GPU (Hopper, Triton >= "
               "3.4) and this fla cannot be asked for chunk 32 (fla < 0.5.2): the chunkwise form compiled with "
               "torch.compile")
    else:
        why = _WHY[chosen]
    level = logging.WARNING if avoided else logging.INFO
    logger.log(level, "delta_rule: backend=%r -> %r for %s %s %s, %s (%s)", requested, chosen, device_type,
               str(dtype).replace("torch.", ""), "gated" if gated else "ungated",
               "training" if needs_grad else "no grad", why)


def fla_delta_rule(q, k, v, beta, scale, initial_state, output_final_state, log_decay, qk_l2norm,
                   chunk_size: int | None = None):
    """Call fla's kernel with the contract of the module docstring: q, k, v, beta cast to the kernel
    dtype, g and the state fp32; ``chunk_size`` passed on only when given (fla's default is 64).
    Returns ``(o in the kernel dtype, final state fp32 or None)``."""
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
