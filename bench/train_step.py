"""
Training-step throughput: picaflor vs transformers' HYV3ForCausalLM (the reference implementation of the same
architecture), on this machine's CPU, in fp32.

One "step" = forward + backward + AdamW step (fused AdamW, the fast one on CPU, for both), with the same config,
the same weights and the same batch, alternated A B B A ... in one process so that machine noise (other jobs on
shared cores) hits both alike. The transformers modules are handed picaflor's very Parameter objects, so the
weights are identical by construction and exist once in memory (one optimizer steps them).

  (a) the MoE layer alone at nano width: d_model 1024, 64 experts x 512, top-2, shared width 2048, 2048 tokens
      (input (1, 2048, 1024) with requires_grad, a fixed random upstream gradient). transformers' HYV3MoE is
      taken out of an HYV3ForCausalLM, so it runs the experts_implementation that model picks by default
      (grouped_mm, i.e. torch._grouped_mm like picaflor, in transformers 5.24 + torch 2.13), and also, unless
      --no-eager, with experts_implementation="eager" (HYV3's own per-expert loop, what an HYV3MoE built on its
      own runs). (b) compares the same two transformers variants.
  (b) a 4-layer nano-width model (1 dense + 3 MoE layers, 16 heads / 4 kv heads, dense ffn 4096) on a batch
      of 2 x 1024 tokens with an LM loss. Vocab 8192 by default (--vocab), not nano's 32768, to keep memory
      small on a shared box; the lm_head is then ~3% of the active matmul work instead of ~11%.

Figures per implementation: median wall time per step (what the issue asks), the best round (closest to an idle
machine), and median process CPU time. FLOPs are active-parameter FLOPs: 6 * N_active per token for forward +
backward (Kaplan et al. 2020, arXiv 2001.08361 sec. 2.1), N_active = the matmul weights a token touches (router,
top_k routed experts, shared expert, attention, dense FFN, lm_head; no embedding lookup, no norms; attention's
sequence-length term left out). Peak = the best of several fp32 2048^3 matmuls timed in this same run.
model.tune_cpu_malloc() is applied (process-wide, so to both) unless --no-malloc-tune, and OMP_WAIT_POLICY is
PASSIVE unless set otherwise or --omp-spin (both help either implementation alike on a shared CPU).

    python bench/train_step.py                 # full run (~10 min on 2 busy cores)
    python bench/train_step.py --quick         # short smoke run
    python bench/train_step.py --json out.json # {"moe_layer_ratio", "model_ratio", "gflops", "peak_gflops", ...}
"""

import argparse
import json
import os
import statistics
import sys
import time

# OpenMP threads that spin while waiting for work burn the cores other jobs need, and on a shared, busy box they
# made a nano-width MoE step 2x slower in wall time (5x in CPU time); sleeping waiters avoid that. libgomp reads
# this when torch loads it, so it is set before the import; --omp-spin keeps the OpenMP default.
if "--omp-spin" not in sys.argv:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model as M  # noqa: E402


def nano_width_config(n_layer, vocab_size, n_dense_layers=1):
    return M.ModelConfig(vocab_size=vocab_size, n_layer=n_layer, n_dense_layers=n_dense_layers, d_model=1024,
                         n_head=16, n_kv_head=4, dense_ffn=4096, n_experts=64, expert_ffn=512, n_shared=4,
                         top_k=2, max_seq_len=2048)


def matmul_peak_gflops(n=2048, reps=8):
    """Best fp32 GEMM rate of this machine right now (2 n^3 FLOPs per n x n @ n x n)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)  # warm-up
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


def hf_model(cfg, experts="default"):
    """HYV3ForCausalLM as transformers builds it; experts="default" keeps its own experts_implementation choice."""
    import transformers
    hc = transformers.HYV3Config(**M.to_hf_config(cfg))
    kw = {} if experts == "default" else {"experts_implementation": experts}
    return transformers.HYV3ForCausalLM._from_config(hc, **kw)


def share_parameters(pf, hf, hf_name=lambda n: n):
    """Make hf use pf's very Parameter objects (and selection-bias buffers): same weights by construction, one
    AdamW serves both, and weights, grads and optimizer state exist once in memory."""
    for name, p in pf.named_parameters():
        parent, _, leaf = hf_name(name).rpartition(".")
        setattr(hf.get_submodule(parent), leaf, p)
    for name, b in pf.named_buffers():
        if name.endswith("e_score_correction_bias"):
            parent, _, leaf = hf_name(name).rpartition(".")
            setattr(hf.get_submodule(parent), leaf, b)


def moe_active_params(cfg):
    """Matmul weights one token touches in one MoE layer: router, top_k routed experts, shared expert."""
    D, F_ = cfg.d_model, cfg.expert_ffn
    return cfg.n_experts * D + cfg.top_k * 3 * D * F_ + 3 * D * cfg.n_shared * F_


def model_active_matmul_params(model):
    n = model.active_params(include_embedding=False)
    return n - sum(p.numel() for name, p in model.named_parameters() if "norm" in name)


def time_steps(step_fns, rounds, warmup):
    """Run each fn in step_fns alternately; returns per-fn lists of (wall s, process CPU s) after warm-up.
    CPU time is printed too: on a shared, oversubscribed box it says what wall time would be on idle cores."""
    times = [[] for _ in step_fns]
    for r in range(warmup + rounds):
        order = range(len(step_fns)) if r % 2 == 0 else reversed(range(len(step_fns)))  # ABBA: no position bias
        for i in order:
            t, c = time.perf_counter(), time.process_time()
            step_fns[i]()
            if r >= warmup:
                times[i].append((time.perf_counter() - t, time.process_time() - c))
    return times


def bench_moe_layer(tokens, rounds, warmup, hf_variants, lr=1e-4):
    """(a): picaflor's MoE block vs HYV3MoE taken from HYV3ForCausalLM (one per experts_implementation)."""
    cfg = nano_width_config(n_layer=2, vocab_size=256)
    torch.manual_seed(0)
    pf_moe = M.MoE(cfg)
    with torch.no_grad():  # picaflor's init: N(0, 0.02), zero bias
        for p in pf_moe.parameters():
            p.normal_(0.0, 0.02)
    names, mods = ["picaflor"], [pf_moe]
    for experts in hf_variants:
        hf = hf_model(cfg, experts)
        hf_moe = hf.model.layers[1].mlp  # keeps the HF config (and so its experts_implementation) it was built with
        share_parameters(pf_moe, hf_moe)
        names.append(f"transformers[{hf.config._experts_implementation}]")
        mods.append(hf_moe)
        del hf
    opt = torch.optim.AdamW(pf_moe.parameters(), lr=lr, fused=True)  # fused: one pass over the weights on CPU
    x0 = torch.randn(1, tokens, cfg.d_model)
    gy = torch.randn(1, tokens, cfg.d_model)  # a fixed upstream gradient

    def make_step(m):
        def step():
            x = x0.clone().requires_grad_(True)
            m(x).backward(gy)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    for m in mods:
        m.train()
    times = time_steps([make_step(m) for m in mods], rounds, warmup)
    return names, times, 6 * moe_active_params(cfg) * tokens


def bench_model(batch, seq_len, vocab, rounds, warmup, hf_variants, lr=1e-4):
    """(b): a 4-layer nano-width model, LM loss on a fixed random batch."""
    cfg = nano_width_config(n_layer=4, vocab_size=vocab)
    torch.manual_seed(0)
    pf = M.Picaflor(cfg)
    names, models = ["picaflor"], [pf]
    for experts in hf_variants:
        hf = hf_model(cfg, experts)
        share_parameters(pf, hf, M.hf_name)
        names.append(f"transformers[{hf.config._experts_implementation}]")
        models.append(hf)
    opt = torch.optim.AdamW(pf.parameters(), lr=lr, fused=True)
    idx = torch.randint(1, vocab, (batch, seq_len + 1))
    inp, tgt = idx[:, :-1], idx[:, 1:]

    def pf_step():
        _, loss = pf(inp, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def make_hf_step(hf):
        def step():  # the same loss as picaflor's (fp32 cross-entropy over all positions)
            logits = hf(input_ids=inp, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits.float().view(-1, vocab), tgt.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    for m in models:
        m.train()
    times = time_steps([pf_step] + [make_hf_step(hf) for hf in models[1:]], rounds, warmup)
    return names, times, 6 * model_active_matmul_params(pf) * batch * seq_len


def medians(times):
    return statistics.median(w for w, _ in times), statistics.median(c for _, c in times)


def report(res, key, title, names, times, flops, n_tokens):
    """Print each implementation's figures; res gets {key}_ratio (vs the first transformers variant: its
    default), {key}_ratio_<impl> for any others, and per-implementation tokens/s and GFLOP/s."""
    print(title + ":  (median wall time per step | the best round | median process CPU time)")
    stats = []
    for name, t in zip(names, times):
        s, c = medians(t)
        b = min(w for w, _ in t)
        stats.append((s, b, c))
        print(f"    {name:26s} {s * 1e3:8.1f} ms {n_tokens / s:7.0f} tok/s {flops / s / 1e9:6.1f} GFLOP/s | "
              f"{b * 1e3:8.1f} ms {flops / b / 1e9:6.1f} GFLOP/s | CPU {c:.2f} s")
        res.setdefault(f"{key}_tokens_per_s", {})[name] = n_tokens / s
        res.setdefault(f"{key}_gflops", {})[name] = flops / s / 1e9
        res.setdefault(f"{key}_gflops_best", {})[name] = flops / b / 1e9
        res.setdefault(f"{key}_cpu_s", {})[name] = c
    (pf_s, pf_b, pf_c) = stats[0]
    for i, ((s, b, c), name) in enumerate(zip(stats[1:], names[1:])):
        suffix = "" if i == 0 else "_" + name.split("[")[1].rstrip("]")
        res[f"{key}_ratio{suffix}"] = s / pf_s
        res[f"{key}_ratio{suffix}_best"] = b / pf_b
        res[f"{key}_ratio{suffix}_cpu_time"] = c / pf_c
        print(f"    picaflor vs {name}: {s / pf_s:.2f}x (best rounds {b / pf_b:.2f}x, CPU time {c / pf_c:.2f}x)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 rounds, 512 tokens: a smoke run (a few minutes)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per implementation (default 5, quick 2)")
    ap.add_argument("--tokens", type=int, default=None,
                    help="tokens per step for the MoE layer (default 2048, quick 512)")
    ap.add_argument("--vocab", type=int, default=8192, help="vocab of the 4-layer model (default 8192)")
    ap.add_argument("--skip-model", action="store_true", help="only the MoE layer")
    ap.add_argument("--no-eager", action="store_true",
                    help="skip the extra comparison with transformers' eager per-expert loop")
    ap.add_argument("--no-malloc-tune", action="store_true", help="skip model.tune_cpu_malloc() (glibc heap reuse)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument("--omp-spin", action="store_true", help="keep OpenMP's default wait policy (default: PASSIVE)")
    ap.add_argument("--json", metavar="OUT", help="write {moe_layer_ratio, model_ratio, gflops, peak_gflops, ...}")
    args = ap.parse_args()
    if args.rounds is not None and args.rounds < 1:  # (0 became 5, silently)
        ap.error("--rounds: at least 1")
    if args.tokens is not None and args.tokens < 1:
        ap.error("--tokens: at least 1")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):  # (found after ~10 minutes)
        ap.error(f"--json {args.json}: its folder does not exist")
    rounds = args.rounds or (2 if args.quick else 5)
    warmup = 1
    tokens = args.tokens or (512 if args.quick else 2048)  # (--quick --tokens N ran 512, silently)
    batch, seq_len = (1, 512) if args.quick else (2, 1024)
    torch.manual_seed(0)
    tuned = False if args.no_malloc_tune else M.tune_cpu_malloc()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, "
          f"malloc tune {'on' if tuned else 'off'}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}, "
          f"{rounds} timed rounds (+{warmup} warm-up), alternated")
    peaks = [matmul_peak_gflops()]
    res = {}

    hf_variants = ["default"] + ([] if args.no_eager else ["eager"])
    names, times, flops = bench_moe_layer(tokens, rounds, warmup, hf_variants)
    peaks.append(matmul_peak_gflops())
    report(res, "moe_layer", f"(a) MoE layer, {tokens} tokens, fwd+bwd+AdamW", names, times, flops, tokens)

    if not args.skip_model:
        names, times, flops = bench_model(batch, seq_len, args.vocab, rounds, warmup, hf_variants)
        peaks.append(matmul_peak_gflops())
        report(res, "model", f"(b) 4-layer nano-width model (vocab {args.vocab}), {batch}x{seq_len} tokens, "
               f"fwd+bwd+AdamW", names, times, flops, batch * seq_len)

    peak = max(peaks)
    res["peak_gflops"] = peak
    res["gflops"] = res["moe_layer_gflops"]["picaflor"]
    res["model_ratio"] = res.get("model_ratio")
    best = res["moe_layer_gflops_best"]["picaflor"]
    line = (f"fp32 matmul peak {peak:.1f} GFLOP/s (best of {len(peaks)} probes); picaflor MoE layer at "
            f"{100 * res['gflops'] / peak:.0f}% of peak (best round {100 * best / peak:.0f}%)")
    if "model_gflops" in res:
        line += (f", 4-layer model at {100 * res['model_gflops']['picaflor'] / peak:.0f}% "
                 f"(best round {100 * res['model_gflops_best']['picaflor'] / peak:.0f}%)")
    print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
