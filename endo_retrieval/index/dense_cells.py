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
    rest (ranked last by the fusion, in corpus order); `probed` gives those passages and their scores, `scores`
    every passage's. Here the probed rows are gathered from the matrix; `SavedCells` reads them in place."""

    def __init__(self, centroids: np.ndarray, cells: np.ndarray):
        self.centroids = centroids
        self.rows = np.argsort(cells, kind="stable").astype(np.int32)  # passages, cell by cell
        self.bounds = np.searchsorted(cells[self.rows], np.arange(len(centroids) + 1))

    @property
    def nbytes(self) -> int:
        """The memory the cells hold besides the vectors."""
        return self.rows.nbytes + self.bounds.nbytes + self.centroids.nbytes

    def nearest(self, query: np.ndarray, probe: int = PROBE) -> np.ndarray:
        return np.argsort(-(self.centroids @ query))[:probe]

    def probed(self, matrix, query: np.ndarray, probe: int = PROBE, near: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
        """(the passages of the cells nearest the question, their cosines)."""
        near = self.nearest(query, probe) if near is None else near
        rows = np.sort(np.concatenate([self.rows[self.bounds[c]: self.bounds[c + 1]] for c in near]))
        return rows, np.asarray(matrix[rows] @ query, np.float64)  # rows in order: the map is read front to back

    def scores(self, matrix, query: np.ndarray, probe: int = PROBE) -> np.ndarray:
        """Every passage's score: the probed ones' cosines, -inf for the rest."""
        rows, values = self.probed(matrix, query, probe)
        out = np.full(len(matrix), -np.inf)
        out[rows] = values
        return out


class SavedCells(Cells):
    """The cells of the saved rows read through their copy in cell order (`ordered`, saved beside the matrix by
    `DenseVectors`), each probed cell one contiguous slice: 18 ms against 77 ms gathered at a million
    (docs/scale.md). The matrix is the saved rows (`kept` None), or some of them (`GatheredRows`: `kept`, the rows
    not removed since) followed by the rows added since, which are scored through their own cells (`added`)."""

    def __init__(self, centroids: np.ndarray, cells: np.ndarray, ordered: np.ndarray,
                 kept: np.ndarray | None = None, added: Cells | None = None):
        super().__init__(centroids, cells)  # `cells`: each saved row's cell
        self.ordered, self.added = ordered, added
        self.n_kept = len(self.rows) if kept is None else len(kept)
        self.places = self.rows  # each row of the copy: its place in the matrix (-1: removed)
        if kept is not None:
            place = np.full(len(self.rows), -1, np.int64)
            place[kept] = np.arange(len(kept))
            self.places = place[self.rows]

    @property
    def nbytes(self) -> int:
        mine = self.places.nbytes if self.places is not self.rows else 0
        return super().nbytes + mine + (self.added.nbytes if self.added is not None else 0)

    def probed(self, matrix, query: np.ndarray, probe: int = PROBE, near: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
        near = self.nearest(query, probe) if near is None else near
        starts, ends = self.bounds[near], self.bounds[near + 1]
        at = np.concatenate(([0], np.cumsum(ends - starts)))  # each probed cell's place among the results
        rows = np.concatenate([self.places[a: b] for a, b in zip(starts, ends)] + [np.zeros(0, np.int64)])
        values = np.empty(len(rows))

        def score(cells: np.ndarray) -> None:  # each cell's slice of the copy, into its own slice of the results
            for i in cells:
                values[at[i]: at[i + 1]] = self.ordered[starts[i]: ends[i]] @ query

        in_parts(score, at)
        if self.n_kept < len(self.rows):  # removed rows
            live = rows >= 0
            rows, values = rows[live], values[live]
        if self.added is not None:
            more, scores = self.added.probed(matrix.extra, query, near=near)
            rows, values = np.concatenate([rows, more + self.n_kept]), np.concatenate([values, scores])
        return rows, values


def in_parts(score, at: np.ndarray) -> None:
    """score(cells) over the probed cells (`at`: where each one's results start, and their end) split in one part
    a core, side by side where they hold PARALLEL_ROWS passages or more: a cell's product is too small for BLAS to
    spread over cores, and the parts write disjoint results."""
    cells = np.arange(len(at) - 1)
    parts = np.array_split(cells, min(CORES, len(cells))) if at[-1] >= PARALLEL_ROWS else [cells]
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
