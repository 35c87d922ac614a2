"""Stage 1 of a corpus search: the candidates the model will read, found cheaply over every passage.

One home for every first stage, one protocol (`FirstStage.candidates`): BM25 over the passages' stems (the words a
question shares with its passage), a dense embedder's cosine (index/dense.py: what it says in other words), and both
fused by weighted reciprocal-rank fusion (`hybrid`, the default), the dense ranking weighing `share`:

    fused(p) = (1 - share) / (RRF_K + rank_bm25(p)) + share / (RRF_K + rank_dense(p))

(Cormack et al. 2009, weighted). The pipeline (methods/pipeline.py), the calibrations and the Ray shards ask this
module: a shard scores its own passages (`FirstStage.scores`) and the reader fuses the shards' heads with the same
`fused_heads` one process runs (distributed/first_stage.py); a new kind of first stage is one class here and one
line in `FIRST_STAGES`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from endo_retrieval.corpus import CorpusMap
from endo_retrieval.index.passages import Passages
from endo_retrieval.scoring.bm25 import words
from endo_retrieval.scoring.fusion import RRF_K
from endo_retrieval.threads import each

DEFAULT_FIRST_STAGE = "hybrid"


class Ranking(Protocol):
    """One way of scoring every passage for a question (higher is better). `embedding`: the question's embedding
    where it was computed already (the Ray reader sends the shards one, so that every shard compares the same)."""

    name: str

    def scores(self, corpus: CorpusMap, passages: Passages, question: str,
               embedding: np.ndarray | None = None) -> np.ndarray: ...


class BM25Ranking:
    """Okapi BM25 over the passages' stems (scoring/bm25.py)."""

    name = "bm25"

    def scores(self, corpus, passages, question, embedding=None):
        query = words(question)
        return passages.bm25.get_scores(query) if query else np.zeros(len(passages))


class DenseRanking:
    """The cosine of the question's embedding with each passage's (index/dense.py; -inf outside the cells searched
    where the index holds cells)."""

    name = "dense"

    def scores(self, corpus, passages, question, embedding=None):
        if getattr(passages, "vectors", None) is None:
            raise ValueError("This first stage needs the passages' embeddings, which this index does not hold (it was "
                             "built with first_stage='bm25'): call index.add_embeddings() and save it, or rebuild it; "
                             "first_stage='bm25' searches it as it is.")
        return passages.dense_scores(corpus, passages.dense.query(question) if embedding is None else embedding)


RANKINGS: dict[str, type] = {"bm25": BM25Ranking, "dense": DenseRanking}


def allowed_passages(corpus: CorpusMap, passages: Passages, where) -> np.ndarray | None:
    """The mask of passages whose document `where(metadata)` accepts (None: all of them)."""
    if where is None:
        return None
    accepted = np.array([bool(where(d.metadata)) for d in corpus.documents()] + [False])  # index -1: no document
    return accepted[corpus.locate(passages.starts)[0]]


@dataclass
class FirstStage:
    """Rankings fused by weighted reciprocal-rank fusion (`weights`: ranking name -> weight; one alone is that
    ranking). BM25's score of every candidate is kept beside, whatever the weights: the pipeline's fusion weighs it."""

    name: str
    weights: dict[str, float]

    @property
    def used(self) -> list[str]:
        """The rankings the fusion reads (weight above 0), in the weights' order."""
        return [name for name, w in self.weights.items() if w > 0]

    def scores(self, corpus: CorpusMap, passages: Passages, question: str,
               embedding: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """{ranking: every passage's score} for the rankings fused, and BM25's whatever the weights."""
        names = list(dict.fromkeys(["bm25", *self.used]))
        score = lambda name: RANKINGS[name]().scores(corpus, passages, question, embedding)  # noqa: E731
        return dict(zip(names, each("rankings", score, names, len(passages) >= PARALLEL_MIN)))

    def candidates(self, corpus: CorpusMap, passages: Passages, question: str, n: int,
                   where: Callable[[dict], bool] | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(the n best passages' indices, best first, ties in corpus order; {ranking: those passages' scores})."""
        scores = self.scores(corpus, passages, question)
        top = fused_top_of([(self.weights[name], scores[name]) for name in self.used], n,
                           allowed_passages(corpus, passages, where))
        out = {name: s[top] for name, s in scores.items()}
        if "dense" in out and not np.isfinite(out["dense"]).all():  # a candidate outside the cells searched
            exact = passages.vectors[top] @ passages.dense.query(question)
            out["dense"] = np.where(np.isfinite(out["dense"]), out["dense"], exact)
        return top, out


PARALLEL_MIN = 100_000  # passages from which the rankings are scored side by side, a thread each: both read
# memory for milliseconds (BM25's postings, the probed cells' vectors) and release the GIL while they do


# name -> the rankings' weights given the dense share (the hybrid's is fitted per model: `EndoPipeline.dense_share`)
FIRST_STAGES: dict[str, Callable[[float], dict[str, float]]] = {
    "hybrid": lambda share: {"bm25": 1.0 - share, "dense": share},
    "bm25": lambda share: {"bm25": 1.0},
    "dense": lambda share: {"dense": 1.0},
}
DENSE_SHARE = {"hybrid": 0.5, "bm25": 0.0, "dense": 1.0}  # where no fit says otherwise


def first_stage(name: str = DEFAULT_FIRST_STAGE, share: float | None = None) -> FirstStage:
    """The first stage called `name`; `share`: the hybrid's dense share (None: DENSE_SHARE)."""
    if name not in FIRST_STAGES:
        raise ValueError(f"Unknown first stage {name!r}; use one of {', '.join(FIRST_STAGES)}.")
    share = DENSE_SHARE.get(name, 0.5) if share is None else share  # a share matters to the rankings that read it
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"dense_share must be a share in [0, 1], got {share!r}.")
    return FirstStage(name, FIRST_STAGES[name](share))


HEAD_MIN = 1024  # each ranking's head holds at least this many passages when several are fused


def head_size(n: int, rankings: int) -> int:
    """How many of each ranking's best `fused_heads` starts from for the fused top n: n for one ranking alone, else
    m = max(HEAD_MIN, 4 n) > RRF_K + 2 n, so that the n-th fused score beats every passage outside the heads."""
    return n if rankings == 1 else max(HEAD_MIN, 4 * n)


def fused_top_of(rankings: list[tuple[float, np.ndarray]], n: int, keep: np.ndarray | None = None) -> np.ndarray:
    """`fused_top` over any number of (weight, scores) rankings."""
    allowed = None if keep is None else np.flatnonzero(keep)
    rankings = [(w, s if allowed is None else s[allowed]) for w, s in rankings if w > 0]
    size, weights = len(rankings[0][1]), [w for w, _ in rankings]
    m = head_size(n, len(rankings))
    if len(rankings) == 1:
        top = best_of(rankings[0][1], n) if size else np.zeros(0, np.int64)
    elif m >= size:
        top = fused_top_plain([s for _, s in rankings], weights, n)
    else:
        parallel = size >= PARALLEL_MIN  # each ranking's pool and head apart, side by side
        ranked = each("rankings", _Ranking, [s for _, s in rankings], parallel)
        top = fused_heads(weights, each("rankings", lambda r: r.best(m), ranked, parallel), n, m,
                          lambda asked: [ranked[r].rank(i) for r, i in asked])
        if top is None:  # not reached for m > RRF_K + 2n; kept as a guard
            top = fused_top_plain([s for _, s in rankings], weights, n)
    return top if allowed is None else allowed[top]


def best_of(scores: np.ndarray, m: int) -> np.ndarray:
    """`np.argsort(-scores, kind="stable")[:m]`: the m best passages, ties by position."""
    return _Ranking(scores).best(m)


def rank_in(scores: np.ndarray, value: float, before: int) -> int:
    """The rank a passage scored `value` at position `before` would have among `scores`: those scored higher and
    those tied before it (`_Ranking.rank`, for a passage elsewhere: a shard counts its part of a global rank)."""
    return int(np.count_nonzero(scores > value) + np.count_nonzero(scores[:max(0, before)] == value))


def fused_top(bm25: np.ndarray, dense: np.ndarray | None, share: float, n: int, keep: np.ndarray | None = None
              ) -> np.ndarray:
    """The `n` best passages by weighted reciprocal-rank fusion, (1 - share) / (RRF_K + BM25 rank) + share /
    (RRF_K + dense rank), ranks from 0 over every allowed passage, best first (ties: corpus order); share 0 or 1 is
    one ranking alone. `keep`: a mask of the passages allowed (ranked among themselves).

    The result is that of sorting both rankings whole (`fused_top_plain`, which a test holds it to), without the
    sorts, which took most of stage 1 at a million passages: only each ranking's best `m` are sorted, and a passage
    among them that is not among the other ranking's best gets its exact rank there by counting when it
    could reach the top n (threshold algorithm). A passage outside both heads scores at most 1 / (RRF_K + m)."""
    rankings = [(1.0 - share, bm25), (share, dense)] if dense is not None else [(1.0, bm25)]
    return fused_top_of(rankings, n, keep)


def fused_top_plain(scores: list[np.ndarray], weights: list[float], n: int) -> np.ndarray:
    """The definition: every ranking sorted whole, the fused scores sorted whole."""
    fused = np.zeros(len(scores[0]))
    for w, s in zip(weights, scores):
        rank = np.empty(len(s))
        rank[np.argsort(-s, kind="stable")] = np.arange(len(s))
        fused += w / (RRF_K + rank)
    return np.lexsort((np.arange(len(fused)), -fused))[:n]


class _Ranking:
    """One ranking's scores with the passages above its lowest score apart (`pool`, in corpus order): BM25 gives
    most passages 0 and the dense stage -inf where it did not look, so what is partitioned and counted is mostly
    that smaller pool (np.partition also crawls over many equal values)."""

    def __init__(self, s: np.ndarray):
        self.s, self.low = s, s.min()
        if np.count_nonzero(s == self.low) > 1:
            self.pool = np.flatnonzero(s > self.low)
            self.values = s[self.pool]
        else:  # no lowest score shared: the pool is every passage (NaN equals no score)
            self.low, self.pool, self.values = np.nan, np.arange(len(s)), s

    def best(self, m: int) -> np.ndarray:
        """`np.argsort(-s, kind="stable")[:m]` (the m best, ties by position) with a partition and a sort of m."""
        if m >= len(self.s):
            return np.argsort(-self.s, kind="stable")
        if len(self.pool) >= m:
            t = np.partition(self.values, len(self.pool) - m)[len(self.pool) - m]  # the m-th largest score
            above, ties = self.pool[self.values > t], self.pool[self.values == t]
        else:
            above, ties = self.pool, np.flatnonzero(self.s == self.low)
        best = np.concatenate([above, ties[: m - len(above)]])
        return best[np.lexsort((best, -self.s[best]))]

    def rank(self, i: int) -> int:
        """Passage i's rank: those scored higher, and those tied before it."""
        v, before = self.s[i], int(np.searchsorted(self.pool, i))
        if v == self.low:
            return len(self.pool) + i - before
        return int(np.count_nonzero(self.values > v) + np.count_nonzero(self.values[:before] == v))


def fused_heads(weights: list[float], heads: list[np.ndarray], n: int, m: int,
                ranks_of: Callable[[list[tuple[int, int]]], list[int]]) -> np.ndarray | None:
    """`fused_top_plain` from each ranking's best m (`heads`: passage indices, best first; shorter where the ranking
    holds fewer). A candidate's rank where it is outside a head is at least m, so its fused score is at most the sum
    with rank m there (`upper`); the candidates best by that bound get their missing ranks counted (`ranks_of`:
    [(ranking, passage)] -> ranks; one process counts in its arrays, the Ray reader asks the shards) until the n best
    are all exact, whose scores and order are then the plain ones: any other candidate's true score is at most its
    bound, and one outside every head at most the sum of w / (RRF_K + m) (< the n-th score when m > RRF_K + 2n, as
    the larger weight's own top n each score >= w / (RRF_K + n)). None where that bound does not hold."""
    cand = np.unique(np.concatenate(heads))
    rank = np.full((len(heads), len(cand)), -1.0)  # -1: outside that ranking's head, not counted yet
    for r, head in enumerate(heads):
        rank[r, np.searchsorted(cand, head)] = np.arange(len(head))
    while True:
        upper = np.zeros(len(cand))
        for w, ranks in zip(weights, rank):  # the plain path's sum, in its order: equal bit for bit
            upper += w / (RRF_K + np.where(ranks < 0, m, ranks))
        top = np.lexsort((cand, -upper))[:n]
        missing = [(r, i) for i in top for r in range(len(heads)) if rank[r, i] < 0]
        if not missing:
            break
        for (r, i), counted in zip(missing, ranks_of([(r, int(cand[i])) for r, i in missing])):
            rank[r, i] = counted
    outside = sum(w / (RRF_K + m) for w in weights)
    if len(top) == n and upper[top[-1]] <= outside:
        return None
    return cand[top]
