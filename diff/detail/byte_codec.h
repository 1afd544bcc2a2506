// ByteWriter / ByteReader: the field-by-field encoding (host byte order,
// fixed-width fields, blocks padded to 8 bytes) of every payload diff/
// stores: embedding data and index chunks (chunk_format.cc), LowDiff's
// differential chunks (differential_log.cc) and the CPR ledger (cpr.cc).
// One implementation, so that every decoder bounds its reads the same way.
//
// Thread-safety: plain values; one thread each.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "pmsnap/common/status.h"

namespace pmsnap::diff::detail {

inline std::uint64_t Pad8(std::uint64_t n) { return (n + 7) / 8 * 8; }

class ByteWriter {
 public:
  template <typename T>
  void Put(const T& v) {
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    out.insert(out.end(), p, p + sizeof(T));
  }
  void PutBytes(const void* data, std::size_t n) {
    const auto* p = static_cast<const std::byte*>(data);
    out.insert(out.end(), p, p + n);
  }
  void PadTo8() { out.resize(Pad8(out.size()), std::byte{0}); }
  // One allocation for what is written next, not a doubling per overflow.
  void Reserve(std::size_t bytes) { out.reserve(out.size() + bytes); }
  std::vector<std::byte> out;
};

// Reads never go past the span: a short read returns false and keeps the
// first failure's text ("<what>: truncated at byte N") for status().
class ByteReader {
 public:
  explicit ByteReader(std::span<const std::byte> in, std::string what = "payload")
      : in_(in), what_(std::move(what)) {}
  template <typename T>
  bool Get(T* v) {
    if (in_.size() - pos_ < sizeof(T)) return Fail("truncated");
    std::memcpy(v, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  // `n` bytes into `out`, then skips their padding to 8 bytes.
  bool GetPadded(std::vector<std::byte>* out, std::uint64_t n) {
    if (in_.size() - pos_ < Pad8(n)) return Fail("truncated block");
    out->assign(in_.data() + pos_, in_.data() + pos_ + n);
    pos_ += Pad8(n);
    return true;
  }
  bool Fail(const std::string& why) {
    if (error_.empty()) error_ = what_ + ": " + why + " at byte " + std::to_string(pos_);
    return false;
  }
  Status status() const { return Status(StatusCode::kCorruption, error_); }
  std::size_t pos() const { return pos_; }
  std::size_t left() const { return in_.size() - pos_; }

 private:
  std::span<const std::byte> in_;
  std::string what_;
  std::size_t pos_ = 0;
  std::string error_;
};

}  // namespace pmsnap::diff::detail
