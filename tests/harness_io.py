"""Shared by tests/test_arm_kernels.py and tests/test_chunk_pool.py: one case in and out of
tests/int4_cpu_harness.cpp (its input file, its run, its output and what it printed)."""

import subprocess

import numpy as np
import torch


def run_harness(cmd, out, header, arrays, M, N, args=()):
    """Write one case (the int64 header [kind, M, N, K, G], then each array's bytes) to out/in.bin and run
    cmd + [in.bin, out.bin] + args: (y [2, M, N], the best loop's and the portable loop's; what it printed, as
    {"int4 loop": "sdot", "threads": "1", ...}; its stderr)."""
    inp, res = out / "in.bin", out / "out.bin"
    with open(inp, "wb") as f:
        f.write(np.asarray(header, dtype=np.int64).tobytes())
        for a in arrays:
            f.write(a.contiguous().numpy().tobytes())
    r = subprocess.run([*cmd, str(inp), str(res), *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    said = dict(line.rsplit(" ", 1) for line in r.stdout.splitlines())
    return torch.from_numpy(np.fromfile(res, dtype=np.float32).copy()).view(2, M, N), said, r.stderr
