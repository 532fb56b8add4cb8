"""
stream_infer's CUDA path in one run, for a machine with an NVIDIA GPU (run on an H200: bench/h200/, README "On a GPU"):

1. kernels: triton_int4_matmul against the reference (dequantize on the device, fp32 matmul) on decode (M = 1, 4,
   16) and prefill (M = 256) shapes of micro's projections and some odd ones: the largest relative error, then ms
   and GB/s of int4 bytes side by side with two baselines in the same run: the reference (dequantize every call,
   what --kernel reference does) and a bf16 matmul on weights dequantized once (what an unquantized model reads).
2. engine: a container on the GPU with the Triton kernel against the same engine with the reference kernel
   (dequantize, then a torch matmul, on the GPU too: a CPU reference would take minutes on micro): final hidden
   states and logits of one forward, greedy tokens, also with the expert cache cut to a quarter of the experts
   (filled at load as far as they fit, misses streamed from disk as on CPU); decode tok/s both ways.

    python container.py --random-config config/micro.py --out micro.pcf4    # once (random weights)
    python bench/gpu_check.py --container micro.pcf4 [--json OUT]
    TRITON_INTERPRET=1 python bench/gpu_check.py --container tiny.pcf4 --device cpu   # no GPU: correctness only

Exits non-zero when an error is over its tolerance or the greedy tokens differ. Under TRITON_INTERPRET=1 on CPU
(what the test runs) the shapes are small and the times mean nothing.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import container as C  # noqa: E402
import kernels  # noqa: E402
import stream_infer as S  # noqa: E402

MICRO_SHAPES = [(3072, 2048), (2048, 2048), (2048, 1024), (8192, 2048), (2048, 4096)]  # q|k|v, o / gate_up, down, shared
ODD_SHAPES = [(33, 48), (40, 100), (96, 256), (64, 70)]
TOLERANCE = 1e-3  # relative to the largest reference output: fp32 accumulation in a different order


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)  # (cuda:N: that device, not the current one)


def rel_err(ref, got):
    return float((ref - got).abs().max() / ref.abs().max())


def median_s(fn, device, reps):
    fn()
    sync(device)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def check_kernels(device, reps):
    gen = torch.Generator().manual_seed(0)
    interp = not device.startswith("cuda")
    if interp:  # the interpreter is slow: two cases (the test suite covers the odd shapes one by one)
        cases = [(1, 33, 48, 16), (3, 40, 100, 32)]
    else:
        cases = [(m, n, k, 64) for n, k in MICRO_SHAPES for m in (1, 4, 16, 256)]
        cases += [(m, n, k, g) for (n, k), g in zip(ODD_SHAPES, (16, 32, 128, 64)) for m in (1, 3, 16)]
    rows, worst = [], 0.0
    for m, n, k, g in cases:
        p, sz = C.quantize_int4(torch.randn(n, k, generator=gen), g)
        x = torch.randn(m, k, generator=gen).to(device)
        p, sz = p.to(device), sz.to(device)
        ref = kernels.int4_matmul_reference(x, p, sz, (n, k), g)
        got = kernels.triton_int4_matmul(x, p, sz, (n, k), g)
        err = rel_err(ref, got)
        worst = max(worst, err)
        row = {"M": m, "N": n, "K": k, "group": g, "rel_err": err}
        if not interp:
            w16 = C.dequantize_int4(p, sz, (n, k), g).to(torch.bfloat16)
            x16 = x.to(torch.bfloat16)
            nbytes = p.numel() * p.element_size() + sz.numel() * sz.element_size()
            for name, fn in (("triton", lambda: kernels.triton_int4_matmul(x, p, sz, (n, k), g)),
                             ("reference", lambda: kernels.int4_matmul_reference(x, p, sz, (n, k), g)),
                             ("bf16_dense", lambda: x16 @ w16.t())):
                row[name + "_ms"] = median_s(fn, device, reps) * 1e3
            row["triton_int4_GB_s"] = nbytes / row["triton_ms"] / 1e6
            row["bf16_dense_GB_s"] = w16.numel() * 2 / row["bf16_dense_ms"] / 1e6
        rows.append(row)
        print(f"  M {m:4d} N {n:5d} K {k:5d} G {g:3d}: rel err {err:.1e}" + ("" if interp else
              f" | triton {row['triton_ms']:.3f} ms ({row['triton_int4_GB_s']:.0f} GB/s int4) | reference "
              f"{row['reference_ms']:.3f} ms | bf16 dense {row['bf16_dense_ms']:.3f} ms ({row['bf16_dense_GB_s']:.0f} GB/s)"))
    return rows, worst


def decode_tok_s(eng, prompt, n):
    timings = []
    list(eng.stream(prompt, n, temperature=0.0, timings=timings))
    return 1.0 / statistics.median(timings[1:])


def check_engine(path, device, n_new, prompt_tokens=16):
    prompt = list(range(5, 5 + prompt_tokens))
    ids = torch.tensor([prompt], device=device)
    ref = S.load(path, device=device, kernel="reference", preload=False)
    h_ref = ref.forward(ids)
    logits_ref, want = ref.logits(h_ref), ref.generate(prompt, n_new)
    del ref  # its resident copy leaves the GPU before the next engine loads
    eng = S.load(path, device=device, kernel="triton")
    cfg = eng.cfg
    h = eng.forward(ids)
    h_err, l_err = rel_err(h_ref, h), rel_err(logits_ref, eng.logits(h))
    got = eng.generate(prompt, n_new)
    res = {"hidden_rel_err": h_err, "logits_rel_err": l_err, "greedy_equal": got == want, "greedy_ref": want,
           "greedy_triton": got}
    print(f"  final hidden states rel err {h_err:.1e}, logits {l_err:.1e}; greedy tokens "
          f"{'equal' if got == want else 'DIFFER'} ({len(want)} tokens)")
    n_experts = (cfg.n_layer - cfg.n_dense_layers) * cfg.n_experts
    if device.startswith("cuda"):
        res["resident_decode_tok_s"] = decode_tok_s(eng, prompt, n_new)
    del eng
    # a quarter of the experts cached (filled at load as far as they fit): misses read from disk, copied to the device
    small = S.load(path, device=device, kernel="triton", preload=False)
    small.cache.budget = max(2 * cfg.top_k, n_experts // 4) * small.container.expert_nbytes
    small.preload_experts(partial=True)
    got = small.generate(prompt, n_new)
    res.update(streamed_greedy_equal=got == want, streamed_misses=small.cache.stats()["misses"])
    print(f"  a quarter of the {n_experts} experts cached: greedy tokens {'equal' if got == want else 'DIFFER'} "
          f"({res['streamed_misses']} misses)")
    if device.startswith("cuda"):
        small.cache.reset_counters()  # the timed decode's hit rate, not the check's generate before it
        res["quarter_cache_decode_tok_s"] = decode_tok_s(small, prompt, n_new)
        res["quarter_cache_hit_rate"] = small.cache.stats()["cache_hit_rate"]
        print(f"  decode {res['resident_decode_tok_s']:.1f} tok/s fully resident, "
              f"{res['quarter_cache_decode_tok_s']:.1f} tok/s with a quarter cached (hit rate "
              f"{res['quarter_cache_hit_rate']:.2f})")
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--container", required=True, help="int4 container (micro.pcf4 for speed figures)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=16, help="greedy tokens to compare and to time")
    ap.add_argument("--prompt-tokens", type=int, default=16, help="prompt length (the prefill's M)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.tokens < 2 or a.prompt_tokens < 1 or a.reps < 1:  # (decode is timed from the second token on)
        sys.exit("gpu_check: --tokens must be at least 2, --prompt-tokens and --reps at least 1")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device here (torch.cuda.is_available() is False); on CPU run it as "
                 "TRITON_INTERPRET=1 python bench/gpu_check.py --container X --device cpu")
    if not a.device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("gpu_check: --device cpu runs the Triton kernels only under TRITON_INTERPRET=1")
    if not os.path.exists(a.container):
        sys.exit(f"gpu_check: no such container {a.container}; build one with "
                 f"python container.py --random-config config/micro.py --out {a.container}")
    name = torch.cuda.get_device_name(a.device) if a.device.startswith("cuda") else "CPU (Triton interpreter)"
    print(f"{name}, torch {torch.__version__}")
    print("kernels: triton_int4_matmul vs the reference")
    rows, worst = check_kernels(a.device, a.reps)
    print(f"kernels: largest rel err {worst:.1e} ({'ok' if worst < TOLERANCE else 'OVER'} {TOLERANCE:g})")
    print(f"engine: {a.container} on {a.device}, kernel triton vs kernel reference")
    try:
        eng = check_engine(a.container, a.device, a.tokens, a.prompt_tokens)
    except (S.StreamError, C.ContainerError, S.EC.CacheError) as e:
        sys.exit(f"gpu_check: {e}")
    ok = (worst < TOLERANCE and max(eng["hidden_rel_err"], eng["logits_rel_err"]) < TOLERANCE and eng["greedy_equal"]
          and eng["streamed_greedy_equal"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "kernels": rows, "engine": eng, "ok": ok}, f, indent=1)
    print("gpu_check: ok" if ok else "gpu_check: FAILED (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
