"""Streaming far past the training length: outputs stay finite and the carried state stays bounded.

A model streamed with its state carried sees states it never saw in training (128-token windows
from a zero state); a state that keeps growing along the stream is the first sign of the collapse of
streamed scores (issue 21). Each case streams a random-init model 20 times a 32-token "training
length" and records the carried state's norm (largest layer, ``stream-eval``'s measure) after every
window: a bounded state stops growing (its largest norm over the last ten windows is within 20% of
the largest over the first ten; what it reaches within the first windows depends on the design: the
fast-weights RNN's history folds into a matrix after its first window, for one); a growing one does
not. Measured margins: bounded designs 0.77-1.11, growing ones 1.29 and 1.98.
"""

from __future__ import annotations

import pytest
import torch

from fastweights.config import ModelConfig
from fastweights.experiments.streaming import state_norms
from fastweights.models.lm import LanguageModel

V, WINDOW, WINDOWS = 40, 32, 20


def stream_norms(kind: str, name: str, options: dict, seed: int = 0) -> tuple[list[float], bool]:
    torch.manual_seed(seed)
    part = {"mixer": {"mixer": name}, "head": {"head": name}, "memory": {"memory": name, "memory_layers": [1]}}[kind]
    model = LanguageModel(ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=2, **part,
                                      options={name: options})).eval()
    x = torch.randint(0, V, (1, WINDOW * WINDOWS), generator=torch.Generator().manual_seed(seed))
    state, norms, finite = None, [], True
    with torch.no_grad():
        for i in range(WINDOWS):
            out = model(x[:, i * WINDOW : (i + 1) * WINDOW], state)
            state = out.state
            if hasattr(model, "trim_state"):
                state = model.trim_state(state, WINDOW)  # the KV cache keeps one window, as stream-eval does
            finite &= bool(torch.isfinite(out.logits).all())
            norms.append(max(state_norms(state)))
    return norms, finite


# designs whose state is bounded by construction: L2-normalised keys with beta in (0, 1) make the delta
# update a contraction along each key (DeltaNet); a decay forgets (gated rules, fast-weights RNN)
BOUNDED = {
    "fwp-delta-l2": ("mixer", "fwp", {"rule": "delta", "feature_map": "identity", "sum_norm": False, "l2_norm": True}),
    "fwp-gated-delta-l2": ("mixer", "fwp", {"rule": "gated_delta", "feature_map": "identity", "sum_norm": False,
                                   "l2_norm": True}),
    "fwp-gated-delta-dpfp": ("mixer", "fwp", {"rule": "gated_delta", "feature_map": "dpfp"}),
    "fwp-gated-dpfp": ("mixer", "fwp", {"rule": "gated", "feature_map": "dpfp"}),
    "gdn": ("mixer", "gdn", {"backend": "torch"}),
    "fast-rnn": ("mixer", "fast_rnn", {"hidden": 32}),
    "fast-rnn-preset-eta": ("mixer", "fast_rnn", {"hidden": 32, "eta": 0.0005}),
    "ln-rnn": ("mixer", "fast_rnn", {"hidden": 32, "fast_weights": False}),
    "lstm": ("mixer", "lstm", {"hidden": 16}),
    "attention": ("mixer", "attention", {}),
    "fwl-head": ("head", "fwl", {"hidden": 16}),
    "fwpkm-memory": ("memory", "fwpkm", {"n_subkeys": 8, "d_key": 16, "d_value": 16, "topk": 4, "chunk_size": 16}),
    "fwmlp-memory": ("memory", "fwmlp", {"d_key": 16, "d_value": 16, "hidden": 32, "chunk_size": 16}),
}
# the designs whose state keeps growing: the sum rule (no forgetting at all) and the delta rule with
# sum-normalised non-negative features, whose keys are short (|phi(k)|^2 ~ 1 / d_dot), so each write
# erases little and the state keeps growing along the stream long after the training length
GROWING = {
    "fwp-sum-dpfp": ("mixer", "fwp", {"rule": "sum", "feature_map": "dpfp"}),
    "fwp-delta-dpfp-sum-norm": ("mixer", "fwp", {"rule": "delta", "feature_map": "dpfp"}),
}


@pytest.mark.parametrize("case", sorted(BOUNDED))
def test_bounded_designs_keep_their_state_at_twenty_times_the_training_length(case):
    norms, finite = stream_norms(*BOUNDED[case])
    assert finite, f"{case}: non-finite logits along the stream"
    assert max(norms[WINDOWS // 2 :]) <= 1.2 * max(norms[: WINDOWS // 2]), f"{case}: still growing: {norms}"


@pytest.mark.parametrize("case", sorted(GROWING))
def test_unbounded_designs_grow(case):
    # the measured reason their streamed scores collapse (docs/fast-weight-programmers.md); if a change makes
    # them bounded, move them to BOUNDED
    norms, finite = stream_norms(*GROWING[case])
    assert finite
    assert norms[-1] > 1.2 * max(norms[: WINDOWS // 2]), norms
