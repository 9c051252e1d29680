"""The routed experts' fp8 weights at run time: WeightCache, which quantizes each weight
version once in the layouts the kernels read (pad_weight's widths), and the launches of the
quantizer entries every fp8 layer's prologue module carries (compiler/templates/
weight_quant.j2 over mokgen/quant.cuh and mokgen/fp8.cuh), so quantizing a weight at run time
compiles nothing. Bit for bit mokgen.quant's references: `mx` as quant.quantize_weight,
`blockwise` as quant.quantize_weight_blockwise (tests/test_quant.py); a dim that is not whole
blocks runs on a copy zero-padded to whole blocks (zeros leave a partial block's scale as it
is)."""
from __future__ import annotations

import functools
import weakref
from types import SimpleNamespace

import torch

from mokgen import quant
from mokgen.runtime import cuda
from mokgen.runtime.abi import padded
from mokgen.runtime.workspace import LayerSpec, nbytes


def _suffix(w: torch.Tensor) -> str:
    quant.check_weight(w)
    return "bf16" if w.dtype == torch.bfloat16 else "f32"


def mx(module, w: torch.Tensor, transposed: bool = False):
    """MXFP8 of a CUDA weight [..., rows, cols], blocks along cols, or with `transposed` along
    rows, returned as [..., cols, rows]: (e4m3 data, uint8 e8m0 scales). `module`: a loaded
    prologue of an mxfp8 plan."""
    sfx = _suffix(w)
    rows, cols = w.shape[-2], w.shape[-1]
    k = rows if transposed else cols
    if k % quant.BLOCK:
        data, scales = mx(module, quant.pad_to(w, -2 if transposed else -1, quant.BLOCK),
                          transposed)
        return data[..., :k], scales
    w = w.contiguous()
    batch = w.numel() // (rows * cols)
    out_shape = (*w.shape[:-2], cols, rows) if transposed else tuple(w.shape)
    data = torch.empty(out_shape, dtype=torch.uint8, device=w.device)
    scales = torch.empty((*out_shape[:-1], out_shape[-1] // quant.BLOCK), dtype=torch.uint8,
                         device=w.device)
    f = module.function(f"mokgen_mx_{'cols' if transposed else 'rows'}_{sfx}")
    blocks = rows * cols // quant.BLOCK
    cuda.launch(f, (max(1, min(4096, -(-blocks // 256))), batch), 256, 0, None,
                [w, rows, cols, data, scales])
    return data.view(torch.float8_e4m3fn), scales


def blockwise(module, w: torch.Tensor):
    """Blockwise fp8 of a CUDA weight [..., rows, cols], 128 x 128 blocks over the last two
    dims: (e4m3 data, fp32 scales [..., ceil(rows/128), ceil(cols/128)]). `module`: a loaded
    prologue of an fp8 plan."""
    sfx = _suffix(w)
    rows, cols = w.shape[-2], w.shape[-1]
    br, bc = quant.WEIGHT_BLOCK
    if rows % br or cols % bc:
        data, scales = blockwise(module, quant.pad_to(quant.pad_to(w, -2, br), -1, bc))
        return data[..., :rows, :cols], scales
    w = w.contiguous()
    batch = w.numel() // (rows * cols)
    data = torch.empty(w.shape, dtype=torch.uint8, device=w.device)
    scales = torch.empty((*w.shape[:-2], rows // br, cols // bc), dtype=torch.float32,
                         device=w.device)
    f = module.function(f"mokgen_fp8w_{sfx}")
    cuda.launch(f, (max(1, min(4096, rows * cols // (br * bc))), batch), 256, 0, None,
                [w, rows, cols, data, scales])
    return data.view(torch.float8_e4m3fn), scales


def pad_weight(w: torch.Tensor, halves: bool) -> torch.Tensor:
    """w [L, rows, cols] with zeros appended to whole 128 x 128 blocks, each of the two
    row halves (W1's gate and up rows, `halves`) on its own: [L, padded rows, padded cols]. The
    kernels' weight tiles and blockwise scales then start at whole blocks of an expert's part,
    and the zeros leave partial blocks' scales as they are (mokgen.quant). w itself when
    every width is whole blocks (the presets)."""
    L, rows, cols = w.shape
    parts = 2 if halves else 1
    r, c = rows // parts, cols
    if r % 128 == 0 and c % 128 == 0:
        return w
    out = w.new_zeros(L, parts, padded(r), padded(c))
    out[:, :, :r, :c] = w.detach().reshape(L, parts, r, c)
    return out.view(L, parts * padded(r), padded(c))


def quantized_weight_bytes(spec: LayerSpec) -> dict:
    """Bytes of one layer's quantized routed weights on one rank, data and scales, as
    WeightCache holds them (0 for bf16 plans): `forward`, the forward's layout, from a
    training step's forward until an optimizer step; `transposed`, the backward's, made and
    freed by each backward call. Sized by WeightCache itself on the meta device, so the
    prediction cannot drift from what it allocates."""
    if not spec.scale_block:
        return {"forward": 0, "transposed": 0}
    return _quantized_bytes(spec.scale_block, spec.local_experts, spec.hidden,
                            spec.intermediate)


@functools.lru_cache(maxsize=64)
def _quantized_bytes(q: int, L: int, D: int, I: int) -> dict:
    """quantized_weight_bytes' sizing, once per shape (~13 ms of meta quantization; a memory
    report asks three times)."""
    w1 = torch.empty(L, 2 * I, D, dtype=torch.bfloat16, device="meta")
    w2 = torch.empty(L, D, I, dtype=torch.bfloat16, device="meta")
    cache = WeightCache(q, slots=1)
    copies = {"forward": cache.get(w1, w2), "transposed": cache.transposed(w1, w2)}
    return {k: nbytes(getattr(c, f) for f in ("w1", "s1", "w2", "s2"))
            for k, c in copies.items()}


# Every WeightCache holding entries, for the optimizer hook below (weak: a cache goes with its
# layer); the hook's handle once registered.
_LIVE_CACHES: weakref.WeakSet = weakref.WeakSet()
_OPTIMIZER_HOOK = None


def _drop_before_optimizer_step(optimizer, args, kwargs) -> None:
    """A global optimizer pre-step hook: every quantized copy is dropped before any optimizer
    steps. Which weights a step changes cannot be told from its parameters: FSDP2 steps
    shards and then all-gathers them into the same unsharded tensors, keeping their version
    counters, so a layer's weights look unchanged though their values are new. Dropping them
    here is what makes the next forward quantize the new values; it also frees them before
    the step's own peak (AdamW's temporaries). The memory returns to the stream that
    allocated it, behind the kernels that read it."""
    for cache in list(_LIVE_CACHES):
        cache.clear()


class WeightCache:
    """The routed experts' fp8 weights (mokgen.quant), quantized once per weight version: a
    training step's forward and backward share one quantization, and an unchanged weight is
    never quantized twice. A weight is the same when it is the same tensor object (the entry
    holds it, so its id cannot be reused) at the same autograd version counter and no
    optimizer has stepped since it was quantized: in-place updates bump the counter, and any
    torch.optim step drops every entry (FSDP2 keeps its unsharded weights' counters across
    steps); a write that does neither (through `.data`, a checkpoint loaded into FSDP2 shards
    mid-run) is not seen until the next optimizer step.
    Kernel layouts, of the weights zero-padded to whole 128 x 128 blocks per expert (W1 per
    gate / up half: pad_weight): e4m3 data [rows, K] as uint8; blockwise scales fp32
    [rows/128, K/128]; MX scales fp32 2^(e - 127) transposed to [K/32, rows] (NaN for the NaN
    byte), so one TMA box brings a slice's scales of 128 columns. `transposed` gives the
    backward's W1^T [L*D, 2I] and W2^T [L*I, D] (its dgrad and dx GEMMs' K is the forward's N;
    e4m3 wgmma reads K-major operands only), made on first use: blockwise blocks are the
    forward's, transposed; MX blocks run along the other dim, so those are quantized again
    from the weight. The first backward on a weight version frees it once its kernel is
    enqueued (backward_done): held to the optimizer step, every layer's copy would be live at
    the backward's end. A second backward on the same version (gradient accumulation, pipeline
    micro-batches) makes it again and keeps it, so accumulation pays one transpose (MX: a
    quantization) more a step, not one a micro-batch.
    Under CUDA graph capture an entry belongs to its capture (the key holds the capture's id):
    whether to quantize is decided on the host, once, so a capture quantizes inside itself
    and every replay quantizes the weights as they are then; the forward and the backward of
    one capture share it, and neither an eager call nor another capture ever reads it (a
    capture that reused an eager entry would multiply those quantized weights after every
    optimizer step). Entries are dropped just before any optimizer's step (a global optimizer
    pre-step hook, registered with the first entry): they may be stale after it, and gradient
    accumulation and activation recomputation, which call again before any step, keep their
    hits."""

    def __init__(self, scale_block: int, slots: int, module=None):
        self.q, self.slots = scale_block, slots  # slots: one per hosted rank
        self.module = module  # the layer's prologue: its weight quantizers (mx, blockwise)
        self._cache: dict = {}

    def _mx(self, w, transposed=False):
        return (mx(self.module, w, transposed) if w.is_cuda
                else quant.quantize_weight(w, transposed))

    def _blockwise(self, w):
        return (blockwise(self.module, w) if w.is_cuda
                else quant.quantize_weight_blockwise(w))

    @staticmethod
    def _key(w1, w2) -> tuple:
        capture = (cuda.capture_id() if w1.is_cuda and torch.cuda.is_current_stream_capturing()
                   else None)
        return (capture, id(w1), w1._version, id(w2), w2._version)

    def get(self, w1, w2):
        key = self._key(w1, w2)
        if key not in self._cache:
            while len(self._cache) >= self.slots:
                self._cache.pop(next(iter(self._cache)))  # the oldest
            (d1, s1), (d2, s2) = (self.quantize(pad_weight(w, h))
                                  for w, h in ((w1, True), (w2, False)))
            self._cache[key] = SimpleNamespace(w1=d1, s1=s1, w2=d2, s2=s2, of=(w1, w2),
                                               backwards=0)
            if not w1.is_meta:  # quantized_weight_bytes' sizing is no layer's
                self._track()
        return self._cache[key]

    def _track(self) -> None:
        global _OPTIMIZER_HOOK
        _LIVE_CACHES.add(self)
        if _OPTIMIZER_HOOK is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            _OPTIMIZER_HOOK = register_optimizer_step_pre_hook(_drop_before_optimizer_step)

    def clear(self) -> None:
        """Forget every quantized weight (the next call quantizes again)."""
        self._cache.clear()

    def transposed(self, w1, w2):
        e = self.get(w1, w2)
        if not hasattr(e, "t"):
            (d1, s1), (d2, s2) = (self._transpose(pad_weight(w, h), d, sc) for w, h, d, sc in
                                  ((w1, True, e.w1, e.s1), (w2, False, e.w2, e.s2)))
            e.t = SimpleNamespace(w1=d1, s1=s1, w2=d2, s2=s2)
        return e.t

    def backward_done(self, w1, w2) -> None:
        """A backward that read the transposed copy is enqueued (on the stream that made the
        copy: the allocator hands its memory only to work ordered after it). The first on
        this weight version frees the copy; from the second on it is kept (see the class)."""
        e = self._cache.get(self._key(w1, w2))
        if e is not None:
            e.backwards += 1
            if e.backwards == 1:
                vars(e).pop("t", None)

    def _transpose(self, w, data, scales):
        """w [L, rows, cols] (padded) and its forward quantization -> ([L*cols, rows],
        scales)."""
        L, rows, cols = w.shape
        if self.q == 128:
            blocks = (L, rows // 128, cols // 128)
            return (data.view(L, rows, cols).transpose(1, 2).reshape(L * cols, rows),
                    scales.view(blocks).transpose(1, 2).reshape(L * cols // 128, rows // 128))
        d, sc = self._mx(w, transposed=True)
        return self._mx_layout(d.reshape(L * cols, rows), sc.reshape(L * cols, rows // 32))

    def quantize(self, w):
        w2d = w.reshape(-1, w.shape[-1])
        if self.q == 128:
            data, scales = self._blockwise(w2d)
            return data.view(torch.uint8), scales
        return self._mx_layout(*self._mx(w2d))

    @staticmethod
    def _mx_layout(data, scales):
        s = torch.exp2(scales.float() - quant.SCALE_BIAS)
        s = torch.where(scales == quant.SCALE_NAN, torch.full_like(s, float("nan")), s)
        return data.view(torch.uint8), s.t().contiguous()
