// Run-time instruction-set detection for the quantization kernels.
// Thread-safety: DetectIsa caches its answer in a function-local static.
#include "pmsnap/quant/cpu.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "detail/kernels.h"

namespace pmsnap::quant {

namespace {
#if defined(__x86_64__) || defined(__i386__)
// CPUID leaf 1, ECX bit 29. Not __builtin_cpu_supports("f16c"): clang 14
// (the fuzz build's compiler, Debian 12) does not know that feature name.
bool CpuHasF16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}
#endif

Isa Probe() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (detail::Avx512Kernels() != nullptr && __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq")) {
    return Isa::kAvx512;
  }
  if (detail::Avx2Kernels() != nullptr && __builtin_cpu_supports("avx2") && CpuHasF16c()) {
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
