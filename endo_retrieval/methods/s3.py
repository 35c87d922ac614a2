"""S3-Attention [S3 Alg. 1]: S3-Pure, BM25 alone, S3-Hybrid, each over one long context and over a corpus.

Each is one small class over the stored index (index/engine.py): for one context the context becomes a
one-document index; over a corpus `EndoIndex.select` (search.py) hands the stored index to the method's own
selection (`select_spans`): the signals it fuses (`signals`) and how they share the token budget [S3 Eq. 8].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Iterator

import numpy as np

from endo_retrieval.core import Compressed, Span, check_budget
from endo_retrieval.methods.base import BaseMethod, fit_to_budget
from endo_retrieval.methods.search import Document, EndoIndex
from endo_retrieval.model.backbone import Backbone
from endo_retrieval.scoring.fusion import RRF_K
from endo_retrieval.scoring.select import QA_KERNEL, density, iter_peaks, spans_from_peaks

# how the stored index scores each signal for a question: [S3 Eq. 7/9] over the feature postings, BM25 over sentences
SIGNAL_SCORES = {"s3": lambda index, question: index.s3_scores(question),
                 "bm25": lambda index, question: index.bm25_scores(question)}


@dataclass
class _EngineMethod(BaseMethod):
    """Two stages, timed apart by the bench: `prepare` indexes the context as a one-document corpus, `select`
    answers a question from it. S3 and S3-Hybrid build the same index (`index_kind`); BM25 needs no SAE pass."""

    backbone: Backbone | None = None
    kernel: int = QA_KERNEL  # Table 6: Conv1D kernel 8 for QA (48 otherwise)
    saes: object | None = None
    name: ClassVar[str] = ""
    index_kind: ClassVar[str] = "features"
    signals: ClassVar[tuple[str, ...]] = ()  # the per-position scores it fuses, in this order
    lead_tail: ClassVar[int] = 0  # the lead/tail bias of one context (at most budget/8); 0: no M_Bias at all
    s3_share: ClassVar[float] = 0.5

    def prepare(self, context: str):
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

    @classmethod
    def signal_scores(cls, index, question: str) -> dict[str, np.ndarray]:
        """The per-position score arrays this method fuses, of the stored `index`: {"s3": S[t], "bm25": ...}."""
        return {name: SIGNAL_SCORES[name](index, question) for name in cls.signals}

    @classmethod
    def select_spans(cls, index, budget: int, scores: dict[str, np.ndarray], lead_tail: int = 0,
                     kernel: int = QA_KERNEL, s3_share: float = 0.5) -> list[Span]:
        """Spans (source order) of the stored `index` under `budget` tokens, from the `scores` of its signals:
        density and NMS peaks per document (never across a document bound), the signals' peaks taking turns
        (`interleave`), grown to sentences; a method with a lead/tail bias keeps `lead_tail` tokens at each end of
        every document first [S3 Eq. 8]."""
        corpus = index.corpus
        bounds = corpus.segment_bounds()
        width = {name: peak_width(name, kernel) for name in scores}
        streams = {name: iter_peaks(density(s, width[name], bounds), width[name], bounds)
                   for name, s in scores.items()}
        taken: list[tuple[str, int]] = []  # (signal, peak) in the order they were offered to the budget
        kept = np.zeros(corpus.n_positions, dtype=bool)
        if cls.lead_tail > 0 and lead_tail > 0:  # M_Bias of [S3 Eq. 8]: the first and last tokens of each document
            for doc in corpus.documents():
                n = min(lead_tail, doc.n_tokens // 2)
                kept[doc.start: doc.start + n] = kept[doc.end - n: doc.end] = True
                taken += [("lead", doc.start), ("tail", doc.end - 1)]
            if kept.sum() > budget:
                raise ValueError(f"lead/tail of {lead_tail} tokens per document exceeds the budget of {budget}.")
        sentences = corpus.sentence_starts()
        peaks = interleave(streams, taken, s3_share, lambda p: int(np.searchsorted(sentences, p, side="right")))
        spans = spans_from_peaks(peaks, sentences, corpus.n_positions, budget, bounds, covered=kept)
        texts = [corpus.span_text(a, b) for a, b in spans]
        return scored_spans(spans, [t + (corpus.doc(t[0]).metadata,) for t in texts], taken)


class S3(_EngineMethod):
    """S3-Pure: IDF-weighted SAE feature co-activation [S3 Eq. 7/9] -> density -> NMS peaks -> sentence spans.
    Paper: "S3-Attention: Attention-Aligned Endogenous Retrieval for Memory-Bounded Long-Context Inference"
    (Ma, Wang, Wang et al.; https://arxiv.org/abs/2601.17702)."""

    name = "s3"
    signals = ("s3",)


class BM25(_EngineMethod):
    """BM25 alone (rank-bm25 Okapi over sentence windows), selected with the same density/peak/span machinery."""

    name = "bm25"
    index_kind = "bm25"
    signals = ("bm25",)


class S3Hybrid(_EngineMethod):
    """S3-Hybrid [S3 Eq. 8]: M_S3 u M_BM25 u M_Bias under one shared budget. The S3 and BM25 peaks take turns by
    rank (half each); the lead/tail bias keeps the first and last `lead_tail` tokens (at most budget/8)."""

    name = "s3-hybrid"
    signals = ("s3", "bm25")
    lead_tail = 32


def peak_width(signal: str, kernel: int) -> int:
    """The density kernel and NMS radius of a signal: BM25 scores are already one value per sentence, so smoothing
    would only blur the peak into a neighbour."""
    return 1 if signal == "bm25" else kernel


def scored_spans(ranges: list[tuple[int, int]], texts: list[tuple], taken: list[tuple[str, int]]) -> list[Span]:
    """The token ranges a budget took as Spans, each scored by reciprocal-rank fusion over the signals that chose it
    (`span_rrf`): evidence that both S3 and BM25 picked ranks above evidence only one of them picked. `texts`:
    (doc_id, char start, char end, text, metadata) per range; `taken`: (signal, peak) in the order the peaks were
    offered to the budget, so each signal's peaks come in its rank order."""
    offered: dict[str, list[int]] = {}
    for sig, p in taken:
        offered.setdefault(sig, []).append(p)
    ranked = {sig: np.asarray(ps) for sig, ps in offered.items()}
    out = []
    for (a, b), (doc_id, c0, c1, text, metadata) in zip(ranges, texts):
        score, signals = span_rrf(a, b, ranked)
        out.append(Span(a, b, c0, c1, text, score, signals, doc_id, metadata))
    return out


def span_rrf(a: int, b: int, ranked: dict[str, np.ndarray]) -> tuple[float, tuple[str, ...]]:
    """Reciprocal-rank fusion of the span [a, b): sum over the signals whose peaks fall inside it of 1 / (RRF_K +
    rank of the signal's best peak there), and those signals."""
    best: dict[str, int] = {}
    for sig, peaks in ranked.items():
        inside = (peaks >= a) & (peaks < b)
        if inside.any():
            best[sig] = int(inside.argmax())
    return sum(1.0 / (RRF_K + r) for r in best.values()), tuple(sorted(best))


def interleave(streams: dict[str, Iterator[int]], taken: list, s3_share: float, sentence_of: Callable[[int], int]
               ) -> Iterator[int]:
    """Yield the signals' peaks alternately by rank for one shared budget (the union of [S3 Eq. 8]): S3 gets `s3_share`
    of the turns. A turn must bring a sentence no signal offered yet: a peak inside an offered sentence is only
    recorded in `taken` (as (signal, peak), so the span credits both signals) and the same signal pulls again."""
    credit = {name: 0.0 for name in streams}
    share = {"s3": s3_share, "bm25": 1.0 - s3_share} if len(streams) == 2 else {n: 1.0 for n in streams}
    live = dict(streams)
    offered: set[int] = set()
    while live:
        for name in live:
            credit[name] += share[name]
        name = max(live, key=lambda n: credit[n])
        credit[name] -= 1.0
        for p in live[name]:
            taken.append((name, p))
            sentence = sentence_of(p)
            if sentence not in offered:
                offered.add(sentence)
                yield p
                break
        else:
            del live[name]
