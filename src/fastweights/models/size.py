"""The size of a model before it exists: the model built on the meta device (parameters counted, the
mechanisms' own options checked, nothing allocated) and a rough estimate of training memory
(parameters and AdamW, activations, fast-weight and memory state), refused above what the machine has
available."""

from __future__ import annotations

import os

from fastweights.core.errors import UserError


def meta_model(model_cfg, vocab_size: int | None = None):
    """The model built on the meta device: checks the mechanisms' own options and counts parameters."""
    import dataclasses

    import torch

    from fastweights.models.lm import LanguageModel

    cfg = dataclasses.replace(model_cfg, vocab_size=vocab_size or model_cfg.vocab_size or 256)
    try:
        with torch.device("meta"):
            return LanguageModel(cfg)
    except UserError:
        raise
    except (ValueError, TypeError, AssertionError, ZeroDivisionError, RuntimeError, KeyError) as e:
        raise UserError(f"model settings (d_model={cfg.d_model}, n_heads={cfg.n_heads}, n_layers={cfg.n_layers}, "
                        f"mixer={cfg.mixer}) are inconsistent: {str(e).splitlines()[0] if str(e) else type(e).__name__}") \
            from None


# ----------------------------------------------------------------------------- memory


def state_floats(model_cfg, seq_len: int) -> dict:
    """Floats of fast-weight and memory state in one training call of ``seq_len`` tokens from a fresh state,
    summed over the model's parts: each part's own ``state_floats`` (declared in its file under ``layers/``,
    or measured on the meta device: ``components.state_floats``), and a block's short convolution.

    ``carried``: per sequence, the state a call returns (e.g. the KV cache of attention, FWP/GDN's S [H, K, V]);
    ``shared``: once per batch (e.g. FwPKM's value table); kept for the backward pass besides, per sequence
    (``backward``) or per batch (``backward_shared``), e.g. the chunk-start states of the chunked kernels.
    ``tests/contracts/test_state_size.py`` compares them with the states models return.
    """
    from fastweights import components

    m = model_cfg
    dims = {"d_model": m.d_model, "n_heads": m.n_heads, "vocab_size": m.vocab_size or 256, "seq_len": seq_len}
    total = dict.fromkeys(components.STATE_KEYS, 0)

    def add(kind: str, name: str) -> None:
        part = components.state_floats(kind, name, (m.options or {}).get(name), **dims)
        for k in total:
            total[k] += part[k]

    for i in range(m.n_layers):
        add("mixer", m.mixer_of(i))
        if m.short_conv:
            total["carried"] += (m.short_conv - 1) * m.d_model
        if m.memory and i in m.memory_layers:
            add("memory", m.memory)
    if m.head != "linear":
        add("head", m.head)
    return total


def estimate_ram(cfg, world: int = 1) -> dict:
    """A rough estimate of one process's training RAM (on a GPU: device memory) in bytes (an approximation, not a promise).

    Parameters, gradients and AdamW's two moments in fp32 (16 bytes per parameter); activations kept
    for the backward pass: per token and layer about 16 d_model + 3 mlp_hidden floats, the logits three
    times over, and T x T scores per head for attention layers; and the fast-weight and memory state
    of :func:`state_floats` for the batch.
    """
    from fastweights.layers.common import swiglu_hidden

    m, t = cfg.model, cfg.train
    params = sum(p.numel() for p in meta_model(m).parameters())
    rows = max(1, t.batch_size // max(1, world))
    tokens = rows * t.seq_len
    h = swiglu_hidden(m.d_model, m.mlp_hidden)
    vocab = m.vocab_size or 256
    floats = tokens * (m.n_layers * (16 * m.d_model + 3 * h) + 3 * vocab)
    attn_layers = sum(1 for i in range(m.n_layers) if m.mixer_of(i) == "attention")
    floats += attn_layers * rows * m.n_heads * t.seq_len * t.seq_len * 2
    st = state_floats(m, t.seq_len)
    state = rows * (st["carried"] + st["backward"]) + st["shared"] + st["backward_shared"]
    return {"parameters": params, "parameter_bytes": 16 * params, "activation_bytes": 4 * floats,
            "state_bytes": 4 * state, "total_bytes": 16 * params + 4 * floats + 4 * state}


def available_ram(device) -> int | None:
    """Free memory of ``device`` in bytes (CUDA: free device memory; CPU: MemAvailable), None if unknown."""
    try:
        if getattr(device, "type", str(device)) == "cuda":
            import torch

            return int(torch.cuda.mem_get_info(device)[0])
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, RuntimeError):
        return None
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return None


def check_ram(cfg, device, world: int = 1, force: bool = False) -> dict:
    est = estimate_ram(cfg, world)
    free = available_ram(device)
    est["available_bytes"] = free
    if free is not None and est["total_bytes"] > free and not force:
        gib = 2**30
        raise UserError(
            f"model.d_model={cfg.model.d_model}, model.n_layers={cfg.model.n_layers}, train.batch_size="
            f"{cfg.train.batch_size}, train.seq_len={cfg.train.seq_len}: training needs about "
            f"{est['total_bytes'] / gib:.1f} GiB ({est['parameters'] / 1e6:,.1f}M parameters: "
            f"{est['parameter_bytes'] / gib:.1f} GiB with gradients and AdamW; activations "
            f"{est['activation_bytes'] / gib:.1f} GiB; fast-weight and memory state {est['state_bytes'] / gib:.1f} "
            f"GiB) but {device} has {free / gib:.1f} GiB available; make the model or batch smaller, or pass "
            "--force-ram to try anyway")
    return est


TOKEN_BYTES = 256  # per token of a user-sized input: its text, ids, per-position records (a generous bound)


def check_tokens_ram(cfg, tokens: int, device, what: str) -> int:
    """Refuse, before anything is allocated, a command sized by a user's number (``niah --lengths``, a generation
    budget) whose ``tokens`` need more than ``device`` has: the model's inference estimate (:func:`estimate_ram`
    at batch 1 over its context) plus ``TOKEN_BYTES`` per token. Returns the estimate in bytes."""
    import copy

    one = copy.deepcopy(cfg)
    one.train.batch_size = 1
    need = estimate_ram(one)["total_bytes"] + TOKEN_BYTES * max(0, int(tokens))
    free = available_ram(device)
    if free is not None and need > free:
        gib = 2**30
        raise UserError(f"{what}: about {need / gib:,.1f} GiB for {int(tokens):,} tokens, but {device} has "
                        f"{free / gib:.1f} GiB available; choose a smaller number")
    return need


DEEP = 64  # layers beyond which building even the meta model takes seconds (milliseconds per layer)


def check_deep_model(cfg, force: bool = False) -> None:
    """A deep model of identical layers (one mixer, no block memory) whose training estimate, extrapolated from
    one and two layers (:func:`estimate_ram` is linear in ``n_layers`` for such models), exceeds the machine is
    refused in seconds, before a meta build of every layer; otherwise nothing (``check_ram`` decides later)."""
    import copy

    m = cfg.model
    if force or m.n_layers <= DEEP or m.layer_mixers or m.memory:
        return
    from fastweights.core.distributed import resolve_device

    def total(n: int) -> int:
        small = copy.deepcopy(cfg)
        small.model.n_layers = n
        return estimate_ram(small)["total_bytes"]

    one, two = total(1), total(2)
    need = one + (m.n_layers - 1) * (two - one)
    device = resolve_device(cfg.train.device)
    free = available_ram(device)
    if free is not None and need > free:
        gib = 2**30
        raise UserError(f"model.n_layers={m.n_layers}: training needs about {need / gib:,.1f} GiB ({(two - one) / 2**20:,.1f} "
                        f"MiB per layer) but {device} has {free / gib:.1f} GiB available; make the model or batch "
                        "smaller, or pass --force-ram to try anyway")
