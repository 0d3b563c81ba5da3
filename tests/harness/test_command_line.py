"""``python -m fastweights.harness`` as the documentation gives it, on a machine without CUDA (issue 40).

The ``python -m fastweights.harness ...`` lines of docs/lm-eval-harness.md (and of the README, if it gains any)
are run as written, through lm-eval's real command line in a subprocess with CUDA hidden, in a folder where
``runs/demo`` is a trained ``tiny`` run; ``--limit 1`` is the only thing added. They must exit 0, print the results
table and a progress line for the scoring. A missing checkpoint is the one-line error, not a device this
machine lacks. Then, in process: which device lm-eval hands our models, and progress lines with a total and an
ETA on a slowed clock."""

import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lm_eval")

import helpers  # noqa: E402
from helpers import HANG_GUARD_S, FakeTime, TimedLog  # noqa: E402

DOCS = [helpers.ROOT / "docs" / "lm-eval-harness.md", helpers.ROOT / "README.md"]
PREFIX = "python -m fastweights.harness "
PROGRESS = re.compile(r"(\d[\d,]*)/([\d,]+) (tok|requests) \|")  # "1,999/1,999 tok |": count, total, unit


def documented_lines() -> list[str]:
    """Every ``python -m fastweights.harness ...`` one-liner of the harness page and the README."""
    return [ln.strip() for doc in DOCS for ln in doc.read_text().splitlines() if ln.strip().startswith(PREFIX)]


def run_harness(argv: list[str], cwd, timeout: float = HANG_GUARD_S) -> subprocess.CompletedProcess:
    """``python -m fastweights.harness ARGV`` with CUDA hidden, offline, one thread (the test's speed only)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(helpers.ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-m", "fastweights.harness", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


MISSING = "checkpoint=/nonexistent/run"


def as_run(line: str) -> list[str]:
    """The arguments of a documented line, and ``--limit 1`` where it evaluates."""
    argv = shlex.split(line)[3:]
    return argv if argv[0] == "ls" else argv + ["--limit", "1"]


def missing_checkpoint_argv() -> list[str]:
    """The first documented command that scores ``runs/demo``, with a checkpoint that does not exist."""
    line = next(ln for ln in documented_lines() if "checkpoint=runs/demo" in ln)
    return [a.replace("checkpoint=runs/demo", MISSING) for a in as_run(line)]


@pytest.fixture(scope="module")
def results(tmp_path_factory, tiny_run) -> dict:
    """Each documented line (and the missing checkpoint's) run in a folder of its own with ``runs/demo``, a
    trained run (a copy each: dynamic evaluation writes its statistics there); all at once, as the runs are
    mostly lm-eval's start."""
    from concurrent.futures import ThreadPoolExecutor

    todo = {line: as_run(line) for line in documented_lines()} | {MISSING: missing_checkpoint_argv()}
    folders = {}
    for key in todo:
        folders[key] = tmp_path_factory.mktemp("user")
        shutil.copytree(tiny_run, folders[key] / "runs" / "demo")
    with ThreadPoolExecutor(len(todo)) as pool:
        done = {key: pool.submit(run_harness, argv, folders[key]) for key, argv in todo.items()}
        return {key: f.result() for key, f in done.items()}


def test_the_docs_give_the_commands_this_file_runs():
    lines = documented_lines()
    assert any("--model fastweights " in ln for ln in lines) and any("--model fastweights-dynamic " in ln
                                                                     for ln in lines)
    assert all("--device" not in ln for ln in lines)  # as written: no device named, on any machine


@pytest.mark.slow
@pytest.mark.parametrize("line", documented_lines(), ids=lambda ln: "_".join(shlex.split(ln)[3:5]))
def test_a_documented_command_runs_as_written_without_cuda(line, results):
    argv = shlex.split(line)[3:]
    evaluates = argv[0] != "ls"
    r = results[line]
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "CUDA is not available" not in r.stderr, r.stderr[-3000:]
    if not evaluates:
        assert "fastweights_heldout_plays" in r.stdout
        return
    tasks = shlex.split(line)[shlex.split(line).index("--tasks") + 1].split(",")
    for task in tasks:  # the results table, one row of metrics per task
        assert re.search(rf"^\|{re.escape(task)}\s*\|.*\|bits_per_byte\s*\|", r.stdout, re.M), r.stdout
    # the scoring's progress line on stderr: the tokens of the one document, counted to their total
    model = argv[argv.index("--model") + 1]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith(f"{model}: loglikelihood_rolling, 1 document(s) | ")]
    assert lines, r.stderr[-3000:]
    count, total, unit = PROGRESS.search(lines[-1]).groups()
    assert count == total != "0" and unit == "tok", lines


@pytest.mark.slow
def test_a_missing_checkpoint_is_the_error_not_the_device(results):
    """The documented command with a checkpoint that does not exist: one line naming it, exit status 2."""
    r = results[MISSING]
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert errors == ["error: checkpoint /nonexistent/run does not exist or is not a directory"], r.stderr[-3000:]
    assert r.stderr.rstrip().endswith(errors[0]) and "Traceback" not in r.stderr


# ----------------------------------------------------------------------------- in process: the device


def _config(argv: list[str], tmp_path=None):
    """lm-eval's EvaluatorConfig of ``lm-eval run ARGV`` as ``python -m fastweights.harness`` builds it."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.config.evaluate_config import EvaluatorConfig

    from fastweights.harness.__main__ import _device_auto_unless_given

    original = EvaluatorConfig.__dict__["from_cli"]
    try:
        _device_auto_unless_given()
        wrapped = EvaluatorConfig.__dict__["from_cli"]
        _device_auto_unless_given()  # wrapping twice is wrapping once
        assert EvaluatorConfig.__dict__["from_cli"] is wrapped and wrapped is not original
        return EvaluatorConfig.from_cli(HarnessCLI()._parser.parse_args(["run", *argv]))
    finally:
        EvaluatorConfig.from_cli = original


@pytest.mark.parametrize("extra, device", [
    ([], "auto"),  # lm-eval's own default, cuda:0, is not used for our models
    (["--device", "cpu"], "cpu"),
    (["--device", "cuda:1"], "cuda:1"),
])
def test_the_device_is_auto_unless_the_user_names_one(extra, device):
    cfg = _config(["--model", "fastweights", "--model_args", "checkpoint=runs/demo", "--tasks", "x", *extra])
    assert cfg.device == device


def test_a_device_in_the_model_arguments_is_used_and_naming_it_twice_is_refused():
    from fastweights.core.errors import UserError

    cfg = _config(["--model", "fastweights-dynamic", "--model_args", "checkpoint=runs/demo,device=cpu", "--tasks", "x"])
    assert cfg.device is None and cfg.model_args["device"] == "cpu"  # lm-eval passes no second one
    with pytest.raises(UserError, match="the device is given twice: --device cuda and model argument device=cpu"):
        _config(["--model", "fastweights", "--model_args", "checkpoint=d,device=cpu", "--tasks", "x",
                 "--device", "cuda"])


def test_a_device_in_a_config_file_is_the_users_and_other_models_keep_lm_evals_default(tmp_path):
    (tmp_path / "run.yaml").write_text("model: fastweights\nmodel_args: {checkpoint: runs/demo}\ndevice: cpu\n"
                                       "tasks: [x]\n")
    assert _config(["--config", str(tmp_path / "run.yaml")]).device == "cpu"
    assert _config(["--model", "hf", "--model_args", "pretrained=gpt2", "--tasks", "x"]).device == "cuda:0"


def test_a_missing_checkpoint_is_reported_before_a_device_the_machine_lacks(monkeypatch, tmp_path):
    """``--device cuda:0`` on a machine without CUDA and a checkpoint that does not exist: the checkpoint."""
    from fastweights.core.errors import UserError
    from fastweights.harness.models import FastweightsStatic

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="^checkpoint .*nope does not exist or is not a directory$"):
        FastweightsStatic(checkpoint=str(tmp_path / "nope"), device="cuda:0")
    ok = helpers.untrained_char_checkpoint(tmp_path, "the cat sat on the mat. " * 20)
    with pytest.raises(UserError, match="device 'cuda:0' requested but CUDA is not available"):
        FastweightsStatic(checkpoint=str(ok), device="cuda:0")


# ----------------------------------------------------------------------------- in process: progress on a slow clock

SECONDS_PER_TOKEN = 0.05  # the fake cost of every token a model call reads
MAX_SILENCE = 10.0


@pytest.mark.filterwarnings("ignore::UserWarning")  # the dynamic model's note that pairs use the trained weights
@pytest.mark.parametrize("kind", ["fastweights", "fastweights-dynamic"])
def test_every_request_type_is_never_silent_without_a_total_and_an_eta(kind, monkeypatch, tmp_path):
    """Slowed model calls (0.05 s a token on a fake clock): each request type prints a progress line with a
    count, a total and an ETA at least every 10 s, and a closing line at its total."""
    from lm_eval.api.instance import Instance

    import fastweights.core.progress as progress_module
    from fastweights.harness.corpora import documents
    from fastweights.harness.models import FastweightsDynamic, FastweightsStatic
    from fastweights.models.lm import LanguageModel

    texts = [d["text"][:600] for d in documents("shakespeare-heldout", ["hamlet_gut.txt", "macbeth_gut.txt"], 2000,
                                                  "ACT I")]
    ckpt = helpers.untrained_char_checkpoint(tmp_path, "".join(texts))
    cls = FastweightsDynamic if kind == "fastweights-dynamic" else FastweightsStatic
    lm = cls(checkpoint=str(ckpt), device="cpu", **({"rule": "sgd", "lr": 0.01} if cls is FastweightsDynamic else {}))
    clock = FakeTime()
    monkeypatch.setattr(progress_module, "time", clock)
    forward = LanguageModel.forward

    def slow_forward(self, tokens, *args, **kwargs):
        clock.t += SECONDS_PER_TOKEN * tokens.numel()
        return forward(self, tokens, *args, **kwargs)

    monkeypatch.setattr(LanguageModel, "forward", slow_forward)
    log = TimedLog(clock)
    monkeypatch.setattr(sys, "stderr", log)
    requests = {
        "loglikelihood_rolling": [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)],
        "loglikelihood": [Instance("loglikelihood", {}, (t[:200], t[200:208]), i) for i, t in enumerate(texts * 4)],
        "generate_until": [Instance("generate_until", {}, (t[:100], {"until": ["\n\n"], "max_gen_toks": 8}), i)
                           for i, t in enumerate(texts * 2)],
    }
    for what, reqs in requests.items():
        start, first = clock.t, len(log.lines)
        getattr(lm, what)(reqs)
        lines = [(t, ln) for t, ln in log.lines[first:] if f"{kind}: {what}" in ln]
        assert lines, (what, log.getvalue())
        total = sum(len(t) - 1 for t in texts) if what == "loglikelihood_rolling" else len(reqs)
        last = start
        for t, ln in lines:
            assert t - last <= MAX_SILENCE, (what, t - last, log.getvalue())
            last = t
            count, shown_total, _ = PROGRESS.search(ln).groups()
            assert int(shown_total.replace(",", "")) == total, ln
            assert "ETA" in ln or count == shown_total, ln
        assert clock.t - last <= MAX_SILENCE
        assert PROGRESS.search(lines[-1][1]).group(1) == PROGRESS.search(lines[-1][1]).group(2)  # closed at total
        assert any("ETA" in ln for _, ln in lines), (what, log.getvalue())


def test_lm_evals_disable_tqdm_turns_the_progress_line_off(capsys, tmp_path):
    from lm_eval.api.instance import Instance

    from fastweights.harness.models import FastweightsStatic

    lm = FastweightsStatic(checkpoint=str(helpers.untrained_char_checkpoint(tmp_path, "abc " * 50)), device="cpu")
    lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("abc abc",), 0)], disable_tqdm=True)
    assert "loglikelihood_rolling" not in capsys.readouterr().err
    lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("abc abc",), 0)])
    assert "fastweights: loglikelihood_rolling, 1 document(s) | 6/6 tok |" in capsys.readouterr().err


def test_the_threads_model_argument_sets_torchs_threads(tmp_path, monkeypatch):
    """``threads=`` reaches the scoring's thread count (seed 18: `use_threads("scoring", None)` survived, every
    harness run on the default)."""
    from fastweights.harness.models import FastweightsStatic

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        FastweightsStatic(checkpoint=str(helpers.untrained_char_checkpoint(tmp_path, "abc " * 50)), device="cpu",
                          threads=2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
