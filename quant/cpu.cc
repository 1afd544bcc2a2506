// Run-time instruction-set detection for the quantization kernels.
// Thread-safety: DetectIsa caches its answer in a function-local static.
#include "pmsnap/quant/cpu.h"

#include "detail/kernels.h"

namespace pmsnap::quant {

namespace {
Isa Probe() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (detail::Avx512Kernels() != nullptr && __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq")) {
    return Isa::kAvx512;
  }
  if (detail::Avx2Kernels() != nullptr && __builtin_cpu_supports("avx2") &&
      __builtin_cpu_supports("f16c")) {
    return Isa::kAvx2;
  }
#endif
  return Isa::kPortable;
}
}  // namespace

Isa DetectIsa() {
  static const Isa best = Probe();
  return best;
}

bool IsaSupported(Isa isa) {
  switch (isa) {
    case Isa::kAuto:
    case Isa::kPortable:
      return true;
    case Isa::kAvx2:
      return DetectIsa() == Isa::kAvx2 || DetectIsa() == Isa::kAvx512;
    case Isa::kAvx512:
      return DetectIsa() == Isa::kAvx512;
  }
  return false;
}

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kAuto:
      return "auto";
    case Isa::kPortable:
      return "portable";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

namespace detail {
const Kernels& KernelsFor(Isa isa) {
  if (isa == Isa::kAuto) isa = DetectIsa();
  if (isa == Isa::kAvx512 && Avx512Kernels() != nullptr) return *Avx512Kernels();
  if (isa == Isa::kAvx2 && Avx2Kernels() != nullptr) return *Avx2Kernels();
  return PortableKernels();
}
}  // namespace detail

}  // namespace pmsnap::quant
