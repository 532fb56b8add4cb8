// int4_loops.h's kernels and expert_reader.cpp's crc32 without torch, for tests/test_arm_kernels.py: built by a
// cross compiler for AArch64 and run under qemu, so the NEON loops and the CRC32 instructions, which no x86 machine
// runs, are checked against the x86 loops bit for bit and against zlib.
// Also, built for this machine, ChunkPool (parallel_chunks without OpenMP, as on macOS): THREADS > 1 splits the
// best loop's blocks or rows over that many threads, repeats it (two callers at once, and after the workers fell
// asleep; exit 3 if a result differs) and prints how many threads really ran a share of a lone caller's work (as
// they were scheduled) and how many a pool job runs on, before and after a job that threw on the calling thread, and
// whether a forked child's pool works.
//   int4_cpu_harness IN OUT [THREADS]
// IN: int64 kind (4, 8 or 32), M, N, K, G; kind 4: x fp32 [M, K], packed uint8 [Np * Kp / 2], sz bf16 bits
// [Kp / G, Np, 2] (container.py's int4 layout); kind 8: x fp32 [M, K], q int8 [N, K], scale fp32 [N]. OUT: y fp32
// [M, N] from the best loop this build has, then y from the portable loop. Prints which loop was the best one.
// Kind 32: M lengths (int64) then K bytes; OUT: per length L, uint32 crc32 of the first L bytes in one call, then
// in two (the first L / 3 bytes, then the rest).
#include "../int4_loops.h"
#define PICAFLOR_NO_TORCH  // expert_reader.cpp's crc32 without its torch ops
#include "../expert_reader.cpp"

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>

#include <sys/wait.h>
#include <unistd.h>

template <class T>
std::vector<T> read_n(FILE* f, int64_t n) {
  std::vector<T> v(n);
  if (n && std::fread(v.data(), sizeof(T), n, f) != size_t(n)) {
    std::fprintf(stderr, "int4_cpu_harness: input too short\n");
    std::exit(2);
  }
  return v;
}

int main(int argc, char** argv) {
  if (argc != 3 && argc != 4) {
    std::fprintf(stderr, "usage: int4_cpu_harness IN OUT [THREADS]\n");
    return 2;
  }
  const int threads = argc == 4 ? std::atoi(argv[3]) : 1;
  std::mutex seen_lock;
  std::set<std::thread::id> seen;  // the threads that ran a share of the best loop (one caller at a time)
  std::atomic<bool> counting{true};
  auto note = [&] {
    std::lock_guard<std::mutex> lock(seen_lock);
    if (counting) seen.insert(std::this_thread::get_id());
  };
  FILE* in = std::fopen(argv[1], "rb");
  if (!in) {
    std::perror(argv[1]);
    return 2;
  }
  const std::vector<int64_t> h = read_n<int64_t>(in, 5);
  const int64_t kind = h[0], M = h[1], N = h[2], K = h[3], G = h[4];
  if (kind == 32) {
    const std::vector<int64_t> lengths = read_n<int64_t>(in, M);
    const std::vector<uint8_t> bytes = read_n<uint8_t>(in, K);
    std::vector<uint32_t> crcs;
    for (int64_t L : lengths) {
      crcs.push_back(crc32_zlib(0, bytes.data(), L));
      crcs.push_back(crc32_zlib(crc32_zlib(0, bytes.data(), L / 3), bytes.data() + L / 3, L - L / 3));
    }
    FILE* out = std::fopen(argv[2], "wb");
    if (!out || std::fwrite(crcs.data(), 4, crcs.size(), out) != crcs.size() || std::fclose(out) != 0) return 2;
#if defined(__PCLMUL__) || defined(__ARM_FEATURE_CRC32)
    std::printf("crc32 path instructions\n");
#else
    std::printf("crc32 path table\n");
#endif
    return 0;
  }
  const std::vector<float> x = read_n<float>(in, M * K);
  std::vector<float> best(M * N), generic(M * N);
  std::function<void(float*)> run_best;  // the best loop over every block (int4) or row (int8), `threads` threads
  if (kind == 4) {
    const int64_t n_groups = (K + G - 1) / G, Kp = n_groups * G, Np = (N + ROWS - 1) / ROWS * ROWS;
    const std::vector<uint8_t> packed = read_n<uint8_t>(in, Np * Kp / 2);
    const std::vector<uint16_t> sz = read_n<uint16_t>(in, n_groups * Np * 2);
    const int loops[2] = {int4_loop(BEST, G), int4_loop(GENERIC, G)};
    Int4X X[2];
    for (int i = 0; i < 2; i++) int4_prepare_x(x.data(), M, K, G, loops[i] != LOOP_FP32, X[i]);
    int4_blocks(loops[1], X[1], x.data(), packed.data(), sz.data(), M, N, K, G, 0, Np / ROWS, generic.data());
    run_best = [&, packed, sz, Np, loop = loops[0], X = X[0]](float* y) {  // copies: the block's locals end
      parallel_chunks(threads, Np / ROWS, [&](int64_t b0, int64_t b1) {
        note();
        int4_blocks(loop, X, x.data(), packed.data(), sz.data(), M, N, K, G, b0, b1, y);
      });
    };
    std::printf("int4 loop %s\n", loops[0] == LOOP_Q8_SDOT ? "sdot" : loops[0] == LOOP_FP32 ? "fp32" : "x86");
  } else {
    const std::vector<int8_t> q = read_n<int8_t>(in, N * K);
    const std::vector<float> scale = read_n<float>(in, N);
    const int loops[2] = {int8_loop(BEST), int8_loop(GENERIC)};
    Int8X X[2];
    for (int i = 0; i < 2; i++)
      if (loops[i] != LOOP8_FP32) int8_prepare_x(x.data(), M, K, X[i]);
    int8_rows_range(loops[1], X[1], x.data(), M, K, q.data(), scale.data(), 0, N, N, generic.data());
    run_best = [&, q, scale, loop = loops[0], X = X[0]](float* y) {
      parallel_chunks(threads, N, [&](int64_t n0, int64_t n1) {
        note();
        int8_rows_range(loop, X, x.data(), M, K, q.data(), scale.data(), n0, n1, N, y);
      });
    };
    std::printf("int8 loop %s\n", loops[0] == LOOP8_SDOT ? "sdot" : loops[0] == LOOP8_FP32 ? "fp32" : "x86");
  }
  run_best(best.data());
  if (threads > 1) {  // the pool again and again: from two callers at once, and after its workers fell asleep
    for (int round = 1; round <= 24; round++) {
      std::vector<float> y1(M * N), y2(M * N);
      if (round % 2) {
        counting = false;  // the second caller runs on its own thread, not the pool's
        std::thread other([&] { run_best(y2.data()); });
        run_best(y1.data());
        other.join();
        counting = true;
      } else {
        run_best(y1.data());
        y2 = y1;
      }
      if (y1 != best || y2 != best) {
        std::fprintf(stderr, "int4_cpu_harness: round %d differs from the first\n", round);
        return 3;
      }
      if (round % 3 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  std::printf("threads %zu\n", seen.size());
  if (threads > 1) {
    // how many distinct threads a pool job runs on (its contract: fn(t) once for every t, each on its own thread)
    auto pool_threads = [&] {
      std::vector<std::thread::id> ids(threads);
      const bool ran = chunk_pool().run(threads, [&](int t) { ids[t] = std::this_thread::get_id(); });
      return ran ? std::set<std::thread::id>(ids.begin(), ids.end()).size() : size_t(0);
    };
    std::printf("pool_threads %zu\n", pool_threads());
    // a job that throws on the calling thread: the pool waits for its workers, and stays usable
    bool threw = false;
    try {
      chunk_pool().run(threads, [](int t) {
        if (t == 0) throw std::runtime_error("the caller's share failed");
      });
    } catch (const std::runtime_error&) {
      threw = true;
    }
    for (int round = 0; round < 8; round++) {
      std::vector<float> y(M * N);
      run_best(y.data());
      if (y != best) {
        std::fprintf(stderr, "int4_cpu_harness: a call after the throw differs\n");
        return 3;
      }
    }
    std::printf("threw %d\npool_threads_after_throw %zu\n", int(threw), pool_threads());
#ifndef __SANITIZE_THREAD__  // (ThreadSanitizer does not support threads started after a multi-threaded fork)
    // a forked child has none of the pool's workers: it must make its own (a hang here is the failure)
    const pid_t child = fork();
    if (child == 0) {
      std::vector<float> y(M * N);
      run_best(y.data());
      _exit(y == best && pool_threads() == size_t(threads) ? 0 : 4);
    }
    int status = 0;
    const bool child_ok = child > 0 && waitpid(child, &status, 0) == child && WIFEXITED(status) &&
                          WEXITSTATUS(status) == 0;
    std::printf("fork_child_ok %d\n", int(child_ok));
#endif
  }
  std::fclose(in);
  FILE* out = std::fopen(argv[2], "wb");
  if (!out || std::fwrite(best.data(), 4, best.size(), out) != best.size() ||
      std::fwrite(generic.data(), 4, generic.size(), out) != generic.size() || std::fclose(out) != 0) {
    std::perror(argv[2]);
    return 2;
  }
  return 0;
}
