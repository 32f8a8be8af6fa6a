// The GDN layer's output norm, w * rmsnorm(x) * silu(z), over each head's values (an XLA FFI
// handler).
//
// XLA:CPU fuses the norm, the weight's broadcast along the heads and SiLU's exp into one loop
// that it leaves unvectorized: about 60 us a layer for a batch-8 decode step of the benchmark
// model (6K values) and 250 us at batch 32, where the values' own reads and writes take a few
// microseconds. Here each head's row is read once for its sum of squares and once for the
// output, and the exp is a polynomial the compiler vectorizes (`fast_exp.h`).
//
// x, z f32[..., D], weight f32[D], attribute eps. Returns f32[..., D]: per row of D,
// (weight * (x * rsqrt(mean(x^2) + eps))) * (z * (1 / (1 + exp(-z)))), the products in the order
// `RMSNormGated` takes them; the sum of squares is taken in kLanes partial sums.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "fast_exp.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kLanes = 16;               // partial sums of squares: one AVX-512 vector
constexpr int64_t kWorkPerThread = 1 << 13;  // values that pay for waking a thread

void Row(const float* x, const float* z, const float* w, float eps, int64_t d, float* out) {
  float partial[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) partial[l] += x[i + l] * x[i + l];
  }
  float sum = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) sum += partial[l];
  for (; i < d; ++i) sum += x[i] * x[i];
  const float r = 1.0f / std::sqrt(sum / static_cast<float>(d) + eps);
  for (int64_t j = 0; j < d; ++j) {
    const float silu = z[j] * flipjax::Sigmoid(z[j]);
    out[j] = (w[j] * (x[j] * r)) * silu;
  }
}

ffi::Error GatedNormImpl(ffi::ThreadPool threads, ffi::Buffer<ffi::F32> x,
                         ffi::Buffer<ffi::F32> z, ffi::Buffer<ffi::F32> weight, float eps,
                         ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), zd = z.dimensions(), wd = weight.dimensions();
  const bool same = xd.size() == zd.size() && std::equal(xd.begin(), xd.end(), zd.begin());
  if (xd.size() < 1 || !same || wd.size() != 1 || wd[0] != xd[xd.size() - 1] || wd[0] < 1) {
    return ffi::Error::InvalidArgument(
        "gated norm: need x and z of one shape [..., D] and weight [D], got D " +
        std::to_string(xd.size() ? xd[xd.size() - 1] : 0) + " and weight of " +
        std::to_string(wd.size() ? wd[0] : 0));
  }
  const int64_t d = wd[0], rows = x.element_count() / d;
  const float *xs = x.typed_data(), *zs = z.typed_data(), *w = weight.typed_data();
  float* ys = out->typed_data();
  flipjax::ParallelFor(threads, rows, 2, flipjax::Threads(threads, rows * d, kWorkPerThread),
                       [=](int64_t first, int64_t last) {
                         for (int64_t b = first; b < last; ++b) {
                           Row(xs + b * d, zs + b * d, w, eps, d, ys + b * d);
                         }
                       });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlipjaxGatedNorm, GatedNormImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // z
                                  .Arg<ffi::Buffer<ffi::F32>>()  // weight
                                  .Attr<float>("eps")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
);
