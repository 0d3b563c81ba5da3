"""Every registered mixer, head and memory, with every variant it declares (``test_variants`` on its class:
rule / feature-map / path / persistence / update): causal at several cut points, later outputs respond to
earlier inputs, streamed pieces equal one call, and a returned state is a value (continuing it twice gives
the same outputs); what FwPKM and FwMLP ``persistence="official"`` add across calls is checked on its own
(issue 22, scope 2). Default environment only: the torch backends, no optional package.

The cases come from the registry (``fastweights.components``), so a new component is checked here with
no edit of this file; one that declares no variants is checked with its default options.
"""

import pytest
import torch

from fastweights import components as registry
from fastweights.testing.registry_cases import B, D, T, V, VARIANTS
from fastweights.testing.registry_cases import build_component as build
from helpers import variant_cases

CUTS = (1, 4, 7, 13)  # first token, a chunk boundary (chunk_size 4), inside a chunk, near the end
PIECES = ((1, 5, 11), (8,), (3, 4, 12))

EXACT = 1e-13  # a masked matmul may reorder a sum of exact zeros and the rest: 1e-17, never a leak's size
# a later output "responds" when it moves by more than this after a unit change of one earlier input (or a
# head's label). Every variant moves some later output by >= 2.7e-3 (smallest: fwl bias-only; labels >= 0.3),
# so 1e-4 leaves a 27x margin yet fails a path that only reaches later outputs at a rounding-like or
# vanishing scale (e.g. a write multiplied by ~0), which the former 1e-8 let through.
RESPONDS = 1e-4
MARGIN = 1e-2  # written vs initial tables move every chunk's outputs by >= 0.2 here (fwmlp 0.23, fwpkm 0.81)


# known library bugs, as strict xfails of one check (an XPASS after the fix fails: drop the entry then)
KNOWN_BUGS: dict = {}  # (FwPKM official's state aliasing its value buffer was one, fixed in layers/fwpkm.py)


def cases(test=None):
    return variant_cases(KNOWN_BUGS, key=lambda kind, name, vid: (test, f"{kind}-{name}-{vid}"))


def official(layer) -> bool:
    return hasattr(layer, "initial_tables")


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, D, generator=g, dtype=torch.float64), torch.randint(0, V, (B, T), generator=g)


def call(kind, layer, x, tok, state=None):
    """One forward; ``state=None`` is a fresh stream from the layer's initial tables.

    A ``persistence="official"`` memory writes its final tables back into the module after every
    call and starts ``state=None`` from them, so without a restore each "fresh" stream here would
    read the previous call's writes (one call and pieces would start from different memories, and
    the causality comparisons would compare different memories). Restoring the initial tables
    before a fresh stream checks the same causality / pieces promises as the other modes; what
    official adds across calls is checked in ``test_official_persistence_writes_back_and_continues``.
    """
    if state is None and official(layer):
        layer.load_state_dict(layer.initial_tables)
    with torch.no_grad():
        return layer(x, tok, state) if kind == "head" else layer(x, state)


def diff(a, b) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


def written_tables(name, st) -> dict:
    """A memory state's fast tables under the names of the module buffers they start from."""
    if name == "fwpkm":
        return {"keys1": st.keys1[0], "keys2": st.keys2[0], "values": st.dense_values()}
    return {k: w[0] for k, w in st.weights.items()}


@pytest.mark.parametrize("kind,name,raw", list(cases()))
def test_causal_and_responsive_at_every_cut(kind, name, raw):
    layer = build(kind, name, raw)
    x, tok = inputs()
    y, state = call(kind, layer, x, tok)
    # a part that carries no state reads each position alone (else pieces could not equal one call); a fast
    # memory writes once per chunk (4 tokens here, targets up to 2 tokens ahead): an input reaches later
    # outputs only from the chunk after its write, so the response is checked at cuts with one after it
    positionwise, chunk_writes = state is None, isinstance(layer, registry.FastMemory)
    g = torch.Generator().manual_seed(1)
    for c in CUTS:
        # the future varies (inputs and, for a head, the tokens whose labels it learns from): the past may not
        x2, tok2 = x.clone(), tok.clone()
        x2[:, c:] = torch.randn(B, T - c, D, generator=g, dtype=torch.float64)
        tok2[:, c:] = (tok2[:, c:] + 1 + torch.randint(0, V - 1, (B, T - c), generator=g)) % V
        y2, _ = call(kind, layer, x2, tok2)
        assert diff(y2[:, :c], y[:, :c]) <= EXACT, f"cut {c}: an output before it changed"
        # one earlier input changes: every component mixing positions changes some later output
        x3 = x.clone()
        x3[:, c - 1] += 1.0
        y3, _ = call(kind, layer, x3, tok)
        assert diff(y3[:, : c - 1], y[:, : c - 1]) <= EXACT
        later = diff(y3[:, c:], y[:, c:])
        if positionwise:
            assert later == 0.0
        elif not chunk_writes or c <= T - 8:
            assert later > RESPONDS, f"cut {c}: no later output depends on position {c - 1} ({later:.2e})"
    if kind == "head":  # a label (token c) reaches the outputs from c on, never before
        for c in CUTS:
            tok3 = tok.clone()
            tok3[:, c] = (tok3[:, c] + 1) % V
            y3, _ = call(kind, layer, x, tok3)
            assert diff(y3[:, :c], y[:, :c]) <= EXACT
            assert diff(y3[:, c:], y[:, c:]) > RESPONDS


@pytest.mark.parametrize("kind,name,raw", list(cases()))
def test_pieces_equal_one_call_and_the_state_continues(kind, name, raw):
    layer = build(kind, name, raw)
    x, tok = inputs()
    nxt, nxt_tok = inputs(seed=3)
    full, state_full = call(kind, layer, x, tok)
    after_full, _ = call(kind, layer, nxt, nxt_tok, state_full)
    for cuts in PIECES:
        outs, state = [], None
        for lo, hi in zip((0, *cuts), (*cuts, T)):
            y, state = call(kind, layer, x[:, lo:hi], tok[:, lo:hi], state)
            outs.append(y)
        torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-10, atol=1e-11)
        after, _ = call(kind, layer, nxt, nxt_tok, state)  # the carried state is the one-call state
        torch.testing.assert_close(after, after_full, rtol=1e-10, atol=1e-11)


@pytest.mark.parametrize("kind,name,raw", list(cases("test_a_returned_state_is_a_value")))
def test_a_returned_state_is_a_value(kind, name, raw):
    """A state kept from a call and continued twice gives the same outputs both times (a later
    forward may not change a state its caller holds)."""
    layer = build(kind, name, raw)
    x, tok = inputs()
    nxt, nxt_tok = inputs(seed=3)
    _, state = call(kind, layer, x, tok)
    first, _ = call(kind, layer, nxt, nxt_tok, state)
    again, _ = call(kind, layer, nxt, nxt_tok, state)
    assert diff(again, first) == 0.0


@pytest.mark.parametrize("name", [n for (k, n), v in VARIANTS.items() if k == "memory" and "official" in v])
def test_official_persistence_writes_back_and_continues(name):
    """What ``persistence="official"`` promises across calls (the checks above restore its initial
    tables before each fresh stream): a call's outputs are those of ``"stream"``; the module then
    holds that call's final tables; the next ``state=None`` call reads them (with an empty queue),
    which moves its outputs by a real margin from a fresh memory's."""
    raw = VARIANTS[("memory", name)]["official"]
    layer = build("memory", name, raw)
    stream = {**raw, "persistence": "stream"}
    twin = build("memory", name, stream)  # same seed: same projections and initial tables
    x, _ = inputs()
    nxt, _ = inputs(seed=3)
    y, _ = call("memory", layer, x, None)
    y_stream, st_stream = call("memory", twin, x, None)
    assert diff(y, y_stream) <= EXACT
    held = {k: t.clone() for k, t in layer.state_dict().items()}  # copies: FwPKM updates its buffers in place
    for k, table in written_tables(name, st_stream).items():
        assert diff(held[k], table) <= EXACT, f"module {k} is not the written table"
        assert diff(held[k], layer.initial_tables[k]) > 1e-3, f"{k} was not written"  # smallest: 0.03
    with torch.no_grad():
        y_next, _ = layer(nxt)  # state=None, no restore: starts from the tables the first call wrote
    reader = build("memory", name, stream)
    reader.load_state_dict(held)
    y_read, _ = call("memory", reader, nxt, None)
    y_fresh, _ = call("memory", twin, nxt, None)
    assert diff(y_next, y_read) <= EXACT
    # y_next reads the written tables from its first chunk on, y_fresh the initial ones: every chunk differs
    for lo in range(0, T, 4):
        assert diff(y_next[:, lo:lo + 4], y_fresh[:, lo:lo + 4]) > MARGIN, f"chunk at {lo} reads no writes"
