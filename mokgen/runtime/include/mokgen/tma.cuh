// mokgen/tma.cuh -- bulk tensor copy (TMA) wrappers.
//
// Tensor maps are encoded on the host (mokgen/runtime/cuda.py, cuTensorMapEncodeTiled) and
// passed by value as `const __grid_constant__ CUtensorMap` kernel parameters; device code
// takes their address (a param-space pointer, valid for TMA) and hands it to these wrappers.
#pragma once
#include <cuda.h>  // CUtensorMap (64-byte opaque struct)
#include "mokgen/ptx.cuh"

namespace mokgen {

// Pulls the descriptor into the TMA unit's cache so the first load of a tile does not pay
// for fetching it from param/global memory.
MOKGEN_DEV void tma_prefetch_desc(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// 2D tile load: box at coordinates (c0 = innermost/column element index, c1 = row) into smem
// `dst`, completing `bytes` of transaction count on `bar`. Out-of-bounds elements of the box
// are zero-filled by the hardware and still counted in the transaction bytes, which is how
// ragged M tiles (rows past the tensor end) stay correct without special cases.
MOKGEN_DEV void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
      : "memory");
}

// Same, with an L2 eviction-priority hint (createpolicy result). Unused by default:
// evict_last on activations + evict_first on weights measured slower on every GEMM variant.
MOKGEN_DEV void tma_load_2d_hint(void* dst, const CUtensorMap* map, uint64_t* bar, int c0,
                                 int c1, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "l"(policy)
      : "memory");
}

// 3D tile store (bulk async-group of the issuing thread): the box at (c0, c1, c2) of the
// map's [depth, rows, cols] tensor (c2: the matrix) from shared memory `src` (laid out as the
// map's swizzle says); box elements past the tensor's bounds are not written. The smem writes
// it reads must be made visible to the async proxy first (fence_proxy_async_shared) by every
// thread that wrote them.
MOKGEN_DEV void tma_store_3d(const CUtensorMap* map, const void* src, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];"
      ::"l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
// The same box added element-wise into the tensor instead of written over it (a bulk tensor
// reduction; the element type is the map's: bf16 sums are rounded to nearest once, as a bf16
// add of the two values). Each element is updated by this one operation, so the result does
// not depend on the order of other CTAs' operations.
MOKGEN_DEV void tma_reduce_add_3d(const CUtensorMap* map, const void* src, int c0, int c1,
                                  int c2) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group"
      " [%0, {%2, %3, %4}], [%1];"
      ::"l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
MOKGEN_DEV void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// This thread's bulk groups but the N most recent have read their shared memory (it may be
// written again) / have completed (their global writes are done).
template <int N>
MOKGEN_DEV void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
template <int N>
MOKGEN_DEV void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}
MOKGEN_DEV void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

MOKGEN_DEV uint64_t l2_policy_evict_last() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
  return p;
}
MOKGEN_DEV uint64_t l2_policy_evict_first() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}

}  // namespace mokgen
