// mokgen/ptx.cuh -- thin inline-PTX wrappers used by the Hopper (sm_90a) megakernel.
//
// Why hand-written PTX: task coordinates are dynamic inside a persistent megakernel and the
// TMA descriptors are encoded from Python, so we want exactly these instructions and nothing
// else between us and the hardware. Every wrapper is a single instruction (or a tiny loop).
#pragma once
#include <cstdint>

#define MOKGEN_DEV __device__ __forceinline__

namespace mokgen {

// Shared-memory addresses in PTX are 32-bit offsets in the shared window.
MOKGEN_DEV uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The kernel's dynamic shared memory (every extern __shared__ array names its base), for
// device code that is not handed the pointer.
MOKGEN_DEV uint8_t* dyn_smem() {
  extern __shared__ __align__(1024) uint8_t mokgen_dyn_smem[];
  return mokgen_dyn_smem;
}

// ---------------------------------------------------------------- mbarrier
MOKGEN_DEV void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count)
               : "memory");
}
// Makes the mbarrier.init visible to the async proxy (TMA complete_tx) and other threads.
MOKGEN_DEV void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// Plain arrive: release.cta semantics, so ordinary smem stores before it are visible to the
// thread that later observes the phase flip via try_wait (acquire.cta).
MOKGEN_DEV void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
// Arrive and announce the number of bytes the TMA engine will deliver for this phase.
MOKGEN_DEV void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}
MOKGEN_DEV bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{\n .reg .pred p;\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      " selp.u32 %0, 1, 0, p;\n}"
      : "=r"(ok)
      : "r"(smem_u32(bar)), "r"(parity)
      : "memory");
  return ok != 0;
}

// Spin limit for every wait: docs/design.md requires bounded spins that report a diagnostic
// instead of hanging the GPU. try_wait already suspends in hardware for a while per call,
// so the iteration count is a coarse timeout. Define MOKGEN_SPIN_LIMIT=0 to disable.
#ifndef MOKGEN_SPIN_LIMIT
#define MOKGEN_SPIN_LIMIT (1u << 26)
#endif

// Diagnostic word written by a timed-out wait before it traps: {magic, tag, block, thread}.
// Host reads it with cuModuleGetGlobal("mokgen_diag") after a launch fails. A global store +
// trap instead of printf: printf is a function call, and a call inside a loop with wgmma in
// flight makes ptxas serialize every wgmma (C7510) and spill.
extern "C" {
__device__ unsigned int mokgen_diag[4];
}

// A wait that ran past its bound: record {magic, tag, block, thread} (the first record
// wins) and trap.
MOKGEN_DEV void record_timeout(int tag, uint32_t parity) {
  if (atomicCAS(&mokgen_diag[0], 0u, 0xDEAD0000u | (parity & 1)) == 0u) {
    mokgen_diag[1] = (unsigned)tag;
    mokgen_diag[2] = blockIdx.x;
    mokgen_diag[3] = threadIdx.x;
  }
  __threadfence_system();
}
MOKGEN_DEV void wait_timed_out(int tag, uint32_t parity) {
  record_timeout(tag, parity);
  __trap();
}

// Waits until the phase with the given parity has completed. `tag` identifies the waiter
// in the diagnostic.
MOKGEN_DEV void mbar_wait(uint64_t* bar, uint32_t parity, int tag = 0) {
#if MOKGEN_SPIN_LIMIT
  uint32_t n = 0;
  while (!mbar_try_wait(bar, parity)) {
    if (++n == MOKGEN_SPIN_LIMIT) wait_timed_out(tag, parity);
  }
#else
  while (!mbar_try_wait(bar, parity)) {
  }
#endif
}

// The same bounded wait for code at its register limit (the fp8 mainloop, 192 live
// accumulators): it only reports whether the phase completed. A __trap() anywhere in that
// code made ptxas spill, so its caller records the timeout and stops instead; the CTA's
// producer then times out on its own bounded wait and traps.
MOKGEN_DEV bool mbar_wait_lean(uint64_t* bar, uint32_t parity) {
#if MOKGEN_SPIN_LIMIT
  for (uint32_t n = 0; n < MOKGEN_SPIN_LIMIT; ++n)
    if (mbar_try_wait(bar, parity)) return true;
  return false;
#else
  while (!mbar_try_wait(bar, parity)) {
  }
  return true;
#endif
}

// ---------------------------------------------------------------- proxy fences
// Ordinary (generic-proxy) smem writes that TMA/wgmma read next need this in the writer.
MOKGEN_DEV void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// Ordinary global writes later read by TMA (e.g. SwiGLU output feeding the down GEMM).
MOKGEN_DEV void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}
MOKGEN_DEV void fence_proxy_async() { asm volatile("fence.proxy.async;" ::: "memory"); }

// ---------------------------------------------------------------- cp.async (gathered rows)
// 16 bytes global -> shared, through L2 only (.cg); ok = false writes 16 zero bytes and reads
// nothing (src-size 0), as TMA zero-fills past a tensor's edge.
MOKGEN_DEV void cp_async_16(uint32_t dst, const void* src, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(ok ? 16 : 0)
               : "memory");
}
// The mbarrier gets one arrival once every cp.async this thread issued before has landed; it
// does not raise the barrier's expected count (noinc), so its init count includes the lanes.
MOKGEN_DEV void cp_async_mbar_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_u32(bar))
               : "memory");
}

// ---------------------------------------------------------------- flags (inter-CTA / peer)
MOKGEN_DEV uint32_t ld_acquire_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
MOKGEN_DEV uint64_t ld_acquire_gpu(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
MOKGEN_DEV uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
MOKGEN_DEV uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
MOKGEN_DEV void st_release_gpu(uint32_t* p, uint32_t v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
MOKGEN_DEV void st_release_gpu(uint64_t* p, uint64_t v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
MOKGEN_DEV void st_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
MOKGEN_DEV void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// ---------------------------------------------------------------- warps, barriers, registers
// elect.sync: exactly one active lane of the (converged) warp returns true.
MOKGEN_DEV bool elect_one() {
  uint32_t pred;
  asm volatile(
      "{\n .reg .pred p;\n .reg .b32 r;\n"
      " elect.sync r|p, 0xffffffff;\n"
      " selp.u32 %0, 1, 0, p;\n}"
      : "=r"(pred));
  return pred != 0;
}
// Named barrier over `count` threads (multiple of 32); id 0 is __syncthreads' barrier, so
// callers use 1..15 to sync a subset (e.g. only the consumer warpgroups).
MOKGEN_DEV void named_bar_sync(uint32_t id, uint32_t count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}
MOKGEN_DEV void named_bar_arrive(uint32_t id, uint32_t count) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(count) : "memory");
}
// Register reallocation between warpgroups. Only honoured with a register cap at entry
// (__launch_bounds__(threads, 1)) and each role in one branch; ptxas warns (C7508) if not.
template <uint32_t N>
MOKGEN_DEV void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}
template <uint32_t N>
MOKGEN_DEV void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}

// ---------------------------------------------------------------- shared-memory matrices
// stmatrix (no CUDA C++ form): four 8 x 8 bf16 matrices of a warp, each lane's register i
// holding matrix i's row l / 4, columns 2 (l % 4), +1 (the mma accumulator layout), to the
// rows whose addresses lanes 8 i .. 8 i + 7 give (16 bytes each).
MOKGEN_DEV void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
               ::"r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}
MOKGEN_DEV uint4 lds_128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
  return v;
}

MOKGEN_DEV int warpgroup_idx() { return __shfl_sync(0xffffffff, (int)threadIdx.x / 128, 0); }

}  // namespace mokgen

// ---------------------------------------------------------------- debug-build checks
// With -DMOKGEN_DEBUG (env MOKGEN_DEBUG=1), index checks record the first failure in
// mokgen_check {code, a, b, block, failures} and skip the access instead of faulting, so the
// host can read what went wrong after the call (a fault would kill the context). Release
// builds compile the checks away.
extern "C" {
__device__ unsigned int mokgen_check[5];
}
namespace mokgen {
MOKGEN_DEV bool check_failed(unsigned code, int a, int b) {
  atomicAdd(&mokgen_check[4], 1u);
  if (atomicCAS(&mokgen_check[0], 0u, code) == 0u) {
    mokgen_check[1] = (unsigned)a;
    mokgen_check[2] = (unsigned)b;
    mokgen_check[3] = blockIdx.x;
  }
  return false;
}
}  // namespace mokgen
#ifdef MOKGEN_DEBUG
#define MOKGEN_OK(cond, code, a, b) ((cond) || mokgen::check_failed((code), (a), (b)))
#else
#define MOKGEN_OK(cond, code, a, b) true
#endif
