#include "testutil/power_loss.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

namespace pmsnap::testing {
namespace {

using layout::detail::InstallPersistenceForTesting;
using layout::detail::seam::Production;

constexpr std::size_t kWord = 8;

// Copies `bytes` (a multiple of kWord, aligned) of the live pool mapping,
// which engine workers may be storing into meanwhile: that is what the
// simulator models. A store not yet drained may or may not have reached PM
// at a power loss, word by word, so any mix of old and new aligned words
// is an image the model allows. Each word is read whole (an aligned 8-byte
// load is atomic on x86). ThreadSanitizer would report these reads against
// the workers' stores: that concurrency is the thing simulated, not a race
// in pmsnap, hence the attribute rather than a suppression naming pmsnap code.
__attribute__((no_sanitize("thread"))) void ReadLive(const std::byte* live, std::byte* out,
                                                      std::size_t bytes) {
  for (std::size_t w = 0; w < bytes; w += kWord) {
    const std::uint64_t word =
        __atomic_load_n(reinterpret_cast<const std::uint64_t*>(live + w), __ATOMIC_RELAXED);
    std::memcpy(out + w, &word, kWord);
  }
}

}  // namespace

std::string PowerLossImage::Describe() const {
  return "image '" + variant + "' at seam event " + std::to_string(event) + " (" +
         std::to_string(line_offsets.size()) + " lines differ from the created file)";
}

PowerLossSimulator::PowerLossSimulator(std::uint64_t seed) : random_(seed) {
  InstallPersistenceForTesting(this);
  installed_ = true;
}

PowerLossSimulator::~PowerLossSimulator() { Stop(); }

void PowerLossSimulator::SetPlan(Plan plan) {
  std::lock_guard<std::mutex> lock(mutex_);
  plan_ = std::move(plan);
}

void PowerLossSimulator::Stop() {
  if (!installed_) return;
  InstallPersistenceForTesting(nullptr);
  installed_ = false;
}

std::uint64_t PowerLossSimulator::events() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return events_;
}

PMEMobjpool* PowerLossSimulator::tracked_pool() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pop_;
}

const std::byte* PowerLossSimulator::tracked_base() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return base_;
}

std::uint64_t PowerLossSimulator::persist_points() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return persist_points_;
}

void PowerLossSimulator::Mapped(PMEMobjpool* pop, std::byte* base, std::uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (mapped_) return;  // another pool while the tracked one is open: not tracked
  if (first_mapping_.empty()) {
    // libpmemobj made the file durable before returning it.
    first_mapping_.assign(base, base + bytes);
    durable_ = first_mapping_;
    durable_sequence_.assign(bytes / kLine + 1, 0);
    pop_ = pop;
    base_ = base;
    mapped_ = true;
    return;
  }
  if (bytes != durable_.size()) return;  // not the file tracked before
  // The tracked file, reopened: libpmemobj's open wrote and made durable its
  // own metadata; pmsnap's undurable stores from before the close stay so.
  pop_ = pop;
  base_ = base;
  mapped_ = true;
  AbsorbLibraryWritesLocked(dirty_before_library_);
  dirty_before_library_.clear();
}

void PowerLossSimulator::Unmapping(PMEMobjpool* pop) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!Tracks(pop)) return;
  dirty_before_library_ = DirtyLinesLocked();
  // Flushed lines not drained by now are as undurable as any dirty line.
  pending_.clear();
  mapped_ = false;
}

void PowerLossSimulator::Flush(PMEMobjpool* pop, const void* addr, std::size_t bytes) {
  Production().Flush(pop, addr, bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  if (!Tracks(pop)) return;
  RecordFlushLocked(addr, bytes);
  const auto [offset, length] = RangeOf(addr, bytes);
  AfterEventLocked(SeamEvent::Kind::kFlush, offset, length);
}

void PowerLossSimulator::Drain(PMEMobjpool* pop) {
  Production().Drain(pop);
  std::lock_guard<std::mutex> lock(mutex_);
  if (!Tracks(pop)) return;
  auto mine = pending_.find(std::this_thread::get_id());
  if (mine != pending_.end()) {
    for (const auto& [offset, line] : mine->second) {
      std::uint64_t& durable_sequence = durable_sequence_[offset / kLine];
      if (line.sequence < durable_sequence) continue;  // another thread made newer bytes durable
      std::memcpy(durable_.data() + offset, line.bytes.data(), kLine);
      durable_sequence = line.sequence;
    }
    pending_.erase(mine);
  }
  AfterEventLocked(SeamEvent::Kind::kDrain);
}

void PowerLossSimulator::CopyNonTemporal(PMEMobjpool* pop, void* dst, const void* src,
                                         std::size_t bytes) {
  Production().CopyNonTemporal(pop, dst, src, bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  if (!Tracks(pop)) return;
  // Streaming stores bypass the cache: like flushed lines, durable at the
  // next drain.
  RecordFlushLocked(dst, bytes);
  const auto [offset, length] = RangeOf(dst, bytes);
  AfterEventLocked(SeamEvent::Kind::kCopyNonTemporal, offset, length);
}

std::size_t PowerLossSimulator::StreamAndHash(void* dst, const void* src, std::size_t bytes,
                                              std::uint64_t* hash) {
  const std::size_t streamed = Production().StreamAndHash(dst, src, bytes, hash);
  std::lock_guard<std::mutex> lock(mutex_);
  const auto* at = static_cast<const std::byte*>(dst);
  if (!mapped_ || at < base_ || at >= base_ + durable_.size()) return streamed;
  RecordFlushLocked(dst, streamed);
  const auto [offset, length] = RangeOf(dst, streamed);
  AfterEventLocked(SeamEvent::Kind::kStreamAndHash, offset, length);
  return streamed;
}

void PowerLossSimulator::BeginLibraryWrites(PMEMobjpool* pop) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!Tracks(pop) || library_depth_++ > 0) return;
  dirty_before_library_ = DirtyLinesLocked();
}

void PowerLossSimulator::EndLibraryWrites(PMEMobjpool* pop) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!Tracks(pop) || --library_depth_ > 0) return;
  AbsorbLibraryWritesLocked(dirty_before_library_);
  dirty_before_library_.clear();
}

std::pair<std::uint64_t, std::uint64_t> PowerLossSimulator::RangeOf(const void* addr,
                                                                    std::size_t bytes) const {
  const auto* at = static_cast<const std::byte*>(addr);
  const std::uint64_t begin = std::min<std::uint64_t>(at - base_, durable_.size());
  return {begin, std::min<std::uint64_t>(bytes, durable_.size() - begin)};
}

void PowerLossSimulator::RecordFlushLocked(const void* addr, std::size_t bytes) {
  if (bytes == 0) return;
  const auto* at = static_cast<const std::byte*>(addr);
  const std::uint64_t begin = static_cast<std::uint64_t>(at - base_) / kLine * kLine;
  const std::uint64_t end =
      std::min<std::uint64_t>(static_cast<std::uint64_t>(at - base_) + bytes, durable_.size());
  auto& mine = pending_[std::this_thread::get_id()];
  const std::uint64_t sequence = ++sequence_;
  for (std::uint64_t offset = begin; offset < end; offset += kLine) {
    PendingLine& line = mine[offset];
    line.sequence = sequence;
    ReadLive(base_ + offset, line.bytes.data(), kLine);
  }
}

const PowerLossSimulator::LineBytes* PowerLossSimulator::NewestPendingLocked(
    std::uint64_t offset) const {
  const PendingLine* newest = nullptr;
  for (const auto& [thread, lines] : pending_) {
    auto it = lines.find(offset);
    if (it == lines.end() || it->second.sequence < durable_sequence_[offset / kLine]) continue;
    if (newest == nullptr || it->second.sequence > newest->sequence) newest = &it->second;
  }
  return newest == nullptr ? nullptr : &newest->bytes;
}

std::map<std::uint64_t, PowerLossSimulator::LineBytes> PowerLossSimulator::DirtyLinesLocked()
    const {
  std::map<std::uint64_t, LineBytes> dirty;
  LineBytes live;
  for (std::uint64_t offset = 0; offset + kLine <= durable_.size(); offset += kLine) {
    ReadLive(base_ + offset, live.data(), kLine);
    if (std::memcmp(live.data(), durable_.data() + offset, kLine) != 0) dirty[offset] = live;
  }
  return dirty;
}

void PowerLossSimulator::AbsorbLibraryWritesLocked(
    const std::map<std::uint64_t, LineBytes>& before) {
  for (const auto& [offset, line] : DirtyLinesLocked()) {
    auto old = before.find(offset);
    if (old != before.end() && old->second == line) continue;
    std::memcpy(durable_.data() + offset, line.data(), kLine);
    durable_sequence_[offset / kLine] = ++sequence_;
  }
}

void PowerLossSimulator::AfterEventLocked(SeamEvent::Kind kind, std::uint64_t offset,
                                          std::uint64_t bytes) {
  const SeamEvent event{kind, events_++, offset, bytes};
  if (event.persist_point()) ++persist_points_;
  if (library_depth_ > 0 || !plan_) return;
  const std::optional<CaptureRequest> request = plan_(event);
  if (request) CaptureLocked(event.index, *request);
}

void PowerLossSimulator::CaptureNow(const CaptureRequest& request) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (mapped_) CaptureLocked(events_, request);
}

void PowerLossSimulator::CaptureLocked(std::uint64_t event_index, const CaptureRequest& request) {
  const std::size_t first = images_.size();
  const std::vector<std::uint64_t> lines = UnsettledLinesLocked();
  images_.push_back(BuildImageLocked(Choice::kNone, "drained only", lines));
  images_.push_back(BuildImageLocked(Choice::kAll, "everything", lines));
  for (int k = 0; k < request.random_images; ++k) {
    images_.push_back(BuildImageLocked(Choice::kRandom, "random " + std::to_string(k), lines));
  }
  for (std::size_t i = first; i < images_.size(); ++i) {
    images_[i].event = event_index;
    images_[i].note = request.note;
  }
}

std::vector<std::uint64_t> PowerLossSimulator::UnsettledLinesLocked() const {
  std::vector<std::uint64_t> lines;
  LineBytes live;
  for (std::uint64_t offset = 0; offset + kLine <= durable_.size(); offset += kLine) {
    if (std::memcmp(durable_.data() + offset, first_mapping_.data() + offset, kLine) != 0) {
      lines.push_back(offset);
      continue;
    }
    ReadLive(base_ + offset, live.data(), kLine);
    if (std::memcmp(live.data(), durable_.data() + offset, kLine) != 0) lines.push_back(offset);
  }
  // Flushed lines whose bytes now equal the durable ones may still differ
  // from them as flushed.
  const std::size_t scanned = lines.size();
  for (const auto& [thread, pending] : pending_) {
    for (const auto& [offset, line] : pending) {
      if (offset + kLine <= durable_.size()) lines.push_back(offset);
    }
  }
  if (lines.size() != scanned) {
    std::sort(lines.begin(), lines.end());
    lines.erase(std::unique(lines.begin(), lines.end()), lines.end());
  }
  return lines;
}

PowerLossImage PowerLossSimulator::BuildImageLocked(Choice choice, const std::string& variant,
                                                    const std::vector<std::uint64_t>& lines) {
  // Per line, per stage (flushed bytes, then later stores): none of the
  // words reached PM, all of them, or each aligned word on its own.
  auto pick = [&]() {
    if (choice != Choice::kRandom) return choice;
    return static_cast<Choice>(random_() % 3);
  };
  auto apply = [&](LineBytes& line, const std::byte* newer) {
    const Choice how = pick();
    if (how == Choice::kNone) return;
    for (std::size_t w = 0; w < kLine; w += kWord) {
      if (how == Choice::kAll || (random_() & 1) != 0) {
        std::memcpy(line.data() + w, newer + w, kWord);
      }
    }
  };
  PowerLossImage image;
  image.variant = variant;
  for (const std::uint64_t offset : lines) {
    const std::byte* durable = durable_.data() + offset;
    LineBytes current;
    ReadLive(base_ + offset, current.data(), kLine);
    const LineBytes* flushed = NewestPendingLocked(offset);
    LineBytes line;
    std::memcpy(line.data(), durable, kLine);
    if (flushed != nullptr) apply(line, flushed->data());
    if (std::memcmp(line.data(), current.data(), kLine) != 0) apply(line, current.data());
    if (std::memcmp(line.data(), first_mapping_.data() + offset, kLine) != 0) {
      image.line_offsets.push_back(offset);
      image.line_bytes.insert(image.line_bytes.end(), line.begin(), line.end());
    }
  }
  return image;
}

std::string PowerLossSimulator::WriteImage(const PowerLossImage& image,
                                           const std::string& path) const {
  // Overwritten in place, not truncated: tmpfs keeps the pages between images.
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT, 0644);
  if (fd < 0) return "cannot create image file '" + path + "': " + std::strerror(errno);
  std::string problem;
  auto write_at = [&](const std::byte* data, std::size_t bytes, std::uint64_t offset) {
    if (problem.empty() &&
        ::pwrite(fd, data, bytes, static_cast<off_t>(offset)) != static_cast<ssize_t>(bytes)) {
      problem = "cannot write image file '" + path + "' at offset " + std::to_string(offset) +
                ": " + std::strerror(errno);
    }
  };
  write_at(first_mapping_.data(), first_mapping_.size(), 0);
  for (std::size_t i = 0; i < image.line_offsets.size(); ++i) {
    write_at(image.line_bytes.data() + i * kLine, kLine, image.line_offsets[i]);
  }
  if (problem.empty() && ::ftruncate(fd, static_cast<off_t>(first_mapping_.size())) != 0) {
    problem = "cannot size image file '" + path + "': " + std::strerror(errno);
  }
  ::close(fd);
  return problem;
}

}  // namespace pmsnap::testing
