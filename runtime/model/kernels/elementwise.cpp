// The decoder's elementwise steps fused, float32 on the CPU: each one pass over its rows in one
// parallel region, where torch runs 2 to 10 operators (and as many parallel regions, each a
// wait for every intra-op thread: costly beside a busy neighbour). The arithmetic is torch's, in
// the same order, so that results agree to float32 rounding (tests/runtime/test_layers.py):
//
//   silu_and_mul(x [T, 2d]) -> [T, d]:  silu(x[:, :d]) * x[:, d:]  (vectorised with torch's own exp: exact)
//   rms_norm(x [T, n], w [n], eps) -> [T, n]:  w * (x * rsqrt(mean(x^2) + eps))
//   add_rms_norm(x, residual, w, eps) -> (norm, sum):  sum = x + residual, norm = rms_norm(sum)
//   rope(x [T, H, D], cos [T, 1, D], sin [T, 1, D]) -> [T, H, D]:  x * cos + rotate_half(x) * sin

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "vector_exp.h"

namespace {

constexpr int64_t kElementsPerTask = 16384;  // below this a second thread costs more than it saves

int64_t grain(int64_t row_elements) { return std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(1, row_elements)); }

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, name, ": expected a float32 CPU tensor, got ",
              x.scalar_type(), " on ", x.device());
  TORCH_CHECK(x.dim() >= 1 && x.stride(-1) == 1, name, ": the last dimension must be contiguous");
}

// silu(gate) * up for one row, the way torch's F.silu then a multiply compute it: x / (1 + exp(-x))
// two vectors at a time through torch's exp at its CPU capability, the rest (fewer than two
// vectors' worth) with std::exp, as torch's vectorised loop does, then times up. The result is
// F.silu(gate) * up bit for bit (tests/runtime/test_layers.py).
void silu_mul_scalar(const float* gate, const float* up, float* dst, int64_t begin, int64_t d) {
  for (int64_t i = begin; i < d; ++i) dst[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

#ifdef ADPFLEET_X86_VECTORS
__attribute__((target("avx512f"))) void silu_mul_avx512(const float* gate, const float* up, float* dst, int64_t d) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512i sign = _mm512_set1_epi32(INT32_MIN);  // -x as torch negates: the sign bit flipped
  int64_t i = 0;
  for (; i + 32 <= d; i += 32)
    for (int64_t j = i; j < i + 32; j += 16) {
      const __m512 g = _mm512_loadu_ps(gate + j);
      const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(sign, _mm512_castps_si512(g)));
      const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, Sleef_expf16_u10(neg)));
      _mm512_storeu_ps(dst + j, _mm512_mul_ps(silu, _mm512_loadu_ps(up + j)));
    }
  silu_mul_scalar(gate, up, dst, i, d);
}

__attribute__((target("avx2"))) void silu_mul_avx2(const float* gate, const float* up, float* dst, int64_t d) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 16 <= d; i += 16)
    for (int64_t j = i; j < i + 16; j += 8) {
      const __m256 g = _mm256_loadu_ps(gate + j);
      const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, Sleef_expf8_u10(_mm256_xor_ps(sign, g))));
      _mm256_storeu_ps(dst + j, _mm256_mul_ps(silu, _mm256_loadu_ps(up + j)));
    }
  silu_mul_scalar(gate, up, dst, i, d);
}
#endif

using SiluMulRow = void (*)(const float*, const float*, float*, int64_t);

void silu_mul_plain(const float* gate, const float* up, float* dst, int64_t d) { silu_mul_scalar(gate, up, dst, 0, d); }

SiluMulRow pick_silu_mul_row() {
#ifdef ADPFLEET_X86_VECTORS
  if (adpfleet::exp_vector_bits() == 512) return silu_mul_avx512;
  if (adpfleet::exp_vector_bits() == 256) return silu_mul_avx2;
#endif
  return silu_mul_plain;
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "silu_and_mul");
  TORCH_CHECK(x.size(-1) % 2 == 0, "silu_and_mul: the last dimension (", x.size(-1), ") must be even");
  static const SiluMulRow row = pick_silu_mul_row();
  const auto rows = x.reshape({-1, x.size(-1)});
  const int64_t n = rows.size(0), d = x.size(-1) / 2, stride = rows.stride(0);
  auto sizes = x.sizes().vec();
  sizes.back() = d;
  auto out = at::empty(sizes, x.options());
  const float* in = rows.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, grain(2 * d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) row(in + t * stride, in + t * stride + d, o + t * d, d);
  });
  return out;
}

// One row: sum = x (+ residual), out = w * (sum * rsqrt(mean(sum^2) + eps)).
void norm_row(const float* x, const float* residual, float* sum, const float* w, float* out, int64_t n, double eps) {
  float squares = 0.0f;
  const float* src = x;
  if (residual != nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) sum[i] = x[i] + residual[i];
    src = sum;
  }
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < n; ++i) squares += src[i] * src[i];
  const float scale = 1.0f / std::sqrt(squares / static_cast<float>(n) + static_cast<float>(eps));
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (src[i] * scale);
}

std::tuple<at::Tensor, at::Tensor> norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                        const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.numel() == n && weight.is_contiguous() && weight.scalar_type() == at::kFloat,
              "rms_norm: expected a contiguous float32 weight of ", n, " elements");
  const auto rows = x.reshape({-1, n});
  at::Tensor res_rows, sum;
  if (residual) {
    TORCH_CHECK(residual->sizes() == x.sizes(), "add_rms_norm: residual ", residual->sizes(), " vs x ", x.sizes());
    res_rows = residual->reshape({-1, n});
    TORCH_CHECK(res_rows.stride(-1) == 1, "add_rms_norm: the residual's last dimension must be contiguous");
    sum = at::empty(x.sizes(), x.options());
  }
  auto out = at::empty(x.sizes(), x.options());
  const float* w = weight.data_ptr<float>();
  at::parallel_for(0, rows.size(0), grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      norm_row(rows.data_ptr<float>() + t * rows.stride(0),
               residual ? res_rows.data_ptr<float>() + t * res_rows.stride(0) : nullptr,
               residual ? sum.data_ptr<float>() + t * n : nullptr, w, out.data_ptr<float>() + t * n, n, eps);
    }
  });
  return {out, sum};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return std::get<0>(norm(x, c10::nullopt, weight, eps));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  return norm(x, residual, weight, eps);
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_rows(x, "rope");
  TORCH_CHECK(x.dim() == 3, "rope: expected x of [tokens, heads, head_dim], got ", x.sizes());
  const int64_t t_n = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == t_n * dim && sin.numel() == t_n * dim,
              "rope: expected contiguous cos and sin of [", t_n, ", 1, ", dim, "]");
  auto out = at::empty({t_n, heads, dim}, x.options());
  const float* in = x.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t ts = x.stride(0), hs = x.stride(1);
  at::parallel_for(0, t_n, grain(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        const float* src = in + t * ts + h * hs;
        float* dst = o + (t * heads + h) * dim;
        const float* ct = c + t * dim;
        const float* st = s + t * dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) dst[i] = src[i] * ct[i] + (-src[i + half]) * st[i];
#pragma omp simd
        for (int64_t i = half; i < dim; ++i) dst[i] = src[i] * ct[i] + src[i - half] * st[i];
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(adpfleet, m) {
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(adpfleet, CPU, m) {
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope", &rope);
}
