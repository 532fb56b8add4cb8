"""
The CPU int4 GEMV that decode spends most of its time in: int4_cpu.cpp (stream_infer --kernel native) vs torch's
_weight_int4pack_mm_for_cpu (--kernel int4pack), side by side in one run, on the container's layout. Then the
int8-row GEMV of the lm_head (--int8-shape, micro's 32768 x 2048): int4_cpu.cpp with int8 activations (what
decode uses on AVX2) vs its fp32-activation loop vs torch's _weight_int8pack_mm.

    python bench/int4_gemv.py [--shape 2048x2048] [--group-size 64] [--mb 320] [--threads 1,2] [--json OUT]

"cold": a loop over enough distinct random matrices (--mb of them) that the weights come from DRAM, as in
decode, where every token reads each weight once. "hot": one matrix again and again (it stays in cache).
Prints GB/s of int4 weights (packed bytes + bf16 scales) and ms per GEMV (M=1), median of --reps rounds.
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import container as C  # noqa: E402
import kernels  # noqa: E402


def median_time(fn, reps):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="2048x2048", help="N x K of each weight matrix (micro's expert gate_up)")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--mb", type=int, default=320, help="MB of distinct matrices in the cold loop (>> L3)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--int8-shape", default="32768x2048", help="N x K of the int8 rows (micro's lm_head); 0 skips")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--pages", choices=("huge", "4k"), default="huge",
                    help="weights in huge-page memory as stream_infer places them (container.anon_buffer), or torch's")
    a = ap.parse_args()
    place = ((lambda t: C.anon_tensor(list(t.shape), t.dtype).copy_(t)) if a.pages == "huge"  # noqa: E731
             else (lambda t: t))
    try:
        N, K = (int(v) for v in a.shape.lower().split("x"))
    except ValueError:
        sys.exit(f"error: --shape {a.shape!r}: N x K, e.g. 2048x2048")
    if N < 1 or K < 1 or a.reps < 1 or a.group_size < 1 or a.mb < 1:
        sys.exit("error: --shape sides, --reps, --group-size and --mb must be at least 1")
    g = a.group_size
    Np, Kp = C.int4_padded_shape((N, K), g)
    op = kernels.native_int4()
    if op is None:
        sys.exit("error: int4_cpu.cpp did not build (see the warning above); install g++ and ninja")
    gen = torch.Generator().manual_seed(0)
    one = Np * Kp // 2 + (Kp // g) * Np * 2 * 2
    n_mats = max(1, (a.mb << 20) // one)
    mats = [(place(torch.randint(0, 256, (Np * Kp // 2,), dtype=torch.uint8, generator=gen)),
             place((torch.randn(Kp // g, Np, 2, generator=gen) * 0.01).to(torch.bfloat16))) for _ in range(n_mats)]
    x = torch.randn(1, K, generator=gen)
    xb = torch.nn.functional.pad(x, (0, Kp - K)).to(torch.bfloat16)
    fns = {"native": lambda p, sz: op.int4_mm(x, p, sz, N, g)}
    if op.has_vnni():  # the native kernel's VNNI loop beside its AVX-512BW and AVX2 ones (same results, bit for bit)
        fns["native_512bw"] = lambda p, sz: op.int4_mm_avx512bw(x, p, sz, N, g)
    if op.has_avx512():
        fns["native_avx2"] = lambda p, sz: op.int4_mm_avx2(x, p, sz, N, g)
    if op.has_sdot():  # AArch64: the dot-product loop beside the portable fp32 one
        fns["native_fp32"] = lambda p, sz: op.int4_mm_generic(x, p, sz, N, g)
    if kernels.cpu_int4pack_ok() and g in kernels.INT4PACK_GROUPS:
        fns["int4pack"] = lambda p, sz: torch._weight_int4pack_mm_for_cpu(xb, p.view(Np, Kp // 2), g, sz)
    print(f"shape {N}x{K} group {g}, {a.pages} pages: {one / 1e6:.2f} MB per matrix, cold loop over {n_mats} ({n_mats * one / 1e6:.0f} MB); "
          f"AVX2 path: {op.has_avx2()}, AVX-512 path: {op.has_avx512()}, VNNI path: {op.has_vnni()}, "
          f"AArch64 dot-product path: {op.has_sdot()}")
    rows = []
    for th in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(th)
        for name, fn in fns.items():
            cold = median_time(lambda: [fn(p, sz) for p, sz in mats], a.reps) / n_mats
            hot = median_time(lambda: fn(*mats[0]), a.reps * 20)
            rows.append(dict(kernel=name, threads=th, cold_ms=cold * 1e3, cold_gb_s=one / cold / 1e9,
                             hot_ms=hot * 1e3, hot_gb_s=one / hot / 1e9))
            r = rows[-1]
            print(f"{name:12s} {th} thread(s): cold {r['cold_gb_s']:5.1f} GB/s ({r['cold_ms']:.3f} ms) | "
                  f"hot {r['hot_gb_s']:5.1f} GB/s ({r['hot_ms']:.3f} ms)")
        if "int4pack" in fns:
            nat, pack = rows[-len(fns)], rows[-1]
            print(f"  native / int4pack at {th} thread(s): cold {pack['cold_ms'] / nat['cold_ms']:.2f}x, "
                  f"hot {pack['hot_ms'] / nat['hot_ms']:.2f}x")
    rows8 = int8_rows_bench(op, a, place) if a.int8_shape != "0" else []
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(shape=[N, K], group_size=g, matrix_bytes=one, rows=rows, int8_rows=rows8), f, indent=1)


def int8_rows_bench(op, a, place):
    """ms per GEMV (M=1) over int8 rows with one fp32 scale each; the matrices (3 of them) are larger than L3."""
    N, K = (int(v) for v in a.int8_shape.lower().split("x"))
    gen = torch.Generator().manual_seed(1)
    qs = [place(torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=gen)) for _ in range(3)]
    scale = torch.rand(N, generator=gen) * 0.01
    x = torch.randn(1, K, generator=gen)
    kernels = {"native_q8": lambda q: op.int8_mm(x, q, scale), "native_q8_avx2": lambda q: op.int8_mm_avx2(x, q, scale),
               "native_fp32": lambda q: op.int8_mm_generic(x, q, scale)}
    if not op.has_avx2():  # (AArch64: int8_mm_avx2 is int8_mm)
        del kernels["native_q8_avx2"]
    if hasattr(torch, "_weight_int8pack_mm"):
        xb, sb = x.to(torch.bfloat16), scale.to(torch.bfloat16)
        kernels["int8pack"] = lambda q: torch._weight_int8pack_mm(xb, q, sb)
    print(f"int8 rows {N}x{K}: {N * K / 1e6:.0f} MB per matrix, loop over {len(qs)}")
    rows = []
    for th in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(th)
        for name, fn in kernels.items():
            ms = median_time(lambda: [fn(q) for q in qs], a.reps) / len(qs) * 1e3
            rows.append(dict(kernel=name, threads=th, ms=ms, gb_s=N * K / ms / 1e6))
            print(f"{name:14s} {th} thread(s): {rows[-1]['gb_s']:5.1f} GB/s ({ms:.2f} ms)")
    return rows


if __name__ == "__main__":
    main()
