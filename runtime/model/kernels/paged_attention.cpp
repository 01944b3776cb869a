// Paged attention for uniform decode batches on the CPU, reading K/V in place through block tables.
//
// torch.ops.adpfleet.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens,
//                                          tokens_per_block, scale) -> out
//   q            [R * query_len, H, D]   the decode tokens, request by request (uniform decode)
//   k/v_cache    [slots, KVH, D]         one layer of the paged cache (slot = block * tokens_per_block + offset)
//   block_tables [R, W] int32            each request's blocks (padded with the null block)
//   seq_lens     [R] int32               tokens in the cache per request, this pass's queries included
// Query j of request r sits at position seq_lens[r] - query_len + j and attends to keys 0..that
// position (causal within the query block, so draft tokens work like the last real token).
//
// One task is (request, KV head): the H / KVH query heads that share the KV head, times the
// query tokens, against that request's keys, read block by block where they live. Tasks are
// handed out longest first from a shared counter to torch's intra-op threads, so both cores
// stay busy whatever the mix of lengths. The inner loops are compiled for AVX-512, AVX2 and
// baseline x86-64 (GCC target_clones), and the right one is picked when the library loads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace {

struct Shape {
  int64_t kv_heads, group, head_dim, query_len, tokens_per_block, table_width, num_slots;
  float scale;
};

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

// Blocks are scattered over the cache, so the hardware prefetcher loses the stream at every
// block boundary (and every 4 KiB page): fetch the key `kPrefetchAhead` positions ahead.
constexpr int64_t kPrefetchAhead = 4;

// Where token `pos` of a request keeps its K (or V) for the task's heads: its block, its slot in
// the block, then `offset` elements into the slot's row.
template <typename T>
inline const T* token_row(const T* cache, const int32_t* block_table, int64_t pos, int64_t bs, int64_t stride,
                          int64_t offset) {
  return cache + (static_cast<int64_t>(block_table[pos / bs]) * bs + pos % bs) * stride + offset;
}

template <typename T>
inline void prefetch(const T* cache, const int32_t* block_table, int64_t pos, int64_t bs, int64_t stride,
                     int64_t offset, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(token_row(cache, block_table, pos, bs, stride, offset));
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
}

// One task: request r's queries for the KV heads [h0, h1) and the query heads that share them.
// Rows are (query token j, KV head, group member g), stored scaled in `qbuf`; each key of the
// request is read once (the task's heads sit side by side in the cache, so a block is one
// contiguous run), scored against every row that sees it; then each value is read once.
template <typename T>
__attribute__((always_inline)) inline void attend_task(
    const T* __restrict q, const T* __restrict k_cache, const T* __restrict v_cache,
    const int32_t* __restrict block_table, int64_t seq_len, int64_t h0, int64_t h1, const Shape& s,
    T* __restrict out, std::vector<float>& qbuf, std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t D = s.head_dim, G = s.group, QL = s.query_len, NKV = h1 - h0;
  const int64_t rows_per_token = NKV * G, rows = QL * rows_per_token;
  const int64_t heads = s.kv_heads * G, key_stride = s.kv_heads * D, bs = s.tokens_per_block;
  qbuf.resize(rows * D);
  scores.resize(rows * seq_len);
  acc.assign(rows * D, 0.0f);
  for (int64_t j = 0; j < QL; ++j) {
    const T* src = q + (j * heads + h0 * G) * D;
    float* dst = qbuf.data() + j * rows_per_token * D;
    for (int64_t i = 0; i < rows_per_token * D; ++i) dst[i] = to_float(src[i]) * s.scale;
  }
  // Query token j sits at position first_query_pos + j and sees keys 0 .. first_query_pos + j.
  const int64_t first_query_pos = seq_len - QL;

  const int64_t task_bytes = NKV * D * static_cast<int64_t>(sizeof(T));
  for (int64_t pos = 0; pos < seq_len; ++pos) {
    if (pos + kPrefetchAhead < seq_len)
      prefetch(k_cache, block_table, pos + kPrefetchAhead, bs, key_stride, h0 * D, task_bytes);
    const T* k = token_row(k_cache, block_table, pos, bs, key_stride, h0 * D);
    for (int64_t j = std::max<int64_t>(0, pos - first_query_pos); j < QL; ++j)
      for (int64_t h = 0; h < NKV; ++h)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = (j * NKV + h) * G + g;
          const float* qr = qbuf.data() + r * D;
          const T* kh = k + h * D;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qr[d] * to_float(kh[d]);
          scores[r * seq_len + pos] = dot;
        }
  }
  std::vector<float> denom(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = first_query_pos + r / rows_per_token + 1;
    float* sr = scores.data() + r * seq_len;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) m = std::max(m, sr[i]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      sr[i] = std::exp(sr[i] - m);
      sum += sr[i];
    }
    denom[r] = sum;
  }
  for (int64_t pos = 0; pos < seq_len; ++pos) {
    if (pos + kPrefetchAhead < seq_len)
      prefetch(v_cache, block_table, pos + kPrefetchAhead, bs, key_stride, h0 * D, task_bytes);
    const T* v = token_row(v_cache, block_table, pos, bs, key_stride, h0 * D);
    for (int64_t j = std::max<int64_t>(0, pos - first_query_pos); j < QL; ++j)
      for (int64_t h = 0; h < NKV; ++h)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = (j * NKV + h) * G + g;
          const float p = scores[r * seq_len + pos];
          const T* vh = v + h * D;
          float* ar = acc.data() + r * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ar[d] += p * to_float(vh[d]);
        }
  }
  for (int64_t j = 0; j < QL; ++j) {
    T* dst = out + (j * heads + h0 * G) * D;
    for (int64_t i = 0; i < rows_per_token; ++i) {
      const int64_t r = j * rows_per_token + i;
      const float inv = 1.0f / denom[r];
      for (int64_t d = 0; d < D; ++d) dst[i * D + d] = static_cast<T>(acc[r * D + d] * inv);
    }
  }
}

#define ADPFLEET_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

#define ADPFLEET_TASK(NAME, T)                                                                    \
  ADPFLEET_CLONES void NAME(const T* q, const T* k_cache, const T* v_cache,                      \
                            const int32_t* block_table, int64_t seq_len, int64_t h0, int64_t h1, \
                            const Shape& s, T* out, std::vector<float>& qbuf,                     \
                            std::vector<float>& scores, std::vector<float>& acc) {                \
    attend_task<T>(q, k_cache, v_cache, block_table, seq_len, h0, h1, s, out, qbuf, scores, acc);    \
  }

ADPFLEET_TASK(attend_f32, float)
ADPFLEET_TASK(attend_bf16, c10::BFloat16)
ADPFLEET_TASK(attend_f16, c10::Half)

inline void attend(const float* q, const float* k, const float* v, const int32_t* bt, int64_t n, int64_t h0, int64_t h1,
                   const Shape& s, float* o, std::vector<float>& a, std::vector<float>& b, std::vector<float>& c) {
  attend_f32(q, k, v, bt, n, h0, h1, s, o, a, b, c);
}
inline void attend(const c10::BFloat16* q, const c10::BFloat16* k, const c10::BFloat16* v, const int32_t* bt,
                   int64_t n, int64_t h0, int64_t h1, const Shape& s, c10::BFloat16* o, std::vector<float>& a,
                   std::vector<float>& b, std::vector<float>& c) {
  attend_bf16(q, k, v, bt, n, h0, h1, s, o, a, b, c);
}
inline void attend(const c10::Half* q, const c10::Half* k, const c10::Half* v, const int32_t* bt, int64_t n,
                   int64_t h0, int64_t h1, const Shape& s, c10::Half* o, std::vector<float>& a, std::vector<float>& b,
                   std::vector<float>& c) {
  attend_f16(q, k, v, bt, n, h0, h1, s, o, a, b, c);
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const int32_t* lens,
         const int32_t* tables, const std::vector<int64_t>& order, const Shape& s, at::Tensor& out) {
  const int64_t R = static_cast<int64_t>(order.size()), KVH = s.kv_heads, HD = s.kv_heads * s.group * s.head_dim;
  // Whole requests (all KV heads: one contiguous run per block) when there are enough of them to
  // share out; otherwise each request's KV heads split into chunks so no thread sits idle.
  const int64_t threads = at::get_num_threads();
  const int64_t chunks = std::min<int64_t>(KVH, (4 * threads + R - 1) / R);
  const int64_t num_tasks = R * chunks;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(threads, num_tasks);
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qbuf, scores, acc;
    for (int64_t w = begin; w < end; ++w)
      for (int64_t t = next++; t < num_tasks; t = next++) {
        const int64_t r = order[t / chunks], c = t % chunks, first = r * s.query_len * HD;
        attend(qp + first, kp, vp, tables + r * s.table_width, lens[r], c * KVH / chunks, (c + 1) * KVH / chunks,
               s, op + first, qbuf, scores, acc);
      }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                  int64_t tokens_per_block, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
              "paged_decode_attention: q must be [tokens, heads, head_dim] and the caches [slots, kv_heads, head_dim]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "paged_decode_attention: q and the caches must share a dtype");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode_attention: q and the caches must be contiguous");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(),
              "paged_decode_attention: block_tables must be a contiguous int32 [requests, blocks]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == at::kInt && seq_lens.size(0) == block_tables.size(0),
              "paged_decode_attention: seq_lens must be int32 [requests]");
  const int64_t R = block_tables.size(0), T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D, "paged_decode_attention: head_dim of q and the caches differ");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "paged_decode_attention: heads must be a multiple of kv_heads");
  TORCH_CHECK(tokens_per_block > 0, "paged_decode_attention: tokens_per_block must be positive");
  auto out = at::empty_like(q);
  if (R == 0) {
    TORCH_CHECK(T == 0, "paged_decode_attention: tokens without requests");
    return out;
  }
  // The uniform-decode invariant, again at the kernel's door: tokens == requests x query_len.
  TORCH_CHECK(T % R == 0, "paged_decode_attention: uniform decode violated: ", T, " tokens for ", R, " requests");
  const Shape s{KVH, H / KVH, D, T / R, tokens_per_block, block_tables.size(1), k_cache.size(0),
                static_cast<float>(scale)};
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = lens[r];
    TORCH_CHECK(n >= s.query_len, "paged_decode_attention: request ", r, " has ", n,
                " tokens, fewer than the query length ", s.query_len);
    const int64_t blocks = (n + tokens_per_block - 1) / tokens_per_block;
    TORCH_CHECK(blocks <= s.table_width, "paged_decode_attention: request ", r, " needs ", blocks,
                " blocks, its block table has ", s.table_width);
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t block = tables[r * s.table_width + b];
      TORCH_CHECK(block >= 0 && (block + 1) * tokens_per_block <= s.num_slots, "paged_decode_attention: request ",
                  r, " names block ", block, ", outside the cache");
    }
  }
  // Longest tasks first, then a shared counter: no thread waits on one that drew the long ones.
  std::vector<int64_t> order(R);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return lens[a] > lens[b]; });
  switch (q.scalar_type()) {
    case at::kFloat: run<float>(q, k_cache, v_cache, lens, tables, order, s, out); break;
    case at::kBFloat16: run<c10::BFloat16>(q, k_cache, v_cache, lens, tables, order, s, out); break;
    case at::kHalf: run<c10::Half>(q, k_cache, v_cache, lens, tables, order, s, out); break;
    default: TORCH_CHECK(false, "paged_decode_attention: dtype ", q.scalar_type(), " is not supported");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(adpfleet, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, int tokens_per_block, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(adpfleet, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
