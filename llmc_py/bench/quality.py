"""The default training run in each precision, for the loss bf16 costs."""
import os
import re
import subprocess
import sys
import time

from ..model import PRECISIONS


def bench_quality(steps, extra=(), out_dir="bench_quality"):
    """The default training run for ``steps`` steps in each precision (each
    `python -m llmc_py.train` in a process of its own, writing to
    out_dir/<precision>); {precision: (final val loss, wall seconds)}."""
    results = {}
    for precision in PRECISIONS:
        folder = os.path.join(out_dir, precision)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "llmc_py.train", "-o", folder, "--overwrite",
                        "-x", str(steps), "-v", str(steps), "-s", "0", "-n", "0",
                        "--precision", precision, *extra], check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(folder, "main.log")) as f:
            val = re.findall(r"tel:(\S+)", f.read())
        results[precision] = (float(val[-1]), time.perf_counter() - start)
    return results
