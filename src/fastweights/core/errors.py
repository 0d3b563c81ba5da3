"""User-facing errors: the CLI prints their message on one line and exits with status 2."""


class UserError(Exception):
    """A problem with the user's input (path, corpus, preset, override, checkpoint).

    The command line turns it into one line on stderr and exit status 2, never a traceback.
    """
