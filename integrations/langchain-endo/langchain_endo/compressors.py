"""The S3 paper's context compression as a LangChain document compressor (for `ContextualCompressionRetriever`).

The documents any retriever returned are read as one context by the local LM and cut down to the endogenous
evidence under one token budget ([S3 Eq. 8]; or ILRe), keeping their order and metadata.
EndoReranker re-orders them by the model's query-focused retrieval heads (QRHead, calibrated as in In-Context
Re-ranking) fused with the first stage's order or scores, and keeps the best `top_n`.
"""
from __future__ import annotations

from typing import Any, Sequence

from langchain_core.callbacks import Callbacks
from langchain_core.documents import BaseDocumentCompressor, Document
from pydantic import ConfigDict, Field, field_validator

from endo_retrieval.integrations import (COMPRESS_METHODS, DEFAULT_FIRST_STAGE, check_read_tokens, check_rerank_weights,
                                        compress_passages, rerank_passages)
from endo_retrieval.methods import DEFAULT_METHOD


class EndoDocumentCompressor(BaseDocumentCompressor):
    """Keep only the evidence of the documents, at most `budget` backbone tokens in all. Each kept document's
    metadata gains `endo_char_spans`: the kept character ranges of its original `page_content`."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    budget: int = Field(default=1024, gt=0)
    method: str = DEFAULT_METHOD
    backbone: Any = Field(default=None, exclude=True, repr=False)

    @field_validator("method")
    @classmethod
    def _known_method(cls, method: str) -> str:
        if method not in COMPRESS_METHODS:
            raise ValueError(f"Unknown compression method {method!r}; use one of {', '.join(COMPRESS_METHODS)}.")
        return method

    def compress_documents(self, documents: Sequence[Document], query: str, callbacks: Callbacks | None = None
                           ) -> Sequence[Document]:
        kept = compress_passages([d.page_content for d in documents], query, self.budget, self.method,
                                 self.backbone)
        return [Document(page_content=k.text, id=documents[k.passage].id,
                         metadata={**documents[k.passage].metadata, "endo_method": self.method,
                                   "endo_char_spans": [list(s) for s in k.char_spans]})
                for k in kept]


# metadata keys a first stage's score may be under (rerankers write relevance_score, some vector stores score,
# EndoRetriever endo_score); the first that every document has is used
SCORE_KEYS = ("relevance_score", "score", "endo_score")


class EndoReranker(BaseDocumentCompressor):
    """The `top_n` best documents, best first, each with its score in `metadata["relevance_score"]` (the key
    LangChain's rerankers write); `score_threshold` drops those below it. By default the first stage's scores (the
    metadata key `score_key`, else the first of SCORE_KEYS every document has, else the documents' ranks) and the
    retrieval heads' scores, each standardised over the documents, are summed with the weights
    {"first_stage": w, "heads": 1 - w}: `weights` when given, else those fitted for the model and `first_stage`
    ("minilm": a dense vector store, or "bm25"), else 0.5 each. `fuse=False` ranks by the heads alone.
    The model reads the documents as one context: `read_tokens` reads each one's best part of at most that many
    tokens (its first sentence, then those sharing the most words with the query; None: whole, as the window
    allows), far faster over long documents. A read that takes more than a few seconds (a CPU) shows a progress bar
    (`progress`; None: when standard error is a terminal) and logs once which settings read less."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    top_n: int = Field(default=5, gt=0, strict=True)
    score_threshold: float | None = None
    fuse: bool = True
    first_stage: str = DEFAULT_FIRST_STAGE
    weights: dict[str, float] | None = None
    score_key: str | None = None
    read_tokens: int | None = None
    progress: bool | None = None
    backbone: Any = Field(default=None, exclude=True, repr=False)

    @field_validator("read_tokens", mode="before")
    @classmethod
    def _read_tokens(cls, read_tokens) -> int | None:
        return check_read_tokens(read_tokens)

    @field_validator("weights")
    @classmethod
    def _two_weights(cls, weights: dict | None) -> dict | None:
        return None if weights is None else check_rerank_weights(weights)

    def compress_documents(self, documents: Sequence[Document], query: str, callbacks: Callbacks | None = None
                           ) -> Sequence[Document]:
        ranked = rerank_passages([d.page_content for d in documents], query, self.top_n, self.backbone,
                                 fuse=self.fuse, first_stage_scores=self._first_stage_scores(documents),
                                 first_stage=self.first_stage, weights=self.weights, read_tokens=self.read_tokens,
                                 progress=self.progress)
        return [Document(page_content=documents[i].page_content, id=documents[i].id,
                         metadata={**documents[i].metadata, "relevance_score": score}) for i, score in ranked
                if self.score_threshold is None or score >= self.score_threshold]

    def _first_stage_scores(self, documents: Sequence[Document]) -> list | None:
        if self.score_key is not None:
            missing = [i for i, d in enumerate(documents) if self.score_key not in d.metadata]
            if missing:
                raise ValueError(f"score_key={self.score_key!r} is not in the metadata of document(s) {missing}; "
                                 "name the key the first stage writes its score to, or leave score_key None.")
            return [d.metadata[self.score_key] for d in documents]
        key = next((k for k in SCORE_KEYS if all(k in d.metadata for d in documents)), None)
        return None if key is None else [d.metadata[key] for d in documents]


__all__ = ["EndoDocumentCompressor", "EndoReranker"]
