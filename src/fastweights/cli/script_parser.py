"""The benchmark scripts' parser (``benchmarks/``; they are not commands, but every argparse class lives in this
package): a bad argument raises ``UserError`` with argparse's message, which the script prints as one line before
it exits 2, never argparse's usage block."""

from __future__ import annotations

import argparse

from fastweights.core.errors import UserError


class ScriptParser(argparse.ArgumentParser):
    """argparse for a benchmark script: a bad argument raises :class:`UserError` with argparse's message."""

    def error(self, message):
        raise UserError(message)
