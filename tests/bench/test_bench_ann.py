"""`endo bench ann`'s measures on small random vectors: recall@k against the exact product, and the cells as the
index trains and searches them (probing every cell is the exact product; probing one of many is not)."""
from __future__ import annotations

import numpy as np


def unit(rows: int, dim: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((rows, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def clustered(rows: int, dim: int, centres: int, seed: int) -> np.ndarray:
    """Unit vectors around `centres` random directions, so cells have neighbourhoods to hold."""
    rng = np.random.default_rng(seed)
    x = unit(centres, dim, seed + 1)[rng.integers(0, centres, rows)] + 0.3 * unit(rows, dim, seed + 2)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_recall_counts_the_exact_top_and_its_ties():
    from endo_bench.ann import exact_top, recall, top_k

    matrix, queries, k = unit(500, 16, 0), unit(8, 16, 1), 10
    ids, scores = exact_top(matrix, queries, k, block=3)
    for q, row in zip(queries, ids):  # the blocked product's top is each question's own
        assert list(row) == list(top_k(matrix @ q, k))
    kth = scores[:, -1]
    assert recall(matrix, queries, list(ids), kth, k).tolist() == [1.0] * len(queries)
    half = [row[: k // 2] for row in ids]
    assert recall(matrix, queries, half, kth, k).tolist() == [0.5] * len(queries)
    assert recall(matrix, queries, [np.zeros(0, np.int64)] * len(queries), kth, k).tolist() == [0.0] * len(queries)
    below = [np.argsort(-(matrix @ q))[k: 2 * k] for q in queries]  # the next k: none of them
    assert recall(matrix, queries, below, kth, k).max() == 0.0
    twin = np.vstack([matrix, matrix[ids[0, -1]]])  # a duplicate of question 0's k-th: found instead, it counts
    found = [np.append(ids[0, :-1], len(matrix))]
    assert recall(twin, queries[:1], found, kth[:1], k).tolist() == [1.0]


def test_top_k_leaves_the_unscored_out():
    from endo_bench.ann import top_k

    scores = np.array([0.1, -np.inf, 0.5, -np.inf, 0.3])
    assert top_k(scores, 2).tolist() == [2, 4]
    assert top_k(scores, 4).tolist() == [2, 4, 0]


def test_cells_probing_every_cell_are_exact_and_one_cell_is_not():
    from endo_bench.ann import cells_found, exact_top, recall, train_cells

    matrix, queries, k = clustered(3000, 24, 40, 0), unit(40, 24, 7), 20
    _, scores = exact_top(matrix, queries, k)
    inverted, built = train_cells(matrix, 30)
    assert built["build_s"] >= built["kmeans_s"] > 0 and len(inverted.centroids) == 30
    found, scored = cells_found(inverted, matrix, queries, k, probe=30)
    assert recall(matrix, queries, found, scores[:, -1], k).tolist() == [1.0] * len(queries)
    assert np.allclose(scored, 1.0)
    found, scored = cells_found(inverted, matrix, queries, k, probe=1)
    one = recall(matrix, queries, found, scores[:, -1], k)
    assert one.mean() < 1.0 and scored.mean() < 0.2
    found, _ = cells_found(inverted, matrix, queries, k, probe=8)
    assert recall(matrix, queries, found, scores[:, -1], k).mean() >= one.mean()


def test_synthetic_copies_are_unit_and_as_near_as_the_noise_says():
    from endo_bench.ann import synthetic

    base = unit(200, 384, 3)
    c = 0.7
    noise = float(np.sqrt((1 / c - 1) / base.shape[1]))
    rows = synthetic(base, 1000, noise, seed=0, block=128)
    assert rows.shape == (1000, 384) and np.allclose(np.linalg.norm(rows, axis=1), 1, atol=1e-5)
    twins = (rows[:200] * rows[200:400]).sum(axis=1)  # two copies of each base row
    assert abs(np.median(twins) - c) < 0.03
