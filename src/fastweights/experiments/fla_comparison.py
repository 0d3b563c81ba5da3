"""Our delta-rule op, layers and models beside flash-linear-attention's (fla) and lucidrains' FwPKM
(``fast-weight-product-key-memory``): what the GPU comparisons (``benchmarks/gpu/cuda_scale.py``,
``gpu_measurements.py``, ``gpu_queue.py``) build, time and check against. The installed versions
(:func:`fla_info`); a ``flash_attn`` stand-in over SDPA for fla's attention layers where the package is absent;
fla's refusal of the gated backward on Hopper switched off for timing (:func:`fla_guard_bypassed`); the delta
rule's backend choices as logged (:class:`BackendLog`); a hybrid config of ours and fla's model of the same shape;
kernel inputs and one forward + backward step of each side (raw fla kernel, our op, a layer, an FwPKM layer);
fla's stand-in (``fastweights.testing.fla_standin``) installed outside pytest for a dry run
(:func:`install_fla_standin`); fla's pure-PyTorch CPU forms, loaded without its Triton-needing package
``__init__`` (:func:`load_fla_cpu`, for ``benchmarks/speed/bench_delta_rule.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from fastweights.core.config import ModelConfig
from fastweights.layers.fwpkm import FwPKM, FwPKMOptions
from fastweights.ops.delta_rule import delta_rule
from fastweights.testing import fla_standin
from fastweights.testing.device_check import err_text


def install_flash_attn_standin() -> str | None:
    """fla's attention layer calls ``flash_attn.flash_attn_func``; without the package, one over SDPA is
    set into ``fla.layers.attn`` (after fla's import, so nothing else sees a fake ``flash_attn``)."""
    try:
        import flash_attn  # noqa: F401

        return None
    except ImportError:
        pass
    try:
        import fla.layers.attn as fla_attn
    except Exception as e:
        return f"fla's attention layer not importable: {err_text(e)}"

    def flash_attn_func(q, k, v, causal=True, window_size=(-1, -1), **kw):  # [B, T, H, D] in and out
        if tuple(window_size) != (-1, -1):
            raise NotImplementedError("stand-in flash_attn_func: no sliding window")
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
        return o.transpose(1, 2)

    fla_attn.flash_attn_func = flash_attn_func
    return "flash_attn absent: fla's attention layers ran a stand-in flash_attn_func over F.scaled_dot_product_attention"


def fla_info() -> dict:
    """The versions of fla, Triton, TileLang and lucidrains' FwPKM that are installed (each one's import error
    where it is not)."""
    out = {}
    try:
        import fla

        out["fla"] = getattr(fla, "__version__", "?")
    except Exception as e:
        out["fla_error"] = err_text(e)
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception as e:
        out["triton_error"] = err_text(e)
    try:
        from importlib.metadata import version

        out["tilelang"] = version("tilelang")
    except Exception:
        out["tilelang"] = None
    try:
        import fast_weight_product_key_memory  # noqa: F401
        from importlib.metadata import version

        out["fast_weight_product_key_memory"] = version("fast-weight-product-key-memory")
    except Exception as e:
        out["lucidrains_error"] = err_text(e)
    return out


@contextlib.contextmanager
def fla_guard_bypassed():
    """Switch off fla's refusal of the gated backward on Hopper with 3.4 <= Triton < 3.7.1 (timing only; the
    GPU queue's gradient checks say whether its gradients are right at our shapes)."""
    import fla.ops.common.chunk_o as chunk_o

    old = chunk_o.TRITON_ABOVE_3_7_1
    chunk_o.TRITON_ABOVE_3_7_1 = True
    try:
        yield
    finally:
        chunk_o.TRITON_ABOVE_3_7_1 = old


class BackendLog(logging.Handler):
    """Collects the delta rule's backend choices (logged once per distinct choice)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def our_config(cfg: dict, fwpkm: bool) -> ModelConfig:
    """Our hybrid of ``cfg``'s shape: GDN mixers with attention at every ``attn_every``-th layer, and with
    ``fwpkm`` the FwPKM memory (``cfg["fwpkm"]``) before the mixers of ``cfg["fwpkm_layers"]``."""
    mixers = ["attention" if (i + 1) % cfg["attn_every"] == 0 else "gdn" for i in range(cfg["n_layers"])]
    options = {"gdn": {"head_dim": cfg["head_dim"]}, "attention": {"head_dim": cfg["head_dim"]}}
    extra = {}
    if fwpkm:
        options["fwpkm"] = dict(cfg["fwpkm"])
        extra = {"memory": "fwpkm", "memory_layers": list(cfg["fwpkm_layers"])}
    return ModelConfig(vocab_size=cfg["vocab"], d_model=cfg["d_model"], n_layers=cfg["n_layers"],
                       n_heads=cfg["n_heads"], mlp_hidden=cfg["mlp"], layer_mixers=mixers, options=options, **extra)


def fla_model(cfg: dict):
    """fla's ``GatedDeltaNetForCausalLM`` of the same shape as :func:`our_config` (attention at the same layers)."""
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

    attn_layers = [i for i in range(cfg["n_layers"]) if (i + 1) % cfg["attn_every"] == 0]
    conf = GatedDeltaNetConfig(
        hidden_size=cfg["d_model"], num_hidden_layers=cfg["n_layers"], num_heads=cfg["n_heads"],
        head_dim=cfg["head_dim"], expand_v=1.0, intermediate_size=cfg["mlp"], vocab_size=cfg["vocab"],
        tie_word_embeddings=True, use_cache=False, max_position_embeddings=cfg["seq_len"],
        attn={"layers": attn_layers, "num_heads": cfg["n_heads"], "num_kv_heads": cfg["n_heads"]},
    )
    return GatedDeltaNetForCausalLM(conf)


def kernel_inputs(b, t, h, dk, dv, device, seed=0):
    """Seeded delta-rule inputs ``[q, k, v, beta, log_decay]`` ([B, T, H, D] and [B, T, H]; keys normalised)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, dk, generator=g)
    k = F.normalize(torch.randn(b, t, h, dk, generator=g), dim=-1)
    v = torch.randn(b, t, h, dv, generator=g)
    beta = torch.rand(b, t, h, generator=g) * 0.9 + 0.05
    log_decay = -torch.rand(b, t, h, generator=g) * 0.1
    return [x.to(device) for x in (q, k, v, beta, log_decay)]


def raw_fla_step(gated, xs, device):
    """One forward + backward of fla's raw chunk kernel (gated or not) on ``xs`` in bf16, state in and out."""
    from fla.ops.delta_rule import chunk_delta_rule
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    q, k, v, beta = (x.to(torch.bfloat16).requires_grad_() for x in xs[:4])
    g = xs[4].clone().requires_grad_()
    s0 = torch.zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3], device=device)  # as our op's call: state in/out

    def step():
        if gated:
            o, s = chunk_gated_delta_rule(q=q, k=k, v=v, g=g, beta=beta, use_qk_l2norm_in_kernel=True,
                                          initial_state=s0, output_final_state=True)
        else:
            o, s = chunk_delta_rule(q=q, k=k, v=v, beta=beta, initial_state=s0, output_final_state=True)
        (o.float().square().mean() + s.sum() * 0).backward()

    return step


def our_op_step(gated, xs, backend, device, leaves=torch.float32):
    """Our op as a layer calls it: q, k, v, beta leaves in ``leaves`` (fp32: the fwp layer's features, cast to
    bf16 inside the op; bf16: as the raw fla step's, like for like), g fp32, under bf16 autocast."""
    q, k, v, beta = (x.to(leaves, copy=True).requires_grad_() for x in xs[:4])
    g = xs[4].clone().requires_grad_()
    s0 = torch.zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3], device=device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            o, s = delta_rule(q, k, v, beta, log_decay=g if gated else None, initial_state=s0, output_final_state=True,
                              backend=backend, qk_l2norm=gated)
        (o.float().square().mean() + s.sum() * 0).backward()

    return step


def layer_step(layer, x, device, autocast: bool = True):
    """One forward + backward of ``layer`` on ``x`` (under bf16 autocast unless ``autocast`` is False)."""
    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            y = layer(x)
            y = y[0] if isinstance(y, tuple) else y
        y.float().square().mean().backward()

    return step


def fla_gdn_layer(cfg):
    """fla's ``GatedDeltaNet`` layer at ``cfg``'s width and heads (chunk mode, short convolution)."""
    from fla.layers import GatedDeltaNet as FlaGDN

    return FlaGDN(hidden_size=cfg["d_model"], expand_v=1.0, head_dim=cfg["head_dim"], num_heads=cfg["n_heads"],
                  mode="chunk", use_short_conv=True, layer_idx=0)


def fwpkm_layer_step(impl, cfg, batch, device):
    """(:func:`layer_step` of one FwPKM layer at ``cfg["fwpkm"]``, ours or lucidrains' per ``impl``, in fp32;
    its parameter count)."""
    torch.manual_seed(0)
    o = cfg["fwpkm"]
    if impl == "ours":
        layer = FwPKM(cfg["d_model"], FwPKMOptions(**o))
    else:
        from fast_weight_product_key_memory import fwPKM

        layer = fwPKM(cfg["d_model"], heads=o["heads"], chunk_size=o["chunk_size"], num_memories=o["n_subkeys"] ** 2,
                      dim_queries_keys=o["d_key"], dim_values=o["d_value"], topk=o["topk"], learning_rate=1.0)
    layer = layer.to(device)
    x = torch.randn(batch, cfg["seq_len"], cfg["d_model"], generator=torch.Generator().manual_seed(3)).to(device)
    x.requires_grad_()
    # fp32 for both: lucidrains' layer fails under bf16 autocast (a lerp of bf16 and fp32 tensors), and the paper
    # runs FwPKM in fp32
    return layer_step(layer, x, device, autocast=False), sum(p.numel() for p in layer.parameters())


# ----------------------------------------------------------------------------- fla's stand-in outside pytest


class _Patcher:
    """pytest's monkeypatch, the two calls fla_standin.install needs (the dry run's stand-in, undone at exit)."""

    def __init__(self):
        self.undo_list = []

    def setitem(self, mapping, key, value):
        self.undo_list.append((mapping.__setitem__, key, mapping[key]) if key in mapping
                              else (lambda k, _v, m=mapping: m.pop(k, None), key, None))
        mapping[key] = value

    def setattr(self, obj, name, value):
        self.undo_list.append((lambda n, v, o=obj: setattr(o, n, v), name, getattr(obj, name)))
        setattr(obj, name, value)


def install_fla_standin() -> str:
    """Install ``fastweights.testing.fla_standin`` in fla's place for this process (a dry run without fla); what
    was installed, in words."""
    fla_standin.install(_Patcher())
    return ("fla absent: the stand-in fastweights.testing.fla_standin (fla 0.6's call contract, our per-step reference "
            "in fp32) ran in its place; fla's layers and models are absent from it")


# ----------------------------------------------------------------------------- ours against fla's chunk kernels in bf16


def delta_inputs(b, t, h, d, device, gated, seed=0):
    """Seeded bf16 inputs ``[q, k, v, beta]`` on ``device`` (K = V = ``d``), fp32 ``log_decay`` when ``gated``
    (else None), and an output gradient ``do``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, d, generator=g)
    k = F.normalize(torch.randn(b, t, h, d, generator=g), dim=-1)  # keys normalised: a stable recurrence
    v = torch.randn(b, t, h, d, generator=g)
    beta = torch.rand(b, t, h, generator=g) * 0.9 + 0.05
    log_decay = -torch.rand(b, t, h, generator=g) * 0.1 if gated else None
    do = torch.randn(b, t, h, d, generator=g)
    bf = [x.to(device=device, dtype=torch.bfloat16) for x in (q, k, v, beta)]
    return bf, (None if log_decay is None else log_decay.to(device)), do.to(device)


def run_impl(impl, fns, xs, log_decay, do, backward: bool):
    """One call of fla's chunk kernel (``impl`` "fla"; ``fns``: its ``{"delta", "gated"}`` chunk functions) or of
    ours (torch backend, fp32 arithmetic inside): the output (and the input gradients of <o, do> when
    ``backward``)."""
    xs = [x.detach().requires_grad_(backward) for x in xs]
    g = None if log_decay is None else log_decay.detach().requires_grad_(backward)
    q, k, v, beta = xs
    if impl == "fla":
        if g is None:
            o, _ = fns["delta"](q, k, v, beta)
        else:
            o, _ = fns["gated"](q, k, v, g, beta)
    else:  # ours, torch backend (fp32 arithmetic inside for bf16 inputs)
        o, _ = delta_rule(q, k, v, beta, log_decay=g, backend="torch")
    if not backward:
        return o, None
    (o.float() * do).sum().backward()
    return o, [x.grad for x in xs] + ([g.grad] if g is not None else [])


# ----------------------------------------------------------------------------- fla's CPU forms


FLA_CHUNKS = (16, 32, 64)
FLA_FILES = {"delta": "ops/delta_rule/naive.py", "gated": "ops/gated_delta_rule/naive.py"}


def load_fla_cpu():
    """fla's two pure-PyTorch chunked modules ``{"delta": module, "gated": module}`` and a description
    ``{"version", "files"}`` (each file's sha256); or None and the reason they cannot be used."""
    spec = importlib.util.find_spec("fla")  # finds the package without running its __init__ (which needs Triton)
    if spec is None or not spec.submodule_search_locations:
        return None, {"reason": "flash-linear-attention (fla-core) is not importable"}
    root = Path(next(iter(spec.submodule_search_locations)))
    mods = {}
    for name, rel in FLA_FILES.items():
        file_spec = importlib.util.spec_from_file_location(f"_fla_cpu_{name}", root / rel)
        mod = importlib.util.module_from_spec(file_spec)
        try:
            file_spec.loader.exec_module(mod)
        except Exception as e:  # noqa: BLE001  (a missing einops, a moved file: recorded, not fatal)
            return None, {"reason": f"fla/{rel} does not load: {type(e).__name__}: {e}"}
        mods[name] = mod
    try:
        version = importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    files = {f"fla/{rel}": hashlib.sha256((root / rel).read_bytes()).hexdigest() for rel in FLA_FILES.values()}
    return mods, {"version": version, "files": files}


def fla_candidates(mods, gated):
    """fla's CPU forms of the (gated) delta rule: ``name -> (fn(q, k, v, beta, g) -> o, wants [B, H, T, D])``."""
    cands = {}
    for c in FLA_CHUNKS:
        if not gated:
            cands[f"delta_rule_chunkwise_C{c}"] = (
                lambda q, k, v, beta, g, c=c: mods["delta"].delta_rule_chunkwise(q, k, v, beta, chunk_size=c)[0],
                True)
        cands[f"naive_chunk_gated_delta_rule_C{c}"] = (
            lambda q, k, v, beta, g, c=c: mods["gated"].naive_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=c)[0],
            False)
    return cands
