"""
A/B of one expert-cache setting, switched every decode token: both values see the same hour of this VM.

    python bench/token_ab.py micro.pcf4 --ram-budget 2G --set n_parts=4,1 [--prompts 12] [--tokens 48]

On a shared 2-core VM the same command moved 20-30% between runs minutes apart (the host's memory and disk), so
whole runs alternated A, B, A, B still needed many rounds to see a 5% change. Here one engine decodes fresh random
prompts and sets `engine.cache.<name>` to the next value before each token (the first value of each prompt
rotates), then prints per value: mean and median ms a token, misses a token, guesses read a token, and the time
waited for reads per miss (a guess asked for before it landed waits too). Only settings read per token make sense
(n_parts: parts per blob read; native_reads: C++ or Python readers; prefetch: the engine's --prefetch; probe:
--prefetch auto's guesses named without reading, on every token (its worst case); fuse_shared:
a layer with every expert cached computes its shared and routed experts in one native call, or the shared one
apart). In-process, no memory cgroup (stream_infer --bench does that; O_DIRECT reads skip the page cache).
"""
import argparse
import os
import statistics
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")  # as stream_infer.py sets when run as a script
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import stream_infer as S  # noqa: E402


def positive_int(v):
    n = int(v)
    if n < 1:
        raise ValueError(v)
    return n


def boolean(v):
    if v.lower() not in ("1", "0", "true", "false"):
        raise ValueError(v)
    return v.lower() in ("1", "true")


def cache_setting(name):
    return lambda eng, v: setattr(eng.cache, name, v)


# name -> (parser, what it takes, how an engine takes a value)
SETTABLE = {"n_parts": (positive_int, "positive int", cache_setting("n_parts")),
            "native_reads": (boolean, "0/1/true/false", cache_setting("native_reads")),
            "prefetch": (boolean, "0/1/true/false", lambda eng, v: eng.set_prefetch(v)),
            # --prefetch auto's probe while off: every layer names the next one's guesses without reading them
            "probe": (boolean, "0/1/true/false", lambda eng, v: [setattr(m, "shadow_guess", v) for m in eng.moes]),
            # a MoE layer with every expert cached: shared + routed experts in one swiglu_mix call, or apart
            "fuse_shared": (boolean, "0/1/true/false", lambda eng, v: [setattr(m, "fuse_shared", v) for m in eng.moes])}


def parse_set(text):
    """'n_parts=4,1' -> ('n_parts', [4, 1])."""
    name, _, values = text.partition("=")
    if name not in SETTABLE or not values:
        raise SystemExit(f"error: --set {text!r}: use NAME=V1,V2 with NAME one of {', '.join(SETTABLE)}")
    parse, what, _ = SETTABLE[name]
    try:
        vals = [parse(v) for v in values.split(",")]
    except ValueError:
        raise SystemExit(f"error: --set {text!r}: values must be {what} values") from None
    if len(vals) < 2:
        raise SystemExit(f"error: --set {text!r}: give at least two values to compare")
    return name, vals


def main():
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("container")
    ap.add_argument("--ram-budget", required=True)
    ap.add_argument("--set", required=True, help="NAME=V1,V2: the cache setting and the values to alternate")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=48, help="decode tokens per prompt (after 16 prompt tokens)")
    a = ap.parse_args()
    name, vals = parse_set(a.set)
    # prompt r's decode tokens take values r, r + 1, ... in turn: together they reach prompts + tokens - 2 of them
    if a.prompts < 1 or a.tokens < 2 or a.prompts + a.tokens - 2 < len(vals):
        raise SystemExit(f"error: --prompts >= 1, --tokens >= 2, and at least one decode token per value: "
                         f"--prompts + --tokens >= {len(vals) + 2} for {len(vals)} values")
    try:
        eng = S.load(a.container, ram_budget=a.ram_budget, prefetch="off")  # each variant sets its own
    except S.StreamError as e:
        raise SystemExit(f"error: {e}") from None
    torch.set_num_threads(S.compute_threads(eng, "auto"))  # (the call alone set nothing)
    cache = eng.cache
    if name == "native_reads" and cache.reader_ops is None:
        raise SystemExit("error: --set native_reads: expert_reader.cpp did not build here, so only Python readers exist")
    lat, miss, wait, guessed = ({v: [] for v in range(len(vals))} for _ in range(4))
    for r in range(a.prompts):
        prompt = torch.randint(1, eng.cfg.vocab_size, (16,), generator=torch.Generator().manual_seed(1000 + r)).tolist()
        timings = []
        it = eng.stream(prompt, a.tokens, temperature=0.0, timings=timings)
        next(it)  # the prompt's pass (prefill) is no one's
        for i in range(a.tokens - 1):
            v = (i + r) % len(vals)
            SETTABLE[name][2](eng, vals[v])
            m0, w0, g0 = cache.misses, cache.read_wait_s, cache.prefetch_reads
            next(it)
            lat[v].append(timings[-1])
            miss[v].append(cache.misses - m0)
            wait[v].append(cache.read_wait_s - w0)
            guessed[v].append(cache.prefetch_reads - g0)
    print(f"{a.container} at {a.ram_budget}: {a.prompts} prompts x {a.tokens - 1} tokens, {name} switched every token")
    for v, val in enumerate(vals):
        mean = statistics.mean(lat[v])
        per_miss = sum(wait[v]) / max(1, sum(miss[v])) * 1e3
        print(f"  {name}={val}: {len(lat[v])} tokens, mean {mean * 1e3:.1f} ms ({1 / mean:.2f} tok/s), median "
              f"{statistics.median(lat[v]) * 1e3:.1f} ms, misses {statistics.mean(miss[v]):.2f} a token, guesses "
              f"{statistics.mean(guessed[v]):.2f} a token, waited "
              f"{statistics.mean(wait[v]) * 1e3:.1f} ms a token ({per_miss:.2f} ms a miss)")


if __name__ == "__main__":
    main()
