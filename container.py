"""
The picaflor int4 streaming container: one file that a laptop streams routed experts from.
Written and read here only (export.py --format int4 and stream_infer.py import this file).

    python container.py CKPT_DIR --out model.pcf4 [--group-size 128] [--embed-bits 8] [--dense-bits 4]
    python container.py --random-config config/micro.py --out micro.pcf4     # random weights, layer by layer
    python container.py --check model.pcf4                                   # validate every checksum

File layout (all integers little-endian):
    0   8 bytes  magic b"PCFLINT4"
    8   uint32   format version (1)
    12  uint32   crc32 (zlib) of the H header bytes below (0, containers written before the check: refused, re-export)
    16  uint64   H = length of the JSON header in bytes (space-padded)
    24  H bytes  JSON header: format, version, model_config, tokenizer_json (the checkpoint's tokenizer.json
                 text, line endings kept, or null), random_weights, quant settings, `tensors` (resident tensors:
                 name -> kind, shape, offset, nbytes, crc32, parts) and `experts` (per MoE layer, per expert: offset,
                 crc32; the common part layout in `expert_layout`)
    ...          zero padding to 4096, then the blobs; every blob starts at a multiple of 4096 and its nbytes
                 is a multiple of 4096 (so O_DIRECT can read it); crc32 (zlib) covers the padded blob.

Blob kinds:
- "f32": raw float32 (router weight, e_score_correction_bias, every norm weight; kept exact).
- "int4": group-wise 4-bit, w ~= (q - 8) * scale + zero for q in 0..15, one (scale, zero) pair in bf16 per
  group of `group_size` consecutive input columns. Parts: `packed` (uint8) then `sz` (bf16 [K/g, N, 2]).
  `packed` is in the layout of torch's CPU int4 kernel (`torch._weight_int4pack_mm_for_cpu`, torch 2.13) as
  its AVX2 build packs: output rows in blocks of 32; per block, per input column k, 16 bytes whose byte j holds
  row j in its low nibble and row j + 16 in its high nibble. int4_cpu.cpp (stream_infer's default) reads it as
  read; so does torch's kernel on AVX2 CPUs, while its AVX-512 build packs 64-row blocks and stream_infer's
  `--kernel int4pack` repacks there (`_convert_weight_to_int4pack_for_cpu`, ~25 ms per 2048x1024 matrix, ~10x the
  read itself), once per resident weight and per expert read. Odd shapes are zero-padded to N % 32 == 0 and K % group_size == 0; the header keeps
  the true shape. `sz` is exactly the kernel's scales_and_zeros tensor.
- "int8": per output row symmetric 8-bit (embeddings / lm_head by default): `q` int8 [N, K] then `scale` f32 [N].
- expert blob: one per (layer, expert): gate_up [2F, D] int4 (gate rows first, as model.py stores them) then
  down [D, F] int4, parts at 64-byte offsets inside the blob: a cache miss is one aligned read.

Quantization choice (measured with `python container.py --measure CKPT_OR_CONFIG`: relative RMS error over all
int4 weights; bits per weight include the bf16 scale and zero of each group):
                      40-step tiny checkpoint        random-init tiny model (N(0, 0.02))
    group  32: asym 0.0749 / sym 0.0812        asym 0.0782 / sym 0.0859     5.00 bpw
    group  64: asym 0.0846 / sym 0.0886        asym 0.0895 / sym 0.0950     4.50 bpw
    group 128: asym 0.0925 / sym 0.0949        asym 0.0993 / sym 0.1028     4.25 bpw
Asymmetric (min/max; the zero is rounded to bf16 first, and where that clips the group's min or max the step is
widened to reach both) beats symmetric (absmax, Q4_0 style) at every group size for the same bytes (the kernel's
format carries a zero per group anyway, so symmetric saves nothing); halving the group buys ~9% less error for
+0.25..0.5 bpw. Default: group 64, asymmetric (4.5 bpw, llama.cpp Q4_0's size); --group-size 128 gives the
4.25 bpw GPTQ/AWQ size. Perplexity on a trained tiny checkpoint: README, "int4 quality"
(bench/quant_quality.py).

Streaming write: tensors are read one at a time with safetensors `safe_open` (experts one expert slice at a
time), quantized and written at their precomputed offsets; peak RAM is about one layer's worth of fp32.
"""

import argparse
import difflib
import errno
import json
import math
import os
import struct
import sys
import zlib

try:  # ISA-L's crc32: the same checksum as zlib's, ~4x faster here (9.5 vs 2.2 GB/s); every streamed expert pays it
    from isal.isal_zlib import crc32
except ImportError:
    crc32 = zlib.crc32
from dataclasses import asdict, fields

import torch

import checkpoint
from model import ModelConfig, expected_shapes, weights_misfit

MAGIC = b"PCFLINT4"
VERSION = 1
ALIGN = 4096
PART_ALIGN = 64
PREFIX = struct.Struct("<8sIIQ")  # magic, version, header crc32 (0 is refused), header length
ROW_BLOCK = 32  # output rows per block of the CPU int4 kernel's packed layout
DEFAULT_GROUP = 64


class ContainerError(Exception):
    """A container that is missing, foreign, truncated or corrupt; the message is one line naming the file."""


def align_up(n, a=ALIGN):
    return (n + a - 1) // a * a


# ----------------------------------------------------------------------------------------------------------
# quantization (pure tensor functions; stream_infer and the tests use them too)

def int4_padded_shape(shape, group_size):
    N, K = shape
    return align_up(N, ROW_BLOCK), align_up(K, group_size)


def int4_nbytes(shape, group_size):
    Np, Kp = int4_padded_shape(shape, group_size)
    return Np * Kp // 2, (Kp // group_size) * Np * 2 * 2  # packed bytes, sz bytes (bf16 pairs)


def quantize_int4(w, group_size, symmetric=False):
    """w (N, K) float -> (packed uint8 (Np*Kp/2,), sz bf16 (Kp/g, Np, 2)) with w ~= (q - 8) * scale + zero."""
    N, K = w.shape
    Np, Kp = int4_padded_shape(w.shape, group_size)
    w = w.float()
    if (Np, Kp) != (N, K):
        w = torch.nn.functional.pad(w, (0, Kp - K, 0, Np - N))
    wg = w.view(Np, Kp // group_size, group_size)
    if symmetric:  # Q4_0 style: the value of largest magnitude maps to -8 (llama.cpp ggml-quants.c)
        amax_idx = wg.abs().argmax(dim=-1, keepdim=True)
        scale = (wg.gather(-1, amax_idx).squeeze(-1) / -8.0)
        scale = torch.where(scale == 0, torch.full_like(scale, 1e-8), scale).to(torch.bfloat16).float()
        zero = torch.zeros_like(scale)
    else:  # min/max asymmetric: q = round((w - min) / scale), expressed in the kernel's (q - 8) form
        mn, mx = wg.amin(dim=-1).double(), wg.amax(dim=-1).double()  # float64: mx - mn overflowed fp32 above 1.7e38
        scale = ((mx - mn) / 15.0).to(torch.bfloat16).double()
        zero = (mn + 8.0 * scale).to(torch.bfloat16).double()  # rounded first, so q is chosen against it
        # zero's bf16 rounding (2^-9 of |zero|) shifts the grid: where |zero| >> max - min it clipped the group's min
        # or max by several steps (a 1e-8 floor did the same to tiny groups); widen the step to reach both, half a
        # step past the end levels as any weight may lie, rounded up in bf16
        need = torch.maximum((zero - mn) / 8.5, (mx - zero) / 7.5)
        wide = need.to(torch.bfloat16)
        wide = torch.where(wide.double() < need, (wide.view(torch.int16) + 1).view(torch.bfloat16), wide).double()
        scale = torch.where(need > scale, wide, scale).clamp_min(torch.finfo(torch.bfloat16).tiny).float()
        zero = zero.float()
    q = torch.round((wg - zero.unsqueeze(-1)) / scale.unsqueeze(-1) + 8.0).clamp_(0, 15).to(torch.uint8)
    q = q.view(Np // ROW_BLOCK, 2, 16, Kp)
    packed = (q[:, 0] | (q[:, 1] << 4)).permute(0, 2, 1).contiguous().view(-1)
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return packed, sz


def unpack_int4(packed, Np, Kp):
    """packed uint8 in the kernel layout -> q uint8 (Np, Kp) with values 0..15."""
    b = packed.view(Np // ROW_BLOCK, Kp, 16).permute(0, 2, 1)
    return torch.cat([b & 15, b >> 4], dim=1).reshape(Np, Kp)


def dequantize_int4(packed, sz, shape, group_size):
    """Reference dequantization -> float32 (N, K) of the true (unpadded) shape."""
    N, K = shape
    Np, Kp = int4_padded_shape(shape, group_size)
    q = unpack_int4(packed, Np, Kp).float().view(Np, Kp // group_size, group_size)
    s = sz[..., 0].float().t().unsqueeze(-1)
    z = sz[..., 1].float().t().unsqueeze(-1)
    return ((q - 8.0) * s + z).view(Np, Kp)[:N, :K].contiguous()


def quantize_int8(w):
    """Per-row symmetric int8: w ~= q * scale[:, None]."""
    w = w.float()
    # floored only at float32's (and bf16's) smallest normal, not at 1e-12: a row of values under ~1e-12 became zeros
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous().view(-1), scale.contiguous()


def dequantize_int8(q, scale, shape):
    return q.view(shape).float() * scale[:, None]


# ----------------------------------------------------------------------------------------------------------
# what goes where

def tensor_class(name):
    if ".mlp.experts." in name:
        return "experts"
    if ".self_attn." in name and name.endswith("_proj.weight"):
        return "attention"
    if ".mlp.shared_experts." in name:
        return "shared"
    if ".mlp." in name and name.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight")):
        return "dense"
    if name.startswith(("embed_tokens", "lm_head")):
        return "embeddings"
    return "exact"


def tensor_kind(name, embed_bits, dense_bits):
    cls = tensor_class(name)
    if cls == "embeddings":
        return "int8" if embed_bits == 8 else "int4"
    if cls in ("attention", "shared", "dense"):
        return "int8" if dense_bits == 8 else "int4"
    return "f32"


def expert_layout(cfg, group_size):
    """Parts of one expert blob: name, true shape, and byte offsets (64-aligned) inside the blob."""
    parts, off = [], 0
    for pname, shape in (("gate_up_proj", [2 * cfg.expert_ffn, cfg.d_model]), ("down_proj", [cfg.d_model, cfg.expert_ffn])):
        pk, szb = int4_nbytes(shape, group_size)
        p = {"name": pname, "kind": "int4", "shape": shape, "group_size": group_size,
             "packed": [off, pk]}
        off = align_up(off + pk, PART_ALIGN)
        p["sz"] = [off, szb]
        off = align_up(off + szb, PART_ALIGN)
        parts.append(p)
    return {"parts": parts, "payload_bytes": off, "nbytes": align_up(off)}


def resident_parts(kind, shape, group_size):
    """Part offsets inside a resident blob."""
    if kind == "f32":
        return {"data": [0, 4 * math.prod(shape)]}, 4 * math.prod(shape)
    if kind == "int8":
        nq = math.prod(shape)
        off = align_up(nq, PART_ALIGN)
        return {"q": [0, nq], "scale": [off, 4 * shape[0]]}, off + 4 * shape[0]
    pk, szb = int4_nbytes(shape, group_size)
    off = align_up(pk, PART_ALIGN)
    return {"packed": [0, pk], "sz": [off, szb]}, off + szb


def encode_blob(kind, w, group_size, symmetric=False, what="a tensor"):
    """Quantize one tensor -> (list of (part offset, bytes)), dequantized tensor for the error report."""
    if kind == "f32":
        t = w.float().contiguous()
        return {"data": t.view(-1).view(torch.uint8)}, t
    if kind == "int8":
        q, s = quantize_int8(w)
        parts, wq = {"q": q.view(torch.uint8), "scale": s.view(torch.uint8)}, dequantize_int8(q, s, w.shape)
    else:
        packed, sz = quantize_int4(w, group_size, symmetric)
        parts, wq = {"packed": packed, "sz": sz.view(-1).view(torch.uint8)}, dequantize_int4(packed, sz, w.shape, group_size)
    if not torch.isfinite(wq).all():  # finite weights near fp32's limit: scales past bf16's (NaN that --check passed)
        raise ContainerError(f"{what} holds a weight of magnitude {float(w.float().abs().max()):.3g}, beyond what {kind} "
                             f"scales hold (the run diverged by this step); export an earlier step_* dir")
    return parts, wq


# ----------------------------------------------------------------------------------------------------------
# weight sources: a checkpoint (safe_open, one tensor / one expert at a time) or random weights

class CheckpointSource:
    def __init__(self, ckpt_dir):
        try:
            self.dir = checkpoint.resolve(ckpt_dir)
            checkpoint.verify(self.dir)
        except checkpoint.CheckpointError as e:
            raise ContainerError(str(e)) from None
        state_path = os.path.join(self.dir, "state.json")
        try:  # (no model_config: a KeyError traceback from container.py CKPT --out)
            with open(state_path, encoding="utf-8") as f:
                state = json.load(f)
            self.cfg = ModelConfig.from_dict(state["model_config"], complete=True)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ContainerError(f"{state_path}: no usable model_config ({e}); use a checkpoint written by "
                                 f"train.py") from None
        self.f = open_safetensors(os.path.join(self.dir, "model.safetensors"))
        self.names = set(self.f.keys())
        check_tensors_match_config(self.f, self.cfg, os.path.join(self.dir, "model.safetensors"))
        tok = os.path.join(self.dir, "tokenizer.json")
        # its exact text (newline=""): CRLF read as LF made the container's tokenizer another file than the manifest's
        self.tokenizer_json = open(tok, encoding="utf-8", newline="").read() if os.path.exists(tok) else None
        self.random = False
        self.chat_tuned = checkpoint.chat_tuned(state)  # chat says when a container's model was never fine-tuned

    def get(self, name):
        return check_finite(self.f.get_tensor(name), f"{self.dir}/model.safetensors: {name}")

    def get_expert(self, name, e):
        return check_finite(self.f.get_slice(name)[e], f"{self.dir}/model.safetensors: {name}[{e}]")


def open_safetensors(path):
    """safe_open(path), or a one-line error when its manifest verified but it is no safetensors file (damaged before
    the manifest was written, or the manifest rewritten): a SafetensorError traceback from every export format."""
    from safetensors import SafetensorError, safe_open
    try:
        return safe_open(path, framework="pt", device="cpu")
    except SafetensorError as e:
        raise ContainerError(f"{path}: not a readable safetensors file ({(str(e).splitlines() or [''])[0]}); re-copy "
                             f"the checkpoint from where it was saved, or export an earlier step_* dir") from None


def check_tensors_match_config(f, cfg, path):
    """Every tensor the config implies, with its shape, and nothing else, in the open safetensors f (its header only):
    a lost tensor was a SafetensorError traceback half-way through a write, and a routed expert a few rows short was
    zero-padded into the container without a word."""
    have = {n: list(f.get_slice(n).get_shape()) for n in f.keys()}
    why = weights_misfit(cfg, have)  # (a state.json's n_layer of 10^12 built a meta model of it until memory ran out)
    if why:
        raise ContainerError(f"{path}: does not fit state.json's model_config ({why}); the checkpoint is inconsistent, "
                             f"use another step_* dir")
    want = expected_shapes(cfg)
    bad = sorted(set(want) ^ set(have))
    if bad:
        raise ContainerError(f"{path}: tensors do not match state.json's model_config (first: {bad[0]}); the "
                             f"checkpoint is inconsistent, use another step_* dir")


def check_finite(t, what):
    """t, unless it holds NaN or Inf (one NaN made its whole int4 group NaN and --check said ok; HF and GGUF exports
    wrote it as it was): a diverged step is refused, for every export format."""
    if t.is_floating_point() and not torch.isfinite(t).all():
        raise ContainerError(f"{what} holds NaN or Inf (the run diverged by this step); export an earlier step_* dir")
    return t


class RandomSource:
    """Random weights as model.Picaflor.init_weights draws them, generated per tensor / per expert from a seed,
    so a model far larger than RAM is never materialised. With direct=True (the benchmark models) quantized
    weights are drawn directly: uniform random 4-bit codes (8-bit for int8 tensors) with a scale that gives the
    init std, so building a 7B container costs a disk write, not 7B float draws and quantizations."""

    def __init__(self, cfg, seed=0, direct=False):
        self.cfg, self.seed, self.direct = cfg, seed, direct
        self.tokenizer_json = None
        self.random = "direct-quantized" if direct else True
        self.chat_tuned = None
        self.out_std = 0.02 / math.sqrt(2 * cfg.n_layer)

    def random_blob(self, kind, name, shape, group_size, e=-1):
        """Parts of a directly drawn quantized tensor (direct mode)."""
        gen, std = self._gen(name, e), self._std(name)
        if kind == "int8":
            q = torch.randint(-127, 128, shape, dtype=torch.int8, generator=gen)
            return {"q": q.view(-1).view(torch.uint8), "scale": torch.full((shape[0],), std / 73.3).view(torch.uint8)}
        Np, Kp = int4_padded_shape(shape, group_size)
        packed = torch.randint(0, 256, (Np * Kp // 2,), dtype=torch.uint8, generator=gen)
        scale = std / 4.61  # uniform codes 0..15 have std 4.61 steps; zero = scale / 2 centres (q - 8)
        sz = torch.tensor([scale, scale / 2], dtype=torch.bfloat16).expand(Kp // group_size, Np, 2).contiguous()
        return {"packed": packed, "sz": sz.view(-1).view(torch.uint8)}

    def _gen(self, name, e=-1):
        return torch.Generator().manual_seed((zlib.crc32(name.encode()) * 1000003 + e + 1 + self.seed) % (1 << 62))

    def _std(self, name):
        return self.out_std if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")) else 0.02

    def get(self, name):
        shape = expected_shapes(self.cfg)[name]
        if name.endswith("norm.weight") or "layernorm" in name:
            return torch.ones(shape)
        if name.endswith("e_score_correction_bias"):
            return torch.zeros(shape)
        return torch.randn(shape, generator=self._gen(name)) * self._std(name)

    def get_expert(self, name, e):
        shape = expected_shapes(self.cfg)[name][1:]
        return torch.randn(shape, generator=self._gen(name, e)) * self._std(name)


def layer_of(name):
    return int(name.split(".")[1]) if name.startswith("layers.") else (-1 if name.startswith("embed") else 10 ** 9)


# ----------------------------------------------------------------------------------------------------------
# writer

def build_header(cfg, source, group_size, embed_bits, dense_bits, symmetric, data_start):
    shapes = expected_shapes(cfg)
    tensors, experts, off = {}, {}, data_start
    layout = expert_layout(cfg, group_size)
    order = sorted((n for n in shapes if ".mlp.experts." not in n), key=lambda n: (layer_of(n), n))
    by_layer = {}
    for n in order:
        by_layer.setdefault(layer_of(n), []).append(n)
    for layer in sorted(by_layer):
        for n in by_layer[layer]:
            kind = tensor_kind(n, embed_bits, dense_bits)
            parts, nb = resident_parts(kind, shapes[n], group_size)
            tensors[n] = {"kind": kind, "shape": shapes[n], "offset": off, "nbytes": align_up(nb),
                          "parts": parts, "crc32": "00000000"}
            if kind == "int4":
                tensors[n]["group_size"] = group_size
            off += align_up(nb)
        if 0 <= layer < cfg.n_layer and layer >= cfg.n_dense_layers:
            experts[str(layer)] = []
            for e in range(cfg.n_experts):
                experts[str(layer)].append({"offset": off, "crc32": "00000000"})
                off += layout["nbytes"]
    header = {
        "format": "picaflor-int4-container", "version": VERSION, "model_config": asdict(cfg),
        "random_weights": source.random,  # False, True, or "direct-quantized" (codes drawn, not weights)
        "quant": {"group_size": group_size, "scheme": "symmetric" if symmetric else "asymmetric",
                  "formula": "w = (q - 8) * scale + zero, q in 0..15, (scale, zero) bf16 per group",
                  "packed_layout": "torch_int4pack_cpu_v1: row blocks of 32; per column k 16 bytes; byte j = row j "
                                   "(low nibble) | row j+16 (high nibble)",
                  "embed_bits": embed_bits, "dense_bits": dense_bits},
        "expert_layout": layout, "tensors": tensors, "experts": experts, "file_bytes": off,
        "tokenizer_json": source.tokenizer_json, "chat_tuned": source.chat_tuned,  # (None: unknown)
    }
    return header


def encode_header(header):
    return json.dumps(header, separators=(",", ":")).encode("utf-8")


def layout_header(cfg, source, group_size, embed_bits, dense_bits, symmetric):
    """Offsets depend on where data starts, which depends on the header length: iterate to a fixed point."""
    data_start = ALIGN
    while True:
        header = build_header(cfg, source, group_size, embed_bits, dense_bits, symmetric, data_start)
        need = align_up(PREFIX.size + len(encode_header(header)))
        if need <= data_start:
            return header, data_start
        data_start = need


def writer_tag():
    """HOST-PID, the name of a temp output's writer: a cleanup on a shared filesystem judges only its own host's pids
    (another machine's live export looked dead here and was deleted)."""
    import checkpoint
    return f"{checkpoint.host_tag()}-{os.getpid()}"


def write_container(ckpt_dir, out_path, group_size=DEFAULT_GROUP, embed_bits=8, progress=True, dense_bits=4,
                    symmetric=False, source=None):
    """Stream a checkpoint (or `source`, e.g. RandomSource) into an int4 container at out_path.
    Returns the quantization report (relative RMS error per tensor class), also written to out_path + '.report.json'."""
    from tqdm import tqdm
    if group_size % 2 or group_size < 2:
        raise ContainerError(f"{out_path}: group size {group_size} must be even and >= 2; pass an even --group-size, "
                             f"e.g. 32")
    if embed_bits not in (4, 8) or dense_bits not in (4, 8):
        raise ContainerError(f"{out_path}: --embed-bits {embed_bits} / --dense-bits {dense_bits}: pass 4 or 8 to each")
    source = source or CheckpointSource(ckpt_dir)
    cfg = source.cfg
    header, data_start = layout_header(cfg, source, group_size, embed_bits, dense_bits, symmetric)
    layout = header["expert_layout"]
    shapes = [t["shape"] for t in header["tensors"].values() if t["kind"] == "int4"] + [p["shape"] for p in layout["parts"]]
    widths = sorted({k for _, k in shapes if k % group_size})
    if widths:  # an input width that is no multiple of the group is padded to one (--group-size 4096: 5x the file)
        true = sum(n * k for n, k in shapes)
        padded = sum(math.prod(int4_padded_shape((n, k), group_size)) for n, k in shapes)
        g = math.gcd(*[k for _, k in shapes])  # (odd widths: it said "a group size dividing 1", and groups are even)
        avoid = (f"a group size dividing {g} avoids it" if g % 2 == 0 else
                 "no group size avoids it: groups are even, and odd widths (d_model, dense_ffn, expert_ffn) are not")
        print(f"WARNING: group size {group_size} does not divide input widths {widths}: they are padded, "
              f"{(padded / true - 1) * 100:.0f}% more int4 weights; {avoid}", file=sys.stderr)
    err = {}  # class -> [sum sq error, sum sq weight, count]

    def account(cls, w, wq):
        a = err.setdefault(cls, [0.0, 0.0, 0])
        a[0] += float((w.float() - wq).pow(2).sum())
        a[1] += float(w.float().pow(2).sum())
        a[2] += w.numel()

    def write_blob(f, offset, nbytes, parts_spec, parts_bytes):
        crc = 0
        pos = 0
        for pname, t in parts_bytes.items():
            start, n = parts_spec[pname]
            b = t.numpy().tobytes()
            assert len(b) == n, (pname, len(b), n)
            if start > pos:
                crc = crc32(bytes(start - pos), crc)
            f.seek(offset + start)
            f.write(b)
            crc = crc32(b, crc)
            pos = start + n
        crc = crc32(bytes(nbytes - pos), crc)
        return f"{crc:08x}"

    tmp = f"{out_path}.tmp-{writer_tag()}"
    n_items = len(header["tensors"]) + sum(len(v) for v in header["experts"].values())
    bar = tqdm(total=n_items, desc=f"int4 container {os.path.basename(out_path)}", unit="blob", disable=not progress)
    try:
        with open(tmp, "wb") as f:
            f.truncate(header["file_bytes"])
            for name, t in header["tensors"].items():  # dict order = layer order (resident, then that layer's experts)
                direct = getattr(source, "direct", False) and t["kind"] != "f32"
                w = source.get(name) if not direct else torch.empty(t["shape"], device="meta")
                if list(w.shape) != t["shape"]:
                    raise ContainerError(f"{ckpt_dir}: tensor {name} has shape {list(w.shape)}, its config says "
                                         f"{t['shape']}; the checkpoint is inconsistent, use another step_* dir")
                if direct:
                    pb = source.random_blob(t["kind"], name, t["shape"], group_size)
                else:
                    pb, wq = encode_blob(t["kind"], w, group_size, symmetric, f"{ckpt_dir}: {name}")
                    account(tensor_class(name), w, wq)
                t["crc32"] = write_blob(f, t["offset"], t["nbytes"], t["parts"], pb)
                bar.update(1)
                layer = layer_of(name)
                last_of_layer = name == max((n for n in header["tensors"] if layer_of(n) == layer), key=lambda n: n)
                if last_of_layer and str(layer) in header["experts"]:
                    for e, ent in enumerate(header["experts"][str(layer)]):
                        pbs, spec = {}, {}
                        for p in layout["parts"]:
                            pname = f"layers.{layer}.mlp.experts.{p['name']}"
                            if getattr(source, "direct", False):
                                pb = source.random_blob("int4", pname, p["shape"], group_size, e)
                            else:
                                w = source.get_expert(pname, e)
                                pb, wq = encode_blob("int4", w, group_size, symmetric, f"{ckpt_dir}: {pname}[{e}]")
                                account("experts", w, wq)
                            pbs[p["name"] + ".packed"], pbs[p["name"] + ".sz"] = pb["packed"], pb["sz"]
                            spec[p["name"] + ".packed"], spec[p["name"] + ".sz"] = p["packed"], p["sz"]
                        ent["crc32"] = write_blob(f, ent["offset"], layout["nbytes"], spec, pbs)
                        bar.update(1)
            hb = encode_header(header)
            hb += b" " * (data_start - PREFIX.size - len(hb))
            f.seek(0)
            f.write(PREFIX.pack(MAGIC, VERSION, zlib.crc32(hb), len(hb)) + hb)
            f.flush()
            os.fsync(f.fileno())
        try:  # (a kill before the new one is written: no stale report)
            os.remove(out_path + ".report.json")
        except FileNotFoundError:  # none, or another writer of out_path removed it first
            pass
        os.replace(tmp, out_path)
        checkpoint.fsync_dir(os.path.dirname(os.path.abspath(out_path)))  # the new name survives a power cut too
    finally:
        bar.close()
        if os.path.exists(tmp):
            os.remove(tmp)
    report = {"container": out_path, "file_bytes": header["file_bytes"], "group_size": group_size,
              "scheme": header["quant"]["scheme"], "embed_bits": embed_bits, "dense_bits": dense_bits,
              "random_weights": header["random_weights"],
              "relative_rms_error": {c: math.sqrt(a[0] / max(a[1], 1e-30)) for c, a in err.items() if c != "exact"},
              "params": {c: a[2] for c, a in err.items()}}
    checkpoint.write_atomic_text(out_path + ".report.json", json.dumps(report, indent=1))
    return report


# ----------------------------------------------------------------------------------------------------------
# reader

def anon_buffer(nbytes):
    """Zeroed, page-aligned memory for weights and expert blobs: a private anonymous mapping advised for
    transparent huge pages (2 MB pages where the kernel grants them, in THP's "madvise" mode too). On micro (2-core
    EPYC VM) one 3.5 MB O_DIRECT preadv into huge pages took 151 us of CPU and 2.07 ms against 396 us and 3.25 ms
    into 4 KB pages (the block layer pins and maps 2 pages, not 864); as 4 parts on the readers the same time and
    258 vs 422 us; 2 threads streamed weights at 33-37 GB/s against 30-32 (fewer TLB misses). Python's default
    mmap is shared memory, which THP's "madvise" mode never backs."""
    import mmap
    buf = mmap.mmap(-1, max(int(nbytes), 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # Linux only; a kernel without THP says EINVAL: 4 KB pages. PICAFLOR_HUGE_PAGES=0 asks for 4 KB pages (A/Bs)
    if hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("PICAFLOR_HUGE_PAGES", "1") != "0":
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return buf


def anon_tensor(shape, dtype):
    """An uninitialised tensor in anon_buffer memory (the engine's fused resident weights)."""
    n = math.prod(shape)
    return torch.frombuffer(anon_buffer(n * dtype.itemsize), dtype=dtype, count=n).view(shape)


def part_tensor(buf, base, spec, dtype):
    """A zero-copy tensor over buf[base + off : base + off + n]."""
    off, n = spec
    return torch.frombuffer(buf, dtype=dtype, count=n // dtype.itemsize, offset=base + off)


class Container:
    """An opened, validated container. Expert blobs are read with one aligned pread each (O_DIRECT when the
    filesystem allows it) and checked against their crc32 the first time this process reads them (a later re-read of
    the same bytes of an unchanged file skips the 0.31 ms check: stream_infer re-reads evicted experts dozens of
    times a token under small budgets); resident tensors are read on demand."""

    def __init__(self, path, header, file_size, data_start):
        self.path, self.header, self.file_size, self.data_start = path, header, file_size, data_start
        self.config = ModelConfig.from_dict(header["model_config"], complete=True)
        self.tokenizer_json = header.get("tokenizer_json")
        self.layout = header["expert_layout"]
        self.expert_nbytes = self.layout["nbytes"]
        self.group_size = header["quant"]["group_size"]
        self.fd = os.open(path, os.O_RDONLY)
        self.identity = self._identity()  # a blob checked once is trusted while the open file stays the same
        self.verified = set()  # (layer, expert) whose crc32 matched in this process
        self.direct_fd = None
        self.retired_fds = []  # direct_fd after O_DIRECT failed, closed by close()
        if hasattr(os, "O_DIRECT"):
            try:
                self.direct_fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError:
                self.direct_fd = None  # tmpfs and some filesystems refuse O_DIRECT: buffered reads instead
        elif sys.platform == "darwin":
            self.direct_fd = self._open_nocache(path)

    @staticmethod
    def _open_nocache(path):
        """macOS has no O_DIRECT: F_NOCACHE (48 in <sys/fcntl.h>) on a descriptor of its own keeps the expert reads
        made through it out of the page cache, which --ram-budget cannot see. None where it is refused."""
        import fcntl
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", 48), 1)
            return fd
        except OSError:
            os.close(fd)
            return None

    def stop_direct_reads(self):
        """O_DIRECT failed on this filesystem: buffered reads from now on. Its descriptor stays open until close()
        (another reader thread may be reading through it this moment; a closed number can be reused by any open)."""
        fd, self.direct_fd = self.direct_fd, None
        if fd is not None:
            self.retired_fds.append(fd)

    def close(self):
        for fd in [self.fd, self.direct_fd] + self.retired_fds:
            if fd is not None:
                os.close(fd)
        self.fd = self.direct_fd = None
        self.retired_fds = []

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # --- raw reads ---
    def _pread(self, offset, nbytes, direct=True, buf=None):
        """One read of nbytes at offset into `buf` (a page-aligned anonymous mmap, or a view into one, of that
        size, reused by the caller) or a fresh one."""
        if buf is None or len(buf) != max(nbytes, 1):
            buf = anon_buffer(nbytes)
        direct_fd = self.direct_fd  # one read of the attribute: another reader thread may clear it
        if direct and direct_fd is not None:
            try:
                got = os.preadv(direct_fd, [buf], offset)
                if got == nbytes:
                    return buf
            except OSError as e:  # a filesystem that opened O_DIRECT but cannot do it: buffered from now on
                if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):  # EIO is the read's error: O_DIRECT
                    raise self.read_error(offset, e) from None  # stays (off for good, the page cache broke --ram-budget)
                self.stop_direct_reads()
        try:
            got = os.preadv(self.fd, [buf], offset)
        except OSError as e:
            raise self.read_error(offset, e) from None
        if got != nbytes:
            raise self.short_read_error(offset, got, nbytes)
        return buf

    def read_error(self, offset, e):
        return ContainerError(f"{self.path}: read error at offset {offset}: {e.strerror}; check the disk")

    def expert_entry(self, layer, expert):
        try:
            return self.header["experts"][str(layer)][expert]
        except (KeyError, IndexError):
            raise ContainerError(f"{self.path}: no routed expert {expert} in layer {layer}") from None

    def read_expert_part(self, layer, expert, buf, start, nbytes):
        """Bytes [start, start + nbytes) of one expert's blob into the same range of `buf` (a page-aligned mmap
        of expert_nbytes; start and nbytes multiples of 4096, so O_DIRECT works): stream_infer reads one blob as
        several parts on several threads, since this disk gave 0.52 GB/s to one 4 MB read at a time and ~0.78 to
        1 MB reads four at a time. Check the whole blob afterwards with check_expert_blob."""
        ent = self.expert_entry(layer, expert)
        view = memoryview(buf)[start:start + nbytes]
        try:
            self._pread(ent["offset"] + start, nbytes, buf=view)
        except ContainerError as e:
            raise ContainerError(f"{e} (layer {layer} expert {expert})") from None
        finally:
            view.release()

    def _identity(self):
        st = os.fstat(self.fd)
        return st.st_ino, st.st_size, st.st_mtime_ns

    def _check_unchanged(self):
        """Bytes checked earlier are trusted only while the open file was not rewritten in place since."""
        if self._identity() != self.identity:
            raise ContainerError(f"{self.path}: the file changed on disk while it was open (size or mtime); "
                                 f"restart to read the new one")

    def check_expert_blob(self, layer, expert, buf):
        """buf (a blob just read) against its crc32, or, when this process already checked that blob, a check
        that the open file was not rewritten in place since (fstat: inode, size, mtime). A file replaced by a
        rename is no concern: the open descriptor keeps reading the old one."""
        if (layer, expert) in self.verified:
            self._check_unchanged()
            return buf
        ent = self.expert_entry(layer, expert)
        if f"{crc32(buf):08x}" != ent["crc32"]:
            raise self.checksum_error(layer, expert)
        self.verified.add((layer, expert))
        return buf

    def checksum_error(self, layer, expert):
        """The one-line error for an expert blob whose crc32 does not match (stream_infer's C++ readers too)."""
        try:  # a file rewritten in place while open (a new export copied over it) is not corrupt: restart
            self._check_unchanged()
        except ContainerError as e:
            return e
        offset = self.expert_entry(layer, expert)["offset"]
        return ContainerError(f"{self.path}: checksum mismatch in layer {layer} expert {expert} (offset {offset}); "
                              f"the file is corrupt, re-export it")

    def short_read_error(self, offset, got, nbytes):
        """The one-line error for a read that ended before its bytes did: the file was cut short."""
        return ContainerError(f"{self.path}: short read at offset {offset} ({got} of {nbytes} bytes); "
                              f"the file is truncated: re-export or re-copy it")

    def read_expert_blob(self, layer, expert, verify=True, buf=None):
        """The whole blob of one routed expert (gate_up and down, packed and scales): one aligned read (into
        `buf` when given: stream_infer recycles evicted experts' buffers)."""
        ent = self.expert_entry(layer, expert)
        buf = self._pread(ent["offset"], self.expert_nbytes, buf=buf)
        return self.check_expert_blob(layer, expert, buf) if verify else buf

    def decode_expert(self, buf):
        """Blob buffer -> {part: {"packed": uint8, "sz": bf16 (K/g, N, 2), "shape", "group_size"}} (zero-copy)."""
        out = {}
        for p in self.layout["parts"]:
            Np, Kp = int4_padded_shape(p["shape"], p["group_size"])
            out[p["name"]] = {"packed": part_tensor(buf, 0, p["packed"], torch.uint8),
                              "sz": part_tensor(buf, 0, p["sz"], torch.bfloat16).view(Kp // p["group_size"], Np, 2),
                              "shape": p["shape"], "group_size": p["group_size"]}
        return out

    def expert_weights(self, layer, expert):
        """Dequantized fp32 {"gate_up_proj": (2F, D), "down_proj": (D, F)} of one routed expert."""
        dec = self.decode_expert(self.read_expert_blob(layer, expert))
        return {k: dequantize_int4(v["packed"], v["sz"], v["shape"], v["group_size"]) for k, v in dec.items()}

    def raw_tensor(self, name):
        """A resident tensor as stored: {"kind", "shape", parts as zero-copy tensors} (crc checked)."""
        t = self.header["tensors"].get(name)
        if t is None:
            raise ContainerError(f"{self.path}: no tensor {name!r} in this container")
        buf = self._pread(t["offset"], t["nbytes"], direct=False)
        self._check_tensor_crc(name, crc32(buf))
        out = {"kind": t["kind"], "shape": t["shape"]}
        if t["kind"] == "f32":
            out["data"] = part_tensor(buf, 0, t["parts"]["data"], torch.float32).view(t["shape"])
        elif t["kind"] == "int8":
            out["q"] = part_tensor(buf, 0, t["parts"]["q"], torch.int8).view(t["shape"])
            out["scale"] = part_tensor(buf, 0, t["parts"]["scale"], torch.float32)
        else:
            g = t["group_size"]
            Np, Kp = int4_padded_shape(t["shape"], g)
            out["packed"] = part_tensor(buf, 0, t["parts"]["packed"], torch.uint8)
            out["sz"] = part_tensor(buf, 0, t["parts"]["sz"], torch.bfloat16).view(Kp // g, Np, 2)
            out["group_size"] = g
        return out

    def check_tensor(self, name, piece=4 << 20):
        """A resident tensor's crc32, read piece by piece, never held whole (stream_infer checks the embedding
        table at load this way and then reads its rows on demand)."""
        t = self.header["tensors"].get(name)
        if t is None:
            raise ContainerError(f"{self.path}: no tensor {name!r} in this container")
        crc, done, buf = 0, 0, None
        while done < t["nbytes"]:
            n = min(piece, t["nbytes"] - done)
            buf = self._pread(t["offset"] + done, n, direct=False, buf=buf)  # reused while pieces are equal
            crc = crc32(buf, crc)
            done += n
        self._check_tensor_crc(name, crc)

    def _check_tensor_crc(self, name, crc):
        t = self.header["tensors"][name]
        if f"{crc:08x}" != t["crc32"]:
            raise ContainerError(f"{self.path}: checksum mismatch in tensor {name} (offset {t['offset']}); "
                                 f"the file is corrupt, re-export it")

    def tensor_rows(self, name, ids):
        """Rows `ids` of an int8-row resident tensor as fp32 [len(ids), K], read from the file (two small preads per
        row, the row and its scale; the page cache serves repeats): embeddings looked up without holding the table.
        Trusts the bytes as check_tensor found them at load, while the open file stays the same."""
        t = self.header["tensors"][name]
        if t["kind"] != "int8":
            raise ContainerError(f"{self.path}: tensor {name} is {t['kind']}; rows are read on demand from int8 only")
        self._check_unchanged()
        N, K = t["shape"]
        q, scale = bytearray(), bytearray()
        for r in ids:
            if not 0 <= r < N:
                raise ContainerError(f"{self.path}: row {r} of {name} is outside 0..{N - 1}")
            row = os.pread(self.fd, K, t["offset"] + t["parts"]["q"][0] + r * K)
            row_scale = os.pread(self.fd, 4, t["offset"] + t["parts"]["scale"][0] + 4 * r)
            if len(row) != K or len(row_scale) != 4:
                raise ContainerError(f"{self.path}: short read of row {r} of {name}; the file is truncated: "
                                     f"re-export or re-copy it")
            q += row
            scale += row_scale
        if not ids:
            return torch.empty(0, K)
        return dequantize_int8(torch.frombuffer(q, dtype=torch.int8), torch.frombuffer(scale, dtype=torch.float32),
                               (len(ids), K))

    def tensor(self, name):
        """A resident tensor dequantized to fp32."""
        r = self.raw_tensor(name)
        if r["kind"] == "f32":
            return r["data"].clone()
        if r["kind"] == "int8":
            return dequantize_int8(r["q"], r["scale"], r["shape"])
        return dequantize_int4(r["packed"], r["sz"], r["shape"], r["group_size"])

    def resident_bytes(self):
        return sum(t["nbytes"] for t in self.header["tensors"].values())

    def dequantized_state_dict(self):
        """A picaflor state dict in fp32 (experts stacked as model.py keeps them); for quality checks and eval."""
        cfg = self.config
        sd = {name: self.tensor(name) for name in self.header["tensors"]}
        for layer, ents in self.header["experts"].items():
            ws = [self.expert_weights(int(layer), e) for e in range(len(ents))]
            for pname in ("gate_up_proj", "down_proj"):
                sd[f"layers.{layer}.mlp.experts.{pname}"] = torch.stack([w[pname] for w in ws])
        if cfg.tie_embeddings:
            sd["lm_head.weight"] = sd["embed_tokens.weight"]
        return sd

    def verify_all(self, progress=False):
        """Read and check every blob (resident and experts)."""
        from tqdm import tqdm
        self.verified.clear()  # every expert's crc32 again, not only the ones this process has not read yet
        for name in tqdm(list(self.header["tensors"]), desc="resident", disable=not progress):
            self.raw_tensor(name)
        for layer, ents in tqdm(list(self.header["experts"].items()), desc="expert layers", disable=not progress):
            for e in range(len(ents)):
                self.read_expert_blob(int(layer), e)


def load_container(path):
    """Open and validate a container (magic, version, header, alignment, size); raises ContainerError."""
    path = str(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(PREFIX.size)
            if not prefix or (len(prefix) < PREFIX.size and MAGIC.startswith(prefix[:8])):  # (said "wrong magic")
                raise ContainerError(f"{path}: truncated ({size} bytes: less than its first {PREFIX.size}); "
                                     f"re-export or re-copy it")
            if prefix[:8] != MAGIC:
                # (not --out {path}: that named the file given, a GGUF say, to be overwritten)
                raise ContainerError(f"{path}: not a picaflor int4 container (wrong magic); make one with python "
                                     f"export.py CKPT --format int4 --out MODEL.pcf4")
            _, version, header_crc, hlen = PREFIX.unpack(prefix)
            if version != VERSION:
                raise ContainerError(f"{path}: container format version {version}, this code reads version {VERSION}; "
                                     f"re-export it with this version of export.py")
            if PREFIX.size + hlen > size:
                raise ContainerError(f"{path}: truncated (header needs {PREFIX.size + hlen} bytes, file has {size}); "
                                     f"re-export or re-copy it")
            raw = f.read(hlen)
    except FileNotFoundError:
        raise ContainerError(f"{path}: no such file; check the path or export one with export.py --format int4") from None
    except IsADirectoryError:
        raise ContainerError(f"{path}: is a directory, not a container file; pass the int4 container export.py "
                             f"--format int4 wrote (a checkpoint dir: export it first)") from None
    except PermissionError:
        raise ContainerError(f"{path}: permission denied") from None
    if header_crc == 0:  # (zeroing the field switched the check off)
        raise ContainerError(f"{path}: its header has no crc32 (written by an export.py before the check, or "
                             f"damaged); re-export it")
    if zlib.crc32(raw) != header_crc:  # a changed rope_theta would otherwise load and decode wrong
        raise ContainerError(f"{path}: corrupt container header (its crc32 does not match: changed or damaged); "
                             f"re-export or re-copy it")
    try:
        header = json.loads(raw)
        cfg = ModelConfig.from_dict(header["model_config"], complete=True)
        tensors, experts, layout = header["tensors"], header["experts"], header["expert_layout"]
        group = header["quant"]["group_size"]
        if not (type(group) is int and group > 0 and group % 2 == 0):
            raise ValueError(f"group_size {group!r}: a positive even count")
        if type(header.get("file_bytes", 0)) is not int or header.get("file_bytes", 0) < 0:
            raise ValueError(f"file_bytes {header['file_bytes']!r}: a byte count")
        # the layout the writer derives from the config, kinds and group size, field for field: a header edited
        # with its crc32 recomputed (or a writer's bug) passed --check, then decoded wrong or raised a traceback
        if layout != expert_layout(cfg, group):
            raise ValueError("expert_layout is not the one its model config and group size give")
        def count(v, what):  # offsets and sizes are read as given: "4096" or Infinity was a traceback later
            if type(v) is not int or v < 0:
                raise ValueError(f"{what} {v!r}: not a byte count")
            return v
        for name, t in tensors.items():
            if t["kind"] not in ("f32", "int8", "int4"):
                raise ValueError(f"{name}: kind {t['kind']!r}")
            if not (type(t["shape"]) is list and t["shape"] and all(type(n) is int and n > 0 for n in t["shape"])):
                raise ValueError(f"{name}: shape {t['shape']!r}")
            parts, nb = resident_parts(t["kind"], t["shape"], group)
            if t["parts"] != parts or count(t["nbytes"], f"{name}: nbytes") < nb or \
                    (t["kind"] == "int4") != ("group_size" in t) or t.get("group_size", group) != group:
                raise ValueError(f"{name}: its parts or group size are not the ones its kind and shape give")
        spans = [(count(t["offset"], f"{name}: offset"), t["nbytes"], name) for name, t in tensors.items()]
        spans += [(count(ent["offset"], f"layer {l} expert {e}: offset"), int(layout["nbytes"]),
                   f"layer {l} expert {e}") for l, ents in experts.items() for e, ent in enumerate(ents)]
        for ent in [*tensors.values(), *(ent for ents in experts.values() for ent in ents)]:
            int(ent["crc32"], 16)  # (a tensor's missing crc32 was a KeyError traceback at its first read)
        # every layer holds resident norms: a header's n_layer of 10^12 built a meta model of it until memory ran out
        if cfg.n_layer > len(tensors):
            raise ValueError(f"n_layer {cfg.n_layer} is more layers than its {len(tensors)} resident tensors hold")
        shapes = expected_shapes(cfg)
        bad_shape = next((n for n, t in tensors.items() if n in shapes and list(t["shape"]) != shapes[n]), None)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, OverflowError) as e:
        raise ContainerError(f"{path}: corrupt container header ({str(e).splitlines()[0][:120]}); "
                             f"re-export it") from None
    if bad_shape:
        raise ContainerError(f"{path}: corrupt container header ({bad_shape} has shape {tensors[bad_shape]['shape']}, its "
                             f"model config says {shapes[bad_shape]}); re-export it")
    data_start = align_up(PREFIX.size + hlen)
    for off, n, what in spans:
        if off % ALIGN or n % ALIGN or off < data_start:
            raise ContainerError(f"{path}: {what} is not 4096-byte aligned (offset {off}, {n} bytes); corrupt header: "
                                 f"re-export it")
    end = max((off + n for off, n, _ in spans), default=data_start)
    if header.get("file_bytes", end) < end:
        raise ContainerError(f"{path}: corrupt container header (file_bytes {header['file_bytes']} is short of its index's "
                             f"{end}); re-export it")
    if end > size or header.get("file_bytes", end) > size:
        raise ContainerError(f"{path}: truncated (index needs {max(end, header.get('file_bytes', end))} bytes, "
                             f"file has {size}); re-export or re-copy it")
    want = set(shapes)
    have = set(tensors) | {f"layers.{l}.mlp.experts.{p}" for l in experts for p in ("gate_up_proj", "down_proj")}
    if want != have:
        missing = sorted(want - have)[:3]
        raise ContainerError(f"{path}: header does not match its model config (missing {missing}); corrupt header: "
                             f"re-export it")
    if any(len(experts.get(str(l), [])) != cfg.n_experts for l in range(cfg.n_dense_layers, cfg.n_layer)):
        raise ContainerError(f"{path}: expert index does not match n_experts={cfg.n_experts}; corrupt header: "
                             f"re-export it")
    del group
    return Container(path, header, size, data_start)


# ----------------------------------------------------------------------------------------------------------
# config files (config/micro.py): model fields as globals

def config_from_file(path):
    import configurator
    g = {}
    if not os.path.isfile(path):
        raise ContainerError(f"{path}: cannot read config file (not a file); pass a file under config/")
    try:  # (a syntax error, an undefined name: a traceback)
        configurator.exec_file(path, g)
    except configurator.ConfigError as e:
        raise ContainerError(str(e)) from None  # (each says its fix: the file's line, or how to save it)
    model_fields = sorted(f.name for f in fields(ModelConfig))
    for key in sorted(configurator.config_keys(g) - set(model_fields)):  # the training keys are left to train.py, but
        near = difflib.get_close_matches(key, model_fields, n=1, cutoff=0.8)  # n_layers = 40 built n_layer's default
        if near:
            raise ContainerError(f"{path}: '{key}' is no model field; did you mean '{near[0]}'? fix the config file")
    try:  # each field of its default's type: n_layer = "2" was a TypeError traceback in validate
        return ModelConfig.from_dict({f.name: configurator.coerce(f.name, g[f.name], f.default)
                                      for f in fields(ModelConfig) if f.name in g})
    except (configurator.ConfigError, ValueError) as e:
        raise ContainerError(f"{path}: {e}; fix the config file") from None


def measure_quantization(ckpt_or_cfg, group_sizes=(32, 64, 128)):
    """Relative RMS error of int4 (all int4-eligible weights) for each group size, sym vs asym."""
    src = CheckpointSource(ckpt_or_cfg) if os.path.isdir(ckpt_or_cfg) else RandomSource(config_from_file(ckpt_or_cfg))
    shapes = expected_shapes(src.cfg)
    rows = []
    for g in group_sizes:
        for sym in (False, True):
            se = ss = bits = n = 0.0
            for name, shape in shapes.items():
                if tensor_class(name) in ("exact", "embeddings"):
                    continue
                ws = [src.get_expert(name, e) for e in range(shape[0])] if tensor_class(name) == "experts" else [src.get(name)]
                for w in ws:
                    p, sz = quantize_int4(w, g, sym)
                    se += float((dequantize_int4(p, sz, w.shape, g) - w.float()).pow(2).sum())
                    ss += float(w.float().pow(2).sum())
                    # the bytes the container stores, padding included: 4 + 32 / g printed for every shape, where
                    # d_model 72 at group 128 stores ~2.5x that
                    bits, n = bits + 8 * sum(int4_nbytes(tuple(w.shape), g)), n + w.numel()
            rows.append({"group_size": g, "scheme": "symmetric" if sym else "asymmetric",
                         "rel_rms_error": math.sqrt(se / ss), "bits_per_weight": bits / n})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description="Write or check a picaflor int4 streaming container.")
    ap.add_argument("ckpt", nargs="?", help="checkpoint dir (step_NNNNNNN/ or a run dir)")
    ap.add_argument("--out", help="container path to write (e.g. model.pcf4)")
    ap.add_argument("--random-config", help="write random weights for this config file (e.g. config/micro.py)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--exact-random", action="store_true",
                    help="with --random-config: draw fp32 weights and quantize them (slow) instead of drawing codes")
    ap.add_argument("--group-size", type=int, default=DEFAULT_GROUP)
    ap.add_argument("--embed-bits", type=int, default=8, choices=[4, 8])
    ap.add_argument("--dense-bits", type=int, default=4, choices=[4, 8], help="attention, shared and dense FFN")
    ap.add_argument("--symmetric", action="store_true", help="absmax (Q4_0-style) instead of min/max groups")
    ap.add_argument("--check", metavar="CONTAINER", help="validate a container and every checksum")
    ap.add_argument("--measure", metavar="CKPT_OR_CONFIG", help="print int4 error per group size, sym vs asym")
    args = ap.parse_args(argv)
    if args.out:
        args.out = args.out.rstrip("/") or "/"  # x.pcf4/: the temp file went inside a folder that does not exist
    try:
        if args.check:
            c = load_container(args.check)
            c.verify_all(progress=True)
            print(f"{args.check}: ok ({c.file_size / 1e9:.3f} GB, {len(c.header['tensors'])} resident tensors, "
                  f"{sum(len(v) for v in c.header['experts'].values())} expert blobs)")
            return 0
        if args.measure:
            for r in measure_quantization(args.measure):
                print(f"group {r['group_size']:4d} {r['scheme']:>10s}: rel RMS error {r['rel_rms_error']:.4f} "
                      f"at {r['bits_per_weight']:.2f} bits/weight")
            return 0
        if not args.out or not (args.ckpt or args.random_config):
            ap.error("give CKPT --out PATH, or --random-config CONFIG --out PATH, or --check CONTAINER")
        import export  # export.py's --out rules: never the source, never a file that is not an earlier container
        parent = os.path.dirname(os.path.abspath(args.out))
        if not os.path.isdir(parent):
            raise ContainerError(f"{args.out}: directory {parent} does not exist; create it or choose another --out")
        try:
            export.check_out(args.ckpt or args.random_config, args.out, "int4")
        except export.ExportError as e:
            raise ContainerError(str(e)) from None
        source = (RandomSource(config_from_file(args.random_config), args.seed, direct=not args.exact_random)
                  if args.random_config else None)
        rep = write_container(args.ckpt, args.out, args.group_size, args.embed_bits, True, args.dense_bits,
                              args.symmetric, source)
        print(json.dumps(rep, indent=1))
        return 0
    except (ContainerError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: {checkpoint.os_error_line(e, args.out)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # (a traceback) write_container removes its temp file; --out is as it was
        wrote = args.out and not (args.check or args.measure)
        print("interrupted" + (f"; {args.out} is as it was" if wrote else ""), file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
