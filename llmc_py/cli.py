"""The one error handler of every command line (``python -m llmc_py.X``):
each tool's ``main`` reads its flags, runs, prints, and leaves what can go
wrong for a user to this decorator, which says it in one line."""
import argparse
import functools
import sys

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


def command(main=None, *, prefix="", interrupted=None):
    """Decorates a command line's ``main(argv=None, ...)``: the wrapped main
    returns main's exit code (0 when it returns None); an error of REPORTED
    prints "{prefix}error: {e}" on stderr and returns 1. With ``interrupted``,
    Ctrl-C prints that line and returns 130 (without, it is not caught).
    argparse's own errors (exit code 2, after the usage) pass through."""
    if main is None:
        return functools.partial(command, prefix=prefix, interrupted=interrupted)

    @functools.wraps(main)
    def wrapped(*args, **kwargs):
        try:
            return main(*args, **kwargs) or 0
        except REPORTED as e:
            print(f"{prefix}error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            if interrupted is None:
                raise
            print(interrupted, file=sys.stderr)
            return 130
    return wrapped
