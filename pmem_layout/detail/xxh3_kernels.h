// XXH3-64 compiled for several instruction sets; the result is identical on
// all of them (xxHash guarantees it), only the speed differs. The best one the
// CPU supports is picked once at run time.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pmsnap::layout::detail {

// Storage for an XXH3_state_t (checked against the real size in each kernel).
struct alignas(64) Xxh3State {
  unsigned char bytes[640];
};

struct Xxh3Kernels {
  const char* name;
  std::uint64_t (*hash)(const void* data, std::size_t bytes, std::uint64_t seed);
  void (*reset)(Xxh3State* state, std::uint64_t seed);
  void (*update)(Xxh3State* state, const void* data, std::size_t bytes);
  std::uint64_t (*digest)(const Xxh3State* state);
  // Fused copy + checksum for the bulk path: streams the first `covered`
  // bytes of src to dst with non-temporal stores while computing
  // XXH3-64(src, bytes, seed 0) from the same loads. Returns `covered` (a
  // multiple of 64; 0 when bytes <= 240, where XXH3 has no long-input loop);
  // the caller copies and persists [covered, bytes) and drains. dst must be
  // 64-byte aligned.
  std::size_t (*copy_and_hash)(void* dst, const void* src, std::size_t bytes, std::uint64_t* hash);
};

extern const Xxh3Kernels kXxh3Scalar;  // SSE2 baseline of x86-64
extern const Xxh3Kernels kXxh3Avx2;
extern const Xxh3Kernels kXxh3Avx512;

const Xxh3Kernels& BestXxh3Kernels();

}  // namespace pmsnap::layout::detail
