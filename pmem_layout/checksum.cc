#include "pmsnap/pmem_layout/checksum.h"

#include "detail/xxh3_kernels.h"

namespace pmsnap::layout {

namespace detail {

const Xxh3Kernels& BestXxh3Kernels() {
  // A pointer, not a reference bound to the lambda's result: gcc 13 takes
  // the latter for a possibly dangling temporary (-Wdangling-reference,
  // an error in the GPU machine's -Werror build).
  static const Xxh3Kernels* const best = []() -> const Xxh3Kernels* {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) {
      return &kXxh3Avx512;
    }
    if (__builtin_cpu_supports("avx2")) return &kXxh3Avx2;
    return &kXxh3Scalar;
  }();
  return *best;
}

}  // namespace detail

std::uint64_t Checksum64(const void* data, std::size_t bytes, std::uint64_t seed) {
  return detail::BestXxh3Kernels().hash(data, bytes, seed);
}

struct StreamingChecksum::State {
  detail::Xxh3State xxh;
};

StreamingChecksum::StreamingChecksum(std::uint64_t seed) : state_(std::make_unique<State>()) {
  detail::BestXxh3Kernels().reset(&state_->xxh, seed);
}

StreamingChecksum::~StreamingChecksum() = default;

void StreamingChecksum::Update(const void* data, std::size_t bytes) {
  detail::BestXxh3Kernels().update(&state_->xxh, data, bytes);
}

std::uint64_t StreamingChecksum::Digest() const {
  return detail::BestXxh3Kernels().digest(&state_->xxh);
}

}  // namespace pmsnap::layout
