"""
How well can an MoE layer's experts be guessed one or two layers early? stream_infer's --prefetch reads the next
layer's experts while this layer computes, naming them by the NEXT layer's router applied to THIS layer's hidden
state (mixtral-offloading's speculative guess); each wrong guess is a wasted read. On micro's random weights about
40% of guesses were wrong and prefetch never won (bench/STREAMING_LOG.md). This measures the same guess on a
trained checkpoint against a random-initialised model of its config, on the same tokens, in one run, without
timing, so the figures hold on any machine.

    python bench/route_guess.py out/tiny --corpus data/local [--tokens 16384] [--seq-len 128] [--json OUT]
    python bench/route_guess.py config/tiny.py                          # a config alone: random weights only

Per pair of MoE layers (L, L+d), d = 1 and 2, over every token, the share of layer L+d's top_k picks named by
  moe_input:  L+d's router (its bias too) on layer L's MoE input; at d = 1 the guess --prefetch makes (in its
              top_k / 2 top_k)
  residual:   L+d's router on layer L's output through L+d's post-attention norm (at d = 1 the latest point before
              L+1's attention; a guess this late would overlap only that attention)
  popular:    L+d's top_k most used experts over these tokens, the same for every token (what any cache already
              keeps; a guess must beat it to be worth a read)
Chance is top_k / n_experts. A guess one layer ahead has one layer's compute (~2-3 ms on micro) to land a read of
about as long; two layers ahead, twice that.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import checkpoint  # noqa: E402
from model import ModelConfig, Picaflor, load_checkpoint  # noqa: E402


def load_models(source, seed, with_random=True):
    """[(label, model)]: the checkpoint and (with_random) a random-initialised model of its config, or a config
    file's random model alone."""
    if source.endswith(".py"):
        g = {}
        with open(source) as f:  # a config file sets model fields as globals, as `python model.py CONFIG` reads it
            exec(compile(f.read(), source, "exec"), g)
        cfg = ModelConfig.from_dict({k: v for k, v in g.items() if k in ModelConfig.__dataclass_fields__})
        trained = None
    else:
        trained = load_checkpoint(source)
        cfg = trained.cfg
    models = [("trained", trained)] if trained is not None else []
    if with_random or trained is None:
        torch.manual_seed(seed)
        models.append(("random init", Picaflor(cfg).eval()))
    return models


def token_windows(args, vocab_size):
    """(N, seq_len) int64 windows: a corpus's val split, or random ids when there is none."""
    n = max(1, args.tokens // args.seq_len)
    if args.corpus:
        import shards
        stream = shards.TokenStream(args.corpus, "val", vocab_size=vocab_size)
        if stream.total_tokens - 1 < n * args.seq_len:
            n = (stream.total_tokens - 1) // args.seq_len
            if n < 1:
                raise SystemExit(f"route_guess: {args.corpus}: val split has {stream.total_tokens} tokens, "
                                 f"need at least {args.seq_len + 1}; pass a smaller --seq-len")
        x, _ = stream.next_batch(n, args.seq_len)
        return x
    g = torch.Generator().manual_seed(args.seed)
    return torch.randint(1, vocab_size, (n, args.seq_len), generator=g)


def recall(guess_idx, true_idx):
    """Share of the true picks that the guess names (both [T, k'] expert ids)."""
    hit = (guess_idx.unsqueeze(-1) == true_idx.unsqueeze(-2)).any(dim=-2)  # [T, k]: true pick j was guessed
    return hit.float().mean().item()


@torch.no_grad()
def measure(model, windows, batch_size):
    """{"L->L+d": {guess: recall}} over every token, pairs of MoE layers d = 1 and 2 apart."""
    cfg = model.cfg
    moe_layers = [i for i, b in enumerate(model.layers) if b.is_moe]
    moe_in, block_out = {}, {}
    hooks = []
    for i in moe_layers:
        blk = model.layers[i]
        hooks.append(blk.mlp.register_forward_pre_hook(lambda m, a, i=i: moe_in.setdefault(i, []).append(
            a[0].reshape(-1, cfg.d_model).float())))
        hooks.append(blk.register_forward_hook(lambda m, a, out, i=i: block_out.setdefault(i, []).append(
            out.reshape(-1, cfg.d_model).float())))
    try:
        for s in range(0, windows.shape[0], batch_size):
            model(windows[s: s + batch_size])
    finally:
        for h in hooks:
            h.remove()
    k, E = cfg.top_k, cfg.n_experts
    result = {}
    pairs = [(d, a, b) for d in (1, 2) for a, b in zip(moe_layers, moe_layers[d:])]
    for d, a, b in pairs:
        nxt = model.layers[b]
        x_a, x_b = torch.cat(moe_in[a]), torch.cat(moe_in[b])
        sel = lambda x: torch.sigmoid(x @ nxt.mlp.gate.weight.float().T) + nxt.mlp.e_score_correction_bias
        true_idx = sel(x_b).topk(k, dim=-1).indices
        by_moe_input = sel(x_a).topk(min(2 * k, E), dim=-1).indices
        by_residual = sel(nxt.post_attention_layernorm(torch.cat(block_out[a])).float()).topk(min(2 * k, E),
                                                                                               dim=-1).indices
        popular = torch.bincount(true_idx.reshape(-1), minlength=E).topk(k).indices.expand(true_idx.shape[0], k)
        result[f"{a}->{b}"] = {
            "ahead": d,
            "moe_input_top_k": recall(by_moe_input[:, :k], true_idx),
            "moe_input_top_2k": recall(by_moe_input, true_idx),
            "residual_top_k": recall(by_residual[:, :k], true_idx),
            "residual_top_2k": recall(by_residual, true_idx),
            "popular_top_k": recall(popular, true_idx),
        }
    return result


def print_row(label, pairs, r):
    print(f"{label:12} {pairs:>8} {r['moe_input_top_k']:>8.3f} / {r['moe_input_top_2k']:.3f} "
          f"{r['residual_top_k']:>7.3f} / {r['residual_top_2k']:.3f} {r['popular_top_k']:>10.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", help="checkpoint (run dir or step dir) or config file (random weights only)")
    ap.add_argument("--corpus", help="corpus dir whose val split is read (default: random token ids)")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--no-random", action="store_true",
                    help="the checkpoint alone (a big model and its random twin may not both fit in RAM)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    if not os.path.exists(args.source):
        raise SystemExit(f"route_guess: {args.source}: no such checkpoint or config")
    if args.seq_len < 2 or args.tokens < args.seq_len or args.batch_size < 1:
        raise SystemExit("route_guess: --seq-len at least 2, --tokens at least --seq-len, --batch-size at least 1")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise SystemExit(f"route_guess: --json {args.json}: its folder does not exist")
    try:
        models = load_models(args.source, args.seed, with_random=not args.no_random)
    except (checkpoint.CheckpointError, OSError, ValueError, KeyError, TypeError, SyntaxError) as e:  # corrupt, malformed
        raise SystemExit(f"route_guess: {e}" if args.source in str(e) else f"route_guess: {args.source}: {e}") from None
    cfg = models[0][1].cfg
    if args.seq_len > cfg.max_seq_len:
        raise SystemExit(f"route_guess: --seq-len {args.seq_len}: the model's max_seq_len is {cfg.max_seq_len}")
    try:
        windows = token_windows(args, cfg.vocab_size)
    except Exception as e:  # a missing or corrupt corpus (shards.DataError), one line
        raise SystemExit(f"route_guess: {e}" if str(args.corpus) in str(e) else f"route_guess: {args.corpus}: {e}") from None
    k, E = cfg.top_k, cfg.n_experts
    print(f"{args.source}: {len(windows) * args.seq_len} tokens ({args.corpus or 'random ids'}), top_k {k} of {E} "
          f"experts (chance {k / E:.3f}); share of layer L+d's picks named d layers early")
    print(f"{'model':12} {'layers':>8} {'moe_input k / 2k':>18} {'residual k / 2k':>17} {'popular k':>10}")
    report = {"source": args.source, "tokens": len(windows) * args.seq_len, "top_k": k, "n_experts": E,
              "corpus": args.corpus, "models": {}}
    for label, model in models:
        res = measure(model, windows, args.batch_size)
        report["models"][label] = {"pairs": res}
        for pair, r in res.items():
            print_row(label, pair, r)
        for d in (1, 2):
            rows = [r for r in res.values() if r["ahead"] == d]
            if not rows:
                continue
            mean = {key: sum(r[key] for r in rows) / len(rows) for key in rows[0] if key != "ahead"}
            report["models"][label][f"mean_{d}_ahead"] = mean
            print_row(label, f"mean +{d}", mean)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
