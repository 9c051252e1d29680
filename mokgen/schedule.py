"""Algorithm 1 of the paper: the pull-based dispatch schedule, in vectorized torch.

Row p of the table says which (source rank, source route index) lands at buffer position p
on this rank. Routes are sorted by (local expert, per-source ordinal, source rank): each
expert gets a contiguous region, and inside it the sources interleave round-robin, so pulls
spread evenly over the peers and each expert's GEMM reads one contiguous block. The same
table, read as (dst_rank, dst_index), drives the combine and both backward operators.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class Schedule(NamedTuple):
    table: torch.Tensor    # int64 [P, 2]: (src_rank, src_route_index) per position
    counts: torch.Tensor   # int64 [L]: routes per local expert
    offsets: torch.Tensor  # int64 [L + 1]: start of each expert's region (offsets[L] == P)

    def padded_offsets(self, tile: int) -> torch.Tensor:
        """Region starts when every expert's region is rounded up to a multiple of `tile`
        (so a GEMM tile never mixes experts). int64 [L + 1]."""
        padded = (self.counts + tile - 1) // tile * tile
        return torch.nn.functional.pad(torch.cumsum(padded, 0), (1, 0))

    def padded_positions(self, tile: int) -> torch.Tensor:
        """Ring row of each table row in the padded layout. int64 [P]."""
        expert = torch.repeat_interleave(
            torch.arange(len(self.counts), device=self.counts.device), self.counts)
        p = torch.arange(len(expert), device=self.counts.device)
        return self.padded_offsets(tile)[expert] + (p - self.offsets[expert])


def _local_routes(routes: torch.Tensor, rank: int, num_local_experts: int):
    if routes.dim() != 2 or routes.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"routes must be an int64 [R, N*k] tensor, got {routes.dtype} "
                         f"{tuple(routes.shape)}")
    R = routes.shape[0]
    if not 0 <= rank < R:
        raise ValueError(f"rank must be in [0, {R}), got {rank}")
    local = routes.long() - rank * num_local_experts
    mask = (local >= 0) & (local < num_local_experts)
    src_rank, src_index = mask.nonzero(as_tuple=True)  # row-major: (r, j) ascending
    return src_rank, src_index, local[src_rank, src_index]


def _ordinals(key: torch.Tensor) -> torch.Tensor:
    """For each element, how many earlier elements share its key (key order is stable)."""
    order = torch.sort(key, stable=True).indices
    sorted_key = key[order]
    first = torch.ones_like(sorted_key, dtype=torch.bool)
    first[1:] = sorted_key[1:] != sorted_key[:-1]
    idx = torch.arange(len(key), device=key.device)
    group_start = torch.cummax(torch.where(first, idx, 0), 0).values
    out = torch.empty_like(key)
    out[order] = idx - group_start
    return out


def dispatch_schedule(routes: torch.Tensor, rank: int, num_local_experts: int) -> Schedule:
    """routes: int [R, N*k], global expert of route j of source rank r. Returns the Schedule
    of every route that targets `rank` (global experts rank*L .. rank*L + L - 1)."""
    L = num_local_experts
    R = routes.shape[0]
    src_rank, src_index, expert = _local_routes(routes, rank, L)
    ordinal = _ordinals(src_rank * L + expert)
    # Sort key (expert, ordinal, source rank); ordinal < routes per rank, so it cannot overflow.
    span = routes.shape[1] + 1
    order = torch.argsort((expert * span + ordinal) * R + src_rank)
    table = torch.stack([src_rank[order], src_index[order]], dim=1)
    counts = torch.bincount(expert, minlength=L)
    offsets = torch.nn.functional.pad(torch.cumsum(counts, 0), (1, 0))
    return Schedule(table, counts, offsets)


def dispatch_positions(routes: torch.Tensor, rank: int, num_local_experts: int):
    """Algorithm 1 as written: the closed-form position of each route, computed without a
    sort, exactly as the GPU schedule kernel does it. Returns (src_rank, src_index, position),
    each int64 [P]. Memory is O(P * R); meant for tests and small problems."""
    L = num_local_experts
    R = routes.shape[0]
    src_rank, src_index, expert = _local_routes(routes, rank, L)
    M = torch.bincount(src_rank * L + expert, minlength=R * L).view(R, L)
    start = torch.nn.functional.pad(torch.cumsum(M.sum(0), 0), (1, 0))[:-1]
    o = _ordinals(src_rank * L + expert)
    m_l = M[:, expert].T                                       # [P, R]: M[r', l] per route
    before = torch.minimum(m_l, o[:, None]).sum(1)             # sum_r' min(M[r',l], o)
    lower = torch.arange(R, device=routes.device)[None, :] < src_rank[:, None]
    earlier = ((m_l > o[:, None]) & lower).sum(1)             # |{r' < r : M[r',l] > o}|
    return src_rank, src_index, start[expert] + before + earlier


def chunk_ordinals(routes: torch.Tensor, rank: int, num_local_experts: int, chunk: int):
    """The GPU count kernel's split of the ordinals (schedule.cuh schedule_count): each source
    rank's routes cut into chunks of `chunk` consecutive routes, counted apart. Returns
    (src_rank, src_index, inside, base): per local route (in _local_routes order) its ordinal
    inside its chunk, and int64 [R, C, L] the routes of source r to local expert l in the
    chunks before chunk c, C = max(1, ceil(N*k / chunk)). A route's ordinal (dispatch_positions)
    is base[r, j // chunk, l] + inside."""
    L = num_local_experts
    R, NK = routes.shape
    C = max(1, -(-NK // chunk))
    src_rank, src_index, expert = _local_routes(routes, rank, L)
    key = (src_rank * C + src_index // chunk) * L + expert
    counts = torch.bincount(key, minlength=R * C * L).view(R, C, L)
    return src_rank, src_index, _ordinals(key), counts.cumsum(1) - counts


def weight_gradient_segments(offsets: list, counts: list, B: int,
                             slots: int) -> tuple[list, list]:
    """The backward's weight-gradient segments as schedule.cuh schedule_segments builds them,
    from the padded region starts `offsets` [L + 1] and each expert's rows `counts` [L]
    (minibatches of B rows, a ring of `slots`): unit 0 the empty experts, then per minibatch
    the segments that end in it, by expert; a segment is (expert, first row, end row, index |
    count << 16), an expert's last one ending at its last row (not its region's padded end).
    -> (segments, seg_start)."""
    L, rows = len(offsets) - 1, offsets[-1]
    nm = -(-rows // B)
    whole = nm <= slots
    units = [[(e, 0, 0, 1 << 16) for e in range(L) if offsets[e + 1] == offsets[e]]]
    units += [[] for _ in range(nm)]
    for e in range(L):
        r0, r1 = offsets[e], offsets[e] + counts[e]
        if r0 == offsets[e + 1]:
            continue
        first, last = r0 // B, (r1 - 1) // B
        if whole:
            units[last + 1].append((e, r0, r1, 1 << 16))
            continue
        for m in range(first, last + 1):
            units[m + 1].append((e, max(r0, m * B), min(r1, (m + 1) * B),
                                 (m - first) | ((last - first + 1) << 16)))
    starts = [0]
    for u in units:
        starts.append(starts[-1] + len(u))
    return [s for u in units for s in u], starts


def wg_acc_slot(segment: tuple, B: int, by_minibatch: bool) -> int:
    """The fp32 running sum a weight-gradient segment adds into (moe_bwd.cuh wgrad_epilogue;
    workspace.LayerSpec.wg_by_minibatch): its expert's first minibatch, or its expert."""
    e, y, _, w = segment
    return y // B - (w & 0xFFFF) if by_minibatch else e
