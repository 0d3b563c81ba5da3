"""The rules numbers given by a user must follow, in one place for the command line (``fastweights.cli.types``
wraps them as argparse types) and for every other front end that takes the same settings (the
lm-evaluation-harness models), so both say the same thing about the same bad value."""

from __future__ import annotations

import math
from typing import Callable


class BadNumber(Exception):
    """A value that breaks its rule; the message is what a user reads (``must be >= 0, got -5``)."""


def number_rule(kind: type, test: Callable, rule: str) -> Callable[[str], int | float]:
    """A parser of text into ``kind`` that raises :class:`BadNumber` unless ``test(value)`` holds."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise BadNumber(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
        if not test(v):
            raise BadNumber(f"must be {rule}, got {text}")
        return v

    parse.__name__ = kind.__name__
    return parse


nonneg_int = number_rule(int, lambda v: v >= 0, ">= 0")
positive_int = number_rule(int, lambda v: v >= 1, ">= 1")
nonneg_float = number_rule(float, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")
positive_float = number_rule(float, lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
fraction = number_rule(float, lambda v: math.isfinite(v) and 0 <= v <= 1, "in [0, 1]")
seed = number_rule(int, lambda v: 0 <= v < 2**63, "in [0, 2**63 - 1]")  # what torch.Generator.manual_seed takes
