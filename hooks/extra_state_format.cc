// Extra state packing (see extra_state.h). Kept apart from the libtorch RNG
// functions in extra_state.cc so that it builds without libtorch: the fuzz
// build (tests/fuzz/) compiles this file alone.
#include <cstring>
#include <string>

#include "pmsnap/hooks/extra_state.h"

namespace pmsnap::hooks {
namespace {

constexpr char kMagic[4] = {'P', 'M', 'S', 'X'};
constexpr std::uint32_t kVersion = 1;

template <typename T>
void Append(std::vector<std::byte>& out, T value) {
  // pmsnap targets little-endian hosts only (FORMAT.md); plain copies suffice.
  const auto* bytes = reinterpret_cast<const std::byte*>(&value);
  out.insert(out.end(), bytes, bytes + sizeof(T));
}

void AppendBlob(std::vector<std::byte>& out, const std::vector<std::byte>& blob) {
  Append<std::uint32_t>(out, static_cast<std::uint32_t>(blob.size()));
  out.insert(out.end(), blob.begin(), blob.end());
}

// Reads from `bytes` front to back; every read is bounds-checked.
class Reader {
 public:
  explicit Reader(std::span<const std::byte> bytes) : bytes_(bytes) {}
  template <typename T>
  bool Read(T* value) {
    if (bytes_.size() - offset_ < sizeof(T)) return false;
    std::memcpy(value, bytes_.data() + offset_, sizeof(T));
    offset_ += sizeof(T);
    return true;
  }
  bool ReadBlob(std::vector<std::byte>* blob) {
    std::uint32_t length = 0;
    if (!Read(&length) || bytes_.size() - offset_ < length) return false;
    blob->assign(bytes_.begin() + offset_, bytes_.begin() + offset_ + length);
    offset_ += length;
    return true;
  }
  bool at_end() const { return offset_ == bytes_.size(); }

 private:
  std::span<const std::byte> bytes_;
  std::size_t offset_ = 0;
};

Status Corrupt(const std::string& what) {
  return Status(StatusCode::kCorruption, "extra state: " + what);
}

}  // namespace

std::vector<std::byte> PackExtraState(const ExtraState& state) {
  std::vector<std::byte> out;
  out.reserve(24 + state.rng_state.size() + state.user.size());
  for (char c : kMagic) out.push_back(static_cast<std::byte>(c));
  Append<std::uint32_t>(out, kVersion);
  Append<std::uint64_t>(out, state.data_position);
  AppendBlob(out, state.rng_state);
  AppendBlob(out, state.user);
  return out;
}

Result<ExtraState> UnpackExtraState(std::span<const std::byte> bytes) {
  Reader reader(bytes);
  char magic[4];
  if (!reader.Read(&magic) || std::memcmp(magic, kMagic, sizeof(kMagic)) != 0) {
    return Corrupt("not packed by PackExtraState (bad magic, " + std::to_string(bytes.size()) +
                   " bytes)");
  }
  std::uint32_t version = 0;
  if (!reader.Read(&version) || version != kVersion) {
    return Corrupt("unsupported version " + std::to_string(version));
  }
  ExtraState state;
  if (!reader.Read(&state.data_position) || !reader.ReadBlob(&state.rng_state) ||
      !reader.ReadBlob(&state.user)) {
    return Corrupt("truncated (" + std::to_string(bytes.size()) + " bytes)");
  }
  if (!reader.at_end()) return Corrupt("trailing bytes");
  return state;
}

}  // namespace pmsnap::hooks
