"""The cost curve every scheduling decision and the simulator's clock rest on."""

import pytest

from services.common.cost_curve import CostCurve


def test_default_curve_reproduces_the_design_table_and_interpolates_linearly():
    cost = CostCurve.h100("7B")
    assert cost.forward_ms(1) == 6.00 and cost.forward_ms(512) == 11.92
    assert cost.forward_ms(384) == pytest.approx((7.32 + 11.92) / 2)
    assert cost.forward_ms(0) == 0.0


def test_beyond_the_last_point_the_last_slope_continues():
    cost = CostCurve.h100("0.5B")
    slope = (1.46 - 1.16) / 256
    assert cost.forward_ms(1024) == pytest.approx(1.46 + slope * 512)


def test_from_measurements_takes_medians_and_forces_a_monotone_curve():
    cost = CostCurve.from_measurements([(1, 1.0), (1, 1.2), (1, 5.0), (64, 1.1), (128, 1.05), (256, 2.0)])
    assert cost.num_tokens == (1, 64, 128, 256)
    assert cost.ms == (1.2, 1.2, 1.2, 2.0)  # noise at 64/128 would make bigger forwards cheaper


def test_bad_curves_are_rejected():
    with pytest.raises(ValueError):
        CostCurve.h100("70B")
    with pytest.raises(ValueError):
        CostCurve.from_measurements([(8, 1.0)])
    with pytest.raises(ValueError):
        CostCurve((1.0, 1.0), (1.0, 2.0))
