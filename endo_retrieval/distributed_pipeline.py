"""The default pipeline `endo` past one GPU, on Ray: stage 1 on the shards of a `ShardedIndex`, stage 2 on readers.

* Stage 1 lives where the corpus lives: each `Shard` (a CPU actor holding a contiguous run of the index's segments
  and its passages' embeddings) scores its own passages with the first stage one process runs, BM25 with the whole
  index's statistics (gathered once when the index opens) and the cosine with each passage's embedding; the reader
  fuses the shards' heads as one process fuses its rankings (hybrid by default; distributed/first_stage.py), so the
  candidates are those one index would have found, in the same order with the same scores.
* Stage 2 runs on `Reader`s, one actor per GPU (per CPU slot without one), each loading the model once. A reader
  takes a whole question: it asks every shard for candidates, reads them as one context and ranks them with the
  calibrated retrieval heads with `EndoPipeline.ranked`, the tail one process runs, then asks the shards that own
  the k best for their hits. Readers never talk to each other, so questions spread over them: `ReaderPool.search_many`
  keeps `calls_per_reader` questions in flight per reader (a threaded actor: one question's stage 1 and texts
  travel while another's read holds the model), handing the next question to whichever reader finishes first.
* `ReaderPool` is a `Searcher` (methods/searcher.py) as `EndoIndex` is, with its options and checks, so the
  LlamaIndex `EndoRetriever(pool)` and LangChain's `EndoRetriever.from_index(pool)` retrieve through it as through
  one index, `first_stage`, `depth` and `read_tokens` included. Other methods (`bm25`,
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

from endo_retrieval.core import Span, capped_question, check_budget
from endo_retrieval.distributed import ModelRecipe, ShardedIndex, ray_cluster, spread, start_workers
from endo_retrieval.distributed.first_stage import sharded_candidates
from endo_retrieval.index.dense import embed
from endo_retrieval.index.engine import unicode_text
from endo_retrieval.index.first_stage import FIRST_STAGES
from endo_retrieval.methods import PIPELINE_METHODS, check_search_method
from endo_retrieval.methods.pipeline import EndoPipeline
from endo_retrieval.methods.searcher import check_search_k
from endo_retrieval.model.backbone import as_text

SERVED = ("endo",)  # the pipelines readers serve; endo-2hop's second hop asks BM25 again mid-read (not yet here)


class Reader:
    """Stage 2 of `endo` on one accelerator: the model, loaded once by `setup()` (a `ModelRecipe`), reads each
    question's candidates, which the shards find (`sharded_candidates`), and its calibrated heads rank them."""

    def __init__(self, setup: Callable, shards: list):
        self.backbone, _ = setup()
        self.shards, self.pipelines = shards, {}
        # the passages' embedder (None: the shards hold no embeddings), for a question the pool sends unembedded
        self.embedder = ray_cluster().get(shards[0].embedder.remote()) if shards else None

    def model_hash(self) -> str:
        return self.backbone.model_hash

    def pipeline(self, depth: int | None = None, read_tokens: int | None = None, first_stage: str | None = None):
        """The EndoPipeline `EndoIndex.pipeline("endo", depth, read_tokens, first_stage)` makes for this model over
        passages with embeddings, made once (the pool asks for "bm25" where the shards hold none)."""
        key = (depth, read_tokens, first_stage)
        if key not in self.pipelines:
            pipeline = EndoPipeline(self.backbone, depth=depth, read_tokens=read_tokens, first_stage=first_stage)
            if pipeline.two_hop:
                raise ValueError("The model's profile turns the second hop on for this first stage; its second hop "
                                 "asks the index again mid-read, which readers do not serve (yet): search with "
                                 "EndoIndex on one process, or another first_stage.")
            self.pipelines[key] = pipeline
        return self.pipelines[key]

    def settings(self, depth: int | None = None, read_tokens: int | None = None, first_stage: str | None = None):
        """The pipeline without its model (its settings resolved from the model's profile): what the shards read
        the candidates with, and what a caller reads `depth` from."""
        settings = copy.copy(self.pipeline(depth, read_tokens, first_stage))
        settings.backbone = None
        return settings

    def search(self, question: str, k: int = 4, budget: int | None = None, method: str | None = None,
               where: Callable[[dict], bool] | None = None, depth: int | None = None,
               read_tokens: int | None = None, first_stage: str | None = None) -> list[Span]:
        """`EndoPipeline.passage_hits` with stage 1 on the shards: the same spans, scores and stage scores. The
        question comes checked by the pool (`ReaderPool.search`); `method`: `endo`, the one readers serve."""
        if method not in (None, *SERVED):
            raise ValueError(f"Readers serve {', '.join(SERVED)}, not {method!r}.")
        return self.read(question, None, k, budget, where, depth, read_tokens, first_stage)

    def read(self, question: str, embedding: np.ndarray | None, k: int, budget: int | None = None, where=None,
             depth: int | None = None, read_tokens: int | None = None, first_stage: str | None = None) -> list[Span]:
        """`search` with the question's embedding given (None: embedded here where stage 1 reads it), the same for
        every shard."""
        pipeline = self.pipeline(depth, read_tokens, first_stage)
        t0 = time.perf_counter()
        pools = pipeline.pools if len(pipeline.pools) > 1 else (None,)  # None: the pipeline's own first stage
        stages = [pipeline.stage_one(vectors=True, first_stage=pool) for pool in pools]
        if embedding is None and any("dense" in stage.used for stage in stages):
            embedding = embed(self.embedder, [question], str(self.backbone.device))[0]
        settings = self.settings(depth, read_tokens, first_stage)
        found = [sharded_candidates(self.shards, stage, question, pipeline.depth, where, settings, embedding)
                 for stage in stages]
        if not len(found[0]):  # no document passes `where`
            return []
        given, owners = given_stage_one(pipeline, found)
        t1 = time.perf_counter()
        ranked = given.ranked(None, None, question, k)
        ranked.ms["first_stage"] = 1000 * (t1 - t0)  # the shards' round trips
        ranked.ms["total"] = 1000 * (time.perf_counter() - t0)
        picks: dict[int, list[int]] = {}
        for r in ranked.rank:
            picks.setdefault(owners[int(ranked.top[r])][0], []).append(int(r))
        asked = [self.shards[shard].passage_hits.remote(
            [(owners[int(ranked.top[r])][1], float(ranked.fused[r]), ranked.scores[r]) for r in rs], question,
            budget, k, pipeline.sources, ranked.ms) for shard, rs in picks.items()]
        got = {r: hit for rs, hits in zip(picks.values(), ray_cluster().get(asked)) for r, hit in zip(rs, hits)}
        return [got[int(r)] for r in ranked.rank]


def given_stage_one(pipeline, found: list) -> tuple[EndoPipeline, list[tuple[int, int]]]:
    """A copy of `pipeline` whose stage 1 is given, one `Candidates` a pool (each ranking's scores of the candidates,
    best first, and what the model reads of each), and each candidate's (shard, passage): its `ranked` then reads,
    scores and fuses them exactly as on one process, a passage two pools hold being one candidate."""
    at: dict[tuple[int, int], int] = {}
    texts, pools = [], []
    for candidates in found:
        ids = []
        for shard, passage, text in zip(candidates.shards, candidates.passages, candidates.texts):
            key = (int(shard), int(passage))
            if key not in at:
                at[key] = len(texts)
                texts.append(text)
            ids.append(at[key])
        pools.append((np.asarray(ids, np.int64), dict(candidates.scores)))
    given = copy.copy(pipeline)
    given.pool_candidates = lambda *_, **__: pools
    given.read_texts = lambda corpus, passages, top, question: [texts[i] for i in top]
    return given, list(at)


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

    def pipeline(self, method: str = "endo", depth: int | None = None, read_tokens: int | None = None,
                 first_stage: str | None = None):
        """The pipeline's settings (`depth`, `read_tokens`, `first_stage`, ...; no model), as `EndoIndex.pipeline`
        resolves them from the model's profile; a bad option is a ValueError."""
        self.check_method(method)
        first_stage = self._first_stage(first_stage)
        key = (depth, read_tokens, first_stage)
        if key not in self._settings:
            self._settings[key] = _get(self.readers[0].settings.remote(depth, read_tokens, first_stage))
        return self._settings[key]

    def _first_stage(self, first_stage: str | None) -> str | None:
        """What the readers run: the one asked for, else the model's (None), BM25's where the shards hold no
        embeddings (as `EndoIndex.pipeline`); a dense stage asked of shards without embeddings is refused."""
        if first_stage is not None and first_stage not in FIRST_STAGES:
            raise ValueError(f"Unknown first stage {first_stage!r}; use one of {', '.join(FIRST_STAGES)}.")
        if self.index.embedder is None:
            if first_stage not in (None, "bm25"):
                raise ValueError(f"first_stage={first_stage!r} needs passage embeddings, which the shards of "
                                 f"{self.index.directory} do not hold (built with first_stage='bm25'): build it "
                                 "again with RayIndexer(method='endo'), or search with first_stage='bm25'.")
            return "bm25"
        return first_stage

    def search(self, question: str, k: int = 4, budget: int | None = None, method: str | None = None,
               where: Callable[[dict], bool] | None = None, depth: int | None = None,
               read_tokens: int | None = None, first_stage: str | None = None) -> list[Span]:
        """`EndoIndex.search`: the k best spans, best first; `endo` on the next reader in turn."""
        method = self._checked(k, budget, method, depth, read_tokens, first_stage)
        if method not in PIPELINE_METHODS:
            return self.index.search(question, k, budget, method, where)
        reader = self.readers[next(self._turn) % len(self.readers)]
        question, stage = _search_question(question), self._first_stage(first_stage)
        return _get(reader.read.remote(question, self._embedding(question, depth, read_tokens, stage), k, budget,
                                       where, depth, read_tokens, stage))

    def search_many(self, questions: Sequence[str], k: int = 4, budget: int | None = None, method: str | None = None,
                    where: Callable[[dict], bool] | None = None, depth: int | None = None,
                    read_tokens: int | None = None, first_stage: str | None = None) -> list[list[Span]]:
        """`search` for every question, in the given order; `endo` questions spread over the readers, each
        taking the next as soon as it has room."""
        if isinstance(questions, str):
            raise ValueError("search_many takes a list of questions; for one question use search().")
        method = self._checked(k, budget, method, depth, read_tokens, first_stage)
        if method not in PIPELINE_METHODS:
            return [self.search(q, k, budget, method, where) for q in questions]
        out: list = [None] * len(questions)
        slots = [r for _ in range(self.calls_per_reader) for r in self.readers]
        asked = [(i, _search_question(q)) for i, q in enumerate(questions)]
        stage = self._first_stage(first_stage)
        submit = lambda reader, job: reader.read.remote(  # noqa: E731
            job[1], self._embedding(job[1], depth, read_tokens, stage), k, budget, where, depth, read_tokens, stage)
        with contextlib.closing(spread(asked, slots, submit)) as finished:
            for (i, _), ready in finished:
                out[i] = _get(ready)
        return out

    def _embedding(self, question: str, depth: int | None, read_tokens: int | None, first_stage: str | None):
        """The question's embedding where stage 1 reads one, made here once, as one process makes it (the last bits
        of an embedding differ from process to process, and with them the order of passages whose cosines tie to
        float rounding)."""
        if "dense" not in self.pipeline("endo", depth, read_tokens, first_stage).stage_one(vectors=True).used:
            return None
        return embed(self.index.embedder, [question])[0]

    def _checked(self, k, budget, method, depth, read_tokens, first_stage) -> str:
        """The method to search with, after every check one index makes before it searches."""
        check_search_k(k)
        method = self.check_method(method)
        if method in PIPELINE_METHODS:
            if budget is not None:
                check_budget(budget)
            self.pipeline(method, depth, read_tokens, first_stage)  # a bad option fails here, once
        else:
            self.index.pipeline(method, depth, read_tokens, first_stage)  # refused: it reads no candidates
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


def _search_question(question: str) -> str:
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
