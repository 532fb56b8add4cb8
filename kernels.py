"""
kernels: int4 and int8 matmuls over an int4 container's bytes as container.py stores them, and the layers
stream_infer.py builds from them (QLinear, QEmbedding); stream_infer picks one with `--kernel` (auto: native on a
CPU with its integer loops, else int4pack; triton on CUDA).

- native (CPU): int4_cpu.cpp, compiled on first use (g++ and ninja; ~15 s, cached), reads the container's bytes as
  they are. On AVX2 it quantizes activations per group to int8 and multiplies integers, as llama.cpp's Q4_0 x Q8_0
  kernels do (relative error ~0.6% on random activations, the size of bf16 rounding), 512 bits wide where the
  compiler targets AVX-512BW (the same integer sums, bit for bit; +11% cold and +40% hot on 2 threads here), and
  as vpermb + vpdpbusd with AVX-512 VNNI (bit for bit again; +8-15% cold, +25% hot over the 512-bit loop), and on
  AArch64 with dot products (ARMv8.2+, Apple M1 on) as zips + sdot (bit for bit the x86 result, tested under
  qemu; unmeasured on ARM hardware); its portable fp32 loop (other CPUs) is slower than int4pack, so auto picks
  native only with AVX2 or ARM dot products. Measured on the earlier AVX2 machine (2 cores, M=1, micro shapes,
  weights cold in DRAM, `python bench/int4_gemv.py`): 7-9 GB/s of int4 weights on 1 thread and 10-13 GB/s on 2,
  vs 3.2 / 6.1 GB/s for torch's `_weight_int4pack_mm_for_cpu` (which dequantizes to bf16); hot in cache 15 GB/s
  per thread vs 3. A software prefetch 1 KB ahead added ~20% cold, and one 8 KB ahead into L2 ~20% more on a
  Xeon VM (`bench/int4_prefetch.py`). Without a compiler it warns once and auto falls back to int4pack.
  int8 rows (embeddings, lm_head) go through the same extension, on AVX2 with activations quantized to int8 per
  32 columns: micro's lm_head GEMV went from 11.4 to 17.7-20.0 GB/s on 2 threads (~2.5 ms less per token; the
  int8 rows part of bench/int4_gemv.py, where torch's _weight_int8pack_mm gives 8.2-10.3).
- int4pack (CPU): torch's `_weight_int4pack_mm_for_cpu`, for machines without a compiler; on AVX-512 CPUs torch
  packs 64-row blocks, so its weights are repacked once each (to_int4pack_layout), experts at every read.
- reference: dequantize, then an fp32 matmul; the check every other kernel is tested against. A chunk of rows at a
  time (REFERENCE_CHUNK), so its temporaries are a few MB that --ram-budget counts, whatever the matrix.
- triton (CUDA): `triton_int4_matmul` (bottom of this file) reads the same bytes; Triton is imported only on that
  path. int8 rows (the lm_head) are dequantized once at load there. Run on an H200 with `bench/gpu_check.py`
  (README "On a GPU"; tiles from bench/triton_tune.py); its correctness part runs on CPU under TRITON_INTERPRET=1
  in the tests.
"""

import contextlib
import os
import platform
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import container as C


def openmp_kernels():
    """Whether int4_cpu.cpp runs on OpenMP threads (torch's libgomp) or on its own (int4_loops.h's ChunkPool):
    Apple clang has no OpenMP, and PICAFLOR_OPENMP=0 asks for the pool here (A/Bs, tests of the macOS build)."""
    return sys.platform != "darwin" and os.environ.get("PICAFLOR_OPENMP", "1") != "0"


# ----------------------------------------------------------------------------------------------------------
# weights as stored in the container

INT4PACK_GROUPS = (32, 64, 128, 256)  # the group sizes torch's CPU int4 kernel takes (torch 2.13)
_INT4PACK = None  # torch's CPU int4 kernel: None unchecked, False absent, else "same" or "repack" (its layout here)


def cpu_int4pack_ok():
    """torch's CPU int4 kernel exists (checked once per process); to_int4pack_layout() gives it the bytes it wants."""
    global _INT4PACK
    if _INT4PACK is None:
        try:
            q = torch.randint(0, 16, (64, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
            ref = torch._convert_weight_to_int4pack_for_cpu(q, 1).flatten()
            _INT4PACK = "same" if torch.equal(C.unpack_int4(ref, 64, 64).int(), q) else "repack"
        except (AttributeError, RuntimeError):
            _INT4PACK = False
    return bool(_INT4PACK)


def int4pack_same_layout():
    """torch packs int4 as container.py stores it (its AVX2 build; its AVX-512 build packs 64-row blocks)."""
    return cpu_int4pack_ok() and _INT4PACK == "same"


def to_int4pack_layout(packed, shape, group_size, rows_at_a_time=128):
    """In place: the container's packed bytes -> the layout torch's int4pack kernel uses on this CPU (the same size).
    A no-op where the layouts agree; elsewhere a repack (~25 ms per 2048x1024 matrix), once per resident weight
    and once per expert read: --kernel int4pack is the fallback for machines without a compiler. Both layouts keep
    a run of rows (a multiple of 64) in the same contiguous bytes, so it goes rows_at_a_time rows at a time: the
    int32 unpacked copy it needs stays a few MB (whole matrices took 10x their bytes, 168 MB for micro's dense FFN)."""
    if group_size in INT4PACK_GROUPS and not int4pack_same_layout():  # other groups: reference, container bytes
        Np, Kp = C.int4_padded_shape(shape, group_size)
        for r0 in range(0, Np, rows_at_a_time):
            part = packed[r0 * Kp // 2:(r0 + rows_at_a_time) * Kp // 2]
            q = C.unpack_int4(part, min(rows_at_a_time, Np - r0), Kp).to(torch.int32)
            part.copy_(torch._convert_weight_to_int4pack_for_cpu(q, 1).view(-1))
    return packed


_LIBC = None


def release_freed_heap():
    """malloc_trim(0): hand the heap's freed pages back to the OS (glibc; else nothing)."""
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


# weights the reference path dequantizes at a time (fp32 elements): whole, an int4 lm_head of nano's shape was three
# fp32 copies at once (384 MiB), more than --ram-budget counted, on top of what glibc's heap kept from the forward's
REFERENCE_CHUNK = 1 << 20


def reference_rows(K):
    """Rows of a (padded) width K the reference path dequantizes at a time: whole 32-row blocks (int4's packing),
    about REFERENCE_CHUNK weights."""
    return max(1, REFERENCE_CHUNK // (C.ROW_BLOCK * K)) * C.ROW_BLOCK


def reference_scratch_bytes(K):
    """The reference path's temporaries for weights at most K wide (padded): one chunk's three fp32 copies and its
    uint8 codes for int4 (the codes as floats, minus 8, times the scales: measured 3.06 copies), two for int8."""
    return (3 * 4 + 1) * reference_rows(K) * K


def chunked_reference(x, N, rows, weight_rows):
    """x @ W^T for W of N rows, dequantized `rows` at a time: weight_rows(r, n) gives rows r .. r + n as fp32."""
    x = x.float()
    if rows >= N:
        return x @ weight_rows(0, N).t()
    y = torch.empty(*x.shape[:-1], N, device=x.device)
    for r in range(0, N, rows):
        n = min(rows, N - r)
        y[..., r:r + n] = x @ weight_rows(r, n).t()
    return y


def int4_matmul_reference(x, packed, sz, shape, group_size):
    """The reference every int4 path must equal: dequantize to fp32, then x @ W^T; reference_rows rows at a time
    (their packed bytes and scales are contiguous slices), so its temporaries stay reference_scratch_bytes."""
    N, K = shape
    Kp = C.int4_padded_shape(shape, group_size)[1]
    rows = reference_rows(Kp)
    return chunked_reference(x, N, rows, lambda r, n: C.dequantize_int4(
        packed[r * Kp // 2:(r + rows) * Kp // 2], sz[:, r:r + rows], (n, K), group_size))


def int8_matmul_reference(x, q, scale, shape):
    """x @ W^T over int8 rows, dequantized reference_rows rows at a time (as int4_matmul_reference)."""
    N, K = shape
    q = q.view(shape)
    return chunked_reference(x, N, reference_rows(K),
                             lambda r, n: C.dequantize_int8(q[r:r + n], scale[r:r + n], (n, K)))


def int4_matmul_cpu(x, packed, sz, shape, group_size):
    """x (M, K) -> (M, N) fp32 through torch's int4pack CPU kernel (bf16 activations); packed as to_int4pack_layout
    left it."""
    if group_size not in INT4PACK_GROUPS:
        return int4_matmul_reference(x, packed, sz, shape, group_size)
    N, K = shape
    Np, Kp = C.int4_padded_shape(shape, group_size)
    xb = x.to(torch.bfloat16)
    if Kp != K:
        xb = F.pad(xb, (0, Kp - K))
    y = torch._weight_int4pack_mm_for_cpu(xb.contiguous(), packed.view(Np, Kp // 2), group_size, sz)
    return y[:, :N].float()


NATIVE = None


def native_int4():
    """torch.ops of int4_cpu.cpp (the fast CPU int4 matmul, over int4_loops.h's loops), compiled on first use
    (~15 s, then cached under ~/.cache/torch_extensions, rebuilt when a source or the compiler changes) or None when
    it cannot be built here."""
    global NATIVE
    if NATIVE is None:
        import hashlib
        from torch.utils import cpp_extension
        here = os.path.dirname(os.path.abspath(__file__))
        src, reader_src = os.path.join(here, "int4_cpu.cpp"), os.path.join(here, "expert_reader.cpp")
        # -march=native: the build dir is keyed by this machine's CPU flags, so a shared home cannot hand a
        # binary to a CPU that lacks its instructions
        try:
            cpu = next((l for l in open("/proc/cpuinfo") if l.startswith(("flags", "Features"))), "")
        except OSError:
            cpu = platform.processor()
        use_omp = openmp_kernels()  # else int4_loops.h's own threads (ChunkPool)
        omp = ["-fopenmp"] if use_omp else []
        # the build dir is keyed by every source's bytes (int4_loops.h and expert_reader.cpp too: int4_cpu.cpp includes
        # them, and cpp_extension watches only the file it is given), so a changed source is a missing .so, said below;
        # else cpp_extension rebuilt it silently (a pull's ~15 s without a word); a missing file: the build fails, loudly
        code = b""
        for part in (src, reader_src, os.path.join(here, "int4_loops.h")):
            try:
                with open(part, "rb") as f:
                    code += f.read()
            except OSError:
                pass
        # and by this checkout's folder: two checkouts (a fork beside main, a CI clone) rebuilt over each other; and
        # by the compiler: another CXX (or an upgraded one) loaded the .so the previous compiler had built
        key = (cpu + torch.__version__ + here + compiler_identity(cpp_extension.get_cxx_compiler())).encode() + code
        name = "picaflor_int4_cpu_" + hashlib.sha1(key).hexdigest()[:10] + ("" if use_omp else "_pool")
        # ARM compilers name the host CPU with -mcpu (gcc and clang: dot products where the core has them)
        arch = ["-mcpu=native"] if platform.machine().lower() in ("aarch64", "arm64") else ["-march=native"]
        # ninja is a pip dependency: make the venv's bin findable when python runs without activating it
        os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
        try:
            build_dir = cpp_extension._get_build_directory(name, False)
            so = os.path.join(build_dir, name + ".so")
            if not os.path.exists(so):
                print("stream_infer: compiling int4_cpu.cpp, the fast CPU int4 kernel (first use, and after its sources "
                      "change; ~15 s)", file=sys.stderr)
            # a read-only cache (an image's, another user's) holding this very build (its name keys it) is loaded as
            # it is: cpp_extension.load wants to write there, and it was "could not build" and the slower kernel
            if os.path.isfile(so) and not os.access(build_dir, os.W_OK):
                torch.ops.load_library(so)
            else:
                with build_turn(build_dir):
                    cpp_extension.load(name=name, sources=[src], extra_cflags=["-O3"] + arch + omp,
                                       extra_ldflags=omp, is_python_module=False, verbose=False)
            NATIVE = torch.ops.picaflor_int4
        except Exception as e:  # no compiler, no ninja, a foreign toolchain: fall back, loudly, once
            why = (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]
            fix = ("make the build folder writable or point TORCH_EXTENSIONS_DIR at one that is"
                   if isinstance(e, OSError) else  # (a filesystem fault got the compiler advice)
                   f"Install a C++ compiler ({'xcode-select --install' if sys.platform == 'darwin' else 'apt install g++'}) "
                   f"and ninja (pip install -r requirements.txt)")
            print(f"stream_infer: warning: could not build {src} ({why}); using torch's slower int4pack kernel. {fix}",
                  file=sys.stderr)
            NATIVE = False
    return NATIVE or None


def compiler_identity(cxx):
    """The C++ compiler cpp_extension builds with (CXX, else c++), as part of the extension's build name: its command,
    the file that runs and what its --version says (none of them: the build fails, loudly, as before)."""
    import shlex
    import shutil
    import subprocess
    try:
        argv = shlex.split(cxx) or [cxx]
    except ValueError:  # (an unbalanced quote: the build says what is wrong with it)
        argv = [cxx]
    exe = shutil.which(argv[0])
    try:
        version = subprocess.run(argv + ["--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, ValueError, subprocess.SubprocessError):
        version = ""
    return "\n".join([cxx, os.path.realpath(exe) if exe else "", version])


@contextlib.contextmanager
def build_turn(build_dir):
    """One build at a time under an flock, which the OS drops when its holder dies: torch's own lock file stays
    behind a build that was killed (SIGTERM, a timeout) and every later load waited on it for ever, silently.
    Holding the flock, a lock file of torch's can only be such a leftover, so it goes."""
    os.makedirs(build_dir, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # (not POSIX: torch's lock only)
        yield
        return
    with open(os.path.join(build_dir, "picaflor-build.flock"), "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process builds (or is stopped mid-build): said, not a silent wait
            f.seek(0)
            print(f"stream_infer: waiting for another build of {build_dir} (pid {f.read().strip() or '?'}) to finish",
                  file=sys.stderr)
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:  # a filesystem without flock (NFS -o nolock: ENOLCK): torch's lock file only, as before
            yield
            return
        f.truncate(0)
        f.write(str(os.getpid()))
        f.flush()
        stale = os.path.join(build_dir, "lock")
        if os.path.exists(stale):
            print(f"stream_infer: removing {stale}, left by a build that was killed", file=sys.stderr)
            os.remove(stale)
        yield


def int4_matmul_native(x, packed, sz, shape, group_size):
    """x (M, K) -> (M, N) fp32 through int4_cpu.cpp (fp32 activations, the container's bytes as they are)."""
    return native_int4().int4_mm(x, packed, sz, shape[0], group_size)


def native_reader():
    """The extension's expert readers (expert_reader.cpp, built with int4_cpu.cpp), or None without a compiler."""
    ops = native_int4() if os.name == "posix" else None
    return ops if ops is not None and hasattr(ops, "blob_read") else None


class QLinear(nn.Module):
    """A linear layer over a container tensor (int4 / int8 / f32), y = x @ W^T, fp32 in and out."""

    def __init__(self, raw, kernel, shared=False):
        """shared: another module reads raw's bytes as the container stores them (a tied int4 embedding)."""
        super().__init__()
        if kernel == "int4pack" and raw["kind"] == "int4" and raw.get("layout") != "int4pack":
            packed = raw["packed"].clone() if shared and not int4pack_same_layout() else raw["packed"]
            raw = dict(raw, packed=to_int4pack_layout(packed, raw["shape"], raw["group_size"]), layout="int4pack")
        self.raw, self.kind, self.shape, self.kernel = raw, raw["kind"], raw["shape"], kernel
        # int4_cpu.cpp's int4_mm arguments after x (forward and Engine._decode_step pass them as they are)
        self.native_args = ((raw["packed"], raw["sz"], self.shape[0], raw["group_size"])
                            if kernel == "native" and self.kind == "int4" else None)
        if self.kind == "int8":
            self.scale_bf16 = raw["scale"].to(torch.bfloat16)
        # on the Triton (GPU) path int8 rows are dequantized once here (fp32, the reference path's arithmetic): per
        # call, micro's lm_head would make a 256 MB temporary every token
        self.dense = (C.dequantize_int8(raw["q"], raw["scale"], self.shape)
                      if self.kind == "int8" and kernel == "triton" else None)
        self.nbytes = sum(v.numel() * v.element_size() for v in raw.values() if isinstance(v, torch.Tensor))

    def forward(self, x):
        if self.native_args is not None:  # the decode hot path: any leading dims, no reshapes
            return NATIVE.int4_mm(x, *self.native_args)
        r = self.raw
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if self.kind == "f32":
            y = x2.float() @ r["data"].t()
        elif self.kind == "int8":
            if self.dense is not None:
                y = x2.float() @ self.dense.t()
            elif self.kernel == "native":
                y = NATIVE.int8_mm(x2, r["q"], r["scale"])
            # torch 2.13's kernel needs K a multiple of 16: else it segfaults for M > 1 (loglikelihood's 64 logit
            # rows) and gives garbage (1e34, NaN) for M = 1 (a decode step's lm_head at d_model 72)
            elif (self.kernel != "reference" and x2.device.type == "cpu" and hasattr(torch, "_weight_int8pack_mm")
                  and self.shape[1] % 16 == 0):
                y = torch._weight_int8pack_mm(x2.to(torch.bfloat16).contiguous(), r["q"], self.scale_bf16).float()
            else:
                y = int8_matmul_reference(x2, r["q"], r["scale"], self.shape)
        elif self.kernel == "int4pack":
            y = int4_matmul_cpu(x2, r["packed"], r["sz"], self.shape, r["group_size"])
        elif self.kernel == "triton":
            y = triton_int4_matmul(x2, r["packed"], r["sz"], self.shape, r["group_size"])
        else:
            y = int4_matmul_reference(x2, r["packed"], r["sz"], self.shape, r["group_size"])
        return y.reshape(*lead, self.shape[0])


class QEmbedding(nn.Module):
    """Token embedding rows dequantized on lookup (int8 rows, int4 row blocks or f32)."""

    def __init__(self, raw):
        super().__init__()
        self.raw, self.shape = raw, raw["shape"]

    def forward(self, idx):
        r, flat = self.raw, idx.reshape(-1)
        if r["kind"] == "f32":
            out = r["data"][flat]
        elif r["kind"] == "int8":
            out = r["q"][flat].float() * r["scale"][flat, None]
        else:  # int4: dequantize the 32-row block of each id
            g, D = r["group_size"], self.shape[1]
            Np, Kp = C.int4_padded_shape(self.shape, g)
            blk = 16 * Kp
            rows = []
            for i in flat.tolist():
                b = i // C.ROW_BLOCK
                q = C.unpack_int4(r["packed"][b * blk:(b + 1) * blk], C.ROW_BLOCK, Kp)[i % C.ROW_BLOCK].float()
                sz = r["sz"][:, i].float()
                rows.append(((q.view(-1, g) - 8) * sz[:, :1] + sz[:, 1:]).view(-1)[:D])
            out = torch.stack(rows)
        return out.reshape(*idx.shape, self.shape[1])



# ----------------------------------------------------------------------------------------------------------
# Triton int4 dequant-matmul (CUDA; tested on CPU with TRITON_INTERPRET=1). Imported lazily.

_TRITON_KERNEL = None


def _triton_kernel():
    global _TRITON_KERNEL
    if _TRITON_KERNEL is not None:
        return _TRITON_KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def int4_mm_kernel(x_ptr, p_ptr, sz_ptr, y_ptr, M, N, K, Np, stride_xm, stride_ym,
                       GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TF32: tl.constexpr):
        # y[m, n] = sum_k x[m, k] * ((q[n, k] - 8) * scale[k // G, n] + zero[k // G, n]); q read from the
        # container layout: byte (n // 32) * 16 * Kp + k * 16 + n % 16, high nibble when n % 32 >= 16
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        Kp = (K + GROUP - 1) // GROUP * GROUP
        nmask = rn < Np
        for k0 in range(0, Kp, BK):
            rk = k0 + tl.arange(0, BK)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            byte = (rn[None, :] // 32) * 16 * Kp + rk[:, None] * 16 + rn[None, :] % 16
            b = tl.load(p_ptr + byte, mask=nmask[None, :] & (rk[:, None] < Kp), other=0).to(tl.int32)
            q = ((b >> ((rn[None, :] % 32) // 16 * 4)) & 15).to(tl.float32) - 8.0
            if GROUP % BK == 0:  # the chunk lies in one group: one row of scales and zeros (BN loads, not BK x BN)
                sidx = ((k0 // GROUP) * Np + rn) * 2
                s = tl.load(sz_ptr + sidx, mask=nmask, other=0.0).to(tl.float32)
                z = tl.load(sz_ptr + sidx + 1, mask=nmask, other=0.0).to(tl.float32)
                w = q * s[None, :] + z[None, :]
            else:
                sidx = ((rk[:, None] // GROUP) * Np + rn[None, :]) * 2
                s = tl.load(sz_ptr + sidx, mask=nmask[None, :] & (rk[:, None] < Kp), other=0.0).to(tl.float32)
                z = tl.load(sz_ptr + sidx + 1, mask=nmask[None, :] & (rk[:, None] < Kp), other=0.0).to(tl.float32)
                w = q * s + z
            if TF32:  # tensor cores (10-bit mantissa products, fp32 sums): prefill only, where the work is
                acc += tl.dot(x.to(tl.float32), w, input_precision="tf32")
            else:
                acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))

    _TRITON_KERNEL = (triton, int4_mm_kernel)
    return _TRITON_KERNEL


# (BM, BN, BK, num_warps, num_stages, tf32) by the rows M: decode (M <= 16) and prefill, the fastest fp32 configs of
# bench/triton_tune.py on an H200 (README "On a GPU"; prefill 1.4x, decode 1.1x the first (16, 32, 32) tiles, whose
# prefill was slower than dequantize-then-matmul). TF32 prefill was 2.5x faster again but put a micro engine's hidden
# states 7.5e-2 off the fp32 reference. A BK that does not divide the group size takes the per-element scale path.
TRITON_CONFIGS = {"decode": (16, 16, 32, 4, 3, False), "prefill": (64, 64, 32, 8, 3, False)}


def triton_int4_matmul(x, packed, sz, shape, group_size, config=None):
    """x (M, K) fp32/bf16 -> (M, N) fp32 with the Triton kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1).
    config: (BM, BN, BK, num_warps, num_stages, tf32), else TRITON_CONFIGS' for decode (M <= 16) or prefill."""
    triton, kern = _triton_kernel()
    N, K = shape
    Np, Kp = C.int4_padded_shape(shape, group_size)
    if Np * Kp // 2 >= 2 ** 31 or x.shape[0] * max(Kp, N) >= 2 ** 31:  # the kernel's offsets are 32-bit ints
        raise ValueError(f"triton_int4_matmul: a {N} x {K} matrix (or {x.shape[0]} rows of it) is past the kernel's "
                         f"32-bit offsets; split it")
    x = x.float().contiguous()
    M = x.shape[0]
    BM, BN, BK, warps, stages, tf32 = config or TRITON_CONFIGS["decode" if M <= 16 else "prefill"]
    y = torch.empty(M, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(M, BM), triton.cdiv(N, BN))
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # Triton launches on the current GPU
        kern[grid](x, packed, sz.view(-1), y, M, N, K, Np, x.stride(0), y.stride(0), GROUP=group_size, BM=BM, BN=BN,
                   BK=BK, TF32=tf32, num_warps=warps, num_stages=stages)
    return y


if __name__ == "__main__":  # python kernels.py: which int4 kernels this machine has (builds the native one)
    import argparse
    argparse.ArgumentParser(description="Builds int4_cpu.cpp if needed and says which kernels and loops this machine "
                                        "has; stream_infer.py --kernel auto picks from them.").parse_args()
    op = native_int4()
    if op is None:
        print("native: did not build (the warning above says why); --kernel auto uses int4pack")
    else:
        loops = [n for n, has in (("avx2", op.has_avx2), ("avx512", op.has_avx512), ("vnni", op.has_vnni),
                                  ("sdot", op.has_sdot)) if has()]
        print(f"native: built, integer loops {', '.join(loops) or 'none (portable fp32 loop only)'}, threads "
              f"{'OpenMP' if openmp_kernels() else 'ChunkPool'}")
    print(f"int4pack: {'torch has it' if cpu_int4pack_ok() else 'absent in this torch'}"
          + (", container layout repacked for it" if cpu_int4pack_ok() and not int4pack_same_layout() else ""))
    print(f"triton: {'CUDA ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device'}")
