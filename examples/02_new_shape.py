"""A MoE shape that is not a preset: describe it, plan it, compile it, run it if a GPU exists."""
import torch

import mokgen
from mokgen.harness.workloads import make_inputs, reference_outputs, rel_error

shape = mokgen.MoEShape(num_experts=64, hidden=2048, intermediate=768, topk=6,
                        shared_intermediate=1536, name="my-moe")
moe = mokgen.compile(shape, ep=4, tokens_per_rank=1024, virtual=True)
print(moe.plan)
print({name: b.resources for name, b in moe.binaries.items()})
if torch.cuda.is_available():
    inputs = make_inputs(shape, 4, 1024)
    ys = moe(**inputs)
    moe.synchronize()
    print("rel. error per rank:", [f"{rel_error(y, r):.2e}"
                                   for y, r in zip(ys, reference_outputs(shape, inputs))])
