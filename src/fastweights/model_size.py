"""The size of a model before it exists: the model built on the meta device (parameters counted, the
mechanisms' own options checked, nothing allocated) and a rough estimate of training memory
(parameters and AdamW, activations, fast-weight and memory state), refused above what the machine has
available."""

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


def _options(name: str, raw_options: dict):
    from fastweights import components as registry

    registry.load_providers()
    for table in (registry.MIXERS, registry.HEADS, registry.MEMORIES):
        if name in table:
            return registry.build_options(table[name], (raw_options or {}).get(name))
    return None


def state_floats(model_cfg, seq_len: int) -> dict:
    """Floats of fast-weight and memory state in one training call of ``seq_len`` tokens from a fresh state,
    computed from the config (``tests/test_reliability.py`` compares them with the states models return).

    ``carried``: per sequence, the state a call returns (the KV cache of attention, FWP/GDN's S [H, K, V],
    the fast RNN's matrix, LSTM cells, the FWL head's per-position updates, a short convolution's inputs,
    FwMLP weights and FwPKM keys with ``persistence = "per_sequence"``); ``shared``: once per batch (FwPKM's
    value table, and FwMLP weights and FwPKM keys shared by the sequences of a batch). Kept for the
    backward pass besides, per sequence (``backward``) or per batch (``backward_shared``): the chunk-start
    states of the chunked FWP/GDN kernels, and what each write of a second-order FwPKM/FwMLP adds (FwPKM's
    row deltas, bounded; FwMLP's new weights). Other intermediate values of the mechanisms are not counted.
    """
    from math import ceil

    m, T = model_cfg, seq_len
    d, H = m.d_model, m.n_heads
    carried = shared = backward = backward_shared = 0
    for i in range(m.n_layers):
        mixer = m.mixer_of(i)
        o = _options(mixer, m.options)
        if mixer == "attention":
            hd = o.head_dim or d // H
            carried += 2 * H * hd * (min(T, o.window - 1) if o.window else T)  # keys and values
        elif mixer == "fwp":
            from fastweights.ops.feature_maps import feature_dim

            hd = o.head_dim or d // H
            d_dot = feature_dim(o.feature_map, hd, nu=o.nu, n_features=o.n_features)
            carried += H * d_dot * hd + (H * d_dot if o.normalize else 0)
            backward += ceil(T / o.chunk_size) * H * d_dot * hd
        elif mixer == "gdn":
            hk = o.head_dim or d // H
            hv = int(round(hk * o.expand_v))
            carried += H * hk * hv + ((o.conv_size - 1) * H * (2 * hk + hv) if o.use_short_conv else 0)
            backward += ceil(T / o.chunk_size) * H * hk * hv
        elif mixer == "fast_rnn":  # h, and the fast matrix A folded from up to `hidden` stored states
            hidden = o.hidden or d
            if not o.fast_weights:
                carried += hidden
            elif o.read_mode == "matrix":
                carried += hidden + hidden * hidden
            elif T <= hidden:  # the attention read keeps the states of the call
                carried += hidden + T * hidden
            else:  # ... folding them into A whenever `hidden` are stored
                carried += hidden + hidden * hidden + ((T - 1) % hidden + 1) * hidden
        elif mixer == "lstm":
            carried += 2 * (o.hidden or d)
        if m.short_conv:
            carried += (m.short_conv - 1) * d
        if m.memory in ("fwpkm", "fwmlp") and i in m.memory_layers:
            o = _options(m.memory, m.options)
            per_sequence = o.persistence == "per_sequence"
            writes = ceil(T / o.chunk_size) if o.second_order and not o.frozen else 0  # kept for the backward pass
            if m.memory == "fwpkm":
                # the value table is shared (each sequence's writes are sparse row deltas on it); the keys are
                # per sequence with persistence = "per_sequence" (tables folded per sequence happen without
                # autograd only, when streaming)
                shared += o.n_subkeys**2 * o.d_value
                keys = o.heads * o.n_subkeys * o.d_key  # two halves of d_key / 2
                carried, shared = (carried + keys, shared) if per_sequence else (carried, shared + keys)
                # each write's row deltas: at most C k H rows per sequence, and never more than the table
                backward += writes * min(o.n_subkeys**2, o.chunk_size * o.topk * o.heads) * o.d_value
            else:
                table = o.hidden * (2 * o.d_key + o.d_value) + 2 * o.hidden + o.d_value  # up, gate, down
                if per_sequence:
                    carried += table
                    backward += writes * table  # each write makes new weights
                else:
                    shared += table
                    backward_shared += writes * table
    if m.head == "fwl":  # the input of the last position and every position's rank-one update factors
        o = _options("fwl", m.options)
        if o.bias_only:
            carried += d + T * (m.vocab_size or 256)
        else:
            s, e = o.hidden or d, o.expansion
            # U [d, e s], W [e s, s], the LayerNorm's gain and bias, and the fast biases a [e s], b [s]
            carried += d + T * (d + 2 * e * s + s + 2 * s + ((e + 1) * s if o.fast_biases else 0))
    return {"carried": carried, "shared": shared, "backward": backward, "backward_shared": backward_shared}


def estimate_memory(cfg, world: int = 1) -> dict:
    """A rough estimate of one process's training memory in bytes (an approximation, not a promise).

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
            f"{est['activation_bytes'] / gib:.1f} GiB; fast-weight and memory state {est['state_bytes'] / gib:.1f} "
            f"GiB) but {device} has {free / gib:.1f} GiB available; make the model or batch smaller, or pass "
            "--force-memory to try anyway")
    return est
