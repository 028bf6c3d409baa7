// Dense-layer dots for the row counts of decoding and tree verification on
// x86-64 CPUs with AVX2 + FMA, as XLA FFI custom calls:
//   DartRowsMatmul{F32,BF16}: out[m, n] = sum_k x[m, k] * w[n, k]  (w [N, K])
// x and out are float32; w is float32 or bfloat16 (widened exactly to float32),
// stored [out, in] (the checkpoint layout).
//
// Why: XLA:CPU reads a weight matrix quickly for one row (its own matrix-vector
// loop) but runs two or more rows through a packing GEMM whose cost, on a CPU
// without AMX, grows far faster than the bytes it reads (a 576 x 49152 LM head:
// 3-5 ms for one row, 13-28 ms for nine). At 1-64 rows a dense layer is bound
// by reading its weights once; this loop does that, each block of weight rows
// reused from L1 by every tile of rows.
//
// Numerics: every output is one 8-lane FMA chain over k in order, a fixed lane
// tree, then the k tail in order. That does not depend on M or on the tiling,
// so a model's output for a token does not depend on how many tokens the call
// holds: a tree verified in one pass gets the logits that decoding its tokens
// one by one would (what keeps speculative decoding lossless).

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 Load8(const uint16_t* p) {  // bfloat16 -> float32, exact
  __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

inline float Widen(float v) { return v; }

inline float Widen(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// A fixed reduction tree over the 8 lanes.
inline float LaneSum(__m256 v) {
  __m128 quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 0x1)));
}

// A tile's R x C accumulators, C weight vectors and one x vector stay in
// registers: 16 ymm with AVX2 (3 x 4), 32 with AVX-512VL (4 x 6: 24 FMAs per
// 10 loads instead of 12 per 7). On the 2-core Zen 4 the larger tile took the
// bf16 LM head at 4 / 7 / 16 / 64 rows from 2.7-2.8 / 3.6 / 6.1-6.3 / 19.9-20.8
// ms to 2.0-2.5 / 2.8-3.3 / 5.3-6.1 / 18.6-19.4 ms (two alternating runs).
#ifdef __AVX512VL__
constexpr int kRowTile = 4;  // rows of x per tile
constexpr int kColTile = 6;  // weight rows per tile
#else
constexpr int kRowTile = 3;
constexpr int kColTile = 4;
#endif
static_assert(kRowTile <= 4, "Column handles a remainder of at most 3 rows");

// Requests the weight rows of a column range from memory into L2 ahead of the
// tiles that read them: from one block ahead, at twice the rate a tile reads,
// at most kLead bytes past the block being read. So the weight stream runs
// all the time, also while a block's later row tiles compute from cache.
// On the 2-core Zen 4, all dense layers of the embedded model (bf16 weights
// from memory) at 1 / 4 / 7 / 8 rows took 16.0 / 17.4 / 24.1 / 26.3 ms with
// software prefetch only in the several-row path, and only in a block's first
// tile; 11.6-12.7 / 16.0-16.6 / 21.3-21.7 / 22.5-22.7 ms with this (medians of
// 9, alternating runs); a decode step of the model 23 -> 18 ms.
class Prefetcher {
 public:
  static constexpr int64_t kLead = 8192;

  // Weights [begin, end), read in blocks of `block_bytes`.
  Prefetcher(const void* begin, const void* end, int64_t block_bytes)
      : end_(static_cast<const char*>(end)),
        next_(std::min(end_, static_cast<const char*>(begin) + block_bytes)),
        limit_(next_) {}

  // The tiles now read the block that ends at `block_end`.
  void Reading(const void* block_end) {
    limit_ = std::min(end_, static_cast<const char*>(block_end) + kLead);
  }

  // Called once per step of a tile that reads `bytes` of weights per step.
  inline void Step(int bytes) {
    for (int b = 0; b < 2 * bytes && next_ < limit_; b += 64, next_ += 64)
      _mm_prefetch(next_, _MM_HINT_T1);
  }

 private:
  const char* end_;
  const char* next_;
  const char* limit_;
};

// out[r, c] for R rows of x against C consecutive weight rows at w.
// Optional: `stash` receives the C weight rows widened to float32, for the
// other row tiles of a block of bf16 weights (see Range); `prefetch` requests
// the range's weights ahead.
template <int R, int C, typename W>
inline void Tile(const float* x, const W* w, float* out, int64_t k_dim, int64_t n_dim,
                 float* stash = nullptr, Prefetcher* prefetch = nullptr) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const int64_t k_vec = k_dim & ~int64_t{7};
  for (int64_t k = 0; k < k_vec; k += 8) {
    if (prefetch) prefetch->Step(C * 8 * int{sizeof(W)});
    __m256 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = Load8(w + c * k_dim + k);
    if (stash)
      for (int c = 0; c < C; ++c) _mm256_storeu_ps(stash + c * k_dim + k, wv[c]);
    for (int r = 0; r < R; ++r) {
      __m256 xv = _mm256_loadu_ps(x + r * k_dim + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      float sum = LaneSum(acc[r][c]);
      for (int64_t k = k_vec; k < k_dim; ++k) {
        if (stash && r == 0) stash[c * k_dim + k] = Widen(w[c * k_dim + k]);
        sum = std::fmaf(x[r * k_dim + k], Widen(w[c * k_dim + k]), sum);
      }
      out[r * n_dim + c] = sum;
    }
  }
}

// Every row of x against the C weight rows at w (out points at their first
// column): tiles of kRowTile rows, then one tile of the rows left.
template <int C, typename W>
inline void Column(const float* x, const W* w, float* out, int64_t m_dim,
                   int64_t k_dim, int64_t n_dim, Prefetcher* prefetch) {
  int64_t m = 0;
  for (; m + kRowTile <= m_dim; m += kRowTile)
    Tile<kRowTile, C>(x + m * k_dim, w, out + m * n_dim, k_dim, n_dim, nullptr, prefetch);
  const float* xm = x + m * k_dim;
  float* om = out + m * n_dim;
  switch (m_dim - m) {
    case 3: Tile<3, C>(xm, w, om, k_dim, n_dim, nullptr, prefetch); break;
    case 2: Tile<2, C>(xm, w, om, k_dim, n_dim, nullptr, prefetch); break;
    case 1: Tile<1, C>(xm, w, om, k_dim, n_dim, nullptr, prefetch); break;
    default: break;
  }
}

// Output columns [n_begin, n_end), in blocks of kColTile weight rows. With
// bfloat16 weights and more than one row tile, the first row tile of each
// block reads the bf16 rows and stashes them widened in a float32 buffer that
// the other row tiles read, so the conversion is not repeated per row tile.
// Meanwhile `prefetch` keeps the rows that follow coming from memory (see
// Prefetcher). The FMAs do not depend on either, so the outputs do not.
template <typename W>
void Range(const float* x, const W* w, float* out, int64_t m_dim, int64_t k_dim,
             int64_t n_dim, int64_t n_begin, int64_t n_end) {
  const bool widen_once = std::is_same_v<W, uint16_t> && m_dim > kRowTile;
  thread_local std::vector<float> block;
  if (widen_once) block.resize(kColTile * k_dim);
  Prefetcher prefetch(w + n_begin * k_dim, w + n_end * k_dim,
                      kColTile * k_dim * int64_t{sizeof(W)});
  int64_t n = n_begin;
  for (; n + kColTile <= n_end; n += kColTile) {
    const W* wn = w + n * k_dim;
    prefetch.Reading(wn + kColTile * k_dim);
    if (widen_once) {
      Tile<kRowTile, kColTile>(x, wn, out + n, k_dim, n_dim, block.data(), &prefetch);
      Column<kColTile>(x + kRowTile * k_dim, block.data(), out + kRowTile * n_dim + n,
                       m_dim - kRowTile, k_dim, n_dim, &prefetch);
    } else {
      Column<kColTile>(x, wn, out + n, m_dim, k_dim, n_dim, &prefetch);
    }
  }
  for (; n < n_end; ++n) {
    prefetch.Reading(w + (n + 1) * k_dim);
    Column<1>(x, w + n * k_dim, out + n, m_dim, k_dim, n_dim, &prefetch);
  }
}

// ---------------------------------------------------------------- threads

struct Work {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> active{0};
};

// Runs item(i) for i in [0, items), in order of i, on the calling thread and
// the XLA intra-op pool's other threads.
template <typename Fn>
void Parallel(ffi::ThreadPool& pool, int64_t items, Fn item) {
  const int64_t helpers =
      std::max<int64_t>(0, std::min<int64_t>(pool.num_threads() - 1, items - 1));
  auto work = std::make_shared<Work>();
  auto drain = [=]() {
    work->active.fetch_add(1);
    for (int64_t i; (i = work->next.fetch_add(1)) < items;) item(i);
    work->active.fetch_sub(1);
  };
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([drain]() { drain(); });
  drain();
  // Every item is taken; wait for helpers still running one. A helper that
  // starts later finds no item and touches no buffer.
  while (work->active.load() != 0) std::this_thread::yield();
}

// Rows of x per row block: a block's rows stay in a core's L2 (1 MB on the
// Zen 4) while every weight block meets them. Without row blocks each block of
// kColTile weight rows streamed all of x: a prefill of 64 x 128 tokens
// (8,192 rows, 19 MB of x per layer input) ran at 327 tokens/s against 619 for
// 16 x 128.
constexpr int64_t kRowBlockBytes = 512 * 1024;

inline int64_t RowBlock(int64_t k_dim) {
  const int64_t rows = kRowBlockBytes / (k_dim * int64_t{sizeof(float)});
  return std::max<int64_t>(kRowTile, rows - rows % kRowTile);
}

// x [..., M, K] @ w [..., N, K].T -> out [..., M, N]; the leading (batch) dims
// of x and w are equal (none for a dense layer; batch and key/value heads for
// attention scores, where each item is a few rows against its own keys).
template <ffi::DataType WT>
ffi::Error RowsMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<WT> w,
                      ffi::ResultBuffer<ffi::F32> out) {
  using W = std::conditional_t<WT == ffi::F32, float, uint16_t>;
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  const size_t rank = xd.size();
  bool ok = rank >= 2 && wd.size() == rank && xd[rank - 1] == wd[rank - 1];
  int64_t batch = 1;
  for (size_t i = 0; ok && i + 2 < rank; ++i) {
    ok = xd[i] == wd[i];
    batch *= xd[i];
  }
  if (!ok)
    return ffi::Error::InvalidArgument(
        "rows_matmul: expected x [..., M, K] and w [..., N, K] with equal leading dims");
  const int64_t m_dim = xd[rank - 2], k_dim = xd[rank - 1], n_dim = wd[rank - 2];
  const float* xp = x.typed_data();
  const W* wp = reinterpret_cast<const W*>(w.untyped_data());
  float* op = out->typed_data();
  if (batch == 0 || m_dim == 0 || n_dim == 0) return ffi::Error::Success();
  // Work items: (batch item, row block, column chunk), row block major within
  // an item, so that both threads read the same rows of x while the weights
  // stream.
  constexpr int64_t kColChunk = kColTile * 16;
  const int64_t row_block = RowBlock(k_dim);
  const int64_t col_chunks = (n_dim + kColChunk - 1) / kColChunk;
  const int64_t row_blocks = (m_dim + row_block - 1) / row_block;
  const int64_t per_item = row_blocks * col_chunks;
  Parallel(pool, batch * per_item, [=](int64_t i) {
    const int64_t b = i / per_item, j = i % per_item;
    const int64_t m = (j / col_chunks) * row_block, n = (j % col_chunks) * kColChunk;
    Range(xp + (b * m_dim + m) * k_dim, wp + b * n_dim * k_dim, op + (b * m_dim + m) * n_dim,
          std::min(row_block, m_dim - m), k_dim, n_dim, n, std::min(n_dim, n + kColChunk));
  });
  return ffi::Error::Success();
}

}  // namespace

#define DART_ROWS_MATMUL(NAME, WT)                                           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, RowsMatmul<WT>,                       \
                                ffi::Ffi::Bind()                             \
                                    .Ctx<ffi::ThreadPool>()                  \
                                    .Arg<ffi::Buffer<ffi::F32>>()            \
                                    .Arg<ffi::Buffer<WT>>()                  \
                                    .Ret<ffi::Buffer<ffi::F32>>());

DART_ROWS_MATMUL(DartRowsMatmulF32, ffi::F32)
DART_ROWS_MATMUL(DartRowsMatmulBF16, ffi::BF16)
