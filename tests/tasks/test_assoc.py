"""Synthetic associative retrieval (Schlag et al. 2021, sec. 6.1): data, model, training loop, CLI."""

import json

import numpy as np
import pytest
import torch

from fastweights.core.errors import UserError
from fastweights.cli import main
from fastweights.tasks.assoc import (
    AssocConfig,
    AssocData,
    AssocModel,
    parse_keys,
    parse_model,
    plot_capacity,
    retrieval_loss,
    symbol,
    train_assoc,
    vocabulary,
)
from helpers import assert_json_shape


def test_vocabulary_names():
    assert [symbol(i) for i in (0, 1, 25, 26, 27, 51, 52, 701, 702)] == \
        ["a", "b", "z", "aa", "ab", "az", "ba", "zz", "aaa"]
    vocab = vocabulary(30)
    assert len(vocab) == 60 and len(set(vocab)) == 60 and vocab[30] == "A" and vocab[56] == "AA"


def test_setting1_keys_unique_and_target_is_the_pair():
    data = AssocData(12, 1, np.random.default_rng(0))
    keys, values, query, target = data.batch(64)
    assert keys.shape == values.shape == (64, 12) and query.shape == target.shape == (64, 1)
    for b in range(64):
        assert sorted(keys[b].tolist()) == list(range(12))  # a permutation: each key once
        assert sorted(values[b].tolist()) == list(range(12))
        pos = keys[b].tolist().index(query[b, 0].item())
        assert target[b, 0] == values[b, pos]


def test_setting2_target_is_value_at_last_occurrence():
    data = AssocData(5, 2, np.random.default_rng(1))
    keys, values, query, target = data.batch(200)
    assert keys.shape == (200, 10)
    repeats = 0
    for b in range(200):
        ks = keys[b].tolist()
        last = max(i for i, k in enumerate(ks) if k == query[b, 0].item())
        assert target[b, 0] == values[b, last]
        repeats += ks.count(query[b, 0].item()) > 1
    assert repeats > 50  # overwrites actually happen


def test_eval_sequence_has_length_s_and_queries_every_distinct_key():
    for setting in (1, 2):
        data = AssocData(30, setting, np.random.default_rng(2))
        keys, values, queries, targets = data.eval_sequence(max_queries=200)
        assert keys.shape == (1, 30)  # length S in both settings (reference quirk)
        assert queries[0].tolist() == sorted(set(keys[0].tolist()))
    assert AssocData(30, 1, np.random.default_rng(3)).eval_sequence(max_queries=7)[2].shape == (1, 7)


@pytest.mark.parametrize("rule,fmap,d_dot", [("sum", "elu1", 64), ("delta", "dpfp", 256), ("gated", "favor", 16)])
def test_model_shapes_and_feature_width(rule, fmap, d_dot):
    model = AssocModel(7, rule, fmap, nu=2, n_features=8)
    assert model.d_dot == d_dot
    assert model.key_embedding.weight.shape == (14, int(14 * 1.1))
    assert not model.value_onehot.requires_grad
    data = AssocData(7, 2, np.random.default_rng(0))
    keys, values, query, target = data.batch(3)
    y = model(keys, values, torch.cat([query, query], 1))
    assert y.shape == (3, 2, 7) and torch.isfinite(y).all()
    loss = retrieval_loss(y, torch.cat([target, target], 1))
    assert loss.shape == (3, 2)


def test_delta_model_matches_reference_loop():
    """The op-based fast weight equals the reference code's loop (W -= v_bar k^T; W += (b v + (1-b) v_bar) k^T)."""
    torch.manual_seed(0)
    model = AssocModel(6, "delta", "dpfp").double()
    data = AssocData(6, 2, np.random.default_rng(4))
    keys, values, query, _ = data.batch(2)
    y = model(keys, values, query)
    v = model.value_onehot[values]
    x = torch.cat([v, model.key_embedding(keys)], -1)
    from fastweights.ops.feature_maps import dpfp

    k = dpfp(model.w_k(x), 1)
    beta = torch.sigmoid(model.w_b(x))
    w = torch.zeros(2, 6, k.shape[-1], dtype=torch.float64)
    for i in range(keys.shape[1]):
        kn = k[:, i] / k[:, i].sum(-1, keepdim=True)
        v_bar = torch.einsum("bdp,bp->bd", w, kn)
        w = w - torch.einsum("bd,bp->bdp", v_bar, kn)
        w = w + torch.einsum("bd,bp->bdp", beta[:, i] * v[:, i] + (1 - beta[:, i]) * v_bar, kn)
    qf = dpfp(model.w_q(model.key_embedding(query)), 1)
    expected = torch.einsum("bvp,blp->blv", w, qf / (qf.sum(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(y, expected, rtol=1e-9, atol=1e-12)


def test_training_learns_a_small_problem():
    cfg = AssocConfig(setting=1, keys=6, rule="sum", feature_map="dpfp", max_steps=600, eval_every=10,
                      eval_sequences=5, stop_loss=0.01)
    result = train_assoc(cfg, progress=False)
    assert result["stopped"] == "solved"
    assert result["final_eval_loss"] <= 0.01
    assert result["history"][0][1] > result["final_eval_loss"]
    assert result["d_dot"] == 128 and result["seq_len"] == 6


def test_training_stops_on_budget_and_reports():
    cfg = AssocConfig(setting=2, keys=8, rule="delta", feature_map="elu1", max_steps=30, eval_every=20,
                      eval_sequences=2)
    result = train_assoc(cfg, progress=False)
    assert result["steps"] == 30 and result["stopped"] == "max_steps"
    assert [h[0] for h in result["history"]] == [20, 30]  # always ends on a measured evaluation
    assert result["seq_len"] == 16
    with pytest.raises(UserError):
        train_assoc(AssocConfig(keys=0), progress=False)


def test_parsers():
    assert parse_keys("60") == [60]
    assert parse_keys("20,40") == [20, 40]
    assert parse_keys("20:100:20") == [20, 40, 60, 80, 100]
    assert parse_model("delta:dpfp2") == {"rule": "delta", "feature_map": "dpfp", "nu": 2}
    assert parse_model("sum:favor64") == {"rule": "sum", "feature_map": "favor", "n_features": 64}
    for bad in ("x", "0", "20:10"):
        with pytest.raises(UserError):
            parse_keys(bad)
    for bad in ("sum", "sum:relu", "hebb:elu1", "sum:dpfpx"):
        with pytest.raises(UserError):
            parse_model(bad)


def test_cli_json_and_plot(tmp_path, capsys):
    out = tmp_path / "r"
    assert main([
        "task", "assoc", "--setting", "2", "--keys", "4,6", "--model", "sum:elu1", "--model", "delta:dpfp1",
        "--max-steps", "20", "--eval-every", "10", "--eval-sequences", "2", "--json", "--quiet",
        "--out", str(out),
    ]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [(r["label"], r["keys"]) for r in printed] == [("sum/elu1", 4), ("sum/elu1", 6),
                                                          ("delta/dpfp1", 4), ("delta/dpfp1", 6)]
    written = json.loads((out / "assoc.json").read_text())
    assert_json_shape(written, "task_assoc")
    assert written["results"][0]["final_eval_loss"] == printed[0]["final_eval_loss"]
    assert written["command"].startswith("fastweights ") and set(written) >= {"date", "git", "machine"}
    assert (out / "assoc.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_capacity_writes_png(tmp_path):
    rows = [{"label": "sum/elu1", "keys": s, "final_eval_loss": loss, "setting": 1}
            for s, loss in ((20, 0.0), (40, 0.1))]
    plot_capacity(rows, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_feature_widths_past_their_bound_are_refused_before_allocation():
    """Issue 52: task assoc --nu 1e9 was killed at 13.5 GB. DPFP's nu is bounded by its rolls (2d - 1 distinct), any
    map's d_dot by MAX_D_DOT, each one line before a model is built."""
    from fastweights.core.errors import UserError
    from fastweights.ops.feature_maps import feature_dim
    from fastweights.tasks.assoc import MAX_D_DOT, AssocConfig, train_assoc

    assert feature_dim("dpfp", 64, nu=127) == 2 * 64 * 127
    with pytest.raises(UserError, match="nu must be in 1..127"):
        feature_dim("dpfp", 64, nu=128)
    with pytest.raises(UserError, match=f"at most {MAX_D_DOT:,}"):
        train_assoc(AssocConfig(feature_map="favor", n_features=MAX_D_DOT, max_steps=1), progress=False)
