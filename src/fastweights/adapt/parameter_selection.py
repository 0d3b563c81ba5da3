"""What dynamic evaluation adapts: the parameters it selects, and the weights it holds fixed.

:func:`select_parameters` picks the adapted parameters by glob patterns on their names (a list, or one
flag's comma-separated string, which :func:`glob_patterns` splits) or by a callable; the evaluators,
the gradient statistics and ``--params`` / ``--exclude-params`` go through it. :func:`frozen_weights`
holds every weight of a model fixed (``eval()`` mode, no gradients) while an adaptation attached to it
(the sparse matrix of :mod:`fastweights.adapt.sparse`, the low-rank deltas of
:mod:`fastweights.adapt.lowrank`) is what is adapted.
"""

from __future__ import annotations

import contextlib
import fnmatch
from typing import Callable, Sequence

import torch
from torch import nn

from fastweights.core.errors import UserError


def select_parameters(model: torch.nn.Module, include: Sequence[str] | str | Callable | None = None,
                      exclude: Sequence[str] | str | None = None) -> dict[str, torch.nn.Parameter]:
    """The parameters dynamic evaluation adapts, by name.

    ``include``: None (every parameter), glob patterns on parameter names (a list, or one string
    with comma-separated patterns, e.g. ``"blocks.2.*,blocks.3.*"`` to adapt the top two blocks of
    a 4-block model), or a callable ``(name, parameter) -> bool``. ``exclude``: glob patterns removed
    afterwards (e.g. ``"embed.*"`` to freeze the embedding). Tied parameters appear once, under
    their first name. Raises UserError when nothing is selected.
    """
    inc = glob_patterns(include) if not callable(include) else None
    exc = glob_patterns(exclude) or []
    out = {}
    for name, p in model.named_parameters():
        if callable(include):
            keep = include(name, p)
        else:
            keep = inc is None or any(fnmatch.fnmatchcase(name, pat) for pat in inc)
        if keep and not any(fnmatch.fnmatchcase(name, pat) for pat in exc):
            out[name] = p
    if not out:
        raise UserError(f"the parameter filter (include {include!r}, exclude {exclude!r}) selects no parameters; "
                        f"names look like {next(iter(n for n, _ in model.named_parameters()), '?')!r}")
    return out


def glob_patterns(spec) -> list[str] | None:
    """The glob patterns of ``spec``: a list as it is, a string split at commas (blanks dropped); None when
    there are none."""
    if spec is None:
        return None
    if isinstance(spec, str):
        spec = [s for s in (x.strip() for x in spec.split(",")) if s]
        return spec or None
    return list(spec) or None


@contextlib.contextmanager
def frozen_weights(model: nn.Module):
    """Within the block, ``model`` in ``eval()`` mode with no gradients for any of its weights (an adaptation
    attached to it is what is adapted); its training mode and ``requires_grad`` flags are restored after."""
    was_training = model.training
    flags = [p.requires_grad for p in model.parameters()]
    model.eval()
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        yield
    finally:
        for p, f in zip(model.parameters(), flags):
            p.requires_grad_(f)
        model.train(was_training)
