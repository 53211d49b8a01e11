"""Token ids as the kernels take them: the ignored target and the check
that names the first id outside the vocabulary (C's LLMC_ERR_RANGE only says
that there is one)."""
import numpy as np

from .lib import lib

# a target equal to this is ignored: no loss, no gradient, not counted in the
# mean (PyTorch's cross_entropy(ignore_index=-1)). Targets only: an input
# token must be a real token.
IGNORE_INDEX = lib.LLMC_IGNORE_INDEX


def first_out_of_vocab(tokens, vocab_size, allow_ignore=False):
    """The index (a tuple) of the first id in ``tokens`` outside [0, vocab_size),
    or None if every id is a token; with ``allow_ignore``, IGNORE_INDEX is
    not an error (targets)."""
    tokens = np.asarray(tokens)
    outside = (tokens < 0) | (tokens >= vocab_size)
    if allow_ignore:
        outside &= tokens != IGNORE_INDEX
    bad = np.flatnonzero(outside)
    return np.unravel_index(bad[0], tokens.shape) if bad.size else None
