// Standalone persistent test kernels for the gemm_tile engine (built to a cubin, driven by
// tests/test_gpu_backward.py). One CTA per SM; tiles come from a global atomic counter, the
// same way the megakernel's compute CTAs will take work.
//   gemm_plain     : C[M,N] = A[M,K] B[N,K]^T, bf16 out.
//   gemm_plain_t   : the same with transposed (MN-major) operands: B given as [K,N]
//                    (trans=1) or A as [K,M] and B as [K,N] (trans=2), as the backward uses.
//                    N need not be a multiple of BN: the last tile is an edge tile (its B
//                    columns past N zero-filled by TMA, its columns past N not stored); one
//                    with at most BN/2 columns runs narrow (kHalfN, gemm_epilogue.cuh half_bit).
//   gemm_swiglu    : grouped: rows [off[e], off[e+1]) of X[M,D] times expert e's stacked
//                    w13[e] = [gate I rows; up I rows] -> H[M,I] = silu(X Wg^T) * (X Wu^T).
//   gemm_down      : grouped: H[M,I] times w2[e][D,I]^T, times a per-row fp32 scale -> Y[M,D].
// Then two experiments beside the engine's schedules: cluster pairs and whole-task ping-pong.
#include <cuda_bf16.h>
#include "mokgen/cluster.cuh"
#include "mokgen/gemm_tile.cuh"

using namespace mokgen;
using CoopCfg = GemmCfg<256, 4>;  // BM=128, BN=256, 4 x 48 KB stages
// The megakernels' CTA pairs (GemmCfg PAIR: its mailbox beside the task slots), asserted here
// with the experiments' configurations below
static_assert(GemmCfg<256, 4, 0, 0, 4, 0, true>::SMEM_BYTES == 197976,
              "mokgen/compiler/lower.py smem_bytes() mirrors it (tests/test_decisions.py)");
#ifndef GROUP_M
#define GROUP_M 16  // as fast as 8, faster than 4
#endif
constexpr int kGroupM = GROUP_M;  // m-blocks per raster group

__device__ __forceinline__ void store_bf16x2(__nv_bfloat16* p, float a, float b) {
#ifdef MOKGEN_TEST_NO_STORE  // timing experiment only: epilogue math without the traffic
  if (a != 12345.f) return;
#endif
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}

// ------------------------------------------------------------------ plain
template <class Cfg>
struct PlainProblem {
  static constexpr bool kMNOperands = true;
  static constexpr bool kNarrowTiles = true;  // N is a runtime value: an edge tile may be narrow
  static constexpr int kQ = 0;
  const CUtensorMap* ta;
  const CUtensorMap* tb;
  __nv_bfloat16* C;
  int M, N, ldc, k_blocks, m_blocks, n_blocks;
  int* counter;
  int trans = 0;  // 0: both K-major; 1: B MN-major; 2: A and B MN-major

  __device__ void prefetch() const { tma_prefetch_desc(ta); tma_prefetch_desc(tb); }
  __device__ const CUtensorMap* map_a(const Task&) const { return ta; }
  __device__ const CUtensorMap* map_b(const Task&) const { return tb; }
  __device__ Task next_task() {
    const int t = atomicAdd(counter, 1);
    if (t >= m_blocks * n_blocks) return stop_task();
    int mb, nb;
    raster_grouped(t, m_blocks, n_blocks, kGroupM, mb, nb);
    const int r0 = mb * Cfg::BM;
    // an edge tile with at most BN/2 columns left runs narrow (half_bit, for a runtime N)
    const int op = (trans == 2 ? (kAMN | kBMN) : trans == 1 ? kBMN : 0) |
                   (N - nb * Cfg::BN <= Cfg::BN / 2 ? kHalfN : 0);
    // MN-major B: columns nb*BN.. of [K, N] from row 0 (b_row1 is the K origin)
    return Task{op, r0, nb * Cfg::BN, trans ? 0 : -1, r0, nb * Cfg::BN, min(Cfg::BM, M - r0),
                k_blocks};
  }
  __device__ void epilogue(const Task& t, float (&acc)[Cfg::kAccRegs], int cwg) {
    __nv_bfloat16* base = C + (size_t)t.c_row0 * ldc + t.c_col0;
    const int ld = ldc;
    for_each_acc_pair<Cfg::BN>(acc, cwg, t.m_valid, [&](int r, int c, float v0, float v1) {
      store_bf16x2(base + (size_t)r * ld + c, v0, v1);
    }, min(Cfg::BN, N - t.c_col0));
  }
  __device__ void signal(const Task&) const {}  // nothing waits on a tile here
};

template <class Cfg>
__device__ void plain(uint8_t* smem, const CUtensorMap& tmA, const CUtensorMap& tmB,
                      __nv_bfloat16* C, int M, int N, int K, int ldc, int* counter, int trans) {
  PlainProblem<Cfg> p{&tmA, &tmB, C, M, N, ldc, (K + 63) / 64, (M + Cfg::BM - 1) / Cfg::BM,
                      ceil_div(N, Cfg::BN), counter, trans};
  gemm_persistent<Cfg>(p, smem);
}

#define MOKGEN_PLAIN(name, Cfg)                                                                \
  extern "C" __global__ void __launch_bounds__(384, 1)                                        \
  name(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB,     \
       __nv_bfloat16* C, int M, int N, int K, int ldc, int* counter) {                       \
    extern __shared__ __align__(1024) uint8_t smem[];                                         \
    plain<Cfg>(smem, tmA, tmB, C, M, N, K, ldc, counter, 0);                                  \
  }
MOKGEN_PLAIN(gemm_plain, CoopCfg)

// tmA: [M,K] box 64x128 (trans 0, 1) or [K,M] box 64x64 (trans 2); tmB: [K,N] box 64x64.
#define MOKGEN_PLAIN_T(name, Cfg)                                                              \
  extern "C" __global__ void __launch_bounds__(384, 1)                                        \
  name(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB,     \
       __nv_bfloat16* C, int M, int N, int K, int ldc, int* counter, int trans) {            \
    extern __shared__ __align__(1024) uint8_t smem[];                                         \
    plain<Cfg>(smem, tmA, tmB, C, M, N, K, ldc, counter, trans);                              \
  }
MOKGEN_PLAIN_T(gemm_plain_t, CoopCfg)

// ------------------------------------------------------------------ grouped (experts)
// seg_off[E+1]: expert e owns rows [seg_off[e], seg_off[e+1]) of A (any sizes; multiples of
// BM in the benchmark). Tiles are numbered expert by expert, then rasterized inside.
template <class Cfg>
struct GroupedProblem {
  static constexpr bool kMNOperands = false;
  static constexpr bool kNarrowTiles = false;
  static constexpr int kQ = 0;
  const CUtensorMap* ta;
  const CUtensorMap* tb;
  const int* seg_off;
  int num_experts, n_blocks, k_blocks;
  int b_rows_per_expert;  // row stride between experts in stacked B
  int dual_off;           // dual-B: row offset of the up block (I); 0 = single B
  int total_tiles;
  int* counter;
  __nv_bfloat16* out;
  int ldo;
  const float* row_scale;  // down projection only

  __device__ void prefetch() const { tma_prefetch_desc(ta); tma_prefetch_desc(tb); }
  __device__ const CUtensorMap* map_a(const Task&) const { return ta; }
  __device__ const CUtensorMap* map_b(const Task&) const { return tb; }
  __device__ Task next_task() {
    int t = atomicAdd(counter, 1);
    if (t >= total_tiles) return stop_task();
    int e = 0, lo = 0, hi = 0, mbe = 0;
    for (; e < num_experts; ++e) {
      lo = __ldg(seg_off + e);
      hi = __ldg(seg_off + e + 1);
      mbe = (hi - lo + Cfg::BM - 1) / Cfg::BM;
      if (t < mbe * n_blocks) break;
      t -= mbe * n_blocks;
    }
    int mb, nb;
    raster_grouped(t, mbe, n_blocks, kGroupM, mb, nb);
    const int r0 = lo + mb * Cfg::BM;
    const int bn = dual_off ? Cfg::BN / 2 : Cfg::BN;  // output columns per tile
    const int b0 = e * b_rows_per_expert + nb * bn;
    return Task{e, r0, b0, dual_off ? b0 + dual_off : -1, r0, nb * bn, min(Cfg::BM, hi - r0),
                k_blocks};
  }
  __device__ void epilogue(const Task& t, float (&acc)[Cfg::kAccRegs], int cwg) {
    __nv_bfloat16* base = out + (size_t)t.c_row0 * ldo + t.c_col0;
    const int ld = ldo;
    if (dual_off) {
      for_each_dual_pair<Cfg::BN>(acc, cwg, t.m_valid,
                                  [&](int r, int c, float g0, float g1, float u0, float u1) {
                                    store_bf16x2(base + (size_t)r * ld + c, silu(g0) * u0,
                                                 silu(g1) * u1);
                                  });
    } else {
      const float* sc = row_scale + t.c_row0;
      for_each_acc_pair<Cfg::BN>(acc, cwg, t.m_valid, [&](int r, int c, float v0, float v1) {
        const float s = __ldg(sc + r);
        store_bf16x2(base + (size_t)r * ld + c, s * v0, s * v1);
      });
    }
  }
  __device__ void signal(const Task&) const {}
};

// X[M,D] (tmX box 64x128), w13[E*2I, D] (tmW box 64x128, two boxes per stage) -> H[M,I].
#define MOKGEN_SWIGLU(name, Cfg)                                                               \
  extern "C" __global__ void __launch_bounds__(384, 1)                                        \
  name(const __grid_constant__ CUtensorMap tmX, const __grid_constant__ CUtensorMap tmW,     \
       const int* seg_off, int num_experts, int D, int I, __nv_bfloat16* H, int total_tiles, \
       int* counter) {                                                                        \
    extern __shared__ __align__(1024) uint8_t smem[];                                         \
    GroupedProblem<Cfg> p{&tmX, &tmW, seg_off, num_experts, I / (Cfg::BN / 2), (D + 63) / 64, \
                          2 * I, I, total_tiles, counter, H, I, nullptr};                     \
    gemm_persistent<Cfg>(p, smem);                                                            \
  }
MOKGEN_SWIGLU(gemm_swiglu, CoopCfg)

// H[M,I] (tmH box 64x128), w2[E*D, I] (tmW box 64x256) -> Y[M,D] = scale[row] * (H w2^T).
#define MOKGEN_DOWN(name, Cfg)                                                                 \
  extern "C" __global__ void __launch_bounds__(384, 1)                                        \
  name(const __grid_constant__ CUtensorMap tmH, const __grid_constant__ CUtensorMap tmW,     \
       const int* seg_off, int num_experts, int I, int D, const float* row_scale,            \
       __nv_bfloat16* Y, int total_tiles, int* counter) {                                     \
    extern __shared__ __align__(1024) uint8_t smem[];                                         \
    GroupedProblem<Cfg> p{&tmH, &tmW, seg_off, num_experts, D / Cfg::BN, (I + 63) / 64, D, 0, \
                          total_tiles, counter, Y, D, row_scale};                             \
    gemm_persistent<Cfg>(p, smem);                                                            \
  }
MOKGEN_DOWN(gemm_down, CoopCfg)

// ------------------------------------------------------------------ cluster pairs (experiment)
// Whether sharing B between two CTAs pays (cluster.cuh): the two CTAs of a cluster run
// vertically adjacent tiles (m-blocks 2 pm and 2 pm + 1) of the same n-block, from a static
// pair schedule (pair cluster id + i * clusters, grouped raster over pairs). MC: each CTA
// loads its own A and half of B (rows 128 rank ..) multicast to both, so a stage is free
// only once both CTAs' consumer warps released it (the empty barrier counts 16, arrived
// locally and remotely). Without MC: the same schedule and cluster, each CTA loading all of
// its B (the control). K-major A and B, M a multiple of 256, N of BN, K of 64; the engine's
// mainloop (gemm_tile.cuh consume_tile) but for the release.
template <class Cfg, bool MC>
__device__ void plain_pair(uint8_t* dyn, const CUtensorMap* ta, const CUtensorMap* tb,
                           __nv_bfloat16* C, int M, int N, int K) {
  const GemmSmem<Cfg> sm = GemmSmem<Cfg>::carve(dyn);
  const uint32_t rank = cluster_ctarank();
  const int cid = (int)cluster_id_x(), ncl = (int)nclusters_x();
  const int m_blocks = M / Cfg::BM, n_blocks = N / Cfg::BN, k_blocks = K / 64;
  const int pairs = m_blocks / 2 * n_blocks;
  if (threadIdx.x == 0) {
    sm.init_stages(1, (MC ? 2 : 1) * Cfg::kConsumerWarps);
    fence_mbarrier_init();
  }
  cluster_sync();  // the peer's barriers exist before anything lands in or arrives on them
  const int wg = warpgroup_idx();
  if (wg == 0) {
    setmaxnreg_dec<Cfg::kProducerRegs>();
    if (threadIdx.x == 0) {
      tma_prefetch_desc(ta);
      tma_prefetch_desc(tb);
      PipeState ps;
      for (int p = cid; p < pairs; p += ncl) {
        int pm, nb;
        raster_grouped(p, m_blocks / 2, n_blocks, kGroupM / 2, pm, nb);
        const int r0 = (2 * pm + (int)rank) * Cfg::BM;
        for (int kb = 0; kb < k_blocks; ++kb) {
          mbar_wait(&sm.empty()[ps.idx()], ps.phase() ^ 1, 102);
          uint64_t* bar = &sm.full()[ps.idx()];
          mbar_arrive_expect_tx(bar, Cfg::STAGE_BYTES);
          tma_load_2d(sm.a_stage(ps.idx()), ta, bar, kb * 64, r0);
          if constexpr (MC)
            tma_load_2d_multicast(sm.b_stage(ps.idx()) + rank * (Cfg::BN / 2) * 128, tb, bar,
                                  kb * 64, nb * Cfg::BN + (int)rank * (Cfg::BN / 2), 0x3);
          else
            tma_load_2d(sm.b_stage(ps.idx()), tb, bar, kb * 64, nb * Cfg::BN);
          ps.template advance<Cfg::STAGES>();
        }
      }
    }
  } else {
    setmaxnreg_inc<Cfg::kConsumerRegs>();
    using Mma = Wgmma<Cfg::BN>;
    const int cwg = wg - 1;
    const bool lane0 = (threadIdx.x & 31) == 0;
    PipeState ps;
    // a stage is free once both CTAs' consumer warps released it (MC: local and remote)
    const auto release = [&](int stage) {
      __syncwarp();
      if (!lane0) return;
      if constexpr (MC) {
        mbar_arrive_cluster(&sm.empty()[stage], 0);
        mbar_arrive_cluster(&sm.empty()[stage], 1);
      } else {
        mbar_arrive(&sm.empty()[stage]);
      }
    };
    for (int p = cid; p < pairs; p += ncl) {
      int pm, nb;
      raster_grouped(p, m_blocks / 2, n_blocks, kGroupM / 2, pm, nb);
      const int r0 = (2 * pm + (int)rank) * Cfg::BM;
      ConsumerAcc<Cfg> acc;
      float(&d)[Mma::kRegs] = *reinterpret_cast<float(*)[Mma::kRegs]>(&acc.r[0]);
      int prev = -1;
      wgmma_fence_regs(acc.main());
      for (int kb = 0; kb < k_blocks; ++kb) {
        mbar_wait_lean(&sm.full()[ps.idx()], ps.phase());
        const uint64_t da = make_desc_kmajor_sw128(sm.a_stage(ps.idx()) + cwg * 64 * 128);
        const uint64_t db = make_desc_kmajor_sw128(sm.b_stage(ps.idx()));
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < Cfg::BK / 16; ++kk)
          Mma::template mma<0, 0>(d, desc_advance_k16(da, kk), desc_advance_k16(db, kk),
                                  (kb | kk) != 0);
        wgmma_commit();
        wgmma_wait<1>();
        if (prev >= 0) release(prev);
        prev = (int)ps.idx();
        ps.template advance<Cfg::STAGES>();
      }
      wgmma_wait<0>();
      wgmma_fence_regs(acc.main());
      release(prev);
      __nv_bfloat16* base = C + (size_t)r0 * N + nb * Cfg::BN;
      for_each_acc_pair<Cfg::BN>(acc.main(), cwg, Cfg::BM,
                                 [&](int r, int c, float v0, float v1) {
                                   store_bf16x2(base + (size_t)r * N + c, v0, v1);
                                 });
    }
  }
  __syncwarp();
  cluster_sync();  // no CTA leaves while its peer may still multicast into it
}

// tmA: [M,K] box 64x128; tmB: [N,K] box 64x128 (MC: half of BN) or 64x256.
#define MOKGEN_PLAIN_PAIR(name, MC)                                                            \
  extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(384, 1)              \
  name(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB,     \
       __nv_bfloat16* C, int M, int N, int K) {                                              \
    extern __shared__ __align__(1024) uint8_t smem[];                                         \
    plain_pair<CoopCfg, MC>(smem, &tmA, &tmB, C, M, N, K);                                    \
  }
MOKGEN_PLAIN_PAIR(gemm_plain_pair, false)
MOKGEN_PLAIN_PAIR(gemm_plain_mc, true)

// ------------------------------------------------------------- whole-task ping-pong (experiment)
// Whether an epilogue can hide behind the other warpgroup's MMA. Each consumer warpgroup
// runs every other task of its CTA end to end: a 128 x TN task, two m64nTN chains a k16 step
// into 2 x TN/2 accumulators (TN = 128: the cooperative tile's 128 a thread; 192: 192), its
// slices streamed once (a stage is 16 KB of A and TN x 128 B of B, 6 or 5 stages), the
// mainloop turns handed over by named barriers (kBarTurn + h: warpgroup h may run its
// mainloop; the other arrives once its own last wgmma is issued, so the next chain queues
// behind this one's tail), so warpgroup h's epilogue of task i runs under warpgroup h ^ 1's
// mainloop of task i + 1. A static schedule (task blockIdx.x + i gridDim.x, grouped raster),
// M a multiple of 128, N of TN, K of 64.
// TR 0: K-major A [M, K] (box 64 x 128) and B [N, K] (box 64 x TN); TR 2: A as [K, M] and B
// as [K, N], both MN-major (the weight gradients' layout; boxes 64 x 64, 2 and TN / 64 a
// slice). TN = 192 (5 stages of 40 KB) is QuACK's sm_90 ping-pong tile (quack gemm_sm90.py:
// a warpgroup owns a whole 128 x 192 tile, 192 accumulators a thread): operand bytes a MAC
// 11% above the cooperative 128 x 256 tile's, where 128 x 128 is 33% above.
// ST = 4 (pt4): the megakernels' ring depth (4 stages) at the 128 x 128 task.
template <int TN, int ST = TN == 128 ? 6 : 5>
using PtCfg = GemmCfg<TN, ST>;
static_assert(PtCfg<128>::SMEM_BYTES == 197928 && PtCfg<192>::SMEM_BYTES == 206104 &&
                  PtCfg<128, 4>::SMEM_BYTES == 132360,
              "mokgen/compiler/lower.py smem_bytes() sizes the launches alike (tests/test_decisions.py)");

constexpr uint32_t kBarTurn = 2;  // + h: 2 and 3 (gemm_types.cuh leaves them to experiments)

// Ring state n slices ahead: past the other warpgroup's task.
template <int S>
__device__ void advance_by(PipeState& ps, int n) {
  const uint32_t i = ps.idx() + (uint32_t)n, wraps = i / S;
  ps.bits = ((ps.bits & 0x80000000u) ^ ((wraps & 1u) << 31)) | (i - wraps * S);
}

// One K slice of a 128-row task from one warpgroup: rows 0..63 of the stage's A into d0,
// 64..127 into d1 (8 KB apart in either layout), against all of its B.
template <class Mma, int BK, int TA, int TB>
__device__ void mma_slice_two_chains(float (&d0)[Mma::kRegs], float (&d1)[Mma::kRegs],
                                     const uint8_t* a, const uint8_t* b, bool accumulate) {
  const uint64_t da0 = TA ? make_desc_mnmajor_sw128(a) : make_desc_kmajor_sw128(a);
  const uint64_t da1 = TA ? make_desc_mnmajor_sw128(a + 64 * 128)
                          : make_desc_kmajor_sw128(a + 64 * 128);
  const uint64_t db = TB ? make_desc_mnmajor_sw128(b) : make_desc_kmajor_sw128(b);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < BK / 16; ++kk) {
    const uint64_t dbk = TB ? desc_advance_k16_mn(db, kk) : desc_advance_k16(db, kk);
    const int scale_d = accumulate || kk != 0;
    Mma::template mma<TA, TB>(d0, TA ? desc_advance_k16_mn(da0, kk) : desc_advance_k16(da0, kk),
                              dbk, scale_d);
    Mma::template mma<TA, TB>(d1, TA ? desc_advance_k16_mn(da1, kk) : desc_advance_k16(da1, kk),
                              dbk, scale_d);
  }
  wgmma_commit();
}

// The mainloop of a 128-row task run by one consumer warpgroup: k_blocks (> 0) slices into
// two m64 chains (mma_slice_two_chains), one wgmma group in flight as in the engine's
// consume_tile, each warp freeing each stage; hand_over: the named barrier the other
// warpgroup waits on for its turn, arrived on once the last wgmma is issued.
template <class Cfg, class Mma, int TA, int TB>
__device__ void consume_two_chains(const GemmSmem<Cfg>& sm, PipeState& ps, int k_blocks,
                                   float (&d0)[Mma::kRegs], float (&d1)[Mma::kRegs],
                                   uint32_t hand_over) {
  const bool lane0 = (threadIdx.x & 31) == 0;
  const auto release = [&](int stage) {
    __syncwarp();
    if (lane0) mbar_arrive(&sm.empty()[stage]);
  };
  int prev = -1;
  wgmma_fence_regs(d0);
  wgmma_fence_regs(d1);
  for (int kb = 0; kb < k_blocks; ++kb) {
    mbar_wait_lean(&sm.full()[ps.idx()], ps.phase());
    mma_slice_two_chains<Mma, Cfg::BK, TA, TB>(d0, d1, sm.a_stage(ps.idx()),
                                               sm.b_stage(ps.idx()), kb != 0);
    wgmma_wait<1>();
    if (prev >= 0) release(prev);
    prev = (int)ps.idx();
    ps.template advance<Cfg::STAGES>();
  }
  named_bar_arrive(hand_over, 256);
  wgmma_wait<0>();
  wgmma_fence_regs(d0);
  wgmma_fence_regs(d1);
  release(prev);
}

template <int TR, int TN, int ST>
__device__ void plain_pt(uint8_t* dyn, const CUtensorMap* ta, const CUtensorMap* tb,
                         __nv_bfloat16* C, int M, int N, int K) {
  using Cfg = PtCfg<TN, ST>;
  using Mma = Wgmma<TN>;
  constexpr int TA = TR == 2, TB = TR == 2, kBox = 64 * 64 * 2;
  const GemmSmem<Cfg> sm = GemmSmem<Cfg>::carve(dyn);
  const int m_blocks = M / 128, n_blocks = N / TN, kbn = K / 64, tiles = m_blocks * n_blocks;
  const int mine = (int)blockIdx.x < tiles ? (tiles - 1 - (int)blockIdx.x) / (int)gridDim.x + 1
                                           : 0;
  if (threadIdx.x == 0) {
    sm.init_stages(1, 4);  // the one warpgroup whose task the stage holds
    fence_mbarrier_init();
  }
  __syncthreads();
  const int wg = warpgroup_idx();
  if (wg == 0) {
    setmaxnreg_dec<Cfg::kProducerRegs>();
    if (threadIdx.x == 0) {
      tma_prefetch_desc(ta);
      tma_prefetch_desc(tb);
      PipeState ps;
      for (int i = 0; i < mine; ++i) {
        int mb, nb;
        raster_grouped((int)blockIdx.x + i * (int)gridDim.x, m_blocks, n_blocks, kGroupM, mb, nb);
        for (int kb = 0; kb < kbn; ++kb) {
          mbar_wait(&sm.empty()[ps.idx()], ps.phase() ^ 1, 102);
          uint64_t* bar = &sm.full()[ps.idx()];
          mbar_arrive_expect_tx(bar, Cfg::STAGE_BYTES);
          if constexpr (TR == 2) {
            for (int j = 0; j < 2; ++j)
              tma_load_2d(sm.a_stage(ps.idx()) + j * kBox, ta, bar, mb * 128 + 64 * j, kb * 64);
            for (int j = 0; j < TN / 64; ++j)
              tma_load_2d(sm.b_stage(ps.idx()) + j * kBox, tb, bar, nb * TN + 64 * j, kb * 64);
          } else {
            tma_load_2d(sm.a_stage(ps.idx()), ta, bar, kb * 64, mb * 128);
            tma_load_2d(sm.b_stage(ps.idx()), tb, bar, kb * 64, nb * TN);
          }
          ps.template advance<Cfg::STAGES>();
        }
      }
    }
  } else {
    setmaxnreg_inc<Cfg::kConsumerRegs>();
    const int h = wg - 1;
    PipeState ps;
    if (h == 1) {
      named_bar_arrive(kBarTurn, 256);  // warpgroup 0 runs the first mainloop
      advance_by<Cfg::STAGES>(ps, kbn);  // past task 0's slices
    }
    for (int i = h; i < mine; i += 2) {
      int mb, nb;
      raster_grouped((int)blockIdx.x + i * (int)gridDim.x, m_blocks, n_blocks, kGroupM, mb, nb);
      float acc[2][TN / 2];
#pragma unroll
      for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int r = 0; r < TN / 2; ++r) acc[c][r] = 0.f;
      named_bar_sync(kBarTurn + h, 256);
      // the other's mainloop queues behind ours (hand-over once our last wgmma is issued)
      consume_two_chains<Cfg, Mma, TA, TB>(sm, ps, kbn, acc[0], acc[1], kBarTurn + (h ^ 1));
      advance_by<Cfg::STAGES>(ps, kbn);  // past the other's next task
      __nv_bfloat16* base = C + (size_t)mb * 128 * N + nb * TN;
#pragma unroll
      for (int c = 0; c < 2; ++c)
        for_each_acc_pair<TN>(acc[c], c, 128, [&](int r, int col, float v0, float v1) {
          store_bf16x2(base + (size_t)r * N + col, v0, v1);
        });
    }
    // the last hand-over is taken by the warpgroup that did not run the last task (with no
    // task, warpgroup 1's first one)
    const int last = mine > 0 ? (mine - 1) & 1 : 1;
    if (h != last) named_bar_sync(kBarTurn + h, 256);
  }
}

#define MOKGEN_PLAIN_PT(name, TR, TN, ST)                                                      \
  extern "C" __global__ void __launch_bounds__(384, 1)                                        \
  name(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB,     \
       __nv_bfloat16* C, int M, int N, int K) {                                              \
    extern __shared__ __align__(1024) uint8_t smem[];                                         \
    plain_pt<TR, TN, ST>(smem, &tmA, &tmB, C, M, N, K);                                       \
  }
MOKGEN_PLAIN_PT(gemm_plain_pt, 0, 128, 6)
MOKGEN_PLAIN_PT(gemm_plain_t2_pt, 2, 128, 6)
MOKGEN_PLAIN_PT(gemm_plain_pt4, 0, 128, 4)
MOKGEN_PLAIN_PT(gemm_plain_t2_pt4, 2, 128, 4)
MOKGEN_PLAIN_PT(gemm_plain_pt192, 0, 192, 5)
MOKGEN_PLAIN_PT(gemm_plain_t2_pt192, 2, 192, 5)
