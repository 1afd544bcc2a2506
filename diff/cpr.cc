#include "pmsnap/diff/cpr.h"

#include <cmath>
#include <cstring>
#include <sstream>

#include "detail/byte_codec.h"

namespace pmsnap::diff::cpr {
namespace {

constexpr char kMagic[12] = {'P', 'M', 'S', 'N', 'A', 'P', 'C', 'P', 'R', 'P', 'L', 'S'};
constexpr std::uint32_t kVersion = 1;

// FNV-1a 64: a ledger is a few hundred bytes; this only has to tell an intact
// image from a torn or foreign one.
std::uint64_t Checksum(std::span<const std::byte> bytes) {
  std::uint64_t h = 1469598103934665603ull;
  for (std::byte b : bytes) {
    h ^= static_cast<std::uint8_t>(b);
    h *= 1099511628211ull;
  }
  return h;
}


std::string Num(double v) {
  std::ostringstream s;
  s.precision(4);
  s << v;
  return s.str();
}

}  // namespace

double SaveIntervalForPls(double target_pls, std::uint32_t emb_shards,
                          double mean_time_to_failure) {
  return 2.0 * target_pls * emb_shards * mean_time_to_failure;
}

double ExpectedPls(double save_interval, std::uint32_t emb_shards, double mean_time_to_failure) {
  return 0.5 * save_interval / (mean_time_to_failure * emb_shards);
}

double OptimalFullRecoveryInterval(const CostModel& cost) {
  return std::sqrt(2.0 * cost.save_seconds * cost.mean_time_to_failure);
}

double FullRecoveryOverhead(const CostModel& cost, double save_interval) {
  return cost.save_seconds * cost.total_seconds / save_interval +
         (cost.load_seconds + save_interval / 2.0 + cost.reschedule_seconds) * cost.total_seconds /
             cost.mean_time_to_failure;
}

double PartialRecoveryOverhead(const CostModel& cost, double save_interval) {
  return cost.save_seconds * cost.total_seconds / save_interval +
         (cost.load_seconds + cost.reschedule_seconds) * cost.total_seconds /
             cost.mean_time_to_failure;
}

Result<RecoveryPlan> PlanRecovery(const CostModel& cost, double target_pls,
                                  std::uint32_t emb_shards, double min_relative_benefit) {
  auto invalid = [](const std::string& what) {
    return Status(StatusCode::kInvalidArgument, "CPR plan: " + what);
  };
  if (!(cost.mean_time_to_failure > 0)) return invalid("mean time to failure must be > 0");
  if (!(cost.total_seconds > 0)) return invalid("total training time must be > 0");
  if (!(cost.save_seconds > 0)) return invalid("checkpoint save overhead must be > 0");
  if (!(cost.load_seconds >= 0) || !(cost.reschedule_seconds >= 0)) {
    return invalid("load and reschedule overheads must be >= 0");
  }
  if (!(target_pls > 0 && target_pls <= 1)) {
    return invalid("target PLS must be in (0, 1], got " + Num(target_pls));
  }
  if (emb_shards == 0) return invalid("at least one embedding shard");
  if (!(min_relative_benefit >= 0 && min_relative_benefit < 1)) {
    return invalid("minimum relative benefit must be in [0, 1)");
  }
  RecoveryPlan plan;
  plan.target_pls = target_pls;
  plan.emb_shards = emb_shards;
  plan.partial_interval = SaveIntervalForPls(target_pls, emb_shards, cost.mean_time_to_failure);
  plan.full_interval = OptimalFullRecoveryInterval(cost);
  plan.partial_overhead = PartialRecoveryOverhead(cost, plan.partial_interval);
  plan.full_overhead = FullRecoveryOverhead(cost, plan.full_interval);
  plan.partial = plan.partial_overhead < (1.0 - min_relative_benefit) * plan.full_overhead;
  plan.save_interval = plan.partial ? plan.partial_interval : plan.full_interval;
  plan.expected_pls =
      plan.partial ? ExpectedPls(plan.save_interval, emb_shards, cost.mean_time_to_failure) : 0;
  const double t = cost.total_seconds;
  plan.reason = std::string(plan.partial ? "partial recovery" : "full recovery (fallback)") +
                ": partial at T_save=" + Num(plan.partial_interval) + " costs " +
                Num(100 * plan.partial_overhead / t) + "% of training, full at T_save=" +
                Num(plan.full_interval) + " costs " + Num(100 * plan.full_overhead / t) +
                "% (partial must save at least " + Num(100 * min_relative_benefit) + "%)";
  return plan;
}

Status PlsLedger::RecordFailure(std::uint64_t samples,
                                std::span<const std::uint64_t> samples_at_last_save) {
  if (total_samples_ == 0 || emb_shards_ == 0) {
    return Status(StatusCode::kInvalidArgument,
                  "PLS ledger: no total sample count or shard count (default-constructed)");
  }
  if (samples_at_last_save.size() > emb_shards_) {
    return Status(StatusCode::kInvalidArgument,
                  "PLS ledger: " + std::to_string(samples_at_last_save.size()) +
                      " shards failed, there are " + std::to_string(emb_shards_));
  }
  std::uint64_t lost = 0;
  for (std::size_t i = 0; i < samples_at_last_save.size(); ++i) {
    if (samples_at_last_save[i] > samples) {
      return Status(StatusCode::kInvalidArgument,
                    "PLS ledger: failed shard " + std::to_string(i) + " was saved at sample " +
                        std::to_string(samples_at_last_save[i]) + ", after the failure at " +
                        std::to_string(samples));
    }
    lost += samples - samples_at_last_save[i];
  }
  // One term of Eq. 3 per failed shard: (S_i - S_last) / (S_total N_emb).
  pls_ += static_cast<double>(lost) /
          (static_cast<double>(total_samples_) * static_cast<double>(emb_shards_));
  lost_samples_ += lost;
  failed_shards_ += samples_at_last_save.size();
  failures_.push_back({samples, lost, static_cast<std::uint32_t>(samples_at_last_save.size()),
                       pls_});
  if (failures_.size() > kMaxFailuresKept) failures_.erase(failures_.begin());
  return Status::Ok();
}

std::vector<std::byte> PlsLedger::Serialize() const {
  detail::ByteWriter w;
  for (char c : kMagic) w.Put(c);
  w.Put(kVersion);
  w.Put(emb_shards_);
  w.Put(total_samples_);
  w.Put(pls_);
  w.Put(lost_samples_);
  w.Put(failed_shards_);
  w.Put(static_cast<std::uint64_t>(failures_.size()));
  for (const PlsFailure& f : failures_) {
    w.Put(f.samples);
    w.Put(f.lost_samples);
    w.Put(f.failed_shards);
    w.Put(f.pls_after);
  }
  w.Put(Checksum(w.out));
  return std::move(w.out);
}

Result<PlsLedger> PlsLedger::Parse(std::span<const std::byte> bytes) {
  auto corrupt = [](const std::string& what) {
    return Status(StatusCode::kCorruption, "PLS ledger: " + what);
  };
  detail::ByteReader r(bytes);
  char magic[sizeof(kMagic)];
  for (char& c : magic) {
    if (!r.Get(&c)) return corrupt("shorter than its magic");
  }
  if (std::memcmp(magic, kMagic, sizeof(kMagic)) != 0) return corrupt("not a ledger (magic)");
  std::uint32_t version = 0;
  PlsLedger ledger;
  std::uint64_t count = 0;
  if (!r.Get(&version)) return corrupt("truncated header");
  if (version != kVersion) {
    return corrupt("version " + std::to_string(version) + ", expected " + std::to_string(kVersion));
  }
  if (!r.Get(&ledger.emb_shards_) || !r.Get(&ledger.total_samples_) || !r.Get(&ledger.pls_) ||
      !r.Get(&ledger.lost_samples_) || !r.Get(&ledger.failed_shards_) || !r.Get(&count)) {
    return corrupt("truncated header");
  }
  if (count > kMaxFailuresKept) return corrupt(std::to_string(count) + " failures listed");
  for (std::uint64_t i = 0; i < count; ++i) {
    PlsFailure f;
    if (!r.Get(&f.samples) || !r.Get(&f.lost_samples) || !r.Get(&f.failed_shards) ||
        !r.Get(&f.pls_after)) {
      return corrupt("truncated failure list");
    }
    ledger.failures_.push_back(f);
  }
  const std::size_t body = r.pos();
  std::uint64_t stored = 0;
  if (!r.Get(&stored)) return corrupt("no checksum");
  if (stored != Checksum(bytes.first(body))) return corrupt("checksum mismatch");
  return ledger;
}

std::optional<PlsLedger> FindPlsLedger(std::span<const std::byte> blob) {
  for (std::size_t i = 0; i + sizeof(kMagic) <= blob.size(); ++i) {
    if (std::memcmp(blob.data() + i, kMagic, sizeof(kMagic)) != 0) continue;
    auto ledger = PlsLedger::Parse(blob.subspan(i));
    if (ledger.ok()) return *ledger;
  }
  return std::nullopt;
}

}  // namespace pmsnap::diff::cpr
