// Instruction-set selection for the quantization kernels.
//
// The library carries a portable kernel set and, on x86-64, AVX2 and AVX-512
// sets chosen at run time. Every set produces identical bytes for identical
// input (tests/quant_simd_equivalence_test.cc checks it), so the choice only
// changes speed.
//
// Thread-safety: all functions are safe to call from any thread.
#pragma once

#include <cstdint>

namespace pmsnap::quant {

enum class Isa : std::uint8_t {
  kAuto = 0,      // the best set this CPU supports
  kPortable = 1,  // plain C++, any CPU
  kAvx2 = 2,      // AVX2 + FMA-free float math + F16C
  kAvx512 = 3,    // AVX-512 F/BW/VL/DQ
};

// The best instruction set the running CPU supports (never kAuto).
Isa DetectIsa();

// True if kernels for `isa` exist in this build and the CPU can run them.
// kAuto and kPortable are always supported.
bool IsaSupported(Isa isa);

// "auto", "portable", "avx2", "avx512".
const char* IsaName(Isa isa);

}  // namespace pmsnap::quant
