// mokgen/sync.cuh -- flags between CTAs and between ranks, every wait bounded by a watchdog.
//
// Counters are monotonic within one call and zeroed on the stream before it (a memset, not a
// host round trip); cross-rank barrier flags carry an epoch instead, so they never need a
// reset and a late rank from call e-1 can't be mistaken for call e.
//
// Watchdog: a wait that outlasts mokgen_watch_timeout_ns records who waited on what in
// mokgen_watch (host-mapped memory: the host reads it without a device round trip), raises
// mokgen_abort, and returns false. Every wait also gives up once mokgen_abort is raised, and
// the callers then stop taking work, so the whole kernel drains and exits instead of hanging;
// the host turns the record into a RuntimeError.
#pragma once
#include "mokgen/ptx.cuh"

extern "C" {
__device__ unsigned long long mokgen_watch_timeout_ns = 5000000000ull;
__device__ unsigned int* mokgen_watch = nullptr;  // [8], set by the host at module load
__device__ unsigned int mokgen_abort = 0;
}

namespace mokgen {

enum WatchWord : int { kWatchCode, kWatchRank, kWatchPhase, kWatchIndex, kWatchValue,
                       kWatchTarget, kWatchBlock, kWatchWords };
constexpr unsigned kWatchMagic = 0x57A7C400u;

MOKGEN_DEV uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

MOKGEN_DEV bool aborted() { return *reinterpret_cast<volatile unsigned*>(&mokgen_abort) != 0; }

MOKGEN_DEV void watchdog_fire(int rank, int phase, int index, uint32_t value, uint32_t target) {
  if (atomicCAS(&mokgen_abort, 0u, 1u) == 0u && mokgen_watch != nullptr) {
    volatile unsigned* w = mokgen_watch;
    w[kWatchRank] = (unsigned)rank;
    w[kWatchPhase] = (unsigned)phase;
    w[kWatchIndex] = (unsigned)index;
    w[kWatchValue] = value;
    w[kWatchTarget] = target;
    w[kWatchBlock] = blockIdx.x;
    __threadfence_system();
    w[kWatchCode] = kWatchMagic;  // written last: the host reads the record once this is set
    __threadfence_system();
  }
}

// Spin until *flag >= target (acquire at gpu scope, or system scope for flags other GPUs
// write). False if the watchdog fired (here or anywhere): the caller must stop.
template <bool kSystem = false>
MOKGEN_DEV bool wait_at_least(const uint32_t* flag, uint32_t target, int rank, int phase,
                              int index) {
  uint32_t v = kSystem ? ld_acquire_sys(flag) : ld_acquire_gpu(flag);
  if (v >= target) return true;
  const uint64_t start = global_ns();
  for (uint32_t n = 1;; ++n) {
    __nanosleep(64);
    v = kSystem ? ld_acquire_sys(flag) : ld_acquire_gpu(flag);
    if (v >= target) return true;
    if ((n & 255) == 0) {
      if (aborted()) return false;
      if (global_ns() - start > mokgen_watch_timeout_ns) {
        watchdog_fire(rank, phase, index, v, target);
        return false;
      }
    }
  }
}

// What a minibatch's ready count reaches: one per comm CTA that pulls it (kCommCtas), or one
// per CTA for the minibatch every CTA pulled before taking its role (FwdConsts' head pull).
template <bool kHead, int kCommCtas>
MOKGEN_DEV uint32_t head_ready(bool head_minibatch) {
  return kHead && head_minibatch ? gridDim.x : (uint32_t)kCommCtas;
}

// Publish a GPU-local count: every thread of the caller's group has finished its stores and
// synchronized; one thread then makes them visible at gpu scope and bumps the count. (Stores
// to peers become visible to them at the rank barrier, which fences at system scope.)
MOKGEN_DEV void signal_add(uint32_t* flag, uint32_t v = 1) {
  __threadfence();
  atomicAdd(flag, v);
}

// Bump a GPU-local count that publishes no data: the caller's stores need not be visible to
// whoever waits on it. signal_add's fence waits until every store the caller's warp issued has
// reached L2, which a consumer warp pays before its warpgroup's next mainloop can start (the
// wgmma is warpgroup-wide): a tile's whole epilogue drained, the tensor core idle meanwhile.
MOKGEN_DEV void signal_add_relaxed(uint32_t* flag, uint32_t v = 1) { atomicAdd(flag, v); }

// Barrier across R ranks by unicast peer writes (no multicast): rank `rank` writes `epoch`
// into slot `rank` of every peer's flag array, then waits until all R slots of its own
// array hold `epoch`. One thread calls it.
template <int R>
struct PeerFlags {
  uint32_t* flags[R];
};

constexpr int kPhaseBarrier = 100;  // watchdog phase of the rank barrier; index = peer

MOKGEN_DEV bool rank_barrier(uint32_t* const* peer_flags, uint32_t* my_flags, int rank,
                             int ranks, uint32_t epoch) {
  __threadfence_system();
  for (int p = 0; p < ranks; ++p) st_release_sys(peer_flags[p] + rank, epoch);
  for (int p = 0; p < ranks; ++p)
    if (!wait_at_least<true>(my_flags + p, epoch, rank, kPhaseBarrier, p)) return false;
  return true;
}

}  // namespace mokgen
