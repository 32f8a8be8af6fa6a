// Moves rows of a page pool without widening it (XLA FFI handlers): writes the step's new K/V
// rows into the pool in place, and reads the blocks of pages attention walks.
//
// XLA:CPU lowers a scatter into a bf16 or fp8 array by widening the whole operand to f32 and
// narrowing it back: writing 4 rows into a 64 MiB bf16 pool cost 128 MiB of temporaries and
// 77 ms, every decode step. Here the output is aliased to the pool (`input_output_aliases`), so
// only the rows' bytes move.
//
// FlipjaxWriteRows: pool [*lead, *row] of any dtype of whole bytes, rows [N, *row] of the pool's
// dtype, ids s32[N] indexing the A = prod(lead) rows of the pool (a page's slot, or a page:
// the caller never reshapes the pool, since XLA copies a reshaped operand it must alias);
// returns the pool with row i written at ids[i] (the pool's buffer). An id outside [0, A) is
// dropped, negative ones included (jnp's scatter would count those from the
// end). Rows are written in order, so of duplicate ids the last one wins, as in a sequential
// loop, where XLA's scatter leaves the order unspecified.

#include <cstdint>
#include <cstring>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

std::string Dims(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// Types packed several to a byte, whose rows need not start on a byte.
bool SubByte(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::S1:
    case ffi::DataType::S2:
    case ffi::DataType::S4:
    case ffi::DataType::U1:
    case ffi::DataType::U2:
    case ffi::DataType::U4:
    case ffi::DataType::F4E2M1FN:
      return true;
    default:
      return false;
  }
}

ffi::Error WriteRowsImpl(ffi::AnyBuffer pool, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> ids,
                         ffi::Result<ffi::AnyBuffer> out) {
  const auto pd = pool.dimensions(), rd = rows.dimensions(), id = ids.dimensions();
  if (pool.element_type() != rows.element_type() || SubByte(pool.element_type()) ||
      ffi::ByteWidth(pool.element_type()) == 0) {
    return ffi::Error::InvalidArgument(
        "write rows: rows must have the pool's dtype, one of whole bytes per element");
  }
  const size_t row_dims = rd.size() - 1, lead = pd.size() - row_dims;
  bool same_row = rd.size() >= 1 && pd.size() > row_dims;
  for (size_t i = 0; same_row && i < row_dims; ++i) same_row = rd[1 + i] == pd[lead + i];
  if (!same_row || id.size() != 1 || id[0] != rd[0]) {
    return ffi::Error::InvalidArgument("write rows: need pool [*lead, *row], rows [N, *row] and "
                                       "ids [N], got pool " + Dims(pd) + ", rows " + Dims(rd) +
                                       " and ids " + Dims(id));
  }
  if (out->element_type() != pool.element_type() || out->size_bytes() != pool.size_bytes()) {
    return ffi::Error::InvalidArgument("write rows: the result must be the pool's shape");
  }
  auto* dst = static_cast<char*>(out->untyped_data());
  // Under input_output_aliases XLA gives the pool and the result one buffer, and copies a pool
  // that is not donated, or is read again, before the call (so measured: a pool not donated,
  // read again in the program, a constant, a scan's carry, an eager call). Only a call made
  // without the alias gets a result buffer of its own, which must start as the pool; where the
  // alias holds this test is all it costs.
  if (dst != pool.untyped_data()) std::memcpy(dst, pool.untyped_data(), pool.size_bytes());
  int64_t count = 1;
  for (size_t i = 0; i < lead; ++i) count *= pd[i];
  const int64_t n = rd[0];
  const size_t row_bytes = count == 0 ? 0 : pool.size_bytes() / count;
  const auto* src = static_cast<const char*>(rows.untyped_data());
  const int32_t* at = ids.typed_data();
  for (int64_t i = 0; i < n; ++i) {
    if (at[i] < 0 || at[i] >= count) continue;
    std::memcpy(dst + at[i] * row_bytes, src + i * row_bytes, row_bytes);
  }
  return ffi::Error::Success();
}

// FlipjaxReadRows: pool [A, *row], ids s32[*I] -> rows [*I, *row], row ids[i] of the pool (zeros
// for an id outside [0, A): table entries past a request's pages may hold anything). XLA:CPU's
// gather from a bf16 or fp8 pool inside attention's block loop widens the whole pool to fp32
// once per call (the widening is hoisted out of the loop): a copy twice the pool's size.
ffi::Error ReadRowsImpl(ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> ids,
                        ffi::Result<ffi::AnyBuffer> out) {
  const auto pd = pool.dimensions();
  const int64_t n = static_cast<int64_t>(ids.element_count());
  if (pd.size() < 1 || out->element_type() != pool.element_type() ||
      SubByte(pool.element_type()) || ffi::ByteWidth(pool.element_type()) == 0 ||
      (pd[0] > 0 && out->size_bytes() != n * (pool.size_bytes() / pd[0]))) {
    return ffi::Error::InvalidArgument("read rows: need pool [A, *row] of whole bytes and a "
                                       "result [*ids, *row] of its dtype, got pool " + Dims(pd));
  }
  const int64_t count = pd[0];
  auto* dst = static_cast<char*>(out->untyped_data());
  if (count == 0) {  // an empty pool: every id is out of range
    std::memset(dst, 0, out->size_bytes());
    return ffi::Error::Success();
  }
  const size_t row_bytes = pool.size_bytes() / count;
  const auto* src = static_cast<const char*>(pool.untyped_data());
  const int32_t* at = ids.typed_data();
  for (int64_t i = 0; i < n; ++i) {
    if (at[i] < 0 || at[i] >= count) {
      std::memset(dst + i * row_bytes, 0, row_bytes);
    } else {
      std::memcpy(dst + i * row_bytes, src + at[i] * row_bytes, row_bytes);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlipjaxReadRows, ReadRowsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // pool
                                  .Arg<ffi::Buffer<ffi::S32>>()   // ids
                                  .Ret<ffi::AnyBuffer>()          // rows
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlipjaxWriteRows, WriteRowsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // pool
                                  .Arg<ffi::AnyBuffer>()          // rows
                                  .Arg<ffi::Buffer<ffi::S32>>()   // ids
                                  .Ret<ffi::AnyBuffer>()          // the pool, aliased
);
