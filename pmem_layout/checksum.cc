#include "pmsnap/pmem_layout/checksum.h"

#include <xxhash.h>

#include <new>

namespace pmsnap::layout {

std::uint64_t Checksum64(const void* data, std::size_t bytes, std::uint64_t seed) {
  return XXH3_64bits_withSeed(data, bytes, seed);
}

struct StreamingChecksum::State {
  XXH3_state_t* xxh = nullptr;
};

StreamingChecksum::StreamingChecksum(std::uint64_t seed) : state_(std::make_unique<State>()) {
  state_->xxh = XXH3_createState();
  if (state_->xxh == nullptr) throw std::bad_alloc();
  XXH3_64bits_reset_withSeed(state_->xxh, seed);
}

StreamingChecksum::~StreamingChecksum() { XXH3_freeState(state_->xxh); }

void StreamingChecksum::Update(const void* data, std::size_t bytes) {
  XXH3_64bits_update(state_->xxh, data, bytes);
}

std::uint64_t StreamingChecksum::Digest() const { return XXH3_64bits_digest(state_->xxh); }

}  // namespace pmsnap::layout
