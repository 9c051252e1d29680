// mokgen/trace.cuh -- per-task timestamps of the persistent GEMM engine (profiling only).
//
// A kernel built with the `trace` profile (GemmCfg::PROF & kProfTrace) records, for each task
// a CTA runs, when its producer asked for it and got it (the dependency waits are inside
// next_task), and when the consumers popped it, finished its mainloop, its epilogue and its
// signal: where a persistent kernel's time goes, task by task (ncu's stall samples cannot
// tell a wait for a dependency from a wait for data, nor one phase from another). Other
// builds compile none of it; the pointer costs 8 bytes.
// The host points mokgen_trace at a buffer of gridDim.x * kTraceRecs records (runtime/abi.py
// has the layout) and sums them.
#pragma once
#include <cstdint>
#include "mokgen/sync.cuh"

extern "C" {
__device__ unsigned long long* mokgen_trace;  // null: record nothing
}

namespace mokgen {

constexpr int kTraceRecs = 4096, kTraceWords = 11;  // runtime/abi.py TRACE_RECS, TRACE_WORDS
// a record's words (abi.py TRACE_FIELDS): clocks are the SM's clock64 (durations),
// kTrGlobalNs the globaltimer when the consumers popped the task (aligns the CTAs); then
// clock sums over the task's ring slices (bf16 tiles of the cooperative schedule; 0 where
// not recorded): the producer's waits for empty stages (kTrFillWait) and its issue of each
// slice from that wait to its last load or arrival (kTrFillIssue), as its one thread (TMA
// rings) or thread 0 of the gathering warpgroup (its warp's cp.async share) sees them, and
// the consumers' thread 128's waits for full stages (kTrFullWait). They tell a ring that
// fills too slowly (the consumers wait on full, the producer does not wait on empty) from
// one the tensor core drains too slowly.
enum TraceWord : int {
  kTrOp, kTrAsk, kTrGot, kTrPop, kTrMain, kTrEpi, kTrDone, kTrGlobalNs,
  kTrFillWait, kTrFillIssue, kTrFullWait
};

MOKGEN_DEV uint64_t trace_clock() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(t));
  return t;
}

// The record of this CTA's i-th task (nullptr past the buffer or when not tracing).
MOKGEN_DEV unsigned long long* trace_rec(int i) {
  unsigned long long* base = mokgen_trace;
  if (base == nullptr || i >= kTraceRecs) return nullptr;
  return base + ((size_t)blockIdx.x * kTraceRecs + i) * kTraceWords;
}

// The three sums between the waits and the record: a CTA's shared words, each written by
// one thread (the producer's recording thread the fill words, 128 the full one), which
// moves it into the task's record and clears it (trace builds only: other kernels never
// name them).
enum TraceSum : int { kSumFillWait, kSumFillIssue, kSumFullWait, kTraceSums };
MOKGEN_DEV unsigned long long* trace_sums() {
  __shared__ unsigned long long sums[kTraceSums];
  return sums;
}

}  // namespace mokgen
