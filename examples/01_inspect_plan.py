"""Inspect what mokgen decides for a layer and what it generates (no GPU needed)."""
import mokgen
from mokgen.compiler import codegen, ir

shape = mokgen.shapes.get("qwen3.5-397b-a17b")
plan = mokgen.plan(shape, ep=64, dtype="bf16", tokens_per_rank=2048)
print(plan)                                   # the decisions, as a table
print(plan.to_json()[:300], "...")            # the same, machine-readable

print(ir.to_text(plan.graph))                 # the task graph, each op with its decisions

for kernel in codegen.emit(plan):             # the CUDA C++ the plan renders to
    print(f"--- {kernel.name}: {len(kernel.source.splitlines())} lines")
    print("\n".join(kernel.source.splitlines()[:12]))
