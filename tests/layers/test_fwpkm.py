"""FwPKM: chunked update vs the straight-from-the-spec reference, streaming, causality, second order,
persistence modes, and the addressing metrics of fastweights.experiments.addressing."""


import pytest
import torch
from torch.func import functional_call

from fastweights.components import MEMORIES, build_options, lookup
from fastweights.core.errors import UserError
from fastweights.layers.fast_memory import zscore
from fastweights.layers.fast_memory_reference import fwpkm_memory_reference
from fastweights.layers.fwpkm import FwPKM, FwPKMOptions
from helpers import assert_json_shape, in_pieces, tiny_lm

F64 = torch.float64
D_MODEL = 12


def small(**kw) -> FwPKMOptions:
    base = dict(n_subkeys=4, d_key=6, d_value=5, heads=1, topk=3, chunk_size=5)
    base.update(kw)
    return FwPKMOptions(**base)


def make(seed=0, dtype=F64, **kw) -> FwPKM:
    torch.manual_seed(seed)
    return FwPKM(D_MODEL, small(**kw)).to(dtype)


def core_inputs(B, T, opts, seed=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, opts.heads, opts.d_key, generator=g, dtype=F64)
    v = torch.randn(B, T, opts.d_value, generator=g, dtype=F64)
    gate = torch.rand(B, T, generator=g, dtype=F64)
    return q, v, gate


VARIANTS = {
    "default": {},
    "literal_scale": dict(update_scale="literal"),
    "dot_score": dict(score="dot"),
    "mse_keys": dict(key_update="mse"),
    "no_key_update": dict(key_update="none"),
    "drop_boundary": dict(boundary="drop"),
    "no_lookahead": dict(lookahead=0),
    "lookahead_2": dict(lookahead=2),
    "two_heads": dict(heads=2),
    "lr_and_weights": dict(lr=0.3, key_lr=2.0, addressing_weight=0.5),
}


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("T", [4, 5, 17])  # no write, exactly one chunk, several chunks + a partial one
def test_chunked_update_matches_reference(name, T):
    layer = make(**VARIANTS[name])
    o = layer.options
    q, v, gate = core_inputs(2, T, o)
    v_hat, st = layer.memory(q, v, gate)
    ref, K1, K2, V = fwpkm_memory_reference(q, v, gate, layer.keys1, layer.keys2, layer.values, o)
    torch.testing.assert_close(v_hat, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st.keys1[0], K1, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st.keys2[0], K2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st.dense_values(), V, rtol=1e-12, atol=1e-12)
    assert st.writes == T // o.chunk_size
    if T >= o.chunk_size:  # the update did something
        assert (V - layer.values).abs().max() > 1e-3
        if o.key_update != "none":
            assert (K1 - layer.keys1).abs().max() > 1e-8


@pytest.mark.parametrize("name", ["default", "two_heads", "mse_keys", "dot_score"])
def test_second_order_gradients_match_reference(name):
    layer = make(**VARIANTS[name])
    o = layer.options
    q, v, gate = core_inputs(2, 13, o, seed=3)
    for t in (q, v, gate):
        t.requires_grad_()
    up = torch.randn(2, 13, o.d_value, dtype=F64)
    v_hat, _ = layer.memory(q, v, gate)
    fast = torch.autograd.grad((v_hat * up).sum(), (q, v, gate))
    ref, *_ = fwpkm_memory_reference(q, v, gate, layer.keys1, layer.keys2, layer.values, o)
    slow = torch.autograd.grad((ref * up).sum(), (q, v, gate))
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_written_values_reach_later_chunks_through_the_update():
    layer = make()
    o = layer.options
    q, v, gate = core_inputs(1, 10, o)
    v.requires_grad_()
    v_hat, _ = layer.memory(q, v, gate)
    (gv,) = torch.autograd.grad(v_hat[:, o.chunk_size:].sum(), v)
    assert gv[:, 1: o.chunk_size].abs().sum() > 0  # targets of chunk 0 were written and then read
    assert gv[:, o.chunk_size + 1:].abs().sum() == 0  # chunk 1's own targets are not written before it reads


def test_per_sequence_equals_reference_run_on_each_row():
    layer = make(persistence="per_sequence")
    o = layer.options
    q, v, gate = core_inputs(3, 12, o)
    v_hat, st = layer.memory(q, v, gate)
    dense = st.dense_values()
    for b in range(3):
        ref, K1, _, V = fwpkm_memory_reference(q[b:b + 1], v[b:b + 1], gate[b:b + 1], layer.keys1, layer.keys2,
                                               layer.values, o)
        torch.testing.assert_close(v_hat[b:b + 1], ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(st.keys1[b], K1, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(dense[b], V, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("persistence", ["stream", "per_sequence", "official"])
@pytest.mark.parametrize("boundary", ["carry", "drop"])
def test_streaming_uneven_calls_equal_one_call(persistence, boundary):
    x = torch.randn(2, 23, D_MODEL, dtype=F64)
    one = make(persistence=persistence, boundary=boundary)
    pieces = make(persistence=persistence, boundary=boundary)
    y_full, st_full = one(x)
    y, st = in_pieces(pieces, x, (3, 1, 7, 2, 6))  # then 4
    torch.testing.assert_close(y, y_full, rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(st.dense_values(), st_full.dense_values(), rtol=1e-11, atol=1e-12)
    assert st.writes == st_full.writes == 4 and st.n_read == st_full.n_read == 3


def test_lookahead_target_never_affects_its_own_chunk():
    """The first token of chunk 1 is the lookahead target of chunk 0's last query: it is written
    only with chunk 1 (carry), so no output of chunk 0 -- nor chunk 1 -- depends on it through memory."""
    layer = make()
    o = layer.options
    q, v, gate = core_inputs(1, 12, o)
    v2 = v.clone()
    v2[:, o.chunk_size] += 1.0
    a, _ = layer.memory(q, v, gate)
    b, _ = layer.memory(q, v2, gate)
    torch.testing.assert_close(a[:, : 2 * o.chunk_size], b[:, : 2 * o.chunk_size], rtol=0, atol=1e-14)
    assert (a[:, 2 * o.chunk_size:] - b[:, 2 * o.chunk_size:]).abs().max() > 1e-8


def test_short_stream_never_writes():
    layer = make()
    x = torch.randn(1, 4, D_MODEL, dtype=F64)
    _, st = layer(x)
    assert st.writes == 0 and st.delta_rows == 0 and st.n_read == 4
    _, st = layer(x[:, :1], st)  # the fifth token completes the chunk
    assert st.writes == 1 and st.delta_rows > 0


def test_one_chunk_value_update_by_hand():
    """Eqs 14-15 written out with loops, both scales; rows not read stay unchanged."""
    for scale_mode in ("rewrite", "literal"):
        layer = make(update_scale=scale_mode, key_update="none", n_subkeys=5)
        o = layer.options
        q, v, gate = core_inputs(2, 5, o, seed=11)
        _, st = layer.memory(q, v, gate)
        before = _reads(layer, q)
        expected = layer.values.clone()
        scale = o.topk * o.heads if scale_mode == "rewrite" else 1.0
        counts = torch.zeros(layer.n_slots)
        for b in range(2):
            for t in range(4):  # pairs (t, t + 1) inside the first chunk
                for r in before["idx"][b, t].tolist():
                    counts[r] += 1
        for b in range(2):
            for t in range(4):
                resid = gate[b, t] * (before["v_hat"][b, t] - v[b, t + 1])
                for j, r in enumerate(before["idx"][b, t].tolist()):
                    expected[r] -= o.lr * scale * before["w"][b, t, j] * resid / counts[r]
        torch.testing.assert_close(st.dense_values(), expected, rtol=1e-12, atol=1e-12)
        untouched = counts == 0
        assert untouched.any()
        assert torch.equal(st.dense_values()[untouched], layer.values[untouched])


def _reads(layer, q):
    st = layer.init_state(q.shape[0], dtype=F64)
    rd = layer._read(q, st)
    return {"idx": rd.local, "w": rd.w, "v_hat": rd.v_hat}


def test_gradcheck_through_two_chunks_wrt_slow_projections():
    torch.manual_seed(0)
    d = 6
    layer = FwPKM(d, small(chunk_size=3, n_subkeys=3, topk=2, d_key=4, d_value=3)).double()
    x = torch.randn(1, 8, d, dtype=F64)
    names = ["io.q_proj.weight", "io.v_proj.weight", "io.g_proj.weight"]
    params = dict(layer.named_parameters())
    probe = torch.randn(1, 8, d, dtype=F64)

    def loss(wq, wv, wg):
        p = dict(params)
        p.update(zip(names, (wq, wv, wg)))
        y, _ = functional_call(layer, p, (x,))
        return (y[:, 3:] * probe[:, 3:]).sum()  # chunks 1 and 2 read what chunks 0 and 1 wrote

    inputs = tuple(params[n].detach().clone().requires_grad_() for n in names)
    assert torch.autograd.gradcheck(loss, inputs, eps=1e-6, atol=1e-6, fast_mode=True)
    # the update path carries gradient: with frozen memory the same loss has a different gradient
    grads = torch.autograd.grad(loss(*inputs), inputs)
    layer.frozen = True
    frozen = torch.autograd.grad(loss(*inputs), inputs)
    assert (grads[1] - frozen[1]).abs().max() > 1e-6  # v_proj only reaches later chunks through writes


def test_state_none_is_deterministic_and_stream_mode_does_not_persist():
    layer = make()
    x = torch.randn(2, 11, D_MODEL, dtype=F64)
    y1, st = layer(x)
    y2, _ = layer(x)
    assert torch.equal(y1, y2)
    y3, _ = layer(x, st)  # carrying the state continues the stream: later reads see the writes
    assert not torch.allclose(y3, y1)


def test_official_persistence_carries_over_calls_and_resets_explicitly():
    layer = make(persistence="official")
    ref = make(persistence="stream")
    x = torch.randn(1, 10, D_MODEL, dtype=F64)
    y1, st1 = layer(x)
    y_ref1, st_ref = ref(x)
    torch.testing.assert_close(y1, y_ref1, rtol=1e-12, atol=1e-12)
    y2, _ = layer(x)  # state=None, but the module now holds the tables written by the first call
    y_ref2, _ = ref(x, _continue_without_queue(ref, st_ref))
    torch.testing.assert_close(y2, y_ref2, rtol=1e-11, atol=1e-12)
    assert not torch.allclose(y2, y1)
    written = layer.values.clone()
    layer.reset_memory()
    assert not torch.allclose(layer.values, written)  # the written tables are gone
    fresh = make(persistence="stream")
    fresh.load_state_dict(layer.state_dict())
    y3, _ = layer(x)  # after the reset the module reads its new tables with nothing written: a fresh stream
    torch.testing.assert_close(y3, fresh(x)[0], rtol=1e-12, atol=1e-12)


def _continue_without_queue(layer, st):
    """The official mode keeps the tables across calls but starts each call with an empty queue."""
    fresh = layer.init_state(st.batch, dtype=F64)
    return type(st)(**{**st.__dict__, "pending_q": fresh.pending_q, "pending_v": fresh.pending_v,
                       "pending_g": fresh.pending_g, "pending_pos": fresh.pending_pos, "n_stale": 0,
                       "reads": None, "n_read": 0, "position": 0})


def test_official_persistence_backward_works():
    layer = make(persistence="official", dtype=torch.float32)
    x = torch.randn(2, 12, D_MODEL, requires_grad=True)
    y, _ = layer(x)
    y.square().sum().backward()
    assert x.grad.abs().sum() > 0


def test_batch_rows_share_memory_only_in_shared_modes():
    x = torch.randn(2, 10, D_MODEL, dtype=F64)
    x2 = x.clone()
    x2[1] = torch.randn(10, D_MODEL, dtype=F64)
    for persistence, shared in (("stream", True), ("per_sequence", False)):
        layer = make(persistence=persistence)
        a, _ = layer(x)
        b, _ = layer(x2)
        torch.testing.assert_close(a[0, :5], b[0, :5], rtol=0, atol=1e-13)  # chunk 0 reads the initial tables
        differs = (a[0, 5:] - b[0, 5:]).abs().max() > 1e-8
        assert bool(differs) == shared


def test_fast_tables_are_not_parameters_and_slow_projections_train():
    layer = make(dtype=torch.float32)
    names = {n for n, _ in layer.named_parameters()}
    assert not names & {"keys1", "keys2", "values"}
    assert {"keys1", "keys2", "values"} <= {n for n, _ in layer.named_buffers()}
    x = torch.randn(2, 12, D_MODEL)
    y, _ = layer(x)
    y.square().mean().backward()
    for n, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, n
    assert layer.aux_loss is None
    assert set(layer.last_stats) >= {"gate_mean", "mem_loss", "addr_loss"}


def test_bf16_autocast_keeps_fast_weights_fp32():
    layer = make(dtype=torch.float32)
    x = torch.randn(1, 11, D_MODEL)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, st = layer(x)
    assert st.parts[0][1].dtype == torch.float32 and st.keys1.dtype == torch.float32
    assert st.pending_v.dtype == torch.float32
    assert torch.isfinite(y.float()).all()


def test_frozen_memory_never_writes_and_reads_the_initial_tables():
    layer = make(frozen=True)
    x = torch.randn(2, 13, D_MODEL, dtype=F64)
    y, st = layer(x)
    assert st.writes == 0 and st.delta_rows == 0 and st.pending_q.shape[1] == 0
    y_short, _ = make()(x[:, :4])  # before any write the unfrozen layer reads the same tables
    torch.testing.assert_close(y[:, :4], y_short, rtol=1e-12, atol=1e-12)
    layer.frozen = False  # switchable at run time (the paper's D.2 check)
    _, st = layer(x)
    assert st.writes == 2


def test_first_order_ablation_detaches_the_update():
    layer = make(second_order=False)
    o = layer.options
    q, v, gate = core_inputs(1, 10, o)
    v.requires_grad_()
    v_hat, st = layer.memory(q, v, gate)
    assert not any(d.requires_grad for _, d in st.parts)
    assert not v_hat.requires_grad or torch.autograd.grad(v_hat.sum(), v, allow_unused=True)[0] is None


def test_write_touches_only_rows_read_with_large_table():
    """N = 64^2 slots: one write adds at most B * C * H * k delta rows, never a dense table."""
    layer = make(n_subkeys=64, dtype=torch.float32)
    x = torch.randn(2, 5, D_MODEL)
    _, st = layer(x)
    ((rows, delta),) = st.parts
    assert 0 < rows.numel() <= 2 * 5 * 3 < layer.n_slots
    assert delta.shape == (rows.numel(), 5)


def test_merging_many_deltas_keeps_outputs():
    layer = make(chunk_size=3)
    layer.fold_threshold = 10**9  # no folding into a dense table here
    q, v, gate = core_inputs(2, 20, layer.options)
    ref, st_ref = layer.memory(q, v, gate)
    layer.max_parts = 2  # merge as soon as a third delta appears
    out, st = layer.memory(q, v, gate)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert len(st.parts) <= 2 < len(st_ref.parts) == 6
    torch.testing.assert_close(st.dense_values(), st_ref.dense_values(), rtol=1e-12, atol=1e-12)


def test_no_grad_fold_keeps_outputs():
    layer = make()
    x = torch.randn(1, 26, D_MODEL, dtype=F64)
    with torch.no_grad():
        y_ref, st_ref = layer(x)
        layer.fold_threshold = 1  # fold after every write
        y, st = layer(x)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    assert st.delta_rows == 0 and st.base is not layer.values
    torch.testing.assert_close(st.dense_values(), st_ref.dense_values(), rtol=1e-12, atol=1e-12)


def test_detached_state_continues_identically():
    layer = make()
    x = torch.randn(1, 14, D_MODEL, dtype=F64, requires_grad=True)
    _, st = layer(x[:, :7])
    y1, _ = layer(x[:, 7:], st)
    y2, _ = layer(x[:, 7:], st.detach())
    torch.testing.assert_close(y1, y2, rtol=0, atol=0)
    # the detached state cuts the graph: no gradient reaches the first call's inputs through it
    g1 = torch.autograd.grad(y1.sum(), x)[0]
    g2 = torch.autograd.grad(y2.sum(), x)[0]
    assert g1[:, :7].abs().max() > 1e-6 and torch.all(g2[:, :7] == 0)
    torch.testing.assert_close(g2[:, 7:], g1[:, 7:], rtol=1e-12, atol=1e-12)


def test_registry_and_user_errors():
    entry = lookup(MEMORIES, "memory", "fwpkm")
    assert entry.cls is FwPKM and entry.cls.placement == "before_mixer"
    opts = build_options(entry, {"n_subkeys": 8, "topk": 2, "chunk_size": 4, "d_key": 4, "d_value": 3})
    layer = entry.cls(d_model=D_MODEL, options=opts)
    y, _ = layer(torch.randn(1, 6, D_MODEL))
    assert y.shape == (1, 6, D_MODEL)
    with pytest.raises(UserError):
        build_options(entry, {"chunksize": 4})
    for bad in (dict(score="cos"), dict(topk=9, n_subkeys=4), dict(persistence="forever"), dict(d_key=5),
                dict(chunk_size=1)):
        with pytest.raises(UserError):
            FwPKM(D_MODEL, small(**bad))
    with pytest.raises(UserError):
        layer(torch.randn(2, 3, D_MODEL), layer(torch.randn(1, 3, D_MODEL))[1])


def test_read_log_and_tracer_hooks():
    from fastweights.experiments.addressing import SlotTracer

    layer = make(dtype=torch.float32)
    layer.record_reads = True
    tracer = SlotTracer()
    layer.tracer = tracer
    x = torch.randn(1, 12, D_MODEL)
    _, st = layer(x[:, :7])
    _, st = layer(x[:, 7:], st)
    positions = torch.cat([r["position"] for r in layer.read_log])
    assert torch.equal(positions, torch.arange(12))
    assert sum(r["indices"].shape[1] for r in layer.read_log) == 12
    # after two writes, every slot read by a written query names that query and its lookahead target
    last = layer.read_log[0]["indices"][0, 0].tolist()
    entries = tracer.lookup(last[0])
    assert entries and all(e["target_pos"] == e["query_pos"] + 1 for e in entries)
    assert all(e["query_pos"] < 10 for e in entries)


# ---------------------------------------------------------------------------- in a model


def _model(memory="fwpkm", vocab_size=23, **opts):
    base = dict(n_subkeys=6, d_key=8, d_value=8, topk=2, chunk_size=4) if memory == "fwpkm" else {}
    return tiny_lm(vocab_size, memory=memory, memory_layers=[1], options={memory: {**base, **opts}}, training=True)


def test_model_with_fwpkm_streams_and_trains():
    from fastweights.models.lm import detach_state

    model = _model().double()
    tokens = torch.randint(0, 23, (2, 19))
    full = model(tokens).logits
    state, outs = None, []
    for a, b in [(0, 3), (3, 4), (4, 13), (13, 19)]:
        out = model(tokens[:, a:b], state)
        outs.append(out.logits)
        state = detach_state(out.state)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-10, atol=1e-10)
    mem_state = state["layers"][1]["memory"]
    assert isinstance(mem_state, type(model(tokens[:, :1]).state["layers"][1]["memory"]))
    assert not mem_state.parts[0][1].requires_grad  # the lead's detach_state reaches inside the state
    model = model.float()
    out = model(tokens, targets=tokens)
    out.loss.backward()
    assert out.aux_loss is None
    block = model.blocks[1]
    assert block.memory.io.q_proj.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------------------- memory statistics


def test_addressing_stats_on_hand_made_counts():
    from fastweights.experiments.addressing import addressing_stats, windowed_addressing_stats

    counts = torch.tensor([3, 1, 0, 0, 2, 0, 0, 2])  # N = 8, 8 reads
    s = addressing_stats(counts)
    assert s["collision"] == pytest.approx((3 + 2 + 2) / 8)
    assert s["coverage"] == pytest.approx(4 / 8)
    p = torch.tensor([3, 1, 2, 2], dtype=F64) / 8
    assert s["kld"] == pytest.approx(float((p * torch.log(p * 8)).sum()))
    uniform = addressing_stats(torch.ones(8, dtype=torch.long))
    assert uniform == {"collision": 0.0, "coverage": 1.0, "kld": pytest.approx(0.0, abs=1e-12), "reads": 8}
    # windows: two full windows of 2 tokens x 2 reads; a trailing partial window is ignored
    idx = torch.tensor([[0, 1], [2, 3], [0, 0], [0, 0], [5, 6]])
    w = windowed_addressing_stats(idx, 8, window=2)
    assert w["windows"] == 2 and not w["partial"]
    assert w["coverage"] == pytest.approx((4 / 8 + 1 / 8) / 2)
    assert w["collision"] == pytest.approx((0 + 1) / 2)
    short = windowed_addressing_stats(idx, 8, window=100)
    assert short["partial"] and short["windows"] == 1


def test_slot_tracer_returns_the_last_write_before_a_read():
    from fastweights.experiments.addressing import SlotTracer

    tr = SlotTracer()
    rows = torch.tensor([[[3, 4], [3, 5]]])  # one sequence, two queries, two reads each
    w = torch.tensor([[[0.6, 0.4], [0.7, 0.3]]])
    tr.record_write(rows, w, torch.tensor([0, 1]), torch.tensor([1, 2]))
    tr.record_write(rows[:, :1], w[:, :1], torch.tensor([5]), torch.tensor([6]))
    assert [e["query_pos"] for e in tr.lookup(3)] == [5]
    assert sorted(e["query_pos"] for e in tr.lookup(3, before=4)) == [0, 1]  # the second write came later
    assert tr.lookup(5, before=2) == []  # written only after token 2 was read
    assert tr.lookup(9) == []


def test_addressing_cli_and_trace(tmp_path, capsys):
    import json

    from fastweights.checkpoints.format import save_model
    from fastweights.cli import main
    from fastweights.core.config import RunConfig
    from fastweights.data import build_tokenizer

    text = "the cat sat on the mat. the dog sat on the log. " * 3
    tok = build_tokenizer("char", text)
    model = _model(vocab_size=tok.vocab_size, chunk_size=8)
    cfg = RunConfig()
    cfg.model = model.config
    cfg.train.seq_len = 32
    save_model(model, tmp_path / "ck", cfg, tok)
    rc = main(["inspect", "addressing", "--checkpoint", str(tmp_path / "ck"), "--text", text, "--window", "40",
               "--trace", "60", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert_json_shape(out, "inspect_addressing")
    (name,) = out["layers"]
    s = out["layers"][name]
    assert s["windows"] == (len(text) - 1) // 40 and 0 < s["coverage"] <= 1 and 0 <= s["collision"] <= 1
    assert 0 < s["gate_mean"] < 1
    slots = out["trace"]["60"]["layers"][name]
    assert len(slots) == 2  # H k = 1 x 2 reads
    stored = [e for r in slots for e in r["stored"]]
    assert stored and all(e["target_pos"] < 60 and e["target_pos"] == e["query_pos"] + 1 for e in stored)
    assert main(["inspect", "addressing", "--checkpoint", str(tmp_path / "missing"), "--text", "abc"]) == 2
    assert main(["inspect", "addressing", "--checkpoint", str(tmp_path / "ck"), "--text", text, "--window", "0"]) == 2


@pytest.mark.parametrize("gate_form", ["linear", "mean8"])
def test_fused_inputs_equal_separate_norms_and_projections(gate_form):
    # inputs() folds the three RMS-norm gains into one matmul; it must equal proj(norm(h)) for each,
    # and output() the same for the output norm
    torch.manual_seed(0)
    mem = FwPKM(d_model=12, options=FwPKMOptions(n_subkeys=4, d_key=8, d_value=6, topk=2, chunk_size=4,
                                                 gate_form=gate_form)).double()
    io = mem.io
    assert io.g_proj.out_features == {"linear": 1, "mean8": 8}[gate_form]  # the released code's gate: mean of 8
    with torch.no_grad():
        for norm in (io.q_norm, io.v_norm, io.g_norm):
            norm.weight.normal_()
    h = torch.randn(2, 5, 12, dtype=torch.float64)
    q, v, g = io.inputs(h)
    v_ref = zscore(io.v_proj(io.v_norm(h)))
    torch.testing.assert_close(q, io.q_proj(io.q_norm(h)), rtol=0, atol=1e-12)
    torch.testing.assert_close(v, v_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(g, torch.sigmoid(io.g_proj(io.g_norm(h)).mean(-1)), rtol=0, atol=1e-12)
    # zscore is written out with sums; it must equal the spec's (v - mean) / (unbiased std + eps)
    x = torch.randn(3, 7, dtype=torch.float64)
    torch.testing.assert_close(zscore(x), (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + 1e-6),
                               rtol=0, atol=1e-12)
    # output() folds out_norm's gain into out_proj: equal to out_proj(out_norm(g v_hat + (1 - g) v))
    with torch.no_grad():
        io.out_norm.weight.normal_()
    v_hat = torch.randn(2, 5, 6, dtype=torch.float64)
    o_ref = io.out_proj(io.out_norm(g.unsqueeze(-1) * v_hat + (1 - g.unsqueeze(-1)) * v))
    torch.testing.assert_close(io.output(v_hat, v, g), o_ref, rtol=0, atol=1e-12)
