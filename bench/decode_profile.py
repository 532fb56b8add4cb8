"""
Where a streamed decode token goes: one engine under --ram-budget decodes after a random prompt, with timers
around the int4_cpu.cpp ops the decode step calls and around the expert cache's bookkeeping, and prints
milliseconds per token for each (the cache's figures exclude the time spent waiting for reads, which is its own
line; the cache's own native calls, its policy ops and expert_reader.cpp's, are counted inside its lines).

    python bench/decode_profile.py micro.pcf4 --ram-budget 2G [--tokens 48] [--prefetch]

In-process, no memory cgroup and no page-cache drop (stream_infer --bench does that; O_DIRECT reads bypass the
page cache anyway). The timers cost a few microseconds a call; compare runs of this script with each other, not
with --bench. On a shared VM check the CPU steal it prints: above a few percent every line is inflated.
"""
import argparse
import collections
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")  # as stream_infer.py sets when run as a script
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import stream_bench as B  # noqa: E402
import kernels  # noqa: E402
import stream_infer as S  # noqa: E402

CACHE_CALLS = ["observe", "request", "_ensure_room", "_score_victim", "_submit", "_evict", "get", "_finish"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("container")
    ap.add_argument("--ram-budget", required=True)
    ap.add_argument("--tokens", type=int, default=48, help="decode tokens (after a 16-token random prompt)")
    ap.add_argument("--prefetch", action="store_true")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    if args.tokens < 2 or args.threads < 1:
        sys.exit("decode_profile: --tokens at least 2, --threads at least 1")
    if not os.path.exists(args.container):
        sys.exit(f"decode_profile: no such container {args.container}; build one with "
                 f"python container.py --random-config config/micro.py --out {args.container}")
    torch.set_num_threads(args.threads)
    try:
        eng = S.Engine(args.container, ram_budget=args.ram_budget, prefetch=args.prefetch)
    except S.StreamError as e:
        sys.exit(f"decode_profile: {e}")
    if eng.kernel != "native":
        sys.exit("decode_profile: int4_cpu.cpp did not build here (see the warning above); nothing to profile")
    spent, calls = collections.Counter(), collections.Counter()
    cache = eng.cache

    def timed(name, fn):
        def call(*a, **k):
            wait0, t0 = cache.read_wait_s, time.perf_counter()
            out = fn(*a, **k)
            spent[name] += time.perf_counter() - t0 - (cache.read_wait_s - wait0)  # minus waiting for reads
            calls[name] += 1
            return out
        return call

    for name in CACHE_CALLS:
        setattr(cache, name, timed("cache." + name, getattr(cache, name)))
    native = kernels.NATIVE

    class TimedOps:
        def __getattr__(self, name):
            return timed(name, getattr(native, name))

    kernels.NATIVE = TimedOps()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, eng.cfg.vocab_size, (16,), generator=gen).tolist()
    timings = []
    it = eng.stream(prompt, args.tokens + 1, timings=timings)
    next(it)  # prefill is not profiled
    spent.clear(), calls.clear(), cache.reset_counters()
    cpu0 = B.cpu_times()
    list(it)
    steal = B.steal_fraction(cpu0, B.cpu_times())
    n, total = len(timings) - 1, sum(timings[1:])
    # the cache's own native calls (policy ops, expert_reader.cpp's) use the ops it was given at load, not the timed
    # ones: they count inside its lines, blob_wait as the wait for reads
    ops = sum(v for k, v in spent.items() if not k.startswith("cache."))
    # the cache calls nest (request -> _ensure_room -> _score_victim), so only the outer ones add up
    outer = sum(spent["cache." + k] for k in ("observe", "request", "get"))
    st = cache.stats()
    print(f"{args.container} at {args.ram_budget}, prefetch {'on' if args.prefetch else 'off'}: {n / total:.2f} tok/s, "
          f"{total / n * 1e3:.1f} ms a token, hit rate {st['cache_hit_rate']:.3f}, CPU steal {'n/a' if steal is None else f'{steal * 100:.0f}%'}")
    print(f"  waiting for reads   {cache.read_wait_s / n * 1e3:6.2f} ms/token")
    print(f"  int4_cpu.cpp ops    {ops / n * 1e3:6.2f} ms/token")
    print(f"  cache bookkeeping   {outer / n * 1e3:6.2f} ms/token (observe + request + get, waits excluded)")
    print(f"  everything else     {(total - ops - outer - cache.read_wait_s) / n * 1e3:6.2f} ms/token (Python glue)")
    for name, v in spent.most_common():
        print(f"    {name:22s} {v / n * 1e3:6.2f} ms/token, {calls[name] / n:5.1f} calls, {v / calls[name] * 1e6:6.0f} us a call")


if __name__ == "__main__":
    main()
