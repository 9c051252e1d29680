// mokgen/fp8.cuh -- the two fp8 activation formats the kernels quantize into, bit for bit
// as mokgen.quant does (its docstrings are the spec), selected by Q = elements per scale:
//   Q = 128: DeepSeek-style blockwise fp8, scale = amax / 448 in IEEE fp32 (1 for an
//            all-zero block), element = v * min(448 / amax, FLT_MAX);
//   Q = 32:  OCP MXFP8, scale = 2^(floor(log2 amax) - 8) (an e8m0 byte; 2^-127 for an all-zero
//            block), element = v / scale, computed as v * 2^-(...) (exact either way).
// Elements are rounded to e4m3 (nearest even, subnormals kept) after clamping to +-448. A block
// holding NaN or Inf gets a NaN scale and e4m3 NaN elements (0x7F), like the reference.
// The kernels keep every scale as the fp32 value it stands for (MX: 2^(byte-127)): the GEMM
// multiplies by it directly. Ring scales are stored scale-major, [ceil(K/Q), rows], so one TMA
// box brings a stage's scales of all tile rows.
// A width K that is not a multiple of Q (any multiple of 16: e4m3 rows are 16-byte vectors)
// ends in a partial block, quantized as if padded with zeros (its amax over the elements it
// has), as mokgen.quant does; the GEMMs' K tail is zero-filled by TMA, data and scales.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include "mokgen/quant.cuh"

namespace mokgen {

// A block's scale (what dequantization multiplies by) and inverse (what quantization
// multiplies by) from its amax (+Inf or NaN when the block holds a non-finite value).
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
    // a block below 448 / FLT_MAX (~1.3e-36) would get an infinite inverse: clamp it
    return {__fdiv_rn(amax, 448.f), fminf(__fdiv_rn(448.f, amax), 3.40282347e38f)};
  } else {  // 2^(b - 127) and its exact inverse 2^(127 - b) = value of byte 254 - b
    const uint8_t b = mx_scale_byte(amax);
    return {mx_scale_value(b), mx_scale_value((uint8_t)(254 - b))};
  }
}

// Two e4m3 of v * inv, low byte first: one rounding each (for MX the product is exact, as
// the reference's division). satfinite clamps to +-448 like the reference's clamp and keeps
// NaN (0x7F).
MOKGEN_DEV uint16_t fp8x2(float a, float b, float inv) {
  return (uint16_t)__nv_cvt_float2_to_fp8x2(make_float2(a * inv, b * inv), __NV_SATFINITE,
                                            __NV_E4M3);
}

// Eight e4m3 of v * inv in one 8-byte vector, v[0] in the low byte.
MOKGEN_DEV uint2 fp8x8(const float (&v)[8], float inv) {
  return make_uint2(fp8x2(v[0], v[1], inv) | (uint32_t)fp8x2(v[2], v[3], inv) << 16,
                    fp8x2(v[4], v[5], inv) | (uint32_t)fp8x2(v[6], v[7], inv) << 16);
}

// max that propagates NaN (fmaxf drops it): a block's amax is NaN or Inf when it holds one.
MOKGEN_DEV float max_nan(float a, float b) {
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}

// Max over groups of LANES consecutive lanes (every lane of the warp must call it).
template <int LANES>
MOKGEN_DEV float group_max(float v) {
#pragma unroll
  for (int o = 1; o < LANES; o <<= 1) v = max_nan(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// One Q-column block of a row that the 4 lanes of a quad hold in the wgmma accumulator layout
// (gemm_epilogue.cuh): this thread's two values of 8-column group g are pair(g), at columns
// 8 g + 2 (lane % 4) and + 1; the block is groups g0 .. g0 + Q/8 - 1. Quantized into the row
// `out` (byte 0 = group 0's column 0); returns the block's scale. Every lane of the warp calls
// it (the amax is a thread max plus two quad shuffles).
// kEdge: a block at the end of a row whose width ends inside it: only groups g < g_end are
// stored (pair(g) must give zeros for the others: a partial block is zero-padded).
template <int Q, bool kEdge = false, class Pair>
MOKGEN_DEV float quantize_quad_block(Pair&& pair, int g0, uint8_t* out, int g_end = 0) {
  float amax = 0.f;
#pragma unroll
  for (int g = g0; g < g0 + Q / 8; ++g) {
    const float2 v = pair(g);
    amax = max_nan(amax, max_nan(fabsf(v.x), fabsf(v.y)));
  }
  const Fp8Scale sc = fp8_scale<Q>(group_max<4>(amax));
  const int lane_col = 2 * (threadIdx.x & 3);
#pragma unroll
  for (int g = g0; g < g0 + Q / 8; ++g) {
    const float2 v = pair(g);
    if (!kEdge || g < g_end)
      *reinterpret_cast<uint16_t*>(out + 8 * g + lane_col) = fp8x2(v.x, v.y, sc.inv);
  }
  return sc.scale;
}

// Blockwise fp8 weights, 128 x 128 blocks over the last two dims of `batch` matrices [rows,
// cols] (blockIdx.y = matrix), bit for bit mokgen.quant.to_fp8_blockwise(w, WEIGHT_BLOCK):
// data [rows, cols] e4m3, scales [rows/128, cols/128]. One CTA of 256 threads per block
// (grid-strided); a thread holds 64 consecutive elements of one row.
template <class T>
__device__ void fp8_weight_blocks(const T* __restrict__ in, int rows, int cols,
                                  uint8_t* __restrict__ data, float* __restrict__ scales) {
  __shared__ float red[8];
  const size_t mat = (size_t)rows * cols;
  in += blockIdx.y * mat;
  data += blockIdx.y * mat;
  const int bc = cols / 128, nblocks = (rows / 128) * bc;
  scales += (size_t)blockIdx.y * nblocks;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int b = blockIdx.x; b < nblocks; b += gridDim.x) {
    const int r = (b / bc) * 128 + threadIdx.x / 2, c0 = (b % bc) * 128 + (threadIdx.x % 2) * 64;
    const T* p = in + (size_t)r * cols + c0;
    float v[64];
    if constexpr (sizeof(T) == 2) {  // bf16: 16-byte loads
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        const int4 raw = reinterpret_cast<const int4*>(p)[q];
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float2 f = __bfloat1622float2(h[c]);
          v[8 * q + 2 * c] = f.x;
          v[8 * q + 2 * c + 1] = f.y;
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < 64; ++i) v[i] = to_f32(p[i]);
    }
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 64; ++i) amax = max_nan(amax, fabsf(v[i]));
    amax = group_max<32>(amax);
    if (lane == 0) red[warp] = amax;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < 8; ++w) amax = max_nan(amax, red[w]);
    __syncthreads();  // red is rewritten by the next block
    const Fp8Scale sc = fp8_scale<128>(amax);
    uint4* out = reinterpret_cast<uint4*>(data + (size_t)r * cols + c0);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      uint32_t w[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float* e = v + 16 * q + 4 * j;
        w[j] = fp8x2(e[0], e[1], sc.inv) | (uint32_t)fp8x2(e[2], e[3], sc.inv) << 16;
      }
      out[q] = make_uint4(w[0], w[1], w[2], w[3]);
    }
    if (threadIdx.x == 0) scales[b] = sc.scale;
  }
}

// 8 consecutive bf16 of a row (one 16-byte vector per lane; Q/8 consecutive lanes hold one
// block) quantized: the 8 e4m3 (low byte first) and the block's scale. Every lane of the warp
// calls it (the block amax is a shuffle).
template <int Q>
MOKGEN_DEV uint2 quantize_bf16x8(int4 raw, float& scale) {
  static_assert(Q % 8 == 0 && Q <= 256, "a block is whole vectors of one warp");
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
  float2 f[4];
  float amax = 0.f;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    f[c] = __bfloat1622float2(h[c]);
    amax = max_nan(amax, max_nan(fabsf(f[c].x), fabsf(f[c].y)));
  }
  const Fp8Scale sc = fp8_scale<Q>(group_max<Q / 8>(amax));
  scale = sc.scale;
  return make_uint2(fp8x2(f[0].x, f[0].y, sc.inv) | (uint32_t)fp8x2(f[1].x, f[1].y, sc.inv) << 16,
                    fp8x2(f[2].x, f[2].y, sc.inv) | (uint32_t)fp8x2(f[3].x, f[3].y, sc.inv) << 16);
}

// Token rows quantized once by their owner, before any peer pulls them (the fp8 forward's
// dispatch then moves half the bytes and quantizes nothing): xq holds [n_cap, D] e4m3, then
// at byte scales_at the fp32 scales [n_cap, ceil(D/Q)]. One warp per row; a lane holds 8
// consecutive elements (one 16-byte load), so Q/8 lanes share a block.
// A row that is not whole warp sweeps (D not a multiple of 256) is quantized in sweeps every
// lane runs: lanes past its end quantize zeros and store nothing, which zero-pads a partial
// last block (its first lane, which stores the scale, is inside the row).
template <int D, int Q>
__device__ void quantize_rows(const __nv_bfloat16* __restrict__ x, int n, uint8_t* __restrict__ xq,
                              size_t scales_at) {
  constexpr int VEC = D / 8, NS = (D + Q - 1) / Q;
  static_assert(D % 16 == 0, "e4m3 rows are whole 16-byte vectors");
  float* scales = reinterpret_cast<float*>(xq + scales_at);
  const int lane = threadIdx.x % 32, warps = gridDim.x * blockDim.x / 32;
  for (int row = (blockIdx.x * blockDim.x + threadIdx.x) / 32; row < n; row += warps) {
    const int4* from = reinterpret_cast<const int4*>(x + (size_t)row * D);
    uint2* to = reinterpret_cast<uint2*>(xq + (size_t)row * D);
    if constexpr (VEC % 32 == 0) {
#pragma unroll 4
      for (int v = lane; v < VEC; v += 32) {
        float scale;
        to[v] = quantize_bf16x8<Q>(from[v], scale);
        if (lane % (Q / 8) == 0) scales[(size_t)row * NS + v * 8 / Q] = scale;
      }
    } else {
#pragma unroll 4
      for (int v0 = 0; v0 < VEC; v0 += 32) {
        const int v = v0 + lane;
        float scale;
        const uint2 q = quantize_bf16x8<Q>(v < VEC ? from[v] : make_int4(0, 0, 0, 0), scale);
        if (v < VEC) {
          to[v] = q;
          if (lane % (Q / 8) == 0) scales[(size_t)row * NS + v * 8 / Q] = scale;
        }
      }
    }
  }
}

// pull_rows' second destination in the fp8 backward: every pulled 16-byte vector (v of ring
// row `row`) also quantized into an e4m3 ring [rows, D] and its scale-major scales
// [ceil(D/Q), RING_ROWS], the same bits as quantize_rows (the forward's replay then sees the
// rows the forward saw; a partial last block likewise zero-padded by the lanes past the row).
template <int D, int Q, int RING_ROWS>
struct QuantSink {
  uint8_t* q;
  float* s;
  MOKGEN_DEV void operator()(int row, int v, int4 x) const {
    float scale;
    reinterpret_cast<uint2*>(q + (size_t)row * D)[v] = quantize_bf16x8<Q>(x, scale);
    if ((threadIdx.x % 32) % (Q / 8) == 0) s[(size_t)(v * 8 / Q) * RING_ROWS + row] = scale;
  }
  // ragged rows (pull_rows): `on` false past the row's end, where the lane only shuffles
  MOKGEN_DEV void operator()(int row, int v, int4 x, bool on) const {
    float scale;
    const uint2 e = quantize_bf16x8<Q>(x, scale);
    if (!on) return;
    reinterpret_cast<uint2*>(q + (size_t)row * D)[v] = e;
    if ((threadIdx.x % 32) % (Q / 8) == 0) s[(size_t)(v * 8 / Q) * RING_ROWS + row] = scale;
  }
};

// Pull dispatch of quantized rows (the fp8 forward): like pull_rows, one warp per ring row,
// copying the source's e4m3 row into ring_q [rows, D] and its ceil(D/Q) scales into the
// scale-major ring_s [ceil(D/Q), RING_ROWS]. Padding rows become zeros with the all-zero
// block's scale (1 for blockwise, 2^-127 for MX), as mokgen.quant quantizes a zero row.
template <int D, int K, int Q, int RING_ROWS>
__device__ void pull_rows_fp8(const int2* __restrict__ table, const uint8_t* const* peer_xq,
                              size_t scales_at, uint8_t* __restrict__ ring_q,
                              float* __restrict__ ring_s, int p_begin, int p_end, int ring_row0,
                              int worker, int workers) {
  constexpr int VEC = D / 16, NS = (D + Q - 1) / Q, BATCH = 4;
  static_assert(D % 16 == 0, "e4m3 rows are whole 16-byte vectors");
  const int lane = threadIdx.x % 32;
  for (int p = p_begin + worker; p < p_end; p += workers) {
    const int2 src = table[p];
    const int row = ring_row0 + p - p_begin;
    int4* to = reinterpret_cast<int4*>(ring_q + (size_t)row * D);
    if (src.x < 0 || !MOKGEN_OK(src.x < 64 * 1024 && row >= 0, 8, src.x, src.y)) {
      for (int v = lane; v < VEC; v += 32) to[v] = make_int4(0, 0, 0, 0);
      for (int j = lane; j < NS; j += 32) ring_s[(size_t)j * RING_ROWS + row] = fp8_scale<Q>(0.f).scale;
      continue;
    }
    const size_t tok = (size_t)(src.y / K);
    const int4* from = reinterpret_cast<const int4*>(peer_xq[src.x] + tok * D);
    const float* from_s = reinterpret_cast<const float*>(peer_xq[src.x] + scales_at) + tok * NS;
    for (int j = lane; j < NS; j += 32) ring_s[(size_t)j * RING_ROWS + row] = from_s[j];
    int v = lane;  // batches of loads before their stores: 2 KB of one row in flight per warp
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
