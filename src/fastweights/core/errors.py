"""User-facing errors: the CLI prints their message on one line and exits with status 2."""


class UserError(Exception):
    """A problem with the user's input (path, corpus, preset, override, checkpoint).

    The command line turns it into one line on stderr and exit status 2, never a traceback.
    """


def exit_status(main) -> int:
    """``main()``'s exit status, a :class:`UserError` from it printed as one line on stderr with status 2 (a
    script's ``sys.exit(exit_status(main))``)."""
    import sys

    try:
        return main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


_SCORE_WORDS = ("loss", "perplexity", "bits", "nll")


def non_finite_score(obj, where: str = "") -> tuple[str, float] | None:
    """The first loss / perplexity / bits value in a result (nested dicts, lists of dicts) that is NaN or
    infinite, as ``(dotted.key, value)``; None when every one is finite. Lists of numbers count under such a key
    (``nll`` per stage) and are skipped under others (curves)."""
    import math

    if isinstance(obj, dict):
        for k, v in obj.items():
            key = f"{where}.{k}" if where else str(k)
            if any(w in str(k) for w in _SCORE_WORDS):
                bad = next((x for x in _numbers(v) if not math.isfinite(x)), None)
                if bad is not None:
                    return key, bad
            found = non_finite_score(v, key) if isinstance(v, (dict, list)) else None
            if found:
                return found
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            found = non_finite_score(v, f"{where}[{i}]") if isinstance(v, dict) else None
            if found:
                return found
    return None


def _numbers(v):
    """The floats of a number or of nested lists of numbers."""
    if isinstance(v, float):
        yield v
    elif isinstance(v, list):
        for x in v:
            yield from _numbers(x)


def refuse_non_finite(result, cause: str) -> None:
    """UserError (one line) naming the first non-finite score of ``result`` and ``cause``; nothing when all are finite."""
    found = non_finite_score(result)
    if found:
        raise UserError(f"{found[0]} is {found[1]}, not a number to report: {cause}")


WORSE_THAN_UNIFORM = 2.0  # a mean loss this many times a uniform guess's: a broken model for the text, not a result


def refuse_worse_than_uniform(loss_nats: float, vocab_size: int | None, what: str) -> None:
    """UserError (one line) when a mean loss (nats per token) exceeds :data:`WORSE_THAN_UNIFORM` times a uniform
    guess's, log(vocabulary): issue 52's FWL heads reported 77-205 nats/token with exit 0 where uniform is 5.5."""
    import math

    if not vocab_size or vocab_size < 2:
        return
    uniform = math.log(vocab_size)
    if loss_nats > WORSE_THAN_UNIFORM * uniform:
        raise UserError(f"{what}: {loss_nats:.4g} nats/token is {loss_nats / uniform:.1f}x a uniform guess over the "
                        f"{vocab_size:,}-token vocabulary ({uniform:.2f} nats): not a result; the model is broken or "
                        "diverges on this text")
