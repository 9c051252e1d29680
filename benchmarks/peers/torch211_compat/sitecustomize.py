"""torchtitan 0.3 on PyTorch 2.11, the GPU machine's (run_gpu.sh puts this folder on the path).

Two PyTorch 2.12 additions torchtitan 0.3 uses, each stood in for only where missing:
- `DataParallelMeshDims` (torch.distributed.fsdp), imported by torchtitan's FSDP modules. On
  one rank torchtitan never builds one (its spmd_types backend passes none to fully_shard for
  a size-1 mesh): the stand-in lets torchtitan import and refuses to be built, so a run that
  would need it (data parallelism over several ranks) stops with a clear error.
- `create_block_mask(..., separate_full_blocks=)`, which torchtitan's flex-attention masks
  pass (True outside its batch-invariant mode). PyTorch 2.11 always keeps full blocks apart,
  which is what True asks: the wrapper drops True and refuses False."""
import functools
import inspect

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


try:
    import torch.nn.attention.flex_attention as _flex
except ImportError:
    _flex = None

if _flex is not None and "separate_full_blocks" not in inspect.signature(
        _flex.create_block_mask).parameters:
    _create_block_mask = _flex.create_block_mask

    @functools.wraps(_create_block_mask)
    def create_block_mask(*args, separate_full_blocks: bool = True, **kwargs):
        if not separate_full_blocks:
            raise RuntimeError("create_block_mask(separate_full_blocks=False) needs PyTorch "
                               ">= 2.12 (stand-in: benchmarks/peers/torch211_compat)")
        return _create_block_mask(*args, **kwargs)

    _flex.create_block_mask = create_block_mask
