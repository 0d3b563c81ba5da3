"""The size of a model before it exists: the model built on the meta device (parameters counted, the
mechanisms' own options checked, nothing allocated) and a rough estimate of training memory, refused
above what the machine has available."""

from __future__ import annotations

import os

from fastweights.errors import UserError


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


def estimate_memory(cfg, world: int = 1) -> dict:
    """A rough estimate of one process's training memory in bytes (a lower bound, not a promise).

    Parameters, gradients and AdamW's two moments in fp32 (16 bytes per parameter), plus
    activations kept for the backward pass: per token and layer about 16 d_model + 3 mlp_hidden
    floats, the logits three times over, and T x T scores per head for attention layers.
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
    return {"parameters": params, "parameter_bytes": 16 * params, "activation_bytes": 4 * floats,
            "total_bytes": 16 * params + 4 * floats}


def available_memory(device) -> int | None:
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


def check_memory(cfg, device, world: int = 1, force: bool = False) -> dict:
    est = estimate_memory(cfg, world)
    free = available_memory(device)
    est["available_bytes"] = free
    if free is not None and est["total_bytes"] > free and not force:
        gib = 2**30
        raise UserError(
            f"model.d_model={cfg.model.d_model}, model.n_layers={cfg.model.n_layers}, train.batch_size="
            f"{cfg.train.batch_size}, train.seq_len={cfg.train.seq_len}: training needs about "
            f"{est['total_bytes'] / gib:.1f} GiB ({est['parameters'] / 1e6:,.1f}M parameters: "
            f"{est['parameter_bytes'] / gib:.1f} GiB with gradients and AdamW; activations "
            f"{est['activation_bytes'] / gib:.1f} GiB) but {device} has {free / gib:.1f} GiB available; "
            "make the model or batch smaller, or pass --force-memory to try anyway")
    return est
