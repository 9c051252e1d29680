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
// Modes 5-8 take the megakernel's addressing (gemm_tile.cuh gather_mn_major): warp w the
// rows 64 / warps * w .., each lane one row's token read once a slice and shuffled, the
// row loop unrolled (copy_pre; warps 2, 4 or 8). Mode 0's loop reads the table row by row,
// each cp.async behind its own load (its SASS: one LDG, one LDGSTS an iteration).
//   5  cp.async + arrive.noinc;
//   6  registers: ld.global.v4 of 4 rows a lane, then their st.shared, batch by batch, then
//      fence.proxy.async and a plain arrive (no cp.async);
//   7  mode 5 with rows in order (no table: row r of slice s is token s * 64 + r);
//   8  mode 6 with up to 16 rows a lane (all of its share at 4 or 8 warps) loaded first.
//   9  TMA, a box a row (64 columns x 1 row through `row_map`): warp w's lane 0 issues its
//      rows' boxes, their tokens read once a slice by the warp's lanes and shuffled;
//  11  mode 5, each slice's copies waited for (wait_group 0) before a plain arrival: the
//      producer serialized on the copies' latency on purpose, to compare with mode 5;
//  12  mode 5 beside mode 4's TMA operand (a weight-gradient slice's A).
// fill_pair (below) is modes 10 and 13-16 of fill_bench.py.
// CTA b's slice s reads the rows of slice b * kCtaSkew + s, so that CTAs do not read the
// same rows at the same time (in session 13 they did: slices * 64 is a multiple of the
// table). Measured in session 14: no rate changed with the skew.
// The consumer's clock64 from its first wait to its last release is the CTA's time; CTA 0's
// last slice is copied out (`last`) for the host to check against the rows it names.
#include <cuda_bf16.h>
#include <cstdint>

#include "mokgen/cluster.cuh"
#include "mokgen/ptx.cuh"
#include "mokgen/tma.cuh"

using namespace mokgen;

constexpr int kMaxWarps = 8, kRows = 64, kBox = 64 * 128, kMaxStages = 6, kCtaSkew = 1031;

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

MOKGEN_DEV void st_shared_16(uint32_t dst, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(dst), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

// Registers modes: N rows a lane in batches of B, each batch's loads before its stores.
template <int N, int B, int RW, int RP>
MOKGEN_DEV void ldg_sts(uint32_t base, const __nv_bfloat16* col, int ld, int tok, int w, int c,
                        int sub) {
#pragma unroll
  for (int i0 = 0; i0 < N; i0 += B) {
    uint4 v[B];
#pragma unroll
    for (int j = 0; j < B; ++j) {
      const int t = __shfl_sync(0xffffffffu, tok, RP * (i0 + j) + sub);
      v[j] = __ldg(reinterpret_cast<const uint4*>(col + (size_t)t * ld));
    }
#pragma unroll
    for (int j = 0; j < B; ++j) {
      const int row = RW * w + RP * (i0 + j) + sub;
      st_shared_16(base + row * 128 + ((c ^ (row & 7)) << 4), v[j]);
    }
  }
}

// How a thread waits for a phase (fill_bench.py's `wait` column): 0 mbarrier.try_wait, the
// megakernel's way (mbar_wait: the thread may be suspended until the phase completes or a
// system-dependent time limit passes); 1 mbarrier.test_wait in a spin, which never suspends;
// 2 try_wait with a suspend-time hint of 20 ns.
MOKGEN_DEV bool bar_test(uint64_t* bar, uint32_t parity, int kind) {
  uint32_t ok;
  if (kind == 1)
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(ok) : "r"(smem_u32(bar)), "r"(parity) : "memory");
  else
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, 20;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(ok) : "r"(smem_u32(bar)), "r"(parity) : "memory");
  return ok != 0;
}
MOKGEN_DEV void bench_wait(uint64_t* bar, uint32_t parity, int kind, int tag) {
  if (kind == 0) return mbar_wait(bar, parity, tag);
  for (uint32_t n = 0; !bar_test(bar, parity, kind); ++n)
    if (n == (1u << 26)) wait_timed_out(tag, parity);
}

// Modes 5-8: W producer warps, BOXES 64-column boxes a row; N instructions a warp a slice,
// each RP rows of PER_ROW lanes. Registers modes load B rows a lane before storing them.
// NR rows from row0 (fill_pair: a CTA's half of the slice), kRows and 0 elsewhere.
template <int W, int BOXES, int NR = kRows>
MOKGEN_DEV void copy_pre(uint8_t* stage, const __nv_bfloat16* src, const int* table,
                         int n_table, int ld, int n_rows, long long s, int w, int mode,
                         int row0 = 0) {
  constexpr int RW = NR / W, PER_ROW = 8 * BOXES, RP = 32 / PER_ROW, N = RW / RP;
  static_assert(RW <= 32 && N >= 1, "a lane reads one row's token");
  const int lane = threadIdx.x & 31, q = lane % PER_ROW, sub = lane / PER_ROW, c = q & 7;
  const int col0 = (int)(s % (ld / (64 * BOXES))) * 64 * BOXES;
  const uint32_t base = smem_u32(stage) + (q >> 3) * kBox;
  const long long p = s * kRows + row0 + RW * w + lane % RW;
  const int tok = mode == 7 ? (int)(p % n_rows) : table[p % n_table];
  const __nv_bfloat16* col = src + col0 + 8 * q;
  if (mode == 5 || mode == 7) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int r = RP * i + sub, row = row0 + RW * w + r;
      const int t = __shfl_sync(0xffffffffu, tok, r);
      cp_async_16(base + row * 128 + ((c ^ (row & 7)) << 4), col + (size_t)t * ld, true);
    }
    return;
  }
  if (mode == 8)
    ldg_sts<N, (N < 16 ? N : 16), RW, RP>(base, col, ld, tok, w, c, sub);
  else
    ldg_sts<N, (N < 4 ? N : 4), RW, RP>(base, col, ld, tok, w, c, sub);
}

MOKGEN_DEV void copy_pre_any(uint8_t* stage, const __nv_bfloat16* src, const int* table,
                             int n_table, int ld, int n_rows, long long s, int boxes, int w,
                             int warps, int mode) {
#define MOKGEN_FB_CASE(W, B)                                                 \
  if (warps == W && boxes == B)                                             \
    return copy_pre<W, B>(stage, src, table, n_table, ld, n_rows, s, w, mode);
  MOKGEN_FB_CASE(2, 2) MOKGEN_FB_CASE(2, 4) MOKGEN_FB_CASE(4, 2)
  MOKGEN_FB_CASE(4, 4) MOKGEN_FB_CASE(8, 2) MOKGEN_FB_CASE(8, 4)
#undef MOKGEN_FB_CASE
}

extern "C" __global__ void __launch_bounds__(32 * (kMaxWarps + 1), 1)
fill_bench(const __nv_bfloat16* src, const int* table, int n_table, int ld,
           const __grid_constant__ CUtensorMap map,
           const __grid_constant__ CUtensorMap row_map, int n_rows, int mode, int warps,
           int stages, int boxes, int slices, int hold, int wk, unsigned long long* out,
           uint8_t* last) {
  // the 128B swizzle's atoms are 1024-aligned (TMA's and the cp.async's address XOR agree)
  uint8_t* smem = dyn_smem() + ((1024 - (smem_u32(dyn_smem()) & 1023)) & 1023);
  const bool tma_a = mode == 4 || mode == 12;
  const int a_bytes = tma_a ? 2 * kBox : 0;  // modes 4 and 12: the TMA operand a stage
  const int stage_bytes = kRows * 128 * boxes + a_bytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + stages * stage_bytes);
  uint64_t* empty = full + kMaxStages;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    for (int i = 0; i < stages; ++i) {
      mbar_init(&full[i], mode == 2 ? 1 : mode == 9 ? warps : 32 * warps + tma_a);
      mbar_init(&empty[i], 1);
    }
    fence_mbarrier_init();
  }
  __syncthreads();
  if (warp < warps) {  // producers
    if (mode == 2 && warp > 0) return;
    const int lag = stages - 2;
    int arrived = 0;  // mode 1: the next slice this lane arrives for
    uint64_t wait_clk = 0, issue_clk = 0;  // thread 0's, modes 2 and 5-11 (out[4 b + 2, 3])
    for (int s = 0; s < slices; ++s) {
      const int i = s % stages;
      const uint64_t tw = clock64();
      if (mode != 3 || lane == 0) bench_wait(&empty[i], ((s / stages) & 1) ^ 1, wk, 1);
      const uint64_t ti = clock64();
      wait_clk += ti - tw;
      if (mode == 3) __syncwarp();
      uint8_t* st = smem + i * stage_bytes;
      const long long sg = (long long)blockIdx.x * kCtaSkew + s;  // the rows' slice
      if (mode == 9) {
        const int rw = kRows / warps, col0 = (int)(sg % (ld / (64 * boxes))) * 64 * boxes;
        const int tok = table[(sg * kRows + rw * warp + lane % rw) % n_table];
        if (lane == 0) mbar_arrive_expect_tx(&full[i], rw * 128 * boxes);
        for (int r = 0; r < rw; ++r) {
          const int t = __shfl_sync(0xffffffffu, tok, r), row = rw * warp + r;
          if (lane == 0)
            for (int j = 0; j < boxes; ++j)
              tma_load_2d(st + j * kBox + row * 128, &row_map, &full[i], col0 + 64 * j, t);
        }
        continue;
      }
      if (mode == 2) {
        if (lane == 0) {
          const int row0 = (int)(sg * kRows % n_rows);
          const int col0 = (s % (ld / (64 * boxes))) * 64 * boxes;
          mbar_arrive_expect_tx(&full[i], stage_bytes);
          for (int j = 0; j < boxes; ++j)
            tma_load_2d(st + j * kBox, &map, &full[i], col0 + 64 * j, row0);
          issue_clk += clock64() - ti;
        }
        continue;
      }
      if (tma_a && threadIdx.x == 0) {
        const int row0 = (int)(sg * kRows % n_rows);
        mbar_arrive_expect_tx(&full[i], a_bytes);
        for (int j = 0; j < 2; ++j)
          tma_load_2d(st + kRows * 128 * boxes + j * kBox, &map, &full[i], 64 * j, row0);
      }
      if (mode >= 5) {
        copy_pre_any(st, src, table, n_table, ld, n_rows, sg, boxes, warp, warps,
                     mode == 11 || mode == 12 ? 5 : mode);
        if (mode == 11) {  // every copy waited for before the arrival: no overlap by design
          cp_async_commit();
          cp_async_wait<0>();
        }
        if (mode == 6 || mode == 8 || mode == 11) {
          fence_proxy_async_smem();  // generic writes a wgmma (async proxy) would read
          mbar_arrive(&full[i]);
        } else {
          cp_async_mbar_arrive(&full[i]);
        }
        issue_clk += clock64() - ti;
        continue;
      }
      copy_share(st, src, table, n_table, ld, sg, boxes, warp, warps);
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
    if (threadIdx.x == 0) {
      out[4 * blockIdx.x + 2] = issue_clk;
      out[4 * blockIdx.x + 3] = wait_clk;
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
    bench_wait(&full[i], (s / stages) & 1, wk, 2);
    if (mode != 2 && mode != 9) fence_proxy_async_smem();  // cp.async (generic proxy) writes
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
  out[4 * blockIdx.x] = clock64() - t0;
  out[4 * blockIdx.x + 1] = sink;
}

// ---------------------------------------------------------------- fill_pair
// The gathered operand shared by the two CTAs of a cluster (the megakernel would run a pair
// of tasks on adjacent tiles that read the same gathered rows): each CTA gathers its half of
// every slice (rows 32 c .. 32 c + 31, c its rank) by cp.async (mode 5's way, 4 warps),
// then warp 4's lane 0 copies that half into the peer's stage with one bulk copy a box
// (cp.async.bulk shared::cta -> shared::cluster, completing on the peer's full barrier). So
// each SM issues half the rows a slice. full[i]: one arrival (the copier once its own
// half landed, expecting the peer's bytes); empty[i]: two (this CTA's consumer and the peer's,
// since both CTAs write into stage i of both). The consumer, warp 5's lane 0, frees each at
// once. tma_a: each CTA also loads a 16 KB operand of its own by TMA a slice (a
// weight-gradient pair's A, adjacent M tiles), arriving on full[i] as a second arrival.
// remote: how the consumer frees the peer's stage. 0 an arrival .release.cluster; 1 none
// (timing only, the rows may race: empty[i] counts this CTA's consumer alone, so the peer
// may write a stage this CTA still reads); 2 .relaxed.cluster; 3 the default, .release.cta
// (CUTLASS's ClusterBarrier::arrive). Session 14: 0 stalls the consumer a round trip each
// slice; 2 and 3 cost what 1 does.
MOKGEN_DEV uint32_t peer_addr(const void* p, uint32_t rank) {
  uint32_t out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(smem_u32(p)), "r"(rank));
  return out;
}
// The peer's empty arrival at the semantics `remote` names (3: cluster.cuh's
// mbar_arrive_cluster, the default .release.cta).
MOKGEN_DEV void mbar_arrive_remote(uint64_t* bar, uint32_t peer, int sem) {
  if (sem == 3) return mbar_arrive_cluster(bar, peer);
  const uint32_t remote = peer_addr(bar, peer);
  if (sem == 2)  // no ordering: the consumer's reads of the stage are done by then
    asm volatile("mbarrier.arrive.relaxed.cluster.shared::cluster.b64 _, [%0];" ::"r"(remote)
                 : "memory");
  else
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(remote)
                 : "memory");
}
MOKGEN_DEV void bulk_to_peer(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, "
      "[%3];" ::"r"(dst), "r"(smem_u32(src)), "r"(bytes), "r"(bar)
      : "memory");
}
// cluster.cuh's cluster_sync without .aligned, as every fill_pair measurement ran it (in
// call J the copier's and consumer's warps reached it with their idle lanes apart)
MOKGEN_DEV void cluster_sync_any() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}

template <int BOXES>
MOKGEN_DEV void pair_half(uint8_t* st, const __nv_bfloat16* src, const int* table, int n_table,
                          int ld, long long sg, int w, uint32_t rank) {
  copy_pre<4, BOXES, kRows / 2>(st, src, table, n_table, ld, 1, sg, w, 5, (int)rank * kRows / 2);
}

extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(32 * 6, 1)
fill_pair(const __nv_bfloat16* src, const int* table, int n_table, int ld,
          const __grid_constant__ CUtensorMap map, int n_rows, int tma_a, int stages,
          int boxes, int slices, int hold, int wk, int remote, unsigned long long* out,
          uint8_t* last) {
  uint8_t* smem = dyn_smem() + ((1024 - (smem_u32(dyn_smem()) & 1023)) & 1023);
  const int rows_bytes = kRows * 128 * boxes, half = kRows / 2 * 128;  // a box's half rows
  const int a_bytes = tma_a ? 2 * kBox : 0;  // each CTA's own TMA operand (its tile's A)
  const int stage_bytes = rows_bytes + a_bytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + stages * stage_bytes);
  uint64_t* empty = full + kMaxStages;
  uint64_t* landed = empty + kMaxStages;  // this CTA's half of stage i landed (128 lanes)
  const uint32_t rank = cluster_ctarank(), peer = rank ^ 1;
  const int warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) {
    for (int i = 0; i < stages; ++i) {
      mbar_init(&full[i], 1 + (tma_a != 0));
      mbar_init(&empty[i], remote == 1 ? 1 : 2);
      mbar_init(&landed[i], 128);
    }
    fence_mbarrier_init();
  }
  cluster_sync_any();  // the peer's barriers exist before anything reaches them
  const long long pair = blockIdx.x / 2;
  if (warp < 4) {
    for (int s = 0; s < slices; ++s) {
      const int i = s % stages;
      bench_wait(&empty[i], ((s / stages) & 1) ^ 1, wk, 1);  // free here and at the peer
      uint8_t* st = smem + i * stage_bytes;
      const long long sg = pair * kCtaSkew + s;
      if (tma_a && threadIdx.x == 0) {  // this CTA's A: rows of its own
        const int row0 = (int)((blockIdx.x * (long long)kCtaSkew + s) * kRows % n_rows);
        mbar_arrive_expect_tx(&full[i], a_bytes);
        for (int j = 0; j < 2; ++j)
          tma_load_2d(st + rows_bytes + j * kBox, &map, &full[i], 64 * j, row0);
      }
      if (boxes == 4)
        pair_half<4>(st, src, table, n_table, ld, sg, warp, rank);
      else
        pair_half<2>(st, src, table, n_table, ld, sg, warp, rank);
      cp_async_mbar_arrive(&landed[i]);
    }
  } else if (warp == 4) {  // the copier (lane 0): each half to the peer once it landed
    // whole warps run these loops: lanes idling at the cluster barrier beside a working lane
    // of their own warp would share its issue slots
    const bool lead = (threadIdx.x & 31) == 0;
    for (int s = 0; s < slices; ++s) {
      const int i = s % stages;
      uint8_t* st = smem + i * stage_bytes;
      bench_wait(&landed[i], (s / stages) & 1, wk, 3);
      if (lead) {
        fence_proxy_async_smem();  // cp.async's writes, read by the bulk copy (async proxy)
        mbar_arrive_expect_tx(&full[i], boxes * half);  // the peer's half, coming
        const uint32_t pfull = peer_addr(&full[i], peer);
        for (int j = 0; j < boxes; ++j) {
          const uint8_t* part = st + j * kBox + rank * half;
          bulk_to_peer(peer_addr(part, peer), part, half, pfull);
        }
      }
      __syncwarp();
    }
  } else {  // warp 5: the consumer (lane 0)
    const bool lead = (threadIdx.x & 31) == 0;
    const uint64_t t0 = clock64();
    unsigned long long sink = 0;
    for (int s = 0; s < slices; ++s) {
      const int i = s % stages;
      bench_wait(&full[i], (s / stages) & 1, wk, 2);
      fence_proxy_async_smem();
      sink += *reinterpret_cast<const volatile uint32_t*>(smem + i * stage_bytes + (s % 64) * 128);
      for (const uint64_t h0 = clock64(); clock64() - h0 < (uint64_t)hold;) {
      }
      if (lead && blockIdx.x == 0 && s == slices - 1)
        for (int b = 0; b < rows_bytes; b += 16)
          *reinterpret_cast<uint4*>(last + b) =
              *reinterpret_cast<const uint4*>(smem + i * stage_bytes + b);
      __syncwarp();
      if (lead) {
        mbar_arrive(&empty[i]);
        if (remote != 1) mbar_arrive_remote(&empty[i], peer, remote);
      }
    }
    if (lead) {
      out[4 * blockIdx.x] = clock64() - t0;
      out[4 * blockIdx.x + 1] = sink;
    }
  }
  cluster_sync_any();  // neither CTA leaves while the other may still write into its stages
}
