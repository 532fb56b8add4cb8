"""int4_loops.h's ChunkPool: the threads its kernels run on where the compiler has no OpenMP (Apple clang on
macOS, where stream_infer builds without -fopenmp, and PICAFLOR_OPENMP=0 here). tests/int4_cpu_harness.cpp, built for this
machine without OpenMP, splits the int4 and int8 loops over 3 threads through the pool, repeats them from two callers
at once and after the workers fell asleep, and must equal the OpenMP extension's output bit for bit; a job that
throws on the calling thread leaves the pool usable; ThreadSanitizer finds no race; the whole extension built
without OpenMP decodes the same tokens; every script that runs the kernels sets OMP_WAIT_POLICY before torch loads."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import container as C  # noqa: E402
from harness_io import run_harness  # noqa: E402
import kernels  # noqa: E402
import stream_infer as S  # noqa: E402

THREADS = 3  # more threads than this machine's 2 cores: a worker preempted mid-call must still be waited for
# (M, N, K, G): N in 32-row blocks from 1 (one thread does it all) to 256; a group size the integer loop leaves
INT4_CASES = [(1, 8192, 2048, 64), (3, 40, 100, 32), (5, 96, 256, 128), (2, 32, 90, 30), (4, 2050, 512, 64)]
INT8_CASES = [(1, 16384, 512), (3, 70, 37), (2, 2, 64)]


def build_harness(out, name, flags):
    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "no C++ compiler: apt-get install g++"
    exe = str(out / name)
    # -Wno-maybe-uninitialized: gcc 12's own AVX-512 intrinsics headers trip it (gcc bug 105593)
    r = subprocess.run([cxx, *flags, "-std=c++17", "-march=native", "-pthread", "-Wall", "-Werror",
                        "-Wno-maybe-uninitialized", "-o", exe, os.path.join(ROOT, "tests", "int4_cpu_harness.cpp")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return exe


@pytest.fixture(scope="module")
def pool_harness(tmp_path_factory):
    out = tmp_path_factory.mktemp("pool")
    return build_harness(out, "harness", ["-O2"]), out


def run_pool(pool_harness, header, arrays, M, N):
    """The harness on one case with THREADS threads: (the pooled loop's y, what it printed: threads that ran a
    share of a lone caller's work, whether the job that threw on the caller did, threads of the calls after it)."""
    exe, out = pool_harness
    y, said, err = run_harness([exe], out, header, arrays, M, N, args=[str(THREADS)])
    assert "WARNING: ThreadSanitizer" not in err, err
    # a pool job runs on THREADS distinct threads, and still does after one threw on the caller (no longer busy)
    assert said["threw"] == "1" and said["pool_threads"] == said["pool_threads_after_throw"] == str(THREADS), said
    assert said.get("fork_child_ok", "1") == "1", said  # (the ThreadSanitizer build does not fork)
    return y[0], int(said["threads"])


def int4_case(M, N, K, G):
    gen = torch.Generator().manual_seed(M * 1000 + K)
    x, w = torch.randn(M, K, generator=gen), torch.randn(N, K, generator=gen)
    packed, sz = C.quantize_int4(w, G)
    return x, packed, sz


@pytest.mark.parametrize("M,N,K,G", INT4_CASES)
def test_pool_int4_equals_openmp_build(pool_harness, M, N, K, G):
    op = kernels.native_int4()
    assert op is not None, "the native extension did not build"
    x, packed, sz = int4_case(M, N, K, G)
    y, threads = run_pool(pool_harness, [4, M, N, K, G], [x, packed, sz.view(torch.int16)], M, N)
    assert torch.equal(y, op.int4_mm(x, packed, sz, N, G))
    blocks = (N + 31) // 32
    # who takes a share of the loop's chunks is up to the scheduler; with 256 blocks (~0.3 ms a call) a worker does
    assert threads == 1 if blocks == 1 else (threads >= 2 if blocks >= 256 else 1 <= threads <= THREADS)


@pytest.mark.parametrize("M,N,K", INT8_CASES)
def test_pool_int8_equals_openmp_build(pool_harness, M, N, K):
    op = kernels.native_int4()
    assert op is not None, "the native extension did not build"
    gen = torch.Generator().manual_seed(M * 1000 + K)
    x = torch.randn(M, K, generator=gen)
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=gen)
    scale = torch.rand(N, generator=gen) * 0.01
    y, threads = run_pool(pool_harness, [8, M, N, K, 0], [x, q, scale], M, N)
    assert torch.equal(y, op.int8_mm(x, q, scale))
    assert threads >= 2 if N >= 16384 else 1 <= threads <= min(N, THREADS)


def test_pool_under_thread_sanitizer(tmp_path):
    """The harness built with ThreadSanitizer (-fsanitize=thread): the pooled loops, two callers at once, sleeping
    and waking workers and the throwing job, with no data race reported."""
    exe = build_harness(tmp_path, "harness_tsan", ["-O1", "-g", "-fsanitize=thread"])
    M, N, K, G = 1, 2048, 512, 64
    x, packed, sz = int4_case(M, N, K, G)
    y, threads = run_pool((exe, tmp_path), [4, M, N, K, G], [x, packed, sz.view(torch.int16)], M, N)
    assert torch.equal(y, kernels.native_int4().int4_mm(x, packed, sz, N, G))


def test_pool_build_decodes_the_same_tokens(tmp_path):
    """The whole extension built as on macOS (PICAFLOR_OPENMP=0: no -fopenmp, kernels on ChunkPool; ~15 s to
    build), run by stream_infer on 3 threads, greedy-decodes the same tokens as this process's OpenMP build."""
    from model import ModelConfig, Picaflor, save_checkpoint
    torch.manual_seed(0)
    m = Picaflor(ModelConfig(vocab_size=300, n_layer=3, n_dense_layers=1, d_model=128, n_head=4, n_kv_head=2,
                             dense_ffn=256, n_experts=8, expert_ffn=128, n_shared=1, top_k=2, max_seq_len=64))
    path = str(tmp_path / "tiny.pcf4")
    C.write_container(save_checkpoint(m, str(tmp_path / "run"), 1), path, group_size=32, progress=False)
    prompt = list(range(5, 21))
    want = S.load(path, kernel="native").generate(prompt, 12)
    code = ("import sys, torch; sys.path.insert(0, sys.argv[1]); import stream_infer as S; torch.set_num_threads(3); "
            "eng = S.load(sys.argv[2], kernel='native'); print(eng.generate(list(range(5, 21)), 12)); "
            "print(next(l.split()[-1] for l in open('/proc/self/maps') if 'picaflor_int4_cpu' in l))")
    r = subprocess.run([sys.executable, "-c", code, ROOT, path], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PICAFLOR_OPENMP="0"))
    assert r.returncode == 0, r.stderr[-3000:]
    tokens, lib = r.stdout.strip().splitlines()[-2:]
    assert "_pool" in os.path.basename(lib), lib  # the pool build, not the OpenMP one
    assert tokens == str(want)


def test_every_script_sets_the_wait_policy_before_torch_loads():
    """libgomp / libomp read OMP_WAIT_POLICY once, when torch loads: each script that runs the int4 kernels must set
    it before then. On the pool (PICAFLOR_OPENMP=0, as on macOS) torch's OpenMP threads must sleep at once (PASSIVE),
    or they spin on the pool's cores; on OpenMP the kernels' own threads spin between GEMVs (ACTIVE)."""
    probe = ("import os, runpy, sys\n"
             "class Hook:  # says the policy at the moment torch is first imported, and ends there (seconds of import)\n"
             "    def find_spec(self, name, path=None, target=None):\n"
             "        if name == 'torch':\n"
             "            print('POLICY', [os.environ.get('OMP_WAIT_POLICY')], flush=True)\n"
             "            os._exit(0)\n"
             "sys.meta_path.insert(0, Hook())\n"
             "sys.argv = sys.argv[1:]\n"
             "try: runpy.run_path(sys.argv[0], run_name='__main__')\n"
             "except SystemExit: pass\n"
             "print('POLICY', [])\n")
    runs = {("stream_infer.py", "0"): "PASSIVE", ("stream_bench.py", "0"): "PASSIVE", ("eval.py", "0"): "PASSIVE",
            ("chat.py", "0"): "PASSIVE", ("stream_infer.py", "1"): "ACTIVE", ("stream_bench.py", "1"): "ACTIVE"}
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    procs = {}
    for (script, openmp), want in runs.items():
        # chat.py imports torch only once it loads a model: a missing container gets it that far
        args = ["missing.pcf4"] if script == "chat.py" else ["--help"]
        procs[(script, openmp)] = subprocess.Popen(
            [sys.executable, "-c", probe, script, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=dict(env, PICAFLOR_OPENMP=openmp))
    for key, p in procs.items():
        out, err = p.communicate(timeout=300)
        line = next((line for line in out.splitlines() if line.startswith("POLICY")), "")
        assert line == f"POLICY [{runs[key]!r}]", (key, out[-500:], err[-1500:])
