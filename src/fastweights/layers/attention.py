"""Causal softmax self-attention with rotary positions, full or sliding-window, and a KV-cache state.

    q_t, k_t, v_t = RoPE(W_q x_t, t), RoPE(W_k x_t, t), W_v x_t
    o_t = sum_{s in S(t)} softmax_s(q_t . k_s / sqrt(d)) v_s,   S(t) = {s <= t}           (full)
                                                            S(t) = {t - W < s <= t}    (sliding window W)

State (the "fast weights" of softmax attention are its KV cache):
    {"k": [B, H, L, D], "v": [B, H, L, D], "pos": int}
where pos is the absolute position of the next token and L the cached length (at most W - 1 with a
window, so memory stays constant when streaming).

Padding (``attention_mask`` [B, T], 0 = padding): a padded key is never attended to, now or later (the
state then also holds "mask" [B, L], which cached keys are real, kept from then on, trimmed with the cache),
and each row's rotary positions count its real tokens only ("pos" becomes a [B] tensor of per-row
positions), so a row's queries see exactly the keys, at the relative positions, that they see alone. The
sliding window then counts real positions, not cache slots (a row's W - 1 real keys may span more slots when
padding sits between them; the cache keeps from the first slot some row still needs). ``trim_state`` (the
bounded context of generation) still cuts slots: exact for padding in front of a row's tokens (left-padded
prompts), whose padding is cut first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fastweights.components import register_mixer
from fastweights.layers.common import RotaryEmbedding, real_positions
from fastweights.ops.linear import Linear


@dataclass
class AttentionOptions:
    window: int = 0  # sliding-window size (keys per query, itself included); 0 = full causal attention
    head_dim: int = 0  # 0 -> d_model // n_heads
    rope_base: float = 10000.0


@register_mixer("attention", AttentionOptions)
class CausalSelfAttention(nn.Module):

    # facts for the project's checks and the memory estimate (fastweights.components, "what a component declares")
    test_variants = {"full": {}, "window4": {"window": 4}}
    compute_dtype_state = ("",)  # the whole state is the KV cache

    @staticmethod
    def state_floats(o, *, d_model, n_heads, seq_len, **_):  # the KV cache: keys and values
        hd = o.head_dim or d_model // n_heads
        return {"carried": 2 * n_heads * hd * (min(seq_len, o.window - 1) if o.window else seq_len)}

    def __init__(self, d_model: int, n_heads: int, options: AttentionOptions | None = None):
        super().__init__()
        options = options or AttentionOptions()
        self.n_heads = n_heads
        self.head_dim = options.head_dim or d_model // n_heads
        if options.window < 0:
            raise ValueError("window must be >= 0")
        self.window = options.window
        inner = n_heads * self.head_dim
        self.qkv = Linear(d_model, 3 * inner, bias=False)
        self.out = Linear(inner, d_model, bias=False)
        self.out.is_residual_proj = True
        self.rope = RotaryEmbedding(self.head_dim, options.rope_base)

    def forward(self, x: torch.Tensor, state: dict | None = None, attention_mask: torch.Tensor | None = None):
        B, T, _ = x.shape
        H, D = self.n_heads, self.head_dim
        pos = state["pos"] if state is not None else 0
        key_mask = state.get("mask") if state is not None else None  # [B, L] real cached keys, once padded
        qkv = self.qkv(x).view(B, T, 3, H, D).permute(2, 0, 3, 1, 4)  # [3, B, H, T, D]
        # unbind rather than indexing: its backward is one stack, where each index's backward
        # zero-fills a tensor the size of qkv (~8% of a CPU training step)
        q, k, v = qkv.unbind(0)
        if attention_mask is not None or key_mask is not None or isinstance(pos, torch.Tensor):
            return self._forward_padded(q, k, v, state, attention_mask, key_mask, pos)
        q, k = self.rope(q, pos), self.rope(k, pos)

        if state is not None and state["k"].shape[2] > 0:
            k = torch.cat([state["k"], k], dim=2)  # [B, H, L + T, D]
            v = torch.cat([state["v"], v], dim=2)
        L = k.shape[2] - T  # cached keys in front of this call's keys

        if L == 0 and self.window == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            # query i sits at absolute position pos + i, key j at pos - L + j
            qpos = torch.arange(T, device=x.device)[:, None] + L
            kpos = torch.arange(L + T, device=x.device)[None, :]
            allowed = kpos <= qpos
            if self.window:
                allowed &= kpos > qpos - self.window
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        o = o.transpose(1, 2).reshape(B, T, H * D)  # [B, H, T, D] -> [B, T, H*D]

        keep = self.window - 1 if self.window else k.shape[2]
        new_state = {
            "k": k[:, :, k.shape[2] - keep :] if keep > 0 else k[:, :, :0],
            "v": v[:, :, v.shape[2] - keep :] if keep > 0 else v[:, :, :0],
            "pos": pos + T,
        }
        return self.out(o), new_state

    def _forward_padded(self, q, k, v, state, mask, key_mask, pos):
        """The forward of a padded call, or of one continuing a state a padded call returned (see the module
        docstring): per-row positions, padded keys never attended to."""
        B, H, T, D = q.shape
        if mask is None:
            mask = torch.ones(B, T, dtype=torch.bool, device=q.device)
        positions = real_positions(mask, pos)  # [B, T]
        q, k = self.rope(q, positions), self.rope(k, positions)
        L = 0
        if state is not None and state["k"].shape[2] > 0:
            L = state["k"].shape[2]
            k = torch.cat([state["k"], k], dim=2)
            v = torch.cat([state["v"], v], dim=2)
            if key_mask is None:
                key_mask = torch.ones(B, L, dtype=torch.bool, device=q.device)
        key_mask = mask if L == 0 else torch.cat([key_mask, mask], dim=1)  # [B, L + T]
        qi = torch.arange(T, device=q.device)[:, None] + L
        kj = torch.arange(L + T, device=q.device)[None, :]
        allowed = (kj <= qi).unsqueeze(0) & key_mask.unsqueeze(1)  # [B, T, L + T]
        new_pos = torch.as_tensor(pos, device=q.device).long() + mask.sum(1)  # [B]
        cut = 0  # cached slots dropped from the front
        if self.window:
            # each real key's position in its row: the row's position after this call minus the real keys from
            # it on; the window counts positions, not cache slots, so padding never takes a real key's place
            kpos = new_pos.unsqueeze(1) - key_mask.long().flip(1).cumsum(1).flip(1)  # [B, L + T]
            allowed = allowed & (kpos.unsqueeze(1) > positions.unsqueeze(2) - self.window)
            # keep from the first slot any row's next query can still see (W - 1 real keys per row)
            alive = key_mask & (kpos > new_pos.unsqueeze(1) - self.window)
            first = torch.where(alive.any(1), alive.int().argmax(1), torch.full_like(new_pos, L + T))
            cut = int(first.min())
        # a padded query may see no key at all (softmax of nothing is NaN): let it see itself; never read
        allowed = allowed | ((kj == qi).unsqueeze(0) & ~mask.unsqueeze(-1))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed.unsqueeze(1))
        o = o.transpose(1, 2).reshape(B, T, H * D)
        new_state = {"k": k[:, :, cut:], "v": v[:, :, cut:], "mask": key_mask[:, cut:],
                     "pos": new_pos.expand(B).clone()}
        return self.out(o), new_state

    @staticmethod
    def trim_state(state: dict, keep: int) -> dict:
        """Keep only the last ``keep`` cached keys/values (bounded context when streaming)."""
        if state["k"].shape[2] <= keep:
            return state
        trimmed = {**state, "k": state["k"][:, :, -keep:] if keep else state["k"][:, :, :0],
                   "v": state["v"][:, :, -keep:] if keep else state["v"][:, :, :0]}
        if "mask" in state:
            trimmed["mask"] = state["mask"][:, -keep:] if keep else state["mask"][:, :0]
        return trimmed
