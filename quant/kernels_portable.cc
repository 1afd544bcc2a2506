// Portable kernel set: the reference every vector set must match byte for
// byte (see detail/kernels.h for the shared contract).
// Thread-safety: pure functions.
#include "detail/kernels.h"

namespace pmsnap::quant::detail {
namespace {

bool MinMaxPortable(const float* x, std::uint32_t n, float* min_out, float* max_out) {
  float lo = x[0], hi = x[0];
  // x - x is 0 for finite x and NaN for NaN or Inf; a NaN sticks in the sum.
  float poison = 0.0f;
  for (std::uint32_t i = 0; i < n; ++i) {
    const float v = x[i];
    lo = v < lo ? v : lo;
    hi = v > hi ? v : hi;
    poison += v - v;
  }
  *min_out = lo + 0.0f;  // -0.0 -> +0.0 so every set stores the same bias bits
  *max_out = hi + 0.0f;
  return poison == 0.0f;
}

void EncodePortable(const float* x, std::uint32_t n, EncodeParams p, float qmax,
                    std::uint8_t* codes) {
  for (std::uint32_t i = 0; i < n; ++i) {
    codes[i] = static_cast<std::uint8_t>(static_cast<int>(EncodeOne(x[i], p, qmax)));
  }
}

void Loss2Portable(const float* x, std::uint32_t n, EncodeParams a, EncodeParams b, float qmax,
                   float* loss_a, float* loss_b) {
  float lanes_a[16] = {}, lanes_b[16] = {};
  FinishLoss2(x, 0, n, a, b, qmax, lanes_a, lanes_b, loss_a, loss_b);
}

constexpr Kernels kPortable = {Isa::kPortable, MinMaxPortable, EncodePortable,
                               Loss2Portable,  nullptr,        nullptr};

}  // namespace

const Kernels& PortableKernels() { return kPortable; }

}  // namespace pmsnap::quant::detail
