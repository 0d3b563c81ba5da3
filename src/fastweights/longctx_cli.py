"""Old import path of the long-context commands, kept working: ``from fastweights.longctx_cli import NAME``.

The commands ``niah``, ``stream-eval``, ``adapt-test`` and ``fwpkm-gates`` live in
:mod:`fastweights.experiments.cli` (registered from there by ``fastweights.cli``); this module
re-exports its public names: ``register_cli``, ``run_stream_eval`` (behind ``stream-eval`` and
``fastweights eval --stream``; its ``args`` attributes are listed in that module's docstring),
``cmd_niah``, ``cmd_adapt_test``, ``cmd_gates``.
"""

from __future__ import annotations

from fastweights.experiments.cli import cmd_adapt_test, cmd_gates, cmd_niah, register_cli, run_stream_eval

__all__ = ["cmd_adapt_test", "cmd_gates", "cmd_niah", "register_cli", "run_stream_eval"]
