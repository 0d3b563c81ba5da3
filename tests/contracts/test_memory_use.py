"""``testing.memory_use`` (what the memory benchmarks measure): the bytes autograd saves for backward, each storage
once; the same by part of a model, parameters left out; a process's peak resident growth around a call."""

from pathlib import Path

import pytest
import torch

from fastweights.testing.memory_use import part_of, peak_rss_growth, saved_bytes, saved_by_part
from helpers import tiny_lm


def test_saved_bytes_count_each_storage_once():
    x = torch.randn(256, 64, requires_grad=True)  # 64 KiB

    def step():
        y = x * x  # saves x (twice: one storage)
        return y.sum()

    assert saved_bytes(step) == 256 * 64 * 4
    w = torch.randn(64, 32, requires_grad=True)
    assert saved_bytes(lambda: (x @ w).sum()) == (256 * 64 + 64 * 32) * 4  # matmul saves both operands
    with torch.no_grad():
        assert saved_bytes(lambda: (x * x).sum()) == 0
    # the saved tensors come back unchanged when backward runs inside the step
    x.grad = None
    assert saved_bytes(lambda: (x * x).sum().backward()) == 256 * 64 * 4
    torch.testing.assert_close(x.grad, 2 * x.detach())


def test_part_of_labels_norms_mixers_their_own_modules_and_mlps():
    from torch import nn

    class Attention(nn.Module):
        pass

    modules = {"blocks.0.mixer": Attention(), "blocks.0.mixer.q": nn.Linear(2, 2), "blocks.0.mixer.inner.k": nn.Linear(2, 2)}
    assert [part_of(n, nn.Identity(), modules) for n in ("blocks.0.norm", "final_norm", "blocks.1.attn_norm")] == \
        ["norms"] * 3
    assert part_of("embed", nn.Identity(), modules) == "embedding"
    assert part_of("blocks.0.mixer", modules["blocks.0.mixer"], modules) == "mixer:Attention"
    assert part_of("blocks.0.mixer.q", modules["blocks.0.mixer.q"], modules) == "mixer:Attention.q"
    assert part_of("blocks.0.mixer.inner.k", modules["blocks.0.mixer.inner.k"], modules) is None  # not the mixer's own
    assert part_of("blocks.0.mlp", nn.Identity(), modules) == "mlp"
    assert part_of("blocks.0.normal", nn.Identity(), modules) is None


def test_status_bytes_reads_one_field_of_proc_self_status_in_bytes(monkeypatch):
    import io

    from fastweights.testing import memory_use

    status = "Name:\tpython\nVmRSSX:\t7 kB\nVmRSS:\t  1234 kB\nVmHWM:\t  2000 kB\n"
    monkeypatch.setattr(memory_use, "open", lambda path: io.StringIO(status), raising=False)
    assert memory_use.status_bytes("VmRSS") == 1234 * 1024 and memory_use.status_bytes("VmHWM") == 2000 * 1024
    with pytest.raises(RuntimeError) as e:
        memory_use.status_bytes("VmSwap")
    assert str(e.value) == "no VmSwap in /proc/self/status"


def test_the_parts_of_a_model_and_their_saved_megabytes():
    model = tiny_lm(11)
    modules = dict(model.named_modules())
    assert part_of("embed", modules["embed"], modules) == "embedding"
    assert part_of("blocks.0.mixer", modules["blocks.0.mixer"], modules).startswith("mixer:")
    assert part_of("blocks.0.mlp", modules["blocks.0.mlp"], modules) == "mlp"
    assert part_of("blocks.0", modules["blocks.0"], modules) is None
    tokens = torch.randint(0, 11, (2, 16))
    parts = saved_by_part(model, lambda: model(tokens, targets=tokens).loss)
    assert parts == dict(sorted(parts.items())) and {"mlp", "embedding", "norms", "loss and head"} <= set(parts)
    mixer = type(modules["blocks.0.mixer"]).__name__
    assert f"mixer:{mixer}" in parts, parts  # named by the mixer's class
    assert any(k.startswith("mixer:") for k in parts) and all(v > 0 for v in parts.values())
    # backward inside the step: the saved tensors come back as they were
    assert saved_by_part(model, lambda: model(tokens, targets=tokens).loss.backward()) == parts
    total = saved_bytes(lambda: model(tokens, targets=tokens).loss) / 2**20
    params = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    assert sum(parts.values()) <= total + 1e-9 and total - sum(parts.values()) <= params + 1e-9  # parameters apart


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux only: reads /proc/self/status")
def test_peak_resident_growth_sees_a_large_allocation():
    import mmap

    def touch_64_mib():  # fresh pages of its own (a tensor may land on pages the allocator already holds)
        with mmap.mmap(-1, 64 * 2**20) as m:
            m.write(b"x" * (64 * 2**20))

    grew = peak_rss_growth(touch_64_mib)
    assert grew >= 48 * 2**20
    assert peak_rss_growth(lambda: None) < 16 * 2**20
