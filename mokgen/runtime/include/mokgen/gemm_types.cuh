// mokgen/gemm_types.cuh -- the GEMM tile engine's vocabulary: tasks and their operand bits,
// ring state, the engine configuration (GemmCfg), its shared-memory layout (GemmSmem) and the
// consumer warpgroups' named barriers. gemm_tile.cuh (the engine), gemm_fp8.cuh (its e4m3
// tiles) and gemm_epilogue.cuh (the accumulators' walkers and stores) share them.
#pragma once
#include <cuda_bf16.h>

#include "mokgen/ptx.cuh"

namespace mokgen {

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

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
// kOpUserShift .. 26 are the Problem's to carry what its epilogue needs (op stays >= 0).
// kHalfN: a narrow edge tile (gemm_epilogue.cuh half_bit). kPairPad, kMcast (GemmCfg::PAIR
// kernels only, set by the engine's producer: gemm_tile.cuh produce_pairs): a task of
// k_blocks slices that only keep the pair's rings in step (no MMA, no epilogue, no signal); a
// task whose B the two CTAs of the pair load half each, multicast to both. The Problem's bits
// end below kPairPad in kernels that may be PAIR.
enum : int {
  kOpcodeMask = 0xff, kBMN = 1 << 8, kAMN = 1 << 9, kF8 = 1 << 10, kOpUserShift = 11,
  kPairPad = 1 << 27, kMcast = 1 << 28, kHalfN = 1 << 30
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
  kProfNoDgradStores = 1024u,  // ... and stores neither dh nor w a (results wrong)
  // gathered operands (GATHER plans): ring-layout row p reads token p mod n, not the table's:
  // the same cp.async from rows in order (what scattered rows cost; results wrong)
  kProfGatherInOrder = 2048u,
  // gathered stages: the consumers skip their proxy fence (what it costs; results may race)
  kProfGatherNoFence = 4096u,
  // gathered stages: lane 0 of each producer warp alone polls the empty barrier, the warp
  // follows it (__syncwarp): what 128 threads polling one mbarrier cost; results right
  kProfGatherOneWaiter = 8192u,
  // the bf16 mainloops issue no wgmma (stages still wait full, then free): how fast the ring
  // fills when no tensor core reads shared memory (results wrong)
  kProfNoMma = 16384u,
  // the forward's routed gate/up and down epilogues (bf16): every value computed, converted
  // and shuffled, but not stored (gemm_epilogue.cuh store_kept): what the stores cost of them
  kProfFwdSinkStores = 32768u,
  // the forward's routed down rows: in order to combine row p, router weight 1, without
  // their table entry and weight loads: what those loads and the scatter cost (results wrong)
  kProfDownInOrder = 65536u
};

template <int BN_, int STAGES_, int Q_ = 0, unsigned PROF_ = 0, int TASK_SLOTS_ = 4,
          int EPI_BYTES_ = 0, bool PAIR_ = false>
struct GemmCfg {
  static constexpr int BM = 128, BK = 64, BN = BN_, Q = Q_;
  static constexpr unsigned PROF = PROF_;
  static constexpr bool TRACE = (PROF & kProfTrace) != 0;  // per-task clocks (trace.cuh)
  static constexpr int STAGES = STAGES_, TASK_SLOTS = TASK_SLOTS_;
  // shared memory the Problem's epilogues stage tiles in (GemmSmem::epi), after the rest
  static constexpr int EPI_BYTES = EPI_BYTES_;
  // CTA pairs (2-CTA clusters, gemm_tile.cuh produce_pairs): the two CTAs take their tasks two
  // at a time and keep their rings in step, so where both tasks read the same B (adjacent row
  // tiles under one expert's weight rows) each loads half of it, multicast to both
  static constexpr bool PAIR = PAIR_;
  static constexpr int kMailSlots = 4;  // PAIR: pairs rank 0 may claim ahead of rank 1
  static constexpr int kThreads = 384;
  static constexpr int kConsumerWarps = 8;
  // arrivals that free a stage: every consumer warp reads each stage; PAIR, every consumer
  // warp of both CTAs frees each stage of both (the peer's producer may multicast into it next)
  static constexpr int kStageFrees = kConsumerWarps * (PAIR ? 2 : 1);
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
  // PAIR's mailbox after the scales: full and empty barriers and an int a slot
  static constexpr int MAIL_BYTES = PAIR ? kMailSlots * (8 + 8 + 4) : 0;
  // the scheduler's `taken` barrier (gemm_tile.cuh schedule_tasks) last, 8 bytes: before
  // the task slots it moved the fp8 scales' TMA boxes off their 128-byte alignment
  static constexpr int TAKEN_AT = STAGES * (STAGE_BYTES + SC_BYTES) + BAR_BYTES +
                                  32 * TASK_SLOTS + MAIL_BYTES;
  static constexpr int ENGINE_BYTES = TAKEN_AT + 8;
  static constexpr int EPI_AT = (ENGINE_BYTES + 1023) / 1024 * 1024;  // 1024-aligned
  static constexpr int SMEM_BYTES = 1024 + (EPI_BYTES ? EPI_AT + EPI_BYTES : ENGINE_BYTES);
  // The producer warpgroup runs the Problem's schedule (next_task: its waits, the task's expert
  // and rows) beside the slices' TMA issue: at 40 registers the bf16 backwards spill it
  // (72-120 B, nvcc 13.0); 56 leaves the consumers 224, where no bf16 consumer code spills.
  // fp8 consumers keep 232 (their scratch beside the accumulators), their producers 40 (none
  // spills there).
  static constexpr int kProducerRegs = Q == 0 ? 56 : 40, kConsumerRegs = Q == 0 ? 224 : 232;
  // A scheduling thread takes the tasks one ahead of the producing thread (gemm_tile.cuh
  // schedule_tasks) where the producer warpgroup's registers hold the Problem's schedule
  // state: at the fp8 kernels' 40 its loop spills (nvcc 13.0, even with the decode's
  // BwdSchedule::launder; the producer's loop that takes its own tasks does not), so they
  // keep that one.
  // More producer registers are not free: setmaxnreg shares the launch's 168 a thread, so
  // 48 would leave the fp8 consumers 224, where they spill.
  static constexpr bool SCHEDULER = Q == 0;
  // producer warps that gather rows (produce_tile_gather) compute their addresses beside the
  // Problem's schedule state: 40 spills the backward with a shared expert (nvcc 13.0), 56
  // leaves the consumers 224, where none of their code spills
  static constexpr int kGatherProducerRegs = 56, kGatherConsumerRegs = 224;
  static_assert(BN == 128 || BN == 192 || BN == 256, "wgmma wrappers exist for N = 128, 192, "
                "256 (192: gemm_test.cu's whole-task ping-pong experiment only)");
  static_assert(STAGE_BYTES % 1024 == 0, "stages keep 1024 B alignment");
  static_assert(Q == 0 || ((Q == 128 || Q == 32) && BN == 256 && BM * BK8 == A_BYTES),
                "fp8 tiles: Q = 128 or 32, two 128-column halves, slices as large as bf16's");
  // setmaxnreg moves registers inside the CTA's pool, which holds what the launch allocated
  // (__launch_bounds__(384, 1): 168 a thread): a request past it waits forever
  static constexpr int kPool = 168 * kThreads;
  static_assert(kProducerRegs * 128 + kConsumerRegs * 256 <= kPool, "register pool");
  static_assert(kGatherProducerRegs * 128 + kGatherConsumerRegs * 256 <= kPool, "register pool");
  static_assert(!PAIR || Q == 0, "CTA pairs: bf16 tiles (produce_pairs)");
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
  // PAIR's mailbox (gemm_tile.cuh pair_post / pair_take), after the scales: [kMailSlots] a
  // pair's first task landed in rank 1 (count 1 + 4 tx bytes) / read by rank 1 (count 1,
  // arrived from there), then the slots' task indices
  MOKGEN_DEV uint64_t* mail_full() const {
    return reinterpret_cast<uint64_t*>(scales() + Cfg::STAGES * (Cfg::SC_BYTES / 4));
  }
  MOKGEN_DEV uint64_t* mail_empty() const { return mail_full() + Cfg::kMailSlots; }
  MOKGEN_DEV int* mail() const {
    return reinterpret_cast<int*>(mail_empty() + Cfg::kMailSlots);
  }

  // the producer has started streaming a task (count 1): the scheduler's pace
  // (gemm_tile.cuh schedule_tasks)
  MOKGEN_DEV uint64_t* taken() const { return reinterpret_cast<uint64_t*>(ring + Cfg::TAKEN_AT); }

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
  // The stages' barriers alone (one thread, then fence_mbarrier_init): full_count arrivals
  // fill a stage, empty_count free it. The test kernels with schedules of their own
  // (gemm_test.cu: cluster pairs, whole-task ping-pong) count their own readers.
  MOKGEN_DEV void init_stages(uint32_t full_count, uint32_t empty_count) const {
    for (int s = 0; s < Cfg::STAGES; ++s) {
      mbar_init(&full()[s], full_count);
      mbar_init(&empty()[s], empty_count);
    }
  }
  // One thread; the caller then __syncthreads() before the role split. full_count: the
  // producer's arrive with the TMA bytes, plus one per lane of the warps that gather rows
  // (produce_tile_gather).
  MOKGEN_DEV void init(uint32_t full_count = 1) const {
    init_stages(full_count, Cfg::kStageFrees);
    if constexpr (Cfg::PAIR) {
      for (int s = 0; s < Cfg::kMailSlots; ++s) {
        mbar_init(&mail_full()[s], 1);
        mbar_init(&mail_empty()[s], 1);
      }
    }
    mbar_init(taken(), 1);
    for (int s = 0; s < Cfg::TASK_SLOTS; ++s) {
      mbar_init(&task_full()[s], 1);
      mbar_init(&task_empty()[s], Cfg::kConsumerWarps);
    }
    fence_mbarrier_init();
  }
};


// Named barriers of the consumer warpgroups (0 is __syncthreads): kBarTile, both warpgroups
// at the end of a tile; store_rows_tma: kBarEpi + warpgroup, its 128 threads around each
// staged box. (gemm_test.cu's experiments use 2 and 3.)
enum : uint32_t { kBarTile = 1, kBarEpi = 10 };

}  // namespace mokgen
