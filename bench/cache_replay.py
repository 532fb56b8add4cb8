"""
Which expert-cache policy misses least? Record the routing of a few prompts through stream_infer (which experts
each layer asked for, and the router's selection keys for all of its experts), then replay those traces through
each policy at each cache capacity, as a fresh `stream_infer --bench` run would see them: the cache filled at load
(the same experts per layer), then prefill, then decode; the hit rate counts decode. No timing: the same traces
give the same figures on any machine, so a policy is judged by misses, not by a noisy clock.

    python bench/cache_replay.py micro.pcf4 --capacities 684,380,229,77 [--prompts 12] [--seed 12] [--json OUT]

Capacities are in experts (a sweep's "experts cached" column: micro caches 684 / 380 / 229 / 77 at 3G / 2G / 1.5G /
1G in the sweep README's replay table used; 228 at 1.5G in the newest). Policies: lru; score (stream_infer's default: evict the lowest decayed router score) at a few decays; belady
(evict the expert needed furthest ahead: it knows the future, so it is a reference, not a policy; it minimises
all misses, prefill included, with a layer's own experts pinned while it runs, so it need not top every decode
hit rate).
tests/test_stream_infer.py checks `replay` against the engine's own counters.
"""
import argparse
import json
import os
import sys
from collections import OrderedDict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import expert_cache as EC  # noqa: E402
import stream_infer as S  # noqa: E402


def replay(policy, entries, router_score, observed, trace, cap, decay=None, count_from=0):
    """Replay one trace from a snapshot: `entries` the cached keys in LRU order, `router_score` layer -> scores,
    `observed` [(lookups before it, layer, selection keys)] and `trace` [(layer, expert)] as ExpertCache records
    them. Each observe window's keys are protected while it runs, as a layer's own experts are. Returns (misses,
    lookups, final cached keys), counting lookups from index count_from on."""
    decay = EC.SCORE_DECAY if decay is None else decay
    cache, score = OrderedDict((k, True) for k in entries), {k: list(v) for k, v in router_score.items()}
    never = len(trace)  # the next use of a key not needed again
    next_use, upcoming = [], {}  # belady: per lookup the index of that key's next use; key -> its next use
    if policy == "belady":
        next_use = [never] * len(trace)
        for i in range(len(trace) - 1, -1, -1):
            next_use[i], upcoming[trace[i]] = upcoming.get(trace[i], never), i  # ends as each key's first use
    misses = lookups = 0
    starts = [i for i, _, _ in observed] + [len(trace)]
    for n, (i, layer, s) in enumerate(observed):
        if policy == "score":
            old = score.get(layer)
            score[layer] = s if old is None else [decay * o + (1.0 - decay) * v for o, v in zip(old, s)]
        window = trace[i:starts[n + 1]]
        protect = set(window)
        for j, key in enumerate(window, start=i):
            if policy == "belady":
                upcoming[key] = next_use[j]
            counted = j >= count_from
            lookups += counted
            if key in cache:
                cache.move_to_end(key)
                continue
            misses += counted
            if len(cache) >= cap:
                rest = [k for k in cache if k not in protect]
                if not rest:  # the engine would evict one of the layer's own experts here; not modelled
                    raise ValueError(f"capacity {cap}: one pass of layer {layer} needs more experts "
                                     f"({len(protect)}) than the cache holds; replay larger capacities")
                if policy == "lru":
                    victim = rest[0]
                elif policy == "score":  # min keeps the first of equals: LRU order breaks ties
                    victim = min(rest, key=lambda k: score[k[0]][k[1]] if k[0] in score else float("-inf"))
                elif policy == "belady":
                    victim = max(rest, key=lambda k: upcoming.get(k, never))
                else:
                    raise ValueError(f"policy {policy!r}")
                del cache[victim]
            cache[key] = True
    return misses, lookups, set(cache)


def record(eng, n_prompts, seed, n_prompt, n_new):
    """[(trace, observed, index of the first decode lookup)] per prompt, greedy, fresh random prompts."""
    import torch
    out = []
    for p in range(n_prompts):
        gen = torch.Generator().manual_seed(seed + p)
        prompt = torch.randint(1, eng.cfg.vocab_size, (n_prompt,), generator=gen).tolist()
        c = eng.cache
        c.record_trace = True
        c.reset_counters()
        it = eng.stream(prompt, n_new + 1, temperature=0.0)
        next(it)
        first_decode = c.lookups
        list(it)
        out.append((list(c.trace), list(c.observed), first_decode))
        c.record_trace = False
        c.reset_counters()
        print(f"prompt {p + 1}/{n_prompts}: {len(out[-1][0])} lookups", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("container")
    ap.add_argument("--capacities", default="684,380,229,77", help="cache sizes in experts, comma-separated")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--seed", type=int, default=12, help="prompt p is torch.randint under seed + p")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--decays", default="0.5,0.8,0.85,0.9,0.95", help="decays tried for policy score")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not os.path.exists(args.container):
        sys.exit(f"{args.container}: no such container (python container.py --random-config config/micro.py --out ...)")
    try:
        caps = [int(c) for c in args.capacities.split(",")]
        decays = [float(d) for d in args.decays.split(",")]
    except ValueError:
        sys.exit(f"--capacities {args.capacities!r} / --decays {args.decays!r}: comma-separated numbers")
    if min(caps) < 1 or not all(0 <= d < 1 for d in decays):
        sys.exit("--capacities must be >= 1 expert and --decays in [0, 1)")
    if args.prompt_tokens < 1 or args.new_tokens < 1 or args.prompts < 1:
        sys.exit("--prompts, --prompt-tokens and --new-tokens must be >= 1")
    try:  # the routing does not depend on the budget: record with every expert resident when RAM allows
        eng = S.load(args.container, ram_budget=None)
    except S.StreamError as e:
        sys.exit(str(e))
    if args.prompt_tokens + args.new_tokens > eng.context:  # (the engine's error named stream_infer's flag)
        sys.exit(f"--prompt-tokens {args.prompt_tokens} + --new-tokens {args.new_tokens} exceed the model's context "
                 f"{eng.context}")
    one_pass = min(eng.cfg.n_experts, args.prompt_tokens * eng.cfg.top_k)  # the most a layer's prefill asks for
    if min(caps) < one_pass:
        sys.exit(f"--capacities {min(caps)}: below the {one_pass} experts one layer's prefill of {args.prompt_tokens} "
                 f"tokens can ask for at once; use >= {one_pass} or fewer --prompt-tokens")
    traces = record(eng, args.prompts, args.seed, args.prompt_tokens, args.new_tokens)
    layers = [m.layer for m in eng.moes]
    policies = [("lru", None)] + [("score", d) for d in decays] + [("belady", None)]
    rows = []
    print(f"\n{'experts':>8} " + " ".join(f"{p + (f' {d}' if d is not None else ''):>11}" for p, d in policies))
    for cap in caps:
        row, start = {"capacity_experts": cap}, EC.partial_preload_keys(layers, eng.cfg.n_experts, cap)
        for policy, d in policies:
            miss = look = 0
            for trace, observed, first in traces:
                m, n, _ = replay(policy, start, {}, observed, trace, cap, decay=d, count_from=first)
                miss, look = miss + m, look + n
            row[policy + (f"_{d}" if d is not None else "")] = 1 - miss / max(look, 1)
        rows.append(row)
        print(f"{cap:8d} " + " ".join(f"{v:11.3f}" for k, v in row.items() if k != "capacity_experts"), flush=True)
    print(f"decode hit rate over {args.prompts} prompts ({args.prompt_tokens} prompt + {args.new_tokens} greedy tokens "
          f"each, seeds {args.seed}..{args.seed + args.prompts - 1}); belady knows the future: a reference")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"container": args.container, "prompts": args.prompts, "seed": args.seed, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
