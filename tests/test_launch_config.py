"""runtime/cuda.py launch_config (no GPU): the extended launch's attributes, as cuLaunchKernelEx
and cuOccupancyMaxActiveClusters receive them; tests/test_gpu_cluster.py launches with them."""
import pytest
from cuda.bindings import driver as cu

from mokgen.runtime import cuda as mc

ID = cu.CUlaunchAttributeID


def test_cluster_and_cooperative_attributes():
    cfg = mc.launch_config((132, 1), 384, 226 * 1024, None, cooperative=True, cluster=2)
    assert (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ) == (132, 1, 1)
    assert (cfg.blockDimX, cfg.sharedMemBytes) == (384, 226 * 1024)
    assert cfg.numAttrs == 2
    by_id = {a.id: a.value for a in cfg.attrs}
    dim = by_id[ID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION].clusterDim
    assert (dim.x, dim.y, dim.z) == (2, 1, 1)
    assert by_id[ID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE].cooperative == 1


def test_no_attributes_for_a_plain_launch():
    assert mc.launch_config(132, 384, 0, None).numAttrs == 0


@pytest.mark.parametrize("grid,cluster", [(131, 2), (6, 4), (4, 0)])
def test_a_grid_must_be_whole_clusters(grid, cluster):
    with pytest.raises(ValueError, match="multiple of the cluster"):
        mc.launch_config(grid, 384, 0, None, cluster=cluster)


def test_max_active_clusters_needs_clusters():
    with pytest.raises(ValueError, match="2 CTAs or more"):
        mc.max_active_clusters(None, 384, 0, 1)
