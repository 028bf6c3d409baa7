// Dense-layer dots for the row counts of decoding and tree verification on
// x86-64 CPUs with AVX2 + FMA, as XLA FFI custom calls:
//   DartRowsMatmul{F32,BF16}: out[m, n] = sum_k x[m, k] * w[n, k]  (w [N, K])
// x and out are float32; w is float32 or bfloat16 (widened exactly to float32),
// stored [out, in] (the checkpoint layout).
//   DartRowsArgmax: out[r] = the first index of the maximum of logits[r, :]
// (greedy tokens; XLA:CPU's reductions take 0.2-0.9 ms for 1-6 rows of a
// 49152-token vocabulary, this loop tens of microseconds).
//   DartTopPThreshold: out[r] = the smallest logit top-p sampling keeps in row r
// (XLA:CPU sorts the whole vocabulary for it: ~14 ms a row of 49152).
//   DartTreeAttention: softmax attention of T new tokens over a head-major KV
// cache's first lengths[b] positions and the tree tokens their mask allows,
// one call per layer (scores, mask, softmax and the weighted values fused;
// see TreeAttention below).
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
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
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

// ---------------------------------------------------------------- AMX

// On a CPU with AMX-BF16 (Intel Sapphire Rapids and later) bf16 weights go
// through the tile unit instead: each row of x is split exactly into three
// bf16 parts (hi + mid + lo == x up to ~2^-24 |x|, as precision.split3 does),
// the parts are the columns of B, a block of 16 weight rows is A, and
// TDPBF16PS accumulates C[n, c] += sum_k A[n, k] B[k, c] in float32 (bf16
// products are exact in float32). So one pass reads each weight once and
// does 16 columns (5 rows of x) per tile product: a tree of 33 tokens costs
// little more than one token. A column's sum runs over k in the same order
// whatever else the call holds, so the result is M-invariant like the AVX2
// path; the three parts of a row are added as sum_split3 adds them.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define DART_HAVE_AMX 1

bool g_amx_enabled = false;

constexpr int kAmxRowsPerBlock = 5;      // rows of x per 16-column block (3 parts each)
constexpr int64_t kAmxK = 32;            // bf16 values of k per tile row

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3 accumulate C, 4-5 hold A (weights), 6-7 hold B (x parts); all 16
// rows of 64 bytes.
inline void ConfigureTiles() {
  TileConfig config{};
  config.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// One column block of B: rows [5 j, 5 j + 5) of x [M, K] -> [K/2, 16, 2] bf16
// (the VNNI layout TDPBF16PS reads): pair kk, column 3 i + p holds part p of
// x[5 j + i, 2 kk .. 2 kk + 1]; column 15 and rows past M are zero. The parts
// are rounded to nearest even by VCVTNEPS2BF16; 16 values of k are 8 pairs,
// one 32-bit word each, scattered 16 words apart.
void PackSplitBlock(const float* x, int64_t m_dim, int64_t k_dim, int64_t block,
                    uint16_t* packed) {
  std::memset(packed, 0, k_dim * 16 * sizeof(uint16_t));
  const __m256i stride = _mm256_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112);
  for (int i = 0; i < kAmxRowsPerBlock; ++i) {
    const int64_t m = block * kAmxRowsPerBlock + i;
    if (m >= m_dim) break;
    int32_t* column = reinterpret_cast<int32_t*>(packed) + 3 * i;
    for (int64_t k = 0; k < k_dim; k += 16) {
      const __m512 v = _mm512_loadu_ps(x + m * k_dim + k);
      const __m256bh hi = _mm512_cvtneps_pbh(v);
      const __m512 rest = _mm512_sub_ps(v, _mm512_cvtpbh_ps(hi));
      const __m256bh mid = _mm512_cvtneps_pbh(rest);
      const __m256bh lo = _mm512_cvtneps_pbh(_mm512_sub_ps(rest, _mm512_cvtpbh_ps(mid)));
      int32_t* words = column + (k / 2) * 16;
      _mm256_i32scatter_epi32(words, stride, reinterpret_cast<__m256i>(hi), 4);
      _mm256_i32scatter_epi32(words + 1, stride, reinterpret_cast<__m256i>(mid), 4);
      _mm256_i32scatter_epi32(words + 2, stride, reinterpret_cast<__m256i>(lo), 4);
    }
  }
}

// out[m, n] for the rows of column block `block` from its C tile [16 n, 16 c].
inline void UnpackSplitRows(const float* c_tile, int64_t block, int64_t m_dim,
                            int64_t n_dim, int64_t n, float* out) {
  for (int i = 0; i < kAmxRowsPerBlock; ++i) {
    const int64_t m = block * kAmxRowsPerBlock + i;
    if (m >= m_dim) break;
    for (int r = 0; r < 16; ++r) {
      const float* parts = c_tile + r * 16 + 3 * i;
      out[m * n_dim + n + r] = parts[0] + (parts[1] + parts[2]);
    }
  }
}

// NB blocks of 16 weight rows at w (row n) against JB column blocks from
// `block`: C tiles over all of k, then unpacked into out.
template <int NB, int JB>
inline void AmxTile(const uint16_t* w, const uint16_t* packed, int64_t block, int64_t m_dim,
                    int64_t k_dim, int64_t n_dim, int64_t n, float* out) {
  _tile_zero(0);
  if (JB > 1) _tile_zero(1);
  if (NB > 1) _tile_zero(2);
  if (NB > 1 && JB > 1) _tile_zero(3);
  const int64_t w_stride = k_dim * int64_t{sizeof(uint16_t)};
  const uint16_t* b0 = packed + block * k_dim * 16;
  const uint16_t* b1 = b0 + k_dim * 16;
  // Tile registers are not renamed, so a tile load waits for the products that
  // read the register before it: with two column blocks each step requests the
  // same columns of the next 2 blocks of weight rows into L2. With one (up to 5
  // rows: decode steps) the hardware prefetchers keep up and the requests only
  // cost issue slots: plain decoding 51.5-51.8 tok/s with them, 58.1-59.7
  // without; DART (two blocks) 74.2-76.5 with, 70.8-72.2 without.
  const char* ahead = reinterpret_cast<const char*>(w + NB * 16 * k_dim);
  for (int64_t k = 0; k < k_dim; k += kAmxK) {
    if (JB > 1)
      for (int r = 0; r < 32; ++r) _mm_prefetch(ahead + r * w_stride + 2 * k, _MM_HINT_T1);
    _tile_loadd(6, b0 + k * 16, 64);
    if (JB > 1) _tile_loadd(7, b1 + k * 16, 64);
    _tile_loadd(4, w + k, w_stride);
    if (NB > 1) _tile_loadd(5, w + 16 * k_dim + k, w_stride);
    _tile_dpbf16ps(0, 4, 6);
    if (JB > 1) _tile_dpbf16ps(1, 4, 7);
    if (NB > 1) _tile_dpbf16ps(2, 5, 6);
    if (NB > 1 && JB > 1) _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float c_tile[16 * 16];
  _tile_stored(0, c_tile, 64);
  UnpackSplitRows(c_tile, block, m_dim, n_dim, n, out);
  if (JB > 1) {
    _tile_stored(1, c_tile, 64);
    UnpackSplitRows(c_tile, block + 1, m_dim, n_dim, n, out);
  }
  if (NB > 1) {
    _tile_stored(2, c_tile, 64);
    UnpackSplitRows(c_tile, block, m_dim, n_dim, n + 16, out);
  }
  if (NB > 1 && JB > 1) {
    _tile_stored(3, c_tile, 64);
    UnpackSplitRows(c_tile, block + 1, m_dim, n_dim, n + 16, out);
  }
}

// Output columns [n_begin, n_end) (multiples of 16) for every row.
void AmxRange(const uint16_t* w, const uint16_t* packed, int64_t m_dim, int64_t k_dim,
              int64_t n_dim, int64_t n_begin, int64_t n_end, float* out) {
  ConfigureTiles();
  const int64_t blocks = (m_dim + kAmxRowsPerBlock - 1) / kAmxRowsPerBlock;
  for (int64_t j = 0; j < blocks; j += 2) {
    const bool pair = j + 1 < blocks;
    int64_t n = n_begin;
    for (; n + 32 <= n_end; n += 32) {
      if (pair) AmxTile<2, 2>(w + n * k_dim, packed, j, m_dim, k_dim, n_dim, n, out);
      else AmxTile<2, 1>(w + n * k_dim, packed, j, m_dim, k_dim, n_dim, n, out);
    }
    if (n < n_end) {
      if (pair) AmxTile<1, 2>(w + n * k_dim, packed, j, m_dim, k_dim, n_dim, n, out);
      else AmxTile<1, 1>(w + n * k_dim, packed, j, m_dim, k_dim, n_dim, n, out);
    }
  }
  _tile_release();
}
#endif  // __AMX_TILE__ && __AMX_BF16__


// ------------------------------------------------------------- the panel form
// DartPanelsMatmulBF16: out[m, 8p + j] = sum_k x[m, k] * w[p, k, j], bf16 weights
// packed [N/8, K, 8] at load time (``dart_jax.models.precision.to_panels``).
//
// Why: the dot form above pays, per FMA, a load of x and (for the first row
// tile) a widened weight vector, and ends every output with a lane sum; at 8
// rows it ran at ~58 GFLOP/s a core in cache on the 2-core Zen 3 (peak ~100),
// and a tree pass is bound by those FMAs, not by the weight stream. Here a
// tile broadcasts x[r, k] (a 4-byte load) against C panel vectors of 8
// outputs each: R x C FMAs per C widened vectors and R broadcasts, no lane
// sums. The embedded model's dense layers at 8 rows, one process alternating
// (session 32, Zen 3): 31.8 ms with the dot form, 21.7 ms with panels.
//
// Numerics: each output is one FMA chain over k in order, started with the
// product at k = 0, whatever M or the tiling is: M-invariant like the dot form
// (a different but fixed order, so a model's numbers for a token still do not
// depend on how many tokens a call holds).

// R rows of x (row stride k_dim) against C panels at w (panel stride k_dim * 8):
// bf16 panels, or float32 ones widened by an earlier tile (`stash`, C panels).
// With `stash` the bf16 panels are widened into it as they are read; with
// `prefetch`, the same offsets two work items ahead are requested into L2.
// Only calls of several row tiles prefetch: whole target passes (session 32,
// Zen 3, one process alternating) at T = 1 / 4 / 6 / 7 / 8 took 16.8 / 22.1 /
// 27.8 / 34.9 / 36.2 ms with no software prefetch, 19.2 / 23.7 / 28.1 / 32.4 /
// 33.0 ms prefetching two items ahead (one item ahead: 19.7 / 23.7 / 30.2 /
// 33.9 / 35.4).
// Fully unrolled, so that the accumulators live in registers.
#define DART_UNROLL _Pragma("GCC unroll 16")

template <int R, int C, bool kFirst, typename W>
inline void PanelStep(const float* x, const W* w, __m256* acc, int64_t k, int64_t k_dim,
                      float* stash) {
  __m256 wv[C];
  DART_UNROLL
  for (int c = 0; c < C; ++c) wv[c] = Load8(w + (c * k_dim + k) * 8);
  if (stash != nullptr) {
    DART_UNROLL
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(stash + (c * k_dim + k) * 8, wv[c]);
  }
  DART_UNROLL
  for (int r = 0; r < R; ++r) {
    const __m256 xb = _mm256_broadcast_ss(x + r * k_dim + k);
    DART_UNROLL
    for (int c = 0; c < C; ++c)
      acc[r * C + c] = kFirst ? _mm256_mul_ps(xb, wv[c])
                              : _mm256_fmadd_ps(xb, wv[c], acc[r * C + c]);
  }
}

template <int R, int C, typename W>
inline void PanelTile(const float* x, const W* w, float* out, int64_t k_dim, int64_t n_dim,
                      float* stash, const char* prefetch) {
  static_assert(R * C + C + 1 <= 17, "accumulators, panels and a broadcast fit 16 ymm");
  __m256 acc[R * C];  // one flat array: GCC kept acc[R][C] partly on the stack
  PanelStep<R, C, true>(x, w, acc, 0, k_dim, stash);
  for (int64_t k = 1; k < k_dim; ++k) {
    if (prefetch != nullptr && (k & 3) == 0) {
      DART_UNROLL
      for (int c = 0; c < C; ++c)
        _mm_prefetch(prefetch + (c * k_dim + k) * 8 * int64_t{sizeof(W)}, _MM_HINT_T1);
    }
    PanelStep<R, C, false>(x, w, acc, k, k_dim, stash);
  }
  DART_UNROLL
  for (int r = 0; r < R; ++r) {
    DART_UNROLL
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(out + r * n_dim + c * 8, acc[r * C + c]);
  }
}

// Rows of x per tile, and panels per tile for that many rows: at least 8
// independent FMA chains (the FMA latency x two pipes) and at most 16 ymm.
inline int PanelRowsPerTile(int64_t m_dim) {
  const int64_t tiles = (m_dim + 5) / 6;
  return static_cast<int>((m_dim + tiles - 1) / tiles);
}

inline int PanelsPerTile(int rows) {
  static constexpr int kPanels[7] = {0, 8, 4, 3, 3, 2, 2};
  return kPanels[rows];
}

template <int C, typename W>
inline void PanelRowTile(int rows, const float* x, const W* w, float* out, int64_t k_dim,
                         int64_t n_dim, float* stash, const char* prefetch) {
  switch (rows) {
#define DART_PANEL_CASE(R)                                                          \
  case R:                                                                           \
    if constexpr (R * C + C + 1 <= 17)                                              \
      PanelTile<R, C>(x, w, out, k_dim, n_dim, stash, prefetch);                    \
    break;
    DART_PANEL_CASE(1) DART_PANEL_CASE(2) DART_PANEL_CASE(3)
    DART_PANEL_CASE(4) DART_PANEL_CASE(5) DART_PANEL_CASE(6)
#undef DART_PANEL_CASE
    default: break;
  }
}

// C panels at w against all m_dim rows: the first row tile reads the bf16
// panels from memory (widening them into the stash when more tiles follow),
// the others read the stash from cache.
template <int C>
void PanelColumn(const float* x, const uint16_t* w, float* out, int64_t m_dim, int64_t k_dim,
                 int64_t n_dim, int rows_per_tile, float* stash, const char* prefetch) {
  const int first = static_cast<int>(std::min<int64_t>(rows_per_tile, m_dim));
  const bool more = m_dim > first;
  PanelRowTile<C>(first, x, w, out, k_dim, n_dim, more ? stash : nullptr, prefetch);
  for (int64_t m = first; m < m_dim; m += rows_per_tile) {
    const int rows = static_cast<int>(std::min<int64_t>(rows_per_tile, m_dim - m));
    PanelRowTile<C, float>(rows, x + m * k_dim, stash, out + m * n_dim, k_dim, n_dim,
                           nullptr, nullptr);
  }
}

template <int C>
void PanelRange(const float* x, const uint16_t* w, float* out, int64_t m_dim, int64_t k_dim,
                int64_t n_dim, int64_t p_begin, int64_t p_end, int64_t panels,
                int rows_per_tile) {
  thread_local std::vector<float> stash;
  const bool several_tiles = m_dim > rows_per_tile;
  if (several_tiles) stash.resize(C * k_dim * 8);
  const int64_t panel_size = k_dim * 8;
  const int64_t ahead = 2 * (p_end - p_begin);  // two work items
  int64_t p = p_begin;
  for (; p + C <= p_end; p += C) {
    const char* prefetch = several_tiles && p + ahead + C <= panels
        ? reinterpret_cast<const char*>(w + (p + ahead) * panel_size) : nullptr;
    PanelColumn<C>(x, w + p * panel_size, out + p * 8, m_dim, k_dim, n_dim, rows_per_tile,
                   stash.data(), prefetch);
  }
  for (; p < p_end; ++p) {  // panels % C: one panel at a time
    stash.resize(k_dim * 8);
    PanelColumn<1>(x, w + p * panel_size, out + p * 8, m_dim, k_dim, n_dim, rows_per_tile,
                   stash.data(), nullptr);
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

#ifdef DART_HAVE_AMX
// The AMX path of RowsMatmul for bf16 weights (k a multiple of 32): x packed
// once per call, work items of whole 16-row blocks of weights; the last n % 16
// columns (none in the models served) take the AVX2 loop.
void AmxMatmul(ffi::ThreadPool& pool, const float* x, const uint16_t* w, float* out,
               int64_t batch, int64_t m_dim, int64_t k_dim, int64_t n_dim) {
  const int64_t blocks = (m_dim + kAmxRowsPerBlock - 1) / kAmxRowsPerBlock;
  const int64_t packed_size = blocks * k_dim * 16;
  thread_local std::vector<uint16_t> packed;
  packed.resize(batch * packed_size);
  uint16_t* pp = packed.data();
  for (int64_t i = 0; i < batch * blocks; ++i) {
    const int64_t b = i / blocks;
    PackSplitBlock(x + b * m_dim * k_dim, m_dim, k_dim, i % blocks,
                   pp + b * packed_size + (i % blocks) * k_dim * 16);
  }
  const int64_t n_tiles = n_dim - n_dim % 16;
  // About four work items per thread, whole pairs of 16-row blocks each: few
  // enough that configuring the tiles per item costs nothing, enough that the
  // threads finish together.
  const int64_t per_thread = 4 * std::max<int64_t>(1, pool.num_threads());
  const int64_t chunk = std::max<int64_t>(32, (n_tiles / per_thread + 31) / 32 * 32);
  const int64_t chunks = (n_tiles + chunk - 1) / chunk;
  const int64_t per_item = chunks + (n_tiles < n_dim ? 1 : 0);
  Parallel(pool, batch * per_item, [=](int64_t i) {
    const int64_t b = i / per_item, j = i % per_item;
    const uint16_t* wb = w + b * n_dim * k_dim;
    float* ob = out + b * m_dim * n_dim;
    if (j < chunks) {
      const int64_t n = j * chunk;
      AmxRange(wb, pp + b * packed_size, m_dim, k_dim, n_dim, n, std::min(n_tiles, n + chunk),
               ob);
    } else {
      Range(x + b * m_dim * k_dim, wb, ob, m_dim, k_dim, n_dim, n_tiles, n_dim);
    }
  });
}
#endif

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
#ifdef DART_HAVE_AMX
  if constexpr (std::is_same_v<W, uint16_t>) {
    if (g_amx_enabled && k_dim % kAmxK == 0) {
      AmxMatmul(pool, xp, wp, op, batch, m_dim, k_dim, n_dim);
      return ffi::Error::Success();
    }
  }
#endif
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

ffi::Error PanelsMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                        ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != 8 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument(
        "panels_matmul: expected x [M, K] and w [N/8, K, 8]");
  const int64_t m_dim = xd[0], k_dim = xd[1], panels = wd[0], n_dim = panels * 8;
  const float* xp = x.typed_data();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.untyped_data());
  float* op = out->typed_data();
  if (m_dim == 0 || panels == 0) return ffi::Error::Success();
  const int rows_per_tile = PanelRowsPerTile(m_dim);
  const int c = PanelsPerTile(rows_per_tile);
  // Work items of about 64 output columns (as the dot form's), whole tiles.
  const int64_t per_item = c * std::max(1, 8 / c);
  const int64_t items = (panels + per_item - 1) / per_item;
  Parallel(pool, items, [=](int64_t i) {
    const int64_t begin = i * per_item, end = std::min(panels, begin + per_item);
    switch (c) {
      case 8: PanelRange<8>(xp, wp, op, m_dim, k_dim, n_dim, begin, end, panels, rows_per_tile); break;
      case 4: PanelRange<4>(xp, wp, op, m_dim, k_dim, n_dim, begin, end, panels, rows_per_tile); break;
      case 3: PanelRange<3>(xp, wp, op, m_dim, k_dim, n_dim, begin, end, panels, rows_per_tile); break;
      default: PanelRange<2>(xp, wp, op, m_dim, k_dim, n_dim, begin, end, panels, rows_per_tile); break;
    }
  });
  return ffi::Error::Success();
}

// logits [R, V] -> out [R]: the first index of each row's maximum. Lane j of
// the vector scan sees indices j, j + 8, ... in order and keeps the first of its
// maxima (a strict, ordered comparison: NaN never wins); the lanes then give the
// maximum and, among the lanes holding it, the smallest index.
ffi::Error RowsArgmax(ffi::Buffer<ffi::F32> logits, ffi::ResultBuffer<ffi::S32> out) {
  auto dims = logits.dimensions();
  if (dims.size() != 2 || dims[1] < 1)
    return ffi::Error::InvalidArgument("rows_argmax: expected logits [R, V] with V >= 1");
  const int64_t rows = dims[0], vocab = dims[1];
  const float* lp = logits.typed_data();
  int32_t* op = out->typed_data();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = lp + r * vocab;
    __m256 best = _mm256_set1_ps(-INFINITY);
    __m256i best_index = _mm256_setzero_si256();
    __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i step = _mm256_set1_epi32(8);
    int64_t v = 0;
    for (; v + 8 <= vocab; v += 8) {
      __m256 value = _mm256_loadu_ps(row + v);
      __m256 greater = _mm256_cmp_ps(value, best, _CMP_GT_OQ);
      best = _mm256_blendv_ps(best, value, greater);
      best_index = _mm256_castps_si256(_mm256_blendv_ps(
          _mm256_castsi256_ps(best_index), _mm256_castsi256_ps(index), greater));
      index = _mm256_add_epi32(index, step);
    }
    alignas(32) float lane_best[8];
    alignas(32) int32_t lane_index[8];
    _mm256_store_ps(lane_best, best);
    _mm256_store_si256(reinterpret_cast<__m256i*>(lane_index), best_index);
    float top = -INFINITY;
    int32_t top_index = 0;
    for (int j = 0; j < 8; ++j) {
      if (lane_best[j] > top || (lane_best[j] == top && lane_index[j] < top_index)) {
        top = lane_best[j];
        top_index = lane_index[j];
      }
    }
    for (; v < vocab; ++v) {  // the tail comes after every scanned index
      if (row[v] > top) {
        top = row[v];
        top_index = static_cast<int32_t>(v);
      }
    }
    op[r] = top_index;
  }
  return ffi::Error::Success();
}

// The smallest logit of the nucleus of one row: walking the logits from the
// largest down, a token is kept while the probability mass strictly before it
// is below top_p (so the largest always is); ties share one value, so the
// result does not depend on their order. Only the top k logits are ordered:
// k grows (x4) until they hold at least top_p of the mass, so the nucleus ends
// inside them. Masses in double precision.
float TopPThreshold(const float* row, int64_t vocab, float top_p, std::vector<float>& scratch) {
  float top = row[0];
  for (int64_t v = 1; v < vocab; ++v) top = std::max(top, row[v]);
  if (!std::isfinite(top)) return top;  // +inf keeps only +inf; all -inf keeps all
  double total = 0.0;
  for (int64_t v = 0; v < vocab; ++v) total += std::exp(static_cast<double>(row[v]) - top);
  scratch.assign(row, row + vocab);
  for (int64_t k = std::min<int64_t>(64, vocab);; k = std::min<int64_t>(4 * k, vocab)) {
    std::nth_element(scratch.begin(), scratch.begin() + (k - 1), scratch.end(),
                     std::greater<float>());
    double mass = 0.0;
    for (int64_t i = 0; i < k; ++i) mass += std::exp(static_cast<double>(scratch[i]) - top);
    if (mass / total >= top_p || k == vocab) {
      std::sort(scratch.begin(), scratch.begin() + k, std::greater<float>());
      double before = 0.0;
      float threshold = scratch[0];
      for (int64_t i = 0; i < k && before / total < top_p; ++i) {
        threshold = scratch[i];
        before += std::exp(static_cast<double>(scratch[i]) - top);
      }
      return threshold;
    }
  }
}

// logits [R, V] -> out [R]: each row's top-p threshold, rows across the pool.
ffi::Error TopPThresholds(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits,
                          ffi::ResultBuffer<ffi::F32> out, float top_p) {
  auto dims = logits.dimensions();
  if (dims.size() != 2 || dims[1] < 1 || !(top_p > 0.0f && top_p <= 1.0f))
    return ffi::Error::InvalidArgument(
        "top_p_threshold: expected logits [R, V] with V >= 1 and 0 < top_p <= 1");
  const int64_t vocab = dims[1];
  const float* lp = logits.typed_data();
  float* op = out->typed_data();
  Parallel(pool, dims[0], [=](int64_t r) {
    thread_local std::vector<float> scratch;
    op[r] = TopPThreshold(lp + r * vocab, vocab, top_p, scratch);
  });
  return ffi::Error::Success();
}


// ------------------------------------------------------------ tree attention
// out[b, t, h G + g] = softmax over the cache positions s < lengths[b] and the
// tree tokens j with mask[b, t, j] of q . k, weighting the values, for the
// query head h G + g of KV head h (G = Hq / Hkv), q scaled by `scale`. One call per
// layer instead of XLA's score dot, masks, exp, sums and two value dots:
// those cost ~4 ms of a 6-token pass of the embedded model on the 2-core Zen 3
// (0.13 ms a layer) and ~1 ms of a one-token pass.
//
// Each query row is computed alone, in the same order whatever the call holds:
// scores (one 8-lane FMA chain over hd and a fixed lane tree, as the dense
// kernel), their maximum, exp(score - max) by a fixed polynomial, the sum and
// the weighted values in position order, cache first.

// exp(x) for x <= 0 (Cephes' single-precision polynomial, ~1 ulp); 0 below
// -87.3 (where exp underflows float32's normal range) and for -inf.
inline __m256 ExpNonPositive(__m256 x) {
  const __m256 low = _mm256_set1_ps(-87.3f);
  const __m256 underflow = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
  x = _mm256_max_ps(x, low);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r),
                                 _mm256_set1_ps(1.0f));
  const __m256i exponent = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(y, _mm256_castsi256_ps(exponent)));
}

// q . k over hd = 8 * V lanes: one FMA chain per lane, then the lane tree.
template <int V, typename K>
inline float Dot(const __m256* q, const K* k) {
  __m256 acc = _mm256_mul_ps(q[0], Load8(k));
  for (int i = 1; i < V; ++i) acc = _mm256_fmadd_ps(q[i], Load8(k + 8 * i), acc);
  return LaneSum(acc);
}

struct AttentionDims {
  int64_t batch, num_tree, num_q_heads, num_kv_heads, cache_size, head_dim;
  float scale;  // of q . k
};

// One query row (batch b, tree token t, query head qh of KV head h).
// `scores` holds at least cache_size + num_tree + 8 floats.
template <int V, typename K>
void AttendRow(const AttentionDims& d, const float* q, const K* k_cache, const K* v_cache,
               int64_t length, const float* k_tree, const float* v_tree, const bool* mask,
               int64_t b, int64_t t, int64_t h, float* out, float* scores) {
  const int64_t hd = d.head_dim;
  __m256 qv[V];  // q * scale, rounded as XLA's multiply would round it
  const __m256 scale = _mm256_set1_ps(d.scale);
  for (int i = 0; i < V; ++i) qv[i] = _mm256_mul_ps(_mm256_loadu_ps(q + 8 * i), scale);
  const K* keys = k_cache + (b * d.num_kv_heads + h) * d.cache_size * hd;
  const K* values = v_cache + (b * d.num_kv_heads + h) * d.cache_size * hd;
  const int64_t tree_stride = d.num_kv_heads * hd;  // between tree tokens
  const float* tree_keys = k_tree + (b * d.num_tree * d.num_kv_heads + h) * hd;
  const float* tree_values = v_tree + (b * d.num_tree * d.num_kv_heads + h) * hd;
  const bool* visible = mask + (b * d.num_tree + t) * d.num_tree;
  // Scores: the cache's first `length`, then the tree (-inf where hidden).
  float top = -INFINITY;
  for (int64_t s = 0; s < length; ++s) {
    scores[s] = Dot<V>(qv, keys + s * hd);
    top = std::max(top, scores[s]);
  }
  for (int64_t j = 0; j < d.num_tree; ++j) {
    float score = -INFINITY;
    if (visible[j]) {
      score = Dot<V>(qv, tree_keys + j * tree_stride);
      top = std::max(top, score);
    }
    scores[length + j] = score;
  }
  __m256 acc[V];
  for (int i = 0; i < V; ++i) acc[i] = _mm256_setzero_ps();
  if (top == -INFINITY) {  // sees nothing: zeros
    for (int i = 0; i < V; ++i) _mm256_storeu_ps(out + 8 * i, acc[i]);
    return;
  }
  // Weights exp(score - top), 8 at a time (padding past the end is -inf -> 0).
  const int64_t total = length + d.num_tree;
  for (int64_t s = total; s < ((total + 7) & ~int64_t{7}); ++s) scores[s] = -INFINITY;
  const __m256 top8 = _mm256_set1_ps(top);
  __m256 sum8 = _mm256_setzero_ps();
  for (int64_t s = 0; s < total; s += 8) {
    const __m256 weight = ExpNonPositive(_mm256_sub_ps(_mm256_loadu_ps(scores + s), top8));
    _mm256_storeu_ps(scores + s, weight);
    sum8 = _mm256_add_ps(sum8, weight);
  }
  const float denom = LaneSum(sum8);  // >= 1: the maximum's own weight
  for (int64_t s = 0; s < length; ++s) {
    const __m256 weight = _mm256_set1_ps(scores[s]);
    const K* value = values + s * hd;
    for (int i = 0; i < V; ++i) acc[i] = _mm256_fmadd_ps(weight, Load8(value + 8 * i), acc[i]);
  }
  for (int64_t j = 0; j < d.num_tree; ++j) {
    if (!visible[j]) continue;
    const __m256 weight = _mm256_set1_ps(scores[length + j]);
    const float* value = tree_values + j * tree_stride;
    for (int i = 0; i < V; ++i) acc[i] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(value + 8 * i), acc[i]);
  }
  const __m256 inverse = _mm256_set1_ps(1.0f / denom);
  for (int i = 0; i < V; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(acc[i], inverse));
}

// Work items: (batch row, KV head, a chunk of its query rows).
template <int V, typename K>
void AttendAll(ffi::ThreadPool& pool, const AttentionDims& d, const float* q, const K* k_cache,
               const K* v_cache, const int32_t* lengths, const float* k_tree,
               const float* v_tree, const bool* mask, float* out) {
  const int64_t group = d.num_q_heads / d.num_kv_heads;
  const int64_t rows = d.num_tree * group;  // per (b, h): t major, then g
  constexpr int64_t kRowsPerItem = 4;
  const int64_t chunks = (rows + kRowsPerItem - 1) / kRowsPerItem;
  Parallel(pool, d.batch * d.num_kv_heads * chunks, [=](int64_t i) {
    const int64_t b = i / (d.num_kv_heads * chunks);
    const int64_t h = (i / chunks) % d.num_kv_heads;
    const int64_t length = std::clamp<int64_t>(lengths[b], 0, d.cache_size);
    thread_local std::vector<float> scores;
    scores.resize(d.cache_size + d.num_tree + 8);
    for (int64_t r = (i % chunks) * kRowsPerItem;
         r < std::min(rows, (i % chunks + 1) * kRowsPerItem); ++r) {
      const int64_t t = r / group, qh = h * group + r % group;
      const int64_t offset = ((b * d.num_tree + t) * d.num_q_heads + qh) * d.head_dim;
      AttendRow<V>(d, q + offset, k_cache, v_cache, length, k_tree, v_tree, mask, b, t, h,
                   out + offset, scores.data());
    }
  });
}

// q [B, T, Hq, hd], k_cache / v_cache [B, Hkv, S, hd] (float32 or
// bf16), lengths [B], k_tree / v_tree [B, T, Hkv, hd], mask [B, T, T] ->
// out [B, T, Hq, hd]; hd one of 16, 32, 64, 128, 256.
template <ffi::DataType KT>
ffi::Error TreeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                         ffi::Buffer<KT> k_cache, ffi::Buffer<KT> v_cache,
                         ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::F32> k_tree,
                         ffi::Buffer<ffi::F32> v_tree, ffi::Buffer<ffi::PRED> mask,
                         ffi::ResultBuffer<ffi::F32> out, float scale) {
  using K = std::conditional_t<KT == ffi::F32, float, uint16_t>;
  auto qd = q.dimensions();
  auto kd = k_cache.dimensions();
  bool ok = qd.size() == 4 && kd.size() == 4 && kd[0] == qd[0] && kd[3] == qd[3] &&
            kd[1] > 0 && qd[2] % kd[1] == 0 && v_cache.dimensions() == kd &&
            lengths.dimensions().size() == 1 && lengths.dimensions()[0] == qd[0] &&
            k_tree.dimensions().size() == 4 && k_tree.dimensions()[0] == qd[0] &&
            k_tree.dimensions()[1] == qd[1] && k_tree.dimensions()[2] == kd[1] &&
            k_tree.dimensions()[3] == qd[3] && v_tree.dimensions() == k_tree.dimensions() &&
            mask.dimensions().size() == 3 && mask.dimensions()[0] == qd[0] &&
            mask.dimensions()[1] == qd[1] && mask.dimensions()[2] == qd[1];
  if (!ok)
    return ffi::Error::InvalidArgument(
        "tree_attention: expected q [B, T, Hq, hd], caches [B, Hkv, S, hd], lengths [B], "
        "tree keys/values [B, T, Hkv, hd] and mask [B, T, T]");
  const AttentionDims d{qd[0], qd[1], qd[2], kd[1], kd[2], qd[3], scale};
  if (d.batch == 0 || d.num_tree == 0) return ffi::Error::Success();
  const K* kc = reinterpret_cast<const K*>(k_cache.untyped_data());
  const K* vc = reinterpret_cast<const K*>(v_cache.untyped_data());
  const bool* mp = reinterpret_cast<const bool*>(mask.untyped_data());
  auto run = [&](auto vectors) {  // hd / 8, a compile-time constant
    AttendAll<decltype(vectors)::value, K>(pool, d, q.typed_data(), kc, vc,
                                           lengths.typed_data(), k_tree.typed_data(),
                                           v_tree.typed_data(), mp, out->typed_data());
  };
  switch (d.head_dim) {
    case 16: run(std::integral_constant<int, 2>{}); break;
    case 32: run(std::integral_constant<int, 4>{}); break;
    case 64: run(std::integral_constant<int, 8>{}); break;
    case 128: run(std::integral_constant<int, 16>{}); break;
    case 256: run(std::integral_constant<int, 32>{}); break;
    default:
      return ffi::Error::InvalidArgument("tree_attention: head_dim must be 16, 32, 64, 128 "
                                         "or 256");
  }
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(DartPanelsMatmulBF16, PanelsMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DartRowsArgmax, RowsArgmax,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DartTopPThreshold, TopPThresholds,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("top_p"));


#define DART_TREE_ATTENTION(NAME, KT)                                        \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, TreeAttention<KT>,                    \
                                ffi::Ffi::Bind()                             \
                                    .Ctx<ffi::ThreadPool>()                  \
                                    .Arg<ffi::Buffer<ffi::F32>>()            \
                                    .Arg<ffi::Buffer<KT>>()                  \
                                    .Arg<ffi::Buffer<KT>>()                  \
                                    .Arg<ffi::Buffer<ffi::S32>>()            \
                                    .Arg<ffi::Buffer<ffi::F32>>()            \
                                    .Arg<ffi::Buffer<ffi::F32>>()            \
                                    .Arg<ffi::Buffer<ffi::PRED>>()           \
                                    .Ret<ffi::Buffer<ffi::F32>>()            \
                                    .Attr<float>("scale"));

DART_TREE_ATTENTION(DartTreeAttentionF32, ffi::F32)
DART_TREE_ATTENTION(DartTreeAttentionBF16, ffi::BF16)

// Asks Linux for the AMX tile state (once per process) and, if granted, sends
// bf16 weights through the AMX path. Returns 1 if that path is on, else 0 (built
// without AMX, or the kernel refused).
extern "C" int DartRowsMatmulEnableAmx() {
#ifdef DART_HAVE_AMX
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  if (!g_amx_enabled)
    g_amx_enabled = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return g_amx_enabled ? 1 : 0;
#else
  return 0;
#endif
}
