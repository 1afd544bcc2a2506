#include "pmsnap/runtime/stats.h"

#include <cstdio>

namespace pmsnap::runtime {

std::string Stats::Summary() const {
  char buf[1024];
  const double blocked_ms_per_step = steps ? blocked_seconds * 1e3 / steps : 0;
  char held[64] = "";
  if (held_bytes > 0) {
    std::snprintf(held, sizeof(held), ", %.1f MB copied after their step", held_bytes / 1e6);
  }
  char staged[64] = "";
  if (epochs_staged > 0) {
    std::snprintf(staged, sizeof(staged), ", %llu staged in host memory",
                  static_cast<unsigned long long>(epochs_staged));
  }
  char queues[160] = "";
  if (device_queues.compute_waits_on_copies > 0 || device_queues.staging_peak_bytes > 0) {
    std::snprintf(queues, sizeof(queues),
                  ", compute stream waited for %llu copies (stalled %llu times, %.3f s)%s",
                  static_cast<unsigned long long>(device_queues.compute_waits_on_copies),
                  static_cast<unsigned long long>(device_queues.compute_stalls),
                  device_queues.compute_stall_seconds,
                  device_queues.staging_peak_bytes > 0 ? ", staged through pinned memory" : "");
  }
  char memory_text[160];
  std::snprintf(memory_text, sizeof(memory_text), ", memory: pool %.1f MB mapped (%.1f MB resident)",
                memory.pool_mapped_bytes / 1e6, memory.pool_resident_bytes / 1e6);
  std::string extra_memory;
  if (memory.staging_bytes > 0) {
    char text[96];
    std::snprintf(text, sizeof(text), ", staging %.1f MB (%.1f MB resident)",
                  memory.staging_bytes / 1e6, memory.staging_resident_bytes / 1e6);
    extra_memory += text;
  }
  if (memory.registered_bytes > 0) {
    char text[64];
    std::snprintf(text, sizeof(text), ", %.1f MB pinned", memory.registered_bytes / 1e6);
    extra_memory += text;
  }
  std::snprintf(buf, sizeof(buf),
                "pmsnap: %llu steps, %llu checkpoints committed (%.1f/min, last iteration %llu%s), "
                "%.1f MB written (+%.1f MB embedding chunks%s), %llu conflicts%s, training thread "
                "blocked %.3f ms/step "
                "(conflicts %.3f s, boundaries %.3f s)%s%s [%s%s%s, %s, %s]",
                static_cast<unsigned long long>(steps),
                static_cast<unsigned long long>(epochs_committed), checkpoints_per_minute(),
                static_cast<unsigned long long>(last_committed_iteration), staged,
                bytes_written / 1e6,
                encoded_bytes_written / 1e6, held, static_cast<unsigned long long>(conflicts), queues,
                blocked_ms_per_step, conflict_wait_seconds, boundary_wait_seconds, memory_text,
                extra_memory.c_str(), device.c_str(),
                pm.empty() ? "" : ", ", pm.c_str(),
                strategy.c_str(), policy.c_str());
  return buf;
}

}  // namespace pmsnap::runtime
