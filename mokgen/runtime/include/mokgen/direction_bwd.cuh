// mokgen/direction_bwd.cuh -- the backward's non-default communication directions (paper 3.1),
// the mirror of the forward's (direction.cuh):
// - push reverse-combine: every owner's comm CTAs write their own dy rows into each expert
//   rank's dy ring slot once that slot's previous minibatch is finished there (a cross-GPU
//   flag the owner polls), then count themselves into the expert's dy_landed[m]; the expert's
//   dgrad tiles wait for all R owners' arrivals.
// - pull reverse-dispatch: the dx tiles' epilogue stores each dx row (and its router-weight
//   gradient) into this rank's staging rows and counts the tile into dx_done[m]; every
//   owner's comm CTAs poll the expert ranks' dx_done, copy the rows of their own routes into
//   their dx rows (the same bf16 values push stores there: the owner's fixed-order sum is
//   bitwise the same), and count themselves into the expert's dx_pulled[m], which frees the
//   staging slot for the minibatch SLOTS later.
// Cross-rank words of a rank (BwdDirPeers::xflags: the forward's words, zeroed before each
// backward too; runtime/abi.py XFLAG_WORDS):
//   [0, MB)    dy_landed[m]: owner comm CTAs that pushed minibatch m's dy here (R * CD)
//   [MB, 2MB)  slot_free[m]: this rank's dy comm CTAs that saw minibatch m finished (its dx
//              and weight-gradient tiles: nothing reads its ring slot any more) (CD)
//   [2MB, 3MB) dx_pulled[m]: owner comm CTAs that pulled minibatch m's staged dx (R * CC)
//   [3MB, 4MB) dx_done[m]: this rank's dx tiles of minibatch m that are done
// Minibatches are walked in backward order (m ascending) on every rank; each wait at
// minibatch m needs only work of minibatches < m, or of m's earlier stage, on any rank (ring
// slots hold >= 2 minibatches), so no rank can wait on a rank that waits on it.
#pragma once
#include <cuda_bf16.h>
#include "mokgen/direction.cuh"
#include "mokgen/sync.cuh"

namespace mokgen {

// Every rank's buffers the backward's non-default directions touch (runtime/abi.py
// BWD_DIR_PEERS). The staging rows are the forward's pull-combine ones (a kernel at a time).
template <int R>
struct BwdDirPeers {
  uint32_t* xflags[R];         // [XFLAG_WORDS * max_minibatches] cross-rank words (above)
  __nv_bfloat16* ring_dy[R];   // push reverse-combine writes peers' dy rings
  const int2* table[R];        // their schedules (ring-layout row -> (src rank, src route))
  const int* meta[R];          // [0] = their ring-layout rows
  __nv_bfloat16* stage[R];     // pull reverse-dispatch: [SLOTS*B, D] dx rows (stage_row)
  float* stage_dw[R];          //   and [SLOTS*B] router-weight gradients, the same rows
};

enum BwdXFlag : int { kXDyLanded = 0, kXSlotFree = 1, kXDxPulled = 2, kXDxDone = 3 };
MOKGEN_DEV uint32_t* bxflag(uint32_t* xflags, int max_minibatches, BwdXFlag which, int m) {
  return xflags + which * max_minibatches + m;
}

// Watchdog phases of these waits (runtime/abi.py BWD_DIR_PHASES).
enum BwdDirPhase : int {
  kPhaseDyPushSlot = 8, kPhaseDyLanded = 9, kPhaseDxReady = 10, kPhaseDxStageSlot = 20,
};

// A ring-layout row's staging row: minibatch m = p / B stages in slot m % SLOTS. Not the
// backward's rotated ring slot (BwdSchedule::slot_row): a puller then needs no more of the
// expert's schedule than its row count.
template <int B, int SLOTS>
MOKGEN_DEV int stage_row(int p) {
  return ((p / B) % SLOTS) * B + p % B;
}

// Rank e's backward schedule for the loops below (S: the kernel's BwdSchedule): its row
// count gives its minibatches, row tiles and (ring rows rotate with the count) ring slots.
template <class S>
MOKGEN_DEV S bwd_schedule_of(const int* meta) {
  S s;
  s.init(meta[0], 0, 0, nullptr);  // tokens, residency, segments: the expert's own business
  return s;
}

// Push reverse-combine, one owner's minibatch-m part for every expert rank (each source
// starts at a different rank so the copies spread over the links): wait for the rank's slot
// to be free, write this owner's dy rows (and, on the expert itself, the zero padding rows:
// the weight gradients sum over every row) into it, count the arrival.
template <class C, class S>
MOKGEN_DEV bool push_dy_minibatch(const BwdDirPeers<C::R>& dir, const __nv_bfloat16* dy, int me,
                                  int max_minibatches, int m, int worker, int workers) {
  const auto sched_of = [&](int e) { return bwd_schedule_of<S>(dir.meta[e]); };
  return for_each_rank_at<C::R>(m, me, sched_of, [&](int e, const S& s) {
    uint32_t* xf = dir.xflags[e];
    if (m >= C::SLOTS &&
        !cta_wait_sys(bxflag(xf, max_minibatches, kXSlotFree, m - C::SLOTS), C::CD, me,
                      kPhaseDyPushSlot, m - C::SLOTS))
      return false;  // the watchdog fired: stop, let the kernel drain
    const int p0 = m * C::B, p1 = min(p0 + C::B, s.rows);
    push_rows<C::D, C::K>(dir.table[e], me, e, dy, dir.ring_dy[e], p0, p1, s.slot_row(m),
                          worker, workers);
    __threadfence_system();  // this thread's row stores, before the CTA's arrival
    __syncthreads();
    if (threadIdx.x == 0) signal_add_sys(bxflag(xf, max_minibatches, kXDyLanded, m));
    return true;
  });
}

// Pull reverse-dispatch, one owner's part of one minibatch of expert rank `src_rank`: the dx
// rows and router-weight gradients of its own routes, from the expert's staging rows into
// its dx rows and dweight (where push reverse-dispatch's epilogue stores them).
template <int D, int B, int SLOTS>
MOKGEN_DEV void pull_dx_rows(const int2* src_table, int me, const __nv_bfloat16* src_stage,
                             const float* src_stage_dw, __nv_bfloat16* dx, float* dweight,
                             int p0, int p1, int worker, int workers) {
  for_picked_rows(src_table, p0, p1, worker, workers, [&](int2 s) { return s.x == me; },
                  [&](int p, int2 s) {
                    const int row = stage_row<B, SLOTS>(p);
                    copy_row_warp<D>(src_stage + (size_t)row * D, dx + (size_t)s.y * D);
                    if (threadIdx.x % 32 == 0) dweight[s.y] = src_stage_dw[row];
                  });
}

// The dx-pulling comm CTA `cta` of the group [CD, COMM): per minibatch, per expert rank, wait
// for its dx tiles, pull, count the pull into the expert's dx_pulled[m].
template <class C, class S>
MOKGEN_DEV void bwd_pull_dx(const BwdDirPeers<C::R>& dir, __nv_bfloat16* dx, float* dweight,
                            int me, int max_minibatches, int cta) {
  const int warps = blockDim.x / 32;
  const int worker = cta * warps + threadIdx.x / 32, workers = C::CC * warps;
  const auto sched_of = [&](int e) { return bwd_schedule_of<S>(dir.meta[e]); };
  walk_positions<C::R, C::B>(dir.meta, me, sched_of, [&](int m, int e, const S& s) {
    uint32_t* xf = dir.xflags[e];
    if (!cta_wait_sys(bxflag(xf, max_minibatches, kXDxDone, m), s.row_tiles(m) * S::DX_N, me,
                      kPhaseDxReady, m))
      return false;
    pull_dx_rows<C::D, C::B, C::SLOTS>(dir.table[e], me, dir.stage[e], dir.stage_dw[e], dx,
                                       dweight, m * C::B, min(m * C::B + C::B, s.rows), worker,
                                       workers);
    __syncthreads();  // every warp's reads of the staging rows are done
    if (threadIdx.x == 0) signal_add_sys(bxflag(xf, max_minibatches, kXDxPulled, m));
    return true;
  });
}

}  // namespace mokgen
