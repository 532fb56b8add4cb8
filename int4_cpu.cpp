// int4_cpu.cpp: stream_infer's native CPU ops over int4_loops.h's loops: the int4 and int8 matmuls (int4_mm,
// int8_mm), and the decode step's small ops in one call each (rms_norm, attn_decode, attn_block, swiglu_ffn,
// swiglu_mix, route) plus the expert cache's score bookkeeping. Built on first use by stream_infer.native_int4()
// (torch.utils.cpp_extension, -O3 -march=native, or -mcpu=native on ARM, cached) with expert_reader.cpp, which it
// includes at its end: one translation unit parses torch's headers once (a build: ~12 s of CPU, not ~24).

#include <cmath>
#include <ATen/Parallel.h>
#include <torch/library.h>
// the ops used, not <ATen/ATen.h>: every op's header took ~3 s more per build
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>

#include "int4_loops.h"

namespace {

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
  if (M == 0) return at::zeros(out_shape(x, N), x.options());  // K = 0: a sum of nothing (empty() was garbage)
  at::Tensor y = at::empty(out_shape(x, N), x.options());
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
    // a NaN score (a router fed a NaN) is the lowest, as in the numpy version (compared as is, it was skipped)
    const double v = std::isnan(s[i]) ? -INFINITY : s[i], vb = best < 0 ? 0.0 : (std::isnan(s[best]) ? -INFINITY : s[best]);
    if (best < 0 || v < vb || (v == vb && t[i] < t[best])) best = i;
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

}  // namespace

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

#include "expert_reader.cpp"  // its reader ops, in this translation unit (see the top)
