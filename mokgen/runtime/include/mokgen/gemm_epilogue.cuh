// mokgen/gemm_epilogue.cuh -- what the GEMM engine's Problems build their epilogues from: the
// tile's edge masks (cols_valid, half_bit), walkers over a warpgroup's accumulators by pair,
// by 8-column group and gate/up dual, and the stores (registers to global memory, or through
// shared memory with TMA).
#pragma once
#include <cuda_bf16.h>

#include "mokgen/gemm_types.cuh"
#include "mokgen/ptx.cuh"
#include "mokgen/tma.cuh"

namespace mokgen {

// ---------------------------------------------------------------- epilogue walkers
// Output columns that exist in a BN-wide tile at column c0 of a W-wide output (a multiple of
// 8). When W is a multiple of BN (every tile full) this is the constant BN and the column
// masks below fold away: full-width shapes compile exactly as without them. Otherwise the
// last tile of the row is an edge tile; its B rows past W are zero-filled by TMA (MN-major B:
// W is the tensor map's width) or are other rows (K-major B: the next expert's), and the
// epilogue drops those columns.
template <int W, int BN>
MOKGEN_DEV int cols_valid(int c0) {
  if constexpr (W % BN == 0) return BN;
  else return min(BN, W - c0);
}
// The same along M: rows that exist in a BM-tall tile at row r0 of a W-tall output (the
// weight gradients, whose M is a width: their A operand is zero-filled past it).
template <int W, int BM>
MOKGEN_DEV int rows_valid(int r0) { return cols_valid<W, BM>(r0); }

// Narrow edge tiles. A BN = 256 tile at column c0 whose columns past BN/2 are all past the
// width W runs its mainloop at N = BN/2 (Task::op bit kHalfN, from half_bit): half the MMA
// time of a tile that is at most half useful, and an MN-major B brings half its boxes
// (produce_tile). Its accumulators past BN/2 stay as ConsumerAcc zeroed them; a full-width
// edge tile computed zeros there from zero-filled B (MN-major) or columns the epilogue drops
// (K-major), so every epilogue sees what it saw. Shapes whose W % 256 is in (0, 128] have
// such a tile (an odd multiple of 128, or 2880 = 11 x 256 + 64): DeepSeek-V2-Lite's I = 1408,
// gpt-oss's D = 2880. Only their kernels compile the narrow mainloop (Problem::kNarrowTiles);
// every other shape's code is as without it.
template <int W, int BN>
constexpr bool half_edge() { return BN == 256 && W % BN != 0 && W % BN <= BN / 2; }
template <int W, int BN>
MOKGEN_DEV int half_bit(int c0) {
  if constexpr (half_edge<W, BN>()) return c0 + BN / 2 >= W ? kHalfN : 0;
  else return 0;
}

// Accumulator layout (see wgmma.cuh): thread (warp w in its warpgroup, lane l) holds for
// even r: row = 64*cwg + 16*w + l/4 + 8*((r/2)%2), cols c = 8*(r/4) + 2*(l%4) and c+1.
// f(row_in_tile, col_in_tile, v_c, v_c1) is called once per pair with row < m_valid and
// col < n_valid only (n_valid a multiple of 8: an 8-column group is in or out as a whole).
// T = float: f may take v_c, v_c1 by reference and update the accumulators.
template <int BN, class T, class F>
MOKGEN_DEV void for_each_acc_pair(T (&acc)[BN / 2], int cwg, int m_valid, F&& f,
                                  int n_valid = BN) {
  const int w = (threadIdx.x >> 5) & 3, l = threadIdx.x & 31;
  const int row_base = 64 * cwg + 16 * w + (l >> 2);
#pragma unroll
  for (int r = 0; r < BN / 2; r += 2) {
    const int row = row_base + 8 * ((r >> 1) & 1);
    const int col = 8 * (r >> 2) + 2 * (l & 3);
    if (row < m_valid && 8 * (r >> 2) < n_valid) f(row, col, acc[r], acc[r + 1]);
  }
}
// Dual-B: accumulator columns [0, BN/2) are gate, [BN/2, BN) are up, and register r + BN/4
// holds column col(r) + BN/2, i.e. the same output column. f(row, col, g0, g1, u0, u1) with
// col in [0, n_valid) (an edge tile's gate half runs into the up rows, and its up half into
// the next expert's rows, past the width: those columns are dropped).
template <int BN, class F>
MOKGEN_DEV void for_each_dual_pair(const float (&acc)[BN / 2], int cwg, int m_valid, F&& f,
                                   int n_valid = BN / 2) {
  const int w = (threadIdx.x >> 5) & 3, l = threadIdx.x & 31;
  const int row_base = 64 * cwg + 16 * w + (l >> 2);
#pragma unroll
  for (int r = 0; r < BN / 4; r += 2) {
    const int row = row_base + 8 * ((r >> 1) & 1);
    const int col = 8 * (r >> 2) + 2 * (l & 3);
    if (row < m_valid && 8 * (r >> 2) < n_valid)
      f(row, col, acc[r], acc[r + 1], acc[r + BN / 4], acc[r + 1 + BN / 4]);
  }
}

// A row's 8 consecutive columns at a time, for 16-byte loads and stores: a warp's access
// then covers 64 contiguous bytes of each of its 8 rows where a pair's covers 16 (half a
// sector each), so an epilogue issues a quarter of the instructions for half the sectors
// (pair by pair, the SwiGLU backward's epilogue takes half as long as its mainloop).
// quad_transpose: the 4 lanes of a quad (one row) trade their pairs. On entry lane q holds
// e[i] = columns 8 (4 g + i) + 2 q, +1; on exit e[i] = columns 8 (4 g + q) + 2 i, +1, the
// 8 columns of group 4 g + q. Two xor-shuffle rounds; selects, not a runtime index (that
// would put e in local memory).
// One round with lane q ^ M: a lane with bit M set trades its elements A0, A1, the other
// its B0, B1 (the partner's, which sit where its own went).
template <int M, int A0, int A1, int B0, int B1>
MOKGEN_DEV void quad_trade(float2 (&e)[4]) {
  const bool a = threadIdx.x & M;
  const float2 s0 = a ? e[A0] : e[B0], s1 = a ? e[A1] : e[B1];
  const float2 r0 = make_float2(__shfl_xor_sync(~0u, s0.x, M), __shfl_xor_sync(~0u, s0.y, M));
  const float2 r1 = make_float2(__shfl_xor_sync(~0u, s1.x, M), __shfl_xor_sync(~0u, s1.y, M));
  e[A0] = a ? r0 : e[A0];
  e[A1] = a ? r1 : e[A1];
  e[B0] = a ? e[B0] : r0;
  e[B1] = a ? e[B1] : r1;
}
MOKGEN_DEV void quad_transpose(float2 (&e)[4]) {
  quad_trade<2, 0, 1, 2, 3>(e);  // the off-diagonal 2 x 2 blocks
  quad_trade<1, 0, 2, 1, 3>(e);  // inside each 2 x 2 block
}
// The 8 columns of accumulator group j (registers 4 j + 2 h, +1 of the 4 lanes) of groups
// 4 g .. 4 g + 3, half h, after quad_transpose: lane q gets group 4 g + q. OFF: register
// offset (dual-B: BN / 4 for the up half).
template <int OFF, int N>
MOKGEN_DEV void oct_of(const float (&acc)[N], int g, int h, float (&v)[8]) {
  float2 e[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) e[i] = make_float2(acc[OFF + 16 * g + 4 * i + 2 * h],
                                                 acc[OFF + 16 * g + 4 * i + 2 * h + 1]);
  quad_transpose(e);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = e[i].x;
    v[2 * i + 1] = e[i].y;
  }
}
// f(row, col, v): v[0..7] = columns col .. col + 7 of tile row `row`, once per group with
// row < m_valid and col < n_valid (a multiple of 8). Bit 3 of row is the thread's half h
// (its rows are row_base and row_base + 8). Every lane shuffles before the masks: call it
// from whole warps.
template <int BN, class F>
MOKGEN_DEV void for_each_acc_oct(const float (&acc)[BN / 2], int cwg, int m_valid, F&& f,
                                 int n_valid = BN) {
  static_assert(BN % 32 == 0, "groups of 8 columns, 4 to a quad");
  const int w = (threadIdx.x >> 5) & 3, l = threadIdx.x & 31;
  const int row_base = 64 * cwg + 16 * w + (l >> 2);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int g = 0; g < BN / 32; ++g) {
      float v[8];
      oct_of<0>(acc, g, h, v);
      const int row = row_base + 8 * h, col = 8 * (4 * g + (l & 3));
      if (row < m_valid && col < n_valid) f(row, col, v);
    }
  }
}
// Dual-B (see for_each_dual_pair): f(row, col, gate[8], up[8]) for output columns col ..
// col + 7 in [0, n_valid).
template <int BN, class F>
MOKGEN_DEV void for_each_dual_oct(const float (&acc)[BN / 2], int cwg, int m_valid, F&& f,
                                  int n_valid = BN / 2) {
  static_assert(BN % 64 == 0, "groups of 8 columns, 4 to a quad, in each half");
  const int w = (threadIdx.x >> 5) & 3, l = threadIdx.x & 31;
  const int row_base = 64 * cwg + 16 * w + (l >> 2);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int g = 0; g < BN / 64; ++g) {
      float gv[8], uv[8];
      oct_of<0>(acc, g, h, gv);
      oct_of<BN / 4>(acc, g, h, uv);
      const int row = row_base + 8 * h, col = 8 * (4 * g + (l & 3));
      if (row < m_valid && col < n_valid) f(row, col, gv, uv);
    }
  }
}
// 2 floats as 2 bf16 in one 32-bit word (a first, in the low half); 8 as one 16-byte vector,
// and back.
MOKGEN_DEV uint32_t bf16x2_bits(float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}
MOKGEN_DEV uint4 bf16x8(const float (&v)[8]) {
  uint4 o;
  uint32_t* w = reinterpret_cast<uint32_t*>(&o);
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = bf16x2_bits(v[2 * i], v[2 * i + 1]);
  return o;
}
MOKGEN_DEV void floats_of_bf16x8(uint4 raw, float (&v)[8]) {
  const uint32_t* w = reinterpret_cast<const uint32_t*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[i]));
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

// A warpgroup's 64 x BN fp32 accumulators (rows 64 cwg .. of the tile) stored as bf16 through
// shared memory with TMA, instead of each thread's 4-byte stores (a warp's store then covers
// 8 rows x 16 B: half-filled sectors, and the warpgroup's next mainloop waits until all are
// issued). 64-column chunks, each a 64 x 64 box (8 KB, 128B-swizzled: a row's 16-byte chunk
// c sits at c ^ (row % 8), so the 8 rows of a warp's shared store hit distinct banks), in
// NBUF buffers of `stage` (NBUF x 8 KB of this warpgroup's, 1024-aligned) in turn; one
// thread (the warpgroup's first) writes each box to global memory with a bulk tensor store,
// so the writes to global memory run under the next chunks and the next tile's mainloop.
// One barrier a chunk: before it, the issuer waits until the store of the chunk whose
// buffer the next chunk fills has read it (none with NBUF = BN / 64 buffers, a row block's
// every chunk: the tile then never waits on its own stores), and on entry until every store
// of the last call has (its chunks used every buffer). Rows and columns past the map's
// bounds (an edge tile) are dropped by TMA; chunks from n_valid on are not issued.
// (col0, row0, z): the warpgroup's first output element in the map's coordinates (z: the
// matrix of a 3D map). add: each box is added into the tensor (tma_reduce_add_3d) instead.
template <int BN, int NBUF = 2>
MOKGEN_DEV void store_rows_tma(const float (&acc)[BN / 2], int cwg, uint8_t* stage,
                               const CUtensorMap* map, int col0, int row0, int z,
                               int n_valid, bool add = false) {
  static_assert(NBUF >= 2 && NBUF <= BN / 64, "two buffers at least, a chunk each at most");
  const int w = (threadIdx.x >> 5) & 3, l = threadIdx.x & 31;
  const bool issuer = (threadIdx.x & 127) == 0;
  const uint32_t bar = kBarEpi + cwg;
  if (issuer) bulk_wait_read<0>();
  named_bar_sync(bar, 128);
#pragma unroll
  for (int q = 0; q < BN / 64; ++q) {
    if (64 * q >= n_valid) break;
    uint8_t* box = stage + (q % NBUF) * 8192;
#pragma unroll
    for (int g = 0; g < 8; ++g) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {  // accumulator pair 4 j + 2 hh: row + 8 hh, group j
        const int r = 16 * w + (l >> 2) + 8 * hh, a = 4 * (8 * q + g) + 2 * hh;
        const uint32_t off = r * 128 + ((g ^ (r & 7)) << 4) + (l & 3) * 4;
        asm volatile("st.shared.b32 [%0], %1;" ::"r"(smem_u32(box + off)),
                     "r"(bf16x2_bits(acc[a], acc[a + 1])) : "memory");
      }
    }
    fence_proxy_async_shared();  // this thread's writes, before the async proxy reads them
    // chunk q + 1 fills chunk q + 1 - NBUF's buffer: that store must have read it (stores
    // committed so far: chunks .. q - 1, of which the newest NBUF - 2 may still be reading)
    if (issuer && q + 1 >= NBUF && q + 1 < BN / 64 && 64 * (q + 1) < n_valid)
      bulk_wait_read<NBUF - 2>();
    named_bar_sync(bar, 128);
    if (issuer) {
      if (add) tma_reduce_add_3d(map, box, col0 + 64 * q, row0, z);
      else tma_store_3d(map, box, col0 + 64 * q, row0, z);
      bulk_commit();
    }
  }
}

// The logistic function, 1 / (1 + 2^(-x log2 e)) with the exponential as PTX ex2.approx.ftz:
// __expf compiles to the non-ftz ex2, which guards each element for a subnormal result (one
// FSETP and a fix-up an element: 385 more instructions in Qwen3's backward megakernel).
// Flushing changes nothing here: such a result (x > 87) only meets 1 + it. x < -88: ex2 gives
// inf and __fdividef 0 (its range guard; with numerator 1 it compiles to the bare MUFU.RCP),
// so silu(x) = x * 0 = 0 as before. Otherwise the same arithmetic as __fdividef(x, 1 +
// __expf(-x)) before (PTX div.approx is a times rcp.approx of b).
MOKGEN_DEV float sigmoid(float x) {
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(-1.4426950408889634f * x));
  return __fdividef(1.f, 1.f + e);
}
MOKGEN_DEV float silu(float x) { return x * sigmoid(x); }

// Profiling (kSink, kProfFwdSinkStores): a 16-byte store goes out only where its first word
// holds a NaN payload no arithmetic here makes (so never): the values' math, conversion and
// shuffles stay (an unused value would be compiled away with them), the stores' cost goes.
template <bool kSink>
MOKGEN_DEV bool store_kept(const uint4& v) { return !kSink || v.x == 0x7fc1deadu; }

// Epilogue stores, 8 columns (16 or 32 bytes) at a time (for_each_acc_oct / _dual_oct), or
// with kOct = false a pair (4 or 8 bytes) at a time: the fp8 kernels, whose consumers have
// no registers to spare (the 8-column walk spilled 8 B in an fp8 backward).
// Gate/up + SwiGLU: act[r * ld + c] = silu(g) u and, unless pre is null, the pre-activations
// pre[r * 2 ld + c] = g, pre[r * 2 ld + ld + c] = u (a backward reads them).
template <int BN, bool kOct = true, bool kSink = false>
MOKGEN_DEV void store_gate_up(const float (&acc)[BN / 2], int cwg, int m_valid,
                              __nv_bfloat16* pre, __nv_bfloat16* act, int ld, int n_valid) {
  if constexpr (kOct) {
    for_each_dual_oct<BN>(acc, cwg, m_valid,
                          [&](int r, int c, const float (&g)[8], const float (&u)[8]) {
      float a[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) a[i] = silu(g[i]) * u[i];
      const uint4 av = bf16x8(a);
      if (store_kept<kSink>(av)) *reinterpret_cast<uint4*>(act + (size_t)r * ld + c) = av;
      if (pre) {
        const uint4 gv = bf16x8(g), uv = bf16x8(u);
        if (store_kept<kSink>(gv)) *reinterpret_cast<uint4*>(pre + (size_t)r * 2 * ld + c) = gv;
        if (store_kept<kSink>(uv))
          *reinterpret_cast<uint4*>(pre + (size_t)r * 2 * ld + ld + c) = uv;
      }
    }, n_valid);
  } else {
    for_each_dual_pair<BN>(acc, cwg, m_valid,
                           [&](int r, int c, float g0, float g1, float u0, float u1) {
      *reinterpret_cast<__nv_bfloat162*>(act + (size_t)r * ld + c) =
          __floats2bfloat162_rn(silu(g0) * u0, silu(g1) * u1);
      if (pre) {
        *reinterpret_cast<__nv_bfloat162*>(pre + (size_t)r * 2 * ld + c) =
            __floats2bfloat162_rn(g0, g1);
        *reinterpret_cast<__nv_bfloat162*>(pre + (size_t)r * 2 * ld + ld + c) =
            __floats2bfloat162_rn(u0, u1);
      }
    }, n_valid);
  }
}
// fp32 rows: out[r * ld + c ..] = the accumulators.
template <int BN, bool kOct = true>
MOKGEN_DEV void store_f32(const float (&acc)[BN / 2], int cwg, int m_valid, float* out, int ld,
                          int n_valid) {
  if constexpr (kOct) {
    for_each_acc_oct<BN>(acc, cwg, m_valid, [&](int r, int c, const float (&v)[8]) {
      float4* o = reinterpret_cast<float4*>(out + (size_t)r * ld + c);
      o[0] = make_float4(v[0], v[1], v[2], v[3]);
      o[1] = make_float4(v[4], v[5], v[6], v[7]);
    }, n_valid);
  } else {
    for_each_acc_pair<BN>(acc, cwg, m_valid, [&](int r, int c, float v0, float v1) {
      *reinterpret_cast<float2*>(out + (size_t)r * ld + c) = make_float2(v0, v1);
    }, n_valid);
  }
}
// Each of the thread's two rows (half h: bit 3 of the tile row) to its own destination row
// dst[h] (nullptr: none), times scale[h], as bf16: rows scattered to their tokens' owners.
template <int BN, bool kOct = true, bool kSink = false>
MOKGEN_DEV void store_rows_to(const float (&acc)[BN / 2], __nv_bfloat16* const (&dst)[2],
                              const float (&scale)[2], int n_valid) {
  if constexpr (kOct) {
    for_each_acc_oct<BN>(acc, 0, 1 << 30, [&](int r, int c, const float (&v)[8]) {
      const int h = (r >> 3) & 1;
      if (dst[h] == nullptr) return;
      float o[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) o[i] = v[i] * scale[h];
      const uint4 ov = bf16x8(o);
      if (store_kept<kSink>(ov)) *reinterpret_cast<uint4*>(dst[h] + c) = ov;
    }, n_valid);
  } else {
    for_each_acc_pair<BN>(acc, 0, 1 << 30, [&](int r, int c, float v0, float v1) {
      const int h = (r >> 3) & 1;
      if (dst[h] != nullptr)
        *reinterpret_cast<__nv_bfloat162*>(dst[h] + c) =
            __floats2bfloat162_rn(v0 * scale[h], v1 * scale[h]);
    }, n_valid);
  }
}

// Rows through shared memory instead of quad transposes (store_rows_staged): the warp writes
// its 16 rows x 64 columns (a chunk) as bf16 with stmatrix (4 instructions a chunk), then each
// lane reads back 16-byte pieces of its own two rows and stores them as the register path does.
// Why: the down tile's epilogue is register work, the transposes (8 shuffles and 16 selects per
// 8 values), not its stores nor its table loads (the profiles fwd_sink_stores and down_in_order
// leave most of its time); staged, it takes 7-9% fewer cycles. A warp reads only its own rows:
// a __syncwarp orders the writes and the reads, no barrier. stage: the warp's 4 KB, two 2 KB
// chunk buffers in turn (a chunk's writes never wait on the previous chunk's reads; the one
// after it does, behind the previous __syncwarp). A row's 16-byte piece c sits at c ^ (row %
// 8): no bank conflict for stmatrix's 8 rows nor the readback's 8 rows x 4 lanes.
// stmatrix_chunk: chunk c into buf; pair(j, h) gives this lane's bf16x2 of 8-column group j,
// row half h (row l / 4 + 8 h, columns 8 j + 2 (l % 4), +1: the accumulator layout).
template <class P>
MOKGEN_DEV void stmatrix_chunk(uint32_t buf, int c, P&& pair) {
  // stmatrix's row addresses: lane l gives row l % 8 (+ 8 for matrices 1 and 3) of the
  // warp's 16, in piece l / 16 of the pair of groups
  const int l = threadIdx.x & 31, srow = (l & 7) + 8 * ((l >> 3) & 1), spiece = l >> 4;
#pragma unroll
  for (int p = 0; p < 4; ++p) {  // groups j, j + 1: matrices (rows 0-7 | 8-15) x group
    const int j = 8 * c + 2 * p;
    stmatrix_x4(buf + srow * 128 + (((2 * p + spiece) ^ (srow & 7)) << 4), pair(j, 0),
                pair(j, 1), pair(j + 1, 0), pair(j + 1, 1));
  }
}
// put(h, col, v): after stmatrix_chunk and a __syncwarp, this lane's 4 pieces of chunk c:
// row l / 4 + 8 h of the warp's, columns col .. col + 7 of the tile (col < n_valid only).
template <class F>
MOKGEN_DEV void staged_pieces(uint32_t buf, int c, int n_valid, F&& put) {
  const int l = threadIdx.x & 31;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = (l >> 2) + 8 * h;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int piece = (l & 3) + 4 * k, col = 64 * c + 8 * piece;
      const uint4 v = lds_128(buf + row * 128 + ((piece ^ (row & 7)) << 4));
      if (col < n_valid) put(h, col, v);
    }
  }
}

// store_rows_to through shared memory (see above).
template <int BN, bool kSink = false>
MOKGEN_DEV void store_rows_staged(const float (&acc)[BN / 2], __nv_bfloat16* const (&dst)[2],
                                  const float (&scale)[2], int n_valid, uint8_t* stage) {
  static_assert(BN % 64 == 0, "64-column chunks");
  const uint32_t base = smem_u32(stage);
  __syncwarp();  // every lane has read the last call's chunks from these buffers
#pragma unroll
  for (int c = 0; c < BN / 64; ++c) {
    if (64 * c >= n_valid) break;
    const uint32_t buf = base + (c & 1) * 2048;
    stmatrix_chunk(buf, c, [&](int j, int h) {
      return bf16x2_bits(acc[4 * j + 2 * h] * scale[h], acc[4 * j + 2 * h + 1] * scale[h]);
    });
    __syncwarp();
    staged_pieces(buf, c, n_valid, [&](int h, int col, const uint4& v) {
      if (dst[h] != nullptr && store_kept<kSink>(v))
        *reinterpret_cast<uint4*>(dst[h] + col) = v;
    });
  }
}

}  // namespace mokgen
