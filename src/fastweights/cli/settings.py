"""Command-line flags generated from a workflow's settings dataclass (the pattern of transformers'
``HfArgumentParser``), so that each setting's default and help are written once, in the dataclass.

- :func:`add_settings` adds one ``--flag`` per field to an argparse parser: the flag is ``--`` + ``prefix`` + the
  field's name with ``-`` for ``_`` (``max_steps`` -> ``--max-steps``; with ``prefix="cache-"``, ``window`` ->
  ``--cache-window``, dest ``cache_window``); its default is the field's, its help ``metadata["help"]``, its
  choices ``metadata["choices"]`` and its metavar ``metadata["metavar"]`` when the field declares them. The value's type is the annotation's (``int``,
  ``float``, ``str``; ``X | None`` as ``X``) unless ``metadata["type"]`` names a parser of the text (a rule of
  :mod:`fastweights.core.numbers` such as ``positive_int``, or a parser of the library's own), whose complaint
  (``BadNumber`` or ``UserError``) becomes argparse's one line naming the flag. A bool that defaults to False is a
  plain flag (``--digit-head``); one that defaults to True is ``--layer-norm/--no-layer-norm``.
- :func:`settings_from` builds the dataclass back from the parsed arguments (fields without a flag keep their
  default).

A field without help, or without a plain default, is a programming error (TypeError) when the parser is built:
every option explains itself and shows its default (``tests/cli/test_help.py``).

    @dataclass
    class Config:
        steps: int = field(default=100, metadata={"help": "training steps", "type": numbers.positive_int})

    add_settings(parser, Config)            # --steps N (default: 100)
    cfg = settings_from(parser.parse_args(), Config)
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from fastweights.cli.types import argparse_type


def _value_type(annotation):
    """``int`` of ``int``, ``int | None`` and ``Optional[int]``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(kinds) == 1:
            return kinds[0]
    return annotation


def setting_fields(cls, exclude=()) -> list[dataclasses.Field]:
    """The fields of ``cls`` that :func:`add_settings` makes flags of (``exclude``: names left out)."""
    unknown = set(exclude) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {sorted(unknown)}")
    return [f for f in dataclasses.fields(cls) if f.init and f.name not in exclude]


def flag_dest(field: dataclasses.Field, prefix: str = "") -> str:
    """The argparse dest of ``field``'s flag (``cache_window`` for ``window`` with ``prefix="cache-"``)."""
    return prefix.replace("-", "_") + field.name


def add_settings(parser, cls, prefix: str = "", exclude=()) -> None:
    """Add one ``--flag`` per field of the dataclass ``cls`` to ``parser`` (a parser or an argument group)."""
    hints = typing.get_type_hints(cls)
    for f in setting_fields(cls, exclude):
        if not f.metadata.get("help"):
            raise TypeError(f"{cls.__name__}.{f.name}: a setting needs its help, field(metadata={{'help': ...}})")
        if f.default is dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{f.name}: a setting on the command line needs a plain default")
        kind = _value_type(hints[f.name])
        kw = {"dest": flag_dest(f, prefix), "default": f.default, "help": f.metadata["help"]}
        if kind is bool and f.default:  # --x/--no-x; it takes no value, so cli.HelpFormatter would not show it
            kw.update(action=argparse.BooleanOptionalAction, help=kw["help"] + " (default: %(default)s)")
        elif kind is bool:
            kw["action"] = "store_true"
        else:
            kw["type"] = argparse_type(f.metadata["type"]) if "type" in f.metadata else kind
            if "choices" in f.metadata:
                kw["choices"] = tuple(f.metadata["choices"])
            if "metavar" in f.metadata:
                kw["metavar"] = f.metadata["metavar"]
        parser.add_argument("--" + prefix + f.name.replace("_", "-"), **kw)


def settings_from(args: argparse.Namespace, cls, prefix: str = "", exclude=(), **given):
    """The dataclass ``cls`` of the parsed ``args`` (the flags :func:`add_settings` added with the same
    ``prefix`` and ``exclude``); ``given`` sets fields the flags do not."""
    values = {f.name: getattr(args, flag_dest(f, prefix)) for f in setting_fields(cls, exclude)
              if hasattr(args, flag_dest(f, prefix))}
    return cls(**{**values, **given})
