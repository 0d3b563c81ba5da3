"""Slow PKM layer: brute-force reference, gradients, placement, registry, optimiser hints."""

import pytest
import torch
import torch.nn.functional as F

from fastweights.core.errors import UserError
from fastweights.layers.pkm import PKM, PKMOptions
from fastweights.components import MEMORIES, build_options, lookup
from fastweights.ops.pkm import pkm_topk_reference

F64 = torch.float64


def make(**kw):
    base = dict(n_subkeys=5, d_key=6, d_value=7, heads=2, topk=3)
    base.update(kw)
    torch.manual_seed(0)
    return PKM(10, PKMOptions(**base)).double()


def reference(layer, x):
    """Score all N slots per head, softmax over each head's top-k, dense read, swilu output."""
    o = layer.options
    B, T, _ = x.shape
    q = layer.query_norm(layer.query_proj(x)).view(B, T, o.heads, o.d_key)
    w, idx, _ = pkm_topk_reference(q, layer.keys1, layer.keys2, o.topk, o.score)
    dense = torch.zeros(B, T, layer.n_slots, dtype=x.dtype).scatter_add(-1, idx.flatten(-2), w.flatten(-2))
    mem = dense @ layer.values
    if o.swilu:
        mem = mem * F.silu(layer.swilu_proj(x))
    return layer.value_proj(mem) if layer.value_proj is not None else mem


@pytest.mark.parametrize("kw", [{}, dict(score="idw"), dict(swilu=False), dict(swilu=False, d_value=10),
                                dict(query_norm=False, heads=1, topk=5)])
def test_matches_brute_force_reference_with_gradients(kw):
    layer = make(**kw)
    x = torch.randn(2, 6, 10, dtype=F64)
    y, state = layer(x)
    assert state is None and y.shape == (2, 6, 10)
    ref = reference(layer, x)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    up = torch.randn_like(y)
    params = [p for p in layer.parameters()]
    ga = torch.autograd.grad((y * up).sum(), params)
    gb = torch.autograd.grad((reference(layer, x) * up).sum(), params)
    for (n, _), a, b in zip(layer.named_parameters(), ga, gb):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=n)
    assert layer.values.shape == (25, kw.get("d_value", 7))


def test_each_token_reads_only_its_own_input():
    layer = make()
    x = torch.randn(1, 8, 10, dtype=F64)
    y0, _ = layer(x)
    x2 = x.clone()
    x2[:, 4] += 1.0
    y1, _ = layer(x2)
    mask = torch.ones(8, dtype=torch.bool)
    mask[4] = False
    torch.testing.assert_close(y1[:, mask], y0[:, mask], rtol=0, atol=0)


def test_value_table_optimiser_hints_and_placement():
    layer = make(values_lr_scale=10.0, values_weight_decay=False)
    assert layer.values.lr_scale == 10.0 and layer.values.no_weight_decay
    assert PKM.placement == "replace_mlp"
    assert {n for n, _ in layer.named_parameters()} >= {"keys1", "keys2", "values", "query_proj.weight"}


def test_read_log_records_slots():
    layer = make()
    layer.record_reads = True
    layer(torch.randn(1, 3, 10, dtype=F64))
    (entry,) = layer.read_log
    assert entry["indices"].shape == (1, 3, 6) and int(entry["indices"].max()) < 25
    torch.testing.assert_close(entry["weights"].sum(-1), torch.full((1, 3), 2.0, dtype=F64))  # one softmax per head


def test_registry_model_and_user_errors():
    from fastweights.core.config import ModelConfig
    from fastweights.models.lm import LanguageModel

    entry = lookup(MEMORIES, "memory", "pkm")
    assert entry.cls is PKM
    opts = build_options(entry, {"n_subkeys": 4, "topk": 2, "heads": 2, "d_key": 4, "d_value": 8})
    cfg = ModelConfig(vocab_size=11, d_model=8, n_layers=2, n_heads=2, memory="pkm", memory_layers=[0],
                      options={"pkm": {"n_subkeys": 4, "topk": 2, "heads": 2, "d_key": 4, "d_value": 8}})
    model = LanguageModel(cfg)
    tokens = torch.randint(0, 11, (2, 9))
    out = model(tokens, targets=tokens)
    out.loss.backward()
    assert model.blocks[0].memory.values.grad.abs().sum() > 0
    assert isinstance(model.blocks[0].mlp, torch.nn.Identity)
    assert PKM(8, opts).values.shape == (16, 8)
    for bad in (dict(d_key=5), dict(topk=9, n_subkeys=4), dict(score="cos"), dict(values_lr_scale=-1.0)):
        with pytest.raises(UserError):
            make(**bad)
