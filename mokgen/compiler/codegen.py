"""Plan -> CUDA C++ source: the plan's annotated task graph, lowered operator by operator into
each kernel's template parameters (mokgen/compiler/lower.py). Templates only instantiate device
headers with them (StrictUndefined: a missing name is an error, never an empty string)."""
from __future__ import annotations

from pathlib import Path

import jinja2

from mokgen.compiler import limits
from mokgen.compiler.build import Kernel
from mokgen.config import CONFIG
from mokgen.compiler.lower import lower, problem_params
from mokgen.compiler.plan import Plan
from mokgen.compiler.planner import annotated, resident_twin
from mokgen.runtime import abi

TEMPLATES = Path(__file__).parent / "templates"
_ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES),
                          undefined=jinja2.StrictUndefined, keep_trailing_newline=True)

# Kernels each plan needs; name -> template. The name is the cache folder's prefix too.
# "bwdres": keep_h plans' second backward, for calls whose ring holds their own forward
# (plan.resident_twin: the default plan's backward, run on the call's kept h).
UNITS = {"prologue": "prologue.cu.j2", "fwd": "fwd.cu.j2", "bwd": "bwd.cu.j2",
         "bwdres": "bwd.cu.j2"}


def constants(plan: Plan) -> dict:
    """unit -> its template parameters: the prologue and the forward lower the forward ops
    of the plan's graph, the backward the backward ops."""
    g = annotated(plan)
    common = dict(problem_params(g), plan_key=plan.key(),
                  profile_mask=abi.profile_mask(plan.profile), sched_chunk=abi.SCHED_CHUNK)
    # fp8 plans: the host lays the weights out at these widths (runtime/weight_quant.py pad_weight)
    q = bool(plan.scale_block)
    common.update(padded_hidden=abi.padded(plan.shape.hidden) if q else plan.shape.hidden,
                  padded_intermediate=abi.padded(plan.shape.intermediate) if q
                  else plan.shape.intermediate)
    fwd, bwd = ({**common, **lower(g, d)} for d in ("fwd", "bwd"))
    return {"prologue": fwd, "fwd": fwd, "bwd": bwd}


# what each unit's source checks of the host <-> device interface (runtime/abi.py)
_ABI = {"fwd": (("FwdBuffers",), ("Fp8Maps",), abi.FWD_PHASES, abi.FWD_OPS),
        "bwd": (("BwdBuffers",), ("BwdMaps", "Fp8BwdMaps"), abi.BWD_PHASES, abi.BWD_OPS)}
_ABI["bwdres"] = _ABI["bwd"]  # the same template


def abi_checks(unit: str) -> str:
    """static_asserts that fail the build when a header's struct or constant drifts from
    runtime/abi.py, the description the host packs from: every field's offset and each
    struct's size, every tensor-map field's slot, the phase numbers and watch-word indices."""
    structs, map_structs, phases, ops = _ABI[unit]
    why = "drifted from mokgen/runtime/abi.py"
    out = []
    for name in structs:
        offsets, size = abi.layout(abi.STRUCTS[name])
        out += [f"static_assert(offsetof(mokgen::{name}, {f}) == {o}, \"{name}.{f} {why}\");"
                for f, o in offsets.items()]
        out.append(f"static_assert(sizeof(mokgen::{name}) == {size}, \"{name} {why}\");")
    for name in map_structs:
        fields, b = abi.MAP_STRUCTS[name], abi.TENSOR_MAP_BYTES
        out += [f"static_assert(offsetof(mokgen::{name}, {f}) == {i * b}, \"{name}.{f} {why}\");"
                for i, f in enumerate(fields)]
        out.append(f"static_assert(sizeof(mokgen::{name}) == {len(fields) * b}, "
                   f"\"{name} {why}\");")
    out += [f"static_assert(mokgen::{k} == {v}, \"{k} {why}\");" for k, (v, _) in phases.items()]
    out += [f"static_assert(mokgen::{k} == {i}, \"{k} {why}\");"
            for i, k in enumerate(abi.WATCH_FIELDS)]
    out.append(f"static_assert(mokgen::kWatchWords <= {abi.WATCH_WORDS}, \"kWatchWords {why}\");")
    out.append(f"static_assert(mokgen::kWatchMagic == {abi.WATCH_MAGIC:#x}u, "
               f"\"kWatchMagic {why}\");")
    out += [f"static_assert(mokgen::{k} == {v}u, \"{k} {why}\");" for k, v in abi.PROFILES.values()]
    consts = {**ops, "kOpcodeMask": abi.OPCODE_MASK, "kF8": abi.F8_TASK, "kHalfN": abi.HALF_N_TASK,
              "kTraceRecs": abi.TRACE_RECS, "kTraceWords": abi.TRACE_WORDS}
    out += [f"static_assert(mokgen::{k} == {v}, \"{k} {why}\");" for k, v in consts.items()]
    out += [f"static_assert(mokgen::{k} == {i}, \"{k} {why}\");"
            for i, k in enumerate(abi.TRACE_FIELDS)]
    return "\n".join(out)


# Kept under this name for the callers that ask why a layer has no backward.
backward_unsupported = limits.backward_unsupported


def units_of(plan: Plan) -> tuple:
    """The units `plan` builds: the prologue and the forward, the backward where it has one,
    and keep_h plans' resident twin beside it."""
    backward = () if backward_unsupported(plan) else ("bwd", "bwdres") if plan.keep_h \
        else ("bwd",)
    return ("prologue", "fwd") + backward


def emit(plan: Plan, units=tuple(UNITS)) -> list[Kernel]:
    if plan.arch != "sm_90a":
        raise ValueError(f"the kernels are built for sm_90a (Hopper) only, got a plan for "
                         f"{plan.gpu} ({plan.arch}); such plans serve mokgen.harness.simulate")
    limits.check(plan)  # a plan built by hand or from JSON gets the planner's rules too
    units = tuple(u for u in units if u in units_of(plan))
    consts = constants(plan)
    if "bwdres" in units:  # the twin re-runs the passes: only when its unit is asked for
        consts["bwdres"] = constants(resident_twin(plan))["bwd"]
    flags = ("-DMOKGEN_DEBUG",) if CONFIG.debug else ()
    # named by unit, GPU and plan: a cache built ahead for a kind says which (kernel.<name>.*)
    name = f"{plan.gpu.lower()}_{plan.key()}"
    kernels = [Kernel(f"{u}_{name}", _ENV.get_template(UNITS[u]).render(
        **consts[u], abi_checks=abi_checks(u) if u in _ABI else "",
        fwd_maps=abi.FWD_MAPS),
        flags) for u in units]
    if CONFIG.dump:
        CONFIG.dump.mkdir(parents=True, exist_ok=True)
        (CONFIG.dump / f"plan_{plan.key()}.json").write_text(plan.to_json())
        for k in kernels:
            (CONFIG.dump / f"{k.name}.cu").write_text(k.source)
    return kernels
