"""Provenance rules for benchmarks/results/*.json, checked by ``report.py --check`` (issue 22).

A result fails the check when
  * it records no ``git.commit`` and is not in LEGACY (results written before results recorded
    their commit; each is listed with that reason and marked "legacy: no commit recorded" in the tables);
  * its command does not write exactly the stored file (``--name`` / ``--out`` naming another file,
    a temporary path, or no name where the script's default name is another file);
  * the code it measures changed after it was measured and it is not in KNOWN_STALE (listed with
    the reason it was not re-run; marked "stale" in the tables; a listed result passes whatever
    commit comes next, so the list must shrink by re-running, never grow silently). "Measured" is the recorded commit
    (stale when the last commit touching SOURCES is not its ancestor) or, for a legacy file, its
    ``date`` field (else the commit that added the file) against that commit's time.

SOURCES declares, per benchmark script (or CLI command), the library code whose behaviour the number
measures: the mechanism and operator files, not the trainer's plumbing (checkpointing, logging),
whose frequent changes do not move a measured value. The script itself always counts.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
S = "src/fastweights/"

SOURCES = {
    "benchmarks/assoc_capacity.py": [S + "tasks/assoc.py", S + "layers/fwp.py", S + "ops/delta_rule.py",
                                     S + "ops/feature_maps.py", S + "ops/linear_attention.py"],
    "benchmarks/ba_retrieval_seeds.py": [S + "tasks/ba_retrieval.py", S + "layers/fast_rnn.py", S + "layers/lstm.py"],
    "benchmarks/bench_delta_rule.py": [S + "ops/delta_rule.py"],
    "benchmarks/bench_dynamic_eval.py": [S + "adapt/dynamic.py", S + "adapt/sparse.py"],
    "benchmarks/bench_fast_rnn.py": [S + "layers/fast_rnn.py"],
    "benchmarks/fast_rnn_sweep.py": [S + "layers/fast_rnn.py", S + "ops/fast_rnn_kernel.py", S + "ops/fast_rnn_kernel.c",
                                     S + "models/lm.py", S + "experiments/streaming.py", "benchmarks/heldout_plays.py"],
    "benchmarks/bench_fast_rnn_vs_lstm.py": [S + "layers/fast_rnn.py", S + "layers/lstm.py", S + "models/lm.py",
                                             S + "ops/fast_rnn_kernel.py", S + "ops/fast_rnn_kernel.c"],
    "benchmarks/bench_fwl.py": [S + "layers/fwl.py", S + "ops/fwl.py", S + "ops/linear_attention.py"],
    "benchmarks/bench_fwpkm_layer.py": [S + "layers/fwpkm.py", S + "layers/fast_memory.py", S + "ops/pkm.py"],
    "benchmarks/bench_fwpkm_model.py": [S + "layers/fwpkm.py", S + "layers/fast_memory.py", S + "ops/pkm.py"],
    "benchmarks/cuda_check.py": ["tests/test_registry_causality.py", "tests/test_device_contract.py",
                                 S + "layers/attention.py", S + "layers/common.py", S + "layers/fwp.py",
                                 S + "layers/fast_rnn.py", S + "ops/fast_rnn_kernel.py", S + "layers/lstm.py",
                                 S + "layers/gdn.py", S + "layers/fwl.py", S + "ops/fwl.py", S + "layers/pkm.py",
                                 S + "ops/pkm.py", S + "layers/fwpkm.py", S + "layers/fast_memory.py",
                                 S + "layers/fwmlp.py", S + "ops/delta_rule.py", S + "ops/linear_attention.py",
                                 S + "ops/feature_maps.py", S + "models/lm.py"],
    "benchmarks/demo_record.py": [S + "demo.py"],
    "benchmarks/dynamic_eval_quality.py": [S + "adapt/dynamic.py", S + "adapt/cache.py"],
    "benchmarks/fwl_dynamic_reference.py": [S + "layers/fwl.py", S + "ops/fwl.py", S + "adapt/dynamic.py"],
    "benchmarks/fwl_ptb.py": [S + "layers/fwl.py", S + "ops/fwl.py"],
    "benchmarks/fwl_quality.py": [S + "layers/fwl.py", S + "ops/fwl.py"],
    "benchmarks/fwpkm_longdocs.py": [S + "layers/fwpkm.py", S + "layers/fast_memory.py", S + "ops/pkm.py"],
    "benchmarks/lm_presets.py": [S + "models/lm.py"],
    "benchmarks/niah_cpu.py": [S + "tasks/niah.py"],
    "benchmarks/niah_pilots.py": [S + "tasks/niah.py"],
    "benchmarks/niah_token.py": [S + "tasks/niah_token.py", S + "tasks/niah.py", S + "layers/fwpkm.py", S + "layers/fast_memory.py",
                                  S + "layers/fwmlp.py"],
    "benchmarks/prepare_memory.py": [S + "data/corpus.py"],
    "benchmarks/ptb_dynamic_eval.py": [S + "adapt/dynamic.py"],
    "benchmarks/smollm2_dynamic_eval.py": [S + "hf/transformers_as_ours.py", S + "hf/kv_context.py",
                                           S + "adapt/hf.py", S + "adapt/hf_context.py", S + "adapt/dynamic.py",
                                           S + "adapt/update_rules.py", S + "evaluate.py",
                                           S + "adapt/cache.py", S + "adapt/lowrank.py", S + "adapt/dynamic_cache.py",
                                           S + "adapt/sparse.py"],
    "benchmarks/fwp_streaming.py": [S + "layers/fwp.py", S + "ops/delta_rule.py", S + "ops/linear_attention.py",
                                    S + "experiments/streaming.py"],
    "benchmarks/stream_memory.py": [S + "layers/fwpkm.py", S + "layers/fast_memory.py", S + "ops/pkm.py"],
    "benchmarks/train_throughput.py": [S + "models/lm.py"],
    "benchmarks/mutation_check.py": ["tests/test_neural_cache.py", "tests/test_leaks.py", "tests/test_fwl.py",
                                     "tests/test_registry_causality.py", "tests/test_model.py", "tests/test_lstm.py",
                                     "tests/test_linear_attention.py", "tests/test_fwp_layer.py", "tests/test_fwpkm.py",
                                     "tests/test_fwmlp.py", "tests/test_dynamic_eval.py", "tests/test_fast_rnn.py",
                                     S + "adapt/dynamic.py", S + "layers/fast_rnn.py", S + "layers/gdn.py",
                                     S + "adapt/cache.py", S + "layers/fwl.py", S + "ops/fwl.py", S + "layers/attention.py",
                                     S + "layers/lstm.py", S + "ops/linear_attention.py", S + "layers/fwpkm.py", S + "layers/fast_memory.py",
                                     S + "layers/fwmlp.py"],
    "benchmarks/leaderboard.py": [S + "models/lm.py", S + "layers/common.py", S + "experiments/streaming.py",
                                  S + "layers/attention.py", S + "layers/fwp.py", S + "ops/delta_rule.py",
                                  S + "ops/linear_attention.py", S + "ops/feature_maps.py", S + "layers/gdn.py",
                                  S + "layers/fast_rnn.py", S + "ops/fast_rnn_kernel.py", S + "ops/fast_rnn_kernel.c",
                                  S + "layers/lstm.py", S + "layers/fwl.py", S + "ops/fwl.py",
                                  S + "layers/fwpkm.py", S + "layers/fast_memory.py", S + "ops/pkm.py",
                                  S + "layers/fwmlp.py", S + "adapt/dynamic.py", S + "adapt/update_rules.py",
                                  "benchmarks/heldout_plays.py"],
    "fastweights adapt-test": [S + "experiments/continual_adaptation.py", S + "memory_switches.py", S + "adapt/dynamic.py"],
    # the per-token comparison of two checkpoints (fwl_quality_1000's): the analysis and the heads it compares
    "fastweights analyze": [S + "analysis.py", S + "layers/fwl.py", S + "ops/fwl.py"],
}

# The file a script writes when its command names none (a command without --name / --out must match).
DEFAULT_STEM = {"benchmarks/fwl_quality.py": "fwl_quality", "benchmarks/bench_fwl.py": "bench_fwl",
                "benchmarks/fwpkm_longdocs.py": "fwpkm_longdocs", "benchmarks/lm_presets.py": "lm_presets",
                "benchmarks/niah_cpu.py": "niah_cpu", "benchmarks/fwl_ptb.py": "fwl_ptb",
                "benchmarks/ba_retrieval_seeds.py": "ba_retrieval_seeds"}

# Results without a commit, listed by name with why (a new result without one fails the check). Empty since
# every result written before results recorded their commit (issue 22) was re-run or retired.
LEGACY: dict[str, str] = {}

# Results whose measured code changed after the run and that were not re-run, with the reason. They stay
# listed until re-run (a listed result that is current fails the check: take it off the list); the
# tables mark a result "stale: code changed after it" whenever it is, listed or not.
KNOWN_STALE: dict[str, str] = {}
# Commits that changed a measured file without changing what it computes for the listed results, each with the
# test that shows it (a test holding the measured code's outputs to values stored before the commit). A result
# is stale when a commit that is NOT listed here for it changed its sources after its recorded commit.
_GOLDEN = ("tests/test_memory_golden.py: FwPKM and FwMLP outputs and gradients (fp64, two calls, state carried) for "
           "every option set these results use are bit-identical at the measured commits (0affc54 for niah_token, "
           "8f6caa1 for stream_memory) and after the commit")


def _board(why: str, test: str = "tests/test_leaderboard.py") -> dict:
    """A declaration for leaderboard.json alone."""
    return {"results": ["leaderboard"], "test": test, "why": why}


BEHAVIOUR_PRESERVING: dict[str, dict] = {
    "e7cac8d5f5c049f41619e0dc26aa821bcdc5970c": {"results": ["niah_token"], "test": "tests/test_memory_golden.py",
                 "why": "fwmlp.py turns autocast off through ops.no_autocast instead of torch.autocast(device type): "
                        "the same context on CPU. " + _GOLDEN},
    "04260d43efec75b0e42b55f1a1e0ee0358182c41": {"results": ["niah_token"], "test": "tests/test_memory_golden.py",
                 "why": "fwmlp.py imports register_memory from fastweights.components (the same function). " + _GOLDEN},
    "c4cef273fa8a7b8ee1d8d27f2d30c49c88eb3613": {"results": ["niah_token", "stream_memory"],
                                                 "test": "tests/test_memory_golden.py",
                 "why": "fwpkm.py split into fast_memory.py / fwpkm_reference.py (code moved, not changed), the "
                        "registry import and no_autocast (same objects on CPU), and persistence='official' returning "
                        "a copy of the value table (neither result uses 'official'). " + _GOLDEN},
    "1337a8d1662917e7a6bb7c6b950a5c00a070aea5": {"results": ["smollm2_dynamic_eval", "smollm2_dynamic_eval_context"], "test": "tests/test_dynamic_hf.py",
                 "why": "adapt/hf.py and adapt/hf_context.py renamed to hf/transformers_as_ours.py and hf/kv_context.py "
                        "with identical content (issue 20's renames, staged, went into this issue 22 commit); b4d5b9e "
                        "restored the old import paths"},
    "b4d5b9ee3a79362232ac0bbb291cf51c8a7e10da": {"results": ["smollm2_dynamic_eval", "smollm2_dynamic_eval_context"], "test": "tests/test_dynamic_hf.py",
                 "why": "completes the move into fastweights/hf/: adapt/hf.py and adapt/hf_context.py re-export the "
                        "same objects, docstrings and imports name the new modules; no code changed (test_dynamic_hf.py "
                        "and test_hf_context.py pass, test_hf_model.py checks the old names are the same objects)"},
    "dfe5e157e58d058d13e23e40fe373e3f6499edd3": {"results": ["niah_token", "stream_memory", "mutation_check", "leaderboard"],
                                                 "test": "tests/test_memory_golden.py",
                 "why": "FwPKM's and FwMLP's shared options declared once in fast_memory.FastMemoryOptions (same names "
                        "and defaults) and their slow references' read/write order shared (reference_schedule); the "
                        "lines mutation_check mutates are untouched. " + _GOLDEN},
    "98a0b8e5a8df6d8fc2666f2fb0d18b1676cd0489": {"results": ["demo", "fwp_streaming", "mutation_check", "niah_token", "prepare_memory",
                                                             "stream_memory", "smollm2_dynamic_eval",
                                                             "smollm2_dynamic_eval_context"],
                                                 "test": "tests/test_provenance.py",
                 "why": "the scripts drop sys.path.insert (python puts the script's folder on sys.path) and common.py's "
                        "provenance functions move into fastweights.provenance unchanged; nothing a script computes "
                        "or records changed (test_provenance.py imports every script as python does)"},
    "b181dfc53c1d74f09a64521fb2505e845b7e59cb": {"results": ["mutation_check", "leaderboard"], "test": "tests/test_fast_rnn.py",
                 "why": "fast_rnn.py gains a compiled kernel beside its unchanged torch path; the line mutation_check "
                        "mutates there (fold_history's return) is untouched and still caught by test_fast_rnn.py"},
    # leaderboard.json: rows from three commits (5be43e5: attention, dynamic-eval; 2dbb551: fwp-delta,
    # fwp-gated-delta, fwl; 4541e4f: fast-rnn, lstm; source_commits in the JSON). These commits touch only
    # its script's bookkeeping, or modes and files the earlier rows do not use.
    "1a9ff6243d5edf0066368fc38c2937a20e9b664d": _board("leaderboard.py gains markdown_table and drops sys.path.insert: training and scoring unchanged"),
    "3aa58940f248cd00275bd7b4e932ddd474b39edc": _board("leaderboard.py records source_commits and declares ENTRY_SOURCES: training and scoring unchanged"),
    "d02622a7f35bed9cbdcbe49f9f50a877d09e0657": _board("the table's 'incomplete' line only"),
    "2e769f6e633b4668e078679ad634f532cfd367a0": _board("the table header computes the parameter range; child() drops an unused field"),
    "4541e4fe9826a256d9d62d857f6f8268e0bd9d8e": _board("a new entry (fwp-delta-elu) in ENTRIES: the other entries' training and scoring unchanged"),
    "a08e9e6d6a6369c714f12a45a953bf982d163f36": {"results": ["fwp_streaming", "leaderboard"], "test": "tests/test_longctx.py",
                 "why": "stream-eval gains a 'windows' mode; the modes fwp_streaming uses (carry, memory) run the "
                        "same code as before (test_longctx holds memory mode to fresh per-segment scoring); the "
                        "leaderboard rows scored before it in 'memory' mode (attention, dynamic-eval) have no memory "
                        "or head state, where 'windows' and 'memory' are the same (test_longctx)"},
    "6e5853d0be297ceea2ea8b0c0ea70f66fb38dd47": {"results": ["mutation_check", "bench_fast_rnn_vs_lstm", "leaderboard"],
                                                 "test": "tests/test_fast_rnn.py",
                 "why": "the fast-RNN kernel's C source, loader and autograd function move out of layers/fast_rnn.py "
                        "into ops/fast_rnn_kernel.{c,py} unchanged: the compiled source text is identical (the same "
                        ".so cache key); test_fast_rnn.py holds both backends to the fp64 reference"},
    "59639b05b5aac9a8a502efa7e31888e10fe98f70": {"results": ["leaderboard", "mutation_check"],
                                                 "test": "tests/test_leaderboard.py",
                 "why": "adds tests (test_fast_rnn, test_stream_stability, test_leaderboard) and moves the held-out play "
                        "list and reader from leaderboard.py into benchmarks/heldout_plays.py unchanged; leaderboard.py "
                        "now keeps committed rows, marks known streaming limits and lists ln-rnn (no row yet) instead of "
                        "fwp-delta-elu (never measured): no measured row's training or scoring changes. The fast-rnn "
                        "preset's eta changed (a config, re-run as its own row)"},
    "b1873d9b8f86e0932f847da7d86fb5d51d0341ad": {"results": ["leaderboard", "mutation_check", "bench_fast_rnn_vs_lstm",
                                                             "cuda_check"],
                                                 "test": "tests/test_fast_rnn.py",
                 "why": "fast_rnn_kernel._decay_weights sets weights below the smallest normal float to 0: at lambda 0.95 "
                        "(every fast-RNN these results ran) no weight of a read of at most 286 states gets near it "
                        "(0.95^285 * 0.5 ~ 2e-7), so the weights and every output are bit-identical "
                        "(test_decay_weights_below_the_normal_range_are_zero checks the kept weights are exact)"},
    "ab8b70ed7e9ca62cb7800380b238c3471905b68e": _board("leaderboard.py's provenance record ignores benchmarks/results/ among a row's dirty paths: no row's "
                        "training or scoring changes"),
    "2be6661f3f0f4830d58bd95f5a2a731663ef2034": _board("leaderboard.py's JSON gains by_entry, a copy of the table's means keyed by entry: no row's "
                        "training or scoring changes"),
    "61c2b744bf91e1671c85b031185c32fb82f0d18d": _board("leaderboard.py renames the measured per_sequence FwMLP entry fwmlp-per-sequence (same preset and "
                        "overrides) and defines a new fwmlp entry (its own row): no measured row's training or scoring changes"),
    "1c822e03d1e190bc4a176471d7bc20da236b2fa8": _board("leaderboard.py loses markdown_table (moved to report.py, presentation only): no row's training "
                        "or scoring changes"),
    "755ed997c5eb2bc74c281d607c4fc6d01da7844b": _board("train.py gains train.carry_reset (default 0: drops_carried_state is then never true) and "
                        "leaderboard.py two entries (fwl-carry, fwl-carry-reset; their own rows): no measured row "
                        "trains with carry_state, so none changes",
                 test="tests/test_carry_state.py"),
    "e95542869caa168edb2cf884ae494fd4dc73746c": _board("ENTRY_SOURCES of the two carry entries only (no row yet): no row's training or scoring changes"),
    "58171eda79de1d579ee937e4c935aab639122d8e": _board("a new entry (fwl-lanes) in ENTRIES and ENTRY_SOURCES: the other entries' training and scoring unchanged"),
    "42e39d002e96eb7072de9ae4b21f6845ededc326": _board("which entries the seeds rule asks seeds of (ABLATIONS left out): no row's training or scoring changes"),
    "7fc83a44a1c2a45ec391a52da04711d2c706b3b7": {"results": ["cuda_check"], "test": "tests/test_device_contract.py",
                 "why": "cuda_check.train_steps replaced by the identical tests/test_device_contract.train, which now "
                        "moves the layer and inputs to a given device and autocasts by its type: the same steps"},
    "70bad0a7131a0d1961d94eb6e059c57a92358544": {"results": ["leaderboard", "mutation_check", "bench_fast_rnn_vs_lstm"],
                                                 "test": "tests/test_lstm.py",
                 "why": "lstm.py runs nn.LSTM in training mode for a forward that needs gradients off the CPU (cuDNN "
                        "refuses the backward of an eval-mode RNN); on the CPU, where these results ran, the call is the "
                        "same as before (test_lstm.py checks a CPU call keeps eval mode); the line mutation_check "
                        "mutates there is unchanged"},
    "eb1108e00cd750c7e33252940dafe73eead4a54f": {"results": ["assoc_capacity"], "test": "tests/test_assoc.py",
                 "why": "tasks/assoc.py: only the CLI's --out file changed (it records the provenance and is written "
                        "atomically); the training and evaluation assoc_capacity.py calls are untouched"},
    "c35d62e5e9aa61afc3528aae3c563d51ef2a0481": _board("leaderboard.py names the FWL, fast-weights RNN and FwMLP source lists once; the same "
                   "lists, nothing a row trains or scores changed"),
    "bde15df70de95213ceb5ee035c8ff605e9733eff": {"results": ["assoc_capacity", "fwl_analysis/analysis"],
                 "test": "tests/test_analysis.py",
                 "why": "analysis.py and tasks/assoc.py write their --out file through provenance.write_cli_result, the "
                        "same record written the same way; nothing they compute changed (test_analysis holds the "
                        "analysis to fresh scoring, test_assoc the written file to the printed results)"},
}

# Results whose recorded command does not write the stored file as it stands (kept, reason given).
COMMAND_MISMATCH: dict[str, str] = {}


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout.strip()


def script_of(command: str) -> str | None:
    """The benchmark script (or CLI command) a recorded command ran."""
    m = re.search(r"benchmarks/[\w.]+\.py", command)
    if m:
        return m.group(0)
    m = re.match(r"\S*fastweights (\S+)", command)
    return f"fastweights {m.group(1)}" if m else None


def command_problem(stem: str, command: str) -> str | None:
    """Why ``command`` would not write benchmarks/results/<stem>.json, or None."""
    if "/tmp" in command or ".tmp" in command:
        return "the command names a temporary path"
    words = command.split()
    named = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "--name"]
    named += [w.split("=", 1)[1] for w in words if w.startswith("--name=")]
    if named:
        return None if named[-1].strip("'\"") == stem else f"--name {named[-1]} writes another file"
    # --out names the JSON itself, or for a `fastweights` command the prefix of PREFIX.json (a benchmark
    # script's other --out is its run folder)
    cli = (script_of(command) or "").startswith("fastweights ")
    outs = [words[i + 1].strip("'\"") for i, w in enumerate(words[:-1])
            if w == "--out" and (cli or words[i + 1].strip("'\"").endswith(".json"))]
    if outs:
        written = (Path(outs[-1]) if outs[-1].endswith(".json") else
                   Path(outs[-1]) / "analysis.json" if script_of(command) == "fastweights analyze" else  # --out DIR
                   Path(outs[-1] + ".json"))
        wanted = f"benchmarks/results/{stem}.json"
        return None if written.as_posix() == wanted else f"--out {outs[-1]} writes {written.as_posix()}, not {wanted}"
    script = script_of(command)
    if script in DEFAULT_STEM and DEFAULT_STEM[script] != stem:
        return f"without --name, {script} writes {DEFAULT_STEM[script]}.json"
    return None


def last_source_commit(paths: list[str], skip=()) -> tuple[str, int] | None:
    """The newest commit that changed ``paths``, leaving out the commits in ``skip``, and its time."""
    for line in git("log", "--format=%H %ct", "--", *paths).splitlines():
        sha, ct = line.split()
        if sha not in skip:
            return sha, int(ct)
    return None


def measured_time(path: Path, rec: dict) -> int:
    """When a legacy result was measured: its ``date`` field (local time) or the commit that added it."""
    date = rec.get("date")
    if isinstance(date, str):
        try:
            return int(time.mktime(time.strptime(date[:19], "%Y-%m-%d %H:%M:%S")))
        except ValueError:
            pass
    if not path.resolve().is_relative_to(ROOT):
        return int(time.time())  # not in the repository (a test's file): measured now
    added = git("log", "--diff-filter=A", "--format=%ct", "--", str(path.resolve().relative_to(ROOT))).split()
    return int(added[-1]) if added else int(time.time())


def result_key(path: Path, results: Path = RESULTS) -> str:
    """A result's name: its path under ``results`` without ``.json`` (``fwl_quality``, ``fwl_analysis/analysis``)."""
    try:
        return path.resolve().relative_to(results.resolve()).with_suffix("").as_posix()
    except ValueError:
        return path.stem


def staleness(path: Path, rec: dict, key: str | None = None) -> str | None:
    """Why the result ``key`` (default: the file's name) is older than the code it measures, or None."""
    key = key or result_key(path)
    script = script_of(str(rec.get("command", "")))
    if script is None or script not in SOURCES:
        return f"no SOURCES entry for its command ({script or 'unrecognised'})"
    paths = SOURCES[script] + ([script] if script.startswith("benchmarks/") else [])
    # commits declared to leave this result valid do not count, for a legacy result (by date) as for one
    # with a recorded commit
    kept = {c for c, entry in BEHAVIOUR_PRESERVING.items() if key in entry.get("results", ())}
    last = last_source_commit(paths, skip=kept)
    if last is None:
        return None
    sha, ct = last
    commit = rec.get("tested_commit") or (rec.get("git") or {}).get("commit")  # the code a copy was made of
    rerun = f"; re-run: {rec.get('command')}"
    if commit:
        # a result assembled from runs at several commits (leaderboard.json) records, per source path, the
        # commit of the run that measured it (``source_commits``); the other paths count from ``commit``
        by_commit: dict[str, list[str]] = {}
        for p in paths:
            by_commit.setdefault((rec.get("source_commits") or {}).get(p, commit), []).append(p)
        for since, group in by_commit.items():
            later = subprocess.run(["git", "-C", str(ROOT), "rev-list", f"{since}..HEAD", "--", *group],
                                   capture_output=True, text=True)
            if later.returncode != 0:  # the recorded commit is not in this history
                return f"its recorded commit {since[:8]} is not in this repository's history{rerun}"
            changed = [c for c in later.stdout.split() if c not in kept]
            if changed:
                return f"{changed[0][:8]} changed {', '.join(group)} after the recorded commit {since[:8]}{rerun}"
        dirty = [p for p in (rec.get("git") or {}).get("dirty_paths") or []
                 if any(p == s or p.startswith(s.rstrip("/") + "/") for s in paths)]
        if dirty and not rec.get("tested_commit"):
            return f"it measured uncommitted changes to {', '.join(dirty)}, not commit {commit[:8]}{rerun}"
        return None
    if ct > measured_time(path, rec):
        return f"{sha[:8]} ({time.strftime('%Y-%m-%d %H:%M', time.localtime(ct))}) changed the measured code after it"
    return None


def status(path: Path) -> str:
    """The provenance mark a table shows for a result: '' (commit recorded, current) or a short note."""
    rec = json.loads(path.read_text())
    notes = []
    if not (rec.get("git") or {}).get("commit"):
        notes.append("legacy: no commit recorded")
    if staleness(path, rec):
        notes.append("stale: code changed after it")
    return "; ".join(notes)


def problems(results: Path = RESULTS) -> list[str]:
    """Every provenance rule broken by a result file in ``results`` (empty when all pass)."""
    out = []
    # a result is a JSON file in ``results`` or one folder down (fastweights analyze writes DIR/analysis.json)
    for path in sorted(results.glob("*.json")) + sorted(results.glob("*/*.json")):
        rec = json.loads(path.read_text())
        key = result_key(path, results)
        name = f"{key}.json"
        command = str(rec.get("command") or "")
        if not command:
            out.append(f"{name}: no command recorded")
        if not (rec.get("git") or {}).get("commit") and key not in LEGACY:
            out.append(f"{name}: no git commit recorded (and not a listed legacy result)")
        why = command_problem(key, command)
        if why and key not in COMMAND_MISMATCH:
            out.append(f"{name}: {why}")
        why = staleness(path, rec, key)
        if why and key not in KNOWN_STALE:
            out.append(f"{name}: older than the code it measures: {why}")
        if not why and key in KNOWN_STALE and results == RESULTS:
            out.append(f"{name}: listed in KNOWN_STALE but measured the current code: take it off the list")
    return out
