"""tf_relupool/recompute_plan.py: the memory budget's planner, a pure function (no TensorFlow)."""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import examples
from tf_relupool import recompute_plan as rp
from tf_relupool.recompute_plan import Candidate


@st.composite
def candidate_sets(draw):
    """Up to 10 candidates; each may need earlier ones (so no cycle)."""
    n = draw(st.integers(0, 10))
    out = []
    for i in range(n):
        needs = draw(st.lists(st.integers(0, i - 1), unique=True, max_size=3)) if i else []
        out.append(Candidate(f"t{i}", draw(st.integers(0, 10**6)), draw(st.integers(0, 10**8)),
                             tuple(f"t{j}" for j in needs)))
    return draw(st.permutations(out))


budgets = st.floats(0, 1, allow_nan=False)


@settings(max_examples=examples(200), deadline=None)
@given(cands=candidate_sets(), b1=budgets, b2=budgets)
def test_a_lower_budget_recomputes_a_superset_and_keeps_no_more(cands, b1, b2):
    low, high = sorted((b1, b2))
    p_low, p_high = rp.plan(cands, low), rp.plan(cands, high)
    assert set(p_high.recompute) <= set(p_low.recompute)
    assert p_low.kept_bytes <= p_high.kept_bytes
    for p, b in ((p_low, low), (p_high, high)):
        assert p.kept_bytes <= b * p.total_bytes + 1e-9 * max(p.total_bytes, 1)
        assert p.total_bytes == sum(c.bytes for c in cands)
        assert p.kept_bytes == p.total_bytes - sum(c.bytes for c in cands
                                                   if c.name in p.recompute)
        assert p.flops == sum(c.flops for c in cands if c.name in p.recompute)


@settings(max_examples=examples(200), deadline=None)
@given(cands=candidate_sets(), b=budgets)
def test_each_recomputed_tensor_follows_what_it_is_recomputed_from(cands, b):
    p = rp.plan(cands, b)
    by_name = {c.name: c for c in cands}
    position = {n: i for i, n in enumerate(p.recompute)}
    for name in p.recompute:
        for need in by_name[name].needs:
            assert need in position and position[need] < position[name], (name, need, p)


@settings(max_examples=examples(100), deadline=None)
@given(cands=candidate_sets())
def test_budget_one_keeps_everything_and_zero_recomputes_everything(cands):
    assert rp.plan(cands, 1).recompute == ()
    everything = rp.plan(cands, 0)
    assert {c.name for c in cands if c.bytes} <= set(everything.recompute)
    assert everything.kept_bytes == 0


def test_cheapest_work_per_byte_first_and_a_prefix_per_budget():
    """MobileNetV2-like block, one unit of bytes each: the activations (elementwise) before the
    depthwise convolution's output, before the 1x1's; the BN output needs its conv's."""
    cands = [Candidate("expand_conv", 6, rp.flops("conv", 6, kernel_elements=1, in_channels=16),
                       ()),
             Candidate("expand_relu", 6, rp.flops("elementwise", 6), ()),
             Candidate("dw_conv", 6, rp.flops("depthwise_conv", 6, kernel_elements=9), ()),
             Candidate("dw_bn", 6, rp.flops("batch_norm", 6), ("dw_conv",))]
    order = rp.recompute_order(cands)
    assert order == ["expand_relu", "dw_conv", "dw_bn", "expand_conv"], order
    # (elementwise 1 FLOP/byte; dw_bn alone 2/byte but it needs dw_conv: the pair adds 10/byte,
    # needs first; the 1x1 convolution 32/byte. A budget's plan is a prefix of that order.)
    assert rp.plan(cands, 0.75).recompute == ("expand_relu",)
    assert rp.plan(cands, 0.5).recompute == ("expand_relu", "dw_conv")
    assert rp.plan(cands, 0.0).recompute == tuple(order)


def test_costs_table_rows():
    """Every COSTS row: FLOPs per output element, times the element count."""
    assert rp.flops("elementwise", 10) == 10
    assert rp.flops("batch_norm", 10) == 20
    assert rp.flops("conv", 10, kernel_elements=9, in_channels=8) == 10 * 2 * 9 * 8
    assert rp.flops("conv", 10, kernel_elements=9, in_channels=8, groups=2) == 10 * 2 * 9 * 4
    assert rp.flops("depthwise_conv", 10, kernel_elements=9) == 10 * 2 * 9
    assert rp.flops("dense", 10, in_features=64) == 10 * 2 * 64
    assert set(rp.COSTS) == {"elementwise", "batch_norm", "conv", "depthwise_conv", "dense"}


@pytest.mark.parametrize("budget", [-0.1, 1.5, math.nan, "0.5", None, True])
def test_bad_budget_is_a_value_error_naming_it(budget):
    with pytest.raises(ValueError, match="budget"):
        rp.plan([Candidate("a", 1, 1, ())], budget)


@pytest.mark.parametrize("cands, match", [
    ([Candidate("a", 1, 1, ()), Candidate("a", 2, 2, ())], "repeats"),
    ([Candidate("a", -1, 1, ())], "bytes"),
    ([Candidate("a", 1, math.inf, ())], "flops"),
    ([Candidate("a", 1, 1, ("b",))], "unknown"),
    ([Candidate("a", 1, 1, ("b",)), Candidate("b", 1, 1, ("a",))], "cycle"),
    ([("a", 1, 1, ())], "Candidate"),
])
def test_bad_candidates_are_value_errors(cands, match):
    with pytest.raises(ValueError, match=match):
        rp.plan(cands, 0.5)


def test_bad_cost_arguments_are_value_errors():
    with pytest.raises(ValueError, match="kind"):
        rp.flops("pool", 10)
    with pytest.raises(ValueError, match="output_elements"):
        rp.flops("elementwise", -1)
