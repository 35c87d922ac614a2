"""The adaptive fusion (scoring/adaptive.py) and its fit across domains (calibration/fusion_rule.py), on made data."""
from __future__ import annotations

import numpy as np
import pytest

from endo_retrieval.calibration.fusion_rule import (FLOOR, TEMPERATURES, GridTables, fit_fixed, fit_rule, per_question,
                                                   soft_minimum)
from endo_retrieval.scoring.adaptive import AdaptiveWeights, feature_names, question_features
from endo_retrieval.scoring.fusion import fuse

STAGES = ("bm25", "dense", "heads")


def rule_with(coef=None, bias=(0.0, 0.0, 0.0)) -> AdaptiveWeights:
    n = len(feature_names(STAGES))
    coef = np.zeros((3, n)) if coef is None else coef
    return AdaptiveWeights(STAGES, coef, np.asarray(bias, float), np.zeros(n), np.ones(n))


def test_without_a_map_the_rule_is_the_fixed_fusion_of_its_bias():
    rng = np.random.default_rng(0)
    scores = {s: rng.normal(size=20) for s in STAGES}
    w = np.array([0.2, 0.5, 0.3])
    rule = rule_with(bias=np.log(w))
    assert rule.weights(scores) == pytest.approx(dict(zip(STAGES, w)))
    assert rule.fuse(scores) == pytest.approx(fuse(scores, dict(zip(STAGES, w))))


def test_a_peaked_stage_gains_weight_where_the_map_says_so():
    names = feature_names(STAGES)
    coef = np.zeros((3, len(names)))
    coef[0, names.index("top:bm25")] = 2.0  # a BM25 best candidate that stands out: trust BM25 more
    rule = rule_with(coef)
    flat = {"bm25": np.linspace(1, 1.1, 20), "dense": np.linspace(0, 1, 20), "heads": np.linspace(0, 1, 20)}
    peaked = dict(flat, bm25=np.r_[np.zeros(19), 9.0])
    assert question_features(peaked, STAGES)["top:bm25"] > question_features(flat, STAGES)["top:bm25"]
    assert rule.weights(peaked)["bm25"] > rule.weights(flat)["bm25"]
    assert sum(rule.weights(peaked).values()) == pytest.approx(1.0)


def test_a_rule_survives_its_json_and_a_damaged_one_is_refused():
    rule = rule_with(np.arange(3 * len(feature_names(STAGES)), dtype=float).reshape(3, -1) / 100)
    back = AdaptiveWeights.from_json(rule.to_json())
    scores = {s: np.arange(5.0) * (i + 1) for i, s in enumerate(STAGES)}
    assert back.weights(scores) == pytest.approx(rule.weights(scores))
    broken = rule.to_json() | {"coef": [[1.0]]}
    with pytest.raises(ValueError, match="needs coef 3 x"):
        AdaptiveWeights.from_json(broken)
    with pytest.raises(ValueError, match="not an adaptive fusion rule"):
        AdaptiveWeights.from_json({"stages": ["bm25"]})
    with pytest.raises(ValueError, match="fit it again"):
        AdaptiveWeights.from_json(rule.to_json() | {"features": ["something else"]})


def made_domain(rng, trusted: str, n: int = 80) -> list:
    """Questions whose gold candidate the `trusted` stage puts first with a clear margin, while the other stages
    score noise; the trusted stage's own curve is peaked, the others flat."""
    out = []
    for _ in range(n):
        docs = [f"d{i}" for i in range(20)]
        gold = int(rng.integers(20))
        scores = {s: rng.normal(size=20) for s in STAGES}
        scores[trusted][gold] += 4.0
        out.append((scores, docs, {docs[gold]}))
    return out


def test_the_fit_learns_which_stage_to_trust_per_question_where_one_fixed_fusion_cannot():
    rng = np.random.default_rng(1)
    train = {"lexical": made_domain(rng, "bm25"), "paraphrase": made_domain(rng, "dense")}
    test = {"lexical": made_domain(rng, "bm25"), "paraphrase": made_domain(rng, "dense")}
    fixed = fit_fixed(train, STAGES)
    rule = fit_rule(train, STAGES, start=fixed)
    for name, its in test.items():
        adaptive = per_question(its, rule.fuse).mean()
        assert adaptive > per_question(its, lambda s: fuse(s, fixed)).mean() + 0.02, name


def boosted_domain(rng, boosts: dict[str, float], n: int = 60) -> list:
    """Questions whose gold candidate each stage favours by its boost (noise elsewhere)."""
    out = []
    for _ in range(n):
        docs = [f"d{i}" for i in range(20)]
        gold = int(rng.integers(20))
        scores = {s: rng.normal(size=20) for s in STAGES}
        for s, b in boosts.items():
            scores[s][gold] += b
        out.append((scores, docs, {docs[gold]}))
    return out


def test_the_soft_minimum_runs_from_the_worst_domain_to_the_mean():
    gains = np.array([[1.0, 4.0], [5.0, 0.0], [3.0, 2.0]])  # domains x fusions
    assert soft_minimum(gains, 0.01) == pytest.approx(gains.min(0), abs=0.05)
    assert soft_minimum(gains, 1e4) == pytest.approx(gains.mean(0), abs=0.01)
    assert soft_minimum(gains, None) == pytest.approx(gains.mean(0))


def test_the_fixed_fit_gives_up_no_domain_for_the_mean_of_the_others():
    """Two domains where the heads add much to weak first stages, one where the embedder is near-perfect and the
    heads only add noise: the mean of the domains' nDCG takes the heads' weight and puts that domain below its
    embedder alone; the soft minimum keeps every domain at or above its better first stage."""
    rng = np.random.default_rng(3)
    domains = {"wiki": boosted_domain(rng, {"bm25": 1.0, "dense": 1.0, "heads": 3.0}),
               "claims": boosted_domain(rng, {"bm25": 1.5, "dense": 0.5, "heads": 3.0}),
               "faq": boosted_domain(rng, {"bm25": 0.5, "dense": 3.5, "heads": 0.0})}
    tables = GridTables(domains, STAGES)
    by_mean = tables.gains(list(domains))[:, tables.best(list(domains), None, floor=None)]
    by_worst = tables.gains(list(domains))[:, tables.best(list(domains), 0.5, floor=None)]
    assert by_mean[2] < -0.5  # the mean gives the paraphrase domain up
    assert by_worst.min() >= -0.5 and by_worst.min() > by_mean.min() + 1.0
    # the floor alone keeps it too: the mean's choice among the fusions that leave every domain within 0.5
    floored = tables.gains(list(domains))[:, tables.best(list(domains), None)]
    assert floored.min() >= -FLOOR and floored.mean() >= by_worst.mean() - 1e-9
    weights, temperature = tables.fit()
    assert temperature in TEMPERATURES and weights == tables.grid[tables.best(list(domains), temperature)]
    assert fit_fixed(domains, STAGES) == weights
