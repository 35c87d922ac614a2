"""fit_reranker_weights on made-up scores: the weight of the first stage against the heads, found by recall."""
from __future__ import annotations

import numpy as np
import pytest

from endo_retrieval.calibration.reranker import fit_reranker_weights

QUESTIONS, CANDIDATES = 40, 12


def made_up(seed: int = 0):
    """Two gold candidates of twelve per question, and noise that misleads whichever signal it is added to."""
    rng = np.random.default_rng(seed)
    gold = np.zeros((QUESTIONS, CANDIDATES), dtype=bool)
    for row in gold:
        row[rng.choice(CANDIDATES, 2, replace=False)] = True
    return gold.astype(np.float64), rng.normal(0, 3, gold.shape), gold


def test_a_perfect_first_stage_gets_all_the_weight():
    gold_score, noise, gold = made_up()
    weights, recall = fit_reranker_weights(gold_score, -gold_score + 0.1 * noise, gold)  # heads rank gold last
    assert weights == {"first_stage": 1.0, "heads": 0.0}
    assert recall[2] == recall[5] == 1.0


def test_perfect_heads_get_all_the_weight():
    gold_score, noise, gold = made_up(1)
    weights, recall = fit_reranker_weights(-gold_score + 0.1 * noise, gold_score, gold)
    assert weights == {"first_stage": 0.0, "heads": 1.0}
    assert recall[2] == 1.0


def test_signals_wrong_in_opposite_ways_are_mixed():
    """first = gold + noise and heads = gold - noise: each alone is misled, their even sum is exact."""
    gold_score, noise, gold = made_up(2)
    weights, recall = fit_reranker_weights(gold_score + noise, gold_score - noise, gold, step=0.25)
    assert weights == {"first_stage": 0.5, "heads": 0.5} and recall[2] == recall[5] == 1.0
    alone = fit_reranker_weights(gold_score + noise, gold_score - noise, gold, step=1.0)[1]
    assert (alone[2] + alone[5]) / 2 < 1.0  # the grid of the corners alone cannot reach it


def test_a_tie_keeps_the_first_stage_alone():
    gold_score, _, gold = made_up(3)
    assert fit_reranker_weights(gold_score, gold_score, gold)[0] == {"first_stage": 1.0, "heads": 0.0}


def test_bad_input_is_refused_with_what_to_give():
    gold_score, _, gold = made_up()
    with pytest.raises(ValueError, match="one entry per question"):
        fit_reranker_weights(gold_score[:3], gold_score, gold)
    with pytest.raises(ValueError, match="Question 0: 12 first-stage scores, 11 heads scores"):
        fit_reranker_weights(gold_score, [row[:-1] for row in gold_score], gold)
    with pytest.raises(ValueError, match="step"):
        fit_reranker_weights(gold_score, gold_score, gold, step=0)
