"""
Prefill speed against the prefill chunk: one engine under --ram-budget (its budget reserves the largest chunk's
activations), fresh random prompts of --prompt-tokens, each chunk size in turn for --reps rounds; prompt tok/s and
expert reads per run, then the medians. Each pass over a chunk reads every expert its tokens route to, so under a
small budget a larger chunk reads each expert fewer times per prompt.

    python bench/prefill_chunk.py micro.pcf4 --ram-budget 1G [--chunks 64,256] [--prompt-tokens 256] [--json OUT]

Not a memory-limited cgroup and no page-cache drop (stream_infer --bench does that): O_DIRECT reads already
bypass the page cache, and every chunk size runs in the same process under the same budget.
"""
import argparse
import json
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")  # as stream_infer.py sets when run as a script
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import stream_infer as S  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("container")
    ap.add_argument("--ram-budget", required=True)
    ap.add_argument("--chunks", default="64,256", help="prefill chunk sizes to compare (tokens per pass)")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json")
    args = ap.parse_args()
    try:
        chunks = [int(c) for c in args.chunks.split(",")]
        assert chunks and min(chunks) >= 1
    except (ValueError, AssertionError):
        sys.exit(f"--chunks {args.chunks!r}: comma-separated positive token counts, e.g. 64,256")
    if args.reps < 1 or args.prompt_tokens < 1 or args.threads < 1:
        sys.exit("--reps, --prompt-tokens and --threads must be at least 1")
    if not os.path.exists(args.container):
        sys.exit(f"{args.container}: no such container (python container.py --random-config config/micro.py --out ...)")
    torch.set_num_threads(args.threads)
    try:
        eng = S.load(args.container, ram_budget=args.ram_budget, prefill_chunk=max(chunks),
                     context=max(512, args.prompt_tokens))
    except S.StreamError as e:
        sys.exit(f"error: {e}")
    gen = torch.Generator().manual_seed(0)
    runs = {c: [] for c in chunks}
    for rep in range(args.reps):
        for c in chunks:
            eng.prefill_chunk = c
            ids = torch.randint(1, eng.cfg.vocab_size, (1, args.prompt_tokens), generator=gen)
            reads0 = eng.cache.reads
            kv = S.KVCache(eng.cfg, 1, args.prompt_tokens, eng.device, torch.float32)
            t0 = time.perf_counter()
            eng.forward(ids, kv)
            dt = time.perf_counter() - t0
            eng.cache.settle()
            run = {"prefill_tok_s": args.prompt_tokens / dt, "expert_reads": eng.cache.reads - reads0}
            runs[c].append(run)
            print(f"chunk {c:4d} round {rep + 1}: {run['prefill_tok_s']:.1f} tok/s, {run['expert_reads']} expert reads",
                  flush=True)
    res = {"container": args.container, "ram_budget": args.ram_budget, "prompt_tokens": args.prompt_tokens,
           "threads": args.threads, "runs": {str(c): r for c, r in runs.items()}}
    for c in chunks:
        v = sorted(r["prefill_tok_s"] for r in runs[c])
        res[f"median_prefill_tok_s_chunk_{c}"] = v[len(v) // 2]
    print(f"median prefill tok/s at {args.ram_budget}, {args.prompt_tokens}-token prompts: "
          + ", ".join(f"chunk {c} {res[f'median_prefill_tok_s_chunk_{c}']:.1f}" for c in chunks))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
