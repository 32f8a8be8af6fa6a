// y = x @ w[group] for rows sorted by group, fp32 (an XLA FFI handler): the experts' matmul of
// a mixture-of-experts layer, with only the weights of the groups that have rows read.
//
// `jax.lax.ragged_dot` on XLA:CPU runs as a dense product against every group, with each
// row masked to its own: it transposes and copies the whole [G, K, N] weight on every call
// and multiplies each row by all G groups. At 16 experts and top-2 that is 8x the arithmetic
// and three passes over every expert's weights, where a decode step needs the routed
// experts' weights only. Here a task takes one group's rows and one panel of that group's
// columns and runs the streamed multiply of `row_panels.h` over them, so each routed expert's
// weight is read once per call and an expert without rows is never touched.
//
// Each row is summed over k in order with fused multiply-adds, as the native matmul does, so a
// row's result depends on neither its group's size nor the batch. Rows after the last group
// (past the sum of the group sizes) are zero, as `ragged_dot` defines them.
//
// Two handlers: FlipjaxRaggedMatmul takes x f32[M, K], w f32[G, K, N] and group_sizes s32[G];
// FlipjaxRaggedMatmulBf16 takes w bf16[G, K, N] and FlipjaxRaggedMatmulInt8 a quantized
// s8[G, K, N] (its per-group, per-column scales the caller's to apply), each widened exactly as
// it is read. All return f32[M, N].

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "parallel.h"
#include "row_panels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using flipjax::rows::Bf16;

template <typename W>
ffi::Error Multiply(ffi::ThreadPool& threads, ffi::Buffer<ffi::F32>& x, const W* w,
                    ffi::Span<const int64_t> wd, ffi::Buffer<ffi::S32>& group_sizes,
                    ffi::ResultBuffer<ffi::F32>& y) {
  const auto xd = x.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || xd[1] != wd[1] || xd[1] == 0 ||
      group_sizes.dimensions().size() != 1 || group_sizes.dimensions()[0] != wd[0]) {
    return ffi::Error::InvalidArgument(
        "ragged matmul: x must be [M, K], w [G, K, N] and group_sizes [G], with K > 0");
  }
  const int64_t m = xd[0], k = xd[1], groups = wd[0], n = wd[2];
  const int32_t* sizes = group_sizes.typed_data();
  std::vector<int64_t> first(groups + 1, 0);
  for (int64_t g = 0; g < groups; ++g) {
    if (sizes[g] < 0) {
      return ffi::Error::InvalidArgument("ragged matmul: group " + std::to_string(g) +
                                         " has a negative size");
    }
    first[g + 1] = first[g] + sizes[g];
  }
  if (first[groups] > m) {
    return ffi::Error::InvalidArgument("ragged matmul: the group sizes sum to " +
                                       std::to_string(first[groups]) + ", more than the " +
                                       std::to_string(m) + " rows of x");
  }
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  std::memset(yp + first[groups] * n, 0, (m - first[groups]) * n * sizeof(float));
  // One task per (group with rows, columns); a group's rows share each task's reads of w.
  std::vector<int64_t> busy;
  for (int64_t g = 0; g < groups; ++g) {
    if (sizes[g] > 0) busy.push_back(g);
  }
  const int64_t n_threads =
      flipjax::Threads(threads, first[groups] * k * n, flipjax::rows::kWorkPerThread);
  // Each group's columns are split for the threads only when there are fewer groups than
  // threads; else whole groups keep them busy.
  const int64_t per_group = std::max<int64_t>(
      1, n_threads / std::max<int64_t>(1, static_cast<int64_t>(busy.size())));
  const flipjax::rows::Columns columns(n, per_group);
  const int64_t tasks = static_cast<int64_t>(busy.size()) * columns.tasks;
  flipjax::ParallelFor(threads, tasks, 2, n_threads, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t g = busy[t / columns.tasks], c = t % columns.tasks;
      flipjax::rows::MultiplyColumns(columns, c, xp + first[g] * k, w + g * k * n,
                                     yp + first[g] * n, first[g + 1] - first[g], k, n);
    }
  });
  return ffi::Error::Success();
}

// The handler for weights of XLA type `T`, read as `W`s (a bf16 as its 16 bits).
template <ffi::DataType T, typename W>
ffi::Error RaggedMatmulOf(ffi::ThreadPool threads, ffi::Buffer<ffi::F32> x, ffi::Buffer<T> w,
                          ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> y) {
  const auto* wp = reinterpret_cast<const W*>(w.untyped_data());
  return Multiply(threads, x, wp, w.dimensions(), group_sizes, y);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlipjaxRaggedMatmul, (RaggedMatmulOf<ffi::F32, float>),
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlipjaxRaggedMatmulBf16, (RaggedMatmulOf<ffi::BF16, Bf16>),
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w
                                  .Arg<ffi::Buffer<ffi::S32>>()   // group_sizes
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlipjaxRaggedMatmulInt8, (RaggedMatmulOf<ffi::S8, int8_t>),
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::S8>>()   // w
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
);
