// mokgen/sync.cuh -- flags between CTAs and between ranks, every wait bounded.
//
// Counters are monotonic within one call and zeroed on the stream before it (a memset, not a
// host round trip); cross-rank barrier flags carry an epoch instead, so they never need a
// reset and a late rank from call e-1 can't be mistaken for call e.
#pragma once
#include "mokgen/ptx.cuh"

namespace mokgen {

// Spin until *flag >= target (acquire at gpu scope, or system scope for flags that other
// GPUs write). On timeout: write {magic, tag, block, value} to mokgen_diag and trap, so the
// host gets an error instead of a hung GPU.
template <bool kSystem = false>
MOKGEN_DEV void wait_at_least(const uint32_t* flag, uint32_t target, uint32_t tag) {
  uint32_t n = 0;
  uint32_t v;
  while ((v = kSystem ? ld_acquire_sys(flag) : ld_acquire_gpu(flag)) < target) {
    __nanosleep(32);
#if MOKGEN_SPIN_LIMIT
    if (++n == MOKGEN_SPIN_LIMIT) {
      mokgen_diag[1] = tag;
      mokgen_diag[2] = blockIdx.x;
      mokgen_diag[3] = v;
      atomicExch(&mokgen_diag[0], 0xF1A60000u);
      __threadfence_system();
      __trap();
    }
#endif
  }
}

// Publish a GPU-local count: every thread of the caller's group has finished its stores and
// synchronized; one thread then makes them visible at gpu scope and bumps the count. (Stores
// to peers become visible to them at the rank barrier, which fences at system scope.)
MOKGEN_DEV void signal_add(uint32_t* flag, uint32_t v = 1) {
  __threadfence();
  atomicAdd(flag, v);
}

// Barrier across R ranks by unicast peer writes (no multicast): rank `rank` writes `epoch`
// into slot `rank` of every peer's flag array, then waits until all R slots of its own
// array hold `epoch`. One thread calls it.
template <int R>
struct PeerFlags {
  uint32_t* flags[R];
};

MOKGEN_DEV void rank_barrier(uint32_t* const* peer_flags, uint32_t* my_flags, int rank, int ranks,
                             uint32_t epoch, uint32_t tag) {
  __threadfence_system();
  for (int p = 0; p < ranks; ++p) st_release_sys(peer_flags[p] + rank, epoch);
  for (int p = 0; p < ranks; ++p) wait_at_least<true>(my_flags + p, epoch, tag + p);
}

}  // namespace mokgen
