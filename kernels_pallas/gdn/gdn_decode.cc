// Tokens of the gated delta rule on the CPU, updating each row's state in slots of the pool
// (an XLA FFI handler): one token per row for a decode step, the few of a speculative verify
// step, each position's state kept in a slot of its own, or a prefill chunk's, every state
// written to the row's own slot (so it stays in cache from one token to the next).
//
// XLA runs the same step as a chain of fusions that gathers the pooled states, decays them,
// reduces them twice, writes them out and scatters them back: about eight passes over every
// row's state. Here each (row, head) state, 16 KB at dk = dv = 64, is read from its slot once,
// stays in L1 for the second pass and is written back in place. The arithmetic follows
// `delta_rule_step` in `reference.py` beside this file term for term (decay first, then the
// two reductions in key order), so both agree to rounding.
//
// Inputs: pool f32[S, H, dk, dv]; reads s32[B], the slot each row's state comes from (outside
// [0, S): a zero state, for padding rows and rows that start fresh); writes s32[B, T], the slot
// the state after each of its tokens goes to (outside [0, S): dropped, for padding, and the
// row's later tokens too); q, k f32[B, H, T, dk] and v f32[B, H, T, dv], prepared (normalised,
// scaled, key heads repeated); alpha = exp(g) and beta f32[B, H, T].
// Outputs: out f32[B, H, T, dv]; the pool, aliased to the input pool, with the new states.
// Rows own distinct slots (the engine's pools check it), so no two rows touch one state; a
// row's token t reads the state its token t - 1 wrote.

#include <algorithm>
#include <cstdint>
#include <memory>

#include "cache_line.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Shapes {
  int64_t slots, heads, tokens, dk, dv;
};

// One (row, head): the old state is `src` (null for a zero state), the new one goes to `dst`.
// `next` (or null) is the state the thread steps after this one: each of its rows is requested
// into L2 while this state's first pass runs, so reading memory overlaps the arithmetic. The
// hardware's prefetchers start afresh at every 4 KB page of a 16 KB state; with the request,
// a decode step's states (in-process, 9 layers of 12 heads, 190 MB of pools) streamed 15-20%
// faster at 8 and 32 rows, on the AVX-512 and the AVX2 build alike.
//
// The sums over the state's rows (kv_mem, out) are kept in arrays of the function's own, of a
// width known when it is compiled (kDv; 0: `dv`, in the caller's scratch), which nothing else
// aliases (the state is updated in place, so `src` may be `dst`): summed into the caller's
// scratch, each row's update stored the sums and loaded them again, behind the state's; so the
// 9 layers of a decode step take 2-17% less time at 32 rows and 19-31% less at 8 (dv = 64,
// AVX2 and AVX-512 builds, interleaved runs). Each sum still adds its terms in the same order,
// and the products are the same bits.
template <int64_t kDv>
void StepHead(const float* src, const float* __restrict q, const float* __restrict k,
              const float* __restrict v, float alpha, float beta, int64_t dk, int64_t dv,
              float* dst, float* __restrict out, float* __restrict scratch, const float* next) {
  if constexpr (kDv > 0) dv = kDv;
  float own[3 * (kDv > 0 ? kDv : 1)];
  float* __restrict kv_mem = kDv > 0 ? own : scratch;
  float* __restrict delta = kv_mem + dv;
  float* __restrict acc = delta + dv;
  std::fill(kv_mem, kv_mem + dv, 0.0f);
  if (src != nullptr) {
    for (int64_t i = 0; i < dk; ++i) {
      const float* row = src + i * dv;
      const float ki = k[i];
      if (next != nullptr) flipjax::RequestLines<2>(next + i * dv, dv);
      for (int64_t j = 0; j < dv; ++j) kv_mem[j] += (row[j] * alpha) * ki;
    }
  }
  for (int64_t j = 0; j < dv; ++j) delta[j] = (v[j] - kv_mem[j]) * beta;
  std::fill(acc, acc + dv, 0.0f);
  for (int64_t i = 0; i < dk; ++i) {
    float* new_row = dst + i * dv;
    const float ki = k[i], qi = q[i];
    if (src != nullptr) {
      const float* row = src + i * dv;
      for (int64_t j = 0; j < dv; ++j) {
        const float s = row[j] * alpha + ki * delta[j];
        new_row[j] = s;
        acc[j] += s * qi;
      }
    } else {
      for (int64_t j = 0; j < dv; ++j) {
        const float s = ki * delta[j];
        new_row[j] = s;
        acc[j] += s * qi;
      }
    }
  }
  std::copy(acc, acc + dv, out);
}

// StepHead for this state's width: compiled in for Qwen3-Next's 128 and the bench model's 64,
// any other through the scratch.
void StepAnyHead(const float* src, const float* q, const float* k, const float* v, float alpha,
                 float beta, int64_t dk, int64_t dv, float* dst, float* out, float* scratch,
                 const float* next) {
  if (dv == 64) return StepHead<64>(src, q, k, v, alpha, beta, dk, dv, dst, out, scratch, next);
  if (dv == 128) return StepHead<128>(src, q, k, v, alpha, beta, dk, dv, dst, out, scratch, next);
  StepHead<0>(src, q, k, v, alpha, beta, dk, dv, dst, out, scratch, next);
}

struct Work {
  Shapes s;
  float* pool;
  const int32_t *reads, *writes;
  const float *q, *k, *v, *alpha, *beta;
  float* out;

  // Head h's state in `slot`, or null for a slot outside the pool.
  float* At(int32_t slot, int64_t h) const {
    if (slot < 0 || slot >= s.slots) return nullptr;
    return pool + (static_cast<int64_t>(slot) * s.heads + h) * s.dk * s.dv;
  }

  // Items [first, last) of rows * heads, each through its row's tokens in order.
  void Run(int64_t first, int64_t last) const {
    std::unique_ptr<float[]> scratch(new float[3 * s.dv]);
    for (int64_t item = first; item < last; ++item) {
      const int64_t b = item / s.heads, h = item % s.heads;
      const float* src = At(reads[b], h);
      const int64_t after = item + 1;
      const float* next = after < last ? At(reads[after / s.heads], after % s.heads) : nullptr;
      for (int64_t t = 0; t < s.tokens; ++t) {
        const int64_t at = item * s.tokens + t;  // (b, h, t) in the head-major inputs
        float* dst = At(writes[b * s.tokens + t], h);
        if (dst == nullptr) {  // padding from here on: nothing to keep; its output reads zero
          std::fill(out + at * s.dv, out + (item + 1) * s.tokens * s.dv, 0.0f);
          break;
        }
        StepAnyHead(src, q + at * s.dk, k + at * s.dk, v + at * s.dv, alpha[at], beta[at],
                    s.dk, s.dv, dst, out + at * s.dv, scratch.get(),
                    t + 1 == s.tokens ? next : nullptr);
        src = dst;
      }
    }
  }
};

ffi::Error GdnDecodeImpl(ffi::ThreadPool pool_threads, ffi::Buffer<ffi::F32> pool,
                         ffi::Buffer<ffi::S32> reads, ffi::Buffer<ffi::S32> writes,
                         ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                         ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> alpha,
                         ffi::Buffer<ffi::F32> beta, ffi::ResultBuffer<ffi::F32> out,
                         ffi::ResultBuffer<ffi::F32> pool_out) {
  const auto pd = pool.dimensions();
  const auto qd = q.dimensions();
  if (pd.size() != 4 || qd.size() != 4 || reads.dimensions().size() != 1 ||
      writes.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument(
        "gdn_decode: pool and q must be rank 4, reads rank 1, writes rank 2");
  }
  const int64_t rows = qd[0], tokens = qd[2];
  if (reads.dimensions()[0] != rows || writes.dimensions()[0] != rows ||
      writes.dimensions()[1] != tokens || qd[1] != pd[1] || qd[3] != pd[2] ||
      v.dimensions()[3] != pd[3]) {
    return ffi::Error::InvalidArgument("gdn_decode: row, token, head or head-dim counts disagree");
  }
  Work work;
  work.s = Shapes{pd[0], pd[1], tokens, pd[2], pd[3]};
  // The output pool is the input pool (aliased): it is read and updated in place.
  work.pool = pool_out->typed_data();
  work.reads = reads.typed_data();
  work.writes = writes.typed_data();
  work.q = q.typed_data();
  work.k = k.typed_data();
  work.v = v.typed_data();
  work.alpha = alpha.typed_data();
  work.beta = beta.typed_data();
  work.out = out->typed_data();
  // A few chunks per thread, so a thread that starts late still finds work.
  flipjax::ParallelFor(pool_threads, rows * pd[1], 4, pool_threads.num_threads(),
                       [work](int64_t first, int64_t last) { work.Run(first, last); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlipjaxGdnDecode, GdnDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // pool
                                  .Arg<ffi::Buffer<ffi::S32>>()  // reads
                                  .Arg<ffi::Buffer<ffi::S32>>()  // writes
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::F32>>()  // alpha
                                  .Arg<ffi::Buffer<ffi::F32>>()  // beta
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // pool, updated
);
