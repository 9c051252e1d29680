"""torchtitan 0.3 on PyTorch 2.11, the GPU machine's (run_gpu.sh puts this folder on the path).

torchtitan 0.3's FSDP modules import `DataParallelMeshDims` from torch.distributed.fsdp, a
PyTorch 2.12 name, at import time. On one rank torchtitan never builds one (its spmd_types
backend passes none to fully_shard for a size-1 mesh), so where PyTorch lacks the name a
stand-in is defined that lets torchtitan import and refuses to be built: a run that would
need it (data parallelism over several ranks) stops with a clear error instead."""
try:
    import torch.distributed.fsdp as _fsdp
except ImportError:  # no torch, or one without torch.distributed: nothing to stand in for
    _fsdp = None

if _fsdp is not None and not hasattr(_fsdp, "DataParallelMeshDims"):
    class DataParallelMeshDims:
        """Stand-in for PyTorch 2.12's; never built on one rank."""

        def __init__(self, *args, **kwargs):
            raise RuntimeError("torchtitan asked for DataParallelMeshDims (sharding over "
                               "several ranks): that needs PyTorch >= 2.12; this stand-in "
                               "(benchmarks/peers/torch211_compat) serves one rank only")

    _fsdp.DataParallelMeshDims = DataParallelMeshDims
