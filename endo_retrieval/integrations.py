"""The adapters' API, framework-free: what the LlamaIndex and LangChain adapters and the MCP server share (imports
as `endo_retrieval.integrations`; needs neither framework).

- `open_index`: build, load, or build-and-save an `EndoIndex` with the checks every adapter wants;
- `check_k`, `check_pipeline_settings`, `check_document_options`: the retrievers' options, checked when built;
- `search_hits`: the retrievers' hits from any `Searcher` (an index, a Ray `ReaderPool`), one per document unless
  passages are asked for;
- `provenance`: the metadata an evidence span carries back into a framework (document id, character offsets);
- `compress_passages`: the S3 paper's compression of one long context, applied to the passages another retriever
  returned, with each kept piece mapped back to the passage it came from;
- `GenerationSettings`: the settings of the local LLM adapters (EndoLLM, ChatEndo), one pydantic model both inherit.

The reranker the adapters' EndoReranker runs is `methods/rerank.py`; the read's progress bar and time hint,
`methods/read_time.py` (both re-exported here, where the adapters have imported them from).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from pydantic import BaseModel, Field

from endo_retrieval.attention import get_backend
from endo_retrieval.core import Span
from endo_retrieval.index.hits import (best_per_document, check_whole_documents,  # noqa: F401 (the adapters' import)
                                      whole_document, with_section)
from endo_retrieval.methods import DEFAULT_METHOD, PIPELINE_METHODS, REGISTRY, compress
from endo_retrieval.methods.heads import PASSAGE_SEPARATOR
from endo_retrieval.methods.read_time import (expected_seconds, long_read, pipeline_progress,  # noqa: F401
                                              progress_enabled)
from endo_retrieval.methods.rerank import (DEFAULT_RERANK_FIRST_STAGE, RERANK_BEST_LAST,  # noqa: F401
                                           RERANK_FIRST_STAGES, RERANK_WEIGHTS, check_read_tokens,
                                           check_rerank_weights, first_stage_signal, fit_to_window,
                                           passage_heads_scores, rerank_passages, reranker_rule, reranker_weights,
                                           water_level)
from endo_retrieval.methods.search import Document, EndoIndex
from endo_retrieval.methods.searcher import Searcher

DEFAULT_FIRST_STAGE = DEFAULT_RERANK_FIRST_STAGE  # the reranker's, as the adapters have imported it
log = logging.getLogger(__name__)

PROVENANCE_KEYS = ("doc_id", "char_start", "char_end", "endo_score", "signals", "endo_stage_scores", "endo_stage_ms",
                   "endo_passage_start", "endo_passage_end")
COMPRESS_METHODS = tuple(REGISTRY)  # compress() over the passages as one context


def open_index(documents: Sequence[Document] | None, index_dir: str | os.PathLike | None, method: str,
               backbone=None, first_stage: str | None = None, embedder: str | None = None) -> EndoIndex:
    """Documents only: a fresh in-memory index. A folder only: load it. Both: build, then save to a folder that
    must not hold an index yet (nothing is ever overwritten by a constructor)."""
    if documents is None and index_dir is None:
        raise ValueError("Give documents (texts, documents or nodes) to index, or a folder with a saved index.")
    if documents is None:
        folder = Path(index_dir)
        if not folder.is_dir():
            raise FileNotFoundError(f"No saved index at {folder}; build one first (pass documents, then persist/save).")
        return EndoIndex.load(folder, backbone=backbone, embedder=embedder)
    if index_dir is not None and (Path(index_dir) / "endo-index.json").exists():
        raise ValueError(f"{index_dir} already holds an index; load it by passing only the folder, or choose an "
                         "empty folder to save the new one.")
    index = EndoIndex(backbone, method=method, first_stage=first_stage, embedder=embedder)
    index.add_documents(list(documents))  # a progress bar on a terminal
    if index_dir is not None:
        index.save(index_dir)
    return index


def check_k(k, name: str = "k") -> int:
    """`k` when it is a whole number >= 0, else a ValueError saying so. k = 0 asks for nothing and gets [] (as
    LlamaIndex's vector retrievers do with similarity_top_k=0), in both adapters, sync and async alike."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
        raise ValueError(f"{name} must be a whole number >= 0 (0 returns no results), got {k!r}.")
    return int(k)


def search_hits(index: Searcher, question: str, k: int, budget: int | None = None, method: str | None = None,
                where=None, return_passages: bool = False, depth: int | None = None,
                read_tokens: int | None = None, *, return_document: bool = False,
                progress: bool | None = None, first_stage: str | None = None) -> list[Span]:
    """The k best hits from `index` (any `Searcher`), best first. By default each from another document: a
    document's best passage (`endo`) or span (`s3-hybrid`, `s3`, `bm25`), with that passage's offsets in its
    document. Fewer than k come back only when
    fewer documents are found: `endo` ranks the candidates the model read (its `depth` passages), the other methods
    what fits `budget` (default: as many spans as it takes). `return_passages=True`: the k best passages as the
    index ranks them, several of which may come from one document. `return_document=True`: each hit is its whole
    document (`whole_document`), ranked by its best passage, whose offsets are in the metadata. `depth`,
    `read_tokens`, `first_stage`: the pipeline's (`Searcher.search`). `progress`: a progress bar while the model
    reads, when that takes more than a few seconds (None: when standard error is a terminal; `pipeline_progress`)."""
    check_document_options(return_passages, return_document)
    pipeline = {"depth": depth, "read_tokens": read_tokens, "first_stage": first_stage}
    if check_k(k) == 0:
        return []
    method = index.check_method(method)
    with pipeline_progress(index, method, depth, read_tokens, progress, first_stage):
        hits = _search_hits(index, question, k, budget, method, where, return_passages, pipeline)
    hits = [with_section(index, h) for h in hits]  # a file's hit names its file, title and section
    return [whole_document(index, h) for h in hits] if return_document else hits


def _search_hits(index, question: str, k: int, budget, method: str, where, return_passages: bool,
                 pipeline: dict) -> list[Span]:
    if return_passages:
        if method in PIPELINE_METHODS:  # the pipeline ranks the candidates it read: at least k of them
            pipeline = {**pipeline, "depth": max(k, index.pipeline(method, **pipeline).depth)}
        return index.search(question, k, budget, method, where, **pipeline)
    if method in PIPELINE_METHODS:
        return _pipeline_hits(index, question, k, budget, method, where, pipeline)
    ask, before = k, None
    while True:  # a document may hold several of the best spans: widen the ask until k documents are found
        spans = index.search(question, ask, budget, method, where)
        found = best_per_document(spans)
        if len(found) >= k or spans == before or (budget is not None and len(spans) < ask):
            if len(found) < k:  # nothing more to find (under the budget when one is given)
                _fewer(k, found, f"the budget of {budget} tokens holds no more" if budget is not None and
                       len(spans) < ask else "no more documents match the question")
            return found[:k]
        ask, before = 2 * ask, spans


FILL_ROUNDS = 3  # reads of twice as many candidates each (x8 in all) while the best passages hold too few documents


def _pipeline_hits(index, question: str, k: int, budget, method: str, where, pipeline: dict) -> list[Span]:
    """The best passage of each of the k best documents by the pipeline. One read scores every candidate, so all of
    them are asked for at once; where they come from fewer than k documents (a long document holds many of the
    best passages), the model reads twice as many candidates, and the documents it finds there follow those
    already found, until k are found, every candidate was read, or FILL_ROUNDS (then a warning says so)."""
    # the first read: the depth asked for, else the fitted one, at least k (then deeper only where too few documents)
    depth = pipeline.get("depth") or max(k, index.pipeline(method, **pipeline).depth)
    found: list[Span] = []
    for _ in range(FILL_ROUNDS + 1):
        # a budget of b * depth // k over depth passages cuts each to b // k tokens, as k passages would be
        passages = index.search(question, depth, None if budget is None else budget * depth // k, method, where,
                                **{**pipeline, "depth": depth})
        found = best_per_document(found + passages)
        if len(found) >= k:
            return found[:k]
        if len(passages) < depth:  # every candidate (that `where` accepts) was read
            _fewer(k, found, "the index holds no more documents" + (" that the filter accepts" if where else ""))
            return found
        depth *= 2
    _fewer(k, found, f"the best {depth // 2} passages come from these documents only; pass a larger depth to read "
           "deeper")
    return found


def _fewer(k: int, found: Sequence[Span], why: str) -> None:
    log.warning("%d of the %d documents asked for: %s.", len(found), k, why)


def check_document_options(return_passages: bool, return_document: bool) -> None:
    """`return_document` hands back one whole document per hit; `return_passages` several passages of one
    document: the two cannot be asked together."""
    if return_passages and return_document:
        raise ValueError("return_document=True returns each hit's whole document (one hit per document) and "
                         "return_passages=True the best passages (several may share a document); ask for one.")


def check_pipeline_settings(index: Searcher, method: str | None, depth: int | None, read_tokens: int | None,
                            first_stage: str | None = None) -> None:
    """A retriever's `depth` / `read_tokens` / `first_stage`, checked when it is built (a bad value fails there, not
    at the first query, by the searcher's own `pipeline`); they tune the `endo` pipelines and are refused for another
    method, which they would not change."""
    if depth is None and read_tokens is None and first_stage is None:
        return
    method = index.check_method(method)
    if method not in PIPELINE_METHODS:
        raise ValueError(f"depth, read_tokens and first_stage tune the endo pipelines; {method!r} reads no "
                         "candidates.")
    index.pipeline(method, depth, read_tokens, first_stage)


def provenance(span: Span) -> dict:
    """The document's own metadata plus where the span lies in that document's text."""
    out = {**span.metadata, "doc_id": span.doc_id, "char_start": span.char_start, "char_end": span.char_end,
           "endo_score": float(span.score), "signals": list(span.signals)}
    if span.stage_scores:  # a pipeline's own score per stage, and the search's time per stage
        out |= {"endo_stage_scores": dict(span.stage_scores), "endo_stage_ms": dict(span.stage_ms)}
    return out


@dataclass(frozen=True)
class Kept:
    """What compression kept of one passage: its text and the character ranges of the passage it came from."""

    passage: int
    text: str
    char_spans: tuple[tuple[int, int], ...]


def compress_passages(passages: Sequence[str], question: str, budget: int, method: str = DEFAULT_METHOD,
                      backbone=None) -> list[Kept]:
    """Compress the passages as one context (joined in the given order) under `budget` tokens and return, in
    passage order, the passages that kept anything with their kept text (pieces joined as `compress` joins
    spans: adjacent pieces as the source text, others with a newline)."""
    if method not in COMPRESS_METHODS:
        raise ValueError(f"Unknown compression method {method!r}; use one of {', '.join(COMPRESS_METHODS)}.")
    if not question or not question.strip():
        raise ValueError("Compression needs the question (the query string) to decide what evidence to keep.")
    if not passages:
        return []
    lengths = np.array([len(p) for p in passages])
    starts = np.concatenate([[0], np.cumsum(lengths + len(PASSAGE_SEPARATOR))[:-1]])
    ends = starts + lengths
    result = compress(PASSAGE_SEPARATOR.join(passages), question, budget=budget, method=method, backbone=backbone)
    pieces: dict[int, list[tuple[int, int]]] = {}
    for span in result.spans:  # a span may cross passage bounds: cut it at every passage it overlaps
        first = int(np.searchsorted(ends, span.char_start, side="right"))
        last = int(np.searchsorted(starts, span.char_end, side="left"))
        for i in range(first, last):
            a, b = max(span.char_start, starts[i]) - starts[i], min(span.char_end, ends[i]) - starts[i]
            if b > a and passages[i][a:b].strip():
                pieces.setdefault(i, []).append((int(a), int(b)))
    return [Kept(i, _join(passages[i], spans), tuple(spans)) for i, spans in sorted(pieces.items())]


def _join(text: str, spans: list[tuple[int, int]]) -> str:
    spans = sorted(spans)
    out = [text[spans[0][0]:spans[0][1]]]
    for (_, prev_end), (a, b) in zip(spans, spans[1:]):
        out.append(text[a:b] if a == prev_end else "\n" + text[a:b])
    return "".join(out)



# A RAG answer is a sentence or a short paragraph: on HotpotQA questions the default model's answers that end by
# themselves take at most ~60 tokens (docs/generation.md), and on a CPU every new token costs a forward of the
# model, so 128 bounds the time of an answer that would not end while leaving room for a few sentences.
DEFAULT_MAX_NEW_TOKENS = 128
# an answer ends before repeating a run of this many tokens (about six words) or a sentence it already wrote
DEFAULT_STOP_ON_REPEAT = 8


class GenerationSettings(BaseModel):
    """How the local LLM adapters generate (LlamaIndex's EndoLLM and LangChain's ChatEndo inherit these fields)."""

    max_new_tokens: int = Field(default=DEFAULT_MAX_NEW_TOKENS, gt=0, description="tokens generated at most per call")
    attention: Any = Field(default=None, description="None (the model's own attention) or a decode-time backend: "
                              "'reattention', 'prhs', 'completion', 'dense', or an instance such as ReAttention()")
    stop_on_repeat: int = Field(default=DEFAULT_STOP_ON_REPEAT, ge=0, description="the answer ends before it repeats "
                                "a run of this many tokens or a sentence it already wrote (0: off)")
    repetition_penalty: float = Field(default=1.0, gt=0, description="transformers' repetition penalty over the "
                                      "answer's own tokens (1: none)")
    no_repeat_ngram_size: int = Field(default=0, ge=0, description="transformers' n-gram block over the answer's own "
                                      "tokens: no n-gram of this size twice (0: none)")
    compress_to: int | None = Field(default=None, gt=0, description="a prompt longer than this many tokens has its "
                                    "context compressed first (endo_retrieval.compress); None: never")
    compress_method: str | None = Field(default=None, description="the compression method (None: the default)")

    def generation_options(self, stats: dict | None = None) -> dict:
        """The keyword arguments of `Backbone.generate` these settings give (`stats` filled with what happened)."""
        options = dict(max_new_tokens=self.max_new_tokens, attention=get_backend(self.attention),
                       stop_on_repeat=self.stop_on_repeat or None, compress_to=self.compress_to,
                       compress_method=self.compress_method, stats=stats)
        if self.repetition_penalty != 1.0:
            options["repetition_penalty"] = self.repetition_penalty
        if self.no_repeat_ngram_size:
            options["no_repeat_ngram_size"] = self.no_repeat_ngram_size
        return options
