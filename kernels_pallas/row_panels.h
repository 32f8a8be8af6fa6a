// The streamed multiply of a few rows by a weight, shared by the native matmul and the native
// grouped (ragged) matmul: y = x @ w with w [K, N] read once, in panels of its columns. Each
// output is the sum over k in order 0..K-1 of fused multiply-adds, so a row's result does not
// depend on how many rows are multiplied with it, or in which group (see matmul/matmul.cc for
// the measurements behind the tile sizes).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include <unistd.h>

#include "cache_line.h"

#if defined(__FMA__) || defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace flipjax::rows {

// Rows per group, and vectors per packed sub-tile (the sub-tile of a full group): their
// accumulators, the sub-tile's row of w and x's broadcast fill the registers. AVX-512: 8 rows x
// 3 vectors, 24 of 32. AVX2: 6 rows x 2 vectors, 12 of 16, so that w's row stays in registers
// too; 4 x 3 left none for it, and each multiply-add read its vector of w again from L1, a
// load per multiply-add, which on a Zen 3 ran at 71 GFLOP/s of one core's 102 where 6 x 2 ran
// at 98 (both from L1).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kRows = 8;
constexpr int kPackedVectors = 3;
#else
constexpr int kLanes = 8;
constexpr int kRows = 6;
constexpr int kPackedVectors = 2;
#endif
constexpr int kPanelVectors = 24;  // the widest task, in vectors (divisible by 8, 6, 3 and 2)
constexpr int64_t kBlock = 64;     // rows of w per pass over a panel
// One group of x's rows of a `wide` task streams w in long runs of its rows instead
// (`OneGroup`): rows of w per pass, and the most outputs a pass keeps in L2 (they are read and
// written once per pass).
constexpr int64_t kWideBlock = 16;
constexpr int64_t kWideOutputs = 1 << 16;
constexpr int kPrefetch = 8;       // rows of w ahead, into L1, within a block
// Bytes of each row of w that groups of x's rows pack at a time (`MultiplyRun`).
constexpr int64_t kRunBytes = 256;
// Multiply-adds that pay for waking a thread: 256 KB of an fp32 weight, about 20 us for one
// thread to read. (At four times this, the one-row products of a 768 x 512 weight, a shared
// expert's, ran on one thread at 14 GB/s: 115 us against 67 us on two.)
constexpr int64_t kWorkPerThread = 1 << 16;

// The most bytes of w a pass of `OneGroup` may span for its next pass to be requested while it
// runs: this CPU's L2 (256 KB where the C library cannot tell). A request is only worth its
// read if the line is still in L2 when the next pass reaches it; a pass of the lm head's 16000
// columns a thread is 1 MB at 4 rows and 4 MB at one, and its requests took the place of the
// lines in use: without them, 1 and 4 rows x [768, 32000] ran 15-43% faster (AVX2, Zen 3, L2
// 512 KB), while a pass of x [2048, 768]'s 384 columns (24 KB) ran 4-25% slower without.
inline int64_t PassAheadBytes() {
  static const int64_t bytes = [] {
#if defined(_SC_LEVEL2_CACHE_SIZE)
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    if (l2 > 0) return static_cast<int64_t>(l2);
#endif
    return int64_t{256} << 10;
  }();
  return bytes;
}

typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint16_t Halves __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t Words __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef int8_t Bytes __attribute__((vector_size(kLanes * sizeof(int8_t))));

// A weight as stored: fp32, bf16 held as its 16 bits, or int8 (a quantized weight, whose
// per-column scale the caller applies to the product).
struct Bf16 {
  uint16_t bits;
};

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline Vec Load(const Bf16* p) {
  Halves h;
  std::memcpy(&h, p, sizeof h);
  const Words w = __builtin_convertvector(h, Words) << 16;
  Vec v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

// An int8 is an integer of at most 8 bits, so its float is exact. Sign-extended to 32 bits and
// converted by the vector instructions: GCC's generic conversion of a byte vector to floats
// ran the int8 product at a third of the fp32 one's rate (48 against 150 GFLOP/s at 32 rows).
inline Vec Load(const int8_t* p) {
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
#else
  Bytes b;
  std::memcpy(&b, p, sizeof b);
  const Vec f = __builtin_convertvector(b, Vec);
#endif
  Vec v;
  std::memcpy(&v, &f, sizeof v);
  return v;
}

// acc + s * w, rounded once where the CPU has FMA, wherever the compiler would put it.
inline Vec MultiplyAdd(float s, Vec w, Vec acc) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(_mm512_set1_ps(s), w, acc);
#elif defined(__FMA__)
  return _mm256_fmadd_ps(_mm256_set1_ps(s), w, acc);
#else
  return acc + s * w;
#endif
}

// The first `width` lanes from p, zeros after them.
template <typename W>
inline Vec LoadPart(const W* p, int width) {
  W part[kLanes] = {};
  std::memcpy(part, p, width * sizeof(W));
  return Load(part);
}

// Lines of w requested into L2 while a packed sub-tile is multiplied: rows of the sub-tile
// (or run of sub-tiles) packed next, from its row k0, spread over the groups of x's rows (group
// `phase` of `every` requests every `every`-th of the `rows`), so the reads go out a few at a
// time beside the arithmetic instead of in a burst while packing.
template <typename W>
struct Ahead {
  const W* w = nullptr;  // none: nothing to request
  int64_t rows = 0;
  int every = 1;
  int phase = 0;
};

// y[0:R, cols] (+)= x[0:R, k0:k1] @ w[k0:k1, cols], cols = V vectors from w's and y's first
// column (rows strided by k for x and n for w and y). With kPartial (V = 1), only the first
// `width` columns are real: w's row is then read a vector wide, into the next row, except
// for the last row, whose tail is copied, and y is read and written `width` wide. The first
// block of rows (k0 = 0) starts from zero, later ones add to y. With kPacked, w holds only
// rows k0..k1 of the V vectors, one after another (`Pack`), and is read in place of memory,
// while `ahead`'s rows are requested, kAheadTiles sub-tiles side by side of each. Unpacked,
// each row's columns `block` rows down are requested into L2 (`block` = k: none).
template <int R, int V, bool kPartial, typename W, bool kPacked = false, int kAheadTiles = 1>
void Block(const float* x, const W* w, float* y, int64_t k, int64_t n, int64_t k0, int64_t k1,
           int width, Ahead<W> ahead, int64_t block) {
  Vec acc[R][V];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) {
      const float* at = y + r * n + v * kLanes;
      acc[r][v] = k0 == 0 ? Vec{} : kPartial ? LoadPart(at, width) : Load(at);
    }
  }
  int64_t due = ahead.phase;  // the next of `ahead`'s rows to request
  for (int64_t i = k0; i < k1; ++i) {
    const W* wi = kPacked ? w + (i - k0) * V * kLanes : w + i * n;
    // The next block is requested while this one is multiplied, so reading memory overlaps
    // the arithmetic of every row group (15-30% faster than only reading ahead in the block,
    // which leaves memory idle while later groups reuse it). Within a block, rows a few ahead
    // are also requested into L1: the first block's come from memory, and a narrow sub-tile
    // (several rows of x) reads each row of w in a few lines that the hardware's prefetchers
    // do not follow across its stride (10% at 8 rows, fp32, from memory; a one-row sub-tile
    // is wide enough to need none after the first block).
    if (!kPacked && i + block < k) {
      RequestLines<1>(wi + block * n, V * kLanes);
    }
    if (!kPacked && (k0 == 0 || R > 1) && i + kPrefetch < k1) {
      RequestLines<3>(wi + kPrefetch * n, V * kLanes);
    }
    if (kPacked && i - k0 == due && due < ahead.rows) {
      RequestLines<1>(ahead.w + due * n, kAheadTiles * V * kLanes);
      due += ahead.every;
    }
    Vec wv[V];
    for (int v = 0; v < V; ++v) {
      wv[v] = kPartial && i == k - 1 ? LoadPart(wi + v * kLanes, width) : Load(wi + v * kLanes);
    }
    for (int r = 0; r < R; ++r) {
      const float s = x[r * k + i];
      for (int v = 0; v < V; ++v) acc[r][v] = MultiplyAdd(s, wv[v], acc[r][v]);
    }
  }
  // Stored through a copy: copying out of acc itself took its address, and GCC then kept the
  // accumulators in memory, storing all of them on every row of w (12 stores to 12 fused
  // multiply-adds, 25 against 63 GFLOP/s for one thread of a Zen 3 from L1).
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) {
      const Vec out = acc[r][v];
      std::memcpy(y + r * n + v * kLanes, &out, (kPartial ? width : kLanes) * sizeof(float));
    }
  }
}

// Block for a group of `rows` rows (1 to kRows).
template <int V, bool kPartial = false, bool kPacked = false, int kAheadTiles = 1, typename W>
void Rows(int rows, const float* x, const W* w, float* y, int64_t k, int64_t n, int64_t k0,
          int64_t k1, int width = kLanes, Ahead<W> ahead = {}, int64_t block = kBlock) {
  switch (rows) {
#define FLIPJAX_ROWS(R) \
  case R:               \
    return Block<R, V, kPartial, W, kPacked, kAheadTiles>(x, w, y, k, n, k0, k1, width, ahead, \
                                                         block);
    FLIPJAX_ROWS(1)
    FLIPJAX_ROWS(2)
    FLIPJAX_ROWS(3)
    FLIPJAX_ROWS(4)
    FLIPJAX_ROWS(5)
    FLIPJAX_ROWS(6)
#if defined(__AVX512F__)
    FLIPJAX_ROWS(7)
    FLIPJAX_ROWS(8)
#endif
#undef FLIPJAX_ROWS
  }
}

// One block of rows of `vectors` columns' vectors for one group of x's rows, in sub-tiles whose
// accumulators fit the registers: the fewer the rows, the wider the sub-tile and the longer each
// read of w. A task's columns are not always a multiple of the sub-tile (an even split of a
// narrow weight), so the last few vectors take narrower tiles.
template <typename W>
void Panel(int rows, int64_t vectors, const float* x, const W* w, float* y, int64_t k, int64_t n,
           int64_t k0, int64_t k1, int64_t block) {
#if defined(__AVX512F__)
  const int sub = rows <= 2 ? 8 : rows <= 4 ? 6 : 3;
#else
  const int sub = rows <= 1 ? 8 : rows <= 2 ? 6 : rows <= 4 ? 3 : kPackedVectors;
#endif
  int64_t v = 0;
  for (; v + sub <= vectors; v += sub) {
    const int64_t c = v * kLanes;
    if (sub == 8) Rows<8>(rows, x, w + c, y + c, k, n, k0, k1, kLanes, {}, block);
    if (sub == 6) Rows<6>(rows, x, w + c, y + c, k, n, k0, k1, kLanes, {}, block);
    if (sub == 3) Rows<3>(rows, x, w + c, y + c, k, n, k0, k1, kLanes, {}, block);
    if (sub == 2) Rows<2>(rows, x, w + c, y + c, k, n, k0, k1, kLanes, {}, block);
  }
  for (; sub >= 3 && v + 3 <= vectors; v += 3) {
    Rows<3>(rows, x, w + v * kLanes, y + v * kLanes, k, n, k0, k1, kLanes, {}, block);
  }
  for (; v < vectors; ++v) {
    Rows<1>(rows, x, w + v * kLanes, y + v * kLanes, k, n, k0, k1, kLanes, {}, block);
  }
}

// How an N-column product is split into tasks of whole vectors: panels of kPanelVectors where
// there are enough of them to keep every thread busy, else the columns split evenly over the
// threads. (Fixed panels split a 512-column weight into 384 and 128 columns, so one of two
// threads did three quarters of the work.) `wide`: one task per thread, a long run of w's
// columns (for one group of x's rows, streamed in passes: `OneGroup`). The columns after the
// last whole vector go with the last task. Tasks start on a whole packed sub-tile
// (kPackedVectors), so that no task ends in a vector too few for one: that vector was
// multiplied from memory a group of x's rows at a time, and an even split of 256 vectors into
// 12 tasks left 8 of them (AVX2, 32 rows: x [768, 2048] twice ran 11-28% faster aligned, x
// [768, 32000] 2-10%, interleaved runs).
struct Columns {
  int64_t tasks;
  int64_t vectors;  // whole vectors in N
  int width;        // columns after them
  bool wide;

  Columns(int64_t n, int64_t threads, bool wide = false)
      : vectors(n / kLanes), width(static_cast<int>(n % kLanes)), wide(wide) {
    const int64_t panels =
        wide ? 1 : std::max<int64_t>(1, (vectors + kPanelVectors - 1) / kPanelVectors);
    tasks = std::min(std::max<int64_t>(1, vectors), (panels + threads - 1) / threads * threads);
  }
  int64_t First(int64_t task) const {  // in vectors
    if (task >= tasks) return vectors;
    return task * (vectors / kPackedVectors) / tasks * kPackedVectors;
  }
};

// Rows k0..k1 of `tiles` sub-tiles of w side by side (rows strided by n) into `packed`, each
// sub-tile's rows one after another, from one read of a run of each row, requesting rows a few
// ahead into L1 (they were requested into L2 while the sub-tile before was multiplied).
template <typename W>
void Pack(const W* w, W* packed, int64_t n, int64_t k0, int64_t k1, int tiles) {
  constexpr int64_t kWidth = kPackedVectors * kLanes;
  for (int64_t i = k0; i < k1; ++i) {
    const W* wi = w + i * n;
    if (i + kPrefetch < k1) RequestLines<3>(wi + kPrefetch * n, tiles * kWidth);
    for (int t = 0; t < tiles; ++t) {
      std::memcpy(packed + (t * (k1 - k0) + i - k0) * kWidth, wi + t * kWidth, kWidth * sizeof(W));
    }
  }
}

// Block k0..k1 of the vectors [from, last) of w too few for a sub-tile, and of the `width`
// columns after them, read in place for each group of x's m rows.
template <typename W>
void Leftovers(int64_t from, int64_t last, int width, const float* x, const W* w, float* y,
               int64_t m, int64_t k, int64_t n, int64_t k0, int64_t k1) {
  for (int64_t v = from; v < last; ++v) {
    for (int64_t r = 0; r < m; r += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, m - r));
      Rows<1>(rows, x + r * k, w + v * kLanes, y + r * n + v * kLanes, k, n, k0, k1);
    }
  }
  const int64_t at = last * kLanes;
  for (int64_t r = 0; width > 0 && r < m; r += kRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kRows, m - r));
    Rows<1, true>(rows, x + r * k, w + at, y + r * n + at, k, n, k0, k1, width);
  }
}

// The rows of x's group `g` of `groups`, when a product's m rows are split into groups of at
// most kRows. Two groups take kRows and the rest (AVX2's 8 rows as 4 + 4 ran 22% slower than
// 6 + 2); three or more share the rows evenly, so that no group is left a few rows whose
// accumulators are too few to keep the FMA units busy (each waits on the latency of its own
// chain): AVX2's 16 rows as 6 + 5 + 5 ran 10% faster than 6 + 6 + 4, 32 rows as 6 + 6 + 5 +
// 5 + 5 + 5 7% faster than five sixes and a two (one thread, fp32 [768, 2048] from memory,
// interleaved). Which group a row is in changes no sum.
inline int GroupRows(int64_t m, int groups, int64_t g) {
  if (groups <= 2) return static_cast<int>(std::min<int64_t>(kRows, m - g * kRows));
  return static_cast<int>(m / groups + (g < m % groups ? 1 : 0));
}

// Sub-tiles packed side by side by `MultiplyRun`: as many as make kRunBytes of a row where a
// sub-tile's row is at most a cache line (AVX2: 4 of fp32, 8 of bf16, 16 of int8); a wider one
// (AVX-512's fp32 and bf16) is packed alone (`MultiplyColumns`).
template <typename W>
constexpr int kRunTiles = kPackedVectors * kLanes * sizeof(W) <= kCacheLineBytes
                              ? static_cast<int>(kRunBytes / (kPackedVectors * kLanes * sizeof(W)))
                              : 1;

// y[0:m, first:last vectors (and `width` columns after them)] = x @ w for two or more groups
// of x's rows (m > kRows), packing kRunTiles sub-tiles of each 64-row block at once. A
// sub-tile of one line (AVX2's fp32) read alone is a column of lines a row apart, which in the
// model's weights (rows a multiple of 1 KB apart) share a few of L1's sets, all of them one set
// where the rows are 4 KB apart ([768, 2048] in fp32: packing it alone ran 25% slower than a
// weight one line wider, memory only); runs of 256 bytes of each row ran 4-36% faster at 7-12
// rows on a Zen 3, paired with packing each sub-tile alone (fp32; the MLP's [768, 2048] and
// the lm head 8-23% at 8 rows), bf16 10-32%, int8 15-35%. From 16 rows on, with the groups'
// rows shared evenly (`GroupRows`), the AVX2 build's fp32 products of a decode step took
// 5-19% less time in runs than a sub-tile at a time at 16 rows and 4-10% less at 32 (two
// threads, weights from memory, a Zen 4, interleaved); on one thread bf16 ran 16-22% faster,
// int8 5-15%, and AVX-512's int8 (5 sub-tiles a run) within noise. A function of its own,
// which `MultiplyColumns` leaves for at once: called from within the panels' loop, or sharing
// their multiplies (which GCC then compiled out of line), it slowed the panels by 4-15%.
template <typename W>
__attribute__((noinline)) void MultiplyRun(int64_t first, int64_t last, int width, const float* x,
                                           const W* w, float* y, int64_t m, int64_t k,
                                           int64_t n) {
  constexpr int kTiles = kRunTiles<W>;
  constexpr int64_t kTile = kPackedVectors * kLanes;
  alignas(64) W packed[kTiles * kBlock * kTile];
  const int64_t tiles = (last - first) / kPackedVectors;
  const int64_t whole = first + tiles * kPackedVectors;
  const int groups = static_cast<int>((m + kRows - 1) / kRows);
  for (int64_t k0 = 0; k0 < k; k0 += kBlock) {
    const int64_t k1 = std::min(k, k0 + kBlock);
    for (int64_t t0 = 0; t0 < tiles; t0 += kTiles) {
      const int count = static_cast<int>(std::min<int64_t>(kTiles, tiles - t0));
      const int64_t v = first + t0 * kPackedVectors;
      Pack(w + v * kLanes, packed, n, k0, k1, count);
      // Requested while this run is multiplied: the block's next run, or the next block's
      // first, a whole run wide (past the task's columns for a short one: a request never
      // faults).
      Ahead<W> ahead{nullptr, 0, count * groups, 0};
      if (t0 + kTiles < tiles) {
        ahead.w = w + k0 * n + (v + kTiles * kPackedVectors) * kLanes;
        ahead.rows = k1 - k0;
      } else if (k1 < k) {
        ahead.w = w + k1 * n + first * kLanes;
        ahead.rows = std::min(k, k1 + kBlock) - k1;
      }
      for (int t = 0; t < count; ++t) {
        const W* tile = packed + t * (k1 - k0) * kTile;
        for (int64_t r = 0, g = 0; r < m; r += GroupRows(m, groups, g), ++g, ++ahead.phase) {
          const int rows = GroupRows(m, groups, g);
          float* yr = y + r * n + (v + t * kPackedVectors) * kLanes;
          Rows<kPackedVectors, false, true, kTiles>(rows, x + r * k, tile, yr, k, n, k0, k1,
                                                    kLanes, ahead);
        }
      }
    }
    Leftovers(whole, last, width, x, w, y, m, k, n, k0, k1);
  }
}

// y[0:rows, first:last vectors (and `width` columns after them)] = x @ w for one group of rows
// (rows <= kRows), reading w in passes of `block` rows over a chunk of the columns (a task of
// a panel's width is one chunk). A task of the `wide` split takes passes of kWideBlock rows, so
// that memory serves kWideBlock runs of a chunk's row at a time (a pass's outputs, read and
// written once each, stay in L2). Read a panel of 24 vectors of each row at a time instead
// (768 bytes under AVX2), w came at 6-7 GB/s on a 2-core Zen 3 whose memory streams long rows
// at 16-19: 4 rows x [768, 32000] and x [768, 2048] ran up to twice as fast this way, 8 rows
// (then two AVX2 groups of 4) 20-60% (two threads, from memory, interleaved runs); passes of 4
// rows were slower than of 8, and 16 beat 8 on most shapes. Past one group, where each group
// reads the pass again, packing it (`MultiplyColumns`) ran 4-30% faster than passes at 7-12
// rows with AVX2's groups of 6.
template <typename W>
void OneGroup(int64_t first, int64_t last, int width, const float* x, const W* w, float* y,
              int rows, int64_t k, int64_t n, int64_t block) {
  const int64_t chunk = std::max<int64_t>(
      kPanelVectors, kWideOutputs / (rows * kLanes) / kPanelVectors * kPanelVectors);
  int64_t c0 = first;
  do {
    const int64_t c1 = std::min(last, c0 + chunk);
    const int64_t pass_bytes = block * ((c1 - c0) * kLanes + width) * int64_t{sizeof(W)};
    const int64_t ahead = pass_bytes <= PassAheadBytes() ? block : k;  // k: none requested
    for (int64_t k0 = 0; k0 < k; k0 += block) {
      const int64_t k1 = std::min(k, k0 + block);
      Panel(rows, c1 - c0, x, w + c0 * kLanes, y + c0 * kLanes, k, n, k0, k1, ahead);
      if (width > 0 && c1 == last) {
        Rows<1, true>(rows, x, w + c1 * kLanes, y + c1 * kLanes, k, n, k0, k1, width, {}, ahead);
      }
    }
    c0 = c1;
  } while (c0 < last);
}

// y[0:m, task's columns] = x[0:m, :] @ w[:, task's columns], rows strided by k (x) and n (w, y).
//
// More rows than one group: every group multiplies each sub-tile of a block of w in turn, from
// a packed copy that stays in L1 for all of them. Read in place, a sub-tile's rows lie a
// multiple of 1 KB apart in the model's weights (their widths are multiples of 256), so they
// fall into a few of L1's sets and evicted each other before the next group read them (at a
// width of a multiple of 1024 fp32 columns, into the same one). Packed, with the weight
// read from memory on two threads (paired runs): [32, 768] x [768, 32000] 11% faster,
// x [768, 2048] 13%, [48-512, 768] x [768, 512] 7-18%; with two groups, 12 rows x [768, 4096]
// 15-18% and x [768, 2048] 8-14%, and the AVX2 build's 8 rows 12-33% (x [768, 32000] within 7%
// either way). Each output's sums are the same.
//
// While a sub-tile is multiplied, the next one's rows are requested into L2 (`Ahead`). Requested
// a block ahead while packing instead, 192 lines at once from memory, the packing waited on them:
// at 32 rows the product from memory ran at two thirds of its rate from cache (126 against 199
// GFLOP/s, [2048, 768]); spread over the arithmetic, x [768, 4096] and x [768, 2304] ran 5-30%
// faster (interleaved runs, several spells), x [2048, 768] up to 15%, x [768, 32000] within 5%.
template <typename W>
void MultiplyColumns(const Columns& columns, int64_t task, const float* x, const W* w, float* y,
                     int64_t m, int64_t k, int64_t n) {
  const int64_t first = columns.First(task), last = columns.First(task + 1);
  const bool tail = task == columns.tasks - 1 && columns.width > 0;
  if (m == 0) return;
  if (m <= kRows) {
    const int64_t block = columns.wide ? kWideBlock : kBlock;
    const int width = tail ? columns.width : 0;
    return OneGroup(first, last, width, x, w, y, static_cast<int>(m), k, n, block);
  }
  if (kRunTiles<W> > 1) {
    return MultiplyRun(first, last, tail ? columns.width : 0, x, w, y, m, k, n);
  }
  alignas(64) W packed[kBlock * kPackedVectors * kLanes];
  for (int64_t k0 = 0; k0 < k; k0 += kBlock) {
    const int64_t k1 = std::min(k, k0 + kBlock);
    int64_t v = first;
    for (; v + kPackedVectors <= last; v += kPackedVectors) {
      Pack(w + v * kLanes, packed, n, k0, k1, 1);
      Ahead<W> ahead{nullptr, 0, static_cast<int>((m + kRows - 1) / kRows), 0};
      if (v + 2 * kPackedVectors <= last) {
        ahead.w = w + k0 * n + (v + kPackedVectors) * kLanes;
        ahead.rows = k1 - k0;
      } else if (k1 < k) {
        ahead.w = w + k1 * n + first * kLanes;
        ahead.rows = std::min(k, k1 + kBlock) - k1;
      }
      const int groups = static_cast<int>((m + kRows - 1) / kRows);
      for (int64_t r = 0, g = 0; r < m; r += GroupRows(m, groups, g), ++g, ++ahead.phase) {
        const int rows = GroupRows(m, groups, g);
        float* yr = y + r * n + v * kLanes;
        Rows<kPackedVectors, false, true>(rows, x + r * k, packed, yr, k, n, k0, k1, kLanes,
                                          ahead);
      }
    }
    Leftovers(v, last, tail ? columns.width : 0, x, w, y, m, k, n, k0, k1);
  }
}

}  // namespace flipjax::rows
