"""The bench's row `endo-2stage`: `endo` over one context read in two stages, as the corpus pipeline reads a
corpus. The library's `endo` on one context is methods/endo.py's `Endo`, which reads the whole context."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from endo_retrieval.corpus import CorpusMap
from endo_retrieval.index.passages import Passages
from endo_retrieval.methods.base import BaseMethod
from endo_retrieval.methods.heads import HeadsError, checked_question
from endo_retrieval.methods.pipeline import EndoPipeline
from endo_retrieval.model.backbone import Backbone
from endo_retrieval.scoring.bm25 import words
from endo_retrieval.scoring.fusion import fuse
from endo_retrieval.scoring.select import sentence_spans


@dataclass
class TwoStageEndo(BaseMethod):
    """`endo` over one context read in two stages, as over a corpus (methods/pipeline.py): the context's runs of whole
    sentences of at most `window_tokens` are the candidates; BM25 keeps the best, the model reads them and the
    question, and the fused stage scores rank them. The budget takes whole sentences of the candidates in that
    order, then of the other windows in BM25's order. The model reads a fixed number of tokens whatever the
    context's length, so time and memory do not grow with it beyond BM25's."""

    name: ClassVar[str] = "endo"

    backbone: object = None
    window_tokens: int = 96
    pipeline: object = None  # an EndoPipeline (None: the model's fitted one)

    def __post_init__(self):
        self.backbone = Backbone.of(self.backbone)
        self.pipeline = self.pipeline or EndoPipeline(self.backbone)

    def prepare(self, context: str):
        if not isinstance(context, str) or not context.strip():
            raise HeadsError("The context is empty; give the text to retrieve from.")
        corpus = CorpusMap()
        corpus.add_document("context", context, self.backbone.encode(context).offsets)
        return corpus, Passages.build(corpus, self.window_tokens)

    def rank(self, prepared, question: str, budget: int):
        corpus, passages = prepared
        question = checked_question(question)
        top, stage, _ = self.pipeline.stage_scores(corpus, passages, question)
        fused = fuse(stage, self.pipeline.weights)
        ranked = top[np.lexsort((np.arange(len(top)), -fused))]
        rest = np.argsort(-passages.bm25.get_scores(words(question)), kind="stable")
        order = np.concatenate([ranked, rest[~np.isin(rest, ranked)]])
        starts = corpus.sentence_starts()
        first = np.searchsorted(starts, passages.starts)  # each window's first and last sentence
        last = np.searchsorted(starts, passages.ends)
        sentences = [i for p in order for i in range(first[p], last[p])]
        score = np.full(len(starts), -np.inf)
        for p, s in zip(top, fused):
            score[first[p]:last[p]] = s
        score = np.where(np.isfinite(score), score, 0.0)
        chose = {i: tuple(sorted(w for w, v in self.pipeline.weights.items() if v))
                 for p in top for i in range(first[p], last[p])}
        return lambda target: sentence_spans(corpus, sentences, target, self.name, chose, score)
