"""Torch CPU threads for the commands that run a model: wall time of `eval` (and the harness's static
scoring, the same `score_tokens`), `generate`, `dynamic eval` (and the harness's dynamic model, the same
evaluator), a training step of the demo-sized model (the shakespeare-char preset: d_model 128, 4 layers, char
vocabulary) and one of a fast-weight preset (shakespeare-char-fwp-delta-dpfp), with 1 and 2 threads, on one
core and on two (``os.sched_setaffinity``), as the machine is and with a busy-loop process keeping one core
busy (pinned to the last core, the one every setting uses); the load average is recorded, so a run on an idle
machine and one on a shared machine can be told apart. For each workload and condition the JSON also holds
the thread count the command's default gives there (``fastweights.core.threads``: one for scoring, the idle
cores at start for training) and its time over the best of 1 and 2 threads.

    python benchmarks/speed/threads.py [--eval-chars 3000] [--generate-tokens 60] [--repeat 3]

Writes benchmarks/results/threads.json; the defaults of ``--threads`` and ``train.threads`` (``fastweights.core.threads``)
is chosen from it. Each number is the median wall time of ``--repeat`` runs of the same work, the settings
interleaved round by round so that load from other jobs on a shared machine hits them alike (the load
average is recorded).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from fastweights.core.threads import prefer_passive_waiting

prefer_passive_waiting()  # as the fastweights command does, before torch loads OpenMP

import torch  # noqa: E402

from fastweights.evidence.result_files import write_result  # noqa: E402
from fastweights.cli.script_parser import ScriptParser, exit_status_of  # noqa: E402
from fastweights.evidence.timing import call_seconds, upper_median  # noqa: E402

from fastweights.adapt.dynamic import DynamicEvaluator  # noqa: E402
from fastweights.core.config import make_config  # noqa: E402
from fastweights.core.threads import SCORING_THREADS, training_threads, use_threads  # noqa: E402
from fastweights.loops.evaluate import SCORING_SEGMENT_LEN, score_tokens  # noqa: E402
from fastweights.loops.generate import generate_tokens  # noqa: E402
from fastweights.models.lm import LanguageModel  # noqa: E402

PRESET = "shakespeare-char"
FAST_WEIGHT_PRESET = "shakespeare-char-fwp-delta-dpfp"
VOCAB = 65  # tinyshakespeare's characters
TRAINING = ("train_step", "train_step_fwp")  # the workloads whose default is training_threads()


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py)."""
    return (probes.preset_probes(PRESET) + probes.preset_probes(FAST_WEIGHT_PRESET)
            + [probes.probe("dynamic", config=probes.preset_model_config(PRESET), rule="sgd")])


def _busy(cpu: int) -> subprocess.Popen:
    """A process spinning on core ``cpu`` (what another job on a shared machine does), until this one ends."""
    code = f"import os; os.sched_setaffinity(0, {{{cpu}}}); parent = os.getppid()\nwhile os.getppid() == parent: pass"
    return subprocess.Popen([sys.executable, "-c", code])


def _workloads(model, cfg, eval_chars: int, generate_tokens_n: int):
    seq_len = cfg.train.seq_len
    gen = torch.Generator().manual_seed(0)
    text = torch.randint(0, VOCAB, (eval_chars,), generator=gen)
    batch = torch.randint(0, VOCAB, (cfg.train.batch_size, seq_len + 1), generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def run_eval():  # what `fastweights eval` does: windows of seq_len, half of each scored
        model.eval()
        score_tokens(model, text, seq_len)

    def run_generate():  # what `fastweights generate` does: one token per call, the state carried
        model.eval()
        for _ in generate_tokens(model, [1, 2, 3], generate_tokens_n, temperature=0.8, seed=0, context=seq_len):
            pass

    def step(m, o):
        m.train()
        loss = m(batch[:, :-1], targets=batch[:, 1:]).loss
        o.zero_grad(set_to_none=True)
        loss.backward()
        o.step()

    torch.manual_seed(0)
    fw_model = LanguageModel(make_config(FAST_WEIGHT_PRESET, [f"model.vocab_size={VOCAB}"]).model)
    fw_opt = torch.optim.AdamW(fw_model.parameters(), lr=1e-4)
    dyn_text = text[: max(2, eval_chars // 3)]

    def run_dynamic_eval():  # what `fastweights dynamic eval` does: score a segment, then update on it
        model.eval()
        DynamicEvaluator(model, rule="sgd", lr=1e-5, segment_len=SCORING_SEGMENT_LEN, context=seq_len).evaluate(dyn_text)

    return {"eval": run_eval, "generate": run_generate, "dynamic_eval": run_dynamic_eval,
            "train_step": lambda: step(model, opt), "train_step_fwp": lambda: step(fw_model, fw_opt)}


def main():
    ap = ScriptParser()
    ap.add_argument("--eval-chars", type=int, default=3000, help="characters `eval` scores")
    ap.add_argument("--generate-tokens", type=int, default=60, help="tokens `generate` samples")
    ap.add_argument("--repeat", type=int, default=3, help="rounds (median)")
    a = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("needs a machine with at least 2 cores (the 1-core setting is one of them)")
    last = cpus[-1]
    cfg = make_config(PRESET, [f"model.vocab_size={VOCAB}"])
    torch.manual_seed(0)
    model = LanguageModel(cfg.model)
    work = _workloads(model, cfg, a.eval_chars, a.generate_tokens)
    conditions = [(cores, load) for cores in (1, 2) for load in ("", "_plus_busy_loop")]
    times = {f"{cores}core{load}": {w: {1: [], 2: []} for w in work} for cores, load in conditions}
    loads = {k: [] for k in times}
    defaults = {k: [] for k in times}
    for name, fn in work.items():  # warm up (allocator, kernels) outside the timed runs
        use_threads("benchmark", 1)
        fn()
    for r in range(a.repeat):
        for cores, load in conditions:
            key = f"{cores}core{load}"
            os.sched_setaffinity(0, {last} if cores == 1 else set(cpus[-2:]))
            busy = _busy(last) if load else None
            try:
                time.sleep(0.5 if busy else 0.0)
                loads[key].append(os.getloadavg()[0])
                defaults[key].append(training_threads())  # what `train` would take here now
                for name, fn in work.items():
                    for threads in (1, 2):
                        use_threads("benchmark", threads)
                        times[key][name][threads].append(call_seconds(fn)[0])
                        print(f"round {r + 1}/{a.repeat} {key} {name} {threads} thread(s): "
                              f"{times[key][name][threads][-1]:.2f} s", flush=True)
            finally:
                if busy is not None:
                    busy.kill()
                    busy.wait()
    os.sched_setaffinity(0, set(cpus))
    seconds = {k: {w: {f"{t}_thread": upper_median(v) for t, v in d.items()} for w, d in per.items()} for k, per in times.items()}
    ratio = {k: {w: d["2_thread"] / d["1_thread"] for w, d in per.items()} for k, per in seconds.items()}
    chosen = {k: {w: (upper_median(defaults[k]) if w in TRAINING else SCORING_THREADS) for w in work} for k in seconds}
    default_over_best = {k: {w: seconds[k][w][f"{chosen[k][w]}_thread"] / min(seconds[k][w].values()) for w in work}
                         for k in seconds}
    res = {"config": vars(a) | {"preset": PRESET, "parameters": sum(p.numel() for p in model.parameters()),
                                "machine_cores": len(cpus)},
           "what": "median wall seconds per workload; 1core: the process pinned to one core, 2core: to two; "
                   "plus_busy_loop: a busy-loop process pinned to one of those cores, on top of whatever else the "
                   "machine runs (its 1-minute load average per round is recorded: 'idle' only when that is low)",
           "seconds": seconds, "ratio_2_threads_over_1": ratio, "seconds_all": {
               k: {w: {f"{t}_thread": v for t, v in d.items()} for w, d in per.items()} for k, per in times.items()},
           "load_average_1m_per_round": loads, "default_threads": chosen, "default_over_best": default_over_best,
           "worst_default_over_best": max(v for per in default_over_best.values() for v in per.values())}
    load = sum(v for per in loads.values() for v in per) / sum(len(per) for per in loads.values())
    res["headline"] = [
        {"what": f"{w}: wall time with 2 threads / with 1 ({k.replace('core', '-core', 1).replace('_', ' ')}, "
                 f"demo-sized model, mean load average {load:.1f} on {len(cpus)} cores)",
         "value": round(ratio[k][w], 2)} for k in ("2core", "2core_plus_busy_loop") for w in work]
    res["headline"].append({"what": "every command's default thread count: its wall time over the best of 1 and 2 "
                                    "threads, worst workload and condition", "value": round(res["worst_default_over_best"], 2),
                            "unit": "x", "target": "<= 1.5"})
    print(res["seconds"])
    write_result("threads", res)


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
