// y = x @ w for the few rows of a decode step, fp32, streaming w from its [K, N] layout (an XLA
// FFI handler).
//
// A GEMM library packs w into panels before it multiplies. At decode's batch sizes w is read
// once per call and barely reused, so the packing adds memory traffic to a product that is
// already bound by it: XLA's [8, 768] x [768, 32000] ran at 10-15 GB/s where a one-row product
// streams the same weights at 28. Here, for one group of x's rows, each thread takes a run of
// w's columns and reads it in passes of a few rows, long runs of each (`OneGroup`
// in `row_panels.h`); for more rows, a task takes a panel of w's columns (1.5 KB of each row) and
// walks its rows in blocks, each packed into L1 while every group of x's rows is multiplied
// into it; either way with the group's accumulators held in registers.
//
// Every output is the sum over k in order 0..K-1 of fused multiply-adds, however many rows x
// has and wherever a row sits, so a row's result does not depend on its batch. The FMAs are
// written out, not left to the compiler: under AMD Zen tuning (`-march=native` there) GCC
// splits some loops' FMA chains into a multiply and an add and leaves others fused, so rows
// in groups of different sizes were rounded differently. Without FMA (x86-64 before AVX2)
// every step is a multiply and an add, which the compiler has no instruction to fuse.
//
// FlipjaxMatmuls (and FlipjaxMatmulsBf16) take one x and several weights w_i [K, N_i] of one
// type, the projections a layer takes from one input, and return each y_i [M, N_i]: one call and
// one wake of the threads for all of them, whose tasks share the pool, instead of one call each
// (and no XLA dot for a weight too narrow for the kernel on its own, such as a GDN layer's
// 24-column gate projection, which XLA's dot took 60-70 us to multiply at 32 rows). A column's
// sum does not depend on the task that takes it, so each y_i is the single product's, bit for
// bit.
//
// The tiles and the multiply itself live in `row_panels.h`, shared with the grouped matmul of
// the experts. Two handlers: FlipjaxMatmul takes x f32[M, K] and w f32[K, N]; FlipjaxMatmulBf16
// takes w bf16[K, N], widened to fp32 as it is read (exactly: a bf16 is the top half of an
// fp32), so it reads half the bytes and multiplies and accumulates as XLA's bf16 product with
// fp32 accumulation does. FlipjaxMatmulInt8 takes a quantized weight s8[K, N], widened exactly
// as it is read (a quarter of fp32's bytes); the per-column scale is the caller's to apply. All
// return y f32[M, N].

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "parallel.h"
#include "row_panels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using flipjax::rows::Bf16;

ffi::Error CheckShapes(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> wd) {
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0] || xd[1] == 0) {
    return ffi::Error::InvalidArgument("matmul: x must be [M, K] and w [K, N], with K > 0");
  }
  return ffi::Error::Success();
}

// One weight of a call: its data, its output and its columns.
template <typename W>
struct Product {
  const W* w;
  float* y;
  int64_t n;
};

// y_i = x @ w_i for every product, x [m, k] (k > 0): each product's columns split into tasks
// as one product's alone would be, every task of the call on the pool at once.
template <typename W>
void MultiplyAll(ffi::ThreadPool& threads, const float* xp, int64_t m, int64_t k,
                 const std::vector<Product<W>>& products) {
  struct Split {
    flipjax::rows::Columns columns;
    int64_t first_task;  // among all of the call's
  };
  int64_t columns = 0;
  for (const auto& product : products) columns += product.n;
  const int64_t n_threads =
      flipjax::Threads(threads, m * k * columns, flipjax::rows::kWorkPerThread);
  std::vector<Split> splits;
  int64_t tasks = 0;
  // One task per thread up to two groups of rows: one group streams it in passes (`OneGroup`),
  // two pack it in blocks across the whole run of columns. With two groups (7-12 rows, AVX2,
  // Zen 3, interleaved runs) the MLP's gate and up projections ran 14-35% faster so, the GDN
  // layer's in-projections 7-37%, the lm head 0-18%, the down projection -5% to +17%, than in
  // 24-vector panels; from 16 rows on, tasks of panels pack runs of them (`MultiplyRun`).
  const bool wide = m <= 2 * flipjax::rows::kRows;
  for (const auto& product : products) {
    splits.push_back({flipjax::rows::Columns(product.n, n_threads, wide), tasks});
    tasks += splits.back().columns.tasks;
  }
  const Product<W>* all = products.data();
  const Split* split = splits.data();
  const int64_t count = static_cast<int64_t>(products.size());
  // ParallelFor returns when every task is done, so the vectors outlive the tasks.
  flipjax::ParallelFor(threads, tasks, 2, n_threads, [=](int64_t first, int64_t last) {
    int64_t p = 0;
    for (int64_t t = first; t < last; ++t) {
      while (p + 1 < count && split[p + 1].first_task <= t) ++p;
      flipjax::rows::MultiplyColumns(split[p].columns, t - split[p].first_task, xp, all[p].w,
                                     all[p].y, m, k, all[p].n);
    }
  });
}

// The handler for several weights of XLA type `T`, read as `W`s: x f32[M, K], then the weights,
// and an output f32[M, N_i] for each.
template <ffi::DataType T, typename W>
ffi::Error MatmulsOf(ffi::ThreadPool threads, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs weights,
                     ffi::RemainingRets outputs) {
  const auto xd = x.dimensions();
  if (weights.size() == 0 || weights.size() != outputs.size()) {
    return ffi::Error::InvalidArgument("matmuls: need one or more weights and an output each");
  }
  std::vector<Product<W>> products;
  for (size_t i = 0; i < weights.size(); ++i) {
    auto w = weights.get<ffi::Buffer<T>>(i);
    auto y = outputs.get<ffi::Buffer<ffi::F32>>(i);
    if (w.has_error()) return w.error();
    if (y.has_error()) return y.error();
    if (auto error = CheckShapes(xd, w->dimensions()); error.failure()) return error;
    const auto yd = (*y)->dimensions();
    if (yd.size() != 2 || yd[0] != xd[0] || yd[1] != w->dimensions()[1]) {
      return ffi::Error::InvalidArgument("matmuls: output " + std::to_string(i) +
                                         " must be [M, N] of x's M and its weight's N");
    }
    products.push_back({reinterpret_cast<const W*>(w->untyped_data()), (*y)->typed_data(),
                        w->dimensions()[1]});
  }
  MultiplyAll(threads, x.typed_data(), xd[0], xd[1], products);
  return ffi::Error::Success();
}

// The handler for weights of XLA type `T`, read as `W`s (a bf16 as its 16 bits).
template <ffi::DataType T, typename W>
ffi::Error MatmulOf(ffi::ThreadPool threads, ffi::Buffer<ffi::F32> x, ffi::Buffer<T> w,
                    ffi::ResultBuffer<ffi::F32> y) {
  if (auto error = CheckShapes(x.dimensions(), w.dimensions()); error.failure()) return error;
  const std::vector<Product<W>> one = {
      {reinterpret_cast<const W*>(w.untyped_data()), y->typed_data(), w.dimensions()[1]}};
  MultiplyAll(threads, x.typed_data(), x.dimensions()[0], x.dimensions()[1], one);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlipjaxMatmuls, (MatmulsOf<ffi::F32, float>),
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .RemainingArgs()               // the weights, f32[K, N_i]
                                  .RemainingRets()               // y_i f32[M, N_i]
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlipjaxMatmulsBf16, (MatmulsOf<ffi::BF16, Bf16>),
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .RemainingArgs()               // the weights, bf16[K, N_i]
                                  .RemainingRets()               // y_i f32[M, N_i]
);
