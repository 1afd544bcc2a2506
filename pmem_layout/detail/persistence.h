// The persistence seam: every store pmem_layout makes durable goes through the
// functions of namespace `seam` below (flush, drain, persist, non-temporal
// copies, the fused copy-and-hash kernel), and so does the start and end of
// every libpmemobj transaction and every mapping of a pool file.
//
// Production runs `LibpmemobjPersistence`, today's libpmemobj calls, inlined:
// each seam call costs one relaxed load of a pointer that is null outside
// tests. A test installs its own `Persistence` (InstallPersistenceForTesting)
// to watch every durability step; tests/testutil/power_loss.h builds the
// images a power loss would leave from them.
//
// The simulated PM bandwidth (PmBandwidth) lives here too: a pool's data
// stores and bulk reads call seam::PaceWrite / PaceRead with that pool's
// PmPacers after the bytes moved, which hold the thread to the modelled rate.
//
// Outside the seam: libpmemobj's own metadata writes (pmemobj_create/open/
// close, its allocator, undo logs and transaction commits); the seam only
// brackets them (LibraryWrites, Mapped, Unmapping). Internal to pmem_layout;
// tests include it to install an implementation.
#pragma once

#include <libpmemobj.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "detail/xxh3_kernels.h"
#include "pmsnap/common/bandwidth_pacer.h"

namespace pmsnap::layout::detail {

// One implementation of the durability steps. Every method may be called
// from any thread at once (workers write parts in parallel); an
// implementation synchronizes itself. `pop` is the pool the bytes belong to.
class Persistence {
 public:
  virtual ~Persistence() = default;

  // A pool file was mapped at `base` (`bytes` long), after pmemobj_create
  // or pmemobj_open returned; everything libpmemobj wrote so far is durable.
  virtual void Mapped(PMEMobjpool* pop, std::byte* base, std::uint64_t bytes) = 0;
  // The mapping of `pop` is about to be closed (pmemobj_close).
  virtual void Unmapping(PMEMobjpool* pop) = 0;
  // Starts writing back the cache lines of [addr, addr + bytes); durable
  // only after this thread's next Drain.
  virtual void Flush(PMEMobjpool* pop, const void* addr, std::size_t bytes) = 0;
  // Waits until this thread's flushes and non-temporal stores are durable.
  virtual void Drain(PMEMobjpool* pop) = 0;
  // Copies src into PM with non-temporal stores; durable after Drain.
  virtual void CopyNonTemporal(PMEMobjpool* pop, void* dst, const void* src, std::size_t bytes) = 0;
  // The fused kernel (Xxh3Kernels::copy_and_hash): streams a prefix of src
  // into dst (64-byte aligned) with non-temporal stores, durable after
  // Drain, and hashes all of src. Returns the prefix's length.
  virtual std::size_t StreamAndHash(void* dst, const void* src, std::size_t bytes,
                                    std::uint64_t* hash) = 0;
  // libpmemobj writes its own metadata (a transaction) between these two;
  // it made them durable by the time EndLibraryWrites is called.
  virtual void BeginLibraryWrites(PMEMobjpool* pop) = 0;
  virtual void EndLibraryWrites(PMEMobjpool* pop) = 0;
};

// The production implementation: libpmemobj's calls, nothing else.
class LibpmemobjPersistence final : public Persistence {
 public:
  void Mapped(PMEMobjpool*, std::byte*, std::uint64_t) override {}
  void Unmapping(PMEMobjpool*) override {}
  void Flush(PMEMobjpool* pop, const void* addr, std::size_t bytes) override {
    pmemobj_flush(pop, addr, bytes);
  }
  void Drain(PMEMobjpool* pop) override { pmemobj_drain(pop); }
  void CopyNonTemporal(PMEMobjpool* pop, void* dst, const void* src, std::size_t bytes) override {
    pmemobj_memcpy(pop, dst, src, bytes, PMEMOBJ_F_MEM_NONTEMPORAL | PMEMOBJ_F_MEM_NODRAIN);
  }
  std::size_t StreamAndHash(void* dst, const void* src, std::size_t bytes,
                            std::uint64_t* hash) override {
    return BestXxh3Kernels().copy_and_hash(dst, src, bytes, hash);
  }
  void BeginLibraryWrites(PMEMobjpool*) override {}
  void EndLibraryWrites(PMEMobjpool*) override {}
};

// The implementation a test installed, or null (production).
extern std::atomic<Persistence*> g_installed_persistence;

// Makes every later seam call go to `persistence` (null: back to
// production) and returns the one it replaces. For tests only: call it
// while no pool is being written; the caller keeps `persistence` alive
// until it is replaced.
Persistence* InstallPersistenceForTesting(Persistence* persistence);

// Test-only planted bug: while set, Pool::Commit skips the drain between
// persisting the commit record and storing the commit word, so the power-loss
// tests can show that they notice a missing drain. Off unless a test sets it.
void DropCommitRecordDrainForTesting(bool drop);
bool CommitRecordDrainDropped();

// One pool's PM bandwidth model: a channel for its writes and one for its
// reads, each null where that direction runs at the machine's speed. Fixed
// at open; the pacers synchronize themselves.
struct PmPacers {
  std::unique_ptr<BandwidthPacer> write;
  std::unique_ptr<BandwidthPacer> read;
};

namespace seam {

using PaceClock = BandwidthPacer::Clock;

// When a paced transfer starts: a clock reading only where `pacer` models
// a rate (the unthrottled path reads no clock).
inline PaceClock::time_point PaceStart(const std::unique_ptr<BandwidthPacer>& pacer) {
  if (pacer != nullptr) [[unlikely]]
    return PaceClock::now();
  return {};
}
// After `bytes` of pool data were made durable (begun at `started`, from
// PaceStart): holds the thread until the pool's write channel has carried
// them.
inline void PaceWrite(const PmPacers& pm, std::uint64_t bytes, PaceClock::time_point started) {
  if (pm.write != nullptr) [[unlikely]]
    pm.write->Pace(bytes, started);
}
// The same for `bytes` read from the pool in bulk.
inline void PaceRead(const PmPacers& pm, std::uint64_t bytes, PaceClock::time_point started) {
  if (pm.read != nullptr) [[unlikely]]
    pm.read->Pace(bytes, started);
}

// Constant-initialized: no guard on the hot path; calls through it are
// direct (the class is final) and inlined.
inline constinit LibpmemobjPersistence g_production;
inline LibpmemobjPersistence& Production() { return g_production; }

// Relaxed: installing happens before any pool is written (see
// InstallPersistenceForTesting), ordered by whatever started the writers.
inline Persistence* Installed() { return g_installed_persistence.load(std::memory_order_relaxed); }

inline void Mapped(PMEMobjpool* pop, std::byte* base, std::uint64_t bytes) {
  if (Persistence* p = Installed(); p != nullptr) [[unlikely]]
    p->Mapped(pop, base, bytes);
}
inline void Unmapping(PMEMobjpool* pop) {
  if (Persistence* p = Installed(); p != nullptr) [[unlikely]]
    p->Unmapping(pop);
}
inline void Flush(PMEMobjpool* pop, const void* addr, std::size_t bytes) {
  if (Persistence* p = Installed(); p != nullptr) [[unlikely]] {
    p->Flush(pop, addr, bytes);
  } else {
    Production().Flush(pop, addr, bytes);
  }
}
inline void Drain(PMEMobjpool* pop) {
  if (Persistence* p = Installed(); p != nullptr) [[unlikely]] {
    p->Drain(pop);
  } else {
    Production().Drain(pop);
  }
}
// Flush + Drain.
inline void Persist(PMEMobjpool* pop, const void* addr, std::size_t bytes) {
  if (Persistence* p = Installed(); p != nullptr) [[unlikely]] {
    p->Flush(pop, addr, bytes);
    p->Drain(pop);
  } else {
    pmemobj_persist(pop, addr, bytes);
  }
}
inline void CopyNonTemporal(PMEMobjpool* pop, void* dst, const void* src, std::size_t bytes) {
  if (Persistence* p = Installed(); p != nullptr) [[unlikely]] {
    p->CopyNonTemporal(pop, dst, src, bytes);
  } else {
    Production().CopyNonTemporal(pop, dst, src, bytes);
  }
}
// CopyNonTemporal + Drain.
inline void CopyPersist(PMEMobjpool* pop, void* dst, const void* src, std::size_t bytes) {
  if (Persistence* p = Installed(); p != nullptr) [[unlikely]] {
    p->CopyNonTemporal(pop, dst, src, bytes);
    p->Drain(pop);
  } else {
    pmemobj_memcpy_persist(pop, dst, src, bytes);
  }
}
inline std::size_t StreamAndHash(void* dst, const void* src, std::size_t bytes,
                                 std::uint64_t* hash) {
  if (Persistence* p = Installed(); p != nullptr) [[unlikely]] {
    return p->StreamAndHash(dst, src, bytes, hash);
  }
  return Production().StreamAndHash(dst, src, bytes, hash);
}

// Brackets a stretch where libpmemobj writes its own metadata (a
// transaction): Begin on construction, End on destruction.
class LibraryWrites {
 public:
  explicit LibraryWrites(PMEMobjpool* pop) : pop_(pop), persistence_(Installed()) {
    if (persistence_ != nullptr) [[unlikely]]
      persistence_->BeginLibraryWrites(pop_);
  }
  ~LibraryWrites() {
    if (persistence_ != nullptr) [[unlikely]]
      persistence_->EndLibraryWrites(pop_);
  }
  LibraryWrites(const LibraryWrites&) = delete;
  LibraryWrites& operator=(const LibraryWrites&) = delete;

 private:
  PMEMobjpool* pop_;
  Persistence* persistence_;
};

}  // namespace seam
}  // namespace pmsnap::layout::detail
