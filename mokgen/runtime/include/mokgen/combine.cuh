// mokgen/combine.cuh -- the owner's side of combine, and the comm role's pull of token rows.
#pragma once
#include <cuda_bf16.h>
#include "mokgen/ptx.cuh"

namespace mokgen {

// y[t] = y_shared[t] + sum_{i<K} combine[t*K + i], in route order and in fp32: a fixed order,
// so the sum is bitwise reproducible (no atomics anywhere in the combine).
template <int D, int K>
__device__ void combine_sum(const __nv_bfloat16* __restrict__ combine,
                            const float* __restrict__ y_shared, __nv_bfloat16* __restrict__ y,
                            int n_tokens) {
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
      int4 raw = *reinterpret_cast<const int4*>(combine + ((t * K + k) * D + v * 8));
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

// Pull-based dispatch: copy ring-layout rows [p_begin, p_end) from their source ranks into
// the ring, one warp per row, 16-byte vectors. Padding rows (src -1) are left as they are:
// GEMM rows are independent and padded rows are masked when results are stored.
template <int D, int K>
__device__ void pull_rows(const int2* __restrict__ table, const __nv_bfloat16* const* peer_x,
                          __nv_bfloat16* __restrict__ ring_x, int p_begin, int p_end,
                          int ring_row0, int worker, int workers) {
  constexpr int VEC = D / 8;
  const int lane = threadIdx.x % 32;
  for (int p = p_begin + worker; p < p_end; p += workers) {
    const int2 src = table[p];
    if (src.x < 0) continue;
    if (!MOKGEN_OK(src.x < 64 * 1024 && ring_row0 + p - p_begin >= 0, 8, src.x, src.y)) continue;
    const int4* from = reinterpret_cast<const int4*>(peer_x[src.x] + (size_t)(src.y / K) * D);
    int4* to = reinterpret_cast<int4*>(ring_x + (size_t)(ring_row0 + p - p_begin) * D);
    // batches of 8 loads before their stores: 4 KB of one row in flight per warp
    constexpr int BATCH = 8;
    int v = lane;
    for (; v + 32 * (BATCH - 1) < VEC; v += 32 * BATCH) {
      int4 buf[BATCH];
#pragma unroll
      for (int b = 0; b < BATCH; ++b) buf[b] = from[v + 32 * b];
#pragma unroll
      for (int b = 0; b < BATCH; ++b) to[v + 32 * b] = buf[b];
    }
    for (; v < VEC; v += 32) to[v] = from[v];
  }
}

}  // namespace mokgen
