import numpy as np
import pytest

from endo_retrieval.scoring.select import density, peaks, runs, select_spans, spans_from_peaks


@pytest.mark.parametrize("kernel", [1, 2, 3, 8, 48])
def test_density_is_box_convolution_same(kernel):
    scores = np.random.default_rng(0).random(100) * (np.random.default_rng(1).random(100) > 0.8)
    expected = np.convolve(scores, np.ones(kernel) / kernel, mode="same")
    np.testing.assert_allclose(density(scores, kernel), expected, atol=1e-6)


def test_density_by_hand():
    assert density(np.array([0, 0, 4, 0, 0.0]), 2).tolist() == [0, 0, 2, 2, 0]
    with pytest.raises(ValueError):
        density(np.zeros(4), 0)


def test_peaks_nms_by_hand():
    d = np.array([0, 1, 3, 1, 0, 2, 0, 0, 0, 5, 4, 0, -1, 0], dtype=float)
    assert peaks(d, n=None, radius=1).tolist() == [9, 2, 5]  # 10 is suppressed by 9, 12 is not positive
    assert peaks(d, n=None, radius=3).tolist() == [9, 2]  # 5 lies within 3 of 2
    assert peaks(d, n=1, radius=1).tolist() == [9]
    assert peaks(np.zeros(5)).tolist() == []


def test_peak_sits_in_the_middle_of_a_plateau():
    scores = np.zeros(40)
    scores[20] = 1.0
    d = density(scores, 8)  # windows [t-4, t+3]: flat from 17 to 24
    assert np.flatnonzero(d).tolist() == list(range(17, 25))
    assert peaks(d, radius=8).tolist() == [20]  # the middle, i.e. the hit itself, not the plateau's edge 17


def test_runs():
    assert runs(np.array([1, 2, 3, 7, 8, 10])) == [(1, 4), (7, 9), (10, 11)]
    assert runs(np.array([1, 2, 3, 4]), breaks=np.array([3])) == [(1, 3), (3, 5)]
    assert runs(np.array([], dtype=int)) == []


SENTENCES = np.array([0, 10, 20, 30, 40])  # five sentences of 10 tokens over 50 positions


def test_peaks_grow_to_sentences_in_peak_order():
    assert spans_from_peaks([25, 5], SENTENCES, 50, budget=20) == [(0, 10), (20, 30)]
    assert spans_from_peaks([25, 15], SENTENCES, 50, budget=20) == [(10, 30)]  # adjacent spans merge
    assert spans_from_peaks([25, 27, 15], SENTENCES, 50, budget=20) == [(10, 30)]  # same sentence counts once


def test_overflowing_sentence_is_trimmed_around_its_peak():
    assert spans_from_peaks([25, 43], SENTENCES, 50, budget=14) == [(20, 30), (41, 45)]  # ties go left
    assert spans_from_peaks([25, 41], SENTENCES, 50, budget=14) == [(20, 30), (40, 44)]  # clipped at the start


def test_budget_smaller_than_one_sentence():
    assert spans_from_peaks([25], SENTENCES, 50, budget=3) == [(24, 27)]
    with pytest.raises(ValueError, match="budget"):
        spans_from_peaks([25], SENTENCES, 50, budget=0)


def test_fewer_tokens_when_peaks_run_out():
    assert spans_from_peaks([5], SENTENCES, 50, budget=30) == [(0, 10)]


def test_segment_bounds_are_never_crossed():
    sentences = np.array([0, 30])  # one long sentence hides the document bound at 12
    spans = spans_from_peaks([10, 14], sentences, 30, budget=30, segment_bounds=np.array([0, 12, 30]))
    assert spans == [(0, 12), (12, 30)]
    for a, b in spans:
        assert not any(a < s < b for s in (12,))


def test_max_span_caps_a_long_sentence():
    assert spans_from_peaks([25], np.array([0]), 50, budget=40, max_span=6) == [(22, 28)]


@pytest.mark.parametrize("seed", range(5))
def test_select_spans_meets_budget_exactly_and_respects_bounds(seed):
    rng = np.random.default_rng(seed)
    n = 2000
    scores = rng.random(n) * (rng.random(n) > 0.9)
    sentences = np.unique(np.concatenate(([0], rng.integers(0, n, 150))))
    docs = np.array([0, 500, 1300, n])
    for budget in (1, 37, 256, 1024):
        spans = select_spans(scores, sentences, budget, kernel=8, segment_bounds=docs)
        assert sum(b - a for a, b, _ in spans) == budget
        assert all(not (a < s < b) for a, b, _ in spans for s in docs)
        assert [a for a, _, _ in spans] == sorted(a for a, _, _ in spans)
        assert all(score > 0 for _, _, score in spans)


def test_fill_false_stops_at_n_peaks():
    scores = np.zeros(50)
    scores[[5, 25, 45]] = [3.0, 2.0, 1.0]
    assert [s[:2] for s in select_spans(scores, SENTENCES, 50, kernel=1, n_peaks=2, fill=False)] == [(0, 10), (20, 30)]
    assert [s[:2] for s in select_spans(scores, SENTENCES, 50, kernel=1, n_peaks=2)] == [(0, 10), (20, 30), (40, 50)]


def test_nms_matches_naive_greedy_reference_on_long_curve():
    """Thousands of local maxima, so the batched candidate ordering is exercised."""
    d = np.random.default_rng(3).random(6000) - 0.2
    radius = 3
    local_max = [t for t in range(len(d)) if d[t] > 0 and d[t] >= d[max(t - 1, 0)] and d[t] >= d[min(t + 1, 5999)]]
    expected, alive = [], set(local_max)
    while alive:
        best = max(alive, key=lambda t: (d[t], -t))
        expected.append(best)
        alive -= set(range(best - radius, best + radius + 1))
    assert len(local_max) > 1024
    assert peaks(d, n=None, radius=radius).tolist() == expected


@pytest.mark.parametrize("kernel", [1, 5, 8])
@pytest.mark.parametrize("given", [[0, 17, 40, 60], [17, 40], [17, 17, 40, 75]])  # ends implied, repeated, past n
def test_density_does_not_leak_across_segments(kernel, given):
    scores = np.random.default_rng(4).random(60)
    bounds = [0, 17, 40, 60]
    box = np.ones(kernel) / kernel
    expected = np.concatenate([np.convolve(scores[a:b], box, mode="same") for a, b in zip(bounds, bounds[1:])])
    np.testing.assert_allclose(density(scores, kernel, segment_bounds=np.array(given)), expected, atol=1e-6)


def test_density_with_segments_shorter_than_the_kernel():
    scores = np.random.default_rng(5).random(300)
    bounds = [0, 1, 3, 4, 9, 50, 52, 200, 203, 300]  # one-token and two-token documents among long ones
    for kernel in (2, 8, 48):
        box = np.ones(kernel) / kernel
        expected = np.concatenate([np.convolve(scores[a:b], box, mode="full")[(kernel - 1) // 2:][: b - a]
                                   for a, b in zip(bounds, bounds[1:])])
        np.testing.assert_allclose(density(scores, kernel, segment_bounds=np.array(bounds)), expected, atol=1e-6)


def test_spans_stay_inside_their_document():
    scores = np.zeros(30)
    scores[9] = 1.0  # last token of a document; [10, 20) is a removed document's empty range
    spans = select_spans(scores, np.array([0, 10, 20]), 25, kernel=8, segment_bounds=np.array([0, 10, 20, 30]))
    assert [s[:2] for s in spans] == [(0, 10)]


def test_nms_with_documents_matches_naive_greedy_reference():
    """Segment bounds: a candidate is a local maximum among the neighbours in its own document, and suppression stops
    at the document's bounds. Many short documents (one and two tokens among them), so edges are often peaks, and
    enough candidates for the batched ordering."""
    from endo_retrieval.scoring.select import iter_peaks

    rng = np.random.default_rng(6)
    n, radius = 5000, 3
    d = (rng.random(n) - 0.2).astype(np.float32)
    bounds = np.unique(np.concatenate(([0, 1, 3, 4, 6], rng.integers(0, n, 400), [n - 1, n])))
    seg = np.searchsorted(bounds, np.arange(n), side="right")
    lo, hi = bounds[seg - 1], bounds[seg]
    local_max = [t for t in range(n) if d[t] > 0 and (t == lo[t] or d[t] >= d[t - 1])
                 and (t == hi[t] - 1 or d[t] >= d[t + 1])]
    expected, alive = [], set(local_max)
    while alive:
        best = max(alive, key=lambda t: (d[t], -t))
        expected.append(best)
        alive -= set(range(max(best - radius, lo[best]), min(best + radius + 1, hi[best])))
    assert len(local_max) > 1024 and {0, n - 1} & set(expected)
    assert list(iter_peaks(d, radius, bounds)) == expected
