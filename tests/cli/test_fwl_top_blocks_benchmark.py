"""benchmarks/quality/fwl_top_blocks.py (issue 50, scope 3): the recipe's command carries K, the variant's chosen
block lr and K's own cache; the pilot chooses each variant's block lr with the lowest loss on the tuning texts; a missing pilot or head is
one line and exit 2; the dynamic-evaluation row of K blocks adapts those blocks and the final norm only."""

import json

import pytest

pytest.importorskip("transformers")

from helpers import benchmark_script, import_benchmark, run_script  # noqa: E402

from fastweights.cli.script_parser import exit_status_of  # noqa: E402
from fastweights.core.errors import UserError  # noqa: E402

bench = import_benchmark("fwl_top_blocks")


def fake_training(commands: list):
    """A stand-in for the recipe's process: records the command."""
    return commands.append


def fake_pilot_losses(losses: dict):
    """A stand-in for judging a trained head on the tuning texts: ``losses[variant][block lr]`` by the head's folder
    name."""

    def pilot_losses(out, cache, tuning):
        variant, lr = out.name.split("-block-lr-")
        assert cache.name == "hidden-cache" and cache.parent == out.parent  # K's own cache
        assert tuning == ["the tuning texts"]
        return {"tuning_nats": losses[variant][float(lr)], "held_out_windows": {"loss_nats": 3.0}}

    return pilot_losses


def flag(cmd, name):
    return cmd[cmd.index(name) + 1]


@pytest.mark.parametrize("losses, best", [
    ({"fwl": {1e-5: 3.1, 1e-4: 3.0}, "test-time-only": {1e-5: 3.0, 1e-4: 3.2}}, {"fwl": 1e-4, "test-time-only": 1e-5}),
    ({"fwl": {1e-5: 3.0, 1e-4: 3.2}, "test-time-only": {1e-5: 3.3, 1e-4: 3.2}}, {"fwl": 1e-5, "test-time-only": 1e-4}),
])
def test_the_pilot_chooses_each_variants_lowest_validation_loss_and_training_uses_it(tmp_path, monkeypatch, losses,
                                                                                      best):
    """The pilot trains K = 2 heads of both variants at every block lr for the full budget and keeps each variant's
    best; --train trains K = 4 at each variant's own lr. Mutations caught: one lr for both variants (the first
    variant's), the pilot at another budget, K = 2 trained again."""
    commands = []
    monkeypatch.setattr(bench, "run", fake_training(commands))
    monkeypatch.setattr(bench, "pilot_losses", fake_pilot_losses(losses))
    assert bench.pilot(tmp_path, threads=1, tuning=["the tuning texts"])["best"] == best
    assert sorted((flag(c, "--variant"), float(flag(c, "--block-lr"))) for c in commands) == sorted(
        (v, lr) for v, _ in bench.VARIANTS for lr in bench.PILOT_BLOCK_LRS)
    assert all(flag(c, "--trainable-blocks") == str(bench.KS[0]) for c in commands)
    assert all(float(flag(c, "--minutes")) == bench.MINUTES for c in commands)
    assert bench.chosen_block_lrs(tmp_path) == best
    commands.clear()
    bench.train(tmp_path, threads=1)
    assert len(commands) == len(bench.VARIANTS) * (len(bench.KS) - 1)
    for cmd in commands:
        k, variant = flag(cmd, "--trainable-blocks"), flag(cmd, "--variant")
        assert k != str(bench.KS[0])  # the pilot's heads are K = 2's
        assert float(flag(cmd, "--block-lr")) == best[variant]
        assert float(flag(cmd, "--minutes")) == bench.MINUTES
        assert flag(cmd, "--cache") == str(tmp_path / f"k{k}" / "hidden-cache")  # one cache per K
        assert flag(cmd, "--out") == str(bench.head_dir(tmp_path, int(k), variant, best[variant]))


def test_an_earlier_pilots_single_block_lr_is_refused(tmp_path):
    (tmp_path / "pilot.json").write_text(json.dumps({"best": 1e-4}))
    with pytest.raises(UserError, match="run --pilot again"):
        bench.chosen_block_lrs(tmp_path)


def test_training_without_a_pilot_is_refused(tmp_path):
    with pytest.raises(UserError, match="--pilot"):
        bench.train(tmp_path, threads=1)


def test_scoring_without_heads_is_one_line_and_exit_2(tmp_path, capsys):
    """The first case runs as ``python fwl_top_blocks.py`` (``sys.exit(exit_status_of(main))``: the real process's
    exit status and stderr); the second calls ``main`` in this process, through ``exit_status_of``, and puts back
    the torch threads its ``--threads`` set."""
    import torch

    argv = ["--runs", str(tmp_path), "--part", "2"]
    for i, missing in enumerate(("no block lr chosen yet", "no trained head")):
        if i == 0:
            r = run_script(benchmark_script("fwl_top_blocks"), *argv)
            status, err = r.returncode, r.stderr
        else:
            threads = torch.get_num_threads()
            capsys.readouterr()
            try:
                status = exit_status_of(lambda: bench.main(argv))
            finally:
                torch.set_num_threads(threads)
            err = capsys.readouterr().err
        assert status == 2 and missing in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1
        (tmp_path / "pilot.json").write_text(json.dumps({"best": {"fwl": 1e-4, "test-time-only": 1e-5}}))


def test_the_top_k_blocks_row_adapts_those_blocks_and_the_norm_only(tmp_path):
    """fwl_comparison.top_blocks_row with K = 1 of the tiny Llama's 2 blocks: block 1 and the norm change,
    nothing else does; its lr is the best of its search on the tuning texts."""
    import torch
    from helpers import tiny_llama_dir

    import fastweights.experiments.fwl_comparison as comparison
    from fastweights.hf.transformers_as_ours import load_hf_model

    fc = vars(comparison)
    lm, _ = load_hf_model(str(tiny_llama_dir(tmp_path, max_positions=128)))
    lm = lm.double().eval()
    before = {n: p.detach().clone() for n, p in lm.named_parameters()}
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, 500, (n,), generator=g)  # noqa: E731
    scored = {"a": ids(33)}
    tuning = [torch.cat([ids(8)] * 3 + [ids(1)]) for _ in range(2)]  # repeats: adapting to them beats static
    seen = []
    real = fc["DynamicEvaluator"]

    class Spy(real):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            if self.update_rule.lr:  # not the static baseline's evaluator
                seen.append(sorted(self.names))

    fc["DynamicEvaluator"] = Spy
    try:
        row, tuned = comparison.top_blocks_row(lm, 1, {"rule": "rms", "lr_there": 1e-3}, scored, tuning, ids(300), 8,
                                          log=lambda _m: None)
    finally:
        fc["DynamicEvaluator"] = real
    assert tuned["blocks"] == 1 and tuned["lr"] == tuned["lr_search"]["best"]
    assert row["a"]["tokens_per_cpu_s"] > 0
    for names in seen:
        assert names and all(n.startswith(("hf.model.layers.1.", "hf.model.norm.")) for n in names), names
    for n, p in lm.named_parameters():  # nothing outside the top block and the norm moved
        if not n.startswith(("hf.model.layers.1.", "hf.model.norm.")):
            torch.testing.assert_close(p, before[n], rtol=0, atol=0)
