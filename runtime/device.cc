#include "pmsnap/runtime/device.h"

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <cstdlib>
#include <cstring>
#include <new>
#include <thread>
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

}  // namespace

// One simulated stream: a thread that runs its jobs in the order they were
// queued. The destructor runs what is queued, then joins.
class SimulatedDevice::Queue {
 public:
  Queue() : thread_([this] { Run(); }) {}
  ~Queue() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    ready_.notify_all();
    thread_.join();
  }
  void Push(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      jobs_.push_back(std::move(job));
    }
    ready_.notify_one();
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
        std::unique_lock<std::mutex> lock(mutex_);
        ready_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }
  std::mutex mutex_;  // guards jobs_, stopping_
  std::condition_variable ready_;
  std::deque<std::function<void()>> jobs_;
  bool stopping_ = false;
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
      link_(options.copy_bandwidth_gbps),
      copy_engine_(options.in_device_bandwidth_gbps) {
  if (options_.asynchronous) compute_ = std::make_unique<Queue>();
}

SimulatedDevice::~SimulatedDevice() {
  // Copies may wait for compute events and compute for copy events: both
  // kinds of stream drain while the other still runs.
  if (compute_) compute_->Drain();
  {
    std::lock_guard<std::mutex> lock(copy_streams_mutex_);
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
  std::lock_guard<std::mutex> lock(copy_streams_mutex_);
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

Result<DeviceEventPtr> SimulatedDevice::CopyToHostAsync(void* dst, const void* src,
                                                        std::size_t bytes, DeviceEventPtr after) {
  if (!compute_) {
    PMSNAP_RETURN_IF_ERROR(CopyToHost(dst, src, bytes));
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
