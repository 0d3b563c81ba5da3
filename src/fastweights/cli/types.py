"""argparse types of the command line's numbers and lists: a bad value is one line naming the flag, exit 2 (the
rules themselves: :mod:`fastweights.core.numbers`)."""

from __future__ import annotations

import argparse

from fastweights.core import numbers
from fastweights.core.errors import UserError


def argparse_type(parse):
    """An argparse type of a parser of text (a :mod:`fastweights.core.numbers` rule, or one of the library's that
    raises ``UserError``): its message, as argparse prints it (``argument --x: must be >= 1, got 0``)."""
    def typed(text: str):
        try:
            return parse(text)
        except (numbers.BadNumber, UserError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    typed.__name__ = parse.__name__  # argparse names the type in its messages
    return typed


nonneg_int = argparse_type(numbers.nonneg_int)
positive_int = argparse_type(numbers.positive_int)
nonneg_float = argparse_type(numbers.nonneg_float)
positive_float = argparse_type(numbers.positive_float)
fraction = argparse_type(numbers.fraction)
seed = argparse_type(numbers.seed)


def ints(text: str, what: str) -> list[int]:
    """Positive integers separated by commas (``--lengths 1024,2048``)."""
    try:
        vals = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{what} must be integers separated by commas, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise UserError(f"{what} must be positive integers separated by commas, got {text!r}")
    return vals


def floats(text: str | None, what: str) -> list[float] | None:
    """Numbers separated by commas (``--lrs 1e-4,3e-4``); None when not given."""
    if not text:
        return None
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{what}: expected comma-separated numbers, got {text!r}") from None
    if not vals:
        raise UserError(f"{what}: empty list")
    return vals
