"""The default pipeline `endo` past one GPU, on Ray: stage 1 on the shards of a `ShardedIndex`, stage 2 on readers.

* Stage 1 lives where the corpus lives: each `Shard` (a CPU actor holding a contiguous run of the index's segments)
  ranks its own passages by BM25 with the whole index's statistics (document frequencies, mean length, number of
  passages, gathered once when the index opens) and sends back its best `depth`, with what the model reads of each;
  the best `depth` of those are the candidates one index would have found, in the same order with the same scores.
* Stage 2 runs on `Reader`s, one actor per GPU (per CPU slot without one), each loading the model once. A reader
  takes a whole question: it asks every shard for candidates, reads them as one context and ranks them with the
  calibrated retrieval heads as `EndoPipeline.search` does on one process, then asks the shards that own the k
  best for their text. Readers never talk to each other, so questions spread over them: `ReaderPool.search_many`
  keeps `calls_per_reader` questions in flight per reader (a threaded actor: one question's stage 1 and texts
  travel while another's read holds the model), handing the next question to whichever reader finishes first.
* `ReaderPool` has `EndoIndex.search`'s signature, methods and checks, so the LlamaIndex `EndoRetriever(pool)` and
  LangChain's `EndoRetriever.from_index(pool)` retrieve through it as through one index. Other methods (`bm25`,
  and `s3`/`s3-hybrid` where the index holds S3 postings) go to the `ShardedIndex`. It is read-only: documents are
  added by `RayIndexer(...).build(DIR, docs, append=True)` and the index opened again.

Plain actors, not Ray Serve: a question is one call to one reader and a fan-out to the shards, which needs no HTTP
layer or autoscaler; `ReaderPool.search` can be wrapped in a Serve deployment unchanged.
"""
from __future__ import annotations

import contextlib
import copy
import itertools
import time
from typing import Callable, Sequence

import numpy as np

from endo_retrieval.distributed import ModelRecipe, ShardedIndex, ray_cluster, spread, start_workers
from endo_retrieval.index.engine import unicode_text
from endo_retrieval.methods import PIPELINE_METHODS, check_search_method
from endo_retrieval.core import Span, capped_question, check_budget
from endo_retrieval.methods.pipeline import EndoPipeline
from endo_retrieval.scoring.fusion import fuse
from endo_retrieval.model.backbone import as_text

SERVED = ("endo",)  # the pipelines readers serve; endo-2hop's second hop asks BM25 again mid-read (not yet here)


class Reader:
    """Stage 2 of `endo` on one accelerator: the model, loaded once by `setup()` (a `ModelRecipe`), reads each
    question's candidates, which it asks the shards for, and its calibrated heads rank them."""

    def __init__(self, setup: Callable, shards: list):
        self.backbone, _ = setup()
        self.shards, self.pipelines = shards, {}

    def model_hash(self) -> str:
        return self.backbone.model_hash

    def pipeline(self, depth: int | None = None, read_tokens: int | None = None):
        """The EndoPipeline `EndoIndex.pipeline("endo", depth, read_tokens)` makes for this model, made once."""
        key = (depth, read_tokens)
        if key not in self.pipelines:
            # the shards hold BM25 only: the dense stage is not sharded (yet), so the Ray reader reads BM25's candidates
            self.pipelines[key] = EndoPipeline(self.backbone, depth=depth, read_tokens=read_tokens, first_stage="bm25")
        return self.pipelines[key]

    def settings(self, depth: int | None = None, read_tokens: int | None = None):
        """The pipeline without its model (its settings resolved from the model's profile): what the shards run
        stage 1 with, and what a caller reads `depth` from."""
        settings = copy.copy(self.pipeline(depth, read_tokens))
        settings.backbone = None
        return settings

    def search(self, question: str, k: int, budget: int | None = None, where=None, depth: int | None = None,
               read_tokens: int | None = None) -> list[Span]:
        """`EndoPipeline.search` (first hop) with stage 1 on the shards: the same spans, scores and stage scores."""
        ray, pipeline, settings = ray_cluster(), self.pipeline(depth, read_tokens), self.settings(depth, read_tokens)
        t0 = time.perf_counter()
        asked = [s.passage_candidates.remote(settings, question, where) for s in self.shards]
        # one index's stage 1 keeps its best `depth` by (score desc, position asc); each shard sent its own best
        top = sorted((c + (shard,) for shard, cs in enumerate(ray.get(asked)) for c in cs), key=lambda c: c[:2])
        top = top[: pipeline.depth]
        if not top:  # no document passes `where`
            return []
        t1 = time.perf_counter()
        _, signals, ms, _ = given_stage_one(pipeline, -np.array([c[0] for c in top]), [c[3] for c in top]
                                            ).first_hop(None, None, question)
        ms["first_stage"] = 1000 * (t1 - t0)  # the shards' round trip
        # as `EndoPipeline.search` ranks: fused stage scores, ties in stage 1's order
        fused = fuse(signals, pipeline.weights)
        rank = np.lexsort((np.arange(len(top)), -fused))[:k]
        picks: dict[int, list[int]] = {}
        for r in rank:
            picks.setdefault(top[r][4], []).append(int(r))
        cut = None if budget is None else max(1, budget // k)
        asked = [self.shards[shard].passage_spans.remote([top[r][2] for r in rs], question, cut)
                 for shard, rs in picks.items()]
        got = {r: part for rs, parts in zip(picks.values(), ray.get(asked)) for r, part in zip(rs, parts)}
        ms["total"] = 1000 * (time.perf_counter() - t0)
        used = tuple(s for s, w in pipeline.weights.items() if w)
        spans = []
        for r in rank:
            start, end, c0, c1, text, doc_id, metadata, whole = got[int(r)]
            stage = {name: round(float(s[r]), 6) for name, s in signals.items()} | {"fused": float(fused[r])}
            spans.append(Span(start, end, c0, c1, text, float(fused[r]), used, doc_id, metadata, stage_scores=stage,
                              stage_ms=dict(ms), whole_document=whole))
        return spans


def given_stage_one(pipeline, bm25: np.ndarray, texts: list[str]):
    """A copy of `pipeline` whose stage 1 is given (the candidates' BM25 scores, best first, and what the model reads
    of each): its `first_hop` then reads and scores them exactly as on one process, whatever its read does."""
    given = copy.copy(pipeline)
    given.candidates = lambda *_, **__: (np.arange(len(bm25)), {"bm25": bm25})
    given.read_texts = lambda corpus, passages, top, question: [texts[i] for i in top]
    return given


class ReaderPool:
    """An index served by Ray: `EndoIndex.search` over a `ShardedIndex` (stage 1, and the methods its shards answer
    alone) and `readers` (stage 2 of `endo`: a list of `Reader` actors, or how many to start, default one per GPU,
    else per CPU slot, each loading `setup`, a `ModelRecipe` of the model the index was built with).
    `search` answers one question; `search_many` spreads many over the readers, `calls_per_reader` in flight each.
    Hits equal `EndoIndex.load(directory).search` on one process (a test), scores up to float rounding."""

    def __init__(self, index: ShardedIndex, readers: list | int | None = None, setup: Callable | None = None,
                 calls_per_reader: int = 2):
        if not isinstance(index, ShardedIndex):
            raise ValueError(f"ReaderPool serves a ShardedIndex (endo_retrieval.distributed), got "
                             f"{type(index).__name__}; open the index folder with ShardedIndex(DIR, shards=N) first.")
        if isinstance(calls_per_reader, bool) or not isinstance(calls_per_reader, int) or calls_per_reader < 1:
            raise ValueError(f"calls_per_reader must be a whole number >= 1, got {calls_per_reader!r}.")
        self.index, self.calls_per_reader, self._turn = index, calls_per_reader, itertools.count()
        self.readers = readers if isinstance(readers, list) else start_workers(
            readers, setup or ModelRecipe(), Reader, index.shards, max_concurrency=calls_per_reader)
        if not self.readers:
            raise ValueError("ReaderPool needs at least one reader.")
        hashes = _get([r.model_hash.remote() for r in self.readers])
        if any(h != index.model_hash for h in hashes):
            raise ValueError(f"The index in {index.directory} was built with model {index.model} "
                             f"({index.model_hash[:12]}); the readers load another ({hashes[0][:12]}): give them "
                             "that model, ReaderPool(index, setup=ModelRecipe(PATH)).")
        self._settings: dict = {}

    @property
    def method(self) -> str:
        return self.index.method

    @property
    def methods(self) -> tuple[str, ...]:
        return SERVED + self.index.methods

    def check_method(self, method: str | None) -> str:
        """`method` (None: the index's own) when the pool serves it, else a ValueError naming those it does."""
        method = check_search_method(method or self.index.method)
        if method not in self.methods:
            why = " (its second hop asks the index again mid-read; use endo, or EndoIndex on one process)" \
                if method in PIPELINE_METHODS else ""
            raise ValueError(f"This sharded index cannot search with {method!r}{why}; it searches with "
                             f"{', '.join(self.methods)}.")
        return method

    def pipeline(self, method: str = "endo", depth: int | None = None, read_tokens: int | None = None):
        """The pipeline's settings (`depth`, `read_tokens`, ...; no model), as `EndoIndex.pipeline` resolves them
        from the model's profile; a bad `depth` or `read_tokens` is a ValueError."""
        self.check_method(method)
        key = (depth, read_tokens)
        if key not in self._settings:
            self._settings[key] = _get(self.readers[0].settings.remote(depth, read_tokens))
        return self._settings[key]

    def search(self, question: str, k: int = 4, budget: int | None = None, method: str | None = None,
               where: Callable[[dict], bool] | None = None, depth: int | None = None,
               read_tokens: int | None = None) -> list[Span]:
        """`EndoIndex.search`: the k best spans, best first; `endo` on the next reader in turn."""
        method = self._checked(k, budget, method, depth, read_tokens)
        if method not in PIPELINE_METHODS:
            return self.index.search(question, k, budget, method, where)
        reader = self.readers[next(self._turn) % len(self.readers)]
        return _get(reader.search.remote(_question(question), k, budget, where, depth, read_tokens))

    def search_many(self, questions: Sequence[str], k: int = 4, budget: int | None = None, method: str | None = None,
                    where: Callable[[dict], bool] | None = None, depth: int | None = None,
                    read_tokens: int | None = None) -> list[list[Span]]:
        """`search` for every question, in the given order; `endo` questions spread over the readers, each
        taking the next as soon as it has room."""
        if isinstance(questions, str):
            raise ValueError("search_many takes a list of questions; for one question use search().")
        method = self._checked(k, budget, method, depth, read_tokens)
        if method not in PIPELINE_METHODS:
            return [self.search(q, k, budget, method, where) for q in questions]
        out: list = [None] * len(questions)
        slots = [r for _ in range(self.calls_per_reader) for r in self.readers]
        asked = [(i, _question(q)) for i, q in enumerate(questions)]
        submit = lambda reader, job: reader.search.remote(job[1], k, budget, where, depth, read_tokens)  # noqa: E731
        with contextlib.closing(spread(asked, slots, submit)) as finished:
            for (i, _), ready in finished:
                out[i] = _get(ready)
        return out

    def _checked(self, k, budget, method, depth, read_tokens) -> str:
        """The method to search with, after every check one index makes before it searches."""
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"k must be a whole number >= 1, got {k!r}.")
        method = self.check_method(method)
        if method in PIPELINE_METHODS:
            if budget is not None:
                check_budget(budget)
            self.pipeline(method, depth, read_tokens)  # a bad depth or read_tokens fails here, once
        elif depth is not None or read_tokens is not None:
            raise ValueError(f"depth and read_tokens tune the endo pipeline; {method!r} reads no candidates.")
        return method

    # the index is read-only here: say how to change it
    def add_documents(self, *_, **__):
        raise ValueError(_READ_ONLY)

    def remove_document(self, *_, **__):
        raise ValueError(_READ_ONLY)

    def save(self, *_, **__):
        raise ValueError(_READ_ONLY)


_READ_ONLY = ("A sharded index is read-only: add documents with RayIndexer(...).build(DIR, docs, append=True) and "
              "open it again; it is saved where it was built.")


def _question(question: str) -> str:
    """The question as `EndoIndex.search` takes it: text, capped in length, valid Unicode."""
    return unicode_text(as_text(capped_question(question)), "question")


def _get(refs):
    """`ray.get`, an actor's error raised as itself (a ValueError stays one, with its own message)."""
    ray = ray_cluster()
    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, Exception):
            raise cause from None
        raise
