"""The adversarial probe of issue 39, replayed (part A: writes through links below ``--out``, tracebacks outside
the Hugging Face code, settings that silently do nothing, misleading messages).

Each case builds what the probe built (a link planted in a run or export directory, a tampered trainer state, a
corpus folder holding a FIFO, a setting that does nothing, ...), runs the real command in-process
(``fastweights.cli.main``, as the other tests of ``tests/cli`` do) and checks:

- a refusal: exit status 2 and exactly one line on stderr, ``error: ...`` naming the cause, no traceback, and
  nothing changed anywhere in the case's folder (``--out`` and the export directory included: nothing
  half-written, nothing written through a link);
- a legal setting that does nothing: the run succeeds, with exactly the documented one-line warning (the
  warnings ``docs/README.md`` lists), and nothing outside ``--out`` changed.

The victim folder ``V`` (what a link points at) and every other file of the case are snapshotted before and
compared after, links recorded as links.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
import warnings
from pathlib import Path

import pytest

from fastweights.cli import main
from helpers import line_matches, resign_manifest

TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog {i % 7}.\n" for i in range(600))
TINY = ["--preset", "tiny", "--quiet", "--set", "train.warmup_steps=1", "--set", "train.eval_tokens=64"]


def _tree(root: Path) -> dict:
    """Every entry below ``root`` (links as links, never followed) with its content hash."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "link -> " + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            elif p.is_file():
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[rel] = "special"
    return out


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """A 3-step tiny run on a small corpus (with its token cache in ``data/``): copy it before changing it."""
    base = tmp_path_factory.mktemp("replay")
    (base / "small.txt").write_text(TEXT)
    out = base / "run"
    assert main(["train", *TINY, "--data", str(base / "small.txt"), "--set", "train.max_steps=3",
                 "--set", "train.eval_every=0", "--out", str(out)]) == 0
    return out


class Case:
    """``tmp``: the case's folder (``tmp/V`` the victim, ``tmp/small.txt`` a corpus); ``run``: a copy-me run."""

    def __init__(self, tmp: Path, run: Path):
        self.tmp, self.run = tmp, run
        self.victim = tmp / "V"
        self.victim.mkdir()
        (self.victim / "victim.json").write_text('{"precious": true}\n')
        self.corpus = tmp / "small.txt"
        self.corpus.write_text(TEXT)

    def copy_run(self, name="out") -> Path:
        dst = self.tmp / name
        shutil.copytree(self.run, dst, symlinks=True)
        return dst

    def train(self, out: Path, *extra) -> list[str]:
        return ["train", *TINY, "--data", str(self.corpus), "--set", "train.max_steps=3", "--out", str(out), *extra]


# ----------------------------------------------------------------------------- the cases: (setup, needle)
# setup(case) -> argv; a needle "error: ..." is a refusal, "warning: ..." a documented warning


def link_token_cache(c):
    """Item 1: ``out/data`` a link to another folder: the token cache would be written there."""
    (c.tmp / "out").mkdir()
    (c.tmp / "out" / "data").symlink_to(c.victim)
    return c.train(c.tmp / "out")


def link_token_cache_overwrite(c):
    """Item 1: the same in a run directory replaced with --overwrite (the run is left as it was)."""
    out = c.copy_run()
    shutil.rmtree(out / "data")
    (out / "data").symlink_to(c.victim)
    return c.train(out, "--overwrite")


def link_token_cache_resume(c):
    out = c.copy_run()
    shutil.rmtree(out / "data")
    (out / "data").symlink_to(c.victim)
    return c.train(out, "--resume", "--set", "train.max_steps=5")


def link_cache_file(c):
    """Item 1: one cache file of ``out/data`` a link (to a file elsewhere)."""
    out = c.copy_run()
    f = next((out / "data").glob("train-*.bin"))
    f.unlink()
    f.symlink_to(c.victim / "victim.json")
    return c.train(out, "--overwrite")


def link_tensorboard(c):
    """Item 1: ``out/tensorboard`` a link: the event files would land in it."""
    pytest.importorskip("tensorboard")
    out = c.copy_run()
    (out / "tensorboard").symlink_to(c.victim)
    return c.train(out, "--overwrite", "--log", "tensorboard")


def file_at_tensorboard(c):
    """A regular file where the TensorBoard events' folder goes, with --overwrite: refused in one line naming what
    cannot be written, before the old run is cleared (found through a mutant of the seed-8 draw, issue 49: the
    refusal came after --overwrite had deleted the run)."""
    pytest.importorskip("tensorboard")
    out = c.copy_run()
    (out / "tensorboard").write_text("not a folder")
    return c.train(out, "--overwrite", "--log", "tensorboard")


def file_at_token_cache(c):
    """The same for the token cache's folder."""
    out = c.copy_run()
    shutil.rmtree(out / "data", ignore_errors=True)
    (out / "data").write_text("not a folder")
    return c.train(out, "--overwrite")


def link_checkpoint_staging(c):
    """Item 1: ``.ckpt-next`` (a save's staging, whose files are moved into the run) a link to a folder."""
    out = c.copy_run()
    (out / ".ckpt-next").symlink_to(c.victim)
    return c.train(out, "--resume", "--set", "train.max_steps=5")


def link_checkpoint_file(c):
    """Item 1: a checkpoint file (``summary.json``, replaced at the end of a run) a link."""
    out = c.copy_run()
    (out / "summary.json").unlink()
    (out / "summary.json").symlink_to(c.victim / "victim.json")
    return c.train(out, "--resume", "--set", "train.max_steps=5")


def link_export_config(c):
    """Item 1: ``exp/config.json`` a link; ``export-hf RUN exp --force`` would overwrite its target."""
    pytest.importorskip("transformers")
    (c.tmp / "exp").mkdir()
    (c.tmp / "exp" / "config.json").symlink_to(c.victim / "victim.json")
    return ["export-hf", str(c.run), str(c.tmp / "exp"), "--force"]


def link_prepared_tokenizer(c):
    """Item 1: ``fastweights prepare --out DIR`` into a prepared directory whose tokenizer.json is a link."""
    out = c.tmp / "prep"
    out.mkdir()
    (out / "prepared.json").write_text("{}")
    (out / "tokenizer.json").symlink_to(c.victim / "victim.json")
    return ["prepare", "--data", str(c.corpus), "--tokenizer", "byte", "--out", str(out), "--quiet"]


def optimizer_wrong_shape(c):
    """Item 5: a trainer state whose optimizer tensor has the wrong shape, checkpoint.json re-signed."""
    import torch

    from fastweights.checkpoints.format import TRAINER_STATE, parse_trainer_state, save_trainer_state

    out = c.copy_run()
    state = parse_trainer_state((out / TRAINER_STATE).read_bytes(), "x")
    first = next(iter(state["optimizer"]["state"].values()))
    first["exp_avg"] = torch.zeros(3)
    save_trainer_state(state, out / TRAINER_STATE)
    resign_manifest(out)
    return c.train(out, "--resume", "--set", "train.max_steps=5")


def trainer_state_other_step(c):
    """Item 5 / missed mutant: a trainer state at another step than checkpoint.json, re-signed."""
    from fastweights.checkpoints.format import TRAINER_STATE, parse_trainer_state, save_trainer_state

    out = c.copy_run()
    state = parse_trainer_state((out / TRAINER_STATE).read_bytes(), "x")
    state["step"] += 1
    save_trainer_state(state, out / TRAINER_STATE)
    resign_manifest(out)
    return c.train(out, "--resume", "--set", "train.max_steps=6")


def _prepared(c, edit):
    out = c.tmp / "prep"
    assert main(["prepare", "--data", str(c.corpus), "--tokenizer", "byte", "--out", str(out), "--quiet"]) == 0
    side = next(out.glob("train-*.bin.json"))
    meta = json.loads(side.read_text())
    edit(meta)
    side.write_text(json.dumps(meta))
    return ["train", *TINY, "--data", str(out), "--set", "train.max_steps=3", "--out", str(c.tmp / "out")]


def token_cache_object_dtype(c):
    """Item 5: a token file whose sidecar declares an object dtype (cannot be memory-mapped)."""
    return _prepared(c, lambda m: m.update(dtype="|O"))


def token_cache_bad_offsets(c):
    """Item 5: a sidecar whose document offsets are not numbers (a traceback before)."""
    return _prepared(c, lambda m: m.update(doc_offsets="zero"))


def compile_without_a_compiler(c):
    """Item 5: ``train.compile=true`` where the C++ compiler cannot build Inductor's kernels: refused in seconds,
    nothing left in --out (a stand-in compiler that answers --version and fails every build)."""
    import torch._inductor.config as inductor_config

    fake = c.tmp / "bin" / "c++"
    fake.parent.mkdir()
    real = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if real is None:
        pytest.skip("no C++ compiler to imitate")
    fake.write_text(f"#!/bin/sh\nfor a in \"$@\"; do case \"$a\" in --version|-v|-dumpversion|-dumpfullversion) "
                    f"exec {real} \"$@\";; esac; done\necho 'fatal error: cannot build' >&2\nexit 1\n")
    fake.chmod(0o755)
    c.patch.setattr(inductor_config.cpp, "cxx", (None, str(fake)))
    c.patch.setattr(inductor_config, "fx_graph_cache", False)
    return c.train(c.tmp / "out", "--set", "train.compile=true")


def options_of_an_unused_mechanism(c):
    """Item 6: fwp options with the attention mixer: a warning, the run trains."""
    return c.train(c.tmp / "out", "--set", "model.options.fwp.rule=\"delta\"")


def fwl_test_time_step_without_test_time_only(c):
    """Item 6: the FWL head's test_time_step_size without test_time_only: a warning."""
    return c.train(c.tmp / "out", "--set", "model.head=\"fwl\"", "--set", "model.options.fwl.segment_len=8",
                   "--set", "model.options.fwl.test_time_step_size=5")


def resume_past_max_steps(c):
    """Item 6: ``--resume --set train.max_steps=2`` on a run at step 3 (printed "3/2 steps", exit 0, before)."""
    return c.train(c.copy_run(), "--resume", "--set", "train.max_steps=2")


def _corpus_dir(c, plant):
    d = c.tmp / "corpus"
    d.mkdir()
    (d / "a.txt").write_text(TEXT)
    plant(d / "z.txt")
    return ["train", *TINY, "--data", str(d), "--set", "train.max_steps=3", "--out", str(c.tmp / "out")]


def corpus_dir_link_to_dev_zero(c):
    """Item 6: a file of a corpus folder that links to /dev/zero (skipped without a word, before)."""
    return _corpus_dir(c, lambda p: p.symlink_to("/dev/zero"))


def corpus_dir_fifo(c):
    """Item 6: a FIFO in a corpus folder."""
    return _corpus_dir(c, lambda p: os.mkfifo(p))


def corpus_dir_broken_link(c):
    """A link to nothing in a corpus folder, named as such (mutation caught, issue 49 seed 9)."""
    return _corpus_dir(c, lambda p: os.symlink(c.tmp / "nowhere.txt", p))


def options_nan(c):
    """Item 7: ``model.options.fwl.step_size_init=nan`` (accepted before, then "diverged ... lower train.lr")."""
    return c.train(c.tmp / "out", "--set", "model.head=\"fwl\"", "--set", "model.options.fwl.step_size_init=nan")


def lr_nan_no_warning_first(c):
    """Item 7: ``train.lr=nan`` with warmup past max_steps: the error alone, no warmup warning before it."""
    return c.train(c.tmp / "out", "--set", "train.lr=nan", "--set", "train.warmup_steps=9")


def hf_dataset_offline(c):
    """Item 7: ``--data hf:nonexistent/ds`` with no network: one line in seconds (56 s and five retries before)."""
    pytest.importorskip("datasets")
    from huggingface_hub import constants

    def unreachable(*a, **k):
        raise OSError(-2, "Name or service not known")

    c.patch.setattr(constants, "HF_HUB_OFFLINE", False)
    c.patch.setattr(socket, "create_connection", unreachable)
    c.deadline = 20
    return ["train", *TINY, "--data", "hf:nonexistent-org-39/no-such-dataset", "--out", str(c.tmp / "out")]


CASES = [
    (link_token_cache, "error: {tmp}/out/data is a symbolic link; refusing to write the token cache through it "
                       "(remove the link)"),
    (link_token_cache_overwrite, "error: {tmp}/out/data is a symbolic link; refusing to write the token cache "
                                 "through it (remove the link)"),
    (link_token_cache_resume, "error: {tmp}/out/data is a symbolic link; refusing to write the token cache through "
                              "it (remove the link)"),
    (link_cache_file, "error: {tmp}/out/data/train-*.bin is a symbolic link; refusing to write the token cache "
                      "through it (remove the link)"),
    (link_tensorboard, "error: {tmp}/out/tensorboard is a symbolic link; refusing to write the TensorBoard events "
                       "through it (remove the link)"),
    (file_at_tensorboard, "error: {tmp}/out/tensorboard is a file, not a folder; cannot write the TensorBoard "
                          "events"),
    (file_at_token_cache, "error: {tmp}/out/data is a file, not a folder; cannot write the token cache"),
    (link_checkpoint_staging, "error: {tmp}/out/.ckpt-next is a symbolic link; refusing to write the run's files "
                              "through it (remove the link)"),
    (link_checkpoint_file, "error: {tmp}/out/summary.json is a symbolic link; refusing to write the run's files "
                           "through it (remove the link)"),
    (link_export_config, "error: {tmp}/exp/config.json is a symbolic link; refusing to write the export through it "
                         "(remove the link)"),
    (link_prepared_tokenizer, "error: {tmp}/prep/tokenizer.json is a symbolic link; refusing to write the prepared "
                              "data through it (remove the link)"),
    (optimizer_wrong_shape, "error: checkpoint {tmp}/out: the trainer state does not fit this model (optimizer "
                            "exp_avg has shape [3], its parameter [41, 32])"),
    (trainer_state_other_step, "error: checkpoint {tmp}/out: trainer state is at step 4 but checkpoint.json says 3"),
    (token_cache_object_dtype, "error: token stream {tmp}/prep/train-*.bin.json is corrupt: dtype '|O' is not "
                               "uint16/uint32"),
    (token_cache_bad_offsets, "error: token stream {tmp}/prep/train-*.bin.json is corrupt: a field of the wrong "
                              "type"),
    (compile_without_a_compiler, "error: train.compile=true: torch.compile cannot build kernels on cpu here "
                                 "(CppCompileError: C++ compile error); set train.compile=false, or install a working "
                                 "compiler"),
    (options_of_an_unused_mechanism, "warning: model.options.fwp is set but the model builds no fwp "
                                     "(model.mixer='attention', model.head='linear', model.memory='' at layers []): "
                                     "these options do nothing"),
    (fwl_test_time_step_without_test_time_only, "warning: model.options.fwl.test_time_step_size=5 does nothing "
                                                "without model.options.fwl.test_time_only = true (the learned step "
                                                "sizes are used)"),
    (resume_past_max_steps, "error: --resume: the run in {tmp}/out is at step 3, past train.max_steps=2; there is "
                            "nothing to train (raise train.max_steps to continue it)"),
    (corpus_dir_link_to_dev_zero, "error: corpus directory {tmp}/corpus: z.txt is not a regular file (a device, "
                                  "pipe or socket, or a link to one); remove it or move it out of the folder"),
    (corpus_dir_fifo, "error: corpus directory {tmp}/corpus: z.txt is not a regular file (a device, pipe or "
                      "socket, or a link to one); remove it or move it out of the folder"),
    (corpus_dir_broken_link, "error: corpus directory {tmp}/corpus: z.txt is a broken link; remove it or move it "
                             "out of the folder"),
    (options_nan, "error: model.options.fwl.step_size_init=nan: must be a finite number"),
    (lr_nan_no_warning_first, "error: train.lr=nan: must be a positive number"),
    (hf_dataset_offline, "error: corpus 'hf:nonexistent-org-39/no-such-dataset': Hugging Face dataset "
                         "'nonexistent-org-39/no-such-dataset' (config None, split 'train') is not in the local cache, "
                         "and huggingface.co cannot be reached (Name or service not known)"),
]


@pytest.mark.parametrize("setup,needle", [pytest.param(s, n, id=s.__name__) for s, n in CASES])
def test_replay(setup, needle, small_run, tmp_path, capsys, monkeypatch):
    c = Case(tmp_path, small_run)
    c.patch, c.deadline = monkeypatch, 120
    argv = setup(c)
    needle = needle.format(tmp=tmp_path)
    before = _tree(tmp_path)
    capsys.readouterr()
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rc = main(argv)
    seconds = time.monotonic() - t0
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err + cap.out, cap.err
    ours = [w for w in caught if f"{os.sep}fastweights{os.sep}" in w.filename]  # not torch's deprecations
    lines = [f"warning: {w.message}" for w in ours] + cap.err.strip().splitlines()
    after = _tree(tmp_path)
    if needle.startswith("error:"):
        assert rc == 2, (rc, cap.err)
        assert len(lines) == 1 and line_matches(needle, lines[0]), lines
        assert after == before, "a refused command changed files: " + str(
            sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k)))
        assert seconds < c.deadline, f"{seconds:.0f} s"
    else:
        assert rc == 0, cap.err
        assert len(lines) == 1 and line_matches(needle, lines[0]), lines
        outside = {k: v for k, v in after.items() if not k.startswith("out")}
        assert outside == {k: v for k, v in before.items() if not k.startswith("out")}
    assert _tree(c.victim) == {"victim.json": hashlib.sha256(b'{"precious": true}\n').hexdigest()}


def test_the_advice_for_missing_gradient_statistics_names_real_flags():
    """Item 7: ``dynamic eval --hf DIR`` with an RMS rule and no statistics said ``dynamic stats ... --out FILE``; the
    flag is ``--save``. Every flag the advice names must parse for ``dynamic stats``."""
    import re

    from fastweights.adapt.setup import DynamicSettings, _grad_stats
    from fastweights.cli import build_parser
    from fastweights.core.errors import UserError

    with pytest.raises(UserError) as e:
        _grad_stats(DynamicSettings(), None, None, None, None, "rms-global-prior", 5, 0, None, False)
    advice = re.search(r"`fastweights dynamic stats ([^`]*)`", str(e.value)).group(1)
    flags = re.findall(r"--[a-z-]+", advice)
    assert set(flags) >= {"--hf", "--data", "--save"}, advice
    argv = ["dynamic", "stats", *[x for f in flags for x in (f, "X")]]
    build_parser().parse_args(argv)  # argparse exits on a flag that does not exist
    assert "--stats FILE" in str(e.value)


def test_a_compiler_that_cannot_build_is_refused_with_the_way_out(monkeypatch):
    """The refusal of ``train.compile=true`` names the backend's first line and what to do (the replay above
    pins its start; this, the whole line), whatever the backend raises."""
    import torch

    from fastweights.core.errors import UserError
    from fastweights.loops.train import check_compile

    def broken(fn, **kw):
        raise RuntimeError("\n  fatal error: cannot build\nmore lines")

    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: lambda t: seen.append(t) or fn(t))  # a working backend
    check_compile("cpu")  # passes, having run the function on a tensor of the device
    assert len(seen) == 1 and seen[0].device.type == "cpu"
    monkeypatch.setattr(torch, "compile", broken)
    with pytest.raises(UserError) as e:
        check_compile("cpu")
    assert str(e.value) == ("train.compile=true: torch.compile cannot build kernels on cpu here (fatal error: cannot "
                            "build); set train.compile=false, or install a working compiler")
