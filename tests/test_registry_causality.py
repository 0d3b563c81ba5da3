"""Every registered mixer, head and memory, with every rule / feature-map / path variant: causal at
several cut points, later outputs respond to earlier inputs, and streamed pieces equal one call
(issue 22, scope 2). Default environment only: the torch backends, no optional package.

A component registered later without an entry in VARIANTS fails ``test_every_registered_name_is_covered``.
"""

import pytest
import torch

from fastweights.models import registry

D, HEADS, V, T, B = 12, 2, 9, 16, 2
CUTS = (1, 4, 7, 13)  # first token, a chunk boundary (chunk_size 4), inside a chunk, near the end
PIECES = ((1, 5, 11), (8,), (3, 4, 12))

FWP_MAPS = {"elu1": {}, "dpfp": {"nu": 2}, "favor": {"n_features": 5}, "identity": {"sum_norm": False, "l2_norm": True}}
FWP = {f"{rule}-{fm}": {"rule": rule, "feature_map": fm, "chunk_size": 4, **extra}
       for rule in ("sum", "gated", "delta", "gated_delta") for fm, extra in FWP_MAPS.items()}
FWP["sum-dpfp-normalize"] = {"rule": "sum", "feature_map": "dpfp", "normalize": True, "chunk_size": 4}

# (kind, name) -> {variant id: options}; mixes: whether an output depends on earlier positions at all
VARIANTS = {
    ("mixer", "attention"): {"full": {}, "window4": {"window": 4}},
    ("mixer", "fwp"): FWP,
    ("mixer", "fast_rnn"): {"matrix": {"read_mode": "matrix", "hidden": 8},
                            "attention-2steps": {"read_mode": "attention", "hidden": 8, "inner_steps": 2},
                            "no-ln-preliminary": {"read_mode": "matrix", "hidden": 8, "ln_preliminary": False},
                            "ln-rnn": {"hidden": 8, "fast_weights": False}},
    ("mixer", "lstm"): {"default": {"hidden": 8}},
    ("mixer", "gdn"): {"conv-gate": {"chunk_size": 4, "backend": "torch"},
                       "plain": {"chunk_size": 4, "backend": "torch", "use_short_conv": False, "use_gate": False,
                                 "expand_v": 2.0}},
    ("head", "fwl"): {"default-path": {"hidden": 4, "segment_len": 5, "chunk_size": 64, "step_size_init": 0.3},
                      "chunked-path": {"hidden": 4, "segment_len": 5, "chunk_size": 4, "step_size_init": 0.3},
                      "no-segments": {"hidden": 4, "segment_len": 0, "chunk_size": 64, "step_size_init": 0.3},
                      "slow-biases": {"hidden": 4, "segment_len": 5, "fast_biases": False, "step_size_init": 0.3},
                      "bias-only": {"hidden": 4, "bias_only": True, "step_size_init": 0.3}},
    ("memory", "pkm"): {"dot": {"n_subkeys": 4, "d_key": 4, "d_value": 6, "heads": 2, "topk": 3},
                        "idw": {"n_subkeys": 4, "d_key": 4, "d_value": 6, "heads": 1, "topk": 2, "score": "idw"}},
    ("memory", "fwpkm"): {p: {"n_subkeys": 3, "d_key": 4, "d_value": 6, "topk": 2, "chunk_size": 4, "persistence": p,
                              **extra}
                          for p, extra in (("stream", {}), ("per_sequence", {"lookahead": 2}),
                                           ("stream-dot-drop", {"score": "dot", "boundary": "drop"}))},
    ("memory", "fwmlp"): {p: {"d_key": 4, "d_value": 6, "hidden": 5, "chunk_size": 4, "lr": 0.5, "persistence": p,
                              **extra}
                          for p, extra in (("stream", {}), ("per_sequence", {"lookahead": 0}),
                                           ("stream-clip-drop", {"grad_clip": 0.05, "boundary": "drop"}))},
}
POSITIONWISE = {("memory", "pkm")}
# memories that write once per chunk (4 tokens here, targets up to 2 tokens ahead): an input reaches
# later outputs only from the chunk after its write, so the response is checked at cuts with one after it
CHUNK_WRITES = {("memory", "fwpkm"), ("memory", "fwmlp")}
EXACT = 1e-13  # a masked matmul may reorder a sum of exact zeros and the rest: 1e-17, never a leak's size
TABLES = {"mixer": registry.MIXERS, "head": registry.HEADS, "memory": registry.MEMORIES}


def cases():
    for (kind, name), variants in VARIANTS.items():
        for vid, raw in variants.items():
            yield pytest.param(kind, name, raw, id=f"{kind}-{name}-{vid}")


def build(kind, name, raw):
    entry = registry.lookup(TABLES[kind], kind, name)
    raw = dict(raw)
    if name in ("fwpkm", "fwmlp"):
        raw["persistence"] = raw["persistence"].split("-")[0]
    options = registry.build_options(entry, raw)
    torch.manual_seed(0)
    if kind == "mixer":
        layer = entry.cls(d_model=D, n_heads=HEADS, options=options)
    elif kind == "head":
        layer = entry.cls(d_model=D, vocab_size=V, options=options)
    else:
        layer = entry.cls(d_model=D, options=options)
    return layer.double().eval()


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, D, generator=g, dtype=torch.float64), torch.randint(0, V, (B, T), generator=g)


def call(kind, layer, x, tok, state=None):
    with torch.no_grad():
        return layer(x, tok, state) if kind == "head" else layer(x, state)


def diff(a, b) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


def test_every_registered_name_is_covered():
    registry.load_providers()
    for kind, table in TABLES.items():
        assert {n for k, n in VARIANTS if k == kind} == set(table), kind


@pytest.mark.parametrize("kind,name,raw", list(cases()))
def test_causal_and_responsive_at_every_cut(kind, name, raw):
    layer = build(kind, name, raw)
    x, tok = inputs()
    y, _ = call(kind, layer, x, tok)
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
        if (kind, name) in POSITIONWISE:
            assert later == 0.0
        elif (kind, name) not in CHUNK_WRITES or c <= T - 8:
            assert later > 1e-8, f"cut {c}: no later output depends on position {c - 1}"
    if kind == "head":  # a label (token c) reaches the outputs from c on, never before
        for c in CUTS:
            tok3 = tok.clone()
            tok3[:, c] = (tok3[:, c] + 1) % V
            y3, _ = call(kind, layer, x, tok3)
            assert diff(y3[:, :c], y[:, :c]) <= EXACT
            assert diff(y3[:, c:], y[:, c:]) > 1e-8


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
