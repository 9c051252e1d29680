"""Stored tuning results (`python -m mokgen tune`): the plan `mokgen.compile` and `mokgen.MoE`
build is the planner's, with a stored winner's minibatch and comm SMs unless the caller forces
any of them. A result is the GPU's it was tuned on (its name and key say which)."""
from __future__ import annotations

import json
from pathlib import Path

from mokgen.compiler.plan import initial_plan
from mokgen.compiler.planner import plan as make_plan
from mokgen.config import CONFIG

TUNED = ("minibatch", "comm_sms_fwd", "comm_sms_bwd")


def tuned_file(shape, ep: int, dtype: str, tokens: int, **target) -> Path:
    """Where the result for this problem on the GPU `target` names (gpu= / arch=, as
    mokgen.plan takes them; default: the plans' default GPU) lives."""
    p = initial_plan(shape, ep, dtype, tokens, **target)  # the problem, before any decision
    return CONFIG.cache / "tuned" / (f"{shape.name or 'shape'}.ep{ep}.n{tokens}.{dtype}."
                                     f"{p.gpu.lower()}.{p.key()}.json")


def load_tuned(shape, ep: int, dtype: str, tokens: int, **target) -> dict:
    """The stored winner's overrides ({} when nothing was tuned or the file is unreadable)."""
    path = tuned_file(shape, ep, dtype, tokens, **target)
    try:
        best = json.loads(path.read_text())["best"]
        return {k: int(best[k]) for k in TUNED if k in best}  # a forward-only result too
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def with_tuned(shape, ep: int, dtype: str, tokens: int, overrides: dict) -> dict:
    """`overrides` completed by a stored tuning result, unless the caller already forces one
    of the tuned fields (explicit choices always win) or leaves SMs to collectives (the
    result was tuned with every SM)."""
    if any(k in overrides for k in TUNED) or overrides.get("reserve_sms") \
            or overrides.get("overlap_comm"):
        return overrides
    tuned = load_tuned(shape, ep, dtype, tokens,
                       **{k: overrides[k] for k in ("gpu", "arch") if k in overrides})
    if "gather" in (overrides.get("dispatch"), overrides.get("reverse_combine")):
        tuned = {}  # tuned for copied rows: gathered ones run no comm CTAs
    if "comm_sms_bwd" in tuned:  # not for keep_h plans (tune() says why), e.g. a result
        rest = {k: v for k, v in tuned.items() if k != "comm_sms_bwd"}  # stored before
        if make_plan(shape, ep=ep, dtype=dtype, tokens_per_rank=tokens,  # keep_h's default
                     **{**rest, **overrides}).keep_h:
            tuned = rest
    return {**tuned, **overrides}


def tuned_plan(shape, ep: int, dtype: str, tokens: int, **overrides):
    """The plan mokgen.compile and mokgen.MoE build: the planner run with `overrides`
    completed by a stored tuning result (with_tuned)."""
    return make_plan(shape, ep=ep, dtype=dtype, tokens_per_rank=tokens,
                     **with_tuned(shape, ep, dtype, tokens, overrides))
