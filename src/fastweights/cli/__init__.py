"""The command line, grouped by job (``fastweights --help``):

    make a model     train | prepare | data list | demo
    score and sample eval (--stream, --dynamic) | generate
    keep learning    dynamic eval|tune|stats|timescale|generate | continual
    experiments      task assoc|ba-retrieval|niah | inspect compare|addressing|gates
    share            export-hf

Every argparse module lives in this package and nothing outside it imports from it: each command parses
its flags, maps them to the library's settings once, and calls the library. Bad input (a missing path, an
unknown preset, a corrupt checkpoint) prints one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys

from fastweights.core.threads import prefer_passive_waiting

prefer_passive_waiting()  # before anything loads torch (and OpenMP with it): see fastweights.core.threads

from fastweights.core.errors import UserError  # noqa: E402

# (heading, commands) in the order `fastweights --help` lists them
JOBS = (("make a model", ("train", "prepare", "data", "demo")),
        ("score and sample", ("eval", "generate")),
        ("keep learning while reading", ("dynamic", "continual", "fwl-head")),
        ("experiments", ("task", "inspect")),
        ("share", ("export-hf",)))


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default, ``(default: VALUE)``, taken from the parser (so it cannot
    drift from the real one). Not for flags (no value) and required arguments, where a default means
    nothing, nor for an empty default (None, "", []): that help says in words what happens without the option
    (``tests/cli/test_help.py`` holds every command to this)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "%(default)" in text or action.default in (None, "", [], argparse.SUPPRESS) or action.required:
            return text
        if action.nargs == 0 or (not action.option_strings and action.nargs not in ("?", "*")):
            return text
        default = ",".join(map(str, action.default)) if isinstance(action.default, list) else "%(default)s"
        return f"{text} (default: {default})"


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)  # every command and subcommand shows its defaults
        super().__init__(*args, **kwargs)

    def error(self, message):  # one line, exit status 2 (argparse's default prints the usage too)
        raise UserError(f"{self.prog}: {message}")


def _command_list(sub) -> str:
    helps = {a.dest: a.help for a in sub._choices_actions}
    width = max(len(n) for n in helps) + 2
    out = []
    for heading, names in JOBS:
        out.append(f"{heading}:")
        out.extend(f"  {n:<{width}}{helps[n]}" for n in names)
    missing = set(helps) - {n for _, names in JOBS for n in names}
    assert not missing, f"commands without a heading in JOBS: {sorted(missing)}"
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    from fastweights.cli import continual, dynamic, eval as eval_, fwl_head, inspect, tasks, train

    p = _Parser(prog="fastweights", description="Language models whose weights change with the text they read.",
                formatter_class=HelpFormatter,
                epilog="`fastweights COMMAND --help` shows a command's options.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND",
                           title="commands")
    train.register(sub, _Parser)
    eval_.register(sub)
    dynamic.register(sub, _Parser)
    continual.register(sub)
    fwl_head.register(sub, _Parser)
    tasks.register(sub, _Parser)
    inspect.register(sub, _Parser)
    _add_unverified(sub)
    _describe(sub)
    listing = _command_list(sub)
    sub.help = "one of the commands above"
    sub._choices_actions.clear()  # listed once, by job, in the description
    p.description += "\n\n" + listing
    return p


def _describe(sub) -> None:
    """Every command and subcommand without a description of its own gets its one-line help as one, so that
    ``fastweights COMMAND --help`` says what the command does (``tests/cli/test_help.py``)."""
    helps = {a.dest: a.help for a in sub._choices_actions}
    for name, parser in sub.choices.items():
        nested = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if nested:
            _describe(nested[0])
        if not parser.description and helps.get(name):
            text = helps[name]
            parser.description = text[0].upper() + text[1:] + ("" if text.endswith(".") else ".")


def _add_unverified(sub) -> None:
    """``--unverified`` on every command (and subcommand) that reads a checkpoint directory."""
    for parser in sub.choices.values():
        nested = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if nested:
            _add_unverified(nested[0])
        elif any("--checkpoint" in a.option_strings for a in parser._actions):
            parser.add_argument("--unverified", action="store_true",
                                help="load a checkpoint directory that has no checkpoint.json (its files then "
                                     "cannot be checked against their recorded sizes and SHA-256)")


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"  # the command line shows what to change, not which file warned


def parse_command_line(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line; with ``--preset NAME`` (the dynamic commands) the shipped setting becomes the
    defaults of the command's flags and the line is parsed again, so that a flag given wins."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "dynamic_preset", None):
        args.apply_dynamic_preset(args.dynamic_preset)
        args = parser.parse_args(argv)
    return args


def main(argv: list[str] | None = None) -> int:
    import warnings

    warnings.formatwarning = _one_line_warning
    try:
        args = parse_command_line(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)  # what result files record as the command
        if getattr(args, "thread_work", None):  # every command that runs a model (train: train.threads, in train())
            from fastweights.core.threads import use_threads

            use_threads(args.thread_work, args.threads)
        from fastweights.ops.linear import linear_route

        linear_route()  # FASTWEIGHTS_LINEAR checked before anything is written
        from fastweights.models.loading import unverified_checkpoints

        with unverified_checkpoints(getattr(args, "unverified", False)):
            return int(args.func(args) or 0)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # a training run saves first (fastweights.loops.train.RunInterrupted says which step)
        print(str(e) or "interrupted", file=sys.stderr)
        return getattr(e, "exit_code", 130)
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
