// Row loops both kernel files use: the RMS norm and RoPE of one row, each the definition its torch
// form (TorchKernels.rms_norm / head_rms_norm, rope.rotate) is tested against.
#pragma once

#include <cmath>
#include <cstdint>

namespace dsv4 {

// With `w`: fp32 weight * normalised fp32 row, cast once (TorchKernels.rms_norm). Without: the fp32
// scale cast to T, then the product in T (TorchKernels.head_rms_norm).
template <typename T>
inline void rms_norm_row(const T* x, const float* w, T* o, int64_t d, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < d; ++i) {
    const float v = static_cast<float>(x[i]);
    ss += v * v;
  }
  const float scale = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
  if (w) {
    for (int64_t i = 0; i < d; ++i) o[i] = static_cast<T>(w[i] * (static_cast<float>(x[i]) * scale));
  } else {
    const float s = static_cast<float>(static_cast<T>(scale));
    for (int64_t i = 0; i < d; ++i) o[i] = static_cast<T>(static_cast<float>(x[i]) * s);
  }
}

// rope.rotate of `rd` channels as interleaved pairs, in fp32 with its two roundings: (rope * cos) +
// (swapped * sin); `sign` -1 inverts. `o` may be `x`.
template <typename T>
inline void rotate_pairs(const T* x, const float* c, const float* s, float sign, int64_t rd, T* o) {
  for (int64_t j = 0; j < rd; j += 2) {
    const float a = static_cast<float>(x[j]), e = static_cast<float>(x[j + 1]);
    const float p0 = a * c[j], q0 = -e * (sign * s[j]);
    const float p1 = e * c[j + 1], q1 = a * (sign * s[j + 1]);
    o[j] = static_cast<T>(p0 + q0);
    o[j + 1] = static_cast<T>(p1 + q1);
  }
}

}  // namespace dsv4
