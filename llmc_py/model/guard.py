"""One thread at a time in a model: its activations are shared state, so a
second thread calling in raises ConcurrentUseError at once, rather than
compute a wrong result. Two models in two threads are fine."""
import contextlib
import functools
import threading

from ..errors import ConcurrentUseError


class ThreadGuard:
    """Held by the thread inside one of a model's entry points (re-entrant)."""

    def __init__(self):
        self._lock = threading.RLock()

    @contextlib.contextmanager
    def hold(self, what):
        """Holds the model for this thread, or raises ConcurrentUseError if
        another thread holds it; ``what`` names the entry point."""
        if not self._lock.acquire(blocking=False):
            raise ConcurrentUseError(f"model.{what}: the model is in use by another thread; "
                                     f"a model serves one thread at a time (give each thread "
                                     f"its own model)")
        try:
            yield
        finally:
            self._lock.release()


def held(method):
    """Runs ``method`` holding the model (its ``exclusive``)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self.exclusive(method.__name__):
            return method(self, *args, **kwargs)
    return wrapper
