"""int4_loops.h (int4_cpu.cpp's loops) and expert_reader.cpp on AArch64 (Apple M-series, Graviton, Snapdragon laptops):
the NEON dot-product loops and the CRC32-instruction crc32, built by a cross compiler and run under qemu (Debian
g++-aarch64-linux-gnu and qemu-user; .ci/run installs them), against the x86 loops this machine runs (bit for bit:
the same integer sums and fused multiply-adds), the dequantize-then-matmul reference and zlib; and the whole
extension, torch ops included, compiled for AArch64 (syntax and types only: no AArch64 torch runs here)."""
import os
import platform
import shutil
import subprocess
import sys
import sysconfig

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import container as C  # noqa: E402
from harness_io import run_harness  # noqa: E402
import kernels  # noqa: E402

CXX, QEMU = "aarch64-linux-gnu-g++", "qemu-aarch64"
INSTALL = "apt-get install g++-aarch64-linux-gnu qemu-user (.ci/run does it)"
# (M, N, K, G): rows of x 1..9 (the loops take 4 at a time), N past a 32-row block, K past the last group, group sizes
# the integer loop takes (G % 4 == 0) and ones it leaves to the portable loop
INT4_CASES = [(1, 64, 64, 32), (3, 40, 100, 32), (5, 96, 256, 128), (9, 65, 130, 64), (2, 70, 200, 64),
              (4, 32, 96, 48), (1, 2048, 512, 64), (2, 32, 90, 30), (6, 31, 33, 32), (5, 33, 9, 12), (3, 40, 44, 4)]
# (M, N, K): K past the last 32-column block (the tail stays fp32), shorter than a block, several blocks
INT8_CASES = [(1, 300, 64), (3, 70, 37), (6, 129, 200), (2, 33, 20), (5, 50, 160)]


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """{"sdot": ARMv8.2 with dot products, "plain": ARMv8.0 without}: static binaries, run under qemu-aarch64."""
    for tool in (CXX, QEMU):
        assert shutil.which(tool), f"{tool} not found: {INSTALL}"
    out = tmp_path_factory.mktemp("arm")
    built = {}
    for name, march in (("sdot", "armv8.2-a+dotprod"), ("plain", "armv8-a")):
        exe = str(out / f"harness_{name}")
        r = subprocess.run([CXX, "-O2", "-std=c++17", f"-march={march}", "-static", "-Wall", "-Werror", "-o", exe,
                            os.path.join(ROOT, "tests", "int4_cpu_harness.cpp")], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        built[name] = exe
    return built, out


def run_case(harness, name, header, arrays, M, N):
    """The harness on one case: (its best loop's y, the portable loop's y, the loop it named)."""
    built, out = harness
    y, said, _ = run_harness([QEMU, built[name]], out, header, arrays, M, N)
    return y[0], y[1], said[f"int{header[0]} loop"]


def x86_native():
    """The x86 extension with its integer loops (AVX2), which the ARM loops must equal bit for bit; None on a host
    that is not x86 (then only the tolerances apply). An x86 host without them fails: the point would be lost."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    op = kernels.native_int4()
    assert op is not None and op.has_avx2(), "the x86 extension with AVX2 is the reference here (g++, an AVX2 CPU)"
    return op


@pytest.mark.parametrize("M,N,K,G", INT4_CASES)
def test_arm_int4_loops_equal_x86_and_reference(harness, M, N, K, G):
    gen = torch.Generator().manual_seed(M * 1000 + K)
    x, w = torch.randn(M, K, generator=gen), torch.randn(N, K, generator=gen)
    x[0, : min(K, G)] = 0.0  # an all-zero group of activations
    packed, sz = C.quantize_int4(w, G)
    arrays = [x, packed, sz.view(torch.int16)]
    ref = kernels.int4_matmul_reference(x, packed, sz, (N, K), G)
    best, generic, loop = run_case(harness, "sdot", [4, M, N, K, G], arrays, M, N)
    assert loop == ("sdot" if G % 4 == 0 else "fp32")
    # the portable loop multiplies fp32 activations: the reference up to summation order
    assert (generic - ref).abs().max() < 1e-5 * ref.abs().max()
    # the dot-product loop quantizes x to int8 per group as the x86 loops do: within int8 rounding of the reference
    assert (best - ref).norm() < 2e-2 * ref.norm()
    op = x86_native()
    if op is not None:
        x86 = op.int4_mm(x, packed, sz, N, G)
        if G % 4 == 0:
            assert torch.equal(best, x86), (best - x86).abs().max()
        else:  # both portable loops: same arithmetic, two compilers' vectorisations
            assert (best - x86).abs().max() < 1e-5 * ref.abs().max()
    plain_best, plain_generic, loop = run_case(harness, "plain", [4, M, N, K, G], arrays, M, N)
    assert loop == "fp32" and torch.equal(plain_best, plain_generic)  # no dot products: the portable loop
    assert (plain_generic - ref).abs().max() < 1e-5 * ref.abs().max()


@pytest.mark.parametrize("M,N,K", INT8_CASES)
def test_arm_int8_loops_equal_x86_and_reference(harness, M, N, K):
    gen = torch.Generator().manual_seed(M * 1000 + K)
    x = torch.randn(M, K, generator=gen)
    x[0, :32] = 0.0  # an all-zero block of activations
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=gen)
    scale = torch.rand(N, generator=gen) * 0.01
    ref = (x @ q.float().t()) * scale
    best, generic, loop = run_case(harness, "sdot", [8, M, N, K, 0], [x, q, scale], M, N)
    assert loop == "sdot"
    assert (generic - ref).abs().max() < 1e-5 * ref.abs().max()
    assert (best - ref).norm() < 2e-2 * ref.norm()
    op = x86_native()
    if op is not None:
        assert torch.equal(best, op.int8_mm(x, q, scale)), (best - op.int8_mm(x, q, scale)).abs().max()
    plain_best, plain_generic, loop = run_case(harness, "plain", [8, M, N, K, 0], [x, q, scale], M, N)
    assert loop == "fp32" and torch.equal(plain_best, plain_generic)


def test_arm_crc32_equals_zlib(harness):
    """expert_reader.cpp's crc32 (each blob's check after its read): AArch64's CRC32 instructions (the ARMv8.2 build)
    and the slicing-by-8 table (ARMv8.0 without them), in one call and in two, against zlib."""
    import zlib
    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()  # a micro expert's size
    lengths = [0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 255, 256, 257, 4099, len(data)]
    want = [zlib.crc32(data[:n]) for n in lengths for _ in range(2)]
    built, out = harness
    inp, res = out / "crc_in.bin", out / "crc_out.bin"
    with open(inp, "wb") as f:
        f.write(np.asarray([32, len(lengths), 0, len(data), 0] + lengths, dtype=np.int64).tobytes() + data)
    for name, path in (("sdot", "instructions"), ("plain", "table")):
        r = subprocess.run([QEMU, built[name], str(inp), str(res)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.split()[-1] == path, r.stdout + r.stderr
        assert np.fromfile(res, dtype=np.uint32).tolist() == want


def test_extension_compiles_for_aarch64():
    """The torch ops around the loops (int4_cpu.cpp, with expert_reader.cpp, which it includes), as stream_infer
    builds them on an ARM machine, compile for AArch64: syntax and types against this torch's headers. With dot
    products only: without them the ops differ in has_sdot's return alone, and the harness above builds int4_loops.h
    and expert_reader.cpp both ways (a second parse of torch's headers cost ~25 s of CI)."""
    assert shutil.which(CXX), f"{CXX} not found: {INSTALL}"
    from torch.utils import cpp_extension
    inc = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    jobs = {(src, march): subprocess.Popen([CXX, "-fsyntax-only", "-std=c++20", f"-march={march}", "-fopenmp", "-Wall",
                                            *inc, os.path.join(ROOT, src)], stderr=subprocess.PIPE, text=True)
            for src, march in (("int4_cpu.cpp", "armv8.2-a+dotprod"),)}
    for (src, march), job in jobs.items():
        err = job.communicate(timeout=300)[1]
        assert job.returncode == 0 and " warning: " not in err, f"{src} ({march}): {err[-3000:]}"
