"""
Training-step throughput: picaflor vs transformers' HYV3ForCausalLM (the reference implementation of the same
architecture), on this machine's CPU, in fp32.

One "step" = forward + backward + AdamW step, with the same config, the same weights and the same batch for
both implementations, alternated A B A B ... in one process so that machine noise (other jobs on shared cores)
hits both alike; figures are medians over the rounds.

  (a) the MoE layer alone at nano width: d_model 1024, 64 experts x 512, top-2, shared width 2048, 2048 tokens
      (input (1, 2048, 1024) with requires_grad, a fixed random upstream gradient);
  (b) a 4-layer nano-width model (1 dense + 3 MoE layers, 16 heads / 4 kv heads, dense ffn 4096) on a batch
      of 2 x 1024 tokens with an LM loss. Vocab 8192 by default (--vocab), not nano's 32768, to keep two
      models' weights, grads and AdamW states within a shared 2-core box's memory; the lm_head is then ~3% of
      the active matmul work instead of ~11%.

FLOPs are active-parameter FLOPs: 6 * N_active per token for forward + backward (Kaplan et al. 2020,
arXiv 2001.08361 sec. 2.1), where N_active counts the matmul weights a token touches (router, top_k routed
experts, shared expert, attention, dense FFN, lm_head; no embedding lookup, no norms); attention's
sequence-length term is left out. Peak = the best of several fp32 (2048 x 2048) @ (2048 x 2048) matmuls timed
in this same run.

transformers runs with its defaults (experts_implementation as HYV3ForCausalLM picks it, sdpa attention);
the script prints which.

    python bench/train_step.py                 # full run (a few minutes on 2 cores)
    python bench/train_step.py --quick         # short smoke run
    python bench/train_step.py --json out.json
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

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


HF_EXPERTS = "default"


def hf_model(cfg):
    import transformers
    hc = transformers.HYV3Config(**M.to_hf_config(cfg))
    kw = {} if HF_EXPERTS == "default" else {"experts_implementation": HF_EXPERTS}
    return transformers.HYV3ForCausalLM._from_config(hc, **kw)


def moe_active_params(cfg):
    """Matmul weights one token touches in one MoE layer: router, top_k routed experts, shared expert."""
    D, F_ = cfg.d_model, cfg.expert_ffn
    return cfg.n_experts * D + cfg.top_k * 3 * D * F_ + 3 * D * cfg.n_shared * F_


def model_active_matmul_params(model):
    c = model.cfg
    n = model.active_params(include_embedding=False)
    n -= sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    return n


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


def medians(times):
    return statistics.median(w for w, _ in times), statistics.median(c for _, c in times)


def bench_moe_layer(tokens, rounds, warmup, lr=1e-4):
    cfg = nano_width_config(n_layer=2, vocab_size=256)
    hf = hf_model(cfg)
    hf_moe = hf.model.layers[1].mlp
    impl = hf.config._experts_implementation
    torch.manual_seed(0)
    with torch.no_grad():  # HF's own init for experts is N(0, 0.02) everywhere; use a realistic picaflor init
        for p in hf_moe.parameters():
            p.normal_(0.0, 0.02)
    pf_moe = M.MoE(cfg)
    pf_moe.load_state_dict({k: v for k, v in hf_moe.state_dict().items()}, strict=False)
    del hf
    pf_moe.train(), hf_moe.train()
    x0 = torch.randn(1, tokens, cfg.d_model)
    gy = torch.randn(1, tokens, cfg.d_model)
    opts = [torch.optim.AdamW(m.parameters(), lr=lr, fused=True) for m in (pf_moe, hf_moe)]

    def make_step(m, opt):
        def step():
            x = x0.clone().requires_grad_(True)
            y = m(x)
            y.backward(gy)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    times = time_steps([make_step(pf_moe, opts[0]), make_step(hf_moe, opts[1])], rounds, warmup)
    flops = 6 * moe_active_params(cfg) * tokens
    return times, flops, impl


def bench_model(batch, seq_len, vocab, rounds, warmup, lr=1e-4):
    cfg = nano_width_config(n_layer=4, vocab_size=vocab)
    torch.manual_seed(0)
    pf = M.Picaflor(cfg)
    hf = hf_model(cfg)
    impl = hf.config._experts_implementation
    # the HF model takes picaflor's very Parameter objects: same weights, and one AdamW serves both, which
    # halves the memory (weights, grads and optimizer state exist once)
    for name, p in pf.named_parameters():
        parent, leaf = M.hf_name(name).rsplit(".", 1)
        setattr(hf.get_submodule(parent), leaf, p)
    for m_pf, layer in zip(pf.layers, hf.model.layers):
        if m_pf.is_moe:
            layer.mlp.e_score_correction_bias = m_pf.mlp.e_score_correction_bias
    pf.train(), hf.train()
    opt = torch.optim.AdamW(pf.parameters(), lr=lr, fused=True)
    idx = torch.randint(1, vocab, (batch, seq_len + 1))
    inp, tgt = idx[:, :-1], idx[:, 1:]

    def pf_step():
        _, loss = pf(inp, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def hf_step():
        loss = hf(input_ids=inp, labels=None, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(loss.float().view(-1, vocab), tgt.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = time_steps([pf_step, hf_step], rounds, warmup)
    flops = 6 * model_active_matmul_params(pf) * batch * seq_len
    return times, flops, impl


def report(res, key, title, times, flops, n_tokens):
    (pf_s, pf_c), (hf_s, hf_c) = medians(times[0]), medians(times[1])
    pf_best, hf_best = min(w for w, _ in times[0]), min(w for w, _ in times[1])
    res[f"{key}_ratio"] = hf_s / pf_s
    res[f"{key}_ratio_best"] = hf_best / pf_best
    res[f"{key}_ratio_cpu_time"] = hf_c / pf_c
    res[f"{key}_tokens_per_s"] = {"picaflor": n_tokens / pf_s, "transformers": n_tokens / hf_s}
    res[f"{key}_gflops"] = {"picaflor": flops / pf_s / 1e9, "transformers": flops / hf_s / 1e9}
    res[f"{key}_gflops_best"] = {"picaflor": flops / pf_best / 1e9, "transformers": flops / hf_best / 1e9}
    res[f"{key}_cpu_s"] = {"picaflor": pf_c, "transformers": hf_c}
    print(title + ":")
    print("    (median wall time per step, then the best round's, then median process CPU time)")
    for name, s, b, c in (("picaflor", pf_s, pf_best, pf_c), ("transformers", hf_s, hf_best, hf_c)):
        print(f"    {name:12s} {s * 1e3:8.1f} ms {n_tokens / s:7.0f} tok/s {flops / s / 1e9:6.1f} GFLOP/s | best "
              f"{b * 1e3:8.1f} ms {flops / b / 1e9:6.1f} GFLOP/s | CPU {c:.2f} s")
    print(f"    ratio {res[key + '_ratio']:.2f}x (best {res[key + '_ratio_best']:.2f}x, "
          f"CPU time {res[key + '_ratio_cpu_time']:.2f}x)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few rounds, fewer tokens: a smoke run (~1 min)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per implementation (default 6, quick 2)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per step for the MoE layer (default 2048)")
    ap.add_argument("--vocab", type=int, default=8192, help="vocab of the 4-layer model (default 8192)")
    ap.add_argument("--skip-model", action="store_true", help="only the MoE layer")
    ap.add_argument("--hf-experts", default="default", choices=["default", "eager", "grouped_mm", "batched_mm"],
                    help="transformers' experts_implementation (default: what HYV3ForCausalLM picks)")
    ap.add_argument("--no-malloc-tune", action="store_true", help="skip model.tune_cpu_malloc() (glibc heap reuse)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument("--json", metavar="OUT", help="write {moe_layer_ratio, model_ratio, gflops, peak_gflops, ...}")
    args = ap.parse_args()
    rounds = args.rounds or (2 if args.quick else 6)
    warmup = 1
    tokens = 512 if args.quick else args.tokens
    batch, seq_len = (1, 512) if args.quick else (2, 1024)
    torch.manual_seed(0)
    global HF_EXPERTS
    HF_EXPERTS = args.hf_experts
    tuned = False if args.no_malloc_tune else M.tune_cpu_malloc()
    if args.threads:
        torch.set_num_threads(args.threads)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, malloc tune {'on' if tuned else 'off'}, "
          f"{rounds} timed rounds (+{warmup} warm-up), medians")
    peaks = [matmul_peak_gflops()]
    res = {}

    times, flops, impl = bench_moe_layer(tokens, rounds, warmup)
    peaks.append(matmul_peak_gflops())
    report(res, "moe_layer", f"(a) MoE layer, {tokens} tokens, fwd+bwd+AdamW (transformers experts_implementation="
           f"{impl})", times, flops, tokens)

    if not args.skip_model:
        times, flops, impl = bench_model(batch, seq_len, args.vocab, rounds, warmup)
        peaks.append(matmul_peak_gflops())
        report(res, "model", f"(b) 4-layer nano-width model (vocab {args.vocab}), {batch}x{seq_len} tokens, "
               f"fwd+bwd+AdamW", times, flops, batch * seq_len)

    peak = max(peaks)
    res["peak_gflops"] = peak
    res["gflops"] = res["moe_layer_gflops"]["picaflor"]
    line = (f"fp32 matmul peak {peak:.1f} GFLOP/s (best of {len(peaks)} probes); picaflor MoE layer at "
            f"{100 * res['gflops'] / peak:.0f}% of peak (best round {100 * res['moe_layer_gflops_best']['picaflor'] / peak:.0f}%)")
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
