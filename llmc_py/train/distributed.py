"""Data-parallel training over MPI, through mpi4py (``pip install ".[mpi]"``).

``mpiexec -n N python -m llmc_py.train ...`` runs N processes (ranks) that
train one model: each reads its own B rows of every global batch of N * B,
and after backward the gradients are averaged across ranks, so every rank
takes the same step. Run alone, ``world()`` is ``Solo()`` and nothing changes.

Determinism: the gradient average never uses MPI's reductions (whose order
depends on the algorithm MPI picks). It is a reduce-scatter in rank order
followed by an all-gather: the flat buffer is cut into N contiguous shards
(shard r is rank r's); every rank sends each shard to its owner
(Alltoallv), and the owner adds the N copies in rank order 0, 1, ..., N-1,
then scales by 1/N; an Allgatherv then gives every rank every shard. Both
only move bytes, so the same N gives bitwise the same run. The exchange goes
CHUNK floats per shard at a time, so its scratch is N * CHUNK floats.

With experts, the load-balancing loss (not linear in the batch) is that of
every rank's rows together: inside each MoE layer's forward the ranks add
their per-expert assignment counts and summed router probabilities
(sum_arrays, in rank order), and each backward uses the whole batch's
fractions, so N ranks of B rows train as one process of N B rows (with -d,
micro-batch by micro-batch). The cross-entropy and the z-loss are means over
tokens: the mean over ranks of theirs is already the whole batch's.

ZeRO-1 (``zero=1``): each rank keeps AdamW's moments for its shard only,
updates its shard of the parameters, and the all-gather moves parameters
instead of gradients; the global gradient norm is the square root of the
shards' squared norms added in rank order. A monitored step's gradients are
gathered to rank 0 (gather_shards), which measures them.
"""
import os
import time

import numpy as np

from ..errors import UsageError
from .optimizer import AdamW

# environment variables that MPI launchers set to the number of processes
# (MPICH's Hydra and Intel MPI: PMI_SIZE; Open MPI; MVAPICH; PMIx)
LAUNCHER_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "PMIX_SIZE")
INSTALL_HINT = 'pip install "llmc_py[mpi]"'
CHUNK = 1 << 22   # floats per shard per exchange (16 MiB)
# a test-only fault: LLMC_TEST_FAULT="RANK:STEP" raises on that rank after that step
FAULT_ENV = "LLMC_TEST_FAULT"


def launched_size():
    """The process count an MPI launcher gave this process (1 without one)."""
    for name in LAUNCHER_SIZE_VARS:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 1


def world():
    """Solo() when run alone; an MPIWorld under an MPI launcher with more than
    one process. UsageError if launched so but mpi4py is missing (N copies of
    one run would otherwise write the same folder)."""
    size = launched_size()
    if size <= 1:
        return Solo()
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise UsageError(f"started by an MPI launcher with {size} processes, but mpi4py is "
                         f"not installed: {INSTALL_HINT} ({e})") from None
    return MPIWorld(MPI.COMM_WORLD, MPI)


def shard_bounds(n, size):
    """[start, stop) of each of ``size`` contiguous shards of n elements."""
    return [(n * r // size, n * (r + 1) // size) for r in range(size)]


class Solo:
    """One process: every collective is the identity."""
    rank, size = 0, 1
    is_root = True

    def mean(self, value):
        return float(value)

    def sum(self, value):
        return float(value)

    def max(self, value):
        return value

    def average(self, buf):
        pass

    def sum_counts(self, counts):
        return counts

    def sum_arrays(self, values):
        return values

    def reduce_scatter_mean(self, buf):
        return 0, buf.size

    def all_gather(self, buf):
        pass

    def gather_shards(self, buf):
        pass

    def broadcast(self, buf):
        pass

    def broadcast_object(self, obj):
        return obj

    def gather(self, shard, n, out=None):
        return shard

    def scatter(self, full, shard):
        shard[...] = full

    def same_on_every_rank(self, what, value):
        pass

    def barrier(self):
        pass

    def abort(self, code):
        pass


class MPIWorld:
    """The ranks of ``comm``; collectives in a fixed order (module docstring)."""

    def __init__(self, comm, MPI):
        self.comm, self.MPI = comm, MPI
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.is_root = self.rank == 0
        self._scratch = None
        self.bytes_sent = 0          # by this rank, in reductions and gathers
        self.seconds = 0.0           # spent in them

    # ---- scalars and objects ------------------------------------------------

    def sum(self, value):
        """The sum over ranks of a float, added in rank order."""
        total = 0.0
        for v in self.comm.allgather(float(value)):
            total += v
        return total

    def mean(self, value):
        return self.sum(value) / self.size

    def max(self, value):
        """The largest over ranks of an int (exact, whatever MPI's algorithm)."""
        return self.comm.allreduce(int(value), op=self.MPI.MAX)

    def sum_counts(self, counts):
        """Rank 0: the sum over ranks of an int64 array (exact in any order);
        the others: None."""
        total = np.empty_like(counts) if self.is_root else None
        self.comm.Reduce(counts, total, op=self.MPI.SUM, root=0)
        return total

    def sum_arrays(self, values):
        """The sum over ranks of a small float64 array, added in rank order,
        on every rank (the same bits everywhere)."""
        values = np.ascontiguousarray(values, np.float64)
        gathered = np.empty((self.size, values.size), np.float64)
        self.comm.Allgather(values, gathered)
        total = gathered[0].copy()
        for row in gathered[1:]:
            total += row
        return total

    def broadcast_object(self, obj):
        return self.comm.bcast(obj, root=0)

    def same_on_every_rank(self, what, value):
        """UsageError on every rank, naming the ranks, unless ``value`` (a
        str) is the same on all of them."""
        values = self.comm.allgather(value)
        differ = [r for r, v in enumerate(values) if v != values[0]]
        if differ:
            raise UsageError(f"rank(s) {differ} have another {what} than rank 0 "
                             f"({values[differ[0]]} vs {values[0]}): every rank must run "
                             f"the same code on the same data")

    def barrier(self):
        self.comm.Barrier()

    def abort(self, code):
        self.comm.Abort(code)

    # ---- arrays -------------------------------------------------------------

    def broadcast(self, buf):
        """Rank 0's ``buf`` (a contiguous array) into every rank's."""
        self.comm.Bcast(buf, root=0)

    def average(self, buf):
        """buf (flat float32) = the mean over ranks of buf, bitwise the same
        on every rank and from run to run."""
        self.reduce_scatter_mean(buf)
        self.all_gather(buf)

    def reduce_scatter_mean(self, buf):
        """This rank's shard of ``buf`` = the mean over ranks of that shard
        (the other shards are left as they were); returns the shard's
        (start, stop)."""
        t0 = time.perf_counter()
        bounds = shard_bounds(buf.size, self.size)
        longest = max(stop - start for start, stop in bounds)
        start, stop = bounds[self.rank]
        chunk = min(CHUNK, longest)
        if self._scratch is None or self._scratch.size < self.size * chunk:
            self._scratch = np.empty(self.size * chunk, np.float32)
        received = self._scratch[:self.size * chunk].reshape(self.size, chunk)
        scale = np.float32(1.0 / self.size)
        F = self.MPI.FLOAT
        for offset in range(0, longest, chunk):
            # piece ``offset`` of every shard goes to its owner
            counts = [max(0, min(chunk, b - a - offset)) for a, b in bounds]
            displs = [a + offset if n else 0 for (a, _), n in zip(bounds, counts)]
            mine = counts[self.rank]
            self.comm.Alltoallv([buf, counts, displs, F],
                                [received, [mine] * self.size,
                                 [r * chunk for r in range(self.size)], F])
            if mine:
                piece = buf[start + offset:start + offset + mine]
                piece[...] = received[0, :mine]
                for r in range(1, self.size):   # in rank order, always
                    piece += received[r, :mine]
                piece *= scale
            self.bytes_sent += 4 * (sum(counts) - mine)
        self.seconds += time.perf_counter() - t0
        return start, stop

    def all_gather(self, buf):
        """Every rank's shard of ``buf`` into every rank's buf."""
        t0 = time.perf_counter()
        bounds = shard_bounds(buf.size, self.size)
        counts = [b - a for a, b in bounds]
        displs = [a for a, _ in bounds]
        self.comm.Allgatherv(self.MPI.IN_PLACE, [buf, counts, displs, self.MPI.FLOAT])
        self.bytes_sent += 4 * counts[self.rank] * (self.size - 1)
        self.seconds += time.perf_counter() - t0

    def gather_shards(self, buf):
        """Every rank's shard of ``buf`` into rank 0's buf (the others' are
        left as they were): all_gather's copy, for rank 0 alone."""
        t0 = time.perf_counter()
        bounds = shard_bounds(buf.size, self.size)
        start, stop = bounds[self.rank]
        if self.is_root:
            spec = [buf, [b - a for a, b in bounds], [a for a, _ in bounds], self.MPI.FLOAT]
            self.comm.Gatherv(self.MPI.IN_PLACE, spec, root=0)
        else:
            self.comm.Gatherv(buf[start:stop], None, root=0)
            self.bytes_sent += 4 * (stop - start)
        self.seconds += time.perf_counter() - t0

    def gather(self, shard, n, out=None):
        """Rank 0: the n-element array whose shards the ranks hold (``shard``
        is this rank's), in ``out`` if given; the others: None."""
        bounds = shard_bounds(n, self.size)
        full = (np.empty(n, np.float32) if out is None else out) if self.is_root else None
        spec = [full, [b - a for a, b in bounds], [a for a, _ in bounds], self.MPI.FLOAT]
        self.comm.Gatherv(shard, spec if self.is_root else None, root=0)
        return full

    def scatter(self, full, shard):
        """Each rank's ``shard`` from rank 0's ``full`` array (None elsewhere)."""
        bounds = shard_bounds(sum(self.comm.allgather(shard.size)), self.size)
        spec = [full, [b - a for a, b in bounds], [a for a, _ in bounds], self.MPI.FLOAT]
        self.comm.Scatterv(spec if self.is_root else None, shard, root=0)


class ShardedAdamW(AdamW):
    """ZeRO-1: AdamW whose moments are this rank's shard of the parameters
    only. step() updates the shard (from the shard of the averaged gradients
    that reduce_scatter_mean left there), then gathers every rank's updated
    shard into every rank's parameters (and their bf16 copy)."""

    def __init__(self, model, world, **adamw):
        self.world = world
        span = shard_bounds(model.num_parameters, world.size)[world.rank]
        super().__init__(model, span=span, **adamw)

    def step(self, learning_rate, t):
        super().step(learning_rate, t)
        self.world.all_gather(self.model.params.memory)
        if self.model.params_bf16 is not None:
            self.model.refresh_bf16()

    def gathered_moments(self):
        """(m, v) for every parameter on rank 0, (None, None) on the others
        (a collective: every rank calls it). Between steps the gradients are
        spent, so m is gathered into their buffer: rank 0 then holds one
        parameter-sized array more than the others, as long as it writes."""
        n = self.model.num_parameters
        return self.world.gather(self.m, n, out=self.model.grads.memory), \
            self.world.gather(self.v, n)

    def load_moments(self, m, v):
        """m and v for every parameter from rank 0 (None elsewhere)."""
        self.world.scatter(m, self.m)
        self.world.scatter(v, self.v)


class RankRows:
    """This rank's B rows of every batch of a DataLoader over N * B rows
    (llm.c's convention: -b is per process). Its position is the global
    loader's, the same on every rank."""

    def __init__(self, loader, world):
        if loader.B % world.size:
            raise ValueError(f"a loader of {loader.B} rows does not split over {world.size} ranks")
        self.loader, self.rank, self.size = loader, world.rank, world.size
        self.B = loader.B // world.size
        self.files = loader.files

    @property
    def num_batches(self):
        return self.loader.num_batches

    def next_batch(self):
        x, y = self.loader.next_batch()
        rows = slice(self.rank * self.B, (self.rank + 1) * self.B)
        return x[rows], y[rows]

    def reset(self):
        self.loader.reset()

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, d, **kwargs):
        self.loader.load_state_dict(d, **kwargs)


def raise_injected_fault(rank, step):
    """Tests only: raises on the rank and after the step FAULT_ENV names."""
    spec = os.environ.get(FAULT_ENV)
    if spec and spec == f"{rank}:{step}":
        raise RuntimeError(f"injected fault ({FAULT_ENV}={spec})")
