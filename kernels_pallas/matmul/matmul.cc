// y = x @ w for the few rows of a decode step, fp32, streaming w from its [K, N] layout (an XLA
// FFI handler).
//
// A GEMM library packs w into panels before it multiplies. At decode's batch sizes w is read
// once per call and barely reused, so the packing adds memory traffic to a product that is
// already bound by it: XLA's [8, 768] x [768, 32000] ran at 10-15 GB/s where a one-row product
// streams the same weights at 28. Here a task takes a panel of w's columns (1.5 KB of each
// row) and walks its rows in blocks; each block stays in L1 while every group of x's rows is
// multiplied into it, with the group's accumulators held in registers.
//
// Every output is the sum over k in order 0..K-1 of fused multiply-adds, however many rows x
// has and wherever a row sits, so a row's result does not depend on its batch. The FMAs are
// written out, not left to the compiler: under AMD Zen tuning (`-march=native` there) GCC
// splits some loops' FMA chains into a multiply and an add and leaves others fused, so rows
// in groups of different sizes were rounded differently. Without FMA (x86-64 before AVX2)
// every step is a multiply and an add, which the compiler has no instruction to fuse.
//
// The tiles and the multiply itself live in `row_panels.h`, shared with the grouped matmul of
// the experts. Two handlers: FlipjaxMatmul takes x f32[M, K] and w f32[K, N]; FlipjaxMatmulBf16 takes w
// bf16[K, N], widened to fp32 as it is read (exactly: a bf16 is the top half of an fp32), so
// it reads half the bytes and multiplies and accumulates as XLA's bf16 product with fp32
// accumulation does. FlipjaxMatmulInt8 takes a quantized weight s8[K, N], widened exactly as it
// is read (a quarter of fp32's bytes); the per-column scale is the caller's to apply. All
// return y f32[M, N].

#include <algorithm>
#include <cstdint>

#include "parallel.h"
#include "row_panels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using flipjax::rows::Bf16;

// y = x @ w over the buffers' data (w of `W`s), any M, K > 0 and N, a column panel per task.
template <typename W>
void Multiply(ffi::ThreadPool& threads, const float* xp, const W* wp, float* yp, int64_t m,
              int64_t k, int64_t n) {
  const int64_t n_threads = flipjax::Threads(threads, m * k * n, flipjax::rows::kWorkPerThread);
  const flipjax::rows::Columns columns(n, n_threads);
  flipjax::ParallelFor(threads, columns.tasks, 2, n_threads, [=](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      flipjax::rows::MultiplyColumns(columns, t, xp, wp, yp, m, k, n);
    }
  });
}

ffi::Error CheckShapes(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> wd) {
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0] || xd[1] == 0) {
    return ffi::Error::InvalidArgument("matmul: x must be [M, K] and w [K, N], with K > 0");
  }
  return ffi::Error::Success();
}

// The handler for weights of XLA type `T`, read as `W`s (a bf16 as its 16 bits).
template <ffi::DataType T, typename W>
ffi::Error MatmulOf(ffi::ThreadPool threads, ffi::Buffer<ffi::F32> x, ffi::Buffer<T> w,
                    ffi::ResultBuffer<ffi::F32> y) {
  if (auto error = CheckShapes(x.dimensions(), w.dimensions()); error.failure()) return error;
  const auto* wp = reinterpret_cast<const W*>(w.untyped_data());
  Multiply(threads, x.typed_data(), wp, y->typed_data(), x.dimensions()[0], x.dimensions()[1],
           w.dimensions()[1]);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlipjaxMatmul, (MatmulOf<ffi::F32, float>),
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlipjaxMatmulBf16, (MatmulOf<ffi::BF16, Bf16>),
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlipjaxMatmulInt8, (MatmulOf<ffi::S8, int8_t>),
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::S8>>()   // w
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
);
