"""The flags the benchmark scripts spell alike, defined once: ``--threads`` (its one default
:data:`fastweights.core.threads.BENCHMARK_THREADS`); the scripts' parser is :class:`fastweights.cli.script_parser.ScriptParser`
(argparse lives in ``cli/``), their dry run is ``--tiny`` and their output ``--out``."""

from __future__ import annotations

from fastweights.core.threads import BENCHMARK_THREADS


def benchmark_threads_flag(parser, note: str = "") -> None:
    """``--threads N`` of a benchmark script: torch CPU threads, default
    :data:`fastweights.core.threads.BENCHMARK_THREADS` (``note``: what the script adds to the help); the script
    sets it with ``use_threads("benchmark", args.threads)``."""
    parser.add_argument("--threads", type=int, default=BENCHMARK_THREADS,
                        help=f"torch CPU threads (default {BENCHMARK_THREADS}: a benchmark on one thread times this "
                             f"process's CPU seconds, unaffected by other jobs on a shared machine{note})")
