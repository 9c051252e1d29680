"""The compiler: shape -> task graph (ir) -> passes -> plan -> CUDA source (lower, codegen,
templates) -> cubin (build). Pure Python; nvcc only for build; no GPU."""
