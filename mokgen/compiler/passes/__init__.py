"""The planning passes, in the order they run. Each is a pure function: it takes the task
graph and returns a copy whose operators carry its decisions (mokgen.compiler.ir.annotate)."""
from mokgen.compiler.passes.comm_direction import comm_direction
from mokgen.compiler.passes.dx_rows import dx_rows
from mokgen.compiler.passes.granularity import granularity
from mokgen.compiler.passes.keep_h import keep_h
from mokgen.compiler.passes.precision import precision
from mokgen.compiler.passes.ring import ring
from mokgen.compiler.passes.sm_partition import sm_partition
from mokgen.compiler.passes.tiling import tiling
from mokgen.compiler.passes.x_window import x_window

# precision sets the bytes per row that the partition and granularity models move;
# the partition sets the comm bandwidth that granularity's exposed-latency term uses;
# granularity sizes minibatches in whole GEMM tiles, the ring in whole minibatches;
# comm_direction names the paper's directions, or gathered rows where a direction has no
# comm CTAs; dx_rows puts one rank's dx rows in a ring that holds every minibatch; x_window
# shrinks the backward's x ring where the forward gathers x;
# keep_h, where the ring holds every minibatch, keeps each call's h (and re-picks the backward's
# comm CTAs for it).
PASSES = (precision, sm_partition, tiling, granularity, comm_direction, ring, dx_rows, x_window,
          keep_h)


def run(g):
    """The annotated graph: every pass, in order, over `g` (mokgen.compiler.plan.initial_graph)."""
    for run_pass in PASSES:
        g = run_pass(g)
    return g


__all__ = ["PASSES", "run", "comm_direction", "precision", "sm_partition", "tiling",
           "granularity", "ring", "dx_rows", "x_window", "keep_h"]
