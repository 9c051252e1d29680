// mokgen/moe_bwd.cuh -- the backward MoE megakernel: persistent, one CTA per SM.
//
// Mirrors the forward (moe_fwd.cuh): comm CTAs [0, COMM) walk the minibatches in backward
// order (ascending: macrobatch 0, which the forward left in the ring, comes first), wait until
// the ring slot's previous minibatch is finished, re-pull x for minibatches the ring lost
// (replay) and pull dy from the tokens' owners (pull reverse-combine), then raise the
// minibatch's ready count (minibatch 0: every CTA pulls a share before taking its role,
// bwd_head_pull). Compute CTAs run the GEMM
// engine over one task list (BwdSchedule). Per unit (0: the rank-local work, the shared
// expert; u >= 1: minibatch u-1):
//   R   replay: gate/up of a minibatch the ring lost -> ring_h (pre-activations), ring_a;
//       unit 0's R, the shared expert's gate/up, only when its forward's pre-activations and
//       a are gone too (BwdBuffers::resident: the forward keeps them as it keeps the ring;
//       bf16 kernels: fp8 ones always recompute it)
//   DG  dy W2_e (W2 read MN-major), epilogue: the router-weight gradient <a, dy W2_e> as
//       per-tile partial sums (no down-projection output is materialized), then the SwiGLU
//       backward of w * dy W2_e -> dh = [d gate, d up], written over the pre-activations it
//       was computed from (ring_h), and w * a written over a (ring_a): the rings the forward
//       left are the backward's too, so it needs no dh or w-scaled dy ring of its own (the
//       generation counter already retires the forward's rings once a backward ran)
//   DX  dh W1_e (MN-major) -> pushed to the owner's dx rows (push reverse-dispatch); the
//       first column tile also sums the router-weight partials and pushes them
//   WG  weight gradients of each expert segment: dW2_e += dy^T (w a), dW1_e += dh^T x, both
//       operands MN-major, K = the segment's rows. A segment is the expert's whole region
//       when the ring holds every minibatch (the planned case), else its rows inside one
//       minibatch; an expert's segments are summed in minibatch order through an fp32
//       buffer, each output tile waiting for the previous segment's: fixed order, no atomics.
// fp8 plans (FwdConsts::Q > 0) run R, DG and DX of the routed experts in e4m3 (gemm_fp8.cuh),
// the weight gradients and the shared expert stay bf16: the comm CTAs pull x and dy as bf16
// and also quantize them per token into e4m3 rings (the same bits as the forward's, so the
// replay reproduces its pre-activations), the DG epilogue quantizes dh along 2I, and DG / DX
// read the transposed fp8 weights (W2^T, W1^T: e4m3 wgmma takes K-major operands only).
// Their forward's ring holds e4m3 x, so for a resident minibatch (no replay: the forward left
// h and, in bf16, a) the comm CTAs still pull x in bf16 for the weight gradients.
// The list is block b = DG(b-1) | [DX + WG](b-2) | R(b): every task waits only on tasks
// earlier in the list, or on comm, which waits only on finished minibatches >= 2 units
// earlier (at least 2 ring slots; FIN(b-2) stays ahead of R(b) for that), so any interleaving
// of CTAs makes progress and every output element is computed by one tile in a fixed K order:
// bitwise reproducible. DG(b-1) leads its block so that a whole DG block lies between DG(u)
// and the FIN(u) tiles that wait for it (with FIN first they would follow DG(u) at once and
// wait for it: a tenth of the backward's time on Qwen3).
// DXRING (one rank, a ring holding every minibatch: passes/dx_rows.py): the routed DX tiles
// leave FIN for a last block of their own, and each writes its rows over its own dy rows in
// the ring once its expert's dW2 tiles (wg2_done) and its row tile's DG tiles have read them;
// the host's dx sum gathers the rows there (combine.cuh combine_sum_at). The tiles of that
// block wait only on tasks before it, so the list's progress argument holds as it is.
// XWIN (x_slots, passes/x_window.py: a forward that gathered x, so the backward pulls it): the
// x ring is a window of XSLOTS minibatch slots; a comm CTA refills a slot once the dW1 tiles
// of every expert in its previous minibatch are done (wait_x_slot, wg1_done), and dW1 reads
// its expert's x rows through the window's wrap (b_wrap).
#pragma once
#include <cuda_bf16.h>
#include "mokgen/combine.cuh"
#include "mokgen/fp8.cuh"
#include "mokgen/gemm_tile.cuh"
#include "mokgen/moe_fwd.cuh"
#include "mokgen/sync.cuh"

namespace mokgen {

enum BwdOp : int {
  kSGateUp = 0, kSDgrad = 1, kSDx = 2, kSWgrad2 = 3, kSWgrad1 = 4,  // shared expert
  kReplay = 5, kDgrad = 6, kDx = 7, kWgrad2 = 8, kWgrad1 = 9,       // routed
};

// Watchdog phases of the backward (runtime/abi.py names them; the build checks the numbers).
enum BwdPhase : int {
  kPhaseSDgrad = 11, kPhaseSDx = 12, kPhaseSWgrad = 13, kPhaseReplay = 14, kPhaseDgrad = 15,
  kPhaseDx = 16, kPhaseWgrad = 17, kPhaseWgradOrder = 18, kPhaseBwdRingSlot = 19,
  kPhaseDxRing = 21, kPhaseXSlot = 22,
};

template <int R>
struct BwdPeers {
  const __nv_bfloat16* x[R];   // every rank's tokens [N, D] (replay)
  const __nv_bfloat16* dy[R];  // every rank's output gradient [N, D]
  __nv_bfloat16* dx[R];        // every rank's dx rows [N*K, D] (the forward's combine buffer)
  float* dweight[R];           // every rank's router-weight gradients [N*K]
};

struct BwdBuffers {
  const int2* table;        // the forward's schedule (or a re-run of it)
  const float* row_weight;
  const int* meta;
  const int* offsets;
  const int4* segs;         // weight-gradient segments (schedule_segments)
  const int* seg_start;
  __nv_bfloat16* ring_x;    // [X_ROWS, D]    resident from the forward, or replayed
  __nv_bfloat16* ring_h;    // [SLOTS*B, 2I]  gate/up pre-activations, then (DG) dh
  __nv_bfloat16* ring_a;    // [SLOTS*B, I]   SwiGLU output, then (DG) w * a
  __nv_bfloat16* ring_dy;   // [SLOTS*B, D]   pulled dy (fp8 plans: also ring_dy8)
  float* dw_part;           // [max rows, DG_N] router-weight gradient partial sums
  __nv_bfloat16* hs_pre;    // [N, 2IS] shared gate/up pre-activations, then (SDG) dh: the
                            // forward's (FwdBuffers::hs_pre) when resident, else recomputed
  __nv_bfloat16* hs_a;      // [N, IS] its SwiGLU output (the forward's h_shared), likewise
  float* dx_shared;         // [N, D]
  __nv_bfloat16* dw1;       // [L, 2I, D] this rank's expert gradients
  __nv_bfloat16* dw2;       // [L, D, I]
  __nv_bfloat16* dsw1;      // [2IS, D]
  __nv_bfloat16* dsw2;      // [D, IS]
  float* wg_acc;            // [slots, 3 I D] fp32 sums of experts spanning several minibatches
  uint32_t* counters;
  // fp8 plans (unused otherwise): e4m3 rings [SLOTS*B, K] and their scales
  // [ceil(K/Q), SLOTS*B]; dh's K is 2 PI, each half padded (FwdConsts::PI, swiglu_backward_fp8)
  uint8_t* ring_x8;         //   x (replay), quantized by the comm CTAs
  float* ring_sx;
  uint8_t* ring_dy8;        //   dy (dgrad), quantized by the comm CTAs
  float* ring_sdy;
  uint8_t* ring_dh8;        //   dh (dx), quantized by the dgrad epilogue
  float* ring_sdh;
  const float* w1s;         //   blockwise weight scales: W1 [L*2PI/128, PD/128] (replay),
  const float* w2ts;        //   W2^T [L*PI/128, PD/128] (dgrad), W1^T [L*PD/128, 2PI/128] (dx)
  const float* w1ts;
  int n_tokens;
  int max_minibatches;
  int rank;
  int resident;             // 1: the ring holds the forward's macrobatch 0 (no replay for it)
                            // and hs_pre / hs_a the forward's shared expert (no recompute);
                            // 2 (XPULL kernels of keep_h plans): its x rows too (no x pull)
  int accumulate;           // 1: dw1 / dw2 hold gradients already (the caller's .grad): add
  int wg_by_minibatch;      // 1: wg_acc's slot is the expert's first minibatch, 0: the expert
  int wgrad_tma;            // 1: maps dw1_st / dw2_st are dw1 / dw2 (kTmaWgrad kernels)
};

// Tensor maps: K-major (box 64 x 128 rows, _k) or MN-major (box 64 x 64, _mn).
struct BwdMaps {
  // hs_dh_*: hs_pre, which holds the shared expert's dh once its dgrad ran
  CUtensorMap x_k, sw1_k, dy_k, sw2_mn, hs_dh_k, sw1_mn, dy_mn, hs_a_mn, hs_dh_mn, x_mn,
      ring_x_k, w1_k, ring_dy_k, w2_mn, ring_dh_k, w1_mn, ring_dy_mn, ring_a_mn, ring_dh_mn,
      ring_x_mn,  // ring_dh_*: ring_h, which holds dh once DG ran
      dw1_st, dw2_st;  // the weight gradients [L, 2I, D] / [L, D, I] (3D), 64 x 64 x 1 boxes
};

// The fp8 backward's operand maps (all zero for bf16 plans): e4m3 boxes 128 x 128 of the rings
// and the padded weights (W1 [L*2PI, PD], W2^T [L*PI, PD], W1^T [L*PD, 2PI]), activation
// scales [ceil(K/Q), rows] and, MX only, weight scales [PK/32, rows].
struct Fp8BwdMaps {
  CUtensorMap ring_x, w1, ring_dy, w2t, ring_dh, w1t, ring_sx, ring_sdy, ring_sdh, w1s, w2ts,
      w1ts;
};

// One weight gradient's MT x NT tiles of an expert in list order (BwdSchedule::kW1WalkM):
// tile index <-> (row tile mt, column tile nt), M innermost where WALK_M. The decode
// (BwdProblem::wgrad) and the completion signal (its wg_seq slot) must agree: round_trips()
// checks it at compile time, at the ends of the range (a constexpr loop over a whole large
// shape's tiles would near the compilers' evaluation limits).
template <int MT, int NT, bool WALK_M>
struct WgradOrder {
  static __host__ __device__ constexpr int index(int mt, int nt) {
    return WALK_M ? nt * MT + mt : mt * NT + nt;
  }
  static __host__ __device__ constexpr int mt(int i) { return WALK_M ? i % MT : i / NT; }
  static __host__ __device__ constexpr int nt(int i) { return WALK_M ? i / MT : i % NT; }
  static constexpr bool round_trips() {
    constexpr int n = MT * NT, ends = 4096;
    for (int i = 0; i < n; i = i + 1 == ends && n > 2 * ends ? n - ends : i + 1)
      if (index(mt(i), nt(i)) != i || mt(i) >= MT || nt(i) >= NT) return false;
    return true;
  }
};

// Widths that are not multiples of the tile end in an edge tile (cols_valid / rows_valid,
// gemm_epilogue.cuh): gate/up across I (IS), dgrad and dW2 across I, dx and dW1 across D, the
// shared expert's across IS and D; the weight gradients' M (D, 2I, 2IS) likewise.
template <class C, class Cfg>
struct BwdSchedule {
  static constexpr int BM = Cfg::BM, BN = Cfg::BN, RT_FULL = C::B / BM;
  static constexpr int GU_N = ceil_div(C::I, BN / 2), DG_N = ceil_div(C::I, BN);
  static constexpr int DX_N = ceil_div(C::D, BN);
  static constexpr int SGU_N = ceil_div(C::IS, BN / 2), SDG_N = ceil_div(C::IS, BN);
  // weight-gradient row tiles: dW2 / dsw2 (M = D), dW1 (M = 2I), dsw1 (M = 2IS)
  static constexpr int MT_D = ceil_div(C::D, BM), MT_2I = ceil_div(2 * C::I, BM);
  static constexpr int MT_2IS = ceil_div(2 * C::IS, BM);
  static constexpr int WN_I = ceil_div(C::I, BN), WN_D = ceil_div(C::D, BN);
  static constexpr int W2T = MT_D * WN_I, W1T = MT_2I * WN_D;
  static constexpr int WT = W2T + W1T;
  // An expert's weight-gradient tiles in list order: consecutive tiles share a block of one
  // operand (its K = the expert's rows) and walk the other's blocks, so the walked operand's
  // whole expert region must stay in L2 while each block of the held one is read from DRAM
  // once. Walk the smaller: dW2 [D, I] = (w dy)^T a walks dy's D columns (M) when D <= I,
  // dW1 [2I, D] = dh^T x walks x's D columns (N) when D <= 2I. Walking dh's 2I columns
  // instead would read Mixtral-8x22B's dh (67 MB an expert, past the 50 MB L2) once per
  // 256-column block of D: 24 times.
  static constexpr bool kW2WalkM = C::D <= C::I, kW1WalkM = 2 * C::I < C::D;
  using W2Order = WgradOrder<MT_D, WN_I, kW2WalkM>;
  using W1Order = WgradOrder<MT_2I, WN_D, kW1WalkM>;
  static_assert(W2Order::round_trips() && W1Order::round_trips(),
                "weight-gradient tile order: index and decode disagree");
  static constexpr int SW2T = MT_D * SDG_N, SW1T = MT_2IS * DX_N;
  static_assert(C::B % BM == 0 && C::SLOTS >= 2, "minibatch of whole tiles, >= 2 ring slots");
  static constexpr bool kRoutedWgrad = (Cfg::PROF & kProfNoRoutedWgrad) == 0;
  static_assert(C::D % 8 == 0 && C::I % 8 == 0 && C::IS % 8 == 0,
                "widths must be multiples of 8 (rows are 16-byte vectors, TMA strides 16 B)");
  static_assert(C::Q == 0 || (C::D % 16 == 0 && C::I % 16 == 0),
                "fp8: hidden and intermediate must be multiples of 16 (e4m3 rows are 16-byte "
                "vectors, TMA strides 16 B; a partial scale block is zero-padded)");

  int rows, nm, rt_last, shared_rt, resident, first_slot;
  bool shared_kept;  // the forward left the shared expert's pre-activations and a: unit 0
                     // has no R tasks and its DG / WG tasks wait for none
  const int* seg_start;

  MOKGEN_DEV void init(int padded_rows, int n_tokens, int resident_flag, const int* starts) {
    rows = padded_rows;
    nm = (rows + C::B - 1) / C::B;
    rt_last = nm ? (rows - (nm - 1) * C::B) / BM : 0;
    shared_rt = C::IS ? (n_tokens + BM - 1) / BM : 0;
    resident = resident_flag ? min(C::SLOTS, nm) : 0;
    // fp8 kernels recompute it (the flag's register made an MXFP8 backward's producer spill
    // 8 B); their forward does not keep it (runtime/moe.py)
    shared_kept = C::Q == 0 && resident_flag != 0;
    first_slot = max(0, nm - C::SLOTS) % C::SLOTS;  // where the forward left minibatch 0
    seg_start = starts;
  }
  // Called at each task's decode (BwdProblem::next_task): an empty asm that may change the
  // fields, so what the decode derives from them is derived again per task, not hoisted out
  // of the task-taking thread's loop into registers it lacks (56 in bf16: without it the
  // scheduling thread and some backwards' producers spill)
  MOKGEN_DEV void launder() {
    asm volatile("" : "+r"(rows), "+r"(nm), "+r"(rt_last), "+r"(shared_rt), "+r"(resident),
                 "+r"(first_slot));
  }
  MOKGEN_DEV int slot_row(int m) const { return ((first_slot + m) % C::SLOTS) * C::B; }
  // a ring row's x row: XWIN (the ring holds every minibatch, so ring rows are layout rows)
  // keeps x in a window of XSLOTS slots (FwdConsts XSLOTS)
  MOKGEN_DEV int x_row(int ring_row) const { return C::XWIN ? ring_row % C::X_ROWS : ring_row; }
  MOKGEN_DEV int row_tiles(int m) const { return m == nm - 1 ? rt_last : RT_FULL; }
  MOKGEN_DEV bool replayed(int m) const { return m >= resident; }
  MOKGEN_DEV int units() const { return nm + 1; }
  MOKGEN_DEV int segments(int u) const { return seg_start[u + 1] - seg_start[u]; }

  // task counts of unit u
  MOKGEN_DEV int r_size(int u) const {
    if (u == 0) return shared_kept ? 0 : shared_rt * SGU_N;
    return replayed(u - 1) ? row_tiles(u - 1) * GU_N : 0;
  }
  MOKGEN_DEV int dg_size(int u) const {
    return u == 0 ? shared_rt * SDG_N : row_tiles(u - 1) * DG_N;
  }
  MOKGEN_DEV int dx_size(int u) const {
    return u == 0 ? shared_rt * DX_N : row_tiles(u - 1) * DX_N;
  }
  MOKGEN_DEV int wg_size(int u) const {
    if constexpr ((Cfg::PROF & kProfNoRoutedWgrad) != 0) {  // profiling (Plan.profile)
      if (u > 0) return 0;
    }
    return (u == 0 && C::IS ? SW2T + SW1T : 0) + segments(u) * WT;
  }
  MOKGEN_DEV int fin_size(int u) const { return dx_size(u) + wg_size(u); }
  // C::DXRING: the routed dx tiles leave their FIN blocks for one block after the last
  // (each waits for its expert's dW2, which is listed with the expert's last minibatch)
  MOKGEN_DEV int fin_dx(int u) const { return C::DXRING && u > 0 ? 0 : dx_size(u); }

  // sums over units [0, n), closed forms: routed units are full but the last one
  MOKGEN_DEV int routed_sum(int n, int per_tile_row) const {  // units 1 .. n-1
    if (n <= 1) return 0;
    int s = (n - 1) * RT_FULL * per_tile_row;
    if (n - 1 >= nm) s += (rt_last - RT_FULL) * per_tile_row;  // the short last minibatch
    return s;
  }
  MOKGEN_DEV int pre_r(int n) const {
    if (n <= 0) return 0;
    n = min(n, units());
    // replayed routed units are m in [resident, n-2]
    int s = r_size(0);
    const int reps = max(0, n - 1 - resident);
    if (reps > 0) {
      s += reps * RT_FULL * GU_N;
      if (n - 1 >= nm) s += (rt_last - RT_FULL) * GU_N;
    }
    return s;
  }
  MOKGEN_DEV int pre_dg(int n) const {
    return n <= 0 ? 0 : dg_size(0) + routed_sum(min(n, units()), DG_N);
  }
  MOKGEN_DEV int pre_fin(int n) const {
    if (n <= 0) return 0;
    n = min(n, units());
    const int dx = dx_size(0) + (C::DXRING ? 0 : routed_sum(n, DX_N));
    if constexpr ((Cfg::PROF & kProfNoRoutedWgrad) != 0)
      return dx + (C::IS ? SW2T + SW1T : 0) + seg_start[1] * WT;
    return dx + (C::IS ? SW2T + SW1T : 0) + seg_start[n] * WT;
  }
  // block b in [0, units + 2): DG(b-1) | FIN(b-2) | R(b) (BwdProblem::next_task); C::DXRING:
  // then a last block of every routed dx tile, minibatch by minibatch
  MOKGEN_DEV int block_start(int b) const { return pre_fin(b - 2) + pre_dg(b - 1) + pre_r(b); }
  MOKGEN_DEV int blocks() const { return units() + 2; }
  MOKGEN_DEV int dx_start() const { return block_start(blocks()); }
  MOKGEN_DEV int total_tasks() const {
    return dx_start() + (C::DXRING ? routed_sum(units(), DX_N) : 0);
  }
};

template <class C, class Cfg>
struct BwdProblem {
  using S = BwdSchedule<C, Cfg>;
  static constexpr bool kMNOperands = true;
  static constexpr int kQ = C::Q;
  // GATHER: the replay and dgrad tiles read x / dy rows where they are, the weight gradients
  // dy (dW2's A) and x (dW1's B) along K (FwdConsts, gemm_tile.cuh GatherSrc)
  static constexpr bool kGather = C::GATHER;
  static constexpr int kGatherLd = C::D, kGatherTopk = C::K;
  static constexpr int BM = Cfg::BM, BN = Cfg::BN;
  // narrow edge tiles (half_bit): the tiles whose N is D (dx, dW1, the shared expert's), I
  // (dgrad, dW2) or IS (the shared expert's dgrad, dsw2)
  static constexpr bool kNarrowTiles = half_edge<C::D, BN>() || half_edge<C::I, BN>() ||
                                       (C::IS > 0 && half_edge<C::IS, BN>());
  // K blocks; TMA zero-fills a K tail past the width (the other operand's rows there are
  // another expert's or past the tensor: finite or zero)
  static constexpr int k_d = ceil_div(C::D, 64), k_i2 = ceil_div(2 * C::I, 64);
  static constexpr int k_is2 = ceil_div(2 * C::IS, 64);
  static constexpr int kRouted = C::Q ? kF8 : 0;  // the routed R / DG / DX tiles' bits
  const BwdMaps* maps;
  const Fp8BwdMaps* f8;
  const BwdPeers<C::R>* peers;
  const BwdBuffers* buf;
  S s;
  uint8_t* stage = nullptr;  // Cfg::EPI_BYTES of shared memory: the weight gradients' boxes
  // The producer's last segment whose rows' dgrad counts it has seen complete (wgrad): a
  // CTA takes many tiles of one segment in a row (WT a segment against ~132 CTAs), and the
  // counts only grow within a launch, so those waits (and their fence) are done once per
  // segment and CTA instead of once per tile: a whole expert's segment is 8 row tiles at
  // Mixtral's 1,024 rows, 8 dependent acquire loads in each short-K tile's next_task.
  // bf16 kernels only: in an MXFP8 backward the producer's extra register (of its 40) made
  // ptxas spill 8 B, so fp8 kernels wait per tile.
  static constexpr bool kWgSeen = C::Q == 0;
  int wg_seen = -1;
  // A weight-gradient tile of a whole expert goes out through shared memory and TMA stores
  // (store_rows_tma) where the kernel has the staging; the maps are 3D, an expert a matrix,
  // so an edge row tile's rows past the expert's are dropped, not written into the next.
  // Each consumer warpgroup stages in its half of EPI_BYTES: 8 KB boxes (lower.py sizes it).
  static constexpr bool kTmaWgrad = Cfg::EPI_BYTES >= 2 * 16384;
  // kTmaWgrad kernels: what the epilogue and the signal of a routed weight-gradient task need
  // of its segment travels in the task (the producer read the segment anyway), so neither reads
  // it from global memory when the segment is its expert's only one: a dependent load at each
  // short-K tile's end, in its warpgroup's way (about 0.5 us a tile). The op's bits above
  // kOpUserShift (gemm_types.cuh): the segment is the expert's only one (whole), it has no rows
  // (empty: a zero tile), the expert; c_col0 holds the minibatch its unit closes (the fin_done
  // count its signal adds to). The fp8 kernels (no staging, no such fast path) read the
  // segment: their producers keep 40 registers, none to spare for the bits' code.
  // Weight-gradient tasks' output origin is (a_row0, b_row0) in every kernel, which is where
  // their operands start.
  static constexpr int kWgradWhole = 1 << kOpUserShift, kWgradEmpty = 1 << (kOpUserShift + 1);
  static constexpr int kWgradExpertShift = kOpUserShift + 2;
  static_assert(!kTmaWgrad || C::L <= (1 << (29 - kWgradExpertShift)),
                "the expert fits the op's bits (below bit 29)");
  static constexpr int kWgradBufs = Cfg::EPI_BYTES / 2 / 8192;
  static MOKGEN_DEV int wgrad_expert(const Task& t) {  // below kHalfN
    return (kNarrowTiles ? t.op & (kHalfN - 1) : t.op) >> kWgradExpertShift;
  }

  // counters: [0] tasks | ready[MB] | r_done[MB*RT] | dg_done[MB*RT] | fin_done[MB]
  // | wg_seq[L*WT] | sr_done[SRT] | sdg_done[SRT] | sr_all | sdg_all
  // | DXRING: wg2_done[L] | XWIN: wg1_done[L] (runtime/workspace.py backward_counter_words)
  MOKGEN_DEV uint32_t* ready() const { return buf->counters + 1; }
  MOKGEN_DEV uint32_t* r_done() const { return ready() + buf->max_minibatches; }
  MOKGEN_DEV uint32_t* dg_done() const { return r_done() + buf->max_minibatches * S::RT_FULL; }
  MOKGEN_DEV uint32_t* fin_done() const { return dg_done() + buf->max_minibatches * S::RT_FULL; }
  MOKGEN_DEV uint32_t* wg_seq() const { return fin_done() + buf->max_minibatches; }
  MOKGEN_DEV uint32_t* sr_done() const { return wg_seq() + C::L * S::WT; }
  MOKGEN_DEV uint32_t* sdg_done() const { return sr_done() + (buf->n_tokens + BM - 1) / BM; }
  MOKGEN_DEV uint32_t* sr_all() const { return sdg_done() + (buf->n_tokens + BM - 1) / BM; }
  MOKGEN_DEV uint32_t* sdg_all() const { return sr_all() + 1; }
  MOKGEN_DEV uint32_t* wg2_done() const { return sdg_all() + 1; }
  MOKGEN_DEV uint32_t* wg1_done() const { return wg2_done() + (C::DXRING ? C::L : 0); }
  // The comm CTAs' view of the same layout (bwd_comm): no Problem of their own.
  static MOKGEN_DEV uint32_t* wg1_done_of(const BwdBuffers& b) {
    BwdProblem p{nullptr, nullptr, nullptr, &b};
    return p.wg1_done();
  }

  // XWIN: dW1's B (x rows, K-wise across its expert's minibatches) wraps in the x window;
  // no other operand does (the replay's x tile is one minibatch's: x_row)
  static constexpr bool kWrapB = C::XWIN;
  MOKGEN_DEV int b_wrap(const Task& t) const { return opcode(t) == kWgrad1 ? C::X_ROWS : 0; }

  MOKGEN_DEV void setup(uint8_t* dyn_smem) {
    s.init(buf->meta[0], buf->n_tokens, buf->resident, buf->seg_start);
    if constexpr (Cfg::EPI_BYTES > 0) stage = GemmSmem<Cfg>::carve(dyn_smem).epi();
  }

  MOKGEN_DEV void prefetch() const {
    const CUtensorMap* m = &maps->x_k;
    for (int i = 0; i < (int)(sizeof(BwdMaps) / sizeof(CUtensorMap)); ++i) tma_prefetch_desc(m + i);
    if constexpr (C::Q > 0) {  // the last 3 maps (MX weight scales) only for MX
      static_assert(sizeof(Fp8BwdMaps) == 12 * sizeof(CUtensorMap), "Fp8BwdMaps layout");
      for (int i = 0; i < (C::Q == 32 ? 12 : 9); ++i) tma_prefetch_desc(&f8->ring_x + i);
    }
  }
  // The fp8 tiles' operand of each op: R, DG or DX.
  template <class T>
  static MOKGEN_DEV T fp8_of(const Task& t, T replay, T dgrad, T dx) {
    return opcode(t) == kReplay ? replay : opcode(t) == kDgrad ? dgrad : dx;
  }
  MOKGEN_DEV const CUtensorMap* map_a(const Task& t) const {
    if (C::Q > 0 && (t.op & kF8)) return fp8_of(t, &f8->ring_x, &f8->ring_dy, &f8->ring_dh);
    switch (opcode(t)) {
      case kSGateUp: return &maps->x_k;
      case kSDgrad: return &maps->dy_k;
      case kSDx: return &maps->hs_dh_k;
      case kSWgrad2: return &maps->dy_mn;
      case kSWgrad1: return &maps->hs_dh_mn;
      case kReplay: return &maps->ring_x_k;
      case kDgrad: return &maps->ring_dy_k;
      case kDx: return &maps->ring_dh_k;
      case kWgrad2: return &maps->ring_dy_mn;
      default: return &maps->ring_dh_mn;
    }
  }
  MOKGEN_DEV const CUtensorMap* map_b(const Task& t) const {
    if (C::Q > 0 && (t.op & kF8)) return fp8_of(t, &f8->w1, &f8->w2t, &f8->w1t);
    switch (opcode(t)) {
      case kSGateUp: return &maps->sw1_k;
      case kSDgrad: return &maps->sw2_mn;
      case kSDx: return &maps->sw1_mn;
      case kSWgrad2: return &maps->hs_a_mn;
      case kSWgrad1: return &maps->x_mn;
      case kReplay: return &maps->w1_k;
      case kDgrad: return &maps->w2_mn;
      case kDx: return &maps->w1_mn;
      case kWgrad2: return &maps->ring_a_mn;
      default: return &maps->ring_x_mn;
    }
  }

  // fp8 tiles' scales (kF8 tasks only)
  MOKGEN_DEV const CUtensorMap* map_sa(const Task& t) const {
    return fp8_of(t, &f8->ring_sx, &f8->ring_sdy, &f8->ring_sdh);
  }
  MOKGEN_DEV const CUtensorMap* map_sb(const Task& t) const {
    return fp8_of(t, &f8->w1s, &f8->w2ts, &f8->w1ts);
  }
  MOKGEN_DEV const float* wsb(const Task& t) const {
    return fp8_of(t, buf->w1s, buf->w2ts, buf->w1ts);
  }

  MOKGEN_DEV int expert_of(int row) const { return expert_at<C::L>(buf->offsets, row); }

  MOKGEN_DEV bool gathers(const Task& t) const {
    const int op = opcode(t);
    return C::GATHER && (op == kReplay || op == kDgrad || op == kWgrad2 || op == kWgrad1);
  }
  // x: the replay's A and dW1's B; dy: the dgrad's A and dW2's
  MOKGEN_DEV GatherSrc gather(const Task& t) const {
    const int op = opcode(t);
    const __nv_bfloat16* base = !gathers(t) ? nullptr
        : op == kReplay || op == kWgrad1 ? peers->x[0] : peers->dy[0];
    return GatherSrc{base, buf->table, buf->n_tokens, op == kWgrad1,
                     (Cfg::PROF & kProfGatherInOrder) != 0};
  }

  // The thread that takes tasks (the scheduler, gemm_tile.cuh schedule_tasks, or the
  // producer) only.
  MOKGEN_DEV Task next_task() {
    s.launder();
    const int t = (int)atomicAdd(buf->counters, 1u);
    if (t >= s.total_tasks() || aborted()) return stop_task();
    // GATHER: a ring row must be its layout row; DXRING: no minibatch may reuse a slot whose
    // dy rows hold dx rows (limits.py); XWIN: x rows are placed by layout row: all three
    // need the ring to hold every minibatch
    if ((C::GATHER || C::DXRING || C::XWIN) && !MOKGEN_OK(s.nm <= C::SLOTS, 23, s.nm, C::SLOTS))
      return stop_task();
    if (C::DXRING && t >= s.dx_start()) {  // the last block: minibatches of whole row tiles
      const int off = t - s.dx_start(), m = off / (S::RT_FULL * S::DX_N);
      return routed_dx(m, off - m * S::RT_FULL * S::DX_N);
    }
    const int b = last_at_most(0, s.blocks() - 1, t, [&](int i) { return s.block_start(i); });
    int off = t - s.block_start(b);
    if (b >= 1 && b - 1 < s.units()) {
      const int u = b - 1;
      if (off < s.dg_size(u)) return u == 0 ? shared_dgrad(off) : routed_dgrad(u - 1, off);
      off -= s.dg_size(u);
    }
    if (b >= 2 && b - 2 < s.units()) {
      const int u = b - 2;
      if (off < s.fin_dx(u)) return u == 0 ? shared_dx(off) : routed_dx(u - 1, off);
      off -= s.fin_dx(u);
      if (off < s.wg_size(u)) return wgrad(u, off);
      off -= s.wg_size(u);
    }
    if (MOKGEN_OK(b < s.units() && off < s.r_size(b), 20, b, off))
      return b == 0 ? shared_gate_up(off) : replay(b - 1, off);
    return stop_task();
  }

  // ---------------------------------------------------------------- shared expert (unit 0)
  MOKGEN_DEV int valid_rows(int r0) const { return min(BM, buf->n_tokens - r0); }

  MOKGEN_DEV Task shared_gate_up(int i) const {
    const int rt = i % s.shared_rt, n0 = (i / s.shared_rt) * (BN / 2), r0 = rt * BM;
    return Task{kSGateUp, r0, n0, C::IS + n0, r0, n0, valid_rows(r0), k_d};
  }
  MOKGEN_DEV Task shared_dgrad(int i) const {
    const int rt = i % s.shared_rt, n0 = (i / s.shared_rt) * BN, r0 = rt * BM;
    if (!s.shared_kept &&
        !wait_at_least(sr_done() + rt, S::SGU_N, buf->rank, kPhaseSDgrad, rt))
      return stop_task();
    return Task{kSDgrad | kBMN | half_bit<C::IS, BN>(n0), r0, n0, 0, r0, n0, valid_rows(r0),
                k_d};
  }
  MOKGEN_DEV Task shared_dx(int i) const {
    const int rt = i % s.shared_rt, n0 = (i / s.shared_rt) * BN, r0 = rt * BM;
    if (!wait_at_least(sdg_done() + rt, S::SDG_N, buf->rank, kPhaseSDx, rt)) return stop_task();
    fence_proxy_async_global();  // dh was written by generic stores; TMA reads it
    return Task{kSDx | kBMN | half_bit<C::D, BN>(n0), r0, n0, 0, r0, n0, valid_rows(r0), k_is2};
  }

  // ---------------------------------------------------------------- routed minibatch m
  MOKGEN_DEV bool wait_ready(int m, int phase) const {
    if constexpr (C::GATHER) return true;  // no comm CTAs: x and dy are there from the start
    if (!wait_at_least(ready() + m, head_ready<C::BWD_HEAD, C::COMM>(m == 0), buf->rank, phase,
                       m))
      return false;
    fence_proxy_async_global();
    return true;
  }
  MOKGEN_DEV Task replay(int m, int i) const {
    const int rt_n = s.row_tiles(m), rt = i % rt_n, n0 = (i / rt_n) * (BN / 2);
    const int p0 = m * C::B + rt * BM, e = expert_of(p0);
    if (!wait_ready(m, kPhaseReplay)) return stop_task();
    // (XWIN on its own branch: an identity x_row call in the common expression moves
    // ptxas's register allocation of the whole kernel)
    if constexpr (C::XWIN)
      return Task{kReplay | kRouted, s.x_row(s.slot_row(m) + rt * BM), e * 2 * C::PI + n0,
                  e * 2 * C::PI + C::PI + n0, p0, n0, BM, k_d};
    return Task{kReplay | kRouted, s.slot_row(m) + rt * BM, e * 2 * C::PI + n0,
                e * 2 * C::PI + C::PI + n0, p0, n0, BM, C::Q ? ceil_div(C::D, 128) : k_d};
  }
  MOKGEN_DEV Task routed_dgrad(int m, int i) const {
    const int rt_n = s.row_tiles(m), rt = i % rt_n, n0 = (i / rt_n) * BN;
    const int p0 = m * C::B + rt * BM, e = expert_of(p0);
    if (!wait_ready(m, kPhaseDgrad)) return stop_task();
    if (s.replayed(m)) {
      if (!wait_at_least(r_done() + m * S::RT_FULL + rt, S::GU_N, buf->rank, kPhaseDgrad, m))
        return stop_task();
    }
    // fp8 tiles read B (K-major) as two 128-row halves; an edge tile whose second half is
    // past the width is narrow, so it never reads the rows there (the next expert's, or past
    // the last expert's and its blockwise scales)
    if (C::Q > 0)  // B = W2^T [L*PI, PD], K-major
      return Task{kDgrad | kF8 | half_bit<C::I, BN>(n0), s.slot_row(m) + rt * BM,
                  e * C::PI + n0, -1, p0, n0, BM, ceil_div(C::D, 128)};
    return Task{kDgrad | kBMN | half_bit<C::I, BN>(n0), s.slot_row(m) + rt * BM, n0, e * C::D,
                p0, n0, BM, k_d};
  }
  MOKGEN_DEV Task routed_dx(int m, int i) const {
    const int rt_n = s.row_tiles(m), rt = i % rt_n, n0 = (i / rt_n) * BN;
    const int p0 = m * C::B + rt * BM, e = expert_of(p0);
    if (!wait_at_least(dg_done() + m * S::RT_FULL + rt, S::DG_N, buf->rank, kPhaseDx, m))
      return stop_task();
    // DXRING: its rows go over their dy rows, which the expert's dW2 tiles read (listed
    // before this last block, with the expert's last minibatch); a tile is one expert's.
    // (The no_routed_wgrad profile lists no dW2 tiles: nothing to wait for.)
    constexpr bool kWaitWg2 = C::DXRING && (Cfg::PROF & kProfNoRoutedWgrad) == 0;
    if (kWaitWg2 && !wait_at_least(wg2_done() + e, S::W2T, buf->rank, kPhaseDxRing, e))
      return stop_task();
    fence_proxy_async_global();
    if (C::Q > 0)  // B = W1^T [L*PD, 2PI], K-major; A = dh [rows, 2PI]
      return Task{kDx | kF8 | half_bit<C::D, BN>(n0), s.slot_row(m) + rt * BM, e * C::PD + n0,
                  -1, p0, n0, BM, 2 * C::PI / 128};
    return Task{kDx | kBMN | half_bit<C::D, BN>(n0), s.slot_row(m) + rt * BM, n0, e * 2 * C::I,
                p0, n0, BM, k_i2};
  }

  // ---------------------------------------------------------------- weight gradients
  // Unit 0: the shared expert's (K = tokens), then zero tiles of experts without rows.
  // Unit u >= 1: tile j % WT of segment seg_start[u] + j / WT. m_valid carries the segment.
  MOKGEN_DEV Task wgrad(int u, int j) {
    constexpr int MN = kAMN | kBMN;
    if (u == 0 && C::IS) {
      const int kt = (buf->n_tokens + 63) / 64;
      if (j < S::SW2T) {  // dsw2 [D, IS] = dy^T a_s
        if (!s.shared_kept &&
            !wait_at_least(sr_all(), s.shared_rt * S::SGU_N, buf->rank, kPhaseSWgrad, 0))
          return stop_task();
        fence_proxy_async_global();
        const int mt = j % S::MT_D, nt = j / S::MT_D;
        return Task{kSWgrad2 | MN | half_bit<C::IS, BN>(nt * BN), mt * BM, nt * BN, 0, mt * BM,
                    nt * BN, -1, kt};
      }
      j -= S::SW2T;
      if (j < S::SW1T) {  // dsw1 [2IS, D] = dh_s^T x
        if (!wait_at_least(sdg_all(), s.shared_rt * S::SDG_N, buf->rank, kPhaseSWgrad, 1))
          return stop_task();
        fence_proxy_async_global();
        const int mt = j % S::MT_2IS, nt = j / S::MT_2IS;
        return Task{kSWgrad1 | MN | half_bit<C::D, BN>(nt * BN), mt * BM, nt * BN, 0, mt * BM,
                    nt * BN, -1, kt};
      }
      j -= S::SW1T;
    }
    const int sid = s.seg_start[u] + j / S::WT, tt = j % S::WT;
    const int4 seg = buf->segs[sid];
    const int e = seg.x, idx = seg.w & 0xffff;
    int k0 = 0, kb = 0;
    if (u > 0) {
      // the segment's row tiles; a whole-expert segment (schedule_segments) spans minibatches,
      // contiguous in the ring because the ring then holds every minibatch in layout order
      if (!MOKGEN_OK(e < C::L && (seg.z - 1) / C::B == u - 1, 21, sid, u)) return stop_task();
      // profiling (Plan.profile): without these waits, what the dependencies cost
      if constexpr ((Cfg::PROF & kProfNoWgradWaits) == 0) {
        if (!kWgSeen || sid != wg_seen) {
          for (int p = seg.y; p < seg.z; p += BM) {
            const int m = p / C::B, rt = (p - m * C::B) / BM;
            if (!wait_at_least(dg_done() + m * S::RT_FULL + rt, S::DG_N, buf->rank,
                               kPhaseWgrad, m))
              return stop_task();
          }
        }
        if (idx > 0 && !wait_at_least(wg_seq() + e * S::WT + tt, idx, buf->rank,
                                      kPhaseWgradOrder, e * S::WT + tt))
          return stop_task();
      }
      // the fence orders this thread's later TMA reads after the acquires above; those of an
      // earlier tile of the segment were fenced then (program order)
      if (!kWgSeen || sid != wg_seen || idx > 0) fence_proxy_async_global();
      if constexpr (kWgSeen) wg_seen = sid;
      k0 = s.slot_row(seg.y / C::B) + seg.y % C::B;
      kb = (seg.z - seg.y + 63) / 64;  // an expert's last segment ends at its last row
    }
    int bits = MN, c_col0 = 0;
    if constexpr (kTmaWgrad) {
      bits |= (e << kWgradExpertShift) | ((seg.w >> 16) == 1 ? kWgradWhole : 0) |
              (seg.z == seg.y ? kWgradEmpty : 0);
      c_col0 = u > 0 ? u - 1 : 0;  // (seg.z - 1) / B, checked above
    }
    if (tt < S::W2T) {  // dW2_e [D, I] = (w dy)^T a
      const int mt = S::W2Order::mt(tt), nt = S::W2Order::nt(tt);
      return Task{kWgrad2 | bits | half_bit<C::I, BN>(nt * BN), mt * BM, nt * BN, k0, mt * BM,
                  c_col0, sid, kb};
    }
    // dW1_e [2I, D] = dh^T x
    const int mt = S::W1Order::mt(tt - S::W2T), nt = S::W1Order::nt(tt - S::W2T);
    return Task{kWgrad1 | bits | half_bit<C::D, BN>(nt * BN), mt * BM, nt * BN, k0, mt * BM,
                c_col0, sid, kb};
  }

  // ---------------------------------------------------------------- epilogues
  // One element's SwiGLU backward: v = d a (before the router weight w), g / u the
  // pre-activations; dot += v a (the router weight's gradient), w a for the weight gradient.
  static MOKGEN_DEV void swiglu_grad(float v, float g, float u, float w, float& dot, float& dg,
                                     float& du, float& wa) {
    const float sg = sigmoid(g), sl = g * sg, a = sl * u;
    dot += v * a;
    wa = w * a;
    const float da = w * v;
    dg = da * u * sg * (1.f + g * (1.f - sg));
    du = da * sl;
  }

  // SwiGLU backward of one tile of d_a (before the router weight): reads the pre-activations
  // h = [g | u] (row stride 2*NI) at the tile's columns, writes dh = [dg | du] the same way.
  // Rows: the two rows of this thread, hp/dhp their h / dh rows (nullptr: not a row; dhp may
  // be hp: each element is read, then written, by this thread alone), ap their a rows (row
  // stride NI) that get w * a (the weight gradient of W2 reads it), or nullptr.
  // Returns <a, d_a> per row (the router-weight gradient's partial sum over these columns).
  // bf16 kernels 8 columns at a time (for_each_acc_oct), fp8 kernels (their shared expert's
  // dgrad; the routed one is swiglu_backward_fp8) pair by pair: 8 columns at a time spilled
  // 8 B in an fp8 backward. Columns past NI (an edge tile) are skipped.
  template <int NI>
  MOKGEN_DEV void swiglu_backward(float (&acc)[BN / 2], int col0,
                                  const __nv_bfloat16* const (&hp)[2],
                                  __nv_bfloat16* const (&dhp)[2],
                                  __nv_bfloat16* const (&ap)[2], const float (&w)[2],
                                  float (&dot)[2]) const {
    dot[0] = dot[1] = 0.f;
    if constexpr (C::Q == 0) {  // 8 columns at a time (for_each_acc_oct's groups,
      // oct_of), the g / u of kAhead groups loaded before any of their stores: dh lands over
      // h, so the compiler may not hoist a group's loads above the previous group's stores,
      // and each group would wait a memory round trip
      constexpr int kAhead = 4;
      static_assert((BN / 32) % kAhead == 0, "whole batches of groups");
      const int q = threadIdx.x & 3;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int g0 = 0; g0 < BN / 32; g0 += kAhead) {
          uint4 graw[kAhead], uraw[kAhead];
          bool ok[kAhead];
#pragma unroll
          for (int i = 0; i < kAhead; ++i) {
            const int c = col0 + 8 * (4 * (g0 + i) + q);
            ok[i] = hp[h] != nullptr && (NI % BN == 0 || c < NI);
            if constexpr ((Cfg::PROF & kProfNoDgradLoads) != 0) continue;  // profiling
            graw[i] = ok[i] ? *reinterpret_cast<const uint4*>(hp[h] + c) : uint4{};
            uraw[i] = ok[i] ? *reinterpret_cast<const uint4*>(hp[h] + NI + c) : uint4{};
          }
#pragma unroll
          for (int i = 0; i < kAhead; ++i) {
            float v[8], g[8], u[8], dg[8], du[8], wa[8];
            oct_of<0>(acc, g0 + i, h, v);  // every lane shuffles, before the mask
            if (!ok[i]) continue;
            const int c = col0 + 8 * (4 * (g0 + i) + q);
            if constexpr ((Cfg::PROF & kProfNoDgradLoads) != 0) {  // profiling: no loads
#pragma unroll
              for (int j = 0; j < 8; ++j) g[j] = u[j] = v[j];
            } else {
              floats_of_bf16x8(graw[i], g);
              floats_of_bf16x8(uraw[i], u);
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) swiglu_grad(v[j], g[j], u[j], w[h], dot[h], dg[j],
                                                    du[j], wa[j]);
            if constexpr ((Cfg::PROF & kProfNoDgradStores) != 0) continue;  // profiling
            *reinterpret_cast<uint4*>(dhp[h] + c) = bf16x8(dg);
            *reinterpret_cast<uint4*>(dhp[h] + NI + c) = bf16x8(du);
            if (ap[h] != nullptr) *reinterpret_cast<uint4*>(ap[h] + c) = bf16x8(wa);
          }
        }
      }
      return;
    }
#pragma unroll
    for (int r = 0; r < BN / 2; r += 2) {
      const int h = (r >> 1) & 1, c = col0 + acc_col(r);
      if (hp[h] == nullptr || (NI % BN != 0 && col0 + 8 * (r >> 2) >= NI)) continue;
      const float2 g = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(hp[h] + c));
      const float2 u = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(hp[h] + NI + c));
      float dg[2], du[2], wa[2];
      const float gg[2] = {g.x, g.y}, uu[2] = {u.x, u.y};
#pragma unroll
      for (int q = 0; q < 2; ++q) swiglu_grad(acc[r + q], gg[q], uu[q], w[h], dot[h], dg[q],
                                              du[q], wa[q]);
      const __nv_bfloat162 dg2 = __floats2bfloat162_rn(dg[0], dg[1]);
      const __nv_bfloat162 du2 = __floats2bfloat162_rn(du[0], du[1]);
      *reinterpret_cast<__nv_bfloat162*>(dhp[h] + c) = dg2;
      *reinterpret_cast<__nv_bfloat162*>(dhp[h] + NI + c) = du2;
      if (ap[h] != nullptr)
        *reinterpret_cast<__nv_bfloat162*>(ap[h] + c) = __floats2bfloat162_rn(wa[0], wa[1]);
    }
  }

  // fp8 plans: the routed SwiGLU backward of a dgrad tile 8 columns at a time, as
  // swiglu_backward's bf16 path (dh over h, w a over a, <a, d_a> per row in dot), with dh
  // also quantized along 2I (the dx GEMM's K) into ring_dh8 + ring_sdh from its bf16 values.
  // A lane's 4 groups of a batch (oct_of: group 4 g + lane % 4) cover 128 columns of its row
  // across the quad, so a Q-column block is Q / 32 of its groups and a quad max: dh waits in
  // registers (packed bf16) for its block's scale alone, and goes out in 8-byte stores where
  // pair by pair it went in 2-byte ones. Each half (d gate, d up) is laid out padded to PI
  // columns (as W1^T's, FwdConsts::PI): an edge tile writes zeros from I to PI (the dx GEMM
  // reads them). Rows r_h: this thread's two tile rows.
  MOKGEN_DEV void swiglu_backward_fp8(const Task& t, const float (&acc)[BN / 2],
                                      const int (&r_h)[2], __nv_bfloat16* const (&hp)[2],
                                      __nv_bfloat16* const (&ap)[2], const float (&w)[2],
                                      float (&dot)[2]) const {
    if constexpr (C::Q > 0) {
      constexpr int kBatch = 4, kPerBlock = C::Q / 32;  // groups a lane has of a batch, a block
      static_assert((BN / 32) % kBatch == 0 && kBatch % kPerBlock == 0, "whole blocks a batch");
      const int q = threadIdx.x & 3;
      dot[0] = dot[1] = 0.f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint8_t* const out = buf->ring_dh8 + (size_t)(t.a_row0 + r_h[h]) * 2 * C::PI;
#pragma unroll
        for (int g0 = 0; g0 < BN / 32; g0 += kBatch) {
          // g / u of the batch loaded before its stores (dh lands over h: the compiler may
          // not hoist a group's loads above the previous group's stores)
          uint4 dg[kBatch], du[kBatch];  // g / u as loaded, then d gate / d up as stored
          int col[kBatch];
#pragma unroll
          for (int i = 0; i < kBatch; ++i) {
            col[i] = t.c_col0 + 8 * (4 * (g0 + i) + q);
            const bool ok = C::I % BN == 0 || col[i] < C::I;
            dg[i] = ok ? *reinterpret_cast<const uint4*>(hp[h] + col[i]) : uint4{};
            du[i] = ok ? *reinterpret_cast<const uint4*>(hp[h] + C::I + col[i]) : uint4{};
          }
#pragma unroll
          for (int i = 0; i < kBatch; ++i) {
            float v[8], g[8], u[8], fg[8], fu[8], wa[8];
            oct_of<0>(acc, g0 + i, h, v);  // every lane shuffles, before the mask
            if (C::I % BN != 0 && col[i] >= C::I) continue;  // zeros (loaded as such)
            floats_of_bf16x8(dg[i], g);
            floats_of_bf16x8(du[i], u);
#pragma unroll
            for (int j = 0; j < 8; ++j) swiglu_grad(v[j], g[j], u[j], w[h], dot[h], fg[j],
                                                    fu[j], wa[j]);
            dg[i] = bf16x8(fg);
            du[i] = bf16x8(fu);
            *reinterpret_cast<uint4*>(hp[h] + col[i]) = dg[i];  // dh over h
            *reinterpret_cast<uint4*>(hp[h] + C::I + col[i]) = du[i];
            *reinterpret_cast<uint4*>(ap[h] + col[i]) = bf16x8(wa);
          }
          if constexpr ((Cfg::PROF & kProfNoDhQuant) != 0) continue;  // profiling
#pragma unroll
          for (int b = 0; b < kBatch; b += kPerBlock) {
            // the block's first column: past PI (an edge tile's last blocks), nothing
            const int block_col = t.c_col0 + 32 * (g0 + b);
            if (C::I % BN != 0 && block_col >= C::PI) break;
#pragma unroll
            for (int half = 0; half < 2; ++half) {  // d gate, then d up (columns + PI)
              float amax = 0.f, f[kPerBlock][8];
#pragma unroll
              for (int i = 0; i < kPerBlock; ++i) {
                floats_of_bf16x8(half ? du[b + i] : dg[b + i], f[i]);
#pragma unroll
                for (int j = 0; j < 8; ++j) amax = max_nan(amax, fabsf(f[i][j]));
              }
              const Fp8Scale sc = fp8_scale<C::Q>(group_max<4>(amax));
#pragma unroll
              for (int i = 0; i < kPerBlock; ++i)
                *reinterpret_cast<uint2*>(out + half * C::PI + col[b + i]) = fp8x8(f[i], sc.inv);
              if (q == 0)
                buf->ring_sdh[(size_t)((half * C::PI + block_col) / C::Q) * C::RING_ROWS +
                              t.a_row0 + r_h[h]] = sc.scale;
            }
          }
        }
      }
    }
  }

  // gate/up + SwiGLU that also keeps the pre-activations (the replay and the shared expert);
  // n_valid: the tile's output columns inside NI
  MOKGEN_DEV void gate_up_epilogue(const Task& t, const float (&acc)[BN / 2], int cwg,
                                   __nv_bfloat16* pre, __nv_bfloat16* act, int NI,
                                   int n_valid) const {
    store_gate_up<BN, C::Q == 0>(acc, cwg, t.m_valid, pre, act, NI, n_valid);
  }

  // A whole expert's weight-gradient tile through registers (the store path of kernels
  // whose stages leave no room for the TMA path's staging tile: fp8), 8 columns at a time
  // (oct_of): 16-byte stores where pairs would issue 4x as many. kAdd: the gradient already
  // there added first, rounded once (fused gradient accumulation); a row's loads all go
  // before its stores, which the compiler could not hoist them above (it cannot tell rows
  // apart: ld is the operand's).
  template <bool kAdd>
  MOKGEN_DEV void store_whole_wgrad(const float (&acc)[BN / 2], int cwg, int m_valid,
                                    int n_valid, __nv_bfloat16* out, int ld) const {
    const int w = (threadIdx.x >> 5) & 3, l = threadIdx.x & 31;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = 64 * cwg + 16 * w + (l >> 2) + 8 * h;
      __nv_bfloat16* const o = out + (size_t)row * ld;
      const auto in = [&](int g) { return row < m_valid && 8 * (4 * g + (l & 3)) < n_valid; };
      uint4 before[BN / 32];
      if constexpr (kAdd) {
#pragma unroll
        for (int g = 0; g < BN / 32; ++g)
          before[g] = in(g) ? *reinterpret_cast<const uint4*>(o + 8 * (4 * g + (l & 3)))
                            : uint4{};
      }
#pragma unroll
      for (int g = 0; g < BN / 32; ++g) {
        float v[8];
        oct_of<0>(acc, g, h, v);  // every lane shuffles, before the mask
        if (!in(g)) continue;
        if constexpr (kAdd) {
          float b[8];
          floats_of_bf16x8(before[g], b);
#pragma unroll
          for (int j = 0; j < 8; ++j) v[j] += b[j];
        }
        *reinterpret_cast<uint4*>(o + 8 * (4 * g + (l & 3))) = bf16x8(v);
      }
    }
  }

  // A weight-gradient tile: one segment's contribution, summed in segment order (fp32 in
  // wg_acc between segments; the last one writes the bf16 gradient, or with `accumulate`
  // adds the sum to the routed gradient already there, rounding once: fused gradient
  // accumulation, no second gradient-sized tensor and no separate add).
  // A whole expert's tile (kTmaWgrad kernels) goes out in bf16 through shared memory and TMA;
  // with `accumulate` as a TMA reduction into the gradient there (the bf16 tile added to it,
  // rounded once more: the same two roundings as autograd's bf16 gradient and its add into
  // .grad), instead of the register path's read of it: the weight gradients are this phase's
  // memory traffic, and their reads were its most expensive part.
  // Rows 64 cwg .. of the tile in acc, by consumer warpgroup cwg (its staging half, its
  // barriers).
  MOKGEN_DEV void wgrad_epilogue(const Task& t, float (&acc)[BN / 2], int cwg) const {
    const int op = opcode(t);
    if constexpr ((Cfg::PROF & kProfNoWgradEpilogue) != 0)  // profiling (Plan.profile)
      if (op == kWgrad2 || op == kWgrad1) return;
    const int row0 = t.a_row0, col0 = t.b_row0;  // the output's origin (kWgradWhole)
    if constexpr (kTmaWgrad) {
      if ((t.op & kWgradWhole) && buf->wgrad_tma) {
        store_rows_tma<BN, (kWgradBufs < BN / 64 ? kWgradBufs : BN / 64)>(
            acc, cwg, stage + cwg * (Cfg::EPI_BYTES / 2),
            op == kWgrad2 ? &maps->dw2_st : &maps->dw1_st, col0, row0 + 64 * cwg,
            wgrad_expert(t),
            op == kWgrad2 ? cols_valid<C::I, BN>(col0) : cols_valid<C::D, BN>(col0),
            buf->accumulate != 0);
        return;
      }
    }
    __nv_bfloat16* out;
    float* ws = nullptr;
    int ld, idx = 0, count = 1;
    if (op == kSWgrad2 || op == kSWgrad1) {
      out = op == kSWgrad2 ? buf->dsw2 : buf->dsw1;
      ld = op == kSWgrad2 ? C::IS : C::D;
    } else {
      const int4 seg = buf->segs[t.m_valid];
      const int e = seg.x;
      idx = seg.w & 0xffff;
      count = seg.w >> 16;
      const size_t ID = (size_t)C::I * C::D;
      // the running sum's slot (workspace.LayerSpec.wg_by_minibatch): the minibatch the
      // expert's rows start in (segment idx starts at minibatch first + idx, segment 0 at
      // the expert's first row), unique to it among the experts that have a sum; or the expert
      const int slot = buf->wg_by_minibatch ? seg.y / C::B - idx : e;
      if (op == kWgrad2) {
        out = buf->dw2 + e * ID;
        ws = buf->wg_acc + slot * 3 * ID;
        ld = C::I;
      } else {
        out = buf->dw1 + e * 2 * ID;
        ws = buf->wg_acc + slot * 3 * ID + ID;
        ld = C::D;
      }
    }
    const size_t base = (size_t)row0 * ld + col0;
    out += base;
    if (ws) ws += base;
    const bool last = idx == count - 1;
    const bool add = buf->accumulate && (op == kWgrad2 || op == kWgrad1);
    const int n_valid = op == kWgrad2  ? cols_valid<C::I, BN>(col0)
                        : op == kSWgrad2 ? cols_valid<C::IS, BN>(col0)
                                         : cols_valid<C::D, BN>(col0);  // dW1, dsw1
    const int m_valid = op == kWgrad1    ? rows_valid<2 * C::I, BM>(row0)
                        : op == kSWgrad1 ? rows_valid<2 * C::IS, BM>(row0)
                                         : rows_valid<C::D, BM>(row0);  // dW2, dsw2
    if (count == 1) {  // the whole expert in one segment: its own path (with the running
      // sum's load and the branches of the general one below in each pair's body, ptxas
      // kept them there: a loop of 64 pairs is not unswitched)
      if (add) store_whole_wgrad<true>(acc, cwg, m_valid, n_valid, out, ld);
      else store_whole_wgrad<false>(acc, cwg, m_valid, n_valid, out, ld);
      return;
    }
    if (add && last) {  // the gradient already there, in a pass of loads alone (a load next
      // to each store below would wait for that store: the compiler cannot tell them apart)
      for_each_acc_pair<BN>(acc, cwg, m_valid, [&](int r, int c, float& v0, float& v1) {
        const float2 before = __bfloat1622float2(
            *reinterpret_cast<const __nv_bfloat162*>(out + (size_t)r * ld + c));
        v0 += before.x;
        v1 += before.y;
      }, n_valid);
    }
    for_each_acc_pair<BN>(acc, cwg, m_valid, [&](int r, int c, float v0, float v1) {
      const size_t o = (size_t)r * ld + c;
      if (idx > 0) {  // L2 only: another SM wrote the running sum
        const float2 prev = __ldcg(reinterpret_cast<const float2*>(ws + o));
        v0 += prev.x;
        v1 += prev.y;
      }
      if (last) *reinterpret_cast<__nv_bfloat162*>(out + o) = __floats2bfloat162_rn(v0, v1);
      else __stcg(reinterpret_cast<float2*>(ws + o), make_float2(v0, v1));
    }, n_valid);
  }

  MOKGEN_DEV void epilogue(const Task& t, float (&acc)[Cfg::kAccRegs], int cwg) {
    // profiling (Plan.profile): the task's completion signals are the engine's, after this
    if constexpr ((Cfg::PROF & kProfNoBwdEpilogues) != 0) return;
    const int op = opcode(t);
    const int row0 = 64 * cwg;  // this warpgroup's first tile row
    if (op == kSGateUp) {
      gate_up_epilogue(t, acc, cwg, buf->hs_pre + (size_t)t.c_row0 * 2 * C::IS + t.c_col0,
                       buf->hs_a + (size_t)t.c_row0 * C::IS + t.c_col0, C::IS,
                       cols_valid<C::IS, BN / 2>(t.c_col0));
    } else if (op == kReplay) {
      if constexpr (C::XWIN) {  // A is the x window's rows; h and a go to the ring row, which
        // is the layout row c_row0 (the ring holds every minibatch)
        gate_up_epilogue(t, acc, cwg, buf->ring_h + (size_t)t.c_row0 * 2 * C::I + t.c_col0,
                         buf->ring_a + (size_t)t.c_row0 * C::I + t.c_col0, C::I,
                         cols_valid<C::I, BN / 2>(t.c_col0));
      } else {
        gate_up_epilogue(t, acc, cwg, buf->ring_h + (size_t)t.a_row0 * 2 * C::I + t.c_col0,
                         buf->ring_a + (size_t)t.a_row0 * C::I + t.c_col0, C::I,
                         cols_valid<C::I, BN / 2>(t.c_col0));
      }
    } else if (op == kSDgrad) {
      const __nv_bfloat16* hp[2];
      __nv_bfloat16* dhp[2];
      __nv_bfloat16* const ap[2] = {nullptr, nullptr};  // dsw2 reads the forward's a (w = 1)
      const float w[2] = {1.f, 1.f};
      float dot[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = row0 + acc_row(2 * h);
        const size_t at = (size_t)(t.c_row0 + r) * 2 * C::IS;
        hp[h] = dhp[h] = r < t.m_valid ? buf->hs_pre + at : nullptr;  // dh over h, as routed
      }
      swiglu_backward<C::IS>(acc, t.c_col0, hp, dhp, ap, w, dot);
    } else if (op == kDgrad) {
      __nv_bfloat16* hp[2];
      __nv_bfloat16* ap[2];
      float w[2], dot[2];
      int r[2], p[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        r[h] = row0 + acc_row(2 * h);
        p[h] = t.c_row0 + r[h];
        const bool pad = buf->table[p[h]].x < 0;
        w[h] = pad ? 0.f : buf->row_weight[p[h]];  // padding rows: dh = 0 (their weight is unset)
        hp[h] = buf->ring_h + (size_t)(t.a_row0 + r[h]) * 2 * C::I;  // dh over h
        ap[h] = buf->ring_a + (size_t)(t.a_row0 + r[h]) * C::I;  // w * a over a
      }
      if constexpr (C::Q > 0) {
        swiglu_backward_fp8(t, acc, r, hp, ap, w, dot);
      } else {
        const __nv_bfloat16* const h_in[2] = {hp[0], hp[1]};
        swiglu_backward<C::I>(acc, t.c_col0, h_in, hp, ap, w, dot);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // a row lives in the 4 lanes of a quad: fixed-order sum
        dot[h] += __shfl_xor_sync(0xffffffff, dot[h], 1);
        dot[h] += __shfl_xor_sync(0xffffffff, dot[h], 2);
        if ((threadIdx.x & 3) == 0) buf->dw_part[(size_t)p[h] * S::DG_N + t.c_col0 / BN] = dot[h];
      }
    } else if (op == kSDx) {
      store_f32<BN, C::Q == 0>(acc, cwg, t.m_valid,
                               buf->dx_shared + (size_t)t.c_row0 * C::D + t.c_col0, C::D,
                               cols_valid<C::D, BN>(t.c_col0));
    } else if (op == kDx) {  // push each row's dx to its owner (reverse dispatch)
      __nv_bfloat16* dst[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = row0 + acc_row(2 * h), p = t.c_row0 + r;
        const int2 src = buf->table[p];
        const bool ok = src.x >= 0 &&
            MOKGEN_OK(src.x < C::R && src.y < buf->n_tokens * C::K && p < s.rows, 22, src.x, p);
        if constexpr (C::DXRING)  // over its own dy row, which DG and dW2 are done with
          dst[h] = ok ? buf->ring_dy + (size_t)(t.a_row0 + r) * C::D + t.c_col0 : nullptr;
        else
          dst[h] = ok ? peers->dx[src.x] + (size_t)src.y * C::D + t.c_col0 : nullptr;
      }
      const float one[2] = {1.f, 1.f};
      store_rows_to<BN, C::Q == 0>(acc, dst, one, cols_valid<C::D, BN>(t.c_col0));
      // the router-weight gradient of each of the task's BM rows, pushed by warpgroup 0's
      // 128 threads (a row each) in either consumer schedule: exactly once per task
      static_assert(BM == 128, "one row per thread of a warpgroup");
      if (t.c_col0 == 0 && cwg == 0) {
        const int p = t.c_row0 + (threadIdx.x & 127);
        const int2 src = buf->table[p];
        if (src.x >= 0) {
          float sum = 0.f;
#pragma unroll
          for (int j = 0; j < S::DG_N; ++j) sum += __ldcg(buf->dw_part + (size_t)p * S::DG_N + j);
          peers->dweight[src.x][src.y] = sum;
        }
      }
    } else {
      wgrad_epilogue(t, acc, cwg);
    }
    if (op == kSGateUp || op == kReplay || op == kSDgrad || op == kDgrad)
      fence_proxy_async_global();  // later GEMMs read these rows through TMA
  }

  // One thread, once per task, after every thread's epilogue stores (gemm_persistent).
  MOKGEN_DEV void signal(const Task& t) const {
    const int op = opcode(t);
    const int rt = (t.c_row0 % C::B) / BM, m = t.c_row0 / C::B;
    switch (op) {
      case kSGateUp: signal_add(sr_done() + t.c_row0 / BM); signal_add(sr_all()); break;
      case kSDgrad: signal_add(sdg_done() + t.c_row0 / BM); signal_add(sdg_all()); break;
      case kReplay: signal_add(r_done() + m * S::RT_FULL + rt); break;
      case kDgrad: signal_add(dg_done() + m * S::RT_FULL + rt); break;
      case kDx:
        // fin_done frees the minibatch's ring slot for a comm CTA's refill
        // (bwd_comm_minibatch), the only reader: where the ring holds every minibatch none
        // comes, and the fence would hold the consumer warp for the dx stores' drain
        if (buf->max_minibatches > C::SLOTS) signal_add(fin_done() + m);
        break;
      case kWgrad2: case kWgrad1: {
        const int tt = op == kWgrad2
            ? S::W2Order::index(t.a_row0 / BM, t.b_row0 / BN)
            : S::W2T + S::W1Order::index(t.a_row0 / BM, t.b_row0 / BN);
        int e, unit;
        bool more = false;  // a later segment of the expert reads this one's fp32 sum
        if (kTmaWgrad && (t.op & kWgradWhole)) {
          if (t.op & kWgradEmpty) break;  // a zero tile of an expert without rows
          e = wgrad_expert(t);
          unit = t.c_col0;
        } else {
          const int4 seg = buf->segs[t.m_valid];
          if (seg.z == seg.y) break;
          e = seg.x;
          unit = (seg.z - 1) / C::B;  // the unit it is listed under
          more = (seg.w & 0xffff) + 1 < (seg.w >> 16);
        }
        if constexpr (C::DXRING) {  // the ring holds every minibatch: one segment each
          // the tile's dy rows were in shared memory and multiplied before this count, so
          // the dx tile that overwrites them after seeing it needs no fence here either
          if (op == kWgrad2) signal_add_relaxed(wg2_done() + e);
        }
        if constexpr (C::XWIN) {  // likewise its x rows, which a comm CTA may then refill
          if (op == kWgrad1) signal_add_relaxed(wg1_done() + e);
        }
        if (more) {
          signal_add(wg_seq() + e * S::WT + tt);
          signal_add(fin_done() + unit);
        } else {
          // the last segment: its bf16 gradient is read by no one in the kernel, and the ring
          // slot this count frees was read by TMA before the mainloop ended, so no fence: the
          // stores drain under the next tile's mainloop (fenced, this epilogue takes ~40% of
          // the short-K weight gradients' time)
          signal_add_relaxed(wg_seq() + e * S::WT + tt);
          signal_add_relaxed(fin_done() + unit);
        }
        break;
      }
      default: break;
    }
  }
};

// Minibatch m's rows into its ring slot, by `workers` warps: x if the ring lost it (replay)
// or may not hold it (XPULL: the forward gathered, or keep_h unless the ring is this call's:
// resident 2), dy unless the owners push it.
template <class C, class S>
MOKGEN_DEV void bwd_pull_minibatch(const BwdPeers<C::R>& peers, const BwdBuffers& buf,
                                   const S& s, int m, int worker, int workers) {
  const int p0 = m * C::B, p1 = min(p0 + C::B, s.rows), ring0 = s.slot_row(m);
  if constexpr (C::Q > 0) {  // the replay and dgrad read e4m3 rows; the weight gradients bf16
    using Sink = QuantSink<C::D, C::Q, C::RING_ROWS>;
    if (s.replayed(m))
      pull_rows<C::D, C::K>(buf.table, peers.x, buf.ring_x, p0, p1, ring0, worker, workers,
                            nullptr, nullptr, Sink{buf.ring_x8, buf.ring_sx});
    else
      pull_rows<C::D, C::K>(buf.table, peers.x, buf.ring_x, p0, p1, ring0, worker, workers);
    pull_rows<C::D, C::K>(buf.table, peers.dy, buf.ring_dy, p0, p1, ring0, worker, workers,
                          nullptr, nullptr, Sink{buf.ring_dy8, buf.ring_sdy});
  } else {
    constexpr int VEC = C::D / 8;
    if constexpr (C::XPULL && VEC % 32 == 0 && (VEC % 256 == 0 || VEC < 256)) {
      if (buf.resident > 1)  // the ring holds this call's x too (keep_h): dy alone
        pull_rows<C::D, C::K>(buf.table, peers.dy, buf.ring_dy, p0, p1, ring0, worker,
                              workers);
      else  // both rows of a route at once (pull_row_pairs)
        pull_row_pairs<C::D, C::K>(buf.table, peers.x, buf.ring_x, s.x_row(ring0), peers.dy,
                                   buf.ring_dy, ring0, p0, p1, worker, workers);
    } else {
      if constexpr (C::XWIN)  // (its own branch: see replay)
        pull_rows<C::D, C::K>(buf.table, peers.x, buf.ring_x, p0, p1, s.x_row(ring0), worker,
                              workers);
      else if (C::XPULL ? buf.resident < 2 || s.replayed(m) : s.replayed(m))
        pull_rows<C::D, C::K>(buf.table, peers.x, buf.ring_x, p0, p1, ring0, worker, workers);
      pull_rows<C::D, C::K>(buf.table, peers.dy, buf.ring_dy, p0, p1, ring0, worker, workers);
    }
  }
  fence_proxy_async_global();
  __syncthreads();
}

// Every CTA, before its role (FwdConsts::BWD_HEAD): its share of minibatch 0, then one count
// each on its ready flag (the replay and dgrad tiles wait for gridDim.x of them there).
template <class C, class Cfg>
MOKGEN_DEV void bwd_head_pull(const BwdPeers<C::R>& peers, const BwdBuffers& buf) {
  if constexpr (C::BWD_HEAD) {
    BwdSchedule<C, Cfg> s;
    s.init(buf.meta[0], buf.n_tokens, buf.resident, buf.seg_start);
    if (s.nm == 0) return;
    const int warps = blockDim.x / 32;
    bwd_pull_minibatch<C>(peers, buf, s, 0, blockIdx.x * warps + threadIdx.x / 32,
                          gridDim.x * warps);
    if (threadIdx.x == 0) signal_add(buf.counters + 1);  // ready[0]: counter layout BwdProblem
  }
}

// One minibatch of a comm CTA's own rank: wait for its ring slot, pull its rows
// (bwd_pull_minibatch; minibatch 0 every CTA pulled already: bwd_head_pull), publish.
// false: the watchdog fired.
// XWIN: minibatch prev's x rows are read by its replay tiles and by the dW1 tiles of every
// expert with rows in it, which wait for its dgrad (and that for its replay): its window slot
// may be refilled once each of those experts' dW1 tiles is done. An expert has at most N rows
// (a token's routes go to distinct experts), so passes/x_window.py sizes the window for its
// last minibatch to be >= 2 before the refilled one: its dW1 tiles (FIN of that minibatch)
// are then listed before the first task that waits for the refill (the refilled minibatch's
// replay), and the wait needs only tasks ahead of it in the list.
template <class C, class S>
MOKGEN_DEV bool wait_x_slot(const BwdBuffers& buf, const S& s, int prev,
                            const uint32_t* wg1_done) {
  if constexpr (!S::kRoutedWgrad) return true;  // profiling: no dW1 tiles read them
  const int r0 = prev * C::B, r1 = min(r0 + C::B, s.rows) - 1;
  const int e1 = expert_at<C::L>(buf.offsets, r1);
  for (int e = expert_at<C::L>(buf.offsets, r0); e <= e1; ++e)
    if (buf.offsets[e + 1] > buf.offsets[e] &&
        !wait_at_least(wg1_done + e, S::W1T, buf.rank, kPhaseXSlot, e))
      return false;
  return true;
}

template <class C, class S>
MOKGEN_DEV bool bwd_comm_minibatch(const BwdPeers<C::R>& peers, const BwdBuffers& buf,
                                   const S& s, int m, int worker, int workers,
                                   uint32_t* fin_done, uint32_t* ready, uint32_t* wg1_done) {
  __shared__ int go;
  if (C::BWD_HEAD && m == 0) return true;
  if (C::XWIN && m >= C::XSLOTS) {  // the x window's slot: its minibatch's dW1 tiles are done
    if (threadIdx.x == 0) go = wait_x_slot<C, S>(buf, s, m - C::XSLOTS, wg1_done);
    __syncthreads();
    if (!go) return false;
  }
  if (m >= C::SLOTS) {  // the slot's previous minibatch must be finished (DX and WG)
    const int prev = m - C::SLOTS;
    if (threadIdx.x == 0)
      go = wait_at_least(fin_done + prev, s.fin_size(prev + 1), buf.rank, kPhaseBwdRingSlot,
                         prev);
    __syncthreads();
    if (!go) return false;
  }
  bwd_pull_minibatch<C>(peers, buf, s, m, worker, workers);
  if (threadIdx.x == 0) signal_add(ready + m);
  return true;
}

// Comm CTA: per minibatch in backward order, free its ring slot, replay-pull x if the ring
// lost it, pull dy, publish. Returns whether every minibatch was done (false: the watchdog
// fired): bwd_comm_join's condition.
template <class C, class Cfg>
MOKGEN_DEV bool bwd_comm(const BwdPeers<C::R>& peers, const BwdBuffers& buf) {
  using S = BwdSchedule<C, Cfg>;
  S s;
  s.init(buf.meta[0], buf.n_tokens, buf.resident, buf.seg_start);
  uint32_t* ready = buf.counters + 1;  // counter layout: BwdProblem
  uint32_t* fin_done = ready + buf.max_minibatches * (1 + 2 * S::RT_FULL);
  uint32_t* wg1_done = C::XWIN ? BwdProblem<C, Cfg>::wg1_done_of(buf) : nullptr;
  const int warps = blockDim.x / 32;
  const int worker = blockIdx.x * warps + threadIdx.x / 32, workers = C::COMM * warps;
  for (int m = 0; m < s.nm; ++m)
    if (!bwd_comm_minibatch<C, S>(peers, buf, s, m, worker, workers, fin_done, ready,
                                  wg1_done))
      return false;
  return true;
}

// Whether a comm CTA of this backward joins the compute CTAs once its pulls are done: the
// kernel that pulls x beside dy (XPULL without an x window: keep_h's backward in a stack of
// layers), whose comm CTAs are many (sm_partition counts the x pulls: 18 on Qwen3-30B-A3B,
// 14% of the SMs) and, the ring holding every minibatch, never wait on the compute; they are
// done with their pulls long before the last tile. A joined CTA takes tasks from the same
// atomic list as the others (BwdProblem::next_task), after its last pull: every task it
// waits on is earlier in the list or a pull, which progress without it. (Kernels whose few
// comm CTAs pull dy alone do not join: there joining measured neutral.)
template <class C>
constexpr bool kCommJoins = C::XPULL && !C::XWIN;

// bwd_comm outlined for the joining kernels: inlined, ptxas keeps values of the comm code and
// of the compute's setup live across both roles and spills.
template <class C, class Cfg>
__device__ __noinline__ bool bwd_comm_join(const BwdPeers<C::R>& peers, const BwdBuffers& buf) {
  return bwd_comm<C, Cfg>(peers, buf);
}

}  // namespace mokgen
