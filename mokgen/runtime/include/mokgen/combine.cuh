// mokgen/combine.cuh -- the owner's side of combine, and the comm role's pull of token rows.
#pragma once
#include <cuda_bf16.h>
#include "mokgen/ptx.cuh"

namespace mokgen {

// 8 bf16 (one 16-byte vector) times w, rounded to bf16.
MOKGEN_DEV int4 scale_bf16x8(int4 raw, float w) {
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const float2 f = __bfloat1622float2(h[c]);
    h[c] = __floats2bfloat162_rn(f.x * w, f.y * w);
  }
  return raw;
}

// y[t] = y_shared[t] + sum_{i<K} rows[row_of(t*K + i)], in route order and in fp32: a fixed
// order, so the sum is bitwise reproducible (no atomics anywhere in the combine).
template <int D, int K, class RowOf>
__device__ void sum_routed_rows(const __nv_bfloat16* __restrict__ rows, RowOf row_of,
                                const float* __restrict__ y_shared,
                                __nv_bfloat16* __restrict__ y, int n_tokens) {
  static_assert(D % 8 == 0, "rows are summed 8 bf16 (16 bytes) at a time");
  constexpr int VEC = D / 8;
  const size_t n = (size_t)n_tokens * VEC;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const size_t t = i / VEC, v = i % VEC;
    float acc[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[c] = 0.f;
    if (y_shared != nullptr) {
      const float4* s = reinterpret_cast<const float4*>(y_shared + t * D + v * 8);
      float4 a = s[0], b = s[1];
      acc[0] = a.x; acc[1] = a.y; acc[2] = a.z; acc[3] = a.w;
      acc[4] = b.x; acc[5] = b.y; acc[6] = b.z; acc[7] = b.w;
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
      int4 raw = *reinterpret_cast<const int4*>(rows + (row_of(t * K + k) * D + v * 8));
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        float2 f = __bfloat1622float2(h[c]);
        acc[2 * c] += f.x;
        acc[2 * c + 1] += f.y;
      }
    }
    int4 out;
    __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
    for (int c = 0; c < 4; ++c) o[c] = __floats2bfloat162_rn(acc[2 * c], acc[2 * c + 1]);
    *reinterpret_cast<int4*>(y + t * D + v * 8) = out;
  }
}

// The owner's combine: route i's row is combine[i].
template <int D, int K>
__device__ void combine_sum(const __nv_bfloat16* __restrict__ combine,
                            const float* __restrict__ y_shared, __nv_bfloat16* __restrict__ y,
                            int n_tokens) {
  sum_routed_rows<D, K>(combine, [](size_t i) { return i; }, y_shared, y, n_tokens);
}

// The same over rows kept elsewhere: route i's row is rows[pos[i]] (the backward's dx rows
// in its dy ring, DXRING: moe_bwd.cuh).
template <int D, int K>
__device__ void combine_sum_at(const __nv_bfloat16* __restrict__ rows, const int* __restrict__ pos,
                               const float* __restrict__ y_shared, __nv_bfloat16* __restrict__ y,
                               int n_tokens) {
  sum_routed_rows<D, K>(rows, [pos](size_t i) { return (size_t)__ldg(pos + i); }, y_shared, y,
                        n_tokens);
}

// pos[route] = its row p of the schedule table (one rank's: every row's source rank is 0),
// for the meta[0] rows of the layout; padding rows (source -1) have no route.
__device__ inline void table_positions(const int2* __restrict__ table, const int* __restrict__ meta,
                                       int* __restrict__ pos) {
  const size_t rows = (size_t)meta[0];
  for (size_t p = blockIdx.x * (size_t)blockDim.x + threadIdx.x; p < rows;
       p += (size_t)gridDim.x * blockDim.x) {
    const int2 src = table[p];
    if (src.x >= 0) pos[src.y] = (int)p;
  }
}

// Pull-based dispatch: copy ring-layout rows [p_begin, p_end) from their source ranks into
// the ring, one warp per row, 16-byte vectors. Padding rows (src -1) are written as zeros: the
// backward's weight gradients sum over every row of a tile (K = rows), where 0 * NaN would
// leak a stale row into the sum. With `scaled` (the backward's reverse-combine pull of dy),
// each row is also written times its router weight into `scaled`. ring_x may be nullptr (the
// fp8 backward's dy: only its scaled and quantized copies are read). `sink(ring row, vector index,
// the 16-byte vector)` sees every vector written (padding: zeros), from all 32 lanes
// uniformly (the fp8 backward quantizes there, fp8.cuh QuantSink). A row that is not whole
// sweeps of the warp (D not a multiple of 256) is copied in sweeps every lane runs, lanes
// past its end carrying zeros: the sink then gets a fourth argument, false for those lanes
// (they take part in its shuffles and store nothing).
struct NoSink {
  MOKGEN_DEV void operator()(int, int, int4) const {}
  MOKGEN_DEV void operator()(int, int, int4, bool) const {}
};
template <int D, int K, class Sink = NoSink>
__device__ void pull_rows(const int2* __restrict__ table, const __nv_bfloat16* const* peer_x,
                          __nv_bfloat16* __restrict__ ring_x, int p_begin, int p_end,
                          int ring_row0, int worker, int workers,
                          __nv_bfloat16* __restrict__ scaled = nullptr,
                          const float* __restrict__ row_weight = nullptr, Sink sink = {}) {
  constexpr int VEC = D / 8;
  static_assert(D % 8 == 0, "rows move as 16-byte vectors");
  const int lane = threadIdx.x % 32;
  for (int p = p_begin + worker; p < p_end; p += workers) {
    const int2 src = table[p];
    const int ring_row = ring_row0 + p - p_begin;
    const size_t row = (size_t)ring_row * D;
    int4* to = ring_x ? reinterpret_cast<int4*>(ring_x + row) : nullptr;
    int4* to_s = scaled ? reinterpret_cast<int4*>(scaled + row) : nullptr;
    if constexpr (VEC % 32 != 0) {  // ragged rows: whole sweeps for every lane (see above)
      const bool pad = src.x < 0 || !MOKGEN_OK(src.x < 64 * 1024 && ring_row >= 0, 8, src.x,
                                               src.y);
      const int4* from =
          pad ? nullptr : reinterpret_cast<const int4*>(peer_x[src.x] + (size_t)(src.y / K) * D);
      const float w = to_s && !pad ? row_weight[p] : 0.f;  // padding: zeros, as above
      constexpr int BATCH = 8;
      for (int v0 = 0; v0 < VEC; v0 += 32 * BATCH) {
        int4 buf[BATCH];
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
          const int v = v0 + 32 * b + lane;
          buf[b] = !pad && v < VEC ? from[v] : make_int4(0, 0, 0, 0);
        }
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
          if (v0 + 32 * b >= VEC) break;  // the same for every lane
          const int v = v0 + 32 * b + lane;
          const bool on = v < VEC;
          if (to && on) to[v] = buf[b];
          if (to_s && on) to_s[v] = scale_bf16x8(buf[b], w);
          sink(ring_row, v, buf[b], on);
        }
      }
      continue;
    }
    if (src.x < 0 || !MOKGEN_OK(src.x < 64 * 1024 && ring_row >= 0, 8, src.x,
                                src.y)) {
      for (int v = lane; v < VEC; v += 32) {
        if (to) to[v] = make_int4(0, 0, 0, 0);
        if (to_s) to_s[v] = make_int4(0, 0, 0, 0);
        sink(ring_row, v, make_int4(0, 0, 0, 0));
      }
      continue;
    }
    const int4* from = reinterpret_cast<const int4*>(peer_x[src.x] + (size_t)(src.y / K) * D);
    const float w = to_s ? row_weight[p] : 0.f;
    // batches of 8 loads before their stores: 4 KB of one row in flight per warp
    constexpr int BATCH = 8;
    int v = lane;
    for (; v + 32 * (BATCH - 1) < VEC; v += 32 * BATCH) {
      int4 buf[BATCH];
#pragma unroll
      for (int b = 0; b < BATCH; ++b) buf[b] = from[v + 32 * b];
#pragma unroll
      for (int b = 0; b < BATCH; ++b) {
        if (to) to[v + 32 * b] = buf[b];
        if (to_s) to_s[v + 32 * b] = scale_bf16x8(buf[b], w);
        sink(ring_row, v + 32 * b, buf[b]);
      }
    }
    for (; v < VEC; v += 32) {
      const int4 x = from[v];
      if (to) to[v] = x;
      if (to_s) to_s[v] = scale_bf16x8(x, w);
      sink(ring_row, v, x);
    }
  }
}

// pull_rows of two row sources at once (the backward's x and dy, XPULL: moe_bwd.cuh
// bwd_pull_minibatch), for rows of whole warp sweeps (D a multiple of 256): one pass over the
// table, each warp with both rows' loads in flight before its stores. No faster than two
// pull_rows passes (more comm CTAs are what helps); kept as the tested path. Padding rows:
// zeros in both, as pull_rows.
template <int D, int K>
__device__ void pull_row_pairs(const int2* __restrict__ table,
                               const __nv_bfloat16* const* peer_a, __nv_bfloat16* __restrict__ ring_a,
                               int ring_a0, const __nv_bfloat16* const* peer_b,
                               __nv_bfloat16* __restrict__ ring_b, int ring_b0, int p_begin,
                               int p_end, int worker, int workers) {
  constexpr int VEC = D / 8, BATCH = 8;
  static_assert(VEC % (32 * BATCH) == 0 || (VEC % 32 == 0 && VEC < 32 * BATCH),
                "whole sweeps of the warp");
  constexpr int SWEEP = VEC < 32 * BATCH ? VEC / 32 : BATCH;  // vectors a lane per batch
  const int lane = threadIdx.x % 32;
  for (int p = p_begin + worker; p < p_end; p += workers) {
    const int2 src = table[p];
    int4* to_a = reinterpret_cast<int4*>(ring_a + (size_t)(ring_a0 + p - p_begin) * D);
    int4* to_b = reinterpret_cast<int4*>(ring_b + (size_t)(ring_b0 + p - p_begin) * D);
    if (src.x < 0 || !MOKGEN_OK(src.x < 64 * 1024, 8, src.x, src.y)) {
      for (int v = lane; v < VEC; v += 32) to_a[v] = to_b[v] = make_int4(0, 0, 0, 0);
      continue;
    }
    const size_t row = (size_t)(src.y / K) * D;
    const int4* from_a = reinterpret_cast<const int4*>(peer_a[src.x] + row);
    const int4* from_b = reinterpret_cast<const int4*>(peer_b[src.x] + row);
    for (int v = lane; v < VEC; v += 32 * SWEEP) {
      int4 a[SWEEP], b[SWEEP];
#pragma unroll
      for (int i = 0; i < SWEEP; ++i) a[i] = from_a[v + 32 * i];
#pragma unroll
      for (int i = 0; i < SWEEP; ++i) b[i] = from_b[v + 32 * i];
#pragma unroll
      for (int i = 0; i < SWEEP; ++i) to_a[v + 32 * i] = a[i];
#pragma unroll
      for (int i = 0; i < SWEEP; ++i) to_b[v + 32 * i] = b[i];
    }
  }
}

}  // namespace mokgen
