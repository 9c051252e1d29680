"""The GEMM engine's operand layouts side by side: C[M,N] = A B^T with both K-major (the
forward), B MN-major (the backward's dgrad) and both MN-major (weight gradients), same sizes.
Usage: python benchmarks/gemm_transposed.py"""
import os
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from mokgen.harness.bench import time_ms  # noqa: E402
from mokgen.compiler.ir import GemmConfig  # noqa: E402
from mokgen.compiler.lower import smem_bytes  # noqa: E402
from mokgen.runtime import cuda as mc  # noqa: E402

cubin = os.path.join(tempfile.mkdtemp(), "g.cubin")
subprocess.run(["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-std=c++17", "-cubin",
                "-I", os.path.join(ROOT, "mokgen/runtime/include"),
                os.path.join(ROOT, "mokgen/runtime/include/mokgen/tests/gemm_test.cu"), "-o",
                cubin], check=True)
SMEM = smem_bytes(GemmConfig(128, 256, 4))  # gemm_test.cu's CoopCfg
f = mc.load_module(cubin).function("gemm_plain_t", SMEM)
sms = torch.cuda.get_device_properties(0).multi_processor_count
counters = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
at = [0]


def run(M, N, K, trans):
    A = torch.randn(M, K, device="cuda").bfloat16()
    B = torch.randn(N, K, device="cuda").bfloat16()
    C = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    if trans == 2:
        At = A.T.contiguous()
        ta = mc.make_tensor_map_2d(At, K, M, M * 2, 64, 64)
    else:
        ta = mc.make_tensor_map_2d(A, M, K, K * 2, 128, 64)
    if trans:
        Bt = B.T.contiguous()
        tb = mc.make_tensor_map_2d(Bt, K, N, N * 2, 64, 64)
    else:
        tb = mc.make_tensor_map_2d(B, N, K, K * 2, 256, 64)

    def go():
        if at[0] == counters.numel():
            counters.zero_()
            at[0] = 0
        at[0] += 1
        mc.launch(f, sms, 384, SMEM, None, [ta, tb, C, M, N, K, N,
                                              mc.Ptr(counters.data_ptr() + 4 * (at[0] - 1)), trans])
    go()
    torch.cuda.synchronize()
    err = ((C.float() - A.float() @ B.float().T).norm() / (A.float() @ B.float().T).norm()).item()
    ms = time_ms(go, 30)
    cub = time_ms(lambda: A @ B.T, 30)
    return 2 * M * N * K / ms / 1e9, 2 * M * N * K / cub / 1e9, err


for M, N, K in ((16384, 2048, 7168), (16384, 7168, 4096), (7168, 2048, 2816), (4096, 7168, 2816),
                (7168, 2048, 384), (4096, 7168, 384)):
    for trans in (0, 1, 2):
        t, cub, err = run(M, N, K, trans)
        print(f"M={M:6} N={N:5} K={K:5} trans={trans}: {t:6.0f} TFLOP/s (cuBLAS {cub:4.0f}) err {err:.1e}",
              flush=True)
