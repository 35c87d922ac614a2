"""The S3 paper's context compression as a LangChain document compressor (for `ContextualCompressionRetriever`).

The documents any retriever returned are read as one context by the local LM and cut down to the endogenous
evidence under one token budget ([S3 Eq. 8]; or ILRe), keeping their order and metadata.
EndoReranker re-orders them by the model's query-focused retrieval heads (QRHead, calibrated as in In-Context
Re-ranking) and keeps the best `top_n`.
"""
from __future__ import annotations

from typing import Any, Sequence

from langchain_core.callbacks import Callbacks
from langchain_core.documents import BaseDocumentCompressor, Document
from pydantic import ConfigDict, Field, field_validator

from endo_retrieval.integrations import COMPRESS_METHODS, compress_passages, rerank_passages
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


class EndoReranker(BaseDocumentCompressor):
    """The `top_n` documents the retrieval heads score highest, best first, each with its score in
    `metadata["relevance_score"]` (the key LangChain's rerankers write); `score_threshold` drops those below it."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    top_n: int = Field(default=5, gt=0, strict=True)
    score_threshold: float | None = None
    backbone: Any = Field(default=None, exclude=True, repr=False)

    def compress_documents(self, documents: Sequence[Document], query: str, callbacks: Callbacks | None = None
                           ) -> Sequence[Document]:
        ranked = rerank_passages([d.page_content for d in documents], query, self.top_n, self.backbone)
        return [Document(page_content=documents[i].page_content, id=documents[i].id,
                         metadata={**documents[i].metadata, "relevance_score": score}) for i, score in ranked
                if self.score_threshold is None or score >= self.score_threshold]


__all__ = ["EndoDocumentCompressor", "EndoReranker"]
