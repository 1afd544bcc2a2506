// Serialized form of quantized tables: header encode/decode with checksums
// and field-by-field validation (layout documented in format.h).
// Thread-safety: pure functions; the CRC table is built once, thread-safely.
#include "pmsnap/quant/format.h"

#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <string>

namespace pmsnap::quant {

namespace {

constexpr std::uint32_t kMagic = 0x54515350;  // "PSQT" little-endian

struct CrcTable {
  std::array<std::array<std::uint32_t, 256>, 8> t{};
  CrcTable() {
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82f63b78u & (0u - (c & 1u)));
      t[0][i] = c;
    }
    for (std::uint32_t i = 0; i < 256; ++i) {
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
    }
  }
};

template <typename T>
void Put(std::uint8_t* p, std::size_t off, T v) {
  std::memcpy(p + off, &v, sizeof(T));
}
template <typename T>
T Get(const std::uint8_t* p, std::size_t off) {
  T v;
  std::memcpy(&v, p + off, sizeof(T));
  return v;
}

Status Corrupt(std::string message) {
  return Status(StatusCode::kCorruption, "quantized table: " + std::move(message));
}

}  // namespace

std::uint32_t Crc32c(std::span<const std::uint8_t> bytes, std::uint32_t crc) {
  static const CrcTable table;
  const auto& t = table.t;
  std::uint32_t c = ~crc;
  const std::uint8_t* p = bytes.data();
  std::size_t n = bytes.size();
  // Slicing-by-8: eight table lookups per 8-byte word.
  while (n >= 8) {
    std::uint64_t w;
    std::memcpy(&w, p, 8);
    w ^= c;
    c = t[7][w & 0xff] ^ t[6][(w >> 8) & 0xff] ^ t[5][(w >> 16) & 0xff] ^ t[4][(w >> 24) & 0xff] ^
        t[3][(w >> 32) & 0xff] ^ t[2][(w >> 40) & 0xff] ^ t[1][(w >> 48) & 0xff] ^ t[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xff];
  return ~c;
}

std::uint64_t SerializedSize(const QuantSpec& spec) {
  return kSerializedHeaderBytes + spec.payload_bytes();
}

Status SerializeInto(const QuantizedView& view, std::span<std::uint8_t> out) {
  const QuantSpec& s = view.spec;
  if (view.payload.size() != s.payload_bytes()) {
    return Status(StatusCode::kInvalidArgument,
                  "payload holds " + std::to_string(view.payload.size()) + " bytes, spec needs " +
                      std::to_string(s.payload_bytes()));
  }
  if (out.size() != SerializedSize(s)) {
    return Status(StatusCode::kInvalidArgument, "output holds " + std::to_string(out.size()) +
                                                    " bytes, serialized form needs " +
                                                    std::to_string(SerializedSize(s)));
  }
  std::uint8_t* h = out.data();
  std::memset(h, 0, kSerializedHeaderBytes);
  Put<std::uint32_t>(h, 0, kMagic);
  Put<std::uint16_t>(h, 4, kSerializedFormatVersion);
  Put<std::uint16_t>(h, 6, static_cast<std::uint16_t>(kSerializedHeaderBytes));
  h[8] = static_cast<std::uint8_t>(s.method);
  h[9] = static_cast<std::uint8_t>(s.bits);
  h[10] = static_cast<std::uint8_t>(s.scale_type);
  h[11] = static_cast<std::uint8_t>(s.layout);
  Put<std::uint32_t>(h, 12, s.dim);
  Put<std::uint64_t>(h, 16, s.rows);
  Put<std::uint64_t>(h, 24, s.row_bytes());
  Put<std::uint64_t>(h, 32, s.payload_bytes());
  Put<std::uint32_t>(h, 40, s.adaptive.num_bins);
  Put<float>(h, 44, s.adaptive.ratio);
  Put<std::uint32_t>(h, 48, Crc32c(view.payload));
  Put<std::uint32_t>(h, 60, Crc32c({h, 60}));
  if (!view.payload.empty()) {
    std::memcpy(h + kSerializedHeaderBytes, view.payload.data(), view.payload.size());
  }
  return Status::Ok();
}

std::vector<std::uint8_t> Serialize(const QuantizedView& view) {
  std::vector<std::uint8_t> out(SerializedSize(view.spec));
  if (!SerializeInto(view, out).ok()) return {};
  return out;
}

Result<QuantizedView> Parse(std::span<const std::uint8_t> bytes) {
  if (bytes.size() < kSerializedHeaderBytes) {
    return Corrupt("truncated header: " + std::to_string(bytes.size()) + " bytes, need " +
                   std::to_string(kSerializedHeaderBytes));
  }
  const std::uint8_t* h = bytes.data();
  const auto magic = Get<std::uint32_t>(h, 0);
  if (magic != kMagic) return Corrupt("bad magic (not a pmsnap quantized table)");
  const auto version = Get<std::uint16_t>(h, 4);
  const auto stored_crc = Get<std::uint32_t>(h, 60);
  const std::uint32_t crc = Crc32c({h, 60});
  if (version > kSerializedFormatVersion) {
    return Status(StatusCode::kUnsupportedVersion,
                  "quantized table format version " + std::to_string(version) +
                      " is newer than this reader (" + std::to_string(kSerializedFormatVersion) +
                      ")");
  }
  if (stored_crc != crc) {
    return Corrupt("header checksum mismatch (stored " + std::to_string(stored_crc) +
                   ", computed " + std::to_string(crc) + ")");
  }
  if (version == 0) return Corrupt("format version 0 is invalid");
  if (Get<std::uint16_t>(h, 6) != kSerializedHeaderBytes) {
    return Corrupt("header size " + std::to_string(Get<std::uint16_t>(h, 6)) + ", expected 64");
  }
  QuantSpec s;
  s.method = static_cast<Method>(h[8]);
  s.bits = h[9];
  s.scale_type = static_cast<ScaleType>(h[10]);
  s.layout = static_cast<Layout>(h[11]);
  s.dim = Get<std::uint32_t>(h, 12);
  s.rows = Get<std::uint64_t>(h, 16);
  s.adaptive.num_bins = Get<std::uint32_t>(h, 40);
  s.adaptive.ratio = Get<float>(h, 44);
  if (h[8] < 1 || h[8] > 4) return Corrupt("unknown method " + std::to_string(h[8]));
  if (s.bits != 2 && s.bits != 3 && s.bits != 4 && s.bits != 8) {
    return Corrupt("bits " + std::to_string(s.bits) + " not in {2,3,4,8}");
  }
  if (h[10] < 1 || h[10] > 2) return Corrupt("unknown scale type " + std::to_string(h[10]));
  if (h[11] < 1 || h[11] > 2) return Corrupt("unknown layout " + std::to_string(h[11]));
  if (s.dim == 0) return Corrupt("dim is 0");
  if (!std::isfinite(s.adaptive.ratio) || s.adaptive.ratio < 0 || s.adaptive.ratio > 1) {
    return Corrupt("adaptive ratio out of [0, 1]");
  }
  for (int i = 52; i < 60; ++i) {
    if (h[i] != 0) return Corrupt("reserved byte " + std::to_string(i) + " is not zero");
  }
  const auto row_bytes = Get<std::uint64_t>(h, 24);
  if (row_bytes != s.row_bytes()) {
    return Corrupt("row bytes " + std::to_string(row_bytes) + " disagree with " +
                   MethodName(s.method) + " " + std::to_string(s.bits) + "-bit dim " +
                   std::to_string(s.dim) + " " + ScaleTypeName(s.scale_type) + " (" +
                   std::to_string(s.row_bytes()) + ")");
  }
  const auto payload_bytes = Get<std::uint64_t>(h, 32);
  // rows * row_bytes must not wrap before comparing it to the payload size.
  if (s.rows != 0 && row_bytes > UINT64_MAX / s.rows) return Corrupt("rows * row bytes overflows");
  if (payload_bytes != s.rows * row_bytes) {
    return Corrupt("payload bytes " + std::to_string(payload_bytes) + " != rows " +
                   std::to_string(s.rows) + " * row bytes " + std::to_string(row_bytes));
  }
  const std::uint64_t available = bytes.size() - kSerializedHeaderBytes;
  if (available < payload_bytes) {
    return Corrupt("truncated payload: " + std::to_string(available) + " of " +
                   std::to_string(payload_bytes) + " bytes present");
  }
  if (available > payload_bytes) {
    return Corrupt(std::to_string(available - payload_bytes) + " trailing bytes after payload");
  }
  std::span<const std::uint8_t> payload = bytes.subspan(kSerializedHeaderBytes, payload_bytes);
  const auto payload_crc = Get<std::uint32_t>(h, 48);
  if (Crc32c(payload) != payload_crc) return Corrupt("payload checksum mismatch");
  return QuantizedView{s, payload};
}

}  // namespace pmsnap::quant
