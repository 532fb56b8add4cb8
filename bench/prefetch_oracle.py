"""
What prefetch could win with a router that guesses well: an upper bound, measured on this machine's disk.

    python bench/prefetch_oracle.py micro.pcf4 --ram-budget 1.5G [--ahead 1,2] [--right 1.0,0.8] [--prompts 8]

A random-weight model's router names only ~60% of the next layer's picks, and a guess one layer ahead mostly lands
too late (bench/STREAMING_LOG.md); a trained router named 82-89% one or two layers ahead on config/tiny.py
(bench/route_guess.py). This runs the engine's own prefetch with guesses taken from the future instead of a
router: each prompt is decoded once greedily to record which experts every layer asks for, then decoded again
while each token takes the next variant in turn (off, then every (ahead, right) pair), so all variants see the
same minutes of a noisy VM and the same cache. A variant guesses layer L+ahead's experts (within the token) while
layer L runs, each guess right with probability `right` (else a random expert that layer does not use). Per variant:
mean and median ms a token, misses and guess reads a token, and time waited for reads. In-process, no memory
cgroup (O_DIRECT reads skip the page cache), as bench/token_ab.py.
"""
import argparse
import os
import random
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")  # as stream_infer.py sets when run as a script
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import stream_infer as S  # noqa: E402


def numbers(text, kind, lo, hi, flag):
    try:
        vals = [kind(v) for v in text.split(",")]
    except ValueError:
        raise SystemExit(f"error: {flag} {text!r}: comma-separated numbers") from None
    if not vals or any(not lo <= v <= hi for v in vals):
        raise SystemExit(f"error: {flag} {text!r}: each in [{lo}, {hi}]")
    return vals


def run(eng, variants, prompts, tokens, seed=0):
    """Decode `prompts` random prompts twice each (record, then measure with the variant switched every token);
    per variant index: lists of seconds a token, misses, seconds waited for reads and guess reads."""
    cache, E = eng.cache, eng.cfg.n_experts
    moe_rank = {m.layer: i for i, m in enumerate(eng.moes)}
    rng = random.Random(seed)
    state = {"trace": None, "token": 0, "variant": None}
    request = cache.request

    def recording_request(keys, protect):  # the first pass: which experts each decode token's layers ask for
        if state["trace"] is not None:
            state["trace"].setdefault((state["token"], keys[0][0]), sorted(e for _, e in keys))
        return request(keys, protect)

    cache.request = recording_request

    def oracle_guess(moe):
        def guess_next(x, protect):
            if not moe.prefetch or state["variant"] is None:
                return
            d, right = state["variant"]
            rank = moe_rank[moe.layer] + d
            if rank >= len(eng.moes):
                return  # the next token's layers depend on a token not yet chosen
            target = eng.moes[rank].layer
            picks = state["future"].get((state["token"], target))
            if picks is None:
                return
            others = [e for e in range(E) if e not in picks]
            keys = [(target, e if rng.random() < right else rng.choice(others)) for e in picks]
            cache.guess(sorted(set(keys)), protect)
        return guess_next

    for m in eng.moes:
        m.guess_next = oracle_guess(m)
    try:
        return measure(eng, variants, prompts, tokens, state)
    finally:  # the engine as it was
        cache.request = request
        for m in eng.moes:
            del m.guess_next
        eng.set_prefetch(False)


def measure(eng, variants, prompts, tokens, state):
    cache, cfg = eng.cache, eng.cfg
    lat, miss, wait, guessed = ({i: [] for i in range(len(variants))} for _ in range(4))
    for r in range(prompts):
        prompt = torch.randint(1, cfg.vocab_size, (16,), generator=torch.Generator().manual_seed(2000 + r)).tolist()
        eng.set_prefetch(False)
        state["trace"], state["token"] = {}, 0
        first = []
        for i, t in enumerate(eng.stream(prompt, tokens, temperature=0.0)):
            first.append(t)
            state["token"] = i + 1  # decode token i + 1 runs after the i-th yield
        state["future"], state["trace"] = state["trace"], None
        timings = []
        state["variant"] = None
        it = eng.stream(prompt, tokens, temperature=0.0, timings=timings)
        second = [next(it)]  # the prompt's pass (prefill) is no one's
        prev = None
        for i in range(tokens - 1):
            v = (i + r) % len(variants)
            state["variant"], state["token"] = variants[v], i + 1
            t0 = time.perf_counter()
            eng.set_prefetch(variants[v] is not None)
            if variants[v] is not None:
                cache.set_slots(2 * cfg.top_k * variants[v][0])  # the guesses of `ahead` layers in flight
            if i > 0 and variants[prev] is not None:  # turning it off waits for guesses in flight: theirs to pay
                lat[prev][-1] += time.perf_counter() - t0
            prev = v
            m0, w0, g0 = cache.misses, cache.read_wait_s, cache.prefetch_reads
            second.append(next(it))
            lat[v].append(timings[-1])
            miss[v].append(cache.misses - m0)
            wait[v].append(cache.read_wait_s - w0)
            guessed[v].append(cache.prefetch_reads - g0)
        if second != first:
            raise SystemExit("error: the second pass decoded other tokens than the first: prefetch changed the output")
    return lat, miss, wait, guessed


def main():
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("container")
    ap.add_argument("--ram-budget", required=True)
    ap.add_argument("--ahead", default="1,2", help="layers ahead the guesses are made (comma-separated)")
    ap.add_argument("--right", default="1.0,0.8", help="share of guesses that are right (comma-separated)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48, help="decode tokens per prompt (after 16 prompt tokens)")
    a = ap.parse_args()
    if not os.path.exists(a.container):
        raise SystemExit(f"error: {a.container}: no such container")
    variants = [None] + [(d, p) for d in numbers(a.ahead, int, 1, 8, "--ahead")
                         for p in numbers(a.right, float, 0.0, 1.0, "--right")]
    # prompt r's decode tokens take variants r, r + 1, ... in turn: together they reach prompts + tokens - 2 of them
    if a.prompts < 1 or a.tokens < 2 or a.prompts + a.tokens - 2 < len(variants):
        raise SystemExit(f"error: --prompts >= 1 and --tokens >= 2, with --prompts + --tokens >= "
                         f"{len(variants) + 2} (each of the {len(variants)} variants needs a token)")
    try:
        eng = S.load(a.container, ram_budget=a.ram_budget, prefetch="off")  # each variant sets its own
    except S.StreamError as e:
        raise SystemExit(f"error: {e}") from None
    torch.set_num_threads(S.compute_threads(eng, "auto"))  # (the call alone set nothing)
    lat, miss, wait, guessed = run(eng, variants, a.prompts, a.tokens)
    print(f"{a.container} at {a.ram_budget}: {a.prompts} prompts x {a.tokens - 1} tokens, the variant switched "
          f"every token; guesses from the recorded future")
    for v, var in enumerate(variants):
        name = "prefetch off" if var is None else f"{var[0]} ahead, {var[1]:.0%} right"
        mean = statistics.mean(lat[v])
        print(f"  {name:22}: {len(lat[v])} tokens, mean {mean * 1e3:.1f} ms ({1 / mean:.2f} tok/s), median "
              f"{statistics.median(lat[v]) * 1e3:.1f} ms, misses {statistics.mean(miss[v]):.2f} a token, guess reads "
              f"{statistics.mean(guessed[v]):.2f} a token, waited {statistics.mean(wait[v]) * 1e3:.1f} ms a token")


if __name__ == "__main__":
    main()
