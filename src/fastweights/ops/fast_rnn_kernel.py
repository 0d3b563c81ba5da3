"""The fast-weights RNN's attention-form recurrence with its time loop compiled (CPU, fp32/fp64).

The equations (:mod:`fastweights.layers.fast_rnn`), the torch implementation (:class:`fastweights.ops.fast_rnn._AttentionReadRNN`) and the
reference written from the paper (``fast_rnn_reference``) are in :mod:`fastweights.layers.fast_rnn`; this
file holds the kernel that runs the same arithmetic in C (``fast_rnn_kernel.c`` beside it): its build and
cache (:func:`step_kernel`), the autograd function that calls it and its buffer pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import math
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
import weakref
from pathlib import Path

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from fastweights.core.files import user_cache_dir

# ----------------------------------------------------------------------------- compiled step kernel
#
# In torch ops the attention-form recurrence is slow on CPU: each step is ~20 small ops, the two reads are
# memory-bound batched GEMVs over every stored state, and the backward pass adds to every stored state's
# gradient at every step. The kernel below runs the whole time loop in C, one call for the forward pass
# and one for the backward pass. It goes through the batch four examples at a time (the recurrence is
# independent per example), so a group's stored states stay in cache for the whole sequence; W h_{t-1}
# for the four is a register-blocked GEMM; each stored state is read once per read (its dot product
# and its accumulation fused); LayerNorm, ReLU and their backward run in the same pass; the gradients
# reaching older stored states are added once per CHUNK steps as a small GEMM. Rows are padded with
# zeros to whole 64-byte vectors. The arithmetic is the torch implementation's up to the order of sums.
#
# It is plain C (no torch headers), built with the system C compiler on first use (about a second) and
# cached per source, compiler and CPU. Without a compiler, on another device, in another dtype (bf16),
# or with FASTWEIGHTS_FAST_RNN_KERNEL=0, the torch implementation (_AttentionReadRNN) runs instead.

_SOURCE_FILE = Path(__file__).with_name("fast_rnn_kernel.c")
_TEMPLATE_MARK = "/* ---- per-dtype template: REAL and _SFX are replaced for float (_f32) and double (_f64) ---- */"


def _kernel_source() -> str:
    """The C source: the shared part, then the template once per dtype."""
    shared, template = _SOURCE_FILE.read_text().split(_TEMPLATE_MARK)
    shared = shared.split("*/\n", 1)[1]  # the file's own header comment is not part of the compiled source
    return shared + "".join(template.replace("REAL", real).replace("_SFX", "_" + sfx)
                            for real, sfx in _KERNEL_DTYPES.values())


def decay_weights(N: int, lam: float, eta: float, like: Tensor) -> Tensor:
    """rev[N - n + i] = eta lam^(n-1-i): the weight of stored state i in the read after n writes."""
    exponents = torch.arange(N - 1, -1, -1, dtype=like.dtype)
    rev = eta * torch.pow(torch.as_tensor(lam, dtype=like.dtype), exponents)
    # a weight below the smallest normal number (lam 0.5 reaches it after 126 fp32 steps) is set to 0: the
    # state it weighs is forgotten to below 1e-38, and subnormal arithmetic made every read that touched it
    # slow (a training step at lam 0.5 took 1.3x the time of one at lam 0.95 until this)
    return rev.masked_fill_(rev < torch.finfo(like.dtype).tiny, 0.0).to(like.device)


class _KernelCtx(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int) for name in ("B", "T", "H", "D", "Hp", "N", "L", "S", "use_ln", "prelim_ln")] + [
        ("eps", ctypes.c_double),
        ("lam", ctypes.c_double),
    ] + [
        (name, ctypes.c_void_p)
        for name in ("U", "h0", "Wt", "Wp", "G", "rev", "A0", "lnw", "lnb", "Z", "MU", "RS", "HS", "WS", "WR", "DZC",
                     "DZ", "DB", "dG", "dlnw", "dlnb", "ybuf", "scratch")
    ]


_KERNEL_DTYPES = {torch.float32: ("float", "f32"), torch.float64: ("double", "f64")}
_kernel_lib: ctypes.CDLL | None | bool = False  # False: not tried yet; None: unavailable


def _build_kernel() -> ctypes.CDLL | None:
    """Compile (once per source, compiler and CPU; cached on disk) and load the step kernel; None if that fails."""
    source = _kernel_source()
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None
    base = ["-O3", "-ffp-contract=fast", "-fopenmp-simd", "-fPIC", "-shared", "-std=c99"]
    flag_sets = [base + ["-march=native"], base]  # the second for a compiler or CPU without -march=native
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:  # -march=native: the binary belongs to this CPU
            cpu = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    cache = user_cache_dir()
    user = os.getuid() if hasattr(os, "getuid") else 0
    for folder, flags in itertools.product((cache, Path(tempfile.gettempdir()) / f"fastweights-{user}"), flag_sets):
        key = hashlib.sha256("\0".join([source, cc, *flags, platform.machine(), cpu]).encode()).hexdigest()[:16]
        lib_path = folder / f"fast_rnn_kernel_{key}.so"
        try:
            if not lib_path.exists():
                folder.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryDirectory(dir=folder) as tmp:
                    src = Path(tmp) / "fast_rnn_kernel.c"
                    src.write_text(source)
                    out = Path(tmp) / lib_path.name
                    subprocess.run([cc, *flags, str(src), "-o", str(out), "-lm"], check=True, capture_output=True,
                                   timeout=120)
                    os.replace(out, lib_path)  # atomic: concurrent builders each install a complete file
            lib = ctypes.CDLL(str(lib_path))
        except (OSError, subprocess.SubprocessError):
            continue
        for sfx in ("f32", "f64"):
            getattr(lib, "fwd_seq_" + sfx).argtypes = [ctypes.c_void_p]
            getattr(lib, "bwd_seq_" + sfx).argtypes = [ctypes.c_void_p]
        return lib
    return None


def step_kernel() -> ctypes.CDLL | None:
    """The compiled step kernel, or None where it cannot be built or FASTWEIGHTS_FAST_RNN_KERNEL=0."""
    global _kernel_lib
    if os.environ.get("FASTWEIGHTS_FAST_RNN_KERNEL", "1") == "0":
        return None
    if _kernel_lib is False:
        _kernel_lib = _build_kernel()
        if _kernel_lib is None:
            warnings.warn("fast_rnn: no C compiler or the step kernel did not build; using the slower torch "
                          "implementation", RuntimeWarning, stacklevel=3)
    return _kernel_lib


_POOL: dict[tuple, list[Tensor]] = {}  # released kernel buffers by (numel, dtype, device)


def _workspace(like: Tensor, *shape: int) -> Tensor:
    """An uninitialised buffer, one released by an earlier backward pass where there is one of this size
    (fresh memory costs a page fault per 4 KiB on first touch, a tenth of the layer's time here)."""
    stack = _POOL.get((math.prod(shape), like.dtype, like.device))
    return stack.pop().view(shape) if stack else like.new_empty(shape)


class _Recycle:
    """An object that lives as long as the autograd context holding it (a handle for weakref.finalize)."""


def _release(*buffers: Tensor) -> None:
    for x in buffers:
        stack = _POOL.setdefault((x.numel(), x.dtype, x.device), [])
        if len(stack) < 16:
            stack.append(x.view(-1))


class AttentionReadRNNKernel(torch.autograd.Function):
    """:class:`_AttentionReadRNN` with the time loop in the compiled kernel (CPU, fp32/fp64).

    The forward and the backward pass are one kernel call each, which runs the whole sequence for
    four examples at a time (``W h_{t-1}`` for the four, then each one's step). Activations are kept
    in buffers indexed [stage, example, step, ...].
    """

    @staticmethod
    def forward(ctx, u, W, ln_weight, ln_bias, h0, A0, history, lam, eta, inner_steps, ln_preliminary, eps):
        B, T, H = u.shape
        L = 0 if history is None else history.shape[1]
        N, S = L + T, inner_steps
        D, Hp = -(-H // 16) * 16, -(-H // 32) * 32  # rows padded with zeros to whole vectors; W to whole blocks
        use_ln = ln_weight is not None
        G = _workspace(u, B, N, D)  # all states written so far: carried history, then this call's h_t
        if L:  # (the kernel writes whole rows of this call's states, zero beyond H)
            G[:, :L, H:] = 0
            G[:, :L, :H] = history
        Wt, Wp, ln = u.new_zeros(H, Hp), u.new_zeros(H, Hp), u.new_zeros(2, D)
        Wt[:, :H], Wp[:, :H] = W.t(), W  # h W^T (forward) and db W (backward) as rows of outer products
        if use_ln:
            ln[0, :H], ln[1, :H] = ln_weight, ln_bias
        buf = dict(
            U=u.contiguous(), h0=h0.contiguous(), Wt=Wt, Wp=Wp, G=G, rev=decay_weights(N, lam, eta, u),
            A0=None if A0 is None else A0.contiguous(), lnw=ln[0], lnb=ln[1],
            Z=_workspace(u, S + 1, B, T, D),  # LN input of every stage (stage 0: b_t)
            MU=u.new_zeros(S + 1, B, T), RS=u.new_zeros(S + 1, B, T),  # LN mean and 1/std
            HS=_workspace(u, S, B, T, D),  # outputs of stages 0..S-1 (stage S is h_t, in G)
            WS=_workspace(u, S, B, T, N),  # read weights rev_i g_i^T q of every stage and step
            ybuf=u.new_empty(4, Hp),
        )
        kctx = _KernelCtx(B=B, T=T, H=H, D=D, Hp=Hp, N=N, L=L, S=S, use_ln=int(use_ln),
                          prelim_ln=int(bool(ln_preliminary)), eps=float(eps), lam=float(lam),
                          **{k: (None if v is None else v.data_ptr()) for k, v in buf.items()})
        getattr(step_kernel(), "fwd_seq_" + _KERNEL_DTYPES[u.dtype][1])(ctypes.addressof(kctx))
        ctx.save_for_backward(W)
        ctx.buf, ctx.kctx, ctx.config = buf, kctx, (L, H, lam, S, use_ln)
        ctx.recycle = _Recycle()  # when the graph (and ctx) is freed, its buffers go back to the pool
        weakref.finalize(ctx.recycle, _release, G, buf["Z"], buf["HS"], buf["WS"])
        return G[:, L:, :H].clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        (W,) = ctx.saved_tensors
        buf, kctx = ctx.buf, ctx.kctx
        L, H, lam, S, use_ln = ctx.config
        G, HS, A0 = buf["G"], buf["HS"], buf["A0"]
        B, N, D = G.shape
        T = N - L
        need = ctx.needs_input_grad
        dG = _workspace(G, B, N, D)  # gradient reaching each stored state (from the output and from later reads)
        dG[:, :L], dG[:, L:, H:] = 0, 0
        dG[:, L:, :H] = d_out
        WR, DZC = G.new_empty(4, S, _CHUNK, N), G.new_empty(4, S, _CHUNK, D)  # a chunk's read weights and dz
        DZ = None if A0 is None else G.new_empty(S, B, T, D)  # dL/dz of every read, for the gradient of A0
        DB = G.new_empty(B, T, H)  # dL/db_t = dL/du_t
        d_ln = G.new_zeros(2, D)  # LayerNorm gain and bias gradients, summed over all steps by the kernel
        scratch = G.new_empty(2, D)
        for k, v in dict(WR=WR, DZC=DZC, DZ=DZ, DB=DB, dG=dG, dlnw=d_ln[0], dlnb=d_ln[1], scratch=scratch).items():
            setattr(kctx, k, None if v is None else v.data_ptr())
        getattr(step_kernel(), "bwd_seq_" + _KERNEL_DTYPES[G.dtype][1])(ctypes.addressof(kctx))
        d_u = DB if need[0] else None
        d_W = d_h0 = d_A0 = d_hist = None
        if need[1]:
            h_prev = torch.cat([buf["h0"].unsqueeze(1), G[:, L : N - 1, :H]], 1)  # h_{t-1} for every step
            d_W = DB.reshape(-1, H).t() @ h_prev.reshape(-1, H)
        d_lnw = d_ln[0, :H] if use_ln and need[2] else None
        d_lnb = d_ln[1, :H] if use_ln and need[3] else None
        if need[4]:
            d_h0 = DB[:, 0] @ W
        if A0 is not None and need[5]:  # sum over steps and stages of lam^n dz q^T
            scale = torch.pow(torch.as_tensor(lam, dtype=G.dtype), torch.arange(L, N, dtype=G.dtype)).to(G.device)
            dz = (DZ[..., :H] * scale[:, None]).permute(1, 0, 2, 3).reshape(B, S * T, H)
            d_A0 = torch.bmm(dz.transpose(1, 2), HS[..., :H].permute(1, 0, 2, 3).reshape(B, S * T, H))
        if L and need[6]:
            d_hist = dG[:, :L, :H].clone()
        _release(dG)
        return d_u, d_W, d_lnw, d_lnb, d_h0, d_A0, d_hist, None, None, None, None, None


_CHUNK = 32  # CHUNK in the kernel source


def kernel_applies(*tensors: Tensor | None) -> bool:
    """Whether the compiled step kernel can run these inputs: CPU tensors of one dtype, fp32 or fp64."""
    present = [x for x in tensors if x is not None]
    dtype = present[0].dtype
    return (
        dtype in _KERNEL_DTYPES
        and all(x.device.type == "cpu" and x.dtype == dtype for x in present)
        and step_kernel() is not None
    )
