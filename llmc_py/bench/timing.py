"""Timing by repeats, peak memory, and the measurements that run in a
process of their own (ours and PyTorch's training step, PyTorch's matmul
and generation): a job is a JSON object on the command line, its result a
JSON line on stdout."""
import json
import resource
import statistics
import subprocess
import sys
import time


def timed(fn, repeats, warmup=1, settle=0.2):
    # let other libraries' spinning worker threads (numpy's BLAS, torch's
    # OpenMP) go idle first, for ``settle`` seconds
    time.sleep(settle)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return {"median": statistics.median(times), "min": min(times), "max": max(times),
            "times": times}


def run_job(module, job, what):
    """The JSON result of ``python -m module JOB`` in a fresh interpreter. A
    failing job raises RuntimeError naming ``what`` with its last error line."""
    done = subprocess.run([sys.executable, "-m", module, json.dumps(job)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["(no output)"]
        raise RuntimeError(f"{what} job failed: {lines[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def peak_rss_mib():
    """This process's peak resident memory in MiB: Linux's VmHWM, which starts
    anew at exec (getrusage's ru_maxrss keeps the forking parent's peak when
    that was larger); elsewhere ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    per_mib = 2**20 if sys.platform == "darwin" else 2**10   # macOS reports bytes, others KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / per_mib
