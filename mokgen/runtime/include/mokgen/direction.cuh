// mokgen/direction.cuh -- the forward's non-default communication directions (paper 3.1):
// push dispatch (each source rank writes its own token rows into the expert rank's ring) and
// pull combine (each owner fetches its weighted rows from the expert ranks' staging rows).
//
// Both walk another rank's schedule: its table and row count (meta) are read through peer
// pointers, so the runtime puts a barrier between the schedule kernels and the megakernel. Both
// need cross-GPU flags, which is what the paper's choice avoids. The cross-rank words of a rank
// (DirPeers::xflags, zeroed before each call like the counters):
//   [0, MB)    landed[m]: source comm CTAs that finished pushing minibatch m here
//   [MB, 2MB)  dn_done[m]: this rank's down tiles done (peers poll it: its ring slot is free
//              again for a pusher; its staging rows are final for a puller)
//   [2MB, 3MB) pulled[m]: owner comm CTAs that finished pulling minibatch m's staged rows
// Every wait is ordered by the minibatch's place in the processing order (and ring slots
// have >= 2 minibatches), so each waits only on work of earlier minibatches or on the
// same minibatch's earlier stage: no rank can wait on a rank that waits on it.
#pragma once
#include <cuda_bf16.h>
#include "mokgen/ptx.cuh"
#include "mokgen/sync.cuh"

namespace mokgen {

// Every rank's buffers the non-default directions touch (runtime/abi.py FWD_DIR_PEERS).
template <int R>
struct DirPeers {
  uint32_t* xflags[R];         // [3 * max_minibatches] cross-rank words (above)
  __nv_bfloat16* ring_x[R];    // push dispatch writes peers' rings
  const int2* table[R];        // their schedules (ring-layout row -> (src rank, src route))
  const int* meta[R];          // [0] = their ring-layout rows
  __nv_bfloat16* stage[R];     // pull combine: [SLOTS*B, D] weighted down rows per ring row
};

enum XFlag : int { kXLanded = 0, kXDnDone = 1, kXPulled = 2 };
MOKGEN_DEV uint32_t* xflag(uint32_t* xflags, int max_minibatches, XFlag which, int m) {
  return xflags + which * max_minibatches + m;
}

// Publish a count a peer GPU waits on: every thread of the CTA made its stores visible
// system-wide before the barrier; one thread then adds with a system-scope atomic.
MOKGEN_DEV void signal_add_sys(uint32_t* flag) {
  __threadfence_system();
  atomicAdd_system(flag, 1u);
}

// One warp copies a D-wide bf16 row (16-byte vectors) from `from`, or writes zeros when
// `from` is null (padding rows: the backward reads every ring row of a tile).
template <int D>
MOKGEN_DEV void copy_row_warp(const __nv_bfloat16* __restrict__ from,
                              __nv_bfloat16* __restrict__ to) {
  static_assert(D % 8 == 0, "rows move as 16-byte vectors");
  constexpr int VEC = D / 8, BATCH = 8;
  const int lane = threadIdx.x % 32;
  const int4* f = reinterpret_cast<const int4*>(from);
  int4* t = reinterpret_cast<int4*>(to);
  // batches of 8 loads before their stores: 4 KB of one row in flight per warp
  for (int v0 = 0; v0 < VEC; v0 += 32 * BATCH) {
    int4 buf[BATCH];
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int v = v0 + 32 * b + lane;
      buf[b] = f != nullptr && v < VEC ? f[v] : make_int4(0, 0, 0, 0);
    }
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int v = v0 + 32 * b + lane;
      if (v < VEC) t[v] = buf[b];
    }
  }
}

// Ring-layout rows [p0, p1) of a peer's table that `mine(src)` picks, spread over `workers`
// warps: each warp reads the table 32 entries at a time and takes every workers-th picked row,
// so the picked rows (about 1/R of them, interleaved by Algorithm 1) keep every warp busy.
// `row(p, src)` runs warp-wide.
template <class Pick, class Row>
MOKGEN_DEV void for_picked_rows(const int2* table, int p0, int p1, int worker, int workers,
                                Pick&& mine, Row&& row) {
  const int lane = threadIdx.x % 32;
  int seen = 0;
  for (int c = p0; c < p1; c += 32) {
    const int p = c + lane;
    const int2 src = p < p1 ? table[p] : make_int2(-1, -1);
    unsigned picked = __ballot_sync(0xffffffffu, p < p1 && mine(src));
    while (picked) {
      const int l = __ffs(picked) - 1;
      picked &= picked - 1;
      if (seen++ % workers != worker) continue;
      const int2 s = make_int2(__shfl_sync(0xffffffffu, src.x, l),
                               __shfl_sync(0xffffffffu, src.y, l));
      row(c + l, s);
    }
  }
}

// Push dispatch, one source rank's part of one minibatch of expert rank `dst`: its own token
// rows, and (when it is `dst` itself) the zero padding rows, into dst's ring slot.
template <int D, int K>
MOKGEN_DEV void push_rows(const int2* dst_table, int me, int dst, const __nv_bfloat16* x,
                          __nv_bfloat16* dst_ring, int p0, int p1, int ring_row0, int worker,
                          int workers) {
  for_picked_rows(dst_table, p0, p1, worker, workers,
                  [&](int2 s) { return s.x >= 0 ? s.x == me : dst == me; },
                  [&](int p, int2 s) {
                    copy_row_warp<D>(s.x >= 0 ? x + (size_t)(s.y / K) * D : nullptr,
                                     dst_ring + (size_t)(ring_row0 + p - p0) * D);
                  });
}

// Pull combine, one owner's part of one minibatch of expert rank `src_rank`: the weighted
// rows of its own routes, from the expert's staging rows into its combine rows (the same
// bf16 values push combine stores there, so combine_sum's result is bitwise the same).
template <int D>
MOKGEN_DEV void pull_combine_rows(const int2* src_table, int me,
                                  const __nv_bfloat16* src_stage, __nv_bfloat16* combine,
                                  int p0, int p1, int ring_row0, int worker, int workers) {
  for_picked_rows(src_table, p0, p1, worker, workers, [&](int2 s) { return s.x == me; },
                  [&](int p, int2 s) {
                    copy_row_warp<D>(src_stage + (size_t)(ring_row0 + p - p0) * D,
                                     combine + (size_t)s.y * D);
                  });
}

// Watchdog phases of these waits (runtime/abi.py FWD_DIR_PHASES).
enum DirPhase : int { kPhasePushSlot = 5, kPhaseCombineReady = 6, kPhaseStageSlot = 7 };

// The minibatch count of rank e's schedule, for the loops below (S: the kernel's FwdSchedule).
template <class S>
MOKGEN_DEV S schedule_of(const int* meta) {
  S s;
  s.init(meta[0], 0);  // n_tokens sizes the shared expert's tasks only: not needed here
  return s;
}

// The most minibatches any rank's schedule has (meta[e][0]: its ring-layout rows): the comm
// loops of the non-default directions, forward and backward, run to it on every rank.
template <int R, int B>
MOKGEN_DEV int max_minibatches_of(const int* const (&meta)[R]) {
  int nm = 0;
  for (int e = 0; e < R; ++e) nm = max(nm, (meta[e][0] + B - 1) / B);
  return nm;
}

// Those loops walk (processing position q, expert rank) q-major, each source starting at a
// different rank so the R ranks' copies spread over the links; a wait at position q only
// needs work of positions < q (or this q's earlier stage) on any rank, so it cannot deadlock.
// `visit(e, s)` for every rank e whose schedule s = sched_of(e) has a position q; it returns
// false when its wait fired the watchdog, and so does the walk then.
template <int R, class Sched, class Visit>
MOKGEN_DEV bool for_each_rank_at(int q, int me, Sched&& sched_of, Visit&& visit) {
  for (int i = 0; i < R; ++i) {
    const int e = (me + i) % R;
    const auto s = sched_of(e);
    if (q >= s.nm) continue;
    if (!visit(e, s)) return false;
  }
  return true;
}

// The comm loops' walk: every position q up to the longest schedule's minibatch count, then
// every rank there (for_each_rank_at); `visit(q, e, s)` false stops the walk (the watchdog
// fired: let the kernel drain).
template <int R, int B, class Sched, class Visit>
MOKGEN_DEV void walk_positions(const int* const (&meta)[R], int me, Sched&& sched_of,
                               Visit&& visit) {
  const int nm = max_minibatches_of<R, B>(meta);
  for (int q = 0; q < nm; ++q)
    if (!for_each_rank_at<R>(q, me, sched_of,
                             [&](int e, const auto& s) { return visit(q, e, s); }))
      return;
}

// Thread 0 waits for a peer GPU's count at `flag` to reach `target`; every thread learns
// whether it did (false: the watchdog fired). Called by the whole CTA; the loops put a
// __syncthreads between two calls (before their arrival), so `go` is read before rewritten.
MOKGEN_DEV bool cta_wait_sys(uint32_t* flag, int target, int me, int phase, int index) {
  __shared__ int go;
  if (threadIdx.x == 0) go = wait_at_least<true>(flag, target, me, phase, index);
  __syncthreads();
  return go;
}

// Push dispatch: the comm CTAs [0, CD) of every source rank write their own token rows into
// each expert rank's ring slot once that slot's previous minibatch left the expert's down
// GEMM (a cross-GPU flag the source polls), then count themselves into the expert's landed[m]
// (R * CD arrivals: the expert's gate/up tiles wait for all of them).
template <class C, class S>
MOKGEN_DEV void fwd_push_dispatch(const DirPeers<C::R>& dir, const __nv_bfloat16* x, int me,
                                  int max_minibatches) {
  const int warps = blockDim.x / 32;
  const int worker = blockIdx.x * warps + threadIdx.x / 32, workers = C::CD * warps;
  const auto sched_of = [&](int e) { return schedule_of<S>(dir.meta[e]); };
  walk_positions<C::R, C::B>(dir.meta, me, sched_of, [&](int q, int e, const S& s) {
    const int m = s.minibatch_at(q);
    uint32_t* xf = dir.xflags[e];
    if (q >= C::SLOTS) {
      const int prev = s.minibatch_at(q - C::SLOTS);
      if (!cta_wait_sys(xflag(xf, max_minibatches, kXDnDone, prev), s.down_tiles(prev), me,
                        kPhasePushSlot, prev))
        return false;
    }
    const int p0 = m * C::B, p1 = min(p0 + C::B, s.rows);
    push_rows<C::D, C::K>(dir.table[e], me, e, x, dir.ring_x[e], p0, p1, (q % C::SLOTS) * C::B,
                          worker, workers);
    __threadfence_system();  // this thread's row stores, before the CTA's arrival
    __syncthreads();
    if (threadIdx.x == 0) signal_add_sys(xflag(xf, max_minibatches, kXLanded, m));
    return true;
  });
}

// Pull combine: comm CTA `cta` of the combine group [CD, COMM) of every owner waits for each
// expert rank's minibatch to leave its down GEMM (the expert's dn_done, a cross-GPU flag),
// copies the staged rows of its own routes into its combine rows, and counts itself into the
// expert's pulled[m] (R * CC of them free the staging slot for the minibatch SLOTS later).
template <class C, class S>
MOKGEN_DEV void fwd_pull_combine(const DirPeers<C::R>& dir, __nv_bfloat16* combine, int me,
                                 int max_minibatches, int cta) {
  const int warps = blockDim.x / 32;
  const int worker = cta * warps + threadIdx.x / 32, workers = C::CC * warps;
  const auto sched_of = [&](int e) { return schedule_of<S>(dir.meta[e]); };
  walk_positions<C::R, C::B>(dir.meta, me, sched_of, [&](int q, int e, const S& s) {
    const int m = s.minibatch_at(q);
    uint32_t* xf = dir.xflags[e];
    if (!cta_wait_sys(xflag(xf, max_minibatches, kXDnDone, m), s.down_tiles(m), me,
                      kPhaseCombineReady, m))
      return false;
    const int p0 = m * C::B, p1 = min(p0 + C::B, s.rows);
    pull_combine_rows<C::D>(dir.table[e], me, dir.stage[e], combine, p0, p1,
                            (q % C::SLOTS) * C::B, worker, workers);
    __syncthreads();  // every warp's reads of the staging rows are done
    if (threadIdx.x == 0) signal_add_sys(xflag(xf, max_minibatches, kXPulled, m));
    return true;
  });
}

}  // namespace mokgen
