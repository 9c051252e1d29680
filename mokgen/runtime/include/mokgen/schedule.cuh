// mokgen/schedule.cuh -- Algorithm 1 (pull-dispatch schedule) on the GPU, no host sync.
//
// Three small kernels, launched back to back on the stream:
//  1. count:   a grid of (chunk, source rank) blocks, one thread per route of a chunk of
//              CHUNK consecutive routes of rank r: every route to a local expert gets its
//              ordinal inside the chunk, and the chunk its count per local expert. Blocks are
//              independent (one rank's routes are not scanned by one block in series: at
//              ep = 1 that would be one SM walking every route);
//  2. offsets: one block turns the chunk counts into each chunk's base (routes of r to l in
//              earlier chunks), sums them into M[r][l] (routes of r to local expert l), and M
//              into expert regions padded to the GEMM tile (so no tile mixes experts); writes
//              the total padded row count and marks padding rows;
//  3. place:   each route's ordinal o (earlier routes of r to the same expert: its chunk's
//              base plus its ordinal in the chunk) puts it at
//              p = S_l + sum_r' min(M[r'][l], o) + |{r' < r : M[r'][l] > o}|
//              -- sorting by (expert, ordinal, source) without a sort: experts contiguous,
//              sources round-robin inside an expert (mokgen.schedule.dispatch_positions).
// Row p of the table is (src_rank, src_route); the route's weight is copied beside it so
// the down-GEMM epilogue reads one array.
// chunk_counts layout: [ranks][chunks][L], chunks = gridDim.x of count (runtime/abi.py
// sched_chunks); count writes counts, offsets overwrites them with the bases.
#pragma once
#include "mokgen/ptx.cuh"

namespace mokgen {

// Block (c, r): routes c*CHUNK .. c*CHUNK + CHUNK - 1 of source rank r, one per thread.
// Dynamic shared memory: wcnt[CHUNK / 32][L] ints, schedule_count_smem bytes.
template <int L, int CHUNK>
constexpr int schedule_count_smem = CHUNK / 32 * L * (int)sizeof(int);

template <int L, int CHUNK>
__device__ void schedule_count(const int* __restrict__ routes, int routes_per_rank, int rank,
                               int* __restrict__ ordinal, int* __restrict__ chunk_counts) {
  static_assert(CHUNK % 32 == 0 && CHUNK <= 1024, "one thread per route: whole warps, one block");
  constexpr int W = CHUNK / 32;
  extern __shared__ int sched_smem[];
  int* wcnt = sched_smem;  // routes of warp w to expert l; then those of warps before w
  const int c = blockIdx.x, r = blockIdx.y;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int j = c * CHUNK + threadIdx.x;
  const size_t at = (size_t)r * routes_per_rank + j;
  const int l = j < routes_per_rank ? routes[at] - rank * L : -1;  // in flight while zeroing
  for (int i = threadIdx.x; i < W * L; i += CHUNK) wcnt[i] = 0;
  __syncthreads();
  const bool local = l >= 0 && l < L;
  // lanes with the same expert; non-local lanes get unique keys so they match only themselves
  const unsigned same = __match_any_sync(0xffffffff, local ? l : -1 - lane);
  const int before_in_warp = __popc(same & ((1u << lane) - 1));
  if (local && before_in_warp == 0) wcnt[warp * L + l] = __popc(same);
  __syncthreads();
  // per expert, exclusive over warps (one column per thread): its total is the chunk's count
  for (int e = threadIdx.x; e < L; e += CHUNK) {
    int run = 0;
#pragma unroll 8
    for (int w = 0; w < W; ++w) {
      const int v = wcnt[w * L + e];
      wcnt[w * L + e] = run;
      run += v;
    }
    chunk_counts[((size_t)r * gridDim.x + c) * L + e] = run;
  }
  __syncthreads();
  if (local) ordinal[at] = wcnt[warp * L + l] + before_in_warp;
}

// Chunk values one thread loads at once (below): a column is a chain of L2 round trips
// otherwise.
constexpr int kChunkBatch = 8;

// Column `p[0], p[stride], ... p[(n-1)*stride]` (one (rank, expert) pair's chunk values):
// with `scan`, replaced by their exclusive prefix sums starting from `run`. Returns run plus
// their sum.
template <bool scan>
__device__ __forceinline__ int chunk_column(int* p, int n, int stride, int run) {
  constexpr int kBatch = kChunkBatch;
  for (int c0 = 0; c0 < n; c0 += kBatch) {
    int v[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) v[k] = c0 + k < n ? p[(size_t)(c0 + k) * stride] : 0;
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      if (scan && c0 + k < n) p[(size_t)(c0 + k) * stride] = run;
      run += v[k];
    }
  }
  return run;
}

// One block (any size up to 1024 threads). chunk_counts in: per-chunk counts, out: per-chunk
// bases; counts[R][L] = M; offsets[L+1] padded region starts; meta[0] = padded rows; table
// padding = -1. Each (rank, expert) column of chunks is split among G thread groups when the
// block has more threads than columns (one expert-parallel rank has few columns: E of them,
// over R ranks), at least a batch of chunks each: group sums first, then each group scans its
// part from the sum before it. M sums into total[l] by shared-memory integer atomics (exact,
// so in any order the same): a loop over the ranks would be R round trips to L2.
// What the block reads back of its own writes across a barrier it reads from shared memory:
// through a __restrict__ global pointer, the compiler once hoisted such reads above the
// barrier (stale offsets sent the padding fill out of bounds).
template <int L, int TILE>
__device__ void schedule_offsets(int* chunk_counts, int ranks, int chunks, int* counts,
                                 int* offsets, int* meta, int2* table) {
  __shared__ int part[1024];  // [G][cols]: a group's sum of its chunks; G * cols <= blockDim
  __shared__ int total[L];
  __shared__ int start[L + 1];
  const int cols = ranks * L, nt = blockDim.x;
  const int G = max(1, min(nt / cols, (chunks + kChunkBatch - 1) / kChunkBatch));
  const int span = (chunks + G - 1) / G;
  // G == 1: threads stride over the columns; otherwise thread t is column t % cols, group t / cols
  const int g = G == 1 ? 0 : threadIdx.x / cols;
  const int c0 = min(chunks, g * span), n = min(chunks, c0 + span) - c0;
  auto column = [&](int col) {
    return chunk_counts + ((size_t)(col / L) * chunks + c0) * L + col % L;
  };
  for (int l = threadIdx.x; l < L; l += nt) total[l] = 0;
  if (G > 1 && g < G) {
    const int col = threadIdx.x % cols;
    part[threadIdx.x] = chunk_column<false>(column(col), n, L, 0);
  }
  __syncthreads();
  for (int col = G == 1 ? threadIdx.x : threadIdx.x % cols; g < G && col < cols;
       col += G == 1 ? nt : cols) {
    int base = 0;
    for (int h = 0; h < g; ++h) base += part[h * cols + col];
    const int m = chunk_column<true>(column(col), n, L, base);
    if (g == G - 1) {  // the last group's chunks end the column
      counts[col] = m;
      atomicAdd(&total[col % L], m);
    }
  }
  __syncthreads();
  const int lane = threadIdx.x % 32, nwarps = nt / 32;
  if (threadIdx.x < 32) {  // start[l + 1] = padded sizes of experts 0..l: a warp scan
    int at = 0;
    for (int l0 = 0; l0 < L; l0 += 32) {
      const int l = l0 + lane;
      int v = l < L ? (total[l] + TILE - 1) / TILE * TILE : 0;
#pragma unroll
      for (int d = 1; d < 32; d *= 2) {
        const int u = __shfl_up_sync(0xffffffff, v, d);
        if (lane >= d) v += u;
      }
      if (l < L) start[l + 1] = at + v;
      at += __shfl_sync(0xffffffff, v, 31);
    }
    if (lane == 0) {
      start[0] = 0;
      meta[0] = at;
    }
  }
  __syncthreads();
  for (int l = threadIdx.x; l <= L; l += nt) offsets[l] = start[l];
  // padding rows: one warp per expert (under TILE rows each), not every thread per expert
  for (int l = threadIdx.x / 32; l < L; l += nwarps)
    for (int p = start[l] + total[l] + lane; p < start[l + 1]; p += 32)
      table[p] = make_int2(-1, -1);
}

template <int L, int CHUNK>
__device__ void schedule_place(const int* __restrict__ routes, const float* __restrict__ weights,
                               int routes_per_rank, int ranks, int rank,
                               const int* __restrict__ ordinal,
                               const int* __restrict__ chunk_base, int chunks,
                               const int* __restrict__ counts, const int* __restrict__ offsets,
                               int2* __restrict__ table, float* __restrict__ row_weight) {
  const size_t n = (size_t)ranks * routes_per_rank;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const int l = routes[i] - rank * L;
    if (l < 0 || l >= L) continue;
    const int r = (int)(i / routes_per_rank), j = (int)(i % routes_per_rank);
    const int o = chunk_base[((size_t)r * chunks + j / CHUNK) * L + l] + ordinal[i];
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
// unit u, for u in [0, minibatches + 1]. An expert's last segment ends at its last row, not
// at its padded region's end (the weight gradients' K is a segment's rows, in 64-row steps:
// a 128-row tile's padding beyond those is not multiplied); the region's last tile holds at
// least one of its rows, so that end is in the same minibatch as the region's.
// counts[ranks][L]: each source rank's routes to each local expert (schedule_offsets).
// The walk is serial (one thread), so it reads the offsets from shared memory, staged by the
// warp: from global memory every expert costs the thread an L2 round trip.
template <int L, int B>
__device__ void schedule_segments(const int* offsets, const int* counts, int ranks,
                                  const int* meta, int slots, int4* segs, int* seg_start) {
  __shared__ int off[L + 1];
  __shared__ int end[L];
  for (int e = threadIdx.x; e <= L; e += blockDim.x) off[e] = offsets[e];
  for (int e = threadIdx.x; e < L; e += blockDim.x) {
    int rows = 0;
    for (int r = 0; r < ranks; ++r) rows += counts[r * L + e];
    end[e] = offsets[e] + rows;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  const int rows = meta[0], nm = (rows + B - 1) / B;
  const bool whole = nm <= slots;
  int n = 0;
  seg_start[0] = 0;
  for (int e = 0; e < L; ++e)
    if (off[e + 1] == off[e]) segs[n++] = make_int4(e, 0, 0, 1 << 16);
  seg_start[1] = n;
  int m_open = 0;  // minibatches whose seg_start is written: [0, m_open)
  for (int e = 0; e < L; ++e) {
    const int r0 = off[e], r1 = end[e];
    if (r0 == off[e + 1]) continue;
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
