"""The planning passes, in the order they run. Each is a pure function: it takes the task
graph and returns a copy whose operators carry its decisions (mokgen.ir.annotate)."""
from .comm_direction import comm_direction
from .dx_rows import dx_rows
from .granularity import granularity
from .keep_h import keep_h
from .precision import precision
from .ring import ring
from .sm_partition import sm_partition
from .tiling import tiling
from .x_window import x_window

# precision sets the bytes per row that the partition and granularity models move;
# the partition sets the comm bandwidth that granularity's exposed-latency term uses;
# granularity sizes minibatches in whole GEMM tiles, the ring in whole minibatches;
# comm_direction prices each direction with all three (SMs, row bytes, minibatches), and the
# ring holds pull combine's staging rows; dx_rows puts one rank's dx rows in a ring that
# holds every minibatch; x_window shrinks the backward's x ring where the forward gathers x;
# keep_h, where the ring holds every minibatch, keeps each call's h (and re-picks the backward's
# comm CTAs for it).
PASSES = (precision, sm_partition, tiling, granularity, comm_direction, ring, dx_rows, x_window,
          keep_h)


def run(g):
    """The annotated graph: every pass, in order, over `g` (mokgen.plan.initial_graph)."""
    for run_pass in PASSES:
        g = run_pass(g)
    return g


__all__ = ["PASSES", "run", "comm_direction", "precision", "sm_partition", "tiling",
           "granularity", "ring", "dx_rows", "x_window", "keep_h"]
