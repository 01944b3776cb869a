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
// One task is (request, KV heads): the H / KVH query heads that share each KV head, times the
// query tokens, against that request's keys and then its values, each read once, token by token
// in address order (the task's heads side by side: a block is one contiguous run), and used for
// every query row of its KV head while it is in L1. Scores are the small GEMM [rows x D] x [D x W]
// per tile of W keys (16 with AVX-512, 8 below): each (row, key) product stays a W-lane vector
// until the tile is done, and one reduction tree sums the tile's W vectors at once, where a dot
// product per key and query head paid a horizontal sum each (vLLM's CPU attention tiles its
// blocks the same way). Tasks are handed out longest first from a shared counter to torch's
// intra-op threads, so both cores stay busy whatever the mix of lengths. The task bodies are
// compiled for AVX-512, AVX2 and baseline x86-64, and the right one is picked when the library
// loads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

namespace {

struct Shape {
  int64_t kv_heads, group, head_dim, query_len, tokens_per_block, table_width, num_slots;
  float scale;
};

#define ADPFLEET_INLINE __attribute__((always_inline)) inline

template <typename T>
ADPFLEET_INLINE float to_float(T x) { return static_cast<float>(x); }

// W floats (and W lane indices) in one GCC vector: one AVX-512 register at W = 16, one AVX2 one at 8.
template <int W> struct Lanes;
template <> struct Lanes<16> {
  typedef float F __attribute__((vector_size(64)));
  typedef int32_t I __attribute__((vector_size(64)));
};
template <> struct Lanes<8> {
  typedef float F __attribute__((vector_size(32)));
  typedef int32_t I __attribute__((vector_size(32)));
};

template <int W>
ADPFLEET_INLINE typename Lanes<W>::F load(const float* p) {
  typename Lanes<W>::F v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <int W>
ADPFLEET_INLINE void store(float* p, typename Lanes<W>::F v) { std::memcpy(p, &v, sizeof v); }

// One level of the reduction tree: x and y each fold their groups of 2H lanes to H (lane i + H
// onto lane i), x's groups then y's side by side in the result.
template <int W, int H>
ADPFLEET_INLINE typename Lanes<W>::F fold(typename Lanes<W>::F x, typename Lanes<W>::F y) {
  typename Lanes<W>::I lo;
  for (int i = 0; i < W; ++i) lo[i] = (i / H) * 2 * H + i % H;
  return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, lo + H);
}

// a[0..2H) -> a[0..H), level by level, until a[0] lane t holds the sum of the lanes of the first a[t].
template <int W, int H>
ADPFLEET_INLINE void fold_levels(typename Lanes<W>::F* a) {
  for (int i = 0; i < H; ++i) a[i] = fold<W, H>(a[2 * i], a[2 * i + 1]);
  if constexpr (H > 1) fold_levels<W, H / 2>(a);
}

// One query row against one key: the W lanes of q * k summed over head_dim's vectors, not yet
// across lanes (a tile's W of them are summed at once by the tree above).
template <int W>
ADPFLEET_INLINE typename Lanes<W>::F dot_lanes(const float* q, const float* k, int64_t D) {
  typename Lanes<W>::F acc = {};
  int64_t c = 0;
  for (; c + W <= D; c += W) acc += load<W>(q + c) * load<W>(k + c);
  for (; c < D; ++c) acc[0] += q[c] * k[c];  // a head_dim that is not a whole number of vectors
  return acc;
}

// acc[0, D) += p * v[0, D)
template <int W>
ADPFLEET_INLINE void axpy(float* acc, float p, const float* v, int64_t D) {
  const typename Lanes<W>::F pv = typename Lanes<W>::F{} + p;
  int64_t c = 0;
  for (; c + W <= D; c += W) store<W>(acc + c, load<W>(acc + c) + pv * load<W>(v + c));
  for (; c < D; ++c) acc[c] += p * v[c];
}

// Per-thread buffers, reused across tasks.
struct Scratch {
  std::vector<float> qbuf, scores, partial, acc, row, zeros, denom;
};

// A task's layout: rows are (query token j, KV head h, group member g), row r = (j NKV + h) G + g;
// a row's scores sit at scores[r * width ...], width = seq_len rounded up to whole tiles.
struct Task {
  int64_t seq_len, h0, kv_heads, rows, width, first_query_pos;
};

// Blocks are scattered over the cache, so the hardware prefetcher loses the stream at every block
// boundary (and every 4 KiB page): fetch the key `kPrefetchAhead` positions ahead.
constexpr int64_t kPrefetchAhead = 4;

// Token `pos`'s K (or V) row for the task's heads, as floats: in place for a float cache, converted
// into scratch otherwise; the token kPrefetchAhead later is fetched meanwhile.
template <typename T>
ADPFLEET_INLINE const float* token_row(const T* cache, const int32_t* block_table, int64_t pos, const Task& task,
                                       const Shape& s, Scratch& m) {
  const int64_t bs = s.tokens_per_block, row_len = task.kv_heads * s.head_dim;
  auto where = [&](int64_t p) {
    return cache + ((static_cast<int64_t>(block_table[p / bs]) * bs + p % bs) * s.kv_heads + task.h0) * s.head_dim;
  };
  if (pos + kPrefetchAhead < task.seq_len) {
    const char* next = reinterpret_cast<const char*>(where(pos + kPrefetchAhead));
    for (int64_t b = 0; b < row_len * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(next + b);
  }
  const T* src = where(pos);
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    for (int64_t i = 0; i < row_len; ++i) m.row[i] = to_float(src[i]);
    return m.row.data();
  }
}

// Pass 1: every row's scores. Keys are read in address order (token by token, the task's heads
// side by side), each once, against every query row of its KV head; a row's dot products stay
// W-lane vectors until a tile of W keys is done, when one reduction tree sums all W. Query token
// j's rows skip tiles wholly past what it sees (softmax and pass 2 read only the keys a row sees).
template <typename T, int W>
ADPFLEET_INLINE void score_keys(const T* k_cache, const int32_t* block_table, const Task& task, const Shape& s,
                                Scratch& m) {
  const int64_t D = s.head_dim, G = s.group, per_token = task.kv_heads * G;
  float* partial = m.partial.data();  // [row][key in tile][lane]
  for (int64_t pos0 = 0; pos0 < task.seq_len; pos0 += W) {
    const int64_t j0 = std::max<int64_t>(0, pos0 - task.first_query_pos);
    for (int64_t t = 0; t < W; ++t) {
      const int64_t pos = pos0 + t;
      const float* row = pos < task.seq_len ? token_row(k_cache, block_table, pos, task, s, m) : m.zeros.data();
      for (int64_t j = j0; j < s.query_len; ++j)
        for (int64_t i = 0; i < per_token; ++i) {  // i = h G + g reads KV head i / G
          const int64_t r = j * per_token + i;
          store<W>(partial + (r * W + t) * W, dot_lanes<W>(m.qbuf.data() + r * D, row + i / G * D, D));
        }
    }
    for (int64_t r = j0 * per_token; r < task.rows; ++r) {
      typename Lanes<W>::F a[W];
      for (int t = 0; t < W; ++t) a[t] = load<W>(partial + (r * W + t) * W);
      fold_levels<W, W / 2>(a);
      store<W>(m.scores.data() + r * task.width + pos0, a[0]);
    }
  }
}

// Query rows, scaled, as floats: qbuf[r * D ...].
template <typename T>
ADPFLEET_INLINE void load_queries(const T* q, const Task& task, const Shape& s, std::vector<float>& qbuf) {
  const int64_t D = s.head_dim, per_token = task.kv_heads * s.group * D, heads = s.kv_heads * s.group;
  qbuf.resize(task.rows * D);
  for (int64_t j = 0; j < s.query_len; ++j) {
    const T* src = q + (j * heads + task.h0 * s.group) * D;
    float* dst = qbuf.data() + j * per_token;
    for (int64_t i = 0; i < per_token; ++i) dst[i] = to_float(src[i]) * s.scale;
  }
}

// Each row's softmax over the keys it sees, unnormalised (denominators into denom).
ADPFLEET_INLINE void softmax_rows(const Task& task, const Shape& s, Scratch& m, std::vector<float>& denom) {
  const int64_t rows_per_token = task.rows / s.query_len;
  denom.resize(task.rows);
  for (int64_t r = 0; r < task.rows; ++r) {
    const int64_t n = task.first_query_pos + r / rows_per_token + 1;
    float* sr = m.scores.data() + r * task.width;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, sr[i]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      sr[i] = std::exp(sr[i] - mx);
      sum += sr[i];
    }
    denom[r] = sum;
  }
}

// Pass 2: every row's weighted sum of the values, read in address order, each once.
template <typename T, int W>
ADPFLEET_INLINE void weigh_values(const T* v_cache, const int32_t* block_table, const Task& task, const Shape& s,
                                  Scratch& m) {
  const int64_t D = s.head_dim, G = s.group, per_token = task.kv_heads * G;
  m.acc.assign(task.rows * D, 0.0f);
  for (int64_t pos = 0; pos < task.seq_len; ++pos) {
    const float* row = token_row(v_cache, block_table, pos, task, s, m);
    for (int64_t j = std::max<int64_t>(0, pos - task.first_query_pos); j < s.query_len; ++j)
      for (int64_t i = 0; i < per_token; ++i) {
        const int64_t r = j * per_token + i;
        axpy<W>(m.acc.data() + r * D, m.scores[r * task.width + pos], row + i / G * D, D);
      }
  }
}

// One task: request r's queries for the KV heads [h0, h1) and the query heads that share them.
// Each key and each value of the request is read from memory once (the task's heads sit side by
// side in the cache, so a block is one contiguous run).
template <typename T, int W>
ADPFLEET_INLINE void attend_task(const T* q, const T* k_cache, const T* v_cache, const int32_t* block_table,
                                 int64_t seq_len, int64_t h0, int64_t h1, const Shape& s, T* out, Scratch& m) {
  const int64_t D = s.head_dim, rows = s.query_len * (h1 - h0) * s.group;
  const Task task{seq_len, h0, h1 - h0, rows, (seq_len + W - 1) / W * W, seq_len - s.query_len};
  load_queries(q, task, s, m.qbuf);
  m.scores.resize(rows * task.width);
  m.partial.resize(rows * W * W);
  m.row.resize(task.kv_heads * D);
  m.zeros.assign(task.kv_heads * D, 0.0f);
  score_keys<T, W>(k_cache, block_table, task, s, m);
  softmax_rows(task, s, m, m.denom);
  weigh_values<T, W>(v_cache, block_table, task, s, m);
  const int64_t heads = s.kv_heads * s.group, per_token = rows / s.query_len;
  for (int64_t j = 0; j < s.query_len; ++j) {
    T* dst = out + (j * heads + h0 * s.group) * D;
    for (int64_t i = 0; i < per_token; ++i) {
      const int64_t r = j * per_token + i;
      const float inv = 1.0f / m.denom[r];
      for (int64_t d = 0; d < D; ++d) dst[i * D + d] = static_cast<T>(m.acc[r * D + d] * inv);
    }
  }
}

// The task body of each dtype, compiled for each ISA: 16-key tiles with AVX-512, 8 below.
#define ADPFLEET_TASK(NAME, TARGET, T, W)                                                                   \
  TARGET void NAME(const T* q, const T* k, const T* v, const int32_t* bt, int64_t n, int64_t h0, int64_t h1, \
                   const Shape& s, T* o, Scratch& m) {                                                      \
    attend_task<T, W>(q, k, v, bt, n, h0, h1, s, o, m);                                                     \
  }
#define ADPFLEET_TASKS(T, SUFFIX)                                                            \
  ADPFLEET_TASK(attend_##SUFFIX##_avx512, __attribute__((target("avx512f,avx512bw,fma"))), T, 16) \
  ADPFLEET_TASK(attend_##SUFFIX##_avx2, __attribute__((target("avx2,fma,f16c"))), T, 8)       \
  ADPFLEET_TASK(attend_##SUFFIX##_plain, , T, 8)

ADPFLEET_TASKS(float, f32)
ADPFLEET_TASKS(c10::BFloat16, bf16)
ADPFLEET_TASKS(c10::Half, f16)

template <typename T>
using TaskFn = void (*)(const T*, const T*, const T*, const int32_t*, int64_t, int64_t, int64_t, const Shape&, T*,
                        Scratch&);

// The widest body this CPU runs, decided once per dtype.
template <typename T>
TaskFn<T> pick(TaskFn<T> avx512, TaskFn<T> avx2, TaskFn<T> plain) {
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return avx2;
  return plain;
}

template <typename T> TaskFn<T> task_fn();
template <> TaskFn<float> task_fn() {
  static const auto fn = pick<float>(attend_f32_avx512, attend_f32_avx2, attend_f32_plain);
  return fn;
}
template <> TaskFn<c10::BFloat16> task_fn() {
  static const auto fn = pick<c10::BFloat16>(attend_bf16_avx512, attend_bf16_avx2, attend_bf16_plain);
  return fn;
}
template <> TaskFn<c10::Half> task_fn() {
  static const auto fn = pick<c10::Half>(attend_f16_avx512, attend_f16_avx2, attend_f16_plain);
  return fn;
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
  const TaskFn<T> attend = task_fn<T>();
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(threads, num_tasks);
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t w = begin; w < end; ++w)
      for (int64_t t = next++; t < num_tasks; t = next++) {
        const int64_t r = order[t / chunks], c = t % chunks, first = r * s.query_len * HD;
        attend(qp + first, kp, vp, tables + r * s.table_width, lens[r], c * KVH / chunks, (c + 1) * KVH / chunks,
               s, op + first, scratch);
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
