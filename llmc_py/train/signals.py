"""Stopping a run cleanly on a signal: Ctrl-C (SIGINT), SIGTERM (what SLURM,
Kubernetes, ``timeout`` and systemd send before they kill a job) and SIGHUP
(a dropped SSH session) all end training at a step boundary with a
checkpoint, never in the middle of a save."""
import signal
import threading
from contextlib import contextmanager

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP")
                     if hasattr(signal, name))


class Stopped(KeyboardInterrupt):
    """A stop signal arrived; ``signum`` says which. A KeyboardInterrupt, so
    code that cleans up after Ctrl-C cleans up after every stop signal.
    ``handled``: the run has already saved what it could and said so."""

    def __init__(self, signum, handled=False):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.handled = signum, handled


class StopSignals:
    """While entered (in the main thread), a stop signal raises Stopped where
    the program is, except inside ``deferred()``: there it is held and
    raised when the block ends, so a save or an optimizer update is never
    cut short. A second signal while one is held changes nothing.

    ``held``: signals are only recorded, from the start (the ranks of a run
    under mpiexec, which must all stop after the same step: a rank that
    stopped on its own would leave the others waiting in a collective).
    ``agree(world)`` at a step boundary then stops every rank together."""

    def __init__(self, held=False):
        self.received = None
        self._depth = 1 if held else 0
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        return False

    def hold(self):
        """From now on signals are only recorded: the run is stopping."""
        self._depth += 1

    def _handle(self, signum, frame):
        if self.received is None:
            self.received = signum
        if self._depth == 0:
            raise Stopped(self.received)

    def agree(self, world):
        """Raises Stopped on every rank of ``world`` (train.distributed) once
        any rank has received a signal (the highest signal number among
        them, so that all exit alike); a collective: every rank calls it."""
        signum = world.max(self.received or 0)
        if signum:
            raise Stopped(signum)

    @contextmanager
    def deferred(self):
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if self._depth == 0 and self.received is not None:
            raise Stopped(self.received)
