// libFuzzer target: the extra-state decoder (hooks/extra_state.h,
// UnpackExtraState), which a restore runs on the bytes of the recovered
// commit record. What it accepts must pack back to the same bytes.
//
// The decoder lives in hooks/extra_state_format.cc, which needs no libtorch;
// the libtorch RNG capture that fills ExtraState::rng_state is not a decoder
// and is not fuzzed (its bytes are opaque here). The Python front end's extra
// state is a pickle, decoded by Python, outside libFuzzer's reach.
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "fuzz_check.h"
#include "pmsnap/hooks/extra_state.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace pmsnap::hooks;
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  auto state = UnpackExtraState(bytes);
  if (!state.ok()) return 0;
  const std::vector<std::byte> packed = PackExtraState(*state);
  FUZZ_CHECK(packed.size() == size);
  FUZZ_CHECK(size == 0 || std::memcmp(packed.data(), data, size) == 0);
  return 0;
}
