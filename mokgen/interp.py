"""Executes a Plan with torch ops exactly as the megakernels do: the kernels' executable spec.

What it mirrors, per rank (virtual ranks run one after another, as on one GPU):
- routes all-gathered, the Algorithm-1 table, expert regions padded to the GEMM tile;
- the ring of `macrobatch` rows in `macrobatch / minibatch` (>= 2) slots, used round-robin in
  processing order (forward: the i-th minibatch processed uses slot i % slots; backward:
  (max(0, minibatches - slots) + i) % slots, where the forward left macrobatch 0); comm runs
  ahead of compute by at most `slots` minibatches (it may only overwrite a slot whose
  minibatch compute has finished); forward walks macrobatches in reverse, so macrobatch 0 is
  resident at the end;
- per tile of `block_m` rows (one expert): gate/up GEMM + SwiGLU, down GEMM times the router
  weight, pushed to the owner's combine row; the owner sums its k rows in route order;
- backward: macrobatch 0 straight from the ring, the rest replayed (x re-pulled, gate/up
  recomputed), dy pulled, the router-weight gradient as <a, dy W2> (SonicMoE), dh and w * a
  written over the ring's h and a, dx pushed back to the source, weight gradients summed in
  ring-position order;
- fp8 plans (`scale_block`): the routed GEMMs multiply quantized operands (tokens quantized
  per row by their owner, the SwiGLU output per row in the epilogue, weights per block: the
  values mokgen.quant.fake_quant gives; the ring holds the values before quantization, as
  the backward sees them: the kernels' backward pulls x in bf16 again for a resident
  minibatch and the forward keeps a in bf16 for it); the backward quantizes its replay,
  dgrad and dx operands each along its K (x and dy per row as pulled, dh per row after its
  bf16 rounding, the weights transposed for dgrad and dx); the weight gradients stay in full
  precision.
Every ring access checks the slot's tag, so a wrong slot, an overwrite of live data or a
missing replay raises instead of producing a plausible number.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mokgen.compiler.plan import Plan
from mokgen.quant import fake_quant
from mokgen.reference import expert_ffn, ffn_backward, route, router_backward
from mokgen.schedule import dispatch_schedule


@dataclass
class RankState:
    """One rank's schedule (padded layout) and ring after the forward."""
    src_rank: torch.Tensor   # [P_pad] source rank of each ring-layout row, -1 on padding
    src_index: torch.Tensor  # [P_pad] source route index, -1 on padding
    expert: torch.Tensor     # [P_pad] local expert of each row
    ring_x: torch.Tensor     # [macrobatch, D] dispatched rows
    ring_h: torch.Tensor     # [macrobatch, 2I] gate/up pre-activations
    ring_a: torch.Tensor     # [macrobatch, I] SwiGLU outputs
    tags: list               # minibatch held by each slot (-1: empty)
    log: list                # ("pull" | "resident" | "compute" | "bwd", minibatch) in order

    @property
    def rows(self) -> int:
        return len(self.src_rank)


class Interpreter:
    def __init__(self, plan: Plan):
        self.plan = plan
        self.k = plan.shape.topk
        self.L = plan.local_experts
        self.b, self.M, self.tile = plan.minibatch, plan.macrobatch, plan.block_m
        self.slots = self.M // self.b
        self.fp8 = {0: None, 128: "fp8", 32: "mxfp8"}[plan.scale_block]

    def _q(self, t, weight=False, halves=None):
        """The values an fp8 kernel multiplies (identity for bf16 plans); `halves`: the dim
        holding gate then up, blocked apart (mokgen.quant.fake_quant)."""
        return t if self.fp8 is None else fake_quant(t, self.fp8, weight, halves).to(t.dtype)

    # ------------------------------------------------------------------ layout
    def _layout(self, routes: torch.Tensor, c: int):
        sched = dispatch_schedule(routes, c, self.L)
        pos = sched.padded_positions(self.tile)
        total = int(sched.padded_offsets(self.tile)[-1])
        src_rank = torch.full((total,), -1, dtype=torch.long)
        src_index = torch.full((total,), -1, dtype=torch.long)
        src_rank[pos], src_index[pos] = sched.table[:, 0], sched.table[:, 1]
        poff = sched.padded_offsets(self.tile)
        expert = torch.repeat_interleave(torch.arange(self.L), poff[1:] - poff[:-1])
        return src_rank, src_index, expert

    def minibatches(self, rows: int) -> int:
        return -(-rows // self.b)

    def forward_order(self, rows: int) -> list:
        """Macrobatches last to first, minibatches ascending inside each."""
        per = self.slots
        n_macro = -(-self.minibatches(rows) // per)
        n = self.minibatches(rows)
        return [m for j in reversed(range(n_macro)) for m in range(j * per, min(n, (j + 1) * per))]

    def _ring_rows(self, m: int, slot: int, rows: int):
        """(ring rows, layout rows) of minibatch m held in `slot`, clipped to the layout."""
        lo, hi = m * self.b, min((m + 1) * self.b, rows)
        return slice(slot * self.b, slot * self.b + hi - lo), slice(lo, hi)

    def _tiles(self, m: int, rows: int):
        lo, hi = m * self.b, min((m + 1) * self.b, rows)
        for t in range(lo, hi, self.tile):
            yield t, min(t + self.tile, hi)

    # ------------------------------------------------------------------ pipeline
    def _run_pipeline(self, st: RankState, order: list, first_slot: int, pull, compute,
                      kind: str):
        """Comm breadth-first (at most `slots` minibatches ahead), compute depth-first. The
        i-th minibatch of `order` uses slot (first_slot + i) % slots."""
        pulled = 0
        slot_of = lambda i: (first_slot + i) % self.slots  # noqa: E731
        for done, m in enumerate(order):
            while pulled < len(order) and pulled - done < self.slots:
                mp, slot = order[pulled], slot_of(pulled)
                if pulled >= self.slots:  # slot reused: its old minibatch must be finished
                    assert st.tags[slot] in order[:done], "ring overwrite of live slot"
                fetched = pull(mp, slot) is not False
                st.tags[slot] = mp
                st.log.append(("pull" if fetched else "resident", mp))
                pulled += 1
            assert st.tags[slot_of(done)] == m, f"minibatch {m} not in its ring slot"
            compute(m, slot_of(done))
            st.log.append((kind, m))

    # ------------------------------------------------------------------ forward
    def forward(self, xs, logits, w1s, w2s, shared_w1=None, shared_w2=None):
        R, (N, D), k = len(xs), xs[0].shape, self.k
        routed = [route(z, k) for z in logits]
        self.experts = [e for e, _ in routed]
        self.weights = torch.stack([w.flatten() for _, w in routed])   # [R, N*k] fp32
        routes = torch.stack([e.flatten() for e in self.experts])      # all-gather
        X = torch.stack(xs)
        combine = X.new_zeros(R, N * k, D)
        self.states = []
        for c in range(R):
            st = self._forward_rank(c, routes, X, w1s[c], w2s[c], combine)
            self.states.append(st)
        self.shapes = (R, N, D)
        return [self._shared(xs[r], shared_w1, shared_w2) + combine[r].view(N, k, D).sum(1)
                for r in range(R)]

    def _forward_rank(self, c, routes, X, w1, w2, combine) -> RankState:
        I = w2.shape[-1]
        src_rank, src_index, expert = self._layout(routes, c)
        st = RankState(src_rank, src_index, expert, X.new_zeros(self.M, X.shape[-1]),
                       X.new_zeros(self.M, 2 * I), X.new_zeros(self.M, I),
                       [-1] * self.slots, [])
        rows = st.rows

        def compute(m, slot):
            for lo, hi, e, rr in self._ring_tiles(st, m, slot):
                self._gate_up(st, rr, w1[e])
                out = self._q(st.ring_a[rr]) @ self._q(w2[e], weight=True).T
                self._push(combine, st, slice(lo, hi), out)

        self._run_pipeline(st, self.forward_order(rows), 0,
                           lambda m, slot: self._pull_x(st, X, m, slot), compute, "compute")
        return st

    def _pull_x(self, st, X, m, slot):
        ring, lay = self._ring_rows(m, slot, st.rows)
        valid = st.src_rank[lay] >= 0
        rows = X.new_zeros(lay.stop - lay.start, X.shape[-1])
        rows[valid] = X[st.src_rank[lay][valid], st.src_index[lay][valid] // self.k]
        st.ring_x[ring] = rows

    def _push(self, dst, st, lay, out, scale=True):
        """Push rows to their owners: dst[src_rank, src_index] (scaled by the route weight)."""
        valid = st.src_rank[lay] >= 0
        r, j = st.src_rank[lay][valid], st.src_index[lay][valid]
        if scale:
            out = out[valid] * self.weights[r, j, None].to(out.dtype)
        else:
            out = out[valid]
        dst[r, j] = out

    @staticmethod
    def _shared(x, w1, w2):
        return torch.zeros_like(x) if w1 is None else expert_ffn(x, w1, w2)

    # ------------------------------------------------------------------ backward
    def backward(self, dys, logits, w1s, w2s, xs, shared_w1=None, shared_w2=None):
        """-> dict of per-rank lists dx, dlogits, dw1, dw2 and dshared_w1, dshared_w2."""
        R, N, D = self.shapes
        k = self.k
        DY = torch.stack(dys)
        dx_buf = DY.new_zeros(R, N * k, D)
        dw_buf = torch.zeros(R, N * k, dtype=torch.float32)
        dw1s, dw2s = [], []
        for c in range(R):
            dw1, dw2 = self._backward_rank(c, DY, torch.stack(xs), w1s[c], w2s[c], dx_buf, dw_buf)
            dw1s.append(dw1)
            dw2s.append(dw2)
        out = {"dw1": dw1s, "dw2": dw2s, "dx": [], "dlogits": []}
        dsw1 = dsw2 = None
        for r in range(R):
            dx = dx_buf[r].view(N, k, D).sum(1)
            if shared_w1 is not None:
                gx, g1, g2, _ = ffn_backward(xs[r], shared_w1, shared_w2, dys[r])
                dx = dx + gx
                dsw1 = g1 if dsw1 is None else dsw1 + g1
                dsw2 = g2 if dsw2 is None else dsw2 + g2
            out["dx"].append(dx)
            out["dlogits"].append(router_backward(logits[r], self.experts[r],
                                                  dw_buf[r].view(N, k)).to(logits[r].dtype))
        out["dshared_w1"], out["dshared_w2"] = dsw1, dsw2
        return out

    def backward_order(self, rows: int) -> list:
        """Macrobatch 0 first (resident in the ring), then the replayed ones ascending."""
        return list(range(self.minibatches(rows)))

    def _backward_rank(self, c, DY, X, w1, w2, dx_buf, dw_buf):
        st = self.states[c]
        rows = st.rows
        dw1, dw2 = torch.zeros_like(w1), torch.zeros_like(w2)
        resident = {m for m in st.tags if m >= 0}
        order = self.backward_order(rows)
        replayed = set()

        def pull(m, slot):
            if m in resident and st.tags[slot] == m:
                return False  # the forward left this minibatch in the ring: nothing to fetch
            replayed.add(m)
            self._pull_x(st, X, m, slot)

        def compute(m, slot):
            for lo, hi, e, rr in self._ring_tiles(st, m, slot):
                if m in replayed:  # ring-aware replay: recompute only gate/up + SwiGLU
                    self._gate_up(st, rr, w1[e])
                self._backward_tile(st, slice(lo, hi), rr, e, DY, w1, w2, dw1, dw2,
                                    dx_buf, dw_buf)

        # the forward processed macrobatch 0 last, from position max(0, n - slots) on
        first_slot = max(0, self.minibatches(rows) - self.slots) % self.slots
        self._run_pipeline(st, order, first_slot, pull, compute, "bwd")
        return dw1, dw2

    def _ring_tiles(self, st, m, slot):
        """Minibatch m's tiles in slot `slot`: (layout rows lo..hi, their expert, their ring
        rows)."""
        ring, lay = self._ring_rows(m, slot, st.rows)
        off = ring.start - lay.start
        for lo, hi in self._tiles(m, st.rows):
            yield lo, hi, int(st.expert[lo]), slice(lo + off, hi + off)

    def _gate_up(self, st, rr, w1e):
        """Gate/up and SwiGLU of the ring rows rr (one expert's tile): h and a into the ring,
        as the forward and the backward's replay both compute them."""
        h = self._q(st.ring_x[rr]) @ self._q(w1e, weight=True, halves=-2).T
        g, u = h.chunk(2, dim=-1)
        st.ring_h[rr], st.ring_a[rr] = h, F.silu(g) * u

    def _backward_tile(self, st, lay, rr, e, DY, w1, w2, dw1, dw2, dx_buf, dw_buf):
        valid = st.src_rank[lay] >= 0
        dy = DY.new_zeros(lay.stop - lay.start, DY.shape[-1])        # pull reverse-combine
        r, j = st.src_rank[lay][valid], st.src_index[lay][valid]
        dy[valid] = DY[r, j // self.k]
        weight = torch.zeros(len(dy), dtype=torch.float32)
        weight[valid] = self.weights[r, j]
        weight = weight[:, None].to(dy.dtype)
        a, h, x = st.ring_a[rr], st.ring_h[rr], st.ring_x[rr]
        da_unscaled = self._q(dy) @ self._q(w2[e].T, True).T         # down-proj input grad
        dw_buf[r, j] = (a * da_unscaled).sum(-1)[valid].float()       # router-weight grad
        da = da_unscaled * weight
        g, u = h.chunk(2, dim=-1)
        sg = torch.sigmoid(g)
        dh = torch.cat([da * u * sg * (1 + g * (1 - sg)), da * g * sg], dim=-1)
        if self.fp8 is not None:  # the kernel stores dh in bf16, then quantizes that
            dh = dh.to(torch.bfloat16).to(dh.dtype)
        # the kernel writes w * a over a and dh over h (it has no rings of its own for them)
        st.ring_a[rr], st.ring_h[rr] = weight * a, dh
        dw2[e] += dy.T @ st.ring_a[rr]
        dw1[e] += dh.T @ x
        self._push(dx_buf, st, lay, self._q(dh, halves=-1) @ self._q(w1[e].T, True, -1).T,
                   scale=False)                                       # push reverse-dispatch
