"""The one error handler of every command line (``python -m llmc_py.X``):
each tool's ``main`` reads its flags, runs, prints, and leaves what can go
wrong for a user to this decorator, which says it in one line."""
import argparse
import contextlib
import functools
import signal
import sys
import threading

from .errors import LlmcError

# said in one line rather than a traceback: the package's own errors, bad
# values (most LlmcErrors are ValueErrors too) and files that cannot be read
# or written
REPORTED = (LlmcError, ValueError, OSError)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's, which appends "(default: X)" to every flag's help, except
    where the help already says its default or there is none to say (None, "")."""

    def _get_help_string(self, action):
        if "(default" in (action.help or "") or action.default in (None, ""):
            return action.help
        return super()._get_help_string(action)


# besides Ctrl-C, what a scheduler (SIGTERM) or a dropped SSH session (SIGHUP) sends
TERMINATING = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP")
                    if hasattr(signal, name))


class Interrupted(KeyboardInterrupt):
    """A terminating signal, raised where the program is, as Ctrl-C raises
    KeyboardInterrupt: the same cleanup runs (temporary files removed)."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


@contextlib.contextmanager
def terminating_signals_interrupt():
    """While inside (in the main thread), TERMINATING signals raise Interrupted."""
    previous = {}
    try:
        if threading.current_thread() is threading.main_thread():   # (signal's rule)
            for signum in TERMINATING:
                previous[signum] = signal.signal(signum, _raise_interrupted)
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def command(main=None, *, prefix="", interrupted=None):
    """Decorates a command line's ``main(argv=None, ...)``: the wrapped main
    returns main's exit code (0 when it returns None); an error of REPORTED
    prints "{prefix}error: {e}" on stderr and returns 1. With ``interrupted``,
    Ctrl-C, SIGTERM and SIGHUP print that line ("{signal}" in it: the
    signal's name) and return 128 + the signal (without, they are not
    caught). argparse's own errors (exit code 2, after the usage) pass
    through."""
    if main is None:
        return functools.partial(command, prefix=prefix, interrupted=interrupted)

    @functools.wraps(main)
    def wrapped(*args, **kwargs):
        try:
            with (terminating_signals_interrupt() if interrupted is not None
                  else contextlib.nullcontext()):
                return main(*args, **kwargs) or 0
        except REPORTED as e:
            print(f"{prefix}error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt as e:
            if interrupted is None:
                raise
            signum = getattr(e, "signum", signal.SIGINT)
            print(interrupted.replace("{signal}", signal.Signals(signum).name), file=sys.stderr)
            return 128 + signum
    return wrapped
