"""How much memory can still be had, and a check to run before a large
allocation, so that a request that cannot fit fails at once with a message
saying what it needed, instead of the process being killed later when the
pages are first touched (Linux grants large allocations lazily); and
return_freed_scratch, which keeps freed kernel scratch from staying resident."""
import ctypes
import os

from ..errors import OutOfMemoryError

GIB = 1 << 30


def _meminfo(path="/proc/meminfo"):
    """{field: bytes} from /proc/meminfo, or {} where there is none."""
    fields = {}
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    scale = 1024 if parts[1:] == ["kB"] else 1
                    fields[name] = int(parts[0]) * scale
    except OSError:
        return {}
    return fields


def _cgroup_headroom(folder="/sys/fs/cgroup"):
    """memory.max - memory.current of this process's cgroup (v2), or None
    if it has no limit or none can be read."""
    try:
        with open(os.path.join(folder, "memory.max")) as f:
            limit = f.read().strip()
        with open(os.path.join(folder, "memory.current")) as f:
            current = int(f.read().strip())
    except (OSError, ValueError):
        return None
    if not limit.isdigit():   # "max": no limit
        return None
    return max(int(limit) - current, 0)


def available_bytes(meminfo="/proc/meminfo", cgroup="/sys/fs/cgroup"):
    """Bytes this process can still allocate and touch: MemAvailable plus free
    swap (Linux), else the free physical pages, capped by a cgroup limit;
    None when the system does not say."""
    info = _meminfo(meminfo)
    if "MemAvailable" in info:
        avail = info["MemAvailable"] + info.get("SwapFree", 0)
    else:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            avail = None
    headroom = _cgroup_headroom(cgroup)
    if headroom is not None:
        avail = headroom if avail is None else min(avail, headroom)
    return avail


def format_bytes(nbytes):
    """e.g. '9.31 TiB (9534.6 GiB)' or '1.50 GiB' or '12.0 MiB'."""
    if nbytes >= 1024 * GIB:
        return f"{nbytes / (1024 * GIB):.2f} TiB ({nbytes / GIB:.1f} GiB)"
    if nbytes >= GIB:
        return f"{nbytes / GIB:.2f} GiB"
    return f"{nbytes / (1 << 20):.1f} MiB"


def require(nbytes, what, available=None):
    """Raises OutOfMemoryError if ``nbytes`` for ``what`` (e.g. "activations
    for B=8, T=1024") exceed what is available (``available_bytes()`` unless
    given). Does nothing when the system does not say how much there is."""
    if available is None:
        available = available_bytes()
    if available is not None and nbytes > available:
        raise OutOfMemoryError(f"{what} need {format_bytes(nbytes)} of memory, but only "
                               f"{format_bytes(available)} is available; use a smaller "
                               f"batch (B), sequence length (T) or model")


# glibc's mallopt parameter for the size from which malloc maps memory of its own
_M_MMAP_THRESHOLD = -3


def return_freed_scratch(threshold=1 << 20):
    """Has glibc's malloc serve every request of ``threshold`` bytes or more
    with memory of its own (mmap), given back to the system when freed.

    By default glibc raises that threshold after each large free (up to 32
    MiB), after which per-call scratch of a few MiB comes from the heap and
    stays there, freed but resident. The matmuls keep theirs in an arena
    (llmc_py.release_scratch), so what remains is the other kernels' scratch
    and numpy's temporaries: 6-10 MiB of the peak of a bf16 step of 2 GPT-2
    124M layers at B=4, T=1024 (measured; 43 MiB before the arena; no change
    in speed). Process-wide, so the programs (train, bench) call it and a
    library user may. Returns False where there is no glibc malloc."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))
