// mokgen/gemm_fp8.cuh -- the GEMM engine's e4m3 tiles (Task::op bit kF8): their producer and
// consumer mainloop, the scales applied as the fp32 partial sums are added up (gemm_tile.cuh
// says how the fp8 tiles fit the bf16 ones' geometry).
#pragma once
#include <cuda_bf16.h>

#include "mokgen/gemm_types.cuh"
#include "mokgen/tma.cuh"
#include "mokgen/wgmma.cuh"

namespace mokgen {

// ---------------------------------------------------------------- fp8 tiles
// B rows of the second 128-column half: the up rows (dual-B) or the next 128 rows.
MOKGEN_DEV int b_half1_row(const Task& t) { return t.b_row1 >= 0 ? t.b_row1 : t.b_row0 + 128; }

// Maps: A and B e4m3 boxes 128 (K) x 128 rows; sa: fp32 [K/Q, A rows], box 128 x 128/Q; sb
// (MX only): fp32 [K/32, B rows], box 128 x 4. NARROW (Problem::kNarrowTiles): a kHalfN task
// brings its first half only (and its scales).
template <class Cfg, bool NARROW = false>
MOKGEN_DEV void produce_tile_fp8(const GemmSmem<Cfg>& sm, PipeState& ps, const CUtensorMap* ta,
                                 const CUtensorMap* tb, const CUtensorMap* tsa,
                                 const CUtensorMap* tsb, const Task& t) {
  constexpr int KQ = Cfg::BK8 / Cfg::Q, HALF = 128 * Cfg::BK8;
  const bool narrow = NARROW && (t.op & kHalfN);
  const uint32_t bytes = Cfg::STAGE_BYTES + Cfg::SC_BYTES -
                         (narrow ? HALF + (Cfg::SB_BYTES > 0 ? 128 * KQ * 4 : 0) : 0);
  for (int kb = 0; kb < t.k_blocks; ++kb) {
    mbar_wait(&sm.empty()[ps.idx()], ps.phase() ^ 1, 102);
    uint64_t* bar = &sm.full()[ps.idx()];
    mbar_arrive_expect_tx(bar, bytes);
    const int k0 = kb * Cfg::BK8;
    tma_load_2d(sm.a_stage(ps.idx()), ta, bar, k0, t.a_row0);
    tma_load_2d(sm.b_stage(ps.idx()), tb, bar, k0, t.b_row0);
    if (!narrow) tma_load_2d(sm.b_stage(ps.idx()) + HALF, tb, bar, k0, b_half1_row(t));
    tma_load_2d(sm.sa_stage(ps.idx()), tsa, bar, t.a_row0, kb * KQ);
    if constexpr (Cfg::SB_BYTES > 0) {
      tma_load_2d(sm.sb_stage(ps.idx()), tsb, bar, t.b_row0, kb * KQ);
      if (!narrow)
        tma_load_2d(sm.sb_stage(ps.idx()) + 128 * KQ, tsb, bar, b_half1_row(t), kb * KQ);
    }
    ps.template advance<Cfg::STAGES>();
  }
}

// acc[i] += tmp[i] * (scale of i's row), i < 64: register i holds row r0, or r0 + 8 when
// (i / 2) is odd (wgmma.cuh).
MOKGEN_DEV void promote_rows(float* acc, const float* tmp, float s0, float s1) {
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = fmaf(tmp[i], (i >> 1) & 1 ? s1 : s0, acc[i]);
}

// Consumer warpgroup cwg (rows 64 cwg ..): acc[0, 128) its 64 x 256 block, acc[128, 192) the
// scratch. wsb: blockwise B scales, fp32 [B rows / 128, k_blocks] (unused for MX). Returns
// false when a stage never arrived (the caller records it and stops). NARROW: a kHalfN
// task's, its first half only (a separate instantiation: no register holds the choice).
template <class Cfg, bool NARROW = false>
MOKGEN_DEV bool consume_tile_fp8(const GemmSmem<Cfg>& sm, PipeState& ps, const Task& t,
                                 float (&acc)[Cfg::kAccRegs + Cfg::kScratch], int cwg,
                                 const float* wsb) {
  constexpr int kHalves = NARROW ? 1 : 2;
  static_assert(Cfg::kAccRegs == 128 && Cfg::kScratch == 64, "two 128-column halves");
  constexpr int Q = Cfg::Q, KQ = Cfg::BK8 / Q, STEPS = Q / 32, HALF = 128 * Cfg::BK8;
  float(&tmp)[64] = *reinterpret_cast<float(*)[64]>(&acc[128]);
  const bool lane0 = (threadIdx.x & 31) == 0;
  const int l = threadIdx.x & 31;
  const int r0 = 64 * cwg + 16 * ((threadIdx.x >> 5) & 3) + (l >> 2);  // rows r0, r0 + 8
  const float* sb0 = wsb + (size_t)(t.b_row0 / 128) * t.k_blocks;
  const float* sb1 = wsb + (size_t)(b_half1_row(t) / 128) * t.k_blocks;
  bool ok = true;
  if constexpr ((Cfg::PROF & kProfFp8NoPromote) != 0) {  // profiling: the wgmma stream alone,
    // accumulating straight into the accumulators (wrong results)
    int prev = -1;
    for (int kb = 0; kb < t.k_blocks; ++kb) {
      ok &= mbar_wait_lean(&sm.full()[ps.idx()], ps.phase());
      const uint64_t da = make_desc_kmajor_sw128(sm.a_stage(ps.idx()) + cwg * 64 * 128);
      wgmma_fence();
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint64_t db = make_desc_kmajor_sw128(sm.b_stage(ps.idx()) + h * HALF);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          WgmmaFp8<128>::mma(*reinterpret_cast<float(*)[64]>(&acc[64 * h]),
                             desc_advance_k16(da, kk), desc_advance_k16(db, kk), (kb | kk) != 0);
      }
      wgmma_commit();
      wgmma_wait<1>();
      if (prev >= 0) { __syncwarp(); if (lane0) mbar_arrive(&sm.empty()[prev]); }
      prev = (int)ps.idx();
      ps.template advance<Cfg::STAGES>();
    }
    wgmma_wait<0>();
    wgmma_fence_regs(acc);
    __syncwarp();
    if (lane0 && prev >= 0) mbar_arrive(&sm.empty()[prev]);
    return ok;
  }
  for (int kb = 0; kb < t.k_blocks; ++kb) {
    float wb[2] = {1.f, 1.f};
    if constexpr (Q == 128) { wb[0] = __ldg(sb0 + kb); if (!NARROW) wb[1] = __ldg(sb1 + kb); }
    ok &= mbar_wait_lean(&sm.full()[ps.idx()], ps.phase());
    const uint64_t da = make_desc_kmajor_sw128(sm.a_stage(ps.idx()) + cwg * 64 * 128);
    const float* sa = sm.sa_stage(ps.idx());
    // Q = 128: one pass of 4 K steps; MX: 4 passes of 1, not unrolled (no index into the
    // accumulators depends on the pass; unrolled, ptxas spilled)
#pragma unroll 1
    for (int s = 0; s < KQ; ++s) {
      const float a0 = sa[s * 128 + r0], a1 = sa[s * 128 + r0 + 8];
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
        const uint64_t db = make_desc_kmajor_sw128(sm.b_stage(ps.idx()) + h * HALF);
        wgmma_fence();
#pragma unroll
        for (int kk = s * STEPS; kk < (s + 1) * STEPS; ++kk)
          WgmmaFp8<128>::mma(tmp, desc_advance_k16(da, kk), desc_advance_k16(db, kk),
                             kk != s * STEPS);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_regs(tmp);
        if constexpr (Q == 128) {
          promote_rows(acc + 64 * h, tmp, a0 * wb[h], a1 * wb[h]);
        } else {  // B scales [half][step][128 columns]. tmp is only read: a value written
          // back into it would move the next wgmma's scratch to fresh registers
          const float* sb = sm.sb_stage(ps.idx()) + (h * KQ + s) * 128 + 2 * (l & 3);
#pragma unroll
          for (int g = 0; g < 16; ++g) {
            const float2 b = *reinterpret_cast<const float2*>(sb + 8 * g);
            float* a = acc + 64 * h + 4 * g;
            a[0] = fmaf(tmp[4 * g] * b.x, a0, a[0]);
            a[1] = fmaf(tmp[4 * g + 1] * b.y, a0, a[1]);
            a[2] = fmaf(tmp[4 * g + 2] * b.x, a1, a[2]);
            a[3] = fmaf(tmp[4 * g + 3] * b.y, a1, a[3]);
          }
        }
      }
    }
    __syncwarp();
    if (lane0) mbar_arrive(&sm.empty()[ps.idx()]);
    ps.template advance<Cfg::STAGES>();
  }
  return ok;
}

}  // namespace mokgen
