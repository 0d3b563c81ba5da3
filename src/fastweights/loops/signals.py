"""How a training run meets SIGINT and SIGTERM.

Before the loop (:class:`SetupSignals`): either signal stops the run at once, and ``train`` removes what it
created (encoding a corpus can take minutes). In the loop (:class:`StopSignals`): the first signal lets the
current step finish, then the run saves and exits (130 for SIGINT, 143 for SIGTERM); a second one stops at
once. Under ``torchrun`` every rank stops on the signal rank 0 received (:func:`agreed_signal`).
"""

from __future__ import annotations

from fastweights.core.distributed import from_rank0


def agreed_signal(stop: "StopSignals", dist, device):
    """The stopping signal rank 0 received (SIGINT or SIGTERM), on every rank; None if none."""
    import signal

    is_int, is_term = from_rank0([stop.signum == signal.SIGINT, stop.signum == signal.SIGTERM], dist, device)
    return signal.SIGINT if is_int else signal.SIGTERM if is_term else None


class Terminated(KeyboardInterrupt):
    """SIGTERM before the training loop (:class:`SetupSignals`)."""

    exit_code = 128 + 15


class SetupSignals:
    """Until the training loop installs :class:`StopSignals`: SIGINT raises KeyboardInterrupt and SIGTERM
    :class:`Terminated`, so that a run stopped while it prepares (encoding a corpus can take minutes) cleans
    up, whatever handler the process had (a host that replaced Python's SIGINT handler, e.g. a notebook or a
    test runner's worker, would otherwise swallow Ctrl-C until training starts)."""

    def __init__(self):
        import signal
        import threading

        self.old = {}
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                old = signal.signal(s, self._handle)
                self.old[s] = signal.SIG_DFL if old is None else old  # None: a handler not installed from Python

    @staticmethod
    def _handle(signum, frame):
        import signal

        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated()

    def restore(self) -> None:
        import signal

        for s, h in self.old.items():
            signal.signal(s, h)
        self.old = {}


class StopSignals:
    """SIGINT/SIGTERM set ``signum`` (the run stops after the current step and saves); a second one stops at once."""

    def __init__(self):
        import signal
        import threading

        self.signum = None
        self.old = {}
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self.old[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame):
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum

    def restore(self) -> None:
        import signal

        for s, h in self.old.items():
            signal.signal(s, h)
        self.old = {}
