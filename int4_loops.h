// int4_loops.h: the CPU int4 (and int8) matmul loops of int4_cpu.cpp, y = x @ W^T with W read straight from the
// container's bytes, and the threads they run on; no torch here: int4_cpu.cpp wraps them in torch ops, and
// tests/int4_cpu_harness.cpp runs them alone (on AArch64 under qemu, and on ChunkPool's threads).
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

#pragma once

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
#include <pthread.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <system_error>
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
#ifndef PREFETCH_L2_BYTES
#define PREFETCH_L2_BYTES 8192
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
// One cache line of a weight stream, ahead of its use: into L1 PREFETCH_BYTES ahead, and into L2 PREFETCH_L2_BYTES
// ahead, so more lines are in flight than L1's fill buffers allow (on a 2-core Xeon VM, cold 2048 x 2048 GEMVs on 2
// threads, variants interleaved in one process: 18.1 GB/s with the L1 prefetch alone, 22.2 with both, a plain read
// of the same bytes 21.8; bench/int4_prefetch.py). L2 = 0: the L1 prefetch alone (the bench's baseline).
template <int L2 = PREFETCH_L2_BYTES>
inline void prefetch_line(const void* p) {
  _mm_prefetch(static_cast<const char*>(p) + PREFETCH_BYTES, _MM_HINT_T0);
  if (L2) _mm_prefetch(static_cast<const char*>(p) + L2, _MM_HINT_T1);
}

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
        prefetch_line<>(p);
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
        prefetch_line<>(p);
        prefetch_line<>(p + 64);
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
template <int MB, int L2 = PREFETCH_L2_BYTES>  // L2: bench/int4_prefetch.py's variants
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
      prefetch_line<L2>(p);
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
  if (finite && amax >= 127.0f / FLT_MAX) {  // below it 127 / amax is inf (FLT_MIN let 1e-37 through: UB casts)
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
      prefetch_line<>(w + b * 32);
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
      prefetch_line<>(w + b * 32);
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
    // on every way out, a throwing fn(0) included: the workers are done with fn (it lives in the caller's frame)
    // before the pool is free again
    struct Done {
      ChunkPool& pool;
      ~Done() {
        for (int spins = 0; pool.left_.load(std::memory_order_acquire) != 0; spins += spins < 4096)
          spins >= 4096 ? std::this_thread::yield() : cpu_relax();  // a preempted worker: let it run
        pool.busy_.store(false, std::memory_order_release);
      }
    } done{*this};
    slots_.reserve(n - 1);  // push_back below cannot throw then
    while (int(slots_.size()) < n - 1) {  // a worker per extra thread, kept (detached) for the process's life
      std::unique_ptr<std::atomic<uint64_t>> slot(new std::atomic<uint64_t>(0));
      try {
        std::thread(&ChunkPool::work, this, int(slots_.size()), slot.get()).detach();
      } catch (const std::system_error&) {  // no thread to be had (a limit): the caller runs the work alone
        return false;
      }
      slots_.push_back(std::move(slot));
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
      (*job_)(w + 1);  // a throw here ends the process (std::terminate), as in an OpenMP region
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

// The process's pool, made on first use. A forked child has none of the parent's threads: the fork handler
// forgets the pool there, so the child makes its own (no lock to inherit held, no system call per call)
std::atomic<ChunkPool*> the_pool{nullptr};
ChunkPool& chunk_pool() {
  ChunkPool* pool = the_pool.load(std::memory_order_acquire);
  if (!pool) {
    static const int forget_in_child =
        pthread_atfork(nullptr, nullptr, [] { the_pool.store(nullptr, std::memory_order_relaxed); });
    (void)forget_in_child;
    ChunkPool* made = new ChunkPool();  // never freed: detached workers may use it until the process ends
    if (the_pool.compare_exchange_strong(pool, made, std::memory_order_acq_rel)) pool = made;
    else delete made;  // another thread's came first (this one has no workers yet)
  }
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

}  // namespace
