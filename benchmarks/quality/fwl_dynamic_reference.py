"""The FWL model next to dynamic evaluation of its base model, on the same held-out text (issue 4).

    python benchmarks/quality/fwl_dynamic_reference.py --base runs/fwl_quality_1000/base --fwl runs/fwl_quality_1000/fwl \
        --name fwl_quality_1000_dynamic

Both checkpoints come from ``benchmarks/quality/fwl_quality.py`` (same backbone and steps; ``--base`` with a linear
head, ``--fwl`` with the FWL head). On the base checkpoint's test split (all of it):

- both models streamed as ``fastweights eval`` does (context ``seq_len``, stride ``seq_len // 2``, state
  carried): the FWL's fast weights adapt to the text, the base model's weights do not;
- the base model with dynamic evaluation (Krause et al. 2018, rms-global-prior): MS_g from its training
  split, lr and decay searched on the first ``--tune-chars`` characters of its validation split (never the
  test text), then static and dynamic scoring of the test split under dynamic evaluation's own protocol
  (segments of 20 characters).

Writes benchmarks/results/NAME.json.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


from fastweights.evidence.result_files import write_result
from fastweights.cli.script_parser import ScriptParser, exit_status_of
from fastweights.core.threads import use_threads
from fastweights.evidence.script_args import benchmark_threads_flag

from fastweights.adapt.evaluate import demo_dynamic
from fastweights.adapt.setup import load_texts
from fastweights.models.loading import load_checkpoint, read_run_config
from fastweights.loops.evaluate import evaluate_documents


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py)."""
    base = probes.preset_model_config("shakespeare-char")
    return (probes.model_probes(base) + probes.preset_probes("shakespeare-char-fwl")
            + [probes.probe("dynamic", config=base, rule="rms-global-prior")])



def main() -> int:
    ap = ScriptParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="checkpoint with the linear head")
    ap.add_argument("--fwl", required=True, help="checkpoint with the FWL head (same backbone)")
    ap.add_argument("--tune-chars", type=int, default=5000, help="validation characters for the lr/decay search")
    benchmark_threads_flag(ap)
    ap.add_argument("--name", default="fwl_dynamic_reference")
    a = ap.parse_args()
    use_threads("benchmark", a.threads)
    for path in (a.base, a.fwl):
        if not (Path(path) / "config.json").is_file():
            print(f"error: {path} is not a checkpoint directory (no config.json)", file=sys.stderr)
            return 2
    base_cfg = read_run_config(Path(a.base))
    texts = load_texts(None, base_cfg, "test")
    corpus = Path(str(base_cfg.data.corpus)).name

    stream = {}
    for label, path in (("base", a.base), ("fwl", a.fwl)):
        model, tok, cfg = load_checkpoint(Path(path))
        model.eval()
        t = time.process_time()
        res = evaluate_documents(model, tok, texts, cfg.train.seq_len, progress=False)
        stream[label] = {"bits_per_char": res.metrics(tok.name)["bits_per_char"], "chars": res.chars,
                         "cpu_seconds": round(time.process_time() - t, 1)}
        print(label, "stream", round(stream[label]["bits_per_char"], 4), flush=True)

    t = time.process_time()
    dyn = demo_dynamic(a.base, tune_chars=a.tune_chars, test_chars=0, verbose=True)
    dyn_cpu = round(time.process_time() - t, 1)
    static_bits, dynamic_bits = dyn["static"]["bits_per_char"], dyn["dynamic"]["bits_per_char"]
    headline = [
        {"what": f"{corpus} test split (all of it), streamed with state carried: base (linear head)",
         "value": round(stream["base"]["bits_per_char"], 4), "unit": "bits/char"},
        {"what": "  same: base + FWL head (same backbone and steps)", "value": round(stream["fwl"]["bits_per_char"], 4),
         "unit": "bits/char", "target": "< base"},
        {"what": "  same text: base model, static -> dynamic evaluation (rms-global-prior, tuned on validation)",
         "value": f"{static_bits:.4f} -> {dynamic_bits:.4f}", "unit": "bits/char"},
    ]
    write_result(a.name, {
        "what": "FWL model vs its base model with dynamic evaluation, same held-out text",
        "checkpoints": {"base": a.base, "fwl": a.fwl},
        "headline": headline,
        "stream": stream,
        "dynamic_eval_of_base": {k: dyn[k] for k in ("static", "dynamic", "relative_improvement", "settings")}
        | {"search": dyn["search"], "cpu_seconds": dyn_cpu},
    })
    return 0


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
