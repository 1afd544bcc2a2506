#include "detail/chunk_format.h"

#include <cmath>
#include <cstddef>
#include <cstring>
#include <type_traits>

#include "detail/byte_codec.h"
#include "pmsnap/quant/format.h"

namespace pmsnap::diff::detail {
namespace {

constexpr std::uint32_t kDataMagic = 0x43444d50;   // "PMDC"
constexpr std::uint32_t kIndexMagic = 0x49444d50;  // "PMDI"
constexpr std::uint16_t kVersion = 1;

// Stored in PM as its raw bytes (a data chunk's first 64): pinned like the
// pool's own structs (pmem_layout/detail/format.h), offsets as FORMAT.md
// gives them, no padding whose bytes would be undefined.
struct DataHeader {
  std::uint32_t magic;
  std::uint16_t version;
  std::uint16_t tensor_count;
  std::uint64_t epoch;
  std::uint64_t rows;
  std::uint64_t bloom_words;
  std::uint64_t reserved[4];
};
static_assert(std::is_standard_layout_v<DataHeader>);
static_assert(std::has_unique_object_representations_v<DataHeader>);
static_assert(sizeof(DataHeader) == 64);
static_assert(offsetof(DataHeader, magic) == 0);
static_assert(offsetof(DataHeader, version) == 4);
static_assert(offsetof(DataHeader, tensor_count) == 6);
static_assert(offsetof(DataHeader, epoch) == 8);
static_assert(offsetof(DataHeader, rows) == 16);
static_assert(offsetof(DataHeader, bloom_words) == 24);
static_assert(offsetof(DataHeader, reserved) == 32);

std::uint64_t Mix(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
constexpr int kBloomHashes = 7;  // ~optimal for 10 bits per key


// Appends the tensor blocks of `rows` given as row records, then finishes.
Status AppendBlock(ByteWriter& w, bool quantized, const quant::QuantSpec& spec, std::uint32_t elems,
                   std::span<const std::uint8_t> records, std::uint64_t rows) {
  if (!quantized) {
    w.Put<std::uint64_t>(rows * elems * sizeof(float));
    w.Put<std::uint64_t>(0);
    w.PutBytes(records.data(), records.size());
  } else {
    quant::QuantSpec s = spec;
    s.rows = rows;
    const std::vector<std::uint8_t> serialized = quant::Serialize(quant::QuantizedView{s, records});
    w.Put<std::uint64_t>(serialized.size());
    w.Put<std::uint64_t>(1);
    w.PutBytes(serialized.data(), serialized.size());
  }
  w.PadTo8();
  return Status::Ok();
}

void WriteHeaderAndKeys(ByteWriter& w, std::uint64_t epoch, std::span<const std::uint64_t> keys,
                        std::size_t tensors, std::uint32_t bloom_bits_per_key) {
  const std::vector<std::uint64_t> bloom = BuildBloom(keys, bloom_bits_per_key);
  DataHeader header{};
  header.magic = kDataMagic;
  header.version = kVersion;
  header.tensor_count = static_cast<std::uint16_t>(tensors);
  header.epoch = epoch;
  header.rows = keys.size();
  header.bloom_words = bloom.size();
  w.Put(header);
  w.PutBytes(keys.data(), keys.size_bytes());
  w.PutBytes(bloom.data(), bloom.size() * sizeof(std::uint64_t));
}

}  // namespace

Status TensorBlock::ReadRow(std::uint64_t r, float* out) const {
  if (!quantized) {
    std::memcpy(out, raw.data() + r * elems_per_row, elems_per_row * sizeof(float));
    return Status::Ok();
  }
  return quant::DequantizeRow(quantized_view, r, out);
}

std::uint64_t BloomWords(std::uint64_t keys, std::uint32_t bits_per_key) {
  if (bits_per_key == 0 || keys == 0) return 0;
  return (keys * bits_per_key + 63) / 64;
}

std::vector<std::uint64_t> BuildBloom(std::span<const std::uint64_t> keys,
                                      std::uint32_t bits_per_key) {
  const std::uint64_t words = BloomWords(keys.size(), bits_per_key);
  if (words == 0) return {};
  std::vector<std::uint64_t> bloom(words, 0);
  const std::uint64_t bits = words * 64;
  for (std::uint64_t key : keys) {
    const std::uint64_t h1 = Mix(key), h2 = Mix(h1) | 1;
    for (int i = 0; i < kBloomHashes; ++i) {
      const std::uint64_t bit = (h1 + i * h2) % bits;
      bloom[bit / 64] |= 1ull << (bit % 64);
    }
  }
  return bloom;
}

bool BloomMayContain(std::span<const std::uint64_t> bloom, std::uint64_t key) {
  if (bloom.empty()) return true;
  const std::uint64_t bits = bloom.size() * 64;
  const std::uint64_t h1 = Mix(key), h2 = Mix(h1) | 1;
  for (int i = 0; i < kBloomHashes; ++i) {
    const std::uint64_t bit = (h1 + i * h2) % bits;
    if (((bloom[bit / 64] >> (bit % 64)) & 1) == 0) return false;
  }
  return true;
}

Result<std::vector<std::byte>> BuildDataChunk(std::uint64_t epoch,
                                              std::span<const std::uint64_t> keys,
                                              std::span<const TensorInput> tensors,
                                              const EncodeOptions& options,
                                              const std::string& table,
                                              std::vector<std::byte> buffer) {
  ByteWriter w;
  w.out = std::move(buffer);
  w.out.clear();
  // The unquantized size, an upper bound of the quantized one: the image is
  // a table's changed rows (megabytes), built once per epoch.
  std::size_t bound = sizeof(DataHeader) + keys.size_bytes() +
                      8 * BloomWords(keys.size(), options.bloom_bits_per_key);
  for (const TensorInput& t : tensors) bound += 16 + Pad8(t.rows.size_bytes());
  w.Reserve(bound);
  WriteHeaderAndKeys(w, epoch, keys, tensors.size(), options.bloom_bits_per_key);
  for (const TensorInput& t : tensors) {
    const bool quantize = options.quantize && t.elems_per_row >= 2 && !keys.empty();
    if (!quantize) {
      PMSNAP_RETURN_IF_ERROR(
          AppendBlock(w, false, {}, t.elems_per_row,
                      {reinterpret_cast<const std::uint8_t*>(t.rows.data()), t.rows.size_bytes()},
                      keys.size()));
      continue;
    }
    quant::TableView view{table, t.rows.data(), keys.size(), t.elems_per_row, 0};
    PMSNAP_ASSIGN_OR_RETURN(quant::QuantizedTable q, quant::Quantize(view, options.quant));
    PMSNAP_RETURN_IF_ERROR(AppendBlock(w, true, q.spec, t.elems_per_row, q.payload, keys.size()));
  }
  return std::move(w.out);
}

Result<std::vector<std::byte>> SliceDataChunk(const DataChunkView& source,
                                              std::span<const std::uint64_t> positions,
                                              std::uint32_t bloom_bits_per_key) {
  std::vector<std::uint64_t> keys;
  keys.reserve(positions.size());
  for (std::uint64_t p : positions) keys.push_back(source.keys[p]);
  ByteWriter w;
  WriteHeaderAndKeys(w, source.epoch, keys, source.tensors.size(), bloom_bits_per_key);
  for (const TensorBlock& t : source.tensors) {
    const std::uint64_t record = t.row_record_bytes();
    std::vector<std::uint8_t> records(record * positions.size());
    // A zero-width tensor has no bytes per row (and `records` no storage:
    // memcpy must not see its null data()).
    for (std::size_t i = 0; record != 0 && i < positions.size(); ++i) {
      std::memcpy(records.data() + i * record, t.row_record(positions[i]), record);
    }
    PMSNAP_RETURN_IF_ERROR(AppendBlock(w, t.quantized, t.quantized_view.spec, t.elems_per_row,
                                       records, positions.size()));
  }
  return std::move(w.out);
}

Result<DataChunkView> ParseDataChunk(std::span<const std::byte> bytes, const std::string& what) {
  ByteReader r(bytes, what);
  DataHeader header{};
  if (!r.Get(&header)) return r.status();
  if (header.magic != kDataMagic) {
    r.Fail("not an embedding data chunk (bad magic)");
    return r.status();
  }
  if (header.version != kVersion) {
    return Status(StatusCode::kUnsupportedVersion,
                  what + ": data chunk version " + std::to_string(header.version));
  }
  if (header.rows > r.left() / 8 || header.bloom_words > r.left() / 8) {
    r.Fail("row count " + std::to_string(header.rows) + " does not fit the chunk");
    return r.status();
  }
  DataChunkView view;
  view.epoch = header.epoch;
  const std::byte* base = bytes.data();
  view.keys = {reinterpret_cast<const std::uint64_t*>(base + r.pos()), header.rows};
  std::size_t pos = r.pos() + header.rows * 8;
  if (bytes.size() - pos < header.bloom_words * 8) {
    return Status(StatusCode::kCorruption, what + ": bloom filter truncated");
  }
  view.bloom = {reinterpret_cast<const std::uint64_t*>(base + pos), header.bloom_words};
  pos += header.bloom_words * 8;
  for (std::size_t i = 1; i < view.keys.size(); ++i) {
    if (view.keys[i] <= view.keys[i - 1]) {
      return Status(StatusCode::kCorruption, what + ": row ids are not ascending");
    }
  }
  for (std::uint16_t t = 0; t < header.tensor_count; ++t) {
    std::uint64_t block_bytes = 0, kind = 0;
    // The previous block's padding may end past the bytes (a block ending
    // unaligned at the end of the chunk): no room for another block then.
    if (pos > bytes.size() || bytes.size() - pos < 16)
      return Status(StatusCode::kCorruption, what + ": tensor block truncated");
    std::memcpy(&block_bytes, base + pos, 8);
    std::memcpy(&kind, base + pos + 8, 8);
    pos += 16;
    if (block_bytes > bytes.size() - pos || kind > 1) {
      return Status(StatusCode::kCorruption,
                    what + ": tensor " + std::to_string(t) + " block header is damaged");
    }
    TensorBlock block;
    block.quantized = kind == 1;
    if (!block.quantized) {
      if (header.rows == 0 ? block_bytes != 0 : block_bytes % (header.rows * 4) != 0) {
        return Status(StatusCode::kCorruption,
                      what + ": tensor " + std::to_string(t) + " size does not match its rows");
      }
      block.elems_per_row =
          header.rows == 0 ? 0 : static_cast<std::uint32_t>(block_bytes / header.rows / 4);
      block.raw = {reinterpret_cast<const float*>(base + pos), block_bytes / 4};
    } else {
      auto parsed = quant::Parse({reinterpret_cast<const std::uint8_t*>(base + pos), block_bytes});
      if (!parsed.ok()) {
        return Status(parsed.status().code(),
                      what + ": tensor " + std::to_string(t) + ": " + parsed.status().message());
      }
      if (parsed->spec.rows != header.rows) {
        return Status(StatusCode::kCorruption, what + ": quantized rows differ from the keys");
      }
      block.quantized_view = *parsed;
      block.elems_per_row = parsed->spec.dim;
    }
    view.tensors.push_back(block);
    pos = Pad8(pos + block_bytes);
  }
  return view;
}

std::vector<std::byte> SerializeIndex(const TableIndex& index) {
  ByteWriter w;
  auto put_ref = [&w](const ChunkRef& ref) {
    w.Put(ref.heap_id);
    w.Put(ref.offset);
    w.Put(ref.length);
  };
  w.Put(kIndexMagic);
  w.Put(static_cast<std::uint32_t>(kVersion));
  w.Put(index.policy);
  w.Put(index.epoch);
  w.Put(index.baseline_epoch);
  put_ref(index.baseline);
  w.Put(index.baseline_seconds);
  w.Put(index.increment_seconds);
  w.Put(index.read_bytes_per_second);
  w.Put(static_cast<std::uint64_t>(index.diff_sizes.size()));
  for (double s : index.diff_sizes) w.Put(s);
  w.Put(static_cast<std::uint64_t>(index.retained.size()));
  for (const RetainedCheckpoint& c : index.retained) {
    w.Put(c.epoch);
    w.Put(c.iteration);
    w.Put(static_cast<std::uint64_t>(c.refs.size()));
    for (const ChunkRef& ref : c.refs) put_ref(ref);
  }
  w.Put(static_cast<std::uint64_t>(index.nodes.size()));
  for (const ListNode& n : index.nodes) {
    put_ref(n.ref);
    w.Put(n.column);
    w.Put(n.row_epoch);
    w.Put(n.min_key);
    w.Put(n.max_key);
    w.Put(n.count);
  }
  return std::move(w.out);
}

Result<TableIndex> ParseIndex(std::span<const std::byte> bytes, const std::string& what) {
  ByteReader r(bytes, what);
  TableIndex index;
  std::uint32_t magic = 0, version = 0;
  auto get_ref = [&r](ChunkRef* ref) {
    return r.Get(&ref->heap_id) && r.Get(&ref->offset) && r.Get(&ref->length);
  };
  // Bounds a count by the bytes left so a damaged count cannot allocate.
  auto get_count = [&r](std::uint64_t* n, std::size_t min_item_bytes) {
    if (!r.Get(n)) return false;
    if (*n > r.left() / min_item_bytes) return r.Fail("count " + std::to_string(*n) + " too large");
    return true;
  };
  if (!r.Get(&magic) || !r.Get(&version)) return r.status();
  if (magic != kIndexMagic) {
    r.Fail("not an embedding index chunk (bad magic)");
    return r.status();
  }
  if (version != kVersion) {
    return Status(StatusCode::kUnsupportedVersion,
                  what + ": index version " + std::to_string(version));
  }
  std::uint64_t n = 0;
  if (!r.Get(&index.policy) || !r.Get(&index.epoch) || !r.Get(&index.baseline_epoch) ||
      !get_ref(&index.baseline) || !r.Get(&index.baseline_seconds) ||
      !r.Get(&index.increment_seconds) || !r.Get(&index.read_bytes_per_second) ||
      !get_count(&n, 8)) {
    return r.status();
  }
  index.diff_sizes.resize(n);
  for (double& s : index.diff_sizes) {
    if (!r.Get(&s)) return r.status();
  }
  if (!get_count(&n, 24)) return r.status();
  index.retained.resize(n);
  for (RetainedCheckpoint& c : index.retained) {
    std::uint64_t refs = 0;
    if (!r.Get(&c.epoch) || !r.Get(&c.iteration) || !get_count(&refs, 24)) return r.status();
    c.refs.resize(refs);
    for (ChunkRef& ref : c.refs) {
      if (!get_ref(&ref)) return r.status();
    }
  }
  if (!get_count(&n, 64)) return r.status();
  index.nodes.resize(n);
  for (ListNode& node : index.nodes) {
    if (!get_ref(&node.ref) || !r.Get(&node.column) || !r.Get(&node.row_epoch) ||
        !r.Get(&node.min_key) || !r.Get(&node.max_key) || !r.Get(&node.count)) {
      return r.status();
    }
  }
  return index;
}

}  // namespace pmsnap::diff::detail
