"""argparse types of the command line's numbers and lists: a bad value is one line naming the flag, exit 2."""

from __future__ import annotations

import argparse
import math

from fastweights.core.errors import UserError


def _number(kind, test, rule: str):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}")
        if not test(v):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return v

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


nonneg_int = _number(int, lambda v: v >= 0, ">= 0")
positive_int = _number(int, lambda v: v >= 1, ">= 1")
nonneg_float = _number(float, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")
positive_float = _number(float, lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
fraction = _number(float, lambda v: math.isfinite(v) and 0 <= v <= 1, "in [0, 1]")
seed = _number(int, lambda v: 0 <= v < 2**63, "in [0, 2**63 - 1]")  # what torch.Generator.manual_seed takes


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
