// The `pmsnap` command line (tools/include/pmsnap/tools/cli.h), shared by the
// C++ executable and `python -m pmsnap`.
#include "pmsnap/tools/cli.h"

#include <cinttypes>
#include <cstdio>
#include <ctime>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "pmsnap/diff/cpr.h"
#include "pmsnap/pmem_layout/pool.h"

namespace pmsnap::tools {
namespace {

using pmsnap::layout::Pool;
using pmsnap::layout::SlotInfo;
using pmsnap::layout::SlotState;

constexpr int kExitOk = 0;
constexpr int kExitDamaged = 1;
constexpr int kExitUsage = 2;
constexpr int kExitBusy = 3;

int Usage(std::ostream& err) {
  err << "usage: pmsnap info POOL [--json]\n"
         "       pmsnap verify POOL [--json]\n"
         "  info    print the pool's format, model signature, units and both slots\n"
         "  verify  check every checksum (records, unit data, chunks)\n"
         "Both only read the pool (it stays byte for byte as it was) and take no\n"
         "lock, so a trainer can open it meanwhile.\n"
         "Exit status: 0 ok; 1 damaged or unreadable (the message says what);\n"
         "2 usage; 3 busy (another process has the pool open, or opened it while\n"
         "it was read: try again once it closed it).\n";
  return kExitUsage;
}

// The exit status for a pool that could not be read: busy or damaged.
int ExitFor(const pmsnap::Status& status) {
  return status.code() == pmsnap::StatusCode::kBusy ? kExitBusy : kExitDamaged;
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

std::string Hex(std::uint64_t value) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "%016" PRIx64, value);
  return buf;
}

std::string IsoTime(std::uint64_t unix_ns) {
  if (unix_ns == 0) return "-";
  const std::time_t seconds = static_cast<std::time_t>(unix_ns / 1000000000ull);
  std::tm tm{};
  gmtime_r(&seconds, &tm);
  char buf[40];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::string HumanBytes(std::uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int u = 0;
  while (value >= 1024 && u < 4) {
    value /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.1f %s", value, units[u]);
  return buf;
}

std::string SlotJson(const SlotInfo& slot, const std::vector<std::string>* problems) {
  std::ostringstream out;
  out << "{\"slot\": " << slot.slot
      << ", \"state\": " << JsonString(pmsnap::layout::SlotStateName(slot.state))
      << ", \"epoch\": " << slot.epoch;
  if (slot.state == SlotState::kComplete) {
    out << ", \"iteration\": " << slot.iteration
        << ", \"commit_time\": " << JsonString(IsoTime(slot.commit_time_unix_ns))
        << ", \"extra_state_bytes\": " << slot.extra_state_bytes
        << ", \"record_valid\": " << (slot.record_valid ? "true" : "false");
  }
  if (problems != nullptr) {
    out << ", \"problems\": [";
    for (std::size_t i = 0; i < problems->size(); ++i) {
      out << (i ? ", " : "") << JsonString((*problems)[i]);
    }
    out << "]";
  }
  out << "}";
  return out.str();
}

std::string SlotLine(const SlotInfo& slot) {
  std::ostringstream out;
  out << "slot " << slot.slot << ": " << pmsnap::layout::SlotStateName(slot.state);
  if (slot.state != SlotState::kEmpty) out << "  epoch " << slot.epoch;
  if (slot.state == SlotState::kComplete) {
    out << "  iteration " << slot.iteration << "  committed " << IsoTime(slot.commit_time_unix_ns)
        << "  extra " << slot.extra_state_bytes << " B"
        << (slot.record_valid ? "" : "  RECORD DAMAGED");
  }
  return out.str();
}

int Info(const Pool& pool, bool json, std::ostream& text) {
  const auto& manifest = pool.manifest();
  const auto& layout = pool.layout();
  auto latest = pool.Latest();
  if (json) {
    std::ostringstream out;
    out << "{\"path\": " << JsonString(pool.path())
        << ", \"format_version\": " << pool.format_version()
        << ", \"model_signature\": " << JsonString(Hex(pool.signature()))
        << ", \"created\": " << JsonString(IsoTime(pool.created_unix_ns()))
        << ", \"file_bytes\": " << pool.file_bytes()
        << ", \"part_bytes\": " << pool.options().part_bytes
        << ", \"extra_state_capacity\": " << pool.options().extra_state_capacity
        << ", \"chunk_heap\": {\"capacity\": " << pool.chunk_heap().capacity_bytes()
        << ", \"used\": " << pool.chunk_heap().used_bytes() << ", \"chunks\": " << pool.chunk_heap().List().size()
        << "}, \"units\": [";
    for (std::size_t u = 0; u < manifest.units.size(); ++u) {
      const auto& unit = manifest.units[u];
      out << (u ? ", " : "") << "{\"name\": " << JsonString(unit.name)
          << ", \"bytes\": " << layout.units[u].bytes
          << ", \"parts\": " << layout.units[u].part_count << ", \"encoded\": "
          << ((unit.flags & pmsnap::layout::kUnitFlagEncoded) ? "true" : "false")
          << ", \"tensors\": [";
      for (std::size_t t = 0; t < unit.tensors.size(); ++t) {
        const auto& tensor = unit.tensors[t];
        out << (t ? ", " : "") << "{\"name\": " << JsonString(tensor.name)
            << ", \"dtype\": " << JsonString(pmsnap::layout::DTypeName(tensor.dtype))
            << ", \"shape\": " << pmsnap::layout::ShapeToString(tensor.shape)
            << ", \"bytes\": " << tensor.bytes() << "}";
      }
      out << "]}";
    }
    out << "], \"slots\": [" << SlotJson(pool.slot_info(0), nullptr) << ", "
        << SlotJson(pool.slot_info(1), nullptr) << "], \"latest\": ";
    if (latest.ok()) {
      out << "{\"slot\": " << latest->slot() << ", \"epoch\": " << latest->epoch()
          << ", \"iteration\": " << latest->iteration() << "}";
      if (auto ledger = pmsnap::diff::cpr::FindPlsLedger(latest->extra_state())) {
        out << ", \"pls\": {\"pls\": " << ledger->pls()
            << ", \"failed_shards\": " << ledger->failed_shards()
            << ", \"emb_shards\": " << ledger->emb_shards()
            << ", \"lost_samples\": " << ledger->lost_samples()
            << ", \"total_samples\": " << ledger->total_samples() << "}";
      }
    } else {
      out << "null";
    }
    // Only under the PM bandwidth model (PMSNAP_PM_*_GBPS): this command's
    // reads were throttled to it.
    if (pool.pm_bandwidth().simulated()) {
      out << ", \"pm\": " << JsonString(pool.pm_bandwidth().Label());
    }
    out << ", \"warnings\": [";
    for (std::size_t i = 0; i < pool.warnings().size(); ++i) {
      out << (i ? ", " : "") << JsonString(pool.warnings()[i]);
    }
    out << "]}";
    text << out.str() << "\n";
    return kExitOk;
  }
  text << "pool            " << pool.path() << "\n"
       << "format version  " << pool.format_version() << "\n"
       << "model signature " << Hex(pool.signature()) << "\n"
       << "created         " << IsoTime(pool.created_unix_ns()) << "\n"
       << "file size       " << HumanBytes(pool.file_bytes()) << "\n"
       << "part size       " << HumanBytes(pool.options().part_bytes) << "\n"
       << "extra state     up to " << HumanBytes(pool.options().extra_state_capacity) << "\n"
       << "chunk heap      " << HumanBytes(pool.chunk_heap().used_bytes()) << " of "
       << HumanBytes(pool.chunk_heap().capacity_bytes()) << " in " << pool.chunk_heap().List().size()
       << " chunks\n"
       << "units           " << manifest.units.size() << " (" << HumanBytes(layout.slot_bytes)
       << " per slot)\n";
  if (layout.extent_bytes != 0) {
    text << "slot extents    " << layout.extent_used.size() << " per slot, of up to "
         << HumanBytes(layout.extent_bytes) << " (format version 2)\n";
  }
  if (pool.pm_bandwidth().simulated()) {
    text << "pm              " << pool.pm_bandwidth().Label()
         << " (PMSNAP_PM_WRITE_GBPS / PMSNAP_PM_READ_GBPS): this command's reads are throttled\n";
  }
  for (std::size_t u = 0; u < manifest.units.size(); ++u) {
    const auto& unit = manifest.units[u];
    text << "  " << unit.name << "  " << HumanBytes(layout.units[u].bytes) << "  "
         << layout.units[u].part_count << " parts"
         << ((unit.flags & pmsnap::layout::kUnitFlagEncoded) ? "  (encoded)" : "") << "\n";
    for (const auto& tensor : unit.tensors) {
      text << "    " << tensor.name << "  " << pmsnap::layout::DTypeName(tensor.dtype) << " "
           << pmsnap::layout::ShapeToString(tensor.shape) << "\n";
    }
  }
  text << SlotLine(pool.slot_info(0)) << "\n" << SlotLine(pool.slot_info(1)) << "\n";
  if (latest.ok()) {
    text << "latest          epoch " << latest->epoch() << " (iteration " << latest->iteration()
         << ") in slot " << latest->slot() << "\n";
    // CPR partial recovery keeps its PLS ledger in the extra state.
    if (auto ledger = pmsnap::diff::cpr::FindPlsLedger(latest->extra_state())) {
      text << "pls             " << ledger->pls() << " (CPR partial recovery: "
           << ledger->failed_shards() << " shard failures over " << ledger->emb_shards()
           << " embedding shards, " << ledger->lost_samples() << " lost samples of "
           << ledger->total_samples() << ")\n";
    }
  } else {
    text << "latest          none: " << latest.status().message() << "\n";
  }
  for (const std::string& w : pool.warnings()) text << "warning         " << w << "\n";
  return kExitOk;
}

int Verify(const Pool& pool, bool json, std::ostream& text) {
  const pmsnap::layout::VerifyReport report = pool.Verify(/*deep=*/true);
  if (json) {
    std::ostringstream out;
    out << "{\"path\": " << JsonString(pool.path())
        << ", \"consistent\": " << (report.ok() ? "true" : "false") << ", \"slots\": ["
        << SlotJson(report.slots[0].info, &report.slots[0].problems) << ", "
        << SlotJson(report.slots[1].info, &report.slots[1].problems) << "], \"chunk_problems\": [";
    for (std::size_t i = 0; i < report.chunk_problems.size(); ++i) {
      out << (i ? ", " : "") << JsonString(report.chunk_problems[i]);
    }
    out << "], \"recoverable_slot\": "
        << (report.recoverable_slot ? std::to_string(*report.recoverable_slot) : "null") << "}";
    text << out.str() << "\n";
  } else {
    for (const auto& slot : report.slots) {
      text << SlotLine(slot.info) << (slot.problems.empty() ? "  ok" : "") << "\n";
      for (const std::string& p : slot.problems) text << "  problem: " << p << "\n";
    }
    for (const std::string& p : report.chunk_problems) text << "chunk problem: " << p << "\n";
    text << pool.path() << ": " << (report.ok() ? "consistent" : "DAMAGED");
    if (report.recoverable_slot) {
      text << " (recovery uses slot " << *report.recoverable_slot << ", epoch "
           << report.slots[*report.recoverable_slot].info.epoch << ")";
    }
    text << "\n";
  }
  return report.ok() ? kExitOk : kExitDamaged;
}

}  // namespace

int RunCli(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  if (!args.empty() && (args[0] == "list" || args[0] == "export" || args[0] == "prune" ||
                        args[0] == "diff")) {
    err << "pmsnap: '" << args[0]
        << "' is a command of the Python package (it needs torch): run `python -m pmsnap "
        << args[0] << " ...` or the `pmsnap` that `pip install .` installs\n";
    return kExitUsage;
  }
  bool json = false;
  std::vector<std::string> positional;
  for (const std::string& arg : args) {
    if (arg == "--json") {
      json = true;
    } else if (arg == "-h" || arg == "--help") {
      Usage(out);
      return kExitOk;
    } else if (arg.rfind("--", 0) == 0) {
      err << "pmsnap: unknown option '" << arg << "'\n";
      return Usage(err);
    } else {
      positional.push_back(arg);
    }
  }
  if (positional.size() != 2 || (positional[0] != "info" && positional[0] != "verify")) {
    return Usage(err);
  }
  const bool verify = positional[0] == "verify";
  pmsnap::layout::OpenOptions options;
  options.verify_data = false;  // `verify` checks every slot itself, `info` reads metadata
  options.read_only = true;     // inspecting a pool never changes a byte of it
  pmsnap::layout::SetWarningSink(nullptr);  // warnings are printed in the report
  auto pool = Pool::Open(positional[1], options);
  if (!pool.ok()) {
    if (json) {
      out << "{\"path\": " << JsonString(positional[1])
          << ", \"error\": " << JsonString(pool.status().ToString())
          << (verify ? ", \"consistent\": false" : "") << "}\n";
    } else {
      err << "pmsnap: " << pool.status().ToString() << "\n";
    }
    return ExitFor(pool.status());
  }
  std::ostringstream report;
  const int code = verify ? Verify(**pool, json, report) : Info(**pool, json, report);
  // A process that opened the pool while it was read may have torn what
  // was read: that is busy, not damage.
  if (pmsnap::Status undisturbed = (*pool)->CheckUndisturbed(); !undisturbed.ok()) {
    err << "pmsnap: " << undisturbed.ToString() << "\n";
    return kExitBusy;
  }
  out << report.str();
  return code;
}

}  // namespace pmsnap::tools
