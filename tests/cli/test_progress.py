"""The progress line: count, rate, fields, and an ETA bounded by a time budget; rates that never read 0; and
every long command, slowed by a fake clock, never silent for more than 10 s without a total and an ETA."""

import io
import re
import sys
import time

import pytest
import torch

from fastweights.core.progress import Progress, format_rate
from fastweights.models.lm import LanguageModel
from helpers import FakeTime, TimedLog, tiny_lm


def _line(bar: Progress, now_offset: float) -> str:
    out = io.StringIO()
    bar.stream, bar.tty = out, False
    bar._draw(bar.start + now_offset)
    return out.getvalue().strip()


def test_eta_from_rate():
    bar = Progress(100, "steps", desc="train", min_interval=0)
    bar.n = 10
    line = _line(bar, 10.0)  # 1 step/s, 90 to go
    assert line.startswith("train | 10/100 steps | 1.0 steps/s") and line.endswith("ETA 01:30")


def test_a_resumed_runs_rate_and_eta_count_only_this_processs_work():
    """Issue 49: after a resume at step 804 the line read 97,430,925 steps/s (all steps since 0 over this
    process's time). The steps done before are in the count, not in the rate or the ETA."""
    bar = Progress(1500, "steps", desc="train", min_interval=0, initial=804, enabled=False)
    bar.start = 0.0  # start + 25 - start is exactly 25 s (not 24.999... with a clock's value as the start)
    bar.update(10)
    line = _line(bar, 25.0)  # 10 steps in 25 s: 2.5 s/step, 686 to go
    assert line.startswith("train | 814/1,500 steps | 2.5 s/step") and line.endswith("ETA 28:35")


def test_a_cpu_second_eta_shows_the_wall_time_it_takes_here():
    """Issue 49: fwl-head train --minutes 3 (CPU minutes) took 30 wall minutes on a busy machine, and the line
    showed only the CPU ETA. Beside it: the wall time at this process's share of a core so far."""
    # enabled=False: update() never draws, so only _line below reads the wall clock (a loaded machine drew early)
    bar = Progress(100, "CPU-sec", desc="train", min_interval=0, clock=time.process_time, enabled=False)
    wall = iter([0.0, 40.0])  # 40 wall seconds for the 10 CPU seconds below: a quarter of a core
    bar.wall_clock = lambda: next(wall)
    bar.wall_start, bar.start = bar.wall_clock(), 0.0  # a start of 0: start + 10 - start is exactly 10 s
    bar.update(10)
    assert _line(bar, 10.0).endswith("ETA 01:30 (wall ~06:00)")
    idle = Progress(100, "CPU-sec", min_interval=0, clock=time.process_time, enabled=False)
    idle.wall_clock, idle.wall_start, idle.start = (lambda: 5.0), 0.0, 0.0  # two threads: fewer wall than CPU s
    idle.update(10)
    assert _line(idle, 10.0).endswith("ETA 01:30 (wall ~01:30)")
    wall_clock = Progress(100, "steps", min_interval=0, enabled=False)
    wall_clock.start = 0.0
    wall_clock.update(10)
    assert _line(wall_clock, 10.0).endswith("ETA 01:30")  # a wall-clock budget: its ETA is already wall time


def test_eta_never_exceeds_the_time_budget():
    bar = Progress(5000, "steps", desc="train", time_limit=300.0)
    bar.n = 40
    assert _line(bar, 10.0).endswith("ETA 04:50")  # the count would say 20:40; the budget ends it at 5:00
    assert _line(bar, 400.0).endswith("ETA 00:00")
    bar.n = 4000  # 400 steps/s: the count ends it in 2.5 s, well inside the budget
    assert _line(bar, 10.0).endswith("ETA 00:02")
    bar.until_time_limit = True  # the budget binds (the total is its estimate): the budget's end is the ETA
    assert _line(bar, 10.0).endswith("ETA 04:50")


def test_fields_and_final_line_have_no_eta():
    bar = Progress(None, "tok", min_interval=0)
    bar.update(5, loss=1.25)
    out = io.StringIO()
    bar.stream, bar.tty = out, False
    bar._draw(bar.start + 1.0, final=True)
    assert "loss 1.25" in out.getvalue() and "ETA" not in out.getvalue()


def test_cpu_clock_counts_cpu_seconds_for_the_budget():
    # train.budget_clock = "cpu": the budget is CPU seconds, so elapsed and ETA must be CPU seconds too
    fake = iter([100.0, 160.0])  # start, then 60 CPU seconds later
    bar = Progress(5000, "steps", desc="train", time_limit=120.0, clock=lambda: next(fake), min_interval=0)
    bar.n = 30
    out = io.StringIO()
    bar.stream, bar.tty = out, False
    bar._draw(bar.clock())
    line = out.getvalue().strip()
    assert "elapsed 01:00" in line and line.endswith("ETA 01:00")
    bar = Progress(10, clock=time.process_time)
    assert bar.clock_label == "cpu"


# ----------------------------------------------------------------------------- rates


@pytest.mark.parametrize("rate,unit,shown", [
    (2500.0, "tok", "2,500 tok/s"), (3.46, "samples", "3.5 samples/s"), (1 / 4.2, "samples", "4.2 s/sample"),
    (0.004, "batches", "250 s/batch"), (1e-7, "tok", "10,000,000 s/tok"), (0.5, "steps", "2.0 s/step")])
def test_a_rate_never_reads_zero(rate, unit, shown):
    assert format_rate(rate, unit) == shown
    assert format_rate(0.0, unit) == ""  # nothing done yet: no rate, rather than "0 x/s"


def test_slow_work_shows_seconds_per_unit_and_a_labelled_loss():
    bar = Progress(20, "samples", desc="niah", loss_unit="nats")
    bar.n, bar.fields = 2, {"loss": 1.5}
    line = bar.line(bar.start + 10.0)  # 5 s per sample: "0 samples/s" before issue 33
    assert "5.0 s/sample" in line and "/s" not in line.replace("s/sample", "")
    assert "loss 1.5 nats" in line and line.endswith("ETA 01:30")
    bar.loss_unit = ""  # a loss of unknown unit (a squared error) is not called nats
    assert "loss 1.5 |" in bar.line(bar.start + 10.0)
    plain = Progress(20, "samples", desc="niah")  # no unit unless given
    plain.n, plain.fields = 2, {"loss": 1.5}
    assert "loss 1.5 |" in plain.line(plain.start + 10.0)
    bar.total, bar.approximate = 40, True
    assert "2/~40 samples" in bar.line(bar.start + 10.0)


def test_an_adopting_bar_counts_inner_bars_of_its_unit():
    out = io.StringIO()
    outer = Progress(100, "tok", desc="outer", stream=out, min_interval=0)
    with outer.adopting():
        inner = Progress(50, "tok", desc="inner", stream=out)
        other = Progress(3, "batches", desc="other", stream=out)
        inner.update(30)
        inner.close()
    assert outer.n == 30 and inner.parent is outer and other.parent is None
    assert "inner" not in out.getvalue()  # the inner bar draws nothing of its own
    assert Progress(5, "tok").parent is None  # outside the block nothing is adopted


# ----------------------------------------------------------------------------- slowed commands

SECONDS_PER_TOKEN = 0.05  # the fake cost of every token a model call reads: a 32-token call takes 1.6 s
MAX_SILENCE = 10.0  # issue 33: no command runs longer than this without a progress line with a total and an ETA
PROGRESS = re.compile(r"\d[\d,.]*/~?[\d,.]+ \S+ \|")  # "120/~4,000 tok |": a count, its total and its unit


@pytest.fixture(scope="module")
def memory_checkpoint(tmp_path_factory):
    """An untrained char-level FwPKM model (the needle alphabet in its vocabulary), its corpus and a text."""
    from fastweights.checkpoints.format import save_model
    from fastweights.core.config import DataConfig, RunConfig, TrainConfig
    from fastweights.data import CharTokenizer
    from fastweights.tasks.niah import Haystack

    d = tmp_path_factory.mktemp("slow")
    text = Haystack.load().text
    (d / "corpus.txt").write_text(text[:30000])
    (d / "doc.txt").write_text(text[40000:40800])
    tok = CharTokenizer.from_text(text[:200000] + "0123456789abcdef" + "ID-")
    model = tiny_lm(tok.vocab_size, memory="fwpkm", memory_layers=[1],
                    options={"fwpkm": dict(n_subkeys=6, d_key=8, d_value=8, topk=2, chunk_size=16)})
    cfg = RunConfig(model=model.config, data=DataConfig(corpus=str(d / "corpus.txt")), train=TrainConfig(seq_len=32))
    save_model(model, d / "ckpt", cfg, tok)
    return d


def _slowed(monkeypatch):
    """Every model call costs SECONDS_PER_TOKEN per token it reads, on the fake clock; stderr is a log."""
    import fastweights.core.progress as progress_module

    clock = FakeTime()
    monkeypatch.setattr(progress_module, "time", clock)
    forward = LanguageModel.forward

    def slow_forward(self, tokens, *args, **kwargs):
        # the model under test only: the fingerprint probes a result records run float64 models of capped
        # size (evidence.probes.probe_config), whose cost does not grow with the checkpoint's
        if next(self.parameters()).dtype != torch.float64:
            clock.t += SECONDS_PER_TOKEN * tokens.numel()
        return forward(self, tokens, *args, **kwargs)

    monkeypatch.setattr(LanguageModel, "forward", slow_forward)
    log = TimedLog(clock)
    monkeypatch.setattr(sys, "stderr", log)
    return clock, log


COMMANDS = {
    "dynamic eval": ["dynamic", "eval", "--checkpoint", "{d}/ckpt", "--data", "{d}/doc.txt", "--rule", "sgd",
                     "--lr", "0.001", "--max-chars", "500"],
    "dynamic tune": ["dynamic", "tune", "--checkpoint", "{d}/ckpt", "--data", "{d}/doc.txt", "--rule", "sgd",
                     "--tune-chars", "200", "--lrs", "1e-3,1e-2,1e-1", "--save", "{d}/tuned.json"],
    "eval --stream": ["eval", "--stream", "--checkpoint", "{d}/ckpt", "--data", "{d}/doc.txt", "--modes", "carry",
                      "--out", "{d}/stream"],
    "inspect addressing": ["inspect", "addressing", "--checkpoint", "{d}/ckpt", "--data", "{d}/doc.txt"],
    "task niah": ["task", "niah", "--checkpoint", "{d}/ckpt", "--lengths", "256,384", "--samples", "2",
                  "--piece", "32", "--out", "{d}/niah"],
}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_slow_command_is_never_silent_without_a_total_and_an_eta(name, memory_checkpoint, monkeypatch):
    from fastweights import cli

    argv = [a.format(d=memory_checkpoint) for a in COMMANDS[name]]
    monkeypatch.chdir(memory_checkpoint)
    clock, log = _slowed(monkeypatch)
    start = clock.t
    assert cli.main(argv) == 0, log.getvalue()
    _assert_never_silent(name, start, clock, log)


def _assert_never_silent(name: str, start: float, clock: FakeTime, log: TimedLog) -> None:
    """From ``start`` to now (fake clock) no stretch longer than MAX_SILENCE passed without a progress line;
    every line has a count, a total and a unit, and all but a phase's closing line (count == total) an ETA."""
    lines = [(t, line) for t, line in log.lines if PROGRESS.search(line)]
    assert lines, f"{name}: no progress line in {log.getvalue()!r}"
    assert clock.t - start > 3 * MAX_SILENCE  # the fake work is long enough for the check to mean something
    times = [start] + [t for t, _ in lines] + [clock.t]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert max(gaps) <= MAX_SILENCE, f"{name}: {max(gaps):.1f} s without a progress line: {log.getvalue()}"
    for _, line in lines:
        done, total = PROGRESS.search(line).group(0).split(" ")[0].split("/")
        assert "ETA" in line or done == total.lstrip("~"), f"{name}: a line of running work without an ETA: {line}"
    # every token costs the same here, so an ETA that weighs the work rightly (by tokens, not by samples or
    # by passes) predicts when its bar closes: within 10% of the bar's time so far, plus the rounding to
    # seconds and one model call
    start_of_bar = start
    for i, (t, line) in enumerate(lines):
        eta = re.search(r"ETA (\d+):(\d+)$", line)
        if eta is None:
            start_of_bar = t
            continue
        close = next(u for u, later in lines[i:] if "ETA" not in later)
        predicted = int(eta.group(1)) * 60 + int(eta.group(2))
        assert abs(predicted - (close - t)) <= 0.1 * (t - start_of_bar) + 3.0, \
            f"{name}: ETA {predicted} s at {line!r}, the bar closed {close - t:.1f} s later"
    assert not re.search(r"(?<![\d.,])0 \S+/s", log.getvalue()), "a rate printed as 0"


def test_continual_adaptation_is_never_silent(monkeypatch):
    from fastweights.adapt.continual import Domain, adapt_test
    from helpers import motif_tokens

    model = tiny_lm(11)
    domains = [Domain(f"d{i}", motif_tokens(161, 11, seed=i), motif_tokens(81, 11, seed=10 + i)) for i in range(2)]
    clock, log = _slowed(monkeypatch)
    start = clock.t
    adapt_test(model, domains, seq_len=32, progress=True)
    _assert_never_silent("continual", start, clock, log)


def test_the_tuning_search_plans_exactly_the_points_it_runs(monkeypatch):
    # the automatic search may stop its coarse stage early: its total is an upper bound ("<=", "~") until
    # then, and exact afterwards, ending at exactly the tokens of the static pass and every point run
    from fastweights.adapt.dynamic import DynamicEvaluator
    from fastweights.adapt.tune import tune_dynamic
    from helpers import motif_tokens

    model = tiny_lm(11)
    docs = [motif_tokens(21, 11)]
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    res = tune_dynamic(lambda lr, decay: DynamicEvaluator(model, rule="sgd-global-prior", lr=lr, decay=decay,
                                                          segment_len=5), docs, progress=True)
    last = out.getvalue().splitlines()[-1]
    n = 20 * (1 + len(res["grid"]))
    assert f"{n:,}/{n:,} tok" in last and f"point {len(res['grid'])}/{len(res['grid'])} " in last, last


def test_a_stream_total_is_estimated_from_what_was_read_and_exact_at_the_end():
    from fastweights.data import ByteTokenizer
    from fastweights.experiments.streaming import encode_documents

    class Doc:  # a document read in three pieces, the last one in two-byte characters
        name, n_chars = "doc", 30

        def pieces(self):
            return ["a" * 10, "b" * 10, "é" * 10]

    docs = encode_documents([Doc(), "xyz"], ByteTokenizer())
    assert (docs.chars, docs.documents) == (33, 2) and docs.estimated_predictions() == (0, False)
    blocks = iter(docs)
    _, first = next(blocks)
    next(first)  # 10 characters, 10 bytes read: 33 characters estimated as 33 tokens, 2 of them context only
    assert docs.estimated_predictions() == (31, False)
    for _ in first:
        pass
    for _, rest in blocks:
        list(rest)
    assert docs.estimated_predictions() == (30 + 10 + 3 - 2, True)  # exact: 43 bytes, each document's first is context
