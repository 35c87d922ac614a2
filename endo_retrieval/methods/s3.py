"""S3-Attention as compressors of one long context [S3 Alg. 1]: S3-Pure, BM25 alone, S3-Hybrid.

Each is one small class over the shared engine (engine.py): the context becomes a one-document index, and the
method decides which signals share the token budget.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from endo_retrieval.model.backbone import Backbone
from endo_retrieval.core import Compressed, Span, check_budget
from endo_retrieval.methods.base import BaseMethod, fit_to_budget
from endo_retrieval.scoring.select import QA_KERNEL


@dataclass
class _EngineMethod(BaseMethod):
    """Two stages, timed apart by the bench: `prepare` indexes the context as a one-document corpus, `select`
    answers a question from it. S3 and S3-Hybrid build the same index (`index_kind`); BM25 needs no SAE pass."""

    backbone: Backbone | None = None
    kernel: int = QA_KERNEL  # Table 6: Conv1D kernel 8 for QA (48 otherwise)
    saes: object | None = None
    name: ClassVar[str] = ""
    index_kind: ClassVar[str] = "features"
    lead_tail: ClassVar[int] = 0
    s3_share: ClassVar[float] = 0.5

    def prepare(self, context: str):
        from endo_retrieval.index.engine import Document, EndoIndex

        index = EndoIndex(self.backbone, method=self.name, saes=self.saes)  # "bm25" builds no feature postings
        index.add_documents([Document("context", context)])
        return index

    def select(self, index, question: str, budget: int) -> Compressed:
        check_budget(budget)
        n = index.corpus.n_tokens
        if n <= budget:  # nothing to drop
            doc = index.corpus.doc("context")
            whole = Span(0, n, 0, len(doc.text), doc.text, 1.0, ("all",), "context")
            return Compressed(doc.text, [whole], n, self.name, budget)
        # the index holds the backbone (self.backbone may be None: the default model)
        return fit_to_budget(self.rank(index, question, budget), budget, index.backbone, self.name)

    def rank(self, index, question: str, budget: int):
        scores = index.signal_scores(question, self.name)
        return lambda target: index.select(question, target, self.name, lead_tail=min(self.lead_tail, target // 8),
                                           kernel=self.kernel, s3_share=self.s3_share, scores=scores)


class S3(_EngineMethod):
    """S3-Pure: IDF-weighted SAE feature co-activation [S3 Eq. 7/9] -> density -> NMS peaks -> sentence spans.
    Paper: "S3-Attention: Attention-Aligned Endogenous Retrieval for Memory-Bounded Long-Context Inference"
    (Ma, Wang, Wang et al.; https://arxiv.org/abs/2601.17702)."""

    name = "s3"


class BM25(_EngineMethod):
    """BM25 alone (rank-bm25 Okapi over sentence windows), selected with the same density/peak/span machinery."""

    name = "bm25"
    index_kind = "bm25"


class S3Hybrid(_EngineMethod):
    """S3-Hybrid [S3 Eq. 8]: M_S3 u M_BM25 u M_Bias under one shared budget. The S3 and BM25 peaks take turns by
    rank (half each); the lead/tail bias keeps the first and last `lead_tail` tokens (at most budget/8)."""

    name = "s3-hybrid"
    lead_tail = 32
