"""
How far ahead the int4 GEMV should prefetch its weights into L2: int4_loops.h's VNNI loop (stream_infer's default
on AVX-512 VNNI CPUs) with the L1 prefetch alone (before) and with an L2 prefetch 4, 8 (the default,
PREFETCH_L2_BYTES) and 16 KB ahead, beside a plain read of the same bytes, on 2 threads over cold matrices,
interleaved round by round in one process (bench/int4_prefetch.cpp, compiled here with g++ -fopenmp).

    python bench/int4_prefetch.py [--shapes 2048x2048,2048x1024] [--rounds 9] [--mb 335] [--json OUT]

Shapes are N x K of one matrix (micro's expert gate|up and down projections by default); "cold" means --mb MB of
distinct matrices, far more than the last-level cache. Prints GB/s of int4 weights (packed bytes + bf16 scales):
median, min and max over the rounds.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def shapes(text):
    try:
        out = [tuple(int(v) for v in s.lower().split("x")) for s in text.split(",")]
    except ValueError:
        raise SystemExit(f"error: --shapes {text!r}: use NxK,NxK (e.g. 2048x2048)") from None
    if any(len(s) != 2 or s[0] % 32 or s[1] % 64 or min(s) < 1 for s in out):
        raise SystemExit(f"error: --shapes {text!r}: N a multiple of 32, K a multiple of 64")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--shapes", type=shapes, default=shapes("2048x2048,2048x1024"))
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--mb", type=int, default=335, help="MB of distinct matrices per pass")
    ap.add_argument("--json")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "int4_prefetch")
        r = subprocess.run(["g++", "-O3", "-march=native", "-fopenmp", "-std=c++17",
                            os.path.join(HERE, "int4_prefetch.cpp"), "-o", exe], capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"error: could not build bench/int4_prefetch.cpp with g++: "
                             f"{(r.stderr.strip().splitlines() or ['?'])[-1]}")
        results = {}
        for n, k in a.shapes:
            # threads that spin between parallel regions, as decode's (an inherited PASSIVE would time wake-ups)
            r = subprocess.run([exe, str(n), str(k), str(a.rounds), str(a.mb)], capture_output=True, text=True,
                               env=dict(os.environ, OMP_WAIT_POLICY="ACTIVE"))
            if r.returncode != 0:
                raise SystemExit(f"error: {r.stderr.strip() or f'int4_prefetch exited {r.returncode}'}")
            rows = [line.split("\t") for line in r.stdout.strip().splitlines()]
            results[f"{n}x{k}"] = {name: {"median": float(m), "min": float(lo), "max": float(hi)}
                                   for name, m, lo, hi in rows}
            print(f"{n} x {k}, 2 threads, cold ({a.mb} MB), {a.rounds} rounds: GB/s median (min-max)")
            for name, m, lo, hi in rows:
                print(f"  {name:14} {float(m):6.2f}  ({float(lo):.2f}-{float(hi):.2f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
