// benchmarks/fill_bench.cu -- how fast one SM can fill a ring of shared-memory stages with
// token rows, outside the megakernel (benchmarks/NOTES.md, session 13: the gathered
// backward's stage fills). Every CTA (one an SM) streams `slices` slices of 64 rows x
// 64 * boxes bf16 columns through a ring of `stages` stages, laid out as the megakernel's
// 128B-swizzled boxes (gemm_tile.cuh gather_mn_major), and one consumer thread takes each
// stage as soon as it is full, optionally holding it `hold` clocks (the tensor core's time a
// slice), then frees it. Fill mechanisms (`mode`):
//   0  cp.async by `warps` producer warps, a lane's cp.async.mbarrier.arrive.noinc a stage
//      (the megakernel's gathered rows), rows through a token table;
//   1  the same rows, each lane's slices as commit groups, arrivals after
//      cp.async.wait_group (stages - 2 behind);
//   2  TMA, one thread: 64 x 64 boxes of rows in order (the copied rows' ring);
//   3  mode 0 with one waiter a warp: lane 0 waits for the empty stage, the warp follows
//      (__syncwarp), instead of every lane polling the mbarrier;
//   4  mode 0 beside a TMA operand, as a weight-gradient slice: warp 0's lane 0 also loads
//      two 64 x 64 boxes of in-order rows (16 KB, the A operand) into the stage's tail.
// The consumer's clock64 from its first wait to its last release is the CTA's time; CTA 0's
// last slice is copied out (`last`) for the host to check against the rows it names.
#include <cuda_bf16.h>
#include <cstdint>

#include "mokgen/ptx.cuh"
#include "mokgen/tma.cuh"

using namespace mokgen;

constexpr int kMaxWarps = 8, kRows = 64, kBox = 64 * 128, kMaxStages = 6;

MOKGEN_DEV void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
MOKGEN_DEV void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
// cp.async.wait_group takes an immediate: the lags the bench runs (stages 3..6)
MOKGEN_DEV void cp_async_wait_lag(int lag) {
  switch (lag) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    case 3: cp_async_wait<3>(); break;
    default: cp_async_wait<4>(); break;
  }
}

// Warp w's share of slice s: rows r = 8 boxes-lane groups, warp w every warps-th group.
MOKGEN_DEV void copy_share(uint8_t* stage, const __nv_bfloat16* src, const int* table,
                           int n_table, int ld, int s, int boxes, int w, int warps) {
  const int lane = threadIdx.x & 31, per_row = 8 * boxes, rows_per = 32 / per_row;
  const int q = lane % per_row, sub = lane / per_row, c = q & 7;
  const int col0 = (s % (ld / (64 * boxes))) * 64 * boxes;
  const uint32_t base = smem_u32(stage) + (q >> 3) * kBox;
  for (int g = w; g * rows_per < kRows; g += warps) {
    const int r = g * rows_per + sub;
    const int tok = table[(s * kRows + r) % n_table];
    cp_async_16(base + r * 128 + ((c ^ (r & 7)) << 4),
                src + (size_t)tok * ld + col0 + 8 * q, true);
  }
}

extern "C" __global__ void __launch_bounds__(32 * (kMaxWarps + 1), 1)
fill_bench(const __nv_bfloat16* src, const int* table, int n_table, int ld,
           const __grid_constant__ CUtensorMap map, int n_rows, int mode, int warps,
           int stages, int boxes, int slices, int hold, unsigned long long* out,
           uint8_t* last) {
  // the 128B swizzle's atoms are 1024-aligned (TMA's and the cp.async's address XOR agree)
  uint8_t* smem = dyn_smem() + ((1024 - (smem_u32(dyn_smem()) & 1023)) & 1023);
  const int a_bytes = mode == 4 ? 2 * kBox : 0;  // mode 4's TMA operand a stage
  const int stage_bytes = kRows * 128 * boxes + a_bytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + stages * stage_bytes);
  uint64_t* empty = full + kMaxStages;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    for (int i = 0; i < stages; ++i) {
      mbar_init(&full[i], mode == 2 ? 1 : 32 * warps + (mode == 4));
      mbar_init(&empty[i], 1);
    }
    fence_mbarrier_init();
  }
  __syncthreads();
  if (warp < warps) {  // producers
    if (mode == 2 && warp > 0) return;
    const int lag = stages - 2;
    int arrived = 0;  // mode 1: the next slice this lane arrives for
    for (int s = 0; s < slices; ++s) {
      const int i = s % stages;
      if (mode != 3 || lane == 0) mbar_wait(&empty[i], ((s / stages) & 1) ^ 1, 1);
      if (mode == 3) __syncwarp();
      uint8_t* st = smem + i * stage_bytes;
      if (mode == 2) {
        if (lane == 0) {
          const int row0 = (int)(((long long)blockIdx.x * slices + s) * kRows % n_rows);
          const int col0 = (s % (ld / (64 * boxes))) * 64 * boxes;
          mbar_arrive_expect_tx(&full[i], stage_bytes);
          for (int j = 0; j < boxes; ++j)
            tma_load_2d(st + j * kBox, &map, &full[i], col0 + 64 * j, row0);
        }
        continue;
      }
      if (mode == 4 && threadIdx.x == 0) {
        const int row0 = (int)(((long long)blockIdx.x * slices + s) * kRows % n_rows);
        mbar_arrive_expect_tx(&full[i], a_bytes);
        for (int j = 0; j < 2; ++j)
          tma_load_2d(st + kRows * 128 * boxes + j * kBox, &map, &full[i], 64 * j, row0);
      }
      copy_share(st, src, table, n_table, ld, blockIdx.x * slices + s, boxes, warp, warps);
      if (mode == 0 || mode == 3 || mode == 4) {
        cp_async_mbar_arrive(&full[i]);
        continue;
      }
      cp_async_commit();
      if (s - arrived >= lag) {
        cp_async_wait_lag(lag);
        fence_proxy_async_smem();
        mbar_arrive(&full[arrived % stages]);
        ++arrived;
      }
    }
    if (mode == 1) {
      cp_async_wait<0>();
      fence_proxy_async_smem();
      for (; arrived < slices; ++arrived) mbar_arrive(&full[arrived % stages]);
    }
    return;
  }
  if (warp != kMaxWarps || lane != 0) return;
  const uint64_t t0 = clock64();
  unsigned long long sink = 0;
  for (int s = 0; s < slices; ++s) {
    const int i = s % stages;
    mbar_wait(&full[i], (s / stages) & 1, 2);
    if (mode != 2) fence_proxy_async_smem();  // cp.async (generic proxy) writes
    sink += *reinterpret_cast<const volatile uint32_t*>(smem + i * stage_bytes + (s % 64) * 128);
    if (hold > 0) {
      const uint64_t h0 = clock64();
      while (clock64() - h0 < (uint64_t)hold) {
      }
    }
    if (blockIdx.x == 0 && s == slices - 1)  // CTA 0's last slice, for the host's check
      for (int b = 0; b < kRows * 128 * boxes; b += 16)  // the gathered rows
        *reinterpret_cast<uint4*>(last + b) =
            *reinterpret_cast<const uint4*>(smem + i * stage_bytes + b);
    mbar_arrive(&empty[i]);
  }
  out[2 * blockIdx.x] = clock64() - t0;
  out[2 * blockIdx.x + 1] = sink;
}
