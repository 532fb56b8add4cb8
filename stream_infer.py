"""
stream_infer: run an int4 MoE container under a fixed RAM budget, routed experts streamed from disk.

    python stream_infer.py model.pcf4 --ram-budget 2G --prompt "The hummingbird" --max-new-tokens 64
    python stream_infer.py model.pcf4 --ram-budget 1G --bench --json bench.json   # honest benchmark (stream_bench.py)
    python stream_infer.py model.pcf4 --ram-budget 4G --experts-per-token 1 --temperature 0.8 --top-p 0.95

Python API (eval.py, bench/quant_quality.py):
    eng = stream_infer.load("model.pcf4", ram_budget="2G")
    eng.generate(prompt_ids, max_new_tokens, temperature=0, top_p=None, experts_per_token=None, seed=None,
                 eos_id=None) -> list[int]; eos_id: one id or several, the one made ends the list (no stop strings)
    eng.stream(...)  yields token ids as they are made (one left unfinished holds its KV positions until closed)
    eng.loglikelihood(context_ids, continuation_ids, experts_per_token=None) -> (sum log p, is_greedy); continuation
    None scores tokens[1:] of context_ids; eng.loglikelihood_batch([(ctx, cont), ...]); experts_per_token None: the
    container's top_k (scored as the container's model, whatever set_experts_per_token serves with)
    Threads may share an engine: its lock (eng.lock) lets one request step run at a time, and a request takes its
    KV positions from the --context the budget reserved (eng.kv_reserve), waiting while other threads' hold them.
    eng.forward(ids, cache) refuses, before any chunk runs, input that does not fit the KV cache (or, with no cache,
    the reserved context): nothing advanced.
    Errors: StreamError for a bad request or load (one line); a corrupt expert blob is container.ContainerError naming
    it, raised at load (when experts are preloaded) or by the request that reads it (the engine serves other requests).
    ram_budget bounds the whole process: an engine loaded beside others counts their memory and what they may still
    allocate (their KV, working memory, unfilled caches), so give the last one the total. A dropped engine closes its
    files and frees its memory; expert_reader.cpp's threads are the process's and stay, idle.

How it works (the implementer's calls, as DESIGN.md asks):
- The model is model.py's Picaflor built on the meta device (model.meta_model: no random init, which would import
  torch._dynamo and cost 180 MB of the budget), its modules swapped for container-backed ones, so
  attention, RoPE, the KV cache, norms and the block wiring are model.py's code, not a copy. Resident (read once
  into private anonymous memory advised for huge pages, container.anon_buffer, as the expert buffers are): the lm_head (int8 rows by default), attention, dense FFN and shared experts (int4),
  norms, routers and selection biases (fp32), plus the KV cache. The int8 embedding table stays on disk when
  the lm_head does not share it: its crc is checked at load and each lookup reads the token's row (DiskEmbedding).
- Routed experts live in ONE byte-budget cache over all layers (expert_cache.py: its readers, its policy "score"
  and why), filled by aligned single reads of each expert's blob from expert_reader.cpp's C++ threads. A layer's
  missing experts are read in parallel while the decoding thread computes the shared expert and then the layer's
  cached experts; every expert's output is summed in the fixed order afterwards (int4_cpu.cpp mix_outputs). On
  micro at 2G (`python stream_infer.py micro.pcf4 --ram-budget 2G --bench --max-new-tokens 32`) that took decode from 13-14 to 16-19
  tok/s, with the crc off the decoding thread and 50 more cached experts (meta_model).
- Prefetch (`--prefetch auto`, the default): the next MoE layer's likely experts are read ahead by applying ITS
  router to the current hidden state (mixtral-offloading's speculative prefetch), overlapping this layer's
  compute, into their own buffers (2 x top_k, carved out of the budget), but only while those guesses are right
  often enough to pay: auto counts how many of each layer's picks the previous layer's guess named (a few decode
  tokens name guesses without reading them while it is off) and every PREFETCH_JUDGE_PICKS picks turns
  prefetch on at >= 80% right, off below 72% (Engine.judge_prefetch; `--bench` prints the share and the
  verdict). Why the bar: prefetch loses here at the ~60% right a random-weight model gets. `python
  bench/prefetch_ab.py micro.pcf4 --ram-budget B` (one process, off and on in turn, before auto existed): 3G 14.0 / 12.4 tok/s (off /
  on), 2G 11.8 / 9.2, 1G 3.7 / 3.3, although guesses keep every hit and cut the misses by 30-45%: half the
  guesses are wrong (+20-40% reads), and on a VM reading costs compute (the 2-thread int4 GEMV 17.3 GB/s alone,
  13.7 while blobs were read in the background, on this VM). `bench/prefetch_oracle.py` (guesses from a
  recorded future, each right with a chosen probability) puts break-even near 65-70% right: at 1.5G 60% right
  lost ~10%, 80% won 3-5% one layer ahead (13% two ahead), 100% 18%; `bench/route_guess.py CKPT` says how often
  a model's router is right (a trained tiny: 87-92%, its random twin 72-73%; random micro 59-62%, so auto stays off
  there, at no measurable cost). `--prefetch` alone forces it on, `--prefetch off` off. Unmeasured on a trained
  model big enough to stream, and on a laptop whose NVMe reads by DMA.
- Budget accounting (`--ram-budget` bounds the whole process): cache bytes = budget - RSS after the resident part
  is loaded (python + torch baseline + resident weights, measured from /proc/self/status; without /proc, as on
  macOS, getrusage's peak, which reserves more) - what other engines of the process may still allocate (their
  `unallocated_bytes`) - the KV cache for `context` positions - working memory (one prefill chunk of 256 tokens'
  activations and its attention scores against the context, 64 logit rows, --kernel reference's chunk of
  dequantized rows, slack; `working_bytes`). If less than 2 x top_k experts would fit (top_k with a single MoE
  layer, none without one), it refuses before loading,
  saying how much is needed.
- int4 kernels (`--kernel`: native on CPU, the default where it builds; int4pack; reference; triton on CUDA):
  kernels.py, whose docstring says how each works and what it measured.
- Decode-time fusions: q|k|v and the shared / dense gate|up are concatenated at load into one int4 matrix each
  (the packed layout is whole 32-row blocks, so this is a byte concatenation), one GEMV instead of three or two;
  a one-token MoE step uses scalar routing weights. Both keep the arithmetic of the unfused path. On the native
  kernel a decode token's layers skip the modules: Engine._decode_step calls the same native functions in Block's
  order from a per-layer plan made at load (bit for bit the module path, tested), the attention half of a layer in
  one op (attn_block), since ~140 nn.Module calls a token cost ~2-3 ms of cold-cache Python here
  (bench/decode_profile.py) and five op calls a layer ~2 tok/s fully resident (README: "A decode step also runs its small ops in one native call each");
  prefill and every other kernel use the modules.
- Cache policy `score` (default; `--cache-policy lru` for plain LRU): expert_cache.py's docstring.
- CUDA: kernels.triton_int4_matmul; int8 rows (the lm_head) are dequantized once at load there. A missed
  expert is read into host memory as on CPU and copied to the GPU; the expert cache, which lives on the GPU, is
  held to the GPU's free memory as well as to --ram-budget. Run on an H200 with `bench/gpu_check.py` (README "On a
  GPU": greedy tokens equal to the reference kernel's, streamed too); it runs on CPU under TRITON_INTERPRET=1 in the tests.
- When every routed expert fits in the budget (or there is none) they are all read at load (`preload`, one
  sequential pass, like llama.cpp loading its weights), so decoding touches no disk; otherwise the cache is filled
  at load with as many as fit, the same number per layer (decoding then starts from a full cache, not an empty
  one); `--no-preload` reads on demand. The load time (`load_s` in --bench) includes it.
- Threads (`--threads auto`): every core, and OpenMP threads spin between GEMVs (OMP_WAIT_POLICY=ACTIVE, set
  when run as a script, not for --chat: they spun on while it waited for input; PASSIVE where the kernels run on
  int4_loops.h's own ChunkPool, macOS). Measured on micro, 2 cores, native kernel, 16 decode tokens: 2G budget
  11.7 tok/s with 2 threads vs 9.0 with 1; 1G 6.0 vs 3.8. (Before expert buffers were recycled, spinning threads
  starved the reader threads while streaming and 1 thread was faster; a machine whose cores are busy elsewhere still
  wants `--threads 1`.)
- Output is identical whatever the budget: the compute order never depends on what was cached.
- Printed text is exact when piped; on a terminal the model's control characters (ESC sequences, carriage
  return, BEL, C1) are written escaped (tokenizer.terminal_text, as chat.py), so a generation cannot drive the terminal.
- No repetition penalty or any other sampling penalty, ever.
"""

import argparse
import contextlib
import gc
import math
import numbers
import operator
import os
import platform
import sys
import threading
import time
import weakref


# Decode is hundreds of small parallel GEMVs per token: with OpenMP threads that sleep between them, 2 threads
# decoded 3x slower than 1 here (2 cores); spinning ones (ACTIVE) 1.7x faster. libgomp reads this at torch import.
# On ChunkPool, torch's own OpenMP threads must sleep at once instead (PASSIVE): woken by a torch op (RoPE's cos
# runs on MKL's threads), spinning ones took a core from the pool's (micro, 6G: decode 25 tok/s against 59).
# (kernels.openmp_kernels(), inline: kernels imports torch)
# --chat waits on a person typing: ACTIVE threads spun on a core each meanwhile (libgomp's default spins briefly,
# then sleeps), so a chat leaves the policy to it.
if __name__ == "__main__":
    openmp = sys.platform != "darwin" and os.environ.get("PICAFLOR_OPENMP", "1") != "0"
    if not (openmp and "--chat" in sys.argv[1:]):
        os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE" if openmp else "PASSIVE")

import torch
import torch.nn as nn
import torch.nn.functional as F

import container as C
import expert_cache as EC
import kernels
from model import KVCache, device_problem, meta_model, more_experts_note, rope_cos_sin, sample_next


class StreamError(Exception):
    """Bad input or a budget that cannot work; the message is one line naming the file and the fix."""


# ----------------------------------------------------------------------------------------------------------
# sizes and process probes

UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(s):
    """'4G', '512M', '1.5G', '1024' (bytes) -> bytes; binary units; a trailing 'B'/'iB' is allowed."""
    if isinstance(s, (int, float)) and not isinstance(s, bool):  # (NaN: a bare ValueError; 0 or less: no budget)
        if not (math.isfinite(s) and s >= 1):
            raise StreamError(f"ram_budget {s!r}: a size in bytes (or a string such as 4G, 512M)")
        return int(s)
    t = str(s).strip().upper()
    t = t[:-2] if t.endswith("IB") else (t[:-1] if t.endswith("B") and len(t) > 1 and t[-2] in UNITS else t)
    unit = t[-1] if t and t[-1] in UNITS else ""
    num = t[:-1] if unit else t
    try:
        v = float(num)
        if not math.isfinite(v) or v <= 0:
            raise ValueError
    except ValueError:
        raise StreamError(f"--ram-budget {s!r}: not a size; use a number with K, M, G or T, e.g. 4G, 512M, 1.5G") from None
    if not unit and v < 1 << 20:  # a bare "4" or "1.5" read as bytes was refused as a budget below the model's needs
        raise StreamError(f"--ram-budget {s!r}: a number without a unit is bytes; give one, e.g. {num}G or {num}M")
    return int(v * UNITS[unit])


def fmt_size(n):
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n}B"


# what a "raise it to at least" suggests above the budget's need: building the model takes RSS beyond its weights'
# bytes (~4 MB on tiny), so a budget of exactly the need was refused again after loading
LOAD_SLACK = 32 << 20


def fmt_budget(n):
    """n rounded up to a whole MiB, as --ram-budget takes it (fmt_size's 2 decimals can round below n)."""
    return f"{-(-n // (1 << 20))}M"


PROC_SELF = "/proc/self"  # Linux; macOS has no /proc (tests point this elsewhere to run as there)


def proc_status(key):
    """A /proc/self/status figure in bytes (0 when absent), or None where there is no /proc (macOS)."""
    try:
        with open(os.path.join(PROC_SELF, "status")) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return 0


def peak_rss_from_rusage():
    """getrusage's peak RSS in bytes (ru_maxrss: bytes on macOS, KiB on Linux); 0 where there is none."""
    try:
        import resource
    except ImportError:
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def rss_bytes():
    """Resident bytes now; without /proc (macOS) the peak so far, which is never less, so the budget's accounting
    (the engine's baseline and resident sizes) errs towards reserving too much, never too little."""
    now = proc_status("VmRSS")
    return now if now is not None else peak_rss_from_rusage()


def peak_rss_bytes():
    peak = proc_status("VmHWM")
    return peak if peak is not None else peak_rss_from_rusage()


def io_counters():
    """(read_bytes really fetched from storage, rchar bytes returned by read syscalls) of this process, or None
    where there is no /proc/self/io (macOS): then nothing can tell storage reads from page-cache hits."""
    try:
        d = dict(line.split(": ") for line in open(os.path.join(PROC_SELF, "io")).read().splitlines() if ": " in line)
        return int(d["read_bytes"]), int(d["rchar"])
    except (OSError, KeyError, ValueError):
        return None


class DiskEmbedding(nn.Module):
    """Token embedding rows read from the container on lookup (int8 rows, when the lm_head does not share
    them): the table (67 MB on micro) leaves the budget to the expert cache, and a token costs two small reads the
    page cache serves. llama.cpp's mmap gets the same by touching only the rows it uses."""

    def __init__(self, container, name, device):
        super().__init__()
        self.c, self.name, self.device = container, name, device
        self.shape = container.header["tensors"][name]["shape"]

    def forward(self, idx):
        try:
            rows = self.c.tensor_rows(self.name, idx.reshape(-1).tolist())
        except C.ContainerError as e:
            raise StreamError(str(e)) from None
        return rows.to(self.device).reshape(*idx.shape, self.shape[1])


# ----------------------------------------------------------------------------------------------------------
# a routed expert over its blob buffer (expert_cache.py holds the cache)

class Expert:
    """One routed expert, decoded zero-copy over its blob buffer: raw parts `gate_up` and `down`, which the native
    kernel multiplies as they are; the other kernels get kernels.QLinear modules (built only for them: two nn.Modules
    cost ~0.1 ms of Python per miss)."""

    def __init__(self, container, buf, kernel, device="cpu", views=None):
        """views: container.decode_expert(buf) made before (the cache keeps a buffer's views); used as they are."""
        dec = views if views is not None else container.decode_expert(buf)
        self.buf = buf  # the cache recycles it on eviction when nothing else holds this expert
        if device != "cpu":  # CUDA: the blob goes to the GPU once per miss (the host buffer is then dropped)
            dec = {k: {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in v.items()} for k, v in dec.items()}
            self.buf = None
        self.gate_up, self.down = {"kind": "int4", **dec["gate_up_proj"]}, {"kind": "int4", **dec["down_proj"]}
        self.tensors = [t for part in dec.values() for t in part.values() if isinstance(t, torch.Tensor)]
        self.native = kernel == "native"
        if self.native:  # swiglu_mix's per-expert arguments, gathered once per miss instead of once per use
            gu, dn = self.gate_up, self.down
            self.mix_args = (gu["packed"], gu["sz"], dn["packed"], dn["sz"], gu["shape"][0], gu["group_size"])
        else:
            self.gate_up_proj = kernels.QLinear(self.gate_up, kernel)
            self.down_proj = kernels.QLinear(self.down, kernel)

    def __call__(self, x):
        if self.native:
            return native_swiglu(x, self.gate_up, self.down)
        g, u = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(g) * u)


# ----------------------------------------------------------------------------------------------------------
# one-call versions of model.py's small modules for the native kernel (int4_cpu.cpp's decode-step helpers):
# a one-token step is otherwise ~100 small torch ops per layer, which cost as much as the GEMVs here

def ffn_args(gu, dn):
    """swiglu_ffn's arguments after x for a fused int4 gate|up and its down (raw int4 parts, as kernels.QLinear.raw)."""
    return gu["packed"], gu["sz"], gu["shape"][0], gu["group_size"], dn["packed"], dn["sz"], dn["shape"][0], dn["group_size"]


def native_swiglu(x, gu, dn):
    """down(silu(gate) * up) over a fused int4 gate|up, in one call (gu, dn: raw int4 parts, as kernels.QLinear.raw)."""
    return kernels.NATIVE.swiglu_ffn(x, *ffn_args(gu, dn))


class NativeFFN(nn.Module):
    """model.MLP (dense FFN, shared expert) with its fused gate|up (stream_infer's fuse()), in one call."""

    def __init__(self, mlp):
        super().__init__()
        self.gate_up_proj, self.down_proj = mlp.gate_up_proj, mlp.down_proj

    def forward(self, x):
        return native_swiglu(x, self.gate_up_proj.raw, self.down_proj.raw)


class NativeRMSNorm(nn.Module):
    """model.RMSNorm (fp32: weight * x / rms(x)) in one call."""

    def __init__(self, norm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x):
        return kernels.NATIVE.rms_norm(x, self.weight, self.eps)


class NativeAttention(nn.Module):
    """model.Attention whose one-token, batch-1, KV-cached step (decode) runs after the fused q|k|v GEMV in one
    call: QK norms, RoPE, the cache write and grouped-query softmax attention. Every other call (prefill, chunks,
    no cache) is model.py's forward."""

    def __init__(self, attn):
        super().__init__()
        self.attn = attn

    def forward(self, x, cos, sin, cache=None):
        a, i = self.attn, self.attn.layer_idx
        if (cache is None or x.shape[:2] != (1, 1) or a.qkv_proj is None or cache.pos >= cache.max_len
                or cache.k[i].dtype != torch.float32):
            return a(x, cos, sin, cache)
        y = kernels.NATIVE.attn_decode(a.qkv_proj(x), a.q_norm.weight, a.k_norm.weight, a.q_norm.eps, cos, sin,
                                cache.k[i], cache.v[i], cache.pos, a.cfg.n_head, a.cfg.n_kv_head)
        return a.o_proj(y)


class StreamedMoE(nn.Module):
    """model.MoE's forward with routed experts fetched from the cache (same router, same mixing)."""

    def __init__(self, cfg, layer, router_w, bias, shared, cache, native):
        super().__init__()
        self.cfg, self.layer, self.router_w, self.bias, self.shared, self.cache = cfg, layer, router_w, bias, shared, cache
        self.top_k = cfg.top_k
        self.next_moe = None  # the next MoE layer, for prefetch
        self.native = native  # int4_cpu.cpp's router and the one-token decode path
        self.prefetch = True
        # --prefetch auto: guesses named without reading (its probe), the experts the last layer's guess named for
        # this one (decode), and [picks, picks the guess named] counted over the engine's layers
        self.shadow_guess, self.guessed, self.guess_tally = False, None, [0, 0]
        self.route_scale = cfg.route_scale
        # the shared expert's swiglu_ffn arguments after x (decode passes them as they are)
        self.shared_args = (ffn_args(shared.gate_up_proj.raw, shared.down_proj.raw) if isinstance(shared, NativeFFN)
                            else None)
        # and as swiglu_mix takes an expert (Expert.mix_args), when both projections share a group size
        sa = self.shared_args
        self.shared_mix_args = (sa[0], sa[1], sa[4], sa[5], sa[2], sa[3]) if sa and sa[3] == sa[7] else None
        self.fuse_shared = True  # bench/token_ab.py --set fuse_shared=1,0 switches it

    def route(self, x, top_k=None):
        """(weights, expert ids, selection keys [rows, E]). DeepSeek-V3 router (as model.Router): sigmoid scores in
        fp32, bias only selects (the keys are scores + bias), weights normalised."""
        if self.native:
            return kernels.NATIVE.route(x, self.router_w, self.bias, top_k or self.top_k, self.route_scale)
        scores = torch.sigmoid(x.float() @ self.router_w.t())
        sel = scores + self.bias
        _, idx = torch.topk(sel, top_k or self.top_k, dim=-1, sorted=False)
        w = scores.gather(1, idx)
        return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.route_scale, idx, sel

    def guess_next(self, x, protect):
        """Prefetch: the next layer's router on this hidden state names the experts to read ahead (with shadow_guess
        it only names them: --prefetch auto's probe). A one-token guess is kept for the next layer to count."""
        nxt = self.next_moe
        if nxt is None or not (self.prefetch or self.shadow_guess):
            return
        _, nidx, _ = nxt.route(x)
        picks = sorted(set(nidx.reshape(-1).tolist()))
        nxt.guessed = picks if nidx.numel() == nxt.top_k else None
        if self.prefetch:
            self.cache.guess([(nxt.layer, e) for e in picks], protect)

    def count_guess(self, picked):
        """One token's picks against the previous layer's guess of them (--prefetch auto's evidence)."""
        self.guess_tally[0] += len(picked)
        self.guess_tally[1] += len(set(picked).intersection(self.guessed))
        self.guessed = None

    def decode(self, x):
        """forward for one token on the native kernel, x fp32 as it comes ([1, 1, D]: the ops take any leading
        dims, so no reshapes): the shared expert in one call, the routed ones in one (or one each while some are
        read), summed in the same fixed order whatever was cached. Lean on purpose: Python after a GEMV runs on
        cold caches here (~40 us per cache lookup), so argument tuples are made once (shared_args, mix_args)."""
        op, cache, layer = kernels.NATIVE, self.cache, self.layer
        w, idx, sel = op.route(x, self.router_w, self.bias, self.top_k, self.route_scale)
        cache.observe(layer, sel)
        picked = idx.tolist()[0]  # top-k: distinct experts (no [0] view: a tensor made per call)
        if self.guessed is not None:
            self.count_guess(picked)
        weight = dict(zip(picked, w.tolist()[0]))
        keys = [(layer, e) for e in sorted(picked)]
        protect = set(keys)
        cache.request(keys, protect)  # this layer's misses, read in parallel (right guesses join the cache)
        if self.prefetch or self.shadow_guess:
            self.guess_next(x, protect)
        # all of this layer's experts at once when they fit together (the budget guarantees 2 x top_k; more with
        # --experts-per-token: then one at a time, the same order and sums)
        together = len(keys) * cache.nbytes <= cache.budget
        entries = cache.entries
        cached = [key for key in keys if key in entries]
        if together and len(cached) == len(keys) and self.fuse_shared and self.shared_mix_args is not None:
            # every expert cached: the shared one and the routed ones in one call, every gate|up projection in one
            # parallel region and every down one in another (the same sums, in the same order, from 0)
            out = torch.zeros_like(x)
            op.swiglu_mix(x, out, *zip(self.shared_mix_args, *[cache.get(key, protect).mix_args for key in keys]),
                          [1.0] + [weight[key[1]] for key in keys])
            return out
        out = op.swiglu_ffn(x, *self.shared_args)  # while this layer's missing experts are read
        if together and len(cached) < len(keys):
            # the cached experts first, while the missing ones are still read; the sums in the fixed order
            ys = {key: cache.get(key, protect)(x) for key in cached + [k for k in keys if k not in cached]}
            op.mix_outputs(out, [ys[key] for key in keys], [weight[key[1]] for key in keys])
            return out
        for group in [keys] if together else [[key] for key in keys]:
            # the argument lists live only for the call: the next group's lookup may evict this group's experts,
            # and a buffer still referenced here could not be recycled (a fresh mmap per miss, over the budget)
            op.swiglu_mix(x, out, *zip(*[cache.get(key, protect if together else {key}).mix_args for key in group]),
                          [weight[key[1]] for key in group])
        return out

    def forward(self, x):
        if self.native and self.shared_args is not None and x.numel() == x.shape[-1] and x.dtype == torch.float32:
            return self.decode(x)
        shape = x.shape
        x = x.reshape(-1, shape[-1]).float()
        w, idx, sel = self.route(x)
        self.cache.observe(self.layer, sel)
        if self.guessed is not None and x.shape[0] == 1:
            self.count_guess(idx[0].tolist())
        self.guessed = None  # counted for one row only (a prompt's rows are not)
        keys = [(self.layer, e) for e in sorted(set(idx.reshape(-1).tolist()))]
        protect = set(keys)
        self.cache.request(keys, protect)  # this layer's misses, read in parallel (right guesses join the cache)
        self.guess_next(x, protect)
        out = self.shared(x).float()
        if x.shape[0] == 1:  # decode: one token, scalar weights (a third of the ops of the general loop below)
            weight = dict(zip(idx[0].tolist(), w[0].tolist()))
            for key in keys:  # the same fixed order and the same arithmetic as the general loop
                out += self.cache.get(key, {key})(x) * weight[key[1]]
            return out.reshape(shape)
        for key in keys:  # fixed order: the result never depends on what was cached
            tok, slot = torch.where(idx == key[1])
            y = self.cache.get(key, {key})(x[tok])
            out.index_add_(0, tok, y * w[tok, slot, None])
        return out.reshape(shape)


def check_sampling(temperature, top_p, flag="", seed=None):
    """model.sample_next's arguments: NaN or a top_p <= 0 made torch.multinomial raise, a negative temperature
    sampled the least likely tokens. flag "--": named as the command line's flags, and --top-p / --seed without a
    temperature are refused (greedy decoding ignored them: the same text for every seed, silently). Returns the
    temperature to sample with: 0 (greedy) for one under 1e-4, said once on stderr with flag "--"."""
    for name, v, kind in (("temperature", temperature, numbers.Real), ("top_p", top_p, numbers.Real),
                          ("seed", seed, numbers.Integral)):  # (a float seed: torch's bare RuntimeError)
        if v is not None and (isinstance(v, bool) or not isinstance(v, kind)):  # (a bare TypeError)
            raise StreamError(f"{flag}{name.replace('_', '-') if flag else name} {v!r}: "
                              f"{'a whole number' if kind is numbers.Integral else 'a number'}")
    if temperature is None or not (temperature >= 0 and math.isfinite(temperature)):
        raise StreamError(f"{flag}temperature {temperature}: 0 (greedy) or more")
    # logits / 1e-39 overflow to inf (a NaN error deep in sampling; it was refused): that close to 0 the draw is the
    # argmax anyway, so greedy, as temperature's limit at 0 is
    greedy = temperature < 1e-4
    if top_p is not None and not 0 < top_p <= 1:
        raise StreamError(f"{flag}{'top-p' if flag else 'top_p'} {top_p}: in (0, 1]")
    if seed is not None and not 0 <= seed < 2 ** 63:  # (torch's manual_seed: an overflow traceback)
        raise StreamError(f"{flag}seed {seed}: 0 to 2**63 - 1")
    if flag and greedy:
        for name, v in (("--top-p", top_p), ("--seed", seed)):
            if v is not None:
                why = "0" if temperature == 0 else f"{temperature}, under 1e-4"
                raise StreamError(f"{name} {v}: decoding is greedy (--temperature {why}), which it does not change; "
                                  f"sample with --temperature T >= 1e-4, or leave {name} out")
        if temperature > 0:
            print(f"note: --temperature {temperature} is under 1e-4: decoding greedily, as --temperature 0 does",
                  file=sys.stderr)
    return 0.0 if greedy else temperature


# ----------------------------------------------------------------------------------------------------------
# the engine

KERNELS = ("auto", "native", "int4pack", "reference", "triton")


def pick_kernel(kernel, device):
    if kernel not in KERNELS:  # (the API took "foo" and ran a path whose scratch the budget did not count)
        raise StreamError(f"kernel {kernel!r}: use one of {', '.join(KERNELS)}")
    if kernel == "auto":
        if device.startswith("cuda"):
            return "triton"
        # its integer loops (AVX2, AArch64 dot products); its portable one is slower than int4pack (x86, measured)
        if kernels.native_int4() is not None and (kernels.native_int4().has_avx2() or kernels.native_int4().has_sdot()):
            return "native"
        if kernels.native_int4() is not None and platform.machine().lower() in ("aarch64", "arm64"):
            # an ARM core (or a compiler) without ARMv8.2 dot products: say why the fast decode path is off
            print("stream_infer: warning: int4_cpu.cpp was built without ARM dot-product instructions (an older "
                  "compiler or a pre-ARMv8.2 core); using torch's int4pack kernel and the slower module-by-module decode",
                  file=sys.stderr)
        return "int4pack" if kernels.cpu_int4pack_ok() else "reference"
    if kernel == "native" and (device != "cpu" or kernels.native_int4() is None):
        raise StreamError("--kernel native: int4_cpu.cpp runs on CPU only and needs a C++ compiler and ninja "
                          "(the warning above says why it did not build); use --kernel int4pack")
    if kernel == "int4pack" and device != "cpu":
        raise StreamError("--kernel int4pack: torch's CPU int4 kernel; on CUDA use --kernel triton (auto picks it)")
    if kernel == "int4pack" and not kernels.cpu_int4pack_ok():
        raise StreamError("--kernel int4pack: this torch build lacks the CPU int4 kernel; "
                          "use --kernel reference (torch is pinned in requirements.txt)")
    return kernel


# tokens per forward pass over a long prompt: bounds activation memory under --ram-budget. Each pass reads every
# expert its tokens route to, so under a small budget prefill is paid in expert reads per chunk: a 256-token prompt
# on micro at 1G took 2617-2711 reads in chunks of 64 and 923-937 in one of 256 (16.9 -> 33.6 tok/s,
# python bench/prefill_chunk.py micro.pcf4 --ram-budget 1G); the chunk's activations measured ~70 KB a token there.
PREFILL_CHUNK = 256
LOGIT_CHUNK = 64  # logit rows (x vocab) computed at a time by loglikelihood
# --prefetch auto reads ahead only while the guesses name enough of the picks. bench/prefetch_oracle.py (micro, 1.5G,
# guesses one layer ahead): 60% right lost ~10% against prefetch off, 80% won 3-5%, 100% 18%; break-even ~70%
PREFETCH_ON_RIGHT, PREFETCH_OFF_RIGHT = 0.80, 0.72
PREFETCH_JUDGE_PICKS = 240  # picks per verdict (+-0.03 on the share right; ~8 tokens of micro with prefetch on)
PREFETCH_PROBE_EVERY_MAX = 32  # while off, one token in 2 names guesses, one in 4 after the next verdict, ... 32
PREFETCH_MODES = ("off", "on", "auto")
LIVE_ENGINES = weakref.WeakSet()  # this process's engines (a later engine's budget counts their reserves)
MAX_READERS = 64  # expert reader threads; 100000 failed to make its threads, a traceback mid-load


def check_readers(n_readers, name):
    """The reader-thread count, checked early by the CLI (before a bench's cgroup) and by the API alike."""
    if not (isinstance(n_readers, int) and 1 <= n_readers <= MAX_READERS):
        raise StreamError(f"{name} {n_readers!r}: 1 to {MAX_READERS} expert reader threads")


class Engine:
    def __init__(self, path, ram_budget=None, device="cpu", kernel="auto", n_readers=4, prefetch="auto",
                 context=None, cache_policy="score", preload="auto", prefill_chunk=PREFILL_CHUNK):
        self.cache_policy, self.n_readers = cache_policy, n_readers
        check_readers(n_readers, "n_readers")
        if cache_policy not in EC.CACHE_POLICIES:  # before anything is loaded
            raise StreamError(f"cache policy {cache_policy!r}: use one of {', '.join(EC.CACHE_POLICIES)}")
        self.prefetch_mode = {False: "off", True: "on", None: "off"}.get(prefetch, prefetch)
        if self.prefetch_mode not in PREFETCH_MODES:
            raise StreamError(f"prefetch {prefetch!r}: use one of {', '.join(PREFETCH_MODES)}")
        # whole numbers, or one line: "x" was a bare ValueError, context 10.5 a fractional KV reserve, "64" a TypeError
        for name, v in (("prefill_chunk", prefill_chunk), ("context", context)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral)):
                raise StreamError(f"{name} {v!r}: a whole number of tokens")
        self.prefill_chunk = int(prefill_chunk)
        if self.prefill_chunk < 1:
            raise StreamError(f"prefill_chunk {prefill_chunk}: must be at least 1 token")
        if problem := device_problem(device):
            raise StreamError(f"device {device!r}: {problem}")
        try:
            self.container = c = C.load_container(path)
        except C.ContainerError as e:
            raise StreamError(str(e)) from None
        self.path, self.device = str(path), str(device)
        self.cfg = cfg = c.config
        # KV positions reserved in the budget (unbounded runs, e.g. eval, get the model's whole context)
        if context is not None and context < 1:  # a negative one made the KV reserve negative: over the budget
            raise StreamError(f"context {context}: at least 1 KV position (default 512 under a budget)")
        self.context = min(context or (512 if ram_budget is not None else cfg.max_seq_len), cfg.max_seq_len)
        # one request step at a time: the expert cache and the MoE layers' top_k are shared (threads sharing an
        # engine got wrong tokens, KeyErrors and an over-budget cache); requests interleave between steps
        self.lock = threading.RLock()
        self.finalizing = sys.is_finalizing  # kept here: at exit this module's globals (sys too) may be None already
        # the budget reserves KV for `context` positions: requests (each with its own KV cache) take their length
        # from it and wait while others hold it (four threads' caches once sat in a budget that counted one)
        self.kv_free, self.kv_held = self.context, {}  # positions not taken; thread id -> positions it holds
        self.kv_turn = threading.Condition()
        self.experts_per_token = cfg.top_k  # the engine's own setting (set_experts_per_token)
        self.max_seq_len = self.context
        self.kernel = pick_kernel(kernel, self.device)
        self.budget = parse_size(ram_budget) if ram_budget is not None else None
        # the container's tokenizer (None without one) inside the baseline: a 32K vocab's tables are several MB
        self.tokenizer = load_tokenizer(c, self.path)
        # budget accounting, before anything big is loaded (on a GPU after its context exists: ~hundreds of MB of RSS)
        if self.device.startswith("cuda"):
            torch.zeros(1, device=self.device)
        # --ram-budget bounds the process: the engines already loaded here count with what they have yet to allocate
        # (a second engine measured the first's RSS only, then the first's cache and KV grew past this budget)
        if LIVE_ENGINES:
            gc.collect()  # engines let go of but held in a reference cycle (a traceback's frames) count no more
        self.others_reserve = sum(e.unallocated_bytes() for e in list(LIVE_ENGINES))
        self.baseline_rss = rss_bytes()
        others = f", other engines here {fmt_size(self.others_reserve)} more" if self.others_reserve else ""
        # untied int8 embeddings (export's default) stay on disk, rows read on lookup (DiskEmbedding)
        embed = c.header["tensors"]["embed_tokens.weight"]
        self.embed_on_disk = not cfg.tie_embeddings and embed["kind"] == "int8"
        self.resident_bytes = c.resident_bytes() - (embed["nbytes"] if self.embed_on_disk else 0)
        self.kv_bytes = 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * self.context * 4
        # allocator slack, LOGIT_CHUNK logit rows (+ log-softmax), one prefill chunk's activations (fp32 temporaries
        # as wide as the widest fused gate|up: four on the torch paths, two with the native one-call FFNs, which
        # measured ~one on micro), and for --kernel reference the temporaries of one chunk of dequantized rows
        # (only the FFNs the model has: a fork's all-dense config keeps expert_ffn, an all-MoE one dense_ffn, unused)
        n_moe = cfg.n_layer - cfg.n_dense_layers
        widest = max([cfg.d_model] + ([2 * cfg.dense_ffn] if cfg.n_dense_layers else [])
                     + ([2 * cfg.n_shared * cfg.expert_ffn, 2 * cfg.expert_ffn] if n_moe else []))
        temporaries = 2 if self.kernel == "native" else 4
        # the widest (padded) row of any matrix: the reference kernel's chunk of rows is sized by it
        # (the expert layout's parts only with MoE layers: an all-dense container still describes expert_ffn's)
        quantized = [v for v in list(c.header["tensors"].values()) + (c.layout["parts"] if n_moe else [])
                     if v["kind"] in ("int4", "int8")]
        widest_k = max([C.int4_padded_shape(v["shape"], v["group_size"])[1] if v["kind"] == "int4" else v["shape"][-1]
                        for v in quantized] + [1])
        # int4pack runs the reference path on a group size torch's kernel does not take (and int8 rows of a width not
        # a multiple of 16): budgeted as --kernel reference (a group-16 container went 23 MiB over without it)
        self.reference_path = self.kernel == "reference" or (self.kernel == "int4pack" and any(
            v["group_size"] not in kernels.INT4PACK_GROUPS if v["kind"] == "int4" else v["shape"][-1] % 16
            for v in quantized))
        # + a prefill chunk's attention scores against the whole context (measured: about one copy), growing with
        # --context: a 4000-token prompt at context 4096 went 62 MiB over the budget without them
        self.working_bytes = ((32 << 20) + 2 * 4 * LOGIT_CHUNK * cfg.vocab_size
                              + temporaries * 4 * self.prefill_chunk * widest
                              + 4 * cfg.n_head * min(self.prefill_chunk, self.context) * self.context
                              + (kernels.reference_scratch_bytes(widest_k) if self.reference_path else 0))
        # a layer's top_k picks together, and the next MoE layer's top_k guesses (none after a lone MoE layer)
        self.min_cache_experts = min(cfg.top_k, cfg.n_experts) * min(n_moe, 2)
        self.min_cache = self.min_cache_experts * c.expert_nbytes
        needed = (self.baseline_rss + self.others_reserve + self.resident_bytes + self.kv_bytes + self.working_bytes
                  + self.min_cache)
        if self.budget is not None and self.budget < needed:
            e = StreamError(
                f"{path}: --ram-budget {fmt_size(self.budget)} is below what this model needs resident: "
                f"{fmt_size(needed)} (python+torch {fmt_size(self.baseline_rss)}{others}, resident weights "
                f"{fmt_size(self.resident_bytes)}, KV cache {fmt_size(self.kv_bytes)} for {self.context} positions, "
                f"working memory {fmt_size(self.working_bytes)}, >= {self.min_cache_experts} experts "
                f"{fmt_size(self.min_cache)}); raise it to at least {fmt_budget(needed + LOAD_SLACK)}")
            e.least_budget = needed + LOAD_SLACK  # (the benchmark's own refusal names the same figure)
            raise e
        t0 = time.perf_counter()
        self.model = self._build_model()
        self.decode_plan = self._decode_plan()
        self.load_s = time.perf_counter() - t0
        self.resident_rss = rss_bytes()
        if self.budget is None:
            cache_budget = (n_moe * cfg.n_experts + 1) * c.expert_nbytes
        else:
            cache_budget = self.budget - self.resident_rss - self.others_reserve - self.kv_bytes - self.working_bytes
            if cache_budget < self.min_cache:
                raise StreamError(f"{path}: --ram-budget {fmt_size(self.budget)} leaves {fmt_size(max(cache_budget, 0))} "
                                  f"for experts after loading the resident part ({fmt_size(self.resident_rss)} RSS"
                                  f"{others}); "
                                  f"raise it to at least {fmt_budget(self.budget - cache_budget + self.min_cache + LOAD_SLACK)}")
        if self.device.startswith("cuda"):  # the experts live on the GPU: never more than its free memory allows
            # (less the KV reserve: each request's KV cache is allocated there later, after the experts filled it)
            free = torch.cuda.mem_get_info(self.device)[0] - self.kv_bytes - self.working_bytes - (512 << 20)
            if free < self.min_cache:
                raise StreamError(f"{path}: {self.device} has {fmt_size(max(free, 0))} free for experts after the resident "
                                  f"part; it needs at least {fmt_size(self.min_cache)}: free GPU memory or use a "
                                  f"smaller model")
            cache_budget = min(cache_budget, free)
        self.cache.budget = cache_budget
        # --prefetch auto's evidence: [picks, picks the previous layer's guess named], over every MoE layer
        self.guess_tally = [0, 0]
        for moe in self.moes:
            moe.guess_tally = self.guess_tally
        self.prefetch_judged = (0, 0)  # the tally at the last verdict
        self.prefetch_probe_every = 2
        self.decode_tokens = 0  # judged so far (auto's probe schedule)
        self.prefetch_verdicts = []  # (share of picks guessed right, prefetch on after it), one per verdict
        self.set_prefetch(self.prefetch_mode == "on")
        self.every_expert_bytes = self.cache.every_expert_bytes
        self.preloaded, self.preloaded_experts = False, 0
        if preload is True or (preload == "auto" and cache_budget >= self.every_expert_bytes):
            self.preload_experts()
        elif preload == "auto":
            self.preload_experts(partial=True)
        LIVE_ENGINES.add(self)

    def unallocated_bytes(self):
        """What this engine may still allocate, as its budget counts it: its KV reserve and working memory, and its
        expert cache's unfilled part (never more than every expert)."""
        cache = self.cache
        return self.kv_bytes + self.working_bytes + max(min(cache.budget, cache.every_expert_bytes) - cache.used, 0)

    def preload_experts(self, partial=False):
        """Read routed experts into the cache now: all of them when they fit (a model that fits in the budget then
        decodes without touching the disk, as llama.cpp's loaded weights do), or with partial=True as many as fit,
        the same number from every layer (without routing statistics, any expert is as likely as another), so
        decoding starts from a full cache instead of an empty one: at a 100% budget on micro, 16 decode tokens
        hit 0.73 of the time from an empty cache."""
        from tqdm import tqdm
        E = self.cfg.n_experts
        if partial:
            keys = EC.partial_preload_keys([m.layer for m in self.moes], E, self.cache.budget // self.cache.nbytes)
        else:
            if self.cache.budget < self.every_expert_bytes:
                raise StreamError(f"{self.path}: cannot preload: the expert cache ({fmt_size(self.cache.budget)}) is "
                                  f"smaller than all experts ({fmt_size(self.every_expert_bytes)})")
            keys = [(m.layer, e) for m in self.moes for e in range(E)]
        if not keys:
            return
        t0 = time.perf_counter()
        bar = tqdm(total=len(keys), desc="preload experts", unit="expert", disable=not sys.stderr.isatty())
        try:
            for i in range(0, len(keys), 64):
                chunk = keys[i:i + 64]
                self.cache.request(chunk, set(chunk))
                self.cache.settle()
                bar.update(len(chunk))
        except KeyboardInterrupt:  # the chunk's reads still queued are dropped, not waited for
            self.cache.cancel()
            raise
        bar.close()
        self.cache.reset_counters()
        self.preloaded, self.preloaded_experts = not partial, len(keys)
        self.load_s += time.perf_counter() - t0

    def _build_model(self):
        c, cfg, kernel = self.container, self.cfg, self.kernel
        native = kernel == "native"
        try:
            raw = {name: c.raw_tensor(name) for name in c.header["tensors"]
                   if not (self.embed_on_disk and name == "embed_tokens.weight")}
            if self.embed_on_disk:
                c.check_tensor("embed_tokens.weight")  # once, piece by piece; lookups then read rows
        except C.ContainerError as e:
            raise StreamError(str(e)) from None
        dev = self.device

        def to_dev(r):
            return {k: (v.to(dev) if isinstance(v, torch.Tensor) and dev != "cpu" else v) for k, v in r.items()}

        def lin(name):
            return kernels.QLinear(to_dev(raw[name]), kernel)

        def fuse(module, fused_name, names):
            """q|k|v or gate|up as one int4 GEMV when they concatenate as bytes (int4, same K and group size, row
            counts that are whole 32-row blocks); else the separate projections. Parts are freed as they go."""
            parts = [raw[n] for n in names]
            attrs = [n.split(".")[-2] for n in names]
            if (all(r["kind"] == "int4" for r in parts) and all(r["shape"][0] % C.ROW_BLOCK == 0 for r in parts)
                    and len({(r["shape"][1], r["group_size"]) for r in parts}) == 1):
                # into huge-page memory, as the container's own reads (C.anon_buffer: faster GEMVs)
                packed = C.anon_tensor([sum(r["packed"].numel() for r in parts)], torch.uint8)
                sz0 = parts[0]["sz"].shape
                sz = C.anon_tensor([sz0[0], sum(r["sz"].shape[1] for r in parts), sz0[2]], parts[0]["sz"].dtype)
                joined = {"kind": "int4", "shape": [sum(r["shape"][0] for r in parts), parts[0]["shape"][1]],
                          "group_size": parts[0]["group_size"], "packed": torch.cat([r["packed"] for r in parts], out=packed),
                          "sz": torch.cat([r["sz"] for r in parts], dim=1, out=sz)}
                setattr(module, fused_name, kernels.QLinear(to_dev(joined), kernel))
                for a in attrs:
                    setattr(module, a, None)
            else:
                for n, a in zip(names, attrs):
                    setattr(module, a, lin(n))
            for n in names:
                del raw[n]

        def vec(name):
            return nn.Parameter(raw[name]["data"].to(dev), requires_grad=False)

        m = meta_model(cfg)  # no random init on meta: that would import torch._dynamo (+180 MB of budget)
        # int4pack's repack (per expert read) and the reference's dequantized matrices are large temporaries that
        # glibc's heap keeps once freed, memory the budget never counted (micro at 1.5G peaked 1.55G, its --bench
        # OOM-killed in the cgroup): near the budget, it is handed back after each expert is built (1.34G)
        trim_above = (0.9 * self.budget if self.budget and kernel in ("int4pack", "reference") and dev == "cpu"
                      else None)

        self.trim_above = trim_above if self.reference_path else None  # its per-call copies: after each forward too

        def make_expert(buf, views):
            e = Expert(c, buf, kernel, dev, views)
            if trim_above and rss_bytes() > trim_above:
                kernels.release_freed_heap()
            return e
        self.cache = EC.ExpertCache(c, 0, make_expert,
                                   score_ops=kernels.NATIVE if native else None,
                                   reader_ops=kernels.native_reader() if native or kernels.NATIVE else None,  # no build for others
                                   n_readers=self.n_readers, policy=self.cache_policy,
                                   # an expert over the buffer's views (int4pack repacks them in place, per blob): new
                                   # views per miss kept glibc's heap from shrinking (int4pack was 50-85 MiB over)
                                   reuse_views=dev == "cpu")
        embed = None if self.embed_on_disk else to_dev(raw["embed_tokens.weight"])  # one device copy when tied
        m.embed_tokens = DiskEmbedding(c, "embed_tokens.weight", dev) if self.embed_on_disk else kernels.QEmbedding(embed)
        m.lm_head = kernels.QLinear(embed, kernel, shared=True) if cfg.tie_embeddings else lin("lm_head.weight")
        m.norm.weight = vec("norm.weight")
        if native:
            m.norm = NativeRMSNorm(m.norm)
        self.moes = []
        for i, b in enumerate(m.layers):
            p = f"layers.{i}."
            b.input_layernorm.weight = vec(p + "input_layernorm.weight")
            b.post_attention_layernorm.weight = vec(p + "post_attention_layernorm.weight")
            a = b.self_attn
            a.o_proj = lin(p + "self_attn.o_proj.weight")
            fuse(a, "qkv_proj", [p + f"self_attn.{proj}.weight" for proj in ("q_proj", "k_proj", "v_proj")])
            if native:
                a.q_norm, a.k_norm = NativeRMSNorm(a.q_norm), NativeRMSNorm(a.k_norm)
                b.input_layernorm = NativeRMSNorm(b.input_layernorm)
                b.post_attention_layernorm = NativeRMSNorm(b.post_attention_layernorm)
                b.self_attn = NativeAttention(a)
            a.q_norm.weight = vec(p + "self_attn.q_norm.weight")
            a.k_norm.weight = vec(p + "self_attn.k_norm.weight")
            if b.is_moe:
                shared = b.mlp.shared_experts
                shared.down_proj = lin(p + "mlp.shared_experts.down_proj.weight")
                fuse(shared, "gate_up_proj", [p + f"mlp.shared_experts.{proj}.weight" for proj in ("gate_proj", "up_proj")])
                if native and shared.gate_up_proj is not None:
                    shared = NativeFFN(shared)
                moe = StreamedMoE(cfg, i, raw[p + "mlp.gate.weight"]["data"].to(dev),
                                  raw[p + "mlp.e_score_correction_bias"]["data"].to(dev), shared, self.cache,
                                  native)
                b.mlp = moe
                self.moes.append(moe)
            else:
                b.mlp.down_proj = lin(p + "mlp.down_proj.weight")
                fuse(b.mlp, "gate_up_proj", [p + f"mlp.{proj}.weight" for proj in ("gate_proj", "up_proj")])
                if native and b.mlp.gate_up_proj is not None:
                    b.mlp = NativeFFN(b.mlp)
        for a, b in zip(self.moes, self.moes[1:]):
            a.next_moe = b
        left = [n for n, t in list(m.named_parameters()) + list(m.named_buffers()) if t.is_meta]
        if left:
            raise StreamError(f"{self.path}: container lacks {left[:3]}; corrupt or foreign container: re-export it "
                              f"(python export.py CKPT --format int4)")
        m.eval()
        return m

    def _decode_plan(self):
        """Per layer, (attn_block's arguments before cos, a dense FFN's swiglu_ffn arguments or None, the MoE step or
        None) for _decode_step (None unless every layer runs on
        them: native kernel, CPU, fused int4 q|k|v, int4 o_proj, native norms, a native dense FFN or StreamedMoE)."""
        if self.kernel != "native" or self.device != "cpu":
            return None
        int4 = (lambda q: isinstance(q, kernels.QLinear) and q.native_args)  # noqa: E731  (int4_mm arguments, or falsy)
        plan = []
        for b in self.model.layers:
            attn, norms = b.self_attn, (b.input_layernorm, b.post_attention_layernorm)
            if not (isinstance(attn, NativeAttention) and all(isinstance(n, NativeRMSNorm) for n in norms)
                    and int4(attn.attn.qkv_proj) and int4(attn.attn.o_proj)
                    and isinstance(b.mlp, (NativeFFN, StreamedMoE))):
                return None
            a = attn.attn
            # a dense FFN's swiglu_ffn arguments, or the MoE step (its one-token path when its shared expert is fused)
            ffn = ffn_args(b.mlp.gate_up_proj.raw, b.mlp.down_proj.raw) if isinstance(b.mlp, NativeFFN) else None
            moe = None if ffn else (b.mlp.decode if b.mlp.native and b.mlp.shared_args else b.mlp.forward)
            attn_args = (norms[0].weight, norms[0].eps, *int4(a.qkv_proj), a.q_norm.weight, a.k_norm.weight,
                         a.q_norm.eps, *int4(a.o_proj), norms[1].weight, norms[1].eps)  # attn_block's, before cos
            plan.append((attn_args, ffn, moe))
        return plan

    def _decode_step(self, x, cos, sin, cache):
        """The layers of one decode token (batch 1, fp32 KV cache with room) as Block, NativeAttention, NativeRMSNorm,
        kernels.QLinear and NativeFFN compute it: the same native functions in the same order (attn_block fuses the attention
        half's five calls), bit for bit, without the ~140 nn.Module calls and ~340 module attribute lookups a token
        that cost milliseconds here."""
        op, pos, H, KV = kernels.NATIVE, cache.pos, self.cfg.n_head, self.cfg.n_kv_head
        x = x.contiguous().clone()  # attn_block adds into it
        for i, (attn_args, ffn, moe) in enumerate(self.decode_plan):
            # rms_norm, q|k|v GEMV, attn_decode, o_proj GEMV, the residual add and the post-attention norm in one call
            h = op.attn_block(x, *attn_args, cos, sin, cache.k[i], cache.v[i], pos, H, KV)
            x += op.swiglu_ffn(h, *ffn) if ffn is not None else moe(h)
        return x

    # --- settings ---
    def set_prefetch(self, on):
        for moe in self.moes:
            moe.prefetch = bool(on)
        self.cache.set_slots(2 * self.cfg.top_k if on else 0)  # a layer's guesses in flight, the last layer's landed

    def judge_prefetch(self):
        """--prefetch auto, before each decode token (forward): every PREFETCH_JUDGE_PICKS picks, prefetch
        goes on when the guesses named >= PREFETCH_ON_RIGHT of them and off below PREFETCH_OFF_RIGHT. While off,
        some tokens name guesses without reading them (the router of the next layer: ~60 us a layer on micro), fewer
        after each verdict that keeps it off, counted over the engine's decode tokens (not each request's, so short
        requests probe too). Nothing to judge when every expert fits in the cache."""
        if self.prefetch_mode != "auto" or not self.moes or self.cache.budget >= self.every_expert_bytes:
            return
        self.decode_tokens += 1
        tally, judged = self.guess_tally, self.prefetch_judged
        on = self.moes[0].prefetch
        named = tally[0] - judged[0]
        if named >= PREFETCH_JUDGE_PICKS:
            right = (tally[1] - judged[1]) / named
            want = right >= (PREFETCH_OFF_RIGHT if on else PREFETCH_ON_RIGHT)
            self.prefetch_judged = tuple(tally)
            self.prefetch_verdicts.append((round(right, 3), want))
            self.prefetch_probe_every = 2 if want else min(2 * self.prefetch_probe_every, PREFETCH_PROBE_EVERY_MAX)
            if want != on:
                self.set_prefetch(want)
                on = want
        probe = not on and self.decode_tokens % self.prefetch_probe_every == 0
        for moe in self.moes:
            moe.shadow_guess = probe

    def stop_probes(self):
        """The end of a request: no probe left on and no guess left over for the next one (a guess is one token's)."""
        for moe in self.moes:
            moe.shadow_guess, moe.guessed = False, None

    def checked_k(self, k):
        if not self.moes and k in (None, self.cfg.top_k):  # (an all-dense config's top_k, 0 included, is no request's)
            return self.cfg.top_k
        k = self.cfg.top_k if k is None else k  # (0 meant the container's top_k here while the command line refused it)
        # a model without MoE layers routes nothing: any k is the same model (an all-dense one with n_experts=0 refused
        # every request with "--experts-per-token 2: must be in 1..0", a flag nobody gave)
        most = self.cfg.n_experts if self.moes else k
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= most:
            raise StreamError(f"--experts-per-token {k}: " + (f"must be in 1..{self.cfg.n_experts}" if self.moes
                                                                 else "a whole number, at least 1"))
        return k

    def set_experts_per_token(self, k):
        """The engine's own setting, which forward() routes with (None: the container's top_k); a request's
        experts_per_token holds for its own steps only (routing below)."""
        k = self.checked_k(k)
        with self.lock:
            self.experts_per_token = k
            for moe in self.moes:
                moe.top_k = k

    @contextlib.contextmanager
    def routing(self, k):
        """One request step with its own experts per token, under the lock; the engine's setting again after it (a
        request that captured the setting before it restored another request's k)."""
        with self.lock:
            for moe in self.moes:
                moe.top_k = k
            try:
                yield
            finally:
                for moe in self.moes:
                    moe.top_k = self.experts_per_token

    @contextlib.contextmanager
    def kv_reserve(self, positions):
        """A request's KV positions out of the budget's reserve, waiting for other threads' requests to end; a
        thread whose own open requests hold what it lacks would wait for ever, so that is an error."""
        me = threading.get_ident()
        with self.kv_turn:
            while self.kv_free < positions:
                if self.kv_held.get(me):
                    raise StreamError(f"a request of {positions} KV positions while this thread's open requests hold "
                                      f"{self.kv_held[me]} of the {self.context} reserved; finish (or close) them first, "
                                      f"or load with a larger context")
                self.kv_turn.wait()
            self.kv_free -= positions
            self.kv_held[me] = self.kv_held.get(me, 0) + positions
        try:
            yield
        finally:
            with self.kv_turn:
                self.kv_free += positions
                self.kv_held[me] -= positions
                if not self.kv_held[me]:
                    del self.kv_held[me]
                self.kv_turn.notify_all()

    # --- forward ---
    def forward(self, ids, cache=None, positions=None, last_only=False):
        """Threads may share the engine: one forward at a time (the lock), see _forward. Input that does not fit the KV
        cache (without one: the reserved context) is refused before any chunk runs. Without a cache, input longer
        than a prefill chunk takes its KV positions from the reserve (kv_reserve), as a request does."""
        if positions is not None:  # (it was taken and ignored: RoPE always counts from the cache's position)
            raise StreamError("Engine.forward: positions are not supported; positions follow the KV cache")
        T = ids.shape[-1]
        # checked before any chunk runs: the chunks that fit advanced the cache, then model.py's ValueError
        if cache is not None and cache.pos + T > cache.max_len:
            raise StreamError(f"Engine.forward: {T} tokens do not fit the KV cache ({cache.pos} of {cache.max_len} "
                              f"positions used); nothing was run: use a larger cache or a new one")
        if cache is None and T > self.context:  # (model.py refuses past max_seq_len; the budget reserved context)
            raise StreamError(f"Engine.forward: {T} tokens exceed the reserved context {self.context} (max_seq_len "
                              f"{self.cfg.max_seq_len}); shorten the input or load with a larger context")
        # a long input without a cache gets one of T positions (_forward): out of the reserve, as a request's (made
        # beside another thread's request it was two KV caches where the budget counts one); before the lock, which
        # the reserve's holders need to finish
        reserve = self.kv_reserve(T) if cache is None and T > self.prefill_chunk else contextlib.nullcontext()
        with reserve, self.lock:
            try:
                return self._forward(ids, cache, last_only)
            finally:
                if self.trim_above and rss_bytes() > self.trim_above:
                    kernels.release_freed_heap()

    @torch.no_grad()
    def _forward(self, ids, cache=None, last_only=False):
        """ids (1, T) -> final hidden states (1, T, D) (fp32), or with last_only the last position's (1, 1, D); the KV
        cache advances by T. Long inputs go through in chunks of prefill_chunk tokens (on a KV cache, a fresh one when
        none is given), so activation memory does not grow with the prompt: the budget reserves one chunk's worth.
        The whole output is T x D floats: stream() asks for the last row only, loglikelihood() a chunk at a time."""
        T, n = ids.shape[1], self.prefill_chunk
        if T > n:
            if cache is None:
                cache = KVCache(self.cfg, 1, T, self.device, torch.float32)
            out = None if last_only else torch.empty(1, T, self.cfg.d_model, device=self.device)
            for i in range(0, T, n):  # filled in place: a cat of the chunks held the whole output twice
                h = self.forward(ids[:, i:i + n], cache)
                if last_only:
                    out = h[:, -1:]
                else:
                    out[:, i:i + n] = h
                del h
            return out
        m = self.model
        start = cache.pos if cache is not None else 0
        if ids.shape == (1, 1) and start > 0:
            self.judge_prefetch()  # a decode token, whichever loop feeds it (stream, chat.py, an API user's)
        x = m.embed_tokens(ids).float()
        pos = torch.arange(start, start + ids.shape[1], device=ids.device)
        cos, sin = rope_cos_sin(pos, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        if (self.decode_plan is not None and ids.shape == (1, 1) and cache is not None and cache.pos < cache.max_len
                and cache.k[0].dtype == torch.float32):
            x = self._decode_step(x, cos, sin, cache)
        else:
            for block in m.layers:
                x = block(x, cos, sin, cache)
        if cache is not None:
            cache.pos += ids.shape[1]
        return m.norm(x[:, -1:] if last_only else x)

    def logits(self, h):
        return self.model.lm_head(h).float()

    def _check_ids(self, ids, what):
        bad = [i for i in ids if not 0 <= int(i) < self.cfg.vocab_size]
        if bad:
            raise StreamError(f"{self.path}: {what} token id {bad[0]} outside vocab 0..{self.cfg.vocab_size - 1}")

    @torch.no_grad()
    def stream(self, prompt_ids, max_new_tokens, temperature=0.0, top_p=None, experts_per_token=None, seed=None,
               eos_id=None, timings=None):
        """New token ids one by one, as a generator (prefill the prompt in chunks of prefill_chunk, then one token per
        step). The request is checked here, when called, not at the first next(): the CLI printed the prompt, then the
        error."""
        try:  # whole numbers only: a float id was truncated, text raised a bare ValueError
            if isinstance(prompt_ids, (str, bytes)):
                raise TypeError
            prompt_ids = [operator.index(i) for i in prompt_ids]
        except TypeError:
            raise StreamError("prompt: a list of token ids (ints); encode text with the container's tokenizer first") from None
        if not prompt_ids:
            raise StreamError("empty prompt: give at least one token")
        self._check_ids(prompt_ids, "prompt")
        temperature = check_sampling(temperature, top_p, seed=seed)  # (a bad seed: a bare torch error, manual_seed)
        try:  # (a negative count gave [] silently, a float a torch TypeError, True one token)
            max_new_tokens = -1 if isinstance(max_new_tokens, bool) else operator.index(max_new_tokens)
        except TypeError:
            max_new_tokens = -1
        if max_new_tokens < 0:
            raise StreamError("max_new_tokens: a whole number, 0 or more")
        try:  # one id or several (a chat template's end markers); a list compared to a token never stopped
            stop_ids = set() if eos_id is None else {operator.index(eos_id)} if not hasattr(eos_id, "__iter__") \
                else {operator.index(i) for i in eos_id}
        except TypeError:
            raise StreamError(f"eos_id {eos_id!r}: a token id or a collection of them") from None
        total = len(prompt_ids) + max_new_tokens - 1  # the last new token is never fed back
        if total > self.context:
            raise StreamError(f"prompt {len(prompt_ids)} + {max_new_tokens} new tokens exceeds the reserved context "
                              f"{self.context} (max_seq_len {self.cfg.max_seq_len}); "
                              f"{self._context_fix(len(prompt_ids), total)}")
        # the request's own, else the engine's (set_experts_per_token): set for each of its steps (routing)
        k = self.checked_k(experts_per_token if experts_per_token is not None else self.experts_per_token)
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        return self._stream_reserved(prompt_ids, max_new_tokens, temperature, top_p, k, gen, stop_ids, timings, total)

    def _context_fix(self, n_prompt, total):
        """What makes a request of n_prompt tokens and `total` KV positions fit, and only that (fewer new tokens do
        nothing for a prompt longer than the context, a larger --context nothing past the model's max_seq_len)."""
        top = self.cfg.max_seq_len
        larger = (f"pass --context {total} or more (max_seq_len {top})" if total <= top
                  else f"pass --context {top} (max_seq_len) with --max-new-tokens {top - n_prompt + 1} or fewer")
        if n_prompt <= self.context:  # the prompt fits: fewer new tokens do
            return (f"lower --max-new-tokens to {self.context - n_prompt + 1} or fewer"
                    + (f", or {larger}" if self.context < top else ""))
        if n_prompt <= top and self.context < top:
            return f"the prompt alone is over the context: shorten the prompt, or {larger}"
        return f"the prompt alone is over the model's max_seq_len {top}: shorten the prompt"

    def _stream_reserved(self, prompt_ids, max_new_tokens, temperature, top_p, k, gen, stop_ids, timings, total):
        with self.kv_reserve(max(total, 1)):
            yield from self._stream(prompt_ids, max_new_tokens, temperature, top_p, k, gen, stop_ids, timings, total)

    def _stream(self, prompt_ids, max_new_tokens, temperature, top_p, k, gen, stop_ids, timings, total):
        kv = KVCache(self.cfg, 1, max(total, 1), self.device, torch.float32)
        ids = torch.tensor([prompt_ids], device=self.device)
        try:
            for step in range(max_new_tokens):
                t0 = time.perf_counter()
                with self.routing(k):  # the engine is shared: other requests' steps come in between
                    h = self.forward(ids, kv, last_only=True)
                    logits = self.logits(h[:, -1])
                nxt = sample_next(logits, temperature, None, top_p, gen)
                tok = int(nxt.item())
                if timings is not None:
                    timings.append(time.perf_counter() - t0)
                yield tok
                if tok in stop_ids:
                    break
                ids = nxt.view(1, 1)
        except KeyboardInterrupt:  # Ctrl-C: the reads still queued are dropped (settle below waited for every one)
            with self.lock:
                self.cache.cancel()
            raise
        finally:
            if not self.finalizing():  # a stream left unfinished until exit: torch is torn down, nothing to tidy
                with self.lock:
                    self.stop_probes()  # a probe is for decode tokens only
                    self.cache.settle()

    def generate(self, prompt_ids, max_new_tokens, temperature=0.0, top_p=None, experts_per_token=None, seed=None,
                 eos_id=None):
        return list(self.stream(prompt_ids, max_new_tokens, temperature, top_p, experts_per_token, seed, eos_id))

    @torch.no_grad()
    def loglikelihood(self, context_ids, continuation_ids=None, experts_per_token=None):
        """(sum of log p(continuation | context), whether every continuation token is the greedy argmax).
        With continuation_ids None: scores tokens[1:] of context_ids given the ones before. experts_per_token: the
        request's own, as stream()'s (None: the container's top_k, whatever the engine serves with)."""
        k = self.checked_k(experts_per_token)
        return self._scored(*self._checked_request(context_ids, continuation_ids), k)

    def _checked_request(self, context_ids, continuation_ids):
        """A loglikelihood request's (context, context + continuation) ids, or a StreamError saying what is wrong."""
        try:  # whole numbers only, as stream(): a float id was truncated, a string's digits were read as ids
            if isinstance(context_ids, (str, bytes)) or isinstance(continuation_ids, (str, bytes)):
                raise TypeError
            ctx = [operator.index(i) for i in context_ids]
            cont = None if continuation_ids is None else [operator.index(i) for i in continuation_ids]
        except TypeError:
            raise StreamError("loglikelihood: lists of token ids (ints); encode text with the container's tokenizer "
                              "first") from None
        if cont is None:
            ctx, cont = ctx[:1], ctx[1:]
        if not ctx or not cont:
            raise StreamError("loglikelihood needs a non-empty context and continuation")
        ids = ctx + cont
        if len(ids) - 1 > self.context:  # the last token is only a target: it is never run
            fix = ("shorten the input (the model's max_seq_len)" if self.context >= self.cfg.max_seq_len
                   else "load with a larger context")
            raise StreamError(f"{len(ids) - 1} tokens exceed the reserved context {self.context}; {fix}")
        self._check_ids(ids, "input")
        return ctx, ids

    def _scored(self, ctx, ids, k):
        with self.kv_reserve(len(ids) - 1), self.routing(k):
            return self._loglikelihood(ctx, ids)

    def _loglikelihood(self, ctx, ids):
        run = ids[:-1]  # position p predicts ids[p + 1]; the continuation's targets start at position len(ctx) - 1
        kv = KVCache(self.cfg, 1, len(run), self.device, torch.float32)
        total, greedy, n = 0.0, True, self.prefill_chunk
        try:
            for c0 in range(0, len(run), n):  # a prefill chunk at a time, scored as it comes (no T x D output kept)
                h = self.forward(torch.tensor([run[c0:c0 + n]], device=self.device), kv)[0]
                first = max(c0, len(ctx) - 1)  # the chunk's first position whose target is a continuation token
                for i in range(first, c0 + h.shape[0], LOGIT_CHUNK):  # logit rows a chunk at a time (the budget: one)
                    j = min(i + LOGIT_CHUNK, c0 + h.shape[0])
                    logits = self.logits(h[i - c0:j - c0])
                    t = torch.tensor(ids[i + 1:j + 1], device=h.device)
                    total += float(torch.log_softmax(logits, dim=-1).gather(1, t[:, None]).sum())
                    greedy = greedy and bool((logits.argmax(dim=-1) == t).all())
                del h
        except KeyboardInterrupt:  # Ctrl-C: the reads still queued are dropped, not waited for
            self.cache.cancel()
            raise
        finally:  # reads in flight end with the request, whatever ended it
            self.cache.settle()
        return total, greedy

    @torch.no_grad()
    def loglikelihood_batch(self, requests, experts_per_token=None):
        """loglikelihood of each (context_ids, continuation_ids) pair; every pair is checked before any is scored
        (a bad one was a bare unpacking error, or a StreamError naming no request, after the ones before it ran)."""
        k = self.checked_k(experts_per_token)
        if not isinstance(requests, (list, tuple)):
            raise StreamError(f"loglikelihood_batch: a list of (context_ids, continuation_ids) pairs, not "
                              f"{type(requests).__name__}")
        checked = []
        for i, req in enumerate(requests):
            if not isinstance(req, (list, tuple)) or len(req) != 2:
                raise StreamError(f"loglikelihood_batch: request {i} is {type(req).__name__} {repr(req)[:40]}, not "
                                  f"a (context_ids, continuation_ids) pair")
            try:
                checked.append(self._checked_request(*req))
            except StreamError as e:
                raise StreamError(f"loglikelihood_batch: request {i}: {e}") from None
        return [self._scored(ctx, ids, k) for ctx, ids in checked]


def compute_threads(eng, threads="auto"):
    """auto: every core, streaming or not (measured in the module docstring)."""
    if threads != "auto":
        return max(1, int(threads))
    # the cores this process may run on (a container's or taskset's share), not the machine's
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def load(path, ram_budget=None, device="cpu", **kw):
    """An Engine over an int4 container; ram_budget like '2G' (None: no limit, every expert cacheable)."""
    return Engine(path, ram_budget=ram_budget, device=device, **kw)


# ----------------------------------------------------------------------------------------------------------
# CLI

def load_tokenizer(cont, path):
    """The container's tokenizer, None when it carries none."""
    if not cont.tokenizer_json:
        return None
    import tempfile
    import tokenizer
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write(cont.tokenizer_json)
    try:
        return tokenizer.Tokenizer.load(f.name)
    except ValueError as e:  # (it was taken for no tokenizer: prompt bytes became token ids)
        raise StreamError(f"{path}: the tokenizer it carries does not load ({e}); re-export it from a checkpoint "
                          f"whose tokenizer.json loads") from None
    finally:
        os.remove(f.name)


def given(argv, flag):
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def check_args(args, argv):
    """Bad flags as one-line errors before anything is loaded (or a benchmark has run for minutes)."""
    if args.ram_budget is not None:
        parse_size(args.ram_budget)
    if not os.path.exists(args.container):
        raise StreamError(f"{args.container}: no such file; export one with python export.py CKPT --format int4 --out PATH")
    if args.threads != "auto" and not (args.threads.isdigit() and int(args.threads) >= 1):
        raise StreamError(f"--threads {args.threads!r}: a positive integer or auto")
    if args.repeat < 1 or (args.repeat > 1 and not args.sweep):
        raise StreamError(f"--repeat {args.repeat}: a positive count of runs per budget, for --sweep")
    check_readers(args.readers, "--readers")
    args.temperature = check_sampling(args.temperature, args.top_p, "--", args.seed)
    if args.experts_per_token is not None and args.experts_per_token < 1:  # 0 meant the default, silently
        raise StreamError(f"--experts-per-token {args.experts_per_token}: at least 1 (leave it out for the model's)")
    budgets = [b.strip() for b in (args.sweep or "").split(",") if b.strip()]
    if args.sweep is not None and not budgets:
        raise StreamError(f"--sweep {args.sweep!r}: a comma-separated list of budgets, e.g. 4G,2G,1G")
    for b in budgets:  # each budget now, named as --sweep's (it said --ram-budget)
        try:
            parse_size(b)
        except StreamError:
            raise StreamError(f"--sweep {args.sweep!r}: {b!r} is not a size; use a number with K, M, G or T, "
                              f"e.g. 4G,2G,1G") from None
    least = 2 if args.bench or args.sweep else 1 if args.chat else 0  # (--chat -1 said "0 or more", then 0 was refused)
    if args.max_new_tokens < least:
        raise StreamError(f"--max-new-tokens {args.max_new_tokens}: " + ("a benchmark times decode after the first "
                          "token, so at least 2" if least == 2 else "at least 1 (the longest answer)" if least == 1
                          else "0 or more"))
    if args.bench_prompt_tokens < 1:
        raise StreamError(f"--bench-prompt-tokens {args.bench_prompt_tokens}: at least 1")
    if problem := device_problem(args.device):
        raise StreamError(f"--device {args.device}: {problem}")
    if args.kernel == "triton" and not str(args.device).startswith("cuda"):
        raise StreamError("--kernel triton: Triton kernels run on CUDA (--device cuda); on the CPU use --kernel auto")
    if args.chat:
        dropped = [f for f in ("--kernel", "--prefetch", "--cache-policy", "--readers", "--no-preload", "--bench",
                               "--sweep", "--json") if given(argv, f)]
        if dropped:
            raise StreamError(f"--chat does not take {', '.join(dropped)} (chat.py serves with the defaults)")
    idle = [f for f in ("--json", "--plot", "--llamacpp-json", "--bench-prompt-tokens") if given(argv, f)]
    if idle and not (args.bench or args.sweep):  # accepted and ignored (--json's folder made, left empty)
        raise StreamError(f"{', '.join(idle)}: for --bench or --sweep only")
    idle = [f for f in ("--plot", "--llamacpp-json") if given(argv, f)]
    if idle and not args.sweep:  # (--bench drew nothing, silently)
        raise StreamError(f"{', '.join(idle)}: the plot of a --sweep; --bench draws none")
    if args.chat and given(argv, "--prompt"):
        raise StreamError("--chat does not take --prompt (type the first message at the prompt)")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path and (os.path.isdir(path) or path.endswith(os.sep)):  # found only after the whole run, a traceback
            raise StreamError(f"{flag} {path}: a folder; give a file path (e.g. {os.path.join(path, 'bench.json')})")
        where = os.path.dirname(os.path.abspath(path)) if path else None
        if where and not os.path.isdir(where):
            try:  # made now, not after a benchmark that ran for minutes
                os.makedirs(where)
            except OSError as e:
                raise StreamError(f"{flag} {path}: cannot make its folder ({e.strerror})")
        if path and os.path.exists(path) and os.path.exists(args.container) and os.path.samefile(path, args.container):
            raise StreamError(f"{flag} {path}: is the container itself (the results would replace it); give another "
                              f"path, e.g. {'bench.json' if flag == '--json' else 'sweep.png'}")
        if path:  # written only after the benchmark: a path it cannot write was a traceback then
            existed = os.path.exists(path)
            try:
                open(path, "a").close()
            except OSError as e:
                raise StreamError(f"{flag} {path}: cannot write it ({e.strerror or e}); give a path you can write")
            if not existed:
                os.remove(path)


def plural(n, word):
    return f"{n} {word}{'' if n == 1 else 's'}"


def timing_summary(n_prompt, step_s):
    """The CLI's speeds from Engine.stream's timings: the prompt's prefill apart from decode (one rate over both
    read 3.5 tok/s on micro at 1G after a 40-token prompt, its decode ran at 17)."""
    if not step_s:
        return f"0 new tokens (prompt of {plural(n_prompt, 'token')} not run)"
    line = f"prompt {plural(n_prompt, 'token')} in {step_s[0]:.2f} s ({n_prompt / step_s[0]:.2f} tok/s)"
    decode_s = sum(step_s[1:])
    if len(step_s) == 1 or decode_s <= 0:
        return line + f", {plural(len(step_s), 'new token')}"
    return line + (f", {plural(len(step_s), 'new token')}: decode {(len(step_s) - 1) / decode_s:.2f} tok/s "
                   f"after the first")


def main(argv=None):
    # allow_abbrev=False: --kern / --max-new got past --chat's checks, which read argv, and were dropped silently
    ap = argparse.ArgumentParser(description="int4 MoE inference under a RAM budget, routed experts streamed from disk.",
                                 allow_abbrev=False)
    ap.add_argument("container", help="int4 container (python export.py CKPT --format int4 --out model.pcf4)")
    ap.add_argument("--ram-budget", help="bound for the whole process, e.g. 4G, 512M, 1.5G (default: no bound)")
    ap.add_argument("--prompt", default="Once upon a time",
                    help="prompt text (token ids '1,2,3' if no tokenizer; default: 'Once upon a time')")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64; --bench: decoded)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=None, help="nucleus sampling with --temperature > 0")
    ap.add_argument("--experts-per-token", type=int, default=None, help="default: the container's top_k")
    ap.add_argument("--seed", type=int, default=None, help="sampling seed (default: a fresh one each run)")
    ap.add_argument("--bench", action="store_true", help="honest benchmark (memory cgroup, page cache dropped)")
    ap.add_argument("--bench-prompt-tokens", type=int, default=32, help="--bench: random prompt tokens prefilled (32)")
    ap.add_argument("--json", help="write the benchmark result here (--sweep: its table as markdown beside it, .md)")
    ap.add_argument("--sweep", help="benchmark at each budget, e.g. 4G,2G,1G (table + PNG plot)")
    ap.add_argument("--plot", help="PNG path for --sweep (default: next to --json, or sweep.png)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="--sweep: run every budget N times (rounds over all budgets) and keep each one's median run")
    ap.add_argument("--llamacpp-json", default="bench/vs_llamacpp.json",
                    help="llama.cpp figures from bench/vs_llamacpp.py to draw beside the sweep")
    ap.add_argument("--chat", action="store_true", help="multi-turn chat at the terminal (chat.py; history kept in the KV cache)")
    ap.add_argument("--kernel", default="auto", choices=KERNELS,
                    help="int4 matmul: auto = triton on CUDA, else native (int4_cpu.cpp, built on first use), else "
                         "int4pack (torch's CPU kernel); reference dequantizes then multiplies")
    ap.add_argument("--readers", type=int, default=4, help="expert reader threads (default 4)")
    ap.add_argument("--prefetch", nargs="?", const="on", default="auto", choices=PREFETCH_MODES,
                    help="read the next layer's likely experts ahead (its router on this hidden state): auto (default: "
                         "on while its guesses name >= 80%% of the picks), on (--prefetch alone, after the container "
                         "path, or --prefetch=on) or off")
    ap.add_argument("--cache-policy", default="score", choices=EC.CACHE_POLICIES,
                    help="expert eviction: score (default: the expert its router scored lowest lately) or lru")
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    ap.add_argument("--threads", default="auto",
                    help="compute threads; auto: every core (use 1 on a machine whose cores are busy elsewhere)")
    ap.add_argument("--context", type=int, default=None, help="KV cache positions reserved in the budget (default "
                    "512 with --ram-budget, else the model's max_seq_len; never more than max_seq_len)")
    ap.add_argument("--no-preload", action="store_true",
                    help="at start-up the expert cache is filled (every expert when all fit in --ram-budget, else as many "
                         "as fit, evenly per layer); this starts empty and reads on demand")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    answering = False  # stdout holds an answer's unfinished line (an error mid-answer went on the end of it)
    try:
        check_args(args, argv)
        if args.chat:  # the chat loop, template and turn tokens live in chat.py; this is its int4 entry point
            if not os.path.exists(os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat.py")):
                raise StreamError("--chat: needs chat.py (the chat issue), which this checkout lacks")
            import chat
            fwd = [args.container, "--temperature", str(args.temperature), "--device", args.device]
            for flag, v in (("--ram-budget", args.ram_budget), ("--top-p", args.top_p), ("--seed", args.seed),
                            ("--experts-per-token", args.experts_per_token), ("--context", args.context)):
                if v is not None:
                    fwd += [flag, str(v)]
            if "--max-new-tokens" in argv or any(a.startswith("--max-new-tokens=") for a in argv):
                fwd += ["--max-new-tokens", str(args.max_new_tokens)]
            if args.threads != "auto":
                fwd += ["--threads", args.threads]
            return chat.main(fwd)
        if args.bench or args.sweep:  # the honest benchmark lives in stream_bench.py
            import stream_bench
            return stream_bench.main(args, argv)
        eng = load(args.container, args.ram_budget, args.device, kernel=args.kernel, n_readers=args.readers,
                   prefetch=args.prefetch, context=args.context, cache_policy=args.cache_policy,
                   preload=False if args.no_preload else "auto")
        torch.set_num_threads(compute_threads(eng, args.threads))
        k = eng.checked_k(args.experts_per_token)  # (a k out of range: its error before any note)
        if note := more_experts_note(k, eng.cfg.top_k if eng.moes else None):
            print(note, file=sys.stderr)
        if args.context and args.context > eng.context:  # (capped without a word)
            print(f"note: --context {args.context} is capped at the model's max_seq_len {eng.context}", file=sys.stderr)
        tok = eng.tokenizer
        if tok is not None:
            ids = [tok.bos_id] + tok.encode(args.prompt)
            # every special, as chat.py and the exports (bos alone: a chat model's answer ran on into a turn it made up)
            eos = set(tok.special_ids.values())
        else:
            try:
                ids = [int(t) for t in args.prompt.split(",")]
            except ValueError:
                if not eng.container.header.get("random_weights"):  # a trained model fed bytes as ids: noise
                    raise StreamError(f"{args.container} has no tokenizer (its checkpoint had no tokenizer.json); give "
                                      f"--prompt as token ids (1,2,3), or export again with --tokenizer FILE")
                ids = [b % (eng.cfg.vocab_size - 1) + 1 for b in args.prompt.encode()]
                print(f"note: {args.container} has no tokenizer (random weights); prompt bytes used as token ids",
                      file=sys.stderr)
            eos = None
        if hasattr(sys.stdout, "reconfigure"):  # a character the terminal's encoding lacks (an emoji in Latin-1, or
            sys.stdout.reconfigure(errors="replace")  # U+FFFD in ASCII) was a UnicodeEncodeError traceback mid-answer
        out, shown, step_s = [], "", []  # step_s[0]: the prompt's prefill (and the first token), then one per token
        tokens = eng.stream(ids, args.max_new_tokens, args.temperature, args.top_p, args.experts_per_token, args.seed,
                            eos, timings=step_s)  # (checked before the prompt is shown)
        # a model's ESC sequences (random weights, a hostile fine-tune) drove the terminal: escaped there, exact piped
        show = str
        if tok is not None and sys.stdout.isatty():
            from tokenizer import terminal_text as show  # (loaded already: the container's tokenizer)
        sys.stdout.write(show(args.prompt) if tok is not None else "")
        answering = True
        for t in tokens:
            out.append(t)
            if tok is not None:
                # as chat.py and eval.py: specials (the <|bos|> that ends a document) not printed by name, and an id
                # with no text (reserved 0) a U+FFFD, not a ValueError
                text = tok.decode_generated(out)
                if not text.endswith("\ufffd"):
                    sys.stdout.write(show(text[len(shown):]))
                    shown = text
            else:
                sys.stdout.write(f"{t} ")
            sys.stdout.flush()
        if tok is not None:  # what a trailing U+FFFD held back (an unfinished character, an id with no text)
            sys.stdout.write(show(tok.decode_generated(out)[len(shown):]))
        st = eng.cache.stats()
        print()
        # (--max-new-tokens 0 runs nothing: no lookups, although the model has routed experts)
        guessed = st["prefetch_hits"] / max(st["lookups"], 1)  # (read from the disk: a hit counted them, 0.73 for 0.38)
        hit = (f"expert hit rate {st['cache_hit_rate']:.3f}" + (f" (+{guessed:.3f} right guesses, read ahead)"
                                                               if guessed else "") if st["lookups"] else
               "no expert lookups" if eng.moes else "no routed experts")
        print(f"[{timing_summary(len(ids), step_s)}; with the prompt's: {hit}, read {st['bytes_read'] / 1e6:.1f} MB; "
              f"peak RSS {fmt_size(peak_rss_bytes())}]", file=sys.stderr)
        return 0
    except (StreamError, EC.CacheError, C.ContainerError) as e:
        if answering:  # (a corrupt expert found mid-answer): the answer's line ends, the error has its own
            with contextlib.suppress(OSError):
                print(flush=True)
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C in a generation or a benchmark (its child and cgroup are gone by now)
        print("\nstream_infer: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `| head`: the reader left; no traceback (stdout pointed elsewhere for the exit's flush)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.modules.setdefault("stream_infer", sys.modules[__name__])  # stream_bench's `import stream_infer`: this module,
    sys.exit(main())                                                # so its StreamError is the one main() catches
