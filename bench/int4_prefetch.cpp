// bench/int4_prefetch.py's timing loop: int4_loops.h's VNNI int4 GEMV (block_q8_vnni, stream_infer's default on
// AVX-512 VNNI CPUs) with its L2 prefetch at several distances, 0 (the L1 prefetch alone) among them, and a plain
// read of the same bytes, interleaved round by round in one process over a cold set of matrices (so every variant
// sees the same minutes of a noisy VM).
//   int4_prefetch N K ROUNDS MB_OF_MATRICES
// prints one line per variant: name, median, min and max GB/s of int4 weights (packed bytes + bf16 scales)
#include "../int4_loops.h"

#include <sys/mman.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(_OPENMP)
using Block = void (*)(const int8_t*, int64_t, const float*, const float*, const uint8_t*, const uint16_t*, int64_t,
                       int64_t, int, int, float*);

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: int4_prefetch N K ROUNDS MB_OF_MATRICES\n");
    return 2;
  }
  const int64_t N = std::atoll(argv[1]), K = std::atoll(argv[2]), G = 64, n_groups = K / G, blocks = N / ROWS;
  const int rounds = std::atoi(argv[3]);
  const int64_t per = N * K / 2 + n_groups * N * 4, n_mat = std::max<int64_t>(1, std::atoll(argv[4]) * 1000000 / per);
  const size_t total = size_t(per * n_mat);
  auto* mem = static_cast<uint8_t*>(mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (mem == MAP_FAILED) return 1;
  madvise(mem, total, MADV_HUGEPAGE);  // the weights are in huge pages in stream_infer too
  std::mt19937 rng(1);
  for (size_t i = 0; i + 4 <= total; i += 4) {
    const uint32_t v = rng();
    std::memcpy(mem + i, &v, 4);
  }
  for (int64_t m = 0; m < n_mat; m++) {  // scales 1.0 (bf16), zeros 1.0: finite sums
    auto* sz = reinterpret_cast<uint16_t*>(mem + m * per + N * K / 2);
    for (int64_t i = 0; i < n_groups * N * 2; i++) sz[i] = 0x3F80;
  }
  std::vector<int8_t> xq(K);
  for (auto& v : xq) v = int8_t(int(rng() % 255) - 127);
  std::vector<float> dx(n_groups, 0.01f), sq(n_groups, 1.0f), y(N * n_mat);
  struct Variant { const char* name; Block fn; };
  const Variant variants[] = {{"L1 1 KB only", block_q8_vnni<1, 0>}, {"+ L2 4 KB", block_q8_vnni<1, 4096>},
                              {"+ L2 8 KB", block_q8_vnni<1, 8192>}, {"+ L2 16 KB", block_q8_vnni<1, 16384>}};
  const int n_var = sizeof(variants) / sizeof(variants[0]);
  std::vector<std::vector<double>> gbs(n_var + 1);
  volatile uint64_t sink = 0;
  for (int r = 0; r < rounds; r++) {
    for (int v = 0; v <= n_var; v++) {
      const auto t0 = std::chrono::steady_clock::now();
      if (v == n_var) {  // a plain read of the same bytes, 64 at a time
        uint64_t acc = 0;
#pragma omp parallel for num_threads(2) reduction(^ : acc) schedule(static)
        for (int64_t i = 0; i < int64_t(total / 64); i++)
          acc ^= uint64_t(_mm_cvtsi128_si64(_mm512_castsi512_si128(_mm512_loadu_si512(mem + i * 64))));
        sink = sink ^ acc;
      } else {
        for (int64_t m = 0; m < n_mat; m++) {
          const uint8_t* packed = mem + m * per;
          const auto* sz = reinterpret_cast<const uint16_t*>(packed + N * K / 2);
#pragma omp parallel for num_threads(2) schedule(static)
          for (int64_t b = 0; b < blocks; b++)
            variants[v].fn(xq.data(), K, dx.data(), sq.data(), packed + b * K * 16, sz, N, b, int(G), int(n_groups),
                           y.data() + m * N + b * ROWS);
        }
      }
      gbs[v].push_back(double(total) / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 1e9);
    }
  }
  for (int v = 0; v <= n_var; v++) {
    std::sort(gbs[v].begin(), gbs[v].end());
    std::printf("%s\t%.2f\t%.2f\t%.2f\n", v == n_var ? "plain read" : variants[v].name, gbs[v][gbs[v].size() / 2],
                gbs[v].front(), gbs[v].back());
  }
  return 0;
}
#else
int main() {
  std::fprintf(stderr, "int4_prefetch: needs AVX-512 VNNI + VBMI and OpenMP (the loop it times)\n");
  return 3;
}
#endif
