"""The planning passes, in the order they run. Each is a pure function Plan -> Plan."""
from .comm_direction import comm_direction
from .granularity import granularity
from .precision import precision
from .ring import ring
from .sm_partition import sm_partition

# precision sets the bytes per row that the partition and granularity models move;
# the partition sets the comm bandwidth that granularity's exposed-latency term uses.
PASSES = (comm_direction, precision, sm_partition, granularity, ring)

__all__ = ["PASSES", "comm_direction", "precision", "sm_partition", "granularity", "ring"]
