"""
Quality cost of the int4 container: validation perplexity of the checkpoint and of its int4 container on the
same tokens, and the relative increase (issue 6 goal: <= 2% on a trained tiny model).

    python bench/quant_quality.py CKPT --corpus data/local [--container model.pcf4] [--json OUT]
    python bench/quant_quality.py CKPT --tokens tokens.bin           # raw uint16 tokens (a shard) or .npy

CKPT is a checkpoint dir or run dir. Without --container the container is written to a temp file with
container.write_container (--group-size / --embed-bits as export.py). Tokens: the corpus's val split read
through shards.TokenStream (verified as training reads it), or a token file; non-overlapping windows of
--seq-len + 1 tokens, the first --max-tokens of them. The two models run one after the other, so only one is in
memory at a time. The int4 side runs through stream_infer's engine (--engine stream_infer, or auto, the default,
when stream_infer.py provides `load(...).loglikelihood`), which computes in fp32, so the checkpoint is scored in
fp32 too, whatever --dtype says (a note on stderr: a bf16 reference counted its own rounding as int4's); with
--engine dequantize both run in --dtype (default bfloat16; the router and its bias stay fp32 as in
load_checkpoint), the int4 side as container.load_container(...).dequantized_state_dict() in a model.Picaflor
(the same forward as the reference, so the difference is the quantization alone).
perplexity = exp(mean next-token NLL over all predicted tokens).
"""

import argparse
import json
import math
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import checkpoint  # noqa: E402
from model import load_checkpoint, meta_model  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def token_windows(args, vocab_size):
    """(N, seq_len + 1) int64 windows: the val split of a corpus, or a token file."""
    W = args.seq_len + 1
    if args.tokens:
        if args.tokens.endswith(".npy"):
            toks = np.load(args.tokens, allow_pickle=False)
        else:
            toks = np.fromfile(args.tokens, dtype="<u2")
        toks = np.asarray(toks, dtype=np.int64).reshape(-1)[: args.max_tokens + 1]
        if toks.size and (toks.max() >= vocab_size or toks.min() < 0):
            raise ValueError(f"{args.tokens}: token id {int(toks.max())} >= model vocab_size {vocab_size}; "
                             f"tokens from another tokenizer?")
        n = (toks.size - 1) // args.seq_len
        if n < 1:
            raise ValueError(f"{args.tokens}: {toks.size} tokens, need at least {W}")
        return torch.from_numpy(np.stack([toks[i * args.seq_len: i * args.seq_len + W] for i in range(n)]))
    import shards
    stream = shards.TokenStream(args.corpus, "val", vocab_size=vocab_size)
    n = min(args.max_tokens, stream.total_tokens - 1) // args.seq_len
    if n < 1:
        raise ValueError(f"{args.corpus}: val split has {stream.total_tokens} tokens, need at least {W}")
    x, y = stream.next_batch(n, args.seq_len)  # row j = stream[j*T : j*T + T + 1]
    return torch.cat([x, y[:, -1:]], dim=1)


@torch.no_grad()
def nll_of(model, windows, batch_size):
    """Sum of next-token NLL and the number of predicted tokens."""
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        w = windows[i: i + batch_size]
        logits = model(w[:, :-1]).float()
        total += F.cross_entropy(logits.reshape(-1, logits.size(-1)), w[:, 1:].reshape(-1), reduction="sum").item()
        count += w[:, 1:].numel()
    return total, count


def model_from_state_dict(cfg, sd, dtype):
    """A Picaflor from a plain state dict (the dequantized container), cast as load_checkpoint casts."""
    model = meta_model(cfg)
    model.to_empty(device="cpu")
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not m.endswith("load_accum") and not (cfg.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"dequantized container does not match the model: missing {missing[:3]} unexpected {unexpected[:3]}")
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    for m in model.moe_layers():
        m.load_accum.zero_()
    model.to(dtype)
    for m in model.moe_layers():  # router and selection bias stay fp32
        m.gate.float()
        m.e_score_correction_bias.data = m.e_score_correction_bias.data.float()
    return model.eval()


def int4_nll(container_path, windows, args):
    """(nll sum, count, path used) for the container."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isfile(os.path.join(here, "stream_infer.py")):
        import stream_infer
        if args.engine != "dequantize" and hasattr(stream_infer, "load"):
            try:
                engine = stream_infer.load(container_path, context=windows.shape[1])
                total, count = 0.0, 0
                for w in windows:
                    ll = engine.loglikelihood(w.tolist())  # summed log p of tokens 1.. given the ones before
                    total -= float(ll if not isinstance(ll, (tuple, list)) else ll[0])
                    count += w.numel() - 1
                return total, count, "stream_infer"
            except (TypeError, AttributeError) as e:  # an engine API this script does not know yet
                if args.engine == "stream_infer":
                    raise ValueError(f"stream_infer.py: load(...).loglikelihood(tokens) not usable ({e})")
                print(f"note: stream_infer engine not usable here ({e}); using the dequantize path", file=sys.stderr)
    import container
    c = container.load_container(container_path)
    model = model_from_state_dict(c.config, c.dequantized_state_dict(), DTYPES[args.dtype])
    total, count = nll_of(model, windows, args.batch_size)
    return total, count, "dequantize"


def say(stage):
    """A line per stage on stderr (a run took ~40 s without a word; stdout keeps the figures)."""
    print(stage + "...", file=sys.stderr, flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description="Validation perplexity of a checkpoint vs its int4 container.")
    ap.add_argument("ckpt", help="checkpoint dir or run dir")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--corpus", help="corpus dir (its val split, via shards.TokenStream)")
    src.add_argument("--tokens", help="token file: raw uint16 (.bin shard) or .npy")
    ap.add_argument("--container", help="int4 container of CKPT (default: write one to a temp file)")
    ap.add_argument("--group-size", type=int, default=None, help="int4 group size when writing the container")
    ap.add_argument("--embed-bits", type=int, default=8, choices=[4, 8])
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per window (default max_seq_len - 1)")
    ap.add_argument("--max-tokens", type=int, default=131072, help="evaluate on at most this many tokens")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    ap.add_argument("--engine", default="auto", choices=["auto", "stream_infer", "dequantize"],
                    help="int4 forward: stream_infer's engine (auto: when stream_infer.py has it) or dequantize")
    ap.add_argument("--json", help="write the figures to this JSON file")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    if args.engine != "dequantize" and args.dtype != "float32":  # the engine computes in fp32: so does the reference,
        print(f"note: stream_infer's engine computes in float32; the checkpoint is scored in float32 too, not "  # or
              f"{args.dtype} (else its rounding counted as int4's)", file=sys.stderr)  # rel_increase mixed the two
        args.dtype = "float32"
    tmpdir = None
    try:
        import container
        ckpt_dir = checkpoint.resolve(args.ckpt)
        ref = load_checkpoint(ckpt_dir, dtype=DTYPES[args.dtype])
        cfg = ref.cfg
        # a window is seq_len inputs + 1 target; the streaming engine reads all seq_len + 1 as its context
        args.seq_len = min(args.seq_len or cfg.max_seq_len - 1, cfg.max_seq_len - 1)
        windows = token_windows(args, cfg.vocab_size)
        say(f"scoring the checkpoint: {windows.shape[0]} windows of {args.seq_len} tokens ({args.dtype})")
        t0 = time.time()
        ref_sum, count = nll_of(ref, windows, args.batch_size)
        t_ref = time.time() - t0
        del ref
        path = args.container
        if path is None:
            tmpdir = tempfile.mkdtemp(prefix="quant_quality-")
            path = os.path.join(tmpdir, "model.pcf4")
            kw = {} if args.group_size is None else {"group_size": args.group_size}
            say(f"writing its int4 container (checkpoint scored in {t_ref:.1f}s)")
            container.write_container(ckpt_dir, path, embed_bits=args.embed_bits, progress=False, **kw)
        say(f"scoring the int4 container: {windows.shape[0]} windows")
        t0 = time.time()
        q_sum, q_count, how = int4_nll(path, windows, args)
        t_q = time.time() - t0
        header = container.load_container(path).header
    except (checkpoint.CheckpointError, ValueError, OSError) as e:
        sys.exit(f"error: {str(e).splitlines()[0]}")
    except Exception as e:
        if type(e).__name__ in ("ContainerError", "DataError", "StreamError"):
            sys.exit(f"error: {e}")
        raise
    finally:
        if tmpdir:
            import shutil
            shutil.rmtree(tmpdir, ignore_errors=True)
    if q_count != count:
        sys.exit(f"error: int4 path scored {q_count} tokens, the reference {count}")
    ppl_ref, ppl_q = math.exp(ref_sum / count), math.exp(q_sum / count)
    res = {
        "checkpoint": ckpt_dir, "container": args.container or "(temp)", "int4_path": how,
        "tokens": count, "seq_len": args.seq_len, "dtype": args.dtype,
        "data": args.tokens or os.path.join(args.corpus, "val"),
        "quant": header.get("quant"),
        "ppl_checkpoint": ppl_ref, "ppl_int4": ppl_q, "rel_increase": ppl_q / ppl_ref - 1,
        "seconds_checkpoint": round(t_ref, 2), "seconds_int4": round(t_q, 2),
    }
    print(f"tokens {count:,} (seq_len {args.seq_len}, {args.dtype}); int4 via {how}")
    print(f"perplexity checkpoint {ppl_ref:.4f}  int4 {ppl_q:.4f}  relative increase {100 * res['rel_increase']:+.2f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
