// mokgen/fp8.cuh -- the two fp8 activation formats the kernels quantize into, bit for bit
// as mokgen.quant does (its docstrings are the spec), selected by Q = elements per scale:
//   Q = 128: DeepSeek-style blockwise fp8, scale = amax / 448 in IEEE fp32 (1 for an
//            all-zero block), element = v * (448 / amax);
//   Q = 32:  OCP MXFP8, scale = 2^(floor(log2 amax) - 8) (an e8m0 byte; 2^-127 for an all-zero
//            block), element = v / scale, computed as v * 2^-(...) (exact either way).
// Elements are rounded to e4m3 (nearest even, subnormals kept) after clamping to +-448. A block
// holding NaN or Inf gets a NaN scale and e4m3 NaN elements (0x7F), like the reference.
// The kernels keep every scale as the fp32 value it stands for (MX: 2^(byte-127)): the GEMM
// multiplies by it directly. Activation scales are stored scale-major, [K/Q, rows], so one
// TMA box brings a stage's scales of all tile rows.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include "mokgen/combine.cuh"
#include "mokgen/quant.cuh"

namespace mokgen {

// A block's scale (what dequantization multiplies by) and inverse (what quantization
// multiplies by) from its amax (+Inf when the block holds a non-finite value).
struct Fp8Scale {
  float scale, inv;
};
template <int Q>
MOKGEN_DEV Fp8Scale fp8_scale(float amax) {
  static_assert(Q == 128 || Q == 32, "Q = 128 (blockwise fp8) or 32 (MXFP8)");
  const float nan = __int_as_float(0x7fc00000);
  if (!isfinite(amax)) return {nan, nan};
  if constexpr (Q == 128) {
    if (amax == 0.f) return {1.f, 1.f};
    return {__fdiv_rn(amax, 448.f), __fdiv_rn(448.f, amax)};
  } else {  // 2^(b - 127) and its exact inverse 2^(127 - b) = value of byte 254 - b
    const uint8_t b = mx_scale_byte(amax);
    return {mx_scale_value(b), mx_scale_value((uint8_t)(254 - b))};
  }
}

// e4m3 of v * inv (one rounding: for MX the product is exact, as the reference's division)
MOKGEN_DEV uint8_t fp8_element(float v, float inv) {
  const float q = v * inv;
  if (isnan(q)) return 0x7F;  // fminf/fmaxf would drop the NaN
  return (uint8_t)__nv_cvt_float_to_fp8(fminf(fmaxf(q, -448.f), 448.f), __NV_SATFINITE,
                                        __NV_E4M3);
}

// |v| for the block's amax, with a non-finite v turned into +Inf so it survives fmaxf.
MOKGEN_DEV float amax_term(float v) { return isfinite(v) ? fabsf(v) : __int_as_float(0x7f800000); }

// Max over groups of LANES consecutive lanes (every lane of the warp must call it).
template <int LANES>
MOKGEN_DEV float group_max(float v) {
#pragma unroll
  for (int o = 1; o < LANES; o <<= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Pull dispatch with quantization (the fp8 forward): like pull_rows, but each ring row is
// written as e4m3 (ring_q [rows, D]) plus its D/Q scales (ring_s [D/Q, RING_ROWS]). A lane
// holds 8 consecutive elements (one 16-byte load), so Q/8 lanes share a block. The source
// rows stay bf16: quantizing once per pulled row keeps the owner's x untouched and needs no
// extra pass over it.
template <int D, int K, int Q, int RING_ROWS>
__device__ void pull_rows_fp8(const int2* __restrict__ table,
                              const __nv_bfloat16* const* peer_x, uint8_t* __restrict__ ring_q,
                              float* __restrict__ ring_s, int p_begin, int p_end, int ring_row0,
                              int worker, int workers) {
  constexpr int VEC = D / 8, LANES = Q / 8, BATCH = 8;
  static_assert(D % Q == 0 && Q % 8 == 0, "rows are whole blocks");
  const int lane = threadIdx.x % 32;
  for (int p = p_begin + worker; p < p_end; p += workers) {
    const int2 src = table[p];
    const int row = ring_row0 + p - p_begin;
    uint2* to = reinterpret_cast<uint2*>(ring_q + (size_t)row * D);
    const bool pad = src.x < 0 || !MOKGEN_OK(src.x < 64 * 1024 && row >= 0, 8, src.x, src.y);
    const int4* from = pad ? nullptr
        : reinterpret_cast<const int4*>(peer_x[src.x] + (size_t)(src.y / K) * D);
    for (int v0 = 0; v0 < VEC; v0 += 32 * BATCH) {  // uniform trip count: shuffles stay full
      int4 buf[BATCH];
#pragma unroll
      for (int b = 0; b < BATCH; ++b) {
        const int v = v0 + 32 * b + lane;
        buf[b] = (from != nullptr && v < VEC) ? from[v] : make_int4(0, 0, 0, 0);
      }
#pragma unroll
      for (int b = 0; b < BATCH; ++b) {
        const int v = v0 + 32 * b + lane;
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&buf[b]);
        float f[8];
        float amax = 0.f;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float2 x = __bfloat1622float2(h[c]);
          f[2 * c] = x.x;
          f[2 * c + 1] = x.y;
          amax = fmaxf(amax, fmaxf(amax_term(x.x), amax_term(x.y)));
        }
        const Fp8Scale sc = fp8_scale<Q>(group_max<LANES>(amax));
        uint32_t lo = 0, hi = 0;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          lo |= (uint32_t)fp8_element(f[c], sc.inv) << (8 * c);
          hi |= (uint32_t)fp8_element(f[4 + c], sc.inv) << (8 * c);
        }
        if (v < VEC) {
          to[v] = make_uint2(lo, hi);
          if (lane % LANES == 0) ring_s[(size_t)(v * 8 / Q) * RING_ROWS + row] = sc.scale;
        }
      }
    }
  }
}

}  // namespace mokgen
