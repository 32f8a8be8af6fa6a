// One decode token of the gated delta rule on the CPU, reading each row's state straight from
// the slot pool (an XLA FFI handler).
//
// XLA runs the same step as a chain of fusions that gathers the pooled states, decays them,
// reduces them twice and writes them once more: about six passes over every row's state. Here
// each (row, head) state, 16 KB at dk = dv = 64, is read from the pool once, stays in L1 for
// the second pass and is written once. The arithmetic follows `delta_rule_step` in
// `kernels_pallas/gdn_reference.py` term for term (decay first, then the two reductions in
// key order), so both agree to rounding.
//
// Inputs: pool f32[S, H, dk, dv]; slots s32[B] (a slot outside [0, S) reads as a zero state:
// padding rows and rows that start fresh); q, k f32[B, H, dk] and v f32[B, H, dv], prepared
// (normalised, scaled, key heads repeated); alpha = exp(g) and beta f32[B, H].
// Outputs: out f32[B, H, dv]; state f32[B, H, dk, dv], each row's new state.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Shapes {
  int64_t slots, heads, dk, dv;
};

// One (row, head): the old state is `src` (null for a zero state), the new one goes to `dst`.
void StepHead(const float* src, const float* q, const float* k, const float* v, float alpha,
              float beta, int64_t dk, int64_t dv, float* dst, float* out, float* scratch) {
  float* kv_mem = scratch;
  std::fill(kv_mem, kv_mem + dv, 0.0f);
  if (src != nullptr) {
    for (int64_t i = 0; i < dk; ++i) {
      const float* row = src + i * dv;
      const float ki = k[i];
      for (int64_t j = 0; j < dv; ++j) kv_mem[j] += (row[j] * alpha) * ki;
    }
  }
  float* delta = scratch + dv;
  for (int64_t j = 0; j < dv; ++j) delta[j] = (v[j] - kv_mem[j]) * beta;
  std::fill(out, out + dv, 0.0f);
  for (int64_t i = 0; i < dk; ++i) {
    float* new_row = dst + i * dv;
    const float ki = k[i], qi = q[i];
    if (src != nullptr) {
      const float* row = src + i * dv;
      for (int64_t j = 0; j < dv; ++j) new_row[j] = row[j] * alpha + ki * delta[j];
    } else {
      for (int64_t j = 0; j < dv; ++j) new_row[j] = ki * delta[j];
    }
    for (int64_t j = 0; j < dv; ++j) out[j] += new_row[j] * qi;
  }
}

struct Work {
  Shapes s;
  const float* pool;
  const int32_t* slots;
  const float *q, *k, *v, *alpha, *beta;
  float *out, *state;
  int64_t items;  // rows * heads
  int64_t chunk;  // items per task
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  // Claims chunks until none is left; returns when this caller has nothing more to do.
  void Drain() {
    std::unique_ptr<float[]> scratch(new float[2 * s.dv]);
    const int64_t state_size = s.dk * s.dv;
    for (;;) {
      const int64_t first = next.fetch_add(chunk);
      if (first >= items) return;
      const int64_t last = std::min(first + chunk, items);
      for (int64_t item = first; item < last; ++item) {
        const int64_t b = item / s.heads, h = item % s.heads;
        const int32_t slot = slots[b];
        const float* src = (slot >= 0 && slot < s.slots)
                               ? pool + (static_cast<int64_t>(slot) * s.heads + h) * state_size
                               : nullptr;
        StepHead(src, q + item * s.dk, k + item * s.dk, v + item * s.dv, alpha[item],
                 beta[item], s.dk, s.dv, state + item * state_size, out + item * s.dv,
                 scratch.get());
      }
      done.fetch_add(last - first);
    }
  }
};

ffi::Error GdnDecodeImpl(ffi::ThreadPool pool_threads, ffi::Buffer<ffi::F32> pool,
                         ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::F32> q,
                         ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                         ffi::Buffer<ffi::F32> alpha, ffi::Buffer<ffi::F32> beta,
                         ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> state) {
  const auto pd = pool.dimensions();
  const auto qd = q.dimensions();
  if (pd.size() != 4 || qd.size() != 3 || slots.dimensions().size() != 1) {
    return ffi::Error::InvalidArgument("gdn_decode: pool must be rank 4, q rank 3, slots rank 1");
  }
  const int64_t rows = qd[0];
  if (slots.dimensions()[0] != rows || qd[1] != pd[1] || qd[2] != pd[2] ||
      v.dimensions()[2] != pd[3]) {
    return ffi::Error::InvalidArgument("gdn_decode: row, head or head-dim counts disagree");
  }
  auto work = std::make_shared<Work>();
  work->s = Shapes{pd[0], pd[1], pd[2], pd[3]};
  work->pool = pool.typed_data();
  work->slots = slots.typed_data();
  work->q = q.typed_data();
  work->k = k.typed_data();
  work->v = v.typed_data();
  work->alpha = alpha.typed_data();
  work->beta = beta.typed_data();
  work->out = out->typed_data();
  work->state = state->typed_data();
  work->items = rows * pd[1];
  const int64_t threads = std::max<int64_t>(1, pool_threads.num_threads());
  // A few chunks per thread, so a thread that starts late still finds work.
  work->chunk = std::max<int64_t>(1, work->items / (4 * threads));
  for (int64_t t = 1; t < threads; ++t) {
    pool_threads.Schedule([work] { work->Drain(); });
  }
  work->Drain();
  // A task scheduled behind busy threads may start after the work is gone; it then returns at
  // once, holding its own reference to `work`, so only finished chunks are waited for here.
  while (work->done.load() < work->items) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlipjaxGdnDecode, GdnDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // pool
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::F32>>()  // alpha
                                  .Arg<ffi::Buffer<ffi::F32>>()  // beta
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // state
);
