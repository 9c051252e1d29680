"""The runtime's host side on the CPU, without the CUDA driver: the forward runtime and the
backward pass built by their own constructors on CPU buffers, over a stand-in driver that
records each launch and answers each module global as the plan's kernels would. What runs is
every line of Python between a layer call and its launches (buffers, tables, tensor-map
requests, argument packing, the fp8 weight cache); what the kernels would compute does not
(their outputs stay as allocated). The GPU suite runs the same paths with the kernels."""
from __future__ import annotations

import struct
from types import SimpleNamespace

import torch

from mokgen.runtime import abi, cuda
from mokgen.runtime.workspace import backward_tiles

SMS = 132  # the stand-in GPU's SMs: every launch's CTAs


class Module(SimpleNamespace):
    """A loaded cubin: its role (prologue, fwd, bwd) and the globals the host reads."""

    def function(self, name, smem=None):
        return name


def module_globals(spec, role: str) -> dict:
    """What the host reads of a plan's cubin of `role`, as its kernels define it."""
    i32 = lambda *v: struct.pack(f"<{len(v)}i", *v)  # noqa: E731
    if role == "prologue":
        return {"mokgen_sched_chunk": i32(abi.SCHED_CHUNK), "mokgen_sched_count_smem": i32(0)}
    if role == "fwd":
        return {"mokgen_fwd_smem_bytes": i32(200_000), "mokgen_fwd_ctas": i32(SMS),
                "mokgen_fwd_cluster": i32(1)}
    return {"mokgen_bwd_smem_bytes": i32(200_000), "mokgen_bwd_tiles": i32(*backward_tiles(spec)),
            "mokgen_bwd_x_rows": i32(spec.x_rows), "mokgen_bwd_ctas": i32(SMS),
            "mokgen_bwd_wgrad_tma": i32(1)}


class DryDriver:
    """Installs the stand-ins (monkeypatch) for one layer spec; `launches` lists the kernel
    names in launch order, `maps` the tensor maps asked for (tensor, rows, cols)."""

    def __init__(self, monkeypatch, spec):
        self.spec, self.launches, self.maps = spec, [], []
        stream = SimpleNamespace(cuda_stream=0)
        patch = monkeypatch.setattr
        patch(cuda, "load_module", lambda cubin: Module(role=cubin.decode(), globals=module_globals(
            spec, cubin.decode())))
        patch(cuda, "read_global", lambda m, name: m.globals[name])
        patch(cuda, "set_global", lambda m, name, value: None)
        patch(cuda, "HostMapped", lambda n: SimpleNamespace(
            device=0, words=lambda k: [0] * k, clear=lambda: None))
        patch(cuda, "launch", lambda f, grid, block, smem, st, args, **kw: self.launches.append(f))
        patch(cuda, "make_tensor_map_2d", lambda t, rows, cols, *a, **kw: self._map(t, rows, cols))
        patch(cuda, "make_tensor_map_3d", lambda t, *a: self._map(t, *t.shape[-2:]))
        patch(cuda, "tensor_map_bytes", lambda m: bytes(abi.TENSOR_MAP_BYTES))
        patch(torch.cuda, "get_device_properties", lambda dev: SimpleNamespace(
            multi_processor_count=SMS))
        patch(torch.cuda, "current_stream", lambda dev=None: stream)

    def _map(self, t, rows, cols):
        assert t.numel() >= rows * cols, f"a map of {rows} x {cols} over {tuple(t.shape)}"
        self.maps.append((t, rows, cols))
        return object()

    def runtimes(self, virtual: bool = True):
        """(ForwardRuntime, BackwardPass) of the spec on CPU buffers (keep_h specs: with the
        resident twin's kernel)."""
        from mokgen.runtime.moe import ForwardRuntime
        from mokgen.runtime.moe_bwd import BackwardPass

        rt = ForwardRuntime(self.spec, b"prologue", b"fwd", virtual, device=torch.device("cpu"))
        return rt, BackwardPass(rt, b"bwd", b"bwd" if self.spec.keep_h else None)
