"""Host side of the mokgen CUDA runtime: load cubins, encode TMA tensor maps, launch kernels.

Only ``cuda.bindings.driver`` is used for the driver API; torch supplies the context (its
primary context), the current stream and device pointers. Every CUresult is checked and a
failure raises RuntimeError naming the call. ``launch`` never synchronizes the host.
"""
from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass
from typing import Any, Sequence

from cuda.bindings import driver as cu

__all__ = [
    "check", "ensure_context", "Module", "load_module", "launch", "make_tensor_map_2d",
    "Ptr", "I32", "U32", "I64", "F32", "Raw", "read_diag", "HostMapped", "set_global",
    "read_global", "launch_config", "max_active_clusters", "capture_id",
]


def _err_name(res) -> str:
    try:
        e, name = cu.cuGetErrorName(res)
        if e == cu.CUresult.CUDA_SUCCESS and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - the name is only cosmetic
        pass
    return str(res)


def check(call: str, out):
    """Unpack a cuda.bindings return value ``(CUresult, *values)``; raise on failure."""
    res, vals = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
    if res != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{call} failed: {_err_name(res)} ({int(res)})")
    if not vals:
        return None
    return vals[0] if len(vals) == 1 else vals


def ensure_context(device: int | None = None) -> None:
    """Make torch's primary context current on this thread (torch creates it lazily)."""
    import torch

    dev = torch.cuda.current_device() if device is None else device
    torch.empty(1, device=f"cuda:{dev}")  # forces torch to create/bind the primary context
    check("cuInit", cu.cuInit(0))
    ctx = check("cuCtxGetCurrent", cu.cuCtxGetCurrent())
    if ctx is None or int(ctx) == 0:
        cudev = check("cuDeviceGet", cu.cuDeviceGet(dev))
        ctx = check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(cudev))
        check("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx))


@dataclass
class Module:
    handle: Any
    image: bytes

    def function(self, name: str, max_dynamic_smem: int = 0):
        f = check(f"cuModuleGetFunction({name})",
                  cu.cuModuleGetFunction(self.handle, name.encode()))
        if max_dynamic_smem:
            attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check(f"cuFuncSetAttribute({name}, MAX_DYNAMIC_SHARED_SIZE_BYTES)",
                  cu.cuFuncSetAttribute(f, attr, int(max_dynamic_smem)))
        return f

    def global_ptr(self, name: str) -> tuple[int, int]:
        """(device address, size) of a __device__ symbol declared extern "C"."""
        ptr, size = check(f"cuModuleGetGlobal({name})",
                          cu.cuModuleGetGlobal(self.handle, name.encode()))
        return int(ptr), int(size)


def load_module(cubin: bytes | str) -> Module:
    """Load a cubin (bytes or a file path) into the current (torch) context."""
    if isinstance(cubin, str):
        with open(cubin, "rb") as fh:
            cubin = fh.read()
    ensure_context()
    handle = check("cuModuleLoadData", cu.cuModuleLoadData(cubin))
    return Module(handle, cubin)


class HostMapped:
    """Pinned host memory the device can write (CU_MEMHOSTALLOC_DEVICEMAP): the host reads
    what a kernel wrote there without a device round trip, also after the kernel gave up."""

    def __init__(self, nbytes: int):
        ensure_context()
        self.nbytes = nbytes
        self.host = int(check("cuMemHostAlloc", cu.cuMemHostAlloc(
            nbytes, cu.CU_MEMHOSTALLOC_DEVICEMAP)))
        self.device = int(check("cuMemHostGetDevicePointer",
                                cu.cuMemHostGetDevicePointer(self.host, 0)))
        ctypes.memset(self.host, 0, nbytes)

    def words(self, n: int) -> list[int]:
        return list((ctypes.c_uint32 * n).from_address(self.host))

    def clear(self) -> None:
        ctypes.memset(self.host, 0, self.nbytes)

    def __del__(self):
        try:
            cu.cuMemFreeHost(self.host)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def set_global(module: Module, name: str, data: bytes) -> None:
    """Write a __device__ variable (synchronous; for set-up, not for calls)."""
    ptr, size = module.global_ptr(name)
    if len(data) != size:
        raise ValueError(f"{name} is {size} bytes, got {len(data)}")
    buf = ctypes.create_string_buffer(data, len(data))
    check(f"cuMemcpyHtoD({name})", cu.cuMemcpyHtoD(ptr, ctypes.addressof(buf), len(data)))


def read_global(module: Module, name: str) -> bytes:
    """The bytes of a __device__ variable (synchronous; for set-up and diagnostics)."""
    ptr, size = module.global_ptr(name)
    buf = ctypes.create_string_buffer(size)
    check(f"cuMemcpyDtoH({name})", cu.cuMemcpyDtoH(ctypes.addressof(buf), ptr, size))
    return buf.raw


def read_diag(module: Module) -> list[int]:
    """The 4-word ``mokgen_diag`` a timed-out mbarrier wait leaves before trapping."""
    return list(struct.unpack("<4I", read_global(module, "mokgen_diag")))


# ---------------------------------------------------------------- argument packing
# Kernel parameters are passed as the driver's void** array: element i points at the bytes of
# parameter i; the driver copies them at launch, so the host storage may die right after.
class _Scalar:
    ctype: Any = None

    def __init__(self, v):
        self.v = v

    def cval(self):
        return self.ctype(self.v)


class Ptr(_Scalar):
    ctype = ctypes.c_uint64


class I32(_Scalar):
    ctype = ctypes.c_int32


class U32(_Scalar):
    ctype = ctypes.c_uint32


class I64(_Scalar):
    ctype = ctypes.c_int64


class F32(_Scalar):
    ctype = ctypes.c_float


class Raw:
    """A struct passed by value: its bytes exactly as the kernel's C++ layout has them."""

    def __init__(self, data: bytes):
        self.buf = ctypes.create_string_buffer(bytes(data), len(data))


def _as_param(a) -> tuple[Any, int]:
    """(keep-alive object, host address of the parameter's bytes)."""
    if isinstance(a, Raw):
        return a.buf, ctypes.addressof(a.buf)
    if isinstance(a, cu.CUtensorMap):  # by value: 64 bytes, pointed at in place
        return a, int(a.getPtr())
    if isinstance(a, _Scalar):
        c = a.cval()
    elif isinstance(a, bool):
        c = ctypes.c_int32(int(a))
    elif isinstance(a, int):
        c = ctypes.c_int32(a)
    elif isinstance(a, float):
        c = ctypes.c_float(a)
    elif hasattr(a, "data_ptr"):  # torch.Tensor -> device pointer
        c = ctypes.c_uint64(a.data_ptr())
    elif a is None:
        c = ctypes.c_uint64(0)
    else:
        raise TypeError(f"unsupported kernel argument type {type(a).__name__}")
    return c, ctypes.addressof(c)


def _stream_handle(stream) -> Any:
    if stream is None:
        import torch

        stream = torch.cuda.current_stream()
    if hasattr(stream, "cuda_stream"):
        stream = stream.cuda_stream
    return cu.CUstream(int(stream))


def capture_id(stream=None) -> int | None:
    """The id of the CUDA graph capture under way on `stream` (torch's current stream by
    default), unique over the process's life; None where the stream is not capturing."""
    status, cid = check("cuStreamGetCaptureInfo",
                        cu.cuStreamGetCaptureInfo(_stream_handle(stream)))[:2]
    if status == cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE:
        return None
    return int(cid)


def _dims(d: Sequence[int] | int) -> tuple[int, int, int]:
    return (d, 1, 1) if isinstance(d, int) else tuple(d) + (1,) * (3 - len(d))


def launch_config(grid: Sequence[int] | int, block: Sequence[int] | int, smem: int, stream,
                  cooperative: bool = False, cluster: int = 1) -> cu.CUlaunchConfig:
    """The CUlaunchConfig of an extended launch (cuLaunchKernelEx, cuOccupancyMax*Clusters):
    `cluster` CTAs along x a thread-block cluster (their shared memory reachable from one
    another, PTX shared::cluster), and for persistent kernels whose CTAs wait on each other
    the cooperative attribute (all CTAs co-resident, or the launch fails). stream None: the
    null stream (what an occupancy query is given; launch passes the current one)."""
    g, b = _dims(grid), _dims(block)
    if cluster < 1 or g[0] % cluster:
        raise ValueError(f"grid.x {g[0]} must be a positive multiple of the cluster {cluster}")
    cfg = cu.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = g
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = b
    cfg.sharedMemBytes = int(smem)
    cfg.hStream = _stream_handle(stream) if stream is not None else cu.CUstream(0)
    attrs = []
    if cluster > 1:
        a = cu.CUlaunchAttribute()
        a.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        a.value.clusterDim.x, a.value.clusterDim.y, a.value.clusterDim.z = cluster, 1, 1
        attrs.append(a)
    if cooperative:
        a = cu.CUlaunchAttribute()
        a.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
        a.value.cooperative = 1
        attrs.append(a)
    cfg.attrs = attrs
    cfg.numAttrs = len(attrs)
    return cfg


def max_active_clusters(func, block: Sequence[int] | int, smem: int, cluster: int) -> int:
    """How many clusters of `cluster` CTAs of `func` the device runs at once (one CTA a
    multiprocessor where its shared memory says so): a persistent kernel launched in clusters
    gets this many times `cluster` CTAs, which may be fewer multiprocessors than the device
    has (the clusters must fit inside its GPCs)."""
    if cluster < 2:  # a config without the cluster attribute: the query answers 0
        raise ValueError(f"max_active_clusters needs clusters of 2 CTAs or more, got {cluster}")
    cfg = launch_config(cluster, block, smem, None, cluster=cluster)
    return int(check("cuOccupancyMaxActiveClusters", cu.cuOccupancyMaxActiveClusters(func, cfg)))


def launch(func, grid: Sequence[int] | int, block: Sequence[int] | int, smem: int,
           stream, args: Sequence[Any], cooperative: bool = False, cluster: int = 1) -> None:
    """Asynchronous cuLaunchKernel. Args: int -> int32, float -> f32, tensor -> pointer,
    CUtensorMap -> by value; wrap with Ptr/I32/U32/I64/F32 to force a type. `cluster` > 1:
    cuLaunchKernelEx in thread-block clusters of that many CTAs (launch_config)."""
    g, b = _dims(grid), _dims(block)
    cfg = None
    if cluster > 1:
        cfg = launch_config(g, b, smem, stream if stream is not None else _stream_handle(None),
                            cooperative, cluster)
    keep, addrs = [], []
    for a in args:
        k, addr = _as_param(a)
        keep.append(k)
        addrs.append(addr)
    arr = (ctypes.c_void_p * max(1, len(addrs)))(*addrs)

    def once():
        if cfg is not None:
            return cu.cuLaunchKernelEx(cfg, func, ctypes.addressof(arr), 0)
        if cooperative:  # persistent kernels whose CTAs wait on each other: co-resident
            return cu.cuLaunchCooperativeKernel(func, g[0], g[1], g[2], b[0], b[1], b[2],
                                                int(smem), _stream_handle(stream),
                                                ctypes.addressof(arr))
        return cu.cuLaunchKernel(func, g[0], g[1], g[2], b[0], b[1], b[2], int(smem),
                                 _stream_handle(stream), ctypes.addressof(arr), 0)
    res = once()
    if _code(res) == cu.CUresult.CUDA_ERROR_INVALID_CONTEXT:
        # a thread torch has not bound its context to yet (autograd's device thread runs a
        # backward whose first CUDA call is ours): bind it, launch again
        ensure_context()
        res = once()
    check("cuLaunchKernelEx" if cfg is not None else
          "cuLaunchCooperativeKernel" if cooperative else "cuLaunchKernel", res)
    del keep, arr


def _code(out):
    return out[0] if isinstance(out, tuple) else out


# ---------------------------------------------------------------- TMA descriptors
_DTYPES = {
    "bf16": (cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2),
    "f16": (cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2),
    "f32": (cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4),
    "u8": (cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8, 1),  # fp8 e4m3 payloads
}
_SWIZZLE = {
    0: cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE,
    32: cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_32B,
    64: cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B,
    128: cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
}


from mokgen.runtime.abi import TENSOR_MAP_BYTES  # noqa: E402 - sizeof(CUtensorMap)


def tensor_map_bytes(m: cu.CUtensorMap) -> bytes:
    """A map's bytes, to embed it in a struct passed by value (e.g. mokgen::Fp8Maps)."""
    return ctypes.string_at(int(m.getPtr()), TENSOR_MAP_BYTES)


def _encode_tiled(ptr: int, dtype: str, sizes: list, strides: list, box: list,
                  swizzle: int) -> cu.CUtensorMap:
    """cuTensorMapEncodeTiled with TMA's limits checked: sizes and box innermost first,
    strides (bytes) of the outer dimensions; out-of-bounds box elements are zero-filled on
    loads (OOB_FILL_NONE means "fill with zeros") and dropped on stores."""
    dt, esize = _DTYPES[dtype]
    if ptr % 16 or any(st % 16 for st in strides):
        raise ValueError("TMA needs 16-byte aligned base address and row stride")
    if swizzle and box[0] * esize > swizzle:
        raise ValueError(f"box inner extent {box[0] * esize} B exceeds the {swizzle}B swizzle")
    if not all(1 <= b <= 256 for b in box):
        raise ValueError("TMA box dimensions must be in [1, 256]")
    return check("cuTensorMapEncodeTiled", cu.cuTensorMapEncodeTiled(
        dt, len(sizes), ptr,
        [cu.cuuint64_t(v) for v in sizes],
        [cu.cuuint64_t(v) for v in strides],
        [cu.cuuint32_t(v) for v in box],
        [cu.cuuint32_t(1)] * len(sizes),
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        _SWIZZLE[swizzle],
        cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    ))


def make_tensor_map_3d(t, box_rows: int, box_cols: int, dtype: str = "bf16",
                       swizzle: int = 128) -> cu.CUtensorMap:
    """Tiled 3D map over a contiguous [depth, rows, cols] tensor t, box box_cols x box_rows x 1:
    a box stops at its own matrix's last row (a 2D map over [depth * rows, cols] would run
    into the next matrix). TMA coordinates are (col, row, matrix)."""
    depth, rows, cols = t.shape
    esize = _DTYPES[dtype][1]
    if not t.is_contiguous():
        raise ValueError("a 3D TMA map needs a contiguous [depth, rows, cols] tensor")
    return _encode_tiled(t.data_ptr(), dtype, [cols, rows, depth],
                         [cols * esize, rows * cols * esize], [box_cols, box_rows, 1], swizzle)


def make_tensor_map_2d(tensor_or_ptr, rows: int, cols: int, row_stride_bytes: int,
                       box_rows: int, box_cols: int, dtype: str = "bf16",
                       swizzle: int = 128) -> cu.CUtensorMap:
    """Tiled 2D map over a row-major [rows, cols] matrix (cols contiguous).

    TMA coordinates are (col, row). Out-of-bounds box elements are zero-filled (OOB_FILL_NONE
    means "fill with zeros"), which the GEMM relies on for ragged M and K tails.
    """
    ptr = tensor_or_ptr.data_ptr() if hasattr(tensor_or_ptr, "data_ptr") else int(tensor_or_ptr)
    return _encode_tiled(ptr, dtype, [cols, rows], [row_stride_bytes], [box_cols, box_rows],
                         swizzle)
