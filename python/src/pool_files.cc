#include "pool_files.h"

#include <pybind11/stl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "embedding.h"
#include "errors.h"
#include "pmsnap/pmem_layout/manifest.h"
#include "pmsnap/pmem_layout/pool.h"
#include "views.h"

namespace pmsnap::python {
namespace {

namespace py = pybind11;

py::dict SlotToDict(const layout::SlotInfo& info) {
  py::dict d;
  d["slot"] = info.slot;
  d["state"] = std::string(layout::SlotStateName(info.state));
  d["epoch"] = info.epoch;
  d["iteration"] = info.iteration;
  d["commit_time_unix_ns"] = info.commit_time_unix_ns;
  d["extra_state_bytes"] = info.extra_state_bytes;
  d["record_valid"] = info.record_valid;
  return d;
}

// A pool opened to read its checkpoints without a model (pmsnap.load_state_dict,
// the exporters and the `pmsnap list/export/diff` commands). Nothing is
// verified or read at open (no data verification, no prefault of the
// mapping): a tensor's bytes are read, and their checksums checked, only
// when that tensor is asked for, so reading one tensor of a large pool reads
// only that tensor. After each read the pages of the pool mapping it went
// through are dropped from this process's page table (the file keeps them),
// so that reading a whole pool tensor by tensor keeps the resident set
// bounded by the largest tensor instead of growing to the pool's size.
//
// Epochs: a retained epoch is one whose slot is COMPLETE with a commit record
// that verifies (two at most, the pool's two slots). Errors name the pool and
// the epoch. Writes nothing of pmsnap's own to the file (libpmemobj's open
// updates its run id in its pool descriptor).
//
// Thread-safety: one Python thread at a time (the GIL is released around
// reads, which the object does not share).
class CheckpointReader {
 public:
  explicit CheckpointReader(const std::string& path) {
    py::gil_scoped_release release;
    layout::OpenOptions options;
    options.verify_data = false;
    options.read_only = true;
    pool_ = ValueOrThrow(layout::Pool::Open(path, options));
  }

  py::dict Describe() const {
    const layout::Pool& pool = this->pool();
    py::dict d;
    d["path"] = pool.path();
    d["file_bytes"] = pool.file_bytes();
    d["part_bytes"] = pool.options().part_bytes;
    d["created_unix_ns"] = pool.created_unix_ns();
    py::dict group;
    group["run_id"] = pool.group().run_id;
    group["rank"] = pool.group().rank;
    group["world_size"] = pool.group().world_size;
    group["model_fingerprint"] = pool.group().model_fingerprint;
    d["group"] = group;
    py::list units;
    for (std::size_t u = 0; u < pool.manifest().units.size(); ++u) {
      const layout::UnitSpec& unit = pool.manifest().units[u];
      py::list tensors;
      for (const layout::TensorSpec& t : unit.tensors) {
        tensors.append(py::make_tuple(t.name, DTypeText(t.dtype), t.shape, t.bytes()));
      }
      units.append(py::make_tuple(unit.name, (unit.flags & layout::kUnitFlagEncoded) != 0,
                                  tensors));
    }
    d["units"] = units;
    d["slots"] = py::make_tuple(SlotToDict(pool.slot_info(0)), SlotToDict(pool.slot_info(1)));
    d["warnings"] = pool.warnings();
    return d;
  }

  // Retained epochs, newest first: [{epoch, iteration, commit_time_unix_ns,
  // slot, extra_state_bytes}].
  py::list Epochs() const {
    pool();  // closed readers refuse
    std::vector<layout::SnapshotView> views;
    for (int s = 0; s < 2; ++s) {
      Result<layout::SnapshotView> view = pool_->Slot(s);
      if (view.ok()) views.push_back(*view);
    }
    std::sort(views.begin(), views.end(),
              [](const auto& a, const auto& b) { return a.epoch() > b.epoch(); });
    py::list out;
    for (const layout::SnapshotView& v : views) {
      py::dict d;
      d["epoch"] = v.epoch();
      d["iteration"] = v.iteration();
      d["commit_time_unix_ns"] = v.commit_time_unix_ns();
      d["slot"] = v.slot();
      d["extra_state_bytes"] = v.extra_state().size();
      out.append(d);
    }
    return out;
  }

  // Every checksum of the pool (layout::Pool::Verify, deep): {epoch:
  // [problems]} for the committed slots, the chunk heap's under -1. Then
  // BusyError if a process opened the pool while it was read.
  py::dict Verify() const {
    const layout::Pool& pool = this->pool();
    layout::VerifyReport report;
    {
      py::gil_scoped_release release;
      report = pool.Verify(/*deep=*/true);
    }
    ThrowIfError(pool.CheckUndisturbed());
    py::dict out;
    for (const auto& slot : report.slots) {
      if (slot.info.state == layout::SlotState::kComplete) out[py::int_(slot.info.epoch)] = slot.problems;
    }
    out[py::int_(-1)] = report.chunk_problems;
    return out;
  }

  py::bytes ExtraState(std::uint64_t epoch) const {
    const layout::SnapshotView view = ViewOf(epoch);
    return py::bytes(reinterpret_cast<const char*>(view.extra_state().data()),
                     view.extra_state().size());
  }

  // Copies tensor `tensor` of unit `unit` at `epoch` to `dst` (tensor bytes),
  // checking every part's checksum; kCorruption naming pool, epoch, unit,
  // tensor and byte range otherwise.
  void ReadTensor(std::uint64_t epoch, std::uint32_t unit, std::uint32_t tensor,
                  std::uintptr_t dst) const {
    const layout::SnapshotView view = ViewOf(epoch);
    const layout::TensorLayout& t = TensorOf(unit, tensor);
    Status status;
    {
      py::gil_scoped_release release;
      auto* out = reinterpret_cast<std::byte*>(dst);
      for (std::uint32_t p = t.first_part; p < t.first_part + t.part_count && status.ok(); ++p) {
        status = pool_->ReadPart(view, p, out + pool_->layout().parts[p].offset_in_tensor);
      }
      ReleasePages(view, unit, tensor);
    }
    ThrowIfError(Annotate(status, epoch));
  }

  // Copies bytes [offset, offset + bytes) of tensor `tensor` of unit `unit`
  // at `epoch` to `dst`, reading and checking only the parts that overlap
  // them (a shard of another world size needs a slice of an old shard).
  // kInvalidArgument for a range past the tensor's end; kCorruption as
  // ReadTensor.
  void ReadRange(std::uint64_t epoch, std::uint32_t unit, std::uint32_t tensor,
                 std::uint64_t offset, std::uint64_t bytes, std::uintptr_t dst) const {
    const layout::SnapshotView view = ViewOf(epoch);
    const layout::TensorLayout& t = TensorOf(unit, tensor);
    if (offset > t.bytes || bytes > t.bytes - offset) {
      ThrowIfError(Status(StatusCode::kInvalidArgument,
                          pool_->path() + ": bytes [" + std::to_string(offset) + ", " +
                              std::to_string(offset + bytes) + ") of unit " +
                              std::to_string(unit) + " tensor " + std::to_string(tensor) +
                              " are past its " + std::to_string(t.bytes) + " bytes"));
    }
    Status status;
    {
      py::gil_scoped_release release;
      auto* out = reinterpret_cast<std::byte*>(dst);
      std::vector<std::byte> whole_part;
      for (std::uint32_t p = t.first_part; p < t.first_part + t.part_count && status.ok(); ++p) {
        const layout::PartLayout& part = pool_->layout().parts[p];
        const std::uint64_t begin = std::max(offset, part.offset_in_tensor);
        const std::uint64_t end = std::min(offset + bytes, part.offset_in_tensor + part.bytes);
        if (begin >= end) continue;
        if (begin == part.offset_in_tensor && end == part.offset_in_tensor + part.bytes) {
          status = pool_->ReadPart(view, p, out + (begin - offset));
          continue;
        }
        // A part the range covers in part: read (and check) it whole, keep the slice.
        whole_part.resize(part.bytes);
        status = pool_->ReadPart(view, p, whole_part.data());
        if (status.ok()) {
          std::memcpy(out + (begin - offset), whole_part.data() + (begin - part.offset_in_tensor),
                      end - begin);
        }
      }
      ReleasePages(view, unit, tensor);
    }
    ThrowIfError(Annotate(status, epoch));
  }

  // Checks the checksums of a tensor's parts without copying them (before a
  // zero-copy view of it is handed out).
  void VerifyTensor(std::uint64_t epoch, std::uint32_t unit, std::uint32_t tensor) const {
    const layout::SnapshotView view = ViewOf(epoch);
    const layout::TensorLayout& t = TensorOf(unit, tensor);
    Status status;
    {
      py::gil_scoped_release release;
      for (std::uint32_t p = t.first_part; p < t.first_part + t.part_count && status.ok(); ++p) {
        status = pool_->VerifyPart(view, p);
      }
      ReleasePages(view, unit, tensor);
    }
    ThrowIfError(Annotate(status, epoch));
  }

  // Offset of a tensor's bytes at `epoch` in the pool file (a single-file
  // pool's offsets are file offsets), to map it read-only.
  std::uint64_t TensorFileOffset(std::uint64_t epoch, std::uint32_t unit,
                                 std::uint32_t tensor) const {
    const layout::SnapshotView view = ViewOf(epoch);
    return pool_->SlotFileOffset(view.slot(), TensorOf(unit, tensor).slot_offset);
  }

  const layout::Pool& pool() const {
    if (pool_ == nullptr) {
      throw StatusError(Status(StatusCode::kFailedPrecondition, "checkpoint reader is closed"));
    }
    return *pool_;
  }
  // Releases the pool (its lock and mapping) now rather than when Python
  // collects the reader; later calls raise FailedPreconditionError.
  void Close() {
    py::gil_scoped_release release;
    pool_.reset();
  }

 private:
  layout::SnapshotView ViewOf(std::uint64_t epoch) const {
    pool();  // closed readers refuse
    Result<layout::SnapshotView> view = pool_->Slot(static_cast<int>(epoch % 2));
    if (view.ok() && view->epoch() == epoch) return *view;
    std::string retained;
    for (int s = 0; s < 2; ++s) {
      Result<layout::SnapshotView> other = pool_->Slot(s);
      if (!other.ok()) continue;
      retained += (retained.empty() ? "" : ", ") + std::to_string(other->epoch()) +
                  " (iteration " + std::to_string(other->iteration()) + ")";
    }
    throw StatusError(Status(StatusCode::kNotFound,
                             "pool " + pool_->path() + ": epoch " + std::to_string(epoch) +
                                 " is not retained (retained epochs: " +
                                 (retained.empty() ? std::string("none") : retained) + ")"));
  }

  const layout::TensorLayout& TensorOf(std::uint32_t unit, std::uint32_t tensor) const {
    const layout::SlotLayout& layout = pool_->layout();
    const layout::Manifest& manifest = pool_->manifest();
    if (unit >= manifest.units.size() || tensor >= layout.units[unit].tensors.size() ||
        (manifest.units[unit].flags & layout::kUnitFlagEncoded)) {
      throw StatusError(Status(StatusCode::kInvalidArgument,
                               "pool " + pool_->path() + ": no slot tensor " +
                                   std::to_string(tensor) + " in unit " + std::to_string(unit)));
    }
    return layout.units[unit].tensors[tensor];
  }

  // Adds pool and epoch to a message that does not name them already.
  Status Annotate(const Status& status, std::uint64_t epoch) const {
    if (status.ok() || status.message().find(pool_->path()) != std::string_view::npos) {
      return status;
    }
    return Status(status.code(), "pool " + pool_->path() + " epoch " + std::to_string(epoch) +
                                     ": " + std::string(status.message()));
  }

  // Drops the whole pages of a tensor's bytes from this process's page table;
  // the data stays in the file (MAP_SHARED), a later read faults it back in.
  void ReleasePages(const layout::SnapshotView& view, std::uint32_t unit,
                    std::uint32_t tensor) const {
    const std::span<const std::byte> bytes = view.tensor(unit, tensor);
    const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
    const auto begin = reinterpret_cast<std::uintptr_t>(bytes.data());
    const std::uintptr_t first = (begin + page - 1) / page * page;
    const std::uintptr_t last = (begin + bytes.size()) / page * page;
    if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
  }

  std::unique_ptr<layout::Pool> pool_;
};


// A pool written epoch by epoch without the engine (pmsnap.dcp.PoolWriter, a
// DCP StorageWriter): Pool's own writer protocol, BeginEpoch -> WriteTensor
// for every tensor -> Commit(extra state), so a crash anywhere leaves the
// pool at its previous commit. Creates the pool for `units` [(name,
// [(role, dtype, shape)])] or opens an existing one made for exactly those
// (kModelMismatch naming the first difference otherwise).
//
// Thread-safety: one Python thread at a time.
class PoolFileWriter {
 public:
  PoolFileWriter(const std::string& path,
                 const std::vector<std::pair<std::string, std::vector<std::tuple<
                     std::string, std::string, std::vector<std::int64_t>>>>>& units,
                 std::uint64_t extra_state_capacity, std::uint64_t part_bytes) {
    layout::Manifest manifest;
    for (const auto& [name, tensors] : units) {
      layout::UnitSpec unit;
      unit.name = name;
      for (const auto& [role, dtype, shape] : tensors) {
        unit.tensors.push_back({role, ParseDType(dtype, "unit '" + name + "'"), shape});
      }
      manifest.units.push_back(std::move(unit));
    }
    py::gil_scoped_release release;
    if (access(path.c_str(), F_OK) == 0) {
      layout::OpenOptions options;
      options.prefault_mapping = false;
      pool_ = ValueOrThrow(layout::Pool::Open(path, manifest, options));
    } else {
      layout::PoolOptions options;
      options.extra_state_capacity = extra_state_capacity;
      options.part_bytes = part_bytes;
      options.prefault_mapping = false;
      pool_ = ValueOrThrow(layout::Pool::Create(path, manifest, options));
    }
  }

  // Iteration of the newest committed epoch, or None.
  std::optional<std::uint64_t> LatestIteration() const {
    Result<layout::SnapshotView> latest = pool().Latest();
    if (!latest.ok()) return std::nullopt;
    return latest->iteration();
  }
  std::uint64_t Begin(std::uint64_t iteration) { return ValueOrThrow(pool().BeginEpoch(iteration)); }
  void WriteTensor(std::uint32_t unit, std::uint32_t tensor, std::uintptr_t src) {
    CallWithoutGil(
        [&] { return pool().WriteTensor(unit, tensor, reinterpret_cast<const void*>(src)); });
  }
  void Commit(const py::bytes& extra_state) {
    const std::string data = extra_state;
    CallWithoutGil([&] {
      return pool().Commit(
          std::span<const std::byte>(reinterpret_cast<const std::byte*>(data.data()), data.size()));
    });
  }
  void Abandon() { pool().Abandon(); }
  void Close() {
    py::gil_scoped_release release;
    pool_.reset();
  }

 private:
  layout::Pool& pool() const {
    if (pool_ == nullptr) {
      throw StatusError(Status(StatusCode::kFailedPrecondition, "pool writer is closed"));
    }
    return *pool_;
  }
  std::unique_ptr<layout::Pool> pool_;
};

// `pmsnap prune POOL --keep N`: keeps the newest `keep` (>= 1) retained
// epochs; with the pool's two slots only keep 1 drops anything (the older
// epoch, Pool::DiscardOlderEpoch). The pool is opened with full data
// verification, so a damaged newest slot is never what is kept.
py::dict PrunePool(const std::string& path, std::uint64_t keep) {
  if (keep < 1) {
    throw StatusError(Status(StatusCode::kInvalidArgument,
                             "pool " + path + ": prune must keep at least 1 epoch"));
  }
  std::unique_ptr<layout::Pool> pool;
  std::optional<std::uint64_t> dropped;
  {
    py::gil_scoped_release release;
    layout::OpenOptions options;
    options.prefault_mapping = false;
    pool = ValueOrThrow(layout::Pool::Open(path, options));
    if (keep < 2) dropped = ValueOrThrow(pool->DiscardOlderEpoch());
  }
  py::list kept;
  for (int s = 0; s < 2; ++s) {
    Result<layout::SnapshotView> view = pool->Slot(s);
    if (view.ok()) kept.append(view->epoch());
  }
  kept.attr("sort")(py::arg("reverse") = true);
  py::dict d;
  d["pool"] = path;
  d["kept"] = kept;
  d["dropped"] = dropped ? py::list(py::make_tuple(*dropped)) : py::list();
  d["warnings"] = pool->warnings();
  return d;
}

// Manifest and commit state of an existing pool, for code that does not know
// the model yet (restore creates lazily-made optimizer state from it).
py::dict ReadPool(const std::string& path, bool verify_data) {
  std::unique_ptr<layout::Pool> pool;
  {
    py::gil_scoped_release release;
    layout::OpenOptions options;
    options.verify_data = verify_data;
    options.read_only = true;
    pool = ValueOrThrow(layout::Pool::Open(path, options));
  }
  py::dict d;
  d["path"] = pool->path();
  d["format_version"] = pool->format_version();
  d["file_bytes"] = pool->file_bytes();
  d["part_bytes"] = pool->options().part_bytes;
  d["extra_state_capacity"] = pool->options().extra_state_capacity;
  d["chunk_heap_bytes"] = pool->options().chunk_heap_bytes;
  py::list units;
  for (const layout::UnitSpec& unit : pool->manifest().units) {
    py::list tensors;
    for (const layout::TensorSpec& t : unit.tensors) {
      tensors.append(py::make_tuple(t.name, DTypeText(t.dtype), t.shape));
    }
    units.append(py::make_tuple(unit.name, tensors));
  }
  d["units"] = units;
  py::list encoded;
  for (const layout::UnitSpec& unit : pool->manifest().units) {
    if (unit.flags & layout::kUnitFlagEncoded) encoded.append(unit.name);
  }
  d["encoded_units"] = encoded;
  d["slots"] = py::make_tuple(SlotToDict(pool->slot_info(0)), SlotToDict(pool->slot_info(1)));
  Result<layout::SnapshotView> latest = pool->Latest();
  if (latest.ok()) {
    py::dict l;
    l["epoch"] = latest->epoch();
    l["iteration"] = latest->iteration();
    l["slot"] = latest->slot();
    d["latest"] = l;
  } else {
    d["latest"] = py::none();
  }
  d["warnings"] = pool->warnings();
  return d;
}

}  // namespace

void RegisterPoolFiles(py::module_& m) {
  py::class_<CheckpointReader>(m, "CheckpointReader",
                               "A pool opened to read its retained checkpoints without a model.")
      .def(py::init<const std::string&>(), py::arg("path"))
      .def("describe", &CheckpointReader::Describe,
           "Path, rank group, units [(name, encoded, [(role, dtype, shape, bytes)])], slots.")
      .def("epochs", &CheckpointReader::Epochs, "Retained epochs, newest first.")
      .def("verify", &CheckpointReader::Verify,
           "Every checksum: {epoch: [problems]} for the committed slots, chunk problems under "
           "-1; BusyError if another process opened the pool meanwhile.")
      .def("close", &CheckpointReader::Close, "Releases the pool file now.")
      .def("extra_state", &CheckpointReader::ExtraState, py::arg("epoch"))
      .def("read_tensor", &CheckpointReader::ReadTensor, py::arg("epoch"), py::arg("unit"),
           py::arg("tensor"), py::arg("dst"))
      .def("read_range", &CheckpointReader::ReadRange, py::arg("epoch"), py::arg("unit"),
           py::arg("tensor"), py::arg("offset"), py::arg("bytes"), py::arg("dst"),
           "Bytes [offset, offset + bytes) of a tensor, reading and checking only the parts "
           "that overlap them.")
      .def("verify_tensor", &CheckpointReader::VerifyTensor, py::arg("epoch"), py::arg("unit"),
           py::arg("tensor"))
      .def("tensor_file_offset", &CheckpointReader::TensorFileOffset, py::arg("epoch"),
           py::arg("unit"), py::arg("tensor"))
      .def(
          "recover_table",
          [](const CheckpointReader& r, const std::string& table, std::uint64_t epoch) {
            return RecoverTableOf(r.pool(), table, epoch);
          },
          py::arg("table"), py::arg("epoch"))
      .def(
          "list_checkpoints",
          [](const CheckpointReader& r, const std::string& table) {
            return ListCheckpointsOf(r.pool(), table);
          },
          py::arg("table"));


  py::class_<PoolFileWriter>(m, "PoolFileWriter",
                             "A pool written epoch by epoch with Pool's commit protocol.")
      .def(py::init<const std::string&,
                    const std::vector<std::pair<
                        std::string, std::vector<std::tuple<std::string, std::string,
                                                            std::vector<std::int64_t>>>>>&,
                    std::uint64_t, std::uint64_t>(),
           py::arg("path"), py::arg("units"), py::arg("extra_state_capacity"),
           py::arg("part_bytes") = std::uint64_t{4} << 20)
      .def("latest_iteration", &PoolFileWriter::LatestIteration)
      .def("begin", &PoolFileWriter::Begin, py::arg("iteration"))
      .def("write_tensor", &PoolFileWriter::WriteTensor, py::arg("unit"), py::arg("tensor"),
           py::arg("src"))
      .def("commit", &PoolFileWriter::Commit, py::arg("extra_state"))
      .def("abandon", &PoolFileWriter::Abandon)
      .def("close", &PoolFileWriter::Close);

  m.def("prune_pool", &PrunePool, py::arg("path"), py::arg("keep"),
        "Keeps the newest `keep` retained epochs of pool `path` -> {pool, kept, dropped}.");
  m.def("read_pool", &ReadPool, py::arg("path"), py::arg("verify_data") = false,
        "Manifest, options and commit state of an existing pool.");
}

}  // namespace pmsnap::python
