// The unit of memory the native kernels request ahead of use (`__builtin_prefetch` fetches one
// line): 64 bytes on every x86-64 CPU.
#pragma once

#include <cstdint>

namespace flipjax {

constexpr int64_t kCacheLineBytes = 64;

}  // namespace flipjax
