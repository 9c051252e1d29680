// mokgen/schedule.cuh -- Algorithm 1 (pull-dispatch schedule) on the GPU, no host sync.
//
// Three small kernels, launched back to back on the stream:
//  1. count:   one block per source rank r scans r's routes in order and gives every route
//              to a local expert its ordinal o (earlier routes of r to the same expert) and
//              M[r][l] (routes of r to local expert l);
//  2. offsets: one block turns M into expert regions padded to the GEMM tile (so no tile
//              mixes experts), writes the total padded row count and marks padding rows;
//  3. place:   each route goes to p = S_l + sum_r' min(M[r'][l], o) + |{r' < r : M[r'][l] > o}|
//              -- sorting by (expert, ordinal, source) without a sort: experts contiguous,
//              sources round-robin inside an expert (mokgen.schedule.dispatch_positions).
// Row p of the table is (src_rank, src_route); the route's weight is copied beside it so
// the down-GEMM epilogue reads one array.
#pragma once
#include "mokgen/ptx.cuh"

namespace mokgen {

// smem: run[L] + wcnt[32][L] ints
template <int L>
__device__ void schedule_count(const int* __restrict__ routes, int routes_per_rank, int rank,
                               int* __restrict__ ordinal, int* __restrict__ counts) {
  extern __shared__ int sched_smem[];
  int* run = sched_smem;
  int* wcnt = sched_smem + L;
  const int r = blockIdx.x;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  for (int i = threadIdx.x; i < L; i += blockDim.x) run[i] = 0;
  const int* my = routes + (size_t)r * routes_per_rank;
  for (int base = 0; base < routes_per_rank; base += blockDim.x) {
    for (int i = threadIdx.x; i < nwarps * L; i += blockDim.x) wcnt[i] = 0;
    __syncthreads();
    const int j = base + threadIdx.x;
    int l = j < routes_per_rank ? my[j] - rank * L : -1;
    const bool local = l >= 0 && l < L;
    // lanes with the same expert; non-local lanes get unique keys so they match only themselves
    const unsigned same = __match_any_sync(0xffffffff, local ? l : -1 - lane);
    const int before_in_warp = __popc(same & ((1u << lane) - 1));
    if (local && before_in_warp == 0) wcnt[warp * L + l] = __popc(same);
    __syncthreads();
    if (local) {
      int o = run[l] + before_in_warp;
      for (int w = 0; w < warp; ++w) o += wcnt[w * L + l];
      ordinal[(size_t)r * routes_per_rank + j] = o;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < L; i += blockDim.x) {
      int add = 0;
      for (int w = 0; w < nwarps; ++w) add += wcnt[w * L + i];
      run[i] += add;
    }
    __syncthreads();
  }
  for (int i = threadIdx.x; i < L; i += blockDim.x) counts[r * L + i] = run[i];
}

// One block. offsets[L+1] padded region starts; meta[0] = padded rows; table padding = -1.
// The offsets are computed in shared memory and read back from there: global `offsets`
// written by thread 0 must not be re-read by the block (a __restrict__ pointer let the
// compiler hoist those reads above the barrier, and stale offsets sent the padding fill
// out of bounds).
template <int L, int TILE>
__device__ void schedule_offsets(const int* __restrict__ counts, int ranks, int* offsets,
                                 int* meta, int2* table) {
  __shared__ int total[L];
  __shared__ int start[L + 1];
  for (int l = threadIdx.x; l < L; l += blockDim.x) {
    int c = 0;
    for (int r = 0; r < ranks; ++r) c += counts[r * L + l];
    total[l] = c;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int at = 0;
    for (int l = 0; l < L; ++l) {
      start[l] = at;
      at += (total[l] + TILE - 1) / TILE * TILE;
    }
    start[L] = at;
    meta[0] = at;
  }
  __syncthreads();
  for (int l = threadIdx.x; l <= L; l += blockDim.x) offsets[l] = start[l];
  for (int l = 0; l < L; ++l) {
    for (int p = start[l] + total[l] + threadIdx.x; p < start[l + 1]; p += blockDim.x)
      table[p] = make_int2(-1, -1);
  }
}

template <int L>
__device__ void schedule_place(const int* __restrict__ routes, const float* __restrict__ weights,
                               int routes_per_rank, int ranks, int rank,
                               const int* __restrict__ ordinal, const int* __restrict__ counts,
                               const int* __restrict__ offsets, int2* __restrict__ table,
                               float* __restrict__ row_weight) {
  const size_t n = (size_t)ranks * routes_per_rank;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const int l = routes[i] - rank * L;
    if (l < 0 || l >= L) continue;
    const int r = (int)(i / routes_per_rank), j = (int)(i % routes_per_rank);
    const int o = ordinal[i];
    int p = offsets[l];
    for (int q = 0; q < ranks; ++q) {
      const int m = counts[q * L + l];
      p += min(m, o) + (q < r && m > o ? 1 : 0);
    }
    table[p] = make_int2(r, j);
    row_weight[p] = weights[i];
  }
}

// The backward's weight-gradient segments, one block, after schedule_offsets. A segment is a
// run of one expert's rows that sits contiguously in the ring while the backward reads it:
// - every minibatch fits the ring at once (minibatches <= slots: the ring is the layout):
//   one segment per expert, its whole region, listed under the expert's last minibatch;
// - otherwise one segment per (expert, minibatch), summed in minibatch order.
// Unit 0 lists the experts with no rows (their gradient is a zero tile, written by the
// kernel); unit m+1 the segments that end in minibatch m, by expert.
// seg = {expert, first row, end row, index | count << 16}; seg_start[u] = segments before
// unit u, for u in [0, minibatches + 1].
template <int L, int B>
__device__ void schedule_segments(const int* offsets, const int* meta, int slots, int4* segs,
                                  int* seg_start) {
  if (threadIdx.x != 0) return;
  const int rows = meta[0], nm = (rows + B - 1) / B;
  const bool whole = nm <= slots;
  int n = 0;
  seg_start[0] = 0;
  for (int e = 0; e < L; ++e)
    if (offsets[e + 1] == offsets[e]) segs[n++] = make_int4(e, 0, 0, 1 << 16);
  seg_start[1] = n;
  int m_open = 0;  // minibatches whose seg_start is written: [0, m_open)
  for (int e = 0; e < L; ++e) {
    const int r0 = offsets[e], r1 = offsets[e + 1];
    if (r0 == r1) continue;
    const int first = r0 / B, last = (r1 - 1) / B;
    for (int m = whole ? last : first; m <= last; ++m) {
      for (; m_open < m; ++m_open) seg_start[m_open + 2] = n;  // close earlier minibatches
      segs[n++] = whole ? make_int4(e, r0, r1, 1 << 16)
                        : make_int4(e, max(r0, m * B), min(r1, (m + 1) * B),
                                    (m - first) | ((last - first + 1) << 16));
    }
  }
  for (; m_open < nm; ++m_open) seg_start[m_open + 2] = n;
}
}  // namespace mokgen
