"""Product-key ops (fastweights.ops.pkm) against brute force and dense autograd references."""

import math

import pytest
import torch

from fastweights.core.errors import UserError
from fastweights.ops.pkm import (
    gather_rows,
    marginal_entropy_topk_grad,
    pkm_aggregated_grad,
    pkm_aggregated_grad_reference,
    pkm_read,
    pkm_read_reference,
    pkm_search,
    pkm_topk,
    pkm_topk_reference,
    sparse_parts_add,
    sparse_parts_merge,
    subkey_grad_topk,
    softmax_short,
    subkey_scores,
    topk_masked_softmax,
)

F64 = torch.float64


def _data(B=2, T=5, H=3, n=7, dk=8, per_sequence=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, dk, generator=g, dtype=F64)
    lead = (B, H) if per_sequence else (H,)
    k1 = torch.randn(*lead, n, dk // 2, generator=g, dtype=F64)
    k2 = torch.randn(*lead, n, dk // 2, generator=g, dtype=F64)
    return q, k1, k2


@pytest.mark.parametrize("score", ["idw", "dot"])
@pytest.mark.parametrize("per_sequence", [False, True])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_product_key_search_equals_brute_force(score, per_sequence, k):
    q, k1, k2 = _data(per_sequence=per_sequence, seed=k)
    w, idx = pkm_topk(q, k1, k2, k, score=score)
    w_ref, idx_ref, scores_ref = pkm_topk_reference(q, k1, k2, k, score=score)
    res = pkm_search(q, k1, k2, k, score=score)
    assert idx.shape == (2, 5, 3, k)
    assert torch.equal(idx, idx_ref)
    torch.testing.assert_close(res.scores, scores_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w, w_ref, rtol=1e-12, atol=1e-12)
    assert int(idx.max()) < 7 * 7


@pytest.mark.parametrize("score", ["idw", "dot"])
def test_true_topk_lies_in_product_of_half_topk_sets(score):
    """The property that makes the search exact: every brute-force top-k slot (i, j) has i in I^1, j in I^2."""
    q, k1, k2 = _data(B=3, T=6, H=2, n=9, seed=5)
    k, n = 4, 9
    res = pkm_search(q, k1, k2, k, score=score)
    _, idx_ref, _ = pkm_topk_reference(q, k1, k2, k, score=score)
    i, j = idx_ref // n, idx_ref % n  # [B, T, H, k]
    in1 = (i.unsqueeze(-1) == res.sub_indices1.unsqueeze(-2)).any(-1)
    in2 = (j.unsqueeze(-1) == res.sub_indices2.unsqueeze(-2)).any(-1)
    assert bool(in1.all()) and bool(in2.all())
    # and the ranks (a, b) of i and j within the sorted half top-k sets obey (a + 1)(b + 1) <= k,
    # the candidate bound the search uses
    a = (i.unsqueeze(-1) == res.sub_indices1.unsqueeze(-2)).float().argmax(-1)
    b = (j.unsqueeze(-1) == res.sub_indices2.unsqueeze(-2)).float().argmax(-1)
    assert bool(((a + 1) * (b + 1) <= k).all())
    assert bool(((a + 1) * (b + 1) > k // 2).any())  # the bound is reached, not vacuous


def test_idw_weights_are_normalised_inverse_distance_products():
    q, k1, k2 = _data(B=1, T=4, H=2, n=6, dk=6)
    eps, k, n = 1e-3, 4, 6
    w, idx = pkm_topk(q, k1, k2, k, score="idw", eps=eps)
    i, j = idx // n, idx % n
    half = 3
    heads = torch.arange(2).view(1, 1, 2, 1)
    d1 = (q[..., :half].unsqueeze(-2) - k1[heads, i]).pow(2).sum(-1)  # [B, T, H, k]
    d2 = (q[..., half:].unsqueeze(-2) - k2[heads, j]).pow(2).sum(-1)
    inv = 1.0 / ((eps + d1) * (eps + d2))
    torch.testing.assert_close(w, inv / inv.sum(-1, keepdim=True), rtol=1e-12, atol=1e-12)


def test_subkey_scores_idw_expansion_matches_difference_form():
    q, k1, _ = _data(B=2, T=3, H=2, n=5, dk=8)
    s = subkey_scores(q[..., :4], k1, "idw", 1e-3)
    direct = -torch.log(1e-3 + (q[..., :4].unsqueeze(-2) - k1.unsqueeze(0).unsqueeze(0)).pow(2).sum(-1))
    torch.testing.assert_close(s, direct, rtol=1e-12, atol=1e-12)


def test_read_matches_dense_reference_and_gradients():
    g = torch.Generator().manual_seed(1)
    values = torch.randn(20, 6, generator=g, dtype=F64, requires_grad=True)
    idx = torch.randint(0, 20, (2, 3, 5), generator=g)
    w = torch.rand(2, 3, 5, generator=g, dtype=F64, requires_grad=True)
    out = pkm_read(values, idx, w)
    ref = pkm_read_reference(values, idx, w)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    up = torch.randn(2, 3, 6, generator=g, dtype=F64)
    ga = torch.autograd.grad((out * up).sum(), (values, w))
    gb = torch.autograd.grad((ref * up).sum(), (values, w))
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gather_rows(values, idx), values[idx])


@pytest.mark.parametrize("average", [True, False])
def test_aggregated_write_matches_dense_autograd(average):
    g = torch.Generator().manual_seed(2)
    n_rows = 12  # few rows and many reads: every row is hit several times (collisions)
    idx = torch.randint(0, n_rows, (3, 4, 5), generator=g)
    w = torch.rand(3, 4, 5, generator=g, dtype=F64)
    e = torch.randn(3, 4, 7, generator=g, dtype=F64)
    rows, grad, counts = pkm_aggregated_grad(idx, w, e, average=average)
    rows_r, grad_r, counts_r = pkm_aggregated_grad_reference(idx, w, e, n_rows, average=average)
    # run-start form: all 60 reads, sorted; a row's gradient and count at its first occurrence, zero at repeats
    assert rows.shape == (60,) and grad.shape == (60, 7) and counts.shape == (60,)
    assert torch.equal(rows, idx.reshape(-1).sort().values)
    start = torch.cat([torch.tensor([True]), rows[1:] != rows[:-1]])
    assert torch.equal(counts > 0, start)
    assert torch.equal(grad[~start], torch.zeros_like(grad[~start]))
    assert torch.equal(rows[start], rows_r) and torch.equal(counts[start], counts_r)
    assert int(counts.max()) > 1
    torch.testing.assert_close(grad[start], grad_r, rtol=1e-12, atol=1e-12)
    # the table the write produces (index_add: repeats add zero) equals the dense gradient
    dense = torch.zeros(n_rows, 7, dtype=F64).index_add(0, rows, grad)
    torch.testing.assert_close(dense[rows_r], grad_r, rtol=1e-12, atol=1e-12)
    # by hand for one row: (1/N_r) sum_{reads of r} w e
    r = int(rows[0])
    mask = idx == r
    manual = (w[mask].unsqueeze(-1) * e.unsqueeze(-2).expand(3, 4, 5, 7)[mask]).sum(0)
    if average:
        manual = manual / mask.sum()
    torch.testing.assert_close(grad[0], manual, rtol=1e-12, atol=1e-12)


def test_aggregated_write_is_twice_differentiable():
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, 5, (4, 3), generator=g)
    w = torch.rand(4, 3, generator=g, dtype=F64, requires_grad=True)
    e = torch.randn(4, 2, generator=g, dtype=F64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda w, e: pkm_aggregated_grad(idx, w, e)[1], (w, e))


def _run_start_parts(g, n_rows, d, n_parts=4, reads=8):
    """Parts as the layer writes them: pkm_aggregated_grad of random reads (repeated rows included),
    plus one part of distinct ids (the form before issue 34, a special case of the run-start form)."""
    parts = []
    for i in range(n_parts):
        idx = torch.randint(0, n_rows, (reads,), generator=g)
        if i == n_parts - 1:
            idx = torch.unique(idx)
        e = torch.randn(idx.numel(), d, generator=g, dtype=F64)
        rows, grad, _ = pkm_aggregated_grad(idx.unsqueeze(-1), torch.ones(idx.numel(), 1, dtype=F64), e)
        parts.append((rows, grad.clone().requires_grad_()))
    return parts


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("lookup", ["search", "map"])
def test_sparse_parts_add_and_merge_match_dense(lookup, static):
    """Both ways of finding a part's rows (binary search; the row -> position map used when the id
    range is small), with data-independent shapes (GPU, compile) or gathering only the hits (CPU),
    give the dense sum and the same gradients."""
    n_ids = None if lookup == "search" else 30
    g = torch.Generator().manual_seed(4)
    n_rows, d = 30, 3
    parts = _run_start_parts(g, n_rows, d)
    assert any(bool((r[1:] == r[:-1]).any()) for r, _ in parts)  # repeated ids inside a part
    dense = torch.zeros(n_rows, d, dtype=F64)
    for i, (rows, delta) in enumerate(parts):
        dense = dense.index_add(0, rows, delta)
        ids = torch.randint(0, n_rows, (17,), generator=g)
        base = torch.randn(17, d, generator=g, dtype=F64)
        got = sparse_parts_add(base, ids, parts[: i + 1], n_ids, static=static)
        torch.testing.assert_close(got, base + dense[ids], rtol=0, atol=1e-14)
    merged_rows, merged = sparse_parts_merge(parts)
    assert merged_rows.numel() == sum(r.numel() for r, _ in parts)  # static size: the entries merged
    assert torch.equal(merged_rows, torch.cat([r for r, _ in parts]).sort().values)
    start = torch.cat([torch.tensor([True]), merged_rows[1:] != merged_rows[:-1]])
    torch.testing.assert_close(merged[start], dense[merged_rows[start]], rtol=0, atol=1e-14)
    assert torch.equal(merged[~start], torch.zeros_like(merged[~start]))
    ids = torch.arange(n_rows)
    torch.testing.assert_close(sparse_parts_add(torch.zeros(n_rows, d, dtype=F64), ids, [(merged_rows, merged)],
                                                n_ids, static=static), dense, rtol=0, atol=1e-14)
    assert torch.autograd.gradcheck(lambda *ds: sparse_parts_add(torch.zeros(n_rows, d, dtype=F64), ids,
                                                                 [(r, x) for (r, _), x in zip(parts, ds)], n_ids,
                                                                 static=static),
                                    tuple(p[1] for p in parts))


def _graph_shapes_static(fn, *args):
    """Compile ``fn`` with ``fullgraph=True`` (a graph break raises) and return (its result, the graph's
    tensors whose size depends on the data: unbacked sizes, which on a GPU are a host sync)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm  # run the captured graph as it is

    torch._dynamo.reset()
    try:
        out = torch.compile(fn, fullgraph=True, backend=capture)(*args)
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1
    dynamic = [node.format_node() for node in graphs[0].graph.nodes
               if isinstance(node.meta.get("example_value"), torch.Tensor)
               and free_unbacked_symbols(node.meta["example_value"])]
    return out, dynamic


def test_write_compiles_in_one_graph_without_data_dependent_shapes():
    """The FwPKM write (aggregated gradient, merge, read back) compiles with fullgraph=True, and no
    tensor in its graph has a size that depends on the data: the CPU stand-in for "no host sync on a
    GPU" (torch.unique, the write before issue 34, compiles too but with a data-dependent size)."""
    g = torch.Generator().manual_seed(5)
    idx = torch.randint(0, 40, (2, 6, 3), generator=g)
    w = torch.rand(2, 6, 3, generator=g, dtype=F64)
    e = torch.randn(2, 6, 4, generator=g, dtype=F64)
    ids = torch.randint(0, 40, (11,), generator=g)
    base = torch.randn(11, 4, generator=g, dtype=F64)

    def write(idx, w, e, ids, base):
        rows, grad, _ = pkm_aggregated_grad(idx, w, e)
        parts = ((rows, -grad), (rows[:5], grad[:5]))
        merged = sparse_parts_merge(parts)
        return sparse_parts_add(base, ids, (merged,), 40) + sparse_parts_add(base, ids, parts)

    out, dynamic = _graph_shapes_static(write, idx, w, e, ids, base)
    assert dynamic == []
    torch.testing.assert_close(out, write(idx, w, e, ids, base), rtol=0, atol=1e-14)
    _, dynamic_unique = _graph_shapes_static(lambda x: torch.unique(x, return_counts=True)[1], idx)
    assert dynamic_unique  # the check sees a data-dependent size where there is one


@pytest.mark.parametrize("options", [{}, {"persistence": "per_sequence", "key_update": "mse"}])
def test_fwpkm_layer_compiles_without_data_dependent_shapes(options):
    """The whole FwPKM layer (reads, writes across three chunks) traces as one graph with static shapes
    and gives the eager result, forward and backward."""
    from fastweights.layers.fwpkm import FwPKM, FwPKMOptions

    torch.manual_seed(0)
    layer = FwPKM(8, FwPKMOptions(n_subkeys=6, d_key=8, d_value=8, topk=3, chunk_size=8, **options)).double()
    x = torch.randn(2, 20, 8, dtype=F64, requires_grad=True)
    y, dynamic = _graph_shapes_static(lambda x: layer(x)[0], x)
    assert dynamic == []
    (gx,) = torch.autograd.grad(y.square().sum(), x)
    y_ref = layer(x)[0]
    (gx_ref,) = torch.autograd.grad(y_ref.square().sum(), x)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("score", ["idw", "dot"])
@pytest.mark.parametrize("per_sequence", [False, True])
def test_addressing_key_gradient_matches_autograd(score, per_sequence):
    """Eqs 16-18 on the top-k entries only equal autograd of the dense top-k-masked formulation."""
    q, k1, _ = _data(B=2, T=6, H=2, n=5, dk=8, per_sequence=per_sequence, seed=7)
    k, n = 2, 5
    keys = k1.clone().requires_grad_()
    s = subkey_scores(q[..., :4], keys, score)  # [B, T, H, n]
    probs = topk_masked_softmax(s, k)
    assert (probs > 0).sum(-1).eq(k).all()  # exactly k sub-keys per row on random data
    p_bar = probs.mean(dim=(1,) if per_sequence else (0, 1))
    loss = (p_bar * torch.log(p_bar + 1e-8)).sum()  # -H(p_bar), summed over heads (and sequences)
    (auto,) = torch.autograd.grad(loss, keys)
    top, idx = s.detach().topk(k, dim=-1)
    grad, loss_topk = marginal_entropy_topk_grad(top, idx, n, per_sequence)
    manual = subkey_grad_topk(grad, idx, top, q[..., :4], keys.detach(), score, per_sequence)
    torch.testing.assert_close(loss_topk, loss.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(manual, auto, rtol=1e-10, atol=1e-12)


def test_addressing_gradient_is_twice_differentiable():
    q, k1, _ = _data(B=1, T=4, H=1, n=4, dk=4, seed=8)
    q.requires_grad_()
    keys = k1.clone().requires_grad_()

    def step(q, keys):  # one key update (eq 18) as a function of the queries and keys
        s = subkey_scores(q[..., :2], keys, "idw")
        top, idx = s.topk(2, dim=-1)
        grad, _ = marginal_entropy_topk_grad(top, idx, 4)
        return keys - subkey_grad_topk(grad, idx, top, q[..., :2], keys, "idw")

    assert torch.autograd.gradgradcheck(step, (q, keys))


def test_search_scores_twice_differentiable():
    q, k1, k2 = _data(B=1, T=2, H=1, n=4, dk=4, seed=9)
    q.requires_grad_()
    k1.requires_grad_()

    def f(q, k1):
        return torch.softmax(pkm_search(q, k1, k2, 2).scores, -1)

    assert torch.autograd.gradgradcheck(f, (q, k1))


def test_per_token_cost_has_no_dense_slot_axis():
    """With N = 4096^2 slots the search returns [.., k] results (internally: [.., n] sub-key scores
    and [.., k^2] candidates, never [.., N])."""
    n = 4096
    q = torch.randn(1, 3, 1, 8)
    k1, k2 = torch.randn(1, n, 4), torch.randn(1, n, 4)
    res = pkm_search(q, k1, k2, 4)
    assert res.sub_top1.shape == (1, 3, 1, 4) and int(res.indices.max()) < n * n
    assert math.prod(res.scores.shape) == 12


def test_bad_arguments_raise_user_errors():
    q, k1, k2 = _data()
    with pytest.raises(UserError):
        pkm_topk(q, k1, k2, 3, score="cosine")
    with pytest.raises(UserError):
        pkm_topk(q, k1, k2, 99)


def test_softmax_short_equals_torch_softmax_with_gradients():
    x = torch.randn(3, 5, 8, dtype=F64, requires_grad=True)
    torch.testing.assert_close(softmax_short(x), torch.softmax(x, -1), rtol=0, atol=1e-15)
    g = torch.randn(3, 5, 8, dtype=F64)
    ours = torch.autograd.grad(softmax_short(x), x, g, create_graph=True)[0]
    ref = torch.autograd.grad(torch.softmax(x, -1), x, g, create_graph=True)[0]
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-14)
    assert torch.autograd.gradgradcheck(softmax_short, (x,))
    big = torch.tensor([[1000.0, 999.0, -1000.0]], dtype=F64)  # the max shift keeps exp finite
    torch.testing.assert_close(softmax_short(big), torch.softmax(big, -1))
