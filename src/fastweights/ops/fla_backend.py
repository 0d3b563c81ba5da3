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
importable, the tensors are on CUDA and the kernel dtype is fp16/bf16; fla 0.6 refuses the gated
backward on Hopper (sm_90) with Triton < 3.7.1 (wrong results, fla issue 640), and there "auto" takes
``"compiled"``, the project's chunkwise form compiled with ``torch.compile``. Each distinct choice is
logged once per process (logger ``fastweights.ops.delta_rule``), not per call.
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


def fla_refuses_gated_backward(device: torch.device) -> bool:
    """fla 0.6 refuses the gated delta-rule backward on Hopper (sm_90) with Triton < 3.7.1."""
    if device.type != "cuda":
        return False
    try:
        major, _ = torch.cuda.get_device_capability(device)
        import triton

        return major == 9 and _version_tuple(triton.__version__) < (3, 7, 1)
    except Exception:
        return True  # cannot tell: do not risk it


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
) -> str:
    """Decide "torch", "compiled" or "fla" for a delta-rule call (``dtype``: the kernel dtype).

    ``"torch"`` / ``"compiled"`` force the PyTorch form (eager / ``torch.compile``); ``"fla"`` forces
    flash-linear-attention and raises UserError when it is not importable or the tensors are not on
    CUDA; ``"auto"`` picks fla for CUDA fp16/bf16 (or autocast) with fla importable, the compiled form
    for a gated call that needs a gradient where fla refuses the gated backward, else torch.
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
    return "fla"


def log_choice_once(requested: str, chosen: str, device_type: str, dtype: torch.dtype, gated: bool,
                    needs_grad: bool) -> None:
    """Log each distinct backend decision once per process."""
    key = (requested, chosen, device_type, dtype, gated, needs_grad)
    if key in _logged:
        return
    _logged.add(key)
    if chosen == requested:
        why = "as requested"
    else:
        why = {
            "fla": "flash-linear-attention's kernels",
            "compiled": "fla refuses the gated backward on this GPU (Hopper, Triton < 3.7.1): the chunkwise form "
                        "compiled with torch.compile",
            "torch": "the chunkwise PyTorch form: fla not importable, not on CUDA, or fp32 outside autocast",
        }[chosen]
    level = logging.WARNING if chosen == "compiled" and requested != "compiled" else logging.INFO
    logger.log(level, "delta_rule: backend=%r -> %r for %s %s %s, %s (%s)", requested, chosen, device_type,
               str(dtype).replace("torch.", ""), "gated" if gated else "ungated",
               "training" if needs_grad else "no grad", why)


def fla_delta_rule(q, k, v, beta, scale, initial_state, output_final_state, log_decay, qk_l2norm):
    """Call fla's kernel with the contract of the module docstring: q, k, v, beta cast to the kernel
    dtype, g and the state fp32. Returns ``(o in the kernel dtype, final state fp32 or None)``."""
    chunk_delta, chunk_gated = _fla_functions()
    dtype = kernel_dtype(q)
    q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))
    common = dict(
        scale=scale,
        initial_state=None if initial_state is None else initial_state.float(),
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=qk_l2norm,
    )
    if log_decay is None:
        return chunk_delta(q=q, k=k, v=v, beta=beta, **common)
    return chunk_gated(q=q, k=k, v=v, g=log_decay.float(), beta=beta, **common)
