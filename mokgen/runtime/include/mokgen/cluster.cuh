// mokgen/cluster.cuh -- thread-block clusters (sm_90): TMA multicast into every CTA of a
// cluster, mbarrier arrives on a peer CTA's barrier, the cluster-wide barrier.
//
// Why: a 128 x 256 tile streams 48 KB from L2 per 64-wide K slice (16 KB of A rows, 32 KB of
// B); two CTAs of a cluster working on vertically adjacent tiles (the same B columns) can
// each load half of B once and multicast it to both, so B's L2 reads halve. Hand-written PTX
// for the reason ptx.cuh gives (exactly these instructions); one instruction a wrapper.
#pragma once
#include <cuda.h>

#include "mokgen/ptx.cuh"

namespace mokgen {

MOKGEN_DEV uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
MOKGEN_DEV uint32_t cluster_id_x() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r));
  return r;
}
MOKGEN_DEV uint32_t nclusters_x() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(r));
  return r;
}

// Every thread of every CTA of the cluster (aligned: whole warps). Release / acquire: what a
// CTA wrote to shared memory before it (barrier inits, fenced) is visible to its peers after.
MOKGEN_DEV void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Arrive on the mbarrier at the same shared-memory offset as `bar`, in cluster CTA `cta`
// (itself included): a consumer freeing a stage that the peer's producer multicasts into.
// The arrive's default release.cta: what it orders is this warp's wgmma reads of the stage,
// complete at wgmma_wait; release.cluster compiles to MEMBAR.ALL.GPU before every arrive
// (waiting for the epilogue's global stores too), which slows the mainloop by about a third.
MOKGEN_DEV void mbar_arrive_cluster(uint64_t* bar, uint32_t cta) {
  asm volatile(
      "{\n .reg .b32 remote;\n"
      " mapa.shared::cluster.u32 remote, %0, %1;\n"
      " mbarrier.arrive.shared::cluster.b64 _, [remote];\n}" ::"r"(
          smem_u32(bar)),
      "r"(cta)
      : "memory");
}

// Store `v` at `slot`'s shared-memory offset in cluster CTA `cta`, completing 4 bytes on the
// mbarrier at `bar`'s offset there: the pair's mailbox (gemm_tile.cuh pair_post), the value
// visible to whoever sees that barrier's phase complete.
MOKGEN_DEV void st_async_cluster(int* slot, uint64_t* bar, uint32_t cta, int v) {
  asm volatile(
      "{\n .reg .b32 rs, rb;\n"
      " mapa.shared::cluster.u32 rs, %0, %2;\n"
      " mapa.shared::cluster.u32 rb, %1, %2;\n"
      " st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [rs], %3, [rb];\n}" ::"r"(
          smem_u32(slot)),
      "r"(smem_u32(bar)), "r"(cta), "r"(v)
      : "memory");
}

// 2D tile load into the same shared-memory offset of every CTA in `mask` (bit i: cluster CTA
// i), each CTA's mbarrier at `bar`'s offset completing the box's bytes.
MOKGEN_DEV void tma_load_2d_multicast(void* dst, const CUtensorMap* map, uint64_t* bar, int c0,
                                      int c1, uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "h"(mask)
      : "memory");
}

}  // namespace mokgen
