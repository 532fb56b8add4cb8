"""
Tile sizes for kernels.triton_int4_matmul, measured: every config of a small grid on micro's projection shapes, for
decode (M = 1 and 16) and prefill (M = 256), each checked against the reference (dequantize, fp32 matmul) and timed
(median of --reps, CUDA-synchronised) side by side with the config in use (kernels.TRITON_CONFIGS) and a bf16
matmul on weights dequantized once (what an unquantized model costs). Prints the best config per class by the sum
of its times over the shapes, with its error; kernels.TRITON_CONFIGS takes the winners. TF32 configs (tensor cores)
are timed but win only with --tf32: on an H200 they were 2.5x faster at prefill with a 5e-4 error per matmul, but a
micro engine's final hidden states after a 96-token prompt were 7.5e-2 off the fp32 reference (6e-6 with fp32).

    python bench/triton_tune.py [--json OUT]            # a CUDA GPU (~2-3 min: one compile per config)
    TRITON_INTERPRET=1 python bench/triton_tune.py --device cpu --quick   # no GPU: the grid's correctness only
"""
import argparse
import itertools
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import container as C  # noqa: E402
import kernels  # noqa: E402

SHAPES = [(3072, 2048), (8192, 2048), (2048, 4096)]  # micro's q|k|v, shared gate|up, a down projection (N, K)
GROUP = 64
DECODE = [(16, bn, bk, w, 3, False) for bn, bk, w in itertools.product((16, 32, 64), (32, 64, 128), (2, 4))]
PREFILL = [(bm, bn, bk, w, 3, tf) for bm, bn, bk, w, tf in itertools.product((64, 128), (64, 128), (32, 64), (4, 8),
                                                                              (False, True))]
TOLERANCE = {False: 1e-4, True: 3e-3}  # relative to the largest output: fp32 in another order; tf32 products


def timed(fn, device, reps):
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="two configs per class on one small shape (the interpreter)")
    ap.add_argument("--tf32", action="store_true", help="let TF32 configs win (see above)")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.reps < 1:
        sys.exit("triton_tune: --reps must be at least 1")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("triton_tune: no CUDA device here; on CPU: TRITON_INTERPRET=1 python bench/triton_tune.py --device cpu --quick")
    if not a.device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("triton_tune: --device cpu runs the Triton kernel only under TRITON_INTERPRET=1")
    shapes, classes = SHAPES, {"decode": ([1, 16], DECODE), "prefill": ([256], PREFILL)}
    if a.quick:
        shapes, a.reps = [(96, 128)], 1
        classes = {"decode": ([1, 3], DECODE[:1] + DECODE[-1:]), "prefill": ([40], PREFILL[:1] + PREFILL[-1:])}
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for n, k in shapes:
        p, sz = C.quantize_int4(torch.randn(n, k, generator=gen), GROUP)
        weights[(n, k)] = (p.to(a.device), sz.to(a.device), C.dequantize_int4(p, sz, (n, k), GROUP).to(a.device))
    report = {"device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "CPU (Triton interpreter)",
              "torch": torch.__version__, "group": GROUP, "classes": {}}
    print(report["device"], "torch", torch.__version__)
    for cls, (ms, configs) in classes.items():
        rows, in_use = [], kernels.TRITON_CONFIGS[cls]
        for cfg in [in_use] + [c for c in configs if c != in_use]:
            total, worst, per = 0.0, 0.0, {}
            try:
                for (n, k), (p, sz, w) in weights.items():
                    for m in ms:
                        x = torch.randn(m, k, generator=gen).to(a.device)
                        ref = x @ w.t()
                        got = kernels.triton_int4_matmul(x, p, sz, (n, k), GROUP, config=cfg)
                        worst = max(worst, float((got - ref).abs().max() / ref.abs().max()))
                        t = timed(lambda: kernels.triton_int4_matmul(x, p, sz, (n, k), GROUP, config=cfg), a.device, a.reps)
                        per[f"M{m}_N{n}_K{k}"] = t * 1e3
                        total += t
            except Exception as e:  # a config this GPU cannot run (shared memory): said, and not a candidate
                print(f"  {cls} {cfg}: failed ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})")
                continue
            ok = worst < TOLERANCE[cfg[5]]
            rows.append({"config": list(cfg), "total_ms": total * 1e3, "rel_err": worst, "ok": ok, "ms": per,
                         "in_use": cfg == in_use})
            print(f"  {cls} BM {cfg[0]:3d} BN {cfg[1]:3d} BK {cfg[2]:3d} warps {cfg[3]} tf32 {cfg[5]!s:5}: "
                  f"{total * 1e3:8.3f} ms over {len(per)} cases, rel err {worst:.1e}{'' if ok else ' OVER'}"
                  f"{'  (in use)' if cfg == in_use else ''}")
        base = {}
        for (n, k), (p, sz, w) in weights.items():
            w16 = w.to(torch.bfloat16)
            for m in ms:
                x16 = torch.randn(m, k, generator=gen).to(a.device, torch.bfloat16)
                base[f"M{m}_N{n}_K{k}"] = timed(lambda: x16 @ w16.t(), a.device, a.reps) * 1e3
        good = [r for r in rows if r["ok"] and (a.tf32 or not r["config"][5])]
        best = min(good, key=lambda r: r["total_ms"]) if good else None
        cur = next((r for r in rows if r["in_use"]), None)
        report["classes"][cls] = {"rows": rows, "best": best, "in_use": cur, "bf16_dense_ms": base}
        if best:
            print(f"{cls}: best {tuple(best['config'])} {best['total_ms']:.3f} ms; in use {cur['total_ms']:.3f} ms"
                  f" ({cur['total_ms'] / best['total_ms']:.2f}x); bf16 dense (dequantized once) "
                  f"{sum(base.values()):.3f} ms" if cur else f"{cls}: best {tuple(best['config'])}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if all(c["best"] for c in report["classes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
