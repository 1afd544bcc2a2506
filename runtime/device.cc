#include "pmsnap/runtime/device.h"

#include <algorithm>
#include <cstdio>
#include <deque>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace pmsnap::runtime {
namespace {

// Single-thread host memcpy bandwidth (GB/s), measured once per process on
// 32 MiB (best of three). Every host or simulated copy is at least a memcpy,
// so estimates never promise more than this.
double HostCopyGbps() {
  static const double gbps = [] {
    constexpr std::size_t kBytes = 32u << 20;
    std::vector<char> src(kBytes, 1), dst(kBytes, 0);
    double best = 0;
    for (int i = 0; i < 3; ++i) {
      const auto start = std::chrono::steady_clock::now();
      std::memcpy(dst.data(), src.data(), kBytes);
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      best = std::max(best, kBytes / std::max(seconds, 1e-9) / 1e9);
    }
    return best;
  }();
  return gbps;
}

std::string FormatBytes(std::uint64_t bytes) {
  char buf[32];
  if (bytes >= (1ull << 30)) {
    std::snprintf(buf, sizeof(buf), "%.1f GiB", bytes / 1073741824.0);
  } else {
    std::snprintf(buf, sizeof(buf), "%.0f MiB", bytes / 1048576.0);
  }
  return buf;
}

// The simulated device's event: a flag the stream that records it sets.
class SimulatedEvent final : public DeviceEvent {
 public:
  void Complete() {
    done_.store(true, std::memory_order_release);
    done_.notify_all();
  }
  bool complete() const { return done_.load(std::memory_order_acquire); }
  void Wait() const {
    while (!done_.load(std::memory_order_acquire)) done_.wait(false, std::memory_order_acquire);
  }

 private:
  std::atomic<bool> done_{false};
};

const SimulatedEvent* AsSimulated(const DeviceEvent* event) {
  return static_cast<const SimulatedEvent*>(event);
}

std::string RangeText(const void* ptr, std::size_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "[%p, +%zu bytes)", ptr, bytes);
  return buf;
}

// What memory [ptr, ptr + bytes) is now: the file and offset (or the
// anonymous mapping) of its first and last byte, from /proc/self/maps; "not
// mapped" where a byte is not. Two readings differ when the range was
// unmapped and something else mapped there.
std::string MappingIdentityOf(const void* ptr, std::size_t bytes) {
  const auto first = reinterpret_cast<std::uintptr_t>(ptr);
  const std::uintptr_t last = first + (bytes == 0 ? 0 : bytes - 1);
  std::string found[2] = {"not mapped", "not mapped"};
  std::FILE* maps = std::fopen("/proc/self/maps", "r");
  if (maps == nullptr) return "unknown (/proc/self/maps unreadable)";
  char line[4096];
  while (std::fgets(line, sizeof(line), maps) != nullptr) {
    unsigned long start = 0, end = 0, offset = 0, inode = 0;
    char perms[8] = {}, dev[16] = {};
    int path_at = 0;
    if (std::sscanf(line, "%lx-%lx %7s %lx %15s %lu %n", &start, &end, perms, &offset, dev,
                    &inode, &path_at) < 6) {
      continue;
    }
    std::string path = path_at > 0 ? std::string(line + path_at) : std::string();
    while (!path.empty() && (path.back() == '\n' || path.back() == ' ')) path.pop_back();
    // A deleted file keeps its inode: the mapping is still the same memory.
    if (path.ends_with(" (deleted)")) path.resize(path.size() - 10);
    const std::uintptr_t points[2] = {first, last};
    for (int i = 0; i < 2; ++i) {
      if (points[i] < start || points[i] >= end) continue;
      // Anonymous memory is named without its bounds: the kernel merges a
      // neighbour's anonymous mapping into the same line (a malloc beside a
      // staging buffer), which changes the bounds but not the memory.
      found[i] = inode != 0 ? path + " (" + dev + " inode " + std::to_string(inode) +
                                  ") at offset " + std::to_string(offset + (points[i] - start))
                            : std::string("anonymous memory");
    }
  }
  std::fclose(maps);
  return found[0] == found[1] ? found[0] : found[0] + " .. " + found[1];
}

// The simulated devices' registrations: one table per process, as CUDA has
// one per context (SimulatedDevice's class comment).
struct SimulatedRegistration {
  const std::byte* begin;
  const std::byte* end;
  std::uint64_t owner;  // SimulatedDevice::serial_
  std::string identity;  // MappingIdentityOf at registration
  int count = 1;
  bool stale = false;  // its memory was unmapped or replaced since
  std::string now;     // what is there instead, once stale
};

struct SimulatedRegistrationTable {
  Mutex mutex;
  std::vector<SimulatedRegistration> ranges PMSNAP_GUARDED_BY(mutex);
  std::atomic<std::uint64_t> direct_copies{0};
  std::atomic<std::uint64_t> staged_copies{0};
  std::atomic<std::uint64_t> next_serial{1};

  // Marks every registration whose memory changed since it was made.
  void FindStaleLocked() PMSNAP_REQUIRES(mutex) {
    for (SimulatedRegistration& range : ranges) {
      if (range.stale) continue;
      std::string now = MappingIdentityOf(range.begin, range.end - range.begin);
      if (now != range.identity) {
        range.stale = true;
        range.now = std::move(now);
      }
    }
  }
};

SimulatedRegistrationTable& Registrations() {
  static auto* table = new SimulatedRegistrationTable;  // outlives static devices
  return *table;
}

std::string DeviceLabel(std::uint64_t serial) {
  return "simulated device #" + std::to_string(serial);
}

std::string Describe(const SimulatedRegistration& range) {
  return RangeText(range.begin, range.end - range.begin) + " registered by " +
         DeviceLabel(range.owner) + " for " + range.identity;
}

}  // namespace

SimulatedRegistrationStats SimulatedRegistrations() {
  SimulatedRegistrationTable& table = Registrations();
  SimulatedRegistrationStats stats;
  {
    MutexLock lock(table.mutex);
    stats.live_ranges = table.ranges.size();
  }
  stats.direct_copies = table.direct_copies.load();
  stats.staged_copies = table.staged_copies.load();
  return stats;
}

Result<HostRegistration> HostRegistration::Register(Device& device, void* ptr, std::size_t bytes,
                                                    std::string* not_registered) {
  Status status = device.RegisterHostDestination(ptr, bytes);
  if (status.code() == StatusCode::kFailedPrecondition) {
    if (not_registered != nullptr) *not_registered = status.message();
    return HostRegistration();
  }
  PMSNAP_RETURN_IF_ERROR(status);
  return HostRegistration(&device, ptr, bytes);
}

HostRegistration::~HostRegistration() {
  Status status = Release();
  if (!status.ok()) std::fprintf(stderr, "pmsnap: %s\n", status.ToString().c_str());
}

HostRegistration::HostRegistration(HostRegistration&& other) noexcept
    : device_(std::exchange(other.device_, nullptr)), ptr_(other.ptr_), bytes_(other.bytes_) {}

HostRegistration& HostRegistration::operator=(HostRegistration&& other) noexcept {
  if (this != &other) {
    Status status = Release();
    if (!status.ok()) std::fprintf(stderr, "pmsnap: %s\n", status.ToString().c_str());
    device_ = std::exchange(other.device_, nullptr);
    ptr_ = other.ptr_;
    bytes_ = other.bytes_;
  }
  return *this;
}

Status HostRegistration::Release() {
  if (device_ == nullptr) return Status::Ok();
  Device* device = std::exchange(device_, nullptr);
  return device->UnregisterHostDestination(ptr_, bytes_);
}

// One simulated stream: a thread that runs its jobs in the order they were
// queued. The destructor runs what is queued, then joins.
class SimulatedDevice::Queue {
 public:
  Queue() : thread_([this] { Run(); }) {}
  ~Queue() {
    {
      MutexLock lock(mutex_);
      stopping_ = true;
    }
    ready_.NotifyAll();
    thread_.join();
  }
  void Push(std::function<void()> job) {
    {
      MutexLock lock(mutex_);
      jobs_.push_back(std::move(job));
    }
    ready_.NotifyOne();
  }
  // Blocks until everything queued before the call ran.
  void Drain() {
    auto drained = std::make_shared<SimulatedEvent>();
    Push([drained] { drained->Complete(); });
    drained->Wait();
  }

 private:
  void Run() {
    while (true) {
      std::function<void()> job;
      {
        MutexLock lock(mutex_);
        while (!stopping_ && jobs_.empty()) ready_.Wait(lock);
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }
  Mutex mutex_;
  CondVar ready_;
  std::deque<std::function<void()>> jobs_ PMSNAP_GUARDED_BY(mutex_);
  bool stopping_ PMSNAP_GUARDED_BY(mutex_) = false;
  std::thread thread_;  // last: starts once the members above exist
};

Result<void*> HostMemoryDevice::Allocate(std::size_t bytes) {
  // Reserve first so concurrent allocations never exceed the capacity.
  std::uint64_t current = allocated_.load(std::memory_order_relaxed);
  do {
    if (current + bytes > capacity_) {
      return Status(StatusCode::kNoSpace, name() + ": cannot allocate " + std::to_string(bytes) +
                                              " bytes of device memory, " +
                                              std::to_string(capacity_ - current) + " free");
    }
  } while (!allocated_.compare_exchange_weak(current, current + bytes, std::memory_order_relaxed));
  std::uint64_t now = current + bytes;
  std::uint64_t peak = peak_.load(std::memory_order_relaxed);
  while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
  void* ptr = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (ptr == nullptr) {
    allocated_.fetch_sub(bytes, std::memory_order_relaxed);
    return Status(StatusCode::kNoSpace,
                  name() + ": host allocation of " + std::to_string(bytes) + " bytes failed");
  }
  return ptr;
}

void HostMemoryDevice::Free(void* ptr, std::size_t bytes) {
  if (ptr == nullptr) return;
  std::free(ptr);
  allocated_.fetch_sub(bytes, std::memory_order_relaxed);
}

std::uint64_t HostMemoryDevice::free_bytes() const {
  const std::uint64_t used = allocated_.load(std::memory_order_relaxed);
  return used >= capacity_ ? 0 : capacity_ - used;
}

Status HostDevice::CopyToHost(void* dst, const void* src, std::size_t bytes) {
  std::memcpy(dst, src, bytes);
  return Status::Ok();
}

Status HostDevice::CopyFromHost(void* dst, const void* src, std::size_t bytes) {
  std::memcpy(dst, src, bytes);
  return Status::Ok();
}

Status HostDevice::CopyInDevice(void* dst, const void* src, std::size_t bytes) {
  std::memcpy(dst, src, bytes);
  return Status::Ok();
}

double HostDevice::EstimateCopyToHostSeconds(std::uint64_t bytes) const {
  return bytes / (HostCopyGbps() * 1e9);
}

double HostDevice::EstimateInDeviceCopySeconds(std::uint64_t bytes) const {
  return bytes / (HostCopyGbps() * 1e9);
}

SimulatedDevice::SimulatedDevice(SimulatedDeviceOptions options)
    : HostMemoryDevice(options.memory_bytes),
      options_(options),
      serial_(Registrations().next_serial.fetch_add(1)),
      link_(options.copy_bandwidth_gbps),
      copy_engine_(options.in_device_bandwidth_gbps) {
  if (options_.asynchronous) compute_ = std::make_unique<Queue>();
}

SimulatedDevice::~SimulatedDevice() {
  // Copies may wait for compute events and compute for copy events: both
  // kinds of stream drain while the other still runs.
  if (compute_) compute_->Drain();
  {
    MutexLock lock(copy_streams_mutex_);
    for (auto& [thread, stream] : copy_streams_) stream->Drain();
  }
  copy_streams_.clear();
  compute_.reset();
}

std::string SimulatedDevice::name() const {
  char buf[192];
  std::snprintf(buf, sizeof(buf), "simulated(%.1f GB/s link, %.0f us, %s device memory%s)",
                options_.copy_bandwidth_gbps, options_.latency_us,
                FormatBytes(options_.memory_bytes).c_str(),
                options_.asynchronous ? ", asynchronous queues" : "");
  return buf;
}

bool SimulatedDevice::EventComplete(const DeviceEvent* event) {
  return event == nullptr || AsSimulated(event)->complete();
}

bool SimulatedDevice::CopyWaitsFor(const DeviceEvent* event) {
  if (options_.testing_copies_ignore_events || EventComplete(event)) return false;
  copies_settled_.fetch_add(1);
  AsSimulated(event)->Wait();
  return true;
}

SimulatedDevice::Queue& SimulatedDevice::CopyStreamForThisThread() {
  MutexLock lock(copy_streams_mutex_);
  std::unique_ptr<Queue>& stream = copy_streams_[std::this_thread::get_id()];
  if (!stream) stream = std::make_unique<Queue>();
  return *stream;
}

Result<DeviceEventPtr> SimulatedDevice::RecordComputeEvent() {
  if (!compute_) return DeviceEventPtr();
  auto event = std::make_shared<SimulatedEvent>();
  compute_->Push([event] { event->Complete(); });
  return DeviceEventPtr(event);
}

Result<DeviceEventPtr> SimulatedDevice::QueueCopy(void* dst, const void* src, std::size_t bytes,
                                                  DeviceEventPtr after, bool uses_link) {
  auto done = std::make_shared<SimulatedEvent>();
  BandwidthPacer& channel = uses_link ? link_ : copy_engine_;
  CopyStreamForThisThread().Push([this, dst, src, bytes, after = std::move(after), done,
                                  &channel] {
    const bool waited = CopyWaitsFor(after.get());
    (void)TimedCopy(dst, src, bytes, channel);  // host memory: cannot fail
    if (!waited) copies_settled_.fetch_add(1);
    done->Complete();
  });
  return DeviceEventPtr(done);
}

Status SimulatedDevice::RegisterHostDestination(void* ptr, std::size_t bytes) {
  if (bytes == 0) return Status::Ok();
  if (options_.testing_refuse_registration) {
    return Status(StatusCode::kFailedPrecondition,
                  name() + " refuses to register " + RangeText(ptr, bytes) +
                      " (testing_refuse_registration): copies into it are staged");
  }
  const auto* begin = static_cast<const std::byte*>(ptr);
  const std::byte* end = begin + bytes;
  SimulatedRegistrationTable& table = Registrations();
  MutexLock lock(table.mutex);
  table.FindStaleLocked();
  // A stale registration anywhere is a lifetime bug: reported at the next
  // registration whether or not it overlaps this one, so that a test finds
  // it wherever the next mapping lands.
  for (const SimulatedRegistration& range : table.ranges) {
    if (!range.stale) continue;
    return Status(StatusCode::kBusy,
                  DeviceLabel(serial_) + " cannot register " + RangeText(ptr, bytes) + ": " +
                      Describe(range) + " was unmapped or replaced (now " + range.now +
                      ") without being unregistered; a GPU would copy into the old pages");
  }
  for (SimulatedRegistration& range : table.ranges) {
    if (range.end <= begin || end <= range.begin) continue;
    if (range.begin == begin && range.end == end && range.owner == serial_) {
      range.count += 1;
      return Status::Ok();
    }
    return Status(StatusCode::kBusy, DeviceLabel(serial_) + " cannot register " +
                                         RangeText(ptr, bytes) + ": it overlaps " +
                                         Describe(range));
  }
  table.ranges.push_back({begin, end, serial_, MappingIdentityOf(ptr, bytes), 1, false, {}});
  return Status::Ok();
}

Status SimulatedDevice::UnregisterHostDestination(void* ptr, std::size_t bytes) {
  if (bytes == 0) return Status::Ok();
  const auto* begin = static_cast<const std::byte*>(ptr);
  SimulatedRegistrationTable& table = Registrations();
  MutexLock lock(table.mutex);
  table.FindStaleLocked();
  for (auto it = table.ranges.begin(); it != table.ranges.end(); ++it) {
    if (it->begin != begin || it->end != begin + bytes || it->owner != serial_) continue;
    if (it->stale) {
      const std::string what = Describe(*it) + " was unmapped or replaced (now " + it->now +
                               ") while registered: unregister before unmapping";
      table.ranges.erase(it);
      return Status(StatusCode::kFailedPrecondition, what);
    }
    if (--it->count == 0) table.ranges.erase(it);
    return Status::Ok();
  }
  return Status(StatusCode::kFailedPrecondition,
                RangeText(ptr, bytes) + " is not registered with " + DeviceLabel(serial_));
}

Status SimulatedDevice::CheckCopyDestination(const void* dst, std::size_t bytes) const {
  const auto* begin = static_cast<const std::byte*>(dst);
  const std::byte* end = begin + bytes;
  SimulatedRegistrationTable& table = Registrations();
  MutexLock lock(table.mutex);
  for (const SimulatedRegistration& range : table.ranges) {
    if (range.end <= begin || end <= range.begin) continue;
    if (range.stale) {
      return Status(StatusCode::kFailedPrecondition,
                    "copy into " + RangeText(dst, bytes) + " refused: " + Describe(range) +
                        " was unmapped or replaced (now " + range.now +
                        "); a GPU would have copied into the old pages");
    }
    if (range.begin <= begin && end <= range.end) {
      table.direct_copies.fetch_add(1, std::memory_order_relaxed);
      return Status::Ok();
    }
  }
  table.staged_copies.fetch_add(1, std::memory_order_relaxed);
  return Status::Ok();
}

Result<DeviceEventPtr> SimulatedDevice::CopyToHostAsync(void* dst, const void* src,
                                                        std::size_t bytes, DeviceEventPtr after) {
  PMSNAP_RETURN_IF_ERROR(CheckCopyDestination(dst, bytes));
  if (!compute_) {
    PMSNAP_RETURN_IF_ERROR(TimedCopy(dst, src, bytes, link_));
    return DeviceEventPtr();
  }
  return QueueCopy(dst, src, bytes, std::move(after), /*uses_link=*/true);
}

Result<DeviceEventPtr> SimulatedDevice::CopyInDeviceAsync(void* dst, const void* src,
                                                          std::size_t bytes, DeviceEventPtr after) {
  if (!compute_) {
    PMSNAP_RETURN_IF_ERROR(CopyInDevice(dst, src, bytes));
    return DeviceEventPtr();
  }
  return QueueCopy(dst, src, bytes, std::move(after), /*uses_link=*/false);
}

Status SimulatedDevice::StreamWaitEvent(const DeviceEvent& event) {
  // The calling thread's copies are synchronous: it is its own stream.
  if (compute_) CopyWaitsFor(&event);
  return Status::Ok();
}

Status SimulatedDevice::Synchronize(const DeviceEvent& event) {
  AsSimulated(&event)->Wait();
  return Status::Ok();
}

Status SimulatedDevice::ComputeWaitFor(DeviceEventPtr event) {
  if (!compute_ || event == nullptr) return Status::Ok();
  compute_waits_.fetch_add(1);
  compute_->Push([this, event = std::move(event)] {
    if (EventComplete(event.get())) return;
    compute_stalls_.fetch_add(1);
    const auto start = Clock::now();
    AsSimulated(event.get())->Wait();
    compute_stall_ns_.fetch_add(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count());
  });
  return Status::Ok();
}

DeviceQueueStats SimulatedDevice::queue_stats() const {
  DeviceQueueStats stats;
  stats.compute_waits_on_copies = compute_waits_.load();
  stats.compute_stalls = compute_stalls_.load();
  stats.compute_stall_seconds = compute_stall_ns_.load() * 1e-9;
  return stats;
}

void SimulatedDevice::LaunchKernel(std::function<void()> kernel) {
  if (compute_) {
    compute_->Push(std::move(kernel));
  } else {
    kernel();
  }
}

void SimulatedDevice::SynchronizeCompute() {
  if (compute_) compute_->Drain();
}

Status SimulatedDevice::TimedCopy(void* dst, const void* src, std::size_t bytes,
                                  BandwidthPacer& channel) {
  const auto start = Clock::now();
  const auto latency = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(options_.latency_us * 1e-6));
  // Reserve the link (or the device's copy engine): transfers queue behind
  // each other like on PCIe.
  const Clock::time_point done = channel.Reserve(bytes, start) + latency;
  std::memcpy(dst, src, bytes);
  BandwidthPacer::WaitUntil(done);
  return Status::Ok();
}

Status SimulatedDevice::CopyToHost(void* dst, const void* src, std::size_t bytes) {
  PMSNAP_RETURN_IF_ERROR(CheckCopyDestination(dst, bytes));
  return TimedCopy(dst, src, bytes, link_);
}

Status SimulatedDevice::CopyFromHost(void* dst, const void* src, std::size_t bytes) {
  return TimedCopy(dst, src, bytes, link_);
}

Status SimulatedDevice::CopyInDevice(void* dst, const void* src, std::size_t bytes) {
  return TimedCopy(dst, src, bytes, copy_engine_);
}

// The simulation moves real bytes with memcpy: a modelled bandwidth above the
// host's memcpy speed is not what a copy will take here.
double SimulatedDevice::EstimateCopyToHostSeconds(std::uint64_t bytes) const {
  return options_.latency_us * 1e-6 +
         bytes / (std::min(options_.copy_bandwidth_gbps, HostCopyGbps()) * 1e9);
}

double SimulatedDevice::EstimateInDeviceCopySeconds(std::uint64_t bytes) const {
  return options_.latency_us * 1e-6 +
         bytes / (std::min(options_.in_device_bandwidth_gbps, HostCopyGbps()) * 1e9);
}

}  // namespace pmsnap::runtime
