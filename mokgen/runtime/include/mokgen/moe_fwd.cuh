// mokgen/moe_fwd.cuh -- the forward MoE megakernel: persistent, one CTA per SM.
//
// CTAs [0, COMM) are comm CTAs: they walk the minibatches in processing order (macrobatches
// last to first, so the ring ends holding macrobatch 0), wait until the ring slot's previous
// minibatch has left the down GEMM, pull the rows from their source ranks (pull dispatch)
// and raise the minibatch's GPU-local ready count; the first minibatch every CTA pulls a
// share of before taking its role (fwd_head_pull). The other CTAs are compute CTAs running
// the warp-specialized GEMM engine over one global task list (FwdSchedule): the shared expert
// first (it fills the first dispatch window), then per minibatch its gate/up tiles (fused
// SwiGLU into the ring) and its down tiles (times the router weight, pushed straight into the
// owner's combine buffer: push combine). Tasks are taken from an atomic counter in list order, and
// every task waits only on tasks earlier in the list or on comm, so taking them in any
// interleaving cannot deadlock and every output element is computed by exactly one tile in
// a fixed K order: the result is bitwise reproducible. There is no cross-rank wait inside.
// fp8 plans (FwdConsts::Q > 0) run the routed tiles in e4m3 (gemm_fp8.cuh): the comm CTAs
// pull rows their owners quantized (fp8.cuh), the gate/up epilogue quantizes the SwiGLU
// output for the down GEMM; the shared expert's tiles stay bf16.
#pragma once
#include <cuda_bf16.h>
#include "mokgen/combine.cuh"
#include "mokgen/fp8.cuh"
#include "mokgen/gemm_tile.cuh"
#include "mokgen/sync.cuh"

namespace mokgen {

enum FwdOp : int { kSharedGateUp = 0, kSharedDown = 1, kGateUp = 2, kDown = 3 };

// Watchdog phases of the forward (runtime/abi.py names them; the build checks the numbers).
enum FwdPhase : int { kPhaseSharedDown = 1, kPhaseGateUp = 2, kPhaseDown = 3, kPhaseRingSlot = 4 };

// Plan constants. B = minibatch rows, SLOTS = ring slots (ring rows = B * SLOTS). Q: the
// routed experts' operands, 0 = bf16, 128 = blockwise fp8, 32 = MXFP8 (fp8.cuh).
// Rows move the paper's way (3.1): the expert rank's comm CTAs pull the x rows it computes
// on (dispatch), its down tiles' epilogues push each weighted row to its owner (combine); the
// backward pulls dy (reverse-combine) and pushes dx (reverse-dispatch) alike.
// PD, PI: D and I as the routed experts' B operands lay them out. fp8: padded to whole 128 x
// 128 blocks per expert, W1 per gate / up half (runtime/moe.py pad_weight), so every weight
// tile and blockwise scale starts at a whole block of its expert's part, and dh's halves the
// same (swiglu_backward_fp8); D and I themselves otherwise (and for every width a multiple of 128).
// The backward (moe_bwd.cuh) instantiates the same constants.
// GATHER: one rank, bf16: no comm CTAs and no x or dy ring; the GEMMs that read x or dy rows
// gather them from the caller's tensors (gemm_tile.cuh GatherSrc): the forward's gate/up, the
// backward's replay, dgrad and weight gradients. The ring then holds every minibatch, so a
// ring row is its ring-layout position (the table's index).
// XPULL (a backward): its forward gathered x alone (limits.GATHER), so the ring holds no x
// rows: the comm CTAs pull x for every minibatch beside dy, not only for the replayed ones.
// DXRING (a backward, reverse_dispatch "ring"): one rank, bf16, a ring holding every
// minibatch; the routed dx tiles run last and write each row over its own dy row (its
// expert's dgrad and dW2 have read them: moe_bwd.cuh), the owner's sum gathers them there
// (combine.cuh combine_sum_at), so the backward writes no combine rows and its dy ring is
// those rows (runtime/peers.py combine_rows).
// XSLOTS (a backward with XPULL, passes/x_window.py): its x ring is a window of XSLOTS
// minibatch slots, not SLOTS: x rows are read only by the replay (one minibatch) and dW1
// (one expert's rows), so a slot is refilled once the dW1 tiles of every expert in it are done
// (moe_bwd.cuh bwd_comm_minibatch); dW1 reads its x rows through the window's wrap
// (BwdProblem::b_wrap). 0: the x ring is the ring.
template <int D_, int I_, int IS_, int K_, int L_, int R_, int B_, int SLOTS_, int COMM_,
          int Q_ = 0, bool GATHER_ = false, bool XPULL_ = false, bool DXRING_ = false,
          int XSLOTS_ = 0>
struct FwdConsts {
  static constexpr int D = D_, I = I_, IS = IS_, K = K_, L = L_, R = R_, B = B_, SLOTS = SLOTS_;
  static constexpr int COMM = COMM_, Q = Q_, RING_ROWS = B_ * SLOTS_;
  static constexpr bool GATHER = GATHER_;
  static_assert(!GATHER_ || (R_ == 1 && Q_ == 0 && COMM_ == 0),
                "gathered rows: one rank, bf16, no comm CTAs");
  static constexpr bool XPULL = XPULL_;
  static_assert(!XPULL_ || (R_ == 1 && Q_ == 0 && COMM_ > 0 && !GATHER_),
                "x pulled by the backward: one rank, bf16, comm CTAs, a backward that copies");
  static constexpr bool DXRING = DXRING_;
  static_assert(!DXRING_ || (R_ == 1 && Q_ == 0 && !GATHER_),
                "dx rows in the dy ring: one rank, bf16, a dy ring");
  static constexpr int XSLOTS = XSLOTS_;
  static constexpr bool XWIN = XSLOTS_ > 0 && XSLOTS_ < SLOTS_;
  static constexpr int X_ROWS = B_ * (XWIN ? XSLOTS_ : SLOTS_);  // the x ring's rows
  static_assert(XSLOTS_ == 0 || (XPULL_ && XSLOTS_ >= 3 && XSLOTS_ <= SLOTS_),
                "an x window: a backward that pulls x (XPULL), 3 .. SLOTS slots");
  // The head pull (fwd_head_pull, bwd_head_pull): every CTA's warps pull the first minibatch
  // together before taking their roles, where the kernel has comm CTAs: a few comm CTAs
  // copying it alone keep every compute CTA waiting through the first ~5% of each direction.
  // Not in the fp8 backward: its comm CTAs quantize what they pull (QuantSink), and that code
  // in every CTA makes ptxas spill in the blockwise kernels (tests/test_codegen.py).
  static constexpr bool FWD_HEAD = COMM_ > 0;
  static constexpr bool BWD_HEAD = COMM_ > 0 && Q_ == 0;
  static constexpr int PD = Q_ ? (D_ + 127) / 128 * 128 : D_;
  static constexpr int PI = Q_ ? (I_ + 127) / 128 * 128 : I_;
};

// The fp8 forward's extra operands (all unused, may be zero, for bf16 plans): e4m3 ring rows
// and weights (padded: FwdConsts::PD, PI), their scales ([ceil(K/Q), rows] fp32 for
// activations; MX weights [PK/32, padded rows] fp32).
struct Fp8Maps {
  CUtensorMap ring_x, ring_a, w1, w2, ring_sx, ring_sa, w1s, w2s;
};

template <int R>
struct PeerTable {
  const __nv_bfloat16* x[R];  // every rank's tokens [N, D] (fp8 plans: quantized, FwdBuffers)
  __nv_bfloat16* combine[R];  // every rank's combine buffer [N*K, D]
};

// Per-call state in global memory. `counters` is zeroed on the stream before each call:
// [0] task counter | ready[MB] comm CTAs done with minibatch m | dn_done[MB] down tiles done
// | gu_done[MB * B/BM] gate/up tiles done per row tile | sgu_done[ceil(N/BM)] shared ones.
struct FwdBuffers {
  const int2* table;        // [rows] (src rank, src route) per ring-layout row; -1 = padding
  const float* row_weight;  // [rows] router weight of each row
  const int* meta;          // [0] = ring-layout rows (padded), from the schedule kernels
  const int* offsets;       // [L+1] padded expert region starts
  __nv_bfloat16* ring_x;    // [SLOTS*B, D]
  __nv_bfloat16* ring_a;    // [SLOTS*B, I] SwiGLU output (fp8 plans: only for a backward)
  __nv_bfloat16* ring_h;    // [SLOTS*B, 2I] gate/up pre-activations, kept for the backward;
                            // nullptr when no backward follows (inference)
  __nv_bfloat16* h_shared;  // [N, IS] the shared expert's SwiGLU output (a backward's too)
  __nv_bfloat16* hs_pre;    // [N, 2IS] its gate/up pre-activations, kept for a bf16
                            // backward (moe_bwd.cuh); nullptr when none follows
  float* y_shared;          // [N, D]
  uint32_t* counters;
  uint8_t* ring_x8;         // fp8 plans: [SLOTS*B, D] e4m3 ring rows (pulled pre-quantized)
  uint8_t* ring_a8;         //   [SLOTS*B, I] e4m3 SwiGLU output, quantized in the epilogue
  float* ring_sx;           //   [ceil(D/Q), SLOTS*B] their scales
  float* ring_sa;           //   [ceil(I/Q), SLOTS*B]
  const float* w1s;         //   blockwise fp8 weight scales [L*2PI/128, PD/128]
  const float* w2s;         //   [L*PD/128, PI/128]
  uint64_t xq_scales_at;    //   byte offset of the scales in every rank's quantized x (xq)
  int n_tokens;
  int max_minibatches;
  int rank;                 // this rank's index, for the watchdog's record
};

// The task list. Work comes in units: unit 0 is the shared expert, unit q+1 the q-th routed
// minibatch in processing order. Each unit has gate/up tasks (GU) and down tasks (DN), and
// the list is GU(0) | GU(1) DN(0) | GU(2) DN(1) | ... | DN(last): the down tiles of a unit come
// one unit after its gate/up tiles. A down tile waits for the gate/up tiles of its rows, and
// with a unit in between those were taken about a wave earlier, so CTAs do not idle at every
// minibatch boundary. Ring slots go round-robin in processing order (slot = q % SLOTS, at least
// 2 slots), so the slot a minibatch reuses was freed by the DN of a unit >= 2 blocks earlier:
// every task waits only on tasks earlier in the list (or on comm, which waits only on those).
template <class C, class Cfg>
struct FwdSchedule {
  static constexpr int BM = Cfg::BM, BN = Cfg::BN;
  // tiles per row tile; a width that is not a multiple of the tile ends in an edge tile
  // (cols_valid, gemm_epilogue.cuh)
  static constexpr int GU_N = ceil_div(C::I, BN / 2);  // gate/up (BN/2 outputs each)
  static constexpr int DN_N = ceil_div(C::D, BN);      // down
  static constexpr int SGU_N = ceil_div(C::IS, BN / 2);
  static constexpr int RT_FULL = C::B / BM;     // row tiles in a full minibatch
  static_assert(C::B % BM == 0, "minibatch must be a multiple of the tile rows");
  static_assert(C::SLOTS >= 2, "the lagged task order needs a ring of at least 2 minibatches");
  static_assert(C::D % 8 == 0 && C::I % 8 == 0 && C::IS % 8 == 0,
                "widths must be multiples of 8 (rows are 16-byte vectors, TMA strides 16 B)");
  static_assert(C::Q == 0 || (C::D % 16 == 0 && C::I % 16 == 0),
                "fp8: hidden and intermediate must be multiples of 16 (e4m3 rows are 16-byte "
                "vectors, TMA strides 16 B; a partial scale block is zero-padded)");

  int rows, nm, n_macro, first_count, rt_last, shared_rt;

  MOKGEN_DEV void init(int padded_rows, int n_tokens) {
    rows = padded_rows;
    nm = (rows + C::B - 1) / C::B;
    n_macro = (nm + C::SLOTS - 1) / C::SLOTS;
    first_count = nm - (n_macro - 1) * C::SLOTS;  // minibatches of the macrobatch done first
    rt_last = nm ? (rows - (nm - 1) * C::B) / BM : 0;
    shared_rt = C::IS ? (n_tokens + BM - 1) / BM : 0;
  }
  // q-th minibatch in processing order (reverse macrobatches, ascending inside each)
  MOKGEN_DEV int minibatch_at(int q) const {
    if (q < first_count) return (n_macro - 1) * C::SLOTS + q;
    q -= first_count;
    return (n_macro - 2 - q / C::SLOTS) * C::SLOTS + q % C::SLOTS;
  }
  MOKGEN_DEV int row_tiles(int m) const { return m == nm - 1 ? rt_last : RT_FULL; }
  MOKGEN_DEV int down_tiles(int m) const { return row_tiles(m) * DN_N; }

  // Units: 0 shared, 1..nm routed; the short minibatch nm-1 is processed at q = first_count-1.
  MOKGEN_DEV int units() const { return nm + 1; }
  MOKGEN_DEV int short_unit() const { return first_count; }
  MOKGEN_DEV int gu_size(int u) const {
    return u == 0 ? shared_rt * SGU_N : (u == short_unit() ? rt_last : RT_FULL) * GU_N;
  }
  MOKGEN_DEV int dn_size(int u) const {
    return u == 0 ? shared_rt * DN_N : (u == short_unit() ? rt_last : RT_FULL) * DN_N;
  }
  // sum of size(u) for u < n, closed form: every routed unit is full but the short one
  MOKGEN_DEV int prefix(int n, bool gu) const {
    if (n <= 0) return 0;
    const int full = RT_FULL * (gu ? GU_N : DN_N);
    int sum = gu ? gu_size(0) : dn_size(0);
    sum += full * (n - 1);
    if (short_unit() >= 1 && short_unit() < n) sum += (gu ? gu_size(short_unit()) : dn_size(short_unit())) - full;
    return sum;
  }
  // block b = GU(b) (b < units) then DN(b-1) (b >= 1)
  MOKGEN_DEV int block_start(int b) const { return prefix(b, true) + prefix(b - 1, false); }
  MOKGEN_DEV int total_tasks() const { return prefix(units(), true) + prefix(units(), false); }
};

// The largest i in [lo, hi] with key(i) <= v, for a non-decreasing key with key(lo) <= v:
// which task block a task index falls in, which expert region a row falls in.
template <class Key>
MOKGEN_DEV int last_at_most(int lo, int hi, int v, Key&& key) {
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (key(mid) <= v) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// The last expert whose (padded) region starts at or before `row`; empty regions have equal
// starts, so this skips them.
template <int L>
MOKGEN_DEV int expert_at(const int* offsets, int row) {
  return last_at_most(0, L - 1, row, [&](int e) { return offsets[e]; });
}

// Tile-local row / column of accumulator register pair r (layout: gemm_epilogue.cuh).
MOKGEN_DEV int acc_row(int r) {
  const int w = (threadIdx.x >> 5) & 3, l = threadIdx.x & 31;
  return 16 * w + (l >> 2) + 8 * ((r >> 1) & 1);
}
MOKGEN_DEV int acc_col(int r) { return 8 * (r >> 2) + 2 * (threadIdx.x & 3); }

template <class C, class Cfg>
struct FwdProblem {
  using S = FwdSchedule<C, Cfg>;
  static constexpr bool kMNOperands = false;
  static constexpr int kQ = C::Q;
  static constexpr bool kGather = C::GATHER;  // the gate/up tiles read x where it is
  static constexpr int kGatherLd = C::D, kGatherTopk = C::K;
  // the down tiles' N is D (shared and routed): a narrow edge tile there (half_bit)
  static constexpr bool kNarrowTiles = half_edge<C::D, Cfg::BN>();
  const Fp8Maps* f8;
  const CUtensorMap *x_map, *hs_map, *ring_x_map, *ring_a_map, *sw1_map, *sw2_map, *w1_map,
      *w2_map;
  const PeerTable<C::R>* peers;
  const FwdBuffers* buf;
  S s;
  // K blocks; TMA zero-fills a K tail past the width in both operands
  static constexpr int k_d = ceil_div(C::D, 64), k_i = ceil_div(C::I, 64);
  static constexpr int k_is = ceil_div(C::IS, 64);
  // routed tiles: their opcode bits and K blocks (fp8 slices are 128 wide; TMA zero-fills
  // a K tail of the activations, the padded weights hold zeros there)
  static constexpr int kRouted = C::Q ? kF8 : 0;
  static constexpr int k_rd = C::Q ? ceil_div(C::D, 128) : k_d;
  static constexpr int k_ri = C::Q ? ceil_div(C::I, 128) : k_i;

  // Counter arrays, derived where used rather than held: consumer registers are scarce.
  MOKGEN_DEV uint32_t* ready() const { return buf->counters + 1; }
  MOKGEN_DEV uint32_t* dn_done() const { return ready() + buf->max_minibatches; }
  MOKGEN_DEV uint32_t* gu_done() const { return ready() + 2 * buf->max_minibatches; }
  MOKGEN_DEV uint32_t* sgu_done() const {
    return gu_done() + buf->max_minibatches * S::RT_FULL;
  }

  // The routed down rows leave through shared memory (store_rows_staged: stmatrix, no quad
  // transposes) in bf16 kernels whose plan gave the epilogue staging (lower.py
  // EPI_STAGE_BYTES: 4 KB a consumer warp); from registers (store_rows_to) otherwise.
  // Staged, the down tile's epilogue takes ~8% fewer cycles (gemm_epilogue.cuh says why).
  static constexpr int kWarpStage = 4096;  // two 2 KB chunk buffers (store_rows_staged)
  static constexpr bool kStagedRows = C::Q == 0 && Cfg::EPI_BYTES > 0;
  static_assert(!kStagedRows || Cfg::EPI_BYTES == 8 * kWarpStage,
                "forward staging: lower.py EPI_STAGE_BYTES, a stage for each consumer warp");
  uint8_t* stage = nullptr;  // Cfg::EPI_BYTES of shared memory (kStagedRows)
  MOKGEN_DEV uint8_t* warp_stage(int cwg) const {
    return stage + (4 * cwg + ((threadIdx.x >> 5) & 3)) * kWarpStage;
  }

  MOKGEN_DEV void setup() {
    s.init(buf->meta[0], buf->n_tokens);
    if constexpr (kStagedRows) stage = GemmSmem<Cfg>::carve(dyn_smem()).epi();
  }

  MOKGEN_DEV void prefetch() const {
    for (const CUtensorMap* m : {x_map, hs_map, ring_x_map, ring_a_map, sw1_map, sw2_map,
                                 w1_map, w2_map})
      tma_prefetch_desc(m);
    if constexpr (C::Q > 0) {
      for (const CUtensorMap* m : {&f8->ring_x, &f8->ring_a, &f8->w1, &f8->w2, &f8->ring_sx,
                                   &f8->ring_sa})
        tma_prefetch_desc(m);
      if constexpr (C::Q == 32) { tma_prefetch_desc(&f8->w1s); tma_prefetch_desc(&f8->w2s); }
    }
  }
  MOKGEN_DEV const CUtensorMap* map_a(const Task& t) const {
    const int op = opcode(t);
    if (C::Q > 0 && op >= kGateUp) return op == kGateUp ? &f8->ring_x : &f8->ring_a;
    return op == kSharedGateUp ? x_map : op == kSharedDown ? hs_map
         : op == kGateUp ? ring_x_map : ring_a_map;
  }
  MOKGEN_DEV const CUtensorMap* map_b(const Task& t) const {
    const int op = opcode(t);
    if (C::Q > 0 && op >= kGateUp) return op == kGateUp ? &f8->w1 : &f8->w2;
    return op == kSharedGateUp ? sw1_map : op == kSharedDown ? sw2_map
         : op == kGateUp ? w1_map : w2_map;
  }
  // fp8 routed tiles' scales
  MOKGEN_DEV const CUtensorMap* map_sa(const Task& t) const {
    return opcode(t) == kGateUp ? &f8->ring_sx : &f8->ring_sa;
  }
  MOKGEN_DEV const CUtensorMap* map_sb(const Task& t) const {
    return opcode(t) == kGateUp ? &f8->w1s : &f8->w2s;
  }
  MOKGEN_DEV const float* wsb(const Task& t) const {
    return opcode(t) == kGateUp ? buf->w1s : buf->w2s;
  }

  MOKGEN_DEV int expert_of(int row) const { return expert_at<C::L>(buf->offsets, row); }

  // GATHER: the routed gate/up tiles' A rows are the tokens of x their table rows name
  MOKGEN_DEV bool gathers(const Task& t) const { return C::GATHER && opcode(t) == kGateUp; }
  MOKGEN_DEV GatherSrc gather(const Task& t) const {
    return GatherSrc{gathers(t) ? peers->x[0] : nullptr, buf->table, buf->n_tokens, false,
                     (Cfg::PROF & kProfGatherInOrder) != 0};
  }

  // The thread that takes tasks (the scheduler, gemm_tile.cuh schedule_tasks, or the
  // producer) only: take the next task and wait for what it reads.
  MOKGEN_DEV Task next_task() { return task_at<true>(claim(1)); }
  // The first of n tasks taken from the list (GemmCfg::PAIR: rank 0 takes two at a time), and
  // the list's length.
  MOKGEN_DEV int claim(int n) const { return (int)atomicAdd(buf->counters, (unsigned)n); }
  MOKGEN_DEV int task_count() const { return s.total_tasks(); }
  // Task t; WAIT: having waited for what it reads (stop where the kernel was aborted, or a
  // wait timed out), else its coordinates alone, waiting for nothing (the pair's peer task:
  // gemm_tile.cuh produce_pairs).
  template <bool WAIT>
  MOKGEN_DEV Task task_at(int t) const {
    if (t >= s.total_tasks() || (WAIT && aborted())) return stop_task();
    // GATHER: a ring row must be its layout row (the ring holds every minibatch)
    if (C::GATHER && !MOKGEN_OK(s.nm <= C::SLOTS, 3, s.nm, C::SLOTS)) return stop_task();
    const int lo = last_at_most(0, s.units(), t, [&](int b) { return s.block_start(b); });
    int off = t - s.block_start(lo);
    const bool gu = lo < s.units() && off < s.gu_size(lo);
    const int u = gu ? lo : lo - 1;
    if (!gu && lo < s.units()) off -= s.gu_size(lo);
    if (!MOKGEN_OK(u >= 0 && u <= s.nm && off < (gu ? s.gu_size(u) : s.dn_size(u)), 1, u, off))
      return stop_task();
    return u == 0 ? shared_task<WAIT>(gu, off) : routed_task<WAIT>(u - 1, gu, off);
  }
  // GemmCfg::PAIR: tasks a and b (their coordinates) read the same B, so the pair multicasts
  // it, half each: tiles of one kind and the same weight rows (b_row0: the expert's and the
  // columns'), as row tiles next to each other in the list are (routed_task, shared_task:
  // row tiles innermost). Gate/up tiles are dual-B already (gate and up halves); PAIR
  // kernels load the down tiles' B as two halves too (down_b_row1; the host's maps of W2
  // have 128-row boxes there: runtime/moe.py). bf16 only (PAIR kernels are).
  MOKGEN_DEV bool shares_b(const Task& a, const Task& b) const {
    return opcode(a) == opcode(b) && a.b_row0 == b.b_row0 && a.b_row1 >= 0 &&
           a.b_row1 == b.b_row1 && a.k_blocks == b.k_blocks;
  }
  // A down tile's second B half (PAIR: rows BN/2 below its first), or -1: one box of BN rows
  static MOKGEN_DEV int down_b_row1(int b_row0) {
    return Cfg::PAIR ? b_row0 + Cfg::BN / 2 : -1;
  }

  template <bool WAIT>
  MOKGEN_DEV Task shared_task(bool gu, int i) const {
    const int BM = Cfg::BM, BN = Cfg::BN;
    const int rt = i % s.shared_rt, nt = i / s.shared_rt, r0 = rt * BM;
    const int valid = min(BM, buf->n_tokens - r0);
    if (gu) {  // shared gate/up + SwiGLU -> h_shared
      const int n0 = nt * (BN / 2);
      return Task{kSharedGateUp, r0, n0, C::IS + n0, r0, n0, valid, k_d};
    }
    if constexpr (WAIT) {
      if (!wait_at_least(sgu_done() + rt, S::SGU_N, buf->rank, kPhaseSharedDown, rt))
        return stop_task();
      fence_proxy_async_global();  // h_shared was written by generic stores; TMA reads it
    }
    return Task{kSharedDown | half_bit<C::D, BN>(nt * BN), r0, nt * BN, down_b_row1(nt * BN), r0,
                nt * BN, valid, k_is};
  }

  template <bool WAIT>
  MOKGEN_DEV Task routed_task(int q, bool gu, int i) const {
    const int BM = Cfg::BM, BN = Cfg::BN;
    const int m = s.minibatch_at(q);
    const int rt_n = s.row_tiles(m);
    const int rt = i % rt_n, nt = i / rt_n;
    const int slot_row = (q % C::SLOTS) * C::B + rt * BM;
    const int p0 = m * C::B + rt * BM, e = expert_of(p0);
    if (!MOKGEN_OK(p0 + BM <= s.rows && slot_row + BM <= C::B * C::SLOTS, 2, p0, slot_row))
      return stop_task();
    if (gu) {  // gate/up + SwiGLU of one row tile, BN/2 output columns
      const int n0 = nt * (BN / 2);
      if constexpr (WAIT && !C::GATHER) {  // gathered: x is there from the start
        const uint32_t want = head_ready<C::FWD_HEAD, C::COMM>(m == s.minibatch_at(0));
        if (!wait_at_least(ready() + m, want, buf->rank, kPhaseGateUp, m))
          return stop_task();
        fence_proxy_async_global();  // ring rows were written by the comm CTAs' plain stores
      }
      return Task{kGateUp | kRouted, slot_row, e * 2 * C::PI + n0, e * 2 * C::PI + C::PI + n0,
                  p0, n0, BM, k_rd};
    }
    // an edge tile whose second 128-column half is past D is narrow: fp8 tiles then never
    // read B rows there (the next expert's, or past the last one's and its scales')
    const auto down = [&] {
      return Task{kDown | kRouted | half_bit<C::D, BN>(nt * BN), slot_row, e * C::PD + nt * BN,
                  down_b_row1(e * C::PD + nt * BN), p0, nt * BN, BM, k_ri};
    };
    if constexpr (!WAIT) return down();
    if (!wait_at_least(gu_done() + m * S::RT_FULL + rt, S::GU_N, buf->rank, kPhaseDown,
                       m * S::RT_FULL + rt))
      return stop_task();
    fence_proxy_async_global();
    return down();
  }

  // Consumer threads: rows 64 cwg .. of the tile, stored from registers (signal() then
  // publishes the task's completion).
  // (Staging every epilogue through shared memory for 16-byte stores makes ptxas spill in
  // the mainloop at 168 registers: only the down rows are staged, kStagedRows.)
  MOKGEN_DEV void epilogue(const Task& t, float (&acc)[Cfg::kAccRegs], int cwg) {
    // profiling (Plan.profile): the task's completion signals are the engine's, after this
    if constexpr ((Cfg::PROF & kProfNoFwdEpilogues) != 0) return;
    constexpr int BN = Cfg::BN;
    const int op = opcode(t);
    if (C::Q > 0 && op == kGateUp) {
      if constexpr (C::Q > 0) swiglu_fp8(t, acc, cwg);
    } else if (op == kSharedGateUp || op == kGateUp) {  // local rows, half-contiguous already
      const bool shared = op == kSharedGateUp;
      __nv_bfloat16* out = shared ? buf->h_shared + (size_t)t.c_row0 * C::IS + t.c_col0
                                  : buf->ring_a + (size_t)t.a_row0 * C::I + t.c_col0;
      const int ld = shared ? C::IS : C::I;
      // the pre-activations, for a backward: routed into ring_h, the shared expert's into
      // hs_pre (both null when none follows)
      __nv_bfloat16* pre = shared
          ? (buf->hs_pre ? buf->hs_pre + (size_t)t.c_row0 * 2 * C::IS + t.c_col0 : nullptr)
          : (buf->ring_h ? buf->ring_h + (size_t)t.a_row0 * 2 * C::I + t.c_col0 : nullptr);
      const int n_valid = shared ? cols_valid<C::IS, BN / 2>(t.c_col0)
                                 : cols_valid<C::I, BN / 2>(t.c_col0);
      // (not through shared memory like the down rows: its three outputs take six chunk
      // rounds, slower than the register path)
      store_gate_up<BN, C::Q == 0, (Cfg::PROF & kProfFwdSinkStores) != 0>(
          acc, cwg, t.m_valid, pre, out, ld, n_valid);
      fence_proxy_async_global();  // the down GEMM reads these rows through TMA
    } else if (op == kSharedDown) {
      store_f32<BN, C::Q == 0>(acc, cwg, t.m_valid,
                               buf->y_shared + (size_t)t.c_row0 * C::D + t.c_col0, C::D,
                               cols_valid<C::D, BN>(t.c_col0));
    } else {  // routed down: scale by the router weight, push to the owners' combine rows
      // a thread holds 2 rows of the tile: look their destinations up once, not per pair
      __nv_bfloat16* dst[2];
      float w[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int p = t.c_row0 + 64 * cwg + acc_row(2 * h);
        if constexpr ((Cfg::PROF & kProfDownInOrder) != 0) {  // profiling: no table, no weight
          dst[h] = peers->combine[buf->rank] +
                   (size_t)(p % (buf->n_tokens * C::K)) * C::D + t.c_col0;
          w[h] = 1.f;
          continue;
        }
        const int2 src = buf->table[p];
        const bool ok = src.x >= 0 &&  // padding rows go nowhere
            MOKGEN_OK(src.x < C::R && src.y < buf->n_tokens * C::K && p < s.rows, 5, src.x, p);
        dst[h] = ok ? peers->combine[src.x] + (size_t)src.y * C::D + t.c_col0 : nullptr;
        w[h] = buf->row_weight[p];
      }
      // an edge tile: its columns inside D
      if constexpr (kStagedRows)
        store_rows_staged<BN, (Cfg::PROF & kProfFwdSinkStores) != 0>(
            acc, dst, w, cols_valid<C::D, BN>(t.c_col0), warp_stage(cwg));
      else
        store_rows_to<BN, C::Q == 0, (Cfg::PROF & kProfFwdSinkStores) != 0>(
            acc, dst, w, cols_valid<C::D, BN>(t.c_col0));
    }
  }

  // One thread, once per task, after every thread's epilogue stores (gemm_persistent).
  MOKGEN_DEV void signal(const Task& t) const {
    const int op = opcode(t), BM = Cfg::BM;
    if (op == kSharedGateUp) signal_add(sgu_done() + t.c_row0 / BM);
    else if (op == kGateUp)
      signal_add(gu_done() + (t.c_row0 / C::B) * S::RT_FULL + (t.c_row0 % C::B) / BM);
    else if (op == kDown) {
      if (C::COMM > 0 && buf->max_minibatches > C::SLOTS)
        signal_add(dn_done() + t.c_row0 / C::B);
      // else nothing waits for it: only a comm CTA refilling the minibatch's ring slot reads
      // dn_done (fwd_comm), and a ring that holds every minibatch is never refilled (nor is
      // there one with gathered rows, COMM = 0). Its fence would hold the consumer warp until
      // the tile's scattered stores reach L2 (the kernel's end publishes them to the combine
      // that follows).
    }
  }

  // fp8 gate/up epilogue: a = silu(g) * u from the fp32 accumulators, quantized along I
  // (the down GEMM's K) into ring_a8 + ring_sa, block by block (quantize_quad_block; Q = 128:
  // the tile's whole 128 output columns of a row). The bf16 pre-activations (for a backward) are stored first, so `a` can
  // overwrite the gate accumulators in place (no second array of 64 live registers); a
  // backward also gets `a` in bf16 (its weight gradients are bf16 GEMMs).
  // An edge tile (I not a multiple of 128) stores its columns inside I only, and quantizes
  // the partial block there with zeros past I.
  MOKGEN_DEV void swiglu_fp8(const Task& t, float (&acc)[Cfg::kAccRegs], int cwg) {
    constexpr int BN = Cfg::BN, G = C::Q / 8;  // column groups (8 wide) per block
    const int n_valid = cols_valid<C::I, BN / 2>(t.c_col0);
    if (buf->ring_h != nullptr) {
      __nv_bfloat16* pre = buf->ring_h + (size_t)t.a_row0 * 2 * C::I + t.c_col0;
      for_each_dual_pair<BN>(acc, cwg, t.m_valid,
                             [&](int r, int c, float g0, float g1, float u0, float u1) {
        *reinterpret_cast<__nv_bfloat162*>(pre + (size_t)r * 2 * C::I + c) =
            __floats2bfloat162_rn(g0, g1);
        *reinterpret_cast<__nv_bfloat162*>(pre + (size_t)r * 2 * C::I + C::I + c) =
            __floats2bfloat162_rn(u0, u1);
      }, n_valid);
    }
    if constexpr ((Cfg::PROF & kProfFp8PlainEpilogue) != 0) return;  // profiling: no SwiGLU
#pragma unroll
    for (int r = 0; r < BN / 4; ++r) acc[r] = silu(acc[r]) * acc[r + BN / 4];
    if (buf->ring_h != nullptr) {
      __nv_bfloat16* act = buf->ring_a + (size_t)t.a_row0 * C::I + t.c_col0;
      for_each_dual_pair<BN>(acc, cwg, t.m_valid,
                             [&](int r, int c, float a0, float a1, float, float) {
        *reinterpret_cast<__nv_bfloat162*>(act + (size_t)r * C::I + c) =
            __floats2bfloat162_rn(a0, a1);
      }, n_valid);
    }
    const int row0 = 64 * cwg + acc_row(0);  // rows row0 (h = 0) and row0 + 8 (h = 1)
    uint8_t* out = buf->ring_a8 + (size_t)t.a_row0 * C::I + t.c_col0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + 8 * h;
#pragma unroll
      for (int g0 = 0; g0 < BN / 16; g0 += G) {  // one block: column groups g0 .. g0 + G - 1
        float scale;
        if constexpr (C::I % 128 == 0) {
          scale = quantize_quad_block<C::Q>(
              [&](int g) { return make_float2(acc[4 * g + 2 * h], acc[4 * g + 2 * h + 1]); },
              g0, out + (size_t)row * C::I);
        } else {  // an edge tile: blocks past I are not there; the partial one is zero-padded
          if (8 * g0 >= n_valid) break;
          scale = quantize_quad_block<C::Q, true>(
              [&](int g) {
                return 8 * g < n_valid ? make_float2(acc[4 * g + 2 * h], acc[4 * g + 2 * h + 1])
                                       : make_float2(0.f, 0.f);
              },
              g0, out + (size_t)row * C::I, n_valid / 8);
        }
        if ((threadIdx.x & 3) == 0)
          buf->ring_sa[(size_t)((t.c_col0 + 8 * g0) / C::Q) * C::RING_ROWS + t.a_row0 + row] =
              scale;
      }
    }
    fence_proxy_async_global();  // the down GEMM reads these rows through TMA
  }
};

// The q-th minibatch in processing order (minibatch m) into its ring slot, by `workers` warps.
template <class C, class S>
MOKGEN_DEV void fwd_pull_minibatch(const PeerTable<C::R>& peers, const FwdBuffers& buf,
                                   const S& s, int q, int worker, int workers) {
  const int m = s.minibatch_at(q);
  const int p0 = m * C::B, p1 = min(p0 + C::B, s.rows), ring0 = (q % C::SLOTS) * C::B;
  if constexpr (C::Q > 0)  // peers.x are the ranks' quantized rows (xq) in fp8 plans
    pull_rows_fp8<C::D, C::K, C::Q, C::RING_ROWS>(
        buf.table, reinterpret_cast<const uint8_t* const*>(peers.x), buf.xq_scales_at,
        buf.ring_x8, buf.ring_sx, p0, p1, ring0, worker, workers);
  else
    pull_rows<C::D, C::K>(buf.table, peers.x, buf.ring_x, p0, p1, ring0, worker, workers);
  fence_proxy_async_global();  // compute reads the ring through TMA (async proxy)
  __syncthreads();
}

// Every CTA, before its role (FwdConsts::FWD_HEAD): its share of the first minibatch, then
// one count each on its ready flag (the gate/up tiles wait for gridDim.x of them there).
template <class C, class Cfg>
MOKGEN_DEV void fwd_head_pull(const PeerTable<C::R>& peers, const FwdBuffers& buf) {
  if constexpr (C::FWD_HEAD) {
    FwdSchedule<C, Cfg> s;
    s.init(buf.meta[0], buf.n_tokens);
    if (s.nm == 0) return;
    const int warps = blockDim.x / 32;
    fwd_pull_minibatch<C>(peers, buf, s, 0, blockIdx.x * warps + threadIdx.x / 32,
                          gridDim.x * warps);
    if (threadIdx.x == 0) signal_add(buf.counters + 1 + s.minibatch_at(0));
  }
}

// Comm CTA: pull every minibatch into its ring slot, in processing order; the first one
// every CTA pulled already (fwd_head_pull).
template <class C, class Cfg>
MOKGEN_DEV void fwd_comm(const PeerTable<C::R>& peers, const FwdBuffers& buf) {
  using S = FwdSchedule<C, Cfg>;
  S s;
  s.init(buf.meta[0], buf.n_tokens);
  uint32_t* ready = buf.counters + 1;
  uint32_t* dn_done = ready + buf.max_minibatches;
  const int warps = blockDim.x / 32;
  __shared__ int go;
  for (int q = C::FWD_HEAD ? 1 : 0; q < s.nm; ++q) {
    const int m = s.minibatch_at(q);
    if (q >= C::SLOTS) {  // the slot's previous minibatch must have left the down GEMM
      const int prev = s.minibatch_at(q - C::SLOTS);
      if (threadIdx.x == 0)
        go = wait_at_least(dn_done + prev, s.down_tiles(prev), buf.rank, kPhaseRingSlot, prev);
      __syncthreads();
      if (!go) return;  // the watchdog fired: stop pulling, let the kernel drain
    }
    fwd_pull_minibatch<C>(peers, buf, s, q, blockIdx.x * warps + threadIdx.x / 32,
                          C::COMM * warps);
    if (threadIdx.x == 0) signal_add(ready + m);
  }
}

}  // namespace mokgen
