// mokgen/quant.cuh -- MXFP8 (OCP Microscaling v1.0) weight quantization on the GPU, bit for
// bit the same as the torch reference mokgen.quant.to_mxfp8 (its docstring is the spec).
//
// One thread per 32-element block: it reads the block, takes amax, picks the e8m0 scale
// X = 2^(floor(log2 amax) - 8) (biased byte clamp(e - 8 + 127, 0, 254); 0 for an all-zero
// block; 255 for a block holding NaN or Inf), divides by X in IEEE fp32 (exact: X is a power
// of two, as the reference's division), clamps to +-448 and rounds to e4m3 (nearest even,
// subnormals kept). A NaN block is written as e4m3 NaN (0x7F), like the reference.
// Two layouts, both as the backward needs them: blocks along a row of [rows, cols] (the
// forward's K = cols), or along a column, written transposed as [cols, rows] (K = rows).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <math.h>
#include "mokgen/ptx.cuh"

namespace mokgen {

constexpr int kMxBlock = 32;

MOKGEN_DEV uint8_t mx_scale_byte(float amax) {
  if (!isfinite(amax)) return 255;
  if (amax == 0.f) return 0;
  const int e = ilogbf(amax);  // floor(log2(amax)), subnormals included
  return (uint8_t)min(254, max(0, e - 8 + 127));
}

MOKGEN_DEV float mx_scale_value(uint8_t byte) {  // 2^(byte - 127) for byte <= 254, exactly
  return byte == 0 ? __int_as_float(0x00400000)  // 2^-127 is a subnormal
                   : __int_as_float((int)byte << 23);
}

MOKGEN_DEV uint8_t mx_element(float v, float scale) {
  const float q = fminf(fmaxf(__fdiv_rn(v, scale), -448.f), 448.f);
  return (uint8_t)__nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3);
}

// Quantize one block of 32 values (already in registers) into out[0..31] and its scale.
MOKGEN_DEV void mx_block(const float (&v)[kMxBlock], uint8_t* out, uint8_t* scale) {
  float amax = 0.f;
  bool finite = true;
#pragma unroll
  for (int i = 0; i < kMxBlock; ++i) {
    finite &= isfinite(v[i]);
    amax = fmaxf(amax, fabsf(v[i]));
  }
  const uint8_t byte = finite ? mx_scale_byte(amax) : 255;
  *scale = byte;
  uint32_t words[kMxBlock / 4];
  const float s = mx_scale_value(byte == 255 ? 127 : byte);
#pragma unroll
  for (int w = 0; w < kMxBlock / 4; ++w) {
    uint32_t packed = 0;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const uint8_t e = byte == 255 ? 0x7F : mx_element(v[4 * w + b], s);
      packed |= (uint32_t)e << (8 * b);
    }
    words[w] = packed;
  }
  uint4* o = reinterpret_cast<uint4*>(out);  // 32 bytes, 16-byte aligned by construction
  o[0] = make_uint4(words[0], words[1], words[2], words[3]);
  o[1] = make_uint4(words[4], words[5], words[6], words[7]);
}

template <class T>
MOKGEN_DEV float to_f32(T v) { return (float)v; }
template <>
MOKGEN_DEV float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

// in: `batch` matrices [rows, cols] (contiguous). Row layout: data [rows, cols], scales
// [rows, cols/32]. Transposed layout: data [cols, rows], scales [cols, rows/32].
template <class T, bool kTransposed>
__device__ void mx_quantize(const T* __restrict__ in, int rows, int cols,
                            uint8_t* __restrict__ data, uint8_t* __restrict__ scales) {
  const size_t mat = (size_t)rows * cols;
  in += blockIdx.y * mat;
  data += blockIdx.y * mat;
  scales += blockIdx.y * (mat / kMxBlock);
  const size_t blocks = mat / kMxBlock;
  for (size_t b = blockIdx.x * (size_t)blockDim.x + threadIdx.x; b < blocks;
       b += (size_t)gridDim.x * blockDim.x) {
    float v[kMxBlock];
    if (!kTransposed) {  // block b = row r, columns 32c..: consecutive threads, consecutive blocks
      const T* p = in + b * kMxBlock;
#pragma unroll
      for (int i = 0; i < kMxBlock; ++i) v[i] = to_f32(p[i]);
      mx_block(v, data + b * kMxBlock, scales + b);
    } else {  // block b = column c, rows 32j..: consecutive threads read consecutive columns
      const int c = (int)(b % cols), j = (int)(b / cols);
      const T* p = in + (size_t)j * kMxBlock * cols + c;
#pragma unroll
      for (int i = 0; i < kMxBlock; ++i) v[i] = to_f32(p[(size_t)i * cols]);
      mx_block(v, data + (size_t)c * rows + j * kMxBlock, scales + (size_t)c * (rows / kMxBlock) + j);
    }
  }
}

}  // namespace mokgen
