"""What the sm_90a kernels implement today, as rules on a Plan: the one place they live.

`check(plan)` raises a ValueError naming the field and the rule for anything the compiled layer
cannot run; `mokgen.compiler.plan` calls it last and codegen again before it emits, so nvcc never sees
a plan the planner accepted and then fails. `backward_unsupported(plan)` says why a plan whose
forward runs gets no backward kernel (None when it gets one); the plan's table shows it.
Kernels that learn edge tiles relax the width rules here and nowhere else.
"""
from __future__ import annotations

from mokgen.compiler.ir.ops import GemmConfig

# route.cuh: one warp per token, lane l holding the logits of experts l, l + 32, ... and a
# 32-bit mask of the ones already picked, so 32 * 32 experts at most.
MAX_EXPERTS = 1024
# Routes are tested up to 32 per token (route.cuh keeps a token's picks in registers).
MAX_TOPK = 32
# Every rank's peer pointers reach the kernels by value (the backward's BwdPeers: 32 bytes a
# rank beside 4 KB of tensor maps), inside CUDA's 32 KB kernel-parameter space: ep 512
# compiles, ep 1024 needs 37136 bytes.
MAX_EP = 512
# Row indices (the schedule table, ring positions, route ordinals) are 32-bit ints.
MAX_ROUTED_ROWS = 2**31 - 1
# The comm ops' directions, the paper's (3.1): the expert rank's comm CTAs pull the rows it
# computes on (dispatch, reverse-combine), the tiles that compute rows push them to their
# owner (combine, reverse-dispatch). Each hand-off is then one GPU-local signal per minibatch;
# the other way round needs R cross-GPU ones (the kernels implemented both; the other ways
# measured slower over NVLink, as the cost model said, and no plan picked them: removed).
DIRECTIONS = {"dispatch": "pull", "combine": "push", "reverse_combine": "pull",
              "reverse_dispatch": "push"}
# The ops that can also move nothing: with one rank holding every token, the GEMMs that read
# x (dispatch) or dy (reverse-combine) rows gather them from the caller's tensors (FwdConsts
# GATHER, gemm_tile.cuh GatherSrc): no comm CTAs, no x or dy ring. The backward gathers only
# where the forward does (its weight gradients gather the x the forward's ring does not hold);
# the forward may gather alone (dispatch "gather", reverse_combine "pull"): its comm CTAs' SMs
# go to the GEMMs, and the backward's comm CTAs pull x into the ring beside dy (FwdConsts XPULL).
GATHER = "gather"
GATHERED = ("dispatch", "reverse_combine")
# The backward's reverse-dispatch can also leave its rows where they are: with one rank, the
# dx tiles write each row over its own dy row in the ring (FwdConsts DXRING), and the owner's
# sum reads them there (mokgen/compiler/passes/dx_rows.py says when and why).
RING = "ring"
RINGED = ("reverse_dispatch",)


def directions(op: str) -> tuple:
    """The values comm op `op` takes: its direction, or the ways that move nothing."""
    return (DIRECTIONS[op],) + ((GATHER,) if op in GATHERED else ()) + \
        ((RING,) if op in RINGED else ())
# GEMM tiles (gemm_types.cuh GemmCfg; one per kernel, every GEMM op of a direction shares it):
# BM is fixed by the engine, two consumer warpgroups of 64 rows (wgmma m64). BN: the engine
# also has N = 128, but the fp8 tiles are two 128-column halves and the host's tensor maps
# have B boxes of BN and BN / 2 rows (runtime/moe.py, moe_bwd.py), all built for 256.
# Stages: 4 x 48 KB fill the 227 KB of shared memory. The engine runs 2 or 3 too (its
# standalone kernels, tests/cuda/gemm_test.cu): measured no faster in the megakernels and
# picked by no plan, so plans take 4.
GEMM_BM, GEMM_BN, GEMM_STAGES = (128,), (256,), (4,)
# Multicast pairs (GemmConfig.pair): the forward in 2-CTA clusters (gemm_tile.cuh
# produce_pairs). The forward only, bf16, both operands by TMA (not gathered rows), and CTAs
# in whole pairs: an even launch and an even count of comm CTAs (a pair's two CTAs take the
# same role).
GEMM_PAIR = (False, True)
DEFAULT_GEMM = GemmConfig(bm=128, bn=256, stages=4)


def _widths(plan) -> list[tuple[str, int]]:
    s = plan.shape
    return [("hidden", s.hidden), ("intermediate", s.intermediate)] + \
        ([("shared_intermediate", s.shared_dim)] if s.shared_experts else [])


def forward_width_rules(plan) -> list[tuple[str, int, int, str]]:
    """(field, value, multiple it must be, why) for the forward and the prologue. A width
    that is not a multiple of its tile ends in an edge tile whose columns (rows) past it are
    dropped, and TMA zero-fills K tails (gemm_epilogue.cuh cols_valid); what remains:"""
    why = "rows move as 16-byte vectors and TMA strides are multiples of 16 bytes"
    rules = [(f, v, 8, why) for f, v in _widths(plan)]
    if plan.scale_block:  # the routed experts' e4m3 tiles (the shared expert stays bf16);
        # a partial scale block is quantized as if zero-padded (fp8.cuh, mokgen.quant)
        why_q = (f"{plan.dtype} rows are e4m3, so a 16-byte vector or TMA stride is "
                 f"16 elements")
        rules += [(f, getattr(plan.shape, f), 16, why_q) for f in ("hidden", "intermediate")]
    return rules


def backward_width_rules(plan) -> list[tuple[str, int, int, str]]:
    """The backward's: the forward's (its edge tiles are the same)."""
    return forward_width_rules(plan)


def violations(plan) -> list[str]:
    """Every rule of the compiled layer (its forward) that `plan` breaks, as sentences."""
    s, out = plan.shape, []
    if s.num_experts > MAX_EXPERTS:
        out.append(f"num_experts must be <= {MAX_EXPERTS} (routing keeps E/32 logits and a "
                   f"32-bit picked mask per lane of one warp), got {s.num_experts}")
    if s.topk > MAX_TOPK:
        out.append(f"topk must be <= {MAX_TOPK}, got {s.topk}")
    if plan.ep > MAX_EP:
        out.append(f"ep must be <= {MAX_EP} (every rank's peer pointers are kernel "
                   f"parameters, 32 KB at most), got {plan.ep}")
    rows = plan.ep * plan.tokens_per_rank * s.topk
    if rows > MAX_ROUTED_ROWS:
        out.append(f"ep * tokens_per_rank * topk must be < 2**31 (32-bit row indices), "
                   f"got {rows}")
    for op in DIRECTIONS:
        got = getattr(plan, op)
        if got is not None and got not in directions(op):
            out.append(f"{op} must be one of {directions(op)}, got {got!r}")
    out += gather_violations(plan)
    if plan.reverse_dispatch == RING:
        out += ring_violations(plan)
    if plan.x_slots is not None:
        out += x_window_violations(plan)
    if plan.keep_h:
        out += keep_h_violations(plan)
    for name in ("gemm_fwd", "gemm_bwd"):
        out += _gemm_violations(name, getattr(plan, name))
    out += pair_violations(plan)
    broken = set()  # one sentence per field: its first rule broken
    for field, v, m, why in forward_width_rules(plan):
        if v % m and field not in broken:
            broken.add(field)
            out.append(f"{field} must be a multiple of {m} for the sm_90a kernels ({why}), "
                       f"got {v}")
    return out


def pair_violations(plan) -> list[str]:
    """The rules of multicast pairs (GEMM_PAIR above); a field not decided yet (None) breaks
    none."""
    if plan.gemm_bwd is not None and plan.gemm_bwd.pair:
        return ["gemm_bwd.pair must be False (the pairs are the forward's: gemm_fwd.pair)"]
    if plan.gemm_fwd is None or not plan.gemm_fwd.pair:
        return []
    out = []
    if plan.scale_block:
        out.append(f"gemm_fwd.pair needs dtype bf16 (the fp8 tiles stream their own slices: "
                   f"gemm_tile.cuh), got {plan.dtype}")
    if plan.dispatch == GATHER:
        out.append(f"gemm_fwd.pair needs dispatch other than {GATHER!r} (a pair's slices come "
                   f"by TMA)")
    for name in ("comm_sms_fwd", "num_sms"):
        v = getattr(plan, name)
        if v is not None and v % 2:
            out.append(f"gemm_fwd.pair needs an even {name} (2-CTA clusters, both CTAs in one "
                       f"role), got {v}")
    return out


def ring_violations(plan) -> list[str]:
    """The rules of dx rows in the dy ring (RING above); a field not decided yet (None)
    breaks none."""
    out = []
    if plan.ep != 1 or plan.scale_block or plan.reverse_combine not in (None, "pull"):
        out.append(f"reverse_dispatch={RING!r} needs ep == 1, dtype bf16 and reverse_combine "
                   f"'pull' (the dx tiles write one rank's dy ring, bf16), got ep {plan.ep}, "
                   f"dtype {plan.dtype}, reverse_combine {plan.reverse_combine!r}")
    return out + _whole_ring(plan, f"reverse_dispatch={RING!r}",
                             "no slot is reused while its dy rows hold dx rows")


def _whole_ring(plan, what: str, why: str) -> list[str]:
    """The rule that the ring holds every minibatch the worst case can fill, for `what`."""
    b, m, rows = plan.minibatch, plan.macrobatch, plan.max_routed_rows
    if None in (b, m, rows) or m // b >= -(-rows // b):
        return []
    return [f"{what} needs a ring that holds every minibatch ({why}): macrobatch {m} < the "
            f"{-(-rows // b)} minibatches of {b} rows that {rows} routed rows can take"]


def keep_h_violations(plan) -> list[str]:
    """The rules of `keep_h` (each call keeps its own h: runtime/workspace.py KeptActivations);
    a field not decided yet (None) breaks none. Its backward pulls x for every minibatch
    (FwdConsts XPULL) and finds every minibatch's h where its forward left it, so the ring
    must hold every minibatch (no slot's h is overwritten within a call)."""
    out = []
    if plan.ep != 1 or plan.scale_block:
        out.append(f"keep_h needs ep == 1 and dtype bf16 (the backward that pulls x for resident "
                   f"minibatches is built and tested there), got ep {plan.ep}, dtype "
                   f"{plan.dtype}")
    return out + _whole_ring(plan, "keep_h", "a call's h is kept whole")


def x_window_min_slots(plan) -> int | None:
    """The fewest minibatch slots an x window may have (mokgen/compiler/passes/x_window.py: the last
    minibatch of the last expert with rows in a slot's minibatch stays 2 minibatches before
    the one refilling it; moe_bwd.cuh wait_x_slot); None until the minibatch is decided."""
    b, bm = plan.minibatch, plan.block_m
    if b is None or bm is None:
        return None
    # a token's routes go to distinct experts: an expert gets at most one row per token
    expert_rows = -(-plan.ep * plan.tokens_per_rank // bm) * bm
    return 3 + (expert_rows - 2) // b


def x_window_slots(x_slots: int | None, ring_slots: int) -> int:
    """The x window the kernels and the workspace get (FwdConsts XSLOTS, LayerSpec.x_slots):
    x_slots where it is smaller than the ring, else 0 (the ring's own: the source and the
    buffers as without a window)."""
    return x_slots if x_slots and x_slots < ring_slots else 0


def x_window_violations(plan) -> list[str]:
    """The rules of an x window (`x_slots`, mokgen/compiler/passes/x_window.py); a field not decided yet
    (None) breaks none."""
    out = []
    if plan.ep != 1 or plan.scale_block or plan.dispatch not in (None, GATHER) or \
            plan.reverse_combine not in (None, "pull"):
        out.append(f"x_slots needs ep == 1, dtype bf16, dispatch={GATHER!r} and reverse_combine "
                   f"'pull' (a forward that gathers x, so that only the backward's comm CTAs "
                   f"copy x rows), got ep {plan.ep}, dtype {plan.dtype}, dispatch "
                   f"{plan.dispatch!r}, reverse_combine {plan.reverse_combine!r}")
    low = x_window_min_slots(plan)
    if low is not None and plan.x_slots < low:
        out.append(f"x_slots must be >= {low} (what one expert's "
                   f"{plan.ep * plan.tokens_per_rank} rows can span, plus 2 minibatches of "
                   f"{plan.minibatch}; the ring's slots or more: no window), got "
                   f"{plan.x_slots}")
    return out


def gather_violations(plan) -> list[str]:
    """The rules of gathered rows (GATHER above), and of launches without comm CTAs; a field
    not decided yet (None) breaks none (sm_partition.gathers asks before the ring exists)."""
    got = {op: getattr(plan, op) for op in GATHERED}
    gather = [op for op, d in got.items() if d == GATHER]
    out = []
    if got["reverse_combine"] == GATHER and got["dispatch"] not in (None, GATHER):
        out.append(f"reverse_combine={GATHER!r} needs dispatch={GATHER!r} (the backward "
                   f"gathers x too, which a forward that copies rows leaves in its ring), got "
                   f"dispatch={got['dispatch']!r}")
    if gather and plan.ep != 1:
        out.append(f"{gather[0]}={GATHER!r} needs ep == 1 (every token on the GPU that runs its "
                   f"experts), got ep {plan.ep}")
    if gather and plan.scale_block:
        out.append(f"{gather[0]}={GATHER!r} needs dtype 'bf16' (fp8 rings hold quantized rows), "
                   f"got {plan.dtype}")
    if got["reverse_combine"] == GATHER and plan.reverse_dispatch not in (None, "push"):
        out.append(f"reverse_combine={GATHER!r} needs reverse_dispatch='push' (no dy ring to "
                   f"leave dx rows in), got {plan.reverse_dispatch!r}")
    for op, name in (("dispatch", "comm_sms_fwd"), ("reverse_combine", "comm_sms_bwd")):
        c = getattr(plan, name)
        if c is None or got[op] is None:
            continue
        if got[op] == GATHER and c != 0:
            out.append(f"{op}={GATHER!r} runs no comm CTAs: {name} must be 0, got {c}")
        if got[op] != GATHER and c == 0:
            out.append(f"{name} must be >= 1 unless {op}={GATHER!r} (its comm CTAs move the "
                       f"rows), got 0")
    if gather and plan.macrobatch is not None and plan.max_routed_rows is not None and \
            plan.macrobatch < plan.max_routed_rows:
        out.append(f"{gather[0]}={GATHER!r} needs a ring that holds every row: macrobatch must "
                   f"be >= {plan.max_routed_rows}, got {plan.macrobatch}")
    return out


def _gemm_violations(name: str, cfg: GemmConfig | None) -> list[str]:
    if cfg is None:
        return []
    return [f"{name}.{f} must be one of {ok} (gemm_tile.cuh and the host's tensor maps; see "
            f"mokgen/compiler/limits.py), got {getattr(cfg, f)}"
            for f, ok in (("bm", GEMM_BM), ("bn", GEMM_BN), ("stages", GEMM_STAGES),
                          ("pair", GEMM_PAIR))
            if getattr(cfg, f) not in ok]


def check(plan) -> None:
    """Raise ValueError listing every rule the compiled layer breaks (nothing: it can run)."""
    bad = violations(plan)
    if bad:
        raise ValueError("; ".join(bad))


def backward_unsupported(plan) -> str | None:
    """Why the backward kernel can't be built for a plan that passes `check` (None: it
    can). Such a plan still gets its forward."""
    for field, v, m, why in backward_width_rules(plan):
        if v % m:
            return f"the backward kernel needs {field} to be a multiple of {m} ({why}), got {v}"
    return None
