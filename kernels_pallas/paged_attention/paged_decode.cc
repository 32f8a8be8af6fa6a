// Decode attention: one query token per row against the row's paged K/V (an XLA FFI handler).
//
// XLA's form (`paged_attention_reference`) walks the page table in a loop over blocks of 128
// positions, each iteration gathering a block of K and of V, transposing them and running small
// dots and reductions. At batch 32 of the benchmark model its three attention layers took 6-7 ms
// of an 85 ms step, for well under a millisecond of arithmetic. Here a task takes one row and one
// KV head: it reads the row's keys once for the scores of the head's query group, takes the
// softmax, and reads the values once for the outputs.
//
// q f32[B, H, D] (head h = kv * G + g); k, v [P, S, Hkv, D], f32 (FlipjaxPagedDecode) or bf16
// (FlipjaxPagedDecodeBf16, widened exactly), or 8-bit, int8 (FlipjaxPagedDecodeInt8) or fp8
// e4m3fn (FlipjaxPagedDecodeFp8), followed by k_scale, v_scale f32[P, Hkv]: element [p, s, h, d]
// is worth pages[p, s, h, d] * scale[p, h]. An 8-bit position is widened exactly once for the
// whole group, and its scale applied once to each score and probability rather than to every
// element, so 8-bit pages cost bf16's arithmetic for half its bytes. page_table s32[B, W];
// positions s32[B], the query's position, which attends to positions 0..pos (-1: a padding row,
// whose output is zero). Returns f32[B, H, D]. A page id outside [0, P) among a row's first
// pos / S + 1 entries is an error: the engine never makes one, and reading it would read
// another buffer.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cache_line.h"
#include "fast_exp.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;                    // partial sums per dot (a vector's width)
constexpr int64_t kWorkPerThread = 1 << 18;  // multiply-adds that pay for waking a thread

// Positions whose scores are taken together, and floats per vector register: a Block.
#if defined(__AVX512F__)
constexpr int64_t kBlock = 16;
constexpr int kRegisters = 32;
#else
constexpr int64_t kBlock = 8;
constexpr int kRegisters = 16;
#endif
typedef float Block __attribute__((vector_size(kBlock * sizeof(float))));

// The most queries of a group whose sums of `per_query` Blocks each stay in the registers at
// once, with a few left for the operands (at least one query; at most 7, as instantiated).
constexpr int QueriesPerTile(int per_query) {
  const int fit = (kRegisters - 4) / per_query;
  return fit < 1 ? 1 : fit > 7 ? 7 : fit;
}

// f(count, g0) over the group's queries [0, group) in tiles: `count` a std::integral_constant of
// kMax queries, then one tile of the rest.
template <int kCount, typename F>
void RestTile(int64_t rest, int64_t g0, F& f) {
  if constexpr (kCount >= 1) {
    if (rest == kCount) return f(std::integral_constant<int, kCount>{}, g0);
    RestTile<kCount - 1>(rest, g0, f);
  }
}

template <int kMax, typename F>
void ByTiles(int64_t group, F f) {
  int64_t g = 0;
  for (; g + kMax <= group; g += kMax) f(std::integral_constant<int, kMax>{}, g);
  RestTile<kMax - 1>(group - g, g, f);
}

inline Block LoadBlock(const float* p) {
  Block v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float Widen(float x) { return x; }

inline float Widen(uint16_t bits) {  // a bf16 is the top half of an fp32
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &word, sizeof x);
  return x;
}

// fp8 e4m3fn's bits, a type of their own so that they widen by their format, not as a number.
struct Fp8 { uint8_t bits; };

inline float Widen(int8_t x) { return static_cast<float>(x); }

// Exact, and written so that GCC vectorizes it (a 256-entry table becomes a gather, measured 3x
// slower; building a subnormal from its mantissa as an integer, 1.5x). A normal number moves its
// exponent from bias 7 to 127. A subnormal (exponent 0), m * 2^-9, is first made the normal
// (1 + m/8) * 2^-6, from which 2^-6 is then subtracted exactly; decoding it as an fp32 subnormal
// instead would fail where XLA's threads treat those as zero. 0x7F and 0xFF (NaN) are never
// written: flipjax clamps to +-448 before the cast.
inline float Widen(Fp8 x) {
  const uint32_t b = x.bits;
  const bool subnormal = (b & 0x78u) == 0;
  const uint32_t word = ((b & 0x7Fu) << 20) + ((subnormal ? 121u : 120u) << 23);
  float magnitude;
  std::memcpy(&magnitude, &word, sizeof magnitude);
  magnitude -= subnormal ? 0x1p-6f : 0.0f;
  return (b & 0x80u) ? -magnitude : magnitude;
}

template <typename T>
constexpr bool kEightBit = std::is_same_v<T, int8_t> || std::is_same_v<T, Fp8>;

// One scale per page and KV head, f32[P, Hkv] (8-bit pages); none for float pages.
struct Scales {
  const float *k = nullptr, *v = nullptr;
  ffi::Span<const int64_t> k_dims, v_dims;
};

// The largest of x[0..n), n > 0, a Block of lanes at a time: a max is exact in any order, and
// std::max_element went one value at a time, each compare waiting on the one before.
inline float Largest(const float* x, int64_t n) {
  float top = x[0];
  int64_t j = 0;
#if defined(__GNUC__) && !defined(__clang__)  // a select of vectors, as GCC writes one
  if (n >= kBlock) {
    Block lanes = LoadBlock(x);
    for (j = kBlock; j + kBlock <= n; j += kBlock) {
      const Block next = LoadBlock(x + j);
      lanes = next > lanes ? next : lanes;
    }
    for (int64_t l = 0; l < kBlock; ++l) top = std::max(top, lanes[l]);
  }
#endif
  for (; j < n; ++j) top = std::max(top, x[j]);
  return top;
}

template <typename T>
float Dot(const float* a, const T* b, int64_t d) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += a[i + l] * Widen(b[i + l]);
  }
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  for (; i < d; ++i) sum += a[i] * Widen(b[i]);
  return sum;
}

bool SameShape(ffi::Span<const int64_t> a, ffi::Span<const int64_t> b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

struct Shape {
  int64_t rows, heads, dim, pages, page_size, kv_heads, width;
};

// A task's buffers, reused from one of its rows to the next.
struct Scratch {
  std::vector<float> scaled, scores, row, keys, inverse;
};

// Row b's KV head kv in `page` of `pool`: its first position (a page holds its positions
// `kv_heads * dim` elements apart).
template <typename T>
const T* PageAt(const Shape& s, const T* pool, int64_t page, int64_t kv) {
  return pool + (page * s.page_size * s.kv_heads + kv) * s.dim;
}

// Positions 0..n-1 of row b's KV head kv in `pool`, page by page, in runs of at most `run`
// positions of one page: f(j, x, m, scale) for each run's first position j, its values x (a
// page holds its positions `stride` elements apart), its length m and its page's scale (8-bit
// pages; 1 for float ones, which have none, so it folds away). Found one position at a time by
// dividing it by the page size, each read had cost two integer divisions.
//
// With `ahead`, the next page's positions are requested into L2 as a page is begun: a row's
// pages lie anywhere in the pool, so the hardware's prefetchers cannot follow from one to the
// next (keys read so, from memory: 6-10% faster at 8 and 32 rows; values, walked once for a
// tile of the group's queries, 3-20%). Two or three pages ahead ran no faster than one.
template <typename T, typename F>
void EachRun(const Shape& s, const T* pool, const float* page_scales, const int32_t* table,
             int64_t b, int64_t kv, int64_t n, int64_t run, F f, bool ahead = false) {
  const int64_t stride = s.kv_heads * s.dim;
  for (int64_t j0 = 0; j0 < n; j0 += s.page_size) {
    const int64_t page = table[b * s.width + j0 / s.page_size];
    if (ahead && j0 + s.page_size < n) {
      const T* next = PageAt(s, pool, table[b * s.width + j0 / s.page_size + 1], kv);
      const int64_t positions = std::min(s.page_size, n - j0 - s.page_size);
      for (int64_t j = 0; j < positions; ++j) flipjax::RequestLines<2>(next + j * stride, s.dim);
    }
    float scale = 1.0f;
    if constexpr (kEightBit<T>) scale = page_scales[page * s.kv_heads + kv];
    const T* x = PageAt(s, pool, page, kv);
    const int64_t last = std::min(n, j0 + s.page_size);
    for (int64_t j = j0; j < last; j += run, x += run * stride) {
      f(j, x, std::min(run, last - j), scale);
    }
  }
}

#if defined(__GNUC__) && !defined(__clang__)
typedef int32_t Lanes __attribute__((vector_size(kBlock * sizeof(int32_t))));

// One stage of a square transpose in registers: for rows a and b = a + h (a's bit h clear),
// element (a, c + h) trades places with (b, c), for every c whose bit h is clear. A stage for
// each bit of a row's index transposes the rows.
template <int64_t h>
inline void TransposeStage(Block* rows) {
  Lanes first, second;
  for (int64_t c = 0; c < kBlock; ++c) {
    first[c] = static_cast<int32_t>((c & h) ? kBlock + (c ^ h) : c);
    second[c] = static_cast<int32_t>((c & h) ? kBlock + c : (c ^ h));
  }
  for (int64_t a = 0; a < kBlock; ++a) {
    if (a & h) continue;
    const Block x = rows[a], y = rows[a | h];
    rows[a] = __builtin_shuffle(x, y, first);
    rows[a | h] = __builtin_shuffle(x, y, second);
  }
}
#endif

// The m <= kBlock keys from `keys` (each `stride` apart) into `transposed` [d, kBlock], widened
// to floats, zeros after the m-th. Float keys whose d is a multiple of kBlock go a square of
// kBlock x kBlock at a time through registers: one element at a time, the copy took longer
// than the scores it serves.
template <typename T>
void Transpose(const T* keys, int64_t stride, int64_t m, int64_t d, float* transposed) {
#if defined(__GNUC__) && !defined(__clang__)
  if constexpr (std::is_same_v<T, float>) {
    if (d % kBlock == 0) {
      for (int64_t c = 0; c < d; c += kBlock) {
        Block rows[kBlock];
        for (int64_t jj = 0; jj < kBlock; ++jj) {
          rows[jj] = jj < m ? LoadBlock(keys + jj * stride + c) : Block{};
        }
        TransposeStage<1>(rows);
        TransposeStage<2>(rows);
        TransposeStage<4>(rows);
        if constexpr (kBlock == 16) TransposeStage<8>(rows);
        for (int64_t ii = 0; ii < kBlock; ++ii) {  // a store a row (one copy of all: a rep movs)
          std::memcpy(transposed + (c + ii) * kBlock, &rows[ii], sizeof(Block));
        }
      }
      return;
    }
  }
#endif
  for (int64_t jj = 0; jj < kBlock; ++jj) {
    const T* x = keys + jj * stride;
    for (int64_t i = 0; i < d; ++i) transposed[i * kBlock + jj] = jj < m ? Widen(x[i]) : 0.0f;
  }
}

// scores[g, j] = q'[g] . k_j for a block of up to kBlock positions of one page (`keys` is that
// page's first position of the block; the block's scale `scale`): the keys are copied, widened,
// into `transposed` [d, kBlock], so that each query's dot is kBlock lanes of multiply-adds over
// d, with no sum across a vector's lanes. One position at a time, every dot ended in 16
// dependent adds: at batch 32 of the benchmark model the kernel took 1.45 ms a layer. The
// group's queries go a tile at a time, each row of `transposed` loaded once for the tile: one
// query at a time, its four chains of multiply-adds waited on their own latency.
template <typename T>
void BlockScores(const float* scaled, int64_t group, int64_t d, const T* keys, int64_t stride,
                 int64_t m, float scale, float* transposed, float* scores, int64_t n) {
  Transpose(keys, stride, m, d, transposed);
  ByTiles<QueriesPerTile(4)>(group, [&](auto count, int64_t g0) {
    constexpr int kQueries = decltype(count)::value;
    Block sum[kQueries][4] = {};  // over i mod 4: four chains of multiply-adds a query
    for (int64_t i = 0; i < d; i += 4) {
      for (int u = 0; u < 4; ++u) {
        const Block t = LoadBlock(transposed + (i + u) * kBlock);
        for (int g = 0; g < kQueries; ++g) sum[g][u] += scaled[(g0 + g) * d + i + u] * t;
      }
    }
    for (int g = 0; g < kQueries; ++g) {
      const Block total = (sum[g][0] + sum[g][1]) + (sum[g][2] + sum[g][3]);
      for (int64_t jj = 0; jj < m; ++jj) scores[(g0 + g) * n + jj] = scale * total[jj];
    }
  });
}

// Blocks of a head's values taken in one walk: the head's kChunks (a power of two), or halves of
// it until two queries' sums of them fit the registers.
constexpr int ChunksPerWalk(int chunks) {
  return chunks > 1 && QueriesPerTile(chunks) < 2 ? ChunksPerWalk(chunks / 2) : chunks;
}

// o[g] = inverse[g] * sum over positions j of p[g, j] * v_j, for float pages whose head is
// kChunks Blocks wide: each query's sums stay in registers over all positions (in memory, read
// and written back at every position, they made a chain of stores and loads). The group's
// queries go a tile at a time over the values (over a part of the head at a time, where a
// tile of two would not fit the registers otherwise: AVX2's 64-wide heads): one query at a
// time, a 64-wide head's four chains (AVX-512) waited on their own latency, and the values were
// walked once for each query.
template <int kChunks>
void BlockValues(const Shape& s, const float* v, const int32_t* table, int64_t b, int64_t kv,
                 int64_t n, const float* p, const float* inverse, float* o) {
  constexpr int64_t d = kChunks * kBlock;
  constexpr int kPart = ChunksPerWalk(kChunks);
  for (int c0 = 0; c0 < kChunks; c0 += kPart) {
    ByTiles<QueriesPerTile(kPart)>(s.heads / s.kv_heads, [&](auto count, int64_t g0) {
      constexpr int kQueries = decltype(count)::value;
      Block acc[kQueries][kPart] = {};
      EachRun(s, v, nullptr, table, b, kv, n, 1, [&](int64_t j, const float* x, int64_t, float) {
        for (int g = 0; g < kQueries; ++g) {
          const float pj = p[(g0 + g) * n + j];
          for (int c = 0; c < kPart; ++c) acc[g][c] += pj * LoadBlock(x + (c0 + c) * kBlock);
        }
      }, /*ahead=*/true);
      for (int g = 0; g < kQueries; ++g) {
        for (int c = 0; c < kPart; ++c) {
          const Block out = acc[g][c] * inverse[g0 + g];
          std::memcpy(o + (g0 + g) * d + (c0 + c) * kBlock, &out, sizeof out);
        }
      }
    });
  }
}

// Row b, KV head kv: out[b, kv * G + g, :] for each g of the group.
template <typename T>
void Attend(const Shape& s, const float* q, const T* k, const T* v, Scales scales,
            const int32_t* table, int32_t position, int64_t b, int64_t kv, float* out,
            Scratch& scratch) {
  const int64_t group = s.heads / s.kv_heads, d = s.dim, stride = s.kv_heads * d;
  float* o = out + (b * s.heads + kv * group) * d;
  std::fill(o, o + group * d, 0.0f);
  if (position < 0) return;
  const int64_t n = static_cast<int64_t>(position) + 1;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  scratch.scaled.resize(group * d);
  scratch.scores.resize(group * n);
  scratch.row.resize(d);
  scratch.inverse.resize(group);
  float* scaled = scratch.scaled.data();
  float* scores = scratch.scores.data();
  float* row = scratch.row.data();
  float* inverse = scratch.inverse.data();
  const float* qb = q + (b * s.heads + kv * group) * d;
  for (int64_t i = 0; i < group * d; ++i) scaled[i] = qb[i] * scale;
  // A position's d values as floats: float pages' own; 8-bit ones widened once into `row` (in
  // L1) for the whole group.
  auto floats = [&](const T* x) {
    if constexpr (kEightBit<T>) {
      for (int64_t i = 0; i < d; ++i) row[i] = Widen(x[i]);
      return static_cast<const float*>(row);
    } else {
      return x;
    }
  };
  if (d % 4 == 0) {
    scratch.keys.resize(d * kBlock);
    EachRun(s, k, scales.k, table, b, kv, n, kBlock, [&](int64_t j, const T* x, int64_t m,
                                                         float ks) {
      BlockScores(scaled, group, d, x, stride, m, ks, scratch.keys.data(), scores + j, n);
    }, /*ahead=*/true);
  } else {
    EachRun(s, k, scales.k, table, b, kv, n, 1, [&](int64_t j, const T* x, int64_t, float ks) {
      const auto* kj = floats(x);
      for (int64_t g = 0; g < group; ++g) scores[g * n + j] = ks * Dot(scaled + g * d, kj, d);
    });
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * n;
    const float top = Largest(sg, n);
    // The exps in a loop of their own, vectorized (the C library's expf, one call a position,
    // was an eighth of the kernel's time at batch 32); summed after, in the same order.
    for (int64_t j = 0; j < n; ++j) sg[j] = flipjax::Exp(sg[j] - top);
  }
  // Each query's total in order of position, the group's queries side by side: one query at a
  // time, each add waited on the one before.
  std::fill(inverse, inverse + group, 0.0f);
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t g = 0; g < group; ++g) inverse[g] += scores[g * n + j];
  }
  for (int64_t g = 0; g < group; ++g) inverse[g] = 1.0f / inverse[g];
  if constexpr (std::is_same_v<T, float>) {
    switch (d % kBlock == 0 ? d / kBlock : 0) {
      case 2: return BlockValues<2>(s, v, table, b, kv, n, scores, inverse, o);
      case 4: return BlockValues<4>(s, v, table, b, kv, n, scores, inverse, o);
      case 8: return BlockValues<8>(s, v, table, b, kv, n, scores, inverse, o);
      case 16: return BlockValues<16>(s, v, table, b, kv, n, scores, inverse, o);
    }
  }
  EachRun(s, v, scales.v, table, b, kv, n, 1, [&](int64_t j, const T* x, int64_t, float vs) {
    const auto* vj = floats(x);
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * n + j] * vs;
      float* og = o + g * d;
      for (int64_t i = 0; i < d; ++i) og[i] += p * Widen(vj[i]);
    }
  });
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t i = 0; i < d; ++i) o[g * d + i] *= inverse[g];
  }
}

template <typename T>
ffi::Error Decode(ffi::ThreadPool& threads, ffi::Buffer<ffi::F32>& q, const T* k, const T* v,
                  ffi::Span<const int64_t> kd, ffi::Span<const int64_t> vd,
                  ffi::Buffer<ffi::S32>& table, ffi::Buffer<ffi::S32>& positions,
                  ffi::ResultBuffer<ffi::F32>& out, Scales scales = {}) {
  if (!SameShape(kd, vd)) {
    return ffi::Error::InvalidArgument("paged decode: K and V pages differ in shape");
  }
  const auto qd = q.dimensions(), td = table.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || positions.dimensions().size() != 1 ||
      td[0] != qd[0] || positions.dimensions()[0] != qd[0] || kd[3] != qd[2] || kd[2] == 0 ||
      qd[1] % kd[2] != 0) {
    return ffi::Error::InvalidArgument(
        "paged decode: need q [B, H, D], pages [P, S, Hkv, D] with Hkv dividing H, "
        "page_table [B, W] and positions [B]");
  }
  const Shape s{qd[0], qd[1], qd[2], kd[0], kd[1], kd[2], td[1]};
  if constexpr (kEightBit<T>) {
    const std::vector<int64_t> want{s.pages, s.kv_heads};
    if (!SameShape(scales.k_dims, want) || !SameShape(scales.v_dims, want)) {
      return ffi::Error::InvalidArgument(
          "paged decode: k_scale and v_scale must be f32[P, Hkv] = [" + std::to_string(s.pages) +
          ", " + std::to_string(s.kv_heads) + "], one per page and KV head");
    }
  }
  const int32_t* tp = table.typed_data();
  const int32_t* pos = positions.typed_data();
  int64_t deepest = 0;
  for (int64_t b = 0; b < s.rows; ++b) {
    if (pos[b] < 0) continue;
    const int64_t used = pos[b] / s.page_size + 1;
    if (used > s.width) {
      return ffi::Error::InvalidArgument("paged decode: row " + std::to_string(b) +
                                         " is past its page table");
    }
    for (int64_t i = 0; i < used; ++i) {
      if (tp[b * s.width + i] < 0 || tp[b * s.width + i] >= s.pages) {
        return ffi::Error::InvalidArgument("paged decode: row " + std::to_string(b) +
                                           " names page " + std::to_string(tp[b * s.width + i]) +
                                           " outside the pool");
      }
    }
    deepest = std::max<int64_t>(deepest, pos[b] + 1);
  }
  const float* qp = q.typed_data();
  float* op = out->typed_data();
  const int64_t work = s.rows * s.heads * deepest * s.dim * 2;
  const int64_t max_threads = std::max<int64_t>(1, work / kWorkPerThread);
  flipjax::ParallelFor(threads, s.rows * s.kv_heads, 4, max_threads,
                       [=](int64_t first, int64_t last) {
                         Scratch scratch;
                         for (int64_t item = first; item < last; ++item) {
                           const int64_t b = item / s.kv_heads, kv = item % s.kv_heads;
                           Attend(s, qp, k, v, scales, tp, pos[b], b, kv, op, scratch);
                         }
                       });
  return ffi::Error::Success();
}

ffi::Error PagedDecodeImpl(ffi::ThreadPool threads, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                           ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> positions,
                           ffi::ResultBuffer<ffi::F32> out) {
  return Decode(threads, q, k.typed_data(), v.typed_data(), k.dimensions(), v.dimensions(), table,
                positions, out);
}

ffi::Error PagedDecodeBf16Impl(ffi::ThreadPool threads, ffi::Buffer<ffi::F32> q,
                               ffi::Buffer<ffi::BF16> k, ffi::Buffer<ffi::BF16> v,
                               ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> positions,
                               ffi::ResultBuffer<ffi::F32> out) {
  const auto* kb = reinterpret_cast<const uint16_t*>(k.untyped_data());
  const auto* vb = reinterpret_cast<const uint16_t*>(v.untyped_data());
  return Decode(threads, q, kb, vb, k.dimensions(), v.dimensions(), table, positions, out);
}

// 8-bit pages of XLA type `E`, read as `T`s. They arrive as untyped buffers because the FFI
// header maps no C++ type to F8E4M3FN (so `ffi::Buffer<F8E4M3FN>` does not compile).
template <ffi::DataType E, typename T>
ffi::Error PagedDecode8BitImpl(ffi::ThreadPool threads, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                               ffi::AnyBuffer v, ffi::Buffer<ffi::F32> k_scale,
                               ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> table,
                               ffi::Buffer<ffi::S32> positions, ffi::ResultBuffer<ffi::F32> out) {
  if (k.element_type() != E || v.element_type() != E) {
    return ffi::Error::InvalidArgument(
        std::string("paged decode: this handler takes K and V pages of ") +
        (E == ffi::S8 ? "int8" : "float8_e4m3fn"));
  }
  const Scales scales{k_scale.typed_data(), v_scale.typed_data(), k_scale.dimensions(),
                      v_scale.dimensions()};
  return Decode(threads, q, static_cast<const T*>(k.untyped_data()),
                static_cast<const T*>(v.untyped_data()), k.dimensions(), v.dimensions(), table,
                positions, out, scales);
}

auto Bind8Bit() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()  // q
      .Arg<ffi::AnyBuffer>()         // k pages
      .Arg<ffi::AnyBuffer>()         // v pages
      .Arg<ffi::Buffer<ffi::F32>>()  // k_scale
      .Arg<ffi::Buffer<ffi::F32>>()  // v_scale
      .Arg<ffi::Buffer<ffi::S32>>()  // page table
      .Arg<ffi::Buffer<ffi::S32>>()  // positions
      .Ret<ffi::Buffer<ffi::F32>>();  // out
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlipjaxPagedDecode, PagedDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k pages
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page table
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlipjaxPagedDecodeBf16, PagedDecodeBf16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // k pages
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // v pages
                                  .Arg<ffi::Buffer<ffi::S32>>()   // page table
                                  .Arg<ffi::Buffer<ffi::S32>>()   // positions
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlipjaxPagedDecodeInt8, (PagedDecode8BitImpl<ffi::S8, int8_t>),
                              Bind8Bit());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlipjaxPagedDecodeFp8, (PagedDecode8BitImpl<ffi::F8E4M3FN, Fp8>),
                              Bind8Bit());
