"""An index opened as shards: `Shard` actors each holding a contiguous run of its segments, answering with the
whole index's statistics; `ShardedIndex` merges their answers into one index's (S3 and BM25 over sentences here,
the pipeline's stage 1 over passages in `first_stage.py`)."""
from __future__ import annotations

import heapq
import os
import uuid
from collections import deque
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from endo_retrieval.core import Span, check_budget
from endo_retrieval.distributed.cluster import ray_cluster
from endo_retrieval.distributed.first_stage import PassageShard
from endo_retrieval.index import segments
from endo_retrieval.index.inverted import FeatureIndex
from endo_retrieval.methods import METHODS, SEARCH_METHODS, check_search_method, method_class
from endo_retrieval.methods.s3 import interleave, peak_width, scored_spans
from endo_retrieval.methods.search import EndoIndex
from endo_retrieval.methods.searcher import best_spans, check_search_k
from endo_retrieval.model.backbone import as_text
from endo_retrieval.index.passages import Passages
from endo_retrieval.scoring.bm25 import SentenceBM25
from endo_retrieval.scoring.select import QA_KERNEL, density, enclosing, ranked_peaks, runs

PEAK_BATCH = 64  # peaks a shard sends per signal and round trip (a budget of 512 tokens takes ~10-30)

class _WholeIndexStats(FeatureIndex):
    """A shard's postings scored with the whole index's freq(f) and token counts ([S3 Eq. 10]'s IDF, stop features)."""

    def freq(self, layer: int) -> np.ndarray:
        return self.totals["freq"][layer]

    def n_tokens(self, layer: int) -> int:
        return self.totals["n_tokens"][layer]


def _okapi_stats(postings) -> dict:
    """What rank-bm25 needs of one shard to compute the whole corpus's idf and mean length: document frequencies
    in first-seen order (its idf average sums in that order), the number of documents and of words."""
    df = np.diff(postings.indptr)
    return {"df": {t: int(df[r]) for t, r in postings.terms.items()}, "n": postings.okapi.corpus_size,
            "words": int(sum(postings.okapi.doc_len)), "epsilon": postings.okapi.epsilon}


def _okapi_totals(parts: list[dict]) -> dict:
    from rank_bm25 import BM25Okapi

    df: dict[str, int] = {}
    for p in parts:  # shards in position order: first-seen order of the union
        for t, c in p["df"].items():
            df[t] = df.get(t, 0) + c
    whole = BM25Okapi.__new__(BM25Okapi)
    whole.corpus_size, whole.epsilon, whole.idf = sum(p["n"] for p in parts), parts[0]["epsilon"], {}
    whole._calc_idf(df)  # rank-bm25's own code, on the union's counts
    return {"idf": whole.idf, "avgdl": sum(p["words"] for p in parts) / whole.corpus_size}


def _use_okapi_totals(postings, whole: dict) -> None:
    """Score one shard's BM25 postings with the whole corpus's idf and mean length (`_okapi_totals`)."""
    okapi = postings.okapi
    okapi.idf, okapi.avgdl = whole["idf"], whole["avgdl"]
    doc_len = np.asarray(okapi.doc_len, dtype=np.float64)
    postings.norm = okapi.k1 * (1 - okapi.b + okapi.b * doc_len / okapi.avgdl)


class Shard(PassageShard):
    """Some of an index's segments in one process, answering with the whole index's statistics: S3 and BM25 over
    sentences (`open`, `more`), and the `endo` pipeline's stage 1 over passages, with their embeddings where the
    segments hold them (`PassageShard`)."""

    def __init__(self, directory: str, parts: list[dict], shift: int, prune: float | None):
        self.index, self.corpus = segments.load_parts(directory, parts)
        self.dense = segments.load_dense(directory, parts)
        self.shift, self.prune, self.streams, self._bm25, self._passages = shift, prune, {}, None, None
        self.questions: dict[str, tuple] = {}  # stage 1's scores of the questions open here

    @property
    def bm25(self):
        if self._bm25 is None:
            self._bm25 = SentenceBM25.build(self.corpus)
        return self._bm25

    @property
    def passages(self) -> Passages:
        """This shard's passages, each with its embedding where the segments hold them (compared with every
        passage: the cells of one process's index are not sharded)."""
        if self._passages is None:
            self._passages = Passages.build(self.corpus)
            if self.dense is not None:
                self._passages.dense = self.dense
                self._passages.vectors = self.dense.matrix([d.doc_id for d in self.corpus.documents()])
        return self._passages

    def stats(self) -> dict:
        return {"embedder": self.dense.embedder if self.dense is not None else None,
                "freq": {l: self.index.freq(l) for l in self.index.layers},
                "n_tokens": {l: self.index.n_tokens(l) for l in self.index.layers},
                "bm25": {k: _okapi_stats(getattr(self.bm25, k)) for k in ("sentences", "windows")}
                | {"passages": _okapi_stats(self.passages.bm25)}}

    def use_totals(self, totals: dict) -> None:
        self.index.__class__, self.index.totals = _WholeIndexStats, totals
        for k in ("sentences", "windows"):
            _use_okapi_totals(getattr(self.bm25, k), totals["bm25"][k])
        _use_okapi_totals(self.passages.bm25, totals["bm25"]["passages"])

    def open(self, qid: str, features, question: str, signals: list[str], kernel: int) -> dict:
        """Score the question here, and start one peak stream per signal; returns their first batches."""
        n, bounds = self.corpus.n_positions, self.corpus.segment_bounds()
        sentences = self.corpus.sentence_starts()
        streams = {}
        for name in signals:
            scores = self.index.score(features, n_positions=n, prune=self.prune) if name == "s3" else \
                self.bm25.token_scores(question)
            width = peak_width(name, kernel)
            curve = density(scores, width, bounds)
            streams[name] = self._records(ranked_peaks(curve, width, bounds), sentences, bounds, n, curve)
        self.streams[qid] = streams
        return self.more(qid)

    def _records(self, peaks, sentences, bounds, n, curve) -> Iterator[tuple]:
        """(-density, candidate, centre, sentence start, sentence end, document start, document end), global."""
        for c, p in peaks:
            start, end = enclosing(sentences, p, n)
            doc_start, doc_end = enclosing(bounds, p, n)
            yield (-float(curve[c]), c, p, max(start, doc_start), min(end, doc_end), doc_start, doc_end)

    def more(self, qid: str, names: list[str] | None = None, batch: int = PEAK_BATCH) -> dict:
        out = {}
        for name in names or list(self.streams[qid]):
            got = [r for _, r in zip(range(batch), self.streams[qid][name])]
            out[name] = ([(r[0],) + tuple(v + self.shift for v in r[1:]) for r in got], len(got) < batch)
        return out

    def close(self, qid: str) -> None:
        self.streams.pop(qid, None)

    def span(self, a: int, b: int) -> tuple:
        doc_id, c0, c1, text = self.corpus.span_text(a - self.shift, b - self.shift)
        return doc_id, c0, c1, text, self.corpus.doc(doc_id).metadata


class ShardedIndex:
    """A committed index (`RayIndexer`) opened as `shards` actors, each holding a contiguous run of its segments.
    `select` and `search` answer as `EndoIndex.load(directory)` would, spans and ranking alike (a test), for the
    methods the shards answer alone (`methods`); `endo` needs the model's readers: `ReaderPool(this index)`.
    `backbone`, `saes`: the question's encoder for S3, loaded only for an index that holds S3 postings. A
    `Searcher` for those methods."""

    def __init__(self, directory: str | os.PathLike, shards: int = 2, backbone=None, saes=None,
                 int8_queries: bool | None = None):
        ray = ray_cluster()
        parts = segments.listed_committed(directory)
        if not parts:
            raise ValueError(f"{directory} holds no index of segments; build it with RayIndexer "
                             "(`endo index --ray`), or open a plain index with EndoIndex.load")
        head = parts[0]["header"]
        self.directory, self.method, self.prune = Path(directory), head["method"], head.get("prune")
        self.model, self.model_hash = head["model"], head["model_hash"]
        self.encoder = None  # the question's encoder for S3: the model and SAEs, no postings (encoded once, here)
        if METHODS[self.method].saes:
            self.encoder = EndoIndex(backbone, self.method, saes=saes, chunk_size=head["chunk_size"],
                                     prune=self.prune, int8_queries=int8_queries)
            if self.encoder.backbone.model_hash != self.model_hash:
                raise ValueError(f"The index in {directory} was built with model {self.model}, not with the loaded "
                                 f"{self.encoder.backbone.model_id}; load that model.")
        runs_ = shares_of(parts, shards)
        shifts = np.cumsum([0] + [sum(p["positions"] for p in run) for run in runs_])[:-1]
        actor = ray.remote(Shard)
        self.shards = [actor.remote(str(directory), run, int(shift), self.prune) for run, shift in zip(runs_, shifts)]
        stats = ray.get([s.stats.remote() for s in self.shards])
        layers = list(stats[0]["freq"])
        totals = {"freq": {l: sum(s["freq"][l] for s in stats) for l in layers},
                  "n_tokens": {l: sum(s["n_tokens"][l] for s in stats) for l in layers},
                  "bm25": {k: _okapi_totals([s["bm25"][k] for s in stats])
                           for k in ("sentences", "windows", "passages")}}
        ray.get([s.use_totals.remote(totals) for s in self.shards])
        embedders = {s["embedder"] for s in stats}
        # the passages' embedder where every shard holds embeddings (the hybrid stage 1), else None (BM25's)
        self.embedder = embedders.pop() if len(embedders) == 1 else None

    @property
    def methods(self) -> tuple[str, ...]:
        """The methods the shards answer alone: S3's where the index holds its postings, and BM25."""
        return tuple(m for m in SEARCH_METHODS if not METHODS[m].passages
                     and (METHODS[self.method].saes or not METHODS[m].saes))

    def check_method(self, method: str | None) -> str:
        """`method` (None: the index's own) when the shards answer it alone, else a ValueError saying what does."""
        method = check_search_method(method or self.method)
        if METHODS[method].passages:
            raise ValueError(f"{method!r} ranks passages with the model: open readers over this index, "
                             "ReaderPool(index) (endo_retrieval.distributed_pipeline), and search there.")
        if method not in self.methods:
            raise ValueError(f"This index was built with method={self.method!r} and holds no S3 feature postings, so "
                             f"it cannot search with {method!r}; it searches with {', '.join(self.methods)}.")
        return method

    def select(self, question: str, budget: int, method: str | None = None, kernel: int = QA_KERNEL,
               s3_share: float = 0.5) -> list[Span]:
        """`EndoIndex.select` over the shards (lead_tail 0, as `search` uses it)."""
        ray = ray_cluster()
        check_budget(budget)
        method, question, qid = self.check_method(method), as_text(question), uuid.uuid4().hex
        signals = list(method_class(method).signals)  # in the order the method fuses them
        features = self.encoder.query_features(question) if "s3" in signals else None
        first = ray.get([s.open.remote(qid, features, question, signals, kernel) for s in self.shards])
        try:
            records: dict[int, tuple] = {}
            streams = {name: self._merged(qid, name, [f[name] for f in first], records) for name in signals}
            taken: list[tuple[str, int]] = []
            peaks = interleave(streams, taken, s3_share, lambda p: records[p][1])  # the sentence's start
            spans = _fill(peaks, records, budget)
        finally:
            for s in self.shards:
                s.close.remote(qid)
        texts = ray.get([self.shards[self._owner(records, a)].span.remote(a, b) for a, b in spans])
        return scored_spans(spans, texts, taken)

    def search(self, question: str, k: int = 4, budget: int | None = None, method: str | None = None,
               where: Callable[[dict], bool] | None = None, depth: int | None = None,
               read_tokens: int | None = None, first_stage: str | None = None) -> list[Span]:
        """`EndoIndex.search` for the methods the shards answer alone (`methods`), which read no candidates."""
        check_search_k(k)
        self.pipeline(method or self.method, depth, read_tokens, first_stage)
        return best_spans(self.select(question, budget or 128 * k, method), k, where)

    def pipeline(self, method: str = "endo", depth: int | None = None, read_tokens: int | None = None,
                 first_stage: str | None = None) -> None:
        """The shards alone serve no pipeline: `endo` is a ValueError naming `ReaderPool`, and so are the
        pipeline's options for another method."""
        method = self.check_method(method)
        if (depth, read_tokens, first_stage) != (None, None, None):
            raise ValueError(f"depth, read_tokens and first_stage tune the endo pipeline; {method!r} reads no "
                             "candidates.")

    def _merged(self, qid: str, name: str, firsts: list, records: dict) -> Iterator[int]:
        """One signal's peaks over all shards, in the order NMS takes them over the union: (density desc, position
        asc) of their candidates; a shard whose batch runs out is asked for the next one."""
        buffers = [(deque(got), done) for got, done in firsts]
        heap: list[tuple] = []

        def refill(i: int) -> None:
            got, done = buffers[i]
            while not got and not done:
                more, done = ray_cluster().get(self.shards[i].more.remote(qid, [name]))[name]
                got.extend(more)
                buffers[i] = (got, done)
            if got:
                heapq.heappush(heap, (got[0][0], got[0][1], i))

        for i in range(len(buffers)):
            refill(i)
        while heap:
            *_, i = heapq.heappop(heap)
            rec = buffers[i][0].popleft()
            records[rec[2]] = rec[2:] + (i,)  # centre -> (centre, sentence start, end, doc start, doc end, shard)
            refill(i)
            yield rec[2]

    def _owner(self, records: dict, a: int) -> int:
        return next(r[5] for r in records.values() if r[3] <= a < r[4])


def shares_of(parts: list[dict], n: int) -> list[list[dict]]:
    """Contiguous runs of segments, about equal in tokens (at most one run per segment)."""
    n = max(1, min(n, len(parts)))
    ends = np.cumsum([p["tokens"] for p in parts])
    cuts = np.unique(np.clip(np.searchsorted(ends, ends[-1] * np.arange(1, n) / n) + 1, 1, len(parts) - 1))
    return [list(r) for r in np.split(np.array(parts, dtype=object), cuts if len(parts) > 1 else []) if len(r)]


def _fill(peaks: Iterator[int], records: dict, budget: int) -> list[tuple[int, int]]:
    """`select.spans_from_peaks` over the merged peaks, with sentences known only where peaks fell: each peak's
    sentence (clipped to its document) is added, the one that overflows trimmed around the peak to what is left."""
    covered, bounds, left = set(), set(), budget
    for p in peaks:
        _, start, end, doc_start, doc_end, _ = records[p]
        bounds |= {doc_start, doc_end}
        new = np.array([t for t in range(start, end) if t not in covered], dtype=np.int64)
        if len(new) > left:
            new = new[np.argsort(np.abs(new - p), kind="stable")[:left]]
        covered.update(new.tolist())
        left -= len(new)
        if left <= 0:
            break
    return runs(np.array(sorted(covered), dtype=np.int64), breaks=np.array(sorted(bounds), dtype=np.int64))

