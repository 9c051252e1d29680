// mokgen/wgmma.cuh -- warpgroup MMA (sm_90a) wrappers: bf16 x bf16 and e4m3 x e4m3 -> fp32.
//
// Operand layouts in shared memory, all written by TMA with 128-byte swizzle:
// - K-major (the forward: activations [rows, K] and nn.Linear weights [out, K]): one
//   64-element (128 B) K slice per row; imm-trans = 0.
// - MN-major (the backward's transposed operands: W2 [D, I] read as [I x D]^T, activations
//   read as [features x rows]): 64-element MN chunks per 128 B row, one row per K index, so a
//   TMA box of 64 (MN) x 64 (K) rows is one 8 KB block; imm-trans = 1.
//
// Accumulator layout of wgmma.m64nNk16 (fp32), per thread of the warpgroup
// (w = warp in warpgroup 0..3, l = lane 0..31), for register index r in [0, N/2):
//     row(r) = 16*w + l/4 + 8*((r/2) % 2)
//     col(r) = 8*(r/4) + 2*(l%4) + (r%2)
// so (r, r+1) for even r are two adjacent columns of one row -> one bf16x2 store.
#pragma once
#include "mokgen/ptx.cuh"

namespace mokgen {

// Shared-memory matrix descriptor for a K-major bf16 tile with 128-byte swizzle.
// Rows are 128 B (64 bf16) apart; the swizzle atom is 8 rows = 1024 B, which is the stride
// between consecutive 8-row core-matrix groups (SBO). LBO is unused for swizzled K-major
// layouts (set to 1). The tile must start 1024-byte aligned so base_offset (bits 49-51) is 0.
// To step along K by 16 elements inside the 128 B row, add 32 B to the start address,
// i.e. add 2 to the descriptor (start address is encoded >> 4): see desc_advance_k16.
MOKGEN_DEV uint64_t make_desc_kmajor_sw128(const void* smem_tile) {
  const uint64_t addr = smem_u32(smem_tile);
  uint64_t d = 0;
  d |= (addr & 0x3FFFFull) >> 4;          // bits 0-13: start address >> 4
  d |= 1ull << 16;                         // bits 16-29: leading byte offset >> 4 (ignored)
  d |= (uint64_t)(1024 >> 4) << 32;        // bits 32-45: stride byte offset >> 4
  d |= 1ull << 62;                         // bits 62-63: 1 = 128B swizzle
  return d;
}
MOKGEN_DEV uint64_t desc_advance_k16(uint64_t desc, int k16_steps) {
  return desc + (uint64_t)(k16_steps * 2);  // 32 B per 16 bf16, in 16 B units
}

// MN-major bf16 tile, 128-byte swizzle (CUTLASS's canonical
// ((8,8,m),(8,k)) : ((1,8,LBO),(64,SBO)) in elements): a K row holds 64 MN elements (128 B),
// 8 K rows form the 1024 B swizzle atom, SBO = 1024 B steps 8 K rows, and LBO steps to the
// next 64-element MN chunk: the 8 KB TMA box (64 MN x 64 K) that follows. One k16 step is
// 16 K rows = 2048 B.
MOKGEN_DEV uint64_t make_desc_mnmajor_sw128(const void* smem_tile) {
  const uint64_t addr = smem_u32(smem_tile);
  uint64_t d = 0;
  d |= (addr & 0x3FFFFull) >> 4;
  d |= (uint64_t)(8192 >> 4) << 16;        // LBO: next 64-wide MN chunk (next TMA box)
  d |= (uint64_t)(1024 >> 4) << 32;        // SBO: next 8 K rows
  d |= 1ull << 62;
  return d;
}
MOKGEN_DEV uint64_t desc_advance_k16_mn(uint64_t desc, int k16_steps) {
  return desc + (uint64_t)(k16_steps * 128);  // 2048 B per 16 K rows, in 16 B units
}

// Orders prior register/smem accesses before the following wgmma reads them.
MOKGEN_DEV void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
MOKGEN_DEV void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Waits until at most N committed groups are still pending.
template <int N>
MOKGEN_DEV void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator reads/writes across an asynchronous wgmma.
template <int R>
MOKGEN_DEV void wgmma_fence_regs(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#define MOKGEN_F8(d, i)                                                                      \
  "+f"(d[i + 0]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]),         \
      "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define MOKGEN_F32(d, i) MOKGEN_F8(d, i), MOKGEN_F8(d, i + 8), MOKGEN_F8(d, i + 16), MOKGEN_F8(d, i + 24)

// D[64 x N] (+)= A[64 x 16] * B[N x 16]^T. scale_d = 0 overwrites D (first K step of a
// tile, which saves zeroing 128 registers), 1 accumulates. TA / TB: the operand is MN-major
// (imm-trans = 1; the instruction takes them as immediates, hence template parameters).
template <int N>
struct Wgmma;

template <>
struct Wgmma<128> {
  static constexpr int kRegs = 64;
  template <int TA = 0, int TB = 0>
  static MOKGEN_DEV void mma(float (&d)[64], uint64_t da, uint64_t db, int scale_d) {
    asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, p, 1, 1, %67, %68;\n}"
      : MOKGEN_F32(d, 0), MOKGEN_F32(d, 32)
      : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));
  }
};

template <>
struct Wgmma<192> {  // the whole-task ping-pong experiment's 128 x 192 tiles (gemm_test.cu)
  static constexpr int kRegs = 96;
  template <int TA = 0, int TB = 0>
  static MOKGEN_DEV void mma(float (&d)[96], uint64_t da, uint64_t db, int scale_d) {
    asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %98, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
      "}, %96, %97, p, 1, 1, %99, %100;\n}"
      : MOKGEN_F32(d, 0), MOKGEN_F32(d, 32), MOKGEN_F32(d, 64)
      : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));
  }
};

template <>
struct Wgmma<256> {
  static constexpr int kRegs = 128;
  template <int TA = 0, int TB = 0>
  static MOKGEN_DEV void mma(float (&d)[128], uint64_t da, uint64_t db, int scale_d) {
    asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, p, 1, 1, %131, %132;\n}"
      : MOKGEN_F32(d, 0), MOKGEN_F32(d, 32), MOKGEN_F32(d, 64), MOKGEN_F32(d, 96)
      : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));
  }
};

// fp8: D[64 x N] (+)= A[64 x 32] * B[N x 32]^T, e4m3 x e4m3 -> fp32. Hopper's fp8 wgmma
// takes K-major operands only (no imm-trans), 32 K elements = 32 bytes per step: the same +2
// descriptor step as bf16's k16 (desc_advance_k16).
template <int N>
struct WgmmaFp8;

template <>
struct WgmmaFp8<128> {
  static constexpr int kRegs = 64;
  static MOKGEN_DEV void mma(float (&d)[64], uint64_t da, uint64_t db, int scale_d) {
    asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, p, 1, 1;\n}"
      : MOKGEN_F32(d, 0), MOKGEN_F32(d, 32)
      : "l"(da), "l"(db), "r"(scale_d));
  }
};

#undef MOKGEN_F32
#undef MOKGEN_F8

}  // namespace mokgen
