"""A LangChain retriever over an `EndoIndex`: by default the `endo` pipeline (BM25 candidates, the local model reads
them, its retrieval heads rank them). Each of the k hits is another of your documents, returned as a `Document` with
that document's id holding its best passage, the passage's character offsets, the score (`relevance_score`, the key
LangChain's rerankers and vector stores' relevance scores use; also `endo_score`) and each stage's score;
`return_passages=True` returns the best passages themselves, several of which may come from one document, and
`return_document=True` the whole documents, as LangChain's own retrievers return them, ranked by their best passage
(its offsets in `endo_passage_start` / `endo_passage_end`)."""
from __future__ import annotations

import asyncio
import os
from contextvars import ContextVar
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
from langchain_core.documents import Document as LCDocument
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict, Field, PrivateAttr, field_validator

from endo_retrieval import Document
from endo_retrieval.methods.searcher import Searcher
from endo_retrieval.integrations import (check_document_options, check_k, check_pipeline_settings,
                                        check_whole_documents, open_index, provenance, search_hits)
from endo_retrieval.methods import DEFAULT_METHOD
from endo_retrieval.core import Span


def to_documents(texts: list[str] | None, documents: list[LCDocument] | None) -> list[Document] | None:
    """Texts and LangChain documents -> engine documents (a document's own id when it has one, else doc-N)."""
    if texts is None and documents is None:
        return None
    docs = [Document(f"doc-{i}", t) for i, t in enumerate(texts or [])]
    offset = len(docs)
    return docs + [Document(d.id or f"doc-{offset + i}", d.page_content, dict(d.metadata))
                   for i, d in enumerate(documents or [])]


def span_document(span: Span, passage: bool = False) -> LCDocument:
    """A hit as a Document: its source document's id, or a passage's own id (its document's and offsets); its score
    in `relevance_score` (as LangChain's rerankers write it) and, as before, `endo_score`."""
    return LCDocument(page_content=span.text, metadata={**provenance(span), "relevance_score": float(span.score)},
                      id=f"{span.doc_id}:{span.char_start}-{span.char_end}" if passage else span.doc_id)


# the index `from_index` hands to the retriever it builds (pydantic builds it, so not through an argument)
_GIVEN_INDEX: ContextVar = ContextVar("given_index", default=None)


class EndoRetriever(BaseRetriever):
    """Evidence ranked by the backbone's attention signals (the `endo` pipeline by default, or `s3-hybrid`, `s3`,
    `bm25`; a method the index cannot serve is refused on construction).

    `texts`/`documents` are indexed on construction; `index_dir` alone loads a saved index, and with texts or
    documents receives the new one (it must not hold an index yet). `invoke(query, k=...)` overrides `k`; k=0
    returns [] and a negative k is refused. `return_document=True`: each hit's `page_content` is its whole document
    (`endo_passage_start` / `endo_passage_end` in the metadata locate the best passage in it). `progress`: a progress
    bar on standard error while the model reads, when that takes more than a few seconds (None: on a terminal).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    texts: list[str] | None = Field(default=None, repr=False)
    documents: list[LCDocument] | None = Field(default=None, repr=False)
    index_dir: str | os.PathLike | None = None
    k: int = 4
    budget: int | None = Field(default=None, gt=0)
    method: str = DEFAULT_METHOD
    filter: dict | None = None  # LangChain's metadata filter (`_matcher`); `invoke(query, filter=...)` overrides it
    return_passages: bool = False  # the best passages, several of which may come from one document
    return_document: bool = False  # each hit the whole document, its best passage's offsets in the metadata
    progress: bool | None = None  # a progress bar while a slow read runs (None: when standard error is a terminal)
    # the pipeline's time against its recall: candidates the model reads, tokens read of each (None: fitted)
    depth: int | None = None
    read_tokens: int | None = None
    # the pipeline's candidates: "hybrid" (BM25 and the dense embedder fused), "bm25", "dense" (None: the fitted one;
    # an index built with "bm25" keeps no passage embeddings); `embedder`: the dense stage's sentence-transformers
    # model (None: all-MiniLM-L6-v2, bundled), recorded in the index, which refuses another
    first_stage: str | None = None
    embedder: str | None = None
    # hits scoring below it are dropped, so fewer than k may come; the score is metadata["relevance_score"] (for `endo`
    # the fused one, 0 being the candidates' average); `invoke(query, score_threshold=...)` overrides it
    score_threshold: float | None = None
    backbone: Any = Field(default=None, exclude=True, repr=False)
    _index: Searcher = PrivateAttr()

    def model_post_init(self, __context: Any) -> None:
        given = _GIVEN_INDEX.get()  # from_index
        docs = to_documents(self.texts, self.documents)
        self._index = given if given is not None else open_index(docs, self.index_dir, self.method, self.backbone,
                                                                 self.first_stage if docs is not None else None,
                                                                 self.embedder)
        self._index.check_method(self.method)
        check_pipeline_settings(self._index, self.method, self.depth, self.read_tokens, self.first_stage)
        check_document_options(self.return_passages, self.return_document)
        if self.return_document:
            check_whole_documents(self._index)
        _matcher(self.filter)  # a filter it cannot read fails here, not at the first query
        self.texts = self.documents = None  # the index holds them now; don't keep a second copy

    @classmethod
    def from_index(cls, index: Searcher, **kwargs) -> "EndoRetriever":
        """A retriever over an index already open: any `Searcher` (endo_retrieval.methods.searcher), an `EndoIndex`
        or an index served by Ray (`endo_retrieval.distributed_pipeline.ReaderPool`), which takes the same options.
        `kwargs`: the fields (k, first_stage, depth, ...)."""
        token = _GIVEN_INDEX.set(index)
        try:
            return cls(**kwargs)
        finally:
            _GIVEN_INDEX.reset(token)

    @field_validator("k", mode="before")
    @classmethod
    def _whole_k(cls, k) -> int:
        return check_k(k)

    @property
    def index(self) -> Searcher:
        return self._index

    def add_documents(self, documents: list[LCDocument], ids: list[str] | None = None) -> list[str]:
        """Index more documents without a rebuild; returns their ids (`ids`, else each document's own id, else a
        new doc-N). A bad document raises before any is added; `save` then writes the index atomically."""
        if ids is not None and len(ids) != len(documents):
            raise ValueError(f"{len(ids)} ids for {len(documents)} documents; give one id per document.")
        taken, docs = set(self._index.doc_ids), []
        for i, d in enumerate(documents):
            doc_id = ids[i] if ids is not None else d.id
            if doc_id is None:
                doc_id = next(f"doc-{n}" for n in range(len(taken), 2 * len(taken) + 2) if f"doc-{n}" not in taken)
            taken.add(doc_id)
            docs.append(Document(doc_id, d.page_content, dict(d.metadata)))
        return self._index.add_documents(docs)

    def delete(self, ids: list[str]) -> bool:
        """Remove the documents `ids`; True when any was removed, False when none of them was indexed (as LangChain's
        vector stores answer `delete`). Ids not in the index are skipped."""
        if isinstance(ids, str) or not isinstance(ids, (list, tuple, set)):
            raise ValueError(f"ids must be a list of document ids, got {ids!r}.")
        known = [i for i in dict.fromkeys(ids) if i in self._index.corpus]
        for doc_id in known:
            self._index.remove_document(doc_id)
        return bool(known)

    async def adelete(self, ids: list[str]) -> bool:
        return await asyncio.to_thread(self.delete, ids)

    def save(self, index_dir: str | os.PathLike) -> None:
        """Write the index (atomically); reload with EndoRetriever(index_dir=...)."""
        self._index.save(index_dir)

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun,
                                k: int | None = None, filter: dict | None = None,
                                score_threshold: float | None = None) -> list[LCDocument]:
        """`filter`: {key: value}, {key: [accepted values]}, {key: {"$gte": 1990, "$lt": 2000}} (the operators $eq
        $ne $in $nin $gt $gte $lt $lte) or {"$and"/"$or": [filters]}; only documents that match can come back."""
        return self._search(query, k, filter, score_threshold)

    async def _aget_relevant_documents(self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun,
                                       k: int | None = None, filter: dict | None = None,
                                       score_threshold: float | None = None) -> list[LCDocument]:
        # the same keywords as the sync path; the backbone serialises model calls, and a worker thread keeps the
        # event loop free meanwhile
        return await asyncio.to_thread(self._search, query, k, filter, score_threshold)

    def _search(self, query: str, k: int | None, filter: dict | None, score_threshold: float | None
                ) -> list[LCDocument]:
        threshold = self.score_threshold if score_threshold is None else score_threshold
        spans = search_hits(self._index, query, self.k if k is None else k, self.budget, self.method,
                            _matcher(filter if filter is not None else self.filter), self.return_passages,
                            self.depth, self.read_tokens, return_document=self.return_document,
                            progress=self.progress, first_stage=self.first_stage)
        return [span_document(s, self.return_passages) for s in spans if threshold is None or s.score >= threshold]


# LangChain's vector-store filter operators -> (metadata value, operand) -> bool; a missing key is None and fails
# every comparison but $ne and $nin, as in the LlamaIndex adapter
COMPARISONS = {
    "$eq": lambda v, x: v == x, "$ne": lambda v, x: v != x,
    "$in": lambda v, x: v in x, "$nin": lambda v, x: v not in x,
    "$gt": lambda v, x: v is not None and v > x, "$gte": lambda v, x: v is not None and v >= x,
    "$lt": lambda v, x: v is not None and v < x, "$lte": lambda v, x: v is not None and v <= x,
}
LOGICAL = {"$and": all, "$or": any}
FILTER_HELP = ("a filter is {key: value}, {key: [accepted values]}, {key: {operator: value}} with the operators "
               f"{', '.join(COMPARISONS)}, or {{'$and' or '$or': [filters]}}")


def _matcher(filter: dict | None):
    """A LangChain metadata filter as a test of a document's metadata (None: every document passes). Several keys
    must all match; a bare value means $eq and a list of values $in. Anything else raises a ValueError that says
    what a filter may hold."""
    if filter is None:
        return None
    if not isinstance(filter, dict) or not filter:
        raise ValueError(f"Cannot read the filter {filter!r}: {FILTER_HELP}.")
    tests = []
    for key, condition in filter.items():
        if key in LOGICAL:
            if not isinstance(condition, list) or not condition:
                raise ValueError(f"{key} takes a non-empty list of filters, got {condition!r}: {FILTER_HELP}.")
            tests.append(_either(LOGICAL[key], [_matcher(f) for f in condition]))
        elif not isinstance(key, str) or key.startswith("$"):
            raise ValueError(f"Unknown filter operator {key!r}: {FILTER_HELP}.")
        elif isinstance(condition, dict):
            tests += [_compare(key, op, operand) for op, operand in condition.items()]
        else:
            tests.append(_compare(key, "$in" if isinstance(condition, list) else "$eq", condition))
    return lambda metadata: all(test(metadata) for test in tests)


def _either(combine, tests):
    return lambda metadata: combine(test(metadata) for test in tests)


def _compare(key: str, op: str, operand):
    if op not in COMPARISONS:
        raise ValueError(f"Unknown filter operator {op!r} for {key!r}: {FILTER_HELP}.")
    if op in ("$in", "$nin") and not isinstance(operand, (list, tuple, set)):
        raise ValueError(f"{op} for {key!r} takes a list of values, got {operand!r}.")
    compare = COMPARISONS[op]

    def test(metadata: dict) -> bool:
        try:
            return bool(compare(metadata.get(key), operand))
        except TypeError:  # e.g. a string compared with a number: the document does not match
            return False

    return test


__all__ = ["EndoRetriever", "span_document", "to_documents"]
