"""Replay of the adversarial probe's cases on model directories, the harness and `fwl-head train` (issue 39,
items 2-5 of "Why"): each exits with status 2 and one line naming what is wrong (or, where the input is legal but
does nothing, exits 0 with the documented warning), and no file anywhere in the case's folder changes (the inputs,
the model directories, the cache: nothing is written, nothing is rebuilt). Tiny offline models only: a Llama with
the bundled GPT-2 tokenizer, conftest's trained ``tiny`` run and its ``export-hf`` directory."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from fastweights.cli import main  # noqa: E402
from helpers import line_matches, tiny_llama_dir  # noqa: E402

DOC = "The cat sat on the mat. The dog sat on the log. " * 6


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_run):
    """Read-only inputs the cases copy: a tiny Llama directory, an `export-hf` directory of the tiny run, and a
    complete hidden-state cache of `fwl-head train` on the Llama."""
    root = tmp_path_factory.mktemp("adversarial-hf")
    llama = tiny_llama_dir(root / "llama")
    assert main(["export-hf", str(tiny_run), str(root / "export")]) == 0
    assert main(["fwl-head", "train", "--hf", str(llama), "--out", str(root / "fwl"), "--cache", str(root / "cache"),
                 "--windows", "5", "--window", "192", "--max-steps", "1", "--quiet"]) == 0
    return {"llama": llama, "export": root / "export", "cache": root / "cache", "run": tiny_run}


# ----------------------------------------------------------------------------- the cases


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _doc(d: Path) -> Path:
    (d / "doc.txt").write_text(DOC)
    return d / "doc.txt"


def _eval_hf(model_dir: Path, doc: Path) -> list[str]:
    return ["dynamic", "eval", "--hf", str(model_dir), "--data", str(doc), "--rule", "sgd", "--lr", "1e-3",
            "--segment-len", "8", "--quiet"]


def export_relabelled_as_llama(m, d):
    """A copy of an export whose config.json says llama, with Llama sizes: every tensor MISSING/UNEXPECTED."""
    model = _copy(m["export"], d / "model")
    cfg = json.loads((m["llama"] / "config.json").read_text())
    cfg["vocab_size"] = json.loads((model / "config.json").read_text())["vocab_size"]
    (model / "config.json").write_text(json.dumps(cfg))
    return "cli", _eval_hf(model, _doc(d))


def one_tensor_deleted(m, d):
    model = _copy(m["llama"], d / "model")
    t = load_file(str(model / "model.safetensors"))
    del t["model.layers.1.self_attn.v_proj.weight"]
    save_file(t, str(model / "model.safetensors"), metadata={"format": "pt"})
    return "cli", _eval_hf(model, _doc(d))


def config_sizes_too_big(m, d):
    """vocab_size 1e10 and hidden_size 1e6: 4e16 bytes were tried before any check."""
    model = _copy(m["llama"], d / "model")
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(vocab_size=10**10, hidden_size=10**6)
    (model / "config.json").write_text(json.dumps(cfg))
    return "cli", _eval_hf(model, _doc(d))


def export_with_huge_d_model(m, d):
    """Our own export-hf directory with d_model 1e6 in config.json: counted on the meta device, refused."""
    model = _copy(m["export"], d / "model")
    cfg = json.loads((model / "config.json").read_text())
    cfg["d_model"] = 10**6
    (model / "config.json").write_text(json.dumps(cfg))
    return "cli", _eval_hf(model, _doc(d))


def default_rule_without_statistics(m, d):
    """The default rule (rms) on a Hugging Face model needs statistics: the message names dynamic stats' --save
    flag (it said --out, which dynamic stats does not take)."""
    argv = _eval_hf(m["llama"], _doc(d))
    for flag in ("--rule", "--lr"):
        i = argv.index(flag)
        del argv[i:i + 2]
    return "cli", argv


def lowrank_rank_too_big(m, d):
    return "cli", ["dynamic", "eval", "--checkpoint", str(m["run"]), "--data", str(_doc(d)), "--rule", "sgd",
                   "--lowrank-rank", "100000000", "--quiet"]


def _harness(d, model_args: str, *extra: str):
    return "harness", ["--model", "fastweights-dynamic" if "rule=" in model_args else "fastweights", "--model_args",
                       model_args, "--tasks", "fastweights_heldout_plays", "--limit", "1", "--device", "cpu", *extra]


def harness_lr_1e30(m, d):
    return _harness(d, f"checkpoint={m['run']},rule=sgd,lr=1e30")


def harness_segment_len_negative(m, d):
    return _harness(d, f"checkpoint={m['run']},segment_len=-5")


def harness_unknown_task(m, d):
    kind, argv = _harness(d, f"checkpoint={m['run']}")
    argv[argv.index("fastweights_heldout_plays")] = "no_such_task"
    return kind, argv


def harness_batch_size_zero(m, d):
    return _harness(d, f"checkpoint={m['run']}", "--batch_size", "0")


def _fwl_train(m, d, cache: Path) -> list[str]:
    return ["fwl-head", "train", "--hf", str(m["llama"]), "--out", str(d / "out"), "--cache", str(cache), "--windows",
            "5", "--window", "192", "--max-steps", "2", "--quiet"]


def fwl_head_on_an_export_hf_directory(m, d):
    """Our own export-hf directory: AttributeError 'LanguageModel' object has no attribute 'max_positions' before."""
    return "cli", ["fwl-head", "train", "--hf", str(_copy(m["export"], d / "model")), "--out", str(d / "out"),
                   "--windows", "5", "--window", "192", "--quiet"]


def fwl_cache_object_array(m, d):
    cache = _copy(m["cache"], d / "cache")
    np.save(cache / "hidden.npy", np.array([{"x": 1}], dtype=object), allow_pickle=True)
    return "cli", _fwl_train(m, d, cache)


def fwl_cache_nan(m, d):
    cache = _copy(m["cache"], d / "cache")
    h = np.load(cache / "hidden.npy", mmap_mode="r+")
    h[2, 5, 3] = np.nan
    h.flush()
    del h
    return "cli", _fwl_train(m, d, cache)


CASES = [  # (build, exit status, the error line or warning line the command must end with: * stands for any text)
    (export_relabelled_as_llama, 2, "error: Hugging Face model {tmp}/model: the weights do not match config.json: "
                                    "20 parameter(s) of the model are missing from its weights (lm_head.weight, "
                                    "model.embed_tokens.weight, model.layers.0.input_layernorm.weight and 17 more); 1 "
                                    "tensor(s) have another shape than config.json gives them (model.norm.weight (32,) "
                                    "vs (16,)); 13 stored tensor(s) belong to no parameter of the model "
                                    "(model.blocks.0.mixer.out.weight, model.blocks.0.mixer.qkv.weight, "
                                    "model.blocks.0.mixer_norm.weight and 10 more); refusing to score a model with "
                                    "weights that are not its own"),
    (one_tensor_deleted, 2, "error: Hugging Face model {tmp}/model: the weights do not match config.json: 1 "
                            "parameter(s) of the model are missing from its weights "
                            "(model.layers.1.self_attn.v_proj.weight); refusing to score a model with weights that are "
                            "not its own"),
    (config_sizes_too_big, 2, "error: Hugging Face model {tmp}/model: config.json declares 10,000,000,293,000,000 "
                              "parameters (about 37,252,904.1 GiB) but cpu has * GiB available; refusing to allocate it"),
    (export_with_huge_d_model, 2, "error: Hugging Face model {tmp}/model: config.json declares 24,000,199,000,000 "
                                  "parameters (about 89,407.7 GiB) but cpu has * GiB available; refusing to allocate it"),
    (default_rule_without_statistics, 2, "error: rule rms-global-prior needs gradient statistics: run `fastweights "
                                         "dynamic stats --hf ... --data TEXT --save FILE` (any generic text of the "
                                         "language will do, e.g. --data novels) and pass --stats FILE, or use --rule "
                                         "sgd"),
    (lowrank_rank_too_big, 2, "error: --lowrank-rank 100000000 exceeds the model's dimensions: the adapted "
                              "projections (blocks.0.mlp.gate_up, ...) have rank at most 32; choose 1..32"),
    (harness_lr_1e30, 2, "error: loglikelihood_rolling: a log-likelihood is nan, not a number to report: dynamic "
                         "evaluation diverged with rule sgd, learning rate 1e+30 (try a smaller lr=)"),
    (harness_segment_len_negative, 2, "error: --model fastweights: model argument segment_len=-5 (--segment-len of "
                                      "the command line): must be >= 0, got -5"),
    (harness_unknown_task, 2, "error: Tasks not found: no_such_task"),
    (harness_batch_size_zero, 0, "warning: fastweights: --batch_size 0 is ignored: requests are scored one at a "
                                 "time, in the order given (results do not depend on it)"),
    (fwl_head_on_an_export_hf_directory, 2, "error: fwl-head train --hf {tmp}/model: is a fastweights model (an "
                                            "`export-hf` directory), not a pretrained transformers model: train an FWL "
                                            "head on it with `fastweights train --set model.head=fwl`; the FWL head "
                                            "goes on a transformers causal LM (a model directory, a .gguf file or "
                                            "smollm2-135m)"),
    (fwl_cache_object_array, 2, "error: hidden-state cache {tmp}/cache: hidden.npy is not the cache its cache.json "
                                "describes (Array can't be memory-mapped: Python objects in dtype.); delete "
                                "{tmp}/cache to rebuild it"),
    (fwl_cache_nan, 2, "error: hidden-state cache {tmp}/cache: window 2 of hidden.npy holds NaN or infinite values "
                       "(the file is corrupt); delete {tmp}/cache to rebuild it"),
]


def _tree(path: Path) -> dict:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(path.rglob("*"))}


def _log_to_this_stderr() -> None:
    """Point every logging stream handler at the current (captured) stderr: transformers and lm-eval keep the
    stderr of the test that first imported them, which capsys has closed since ('--- Logging error ---')."""
    import logging

    for logger in [logging.getLogger(), *(v for v in logging.root.manager.loggerDict.values()
                                          if isinstance(v, logging.Logger))]:
        for handler in logger.handlers:
            if type(handler) is logging.StreamHandler:
                handler.stream = sys.stderr  # not setStream: it flushes the closed one


def _run(kind: str, argv: list[str]) -> int:
    _log_to_this_stderr()
    if kind == "cli":
        return main(argv)
    from lm_eval.config.evaluate_config import EvaluatorConfig

    from fastweights.harness.__main__ import main as harness_main

    saved, from_cli = sys.argv[:], EvaluatorConfig.__dict__["from_cli"]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = lambda message, *a, **k: print(f"warning: {message}", file=sys.stderr)
            return harness_main(argv)
    finally:
        # the harness's entry point wraps lm-eval's config reader for the process it runs in: put it back, or a
        # later test in this worker finds it wrapped already (tests/harness/test_command_line.py failed so when
        # xdist's loadfile scheduling put the two files in one worker, in this order)
        sys.argv, EvaluatorConfig.from_cli = saved, from_cli


@pytest.mark.parametrize("build, code, needle", CASES, ids=[c[0].__name__ for c in CASES])
def test_the_probes_case_exits_with_one_line_and_changes_nothing(models, build, code, needle, tmp_path, capsys):
    if build.__name__.startswith("harness"):
        pytest.importorskip("lm_eval")
    kind, argv = build(models, tmp_path)
    before, inputs = _tree(tmp_path), {k: _tree(v) for k, v in models.items()}
    capsys.readouterr()
    rc = _run(kind, argv)
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err + cap.out, cap.err
    lines = [ln for ln in cap.err.strip().splitlines() if ln.strip()]
    if code == 2:
        assert rc == 2, cap.err
        errors = [ln for ln in lines if ln.startswith("error:")]
        assert len(errors) == 1 and lines[-1] == errors[0], cap.err
        assert line_matches(needle.format(tmp=tmp_path), errors[0]), errors[0]
    else:
        assert rc == 0, cap.err
        assert any(line_matches(needle.format(tmp=tmp_path), ln) for ln in lines), cap.err
    assert _tree(tmp_path) == before  # nothing written or rebuilt, not even in the folders the command names
    assert {k: _tree(v) for k, v in models.items()} == inputs
