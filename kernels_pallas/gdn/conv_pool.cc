// The GDN layer's causal conv over pooled conv states, in their slots (an XLA FFI handler).
//
// XLA's form (`causal_conv` over rows gathered from the pool) gathers each row's K-1 last inputs,
// concatenates the call's tokens after them, takes the conv and SiLU and the new window in
// separate passes, and a second program writes the windows back into the pool: at batch 32 of
// the benchmark model about 0.4 ms a layer, for under 2 MB of reads and writes. Here a task
// takes a row: it reads the row's window from its slot once, writes its outputs, and writes the
// new window into the row's slot of the (aliased) pool.
//
// pool f32[S, K-1, C]; reads s32[B], the slot each row's window comes from (outside [0, S): a
// zero window, for a row that starts at position 0 or a padding row); writes s32[B], the slot
// the row's new window goes to (outside [0, S): dropped); x f32[B, T, W] and columns s32[C],
// the call's inputs: channel i of a token is its column columns[i] (the columns of q, k and v
// in the layer's projection, which XLA's slices and concatenation had copied out in 100 us a
// layer at batch 32); weight f32[C, K]; lengths s32[B], how many of the row's T tokens are real
// (they come first).
// Returns y f32[B, T, C] = silu(sum over j of window_j * weight[:, j]) at each token, over the
// row's window followed by its tokens (the exp vectorized: the C library's, a call a value, took
// 0.4 ms a layer at batch 32), and the pool with each row's new window: the last K-1 of its
// inputs up to its last real token. Rows must write distinct slots and read only the slot they
// write (or none).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fast_exp.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kWorkPerThread = 1 << 16;  // multiply-adds that pay for waking a thread

// Channels [to, to + length) of a token's input are x's columns [from, from + length).
struct Run {
  int64_t from, to, length;
};

struct Conv {
  int64_t slots, window, channels, rows, tokens, width;
  float* pool;
  const int32_t *reads, *writes, *lengths;
  const float *x, *taps, *zeros;  // taps: the weight transposed, [K, C]
  float* y;
  const std::vector<Run>* runs;  // none: x's rows are the inputs themselves

  // Row b. Its inputs are its window's K-1 rows (from its slot, or zeros) then its tokens; each
  // output is sum over j of input[t + j] * tap j, the products added in order of j, and each
  // loop runs over channels, contiguous in every operand.
  void Row(int64_t b, std::vector<const float*>& inputs, std::vector<float>& gathered) const {
    const int64_t c = channels;
    const bool read = reads[b] >= 0 && reads[b] < slots;
    inputs.resize(window + tokens);
    for (int64_t p = 0; p < window; ++p) {
      inputs[p] = read ? pool + (reads[b] * window + p) * c : zeros;
    }
    if (!runs->empty()) gathered.resize(tokens * c);
    for (int64_t t = 0; t < tokens; ++t) {
      const float* row = x + (b * tokens + t) * width;
      if (runs->empty()) {
        inputs[window + t] = row;
        continue;
      }
      float* to = gathered.data() + t * c;
      for (const Run& r : *runs) std::memcpy(to + r.to, row + r.from, r.length * sizeof(float));
      inputs[window + t] = to;
    }
    for (int64_t t = 0; t < tokens; ++t) {
      float* out = y + (b * tokens + t) * c;
      const float* first = inputs[t];
      for (int64_t i = 0; i < c; ++i) out[i] = first[i] * taps[i];
      for (int64_t j = 1; j <= window; ++j) {
        const float* in = inputs[t + j];
        const float* tap = taps + j * c;
        for (int64_t i = 0; i < c; ++i) out[i] += in[i] * tap[i];
      }
      for (int64_t i = 0; i < c; ++i) out[i] *= flipjax::Sigmoid(out[i]);
    }
    if (writes[b] < 0 || writes[b] >= slots) return;
    // The new window, row by row from the lowest: a row never comes from a lower row of the
    // same slot, so none is overwritten before it is copied.
    const int64_t real = std::clamp<int64_t>(lengths[b], 0, tokens);
    for (int64_t p = 0; p < window; ++p) {
      float* to = pool + (writes[b] * window + p) * c;
      if (to != inputs[real + p]) std::memmove(to, inputs[real + p], c * sizeof(float));
    }
  }
};

ffi::Error ConvPoolImpl(ffi::ThreadPool threads, ffi::Buffer<ffi::F32> pool,
                        ffi::Buffer<ffi::S32> reads, ffi::Buffer<ffi::S32> writes,
                        ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> columns,
                        ffi::Buffer<ffi::F32> weight, ffi::Buffer<ffi::S32> lengths,
                        ffi::ResultBuffer<ffi::F32> y,
                        ffi::ResultBuffer<ffi::F32> pool_out) {
  const auto pd = pool.dimensions(), xd = x.dimensions(), wd = weight.dimensions();
  if (pd.size() != 3 || xd.size() != 3 || wd.size() != 2 || reads.dimensions().size() != 1 ||
      writes.dimensions().size() != 1 || lengths.dimensions().size() != 1 ||
      columns.dimensions().size() != 1) {
    return ffi::Error::InvalidArgument(
        "conv pool: need pool [S, K-1, C], x [B, T, W], columns [C], weight [C, K], reads, "
        "writes and lengths [B]");
  }
  const int64_t rows = xd[0];
  if (columns.dimensions()[0] != pd[2] || wd[0] != pd[2] || wd[1] != pd[1] + 1 || reads.dimensions()[0] != rows ||
      writes.dimensions()[0] != rows || lengths.dimensions()[0] != rows) {
    return ffi::Error::InvalidArgument(
        "conv pool: channel, tap or row counts disagree: pool [" + std::to_string(pd[0]) + ", " +
        std::to_string(pd[1]) + ", " + std::to_string(pd[2]) + "], weight [" +
        std::to_string(wd[0]) + ", " + std::to_string(wd[1]) + "], x rows " +
        std::to_string(rows));
  }
  float* dst = pool_out->typed_data();
  // Under input_output_aliases XLA gives the pool and the result one buffer; a call made without
  // the alias gets a result of its own, which must start as the pool.
  if (dst != pool.typed_data()) std::memcpy(dst, pool.typed_data(), pool.size_bytes());
  const int64_t c = pd[2], k = wd[1], width = xd[2];
  // Channel i of a token is its column columns[i], gathered in runs of consecutive columns; a
  // single run from column 0 of a row as wide as the channels is the row itself.
  std::vector<Run> runs;
  const int32_t* cols = columns.typed_data();
  for (int64_t i = 0; i < c; ++i) {
    if (cols[i] < 0 || cols[i] >= width) {
      return ffi::Error::InvalidArgument("conv pool: channel " + std::to_string(i) +
                                         " names column " + std::to_string(cols[i]) +
                                         " of a row of " + std::to_string(width));
    }
    if (!runs.empty() && runs.back().from + runs.back().length == cols[i]) {
      ++runs.back().length;
    } else {
      runs.push_back({cols[i], i, 1});
    }
  }
  if (runs.size() == 1 && runs[0].from == 0 && width == c) runs.clear();
  std::vector<float> taps(k * c), zeros(c, 0.0f);
  const float* w = weight.typed_data();
  for (int64_t i = 0; i < c; ++i) {
    for (int64_t j = 0; j < k; ++j) taps[j * c + i] = w[i * k + j];
  }
  const Conv conv{pd[0],
                  pd[1],
                  c,
                  rows,
                  xd[1],
                  width,
                  dst,
                  reads.typed_data(),
                  writes.typed_data(),
                  lengths.typed_data(),
                  x.typed_data(),
                  taps.data(),
                  zeros.data(),
                  y->typed_data(),
                  &runs};
  const int64_t work = rows * xd[1] * c * k;
  flipjax::ParallelFor(threads, rows, 2, flipjax::Threads(threads, work, kWorkPerThread),
                       [conv](int64_t first, int64_t last) {
                         std::vector<const float*> inputs;
                         std::vector<float> gathered;
                         for (int64_t b = first; b < last; ++b) conv.Row(b, inputs, gathered);
                       });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlipjaxConvPool, ConvPoolImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // pool
                                  .Arg<ffi::Buffer<ffi::S32>>()  // reads
                                  .Arg<ffi::Buffer<ffi::S32>>()  // writes
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::S32>>()  // columns
                                  .Arg<ffi::Buffer<ffi::F32>>()  // weight
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lengths
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
                                  .Ret<ffi::Buffer<ffi::F32>>()  // pool, updated
);
