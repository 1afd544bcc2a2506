// What the pool code knows about libpmemobj: how much room its allocator
// and metadata take, its error text, and transactions that return instead
// of longjmp-ing. Shared by pool creation, open and the chunk heap.
#pragma once

#include <libpmemobj.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

#include "detail/persistence.h"
#include "pmsnap/common/status.h"

namespace pmsnap::layout::detail {

constexpr std::uint64_t AlignUp(std::uint64_t value, std::uint64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

// libpmemobj internals, sized generously: pool header, lanes, heap header.
inline constexpr std::uint64_t kPmemobjBaseOverhead = 16ull << 20;
// Per zone (up to ~16 GiB of heap): zone header plus chunk headers.
inline constexpr std::uint64_t kPmemobjZoneBytes = 16ull << 30;
inline constexpr std::uint64_t kPmemobjZoneOverhead = 1ull << 20;
// Allocation unit of large pmemobj objects.
inline constexpr std::uint64_t kPmemobjChunkBytes = 256ull << 10;
inline constexpr std::uint64_t kPmemobjMinPool = 8ull << 20;
// libpmemobj's compact allocation header, in front of every object.
inline constexpr std::uint64_t kAllocationHeaderBytes = 16;

// libpmemobj 1.x's pool descriptor (struct pmemobjpool, src/libpmemobj/obj.h),
// where a read-only open (OpenOptions::read_only) finds the root object
// without libpmemobj: the 4 KiB pool header (signature "PMEMOBJ", then the
// format's major version), the 1 KiB layout name, lanes_offset, nlanes,
// heap_offset, 8 + 984 unused bytes and the descriptor checksum, then
// root_offset, run_id (which every pmemobj_open moves) and root_size.
// pool_readonly_test checks these against pmemobj_root on a live pool.
inline constexpr std::uint64_t kPmemobjMajorAt = 8;
inline constexpr std::uint32_t kPmemobjMajor = 6;
inline constexpr std::uint64_t kPmemobjRootOffsetAt = 6144;
inline constexpr std::uint64_t kPmemobjRunIdAt = 6152;
inline constexpr std::uint64_t kPmemobjRootSizeAt = 6160;

// "<what>: <libpmemobj's last message, or errno's text>".
inline std::string PmdkError(const char* what) {
  const char* msg = pmemobj_errormsg();
  return std::string(what) + ": " + ((msg != nullptr && *msg != '\0') ? msg : std::strerror(errno));
}

// libpmemobj's text for a failed pmemobj_create/open that set errno `err`.
inline std::string PmdkMessage(int err) {
  const char* msg = pmemobj_errormsg();
  return (msg != nullptr && *msg != '\0') ? msg : std::strerror(err);
}

// Runs `body` inside a pmemobj transaction that returns (never longjmps) on
// failure. `body` returns 0 or an errno value. kNoSpace for ENOMEM, else
// kIOError, with `what` and libpmemobj's message.
template <typename Body>
Status RunTransaction(PMEMobjpool* pop, const std::string& what, Body&& body) {
  const seam::LibraryWrites library_writes(pop);
  if (pmemobj_tx_begin(pop, nullptr, TX_PARAM_NONE) != 0) {
    return {StatusCode::kIOError, PmdkError(("cannot begin transaction for " + what).c_str())};
  }
  pmemobj_tx_set_failure_behavior(POBJ_TX_FAILURE_RETURN);
  int rc = body();
  std::string failure;
  if (rc != 0 && pmemobj_tx_stage() == TX_STAGE_WORK) {
    failure = PmdkError(what.c_str());
    pmemobj_tx_abort(rc);
  } else if (rc == 0) {
    pmemobj_tx_commit();
  } else {
    failure = PmdkError(what.c_str());
  }
  const int end_rc = pmemobj_tx_end();
  if (rc == 0 && end_rc == 0) return Status::Ok();
  const int err = rc != 0 ? rc : end_rc;
  if (failure.empty()) failure = PmdkError(what.c_str());
  return {err == ENOMEM ? StatusCode::kNoSpace : StatusCode::kIOError, failure};
}

}  // namespace pmsnap::layout::detail
