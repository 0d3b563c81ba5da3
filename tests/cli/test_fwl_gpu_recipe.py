"""benchmarks/gpu/fwl_smollm2_gpu.py, issue 41's GPU recipe, on the CPU: its dry run (``--device cpu --tiny``: a
tiny random Llama, tiny texts, a few steps) writes a JSON with the command, the device, the versions, the
settings and finite numbers for every row and text, the gain split adding up; its training loop carries the
state across windows exactly as one long call does and never lets a window see later tokens; the slow part
is the head with zero step sizes, restored after; the static row is the backbone's own logits; the training
streams are consecutive stretches of documents that are never scored; bad input is one line with exit 2."""

import contextlib
import json
import math
import re
from pathlib import Path

import pytest
import torch
from helpers import HANG_GUARD_S, ROOT, gpu_queue_dry_run, import_benchmark, run_script, tiny_llama_dir

from fastweights.cli.script_parser import exit_status_of
from fastweights.hf import fwl_training
from fastweights.hf.fwl_online import PretrainedLogits, training_streams

from fastweights.layers.fwl import slow_part

SCRIPT = ROOT / "benchmarks" / "gpu" / "fwl_smollm2_gpu.py"


def run(*args, timeout=HANG_GUARD_S):
    return run_script(SCRIPT, *args, timeout=timeout)


@pytest.fixture(scope="module")
def recipe():
    return import_benchmark("fwl_smollm2_gpu")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """The recipe's dry run as the GPU queue's dry run ran it (``fwl_smollm2_gpu.py --device cpu --tiny --out F``,
    shared with tests/cli/test_gpu_queue.py): the end of its stdout and its JSON."""
    r = gpu_queue_dry_run(tmp_path_factory)
    assert r["returncode"] == 0, r["stderr"][-3000:]
    item = json.loads((Path(r["out"]) / "gpu_queue.json").read_text())["items"]["fwl/smollm2_recipe"]
    assert item["status"] == "ok", item
    return item["result"]["stdout_tail"], item["result"]["recipe"]


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_the_dry_run_records_the_command_device_versions_and_settings(dry_run, recipe):
    stdout, res = dry_run
    assert res["command"].endswith("benchmarks/gpu/fwl_smollm2_gpu.py --device cpu --tiny")  # --out left out
    assert res["complete"] is True and res["tiny"] is True and "error" not in res
    assert res["device"]["type"] == "cpu" and res["versions"]["torch"] == torch.__version__
    assert res["versions"]["transformers"] and res["git"]["commit"] and res["git"]["code"]
    assert "probes" not in res  # summarised afterwards by the repository's tools (tools/evidence.py)
    import dataclasses

    assert res["settings"] == dataclasses.asdict(recipe.TINY)
    from fastweights.hf.fwl_head import PRETRAINED_FWL_DEFAULTS

    assert all(res["fwl_options"][k] == v for k, v in PRETRAINED_FWL_DEFAULTS.items())
    assert set(res["excerpts"]) == set(recipe.SCORED_TEXTS)
    assert all(e["predictions"] == recipe.TINY.tokens for e in res["excerpts"].values())
    assert "training for" in stdout and "FWL vs static" in stdout
    logged = re.findall(r"\] train: step (\d+), ", stdout)  # the first step at once, then one line per 15 s at most
    assert logged[:1] == ["1"] and len(logged) < recipe.TINY.max_steps, logged


def test_every_row_and_text_has_finite_numbers_and_the_gain_split_adds_up(dry_run, recipe):
    _, res = dry_run
    rows = res["results"]
    assert list(rows) == ["static", "fwl_at_init", "fwl", "fwl_slow"]
    for row, r in rows.items():
        assert set(r["per_text"]) == set(recipe.SCORED_TEXTS), row
        for k, t in r["per_text"].items():
            assert t["tokens"] == recipe.TINY.tokens and finite(t["perplexity"]) and t["perplexity"] > 1, (row, k)
            assert finite(t["tokens_per_s"]) and t["tokens_per_s"] > 0 and finite(t["throughput_ratio_to_static"])
    for k in recipe.SCORED_TEXTS:  # the head starts near the identity (the recipe's LayerNorm gain 0.05)
        assert rows["fwl_at_init"]["per_text"][k]["loss_nats"] == pytest.approx(
            rows["static"]["per_text"][k]["loss_nats"], rel=1e-3)
        s = res["gain_split"][k]
        assert s["gain_nats"] == pytest.approx(s["slow_gain_nats"] + s["fast_gain_nats"], abs=1e-9)
        assert s["gain_nats"] == pytest.approx(rows["static"]["per_text"][k]["loss_nats"]
                                               - rows["fwl"]["per_text"][k]["loss_nats"], abs=1e-9)
        assert s["slow_perplexity"] == pytest.approx(rows["fwl_slow"]["per_text"][k]["perplexity"])
        assert all(finite(v) for v in s.values())


def test_training_ran_its_steps_on_documents_never_scored(dry_run, recipe):
    _, res = dry_run
    tr = res["training"]
    assert tr["steps"] == recipe.TINY.max_steps == len(tr["history"]) and tr["tokens"] > 0
    assert tr["tokens_per_s"] == pytest.approx(tr["tokens"] / tr["seconds"])
    assert tr["history_columns"] == ["step", "seconds", "window_index", "loss_nats", "lr_scale"]
    assert all(len(h) == 5 and h[0] == i + 1 for i, h in enumerate(tr["history"]))
    # its steps end a dry run (an unbounded budget), and its rates decay over them
    sched = tr["schedule"]
    assert [h[4] for h in tr["history"]] == [
        fwl_training.online_lr_scale(i, 0.0, math.inf, recipe.TINY.max_steps, sched["warmup_steps"],
                                     sched["final_lr_fraction"]) for i in range(recipe.TINY.max_steps)]
    assert all(finite(h[3]) for h in tr["history"])
    assert [h[2] for h in tr["history"]] == [0, 1, 0, 1]  # the windows of each stream, in order
    half = tr["history"][len(tr["history"]) // 2:]  # the loss by window over the second half of the steps
    want = {str(j): sum(h[3] for h in half if h[2] == j) / sum(h[2] == j for h in half) for j in (0, 1)}
    assert tr["loss_by_window_second_half"] == pytest.approx(want, rel=1e-12)
    assert tr["learned_step_sizes"] and all(finite(v) for v in tr["learned_step_sizes"].values())
    assert tr["learned_decays"] and all(0 < v < 1 for v in tr["learned_decays"].values())  # gamma in (0, 1)
    assert tr["streams"] == recipe.TINY.batch * 2 and set(tr["corpora"]) <= set(recipe.TRAINING_MIX)
    from fastweights.hf.fwl_training import HELD_OUT_NAMES

    scored_docs = {e["document"].split(":")[1].lower() for e in res["excerpts"].values()}
    for doc in tr["documents"]:
        name = doc.split(":", 1)[1].lower()
        assert not any(n in name for n in HELD_OUT_NAMES) and name not in scored_docs, doc


@pytest.fixture(scope="module")
def tiny_fwl(tmp_path_factory, recipe):
    """A float64 tiny Llama with an FWL head whose fast update acts (non-zero gain and step sizes)."""
    import dataclasses

    from fastweights.hf.transformers_as_ours import load_hf_model

    backbone, tok = load_hf_model(str(tiny_llama_dir(tmp_path_factory.mktemp("llama"))))
    options = dataclasses.replace(recipe.FWLOptions(**recipe.PRETRAINED_FWL_DEFAULTS), segment_len=8, chunk_size=16,
                                  step_size_init=0.05)
    torch.manual_seed(0)
    model = recipe.HFCausalLMWithFWL(backbone, options, trainable_blocks=1).double().eval()
    with torch.no_grad():
        model.head.ln_weight.fill_(0.5)
    return model, tok


@torch.no_grad()
def test_state_carried_across_training_windows_equals_one_long_call(tiny_fwl, recipe):
    model, _ = tiny_fwl
    tokens = torch.randint(0, 500, (2, 3 * 20 + 8))  # windows of 20, a shorter last one
    one = model(tokens[:, :-1])
    nll = torch.nn.functional.cross_entropy(one.logits.transpose(1, 2), tokens[:, 1:], reduction="none")
    windows = list(fwl_training.stream_windows(model, tokens, 20))
    assert [j for j, _ in windows] == [0, 1, 2, 3]
    for j, out in windows:
        assert out.loss.item() == pytest.approx(nll[:, 20 * j:20 * (j + 1)].mean().item(), rel=1e-10, abs=1e-12), j
    state = windows[-1][1].state  # carried detached: no graph reaches back into earlier windows
    leaves = [t for t in torch.utils._pytree.tree_leaves(fwl_training.detached(state)) if isinstance(t, torch.Tensor)]
    assert leaves and not any(t.requires_grad for t in leaves)


@torch.no_grad()
def test_a_training_window_never_sees_later_tokens(tiny_fwl, recipe):
    model, _ = tiny_fwl
    tokens = torch.randint(0, 500, (1, 61))
    changed = tokens.clone()
    changed[:, 41:] = (changed[:, 41:] + 7) % 500  # after window 1's last target (token 40)
    before = [out.loss.item() for _, out in fwl_training.stream_windows(model, tokens, 20)]
    after = [out.loss.item() for _, out in fwl_training.stream_windows(model, changed, 20)]
    assert after[:2] == before[:2] and after[2] != before[2]


@torch.no_grad()
def test_the_slow_part_is_the_head_with_zero_step_sizes_restored_after(tiny_fwl, recipe):
    model, _ = tiny_fwl
    tokens = torch.randint(0, 500, (1, 40))
    full = model(tokens).logits
    saved = {n: float(p) for n, p in model.head.step_sizes.items()}
    with slow_part(model.head) as head:
        assert all(float(a) == 0.0 for a in head.current_step_sizes().values())
        slow = model(tokens).logits
        h, _ = model.backbone.forward_features(tokens)
        torch.testing.assert_close(slow, model.head.slow_forward(h), rtol=1e-10, atol=1e-10)
    assert {n: float(p) for n, p in model.head.step_sizes.items()} == saved
    assert not torch.allclose(slow, full)
    torch.testing.assert_close(model(tokens).logits, full, rtol=0, atol=0)


@torch.no_grad()
def test_the_static_row_is_the_backbones_own_logits(tiny_fwl, recipe):
    model, _ = tiny_fwl
    tokens = torch.randint(0, 500, (2, 30))
    static = PretrainedLogits(model.backbone)
    first = static(tokens[:, :17])
    second = static(tokens[:, 17:], first.state)
    own = model.backbone(tokens).logits
    torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), own.float(), rtol=1e-5, atol=1e-6)


def test_parameter_groups_give_the_step_sizes_and_decays_their_own_rate(tiny_fwl, recipe):
    model, _ = tiny_fwl
    R = fwl_training.RECIPE
    groups = {g["name"]: g for g in fwl_training.param_groups(model, R.lr, R.step_lr, R.block_lr)}
    ids = lambda ps: {id(p) for p in ps}  # noqa: E731
    fast = list(model.head.step_sizes.values()) + list(model.head.decay_logits.values())
    assert ids(groups["fast"]["params"]) == ids(fast) and groups["fast"]["lr"] == R.step_lr
    assert ids(groups["blocks"]["params"]) == ids(model.backbone.layers[-1].parameters())
    assert groups["head"]["lr"] == R.lr and groups["blocks"]["lr"] == R.block_lr
    every = [p for g in groups.values() for p in g["params"]]
    assert len(every) == len(ids(every)) == sum(1 for p in model.parameters() if p.requires_grad)


def test_training_streams_are_consecutive_stretches_of_each_document(tiny_fwl, recipe):
    _, tok = tiny_fwl
    from fastweights.data import load_corpus

    it = training_streams(tok, 50, seed=0, streams_per_doc=2)
    first = [next(it) for _ in range(6)]
    assert [s.split(":")[0] for _, s in first] == list(recipe.TRAINING_MIX) * 2  # the corpora in turn
    for i, (ids, source) in enumerate(first):
        corpus, doc_name = source.split(":", 1)
        (doc,) = [d for d in load_corpus(corpus) if d.name == doc_name]
        whole = torch.as_tensor(tok.encode(doc.text[:2 * 50 * 8]))
        k = i // len(recipe.TRAINING_MIX)  # the first and then the second stretch of the same document
        assert first[i % 3][1] == source and torch.equal(ids, whole[k * 50:(k + 1) * 50]), source
    # streams_per_doc 0: every stretch of each document, the whole text tokenized
    every = training_streams(tok, 50, seed=0, corpora=recipe.TRAINING_MIX[:1])
    ids, source = next(every)
    corpus, doc_name = source.split(":", 1)
    (doc,) = [d for d in load_corpus(corpus) if d.name == doc_name]
    whole = torch.as_tensor(tok.encode(doc.text))
    stretches = [ids] + [next(every)[0] for _ in range(len(whole) // 50 - 1)]
    assert len(whole) // 50 > 2 and torch.equal(torch.cat(stretches), whole[:len(stretches) * 50])


@pytest.mark.parametrize("args, says", [
    (["--device", "cuda", "--tiny"], "CUDA is not available"),
    (["--device", "cpu", "--gguf", "missing/smollm2.gguf"], "no such file"),
    (["--device", "cpu", "--tiny", "--gguf", "x.gguf"], "--tiny builds its own"),
    (["--device", "cpu", "--tiny", "--minutes", "0"], "--minutes must be > 0"),
    (["--device", "cpu", "--tiny", "--batch", "two"], "invalid int value"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, says, recipe, capsys):
    """``--batch two`` runs as ``python fwl_smollm2_gpu.py`` (``sys.exit(main())``: the real process's exit status
    and stderr); the other cases call ``main`` in this process, through ``exit_status_of`` (a Python start and the
    imports of torch and transformers saved per case)."""
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    out = tmp_path / "r.json"
    argv = [*args, "--out", str(out)]
    if "--batch" in args:
        r = run(*argv, timeout=HANG_GUARD_S)
        status, err = r.returncode, r.stderr
    else:
        capsys.readouterr()
        status = exit_status_of(lambda: recipe.main(argv))
        err = capsys.readouterr().err
    assert status == 2 and says in err, err[-2000:]
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    assert "Traceback" not in err
    assert not out.exists()


def test_the_recipe_scores_the_texts_of_the_cpu_comparison(recipe):
    """The GPU recipe's scored texts are fwl_smollm2.py's (fwl_comparison.TEXTS), so the two results compare text
    for text."""
    from fastweights.experiments.fwl_comparison import TEXTS

    assert set(recipe.SCORED_TEXTS) == {spec.key for spec, _ in TEXTS if spec.role == "scored"}


def test_the_online_schedule_warms_up_then_decays_over_whichever_limit_ends_the_run():
    scale = fwl_training.online_lr_scale
    assert scale(0, 0.0, 100.0, 0, 4, 0.1) == pytest.approx(0.25)  # warm-up: (step + 1) / warmup_steps
    assert scale(9, 50.0, 100.0, 0, 4, 0.1) == pytest.approx(1 - 0.9 * 0.5)  # half the time spent
    assert scale(9, 150.0, 100.0, 0, 4, 0.1) == pytest.approx(0.1)  # past the budget: the final fraction
    assert scale(5, 0.0, math.inf, 10, 4, 0.1) == pytest.approx(1 - 0.9 * 0.5)  # the steps end it: half of them
    assert scale(5, 80.0, 100.0, 10, 4, 0.1) == pytest.approx(1 - 0.9 * 0.8)  # the clock binds first
    assert scale(8, 10.0, 100.0, 10, 4, 0.1) == pytest.approx(1 - 0.9 * 0.8)  # the steps bind first


def test_the_online_trainer_steps_the_recipes_adamw_without_weight_decay(tiny_fwl, monkeypatch):
    """Both trainers build their AdamW in one place (``head_optimizer``): the recipe's groups and no weight decay.
    Mutation caught (issue 49, seed 7): the online form's decay set to 1."""
    model, _ = tiny_fwl
    made = []
    real = fwl_training.head_optimizer
    monkeypatch.setattr(fwl_training, "head_optimizer", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    streams = iter([(torch.randint(0, 500, (17,)), "doc")] * 2)
    out = fwl_training.train_head_online(model, streams, batch=2, window=16, windows_per_stream=1, budget_s=math.inf,
                                         lr=0.0, step_lr=0.0, block_lr=0.0, max_steps=1)
    assert out["steps"] == 1 and len(made) == 1
    assert [g["name"] for g in made[0].param_groups] == ["head", "fast", "blocks"]
    assert all(g["weight_decay"] == 0.0 for g in made[0].param_groups)


def test_the_online_trainer_counts_the_tokens_of_every_step(tiny_fwl):
    """tokens (and tokens/s) add every step's batch x window predictions, not the last step's alone."""
    model, _ = tiny_fwl
    streams = iter([(torch.randint(0, 500, (17,)), "doc")] * 6)
    out = fwl_training.train_head_online(model, streams, batch=2, window=16, windows_per_stream=1, budget_s=math.inf,
                                         lr=0.0, step_lr=0.0, block_lr=0.0, max_steps=3)
    assert out["steps"] == 3 and out["tokens"] == 3 * 2 * 16
    assert out["tokens_per_s"] == pytest.approx(out["tokens"] / out["seconds"])


def test_the_online_trainer_stops_when_its_clock_reaches_the_budget(tiny_fwl, monkeypatch):
    """With no step limit (the default) the run ends at the first step where ``clock`` has advanced by ``budget_s``
    since the start: a stand-in clock at 1,000 s plus 10 s per optimizer step, a budget of 30 s: 3 steps, each
    group's rate its base rate times ``online_lr_scale`` at the seconds spent. Mutations caught (module run of
    2026-11-30): a default step limit of 1; the clock added to the start; the budget reached only when passed; the
    rates not set, or divided by the factor; the step's index not passed on."""
    import copy

    model = copy.deepcopy(tiny_fwl[0])  # trained here: the shared model stays as it was
    done, rates, steps = [0], [], []
    real = fwl_training.optimizer_step

    def counting(loss, optimizer, params, step):
        rates.append({g["name"]: g["lr"] / g["base_lr"] for g in optimizer.param_groups})
        steps.append(step)
        done[0] += 1
        return real(loss, optimizer, params, step)

    monkeypatch.setattr(fwl_training, "optimizer_step", counting)
    ids = torch.randint(0, 500, (17,))
    streams = iter([(ids, "c1:a"), (ids, "c2:b")] * 10)
    out = fwl_training.train_head_online(model, streams, batch=2, window=16, windows_per_stream=1, budget_s=30.0,
                                         clock=lambda: 1000.0 + 10.0 * done[0], lr=1e-3, step_lr=1e-3, block_lr=1e-3,
                                         warmup_steps=1, final_lr_fraction=0.1)
    assert out["steps"] == 3 and steps == [0, 1, 2]
    want = [fwl_training.online_lr_scale(i, 10.0 * i, 30.0, 0, 1, 0.1) for i in range(3)]
    assert [sorted(set(r.values())) for r in rates] == [[pytest.approx(w)] for w in want] and want[2] < want[0]
    # what it trained on: every stream taken, by document and by corpus (the sources not counted survived too)
    assert (out["streams"], out["documents"], out["corpora"]) == (6, ["c1:a", "c2:b"], {"c1": 3, "c2": 3})


def test_the_online_trainer_decays_over_its_steps_and_runs_each_window_under_amp(tiny_fwl):
    """With a step limit and an unbounded budget the rates decay over the steps (each history row's factor is
    ``online_lr_scale`` at that step with ``max_steps``), and every window runs under the ``amp`` context given.
    Mutations caught (module run of 2026-11-30): the step limit not passed to the schedule; ``amp`` not passed on."""
    model, _ = tiny_fwl
    entered = []

    def amp():
        entered.append(1)
        return contextlib.nullcontext()

    streams = iter([(torch.randint(0, 500, (17,)), "c:doc")] * 8)
    out = fwl_training.train_head_online(model, streams, batch=2, window=16, windows_per_stream=1, budget_s=math.inf,
                                         amp=amp, lr=0.0, step_lr=0.0, block_lr=0.0, max_steps=4, warmup_steps=1,
                                         final_lr_fraction=0.1)
    want = [fwl_training.online_lr_scale(i, 0.0, math.inf, 4, 1, 0.1) for i in range(4)]
    assert [row[4] for row in out["history"]] == pytest.approx(want) and want[-1] < want[0]
    assert len(entered) == 4  # one window per step
