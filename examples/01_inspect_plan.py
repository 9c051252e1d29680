"""Inspect what mokgen decides for a layer and what it generates (no GPU needed)."""
import mokgen
from mokgen import codegen, ir

shape = mokgen.shapes.get("qwen3.5-397b-a17b")
plan = mokgen.plan(shape, ep=64, dtype="bf16", tokens_per_rank=2048)
print(plan)                                   # the decisions, as a table
print(plan.to_json()[:300], "...")            # the same, machine-readable

graph = ir.build_graph(shape, ep=64, tokens=2048, direction="fwd")
print(ir.to_text(graph))                      # the task graph the passes reason about

for kernel in codegen.emit(plan):             # the CUDA C++ the plan renders to
    print(f"--- {kernel.name}: {len(kernel.source.splitlines())} lines")
    print("\n".join(kernel.source.splitlines()[:12]))
