"""One CPU linear: ``y = x W^T + b`` and its two backward products, each on the fastest correct fp32 kernel of
the machine that runs it, chosen there by measurement.

    forward        y  = x W^T + b        [M, K] . [N, K]^T -> [M, N]
    input grad     dx = g W              [M, N] . [N, K]   -> [M, K]
    weight grad    dW = g^T x            [N, M] . [M, K]   -> [N, K]        db = sum_m g

Why: torch's fp32 GEMM on an x86 CPU is MKL's, and oneDNN's (``torch.ops.mkldnn._linear_pointwise``, the op
torch's compiler emits for CPU linears) is another. On one core of an AMD EPYC (AVX-512) MKL runs its AVX2 path,
about 85 GFLOP/s, where oneDNN's reaches 175-230 on the same shapes; on an Intel Xeon both reach 150-170 and MKL
is as fast or faster (``benchmarks/speed/gemm_ceiling.py`` records both on the machine it runs on). So no kernel
is assumed. For each shape class of a call (M rounded up to a power of two, K, N, the weight's layout) the three
products are timed on each kernel (two rounds, in turn; oneDNN in two forms, ``a w^T`` and ``(w a^T)^T``, which
copy different operands), on this machine and thread count; a oneDNN form is taken for a product only where it is
at least :data:`MARGIN` faster than torch's kernel and gives its numbers, and the choice is kept in a file
under the user's cache folder, so that every process of the machine (a run and its resume) computes with the same
kernels, bit for bit.

Where torch's kernel is chosen for every product a call needs, the call is ``F.linear`` itself (torch's own
autograd, no Python Function in between): on a machine where torch's kernel is the fastest, nothing is slower.

``F.linear`` also serves: dtypes other than fp32, devices other than the CPU, machines or builds without oneDNN,
a weight neither contiguous nor its transpose, an input that is not contiguous, CPU autocast, ``torch.compile``
(its compiler picks its own CPU linear), ``torch.func`` transforms (vmap and grad: the private op has no batching
rule), tiny products (below :data:`MIN_WORK` multiply-adds, where the Python Function costs more than any kernel
saves), and ``FASTWEIGHTS_LINEAR=torch``. Double backward (``create_graph``, the FWL's second-order gradients)
differentiates torch's products.

:class:`Linear` is ``nn.Linear`` computing through :func:`linear` (the same parameters and state dict), and
:func:`fast_linears` lends that forward to every ``nn.Linear`` of a model for the duration of a ``with``
block (a Hugging Face backbone scored or adapted by the library).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import platform
import time
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastweights.core.errors import UserError
from fastweights.core.files import merge_into_json_cache, user_cache_dir

log = logging.getLogger(__name__)

#: oneDNN is taken for a product only where torch's kernel takes at least this much longer (noise and the
#: Python Function's own cost are not worth a kernel switch)
MARGIN = 1.1
#: multiply-adds (M K N) below which a call is ``F.linear`` without measuring: ~10 microseconds of GEMM, about
#: what the autograd Function adds
MIN_WORK = 1 << 20
#: ``FASTWEIGHTS_LINEAR``: ``auto`` (measured, the default), ``torch`` (never oneDNN), ``onednn`` (oneDNN for
#: every product of every call it can serve, tiny ones too; for tests and benchmarks)
ROUTES = ("auto", "torch", "onednn")
PRODUCTS = ("forward", "input_grad", "weight_grad")
CACHE_FILE = "linear_kernels.json"


def _torch_kernel(a: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    return F.linear(a, w, bias)


def _onednn_kernel(a: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise.default(a, w, bias, "none", [], "")


def _onednn_transposed_kernel(a: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    """``a w^T + bias`` as ``(w a^T)^T`` on oneDNN. oneDNN's linear reads its first operand row by row and copies
    it first when it is a transpose; the weight gradient's is one (``g^T``, [N, M]). Swapped, the copy is of ``w``
    (``x^T``, [M, K]) and of the [K, N] result: less when N is well above K (the demo's MLP gate and up, 4,096 x
    128 -> 704), more when M is small (a 64-token segment's 49,152-word head); ``gemm_ceiling.json`` records both
    forms' GFLOP/s per product on the machine that ran it."""
    out = _onednn_kernel(w, a, None).T.contiguous()
    return out if bias is None else out.add_(bias)


#: a kernel computes ``a w^T + bias`` for ``a [m, k]``, ``w [n, k]`` of any strides; the three products are each
#: one call of a kernel (:func:`_product`)
KERNELS = {"torch": _torch_kernel, "onednn": _onednn_kernel, "onednn_transposed": _onednn_transposed_kernel}


@functools.cache
def onednn_available() -> bool:
    """Whether oneDNN's linear exists here and gives ``F.linear``'s numbers on a small strided call with a bias
    (the op is private: another signature or meaning in a later torch drops it, everything stays on torch's)."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not torch.backends.mkldnn.is_available():
        return False
    try:
        x, w, b = torch.linspace(-1, 1, 12).view(3, 4), torch.linspace(1, -2, 20).view(4, 5).T, torch.arange(5.0)
        with torch.no_grad():
            return torch.allclose(_onednn_kernel(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    except (AttributeError, RuntimeError, TypeError):
        return False


def linear_route() -> str:
    """``FASTWEIGHTS_LINEAR`` (one of :data:`ROUTES`, default ``auto``); a UserError for any other value."""
    route = os.environ.get("FASTWEIGHTS_LINEAR", "auto")
    if route not in ROUTES:  # a misspelt route is said, not silently measured
        raise UserError(f"FASTWEIGHTS_LINEAR must be one of {', '.join(ROUTES)}, got {route!r}")
    return route


def _product(product: str, fn, x: Tensor, w: Tensor, g: Tensor | None, bias: Tensor | None = None) -> Tensor:
    """One product of the linear on the kernel ``fn``: ``x [M, K]``, ``w [N, K]``, ``g [M, N]`` (the output's
    gradient)."""
    if product == "forward":
        return fn(x, w, bias)
    if product == "input_grad":
        return fn(g, w.T, None)  # g W
    return fn(g.T, x.T, None)  # g^T x


# ---------------------------------------------------------------------------------------------- the choice


def _machine_key() -> str:
    """What a kernel's speed depends on besides the shape: the CPU, torch and its oneDNN, the thread count; and
    the kernels a choice was made among (a choice stored before a kernel was added is made again)."""
    return f"{_cpu_key()}-t{torch.get_num_threads()}-{'.'.join(KERNELS)}"


@functools.cache
def _cpu_key() -> str:
    """The CPU (model and flags), torch's version and whether it has oneDNN, hashed: read once per process (a
    linear call asks for it every time)."""
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = "".join(line for line in f if line.startswith(("model name", "flags", "Features")))[:4096]
    except OSError:
        cpu = platform.processor()
    parts = [platform.machine(), cpu, torch.__version__, str(torch.backends.mkldnn.is_available())]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _rows_class(m: int) -> int:
    """M rounded up to a power of two: a scoring loop's ragged last segment shares its full segments' class."""
    return 1 << max(m - 1, 0).bit_length()


def shape_key(m: int, k: int, n: int, weight_transposed: bool) -> str:
    """The shape class of a call: :func:`_rows_class` of M, K, N and whether the weight is stored transposed
    (``[K, N]`` contiguous, seen as ``[N, K]``)."""
    return f"{_rows_class(m)}x{k}x{n}{'T' if weight_transposed else ''}"


_CHOICES: dict[str, dict[str, list[str]]] = {}  # machine key -> shape key -> kernel per product


def _cache_path():
    return user_cache_dir() / CACHE_FILE


def _load_choices(machine: str) -> dict[str, list[str]]:
    if machine not in _CHOICES:
        try:
            stored = json.loads(_cache_path().read_text()).get(machine, {})
            _CHOICES[machine] = {k: v for k, v in stored.items()
                                 if isinstance(v, list) and len(v) == 3 and all(x in KERNELS for x in v)}
        except (OSError, ValueError, AttributeError):
            _CHOICES[machine] = {}
    return _CHOICES[machine]


def _store_choice(machine: str, key: str, kernels: list[str]) -> None:
    """Merge one choice into the cache file (read, add, atomic replace): a concurrent process loses at most its
    own newest entry, which it measures again next time; an unwritable cache folder keeps choices in memory."""
    try:
        merge_into_json_cache(_cache_path(), (machine, key), kernels, indent=0)
    except OSError as e:
        log.debug("linear kernel choices not stored (%s)", e)


def _best_time(fn, budget_s: float = 0.02, most: int = 20) -> float:
    fn()  # warm-up: allocation, oneDNN's primitive cache
    best, spent, n = float("inf"), 0.0, 0
    while n < 3 or (spent < budget_s and n < most):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent, n = min(best, dt), spent + dt, n + 1
    return best


@torch.no_grad()
def measure(m: int, k: int, n: int, weight_transposed: bool, kernels=None,
            rounds: int = 2) -> dict[str, dict[str, float]]:
    """Seconds (the best over ``rounds`` rounds, the kernels taking turns, each round the best of several calls) of
    each product on each kernel, for ``x [m, k]`` and ``W [n, k]`` of random fp32 values (drawn from a private
    generator: the global random stream is not touched). A kernel whose result differs from torch's beyond fp32
    rounding gets ``inf``."""
    kernels = kernels or KERNELS
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(m, k, generator=gen) - 0.5
    w = (torch.rand(k, n, generator=gen) - 0.5).T if weight_transposed else torch.rand(n, k, generator=gen) - 0.5
    g = torch.rand(m, n, generator=gen) - 0.5
    times: dict[str, dict[str, float]] = {}
    for product in PRODUCTS:
        want = _product(product, _torch_kernel, x, w, g)
        scale = float(want.abs().max()) + 1e-6
        times[product] = {name: float("inf") for name in kernels}  # a kernel with other numbers is never chosen
        right = []
        for name, fn in kernels.items():
            try:  # each product sums over one of m, k, n: rounding grows with the square root of the longest
                if (_product(product, fn, x, w, g) - want).abs().max() <= 1e-4 * scale * max(k, m, n) ** 0.5:
                    right.append(name)
            except (RuntimeError, TypeError):
                pass
        # rounds with the kernels in turn, every other round in the other order: a burst of load on a shared
        # machine during one kernel's timing would otherwise decide the choice
        for r in range(rounds):
            for name in right if r % 2 == 0 else right[::-1]:
                t = _best_time(lambda: _product(product, kernels[name], x, w, g))
                times[product][name] = min(times[product][name], t)
    return times


def choose(times: dict[str, dict[str, float]]) -> list[str]:
    """The kernel per product: the fastest where torch's takes at least :data:`MARGIN` times as long as it, else
    torch's."""
    chosen = []
    for product in PRODUCTS:
        t = times[product]
        best = min(t, key=t.get)
        chosen.append(best if best != "torch" and t["torch"] >= MARGIN * t[best] else "torch")
    return chosen


def kernels_for(m: int, k: int, n: int, weight_transposed: bool, route: str | None = None) -> list[str]:
    """The kernel of each product (:data:`PRODUCTS`) for a call of this shape on this machine: forced by the route
    (``FASTWEIGHTS_LINEAR`` unless given), else the stored choice, else measured now and stored."""
    route = route or linear_route()
    if route == "torch" or not onednn_available():
        return ["torch"] * 3
    if route == "onednn":
        return ["onednn"] * 3
    if m * k * n < MIN_WORK:
        return ["torch"] * 3
    machine, key = _machine_key(), shape_key(m, k, n, weight_transposed)
    stored = _load_choices(machine)
    if key not in stored:
        stored[key] = choose(measure(_rows_class(m), k, n, weight_transposed))
        log.info("linear %s: %s (measured on this machine)", key, dict(zip(PRODUCTS, stored[key])))
        _store_choice(machine, key, stored[key])
    return stored[key]


# ---------------------------------------------------------------------------------------------- the linear


class _Linear(torch.autograd.Function):
    """``x2 [M, K] W^T + b`` with each product on its chosen kernel; backward under ``create_graph`` in torch's
    differentiable products."""

    @staticmethod
    def forward(x2, weight, bias, kernels):
        return _product("forward", KERNELS[kernels[0]], x2, weight, None, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x2, weight, bias, kernels = inputs
        ctx.save_for_backward(x2, weight)
        ctx.kernels = kernels

    @staticmethod
    def backward(ctx, g):
        x2, weight = ctx.saved_tensors
        need_x, need_w, need_b, _ = ctx.needs_input_grad
        if torch.is_grad_enabled():  # create_graph: the products themselves must be differentiable
            kernels = ("torch",) * 3
        else:
            kernels = ctx.kernels
        dx = _product("input_grad", KERNELS[kernels[1]], x2, weight, g) if need_x else None
        dw = _product("weight_grad", KERNELS[kernels[2]], x2, weight, g) if need_w else None
        db = g.sum(0) if need_b else None
        return dx, dw, db, None


def _layout(w: Tensor) -> bool | None:
    """Whether a 2-D weight ``[N, K]`` is stored transposed: False for unit-stride rows (``[N, K]`` row-major, a row
    slice of one too), True for unit-stride columns (the transpose of a row-major ``[K, N]``, a column slice of one
    too), None for any other strides (``F.linear``)."""
    if w.stride(-1) == 1:
        return False
    return True if w.stride(0) == 1 else None


def _serves(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    tensors = (x, weight) if bias is None else (x, weight, bias)
    return (all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)
            and weight.dim() == 2 and x.dim() >= 1 and x.is_contiguous()
            and torch.backends.mkldnn.enabled and not torch.is_autocast_enabled("cpu")
            and not torch.compiler.is_compiling()
            and not any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors))


def call_kernels(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> list[str] | None:
    """The kernel of each product :func:`linear` computes this call with, or None where the call is ``F.linear``
    whatever is measured (module docstring)."""
    route = linear_route()
    if route == "torch" or not _serves(x, weight, bias):
        return None
    layout = _layout(weight)
    if layout is None:
        return None
    n, k = weight.shape
    return kernels_for(x.numel() // k, k, n, layout, route)


def linear_grads(x2: Tensor, weight: Tensor, g: Tensor, need_x: bool = True, need_w: bool = True):
    """``(g W, g^T x2)`` (each None when not needed): the backward products of ``linear(x2, weight)`` for the output
    gradient ``g [M, N]`` (``x2 [M, K]``, ``weight [N, K]``), each on the kernel this machine chose for the call's
    shape class, torch's where :func:`linear` would call ``F.linear``: for code that forms a linear's gradients
    itself (``ops.linear_cross_entropy``)."""
    kernels = call_kernels(x2, weight) or ("torch",) * 3
    dx = _product("input_grad", KERNELS[kernels[1]], x2, weight, g) if need_x else None
    dw = _product("weight_grad", KERNELS[kernels[2]], x2, weight, g) if need_w else None
    return dx, dw


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x W^T + b`` (``x [..., K]``, ``weight [N, K]``, ``bias [N]`` or None -> ``[..., N]``) as ``F.linear``
    computes it, each product on this machine's faster kernel (module docstring); autograd as ``F.linear``'s."""
    kernels = call_kernels(x, weight, bias)
    if kernels is None:
        return F.linear(x, weight, bias)
    n, k = weight.shape
    wants_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    needed = [kernels[0]]
    if wants_grad and x.requires_grad:
        needed.append(kernels[1])
    if wants_grad and weight.requires_grad:
        needed.append(kernels[2])
    if all(kn == "torch" for kn in needed):
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, k)
    if not wants_grad:
        return KERNELS[kernels[0]](x2, weight, bias).view(*x.shape[:-1], n)
    return _Linear.apply(x2, weight, bias, tuple(kernels)).view(*x.shape[:-1], n)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, initialisation and state dict) computing through :func:`linear`."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


def _linear_forward(module: nn.Linear, x: Tensor) -> Tensor:
    return linear(x, module.weight, module.bias)


#: per model, its ``nn.Linear`` modules and the forward each is lent: found once (walking a 30-block model's
#: modules and building the forwards cost a millisecond, a generation step's tenth), so a module added to the model
#: later is not lent
_LENDABLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def fast_linears(model: nn.Module):
    """Every ``nn.Linear`` of ``model`` computes through :func:`linear` inside the block, and as before after it
    (a module whose ``forward`` was already replaced on the instance, by a hook library say, is left alone)."""
    if model not in _LENDABLE:
        _LENDABLE[model] = [(m, functools.partial(_linear_forward, m)) for m in model.modules()
                            if isinstance(m, nn.Linear) and not isinstance(m, Linear)]
    # the instance's __dict__ directly: nn.Module.__setattr__'s checks, for a plain function, end there too
    lent = [(m.__dict__, fwd) for m, fwd in _LENDABLE[model] if "forward" not in m.__dict__]
    for attrs, fwd in lent:
        attrs["forward"] = fwd
    try:
        yield model
    finally:
        for attrs, _ in lent:
            attrs.pop("forward", None)
