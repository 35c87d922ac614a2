"""The pipeline's setting is chosen on recall@2, @5 and @10 together, the cheaper on a tie."""
from endo_retrieval.calibration.pipeline import choose


def row(depth, read_tokens, r2, r5, r10, order="best-last"):
    return {"depth": depth, "read_tokens": read_tokens, "order": order,
            "recall": {"@2": r2, "@5": r5, "@10": r10}}


def test_a_shallow_depth_that_only_ties_at_2_and_5_loses_on_10():
    # as the 135M model's grid: depth 10 a hair ahead on (@2 + @5) / 2, its top 10 only stage 1's
    shallow, deep = row(10, 128, 0.7111, 0.8446, 0.9003), row(20, 128, 0.7111, 0.8429, 0.9139)
    assert choose([shallow, deep]) is deep


def test_ties_go_to_the_cheaper_setting():
    a, b, c = row(30, 256, 0.7, 0.8, 0.9), row(20, 256, 0.7, 0.8, 0.9), row(20, 128, 0.7, 0.8, 0.9)
    assert choose([a, b, c]) is c


def test_a_clear_gain_at_2_and_5_wins_over_a_small_loss_at_10():
    better = row(30, 128, 0.74, 0.91, 0.95, "first-stage")
    assert choose([row(10, 128, 0.70, 0.85, 0.96), better]) is better
