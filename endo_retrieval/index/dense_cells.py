"""The dense stage's cells (an inverted file over the passage vectors, from ANN_MIN passages): spherical k-means
centroids, each passage's nearest cell, and a question's scores over the passages of its PROBE nearest cells."""
from __future__ import annotations

import numpy as np

from endo_retrieval.threads import CORES, each

# cells searched per question, of about sqrt(passages) (1,000 at a million: 13% of the passages). 128 is the fewest
# measured whose recall@20 against the exact product reaches 0.98 at a million's 1,000 cells: 0.984 on real MiniLM
# embeddings, 0.999 on a synthetic million (16 had 0.846 and 0.956; `endo bench ann`, docs/scale.md)
PROBE = 128
PARALLEL_ROWS = 50_000  # probed passages from which the cells are scored in one part a core


class Cells:
    """An inverted file over one matrix of passage vectors: the passages of each cell (CSR) beside the cells'
    centroids. A question's scores are the exact cosines of the passages in its PROBE nearest cells, -inf for the
    rest (ranked last by the fusion, in corpus order). `ordered`: the matrix's rows in cell order (`rows`), saved
    beside it (`DenseVectors`), so that each probed cell is one contiguous slice read in place; without it the
    probed rows are gathered (a copy of 13% of the vectors a question at a million: 77 ms against 18 ms read in
    place, docs/scale.md)."""

    def __init__(self, centroids: np.ndarray, cells: np.ndarray, ordered: np.ndarray | None = None):
        self.centroids, self.ordered = centroids, ordered
        self.rows = np.argsort(cells, kind="stable").astype(np.int32)  # passages, cell by cell
        self.bounds = np.searchsorted(cells[self.rows], np.arange(len(centroids) + 1))

    @property
    def nbytes(self) -> int:
        """The memory the cells hold besides the vectors."""
        return self.rows.nbytes + self.bounds.nbytes + self.centroids.nbytes

    def nearest(self, query: np.ndarray, probe: int = PROBE) -> np.ndarray:
        return np.argsort(-(self.centroids @ query))[:probe]

    def scores(self, matrix: np.ndarray, query: np.ndarray, probe: int = PROBE, near: np.ndarray | None = None
               ) -> np.ndarray:
        near = self.nearest(query, probe) if near is None else near
        out = np.full(len(matrix), -np.inf)
        if self.ordered is not None:
            def score(cells: np.ndarray) -> None:
                for c in cells:
                    a, b = self.bounds[c], self.bounds[c + 1]
                    out[self.rows[a: b]] = self.ordered[a: b] @ query

            in_parts(score, near, self.bounds)
            return out
        rows = np.sort(np.concatenate([self.rows[self.bounds[c]: self.bounds[c + 1]] for c in near]))
        out[rows] = matrix[rows] @ query  # rows in order: the memory map is read front to back
        return out


class SavedCells:
    """The cells of a matrix that is some of the saved rows (`GatheredRows`: `kept`, the rows not removed since)
    followed by the rows added since: the saved ones scored through their cell-ordered copy (`Cells.ordered`), each
    written to its place in the matrix, the added ones through their own cells; the same scores as `Cells` over the
    whole matrix."""

    def __init__(self, saved: Cells, kept: np.ndarray, added: Cells | None):
        self.saved, self.n_kept, self.added = saved, len(kept), added
        place = np.full(len(saved.rows), -1, np.int64)  # each saved row's place in the matrix (-1: removed)
        place[kept] = np.arange(len(kept))
        self.places = place[saved.rows]  # in cell order, as the copy is

    @property
    def nbytes(self) -> int:
        return self.saved.nbytes + self.places.nbytes + (self.added.nbytes if self.added is not None else 0)

    def scores(self, matrix, query: np.ndarray, probe: int = PROBE) -> np.ndarray:
        saved = self.saved
        near = saved.nearest(query, probe)
        out = np.full(len(matrix), -np.inf)

        def score(cells: np.ndarray) -> None:
            for c in cells:
                a, b = saved.bounds[c], saved.bounds[c + 1]
                places, live = self.places[a: b], self.places[a: b] >= 0
                out[places[live]] = (saved.ordered[a: b] @ query)[live]

        in_parts(score, near, saved.bounds)
        if self.added is not None:
            out[self.n_kept:] = self.added.scores(matrix.extra, query, near=near)
        return out


def in_parts(score, near: np.ndarray, bounds: np.ndarray) -> None:
    """score(cells) over `near` split in one part a core, side by side where they hold PARALLEL_ROWS passages or
    more: a cell's product is too small for BLAS to spread over cores, and the parts write disjoint rows."""
    rows = int(np.sum(bounds[near + 1] - bounds[near]))
    parts = np.array_split(near, min(CORES, len(near))) if rows >= PARALLEL_ROWS else [near]
    each("cells", score, parts)


def ordered_by_cell(matrix, cells: np.ndarray, out: np.ndarray, batch: int = 65536) -> None:
    """Fill `out` (a matrix's shape) with the matrix's rows in cell order (`Cells.rows`), `batch` rows at a time."""
    rows = np.argsort(cells, kind="stable")
    for a in range(0, len(rows), batch):
        out[a: a + batch] = matrix[rows[a: a + batch]]


def nearest_cells(vectors: np.ndarray, centroids: np.ndarray, batch: int = 65536) -> np.ndarray:
    """Each vector's cell: the centroid of the highest cosine (int32), `batch` vectors at a time."""
    out = np.empty(len(vectors), np.int32)
    for a in range(0, len(vectors), batch):
        out[a: a + batch] = np.argmax(np.asarray(vectors[a: a + batch], np.float32) @ centroids.T, axis=1)
    return out


def spherical_kmeans(matrix: np.ndarray, k: int, rounds: int = 8, per_cell: int = 32, seed: int = 0
                     ) -> np.ndarray:
    """k unit centroids by spherical k-means (cosine) on a sample of `per_cell` x k rows; a cell left empty
    keeps its centroid."""
    rng = np.random.default_rng(seed)
    sample = np.asarray(matrix[np.sort(rng.choice(len(matrix), min(len(matrix), per_cell * k), replace=False))],
                        np.float32)
    centroids = sample[rng.choice(len(sample), k, replace=False)].copy()
    for _ in range(rounds):
        cell = nearest_cells(sample, centroids)
        sums = np.zeros_like(centroids)
        np.add.at(sums, cell, sample)
        norms = np.linalg.norm(sums, axis=1, keepdims=True)
        centroids = np.where(norms > 0, sums / np.maximum(norms, 1e-12), centroids).astype(np.float32)
    return centroids
