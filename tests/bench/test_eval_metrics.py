"""Metrics checked against numbers worked out by hand (a two-item toy set; KL of full vs itself is 0)."""
import math

import pytest
import torch

from endo_bench.metrics import (
    answer_recall,
    compression,
    exact_match,
    f1_score,
    kl_divergence,
    nll,
    normalize_answer,
    retention,
    sp_recall,
)

# Two toy items: a prediction, the gold answers, gold supporting sentences and what a method selected.
TOY = [
    {"pred": "the Eiffel Tower in Paris", "golds": ["Eiffel Tower"],
     "supporting": ["The tower is 330 metres tall.", "It was built in 1889."],
     "selected": "Intro text.\nThe tower is 330 metres TALL!\nThe Eiffel tower stands in Paris."},
    {"pred": "Barack Obama.", "golds": ["barack obama", "Obama"],
     "supporting": ["He was born in Hawaii."],
     "selected": "Some other text.\nHe was born in Hawaii.\nHe became president in 2009."},
]


def test_toy_set_by_hand():
    # Item 1: pred normalises to "eiffel tower in paris" (4 tokens), gold "eiffel tower" (2): overlap 2,
    # P = 2/4, R = 2/2, F1 = 2 * 0.5 * 1 / 1.5 = 2/3; not an exact match. Item 2: "barack obama" matches exactly.
    f1 = [f1_score(t["pred"], t["golds"]) for t in TOY]
    em = [exact_match(t["pred"], t["golds"]) for t in TOY]
    assert f1 == pytest.approx([2 / 3, 1.0])
    assert em == [0.0, 1.0]
    assert sum(f1) / 2 == pytest.approx(5 / 6) and sum(em) / 2 == 0.5
    # sp_recall: item 1 keeps the first supporting sentence (case and punctuation differ) but not the second: 1/2;
    # item 2 keeps its only one: 1.
    sp = [sp_recall(t["selected"], t["supporting"]) for t in TOY]
    assert sp == [0.5, 1.0]
    # answer_recall: "eiffel tower" is in item 1's selection; neither "barack obama" nor "obama" is in item 2's.
    ar = [answer_recall(t["selected"], t["golds"]) for t in TOY]
    assert ar == [1.0, 0.0]


def test_normalize_answer_squad_rules():
    assert normalize_answer("The  Quick, brown fox!") == "quick brown fox"
    assert normalize_answer("An apple a day\tkeeps...") == "apple day keeps"
    assert normalize_answer("Theatre") == "theatre"  # articles only as whole words


def test_f1_counts_repeated_tokens_once_per_match():
    # pred "cat cat cat" vs gold "cat cat dog": overlap min(3, 2) = 2, P = R = 2/3, F1 = 2/3.
    assert f1_score("the cat cat cat", "cat cat dog") == pytest.approx(2 / 3)
    assert f1_score("dog", ["cat", "the dog"]) == 1.0  # best over golds
    assert f1_score("", "cat") == 0.0
    with pytest.raises(ValueError, match="gold"):
        f1_score("x", [])


def test_recall_matches_whole_words_only():
    assert answer_recall("Released in 1994.", ["1"]) == 0.0
    assert answer_recall("Released in 1 year.", ["1"]) == 1.0
    assert sp_recall("The red wood grows.", ["Ed wood grows."]) == 0.0
    assert sp_recall("Nothing", []) is None


def test_answer_recall_leaves_out_yes_no():
    assert answer_recall("yes, yes and no", ["yes"]) is None
    assert answer_recall("no", ["No."]) is None


def _naive_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    total = 0.0
    for row_p, row_q in zip(p_logits.tolist(), q_logits.tolist()):
        zp, zq = sum(math.exp(x) for x in row_p), sum(math.exp(x) for x in row_q)
        total += sum(math.exp(a) / zp * (a - math.log(zp) - b + math.log(zq)) for a, b in zip(row_p, row_q))
    return total / len(p_logits)


def test_kl_by_hand_and_against_naive_reference():
    # P = (1/2, 1/2), Q = (3/4, 1/4): KL = 1/2 ln(2/3) + 1/2 ln 2 = 1/2 ln(4/3).
    p, q = torch.tensor([[0.0, 0.0]]), torch.tensor([[math.log(3), 0.0]], dtype=torch.float64)
    assert kl_divergence(p, q) == pytest.approx(0.5 * math.log(4 / 3), abs=1e-12)
    gen = torch.Generator().manual_seed(0)
    full, comp = torch.randn(5, 50, generator=gen), torch.randn(5, 50, generator=gen)
    kl = kl_divergence(full, comp)
    assert kl > 0
    assert kl == pytest.approx(_naive_kl(full, comp), rel=1e-9)


def test_kl_of_identical_logits_is_exactly_zero():
    logits = torch.randn(7, 1000, dtype=torch.float32) * 5
    assert kl_divergence(logits, logits.clone()) == 0.0


def test_kl_and_nll_reject_bad_shapes():
    with pytest.raises(ValueError, match="shapes differ"):
        kl_divergence(torch.zeros(3, 10), torch.zeros(2, 10))
    with pytest.raises(ValueError, match=r"\(T, V\)"):
        kl_divergence(torch.zeros(10), torch.zeros(10))
    with pytest.raises(ValueError, match="target_ids"):
        nll(torch.zeros(3, 10), torch.tensor([1, 2]))


def test_nll_by_hand():
    # Position 0: uniform over 2, target 0 -> ln 2. Position 1: Q = (3/4, 1/4), target 1 -> ln 4.
    logits = torch.tensor([[0.0, 0.0], [math.log(3), 0.0]], dtype=torch.float64)
    assert nll(logits, torch.tensor([0, 1])) == pytest.approx((math.log(2) + math.log(4)) / 2, abs=1e-12)


def test_retention_and_compression():
    assert retention(0.45, 0.9) == pytest.approx(0.5)
    assert retention(0.3, 0.0) is None
    assert retention(None, 0.9) is None and retention(0.5, None) is None
    assert compression(8192, 1024) == 8.0
    assert compression(100, 0) is None
    with pytest.raises(ValueError):
        compression(-1, 10)
