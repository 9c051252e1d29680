"""benchmarks/gather_ab: a variant spec's plan overrides (what each A/B side is built with)."""
import pytest

from benchmark_scripts import load


def test_variant_specs_force_plan_fields():
    v = load("gather_ab").variant
    assert v("pull") == dict(dispatch="pull", reverse_combine="pull")
    assert v("fwd-gather+comm_sms_bwd=8") == dict(dispatch="gather", reverse_combine="pull",
                                                   comm_sms_bwd=8)
    assert v("pull+keep_h=true+x_slots=-1")["keep_h"] is True
    assert v("pull+keep_h=true+x_slots=-1")["x_slots"] == -1
    # a tuple field (GemmConfig): colon-separated, as the --variants list is comma-separated
    assert v("pull+gemm_fwd=128:256:3")["gemm_fwd"] == (128, 256, 3)
    assert v("gather+gemm_bwd=128:256:4:false:false:true")["gemm_bwd"] == \
        (128, 256, 4, False, False, True)
    with pytest.raises(KeyError):
        v("nonesuch")
