// e^x and the logistic sigmoid as branch-free arithmetic, so that a loop over them is vectorized
// at the build's width (a call to the C library's expf leaves the loop scalar), shared by the
// native kernels.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace flipjax {

// e^x within 2 ulp of the correctly rounded value, for x clamped to [-87, 88] (below, e^x is
// under the smallest normal float; above, it overflows): 2^n * e^r with n the nearest integer
// to x / ln 2 and |r| <= ln 2 / 2 (Cody and Waite's split of ln 2), e^r by Cephes' polynomial.
inline float Exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  constexpr float kRound = 0x1.8p23f;  // adding and subtracting it rounds to an integer
  const float n = (x * 1.44269504088896341f + kRound) - kRound;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float er = (p * r) * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return er * scale;
}

// 1 / (1 + e^-x), in the order XLA expands `jax.nn.sigmoid` (and so SiLU, x * sigmoid(x)).
inline float Sigmoid(float x) { return 1.0f / (1.0f + Exp(-x)); }

}  // namespace flipjax
