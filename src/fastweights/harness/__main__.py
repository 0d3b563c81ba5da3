"""``python -m fastweights.harness [lm-eval arguments]``: lm-eval's command line with the fastweights models
registered and the local tasks on the include path.

    python -m fastweights.harness --model fastweights --model_args checkpoint=runs/demo \\
        --tasks fastweights_heldout_plays
    python -m fastweights.harness --model fastweights-dynamic --model_args checkpoint=runs/demo \\
        --tasks fastweights_heldout_plays     # lr and decay: the checkpoint's tuned file, else the defaults
    python -m fastweights.harness ls tasks        # any lm-eval subcommand

``--include_path`` is added (the package's ``harness/tasks``) unless given. When every task of ``--tasks`` is one of
those, lm-eval's own task folder is not indexed (reading its 14,000 YAML files took 10 of a run's 15 seconds here).
The device of the fastweights models is
``auto`` (CUDA where there is one, else the CPU) unless ``--device`` (or ``device`` in ``--config``'s file or in
``--model_args``) names one: lm-eval's own default, ``cuda:0``, is not used for them.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

from fastweights.core.errors import UserError


def main(argv: list[str] | None = None) -> int:
    from fastweights.harness import TASKS, register

    args = list(sys.argv[1:] if argv is None else argv)
    try:
        register()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args and args[0] not in ("-h", "--help") and not any(a == "--include_path" or a.startswith("--include_path=")
                                                             for a in args):
        args += ["--include_path", str(TASKS)]
    from lm_eval.__main__ import cli_evaluate

    _device_auto_unless_given()
    sys.argv = ["lm-eval", *args]
    try:
        with _only_local_tasks_when_they_suffice(args, TASKS):
            cli_evaluate()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ValueError, KeyError, FileNotFoundError) as e:
        if not _raised_by_lm_eval(e):
            raise
        # lm-eval's own refusals of its arguments (an unknown task or model, a bad option): one line, not a traceback
        text = str(e.args[0] if isinstance(e, KeyError) and e.args else e).strip()
        print(f"error: {text.splitlines()[0] if text else type(e).__name__}", file=sys.stderr)
        return 2
    return 0


def _device_auto_unless_given() -> None:
    """lm-eval's command line passes its default device (``cuda:0``) to every model whenever ``--device`` is not
    given, which would override the fastweights models' ``auto`` and fail on a machine without CUDA. For our models
    the device lm-eval passes becomes ``auto`` unless the user named one (``--device``, ``device:`` in ``--config``'s
    file); a device in ``--model_args`` is used as given (and naming it twice is refused in one line)."""
    from lm_eval.config.evaluate_config import EvaluatorConfig

    from fastweights.harness import MODEL_NAMES

    original = EvaluatorConfig.__dict__.get("from_cli")
    if not isinstance(original, classmethod) or getattr(original.__func__, "_fastweights", False):
        return

    def from_cli(cls, namespace):
        cfg = original.__func__(cls, namespace)
        if cfg.model not in MODEL_NAMES:
            return cfg
        given = getattr(namespace, "device", None)
        if not given and getattr(namespace, "config", None):
            given = (cls.load_yaml_config(namespace.config) or {}).get("device")
        in_model_args = isinstance(cfg.model_args, dict) and cfg.model_args.get("device") is not None
        if given and in_model_args:
            raise UserError(f"the device is given twice: --device {given} and model argument "
                            f"device={cfg.model_args['device']}; give one")
        cfg.device = given or (None if in_model_args else "auto")
        return cfg

    from_cli._fastweights = True
    EvaluatorConfig.from_cli = classmethod(from_cli)


@contextmanager
def _only_local_tasks_when_they_suffice(args: list[str], folder: Path):
    """Within: lm-eval's task manager skips lm-eval's built-in tasks when ``--tasks`` names only tasks of ``folder``
    (the include path's own YAML files), as the documented commands do; any other name (lm-eval's, a file, a
    misspelling that lm-eval should report) keeps the full index."""
    import lm_eval.tasks

    requested = _option(args, "--tasks")
    ours = {p.stem for p in folder.glob("*.yaml")}
    if not requested or not set(requested.split(",")) <= ours or _option(args, "--include_path") != str(folder):
        yield
        return
    full = lm_eval.tasks.TaskManager

    class LocalTaskManager(full):
        def __init__(self, *a, **kw):
            super().__init__(*a, **{**kw, "include_defaults": False})

    lm_eval.tasks.TaskManager = LocalTaskManager
    try:
        yield
    finally:
        lm_eval.tasks.TaskManager = full


def _option(args: list[str], flag: str) -> str | None:
    """The value of ``flag`` in an lm-eval argument list (``--flag value`` or ``--flag=value``), else None."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a[len(flag) + 1:]
    return None


def _raised_by_lm_eval(e: BaseException) -> bool:
    """Whether ``e`` was raised inside the ``lm_eval`` package (its checks of the command line), not in ours."""
    import traceback

    import lm_eval

    frames = traceback.extract_tb(e.__traceback__)
    root = Path(lm_eval.__file__).resolve().parent
    return bool(frames) and Path(frames[-1].filename).resolve().is_relative_to(root)


if __name__ == "__main__":
    sys.exit(main())
