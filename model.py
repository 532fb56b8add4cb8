"""
picaflor model: a fine-grained Mixture-of-Experts decoder-only transformer.

Architecture (identical to Hugging Face `HYV3ForCausalLM`, model_type `hy_v3`, and llama.cpp `hy_v3`):
- token embedding -> n_layer blocks -> final RMSNorm -> lm_head
- block: x += attn(rmsnorm(x)); x += ffn(rmsnorm(x))   (pre-norm)
- attention: grouped-query (n_kv_head < n_head), per-head RMSNorm on q and k (over head_dim), full RoPE
  (rotate_half / NEOX layout), no biases
- ffn: the first n_dense_layers blocks use a dense SwiGLU of width dense_ffn; the others are MoE:
  sigmoid router in fp32 with a selection-only bias (DeepSeek-V3), top_k routed SwiGLU experts of width
  expert_ffn whose weights are normalised to sum to 1 then multiplied by route_scale, plus one ungated
  shared SwiGLU expert of width n_shared * expert_ffn
- balance without auxiliary loss (DeepSeek-V3, arXiv 2412.19437 sec. 2.1.2):
  after each optimizer step bias += gamma * sign(mean_load - load), centred.

Parameter names are HF's with the leading "model." dropped (lm_head keeps its name), so the mapping to
`HYV3ForCausalLM` is one line (see HF_NAME_TABLE below and `to_hf_state_dict`).

Implementer's calls (recorded here as DESIGN.md asks):
- routed experts are stored as HF keeps them in memory: experts.gate_up_proj [E, 2F, D] (gate rows first),
  experts.down_proj [E, D, F]; dispatch sorts token-slots by expert and runs torch._grouped_mm (bf16 on CUDA
  sm90+), with a padded-bmm fallback elsewhere; on CPU the sorted rows go to `ExpertFFNCPU`, which deals whole
  experts to the cores (single-threaded GEMMs each): ~20% faster than grouped_mm for a nano-width MoE layer on
  2 cores (bench/train_step.py); `moe_reference` is the plain per-expert loop that tests compare against.
  The row shuffles around the grouped matmuls are small autograd Functions whose backward is a gather through
  the inverse permutation (no scatter-add: deterministic on GPU, faster on CPU), and the SwiGLU between them
  writes its (rows, 2F) grad in one contiguous piece; the k expert outputs are mixed with the routing weights
  in fp32.
- on CPU, `tune_cpu_malloc()` (call once at start-up) keeps glibc from unmapping and page-faulting the big
  expert-grad tensors every step; with it a nano-width MoE layer's backward took ~20% less CPU time here.
- the per-expert token counts of training forwards accumulate in a non-persistent buffer (`load_accum`) so
  gradient accumulation and DDP all-reduce see the load of the whole optimizer step; tokens a forward's load_mask
  leaves out (train.py: packed chat rows' <|bos|> padding, identical tokens that all pick the same experts) are
  routed but not counted, so they steer no bias.
"""

import difflib
import json
import math
import os
import re
import sys
from dataclasses import dataclass, asdict, fields

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelConfig:
    vocab_size: int = 32768
    n_layer: int = 24
    n_dense_layers: int = 1
    d_model: int = 1024
    n_head: int = 16
    n_kv_head: int = 4
    dense_ffn: int = 4096
    n_experts: int = 64
    expert_ffn: int = 512
    n_shared: int = 4            # shared expert width = n_shared * expert_ffn
    top_k: int = 2
    route_scale: float = 1.0
    bias_update_rate: float = 1e-3  # gamma of the aux-loss-free balancing
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    @property
    def head_dim(self):
        return self.d_model // self.n_head

    def validate(self):
        sizes = (["vocab_size", "n_layer", "d_model", "n_head", "n_kv_head", "max_seq_len"]
                 + (["dense_ffn"] if self.n_dense_layers > 0 else [])
                 + (["n_experts", "expert_ffn", "n_shared"] if self.n_dense_layers < self.n_layer else []))
        small = [f"{k}={getattr(self, k)}" for k in sizes if getattr(self, k) < 1]
        if small:  # a zero head count divided by zero below
            raise ValueError("bad model config: " + ", ".join(small) + " must be at least 1")
        problems = []
        if self.d_model % self.n_head:
            problems.append(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            problems.append(f"n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}")
        if self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even for RoPE")
        if not 0 <= self.n_dense_layers <= self.n_layer:
            problems.append(f"n_dense_layers={self.n_dense_layers} must be in [0, n_layer={self.n_layer}]")
        if self.n_dense_layers < self.n_layer and not 1 <= self.top_k <= self.n_experts:
            problems.append(f"top_k={self.top_k} must be in [1, n_experts={self.n_experts}]")
        # finite in float32, which the model computes in (a negative rope_theta surfaced as a NaN loss at step 0; 1e308
        # was inf there, and an OverflowError traceback in the GGUF export)
        f32_max = torch.finfo(torch.float32).max
        for k in ("rope_theta", "norm_eps", "route_scale"):
            if not (0 < getattr(self, k) <= f32_max):
                problems.append(f"{k}={getattr(self, k)} must be a finite number > 0 (float32's)")
        if not 0 <= self.bias_update_rate <= f32_max:
            problems.append(f"bias_update_rate={self.bias_update_rate} must be a finite number >= 0 (float32's)")
        if problems:
            raise ValueError("bad model config: " + "; ".join(problems))
        return self

    @classmethod
    def missing_keys(cls, d):
        """The fields a config dict does not name, sorted (a saved one must name every field)."""
        return sorted({f.name for f in fields(cls)} - set(d))

    @classmethod
    def from_dict(cls, d, complete=False):
        """complete: d is a saved config (state.json), which must name every field; a default standing in for a
        missing one (rope_theta, norm_eps, route_scale) gave other logits without a word."""
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown model config keys {unknown}")
        missing = cls.missing_keys(d) if complete else []
        if missing:
            raise ValueError(f"model config lacks keys {missing}")
        # each field of its default's type (a float may be written as a whole number): n_dense_layers 0.5 or n_layer
        # "3" from a saved dict passed validate and was a TypeError traceback in range() later
        wrong = [f"{f.name}={d[f.name]!r}" for f in fields(cls) if f.name in d and not (
            type(d[f.name]) is type(f.default) or type(f.default) is float and type(d[f.name]) is int)]
        if wrong:
            raise ValueError(f"model config field {wrong[0]} is not of its kind (a whole number, a number or "
                             f"true/false, as {cls.__name__} defines)")
        return cls(**d).validate()


# ----------------------------------------------------------------------------------------------------------
# building blocks

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # normalise in fp32, cast back, then scale (the order HF's HYV3RMSNorm uses)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rope_cos_sin(positions, head_dim, theta, dtype):
    """cos/sin tables (T, head_dim) for NEOX-style rotate_half RoPE (RoFormer, arXiv 2104.09864)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x, cos, sin):
    # x: (B, H, T, hd)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class KVCache:
    """Preallocated per-layer key/value cache for generation; `pos` is the number of cached positions."""

    def __init__(self, cfg, batch_size, max_len, device, dtype):
        shape = (batch_size, cfg.n_kv_head, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.max_len = max_len
        self.pos = 0

    def update(self, layer, k, v):
        T = k.shape[2]
        if self.pos + T > self.max_len:
            raise ValueError(f"KV cache full: {self.pos} + {T} > {self.max_len} positions")
        self.k[layer][:, :, self.pos:self.pos + T] = k
        self.v[layer][:, :, self.pos:self.pos + T] = v
        return self.k[layer][:, :, :self.pos + T], self.v[layer][:, :, :self.pos + T]


class Attention(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        hd = cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_head * hd, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_head * hd, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_head * hd, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * hd, cfg.d_model, bias=False)
        self.q_norm = RMSNorm(hd, cfg.norm_eps)
        self.k_norm = RMSNorm(hd, cfg.norm_eps)
        self.qkv_proj = None  # optional fused q|k|v (stream_infer's int4 engine: one GEMV); checkpoints keep three

    def forward(self, x, cos, sin, cache=None, attn_mask=None):
        B, T, _ = x.shape
        hd = self.cfg.head_dim
        if self.qkv_proj is not None:
            kv = self.cfg.n_kv_head * hd
            q, k, v = self.qkv_proj(x).split([self.cfg.n_head * hd, kv, kv], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = self.q_norm(q.view(B, T, -1, hd)).transpose(1, 2)
        k = self.k_norm(k.view(B, T, -1, hd)).transpose(1, 2)
        v = v.view(B, T, -1, hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        past = 0
        if cache is not None:
            past = cache.pos
            k, v = cache.update(self.layer_idx, k, v)
        if attn_mask is not None:  # (B, 1, T, T): causal within each packed document (training only)
            # k, v repeated per query head: CUDA's masked kernel (memory-efficient) may not take enable_gqa, and its
            # fallback (math) holds B x H x T x T scores per layer
            rep = q.shape[1] // k.shape[1]
            y = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                               attn_mask=attn_mask)
        elif past == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        elif T == 1:
            y = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        else:  # a chunk appended to a cache: query i sees keys 0 .. past + i
            mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020, arXiv 2002.05202); also the shared expert."""

    def __init__(self, d_model, width):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, width, bias=False)
        self.up_proj = nn.Linear(d_model, width, bias=False)
        self.down_proj = nn.Linear(width, d_model, bias=False)
        self.gate_up_proj = None  # optional fused gate|up (stream_infer's int4 engine); checkpoints keep two

    def forward(self, x):
        if self.gate_up_proj is not None:
            g, u = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(g) * u)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_model, dtype=torch.float32))

    def forward(self, x, bias, top_k, route_scale):
        """Sigmoid scores in fp32; the bias only chooses experts; weights = normalised unbiased scores."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))
            _, idx = torch.topk(scores + bias, top_k, dim=-1, sorted=False)
            w = scores.gather(1, idx)
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * route_scale
        return w, idx


class Experts(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        E, F_, D = cfg.n_experts, cfg.expert_ffn, cfg.d_model
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * F_, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, F_))


def grouped_mm_ok(x, w):
    """torch._grouped_mm covers fp32/bf16 on CPU and bf16 on CUDA (sm90+); else the padded-bmm path."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return False  # its meta (compile-time) kernel takes bf16 only (torch 2.13)
    if any(n * x.element_size() % 16 for n in w.shape[-2:]):  # forward and backward need 16-byte row strides
        return False  # ("strides should be multiple of 16 bytes": d_model or expert_ffn not a multiple of 8 in bf16)
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16)
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9
    return False


def expert_matmul(xs, w, counts, offs):
    """Rows of xs are sorted by expert (counts[e] rows for expert e); returns xs_e @ w[e]^T per group."""
    if grouped_mm_ok(xs, w):
        return torch._grouped_mm(xs, w.transpose(-2, -1), offs=offs)
    # padded fallback: scatter rows into (E, Cmax, D), one bmm, gather back
    E = w.shape[0]
    cmax = int(counts.max().item()) if counts.numel() else 0
    starts = offs.long() - counts
    slot = torch.arange(xs.shape[0], device=xs.device) - torch.repeat_interleave(starts, counts)
    expert_of_row = torch.repeat_interleave(torch.arange(E, device=xs.device), counts)
    padded = xs.new_zeros(E, max(cmax, 1), xs.shape[1])
    padded[expert_of_row, slot] = xs
    out = torch.bmm(padded, w.transpose(-2, -1))
    return out[expert_of_row, slot]


class GatherSlots(torch.autograd.Function):
    """Token rows copied into expert-sorted slot order: x[token_of_slot] (each token appears k times). Backward
    brings the slot grads back to token order through the inverse permutation and sums each token's k copies:
    a gather and a reduction instead of autograd's scatter-add (faster on CPU, deterministic on GPU)."""

    @staticmethod
    def forward(ctx, x, token_of_slot, slot_of_choice, k):
        ctx.save_for_backward(slot_of_choice)
        ctx.k = k
        return x.index_select(0, token_of_slot)

    @staticmethod
    def backward(ctx, grad):
        (slot_of_choice,) = ctx.saved_tensors
        return grad.index_select(0, slot_of_choice).view(-1, ctx.k, grad.shape[-1]).sum(1), None, None, None


class PermuteRows(torch.autograd.Function):
    """rows = x[perm] for a permutation (inverse inv); backward is the gather grad[inv], never a scatter."""

    @staticmethod
    def forward(ctx, x, perm, inv):
        ctx.save_for_backward(inv)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad):
        (inv,) = ctx.saved_tensors
        return grad.contiguous().index_select(0, inv), None, None


class SwiGLUAct(torch.autograd.Function):
    """silu(gate) * up from the fused (rows, 2F) gate_up output; backward returns d gate and d up as one
    contiguous (rows, 2F) grad (grouped_mm's backward rejects zero-stride/odd-stride grads) and recomputes
    silu(gate) instead of saving it (one (rows, F) activation less per MoE layer)."""

    @staticmethod
    def forward(ctx, h):
        ctx.save_for_backward(h)
        g, u = h.chunk(2, dim=-1)
        return F.silu(g) * u

    @staticmethod
    def backward(ctx, grad):
        (h,) = ctx.saved_tensors
        g, u = h.chunk(2, dim=-1)
        # d/dg: fused silu_backward (fp32 math for bf16 inputs); d/du: grad * silu(g)
        return torch.cat([torch.ops.aten.silu_backward(grad * u, g), grad * F.silu(g)], dim=-1)


CPU_EXPERT_PARALLEL = True  # False: torch._grouped_mm on CPU too (the CUDA path)
_EXPERT_POOL = [None, 0]  # (ThreadPoolExecutor, its size), made on first use


def expert_parallel(fn, bounds, n_threads):
    """fn(list of experts) on n_threads Python threads, each running whole experts with single-threaded
    GEMMs; experts are dealt longest-first to the least-loaded thread (LPT). The GIL is released inside the
    GEMMs, so the threads run in parallel."""
    if n_threads <= 1:
        fn(range(len(bounds)))
        return

    # grad and inference mode are thread-local: the pool must not record these GEMMs, and under eval's
    # inference_mode the outputs are inference tensors, which only a thread in inference mode may write into
    inference = torch.is_inference_mode_enabled()

    def worker(es):
        with torch.inference_mode(inference), torch.no_grad():
            fn(es)
    from concurrent.futures import ThreadPoolExecutor
    if _EXPERT_POOL[1] != n_threads:
        _EXPERT_POOL[:] = [ThreadPoolExecutor(n_threads, thread_name_prefix="experts"), n_threads]
    lists, loads = [[] for _ in range(n_threads)], [0] * n_threads
    for e in sorted(range(len(bounds)), key=lambda e: bounds[e][0] - bounds[e][1]):
        if bounds[e][1] > bounds[e][0]:
            i = loads.index(min(loads))
            lists[i].append(e)
            loads[i] += bounds[e][1] - bounds[e][0]
    torch.set_num_threads(1)
    try:
        for f in [_EXPERT_POOL[0].submit(worker, es) for es in lists]:
            f.result()
    finally:
        torch.set_num_threads(n_threads)


class ExpertFFNCPU(torch.autograd.Function):
    """All routed experts on CPU, rows already sorted by expert: y_e = swiglu(xs_e @ W_gu[e]^T) @ W_d[e]^T.
    Experts run in parallel, one thread each with single-threaded GEMMs: for ~64-row experts this beat
    torch._grouped_mm (which splits every small GEMM across the threads) on a 2-core CPU, most of all for the
    weight grads (bench/train_step.py has the figures). Backward recomputes silu(gate) * up from h."""

    @staticmethod
    def forward(ctx, xs, w_gu, w_d, bounds):
        n_threads = torch.get_num_threads()
        h = xs.new_empty(xs.shape[0], w_gu.shape[1])
        y = xs.new_empty(xs.shape[0], w_d.shape[1])
        Fw = w_d.shape[2]

        def run(es):
            for e in es:
                s, t = bounds[e]
                if t > s:
                    torch.mm(xs[s:t], w_gu[e].t(), out=h[s:t])
                    torch.mm(F.silu(h[s:t, :Fw]) * h[s:t, Fw:], w_d[e].t(), out=y[s:t])
        expert_parallel(run, bounds, n_threads)
        ctx.save_for_backward(xs, w_gu, w_d, h)
        ctx.bounds = bounds
        return y

    @staticmethod
    def backward(ctx, dy):
        xs, w_gu, w_d, h = ctx.saved_tensors
        bounds, Fw = ctx.bounds, w_d.shape[2]
        dy = dy.contiguous()
        dxs = torch.empty_like(xs)  # every row belongs to one expert: all written below
        dw_gu = torch.empty_like(w_gu) if ctx.needs_input_grad[1] else None
        dw_d = torch.empty_like(w_d) if ctx.needs_input_grad[2] else None
        for e, (s, t) in enumerate(bounds):  # experts with no rows get zero grads (no memset of the rest)
            if t <= s:
                for g in (dw_gu, dw_d):
                    if g is not None:
                        g[e].zero_()

        def run(es):
            for e in es:
                s, t = bounds[e]
                if t <= s:
                    continue
                g, u = h[s:t, :Fw], h[s:t, Fw:]
                sg = F.silu(g)
                dye = dy[s:t]
                if dw_d is not None:  # dW_d = dy^T a, with the transposed operand made contiguous (2x here)
                    torch.mm(dye.t().contiguous(), sg * u, out=dw_d[e])
                da = torch.mm(dye, w_d[e])
                dh = torch.cat([torch.ops.aten.silu_backward(da * u, g), da * sg], dim=-1)
                if dw_gu is not None:
                    torch.mm(dh.t().contiguous(), xs[s:t], out=dw_gu[e])
                torch.mm(dh, w_gu[e], out=dxs[s:t])
        expert_parallel(run, bounds, torch.get_num_threads())
        return dxs, dw_gu, dw_d, None


class MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = MLP(cfg.d_model, cfg.n_shared * cfg.expert_ffn)
        # selection-only bias: a buffer (no gradient, no weight decay), saved and exported
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_experts, dtype=torch.float32))
        # token-slots per expert summed over the training forwards since the last bias update
        # (int64: exact counts, and model.to(bfloat16) leaves integer buffers alone)
        self.register_buffer("load_accum", torch.zeros(cfg.n_experts, dtype=torch.int64), persistent=False)
        self.top_k = cfg.top_k  # may be lowered at serve time
        self.last_load = None
        self.load_rows = None  # (N,) bool: the rows load_accum counts (None: all); set by Picaflor.forward

    def route(self, x):
        return self.gate(x, self.e_score_correction_bias, self.top_k, self.cfg.route_scale)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        w, idx = self.route(x)
        routed = self._dispatch(x, w, idx)
        out = routed + self.shared_experts(x).float()
        return out.to(x.dtype).reshape(shape)

    def _dispatch(self, x, w, idx):
        """The k routed experts' outputs for each row of x, mixed by the routing weights w (fp32)."""
        N, k = idx.shape
        E = self.cfg.n_experts
        flat = idx.reshape(-1)
        if self.training and self.load_rows is not None:  # rows not counted (chat padding): routed, steer no bias
            # one bincount, uncounted slots as E..2E-1 (a second one cost a graph break per layer under compile)
            both = torch.bincount(flat + E * (~self.load_rows).repeat_interleave(k), minlength=2 * E).view(2, E)
            counts = both.sum(0)
            self.load_accum += both[0]
        else:
            counts = torch.bincount(flat, minlength=E)
            if self.training:
                self.load_accum += counts
        self.last_load = counts.detach()
        # slots (token, choice) sorted by expert (torchtitan-style dispatch); slot_of_choice is the inverse
        order = torch.argsort(flat, stable=True)
        token_of_slot = order // k
        slot_of_choice = torch.empty_like(order).scatter_(0, order, torch.arange(N * k, device=x.device))
        offs = torch.cumsum(counts, 0).to(torch.int32)
        wdt = self.experts.gate_up_proj.dtype
        if torch.is_autocast_enabled(x.device.type):
            wdt = torch.get_autocast_dtype(x.device.type)
        xs = GatherSlots.apply(x.to(wdt), token_of_slot, slot_of_choice, k)  # (N*k, D); .to is a no-op if same
        if x.device.type == "cpu" and CPU_EXPERT_PARALLEL and not torch.compiler.is_compiling():
            ends = offs.tolist()
            bounds = [(ends[e - 1] if e else 0, ends[e]) for e in range(E)]
            with torch.autocast("cpu", enabled=False):
                y = ExpertFFNCPU.apply(xs, self.experts.gate_up_proj.to(wdt), self.experts.down_proj.to(wdt), bounds)
        else:
            h = expert_matmul(xs, self.experts.gate_up_proj.to(wdt), counts, offs)
            y = expert_matmul(SwiGLUAct.apply(h), self.experts.down_proj.to(wdt), counts, offs)
        # back to (token, choice) order, then mix the k outputs with the routing weights, in fp32
        y = PermuteRows.apply(y, slot_of_choice, order).view(N, k, -1)
        return (y.float() * w.unsqueeze(-1)).sum(dim=1)


def compile_model(model, device_type):
    """torch.compile; on CPU each MoE layer's dispatch stays eager: its data-dependent sizes (bincount, the padded
    fallback's counts.max()) broke the graph and recompiled as the routing changed, and eager runs ExpertFFNCPU."""
    if device_type == "cpu":
        for m in model.modules():
            if isinstance(m, MoE):
                m._dispatch = torch.compiler.disable(m._dispatch)
    return torch.compile(model)


def moe_reference(moe, x):
    """Plain per-expert loop (what grouped dispatch must equal); used by tests and as documentation."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    w, idx = moe.route(x)
    out = torch.zeros(x.shape[0], shape[-1], dtype=torch.float32, device=x.device)
    for e in range(moe.cfg.n_experts):
        tok, slot = torch.where(idx == e)
        if tok.numel() == 0:
            continue
        g, u = F.linear(x[tok], moe.experts.gate_up_proj[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(g) * u, moe.experts.down_proj[e])
        out.index_add_(0, tok, y.float() * w[tok, slot, None])
    out = out + moe.shared_experts(x).float()
    return out.to(x.dtype).reshape(shape)


class Block(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.is_moe = layer_idx >= cfg.n_dense_layers
        self.mlp = MoE(cfg) if self.is_moe else MLP(cfg.d_model, cfg.dense_ffn)

    def forward(self, x, cos, sin, cache=None, attn_mask=None):
        h = self.input_layernorm(x)  # (attn_mask only when set: stream_infer swaps in attention modules without it)
        x = x + (self.self_attn(h, cos, sin, cache) if attn_mask is None
                 else self.self_attn(h, cos, sin, attn_mask=attn_mask))
        return x + self.mlp(self.post_attention_layernorm(x))


# ----------------------------------------------------------------------------------------------------------
# the model

class Picaflor(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg.validate()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, std=0.02):
        # GPT-2 style: N(0, 0.02), residual-output projections scaled by 1/sqrt(2 * n_layer)
        out_std = std / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                p.normal_(0.0, out_std)
            else:
                p.normal_(0.0, std)
        for m in self.moe_layers():
            m.e_score_correction_bias.zero_()

    def moe_layers(self):
        return [b.mlp for b in self.layers if b.is_moe]

    def set_top_k(self, k):
        """Serve with fewer (or more) experts per token than training used."""
        # (no MoE layer: nothing is routed, any k >= 1 is the same model; an all-dense n_experts=0 one refused them all)
        if not 1 <= k <= (self.cfg.n_experts if self.moe_layers() else k):
            raise ValueError(f"top_k={k} must be in [1, {self.cfg.n_experts}]" if self.moe_layers() else
                             f"top_k={k} must be at least 1")
        for m in self.moe_layers():
            m.top_k = k

    def forward(self, idx, targets=None, cache=None, return_load=False, loss_mask=None, doc_ids=None, load_mask=None):
        """idx (B, T) -> logits (B, T, V); with targets returns (logits, loss) where loss ignores -1 targets
        (and positions where loss_mask is 0). With return_load also returns per-MoE-layer token counts (L, E).
        doc_ids (B, T), non-decreasing along T: a token attends only to earlier tokens of its own document (packed
        SFT rows: one conversation never sees another; RoPE is relative, so positions need no reset).
        load_mask (B, T): the tokens a training forward counts in the expert load (0: padding, routed but not counted:
        its identical <|bos|> tokens all pick the same experts, and the bias then steered real tokens off them)."""
        B, T = idx.shape
        attn_mask = None
        if doc_ids is not None:
            if cache is not None:
                raise ValueError("doc_ids is for training windows, not with a KV cache")
            same = doc_ids[:, :, None] == doc_ids[:, None, :]
            attn_mask = (same & torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()).unsqueeze(1)
        if self.training:
            for m in self.moe_layers():
                m.load_rows = None if load_mask is None else load_mask.reshape(-1).bool()
        start = cache.pos if cache is not None else 0
        if start + T > self.cfg.max_seq_len and cache is None:
            raise ValueError(f"sequence of {T} tokens is longer than max_seq_len={self.cfg.max_seq_len}")
        x = self.embed_tokens(idx)
        positions = torch.arange(start, start + T, device=idx.device)
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        for block in self.layers:
            x = block(x, cos, sin, cache, attn_mask)
        if cache is not None:
            cache.pos += T
        x = self.norm(x)
        out = []
        if targets is None:
            out.append(self.lm_head(x))
        else:
            logits = self.lm_head(x)
            if loss_mask is not None:
                targets = targets.masked_fill(loss_mask == 0, -1)
            flat = targets.reshape(-1)
            # the mean over the targets left; a window with none (all masked: an SFT window of prompt tokens) is 0,
            # not 0/0 = NaN, which stopped the run as a "non-finite loss"
            loss = (F.cross_entropy(logits.float().view(-1, logits.size(-1)), flat, ignore_index=-1, reduction="sum")
                    / (flat != -1).sum().clamp(min=1))
            out += [logits, loss]
        if return_load:
            out.append(torch.stack([m.last_load for m in self.moe_layers()]) if self.moe_layers()
                       else torch.zeros(0, self.cfg.n_experts))
        return out[0] if len(out) == 1 else tuple(out)

    # --- balancing -----------------------------------------------------------------------------------------

    def take_expert_load(self):
        """(L, E) token-slots per expert accumulated since the last call; resets the accumulators."""
        moes = self.moe_layers()
        if not moes:
            return torch.zeros(0, self.cfg.n_experts)
        load = torch.stack([m.load_accum.float() for m in moes])
        for m in moes:
            m.load_accum.zero_()
        return load

    @torch.no_grad()
    def update_router_bias(self, load, gamma=None):
        """Aux-loss-free balancing (DeepSeek-V3): bias += gamma * sign(mean(load) - load), centred.
        `load` (L, E) is the step's token count per expert (all-reduced across ranks by the caller)."""
        gamma = self.cfg.bias_update_rate if gamma is None else gamma
        for m, l in zip(self.moe_layers(), load):
            l = l.to(m.e_score_correction_bias.device).float()
            delta = gamma * torch.sign(l.mean() - l)
            m.e_score_correction_bias += delta - delta.mean()

    # --- sizes ------------------------------------------------------------------------------------------

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def active_params(self, top_k=None, include_embedding=True):
        """Parameters touched per token: everything except the routed experts not chosen."""
        c = self.cfg
        k = c.top_k if top_k is None else top_k
        total = self.num_params()
        n_moe = c.n_layer - c.n_dense_layers
        inactive = n_moe * (c.n_experts - k) * 3 * c.d_model * c.expert_ffn
        if not include_embedding:
            total -= self.embed_tokens.weight.numel() if not c.tie_embeddings else 0
        return total - inactive

    def flops_per_token(self, seq_len):
        """Training FLOPs per token: 6 * active matmul params + attention (PaLM, arXiv 2204.02311 app. B)."""
        c = self.cfg
        matmul_params = self.active_params(include_embedding=False)
        matmul_params -= sum(p.numel() for n, p in self.named_parameters() if "norm" in n)
        return 6 * matmul_params + 12 * c.n_layer * c.n_head * c.head_dim * seq_len

    # --- generation ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, use_cache=True,
                 eos_id=None, generator=None):
        """Sample max_new_tokens after idx (B, T). temperature 0 = greedy. No repetition penalty, ever.
        eos_id: a row that draws it is done (its later positions repeat eos_id); generation stops when all are."""
        B, T = idx.shape
        if T == 0:  # (a reshape error deep in attention otherwise)
            raise ValueError("empty prompt: give at least one token (a document starts with the tokenizer's bos_id)")
        total = T + max(max_new_tokens - 1, 0)  # positions run: the last new token is never fed back
        if total > self.cfg.max_seq_len:
            raise ValueError(f"prompt {T} + {max_new_tokens} new tokens exceeds max_seq_len={self.cfg.max_seq_len}: "
                             f"they run {total} positions (the last new token is never fed back)")
        cache = KVCache(self.cfg, B, total, idx.device, self.embed_tokens.weight.dtype) if use_cache else None
        seq, step_in = idx, idx
        done = torch.zeros(B, 1, dtype=torch.bool, device=idx.device)
        for _ in range(max_new_tokens):
            logits = self(step_in if use_cache else seq, cache=cache)[:, -1, :].float()
            nxt = sample_next(logits, temperature, top_k, top_p, generator)
            if eos_id is not None:  # per row: the batch stopped only when all rows drew eos at the same step
                nxt = nxt.masked_fill(done, eos_id)
                done |= nxt == eos_id
            seq = torch.cat([seq, nxt], dim=1)
            step_in = nxt
            if eos_id is not None and bool(done.all()):
                break
        return seq


class _SkipRandomInitOnMeta(torch.overrides.TorchFunctionMode):
    """Random init of a meta tensor is a no-op: torch runs it through torch._refs, whose first call imports
    torch._dynamo (+180 MB RSS measured here), which stream_infer's --ram-budget would pay for values no one reads."""
    SKIP = {"normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
            "trunc_normal_", "orthogonal_"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t = args[0] if args else kwargs.get("tensor", kwargs.get("self"))  # torch.nn.init passes it by keyword
        if getattr(func, "__name__", None) in self.SKIP and isinstance(t, torch.Tensor) and t.is_meta:
            return t
        return func(*args, **kwargs)


def meta_model(cfg):
    """Picaflor's module tree on the meta device (shapes only, no memory, no init): fill it with to_empty +
    load_state_dict, or swap its modules (stream_infer)."""
    with torch.device("meta"), _SkipRandomInitOnMeta():
        return Picaflor(cfg)


def sample_next(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """One token per row from (B, V) logits: greedy at temperature 0, else top-k / nucleus (top-p) sampling."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # keep the smallest set with mass >= top_p: a token after exactly top_p is dropped too (> kept it)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= top_p
        drop[:, 0] = False  # the most likely token stays (a top_p below float32's smallest number compared as 0)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, sorted_idx, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    if generator is not None and generator.device != probs.device:  # a seeded CPU generator with GPU logits:
        return torch.multinomial(probs.cpu(), 1, generator=generator).to(probs.device)  # the same draw as on CPU
    return torch.multinomial(probs, 1, generator=generator)


def tune_cpu_malloc():
    """CPU training speed-up (process-wide, call once at start-up): glibc hands every freed block above 32 MiB back
    to the OS (munmap), so each step page-faults its big tensors in afresh; the routed experts' weight grads
    (384 MiB per nano MoE layer) then cost ~200 ms of page faults per layer per step (measured here, 2 cores).
    mallopt(M_MMAP_MAX=0) serves them from the heap and M_TRIM_THRESHOLD=2 GiB keeps freed memory for reuse.
    glibc only; returns True when applied, False (and changes nothing) elsewhere."""
    import ctypes
    import ctypes.util
    import platform
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc malloc.h
        return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2 ** 31 - 1))
    except (OSError, AttributeError):
        return False


# ----------------------------------------------------------------------------------------------------------
# balance statistics

def load_stats(load, dead_share=0.1):
    """Per-layer coefficient of variation of expert load and fraction of dead experts (below dead_share of
    the fair share) from a (L, E) token-count tensor summed over a logging window."""
    load = load.float()
    mean = load.mean(dim=-1, keepdim=True).clamp_min(1e-9)
    cv = load.std(dim=-1, unbiased=False) / mean.squeeze(-1)
    dead = (load < dead_share * mean).float().mean(dim=-1)
    return cv, dead


# ----------------------------------------------------------------------------------------------------------
# Hugging Face HYV3ForCausalLM interop
#
# HF_NAME_TABLE: picaflor name            -> HYV3ForCausalLM name
#   embed_tokens.weight                    -> model.embed_tokens.weight
#   layers.N.input_layernorm.weight        -> model.layers.N.input_layernorm.weight
#   layers.N.self_attn.{q,k,v,o}_proj.weight, {q,k}_norm.weight -> model.layers.N.self_attn.(same)
#   layers.N.post_attention_layernorm.weight -> model.layers.N.post_attention_layernorm.weight
#   layers.N.mlp.{gate,up,down}_proj.weight (dense)            -> model.layers.N.mlp.(same)
#   layers.N.mlp.gate.weight (router, fp32)                    -> model.layers.N.mlp.gate.weight
#   layers.N.mlp.e_score_correction_bias (fp32 buffer)         -> model.layers.N.mlp.e_score_correction_bias
#   layers.N.mlp.experts.gate_up_proj [E, 2F, D]               -> model.layers.N.mlp.experts.gate_up_proj
#   layers.N.mlp.experts.down_proj [E, D, F]                   -> model.layers.N.mlp.experts.down_proj
#   layers.N.mlp.shared_experts.{gate,up,down}_proj.weight     -> model.layers.N.mlp.shared_experts.(same)
#   norm.weight                            -> model.norm.weight
#   lm_head.weight                         -> lm_head.weight
# Hub checkpoints store experts per expert (mlp.experts.N.{gate,up,down}_proj.weight); transformers'
# loader converts them to the stacked form above when it reads them.

def hf_name(name):
    return name if name.startswith("lm_head") else "model." + name


def to_hf_state_dict(state_dict):
    return {hf_name(k): v for k, v in state_dict.items() if not k.endswith("load_accum")}


def from_hf_state_dict(hf_sd):
    out = {}
    for k, v in hf_sd.items():
        if k.startswith("model."):
            out[k[len("model."):]] = v
        elif k.startswith("lm_head"):
            out[k] = v
        # rotary inv_freq and other non-persistent HF buffers are ignored
    return out


def to_hf_config(cfg: ModelConfig, **extra):
    """A dict HYV3Config accepts (transformers >= 5.24); `extra` adds e.g. bos/eos token ids."""
    d = dict(
        architectures=["HYV3ForCausalLM"], model_type="hy_v3",
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.dense_ffn,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
        head_dim=cfg.head_dim, hidden_act="silu", max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=float(cfg.norm_eps), tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, mlp_bias=False,
        num_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k, num_shared_experts=cfg.n_shared,
        moe_intermediate_size=cfg.expert_ffn, router_scaling_factor=float(cfg.route_scale),
        mlp_layer_types=["dense"] * cfg.n_dense_layers + ["sparse"] * (cfg.n_layer - cfg.n_dense_layers),
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
    )  # (floats as floats: HYV3Config is strict, an int route_scale=2 in config.json failed the whole load)
    if cfg.n_dense_layers < cfg.n_layer and (cfg.d_model % 8 or cfg.expert_ffn % 8):
        # transformers' default experts (torch._grouped_mm) need 16-byte rows: "strides should be multiple of 16 bytes"
        d["experts_implementation"] = "eager"
    d.update(extra)
    return d


def from_hf_config(hf):
    """ModelConfig from an HYV3Config (object or dict)."""
    g = (lambda k, default=None: hf.get(k, default)) if isinstance(hf, dict) else (lambda k, default=None: getattr(hf, k, default))
    types = g("mlp_layer_types") or ["dense"] + ["sparse"] * (g("num_hidden_layers") - 1)
    n_dense = types.index("sparse") if "sparse" in types else len(types)
    if types != ["dense"] * n_dense + ["sparse"] * (len(types) - n_dense):
        raise ValueError(f"picaflor needs dense layers first, then sparse; got mlp_layer_types={types}")
    # RoPE: rope_parameters (transformers 5), else the older top-level rope_theta; never a guessed default (HF's is
    # not 10000) and never a scaled variant read as plain RoPE
    rope = g("rope_parameters") or g("rope_scaling") or {}
    theta = rope.get("rope_theta", g("rope_theta"))
    if theta is None:
        raise ValueError("the config names no rope_theta (rope_parameters or rope_theta); picaflor will not guess it")
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"rope_type {rope.get('rope_type', rope.get('type'))!r}: picaflor implements plain RoPE only")
    hd = g("head_dim") or g("hidden_size") // g("num_attention_heads")
    if hd * g("num_attention_heads") != g("hidden_size"):
        raise ValueError("picaflor needs head_dim * num_attention_heads == hidden_size")
    return ModelConfig(
        vocab_size=g("vocab_size"), n_layer=g("num_hidden_layers"), n_dense_layers=n_dense, d_model=g("hidden_size"),
        n_head=g("num_attention_heads"), n_kv_head=g("num_key_value_heads"), dense_ffn=g("intermediate_size"),
        n_experts=g("num_experts"), expert_ffn=g("moe_intermediate_size"), n_shared=g("num_shared_experts"),
        top_k=g("num_experts_per_tok"), route_scale=g("router_scaling_factor"),
        rope_theta=float(theta), max_seq_len=g("max_position_embeddings"),
        norm_eps=g("rms_norm_eps"), tie_embeddings=bool(g("tie_word_embeddings", False)),
    ).validate()


# ----------------------------------------------------------------------------------------------------------
# checkpoints (format, writing and manifests: checkpoint.py; retention: rundir.py)

def save_checkpoint(model, out_dir, step, state=None, extra_writers=None, tokenizer_file=None, tick=None):
    """Write out_dir/step_NNNNNNN/ atomically: model.safetensors, state.json (state + model_config), a copy
    of the tokenizer file as tokenizer.json (so every consumer finds it in the checkpoint), extra files. tick: as
    checkpoint.save's."""
    import pathlib
    import shutil
    import checkpoint
    from safetensors.torch import save_file
    sd = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items() if not k.endswith("load_accum")}
    if model.cfg.tie_embeddings:
        sd.pop("lm_head.weight", None)
    state = dict(state or {})
    state.setdefault("step", step)
    state["model_config"] = asdict(model.cfg)
    def write_weights(p):
        save_file(sd, p, metadata={"format": "pt"})
        # safetensors makes its file 0600 (the step's other files: 0666 less the umask, as its folder's 0777 less it),
        # so whoever else could read the checkpoint (a group, a mirror's reader) read everything but its weights
        try:
            os.chmod(p, os.stat(os.path.dirname(os.path.abspath(p))).st_mode & 0o666)
        except OSError:  # a mount without modes (a bucket's FUSE): the save stands, as its other files' modes do
            pass

    writers = {"model.safetensors": write_weights,
               # (with, so an error reported at close is raised: a bare open().write() dropped it, a short file verified)
               "state.json": lambda p: pathlib.Path(p).write_text(json.dumps(state, indent=1))}
    if tokenizer_file:
        writers["tokenizer.json"] = lambda p: shutil.copyfile(tokenizer_file, p)
    writers.update(extra_writers or {})
    return checkpoint.save(out_dir, step, writers, tick=tick)


def more_experts_note(k, trained):
    """The line stream_infer.py, chat.py and eval.py say once when they route k experts per token, more than the
    trained top_k of a model with MoE layers (trained None: none): allowed, an experiment, but not the model trained."""
    if k is not None and trained is not None and k > trained:
        return f"note: serving with {k} experts per token, more than the {trained} the model was trained with"
    return None


def device_problem(device):
    """Why `device` cannot run a model here, in a few words, or None (chat, eval, stream_infer share the check)."""
    device = str(device)
    if device != "cpu" and device != "cuda" and not re.fullmatch(r"cuda:\d+", device):
        return "use cpu, cuda or cuda:N"  # mps/xla/typos failed deep inside a load with a traceback
    if device.startswith("cuda"):
        if not torch.cuda.is_available():  # pin_memory/safetensors tracebacks otherwise
            return f"no CUDA GPU is visible to this torch ({torch.__version__}); use cpu"
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            return f"this machine has {torch.cuda.device_count()} CUDA device(s), numbered from 0"
    return None


def expected_shapes(cfg):
    """name -> shape of every tensor a picaflor checkpoint holds (lm_head omitted when tied); ValueError for a config
    whose tensors are past torch's sizes (a saved d_model of 10^12: "Storage size calculation overflowed")."""
    try:
        sd = {k: list(v.shape) for k, v in meta_model(cfg).state_dict().items() if not k.endswith("load_accum")}
    except RuntimeError as e:
        raise ValueError(f"its model config gives tensors past torch's sizes ({str(e).splitlines()[0][:80]})") from None
    if cfg.tie_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def weights_misfit(cfg, shapes):
    """Why weights (name -> shape) cannot load into a model of cfg (a layer count or a shape; names are left to the
    caller), or None; judged before any memory is taken: a saved config's n_layer of 10^12 built modules until
    memory ran out, and a vocab_size of 2^31 asked for 274 GB before the shapes were compared."""
    held = len({k.split(".")[1] for k in shapes if k.startswith("layers.")})
    if cfg.n_layer > held:
        return f"n_layer {cfg.n_layer}, the weights hold {held} layers"
    try:
        want = expected_shapes(cfg)
    except ValueError as e:
        return str(e)
    bad = next((k for k, s in shapes.items() if k in want and list(s) != want[k]), None)
    return f"{bad} is {list(shapes[bad])}, its config gives {want[bad]}" if bad else None


def load_checkpoint(path, device="cpu", dtype=None):
    """Model in eval mode from a checkpoint dir `step_NNNNNNN/` or a run dir (its LATEST). Verifies the
    manifest first; weights come from safetensors, nothing is unpickled."""
    import checkpoint
    from safetensors.torch import load_file
    ckpt_dir = checkpoint.resolve(path)
    checkpoint.verify(ckpt_dir)
    try:  # a checkpoint of a newer picaflor (a config key this one lacks) or a hand-edited state.json
        with open(os.path.join(ckpt_dir, "state.json")) as f:
            cfg = ModelConfig.from_dict(json.load(f)["model_config"], complete=True)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise checkpoint.CheckpointError(f"{ckpt_dir}/state.json: no model config this picaflor can build "
                                         f"({type(e).__name__}: {str(e)[:160]}); use the picaflor that wrote it")
    from safetensors import SafetensorError
    try:
        sd = load_file(os.path.join(ckpt_dir, "model.safetensors"), device=str(device))
    except SafetensorError as e:  # damaged before its manifest was written, or the manifest rewritten: a traceback
        raise checkpoint.CheckpointError(f"{ckpt_dir}/model.safetensors: not a readable safetensors file "
                                         f"({(str(e).splitlines() or [''])[0]}); re-copy the checkpoint from where "
                                         f"it was saved, or point at another checkpoint (an earlier step_* dir)")
    why = weights_misfit(cfg, {k: t.shape for k, t in sd.items()})
    if why:
        raise checkpoint.CheckpointError(f"{ckpt_dir}/model.safetensors: does not fit its state.json config ({why}); "
                                         f"use the checkpoint as train.py wrote it, or another one")
    model = meta_model(cfg)
    model.to_empty(device=device)
    try:
        missing, unexpected = model.load_state_dict(sd, strict=False)
    except RuntimeError as e:  # a shape that differs from the config's
        raise checkpoint.CheckpointError(f"{ckpt_dir}/model.safetensors: does not fit its state.json config "
                                         f"({str(e).strip().splitlines()[-1].strip()[:200]})")
    missing = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise checkpoint.CheckpointError(f"{ckpt_dir}/model.safetensors: missing {missing[:3]} unexpected "
                                         f"{unexpected[:3]}; the file does not match its state.json config")
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    for m in model.moe_layers():
        m.load_accum.zero_()
    if dtype is not None:
        to_dtype_keeping_router(model, dtype, sd)
    model.eval()
    return model


def to_dtype_keeping_router(model, dtype, sd):
    """model.to(dtype), but each router and its bias stay fp32, exactly as in sd (cast back after .to, a bf16 router
    picks other experts for ~0.1-0.3% of tokens)."""
    model.to(dtype)
    for name, m in model.named_modules():
        if isinstance(m, MoE):
            m.gate.weight.data = sd[f"{name}.gate.weight"].float()
            m.e_score_correction_bias.data = sd[f"{name}.e_score_correction_bias"].float()
    return model


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="Print a config's parameter counts: python model.py config/nano.py")
    ap.add_argument("config", nargs="?", help="a config file that sets model fields (n_layer = 24, ...) as globals")
    args = ap.parse_args()
    g = {}
    if args.config:
        try:
            exec(compile(open(args.config).read(), args.config, "exec"), g)
        except Exception as e:  # (a missing file, a syntax error): one line
            sys.exit(f"model.py: error: {args.config}: {type(e).__name__}: {e}")
    import configurator
    names = [f.name for f in fields(ModelConfig)]
    others = sorted(configurator.config_keys(g) - set(names))
    typos = [f"{k} (did you mean {m[0]}?)" for k in others for m in [difflib.get_close_matches(k, names, 1, 0.8)] if m]
    if typos:  # n_layers = 4 printed the default's 24 layers
        sys.exit(f"model.py: error: {args.config}: not model fields: {', '.join(typos)}")
    try:  # each field of its default's type (n_layer = 4.5 was a traceback)
        cfg = ModelConfig.from_dict({f.name: configurator.coerce(f.name, g[f.name], f.default)
                                     for f in fields(ModelConfig) if f.name in g})
    except (ValueError, TypeError, configurator.ConfigError) as e:
        sys.exit(f"model.py: error: {args.config or 'the defaults'}: {e}")
    m = meta_model(cfg)
    # one unit for all three, by the total's size: tiny in B printed 0.003B / 0.002B / 0.002B
    scale, unit, digits = (1e9, "B", 3) if m.num_params() >= 1e8 else (1e6, "M", 1)
    print(f"total params {m.num_params() / scale:.{digits}f}{unit}, active per token "
          f"{m.active_params() / scale:.{digits}f}{unit} "
          f"(top_k={cfg.top_k}; {m.active_params(top_k=1) / scale:.{digits}f}{unit} at top_k=1)")
