"""`llama_index.retrievers.endo`: endogenous retrieval as a LlamaIndex retriever.

By default the `endo` pipeline: BM25 finds candidate passages, the local model reads them, and its retrieval heads
rank them. Each hit is one of your nodes, each of the `similarity_top_k` another one: a `TextNode` with the node's id
holding its best passage (the whole node when it is short), its character offsets in the node, its score the fused one
(higher is better) and each stage's score in its metadata. The S3 methods (`s3-hybrid`, `s3`) and `bm25` hold the
node's best sentence span. `return_passages=True`: the best passages themselves, several of which may come from one
node, each with an id of its own. `return_document=True`: each hit the whole node, as LlamaIndex's own retrievers
return nodes, ranked by its best passage (whose character offsets are `endo_passage_start` / `endo_passage_end` in
the metadata).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path
from typing import Sequence

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.callbacks import CallbackManager
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.schema import (BaseNode, MetadataMode, NodeRelationship, NodeWithScore, QueryBundle,
                                     RelatedNodeInfo, TextNode)
from llama_index.core.tools import RetrieverTool
from llama_index.core.vector_stores.types import FilterCondition, FilterOperator, MetadataFilters

from endo_retrieval import Document
from endo_retrieval.methods.searcher import Searcher
from endo_retrieval.integrations import (PROVENANCE_KEYS, check_document_options, check_k, check_pipeline_settings,
                                        check_whole_documents, open_index, provenance, search_hits)
from endo_retrieval.methods import DEFAULT_METHOD
from endo_retrieval.core import Span

SETTINGS_FILE = "llama_index_retriever.json"
dispatcher = get_dispatcher(__name__)
logger = logging.getLogger(__name__)
REF_DOC_KEY = "ref_doc_id"  # the source document a node was parsed from, kept for delete_ref_doc


def to_documents(nodes: Sequence[BaseNode]) -> list[Document]:
    """LlamaIndex nodes (or Documents) -> engine documents keyed by node id; their text, not their metadata,
    is what the model reads."""
    return [Document(n.node_id, n.get_content(metadata_mode=MetadataMode.NONE),
                     dict(n.metadata) | ({REF_DOC_KEY: n.ref_doc_id} if n.ref_doc_id else {})) for n in nodes]


def span_node(span: Span, passage: bool = False) -> NodeWithScore:
    """An evidence span as a node: the span's text, linked to its source node, with character offsets. It keeps its
    source node's id (so LlamaIndex's evaluators match it to the node) unless it is one of several `passage`s of that
    node and not the node's whole text."""
    node = TextNode(
        id_=span.doc_id if span.whole_document or not passage else f"{span.doc_id}:{span.char_start}-{span.char_end}",
        text=span.text,
        metadata=provenance(span),
        start_char_idx=span.char_start,
        end_char_idx=span.char_end,
        relationships={NodeRelationship.SOURCE: RelatedNodeInfo(node_id=span.doc_id, metadata=span.metadata)},
        excluded_llm_metadata_keys=[*PROVENANCE_KEYS, REF_DOC_KEY],  # offsets are for code, not for the prompt
        excluded_embed_metadata_keys=[*PROVENANCE_KEYS, REF_DOC_KEY],
    )
    return NodeWithScore(node=node, score=float(span.score))


OPERATORS = {  # LlamaIndex's metadata filter operators -> (metadata value, filter value) -> bool
    FilterOperator.EQ: lambda v, x: v == x, FilterOperator.NE: lambda v, x: v != x,
    FilterOperator.GT: lambda v, x: v is not None and v > x, FilterOperator.GTE: lambda v, x: v is not None and v >= x,
    FilterOperator.LT: lambda v, x: v is not None and v < x, FilterOperator.LTE: lambda v, x: v is not None and v <= x,
    FilterOperator.IN: lambda v, x: v in x, FilterOperator.NIN: lambda v, x: v not in x,
    FilterOperator.ANY: lambda v, x: isinstance(v, list) and any(i in v for i in x),
    FilterOperator.ALL: lambda v, x: isinstance(v, list) and all(i in v for i in x),
    FilterOperator.CONTAINS: lambda v, x: isinstance(v, list) and x in v,
    FilterOperator.TEXT_MATCH: lambda v, x: isinstance(v, str) and x in v,
    FilterOperator.TEXT_MATCH_INSENSITIVE: lambda v, x: isinstance(v, str) and x.lower() in v.lower(),
    FilterOperator.IS_EMPTY: lambda v, x: v in (None, "", []),
}


def metadata_predicate(filters: MetadataFilters | None):
    """LlamaIndex `MetadataFilters` as a test of a document's metadata (None: every document passes); a missing key
    fails every operator but `!=`, `nin` and `is_empty`."""
    if filters is None:
        return None

    def test(f, metadata: dict) -> bool:
        if isinstance(f, MetadataFilters):
            results = [test(g, metadata) for g in f.filters]
            if f.condition == FilterCondition.OR:
                return any(results)
            if f.condition == FilterCondition.NOT:
                return not any(results)
            return all(results)
        try:
            return bool(OPERATORS[f.operator](metadata.get(f.key), f.value))
        except TypeError:  # e.g. a string compared with a number: the document does not match
            return False

    for f in _leaves(filters):
        if f.operator not in OPERATORS:
            raise ValueError(f"Metadata filter operator {f.operator!r} is not supported; use one of "
                             f"{', '.join(o.value for o in OPERATORS)}.")
    return lambda metadata: test(filters, metadata)


def _leaves(filters: MetadataFilters):
    for f in filters.filters:
        yield from _leaves(f) if isinstance(f, MetadataFilters) else (f,)


class EndoRetrievalStages(BaseEvent):
    """LlamaIndex instrumentation event, inside the retrieval's span: the method and each stage's milliseconds."""

    method: str
    stage_ms: dict[str, float]

    @classmethod
    def class_name(cls) -> str:
        return "EndoRetrievalStages"


class EndoRetriever(BaseRetriever):
    """Evidence found by the backbone's own attention signals: `method` is the `endo` pipeline by default, or
    `s3-hybrid`, `s3`, `bm25` (an index built for `endo` or `bm25` holds no S3 postings: refused here).
    similarity_top_k=0 retrieves nothing; a negative one is refused. `return_document=True`: each hit is the whole
    node (its best passage's offsets in the metadata). `progress`: a progress bar on standard error while the model
    reads, when that takes more than a few seconds (None: when standard error is a terminal). `index`: any
    `Searcher` (endo_retrieval.methods.searcher): an `EndoIndex`, or a Ray `ReaderPool`, which takes every option."""

    def __init__(self, index: Searcher, similarity_top_k: int = 4, budget: int | None = None,
                 method: str = DEFAULT_METHOD, filters: MetadataFilters | None = None,
                 return_passages: bool = False, callback_manager: CallbackManager | None = None,
                 verbose: bool = False, depth: int | None = None, read_tokens: int | None = None,
                 return_document: bool = False, progress: bool | None = None, first_stage: str | None = None):
        check_k(similarity_top_k, "similarity_top_k")  # 0 is allowed and retrieves nothing
        index.check_method(method)  # a method the index cannot serve fails here, not at the first query
        self.index = index
        self.similarity_top_k = similarity_top_k
        self.budget = budget
        self.method = method
        self.filters = filters  # only nodes whose metadata passes can come back (never with a placeholder score)
        self.return_passages = bool(return_passages)  # the best passages, not one hit per node
        self.return_document = bool(return_document)  # each hit the whole node, not its best passage
        check_document_options(self.return_passages, self.return_document)
        if self.return_document:
            check_whole_documents(index)
        self.progress = progress
        # the pipeline's time against its recall: candidates the model reads, tokens read of each (None: fitted)
        self.depth, self.read_tokens = depth, read_tokens
        # the pipeline's candidates: "hybrid" (BM25 and the index's embedder), "bm25", "dense"; None: the fitted one
        self.first_stage = first_stage
        check_pipeline_settings(index, method, depth, read_tokens, first_stage)
        metadata_predicate(filters)  # an unsupported operator fails here
        super().__init__(callback_manager=callback_manager, verbose=verbose)

    @classmethod
    def from_defaults(cls, nodes: Sequence[BaseNode] | None = None, documents: Sequence[BaseNode] | None = None,
                      persist_dir: str | os.PathLike | None = None, similarity_top_k: int = 4,
                      budget: int | None = None, method: str = DEFAULT_METHOD, backbone=None,
                      filters: MetadataFilters | None = None, return_passages: bool = False,
                      depth: int | None = None, read_tokens: int | None = None, return_document: bool = False,
                      first_stage: str | None = None, embedder: str | None = None, **kwargs) -> "EndoRetriever":
        """Index `nodes` or `documents` (whole documents are fine: evidence is cut to sentences at query time),
        or load `persist_dir` when given alone. With both, the new index is saved to the (empty) persist_dir.
        `first_stage="bm25"` builds an index without passage embeddings; `embedder`: the sentence-transformers
        model of the dense stage (default all-MiniLM-L6-v2, bundled; a loaded index refuses another)."""
        if nodes is not None and documents is not None:
            raise ValueError("Pass nodes or documents, not both.")
        given = nodes if nodes is not None else documents
        index = open_index(None if given is None else to_documents(given), persist_dir, method, backbone,
                           first_stage if given is not None else None, embedder)
        return cls(index, similarity_top_k, budget, method, filters, return_passages, depth=depth,
                   read_tokens=read_tokens, return_document=return_document, first_stage=first_stage, **kwargs)

    @classmethod
    def from_documents(cls, documents: Sequence[BaseNode], **kwargs) -> "EndoRetriever":
        return cls.from_defaults(documents=documents, **kwargs)

    def insert(self, nodes: Sequence[BaseNode]) -> None:
        """Index more nodes (or Documents) without a rebuild; a bad one raises before any is added. `persist`
        then writes the whole index atomically."""
        self.index.add_documents(to_documents(nodes))

    def delete_ref_doc(self, ref_doc_id: str, raise_error: bool = False) -> None:
        """Remove every indexed node parsed from the document `ref_doc_id` (or the node of that id). An unknown id
        is nothing to delete: a warning is logged, as LlamaIndex's indexes do; `raise_error=True` raises a ValueError
        instead, as LlamaIndex's docstores do."""
        ids = [d.doc_id for d in self.index.corpus.documents()
               if d.doc_id == ref_doc_id or d.metadata.get(REF_DOC_KEY) == ref_doc_id]
        if not ids:
            if raise_error:
                raise ValueError(f"ref_doc_id {ref_doc_id!r} not found: no indexed node comes from it.")
            logger.warning("ref_doc_id %r not found, nothing deleted.", ref_doc_id)
        for doc_id in ids:
            self.index.remove_document(doc_id)

    async def adelete_ref_doc(self, ref_doc_id: str, raise_error: bool = False) -> None:
        await asyncio.to_thread(self.delete_ref_doc, ref_doc_id, raise_error)

    def persist(self, persist_dir: str | os.PathLike) -> None:
        """Save the index (atomically) and this retriever's settings into `persist_dir`."""
        self.index.save(persist_dir)
        settings = {"similarity_top_k": self.similarity_top_k, "budget": self.budget, "method": self.method,
                    "return_passages": self.return_passages, "depth": self.depth, "read_tokens": self.read_tokens,
                    "first_stage": self.first_stage,
                    "return_document": self.return_document}
        tmp = Path(persist_dir) / f".{SETTINGS_FILE}.tmp"
        tmp.write_text(json.dumps(settings))
        os.replace(tmp, Path(persist_dir) / SETTINGS_FILE)

    @classmethod
    def from_persist_dir(cls, persist_dir: str | os.PathLike, backbone=None, **overrides) -> "EndoRetriever":
        """Reload a persisted retriever; keyword arguments override the saved settings."""
        index = open_index(None, persist_dir, None, backbone)
        saved = Path(persist_dir) / SETTINGS_FILE
        try:
            settings = json.loads(saved.read_text()) if saved.exists() else {}
        except json.JSONDecodeError:
            raise ValueError(f"{saved} is corrupt; delete it (the defaults apply) or persist the retriever again.")
        return cls(index, **{**settings, **overrides})

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        k = check_k(self.similarity_top_k, "similarity_top_k")  # checked again: the attribute may have been set
        spans = search_hits(self.index, query_bundle.query_str, k, self.budget, self.method,
                            metadata_predicate(self.filters), self.return_passages, self.depth, self.read_tokens,
                            return_document=self.return_document, progress=self.progress,
                            first_stage=self.first_stage)
        if spans and spans[0].stage_ms:
            dispatcher.event(EndoRetrievalStages(method=self.method, stage_ms=spans[0].stage_ms))
        return [span_node(s, self.return_passages) for s in spans]

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        # the backbone serialises model calls; a worker thread keeps the event loop free meanwhile
        return await asyncio.to_thread(self._retrieve, query_bundle)

    def as_tool(self, name: str = "endo_search", description: str | None = None) -> RetrieverTool:
        """A ready tool for LlamaIndex agents: returns the evidence spans for a query."""
        return RetrieverTool.from_defaults(self, name=name, description=description or (
            "Finds evidence sentences in the indexed documents. Input: a question or search query."))


__all__ = ["EndoRetrievalStages", "EndoRetriever", "metadata_predicate", "span_node", "to_documents"]
