"""Mutation check (issue 22): put plausible bugs into a copy of the code, one at a time, and show the
default test suite catches every one.

For each mutation: ``git archive HEAD`` into a temporary directory, apply the mutation there (the
working tree is never touched), run the named default-suite test files with that copy's ``src`` first
on PYTHONPATH (the subprocess checks it imports the mutated copy), and record which tests failed.
A control run first runs the union of the test files on the unmutated copy: they must pass, so a
failure under a mutation is the mutation's doing. Only the listed test files run per mutation (not
the whole suite), which keeps the check to a few CPU minutes; the JSON names them.

    python tools/mutation_check.py                 # writes benchmarks/results/mutation_check.json
    python tools/mutation_check.py --only fwl_default_mask_inclusive

A bar (``--bar FILE``): a JSON list of ``{"file", "original", "mutant", "tests": [node ids], "what"}``, each a
one-line bug an audit found the suite missed and the tests written for it (``tests/mutants/issue49_bar.json``).
Each is applied alone to a copy of HEAD as above, its named tests run, and the bar holds when every named test
fails on its mutant (a parametrized test's node id counts when any of its cases fails) after all of them passed
on the unmutated copy. It prints one line per mutant and exits 1 on a survivor; it writes no result file. Not
part of the default suite (it runs the named tests once per mutant); ``tests/mutants/test_bars.py`` checks only
that each bar can still be applied (its original line once in its file, its tests present).

    python tools/mutation_check.py --bar tests/mutants/issue49_bar.json
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fastweights.evidence.result_files import REPO, write_result
from fastweights.cli.script_parser import ScriptParser, exit_status_of

S = "src/fastweights/"
LEAK, REG = "tests/contracts/test_leaks.py", "tests/contracts/test_registry_causality.py"
MISSED = "tests/cli/test_missed_mutations.py"

# the chunk loops' write, as lines (then a mutation can add a re-read after it)
_PKM_WRITE = "\n".join(["                if not self.frozen and st.n_read == C:", "                    st = self._write(st)", ""])
_MLP_WRITE = "\n".join(["                    if st.n_read == C:", "                        st = self._write(st)", ""])

# name, file, [(old, new), ...], test files, what the bug is
MUTATIONS = [
    ("cache_update_before_score", S + "adapt/cache.py",
     [("                mem_h = torch.cat([mem_h, h])[-self.window :]\n"
       "                mem_y = torch.cat([mem_y, y])[-self.window :]\n", ""),
      ("                p = cache_mix(p_model,",
       "                mem_h = torch.cat([mem_h, h])[-self.window :]\n"
       "                mem_y = torch.cat([mem_y, y])[-self.window :]\n"
       "                p = cache_mix(p_model,")],
     ["tests/layers/test_neural_cache.py", LEAK], "neural cache memory updated with the segment before it is scored"),
    ("cache_mask_inclusive", S + "adapt/cache.py", [("valid = (k < q)", "valid = (k <= q)")],
     ["tests/layers/test_neural_cache.py", LEAK], "a cache query sees its own (hidden, next token) pair"),
    ("fwl_default_mask_inclusive", S + "ops/fwl.py",
     [("(idx[None, :] < idx[:, None])", "(idx[None, :] <= idx[:, None])")],
     ["tests/layers/test_fwl.py", LEAK, REG], "FWL one-block path: the strict mask made inclusive"),
    ("fwl_chunked_mask_inclusive", S + "ops/fwl.py",
     [("k_shift = F.pad(k[:, :-1], (0, 0, 1, 0))", "k_shift = k"),
      ("v_shift = F.pad(v[:, :-1], (0, 0, 1, 0))", "v_shift = v")],
     ["tests/layers/test_fwl.py", LEAK, REG], "FWL chunked path: keys and values not shifted (inclusive)"),
    ("dynamic_eval_update_before_score", S + "adapt/dynamic.py",
     [("                # 1. score: record the segment's losses before any update has seen its tokens\n"
       "                scored = tok_nll.detach()\n",
       "                self.update_rule.apply(deltas, torch.autograd.grad(tok_nll.mean(), leaves, allow_unused=True))\n"
       "                scored = token_nll(forward(x, model_state)[0], y).detach()\n")],
     ["tests/adapt/test_dynamic_eval.py"], "dynamic evaluation scores a segment after an update on that segment"),
    ("fast_rnn_carried_matrix_dropped", S + "ops/fast_rnn.py",
     [("return folded if A is None else folded + (lam**n) * A", "return folded")],
     ["tests/layers/test_fast_rnn.py", REG], "fast-weights RNN: the carried fast matrix A is dropped when the history is folded"),
    ("gdn_conv_cache_not_carried", S + "layers/gdn.py",
     [('causal_conv1d_silu(qkv, self.conv_weight, state["conv"], attention_mask)',
       "causal_conv1d_silu(qkv, self.conv_weight, None, attention_mask)")],
     ["tests/layers/test_fwp_layer.py", REG], "Gated DeltaNet: the short convolution restarts at every call"),
    ("fwl_fast_update_wrong_sign", S + "ops/fwl.py",
     [('z = z - matrix_term("U"', 'z = z + matrix_term("U"')],
     ["tests/layers/test_fwl.py"], "FWL: the first layer's fast update added instead of subtracted"),
    ("attention_sees_next_token", S + "layers/attention.py", [("allowed = kpos <= qpos", "allowed = kpos <= qpos + 1")],
     ["tests/layers/test_model.py", REG], "attention's explicit mask lets a query see the next key"),
    ("attention_window_off_by_one", S + "layers/attention.py",
     [("allowed &= kpos > qpos - self.window", "allowed &= kpos >= qpos - self.window")],
     ["tests/layers/test_model.py", REG], "sliding window keeps one key too many"),
    ("attention_position_not_carried", S + "layers/attention.py", [('"pos": pos + T,', '"pos": T,')],
     ["tests/layers/test_model.py", REG], "the KV-cache state does not carry the absolute position (RoPE restarts)"),
    ("lstm_cell_not_carried", S + "layers/lstm.py",
     [("LSTMState(h.squeeze(0), c.squeeze(0))", "LSTMState(h.squeeze(0), 0 * c.squeeze(0))")],
     ["tests/layers/test_lstm.py", REG], "the LSTM state drops its cell"),
    ("linear_attention_mask_one_ahead", S + "ops/linear_attention.py",
     [(".tril(-1 if strict else 0)", ".tril(-1 if strict else 1)")],
     ["tests/ops/test_linear_attention.py", "tests/layers/test_fwp_layer.py", REG], "chunked linear attention reads one step ahead"),
    ("fwpkm_update_wrong_sign", S + "layers/fwpkm.py",
     [("-o.lr * scale * grad", "o.lr * scale * grad")], ["tests/layers/test_fwpkm.py"], "FwPKM value update climbs the loss"),
    ("fwpkm_target_ignores_lookahead", S + "layers/fwpkm.py",
     [("target = st.pending_v[:, L: L + n_pairs]", "target = st.pending_v[:, :n_pairs]")],
     ["tests/layers/test_fwpkm.py"], "FwPKM writes the token's own value, not the one L ahead"),
    ("fwpkm_write_count_not_carried", S + "layers/fwpkm.py",
     [("n_stale=carry, reads=None, n_read=0, writes=st.writes + 1,", "n_stale=carry, reads=None, n_read=0, writes=1,")],
     ["tests/layers/test_fwpkm.py"], "FwPKM state: the write counter restarts at every write"),
    ("fwpkm_read_after_own_write", S + "layers/fwpkm.py",
     [(_PKM_WRITE, _PKM_WRITE + "                    outs[-1] = self._read(qc, st).v_hat\n")],
     ["tests/layers/test_fwpkm.py", LEAK], "FwPKM: a chunk's outputs re-read after the write of that chunk (update before score)"),
    ("fwmlp_read_after_own_write", S + "layers/fwmlp.py",
     [(_MLP_WRITE, _MLP_WRITE + "                        outs[-1] = swiglu_forward(st.weights, q[:, sl]).y\n")],
     ["tests/layers/test_fwmlp.py", LEAK], "FwMLP: a chunk's outputs recomputed after the write of that chunk (update before score)"),
    ("fwmlp_update_wrong_sign", S + "layers/fwmlp.py",
     [("weights = {k: st.weights[k] - o.lr * grads[k]", "weights = {k: st.weights[k] + o.lr * grads[k]")],
     ["tests/layers/test_fwmlp.py"], "FwMLP fast update climbs the loss"),
    # issue 32: five bugs an independent audit found the suite missed, and grad_accum's validation
    ("stream_carry_drops_dynamic_state", S + "experiments/streaming.py",
     [('state if mode == "carry" else None,', "None,")],
     [MISSED], "stream_eval carry mode starts each document's dynamic evaluation afresh (None, not the carried state)"),
    ("memory_only_state_drops_fwl_head", S + "models/memory_switches.py",
     [('return {"layers": layers, "head": state.get("head")}', 'return {"layers": layers, "head": None}')],
     [MISSED], "memory_only_state drops the FWL head's fast weights (memory mode equals windows)"),
    ("fast_rnn_eps_ignored", S + "layers/fast_rnn.py",
     [("common = dict(ln_weight=ln_w, ln_bias=ln_b, eps=self.eps)", "common = dict(ln_weight=ln_w, ln_bias=ln_b, eps=1e-5)")],
     [MISSED], "FastWeightRNN(eps=...) ignored: the LayerNorm epsilon is always 1e-5"),
    ("resume_torch_rng_not_restored", S + "loops/train.py",
     [('    torch.set_rng_state(s["torch"])\n', "")],
     [MISSED], "resume leaves torch's global RNG unrestored (dropout masks differ from the straight run)"),
    ("dynamic_context_equal_to_segment", S + "adapt/dynamic.py",
     [("if context is not None and context <= segment_len:", "if context is not None and context < segment_len:")],
     [MISSED], "DynamicEvaluator accepts context == segment_len, which its guard means to refuse"),
    ("grad_accum_not_validated", S + "checkpoints/config_checks.py",
     [('("seq_len", "batch_size", "grad_accum", "max_steps", "log_every", "eval_tokens")',
       '("seq_len", "batch_size", "max_steps", "log_every", "eval_tokens")')],
     [MISSED], "train.grad_accum=0 accepted (a ZeroDivisionError later instead of one line)"),
]


def copy_commit(dest: Path, commit: str) -> None:
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


def run_tests(root: Path, files: list[str], timeout: float, maxfail: int = 0) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "OMP_NUM_THREADS": "1"}
    where = subprocess.run([sys.executable, "-c", "import fastweights; print(fastweights.__file__)"],
                           cwd=root, env=env, capture_output=True, text=True).stdout.strip()
    assert where.startswith(str(root)), f"the copy is not the code imported: {where}"
    # pyproject's addopts already give -q (a second -q would drop the "N passed" line)
    cmd = [sys.executable, "-m", "pytest", "-rf", "-p", "no:cacheprovider", *files]
    if maxfail:
        cmd.insert(-len(files), f"--maxfail={maxfail}")
    start = time.process_time()
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        out, rc = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
    failed = sorted(set(re.findall(r"^FAILED (.+?)(?: - .*)?$", out, re.M)))  # node ids may hold spaces
    return {"returncode": rc, "failed_tests": failed, "wall_seconds": round(time.perf_counter() - t0, 1),
            "children_cpu_seconds": round(time.process_time() - start + _children_cpu(), 1),
            "summary": next((line.strip("= ") for line in reversed(out.splitlines())
                             if re.search(r"\d+ (passed|failed|error)", line)), out.strip()[-200:])}


_last_children = [0.0]


def _children_cpu() -> float:
    t = os.times()
    now = t.children_user + t.children_system
    delta, _last_children[0] = now - _last_children[0], now
    return delta


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py)."""
    sites: dict[str, list[str]] = {}
    for _, path, edits, _, _ in MUTATIONS:
        sites.setdefault(path, []).extend(old for old, _ in edits)
    return [probes.probe("source", path=path, texts=texts) for path, texts in sorted(sites.items())]



def load_bar(path: Path) -> list[dict]:
    """The mutants of a bar file (module docstring), checked for the fields each needs."""
    bar = json.loads(Path(path).read_text())
    if not isinstance(bar, list) or not bar:
        raise SystemExit(f"{path}: not a non-empty JSON list of mutants")
    for i, m in enumerate(bar):
        if not (isinstance(m, dict) and all(isinstance(m.get(k), str) for k in ("file", "original", "mutant"))
                and isinstance(m.get("tests"), list) and m["tests"] and all(isinstance(x, str) for x in m["tests"])
                and m["original"] != m["mutant"]):
            raise SystemExit(f"{path}: mutant {i} needs file, original and mutant (strings that differ) and tests "
                             "(node ids)")
    return bar


def _failed(node: str, failed: list[str]) -> bool:
    """Whether the test ``node`` failed: its node id among ``failed``, or one of its parametrized cases."""
    return any(f == node or f.startswith(node + "[") for f in failed)


def run_bar(path: Path, timeout: float) -> int:
    """Apply each mutant of the bar at ``path`` alone to a copy of HEAD and run its named tests: 0 when every
    named test passes on the unmutated copy and fails on its mutant, else 1."""
    bar = load_bar(path)
    nodes = sorted({n for m in bar for n in m["tests"]})
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    survivors = 0
    with tempfile.TemporaryDirectory(prefix="fw-bar-") as tmp:
        control = Path(tmp) / "control"
        control.mkdir()
        copy_commit(control, head)
        ctl = run_tests(control, nodes, timeout)
        print(f"control (unmutated {head[:10]}, {len(nodes)} tests): rc={ctl['returncode']} {ctl['summary']}",
              flush=True)
        if ctl["returncode"] != 0:
            print("the unmutated copy fails the bar's tests: no mutant can be judged", file=sys.stderr)
            return 1
        for i, m in enumerate(bar):
            root = Path(tmp) / f"m{i}"
            root.mkdir()
            copy_commit(root, head)
            target = root / m["file"]
            text = target.read_text()
            if text.count(m["original"]) != 1:
                raise SystemExit(f"mutant {i}: {m['original']!r} occurs {text.count(m['original'])} times in "
                                 f"{m['file']}, not once: update {path}")
            target.write_text(text.replace(m["original"], m["mutant"]))
            res = run_tests(root, m["tests"], timeout)
            missed = [n for n in m["tests"] if not _failed(n, res["failed_tests"])]
            caught = res["returncode"] != 0 and not missed
            survivors += not caught
            print(f"{'caught  ' if caught else 'SURVIVED'} {m['file']}: {m['original'].strip()!r} -> "
                  f"{m['mutant'].strip()!r}" + (f" (passed: {', '.join(missed)})" if missed else ""), flush=True)
            shutil.rmtree(root)
    print(f"{len(bar) - survivors} of {len(bar)} mutants caught by their named tests", flush=True)
    return 1 if survivors else 0


def main() -> int:
    ap = ScriptParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="mutation names (default: all)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per test run")
    ap.add_argument("--name", default="mutation_check", help="result file stem")
    ap.add_argument("--bar", type=Path, help="a bar file of mutants and the tests that must catch them (docstring)")
    a = ap.parse_args()
    if a.bar is not None:
        return run_bar(a.bar, a.timeout)
    chosen = [m for m in MUTATIONS if not a.only or m[0] in a.only]
    files = sorted({f for m in chosen for f in m[3]})
    results = []
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()  # one commit for every copy, whatever is committed meanwhile
    with tempfile.TemporaryDirectory(prefix="fw-mutation-") as tmp:
        control = Path(tmp) / "control"
        control.mkdir()
        copy_commit(control, head)
        _children_cpu()
        ctl = run_tests(control, files, a.timeout)
        print(f"control (unmutated, {len(files)} files): rc={ctl['returncode']} {ctl['summary']}", flush=True)
        if ctl["returncode"] != 0:
            print("the unmutated copy fails its tests: no mutation can be judged", file=sys.stderr)
        for name, path, edits, tests, what in chosen:
            root = Path(tmp) / name
            root.mkdir()
            copy_commit(root, head)
            target = root / path
            text = target.read_text()
            for old, new in edits:
                if text.count(old) != 1:
                    raise SystemExit(f"{name}: {old!r} occurs {text.count(old)} times in {path}, not once")
                text = text.replace(old, new)
            target.write_text(text)
            # each test file on its own and to the end, so the JSON lists every test that catches it
            by_file = {f: run_tests(root, [f], a.timeout) for f in tests}
            for res in by_file.values():
                res["caught"] = res["returncode"] != 0 and bool(res["failed_tests"])
            caught = any(res["caught"] for res in by_file.values())
            catchers = [f for f, res in by_file.items() if res["caught"]]
            print(f"{name}: {'caught by ' + ', '.join(catchers) if caught else 'NOT CAUGHT'}", flush=True)
            results.append({"mutation": name, "file": path, "what": what,
                            "edits": [{"old": o, "new": n} for o, n in edits], "test_files_run": tests,
                            "caught": caught, "caught_by_files": catchers,
                            "failed_tests": [t for res in by_file.values() for t in res["failed_tests"]],
                            "children_cpu_seconds": round(sum(r["children_cpu_seconds"] for r in by_file.values()), 1),
                            "by_file": by_file})
    n_caught = sum(r["caught"] for r in results)
    write_result(a.name, {
        "tested_commit": head,  # the copies are git archive of it: uncommitted changes (git.dirty_paths) are not in them
        "what": "plausible bugs put into a copy of the code one at a time; the default-suite test files named "
                "per mutation run against the copy (its src first on PYTHONPATH), each file on its own and to the end: "
                "failed_tests lists every test that catches the mutation",
        "control": {"test_files_run": files, **ctl, "passed": ctl["returncode"] == 0},
        "mutations": results,
        "headline": [{"what": "mutation check: plausible bugs caught by the default test suite",
                      "value": f"{n_caught} of {len(results)}", "target": "all"}],
        "all_caught": n_caught == len(results) and ctl["returncode"] == 0,
    })
    return 0 if n_caught == len(results) and ctl["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
