"""Thread-block clusters through the runtime (marked gpu): `mokgen.runtime.cuda.launch` with
cluster=2 (cuLaunchKernelEx) runs a kernel with no compile-time cluster shape in pairs of
CTAs that read each other's shared memory, also as a cooperative (persistent) launch of as
many clusters as `max_active_clusters` says fit; that count is what a persistent megakernel
in pairs would get (the clusters must fit inside the GPCs: maybe fewer than all the SMs).
    device: python tests/test_gpu_cluster.py   (prints the counts for the megakernel's shape)"""
import os
import subprocess
import sys

import pytest
import torch

from mokgen.compiler.build import INCLUDE_DIR

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

pytestmark = pytest.mark.gpu

# thread 0 of each CTA puts a value in its shared memory, the cluster syncs (cluster.cuh),
# then reads its peer's through the cluster window (mapa + ld.shared::cluster) and records
# it, with its rank and multiprocessor; the cluster syncs again before anyone leaves
SRC = r"""
#include <cstdint>
#include "mokgen/cluster.cuh"
extern "C" __global__ void __launch_bounds__(384, 1) cluster_probe(int* out) {
  extern __shared__ __align__(16) uint32_t smem[];
  const uint32_t rank = mokgen::cluster_ctarank();
  uint32_t smid, remote;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  if (threadIdx.x == 0) smem[0] = blockIdx.x * 1000u + rank;
  mokgen::cluster_sync();
  if (threadIdx.x == 0) {
    uint32_t v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
                 : "=r"(remote) : "r"(mokgen::smem_u32(smem)), "r"(rank ^ 1u));
    asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(remote) : "memory");
    out[3 * blockIdx.x] = (int)rank;
    out[3 * blockIdx.x + 1] = (int)v;
    out[3 * blockIdx.x + 2] = (int)smid;
  }
  mokgen::cluster_sync();
}
"""
MEGA_SMEM = 226 * 1024  # the megakernels' dynamic shared memory a CTA (one CTA an SM)


def build_probe(d: str):
    """The probe compiled into directory d and loaded: its CUfunction."""
    from mokgen.runtime import cuda as mc

    src, cubin = os.path.join(d, "probe.cu"), os.path.join(d, "probe.cubin")
    with open(src, "w") as fh:
        fh.write(SRC)
    subprocess.run(["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-O3",
                    "-I", str(INCLUDE_DIR), src, "-o", cubin], check=True)
    mc.ensure_context()
    return mc.load_module(cubin).function("cluster_probe", MEGA_SMEM)


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    return build_probe(str(tmp_path_factory.mktemp("cluster")))


def _run(f, grid, cooperative):
    from mokgen.runtime import cuda as mc

    out = torch.full((3 * grid,), -1, dtype=torch.int32, device="cuda")  # poisoned
    mc.launch(f, grid, 384, MEGA_SMEM, torch.cuda.current_stream(), [out],
              cooperative=cooperative, cluster=2)
    torch.cuda.synchronize()
    return out.view(grid, 3).cpu()


def _check_pairs(rec):
    b = torch.arange(rec.shape[0], dtype=torch.int32)
    assert torch.equal(rec[:, 0], b % 2), "cluster ranks"
    assert torch.equal(rec[:, 1], (b ^ 1) * 1000 + (b % 2 ^ 1)), "the peer's shared memory"


def test_cluster_launch_reads_the_peers_shared_memory(probe):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    _check_pairs(_run(probe, 2 * sms, cooperative=False))  # two waves: not co-resident


def test_cooperative_cluster_launch_of_every_cluster_that_fits(probe):
    from mokgen.runtime import cuda as mc

    n2 = mc.max_active_clusters(probe, 384, MEGA_SMEM, 2)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert 1 <= n2 and 2 * n2 <= sms  # an H200: 66 (all 132 SMs); clusters of 4: 30 (120)
    rec = _run(probe, 2 * n2, cooperative=True)
    _check_pairs(rec)
    assert len(set(rec[:, 2].tolist())) == 2 * n2, "one CTA a multiprocessor"
    with pytest.raises(RuntimeError):  # one cluster more than fit: refused, not hung
        _run(probe, 2 * n2 + 2, cooperative=True)


if __name__ == "__main__":  # the counts, printed
    import tempfile

    from mokgen.runtime import cuda as mc

    f = build_probe(tempfile.mkdtemp(prefix="cluster"))
    for c in (2, 4, 8):
        n = mc.max_active_clusters(f, 384, MEGA_SMEM, c)
        print(f"cluster {c}: {n} clusters at once, {n * c} CTAs "
              f"({MEGA_SMEM // 1024} KB shared memory, 384 threads a CTA)")
