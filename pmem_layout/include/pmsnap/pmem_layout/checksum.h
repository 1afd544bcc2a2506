// Checksums for pool structures and unit parts: XXH3-64 (libxxhash), fast
// enough to run while copying at memory bandwidth.
//
// Thread-safety: functions are pure; a StreamingChecksum belongs to one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace pmsnap::layout {

std::uint64_t Checksum64(const void* data, std::size_t bytes, std::uint64_t seed = 0);

// Incremental XXH3-64: Update() over consecutive pieces gives the same value
// as Checksum64 over their concatenation.
class StreamingChecksum {
 public:
  explicit StreamingChecksum(std::uint64_t seed = 0);
  ~StreamingChecksum();
  StreamingChecksum(const StreamingChecksum&) = delete;
  StreamingChecksum& operator=(const StreamingChecksum&) = delete;
  void Update(const void* data, std::size_t bytes);
  std::uint64_t Digest() const;

 private:
  struct State;
  std::unique_ptr<State> state_;  // heap: keeps the 576-byte XXH3 state out of this header
};

}  // namespace pmsnap::layout
