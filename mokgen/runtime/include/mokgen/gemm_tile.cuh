// mokgen/gemm_tile.cuh -- warp-specialized TMA + wgmma GEMM tile engine for the megakernel.
//
// CTA shape: 384 threads = 3 warpgroups.
//   warpgroup 0: producer. One elected thread pops tasks from the scheduler (Problem),
//                publishes them on the smem task channel, and streams A/B K-slices into the
//                smem ring with TMA. The other 127 threads exit right away. setmaxnreg.dec.
//   warpgroups 1,2: consumers. Each owns 64 rows of the BM=128 tile (cwg = 0/1) and issues
//                m64nBNk16 wgmma over the whole BN; then runs the epilogue. setmaxnreg.inc.
// Tile op: C[BM x BN] = A[a_row0 : a_row0+BM, 0:K] * B[b_row0 : b_row0+BN, 0:K]^T, A and B
// K-contiguous (nn.Linear weights). Dual-B (fused SwiGLU): B tile = BN/2 gate rows from b_row0
// stacked on BN/2 up rows from b_row1, so each thread holds gate and up accumulators of the
// same output column (see for_each_dual_pair).
// Transposed operands (the backward; Task::op bits kBMN / kAMN, only for Problems that set
// kMNOperands): an MN-major B is read from a row-major [K, N] tensor at columns b_row0.. and
// rows b_row1 + k (dgrad: W2 [D, I] as B of dy * W2); an MN-major A (weight gradients: both
// operands are activations [rows, features]) at columns a_row0.. and the same rows b_row1 + k.
//
// Pipeline state (ring slot + mbarrier phase) lives in registers of the producer thread and of
// every consumer thread and PERSISTS across tiles: the megakernel runs many tiles per CTA and
// the ring never drains between them, so the producer prefetches tile n+1 while consumers do
// tile n's epilogue.
#pragma once
#include "mokgen/ptx.cuh"
#include "mokgen/tma.cuh"
#include "mokgen/wgmma.cuh"

namespace mokgen {

// A unit of work. Kept to 8 ints (32 B) so a channel slot is two 16 B smem accesses.
struct Task {
  int op;        // < 0: stop (no more work for this CTA); >= 0: user opcode (picks maps/epilogue)
  int a_row0;    // first A row (TMA zero-fills rows past the tensor end)
  int b_row0;    // first B row (expert e: e * rows_per_expert + n offset)
  int b_row1;    // dual-B only: first row of the second B half (up proj.); -1 = single B
  int c_row0;    // output row origin, for the epilogue
  int c_col0;    // output column origin, for the epilogue
  int m_valid;   // rows of this tile that exist (<= BM); the epilogue never sees the others
  int k_blocks;  // ceil(K / 64); TMA zero-fills a K tail
};
static_assert(sizeof(Task) == 32, "Task is 32 bytes");

MOKGEN_DEV Task stop_task() { return Task{-1, 0, 0, -1, 0, 0, 0, 0}; }

// Operand layout bits of Task::op; the low byte is the Problem's own opcode.
enum : int { kOpcodeMask = 0xff, kBMN = 1 << 8, kAMN = 1 << 9 };
MOKGEN_DEV int opcode(const Task& t) { return t.op & kOpcodeMask; }

// Slot index + parity of a ring of S mbarrier-guarded slots.
struct PipeState {
  uint32_t idx = 0;
  uint32_t phase = 0;
  template <int S>
  MOKGEN_DEV void advance() {
    if (++idx == S) { idx = 0; phase ^= 1; }
  }
};

template <int BN_, int STAGES_, int TASK_SLOTS_ = 4>
struct GemmCfg {
  static constexpr int BM = 128, BK = 64, BN = BN_;
  static constexpr int STAGES = STAGES_, TASK_SLOTS = TASK_SLOTS_;
  static constexpr int kThreads = 384;
  static constexpr int kConsumerWarps = 8;
  static constexpr int kAccRegs = BN / 2;  // fp32 accumulators per consumer thread
  static constexpr int A_BYTES = BM * BK * 2;
  static constexpr int B_BYTES = BN * BK * 2;
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
  static constexpr int BAR_BYTES = 8 * (2 * STAGES + 2 * TASK_SLOTS);
  // 1024 B of slack: the 128B-swizzle atom must be 1024-aligned and the dynamic smem base is
  // not guaranteed to be.
  static constexpr int SMEM_BYTES = 1024 + STAGES * STAGE_BYTES + BAR_BYTES + 32 * TASK_SLOTS;
  static constexpr int kProducerRegs = 40, kConsumerRegs = 232;
  static_assert(BN == 128 || BN == 256, "wgmma wrappers exist for N = 128, 256");
  static_assert(STAGE_BYTES % 1024 == 0, "stages keep 1024 B alignment");
  static_assert(kProducerRegs * 128 + kConsumerRegs * 256 <= 65536, "register file");
};

// Pointers carved out of dynamic shared memory. Ring stage s: A at stage(s), B right after.
template <class Cfg>
struct GemmSmem {
  uint8_t* ring;
  uint64_t* full;        // [STAGES] TMA bytes landed (count 1 + tx)
  uint64_t* empty;       // [STAGES] consumers done reading (count = consumer warps)
  uint64_t* task_full;   // [TASK_SLOTS] task published (count 1)
  uint64_t* task_empty;  // [TASK_SLOTS] task read by all consumer warps
  Task* tasks;           // [TASK_SLOTS]

  MOKGEN_DEV uint8_t* a_stage(int s) const { return ring + s * Cfg::STAGE_BYTES; }
  MOKGEN_DEV uint8_t* b_stage(int s) const { return ring + s * Cfg::STAGE_BYTES + Cfg::A_BYTES; }

  static MOKGEN_DEV GemmSmem carve(uint8_t* dyn) {
    GemmSmem m;
    const uint32_t base = smem_u32(dyn);
    m.ring = dyn + (((base + 1023u) & ~1023u) - base);
    uint8_t* p = m.ring + Cfg::STAGES * Cfg::STAGE_BYTES;
    m.full = reinterpret_cast<uint64_t*>(p);
    m.empty = m.full + Cfg::STAGES;
    m.task_full = m.empty + Cfg::STAGES;
    m.task_empty = m.task_full + Cfg::TASK_SLOTS;
    m.tasks = reinterpret_cast<Task*>(m.task_empty + Cfg::TASK_SLOTS);
    return m;
  }
  // One thread; the caller then __syncthreads() before the role split.
  MOKGEN_DEV void init() const {
    for (int s = 0; s < Cfg::STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], Cfg::kConsumerWarps);
    }
    for (int s = 0; s < Cfg::TASK_SLOTS; ++s) {
      mbar_init(&task_full[s], 1);
      mbar_init(&task_empty[s], Cfg::kConsumerWarps);
    }
    fence_mbarrier_init();
  }
};

// ---------------------------------------------------------------- task channel
// Single producer thread -> all consumer threads. The producer may run TASK_SLOTS tasks
// ahead. Slot writes are plain smem stores ordered by the arrive's release semantics.
template <class Cfg>
MOKGEN_DEV void task_push(const GemmSmem<Cfg>& sm, PipeState& ts, const Task& t) {
  mbar_wait(&sm.task_empty[ts.idx], ts.phase ^ 1, 100);
  sm.tasks[ts.idx] = t;
  mbar_arrive(&sm.task_full[ts.idx]);
  ts.template advance<Cfg::TASK_SLOTS>();
}
// Called by every consumer thread (whole warps): one arrive per warp frees the slot.
template <class Cfg>
MOKGEN_DEV Task task_pop(const GemmSmem<Cfg>& sm, PipeState& ts) {
  mbar_wait(&sm.task_full[ts.idx], ts.phase, 101);
  const Task t = sm.tasks[ts.idx];
  __syncwarp();
  if ((threadIdx.x & 31) == 0) mbar_arrive(&sm.task_empty[ts.idx]);
  ts.template advance<Cfg::TASK_SLOTS>();
  return t;
}

// ---------------------------------------------------------------- producer
// Streams the K-slices of one tile. Tensor map boxes: A = 64 x BM; B = 64 x BN (single) or
// 64 x BN/2 (dual). Wait on `empty` with the flipped parity: a fresh barrier counts as
// having completed the phase before phase 0, so the first STAGES waits pass at once.
template <class Cfg>
MOKGEN_DEV void produce_tile(const GemmSmem<Cfg>& sm, PipeState& ps, const CUtensorMap* ta,
                             const CUtensorMap* tb, const Task& t) {
  // MN-major operands arrive as 64 x 64 boxes, 8 KB each, stacked along MN (wgmma.cuh)
  constexpr int kBox = 64 * 64 * 2;
  const bool amn = t.op & kAMN, bmn = t.op & kBMN;
  for (int kb = 0; kb < t.k_blocks; ++kb) {
    mbar_wait(&sm.empty[ps.idx], ps.phase ^ 1, 102);
    uint64_t* bar = &sm.full[ps.idx];
    mbar_arrive_expect_tx(bar, Cfg::STAGE_BYTES);
    const int k0 = kb * Cfg::BK;
    if (amn) {
      for (int j = 0; j < Cfg::BM / 64; ++j)
        tma_load_2d(sm.a_stage(ps.idx) + j * kBox, ta, bar, t.a_row0 + 64 * j, t.b_row1 + k0);
    } else {
      tma_load_2d(sm.a_stage(ps.idx), ta, bar, k0, t.a_row0);
    }
    if (bmn) {
      for (int j = 0; j < Cfg::BN / 64; ++j)
        tma_load_2d(sm.b_stage(ps.idx) + j * kBox, tb, bar, t.b_row0 + 64 * j, t.b_row1 + k0);
    } else {
      tma_load_2d(sm.b_stage(ps.idx), tb, bar, k0, t.b_row0);
      if (t.b_row1 >= 0)  // dual-B: second half (up rows) right below the first
        tma_load_2d(sm.b_stage(ps.idx) + (Cfg::BN / 2) * 128, tb, bar, k0, t.b_row1);
    }
    ps.template advance<Cfg::STAGES>();
  }
}

// ---------------------------------------------------------------- consumer mainloop
// One consumer warpgroup (cwg = 0/1 -> tile rows 64*cwg ..) accumulates its 64 x BN block.
// One wgmma group stays in flight: after committing K-slice kb we wait for slice kb-1 and
// only then hand its stage back, so the tensor core never idles on the release handshake.
// TA / TB: A / B MN-major (see wgmma.cuh for the two descriptor forms).
template <class Cfg, int TA = 0, int TB = 0>
MOKGEN_DEV void consume_tile(const GemmSmem<Cfg>& sm, PipeState& ps, const Task& t,
                             float (&acc)[Cfg::kAccRegs], int cwg) {
  using Mma = Wgmma<Cfg::BN>;
  const bool lane0 = (threadIdx.x & 31) == 0;
  if (t.k_blocks <= 0) {
#pragma unroll
    for (int i = 0; i < Cfg::kAccRegs; ++i) acc[i] = 0.f;
    return;
  }
  int prev = -1;
  wgmma_fence_regs(acc);
  for (int kb = 0; kb < t.k_blocks; ++kb) {
    mbar_wait(&sm.full[ps.idx], ps.phase, 103);
    // a warpgroup's 64 A rows are 8 KB in either layout
    const uint8_t* a = sm.a_stage(ps.idx) + cwg * 64 * 128;
    const uint64_t da = TA ? make_desc_mnmajor_sw128(a) : make_desc_kmajor_sw128(a);
    const uint64_t db = TB ? make_desc_mnmajor_sw128(sm.b_stage(ps.idx))
                           : make_desc_kmajor_sw128(sm.b_stage(ps.idx));
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Cfg::BK / 16; ++kk)
      Mma::template mma<TA, TB>(acc, TA ? desc_advance_k16_mn(da, kk) : desc_advance_k16(da, kk),
                                TB ? desc_advance_k16_mn(db, kk) : desc_advance_k16(db, kk),
                                (kb | kk) != 0);
    wgmma_commit();
    wgmma_wait<1>();
    if (prev >= 0) {
      __syncwarp();
      if (lane0) mbar_arrive(&sm.empty[prev]);
    }
    prev = (int)ps.idx;
    ps.template advance<Cfg::STAGES>();
  }
  wgmma_wait<0>();
  wgmma_fence_regs(acc);
  __syncwarp();
  if (lane0) mbar_arrive(&sm.empty[prev]);
}

// ---------------------------------------------------------------- epilogue walkers
// Accumulator layout (see wgmma.cuh): thread (warp w in its warpgroup, lane l) holds for
// even r: row = 64*cwg + 16*w + l/4 + 8*((r/2)%2), cols c = 8*(r/4) + 2*(l%4) and c+1.
// f(row_in_tile, col_in_tile, v_c, v_c1) is called once per pair with row < m_valid only.
template <int BN, class F>
MOKGEN_DEV void for_each_acc_pair(const float (&acc)[BN / 2], int cwg, int m_valid, F&& f) {
  const int w = (threadIdx.x >> 5) & 3, l = threadIdx.x & 31;
  const int row_base = 64 * cwg + 16 * w + (l >> 2);
#pragma unroll
  for (int r = 0; r < BN / 2; r += 2) {
    const int row = row_base + 8 * ((r >> 1) & 1);
    const int col = 8 * (r >> 2) + 2 * (l & 3);
    if (row < m_valid) f(row, col, acc[r], acc[r + 1]);
  }
}
// Dual-B: accumulator columns [0, BN/2) are gate, [BN/2, BN) are up, and register r + BN/4
// holds column col(r) + BN/2, i.e. the same output column. f(row, col, g0, g1, u0, u1) with
// col in [0, BN/2).
template <int BN, class F>
MOKGEN_DEV void for_each_dual_pair(const float (&acc)[BN / 2], int cwg, int m_valid, F&& f) {
  const int w = (threadIdx.x >> 5) & 3, l = threadIdx.x & 31;
  const int row_base = 64 * cwg + 16 * w + (l >> 2);
#pragma unroll
  for (int r = 0; r < BN / 4; r += 2) {
    const int row = row_base + 8 * ((r >> 1) & 1);
    const int col = 8 * (r >> 2) + 2 * (l & 3);
    if (row < m_valid) f(row, col, acc[r], acc[r + 1], acc[r + BN / 4], acc[r + 1 + BN / 4]);
  }
}

// __fdividef: IEEE division compiles to a called slow-path subroutine per element; the fast
// form is exact enough for bf16 outputs and gives 0 for very negative x (huge denominator).
MOKGEN_DEV float silu(float x) { return __fdividef(x, 1.f + __expf(-x)); }

// Tile rasterization inside one [m_blocks x n_blocks] grid: groups of `group` m-blocks walk
// n with m fastest, so CTAs working at the same time share B (weight) panels in L2 and the
// A panels of a group stay resident while n advances.
MOKGEN_DEV void raster_grouped(int t, int m_blocks, int n_blocks, int group, int& mb, int& nb) {
  const int per_group = group * n_blocks;
  const int g = t / per_group;
  const int r = t - g * per_group;
  const int gs = min(group, m_blocks - g * group);
  mb = g * group + r % gs;
  nb = r / gs;
}

// ---------------------------------------------------------------- persistent driver
// Problem must provide (device):
//   static constexpr bool kMNOperands;         // tasks may set kAMN / kBMN
//   void prefetch() const;                     // producer thread: tma_prefetch_desc(...)
//   Task next_task();                          // producer thread: next task or stop_task()
//   const CUtensorMap* map_a(const Task&) const; const CUtensorMap* map_b(const Task&) const;
//   void epilogue(const Task&, float (&acc)[Cfg::kAccRegs], int cwg);   // consumer threads
// Must be called by all 384 threads with the kernel's dynamic smem (>= Cfg::SMEM_BYTES) and
// the kernel declared __launch_bounds__(384, 1) so setmaxnreg takes effect.
template <class Cfg, class Problem>
MOKGEN_DEV void gemm_persistent(Problem& prob, uint8_t* dyn_smem) {
  const GemmSmem<Cfg> sm = GemmSmem<Cfg>::carve(dyn_smem);
  if (threadIdx.x == 0) sm.init();
  __syncthreads();
  const int wg = warpgroup_idx();
  if (wg == 0) {
    setmaxnreg_dec<Cfg::kProducerRegs>();
    if (threadIdx.x < 32 && elect_one()) {
      prob.prefetch();
      PipeState ps, ts;
      for (;;) {
        const Task t = prob.next_task();
        task_push<Cfg>(sm, ts, t);
        if (t.op < 0) break;
        produce_tile<Cfg>(sm, ps, prob.map_a(t), prob.map_b(t), t);
      }
    }
  } else {
    setmaxnreg_inc<Cfg::kConsumerRegs>();
    PipeState ps, ts;
    for (;;) {
      // Zeroed per tile although the first wgmma overwrites it (scale_d = 0): "+f" operands of
      // an uninitialized array read the previous tile's registers in PTX, which keeps all
      // accumulators live through the epilogue and made ptxas spill them. 128 MOVs per tile.
      float acc[Cfg::kAccRegs];
#pragma unroll
      for (int i = 0; i < Cfg::kAccRegs; ++i) acc[i] = 0.f;
      const Task t = task_pop<Cfg>(sm, ts);
      if (t.op < 0) break;
      if constexpr (Problem::kMNOperands) {  // three mainloops; only the backward has them
        if (t.op & kAMN) consume_tile<Cfg, 1, 1>(sm, ps, t, acc, wg - 1);
        else if (t.op & kBMN) consume_tile<Cfg, 0, 1>(sm, ps, t, acc, wg - 1);
        else consume_tile<Cfg>(sm, ps, t, acc, wg - 1);
      } else {
        consume_tile<Cfg>(sm, ps, t, acc, wg - 1);
      }
      prob.epilogue(t, acc, wg - 1);
    }
  }
}

}  // namespace mokgen
