"""Stage 1 of the `endo` pipeline over shards, the same first stage one process runs (index/first_stage.py).

Each shard scores its own passages (`FirstStage.scores`: BM25 with the whole index's statistics, the cosine of the
question with each passage's embedding) and keeps the scores while the question is open. The reader merges each
ranking's head (the m best of every shard hold the m best of the whole) and fuses them with `fused_heads`, as one
process does, asking the shards to count the ranks it lacks (a passage's rank is the sum of each shard's count of
those above it); then the shards that hold the winners send their scores and what the model reads of them. The
candidates, their order and scores are one process's over the same corpus (a test). Passages are numbered as one
process numbers them: the shards hold contiguous runs in position order, so a passage's number is its number on its
shard plus the passages (those `where` accepts) of the shards before it.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, replace

import numpy as np

from endo_retrieval.core import Span
from endo_retrieval.distributed.cluster import ray_cluster
from endo_retrieval.index.first_stage import FirstStage, allowed_passages, best_of, fused_heads, head_size, rank_in
from endo_retrieval.index.passages import passage_span
from endo_retrieval.scoring.bm25 import words


class PassageShard:
    """A shard's side of stage 1 and of the hits (mixed into `Shard`, which holds `corpus`, `passages` with their
    embeddings, `shift` and `questions`)."""

    def embedder(self) -> str | None:
        """The embedder of this shard's passages, None where they have no embeddings."""
        return self.dense.embedder if self.dense is not None else None

    def stage_one_heads(self, qid: str, stage: FirstStage, question: str, where, m: int,
                        embedding: np.ndarray | None = None) -> dict:
        """Score every passage here for `stage` (kept under `qid`; `embedding`: the question's, the same for every
        shard); send each fused ranking's best m, and every ranking's score of the passages in those heads. Indices
        count the passages `where` accepts."""
        scores = stage.scores(self.corpus, self.passages, question, embedding)
        keep = allowed_passages(self.corpus, self.passages, where)
        allowed = np.arange(len(self.passages)) if keep is None else np.flatnonzero(keep)
        scores = {name: s[allowed] for name, s in scores.items()}
        self.questions[qid] = (allowed, scores)
        heads = {name: best_of(scores[name], m) if len(allowed) else np.zeros(0, np.int64) for name in stage.used}
        known = np.unique(np.concatenate([np.zeros(0, np.int64), *heads.values()]))
        return {"size": len(allowed), "heads": heads, "known": known,
                "scores": {name: s[known] for name, s in scores.items()}}

    def stage_one_ranks(self, qid: str, asked: list[tuple[str, float, int]]) -> list[int]:
        """For each (ranking, score, position): this shard's share of that passage's rank, its passages scored
        higher and those tied before the position (a position past this shard's counts all of them)."""
        _, scores = self.questions[qid]
        return [rank_in(scores[name], value, before) for name, value, before in asked]

    def stage_one_picks(self, qid: str, picks: list[int], settings, question: str) -> dict:
        """The candidates `picks` (indices among the accepted passages): their passage here, global start, every
        ranking's score and what the model reads of them (`settings`: the reader's pipeline without its model)."""
        allowed, scores = self.questions[qid]
        top = allowed[np.asarray(picks, np.int64)]
        return {"passages": top, "starts": self.passages.starts[top] + self.shift,
                "scores": {name: s[picks] for name, s in scores.items()},
                "texts": settings.read_texts(self.corpus, self.passages, top, question)}

    def stage_one_close(self, qid: str) -> None:
        self.questions.pop(qid, None)

    def passage_hits(self, picks: list[tuple[int, float, dict]], question: str, budget: int | None, k: int,
                     sources: tuple[str, ...], ms: dict) -> list[Span]:
        """The passages `picks` ((passage here, fused score, stage scores)) as hits, made as one process makes them
        (`passage_span`), positions global."""
        q = set(words(question))
        return [_shifted(passage_span(self.corpus, self.passages, int(i), score, q, budget, k, sources,
                                      stage_scores=stage, stage_ms=dict(ms)), self.shift) for i, score, stage in picks]


def _shifted(span: Span, shift: int) -> Span:
    return replace(span, start=span.start + shift, end=span.end + shift)


@dataclass
class Candidates:
    """Stage 1's candidates over shards, best first: the shard holding each, its passage there, its global start,
    each ranking's score ({"bm25": ..., "dense": ...}) and what the model reads of it."""

    shards: np.ndarray
    passages: np.ndarray
    starts: np.ndarray
    scores: dict[str, np.ndarray]
    texts: list[str]

    def __len__(self) -> int:
        return len(self.passages)


def sharded_candidates(shards: list, stage: FirstStage, question: str, n: int, where, settings,
                       embedding: np.ndarray | None = None, head: int | None = None) -> Candidates:
    """`stage.candidates(corpus, passages, question, n, where)` of one process, over the `shards` (Shard actors in
    position order). `embedding`: the question's, computed once for all shards (None: each embeds it, and the last
    bits of a cosine may then differ between shards, which reorders passages of equal text). `head`: each ranking's
    head size (None: `head_size`, one process's; a test asks smaller)."""
    ray, qid = ray_cluster(), uuid.uuid4().hex
    m = head or head_size(n, len(stage.used))
    try:
        got = ray.get([s.stage_one_heads.remote(qid, stage, question, where, m, embedding) for s in shards])
        offsets = np.cumsum([0] + [g["size"] for g in got])
        top = _fused_top(shards, qid, stage, got, offsets, n, m)
        owner = np.searchsorted(offsets, top, side="right") - 1
        asked = {int(o): shards[o].stage_one_picks.remote(qid, (top[owner == o] - offsets[o]).tolist(), settings,
                                                          question) for o in dict.fromkeys(owner.tolist())}
        picks = dict(zip(asked, ray.get(list(asked.values()))))
    finally:
        for s in shards:
            s.stage_one_close.remote(qid)
    order = np.argsort(np.argsort(owner, kind="stable"), kind="stable")  # top's order from the owners' groups
    grouped = [picks[o] for o in sorted(picks)]
    joined = lambda key: np.concatenate([p[key] for p in grouped] or [np.zeros(0, np.int64)])[order]  # noqa: E731
    names = list(grouped[0]["scores"]) if grouped else []
    texts = [t for p in grouped for t in p["texts"]]
    return Candidates(owner, joined("passages"), joined("starts"),
                      {name: np.concatenate([p["scores"][name] for p in grouped])[order] for name in names},
                      [texts[i] for i in order])


def _fused_top(shards: list, qid: str, stage: FirstStage, got: list[dict], offsets: np.ndarray, n: int,
               m: int) -> np.ndarray:
    """The fused top n's global indices: each ranking's merged head, then `fused_heads` with the ranks it lacks
    counted on every shard."""
    names = stage.used
    known = np.concatenate([g["known"] + offsets[s] for s, g in enumerate(got)])
    value = {name: np.concatenate([g["scores"][name] for g in got]) for name in names}
    heads = []
    for name in names:
        index = np.concatenate([g["heads"][name] + offsets[s] for s, g in enumerate(got)])
        scores = value[name][np.searchsorted(known, index)]
        heads.append(index[np.lexsort((index, -scores))][:m])
    if len(names) == 1:
        return heads[0][:n]

    def ranks_of(asked: list[tuple[int, int]]) -> list[int]:
        queries = [(names[r], float(value[names[r]][np.searchsorted(known, i)]), i) for r, i in asked]
        counts = ray_cluster().get([shard.stage_one_ranks.remote(qid, [(name, v, i - int(offsets[s]))
                                                                      for name, v, i in queries])
                                    for s, shard in enumerate(shards)])
        return np.sum(counts, axis=0).astype(int).tolist()

    top = fused_heads([stage.weights[name] for name in names], heads, n, m, ranks_of)
    if top is None:  # m > RRF_K + 2n (head_size) rules it out
        raise RuntimeError(f"the fused top {n} is not exact from heads of {m}; ask for larger heads")
    return top
