// mokgen/route.cuh -- softmax top-k routing on the GPU and the route all-gather.
//
// One warp per token. Scores are fp32 softmax of the logits; the top-k is taken on the logits
// (softmax is monotonic) with ties to the lower expert id, matching mokgen.reference.route.
// Weights are renormalized over the selected experts. Each rank writes its routes straight
// into every peer's gathered table (unicast stores; NVLink multicast is never used).
// NaN / +Inf logits propagate, they never drop a route: NaN ranks as +Inf in the selection
// (torch's descending sort puts NaN first too), every token still gets k valid experts, and
// such a token's weights (hence its output row) are NaN. Other tokens are unaffected.
#pragma once
#include "mokgen/ptx.cuh"

namespace mokgen {

// Every rank's gathered tables, passed by value (no device-side pointer array to upload).
template <int R>
struct RouteTables {
  int* routes[R];     // rank p's [R, N*K] table of global expert ids
  float* weights[R];  // rank p's [R, N*K] table of router weights
};

template <int E, int K>
__device__ void route_tokens(const float* __restrict__ logits, int n_tokens, int rank,
                             int* const* peer_routes, float* const* peer_weights, int ranks) {
  // Lane l holds experts l, l + 32, ...; when 32 does not divide E the last column's lanes
  // past E hold -inf and are never candidates (the e < E test below), so any E works.
  constexpr int PER_LANE = (E + 31) / 32;
  static_assert(PER_LANE <= 32, "at most 1024 experts: the picked-expert mask is one 32-bit "
                                "word per lane (mokgen.compiler.limits refuses more at plan time)");
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * blockDim.x / 32;
  for (int t = (blockIdx.x * blockDim.x + threadIdx.x) / 32; t < n_tokens; t += warps) {
    float z[PER_LANE];
    float zmax = -INFINITY;
    bool bad = false;  // a NaN logit in this lane
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      int e = lane + 32 * i;
      z[i] = e < E ? logits[(size_t)t * E + e] : -INFINITY;
      bad |= z[i] != z[i];
      if (z[i] != z[i]) z[i] = INFINITY;  // selection key; the weights turn NaN below
      zmax = fmaxf(zmax, z[i]);
    }
    bad = __any_sync(0xffffffff, bad);
    for (int o = 16; o; o >>= 1) zmax = fmaxf(zmax, __shfl_xor_sync(0xffffffff, zmax, o));
    int picked[K];
    float ex[K];
    float total = 0.f;
    unsigned taken = 0;  // bit i: expert lane + 32 i already picked (never picked twice)
#pragma unroll
    for (int k = 0; k < K; ++k) {
      // warp argmax over (value desc, id asc), skipping experts already taken
      float best = -INFINITY;
      int best_e = 0x7fffffff;
#pragma unroll
      for (int i = 0; i < PER_LANE; ++i) {
        int e = lane + 32 * i;
        if (e < E && !(taken >> i & 1u) && (z[i] > best || (z[i] == best && e < best_e))) {
          best = z[i];
          best_e = e;
        }
      }
      for (int o = 16; o; o >>= 1) {
        float ob = __shfl_xor_sync(0xffffffff, best, o);
        int oe = __shfl_xor_sync(0xffffffff, best_e, o);
        if (ob > best || (ob == best && oe < best_e)) { best = ob; best_e = oe; }
      }
      picked[k] = best_e;
      ex[k] = bad ? NAN : expf(best - zmax);  // +Inf: inf - inf = NaN, as in torch.softmax
      total += ex[k];
#pragma unroll
      for (int i = 0; i < PER_LANE; ++i)  // constant indices keep z[] in registers
        if (lane + 32 * i == best_e) taken |= 1u << i;
    }
    // lane p writes this token's K routes into rank p's table ([R, N*K], row = source)
    if (lane < ranks) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        size_t at = ((size_t)rank * n_tokens + t) * K + k;
        peer_routes[lane][at] = picked[k];
        peer_weights[lane][at] = ex[k] / total;
      }
    }
    for (int p = 32 + lane; p < ranks; p += 32) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        size_t at = ((size_t)rank * n_tokens + t) * K + k;
        peer_routes[p][at] = picked[k];
        peer_weights[p][at] = ex[k] / total;
      }
    }
  }
}

// The router logits' gradient from the router weights' (mokgen.reference.router_backward, on
// the renormalized softmax top-k): s = softmax(z) in fp32, p_k = s[e_k], T = sum p_k,
// w_k = p_k / T, ds_k = (dw_k - sum_j dw_j w_j) / T (zero off the picked experts), and
// dz = s (ds - c) with c = sum_k ds_k p_k (the reference sums ds s over every expert: the
// same terms and zeros). One warp per token as route_tokens, fixed reduction orders: the
// result is bitwise repeatable. One launch where the reference takes ~15 small ones.
template <int E, int K>
__device__ void router_backward_tokens(const float* __restrict__ logits,
                                       const int* __restrict__ experts,
                                       const float* __restrict__ dweights,
                                       float* __restrict__ dlogits, int n_tokens) {
  constexpr int PER_LANE = (E + 31) / 32;
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * blockDim.x / 32;
  for (int t = (blockIdx.x * blockDim.x + threadIdx.x) / 32; t < n_tokens; t += warps) {
    float s[PER_LANE];
    float zmax = -INFINITY;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      const int e = lane + 32 * i;
      s[i] = e < E ? logits[(size_t)t * E + e] : -INFINITY;
      zmax = fmaxf(zmax, s[i]);  // a NaN logit: fmaxf skips it, expf(NaN - m) keeps it
    }
    for (int o = 16; o; o >>= 1) zmax = fmaxf(zmax, __shfl_xor_sync(0xffffffff, zmax, o));
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      s[i] = lane + 32 * i < E ? expf(s[i] - zmax) : 0.f;
      sum += s[i];
    }
    for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) s[i] /= sum;
    int ek[K];
    float p[K], dw[K];
    float total = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      ek[k] = experts[(size_t)t * K + k];
      dw[k] = dweights[(size_t)t * K + k];
      // s[e_k] from the lane holding it. Tested on the expert id, not on its column i ==
      // e_k / 32: that form ptxas turned into s[] indexed in local memory (E 512, k 10)
      float mine = 0.f;
#pragma unroll
      for (int i = 0; i < PER_LANE; ++i)
        if (lane + 32 * i == ek[k]) mine = s[i];
      p[k] = __shfl_sync(0xffffffff, mine, ek[k] % 32);
      total += p[k];
    }
    float a = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) a += dw[k] * (p[k] / total);
    float ds[K], c = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      ds[k] = (dw[k] - a) / total;
      c += ds[k] * p[k];
    }
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      const int e = lane + 32 * i;
      if (e >= E) continue;
      float d = 0.f;
#pragma unroll
      for (int k = 0; k < K; ++k)
        if (ek[k] == e) d = ds[k];
      dlogits[(size_t)t * E + e] = s[i] * (d - c);
    }
  }
}

// Routes chosen by the caller (a model's own router): gather them into every rank's tables as
// route_tokens does. An expert id outside [0, E) would drop a route, so it is sent to expert 0
// with a NaN weight instead: that token's output turns NaN, nothing else changes.
template <int E, int K>
__device__ void gather_routes(const int* __restrict__ experts, const float* __restrict__ weights,
                              int n_tokens, int rank, int* const* peer_routes,
                              float* const* peer_weights, int ranks) {
  const size_t n = (size_t)n_tokens * K;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    int e = experts[i];
    float w = weights[i];
    if (e < 0 || e >= E) {
      e = 0;
      w = NAN;
    }
    const size_t at = (size_t)rank * n + i;
    for (int p = 0; p < ranks; ++p) {
      peer_routes[p][at] = e;
      peer_weights[p][at] = w;
    }
  }
}

}  // namespace mokgen
