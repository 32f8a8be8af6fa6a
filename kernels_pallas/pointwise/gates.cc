// Gated products (XLA FFI handlers): silu(g) * x, the MLP's, and x * sigmoid(g), attention's
// output gate.
//
// XLA:CPU fuses the exp with the product's other operand into one loop that it leaves
// unvectorized: at a batch-32 decode step of the benchmark model, 46 us a layer for the MLP's
// 65K values and 85 us for attention's 25K, where reading and writing them takes a few.
// Here the exp is a polynomial the compiler vectorizes (`fast_exp.h`).
//
// FlipjaxSiluMul and FlipjaxSigmoidMul: g, x f32 of one shape -> f32 of that shape, each value
// (g * (1 / (1 + exp(-g)))) * x and x * (1 / (1 + exp(-g))): `jax.nn.silu(g) * x` and
// `x * jax.nn.sigmoid(g)` in the order XLA takes their products.

#include <algorithm>
#include <cstdint>

#include "fast_exp.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kWorkPerThread = 1 << 13;  // values that pay for waking a thread
constexpr int64_t kChunk = 1 << 11;          // values a task takes at a time

template <bool kSilu>
ffi::Error GateImpl(ffi::ThreadPool threads, ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> x,
                    ffi::ResultBuffer<ffi::F32> out) {
  const auto gd = g.dimensions(), xd = x.dimensions();
  if (gd.size() != xd.size() || !std::equal(gd.begin(), gd.end(), xd.begin())) {
    return ffi::Error::InvalidArgument("gate: g and x must have one shape");
  }
  const int64_t n = static_cast<int64_t>(x.element_count());
  const float *gs = g.typed_data(), *xs = x.typed_data();
  float* ys = out->typed_data();
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  flipjax::ParallelFor(threads, chunks, 2, flipjax::Threads(threads, n, kWorkPerThread),
                       [=](int64_t first, int64_t last) {
                         const int64_t end = std::min(n, last * kChunk);
                         for (int64_t i = first * kChunk; i < end; ++i) {
                           const float sigmoid = flipjax::Sigmoid(gs[i]);
                           ys[i] = kSilu ? (gs[i] * sigmoid) * xs[i] : xs[i] * sigmoid;
                         }
                       });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlipjaxSiluMul, GateImpl<true>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // g
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Ret<ffi::Buffer<ffi::F32>>()  // silu(g) * x
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlipjaxSigmoidMul, GateImpl<false>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // g
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Ret<ffi::Buffer<ffi::F32>>()  // x * sigmoid(g)
);
