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


def exit_status_of(main) -> int:
    """``main()``'s exit status, a :class:`UserError` raised anywhere in it (a bad argument, or a search of hours
    that found nothing to choose) printed as one line and 2: a script's ``sys.exit(exit_status_of(main))``."""
    import sys

    try:
        return main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
