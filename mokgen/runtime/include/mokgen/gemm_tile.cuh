// mokgen/gemm_tile.cuh -- warp-specialized TMA + wgmma GEMM tile engine for the megakernel.
//
// CTA shape: 384 threads = 3 warpgroups.
//   warpgroup 0: producer. One elected thread pops tasks from the scheduler (Problem),
//                publishes them on the smem task channel, and streams A/B K-slices into the
//                smem ring with TMA. With SIGNAL_WARP, warp 1 raises the tasks' completion
//                signals (signal_tasks). The other threads exit right away. setmaxnreg.dec.
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
// Two consumer schedules (GemmCfg::PINGPONG, the plan's GemmConfig.pingpong):
// - cooperative (default): both consumer warpgroups run every K-slice of a tile at once, rows
//   64 cwg .. each, then both run the epilogue: the tensor core idles during every epilogue.
// - ping-pong: the same 128 x BN task, but its two 64 x BN halves are run one after the other,
//   warpgroup h owning half h of every task. The producer streams the task's K-slices twice
//   (half 0, then half 1), so warpgroup 0's epilogue of task n runs while warpgroup 1's
//   wgmma of task n runs, and warpgroup 1's epilogue while warpgroup 0's wgmma of task n+1.
//   Named barriers hand the mainloop turn over (kBarTurn) once a warpgroup's last wgmma is
//   issued, so the two take turns on the tensor core (the next chain queued behind the
//   previous one's tail) and each epilogue starts as early as possible. Why halves of a task rather than a
//   128 x 128 tile per warpgroup: the accumulators stay the cooperative ones (64 x BN per
//   warpgroup, 128 registers at BN = 256, the same budget under setmaxnreg 232), so every
//   epilogue, the tasks, the schedules and the host's tensor maps are shared by both modes,
//   and the task's completion signal stays one per task (warpgroup 1 raises it once both
//   halves are stored: kBarDone). The cost: B is read from L2 twice per task (the second
//   read right after the first, so it hits L2) and a K-major A box holds both halves' rows
//   (the host's maps have 128-row boxes), so each half streams 48 KB slices where the
//   cooperative tile streams 48 KB per two halves; an MN-major A (weight gradients) is two
//   64-row boxes and a half loads only its own. Which mode a GEMM runs is measured
//   (benchmarks/gemm_engine.py), not assumed. Measured on an H200 (commit b05eac0): ping-pong
//   wins only on short K (K = 384 / 768: 1.02-1.09x) and loses everywhere the time goes (the
//   gate/up and down GEMMs 0.62-0.91x; the layer's forward 0.54-0.77x, backward 0.86-0.90x):
//   each half streams its slices on its own, which costs more than the hidden epilogue
//   saves. So cooperative is the default and ping-pong a plan option.
#pragma once
#include <cuda_bf16.h>

#include "mokgen/ptx.cuh"
#include "mokgen/tma.cuh"
#include "mokgen/trace.cuh"
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

// Operand layout bits of Task::op; the low byte is the Problem's own opcode, and bits
// kOpUserShift .. 29 are the Problem's to carry what its epilogue needs (op stays >= 0).
// kHalfN: a narrow edge tile (half_bit below).
enum : int {
  kOpcodeMask = 0xff, kBMN = 1 << 8, kAMN = 1 << 9, kF8 = 1 << 10, kOpUserShift = 11,
  kHalfN = 1 << 30
};
MOKGEN_DEV int opcode(const Task& t) { return t.op & kOpcodeMask; }

// Slot index + parity of a ring of S mbarrier-guarded slots, in one register (parity in
// bit 31): the fp8 consumer holds two of these beside 192 accumulators.
struct PipeState {
  uint32_t bits = 0;
  MOKGEN_DEV uint32_t idx() const { return bits & 0x7fffffffu; }
  MOKGEN_DEV uint32_t phase() const { return bits >> 31; }
  template <int S>
  MOKGEN_DEV void advance() {
    bits = idx() + 1 == S ? (bits & 0x80000000u) ^ 0x80000000u : bits + 1;
  }
  // n slots at once (ping-pong: past the other warpgroup's half of a task)
  template <int S>
  MOKGEN_DEV void advance_by(int n) {
    const uint32_t i = idx() + (uint32_t)n, wraps = i / S;
    bits = ((bits & 0x80000000u) ^ ((wraps & 1u) << 31)) | (i - wraps * S);
  }
};

// Profiling variants: a plan's `profile` (runtime/abi.py PROFILES), rendered by codegen as a
// mask. Timing-only builds whose results are wrong; 0 in every other plan, where each branch
// on it folds away at compile time.
enum Profile : unsigned {
  kProfNoRoutedWgrad = 1u,    // the backward skips the routed weight-gradient tiles
  kProfNoDhQuant = 2u,        // the fp8 dgrad epilogue does not quantize dh
  kProfFp8NoPromote = 4u,     // fp8 tiles: the wgmma stream alone, no scale promotion
  kProfFp8PlainEpilogue = 8u,  // the fp8 forward's gate/up epilogue: no SwiGLU, no quantization
  kProfNoWgradEpilogue = 16u,  // the routed weight-gradient tiles: mainloop, no epilogue
  kProfNoBwdEpilogues = 32u,   // every backward tile: mainloop, no epilogue (signals still go)
  kProfNoWgradWaits = 64u,     // the routed weight-gradient tasks start without their waits
  kProfNoFwdEpilogues = 128u,  // every forward tile: mainloop, no epilogue (signals still go)
  kProfTrace = 256u,           // per-task timestamps into mokgen_trace (trace.cuh); results right
  kProfNoDgradLoads = 512u,    // the routed SwiGLU backward (bf16): d_a stands in for g / u
  kProfNoDgradStores = 1024u   // ... and stores neither dh nor w a (results wrong)
};

template <int BN_, int STAGES_, int Q_ = 0, unsigned PROF_ = 0, int TASK_SLOTS_ = 4,
          bool PINGPONG_ = false, bool SIGNAL_WARP_ = false, int EPI_BYTES_ = 0>
struct GemmCfg {
  static constexpr int BM = 128, BK = 64, BN = BN_, Q = Q_;
  static constexpr unsigned PROF = PROF_;
  static constexpr bool TRACE = (PROF & kProfTrace) != 0;  // per-task clocks (trace.cuh)
  static constexpr int STAGES = STAGES_, TASK_SLOTS = TASK_SLOTS_;
  static constexpr bool PINGPONG = PINGPONG_;
  // a warp of the producer warpgroup raises each task's completion signal (signal_warp)
  static constexpr bool SIGNAL_WARP = SIGNAL_WARP_;
  // shared memory the Problem's epilogues stage tiles in (GemmSmem::epi), after the rest
  static constexpr int EPI_BYTES = EPI_BYTES_;
  static constexpr int kThreads = 384;
  static constexpr int kConsumerWarps = 8;
  // warps that read (and free) each ring stage: both consumer warpgroups, or in ping-pong the
  // one whose half-tile the stage holds
  static constexpr int kStageReaders = PINGPONG ? 4 : 8;
  static constexpr int kAccRegs = BN / 2;  // fp32 accumulators per consumer thread
  static constexpr int A_BYTES = BM * BK * 2;
  static constexpr int B_BYTES = BN * BK * 2;
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
  // fp8 slices: 128 e4m3 along K in the same A / B bytes; scales per slice (fp32): A per row
  // and 32-step ([128/Q][BM]), B per column and 32-step for MX only ([2 halves][4][128])
  static constexpr int BK8 = 128;
  static constexpr int kScratch = Q ? 64 : 0;  // fp8 scratch accumulators (after kAccRegs)
  static constexpr int SA_BYTES = Q ? BM * (BK8 / Q) * 4 : 0;
  static constexpr int SB_BYTES = Q == 32 ? BN * (BK8 / Q) * 4 : 0;
  static constexpr int SC_BYTES = SA_BYTES + SB_BYTES;
  static constexpr int BAR_BYTES = 8 * (2 * STAGES + 2 * TASK_SLOTS);
  // 1024 B of slack: the 128B-swizzle atom must be 1024-aligned and the dynamic smem base is
  // not guaranteed to be.
  static constexpr int ENGINE_BYTES = STAGES * (STAGE_BYTES + SC_BYTES) + BAR_BYTES +
                                      32 * TASK_SLOTS + (SIGNAL_WARP ? 16 : 0);
  static constexpr int EPI_AT = (ENGINE_BYTES + 1023) / 1024 * 1024;  // 1024-aligned
  static constexpr int SMEM_BYTES = 1024 + (EPI_BYTES ? EPI_AT + EPI_BYTES : ENGINE_BYTES);
  static constexpr int kProducerRegs = 40, kConsumerRegs = 232;
  // producer warps that gather rows (produce_tile_gather) compute their addresses beside the
  // Problem's schedule state: 40 spilled the backward with a shared expert (nvcc 13.0), 56
  // leaves the consumers 224, where none of their code spills
  static constexpr int kGatherProducerRegs = 56, kGatherConsumerRegs = 224;
  static_assert(BN == 128 || BN == 256, "wgmma wrappers exist for N = 128, 256");
  static_assert(STAGE_BYTES % 1024 == 0, "stages keep 1024 B alignment");
  static_assert(Q == 0 || ((Q == 128 || Q == 32) && BN == 256 && BM * BK8 == A_BYTES),
                "fp8 tiles: Q = 128 or 32, two 128-column halves, slices as large as bf16's");
  // setmaxnreg moves registers inside the CTA's pool, which holds what the launch allocated
  // (__launch_bounds__(384, 1): 168 a thread): a request past it waits forever
  static constexpr int kPool = 168 * kThreads;
  static_assert(kProducerRegs * 128 + kConsumerRegs * 256 <= kPool, "register pool");
  static_assert(kGatherProducerRegs * 128 + kGatherConsumerRegs * 256 <= kPool, "register pool");
  static_assert(!(PINGPONG && SIGNAL_WARP), "the signal warp serves the cooperative schedule");
  static_assert(SMEM_BYTES <= 227 * 1024, "shared memory per block (sm_90)");
};

// Pointers carved out of dynamic shared memory. Ring stage s: A at stage(s), B right after.
// Only the ring base is held; everything else is a constant offset from it (a consumer
// thread is short of registers: the fp8 tiles use 192 for accumulators).
template <class Cfg>
struct GemmSmem {
  uint8_t* ring;
  static constexpr int kBarsAt = Cfg::STAGES * Cfg::STAGE_BYTES;  // barriers after the ring

  // [STAGES] TMA bytes landed (count 1 + tx)
  MOKGEN_DEV uint64_t* full() const { return reinterpret_cast<uint64_t*>(ring + kBarsAt); }
  // [STAGES] consumers done reading (count = consumer warps)
  MOKGEN_DEV uint64_t* empty() const { return full() + Cfg::STAGES; }
  // [TASK_SLOTS] task published (count 1) / task done with by all consumer warps
  MOKGEN_DEV uint64_t* task_full() const { return empty() + Cfg::STAGES; }
  MOKGEN_DEV uint64_t* task_empty() const { return task_full() + Cfg::TASK_SLOTS; }
  MOKGEN_DEV Task* tasks() const {  // [TASK_SLOTS]
    return reinterpret_cast<Task*>(task_empty() + Cfg::TASK_SLOTS);
  }
  MOKGEN_DEV float* scales() const {  // [STAGES][SC_BYTES / 4] fp8 scales of each stage
    return reinterpret_cast<float*>(tasks() + Cfg::TASK_SLOTS);
  }
  // [EPI_BYTES] the Problem's epilogue staging (1024-aligned: 128B-swizzled TMA boxes)
  MOKGEN_DEV uint8_t* epi() const { return ring + Cfg::EPI_AT; }
  // SIGNAL_WARP: set by a consumer whose mainloop timed out (the signal warp then stops)
  MOKGEN_DEV int* stopped() const {
    return reinterpret_cast<int*>(scales() + Cfg::STAGES * (Cfg::SC_BYTES / 4));
  }

  MOKGEN_DEV uint8_t* a_stage(int s) const { return ring + s * Cfg::STAGE_BYTES; }
  MOKGEN_DEV uint8_t* b_stage(int s) const { return ring + s * Cfg::STAGE_BYTES + Cfg::A_BYTES; }
  MOKGEN_DEV float* sa_stage(int s) const { return scales() + s * (Cfg::SC_BYTES / 4); }
  MOKGEN_DEV float* sb_stage(int s) const { return sa_stage(s) + Cfg::SA_BYTES / 4; }

  static MOKGEN_DEV GemmSmem carve(uint8_t* dyn) {
    GemmSmem m;
    const uint32_t base = smem_u32(dyn);
    m.ring = dyn + (((base + 1023u) & ~1023u) - base);
    return m;
  }
  // One thread; the caller then __syncthreads() before the role split. full_count: the
  // producer's arrive with the TMA bytes, plus one per lane of the warps that gather rows
  // (produce_tile_gather).
  MOKGEN_DEV void init(uint32_t full_count = 1) const {
    for (int s = 0; s < Cfg::STAGES; ++s) {
      mbar_init(&full()[s], full_count);
      mbar_init(&empty()[s], Cfg::kStageReaders);
    }
    for (int s = 0; s < Cfg::TASK_SLOTS; ++s) {
      mbar_init(&task_full()[s], 1);
      // the signal warp frees a slot once it has signalled the task (signal_warp)
      mbar_init(&task_empty()[s], Cfg::SIGNAL_WARP ? 1 : Cfg::kConsumerWarps);
    }
    if constexpr (Cfg::SIGNAL_WARP) *stopped() = 0;
    fence_mbarrier_init();
  }
};

// ---------------------------------------------------------------- task channel
// Single producer thread -> all consumer threads. The producer may run TASK_SLOTS - 1 tasks
// ahead (consumers keep the current one's slot until its epilogue is done). Slot writes are
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
// half >= 0 (ping-pong): the slices of rows 64 half .. only; an MN-major A then brings only
// that half's box (at the offset the consumer reads it from), a K-major A its whole box.
// NARROW (Problem::kNarrowTiles): a kHalfN task's MN-major B brings only the boxes of its first
// BN/2 columns, the ones its mainloop reads (a K-major B box is BN rows: loaded whole).
// One K-slice's TMA loads of A (an MN-major A: its boxes j0 .. j1 - 1) and of B (an
// MN-major B: its first b_boxes boxes; dual-B: the up rows right below the gate rows), for
// stage `bar`. produce_tile and produce_tile_gather share them.
template <class Cfg>
MOKGEN_DEV void load_a_slice(uint8_t* stage, const CUtensorMap* ta, uint64_t* bar, const Task& t,
                             int k0, bool amn, int j0, int j1) {
  constexpr int kBox = 64 * 64 * 2;
  if (amn) {
    for (int j = j0; j < j1; ++j)
      tma_load_2d(stage + j * kBox, ta, bar, t.a_row0 + 64 * j, t.b_row1 + k0);
  } else {
    tma_load_2d(stage, ta, bar, k0, t.a_row0);
  }
}
template <class Cfg>
MOKGEN_DEV void load_b_slice(uint8_t* stage, const CUtensorMap* tb, uint64_t* bar, const Task& t,
                             int k0, bool bmn, int b_boxes) {
  constexpr int kBox = 64 * 64 * 2;
  if (bmn) {
    for (int j = 0; j < b_boxes; ++j)
      tma_load_2d(stage + j * kBox, tb, bar, t.b_row0 + 64 * j, t.b_row1 + k0);
  } else {
    tma_load_2d(stage, tb, bar, k0, t.b_row0);
    if (t.b_row1 >= 0)  // dual-B: second half (up rows) right below the first
      tma_load_2d(stage + (Cfg::BN / 2) * 128, tb, bar, k0, t.b_row1);
  }
}

template <class Cfg, bool NARROW = false>
MOKGEN_DEV void produce_tile(const GemmSmem<Cfg>& sm, PipeState& ps, const CUtensorMap* ta,
                             const CUtensorMap* tb, const Task& t, int half = -1) {
  // MN-major operands arrive as 64 x 64 boxes, 8 KB each, stacked along MN (wgmma.cuh)
  constexpr int kBox = 64 * 64 * 2;
  const bool amn = t.op & kAMN, bmn = t.op & kBMN;
  const bool narrow = NARROW && bmn && (t.op & kHalfN);
  const int j0 = half < 0 ? 0 : half, j1 = half < 0 ? Cfg::BM / 64 : half + 1;
  const int b_boxes = narrow ? Cfg::BN / 128 : Cfg::BN / 64;
  const uint32_t bytes = Cfg::STAGE_BYTES - (amn ? (Cfg::BM / 64 - (j1 - j0)) * kBox : 0) -
                         (narrow ? (Cfg::BN / 64 - b_boxes) * kBox : 0);
  for (int kb = 0; kb < t.k_blocks; ++kb) {
    mbar_wait(&sm.empty()[ps.idx()], ps.phase() ^ 1, 102);
    uint64_t* bar = &sm.full()[ps.idx()];
    mbar_arrive_expect_tx(bar, bytes);
    const int k0 = kb * Cfg::BK;
    load_a_slice<Cfg>(sm.a_stage(ps.idx()), ta, bar, t, k0, amn, j0, j1);
    load_b_slice<Cfg>(sm.b_stage(ps.idx()), tb, bar, t, k0, bmn, b_boxes);
    ps.template advance<Cfg::STAGES>();
  }
}

// ---------------------------------------------------------------- gathered operands
// An operand whose rows are named by index instead of lying in a tensor (Problem::kGather:
// one rank holding every expert reads x and dy where the caller left them, instead of the
// copies a dispatch would make into the ring; design.md). The rows are token rows of a
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
};

// The token ring-layout row p holds, or -1 (padding, or a table entry past the tokens).
template <int K>
MOKGEN_DEV int gather_token(const GatherSrc& g, int p) {
  const int2 e = g.table[p];
  const int tok = e.x >= 0 ? e.y / K : -1;
  return (unsigned)tok < (unsigned)g.rows ? tok : -1;
}

// The producer warpgroup's four warps gather (warp 1's signal duty is the cooperative
// schedule's option, not taken with gathered rows): each brings a quarter of every slice's
// rows. One warp alone issued a slice's 32-64 cp.async instructions with their shuffles and
// addresses too slowly for the tensor core (an H200: the layer at half speed, 0.75x unrolled).
constexpr int kGatherWarps = 4;
static_assert(kGatherWarps * 32 == 128 && kGatherWarps * 16 == 64,
              "a warp's share: 32 rows of a K-major A tile, 16 of an MN-major slice");

// K-major A slice: tile rows 0..127 (ring-layout rows p0 ..) at columns k0 .. k0 + 63; warp w
// the rows 32 w .. 32 w + 31. Lane l reads the token of row 32 w + l (the table, each slice:
// L1 holds it after the first); lanes 8 s .. 8 s + 7 bring one row's 128 contiguous bytes
// (an instruction: four rows), the row's token shuffled from the lane that read it.
template <int LD, int K>
MOKGEN_DEV void gather_k_major(uint8_t* stage, const GatherSrc& g, int p0, int k0, int w) {
  const int lane = threadIdx.x & 31, c = lane & 7, sub = lane >> 3;
  const int col = k0 + 8 * c;
  const bool col_ok = col < LD;  // a K tail: zeros, as TMA's
  const uint32_t base = smem_u32(stage) + (32 * w + sub) * 128;
  const int tok = gather_token<K>(g, p0 + 32 * w + lane);
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

// Nothing is held across the slices but the slice count and the ring state: the task is read
// again from its shared-memory slot (the producer rewrites that slot only after this task:
// task_push), the GatherSrc asked of the Problem (its pointers are kernel parameters), so
// the producer warps fit their 56 registers beside the Problem's schedule state.
template <class Cfg, class Problem>
MOKGEN_DEV void produce_tile_gather(const Problem& prob, const GemmSmem<Cfg>& sm, PipeState& ps,
                                    const volatile Task* slot) {
  constexpr int kBox = 64 * 64 * 2, LD = Problem::kGatherLd, K = Problem::kGatherTopk;
  const bool lead = threadIdx.x == 0;
  const int w = threadIdx.x >> 5;  // this warp's share of the gathered rows
  const int k_blocks = slot->k_blocks;
  for (int kb = 0; kb < k_blocks; ++kb) {
    const Task t{slot->op, slot->a_row0, slot->b_row0, slot->b_row1, slot->c_row0,
                 slot->c_col0, slot->m_valid, k_blocks};
    const bool amn = t.op & kAMN, bmn = t.op & kBMN;
    const bool narrow = Problem::kNarrowTiles && bmn && (t.op & kHalfN);
    const int b_boxes = narrow ? Cfg::BN / 128 : Cfg::BN / 64;
    const bool gat = prob.gathers(t), gat_b = gat && prob.gather(t).b, gat_a = gat && !gat_b;
    mbar_wait(&sm.empty()[ps.idx()], ps.phase() ^ 1, 102);
    uint64_t* bar = &sm.full()[ps.idx()];
    const int k0 = kb * Cfg::BK;
    if (lead) {  // the operand that is not gathered comes by TMA
      const CUtensorMap *ta = prob.map_a(t), *tb = prob.map_b(t);
      mbar_arrive_expect_tx(bar, (gat_a ? 0 : Cfg::A_BYTES) + (gat_b ? 0 : b_boxes * kBox));
      if (!gat_a) load_a_slice<Cfg>(sm.a_stage(ps.idx()), ta, bar, t, k0, amn, 0, Cfg::BM / 64);
      if (!gat_b) load_b_slice<Cfg>(sm.b_stage(ps.idx()), tb, bar, t, k0, bmn, b_boxes);
    }
    __syncwarp();
    if (gat_a) {
      if (amn)
        gather_mn_major<LD, K>(sm.a_stage(ps.idx()), prob.gather(t), t.b_row1 + k0, t.a_row0,
                               Cfg::BM / 64, w);
      else
        gather_k_major<LD, K>(sm.a_stage(ps.idx()), prob.gather(t), t.c_row0, k0, w);
    }
    if (gat_b)
      gather_mn_major<LD, K>(sm.b_stage(ps.idx()), prob.gather(t), t.b_row1 + k0, t.b_row0,
                             b_boxes, w);
    cp_async_mbar_arrive(bar);
    ps.template advance<Cfg::STAGES>();
  }
}

// ---------------------------------------------------------------- consumer mainloop
// One consumer warpgroup (cwg = 0/1 -> tile rows 64*cwg ..) accumulates its 64 x BN block.
// One wgmma group stays in flight: after committing K-slice kb we wait for slice kb-1 and
// only then hand its stage back, so the tensor core never idles on the release handshake.
// TA / TB: A / B MN-major (see wgmma.cuh for the two descriptor forms). Returns false when
// a stage never arrived (the caller records it and stops). hand_over (ping-pong; 0: none):
// the named barrier the other warpgroup waits on for its turn, arrived on once the last
// wgmma is issued, so its first ones queue behind this chain's tail instead of waiting for it.
// NARROW: a kHalfN task's mainloop, N = BN/2 into the first half of the accumulators.
// gathered: an operand of the stage was written by cp.async (produce_tile_gather), ordinary
// writes that the wgmma's async proxy reads only after a proxy fence.
template <class Cfg, int TA = 0, int TB = 0, bool NARROW = false>
MOKGEN_DEV bool consume_tile(const GemmSmem<Cfg>& sm, PipeState& ps, const Task& t,
                             float (&acc)[Cfg::kAccRegs], int cwg, uint32_t hand_over = 0,
                             bool gathered = false) {
  using Mma = Wgmma<NARROW ? Cfg::BN / 2 : Cfg::BN>;
  float(&d)[Mma::kRegs] = *reinterpret_cast<float(*)[Mma::kRegs]>(&acc[0]);
  const bool lane0 = (threadIdx.x & 31) == 0;
  if (t.k_blocks <= 0) {
#pragma unroll
    for (int i = 0; i < Cfg::kAccRegs; ++i) acc[i] = 0.f;
    if (hand_over) named_bar_arrive(hand_over, 256);
    return true;
  }
  int prev = -1;
  bool ok = true;
  wgmma_fence_regs(acc);
  for (int kb = 0; kb < t.k_blocks; ++kb) {
    ok &= mbar_wait_lean(&sm.full()[ps.idx()], ps.phase());
    if (gathered) fence_proxy_async_smem();
    // a warpgroup's 64 A rows are 8 KB in either layout
    const uint8_t* a = sm.a_stage(ps.idx()) + cwg * 64 * 128;
    const uint64_t da = TA ? make_desc_mnmajor_sw128(a) : make_desc_kmajor_sw128(a);
    const uint64_t db = TB ? make_desc_mnmajor_sw128(sm.b_stage(ps.idx()))
                           : make_desc_kmajor_sw128(sm.b_stage(ps.idx()));
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Cfg::BK / 16; ++kk)
      Mma::template mma<TA, TB>(d, TA ? desc_advance_k16_mn(da, kk) : desc_advance_k16(da, kk),
                                TB ? desc_advance_k16_mn(db, kk) : desc_advance_k16(db, kk),
                                (kb | kk) != 0);
    wgmma_commit();
    wgmma_wait<1>();
    if (prev >= 0) {
      __syncwarp();
      if (lane0) mbar_arrive(&sm.empty()[prev]);
    }
    prev = (int)ps.idx();
    ps.template advance<Cfg::STAGES>();
  }
  if (hand_over) named_bar_arrive(hand_over, 256);
  wgmma_wait<0>();
  wgmma_fence_regs(acc);
  __syncwarp();
  if (lane0) mbar_arrive(&sm.empty()[prev]);
  return ok;
}

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

// ---------------------------------------------------------------- epilogue walkers
__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Output columns that exist in a BN-wide tile at column c0 of a W-wide output (a multiple of
// 8). When W is a multiple of BN (every tile full) this is the constant BN and the column
// masks below fold away: full-width shapes compile exactly as without them. Otherwise the
// last tile of the row is an edge tile; its B rows past W are zero-filled by TMA (MN-major B:
// W is the tensor map's width) or are other rows (K-major B: the next expert's), and the
// epilogue drops those columns.
template <int W, int BN>
MOKGEN_DEV int cols_valid(int c0) {
  if constexpr (W % BN == 0) return BN;
  else return min(BN, W - c0);
}
// The same along M: rows that exist in a BM-tall tile at row r0 of a W-tall output (the
// weight gradients, whose M is a width: their A operand is zero-filled past it).
template <int W, int BM>
MOKGEN_DEV int rows_valid(int r0) { return cols_valid<W, BM>(r0); }

// Narrow edge tiles. A BN = 256 tile at column c0 whose columns past BN/2 are all past the
// width W runs its mainloop at N = BN/2 (Task::op bit kHalfN, from half_bit): half the MMA
// time of a tile that is at most half useful, and an MN-major B brings half its boxes
// (produce_tile). Its accumulators past BN/2 stay as ConsumerAcc zeroed them; a full-width
// edge tile computed zeros there from zero-filled B (MN-major) or columns the epilogue drops
// (K-major), so every epilogue sees what it saw. Shapes whose W % 256 is in (0, 128] have
// such a tile (an odd multiple of 128, or 2880 = 11 x 256 + 64): DeepSeek-V2-Lite's I = 1408,
// gpt-oss's D = 2880. Only their kernels compile the narrow mainloop (Problem::kNarrowTiles);
// every other shape's code is as without it.
template <int W, int BN>
constexpr bool half_edge() { return BN == 256 && W % BN != 0 && W % BN <= BN / 2; }
template <int W, int BN>
MOKGEN_DEV int half_bit(int c0) {
  if constexpr (half_edge<W, BN>()) return c0 + BN / 2 >= W ? kHalfN : 0;
  else return 0;
}

// Accumulator layout (see wgmma.cuh): thread (warp w in its warpgroup, lane l) holds for
// even r: row = 64*cwg + 16*w + l/4 + 8*((r/2)%2), cols c = 8*(r/4) + 2*(l%4) and c+1.
// f(row_in_tile, col_in_tile, v_c, v_c1) is called once per pair with row < m_valid and
// col < n_valid only (n_valid a multiple of 8: an 8-column group is in or out as a whole).
// T = float: f may take v_c, v_c1 by reference and update the accumulators.
template <int BN, class T, class F>
MOKGEN_DEV void for_each_acc_pair(T (&acc)[BN / 2], int cwg, int m_valid, F&& f,
                                  int n_valid = BN) {
  const int w = (threadIdx.x >> 5) & 3, l = threadIdx.x & 31;
  const int row_base = 64 * cwg + 16 * w + (l >> 2);
#pragma unroll
  for (int r = 0; r < BN / 2; r += 2) {
    const int row = row_base + 8 * ((r >> 1) & 1);
    const int col = 8 * (r >> 2) + 2 * (l & 3);
    if (row < m_valid && 8 * (r >> 2) < n_valid) f(row, col, acc[r], acc[r + 1]);
  }
}
// Dual-B: accumulator columns [0, BN/2) are gate, [BN/2, BN) are up, and register r + BN/4
// holds column col(r) + BN/2, i.e. the same output column. f(row, col, g0, g1, u0, u1) with
// col in [0, n_valid) (an edge tile's gate half runs into the up rows, and its up half into
// the next expert's rows, past the width: those columns are dropped).
template <int BN, class F>
MOKGEN_DEV void for_each_dual_pair(const float (&acc)[BN / 2], int cwg, int m_valid, F&& f,
                                   int n_valid = BN / 2) {
  const int w = (threadIdx.x >> 5) & 3, l = threadIdx.x & 31;
  const int row_base = 64 * cwg + 16 * w + (l >> 2);
#pragma unroll
  for (int r = 0; r < BN / 4; r += 2) {
    const int row = row_base + 8 * ((r >> 1) & 1);
    const int col = 8 * (r >> 2) + 2 * (l & 3);
    if (row < m_valid && 8 * (r >> 2) < n_valid)
      f(row, col, acc[r], acc[r + 1], acc[r + BN / 4], acc[r + 1 + BN / 4]);
  }
}

// A row's 8 consecutive columns at a time, for 16-byte loads and stores: a warp's access
// then covers 64 contiguous bytes of each of its 8 rows where a pair's covers 16 (half a
// sector each), so an epilogue issues a quarter of the instructions for half the sectors
// (trace.cuh put the pairwise SwiGLU backward at 29 us a 128 x 256 tile, half its mainloop).
// quad_transpose: the 4 lanes of a quad (one row) trade their pairs. On entry lane q holds
// e[i] = columns 8 (4 g + i) + 2 q, +1; on exit e[i] = columns 8 (4 g + q) + 2 i, +1, the
// 8 columns of group 4 g + q. Two xor-shuffle rounds; selects, not a runtime index (that
// would put e in local memory).
// One round with lane q ^ M: a lane with bit M set trades its elements A0, A1, the other
// its B0, B1 (the partner's, which sit where its own went).
template <int M, int A0, int A1, int B0, int B1>
MOKGEN_DEV void quad_trade(float2 (&e)[4]) {
  const bool a = threadIdx.x & M;
  const float2 s0 = a ? e[A0] : e[B0], s1 = a ? e[A1] : e[B1];
  const float2 r0 = make_float2(__shfl_xor_sync(~0u, s0.x, M), __shfl_xor_sync(~0u, s0.y, M));
  const float2 r1 = make_float2(__shfl_xor_sync(~0u, s1.x, M), __shfl_xor_sync(~0u, s1.y, M));
  e[A0] = a ? r0 : e[A0];
  e[A1] = a ? r1 : e[A1];
  e[B0] = a ? e[B0] : r0;
  e[B1] = a ? e[B1] : r1;
}
MOKGEN_DEV void quad_transpose(float2 (&e)[4]) {
  quad_trade<2, 0, 1, 2, 3>(e);  // the off-diagonal 2 x 2 blocks
  quad_trade<1, 0, 2, 1, 3>(e);  // inside each 2 x 2 block
}
// The 8 columns of accumulator group j (registers 4 j + 2 h, +1 of the 4 lanes) of groups
// 4 g .. 4 g + 3, half h, after quad_transpose: lane q gets group 4 g + q. OFF: register
// offset (dual-B: BN / 4 for the up half).
template <int OFF, int N>
MOKGEN_DEV void oct_of(const float (&acc)[N], int g, int h, float (&v)[8]) {
  float2 e[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) e[i] = make_float2(acc[OFF + 16 * g + 4 * i + 2 * h],
                                                 acc[OFF + 16 * g + 4 * i + 2 * h + 1]);
  quad_transpose(e);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = e[i].x;
    v[2 * i + 1] = e[i].y;
  }
}
// f(row, col, v): v[0..7] = columns col .. col + 7 of tile row `row`, once per group with
// row < m_valid and col < n_valid (a multiple of 8). Bit 3 of row is the thread's half h
// (its rows are row_base and row_base + 8). Every lane shuffles before the masks: call it
// from whole warps.
template <int BN, class F>
MOKGEN_DEV void for_each_acc_oct(const float (&acc)[BN / 2], int cwg, int m_valid, F&& f,
                                 int n_valid = BN) {
  static_assert(BN % 32 == 0, "groups of 8 columns, 4 to a quad");
  const int w = (threadIdx.x >> 5) & 3, l = threadIdx.x & 31;
  const int row_base = 64 * cwg + 16 * w + (l >> 2);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int g = 0; g < BN / 32; ++g) {
      float v[8];
      oct_of<0>(acc, g, h, v);
      const int row = row_base + 8 * h, col = 8 * (4 * g + (l & 3));
      if (row < m_valid && col < n_valid) f(row, col, v);
    }
  }
}
// Dual-B (see for_each_dual_pair): f(row, col, gate[8], up[8]) for output columns col ..
// col + 7 in [0, n_valid).
template <int BN, class F>
MOKGEN_DEV void for_each_dual_oct(const float (&acc)[BN / 2], int cwg, int m_valid, F&& f,
                                  int n_valid = BN / 2) {
  static_assert(BN % 64 == 0, "groups of 8 columns, 4 to a quad, in each half");
  const int w = (threadIdx.x >> 5) & 3, l = threadIdx.x & 31;
  const int row_base = 64 * cwg + 16 * w + (l >> 2);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int g = 0; g < BN / 64; ++g) {
      float gv[8], uv[8];
      oct_of<0>(acc, g, h, gv);
      oct_of<BN / 4>(acc, g, h, uv);
      const int row = row_base + 8 * h, col = 8 * (4 * g + (l & 3));
      if (row < m_valid && col < n_valid) f(row, col, gv, uv);
    }
  }
}
// 8 floats as 8 bf16 (one 16-byte vector), and back.
MOKGEN_DEV uint4 bf16x8(const float (&v)[8]) {
  uint4 o;
  uint32_t* w = reinterpret_cast<uint32_t*>(&o);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 b = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    w[i] = *reinterpret_cast<const uint32_t*>(&b);
  }
  return o;
}
MOKGEN_DEV void floats_of_bf16x8(uint4 raw, float (&v)[8]) {
  const uint32_t* w = reinterpret_cast<const uint32_t*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[i]));
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

// Named barriers of the consumer warpgroups (0 is __syncthreads): kBarTile, both warpgroups
// at the end of a cooperative tile; ping-pong: kBarTurn + h, warpgroup h may run its
// mainloop (the other arrives once its own is issued: consume_tile); kBarDone + (task parity),
// both halves of a task are stored (warpgroup 0 arrives, warpgroup 1 waits and signals);
// SIGNAL_WARP: kBarSignal + task slot, both consumer warpgroups have stored the slot's task
// (they arrive, the signal warp waits).
// store_rows_tma: kBarEpi + warpgroup, its 128 threads around each staged box.
enum : uint32_t { kBarTile = 1, kBarTurn = 2, kBarDone = 4, kBarSignal = 6, kBarEpi = 10 };

// A warpgroup's 64 x BN fp32 accumulators (rows 64 cwg .. of the tile) stored as bf16 through
// shared memory with TMA, instead of each thread's 4-byte stores (a warp's store then covers
// 8 rows x 16 B: half-filled sectors, and the warpgroup's next mainloop waits until all are
// issued). 64-column chunks, each a 64 x 64 box (8 KB, 128B-swizzled: a row's 16-byte chunk
// c sits at c ^ (row % 8), so the 8 rows of a warp's shared store hit distinct banks), in
// NBUF buffers of `stage` (NBUF x 8 KB of this warpgroup's, 1024-aligned) in turn; one
// thread (the warpgroup's first) writes each box to global memory with a bulk tensor store,
// so the writes to global memory run under the next chunks and the next tile's mainloop.
// One barrier a chunk: before it, the issuer waits until the store of the chunk whose
// buffer the next chunk fills has read it (none with NBUF = BN / 64 buffers, a row block's
// every chunk: the tile then never waits on its own stores), and on entry until every store
// of the last call has (its chunks used every buffer). Rows and columns past the map's
// bounds (an edge tile) are dropped by TMA; chunks from n_valid on are not issued.
// (col0, row0, z): the warpgroup's first output element in the map's coordinates (z: the
// matrix of a 3D map). add: each box is added into the tensor (tma_reduce_add_3d) instead.
template <int BN, int NBUF = 2>
MOKGEN_DEV void store_rows_tma(const float (&acc)[BN / 2], int cwg, uint8_t* stage,
                               const CUtensorMap* map, int col0, int row0, int z,
                               int n_valid, bool add = false) {
  static_assert(NBUF >= 2 && NBUF <= BN / 64, "two buffers at least, a chunk each at most");
  const int w = (threadIdx.x >> 5) & 3, l = threadIdx.x & 31;
  const bool issuer = (threadIdx.x & 127) == 0;
  const uint32_t bar = kBarEpi + cwg;
  if (issuer) bulk_wait_read<0>();
  named_bar_sync(bar, 128);
#pragma unroll
  for (int q = 0; q < BN / 64; ++q) {
    if (64 * q >= n_valid) break;
    uint8_t* box = stage + (q % NBUF) * 8192;
#pragma unroll
    for (int g = 0; g < 8; ++g) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {  // accumulator pair 4 j + 2 hh: row + 8 hh, group j
        const int r = 16 * w + (l >> 2) + 8 * hh, a = 4 * (8 * q + g) + 2 * hh;
        const __nv_bfloat162 v = __floats2bfloat162_rn(acc[a], acc[a + 1]);
        const uint32_t off = r * 128 + ((g ^ (r & 7)) << 4) + (l & 3) * 4;
        asm volatile("st.shared.b32 [%0], %1;" ::"r"(smem_u32(box + off)),
                     "r"(*reinterpret_cast<const uint32_t*>(&v)) : "memory");
      }
    }
    fence_proxy_async_shared();  // this thread's writes, before the async proxy reads them
    // chunk q + 1 fills chunk q + 1 - NBUF's buffer: that store must have read it (stores
    // committed so far: chunks .. q - 1, of which the newest NBUF - 2 may still be reading)
    if (issuer && q + 1 >= NBUF && q + 1 < BN / 64 && 64 * (q + 1) < n_valid)
      bulk_wait_read<NBUF - 2>();
    named_bar_sync(bar, 128);
    if (issuer) {
      if (add) tma_reduce_add_3d(map, box, col0 + 64 * q, row0, z);
      else tma_store_3d(map, box, col0 + 64 * q, row0, z);
      bulk_commit();
    }
  }
}

// The logistic function, 1 / (1 + 2^(-x log2 e)) with the exponential as PTX ex2.approx.ftz:
// __expf compiles to the non-ftz ex2, which guards each element for a subnormal result (one
// FSETP and a fix-up an element: 385 more instructions in Qwen3's backward megakernel).
// Flushing changes nothing here: such a result (x > 87) only meets 1 + it. x < -88: ex2 gives
// inf and __fdividef 0 (its range guard; with numerator 1 it compiles to the bare MUFU.RCP),
// so silu(x) = x * 0 = 0 as before. Otherwise the same arithmetic as __fdividef(x, 1 +
// __expf(-x)) before (PTX div.approx is a times rcp.approx of b).
MOKGEN_DEV float sigmoid(float x) {
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(-1.4426950408889634f * x));
  return __fdividef(1.f, 1.f + e);
}
MOKGEN_DEV float silu(float x) { return x * sigmoid(x); }

// Epilogue stores, 8 columns (16 or 32 bytes) at a time (for_each_acc_oct / _dual_oct), or
// with kOct = false a pair (4 or 8 bytes) at a time: the fp8 kernels, whose consumers have
// no registers to spare (the 8-column walk spilled 8 B in the signal-warp fp8 backward).
// Gate/up + SwiGLU: act[r * ld + c] = silu(g) u and, unless pre is null, the pre-activations
// pre[r * 2 ld + c] = g, pre[r * 2 ld + ld + c] = u (a backward reads them).
template <int BN, bool kOct = true>
MOKGEN_DEV void store_gate_up(const float (&acc)[BN / 2], int cwg, int m_valid,
                              __nv_bfloat16* pre, __nv_bfloat16* act, int ld, int n_valid) {
  if constexpr (kOct) {
    for_each_dual_oct<BN>(acc, cwg, m_valid,
                          [&](int r, int c, const float (&g)[8], const float (&u)[8]) {
      float a[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) a[i] = silu(g[i]) * u[i];
      *reinterpret_cast<uint4*>(act + (size_t)r * ld + c) = bf16x8(a);
      if (pre) {
        *reinterpret_cast<uint4*>(pre + (size_t)r * 2 * ld + c) = bf16x8(g);
        *reinterpret_cast<uint4*>(pre + (size_t)r * 2 * ld + ld + c) = bf16x8(u);
      }
    }, n_valid);
  } else {
    for_each_dual_pair<BN>(acc, cwg, m_valid,
                           [&](int r, int c, float g0, float g1, float u0, float u1) {
      *reinterpret_cast<__nv_bfloat162*>(act + (size_t)r * ld + c) =
          __floats2bfloat162_rn(silu(g0) * u0, silu(g1) * u1);
      if (pre) {
        *reinterpret_cast<__nv_bfloat162*>(pre + (size_t)r * 2 * ld + c) =
            __floats2bfloat162_rn(g0, g1);
        *reinterpret_cast<__nv_bfloat162*>(pre + (size_t)r * 2 * ld + ld + c) =
            __floats2bfloat162_rn(u0, u1);
      }
    }, n_valid);
  }
}
// fp32 rows: out[r * ld + c ..] = the accumulators.
template <int BN, bool kOct = true>
MOKGEN_DEV void store_f32(const float (&acc)[BN / 2], int cwg, int m_valid, float* out, int ld,
                          int n_valid) {
  if constexpr (kOct) {
    for_each_acc_oct<BN>(acc, cwg, m_valid, [&](int r, int c, const float (&v)[8]) {
      float4* o = reinterpret_cast<float4*>(out + (size_t)r * ld + c);
      o[0] = make_float4(v[0], v[1], v[2], v[3]);
      o[1] = make_float4(v[4], v[5], v[6], v[7]);
    }, n_valid);
  } else {
    for_each_acc_pair<BN>(acc, cwg, m_valid, [&](int r, int c, float v0, float v1) {
      *reinterpret_cast<float2*>(out + (size_t)r * ld + c) = make_float2(v0, v1);
    }, n_valid);
  }
}
// Each of the thread's two rows (half h: bit 3 of the tile row) to its own destination row
// dst[h] (nullptr: none), times scale[h], as bf16: rows scattered to their tokens' owners.
template <int BN, bool kOct = true>
MOKGEN_DEV void store_rows_to(const float (&acc)[BN / 2], __nv_bfloat16* const (&dst)[2],
                              const float (&scale)[2], int n_valid) {
  if constexpr (kOct) {
    for_each_acc_oct<BN>(acc, 0, 1 << 30, [&](int r, int c, const float (&v)[8]) {
      const int h = (r >> 3) & 1;
      if (dst[h] == nullptr) return;
      float o[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) o[i] = v[i] * scale[h];
      *reinterpret_cast<uint4*>(dst[h] + c) = bf16x8(o);
    }, n_valid);
  } else {
    for_each_acc_pair<BN>(acc, 0, 1 << 30, [&](int r, int c, float v0, float v1) {
      const int h = (r >> 3) & 1;
      if (dst[h] != nullptr)
        *reinterpret_cast<__nv_bfloat162*>(dst[h] + c) =
            __floats2bfloat162_rn(v0 * scale[h], v1 * scale[h]);
    }, n_valid);
  }
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

// The mainloop a task's operand bits ask for: fp8 (kF8), MN-major operands (kAMN / kBMN), or
// the plain K-major one; only the variants the Problem can issue are compiled. hand_over:
// consume_tile's (the fp8 mainloop drains every slice itself: it hands over at its end).
// Whether Problem gathers operand rows (its kGather; Problems without one do not).
template <class P, class = void>
struct GatherTrait { static constexpr bool value = false; };
template <class P>
struct GatherTrait<P, decltype(void(P::kGather))> { static constexpr bool value = P::kGather; };
template <class P>
__host__ __device__ constexpr bool gathers_rows() { return GatherTrait<P>::value; }

template <class Cfg, class Problem>
MOKGEN_DEV bool consume(const Problem& prob, const GemmSmem<Cfg>& sm, PipeState& ps,
                        const Task& t, float (&acc)[Cfg::kAccRegs + Cfg::kScratch], int cwg,
                        uint32_t hand_over = 0) {
  float(&acc0)[Cfg::kAccRegs] = *reinterpret_cast<float(*)[Cfg::kAccRegs]>(&acc[0]);
  if constexpr (Problem::kQ > 0) {
    if (t.op & kF8) {
      if constexpr (Problem::kNarrowTiles) {
        if (t.op & kHalfN) {
          const bool ok = consume_tile_fp8<Cfg, true>(sm, ps, t, acc, cwg, prob.wsb(t));
          if (hand_over) named_bar_arrive(hand_over, 256);
          return ok;
        }
      }
      const bool ok = consume_tile_fp8<Cfg>(sm, ps, t, acc, cwg, prob.wsb(t));
      if (hand_over) named_bar_arrive(hand_over, 256);
      return ok;
    }
  }
  bool g = false;  // constant false where the Problem gathers nothing: folds away
  if constexpr (gathers_rows<Problem>()) g = prob.gathers(t);
  if constexpr (Problem::kNarrowTiles) {
    if (t.op & kHalfN) {
      if constexpr (Problem::kMNOperands) {
        if (t.op & kAMN) return consume_tile<Cfg, 1, 1, true>(sm, ps, t, acc0, cwg, hand_over, g);
        if (t.op & kBMN) return consume_tile<Cfg, 0, 1, true>(sm, ps, t, acc0, cwg, hand_over, g);
      }
      return consume_tile<Cfg, 0, 0, true>(sm, ps, t, acc0, cwg, hand_over, g);
    }
  }
  if constexpr (Problem::kMNOperands) {
    if (t.op & kAMN) return consume_tile<Cfg, 1, 1>(sm, ps, t, acc0, cwg, hand_over, g);
    if (t.op & kBMN) return consume_tile<Cfg, 0, 1>(sm, ps, t, acc0, cwg, hand_over, g);
  }
  return consume_tile<Cfg>(sm, ps, t, acc0, cwg, hand_over, g);
}

// ---------------------------------------------------------------- persistent driver
// Problem must provide (device):
//   static constexpr bool kMNOperands;         // tasks may set kAMN / kBMN
//   static constexpr bool kNarrowTiles;        // tasks may set kHalfN (half_bit)
//   void prefetch() const;                     // producer thread: tma_prefetch_desc(...)
//   static constexpr int kQ;                   // 0, or Cfg::Q: tasks may set kF8
//   Task next_task();                          // producer thread: next task or stop_task()
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
// have all reached L2, then the count. Raised by a consumer thread (thread 128), that wait
// holds its warp, and with it its warpgroup's next wgmma, for the whole drain of the tile's
// stores. With SIGNAL_WARP the consumers only arrive on the slot's barrier and go on to the
// next task's mainloop; the signal warp (signal_tasks) waits there, fences and signals, so
// the drain runs under the next tile's MMA. The fence is cumulative: the stores are ordered
// before it by the barrier (PTX memory model), as they were by kBarTile before. Measured on
// an H200 (commit 8b4fa71, backward): within 1-2% of the default on kimi ep 8, Qwen3 and
// Mixtral, so the default stays consumer-signalled: the epilogues' cost was their uncoalesced
// stores themselves (ncu), not the drain's wait (store_rows_tma fixed that for the weight
// gradients: backward 10.16 -> 7.82 ms on kimi ep 8).
template <class Cfg, class Problem>
MOKGEN_DEV void consumer_cooperative(Problem& prob, const GemmSmem<Cfg>& sm, int cwg) {
  PipeState ps, ts;
  int traced = 0;  // Cfg::TRACE: this CTA's tasks so far
  for (;;) {
    ConsumerAcc<Cfg> acc;
    const Task* slot = task_pop<Cfg>(sm, ts);
    if (slot == nullptr || slot->op < 0) break;
    const Task& t = *slot;
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
    if constexpr (Cfg::TRACE)
      if (rec) rec[kTrMain] = trace_clock();
    if (!ok) {  // a stage never arrived: record it and stop (see mbar_wait_lean)
      record_timeout(103, ps.phase());
      if constexpr (Cfg::SIGNAL_WARP) {  // the signal warp must not wait for us forever
        *sm.stopped() = 1;
        named_bar_arrive(kBarSignal + ts.idx(), 256 + 32);
      }
      break;
    }
    prob.epilogue(t, acc.main(), cwg);
    if constexpr (Cfg::TRACE)
      if (rec) rec[kTrEpi] = trace_clock();
    if constexpr (Cfg::SIGNAL_WARP) {
      named_bar_arrive(kBarSignal + ts.idx(), 256 + 32);
      ts.template advance<Cfg::TASK_SLOTS>();  // the signal warp frees the slot
    } else {
      named_bar_sync(kBarTile, 256);
      if (threadIdx.x == 128) prob.signal(t);
      task_release<Cfg>(sm, ts);
    }
    if constexpr (Cfg::TRACE)
      if (rec) rec[kTrDone] = trace_clock();
  }
}

// The signal warp (SIGNAL_WARP; warp 1, in the producer warpgroup): follows the task channel
// as the consumers do, waits for both consumer warpgroups to have stored each task, signals
// it and frees its slot (the producer can then reuse it). It waits on nothing but the
// consumers of the task at hand, so a task's signal never waits for a later task.
template <class Cfg, class Problem>
MOKGEN_DEV void signal_tasks(const Problem& prob, const GemmSmem<Cfg>& sm) {
  static_assert(kBarSignal + Cfg::TASK_SLOTS <= 16, "16 named barriers");
  PipeState ts;
  for (;;) {
    const Task* slot = task_pop<Cfg>(sm, ts);
    if (slot == nullptr || slot->op < 0) break;
    named_bar_sync(kBarSignal + ts.idx(), 256 + 32);
    if (*sm.stopped()) break;
    if ((threadIdx.x & 31) == 0) prob.signal(*slot);
    task_release<Cfg>(sm, ts);
  }
}

// Ping-pong consumers: warpgroup h does half h (rows 64 h ..) of every task, the halves'
// mainloops in turn (half 0 of task n, half 1 of task n, half 0 of task n+1, ...), each
// epilogue beside the other warpgroup's mainloop. The ring holds each task's half-0 slices,
// then its half-1 slices: a warpgroup steps its ring state past the other's.
// Each named barrier sees, in turn, one warpgroup's arrive and the other's sync, never two
// arrives in a row: turn 0 is given once up front (warpgroup 1 arrives before its first
// task) and then after each of warpgroup 1's mainloops, turn 1 after each of warpgroup 0's,
// and warpgroup 0 takes turn 0 once more at the stop, so every arrive has its sync. A task's
// done barrier alternates between two ids by task parity (the task slot's, TASK_SLOTS being
// even): warpgroup 0 arrives for task n + 2 only after its turn for n + 2, which warpgroup 1
// gives after its sync on task n's. Nothing here is held in a register across the mainloop
// but the two ring states (the fp8 consumers have none to spare).
// A mainloop that times out is recorded; the warpgroup then skips that epilogue but keeps
// the barrier protocol, so its sibling never waits on a barrier forever (the producer
// hands out stop once the kernel is aborted).
template <class Cfg, class Problem>
MOKGEN_DEV void consumer_pingpong(Problem& prob, const GemmSmem<Cfg>& sm, int h) {
  static_assert(Cfg::TASK_SLOTS % 2 == 0, "the done barrier's id follows the slot's parity");
  PipeState ps, ts;
  if (h == 1) named_bar_arrive(kBarTurn, 256);  // warpgroup 0 runs the first mainloop
  for (;;) {
    ConsumerAcc<Cfg> acc;
    const Task* slot = task_pop<Cfg>(sm, ts);
    if (slot == nullptr || slot->op < 0) {
      if (h == 0) named_bar_sync(kBarTurn, 256);  // warpgroup 1's last turn handed back
      break;
    }
    const Task& t = *slot;
    if (h == 1) ps.template advance_by<Cfg::STAGES>(t.k_blocks);  // past half 0
    named_bar_sync(kBarTurn + h, 256);
    const bool ok = consume<Cfg, Problem>(prob, sm, ps, t, acc.r, h, kBarTurn + (h ^ 1));
    if (h == 0) ps.template advance_by<Cfg::STAGES>(t.k_blocks);  // past half 1
    if (ok) prob.epilogue(t, acc.main(), h);
    else record_timeout(103, ps.phase());
    const uint32_t done = kBarDone + (ts.idx() & 1);
    if (h == 0) {
      named_bar_arrive(done, 256);
    } else {
      named_bar_sync(done, 256);
      if (threadIdx.x == 256) prob.signal(t);
    }
    task_release<Cfg>(sm, ts);
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
  if (lead) prob.prefetch();
  PipeState ps, ts, tp;  // ring, task channel as read, task channel as written (thread 0)
  for (int i = 0;; ++i) {
    if (lead) {
      uint64_t ask = 0;
      if constexpr (Cfg::TRACE) ask = trace_clock();
      const Task t = prob.next_task();
      if constexpr (Cfg::TRACE) {
        if (unsigned long long* rec = t.op < 0 ? nullptr : trace_rec(i)) {
          rec[kTrOp] = (unsigned)t.op | ((unsigned long long)t.k_blocks << 32);
          rec[kTrAsk] = ask;
          rec[kTrGot] = trace_clock();
        }
      }
      task_push<Cfg>(sm, tp, t);
    }
    __syncwarp();
    const Task* slot = task_pop<Cfg>(sm, ts);
    if (slot == nullptr || slot->op < 0) break;
    produce_tile_gather<Cfg>(prob, sm, ps, slot);
    ts.template advance<Cfg::TASK_SLOTS>();
  }
}

template <class Cfg, class Problem>
MOKGEN_DEV void gemm_persistent(Problem& prob, uint8_t* dyn_smem) {
  constexpr bool kGather = gathers_rows<Problem>();
  static_assert(!kGather || (Problem::kQ == 0 && !Cfg::PINGPONG && !Cfg::SIGNAL_WARP),
                "gathered operands: bf16 tiles, cooperative consumers, no signal warp (every "
                "producer warp gathers)");
  const GemmSmem<Cfg> sm = GemmSmem<Cfg>::carve(dyn_smem);
  if (threadIdx.x == 0) sm.init(kGather ? 1 + 32 * kGatherWarps : 1);
  __syncthreads();
  const int wg = warpgroup_idx();
  if (wg == 0) {
    setmaxnreg_dec<kGather ? Cfg::kGatherProducerRegs : Cfg::kProducerRegs>();
    if constexpr (Cfg::SIGNAL_WARP)
      if (threadIdx.x >= 32 && threadIdx.x < 64) signal_tasks<Cfg>(prob, sm);
    if constexpr (kGather) {
      produce_gathering<Cfg>(prob, sm);  // the whole warpgroup
    } else if (threadIdx.x < 32 && elect_one()) {
      prob.prefetch();
      PipeState ps, ts;
      for (int i = 0;; ++i) {
        uint64_t ask = 0;
        if constexpr (Cfg::TRACE) ask = trace_clock();
        const Task t = prob.next_task();
        if constexpr (Cfg::TRACE) {  // the consumers' thread 128 adds
          // the rest of the record (consumer_cooperative; ping-pong records none of it)
          if (unsigned long long* rec = t.op < 0 ? nullptr : trace_rec(i)) {
            rec[kTrOp] = (unsigned)t.op | ((unsigned long long)t.k_blocks << 32);
            rec[kTrAsk] = ask;
            rec[kTrGot] = trace_clock();
          }
        }
        task_push<Cfg>(sm, ts, t);
        if (t.op < 0) break;
#pragma unroll 1
        for (int h = 0; h < (Cfg::PINGPONG ? 2 : 1); ++h) {  // ping-pong: each half in turn
          if constexpr (Problem::kQ > 0) {
            if (t.op & kF8) {
              produce_tile_fp8<Cfg, Problem::kNarrowTiles>(sm, ps, prob.map_a(t), prob.map_b(t),
                                                           prob.map_sa(t), prob.map_sb(t), t);
              continue;
            }
          }
          produce_tile<Cfg, Problem::kNarrowTiles>(sm, ps, prob.map_a(t), prob.map_b(t), t,
                                                   Cfg::PINGPONG ? h : -1);
        }
      }
    }
  } else {
    setmaxnreg_inc<kGather ? Cfg::kGatherConsumerRegs : Cfg::kConsumerRegs>();
    if constexpr (Cfg::PINGPONG) consumer_pingpong<Cfg>(prob, sm, wg - 1);
    else consumer_cooperative<Cfg>(prob, sm, wg - 1);
    // store_rows_tma's last stores read shared memory, which ends with the CTA
    if constexpr (Cfg::EPI_BYTES > 0) bulk_wait<0>();
  }
}

}  // namespace mokgen
