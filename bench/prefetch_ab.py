"""
Does prefetch pay on this machine? Two measurements, one run:

1. interference: the 2-thread native int4 GEMV (GB/s of weights, from DRAM) alone, then while expert blobs are read
   from the container in the background as the cache reads them (O_DIRECT parts on reader threads). Prefetch can
   only win if compute keeps its speed while the disk reads.
2. A/B/C: one engine under --ram-budget, decoding fresh random prompts with prefetch off, on and auto in turn
   (each mode sees the cache the others left, as a long session would; auto keeps its verdicts from round to
   round), --reps rounds; tok/s and cache counters per run, then the medians.

    python bench/prefetch_ab.py micro.pcf4 --ram-budget 2G [--reps 3] [--tokens 24] [--json OUT]

Not a memory-limited cgroup and no page-cache drop (stream_infer --bench does that): O_DIRECT reads already
bypass the page cache, and both modes run in the same process under the same budget.
"""
import argparse
import json
import os
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")  # as stream_infer.py sets when run as a script
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import container as C  # noqa: E402
import expert_cache as EC  # noqa: E402
import kernels  # noqa: E402
import stream_infer as S  # noqa: E402


def gemv_rate(mats, x, secs):
    """GB/s of int4 weights through the native kernel over distinct matrices (weights from DRAM)."""
    t0, done = time.perf_counter(), 0
    while time.perf_counter() - t0 < secs:
        for packed, sz, n in mats:
            kernels.native_int4().int4_mm(x, packed, sz, n, 64)
            done += packed.numel() + 2 * sz.numel()
    return done / (time.perf_counter() - t0) / 1e9


def background_reads(cont, n_readers, stop, counted):
    """Read random expert blobs as ExpertCache does (n_readers aligned parts at once) until stop is set."""
    keys = [(int(l), e) for l, ents in cont.header["experts"].items() for e in range(len(ents))]
    n = cont.expert_nbytes
    part = -(-n // n_readers // C.ALIGN) * C.ALIGN
    buf = EC.BlobBuffers(n).take()  # as the cache's buffers
    ops = kernels.native_reader()
    if ops is not None:  # as the cache reads: expert_reader.cpp's threads
        while not stop.is_set():
            EC.NativeRead(cont, random.choice(keys), buf, 2, n_readers, ops, verify=False).result()
            counted[0] += n
        return
    with ThreadPoolExecutor(n_readers) as pool:
        while not stop.is_set():
            key = random.choice(keys)
            for f in [pool.submit(cont.read_expert_part, *key, buf, o, min(part, n - o)) for o in range(0, n, part)]:
                f.result()
            counted[0] += n


def interference(path, n_readers, secs=2.0):
    cont = C.load_container(path)
    d = cont.config.d_model
    mats = [(torch.randint(0, 256, (d * d // 2,), dtype=torch.uint8), torch.ones(d // 64, d, 2, dtype=torch.bfloat16), d)
            for _ in range(64)]  # 64 x 2.2 MB: far beyond the caches
    x = torch.randn(1, d)
    alone = gemv_rate(mats, x, secs)
    stop, counted = threading.Event(), [0]
    reader = threading.Thread(target=background_reads, args=(cont, n_readers, stop, counted))
    t0 = time.perf_counter()
    reader.start()
    during = gemv_rate(mats, x, secs)
    stop.set()
    reader.join()
    disk = counted[0] / (time.perf_counter() - t0) / 1e9
    return {"gemv_alone_gb_s": alone, "gemv_while_reading_gb_s": during, "disk_while_computing_gb_s": disk}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("container")
    ap.add_argument("--ram-budget", required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=24, help="decode tokens per run (after a 16-token prompt)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--readers", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.reps < 1 or args.tokens < 2 or args.threads < 1 or not 1 <= args.readers <= 64:
        sys.exit("--reps at least 1, --tokens at least 2, --threads at least 1, --readers 1 to 64")
    try:  # before the interference phase (a minute), not after it
        S.parse_size(args.ram_budget)
    except S.StreamError as e:
        sys.exit(str(e))
    torch.set_num_threads(args.threads)
    if not os.path.exists(args.container):
        sys.exit(f"{args.container}: no such container (python container.py --random-config config/micro.py --out ...)")
    if kernels.native_int4() is None:
        sys.exit("the native int4 kernel did not build (needs g++ and ninja); prefetch is judged on it")
    res = {"container": args.container, "ram_budget": args.ram_budget, "threads": args.threads}
    res["interference"] = inter = interference(args.container, args.readers)
    print(f"int4 GEMV ({args.threads} threads): {inter['gemv_alone_gb_s']:.2f} GB/s alone, "
          f"{inter['gemv_while_reading_gb_s']:.2f} GB/s while experts are read in the background "
          f"(the disk gave {inter['disk_while_computing_gb_s']:.2f} GB/s meanwhile)", flush=True)
    try:
        eng = S.load(args.container, ram_budget=args.ram_budget, n_readers=args.readers, prefetch="off")  # set per run
    except S.StreamError as e:  # a budget below the resident part: one line
        sys.exit(str(e))
    gen = torch.Generator().manual_seed(0)
    runs = {"off": [], "on": [], "auto": []}
    for rep in range(args.reps):
        for mode in runs:
            eng.prefetch_mode = mode  # auto judges its own guesses before each decode token (Engine.judge_prefetch),
            eng.prefetch_judged = tuple(eng.guess_tally)  # not those the "on" run made
            eng.set_prefetch(mode == "on" or (mode == "auto" and bool(eng.prefetch_verdicts)
                                              and eng.prefetch_verdicts[-1][1]))
            prompt = torch.randint(1, eng.cfg.vocab_size, (16,), generator=gen).tolist()
            eng.cache.reset_counters()
            timings = []
            list(eng.stream(prompt, args.tokens + 1, timings=timings))
            st = eng.cache.stats()
            run = {"decode_tok_s": len(timings[1:]) / sum(timings[1:]),
                   **{k: st[k] for k in ("lookups", "hits", "prefetch_hits", "misses", "reads", "prefetch_reads")}}
            runs[mode].append(run)
            if mode == "auto":
                run["verdicts"] = list(eng.prefetch_verdicts)
            print(f"prefetch {mode:4s} round {rep + 1}: {run['decode_tok_s']:.2f} tok/s, hits {run['hits']}, "
                  f"prefetch hits {run['prefetch_hits']}, misses {run['misses']}, reads {run['reads']} "
                  f"({run['prefetch_reads']} guesses) of {run['lookups']} lookups"
                  + (f"; auto's verdicts so far (share right, on): {run['verdicts']}" if mode == "auto" else ""),
                  flush=True)
    res["runs"] = runs
    for mode in runs:
        v = sorted(r["decode_tok_s"] for r in runs[mode])
        res[f"median_tok_s_prefetch_{mode}"] = v[len(v) // 2]
    print(f"median decode tok/s at {args.ram_budget}: prefetch off {res['median_tok_s_prefetch_off']:.2f}, "
          f"on {res['median_tok_s_prefetch_on']:.2f}, auto {res['median_tok_s_prefetch_auto']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
