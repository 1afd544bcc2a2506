#include "pmsnap/pmem_layout/manifest.h"

#include <algorithm>
#include <cstring>
#include <set>
#include <sstream>

#include "pmsnap/pmem_layout/checksum.h"

namespace pmsnap::layout {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the pool format is little-endian; big-endian hosts are not supported");

constexpr std::uint32_t kManifestMagic = 0x4e414d50;  // "PMAN"
constexpr std::uint32_t kManifestEncodingVersion = 1;

class ByteWriter {
 public:
  template <typename T>
  void Put(T value) {
    const auto* p = reinterpret_cast<const std::byte*>(&value);
    out_.insert(out_.end(), p, p + sizeof(T));
  }
  void PutString(const std::string& s) {
    Put<std::uint32_t>(static_cast<std::uint32_t>(s.size()));
    const auto* p = reinterpret_cast<const std::byte*>(s.data());
    out_.insert(out_.end(), p, p + s.size());
  }
  std::vector<std::byte> Take() { return std::move(out_); }

 private:
  std::vector<std::byte> out_;
};

// Bounds-checked reads; the first failure sticks and names what was read.
class ByteReader {
 public:
  ByteReader(std::span<const std::byte> in, std::string_view what) : in_(in), what_(what) {}

  template <typename T>
  bool Get(T* value, const char* field) {
    if (!Need(sizeof(T), field)) return false;
    std::memcpy(value, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  bool GetString(std::string* s, const char* field) {
    std::uint32_t len = 0;
    if (!Get(&len, field)) return false;
    if (len > kMaxNameBytes) {
      return Fail(std::string(field) + " length " + std::to_string(len) + " exceeds " +
                  std::to_string(kMaxNameBytes));
    }
    if (!Need(len, field)) return false;
    s->assign(reinterpret_cast<const char*>(in_.data() + pos_), len);
    pos_ += len;
    return true;
  }
  bool Fail(const std::string& why) {
    if (error_.empty()) {
      error_ =
          "manifest of " + std::string(what_) + " at byte " + std::to_string(pos_) + ": " + why;
    }
    return false;
  }
  bool AtEnd() const { return pos_ == in_.size(); }
  const std::string& error() const { return error_; }

 private:
  bool Need(std::size_t bytes, const char* field) {
    if (in_.size() - pos_ < bytes) {
      return Fail(std::string("truncated while reading ") + field + " (need " +
                  std::to_string(bytes) + " bytes, " + std::to_string(in_.size() - pos_) +
                  " left)");
    }
    return true;
  }
  std::span<const std::byte> in_;
  std::string_view what_;
  std::size_t pos_ = 0;
  std::string error_;
};

std::uint64_t AlignUp(std::uint64_t value, std::uint64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

// The encoding of everything that defines the model (not the pool options).
void SerializeUnits(const Manifest& manifest, ByteWriter& w) {
  w.Put<std::uint32_t>(static_cast<std::uint32_t>(manifest.units.size()));
  for (const UnitSpec& unit : manifest.units) {
    w.PutString(unit.name);
    w.Put<std::uint32_t>(unit.flags);
    w.Put<std::uint32_t>(static_cast<std::uint32_t>(unit.tensors.size()));
    for (const TensorSpec& t : unit.tensors) {
      w.PutString(t.name);
      w.Put<std::uint8_t>(static_cast<std::uint8_t>(t.dtype));
      w.Put<std::uint8_t>(static_cast<std::uint8_t>(t.shape.size()));
      for (std::int64_t d : t.shape) w.Put<std::int64_t>(d);
    }
  }
}

}  // namespace

std::size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat64:
    case DType::kInt64:
      return 8;
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
    case DType::kInt16:
      return 2;
    case DType::kInt8:
    case DType::kUInt8:
    case DType::kBool:
      return 1;
  }
  return 0;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kInt64:
      return "int64";
    case DType::kInt32:
      return "int32";
    case DType::kInt16:
      return "int16";
    case DType::kInt8:
      return "int8";
    case DType::kUInt8:
      return "uint8";
    case DType::kBool:
      return "bool";
  }
  return "unknown";
}

std::uint64_t TensorSpec::numel() const {
  std::uint64_t n = 1;
  for (std::int64_t d : shape) n *= static_cast<std::uint64_t>(d < 0 ? 0 : d);
  return n;
}

std::uint64_t UnitSpec::bytes() const {
  std::uint64_t total = 0;
  for (const TensorSpec& t : tensors) total += t.bytes();
  return total;
}

std::string ShapeToString(std::span<const std::int64_t> shape) {
  std::ostringstream out;
  out << '[';
  for (std::size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << ']';
  return out.str();
}

Status Manifest::Validate() const {
  std::set<std::string_view> names;
  for (std::size_t u = 0; u < units.size(); ++u) {
    const UnitSpec& unit = units[u];
    const std::string where = "unit " + std::to_string(u) + " '" + unit.name + "'";
    if (unit.name.empty() || unit.name.size() > kMaxNameBytes) {
      return {StatusCode::kInvalidArgument,
              where + ": name must have 1.." + std::to_string(kMaxNameBytes) + " bytes"};
    }
    if (!names.insert(unit.name).second) {
      return {StatusCode::kInvalidArgument, where + ": duplicate unit name"};
    }
    if (unit.tensors.empty() || unit.tensors.size() > kMaxTensorsPerUnit) {
      return {StatusCode::kInvalidArgument,
              where + ": needs 1.." + std::to_string(kMaxTensorsPerUnit) + " tensors"};
    }
    std::set<std::string_view> tensor_names;
    for (const TensorSpec& t : unit.tensors) {
      const std::string twhere = where + " tensor '" + t.name + "'";
      if (t.name.empty() || t.name.size() > kMaxNameBytes || !tensor_names.insert(t.name).second) {
        return {StatusCode::kInvalidArgument,
                twhere + ": tensor names must be unique and non-empty"};
      }
      if (DTypeSize(t.dtype) == 0) {
        return {StatusCode::kInvalidArgument,
                twhere + ": unknown dtype code " + std::to_string(static_cast<int>(t.dtype))};
      }
      if (t.shape.size() > kMaxRank) {
        return {StatusCode::kInvalidArgument, twhere + ": rank " + std::to_string(t.shape.size()) +
                                                  " exceeds " + std::to_string(kMaxRank)};
      }
      for (std::int64_t d : t.shape) {
        if (d < 0) {
          return {StatusCode::kInvalidArgument,
                  twhere + ": negative dimension in shape " + ShapeToString(t.shape)};
        }
      }
    }
  }
  return Status::Ok();
}

std::uint64_t Manifest::Signature() const {
  ByteWriter w;
  SerializeUnits(*this, w);
  std::vector<std::byte> bytes = w.Take();
  return Checksum64(bytes.data(), bytes.size(), /*seed=*/0x706d736e6170);
}

std::vector<std::byte> Manifest::Serialize() const {
  ByteWriter w;
  w.Put<std::uint32_t>(kManifestMagic);
  w.Put<std::uint32_t>(kManifestEncodingVersion);
  SerializeUnits(*this, w);
  return w.Take();
}

Result<Manifest> Manifest::Parse(std::span<const std::byte> bytes, std::string_view what) {
  ByteReader r(bytes, what);
  Manifest manifest;
  auto corruption = [&r]() { return Status(StatusCode::kCorruption, r.error()); };
  std::uint32_t magic = 0, version = 0, unit_count = 0;
  if (!r.Get(&magic, "magic") || !r.Get(&version, "encoding version")) return corruption();
  if (magic != kManifestMagic) {
    r.Fail("bad manifest magic");
    return corruption();
  }
  if (version != kManifestEncodingVersion) {
    return Status(StatusCode::kUnsupportedVersion,
                  "manifest of " + std::string(what) + " uses encoding version " +
                      std::to_string(version) + ", this build reads version " +
                      std::to_string(kManifestEncodingVersion));
  }
  if (!r.Get(&unit_count, "unit count")) return corruption();
  // Each unit takes at least 12 bytes; reject counts the blob cannot hold
  // before reserving memory for them.
  if (unit_count > bytes.size() / 12) {
    r.Fail("unit count " + std::to_string(unit_count) + " does not fit in " +
           std::to_string(bytes.size()) + " bytes");
    return corruption();
  }
  manifest.units.resize(unit_count);
  for (UnitSpec& unit : manifest.units) {
    std::uint32_t tensor_count = 0;
    if (!r.GetString(&unit.name, "unit name") || !r.Get(&unit.flags, "unit flags") ||
        !r.Get(&tensor_count, "tensor count")) {
      return corruption();
    }
    if (tensor_count > kMaxTensorsPerUnit) {
      r.Fail("unit '" + unit.name + "' claims " + std::to_string(tensor_count) + " tensors");
      return corruption();
    }
    unit.tensors.resize(tensor_count);
    for (TensorSpec& t : unit.tensors) {
      std::uint8_t dtype = 0, rank = 0;
      if (!r.GetString(&t.name, "tensor name") || !r.Get(&dtype, "dtype") ||
          !r.Get(&rank, "rank")) {
        return corruption();
      }
      if (rank > kMaxRank) {
        r.Fail("tensor '" + t.name + "' claims rank " + std::to_string(rank));
        return corruption();
      }
      t.dtype = static_cast<DType>(dtype);
      t.shape.resize(rank);
      for (std::int64_t& d : t.shape) {
        if (!r.Get(&d, "dimension")) return corruption();
      }
    }
  }
  if (!r.AtEnd()) {
    r.Fail("trailing bytes after the last unit");
    return corruption();
  }
  Status valid = manifest.Validate();
  if (!valid.ok()) {
    return Status(StatusCode::kCorruption,
                  "manifest of " + std::string(what) + " is inconsistent: " + valid.message());
  }
  return manifest;
}

std::string Manifest::FirstDifference(const Manifest& other) const {
  const std::size_t common = std::min(units.size(), other.units.size());
  for (std::size_t u = 0; u < common; ++u) {
    const UnitSpec& a = units[u];
    const UnitSpec& b = other.units[u];
    if (a == b) continue;
    std::ostringstream out;
    out << "unit " << u << " '" << a.name << "'";
    if (a.name != b.name) {
      out << ": name differs ('" << a.name << "' vs '" << b.name << "')";
      return out.str();
    }
    if (a.flags != b.flags) {
      out << ": flags " << a.flags << " vs " << b.flags;
      return out.str();
    }
    if (a.tensors.size() != b.tensors.size()) {
      out << ": " << a.tensors.size() << " tensors vs " << b.tensors.size();
      return out.str();
    }
    for (std::size_t t = 0; t < a.tensors.size(); ++t) {
      const TensorSpec& ta = a.tensors[t];
      const TensorSpec& tb = b.tensors[t];
      if (ta == tb) continue;
      out << ": tensor " << t << " '" << ta.name << "'";
      if (ta.name != tb.name) {
        out << " name differs ('" << ta.name << "' vs '" << tb.name << "')";
      } else if (ta.dtype != tb.dtype) {
        out << " dtype " << DTypeName(ta.dtype) << " vs " << DTypeName(tb.dtype);
      } else {
        out << " shape " << ShapeToString(ta.shape) << " vs " << ShapeToString(tb.shape);
      }
      return out.str();
    }
  }
  if (units.size() != other.units.size()) {
    std::ostringstream out;
    out << units.size() << " units vs " << other.units.size();
    if (units.size() > other.units.size()) {
      out << " (first extra unit: '" << units[common].name << "')";
    } else {
      out << " (first missing unit: '" << other.units[common].name << "')";
    }
    return out.str();
  }
  return "";
}

SlotLayout ComputeLayout(const Manifest& manifest, std::uint64_t part_bytes,
                         std::uint64_t extent_bytes) {
  SlotLayout layout;
  layout.extent_bytes = extent_bytes;
  layout.units.resize(manifest.units.size());
  std::uint64_t offset = 0;
  for (std::size_t u = 0; u < manifest.units.size(); ++u) {
    const UnitSpec& spec = manifest.units[u];
    UnitLayout& unit = layout.units[u];
    unit.first_part = static_cast<std::uint32_t>(layout.parts.size());
    unit.tensors.resize(spec.tensors.size());
    if ((spec.flags & kUnitFlagEncoded) == 0) {
      for (std::size_t t = 0; t < spec.tensors.size(); ++t) {
        TensorLayout& tensor = unit.tensors[t];
        tensor.bytes = spec.tensors[t].bytes();
        offset = AlignUp(offset, kTensorAlignment);
        if (extent_bytes != 0 && tensor.bytes <= extent_bytes &&
            offset % extent_bytes + tensor.bytes > extent_bytes) {
          offset = AlignUp(offset, extent_bytes);
        }
        tensor.slot_offset = offset;
        tensor.first_part = static_cast<std::uint32_t>(layout.parts.size());
        // A zero-byte tensor still gets one (empty) part so every tensor has
        // a checksum entry and a "written" mark.
        std::uint64_t done = 0;
        do {
          const std::uint64_t piece = std::min(part_bytes, tensor.bytes - done);
          layout.parts.push_back(PartLayout{static_cast<std::uint32_t>(u),
                                            static_cast<std::uint32_t>(t), done, piece,
                                            offset + done});
          done += piece;
        } while (done < tensor.bytes);
        tensor.part_count = static_cast<std::uint32_t>(layout.parts.size()) - tensor.first_part;
        offset += tensor.bytes;
        unit.bytes += tensor.bytes;
      }
    }
    unit.part_count = static_cast<std::uint32_t>(layout.parts.size()) - unit.first_part;
  }
  layout.slot_bytes = AlignUp(offset, kTensorAlignment);
  if (extent_bytes == 0) {
    layout.extent_used = {layout.slot_bytes};
  } else {
    layout.extent_used.assign(std::max<std::uint64_t>(1, (layout.slot_bytes + extent_bytes - 1) /
                                                             extent_bytes),
                              0);
    for (const UnitLayout& unit : layout.units) {
      for (const TensorLayout& tensor : unit.tensors) {
        if (tensor.bytes == 0) continue;
        const std::uint64_t extent = tensor.slot_offset / extent_bytes;
        const std::uint64_t end =
            AlignUp(tensor.slot_offset + tensor.bytes, kTensorAlignment) - extent * extent_bytes;
        layout.extent_used[extent] = std::max(layout.extent_used[extent], end);
      }
    }
  }
  return layout;
}

}  // namespace pmsnap::layout
