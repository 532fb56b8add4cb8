// int4_cpu.cpp: stream_infer's CPU int4 matmul, y = x @ W^T with W read straight from the container's bytes.
// Built on first use by stream_infer.native_int4() (torch.utils.cpp_extension, -O3 -march=native, or -mcpu=native
// on ARM, cached). With PICAFLOR_NO_TORCH defined it is the loops alone, without torch (tests/int4_cpu_harness.cpp).
//
// Why not torch's _weight_int4pack_mm_for_cpu: it dequantizes to bf16 and streamed ~3 GB/s of int4 weights per
// thread here, while decode is a memory-bound GEMV: the kernel has to keep up with DRAM, not with the ALUs.
//
// Layout (container.py, "int4"): output rows in blocks of 32; per block, per input column k, 16 bytes whose
// byte j holds row j in its low nibble and row j + 16 in its high nibble. sz is bf16 [Kp/G, Np, 2] =
// (scale, zero) per (group of G input columns, row): w = (q - 8) * scale + zero. Per group,
//     sum_k w[r,k] x[k] = scale[r] * (sum_k q[r,k] x[k] - 8 sx) + zero[r] * sx,   sx = sum_k x[k],
// so the inner loop only needs the raw nibbles q, and each group ends with one fix-up per row.
// Two inner loops:
// - AVX2 (x86 with AVX2 and G % 4 == 0): integer dot products, as llama.cpp's Q4_0 x Q8_0 ones; x is quantized
//   per (row, group) to int8 first (Q8_0-style, the same rounding llama.cpp applies to activations). Where the
//   compiler targets AVX-512BW and G % 8 == 0 the same integer arithmetic runs 512 bits wide (block_q8_512), and
//   with AVX-512 VNNI + VBMI (Ice Lake, Sapphire Rapids, Zen 4) as vpermb + vpdpbusd (block_q8_vnni). On AArch64
//   with dot products (ARMv8.2+: Apple M1 on) the same sums come from zips + sdot (block_q8_sdot), bit for bit.
// - portable fp32 (every other CPU, and the exact check the tests compare against).
// Each thread owns whole 32-row blocks; rows of x go 4 at a time so a block's bytes are decoded once per 4 rows
// and stay in L1/L2 for the next 4.

#ifndef PICAFLOR_NO_TORCH  // tests/int4_cpu_harness.cpp: the kernels alone, without torch
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#endif

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>
#ifndef _OPENMP
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#endif

#ifdef __AVX2__
#include <immintrin.h>
#endif
#if defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#include <arm_neon.h>
#endif

namespace {

constexpr int ROWS = 32;  // rows per packed block
constexpr int MB_MAX = 4;  // rows of x per pass over a block
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 1024
#endif

// The kernels take the rows of x per pass (1..MB_MAX) as a template argument: f(std::integral_constant<int, mb>).
template <class F>
inline void with_rows(int64_t mb, F&& f) {
  if (mb == 1) f(std::integral_constant<int, 1>{});
  else if (mb == 2) f(std::integral_constant<int, 2>{});
  else if (mb == 3) f(std::integral_constant<int, 3>{});
  else f(std::integral_constant<int, 4>{});
}

inline float bf16_to_f32(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Portable path (any CPU the compiler targets; also what the AVX2 path is tested against).
template <int MB>
void block_generic(const float* x, int64_t ldx, const float* sx, const uint8_t* blk, const uint16_t* sz,
                   int64_t Np, int64_t b, int64_t K, int G, int n_groups, float* out /* [MB][32] */) {
  float total[MB][ROWS] = {};
  for (int g = 0; g < n_groups; g++) {
    float acc[MB][ROWS] = {};
    const int64_t k0 = int64_t(g) * G, k1 = std::min<int64_t>(k0 + G, K);
    for (int64_t k = k0; k < k1; k++) {
      const uint8_t* p = blk + k * 16;
      for (int m = 0; m < MB; m++) {
        const float xv = x[m * ldx + k];
        for (int j = 0; j < 16; j++) {
          acc[m][j] += float(p[j] & 15) * xv;
          acc[m][j + 16] += float(p[j] >> 4) * xv;
        }
      }
    }
    const uint16_t* s = sz + (int64_t(g) * Np + b * ROWS) * 2;
    for (int m = 0; m < MB; m++) {
      const float sxg = sx[m * n_groups + g];
      for (int r = 0; r < ROWS; r++)
        total[m][r] += bf16_to_f32(s[2 * r]) * (acc[m][r] - 8.0f * sxg) + bf16_to_f32(s[2 * r + 1]) * sxg;
    }
  }
  std::memcpy(out, total, sizeof(total));
}

#ifdef __AVX2__
// Shared by the integer loops (block_q8, block_q8_512), which differ only in how they sum a group's q x xq.
// (scale, zero) of group g + 2: 128 bytes every Np * 4 bytes, a stride the HW prefetcher does not follow across
// pages (+5-10% on 2 threads in an interleaved A/B of cold GEMVs here)
inline void prefetch_group_scales(const uint16_t* sz, int64_t Np, int64_t b, int g, int n_groups) {
  if (g + 2 < n_groups) {
    const char* sn = reinterpret_cast<const char*>(sz + (int64_t(g + 2) * Np + b * ROWS) * 2);
    _mm_prefetch(sn, _MM_HINT_T0);
    _mm_prefetch(sn + 64, _MM_HINT_T0);
  }
}

// A group's end: total += dx * (scale * (isum - 8 sq) + zero * sq) per row, from its int32 sums acc32 (rows 8i..8i+7
// in acc32[m][i]). (scale, zero) of 8 consecutive rows = 8 little-endian uint32: scale low half, zero high half.
template <int MB>
inline void fix_up_group(const __m256i (&acc32)[MB][4], const uint16_t* sz, int64_t Np, int64_t b, int g,
                         int n_groups, const float* dx, const float* sq, __m256 (&total)[MB][4]) {
  const __m256i hi16 = _mm256_set1_epi32(int(0xFFFF0000u));
  const uint16_t* s = sz + (int64_t(g) * Np + b * ROWS) * 2;
  __m256 scale[4], zero[4];
  for (int i = 0; i < 4; i++) {
    const __m256i pair = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 16 * i));
    scale[i] = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
    zero[i] = _mm256_castsi256_ps(_mm256_and_si256(pair, hi16));
  }
  for (int m = 0; m < MB; m++) {
    const float d = dx[m * n_groups + g], c = sq[m * n_groups + g] * d;
    const __m256 dv = _mm256_set1_ps(d), cv = _mm256_set1_ps(c), m8c = _mm256_set1_ps(-8.0f * c);
    for (int i = 0; i < 4; i++) {
      const __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc32[m][i]), dv, m8c);
      total[m][i] = _mm256_fmadd_ps(zero[i], cv, _mm256_fmadd_ps(scale[i], t, total[m][i]));
    }
  }
}

// The AVX2 path multiplies integers, as llama.cpp's Q4_0 x Q8_0 dot products do: x is quantized per (row, group)
// to int8 (xq = round(x / dx), dx = max|x| / 127), and each group's sum_k q[r,k] xq[k] comes from maddubs
// (u8 x s8 -> pairwise int16 sums): ~6 instructions per 32 weights instead of ~17 for the fp32 path.
// Pairing: lanes hold columns (k, k+2) and (k+1, k+3); unpacking them byte by byte puts q[r,k] next to q[r,k+1].
template <int MB>
void block_q8(const int8_t* xq, int64_t ldq, const float* dx, const float* sq, const uint8_t* blk,
              const uint16_t* sz, int64_t Np, int64_t b, int G, int n_groups, float* out) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  // x bytes (k, k+1, k+2, k+3) broadcast -> lane 0: (k, k+1) x 8, lane 1: (k+2, k+3) x 8
  const __m256i pair_idx = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                            2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
  __m256 total[MB][4];
  for (int m = 0; m < MB; m++)
    for (int i = 0; i < 4; i++) total[m][i] = _mm256_setzero_ps();
  for (int g = 0; g < n_groups; g++) {
    __m256i acc32[MB][4];
    for (int m = 0; m < MB; m++)
      for (int i = 0; i < 4; i++) acc32[m][i] = _mm256_setzero_si256();
    const int64_t g0 = int64_t(g) * G, g1 = g0 + G;
    prefetch_group_scales(sz, Np, b, g, n_groups);
    for (int64_t k0 = g0; k0 < g1; k0 += 32) {  // int16 sums: 8 steps of <= 2*15*127 each stay below 32767
      __m256i acc16[MB][4];
      for (int m = 0; m < MB; m++)
        for (int i = 0; i < 4; i++) acc16[m][i] = _mm256_setzero_si256();
      const int64_t k1 = std::min<int64_t>(k0 + 32, g1);
      for (int64_t k = k0; k < k1; k += 4) {
        const uint8_t* p = blk + k * 16;
        _mm_prefetch(reinterpret_cast<const char*>(p) + PREFETCH_BYTES, _MM_HINT_T0);
        const __m256i A = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(p + 32), reinterpret_cast<const __m128i*>(p));
        const __m256i B = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(p + 48), reinterpret_cast<const __m128i*>(p + 16));
        const __m256i Alo = _mm256_and_si256(A, low4), Ahi = _mm256_and_si256(_mm256_srli_epi16(A, 4), low4);
        const __m256i Blo = _mm256_and_si256(B, low4), Bhi = _mm256_and_si256(_mm256_srli_epi16(B, 4), low4);
        const __m256i w[4] = {_mm256_unpacklo_epi8(Alo, Blo), _mm256_unpackhi_epi8(Alo, Blo),   // rows 0-7, 8-15
                              _mm256_unpacklo_epi8(Ahi, Bhi), _mm256_unpackhi_epi8(Ahi, Bhi)};  // rows 16-23, 24-31
        for (int m = 0; m < MB; m++) {
          int32_t x4;
          std::memcpy(&x4, xq + m * ldq + k, 4);
          const __m256i xv = _mm256_shuffle_epi8(_mm256_set1_epi32(x4), pair_idx);
          for (int i = 0; i < 4; i++) acc16[m][i] = _mm256_add_epi16(acc16[m][i], _mm256_maddubs_epi16(w[i], xv));
        }
      }
      for (int m = 0; m < MB; m++)  // lane 0 (columns k, k+1) + lane 1 (k+2, k+3) of the same 8 rows, as int32
        for (int i = 0; i < 4; i++)
          acc32[m][i] = _mm256_add_epi32(acc32[m][i],
                                         _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc16[m][i])),
                                                          _mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc16[m][i], 1))));
    }
    fix_up_group<MB>(acc32, sz, Np, b, g, n_groups, dx, sq, total);
  }
  for (int m = 0; m < MB; m++)
    for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + m * ROWS + 8 * i, total[m][i]);
}
#endif

#ifdef __AVX512BW__
// AVX-512BW: the AVX2 kernel's arithmetic on 8 columns x 32 rows per step (128 bytes), each 128-bit lane pairing
// columns as block_q8 does: int32 sums identical to block_q8's, so the results are bit for bit the same. 2-thread
// GEMVs 14.7 -> 16.3 GB/s cold, 19.5 -> 27.5 hot, on a Sapphire Rapids VM (bench/int4_gemv.py).
template <int MB>
void block_q8_512(const int8_t* xq, int64_t ldq, const float* dx, const float* sq, const uint8_t* blk,
                  const uint16_t* sz, int64_t Np, int64_t b, int G, int n_groups, float* out) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  // x bytes (k .. k+7) broadcast -> 128-bit lane l: (k+2l, k+2l+1) x 8
  const __m512i pair_idx = _mm512_set_epi64(0x0706070607060706, 0x0706070607060706, 0x0504050405040504,
                                            0x0504050405040504, 0x0302030203020302, 0x0302030203020302,
                                            0x0100010001000100, 0x0100010001000100);
  __m256 total[MB][4];
  for (int m = 0; m < MB; m++) for (int i = 0; i < 4; i++) total[m][i] = _mm256_setzero_ps();
  for (int g = 0; g < n_groups; g++) {
    __m256i acc32[MB][4];
    for (int m = 0; m < MB; m++) for (int i = 0; i < 4; i++) acc32[m][i] = _mm256_setzero_si256();
    const int64_t g0 = int64_t(g) * G, g1 = g0 + G;
    prefetch_group_scales(sz, Np, b, g, n_groups);
    for (int64_t k0 = g0; k0 < g1; k0 += 32) {
      __m512i acc16[MB][4];
      for (int m = 0; m < MB; m++) for (int i = 0; i < 4; i++) acc16[m][i] = _mm512_setzero_si512();
      const int64_t k1 = std::min<int64_t>(k0 + 32, g1);
      for (int64_t k = k0; k < k1; k += 8) {
        const uint8_t* p = blk + k * 16;
        _mm_prefetch(reinterpret_cast<const char*>(p) + PREFETCH_BYTES, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(p) + PREFETCH_BYTES + 64, _MM_HINT_T0);
        const __m512i C0 = _mm512_loadu_si512(p), C1 = _mm512_loadu_si512(p + 64);
        const __m512i A = _mm512_shuffle_i64x2(C0, C1, 0x88), B = _mm512_shuffle_i64x2(C0, C1, 0xDD);
        const __m512i Alo = _mm512_and_si512(A, low4), Ahi = _mm512_and_si512(_mm512_srli_epi16(A, 4), low4);
        const __m512i Blo = _mm512_and_si512(B, low4), Bhi = _mm512_and_si512(_mm512_srli_epi16(B, 4), low4);
        const __m512i w[4] = {_mm512_unpacklo_epi8(Alo, Blo), _mm512_unpackhi_epi8(Alo, Blo),
                              _mm512_unpacklo_epi8(Ahi, Bhi), _mm512_unpackhi_epi8(Ahi, Bhi)};
        for (int m = 0; m < MB; m++) {
          int64_t x8;
          std::memcpy(&x8, xq + m * ldq + k, 8);
          const __m512i xv = _mm512_shuffle_epi8(_mm512_set1_epi64(x8), pair_idx);
          for (int i = 0; i < 4; i++) acc16[m][i] = _mm512_add_epi16(acc16[m][i], _mm512_maddubs_epi16(w[i], xv));
        }
      }
      for (int m = 0; m < MB; m++)
        for (int i = 0; i < 4; i++) {
          const __m512i lo = _mm512_cvtepi16_epi32(_mm512_castsi512_si256(acc16[m][i]));
          const __m512i hi = _mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(acc16[m][i], 1));
          const __m512i s = _mm512_add_epi32(lo, hi);
          acc32[m][i] = _mm256_add_epi32(acc32[m][i], _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1)));
        }
    }
    fix_up_group<MB>(acc32, sz, Np, b, g, n_groups, dx, sq, total);
  }
  for (int m = 0; m < MB; m++) for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + m * ROWS + 8 * i, total[m][i]);
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
// AVX-512 VNNI + VBMI: one vpermb puts 4 columns of a row side by side in each 32-bit lane (16 rows a register),
// and vpdpbusd sums those 4 nibble x int8 products straight into int32: ~8 instructions per 64 bytes against ~12
// for block_q8_512, and no int16 stage. Integer sums, so bit for bit block_q8's result.
template <int MB>
void block_q8_vnni(const int8_t* xq, int64_t ldq, const float* dx, const float* sq, const uint8_t* blk,
                   const uint16_t* sz, int64_t Np, int64_t b, int G, int n_groups, float* out) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  // 64 bytes = columns k..k+3 x 16 bytes (row j low nibble, row j + 16 high); byte 4r + c of the result is
  // source byte 16c + r: row r's 4 columns in lane r
  alignas(64) int8_t idx_bytes[64];
  for (int r = 0; r < 16; r++)
    for (int c = 0; c < 4; c++) idx_bytes[4 * r + c] = int8_t(16 * c + r);
  const __m512i to_rows = _mm512_load_si512(idx_bytes);
  __m256 total[MB][4];
  for (int m = 0; m < MB; m++) for (int i = 0; i < 4; i++) total[m][i] = _mm256_setzero_ps();
  for (int g = 0; g < n_groups; g++) {
    __m512i lo[MB], hi[MB];  // int32 sums of rows 0-15 and 16-31
    for (int m = 0; m < MB; m++) lo[m] = hi[m] = _mm512_setzero_si512();
    const int64_t g0 = int64_t(g) * G, g1 = g0 + G;
    prefetch_group_scales(sz, Np, b, g, n_groups);
    for (int64_t k = g0; k < g1; k += 4) {
      const uint8_t* p = blk + k * 16;
      _mm_prefetch(reinterpret_cast<const char*>(p) + PREFETCH_BYTES, _MM_HINT_T0);
      const __m512i P = _mm512_permutexvar_epi8(to_rows, _mm512_loadu_si512(p));
      const __m512i Wlo = _mm512_and_si512(P, low4), Whi = _mm512_and_si512(_mm512_srli_epi16(P, 4), low4);
      for (int m = 0; m < MB; m++) {
        int32_t x4;
        std::memcpy(&x4, xq + m * ldq + k, 4);
        const __m512i xv = _mm512_set1_epi32(x4);
        lo[m] = _mm512_dpbusd_epi32(lo[m], Wlo, xv);
        hi[m] = _mm512_dpbusd_epi32(hi[m], Whi, xv);
      }
    }
    __m256i acc32[MB][4];
    for (int m = 0; m < MB; m++) {
      acc32[m][0] = _mm512_castsi512_si256(lo[m]);
      acc32[m][1] = _mm512_extracti64x4_epi64(lo[m], 1);
      acc32[m][2] = _mm512_castsi512_si256(hi[m]);
      acc32[m][3] = _mm512_extracti64x4_epi64(hi[m], 1);
    }
    fix_up_group<MB>(acc32, sz, Np, b, g, n_groups, dx, sq, total);
  }
  for (int m = 0; m < MB; m++) for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + m * ROWS + 8 * i, total[m][i]);
}
#endif

#if defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
// AArch64 with the dot-product instructions (ARMv8.2+: Apple M1 on, Graviton 2 on, Cortex-A76 on): block_q8's
// integer arithmetic. Zips put 4 columns of a row side by side in each 32-bit lane (T[j]: rows 4j..4j+3 in the low
// nibbles, rows 16+4j.. in the high ones), sdot sums those 4 nibble x int8 products into int32, and the fix-up is
// fix_up_group's fused multiply-adds in its order: bit for bit the x86 loops' result (tests/test_arm_kernels.py
// runs it under qemu against them). ~28 instructions per 64 bytes; not yet timed on ARM hardware.
template <int MB>
void block_q8_sdot(const int8_t* xq, int64_t ldq, const float* dx, const float* sq, const uint8_t* blk,
                   const uint16_t* sz, int64_t Np, int64_t b, int G, int n_groups, float* out) {
  const uint8x16_t low4 = vdupq_n_u8(0x0F);
  const uint32x4_t hi16 = vdupq_n_u32(0xFFFF0000u);
  float32x4_t total[MB][8];
  for (int m = 0; m < MB; m++) for (int j = 0; j < 8; j++) total[m][j] = vdupq_n_f32(0.0f);
  for (int g = 0; g < n_groups; g++) {
    int32x4_t acc[MB][8];  // rows 4j..4j+3 in acc[m][j]
    for (int m = 0; m < MB; m++) for (int j = 0; j < 8; j++) acc[m][j] = vdupq_n_s32(0);
    const int64_t g0 = int64_t(g) * G, g1 = g0 + G;
    for (int64_t k = g0; k < g1; k += 4) {
      const uint8_t* p = blk + k * 16;
      const uint8x16_t c0 = vld1q_u8(p), c1 = vld1q_u8(p + 16), c2 = vld1q_u8(p + 32), c3 = vld1q_u8(p + 48);
      const uint16x8_t z01a = vreinterpretq_u16_u8(vzip1q_u8(c0, c1)), z01b = vreinterpretq_u16_u8(vzip2q_u8(c0, c1));
      const uint16x8_t z23a = vreinterpretq_u16_u8(vzip1q_u8(c2, c3)), z23b = vreinterpretq_u16_u8(vzip2q_u8(c2, c3));
      const uint8x16_t T[4] = {vreinterpretq_u8_u16(vzip1q_u16(z01a, z23a)), vreinterpretq_u8_u16(vzip2q_u16(z01a, z23a)),
                               vreinterpretq_u8_u16(vzip1q_u16(z01b, z23b)), vreinterpretq_u8_u16(vzip2q_u16(z01b, z23b))};
      int8x16_t w[8];
      for (int j = 0; j < 4; j++) {
        w[j] = vreinterpretq_s8_u8(vandq_u8(T[j], low4));
        w[j + 4] = vreinterpretq_s8_u8(vshrq_n_u8(T[j], 4));
      }
      for (int m = 0; m < MB; m++) {
        int32_t x4;
        std::memcpy(&x4, xq + m * ldq + k, 4);
        const int8x16_t xv = vreinterpretq_s8_s32(vdupq_n_s32(x4));
        for (int j = 0; j < 8; j++) acc[m][j] = vdotq_s32(acc[m][j], w[j], xv);
      }
    }
    // fix_up_group: (scale, zero) of 4 consecutive rows = 4 little-endian uint32, scale low half, zero high half
    const uint16_t* s = sz + (int64_t(g) * Np + b * ROWS) * 2;
    float32x4_t scale[8], zero[8];
    for (int j = 0; j < 8; j++) {
      uint32x4_t pair;
      std::memcpy(&pair, s + 8 * j, 16);
      scale[j] = vreinterpretq_f32_u32(vshlq_n_u32(pair, 16));
      zero[j] = vreinterpretq_f32_u32(vandq_u32(pair, hi16));
    }
    for (int m = 0; m < MB; m++) {
      const float d = dx[m * n_groups + g], c = sq[m * n_groups + g] * d;
      const float32x4_t dv = vdupq_n_f32(d), cv = vdupq_n_f32(c), m8c = vdupq_n_f32(-8.0f * c);
      for (int j = 0; j < 8; j++) {
        const float32x4_t t = vfmaq_f32(m8c, vcvtq_f32_s32(acc[m][j]), dv);
        total[m][j] = vfmaq_f32(vfmaq_f32(total[m][j], scale[j], t), zero[j], cv);
      }
    }
  }
  for (int m = 0; m < MB; m++) for (int j = 0; j < 8; j++) vst1q_f32(out + m * ROWS + 4 * j, total[m][j]);
}
#endif

// x[0..n) to int8 as the AVX2 paths multiply it (Q8_0-style): xq = round(x / dx), dx = max|x| / 127, rounding half
// to even as torch.round; *total = sum of xq. Returns dx: NaN when x holds NaN / inf (NaN out, as torch would give);
// an all-zero or denormal-only group stays 0.
float quantize_q8(const float* x, int64_t n, int8_t* xq, int32_t* total) {
  float amax = 0.0f;
  bool finite = true;
  for (int64_t k = 0; k < n; k++) {
    amax = std::max(amax, std::fabs(x[k]));
    finite = finite && std::isfinite(x[k]);
  }
  *total = 0;
  if (finite && amax >= FLT_MIN) {
    const float inv = 127.0f / amax;
    for (int64_t k = 0; k < n; k++) {
      const int32_t v = int32_t(std::nearbyint(x[k] * inv));
      xq[k] = int8_t(v);
      *total += v;
    }
  } else {
    std::fill(xq, xq + n, int8_t(0));
  }
  return finite ? amax / 127.0f : NAN;
}

// GENERIC: the portable loop; AVX2_ONLY: no AVX-512; AVX512BW_ONLY: no VNNI (tests and bench/int4_gemv.py)
enum Path { BEST = 0, GENERIC = 1, AVX2_ONLY = 2, AVX512BW_ONLY = 3 };

// The inner loop int4_mm runs for `path` on the instructions this file was compiled for
enum Int4Loop { LOOP_FP32, LOOP_Q8, LOOP_Q8_512, LOOP_Q8_VNNI, LOOP_Q8_SDOT };

int int4_loop(int path, int64_t G) {
  if (path == GENERIC || G % 4 != 0) return LOOP_FP32;
#if defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
  return LOOP_Q8_SDOT;
#elif defined(__AVX2__)
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
  if (path == BEST) return LOOP_Q8_VNNI;  // its loop steps 4 columns: G % 4 == 0 is enough
#endif
#ifdef __AVX512BW__
  if ((path == BEST || path == AVX512BW_ONLY) && G % 8 == 0) return LOOP_Q8_512;
#endif
  return LOOP_Q8;
#else
  return LOOP_FP32;
#endif
}

// x as every block needs it, per (row of x, group): the scale dx and the sum of xq (integer loops: xq is x quantized
// Q8_0-style, zero-padded to Kp) or of x (fp32 loop)
struct Int4X {
  std::vector<float> dx, sx;
  std::vector<int8_t> xq;
};

void int4_prepare_x(const float* xp, int64_t M, int64_t K, int64_t G, bool q8, Int4X& X) {
  const int64_t n_groups = (K + G - 1) / G, Kp = n_groups * G;
  X.dx.assign(M * n_groups, 0.0f);
  X.sx.assign(M * n_groups, 0.0f);
  if (q8) {
    X.xq.assign(M * Kp, 0);
    for (int64_t m = 0; m < M; m++)
      for (int64_t g = 0; g < n_groups; g++) {
        const int64_t k0 = g * G, k1 = std::min(k0 + G, K);
        int32_t total = 0;
        X.dx[m * n_groups + g] = quantize_q8(xp + m * K + k0, k1 - k0, X.xq.data() + m * Kp + k0, &total);
        X.sx[m * n_groups + g] = float(total);
      }
  } else {
    for (int64_t m = 0; m < M; m++)
      for (int64_t k = 0; k < K; k++) X.sx[m * n_groups + k / G] += xp[m * K + k];
  }
}

// y [M, N] = x [M, K] @ W^T for the 32-row blocks b0..b1 of W: int4_mm's work, one thread's share (no torch here:
// tests/int4_cpu_harness.cpp runs it on AArch64 under qemu)
void int4_blocks(int loop, const Int4X& X, const float* xp, const uint8_t* pp, const uint16_t* sp, int64_t M,
                 int64_t N, int64_t K, int64_t G, int64_t b0, int64_t b1, float* yp) {
  const int64_t n_groups = (K + G - 1) / G, Kp = n_groups * G, Np = (N + ROWS - 1) / ROWS * ROWS;
  float out[MB_MAX * ROWS];
  for (int64_t b = b0; b < b1; b++) {
    const uint8_t* blk = pp + b * Kp * 16;
    for (int64_t m0 = 0; m0 < M; m0 += MB_MAX) {
      const int mb = int(std::min<int64_t>(MB_MAX, M - m0));
      const float* sxm = X.sx.data() + m0 * n_groups;
      const int8_t* xm = loop == LOOP_FP32 ? nullptr : X.xq.data() + m0 * Kp;
      const float* dxm = X.dx.data() + m0 * n_groups;
      (void)xm, (void)dxm;
      with_rows(mb, [&](auto R) {
        constexpr int MBR = decltype(R)::value;
#if defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
        if (loop == LOOP_Q8_SDOT) return block_q8_sdot<MBR>(xm, Kp, dxm, sxm, blk, sp, Np, b, int(G), int(n_groups), out);
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
        if (loop == LOOP_Q8_VNNI) return block_q8_vnni<MBR>(xm, Kp, dxm, sxm, blk, sp, Np, b, int(G), int(n_groups), out);
#endif
#ifdef __AVX512BW__
        if (loop == LOOP_Q8_512) return block_q8_512<MBR>(xm, Kp, dxm, sxm, blk, sp, Np, b, int(G), int(n_groups), out);
#endif
#ifdef __AVX2__
        if (loop == LOOP_Q8) return block_q8<MBR>(xm, Kp, dxm, sxm, blk, sp, Np, b, int(G), int(n_groups), out);
#endif
        block_generic<MBR>(xp + m0 * K, K, sxm, blk, sp, Np, b, K, int(G), int(n_groups), out);
      });
      const int64_t rows = std::min<int64_t>(ROWS, N - b * ROWS);
      for (int m = 0; m < mb; m++) std::memcpy(yp + (m0 + m) * N + b * ROWS, out + m * ROWS, rows * sizeof(float));
    }
  }
}

// int8 rows (container.py "int8": q [N, K] int8, one fp32 scale per row; embeddings / lm_head): y = (x @ q^T) * scale.
// Portable loop (and the exact check); AVX2 CPUs take int8_rows_q8 below. Rows of x go 4 at a time.
template <int MB>
void int8_rows(const float* x, int64_t K, const int8_t* q, const float* scale, int64_t n0, int64_t n1, int64_t N,
               float* y) {
  for (int64_t n = n0; n < n1; n++) {
    const int8_t* w = q + n * K;
    float acc[MB] = {};
    for (int64_t k = 0; k < K; k++)
      for (int m = 0; m < MB; m++) acc[m] += float(w[k]) * x[m * K + k];
    for (int m = 0; m < MB; m++) y[m * N + n] = acc[m] * scale[n];
  }
}

#ifdef __AVX2__
// int8 rows x int8 activations (AVX2): x quantized per block of 32 columns (Q8_0-style, xq = round(x / dx),
// dx = max|x| / 127, as llama.cpp quantizes activations for its int8 dot products); per block, sum_k w xq comes
// from maddubs(|w|, xq with w's sign) + madd, one int32 -> fp32 fix-up. ~6 instructions per 32 weights against
// ~12 for an fp32 AVX2 loop, which did not keep up with DRAM on micro's lm_head (32768 x 2048, 2 threads:
// 11.4 GB/s, 5.9 ms a token, against 18.6 GB/s for this one in an interleaved A/B here).
// Columns past the last whole block stay fp32.
// One 32-column block b of an int8 row w (AVX2): v[m] += dx[m, b] * sum_k w[k] xq[m, k], the sums as int32 lanes
// (maddubs(|w|, xq with w's sign) + madd). int8_rows_q8's step, and int8_rows_vnni's for an odd last block.
template <int MB>
inline void int8_block_avx2(const int8_t* w, const int8_t* xq, const float* dx, int64_t nb, int64_t b, __m256 (&v)[MB]) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * 32));
  const __m256i aw = _mm256_sign_epi8(wv, wv);  // |w|: q is in [-127, 127]
  for (int m = 0; m < MB; m++) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * nb * 32 + b * 32));
    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wv)), ones);
    v[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dx[m * nb + b]), v[m]);
  }
}

// A row's end: v's lanes summed, the columns past the last whole block added in fp32, times the row's scale.
template <int MB>
inline void int8_row_end(const __m256 (&v)[MB], const int8_t* w, const float* x, int64_t K, int64_t nb,
                         const float* scale, int64_t n, int64_t N, float* y) {
  for (int m = 0; m < MB; m++) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v[m]), _mm256_extractf128_ps(v[m], 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    float acc = _mm_cvtss_f32(h);
    for (int64_t k = nb * 32; k < K; k++) acc = std::fma(float(w[k]), x[m * K + k], acc);  // fused on every CPU alike
    y[m * N + n] = acc * scale[n];
  }
}

template <int MB>
void int8_rows_q8(const int8_t* xq, const float* dx, int64_t nb, const float* x, int64_t K, const int8_t* q,
                  const float* scale, int64_t n0, int64_t n1, int64_t N, float* y) {
  for (int64_t n = n0; n < n1; n++) {
    const int8_t* w = q + n * K;
    __m256 v[MB];
    for (int m = 0; m < MB; m++) v[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
      _mm_prefetch(reinterpret_cast<const char*>(w + b * 32) + PREFETCH_BYTES, _MM_HINT_T0);
      int8_block_avx2<MB>(w, xq, dx, nb, b, v);
    }
    int8_row_end<MB>(v, w, x, K, nb, scale, n, N, y);
  }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
// int8_rows_q8 on AVX-512 VNNI: two blocks of 32 columns a step, vpdpbusd(|w|, xq with w's sign) giving the same
// int32 lane sums as maddubs + madd, and the two blocks' fix-ups applied in block order, so bit for bit the AVX2
// loop's result. ~12 instructions per 64 weights against ~18.
template <int MB>
void int8_rows_vnni(const int8_t* xq, const float* dx, int64_t nb, const float* x, int64_t K, const int8_t* q,
                    const float* scale, int64_t n0, int64_t n1, int64_t N, float* y) {
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t n = n0; n < n1; n++) {
    const int8_t* w = q + n * K;
    __m256 v[MB];
    for (int m = 0; m < MB; m++) v[m] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
      _mm_prefetch(reinterpret_cast<const char*>(w + b * 32) + PREFETCH_BYTES, _MM_HINT_T0);
      const __m512i wv = _mm512_loadu_si512(w + b * 32);
      const __m512i aw = _mm512_abs_epi8(wv);
      const __mmask64 neg = _mm512_movepi8_mask(wv);
      for (int m = 0; m < MB; m++) {
        const __m512i xv = _mm512_loadu_si512(xq + m * nb * 32 + b * 32);
        const __m512i p = _mm512_dpbusd_epi32(zero, aw, _mm512_mask_sub_epi8(xv, neg, zero, xv));
        const __m512 pf = _mm512_cvtepi32_ps(p);
        v[m] = _mm256_fmadd_ps(_mm512_castps512_ps256(pf), _mm256_set1_ps(dx[m * nb + b]), v[m]);
        v[m] = _mm256_fmadd_ps(_mm512_extractf32x8_ps(pf, 1), _mm256_set1_ps(dx[m * nb + b + 1]), v[m]);
      }
    }
    if (b < nb) int8_block_avx2<MB>(w, xq, dx, nb, b, v);  // an odd last block: int8_rows_q8's step
    int8_row_end<MB>(v, w, x, K, nb, scale, n, N, y);
  }
}
#endif

#if defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
// int8_rows_q8 on AArch64 dot products: sdot gives the 8 int32 sums maddubs + madd give (columns 4i..4i+3 in lane
// i), and the fix-ups and int8_row_end's horizontal sum run in their order: bit for bit int8_rows_q8's result.
template <int MB>
void int8_rows_sdot(const int8_t* xq, const float* dx, int64_t nb, const float* x, int64_t K, const int8_t* q,
                    const float* scale, int64_t n0, int64_t n1, int64_t N, float* y) {
  const int32x4_t zero = vdupq_n_s32(0);
  for (int64_t n = n0; n < n1; n++) {
    const int8_t* w = q + n * K;
    float32x4_t v[MB][2];
    for (int m = 0; m < MB; m++) v[m][0] = v[m][1] = vdupq_n_f32(0.0f);
    for (int64_t b = 0; b < nb; b++) {
      const int8x16_t w0 = vld1q_s8(w + b * 32), w1 = vld1q_s8(w + b * 32 + 16);
      for (int m = 0; m < MB; m++) {
        const int8_t* xb = xq + m * nb * 32 + b * 32;
        const float32x4_t d = vdupq_n_f32(dx[m * nb + b]);
        v[m][0] = vfmaq_f32(v[m][0], vcvtq_f32_s32(vdotq_s32(zero, w0, vld1q_s8(xb))), d);
        v[m][1] = vfmaq_f32(v[m][1], vcvtq_f32_s32(vdotq_s32(zero, w1, vld1q_s8(xb + 16))), d);
      }
    }
    for (int m = 0; m < MB; m++) {
      float h[4];  // int8_row_end's order: lanes i + (i + 4), then (0 + 2) + (1 + 3)
      vst1q_f32(h, vaddq_f32(v[m][0], v[m][1]));
      float acc = (h[0] + h[2]) + (h[1] + h[3]);
      for (int64_t k = nb * 32; k < K; k++) acc = std::fma(float(w[k]), x[m * K + k], acc);  // as int8_row_end
      y[m * N + n] = acc * scale[n];
    }
  }
}
#endif

// The inner loop int8_mm runs for `path` on the instructions this file was compiled for
enum Int8Loop { LOOP8_FP32, LOOP8_Q8, LOOP8_VNNI, LOOP8_SDOT };

int int8_loop(int path) {
  if (path == GENERIC) return LOOP8_FP32;
#if defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
  return LOOP8_SDOT;
#elif defined(__AVX2__)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
  if (path == BEST) return LOOP8_VNNI;
#endif
  return LOOP8_Q8;
#else
  return LOOP8_FP32;
#endif
}

// x quantized per block of 32 columns for the integer loops (xq, dx per (row of x, block)); columns past the last
// whole block stay fp32
struct Int8X {
  std::vector<int8_t> xq;
  std::vector<float> dx;
};

void int8_prepare_x(const float* xp, int64_t M, int64_t K, Int8X& X) {
  const int64_t nb = K / 32;
  X.xq.assign(M * nb * 32, 0);
  X.dx.assign(M * nb, 0.0f);
  for (int64_t m = 0; m < M; m++)
    for (int64_t b = 0; b < nb; b++) {
      int32_t total = 0;
      X.dx[m * nb + b] = quantize_q8(xp + m * K + b * 32, 32, X.xq.data() + (m * nb + b) * 32, &total);
    }
}

// y [M, N] = (x [M, K] @ q^T) * scale for rows n0..n1 of q: int8_mm's work, one thread's share (no torch here)
void int8_rows_range(int loop, const Int8X& X, const float* xp, int64_t M, int64_t K, const int8_t* qp,
                     const float* sp, int64_t n0, int64_t n1, int64_t N, float* yp) {
  const int64_t nb = K / 32;
  for (int64_t m0 = 0; m0 < M; m0 += MB_MAX) {
    const int64_t mb = std::min<int64_t>(MB_MAX, M - m0);
    const int8_t* xqm = loop == LOOP8_FP32 ? nullptr : X.xq.data() + m0 * nb * 32;
    const float* dxm = loop == LOOP8_FP32 ? nullptr : X.dx.data() + m0 * nb;
    const float* xm = xp + m0 * K;
    float* ym = yp + m0 * N;
    (void)xqm, (void)dxm;
    with_rows(mb, [&](auto R) {
      constexpr int MBR = decltype(R)::value;
#if defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
      if (loop == LOOP8_SDOT) return int8_rows_sdot<MBR>(xqm, dxm, nb, xm, K, qp, sp, n0, n1, N, ym);
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
      if (loop == LOOP8_VNNI) return int8_rows_vnni<MBR>(xqm, dxm, nb, xm, K, qp, sp, n0, n1, N, ym);
#endif
#ifdef __AVX2__
      if (loop == LOOP8_Q8) return int8_rows_q8<MBR>(xqm, dxm, nb, xm, K, qp, sp, n0, n1, N, ym);
#endif
      int8_rows<MBR>(xm, K, qp, sp, n0, n1, N, ym);
    });
  }
}

// Workers for parallel_chunks where the compiler has no OpenMP (Apple clang on macOS, the harness): started on
// first use, they spin ~0.2 ms after each call (decode calls again within microseconds, as libgomp's threads
// spin) and then sleep, so an idle process burns no CPU. One call at a time: a concurrent or nested caller runs
// its work on its own thread instead of waiting.
#ifndef _OPENMP
class ChunkPool {
 public:
  // fn(t) for t in 0..n-1, t = 0 on the calling thread; false (nothing run) while the pool is busy
  bool run(int n, const std::function<void(int)>& fn) {
    bool idle = false;
    if (!busy_.compare_exchange_strong(idle, true, std::memory_order_acquire)) return false;
    while (int(slots_.size()) < n - 1) {  // a worker per extra thread, kept for the process's life
      slots_.emplace_back(new std::atomic<uint64_t>(0));
      std::thread(&ChunkPool::work, this, int(slots_.size()) - 1, slots_.back().get()).detach();  // ends with the process
    }
    job_ = &fn;
    left_.store(n - 1);
    {
      std::lock_guard<std::mutex> lock(sleep_);  // a worker about to sleep sees its new slot value or the notify
      ++generation_;
      for (int w = 0; w < n - 1; w++) slots_[w]->store(generation_, std::memory_order_release);
    }
    wake_.notify_all();
    fn(0);
    for (int spins = 0; left_.load(std::memory_order_acquire) != 0; spins++)
      spins > 4096 ? std::this_thread::yield() : cpu_relax();  // a preempted worker: let it run
    busy_.store(false, std::memory_order_release);
    return true;
  }

 private:
  // a pause between polls: the spinning thread may share its core with one that computes (SMT)
  static void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

  void work(int w, std::atomic<uint64_t>* slot_ptr) {
    uint64_t seen = 0;
    std::atomic<uint64_t>& slot = *slot_ptr;
    for (;;) {
      const auto since = std::chrono::steady_clock::now();
      for (int spins = 0; slot.load(std::memory_order_acquire) == seen; spins++) {
        cpu_relax();
        if (spins % 256 == 255 && std::chrono::steady_clock::now() - since > std::chrono::microseconds(200)) {
          std::unique_lock<std::mutex> lock(sleep_);
          wake_.wait(lock, [&] { return slot.load(std::memory_order_acquire) != seen; });
        }
      }
      seen = slot.load(std::memory_order_acquire);
      (*job_)(w + 1);
      left_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  std::atomic<bool> busy_{false};  // a flag, not a mutex: a nested call comes from the thread that holds it
  std::mutex sleep_;
  std::condition_variable wake_;
  std::vector<std::unique_ptr<std::atomic<uint64_t>>> slots_;  // worker w runs a job when its slot changes
  const std::function<void(int)>* job_ = nullptr;
  std::atomic<int> left_{0};
  uint64_t generation_ = 0;
};

// The process's pool; a forked child (which has none of the parent's threads) makes its own
ChunkPool& chunk_pool() {
  static ChunkPool* pool = nullptr;
  static pid_t owner = 0;
  static std::mutex made;
  std::lock_guard<std::mutex> lock(made);
  if (!pool || owner != getpid()) pool = new ChunkPool(), owner = getpid();  // the old one is left: never freed
  return *pool;
}
#endif

// Runs fn(i0, i1) over [0, n) in contiguous chunks on up to `threads` threads, one fork/join per call: OpenMP's
// (torch's libgomp on Linux), else ChunkPool's. DYNAMIC_CHUNKS: ~8 chunks a thread, taken from a shared counter,
// so a thread the OS or the hypervisor preempted (a reader thread's syscall, an interrupt, CPU steal) hands its
// share to the others instead of holding up the whole call; else a static split, one chunk a thread.
#ifndef DYNAMIC_CHUNKS
#define DYNAMIC_CHUNKS 1
#endif
template <typename F>
void parallel_chunks(int threads, int64_t n, const F& fn) {
  const int nt = int(std::min<int64_t>(threads, n));
  if (nt <= 1) {
    fn(int64_t(0), n);
    return;
  }
#if DYNAMIC_CHUNKS
  const int64_t chunk = std::max<int64_t>(1, (n + 8 * nt - 1) / (8 * nt));
  std::atomic<int64_t> next{0};
  auto share = [&] {
    for (int64_t i0 = next.fetch_add(chunk); i0 < n; i0 = next.fetch_add(chunk)) fn(i0, std::min(i0 + chunk, n));
  };
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
  share();
#else
  if (!chunk_pool().run(nt, [&](int) { share(); })) share();
#endif
#else
  auto part = [&](int t) { fn(n * t / nt, n * (t + 1) / nt); };
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static, 1)
  for (int t = 0; t < nt; t++) part(t);
#else
  if (!chunk_pool().run(nt, part))
    for (int t = 0; t < nt; t++) part(t);
#endif
#endif
}

#ifndef PICAFLOR_NO_TORCH  // the torch ops
// parallel_chunks on torch's intra-op thread count (torch.set_num_threads)
template <typename F>
void parallel_chunks(int64_t n, const F& fn) {
  parallel_chunks(at::get_num_threads(), n, fn);
}

// x [..., K] as fp32 and contiguous, with no dispatch when it already is (decode calls these ~200 times a token)
at::Tensor as_float_contiguous(const at::Tensor& x) {
  return (x.scalar_type() == at::kFloat && x.is_contiguous()) ? x : x.to(at::kFloat).contiguous();
}

std::vector<int64_t> out_shape(const at::Tensor& x, int64_t N) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return shape;
}

// One matrix of an int4 matmul: its checked shapes, x as fp32 and as the loops take it, and y
struct Int4Job {
  at::Tensor x, y;
  int64_t M = 0, K = 0, N = 0, G = 0, n_blocks = 0;
  const uint8_t* pp = nullptr;
  const uint16_t* sp = nullptr;
  int loop = LOOP_FP32;
  int64_t x_from = -1;  // the job whose prepared x (`own`) this one uses: itself, or an earlier one with the same x
  Int4X own;
};

void int4_job(Int4Job& j, const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& sz, int64_t N,
              int64_t group_size, int path) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.device().is_cpu(), "int4_mm: x must be a CPU tensor [..., K]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "int4_mm: packed must be contiguous uint8");
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.is_contiguous(), "int4_mm: sz must be contiguous bf16");
  j.x = as_float_contiguous(x_in);
  const int64_t K = j.x.size(-1), M = K ? j.x.numel() / K : 0, G = group_size;
  TORCH_CHECK(G > 0 && N > 0 && K > 0, "int4_mm: bad shape");
  const int64_t n_groups = (K + G - 1) / G, Kp = n_groups * G, Np = (N + ROWS - 1) / ROWS * ROWS;
  TORCH_CHECK(packed.numel() == Np * Kp / 2, "int4_mm: packed has ", packed.numel(), " bytes, expected ", Np * Kp / 2);
  TORCH_CHECK(sz.numel() == n_groups * Np * 2, "int4_mm: sz has ", sz.numel(), " values, expected ", n_groups * Np * 2);
  j.y = at::empty(out_shape(j.x, N), j.x.options());
  j.M = M, j.K = K, j.N = N, j.G = G, j.n_blocks = M ? Np / ROWS : 0;
  j.pp = packed.data_ptr<uint8_t>();
  j.sp = reinterpret_cast<const uint16_t*>(sz.data_ptr<at::BFloat16>());
  j.loop = int4_loop(path, G);
}

// Several int4 matmuls in one parallel region: the 32-row blocks of every matrix form one work list, so a MoE
// layer's experts take one fork/join per projection instead of one per matrix, in longer runs of weights a thread.
// Each job's y is what it would be alone, bit for bit: the same blocks through the same loop on the same x.
void int4_run(std::vector<Int4Job>& jobs) {
  std::vector<int64_t> first(jobs.size() + 1, 0);  // job i owns work items first[i] .. first[i + 1]
  for (size_t i = 0; i < jobs.size(); i++) {
    Int4Job& j = jobs[i];
    for (size_t e = 0; e < i && j.x_from < 0; e++)  // x shared with an earlier job (a layer's gate|up projections)
      if (jobs[e].x.data_ptr() == j.x.data_ptr() && jobs[e].M == j.M && jobs[e].K == j.K && jobs[e].G == j.G &&
          (jobs[e].loop == LOOP_FP32) == (j.loop == LOOP_FP32))
        j.x_from = jobs[e].x_from;
    if (j.x_from < 0 && j.M) {
      int4_prepare_x(j.x.data_ptr<float>(), j.M, j.K, j.G, j.loop != LOOP_FP32, j.own);
      j.x_from = int64_t(i);
    }
    first[i + 1] = first[i] + j.n_blocks;
  }
  parallel_chunks(first.back(), [&](int64_t w0, int64_t w1) {
    for (size_t i = 0; i < jobs.size(); i++) {
      const int64_t b0 = std::max(w0, first[i]), b1 = std::min(w1, first[i + 1]);
      const Int4Job& j = jobs[i];
      if (b0 < b1)
        int4_blocks(j.loop, jobs[j.x_from].own, j.x.data_ptr<float>(), j.pp, j.sp, j.M, j.N, j.K, j.G, b0 - first[i],
                    b1 - first[i], j.y.data_ptr<float>());
    }
  });
}

at::Tensor int4_mm_impl(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& sz, int64_t N,
                        int64_t group_size, int path) {
  std::vector<Int4Job> jobs(1);
  int4_job(jobs[0], x_in, packed, sz, N, group_size, path);
  int4_run(jobs);
  return jobs[0].y;
}

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz, int64_t N,
                   int64_t group_size) {
  return int4_mm_impl(x, packed, sz, N, group_size, BEST);
}

at::Tensor int4_mm_generic(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz, int64_t N,
                           int64_t group_size) {
  return int4_mm_impl(x, packed, sz, N, group_size, GENERIC);
}

at::Tensor int4_mm_avx2(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz, int64_t N,
                        int64_t group_size) {
  return int4_mm_impl(x, packed, sz, N, group_size, AVX2_ONLY);
}

at::Tensor int4_mm_avx512bw(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz, int64_t N,
                            int64_t group_size) {
  return int4_mm_impl(x, packed, sz, N, group_size, AVX512BW_ONLY);
}

at::Tensor int8_mm_impl(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scale_in, int path) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.device().is_cpu(), "int8_mm: x must be a CPU tensor [..., K]");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous(), "int8_mm: q must be contiguous int8 [N, K]");
  const at::Tensor x = as_float_contiguous(x_in), scale = as_float_contiguous(scale_in);
  const int64_t K = x.size(-1), M = K ? x.numel() / K : 0, N = q.size(0);
  TORCH_CHECK(q.size(1) == K, "int8_mm: q has ", q.size(1), " columns, x has ", K);
  TORCH_CHECK(scale.numel() == N, "int8_mm: scale has ", scale.numel(), " values, expected ", N);
  at::Tensor y = at::empty(out_shape(x, N), x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int loop = int8_loop(path);
  Int8X X;
  if (loop != LOOP8_FP32) int8_prepare_x(xp, M, K, X);
  parallel_chunks(N, [&](int64_t n0, int64_t n1) { int8_rows_range(loop, X, xp, M, K, qp, sp, n0, n1, N, yp); });
  return y;
}

at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  return int8_mm_impl(x, q, scale, BEST);
}

at::Tensor int8_mm_generic(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  return int8_mm_impl(x, q, scale, GENERIC);
}

at::Tensor int8_mm_avx2(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  return int8_mm_impl(x, q, scale, AVX2_ONLY);
}

// ----------------------------------------------------------------------------------------------------------
// Decode-step helpers. A one-token step is ~100 small torch ops per layer, and at ~5-40 us each (F.rms_norm on a
// 2048-vector took 40 us here) they cost as much as the GEMVs; these do the same arithmetic in one call each.

float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.0f;
#ifdef __AVX2__
  __m256 v0 = _mm256_setzero_ps(), v1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    v0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), v0);
    v1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), v1);
  }
  v0 = _mm256_add_ps(v0, v1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v0), _mm256_extractf128_ps(v0, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  s = _mm_cvtss_f32(h);
#endif
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

// y = weight * x / sqrt(mean(x^2) + eps) over the last dim (model.RMSNorm, fp32)
void rms_norm_row(const float* x, const float* w, float eps, int64_t n, float* y) {
  const float r = 1.0f / std::sqrt(dot(x, x, n) / float(n) + eps);
  for (int64_t i = 0; i < n; i++) y[i] = w[i] * (x[i] * r);
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  const at::Tensor x = as_float_contiguous(x_in), w = as_float_contiguous(w_in);
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  TORCH_CHECK(w.numel() == n, "rms_norm: weight has ", w.numel(), " values, x rows have ", n);
  at::Tensor y = at::empty_like(x);
  for (int64_t r = 0; r < rows; r++)
    rms_norm_row(x.data_ptr<float>() + r * n, w.data_ptr<float>(), float(eps), n, y.data_ptr<float>() + r * n);
  return y;
}

// NEOX rotate_half RoPE on one head: x*cos + cat(-x2, x1)*sin (model.apply_rope)
void rope_head(float* x, const float* cos, const float* sin, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < half; i++) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

// One query position of model.Attention after the q|k|v projection, for batch 1 with a KV cache: per-head QK
// RMSNorm, RoPE, the new key and value written at `pos`, softmax(q k^T / sqrt(hd)) v over positions 0..pos with
// grouped-query heads (query head h reads kv head h / (H / KV), as SDPA's enable_gqa). Returns [1, 1, H * hd].
at::Tensor attn_decode(const at::Tensor& qkv_in, const at::Tensor& q_norm_w, const at::Tensor& k_norm_w, double eps,
                       const at::Tensor& cos_in, const at::Tensor& sin_in, at::Tensor k_cache, at::Tensor v_cache,
                       int64_t pos, int64_t n_head, int64_t n_kv_head) {
  const at::Tensor qkv = as_float_contiguous(qkv_in), cs = as_float_contiguous(cos_in), sn = as_float_contiguous(sin_in);
  const at::Tensor qw = as_float_contiguous(q_norm_w), kw = as_float_contiguous(k_norm_w);
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() && k_cache.dim() == 4 &&
                  k_cache.size(0) == 1 && v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous() &&
                  v_cache.scalar_type() == at::kFloat,
              "attn_decode: caches must be contiguous fp32 [1, KV, max_len, hd]");
  const int64_t hd = k_cache.size(3), max_len = k_cache.size(2), H = n_head, KV = n_kv_head;
  TORCH_CHECK(k_cache.size(1) == KV && H % KV == 0, "attn_decode: head counts do not match the cache");
  TORCH_CHECK(qkv.numel() == (H + 2 * KV) * hd, "attn_decode: qkv has ", qkv.numel(), " values, expected ", (H + 2 * KV) * hd);
  TORCH_CHECK(cs.numel() == hd && sn.numel() == hd, "attn_decode: cos/sin must hold one position");
  TORCH_CHECK(qw.numel() == hd && kw.numel() == hd, "attn_decode: QK norm weights must have head_dim values");
  TORCH_CHECK(pos >= 0 && pos < max_len, "KV cache full: ", pos, " + 1 > ", max_len, " positions");
  const float* src = qkv.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  std::vector<float> q(H * hd);
  for (int64_t h = 0; h < H; h++) {
    rms_norm_row(src + h * hd, qw.data_ptr<float>(), float(eps), hd, q.data() + h * hd);
    rope_head(q.data() + h * hd, cs.data_ptr<float>(), sn.data_ptr<float>(), hd);
  }
  for (int64_t j = 0; j < KV; j++) {
    float* kdst = kc + (j * max_len + pos) * hd;
    rms_norm_row(src + (H + j) * hd, kw.data_ptr<float>(), float(eps), hd, kdst);
    rope_head(kdst, cs.data_ptr<float>(), sn.data_ptr<float>(), hd);
    std::memcpy(vc + (j * max_len + pos) * hd, src + (H + KV + j) * hd, hd * sizeof(float));
  }
  at::Tensor y = at::zeros({1, 1, H * hd}, qkv.options());
  float* yp = y.data_ptr<float>();
  const int64_t T = pos + 1, group = H / KV;
  const float scale = 1.0f / std::sqrt(float(hd));
  auto one_head = [&](int64_t h) {
    const int64_t j = h / group;
    const float* qh = q.data() + h * hd;
    std::vector<float> p(T);
    float mx = -INFINITY;
    for (int64_t t = 0; t < T; t++) {
      p[t] = dot(qh, kc + (j * max_len + t) * hd, hd) * scale;
      mx = std::max(mx, p[t]);
    }
    float total = 0.0f;
    for (int64_t t = 0; t < T; t++) total += (p[t] = std::exp(p[t] - mx));
    float* out = yp + h * hd;
    for (int64_t t = 0; t < T; t++) {
      const float a = p[t] / total;
      const float* vt = vc + (j * max_len + t) * hd;
      for (int64_t i = 0; i < hd; i++) out[i] += a * vt[i];
    }
  };
  if (T * H * hd < (1 << 16)) {  // short contexts: not worth waking threads
    for (int64_t h = 0; h < H; h++) one_head(h);
  } else {
    parallel_chunks(H, [&](int64_t h0, int64_t h1) {
      for (int64_t h = h0; h < h1; h++) one_head(h);
    });
  }
  return y;
}

// The attention half of a decode step (Engine._decode_step) in one call: h = rms_norm(x), x += o_proj(attention of
// qkv_proj(h)), returns rms_norm(x) with the post-attention weights. The same functions in the same order as the
// separate ops, so bit for bit their result; x is updated in place (the caller's own hidden state).
at::Tensor attn_block(at::Tensor x, const at::Tensor& w_in, double eps_in, const at::Tensor& qkv_packed,
                      const at::Tensor& qkv_sz, int64_t qkv_n, int64_t qkv_group, const at::Tensor& q_norm_w,
                      const at::Tensor& k_norm_w, double qk_eps, const at::Tensor& o_packed, const at::Tensor& o_sz,
                      int64_t o_n, int64_t o_group, const at::Tensor& w_post, double eps_post, const at::Tensor& cos,
                      const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, int64_t pos, int64_t n_head,
                      int64_t n_kv_head) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous() && x.numel() == x.size(-1) &&
                  x.size(-1) == o_n, "attn_block: x must be one contiguous fp32 CPU row of d_model values");
  const at::Tensor y = attn_decode(int4_mm_impl(rms_norm(x, w_in, eps_in), qkv_packed, qkv_sz, qkv_n, qkv_group, BEST),
                                   q_norm_w, k_norm_w, qk_eps, cos, sin, k_cache, v_cache, pos, n_head, n_kv_head);
  const at::Tensor o = int4_mm_impl(y, o_packed, o_sz, o_n, o_group, BEST);
  float* xp = x.data_ptr<float>();
  const float* op = o.data_ptr<float>();
  for (int64_t i = 0; i < o_n; i++) xp[i] += op[i];
  return rms_norm(x, w_post, eps_post);
}

// silu(gate) * up from gate|up rows [..., 2F] (gate first) -> [..., F]
at::Tensor swiglu_act(const at::Tensor& h, int64_t two_f) {
  const int64_t F = two_f / 2, rows = h.numel() / two_f;
  std::vector<int64_t> shape(h.sizes().begin(), h.sizes().end());
  shape.back() = F;
  at::Tensor a = at::empty(shape, h.options());
  const float* hp = h.data_ptr<float>();
  float* ap = a.data_ptr<float>();
  for (int64_t r = 0; r < rows; r++)
    for (int64_t i = 0; i < F; i++) {
      const float g = hp[r * two_f + i], u = hp[r * two_f + F + i];
      ap[r * F + i] = g / (1.0f + std::exp(-g)) * u;
    }
  return a;
}

// SwiGLU FFN on int4 weights: down(silu(gate) * up) with gate|up fused as one [2F, D] matrix (gate rows first,
// as model.py and container.py store routed experts): the whole expert in one call.
at::Tensor swiglu_ffn(const at::Tensor& x, const at::Tensor& gu_packed, const at::Tensor& gu_sz, int64_t two_f,
                      int64_t gu_group, const at::Tensor& down_packed, const at::Tensor& down_sz, int64_t d_out,
                      int64_t down_group) {
  TORCH_CHECK(two_f % 2 == 0, "swiglu_ffn: gate|up rows must be even");
  return int4_mm_impl(swiglu_act(int4_mm_impl(x, gu_packed, gu_sz, two_f, gu_group, BEST), two_f), down_packed,
                      down_sz, d_out, down_group, BEST);
}

// o += wt * y: the rounded product, then the add (torch's `out += y * w`)
void add_scaled(float* o, const float* y, int64_t n, float wt) {
  for (int64_t j = 0; j < n; j++) {
    const float t = y[j] * wt;
    o[j] += t;
  }
}

// A one-token MoE layer's routed FFNs in one call: out += weights[i] * swiglu_ffn_i(x) for each i in the order
// given (stream_infer passes the shared expert's output as `out`, then the routed experts in a fixed order).
void swiglu_mix(const at::Tensor& x, at::Tensor out, at::TensorList gu_packed, at::TensorList gu_sz,
                at::TensorList down_packed, at::TensorList down_sz, at::IntArrayRef two_f, at::IntArrayRef group_size,
                at::ArrayRef<double> weights) {
  const size_t n = gu_packed.size();
  TORCH_CHECK(gu_sz.size() == n && down_packed.size() == n && down_sz.size() == n && two_f.size() == n &&
                  group_size.size() == n && weights.size() == n, "swiglu_mix: lists of different lengths");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() == x.numel() && !out.is_alias_of(x),
              "swiglu_mix: out must be contiguous fp32 shaped like x, and not x itself");
  const int64_t d_out = x.size(-1);
  // every expert's gate|up in one parallel region, then every down projection in one (int4_run): each y is
  // swiglu_ffn's, bit for bit
  std::vector<Int4Job> gate_up(n), down(n);
  for (size_t i = 0; i < n; i++) {
    TORCH_CHECK(two_f[i] % 2 == 0, "swiglu_mix: gate|up rows must be even");
    int4_job(gate_up[i], x, gu_packed[i], gu_sz[i], two_f[i], group_size[i], BEST);
  }
  int4_run(gate_up);
  for (size_t i = 0; i < n; i++)
    int4_job(down[i], swiglu_act(gate_up[i].y, two_f[i]), down_packed[i], down_sz[i], d_out, group_size[i], BEST);
  int4_run(down);
  float* o = out.data_ptr<float>();
  for (size_t i = 0; i < n; i++) add_scaled(o, down[i].y.data_ptr<float>(), down[i].y.numel(), float(weights[i]));
}

// out += weights[i] * ys[i] in the order given, as swiglu_mix sums: stream_infer computes a layer's cached experts
// while its missing ones are read, then sums every expert's output in the fixed order.
void mix_outputs(at::Tensor out, at::TensorList ys, at::ArrayRef<double> weights) {
  TORCH_CHECK(ys.size() == weights.size(), "mix_outputs: lists of different lengths");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous(), "mix_outputs: out must be contiguous fp32");
  for (size_t i = 0; i < ys.size(); i++) {
    TORCH_CHECK(ys[i].scalar_type() == at::kFloat && ys[i].is_contiguous() && ys[i].numel() == out.numel() &&
                    !out.is_alias_of(ys[i]), "mix_outputs: each y must be contiguous fp32 shaped like out, and not out");
    add_scaled(out.data_ptr<float>(), ys[i].data_ptr<float>(), out.numel(), float(weights[i]));
  }
}

// The DeepSeek-V3 router of model.Router for rows of x: scores = sigmoid(x W^T) in fp32, experts chosen by
// scores + bias (the bias only selects), weights = chosen scores / their sum * route_scale. Also returns the
// selection keys scores + bias [rows, E]: stream_infer's expert cache evicts by them (policy "score").
std::tuple<at::Tensor, at::Tensor, at::Tensor> route(const at::Tensor& x_in, const at::Tensor& w_in, const at::Tensor& bias_in,
                                         int64_t top_k, double route_scale) {
  const at::Tensor x = as_float_contiguous(x_in), w = as_float_contiguous(w_in), bias = as_float_contiguous(bias_in);
  const int64_t D = x.size(-1), rows = D ? x.numel() / D : 0, E = w.size(0);
  TORCH_CHECK(w.dim() == 2 && w.size(1) == D && bias.numel() == E && top_k >= 1 && top_k <= E, "route: bad shapes");
  at::Tensor weights = at::empty({rows, top_k}, x.options());
  at::Tensor idx = at::empty({rows, top_k}, x.options().dtype(at::kLong));
  at::Tensor keys = at::empty({rows, E}, x.options());
  std::vector<float> scores(rows * E);
  std::vector<int64_t> order(E);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  auto score_rows = [&](int64_t i0, int64_t i1) {  // (row, expert) pairs; each dot the same whichever thread
    for (int64_t i = i0; i < i1; i++)
      scores[i] = 1.0f / (1.0f + std::exp(-dot(xp + (i / E) * D, wp + (i % E) * D, D)));
  };
  if (rows * E * D < (1 << 16)) score_rows(0, rows * E);  // tiny routers: not worth waking threads
  else parallel_chunks(rows * E, score_rows);  // micro's [64, 2048] fp32 router: 0.5 MB a layer per token
  for (int64_t r = 0; r < rows; r++) {
    const float* score = scores.data() + r * E;
    float* key = keys.data_ptr<float>() + r * E;
    for (int64_t e = 0; e < E; e++) {
      key[e] = score[e] + bias.data_ptr<float>()[e];
      order[e] = e;
    }
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [&](int64_t a, int64_t b) { return key[a] > key[b] || (key[a] == key[b] && a < b); });
    float total = 0.0f;
    for (int64_t i = 0; i < top_k; i++) total += score[order[i]];
    for (int64_t i = 0; i < top_k; i++) {
      idx.data_ptr<int64_t>()[r * top_k + i] = order[i];
      weights.data_ptr<float>()[r * top_k + i] = score[order[i]] / (total + 1e-20f) * float(route_scale);
    }
  }
  return {weights, idx, keys};
}

// Policy "score" of expert_cache.ExpertCache, one decode token: row = decay * row + (1 - decay) * key per expert,
// or row = key on the layer's first pass. Each product is rounded on its own before the sum (volatile: no fused
// multiply-add), as numpy's `row *= d; row += (1 - d) * s` and bench/cache_replay.py's Python floats round it.
void observe_scores(at::Tensor row, const at::Tensor& keys, double decay, bool first) {
  TORCH_CHECK(row.scalar_type() == at::kDouble && row.is_contiguous() && keys.scalar_type() == at::kFloat &&
              keys.is_contiguous() && keys.numel() == row.numel(), "observe_scores: row f64 [E], keys f32 [1, E]");
  double* r = row.data_ptr<double>();
  const float* k = keys.data_ptr<float>();
  for (int64_t e = 0; e < row.numel(); e++) {
    if (first) {
      r[e] = double(k[e]);
      continue;
    }
    volatile double old_part = r[e] * decay;
    volatile double new_part = (1.0 - decay) * double(k[e]);
    r[e] = old_part + new_part;
  }
}

// The eviction victim of policy "score": the flat [layer, expert] index with the lowest score among cached ones
// (stamp >= 0) not in `protect`, the oldest stamp among equal scores; -1 when there is none. As numpy's
// ExpertCache._score_victim_numpy, without its ~10 array temporaries per eviction.
int64_t score_victim(const at::Tensor& score, const at::Tensor& stamp, at::IntArrayRef protect) {
  TORCH_CHECK(score.scalar_type() == at::kDouble && stamp.scalar_type() == at::kLong && score.is_contiguous() &&
              stamp.is_contiguous() && score.numel() == stamp.numel(), "score_victim: score f64, stamp i64, same shape");
  const double* s = score.data_ptr<double>();
  const int64_t* t = stamp.data_ptr<int64_t>();
  const int64_t n = score.numel();
  int64_t best = -1;
  for (int64_t i = 0; i < n; i++) {
    if (t[i] < 0 || std::find(protect.begin(), protect.end(), i) != protect.end()) continue;
    if (best < 0 || s[i] < s[best] || (s[i] == s[best] && t[i] < t[best])) best = i;
  }
  return best;
}

bool has_avx512() {
#ifdef __AVX512BW__
  return true;
#else
  return false;
#endif
}

bool has_vnni() {
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
  return true;
#else
  return false;
#endif
}

bool has_sdot() {
#if defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
  return true;
#else
  return false;
#endif
}

bool has_avx2() {
#ifdef __AVX2__
  return true;
#else
  return false;
#endif
}

#endif  // PICAFLOR_NO_TORCH
}  // namespace

#ifndef PICAFLOR_NO_TORCH
TORCH_LIBRARY(picaflor_int4, m) {
  m.def("int4_mm(Tensor x, Tensor packed, Tensor sz, int N, int group_size) -> Tensor", &int4_mm);
  m.def("int4_mm_generic(Tensor x, Tensor packed, Tensor sz, int N, int group_size) -> Tensor", &int4_mm_generic);
  m.def("int8_mm(Tensor x, Tensor q, Tensor scale) -> Tensor", &int8_mm);
  m.def("int8_mm_generic(Tensor x, Tensor q, Tensor scale) -> Tensor", &int8_mm_generic);
  m.def("int8_mm_avx2(Tensor x, Tensor q, Tensor scale) -> Tensor", &int8_mm_avx2);
  m.def("has_avx2() -> bool", &has_avx2);
  m.def("has_sdot() -> bool", &has_sdot);
  m.def("has_avx512() -> bool", &has_avx512);
  m.def("int4_mm_avx2(Tensor x, Tensor packed, Tensor sz, int N, int group_size) -> Tensor", &int4_mm_avx2);
  m.def("int4_mm_avx512bw(Tensor x, Tensor packed, Tensor sz, int N, int group_size) -> Tensor", &int4_mm_avx512bw);
  m.def("has_vnni() -> bool", &has_vnni);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("attn_decode(Tensor qkv, Tensor q_norm_w, Tensor k_norm_w, float eps, Tensor cos, Tensor sin, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, int pos, int n_head, int n_kv_head) -> Tensor", &attn_decode);
  m.def("attn_block(Tensor(a!) x, Tensor w_in, float eps_in, Tensor qkv_packed, Tensor qkv_sz, int qkv_n, "
        "int qkv_group, Tensor q_norm_w, Tensor k_norm_w, float qk_eps, Tensor o_packed, Tensor o_sz, int o_n, "
        "int o_group, Tensor w_post, float eps_post, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
        "Tensor(c!) v_cache, int pos, int n_head, int n_kv_head) -> Tensor", &attn_block);
  m.def("swiglu_ffn(Tensor x, Tensor gu_packed, Tensor gu_sz, int two_f, int gu_group, Tensor down_packed, "
        "Tensor down_sz, int d_out, int down_group) -> Tensor", &swiglu_ffn);
  m.def("swiglu_mix(Tensor x, Tensor(a!) out, Tensor[] gu_packed, Tensor[] gu_sz, Tensor[] down_packed, "
        "Tensor[] down_sz, int[] two_f, int[] group_size, float[] weights) -> ()", &swiglu_mix);
  m.def("mix_outputs(Tensor(a!) out, Tensor[] ys, float[] weights) -> ()", &mix_outputs);
  m.def("route(Tensor x, Tensor w, Tensor bias, int top_k, float route_scale) -> (Tensor, Tensor, Tensor)", &route);
  m.def("observe_scores(Tensor(a!) row, Tensor keys, float decay, bool first) -> ()", &observe_scores);
  m.def("score_victim(Tensor score, Tensor stamp, int[] protect) -> int", &score_victim);
}
#endif
