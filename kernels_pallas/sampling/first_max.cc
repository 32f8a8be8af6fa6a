// Each row's first maximum (an XLA FFI handler): the token of a greedy draw, and of the
// Gumbel-max draw of a sampled one.
//
// XLA:CPU takes a row's argmax in three passes over the logits (its max, a broadcast of it, an
// index rank per element and a reduction of the ranks: `reference.first_max`), each of them a
// parallel loop; at 32 rows of a 32k vocabulary that was 4 ms of a decode step's sampling, on
// the path between one step and the next. Here a row is read once (again, up to it, only for
// a row with a NaN); rows are shared among threads from 128K logits each (a row of a large
// vocabulary; the engine's host thread waits on the sampled ids meanwhile).
//
// FlipjaxFirstMax: x f32[*lead, V] with V > 0 -> s32[*lead], the index of each row's first
// maximum, as `jnp.argmax` gives it: a NaN counts as the maximum (the first NaN wins), and
// -0.0 equals 0.0.

#include <cmath>
#include <cstdint>
#include <cstring>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// A vector register's width. Sixteen lanes under AVX2, for GCC to split in two, came out as
// scalar code: 32 rows of 32k logits took 4 ms on one thread of a Zen 3, 0.12 ms at eight
// lanes (in L3), and the kernel ran at half the speed of XLA's argmax between decode steps.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
// Logits that pay for waking a thread: 512 KB, about 40 us for one thread to read.
constexpr int64_t kWorkPerThread = 1 << 17;
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t Mask __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline bool Any(Mask m) {
  int32_t any = 0;
  for (int64_t i = 0; i < kLanes; ++i) any |= m[i];
  return any != 0;
}

// The first i in [0, v) where hit(x[i]), the vectors compared a whole at a time; v if none.
template <typename Hit, typename HitVec>
int64_t First(const float* x, int64_t v, Hit hit, HitVec hit_vec) {
  int64_t i = 0;
  for (; i + kLanes <= v; i += kLanes) {
    if (Any(hit_vec(Load(x + i)))) break;
  }
  for (; i < v; ++i) {
    if (hit(x[i])) return i;
  }
  return v;
}

// Each lane keeps its largest value and where it first came (a later equal value does not
// move it), over two interleaved sets of vectors, so that two chains of compares run at once;
// the row's first maximum is then the earliest index among the lanes that hold the largest.
// A row is read once (it had been read once for its maximum and again up to where it came,
// each vector's compare reduced across lanes: 450 us for 32 rows of 32k logits in a decode
// step, between one step and the next).
int32_t FirstMax(const float* x, int64_t v) {
  float top = -INFINITY;
  int64_t at = 0;
  bool nan = false;
  int64_t i = 0;
  if (v >= 2 * kLanes) {
    Mask lane;
    for (int64_t l = 0; l < kLanes; ++l) lane[l] = static_cast<int32_t>(l);
    Vec m[2] = {Load(x), Load(x + kLanes)};
    Mask first[2] = {lane, lane + static_cast<int32_t>(kLanes)};
    Mask nans = (m[0] != m[0]) | (m[1] != m[1]);
    for (i = 2 * kLanes; i + 2 * kLanes <= v; i += 2 * kLanes) {
      for (int s = 0; s < 2; ++s) {
        const Vec c = Load(x + i + s * kLanes);
        const Mask more = c > m[s];
        m[s] = more ? c : m[s];
        first[s] = more ? lane + static_cast<int32_t>(i + s * kLanes) : first[s];
        nans |= c != c;
      }
    }
    nan = Any(nans);
    at = v;
    for (int s = 0; s < 2; ++s) {
      for (int64_t l = 0; l < kLanes; ++l) top = m[s][l] > top ? m[s][l] : top;
    }
    for (int s = 0; s < 2; ++s) {
      for (int64_t l = 0; l < kLanes; ++l) {
        if (m[s][l] == top && first[s][l] < at) at = first[s][l];
      }
    }
  }
  for (; i < v; ++i) {  // the tail, or a short row, after everything above in index order
    nan |= std::isnan(x[i]);
    if (x[i] > top) {
      top = x[i];
      at = i;
    }
  }
  if (nan) {
    return static_cast<int32_t>(
        First(x, v, [](float a) { return a != a; }, [](Vec a) { return a != a; }));
  }
  return static_cast<int32_t>(at);
}

ffi::Error FirstMaxImpl(ffi::ThreadPool threads, ffi::Buffer<ffi::F32> x,
                        ffi::ResultBuffer<ffi::S32> out) {
  const auto dims = x.dimensions();
  if (dims.size() < 1 || dims.back() <= 0 || dims.back() > INT32_MAX) {
    return ffi::Error::InvalidArgument("first max: x must be [*lead, V] with 0 < V < 2^31");
  }
  const int64_t v = dims.back();
  const int64_t rows = static_cast<int64_t>(x.element_count()) / v;
  if (static_cast<int64_t>(out->element_count()) != rows) {
    return ffi::Error::InvalidArgument("first max: the result must have one index per row");
  }
  const float* xp = x.typed_data();
  int32_t* yp = out->typed_data();
  const int64_t n_threads = flipjax::Threads(threads, rows * v, kWorkPerThread);
  flipjax::ParallelFor(threads, rows, 1, n_threads, [=](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) yp[r] = FirstMax(xp + r * v, v);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlipjaxFirstMax, FirstMaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Ret<ffi::Buffer<ffi::S32>>()  // index of each row's maximum
);
