// mokgen/gemm_tile.cuh -- warp-specialized TMA + wgmma GEMM tile engine for the megakernel.
//
// CTA shape: 384 threads = 3 warpgroups.
//   warpgroup 0: producer. One elected thread pops tasks from the scheduler (Problem),
//                publishes them on the smem task channel, and streams A/B K-slices into the
//                smem ring with TMA. The other threads exit right away. setmaxnreg.dec.
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
// fp8 tiles (Task::op bit kF8, only for Problems with kQ > 0; the shared expert stays bf16 in
// the same kernel) have the bf16 tiles' geometry, 128 x 256 with each consumer warpgroup
// owning 64 rows, so the epilogues and the schedule are shared. Operands are e4m3, K-major,
// 128-element K slices (the same 16 KB A / 32 KB B stage as a bf16 64-element slice). A
// warpgroup runs its two 128-column halves (B rows b_row0.. and b_half1_row: gate and up
// for dual-B) one after the other through a 64-register scratch accumulator, then adds the
// scratch into its 128 fp32 accumulators times the scales: once per slice for Q = 128
// (blockwise fp8: A scale per row, B scale per 128 x 128 weight block, read from global
// memory), once per 32-wide K step for Q = 32 (MXFP8: A scale per row and step, B scale per
// column and step), the A (and MX B) scales brought into shared memory by TMA with the slice.
// The scratch is the tail of one 192-register accumulator array: as a separate array, ptxas
// moved the accumulators around it and spilled.
//
// Pipeline state (ring slot + mbarrier phase) lives in registers of the producer thread and of
// every consumer thread and PERSISTS across tiles: the megakernel runs many tiles per CTA and
// the ring never drains between them, so the producer prefetches tile n+1 while consumers do
// tile n's epilogue.
//
// The consumers are cooperative: both warpgroups run every K-slice of a tile at once, then
// both run the epilogue, so the tensor core idles during each epilogue while the producer
// keeps the ring filling for the next tile.
#pragma once
#include <cuda_bf16.h>

#include "mokgen/cluster.cuh"
#include "mokgen/gemm_epilogue.cuh"
#include "mokgen/gemm_fp8.cuh"
#include "mokgen/gemm_types.cuh"
#include "mokgen/ptx.cuh"
#include "mokgen/tma.cuh"
#include "mokgen/trace.cuh"
#include "mokgen/wgmma.cuh"

namespace mokgen {

// ---------------------------------------------------------------- task channel
// The thread that takes tasks (the scheduler, or the producer) -> the producer (with a
// scheduler) and all consumer threads. The consumers keep the current task's slot until its
// epilogue is done: the next TASK_SLOTS - 1 may be pushed meanwhile. Slot writes are
// plain smem stores ordered by the arrive's release semantics.
template <class Cfg>
MOKGEN_DEV void task_push(const GemmSmem<Cfg>& sm, PipeState& ts, const Task& t) {
  mbar_wait(&sm.task_empty()[ts.idx()], ts.phase() ^ 1, 100);
  sm.tasks()[ts.idx()] = t;
  mbar_arrive(&sm.task_full()[ts.idx()]);
  ts.template advance<Cfg::TASK_SLOTS>();
}
// Called by every consumer thread (whole warps). The task stays in its slot until
// task_release (after the epilogue): read from shared memory where used, its fields need
// no registers across the mainloop (the fp8 one has none to spare), and the producer still
// runs TASK_SLOTS - 1 tasks ahead. A task that never comes is recorded and read as stop
// (consumer code never traps: mbar_wait_lean); nullptr then.
template <class Cfg>
MOKGEN_DEV const Task* task_pop(const GemmSmem<Cfg>& sm, const PipeState& ts) {
  if (!mbar_wait_lean(&sm.task_full()[ts.idx()], ts.phase())) {
    record_timeout(101, ts.phase());
    return nullptr;
  }
  return &sm.tasks()[ts.idx()];
}
// One arrive per warp frees the slot.
template <class Cfg>
MOKGEN_DEV void task_release(const GemmSmem<Cfg>& sm, PipeState& ts) {
  __syncwarp();
  if ((threadIdx.x & 31) == 0) mbar_arrive(&sm.task_empty()[ts.idx()]);
  ts.template advance<Cfg::TASK_SLOTS>();
}

// ---------------------------------------------------------------- producer
// Streams the K-slices of one tile. Tensor map boxes: A = 64 x BM; B = 64 x BN (single) or
// 64 x BN/2 (dual). Wait on `empty` with the flipped parity: a fresh barrier counts as
// having completed the phase before phase 0, so the first STAGES waits pass at once.
// NARROW (Problem::kNarrowTiles): a kHalfN task's MN-major B brings only the boxes of its first
// BN/2 columns, the ones its mainloop reads (a K-major B box is BN rows: loaded whole).
// One K-slice's TMA loads of A (an MN-major A: its BM / 64 boxes) and of B (an MN-major B:
// its first b_boxes boxes; dual-B: the up rows right below the gate rows), for stage `bar`.
// produce_tile and produce_tile_gather share them.
template <class Cfg>
MOKGEN_DEV void load_a_slice(uint8_t* stage, const CUtensorMap* ta, uint64_t* bar, const Task& t,
                             int k0, bool amn) {
  constexpr int kBox = 64 * 64 * 2;
  if (amn) {
    for (int j = 0; j < Cfg::BM / 64; ++j)
      tma_load_2d(stage + j * kBox, ta, bar, t.a_row0 + 64 * j, t.b_row1 + k0);
  } else {
    tma_load_2d(stage, ta, bar, k0, t.a_row0);
  }
}
// WRAP: an MN-major B's K rows from b_k (t.b_row1 in a window of b_wrap rows, 0: none;
// produce_tile WRAP).
template <class Cfg, bool WRAP = false>
MOKGEN_DEV void load_b_slice(uint8_t* stage, const CUtensorMap* tb, uint64_t* bar, const Task& t,
                             int k0, bool bmn, int b_boxes, int b_k = 0, int b_wrap = 0) {
  constexpr int kBox = 64 * 64 * 2;
  if (bmn) {
    int bk = t.b_row1 + k0;
    if constexpr (WRAP) {
      bk = b_k + k0;
      bk -= b_wrap && bk >= b_wrap ? b_wrap : 0;
    }
    for (int j = 0; j < b_boxes; ++j)
      tma_load_2d(stage + j * kBox, tb, bar, t.b_row0 + 64 * j, bk);
  } else {
    tma_load_2d(stage, tb, bar, k0, t.b_row0);
    if (t.b_row1 >= 0)  // dual-B: second half (up rows) right below the first
      tma_load_2d(stage + (Cfg::BN / 2) * 128, tb, bar, k0, t.b_row1);
  }
}

// The producing thread (trace builds): its i-th task's fill sums into the record, cleared.
MOKGEN_DEV void trace_fill_record(int i) {
  unsigned long long* sums = trace_sums();
  if (unsigned long long* rec = trace_rec(i)) {
    rec[kTrFillWait] = sums[kSumFillWait];
    rec[kTrFillIssue] = sums[kSumFillIssue];
  }
  sums[kSumFillWait] = sums[kSumFillIssue] = 0;
}
// Trace builds (trace.cuh kTrFillWait / kTrFillIssue): the producing thread's clocks of a
// slice (`mine`: the one thread that records), t0 its empty wait's start, the wait's end
// (trace_fill moves t0 there) and its last issue.
MOKGEN_DEV void trace_fill(uint64_t& t0, bool mine) {
  const uint64_t now = trace_clock();
  if (mine) trace_sums()[kSumFillWait] += now - t0;
  t0 = now;
}
MOKGEN_DEV void trace_issued(uint64_t t0, bool mine) {
  if (mine) trace_sums()[kSumFillIssue] += trace_clock() - t0;
}

// WRAP (Problem::kWrapB): an MN-major B's K rows lie in a window ring of b_wrap rows (0: not
// this task's), a multiple of the slice, so a slice never straddles its wrap.
template <class Cfg, bool NARROW = false, bool WRAP = false>
MOKGEN_DEV void produce_tile(const GemmSmem<Cfg>& sm, PipeState& ps, const CUtensorMap* ta,
                             const CUtensorMap* tb, const Task& t, int b_wrap = 0) {
  // MN-major operands arrive as 64 x 64 boxes, 8 KB each, stacked along MN (wgmma.cuh)
  constexpr int kBox = 64 * 64 * 2;
  const bool amn = t.op & kAMN, bmn = t.op & kBMN;
  const bool narrow = NARROW && bmn && (t.op & kHalfN);
  const int b_boxes = narrow ? Cfg::BN / 128 : Cfg::BN / 64;
  const uint32_t bytes = Cfg::STAGE_BYTES - (narrow ? (Cfg::BN / 64 - b_boxes) * kBox : 0);
  int b_k = 0;  // WRAP: the window row of B's first K row
  if constexpr (WRAP) b_k = b_wrap ? t.b_row1 % b_wrap : t.b_row1;
  for (int kb = 0; kb < t.k_blocks; ++kb) {
    uint64_t t0 = 0;
    if constexpr (Cfg::TRACE) t0 = trace_clock();
    mbar_wait(&sm.empty()[ps.idx()], ps.phase() ^ 1, 102);
    if constexpr (Cfg::TRACE) trace_fill(t0, true);
    uint64_t* bar = &sm.full()[ps.idx()];
    mbar_arrive_expect_tx(bar, bytes);
    const int k0 = kb * Cfg::BK;
    load_a_slice<Cfg>(sm.a_stage(ps.idx()), ta, bar, t, k0, amn);
    load_b_slice<Cfg, WRAP>(sm.b_stage(ps.idx()), tb, bar, t, k0, bmn, b_boxes, b_k, b_wrap);
    if constexpr (Cfg::TRACE) trace_issued(t0, true);
    ps.template advance<Cfg::STAGES>();
  }
}

// ---------------------------------------------------------------- gathered operands
// An operand whose rows are named by index instead of lying in a tensor (Problem::kGather:
// one rank holding every expert reads x and dy where the caller left them, instead of the
// copies a dispatch would make into the ring; docs/design.md). The rows are token rows of a
// [rows, ld] bf16 tensor; which token a ring-layout row p holds is the schedule's table
// (p -> (src rank, src route), route / topk the token, rank < 0 padding: zeros). The
// producer warpgroup's warps bring them with 16-byte cp.async into the 128B-swizzled places
// TMA would have put them (chunk c of smem row r at c ^ (r & 7)), so the consumers are
// unchanged but for a proxy fence (consume_tile: wgmma reads what ordinary cp.async wrote).
// Each lane's cp.async.mbarrier.arrive completes the stage together with the other operand's
// TMA bytes. Two shapes: a K-major A tile (128 rows, a 64-column K slice each: the forward's
// gate/up, the backward's dgrad and replay) and an MN-major operand gathered along K (64 rows
// a slice, 64-column boxes along MN: the weight gradients' dy and x).

// What a task gathers: rows of `base` (nullptr: nothing, both operands come by TMA), as its A
// operand or (b) its MN-major B. LD (row length = stride, elements) and K (routes a token)
// are the Problem's constants (kGatherLd, kGatherTopk): registers are the producer's
// scarcest resource (56 a thread beside the consumers' 224).
struct GatherSrc {
  const __nv_bfloat16* base = nullptr;
  const int2* table = nullptr;
  int rows = 0;    // tokens: a table entry past them reads as padding
  bool b = false;  // the B operand (MN-major), else A
  bool in_order = false;  // profiling (kProfGatherInOrder, a constant): row p is token p % rows
};

// The token ring-layout row p holds, or -1 (padding, or a table entry past the tokens).
template <int K>
MOKGEN_DEV int gather_token(const GatherSrc& g, int p) {
  if (g.in_order) return p % g.rows;
  const int2 e = g.table[p];
  const int tok = e.x >= 0 ? e.y / K : -1;
  return (unsigned)tok < (unsigned)g.rows ? tok : -1;
}

// The producer warpgroup's four warps gather: each brings a quarter of every slice's rows.
// One warp alone issues a slice's 32-64 cp.async instructions with their shuffles and
// addresses too slowly for the tensor core (the layer at half speed).
constexpr int kGatherWarps = 4;
static_assert(kGatherWarps * 32 == 128 && kGatherWarps * 16 == 64,
              "a warp's share: 32 rows of a K-major A tile, 16 of an MN-major slice");

// K-major A slice: tile rows 0..127 at columns k0 .. k0 + 63; warp w the rows 32 w .. 32 w + 31.
// tok: the token of row 32 w + l for lane l, read once a task by produce_tile_gather (read here
// every slice, the table load would sit at the head of each slice's copies; the gain is within
// noise, kept as one load less a slice); lanes 8 s .. 8 s + 7 bring one row's 128 contiguous bytes
// (an instruction: four rows), the row's token shuffled from the lane that holds it.
template <int LD>
MOKGEN_DEV void gather_k_major(uint8_t* stage, const GatherSrc& g, int tok, int k0, int w) {
  const int lane = threadIdx.x & 31, c = lane & 7, sub = lane >> 3;
  const int col = k0 + 8 * c;
  const bool col_ok = col < LD;  // a K tail: zeros, as TMA's
  const uint32_t base = smem_u32(stage) + (32 * w + sub) * 128;
#pragma unroll 4
  for (int il = 0; il < 8; ++il) {
    const int row = 32 * w + 4 * il + sub;
    const int t = __shfl_sync(0xffffffffu, tok, 4 * il + sub);
    const bool ok = col_ok && t >= 0;
    cp_async_16(base + 4 * il * 128 + ((c ^ (row & 7)) << 4),
                g.base + (ok ? (size_t)t * LD + col : 0), ok);
  }
}

// MN-major slice: K rows p0 .. p0 + 63 (ring-layout rows), columns col0 .. col0 + 64 boxes
// - 1, as `boxes` (2 or 4) 64 x 64 boxes of 8 KB; warp w the rows 16 w .. 16 w + 15. 8 boxes
// lanes bring one row's contiguous 128 boxes bytes.
template <int LD, int K>
MOKGEN_DEV void gather_mn_major(uint8_t* stage, const GatherSrc& g, int p0, int col0,
                                int boxes, int w) {
  const int lane = threadIdx.x & 31, per_row = 8 * boxes;
  const int q = lane % per_row, sub = lane / per_row, c = q & 7;
  const int col = col0 + 8 * q;  // box q / 8, chunk c
  const bool col_ok = col < LD;  // an edge tile's columns past the width: zeros
  const uint32_t base = smem_u32(stage) + (q >> 3) * (64 * 128);
  const int tok = gather_token<K>(g, p0 + 16 * w + (lane & 15));
#pragma unroll 4
  for (int r = sub; r < 16; r += 4 / boxes) {
    const int row = 16 * w + r;
    const int t = __shfl_sync(0xffffffffu, tok, r);
    const bool ok = col_ok && t >= 0;
    cp_async_16(base + row * 128 + ((c ^ (row & 7)) << 4),
                g.base + (ok ? (size_t)t * LD + col : 0), ok);
  }
}

// Nothing is held across the slices but the slice count, the ring state and a K-major
// gathered A's token (one register a lane): the task is read again from its shared-memory
// slot (the producer rewrites that slot only after this task: task_push), the GatherSrc asked
// of the Problem (its pointers are kernel parameters), so the producer warps fit their 56
// registers beside the Problem's schedule state.
template <class Cfg, class Problem>
MOKGEN_DEV void produce_tile_gather(const Problem& prob, const GemmSmem<Cfg>& sm, PipeState& ps,
                                    const volatile Task* slot) {
  constexpr int kBox = 64 * 64 * 2, LD = Problem::kGatherLd, K = Problem::kGatherTopk;
  const bool lead = threadIdx.x == 0;
  const int w = threadIdx.x >> 5;  // this warp's share of the gathered rows
  const int k_blocks = slot->k_blocks;
  const auto read_task = [&] {
    return Task{slot->op, slot->a_row0, slot->b_row0, slot->b_row1, slot->c_row0,
                slot->c_col0, slot->m_valid, k_blocks};
  };
  int tok_a = -1;  // a K-major gathered A: this lane's row's token, the same every slice
  {
    const Task t = read_task();
    if (prob.gathers(t) && !prob.gather(t).b && !(t.op & kAMN))
      tok_a = gather_token<K>(prob.gather(t), t.c_row0 + 32 * w + (threadIdx.x & 31));
  }
  for (int kb = 0; kb < k_blocks; ++kb) {
    const Task t = read_task();
    const bool amn = t.op & kAMN, bmn = t.op & kBMN;
    const bool narrow = Problem::kNarrowTiles && bmn && (t.op & kHalfN);
    const int b_boxes = narrow ? Cfg::BN / 128 : Cfg::BN / 64;
    const bool gat = prob.gathers(t), gat_b = gat && prob.gather(t).b, gat_a = gat && !gat_b;
    uint64_t t0 = 0;
    if constexpr (Cfg::TRACE) t0 = trace_clock();
    if constexpr ((Cfg::PROF & kProfGatherOneWaiter) != 0) {  // profiling: one poller a warp
      if ((threadIdx.x & 31) == 0) mbar_wait(&sm.empty()[ps.idx()], ps.phase() ^ 1, 102);
      __syncwarp();
    } else {
      mbar_wait(&sm.empty()[ps.idx()], ps.phase() ^ 1, 102);
    }
    if constexpr (Cfg::TRACE) trace_fill(t0, lead);
    uint64_t* bar = &sm.full()[ps.idx()];
    const int k0 = kb * Cfg::BK;
    if (lead) {  // the operand that is not gathered comes by TMA
      const CUtensorMap *ta = prob.map_a(t), *tb = prob.map_b(t);
      mbar_arrive_expect_tx(bar, (gat_a ? 0 : Cfg::A_BYTES) + (gat_b ? 0 : b_boxes * kBox));
      if (!gat_a) load_a_slice<Cfg>(sm.a_stage(ps.idx()), ta, bar, t, k0, amn);
      if (!gat_b) load_b_slice<Cfg>(sm.b_stage(ps.idx()), tb, bar, t, k0, bmn, b_boxes);
    }
    __syncwarp();
    if (gat_a) {
      if (amn)
        gather_mn_major<LD, K>(sm.a_stage(ps.idx()), prob.gather(t), t.b_row1 + k0, t.a_row0,
                               Cfg::BM / 64, w);
      else
        gather_k_major<LD>(sm.a_stage(ps.idx()), prob.gather(t), tok_a, k0, w);
    }
    if (gat_b)
      gather_mn_major<LD, K>(sm.b_stage(ps.idx()), prob.gather(t), t.b_row1 + k0, t.b_row0,
                             b_boxes, w);
    cp_async_mbar_arrive(bar);
    if constexpr (Cfg::TRACE) trace_issued(t0, lead);
    ps.template advance<Cfg::STAGES>();
  }
}

// ---------------------------------------------------------------- consumer mainloop
// One consumer warp (its lane 0) is done reading ring stage `stage`. PAIR: it frees the
// stage in both CTAs of the pair, so neither producer fills a stage (its own, or the peer's
// half by multicast) that a consumer of either CTA still reads (produce_pairs).
template <class Cfg>
MOKGEN_DEV void free_stage(const GemmSmem<Cfg>& sm, int stage) {
  mbar_arrive(&sm.empty()[stage]);
  if constexpr (Cfg::PAIR) mbar_arrive_cluster(&sm.empty()[stage], cluster_ctarank() ^ 1);
}

// One consumer warpgroup (cwg = 0/1 -> tile rows 64*cwg ..) accumulates its 64 x BN block.
// One wgmma group stays in flight: after committing K-slice kb we wait for slice kb-1 and
// only then hand its stage back, so the tensor core never idles on the release handshake.
// TA / TB: A / B MN-major (see wgmma.cuh for the two descriptor forms). Returns false when
// a stage never arrived (the caller records it and stops).
// NARROW: a kHalfN task's mainloop, N = BN/2 into the first half of the accumulators.
// gathered: an operand of the stage was written by cp.async (produce_tile_gather), ordinary
// writes that the wgmma's async proxy reads only after a proxy fence.
template <class Cfg, int TA = 0, int TB = 0, bool NARROW = false>
MOKGEN_DEV bool consume_tile(const GemmSmem<Cfg>& sm, PipeState& ps, const Task& t,
                             float (&acc)[Cfg::kAccRegs], int cwg, bool gathered = false) {
  using Mma = Wgmma<NARROW ? Cfg::BN / 2 : Cfg::BN>;
  float(&d)[Mma::kRegs] = *reinterpret_cast<float(*)[Mma::kRegs]>(&acc[0]);
  const bool lane0 = (threadIdx.x & 31) == 0;
  if (t.k_blocks <= 0) {
#pragma unroll
    for (int i = 0; i < Cfg::kAccRegs; ++i) acc[i] = 0.f;
    return true;
  }
  int prev = -1;
  bool ok = true;
  wgmma_fence_regs(acc);
  for (int kb = 0; kb < t.k_blocks; ++kb) {
    uint64_t t0 = 0;
    if constexpr (Cfg::TRACE) t0 = trace_clock();
    ok &= mbar_wait_lean(&sm.full()[ps.idx()], ps.phase());
    if constexpr (Cfg::TRACE)  // trace.cuh kTrFullWait
      if (threadIdx.x == 128) trace_sums()[kSumFullWait] += trace_clock() - t0;
    if ((Cfg::PROF & kProfGatherNoFence) == 0 && gathered) fence_proxy_async_smem();
    // a warpgroup's 64 A rows are 8 KB in either layout
    const uint8_t* a = sm.a_stage(ps.idx()) + cwg * 64 * 128;
    const uint64_t da = TA ? make_desc_mnmajor_sw128(a) : make_desc_kmajor_sw128(a);
    const uint64_t db = TB ? make_desc_mnmajor_sw128(sm.b_stage(ps.idx()))
                           : make_desc_kmajor_sw128(sm.b_stage(ps.idx()));
    wgmma_fence();
    if constexpr ((Cfg::PROF & kProfNoMma) == 0) {
#pragma unroll
      for (int kk = 0; kk < Cfg::BK / 16; ++kk)
        Mma::template mma<TA, TB>(d, TA ? desc_advance_k16_mn(da, kk) : desc_advance_k16(da, kk),
                                  TB ? desc_advance_k16_mn(db, kk) : desc_advance_k16(db, kk),
                                  (kb | kk) != 0);
    }
    wgmma_commit();
    wgmma_wait<1>();
    if (prev >= 0) {
      __syncwarp();
      if (lane0) free_stage<Cfg>(sm, prev);
    }
    prev = (int)ps.idx();
    ps.template advance<Cfg::STAGES>();
  }
  wgmma_wait<0>();
  wgmma_fence_regs(acc);
  __syncwarp();
  if (lane0) free_stage<Cfg>(sm, prev);
  return ok;
}

// A pad task's slices (GemmCfg::PAIR, kPairPad): each waited for and freed, nothing read.
template <class Cfg>
MOKGEN_DEV bool consume_pad(const GemmSmem<Cfg>& sm, PipeState& ps, int k_blocks) {
  bool ok = true;
  for (int kb = 0; kb < k_blocks; ++kb) {
    ok &= mbar_wait_lean(&sm.full()[ps.idx()], ps.phase());
    __syncwarp();
    if ((threadIdx.x & 31) == 0) free_stage<Cfg>(sm, ps.idx());
    ps.template advance<Cfg::STAGES>();
  }
  return ok;
}

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

// Whether Problem gathers operand rows (its kGather; Problems without one do not).
template <class P, class = void>
struct GatherTrait { static constexpr bool value = false; };
template <class P>
struct GatherTrait<P, decltype(void(P::kGather))> { static constexpr bool value = P::kGather; };
template <class P>
__host__ __device__ constexpr bool gathers_rows() { return GatherTrait<P>::value; }
// Whether Problem has operands whose K rows wrap in a window ring (its kWrapB; then its
// int b_wrap(t) gives a task's window rows, 0 for none: produce_tile WRAP).
template <class P, class = void>
struct WrapTrait { static constexpr bool value = false; };
template <class P>
struct WrapTrait<P, decltype(void(P::kWrapB))> { static constexpr bool value = P::kWrapB; };

// The mainloop a task's operand bits ask for: fp8 (kF8), MN-major operands (kAMN / kBMN), or
// the plain K-major one; only the variants the Problem can issue are compiled.
template <class Cfg, class Problem>
MOKGEN_DEV bool consume(const Problem& prob, const GemmSmem<Cfg>& sm, PipeState& ps,
                        const Task& t, float (&acc)[Cfg::kAccRegs + Cfg::kScratch], int cwg) {
  float(&acc0)[Cfg::kAccRegs] = *reinterpret_cast<float(*)[Cfg::kAccRegs]>(&acc[0]);
  if constexpr (Problem::kQ > 0) {
    if (t.op & kF8) {
      if constexpr (Problem::kNarrowTiles) {
        if (t.op & kHalfN) return consume_tile_fp8<Cfg, true>(sm, ps, t, acc, cwg, prob.wsb(t));
      }
      return consume_tile_fp8<Cfg>(sm, ps, t, acc, cwg, prob.wsb(t));
    }
  }
  bool g = false;  // constant false where the Problem gathers nothing: folds away
  if constexpr (gathers_rows<Problem>()) g = prob.gathers(t);
  if constexpr (Problem::kNarrowTiles) {
    if (t.op & kHalfN) {
      if constexpr (Problem::kMNOperands) {
        if (t.op & kAMN) return consume_tile<Cfg, 1, 1, true>(sm, ps, t, acc0, cwg, g);
        if (t.op & kBMN) return consume_tile<Cfg, 0, 1, true>(sm, ps, t, acc0, cwg, g);
      }
      return consume_tile<Cfg, 0, 0, true>(sm, ps, t, acc0, cwg, g);
    }
  }
  if constexpr (Problem::kMNOperands) {
    if (t.op & kAMN) return consume_tile<Cfg, 1, 1>(sm, ps, t, acc0, cwg, g);
    if (t.op & kBMN) return consume_tile<Cfg, 0, 1>(sm, ps, t, acc0, cwg, g);
  }
  return consume_tile<Cfg>(sm, ps, t, acc0, cwg, g);
}

// ---------------------------------------------------------------- persistent driver
// Problem must provide (device):
//   static constexpr bool kMNOperands;         // tasks may set kAMN / kBMN
//   static constexpr bool kNarrowTiles;        // tasks may set kHalfN (half_bit)
//   void prefetch() const;                     // thread 0 at the start: tma_prefetch_desc(...)
//   static constexpr int kQ;                   // 0, or Cfg::Q: tasks may set kF8
//   Task next_task();                          // the thread that takes tasks (schedule_tasks,
//                                              // else the producer): next or stop_task()
//   const CUtensorMap* map_a(const Task&) const; const CUtensorMap* map_b(const Task&) const;
//   void epilogue(const Task&, float (&acc)[Cfg::kAccRegs], int cwg);   // consumer threads:
//                                              // rows 64 cwg .. of the task
//   void signal(const Task&);                  // one thread, once per task, after every
//                                              // thread's epilogue stores of it
//   fp8 (kQ > 0): map_sa(t), map_sb(t) (TMA maps of the scales) and const float* wsb(t).
//   optional, static constexpr bool kGather (bf16 tiles only; gathered operands above), then
//   static constexpr int kGatherLd, kGatherTopk; GatherSrc gather(t) (base nullptr: both
//   operands by TMA; a gathered B is MN-major) and bool gathers(t) (the consumers fence).
//   next_task() is then called by thread 0 while the producer warpgroup's other warps wait.
//   optional, static constexpr bool kWrapB, then int b_wrap(t) (not with kGather): the rows of
//   a window ring an MN-major B's K rows wrap in, or 0 (produce_tile WRAP).
//   GemmCfg::PAIR kernels (launched in 2-CTA clusters; produce_pairs): int claim(int n) (the
//   first of n tasks taken), int task_count(), template <bool WAIT> Task task_at(int t)
//   (WAIT: next_task's waits for task t; else its coordinates alone, the same in both CTAs)
//   and bool shares_b(a, b) (the two tasks read the same B: a dual B, b_row1 >= 0).
// Must be called by all 384 threads with the kernel's dynamic smem (>= Cfg::SMEM_BYTES) and
// the kernel declared __launch_bounds__(384, 1) so setmaxnreg takes effect.

// A consumer warpgroup's accumulators (fp8: + the scratch, consume_tile_fp8), zeroed per tile
// although the first wgmma overwrites them (scale_d = 0): "+f" operands of an uninitialized
// array read the previous tile's registers in PTX, which keeps all accumulators live through
// the epilogue and made ptxas spill them. 128 MOVs per tile.
template <class Cfg>
struct ConsumerAcc {
  float r[Cfg::kAccRegs + Cfg::kScratch];
  MOKGEN_DEV ConsumerAcc() {
#pragma unroll
    for (int i = 0; i < Cfg::kAccRegs + Cfg::kScratch; ++i) r[i] = 0.f;
  }
  MOKGEN_DEV float (&main())[Cfg::kAccRegs] {  // the tile's accumulators, for the epilogue
    return *reinterpret_cast<float(*)[Cfg::kAccRegs]>(&r[0]);
  }
};

// Cooperative consumers: warpgroup cwg does rows 64 cwg .. of every tile, both at once.
// A task's signal publishes its epilogue's stores: a gpu-scope fence, which waits until they
// have all reached L2, then the count, raised by a consumer thread (thread 128) once both
// warpgroups have stored the tile (kBarTile); its wait holds that warpgroup's next wgmma for
// the drain of the tile's stores.
template <class Cfg, class Problem>
MOKGEN_DEV void consumer_cooperative(Problem& prob, const GemmSmem<Cfg>& sm, int cwg) {
  PipeState ps, ts;
  int traced = 0;  // Cfg::TRACE: this CTA's tasks so far
  for (;;) {
    ConsumerAcc<Cfg> acc;
    const Task* slot = task_pop<Cfg>(sm, ts);
    if (slot == nullptr || slot->op < 0) break;
    const Task& t = *slot;
    if constexpr (Cfg::PAIR) {
      if (t.op & kPairPad) {  // the peer's task is longer: step past its extra slices
        if (!consume_pad<Cfg>(sm, ps, t.k_blocks)) {
          record_timeout(103, ps.phase());
          break;
        }
        task_release<Cfg>(sm, ts);
        continue;
      }
    }
    unsigned long long* rec = nullptr;
    if constexpr (Cfg::TRACE) {
      if (threadIdx.x == 128) rec = trace_rec(traced);
      ++traced;
      if (rec) {
        rec[kTrPop] = trace_clock();
        rec[kTrGlobalNs] = global_ns();
      }
    }
    const bool ok = consume<Cfg, Problem>(prob, sm, ps, t, acc.r, cwg);
    if constexpr (Cfg::TRACE) {
      if (rec) rec[kTrMain] = trace_clock();
      if (threadIdx.x == 128) {
        if (rec) rec[kTrFullWait] = trace_sums()[kSumFullWait];
        trace_sums()[kSumFullWait] = 0;
      }
    }
    if (!ok) {  // a stage never arrived: record it and stop (see mbar_wait_lean)
      record_timeout(103, ps.phase());
      break;
    }
    prob.epilogue(t, acc.main(), cwg);
    if constexpr (Cfg::TRACE)
      if (rec) rec[kTrEpi] = trace_clock();
    named_bar_sync(kBarTile, 256);
    if (threadIdx.x == 128) prob.signal(t);
    task_release<Cfg>(sm, ts);
    if constexpr (Cfg::TRACE)
      if (rec) rec[kTrDone] = trace_clock();
  }
}

// The producing thread (trace builds): its i-th task, asked for at `ask`, got now (the
// consumers' thread 128 adds the rest of the record: consumer_cooperative).
MOKGEN_DEV void trace_task_got(int i, const Task& t, uint64_t ask) {
  if (unsigned long long* rec = t.op < 0 ? nullptr : trace_rec(i)) {
    rec[kTrOp] = (unsigned)t.op | ((unsigned long long)t.k_blocks << 32);
    rec[kTrAsk] = ask;
    rec[kTrGot] = trace_clock();
  }
}

// ---------------------------------------------------------------- CTA pairs (GemmCfg::PAIR)
// The two CTAs of a 2-CTA cluster take their tasks two at a time: rank 0 claims tasks
// base, base + 1 from the Problem's counter and posts base to rank 1 (a mailbox in rank 1's
// shared memory, st.async), rank r runs task base + r. Their rings stay in step: each CTA
// runs as many slices a pair as the longer of the two tasks has (the shorter one's CTA runs
// the rest as a pad task: its stages filled with nothing and freed), and every consumer warp
// frees each stage in both CTAs (free_stage). So stage s holds slice j in both at once, and
// where the two tasks read the same B (Problem::shares_b: the same weight rows and K, as
// vertically adjacent tiles of one expert are) each CTA loads its A and half of B (a dual B: rank
// 0 the rows at b_row0, rank 1 those at b_row1), multicast into both CTAs' stage: B's reads from
// L2 halve. Why: at the board's power limit the tensor cores' clock is what bounds the long GEMMs,
// and the L2 -> SM traffic is energy (a standalone GEMM's multicast pairs run a few percent faster
// at the cap than the same pairs without it). The decisions that must agree in both CTAs (how many
// slices, multicast or not, stop) are pure functions of base (Problem::task_at<false>, which waits
// for nothing); each CTA waits only for its own task's inputs (task_at<true>).
template <class Cfg>
MOKGEN_DEV void pair_post(const GemmSmem<Cfg>& sm, PipeState& ms, int base) {  // rank 0
  mbar_wait(&sm.mail_empty()[ms.idx()], ms.phase() ^ 1, 105);
  st_async_cluster(&sm.mail()[ms.idx()], &sm.mail_full()[ms.idx()], 1, base);
  ms.template advance<Cfg::kMailSlots>();
}
template <class Cfg>
MOKGEN_DEV int pair_take(const GemmSmem<Cfg>& sm, PipeState& ms) {  // rank 1
  uint64_t* full = &sm.mail_full()[ms.idx()];
  mbar_arrive_expect_tx(full, 4);
  mbar_wait(full, ms.phase(), 104);
  const int base = sm.mail()[ms.idx()];
  mbar_arrive_cluster(&sm.mail_empty()[ms.idx()], 0);
  ms.template advance<Cfg::kMailSlots>();
  return base;
}

// k_blocks slices of a multicast task: A (with_a; a pad of a task whose own CTA stopped
// early brings none) and this rank's half of the dual B into both CTAs' stage, each stage
// expecting A and all of B (the other half is the peer's multicast).
template <class Cfg>
MOKGEN_DEV void produce_tile_mc(const GemmSmem<Cfg>& sm, PipeState& ps, const CUtensorMap* ta,
                                const CUtensorMap* tb, const Task& t, uint32_t rank, int k_blocks,
                                bool with_a) {
  for (int kb = 0; kb < k_blocks; ++kb) {
    uint64_t t0 = 0;
    if constexpr (Cfg::TRACE) t0 = trace_clock();
    mbar_wait(&sm.empty()[ps.idx()], ps.phase() ^ 1, 102);
    if constexpr (Cfg::TRACE) trace_fill(t0, true);
    uint64_t* bar = &sm.full()[ps.idx()];
    mbar_arrive_expect_tx(bar, (with_a ? Cfg::A_BYTES : 0) + Cfg::B_BYTES);
    const int k0 = kb * Cfg::BK;
    if (with_a) tma_load_2d(sm.a_stage(ps.idx()), ta, bar, k0, t.a_row0);
    tma_load_2d_multicast(sm.b_stage(ps.idx()) + rank * (Cfg::BN / 2) * 128, tb, bar, k0,
                          rank ? t.b_row1 : t.b_row0, 0x3);
    if constexpr (Cfg::TRACE) trace_issued(t0, true);
    ps.template advance<Cfg::STAGES>();
  }
}

template <class Cfg, class Problem>
MOKGEN_DEV void produce_pairs(Problem& prob, const GemmSmem<Cfg>& sm) {
  const uint32_t rank = cluster_ctarank();
  PipeState ps, ts, ms;  // ring, task channel, mailbox
  // Rank 0 claims and posts each pair one pair ahead: the claim's atomic runs under this
  // pair's decoding and waits, and rank 1 finds the pair in its mailbox when it gets there.
  // (What pairs add to the producer's ask is its two decodes, not the atomic: claiming ahead
  // leaves the ask as long as claiming when needed.)
  int next = 0;
  if (rank == 0) {
    next = prob.claim(2);
    pair_post<Cfg>(sm, ms, next);
  }
  for (int i = 0;;) {
    uint64_t ask = 0;
    if constexpr (Cfg::TRACE) ask = trace_clock();
    const int base = rank == 0 ? next : pair_take<Cfg>(sm, ms);
    if (base >= prob.task_count()) {  // past the end (both CTAs see it at the same base)
      task_push<Cfg>(sm, ts, stop_task());
      break;
    }
    if (rank == 0) next = prob.claim(2);  // posted below, once its atomic has returned
    // this CTA's task, having waited for its inputs (stop: aborted, then a pad), and the
    // peer's coordinates; the slice count and multicast from both, as the peer has them
    // (this task's own coordinates again where the wait stopped it)
    Task t = prob.template task_at<true>(base + (int)rank);
    const Task o = prob.template task_at<false>(base + (int)(rank ^ 1));
    const Task mine = t.op >= 0 ? t : prob.template task_at<false>(base + (int)rank);
    if (rank == 0) pair_post<Cfg>(sm, ms, next);
    const int k = max(mine.op < 0 ? 0 : mine.k_blocks, o.op < 0 ? 0 : o.k_blocks);
    const bool mc = mine.op >= 0 && o.op >= 0 && prob.shares_b(mine, o);
    const int own = t.op < 0 ? 0 : t.k_blocks;
    if (own > 0) {
      if (mc) t.op |= kMcast;
      if constexpr (Cfg::TRACE) trace_task_got(i, t, ask);
      task_push<Cfg>(sm, ts, t);
      if (mc)
        produce_tile_mc<Cfg>(sm, ps, prob.map_a(t), prob.map_b(t), t, rank, own, true);
      else
        produce_tile<Cfg, Problem::kNarrowTiles>(sm, ps, prob.map_a(t), prob.map_b(t), t);
      if constexpr (Cfg::TRACE) trace_fill_record(i);
      ++i;
    }
    if (k > own) {  // the peer's task is longer, or this one stopped: its slices, empty
      task_push<Cfg>(sm, ts, Task{kPairPad, 0, 0, -1, 0, 0, 0, k - own});
      if (mc) {  // the peer still expects this rank's half of B (own is 0: aborted)
        produce_tile_mc<Cfg>(sm, ps, prob.map_a(mine), prob.map_b(mine), mine, rank, k, false);
      } else {
        for (int kb = own; kb < k; ++kb) {
          mbar_wait(&sm.empty()[ps.idx()], ps.phase() ^ 1, 102);
          mbar_arrive(&sm.full()[ps.idx()]);
          ps.template advance<Cfg::STAGES>();
        }
      }
    }
  }
  // Stay until every arrive the peer makes here has landed: its consumers' frees of the last
  // STAGES slices, and (rank 0) rank 1's reads of the mailbox.
  for (int s = 0; s < Cfg::STAGES; ++s) {
    mbar_wait(&sm.empty()[ps.idx()], ps.phase() ^ 1, 106);
    ps.template advance<Cfg::STAGES>();
  }
  if (rank == 0) {
    for (int s = 0; s < Cfg::kMailSlots; ++s) {
      mbar_wait(&sm.mail_empty()[ms.idx()], ms.phase() ^ 1, 105);
      ms.template advance<Cfg::kMailSlots>();
    }
  }
}

// The producer of a Problem that gathers: the whole producer warpgroup (kGatherWarps).
// Thread 0 takes each task (and waits for what it reads) and publishes it on the task
// channel; every gathering warp follows the channel as the consumers do and streams its share
// of the task. The slot stays valid for them without an arrival of theirs: the consumers free
// it only after the task's last stage, which needs every warp's rows.
template <class Cfg, class Problem>
MOKGEN_DEV void produce_gathering(Problem& prob, const GemmSmem<Cfg>& sm) {
  const bool lead = threadIdx.x == 0;
  PipeState ps, ts, tp;  // ring, task channel as read, task channel as written (thread 0)
  for (int i = 0;; ++i) {
    if (lead) {
      uint64_t ask = 0;
      if constexpr (Cfg::TRACE) ask = trace_clock();
      const Task t = prob.next_task();
      if constexpr (Cfg::TRACE) trace_task_got(i, t, ask);
      task_push<Cfg>(sm, tp, t);
    }
    __syncwarp();
    const Task* slot = task_pop<Cfg>(sm, ts);
    if (slot == nullptr || slot->op < 0) break;
    produce_tile_gather<Cfg>(prob, sm, ps, slot);
    if constexpr (Cfg::TRACE)
      if (lead) trace_fill_record(i);
    ts.template advance<Cfg::TASK_SLOTS>();
  }
}

// The scheduling thread (warp 2 of the producer warpgroup, beside the producing thread of warp
// 0): takes each task from the Problem (next_task: the list's atomic, the task's decode, its
// dependency waits) and publishes it on the task channel, one task ahead of the producer. It
// asks for task i + 1 once the producer has started streaming task i (sm.taken()), so the ask
// runs under task i's slices. Why: an ask takes microseconds (a task's decode and dependency
// waits); done by the producing thread it runs between task i's last slice and task i + 1's
// first, which the short-K weight-gradient tasks feel most. One ahead, not TASK_SLOTS - 1: a
// claimed task is one other CTAs may wait on, so claims stay as close to their runs as the ask
// allows. Deadlock-free: a task waits only on tasks earlier in the list, and the earliest
// unfinished one is running (its CTA's task before it, if any, is finished).
template <class Cfg, class Problem>
MOKGEN_DEV void schedule_tasks(Problem& prob, const GemmSmem<Cfg>& sm) {
  PipeState ts;
  for (;;) {
    // Task i waits for the taken barrier's phase i: the producer completes phase 0 up front
    // and phase i by taking task i - 1. i's parity is its slot's (TASK_SLOTS is even), so
    // the loop holds no count of its own (its 56 registers hold the Problem's schedule
    // state). Unbounded (no watchdog): the producer takes every task it is given unless
    // one of its own bounded waits trapped, and the watchdog's path here spilled.
    while (!mbar_try_wait(sm.taken(), ts.idx() & 1)) {
    }
    const Task t = prob.next_task();
    task_push<Cfg>(sm, ts, t);
    if (t.op < 0) break;
  }
}

// One task's slices, in the mainloop its operand bits ask for (fp8: kF8; else bf16, an
// MN-major B of a kHalfN task its first BN/2 columns, K rows in a window ring: kWrapB).
template <class Cfg, class Problem>
MOKGEN_DEV void produce_task(Problem& prob, const GemmSmem<Cfg>& sm, PipeState& ps,
                             const Task& t) {
  if constexpr (Problem::kQ > 0) {
    if (t.op & kF8) {
      produce_tile_fp8<Cfg, Problem::kNarrowTiles>(sm, ps, prob.map_a(t), prob.map_b(t),
                                                   prob.map_sa(t), prob.map_sb(t), t);
      return;
    }
  }
  constexpr bool kWrap = WrapTrait<Problem>::value;
  int wrap = 0;
  if constexpr (kWrap) wrap = prob.b_wrap(t);
  produce_tile<Cfg, Problem::kNarrowTiles, kWrap>(sm, ps, prob.map_a(t), prob.map_b(t), t, wrap);
}

// The producing thread: streams each task's slices. Cfg::SCHEDULER: it follows the task
// channel as the consumers do (the consumers free each slot) and trace builds record its
// wait for the task as the ask (the scheduler's next_task, where that did not finish under
// the previous task); else it takes each task itself and publishes it.
template <class Cfg, class Problem>
MOKGEN_DEV void produce_tasks(Problem& prob, const GemmSmem<Cfg>& sm) {
  static_assert(Cfg::TASK_SLOTS % 2 == 0, "schedule_tasks reads a task's parity off its slot");
  PipeState ps, ts;
  if constexpr (Cfg::SCHEDULER) mbar_arrive(sm.taken());  // task 0 may be taken at once
  for (int i = 0;; ++i) {
    uint64_t ask = 0;
    if constexpr (Cfg::TRACE) ask = trace_clock();
    Task t;
    if constexpr (Cfg::SCHEDULER) {
      mbar_wait(&sm.task_full()[ts.idx()], ts.phase(), 101);  // bounded: the scheduler's are not
      t = sm.tasks()[ts.idx()];
      if (t.op < 0) break;
      mbar_arrive(sm.taken());
      ts.template advance<Cfg::TASK_SLOTS>();
    } else {
      t = prob.next_task();
      task_push<Cfg>(sm, ts, t);
      if (t.op < 0) break;
    }
    if constexpr (Cfg::TRACE) trace_task_got(i, t, ask);
    produce_task<Cfg>(prob, sm, ps, t);
    if constexpr (Cfg::TRACE) trace_fill_record(i);
  }
}

template <class Cfg, class Problem>
MOKGEN_DEV void gemm_persistent(Problem& prob, uint8_t* dyn_smem) {
  constexpr bool kGather = gathers_rows<Problem>();
  static_assert(!kGather || Problem::kQ == 0, "gathered operands: bf16 tiles");
  static_assert(!(kGather && Cfg::PAIR), "CTA pairs: both operands by TMA (produce_pairs)");
  const GemmSmem<Cfg> sm = GemmSmem<Cfg>::carve(dyn_smem);
  if (threadIdx.x == 0) {
    sm.init(kGather ? 1 + 32 * kGatherWarps : 1);
    // the maps' descriptor prefetches, here at the launch's 168 registers: issued by the
    // producer after its setmaxnreg.dec they made ptxas spill its schedule state around them
    prob.prefetch();
  }
  if constexpr (Cfg::TRACE)  // trace.cuh's sums start at 0
    if (threadIdx.x == 0)
      for (int k = 0; k < kTraceSums; ++k) trace_sums()[k] = 0;
  // PAIR: the peer's barriers exist before anything lands in or arrives on them
  if constexpr (Cfg::PAIR) cluster_sync();
  else __syncthreads();
  const int wg = warpgroup_idx();
  if (wg == 0) {
    setmaxnreg_dec<kGather ? Cfg::kGatherProducerRegs : Cfg::kProducerRegs>();
    if constexpr (kGather) {
      produce_gathering<Cfg>(prob, sm);  // the whole warpgroup
    } else if constexpr (Cfg::PAIR) {
      if (threadIdx.x < 32 && elect_one()) produce_pairs<Cfg>(prob, sm);
    } else if constexpr (Cfg::SCHEDULER) {
      if (threadIdx.x >= 64 && threadIdx.x < 96) {
        if (elect_one()) schedule_tasks<Cfg>(prob, sm);
      } else if (threadIdx.x < 32 && elect_one()) {
        produce_tasks<Cfg>(prob, sm);
      }
    } else if (threadIdx.x < 32 && elect_one()) {
      produce_tasks<Cfg>(prob, sm);
    }
  } else {
    setmaxnreg_inc<kGather ? Cfg::kGatherConsumerRegs : Cfg::kConsumerRegs>();
    consumer_cooperative<Cfg>(prob, sm, wg - 1);
    // store_rows_tma's last stores read shared memory, which ends with the CTA
    if constexpr (Cfg::EPI_BYTES > 0) bulk_wait<0>();
  }
}

}  // namespace mokgen
