"""`endo`, the default pipeline over a corpus: BM25 finds candidates, the model reads them, its retrieval heads rank
them.

Stage 1, cheap and over everything: BM25 over passages (a document as the user gave it, or a run of whole sentences
of at most PASSAGE_TOKENS of a longer one) keeps the best `depth`.
Stage 2: the model reads the candidates as one context, each cut to its best `read_tokens` (its first sentence,
which names what the passage is about, then the sentences that share the most question words), in the order chosen
on labelled data (best last: nearest the question), then the question; a candidate scores each calibrated
retrieval head's attention at its strongest token, summed over the heads (QRHead, calibrated as In-Context
Re-ranking does: `methods.heads.passage_signals`). A second hop re-reads the best first-hop candidates before the
question, for bridge questions whose second passage shares no word with the question.
The final score is the weighted sum of the stage scores, each standardised over the candidates, with weights fitted
on labelled data (`endo calibrate-pipeline`); the fit's grid holds BM25 alone, so on the data it was fitted on the
pipeline does not fall below its first stage.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from endo_retrieval.scoring.bm25 import OkapiPostings
from endo_retrieval.index.corpus import CorpusMap
from endo_retrieval.scoring.fusion import fuse
from endo_retrieval.methods.base import Span
from endo_retrieval.scoring.bm25 import words

PASSAGE_TOKENS = 256  # a document longer than this is cut into passages of whole sentences up to this many tokens
# the pipeline's settings where the model's profile has none (the shipped profile holds the values fitted on data)
DEFAULTS = {"depth": 20, "read_tokens": 128, "best_last": True, "weights": {"bm25": 0.5, "heads": 0.5}}


@dataclass
class Passages:
    """The corpus cut into candidate passages (token ranges [starts[i], ends[i]) inside one document), their
    sentences and BM25 over their words; built once per corpus state."""

    starts: np.ndarray
    ends: np.ndarray
    sentences: np.ndarray  # sorted global sentence starts (every passage start is one)
    bm25: OkapiPostings

    @classmethod
    def build(cls, corpus: CorpusMap, max_tokens: int = PASSAGE_TOKENS) -> "Passages":
        starts, ends = [], []
        for doc in corpus.documents():
            cuts = passage_cuts(doc.sentence_starts, doc.end, max_tokens)
            starts += cuts[:-1]
            ends += cuts[1:]
        texts = [corpus.span_text(a, b)[3] for a, b in zip(starts, ends)]
        return cls(np.asarray(starts, np.int64), np.asarray(ends, np.int64), corpus.sentence_starts(),
                   OkapiPostings.build([words(t) for t in texts]))

    def __len__(self) -> int:
        return len(self.starts)


def passage_cuts(sentence_starts: np.ndarray, end: int, max_tokens: int) -> list[int]:
    """Bounds [start, ..., end] of a document's passages: each as many whole sentences as fit in `max_tokens`
    (a longer sentence is a passage of its own, cut every `max_tokens`)."""
    cuts = [int(sentence_starts[0])]
    while end - cuts[-1] > max_tokens:
        fits = sentence_starts[(sentence_starts > cuts[-1]) & (sentence_starts <= cuts[-1] + max_tokens)]
        cuts.append(int(fits[-1]) if len(fits) else cuts[-1] + max_tokens)
    return cuts + [int(end)]


def best_part(corpus: CorpusMap, sentences: np.ndarray, a: int, b: int, question_words: set[str], max_tokens: int
              ) -> list[tuple[int, int]]:
    """Token ranges, in source order, of what to keep of the passage [a, b) in `max_tokens`: its first sentence,
    then its sentences with the most distinct question words (ties: earlier first), whole while they fit; the
    first one is cut to `max_tokens` if it alone is longer."""
    if b - a <= max_tokens:
        return [(a, b)]
    inner = sentences[(sentences > a) & (sentences < b)]
    bounds = np.concatenate(([a], inner, [b]))
    pieces = list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))
    overlap = [len(question_words & set(words(corpus.span_text(s, e)[3]))) for s, e in pieces[1:]]
    keep, used = [pieces[0]], min(pieces[0][1] - pieces[0][0], max_tokens)
    keep[0] = (a, a + used)
    for i in np.argsort(-np.asarray(overlap), kind="stable"):
        s, e = pieces[1 + int(i)]
        if used + e - s <= max_tokens and overlap[i] > 0:
            keep.append((s, e))
            used += e - s
    return sorted(keep)


def part_text(corpus: CorpusMap, parts: list[tuple[int, int]]) -> str:
    """The text of `best_part`'s pieces, joined by ' ... ' where something was left out between them."""
    return " ... ".join(corpus.span_text(a, b)[3].strip() for a, b in parts)


@dataclass
class EndoPipeline:
    """The `endo` ranking of a corpus's passages for a question (see the module docstring). Settings left None come
    from the model's heads profile (`pipeline`, fitted by `endo calibrate-pipeline`), else DEFAULTS."""

    backbone: object
    depth: int | None = None  # candidates stage 1 hands to the model
    read_tokens: int | None = None  # tokens the model reads of each candidate
    best_last: bool | None = None  # the model reads the candidates best last (nearest the question)
    weights: dict[str, float] | None = None  # stage score -> weight: "bm25", "heads", "hop2"
    # the model's linear maps in int8 (CPU only): the read takes about half the time, but on dev300's first 100
    # questions recall@5 fell from 80.5 (fp32, as bf16 on a GPU) to 75.5, so it is off unless asked for
    int8: bool = False
    heads: list | None = None

    def __post_init__(self):
        from endo_retrieval.methods.heads import profile_heads
        from endo_retrieval.model.profiles import heads_profile

        self.heads = [tuple(map(int, h)) for h in (self.heads or profile_heads(self.backbone))]
        fitted = (heads_profile(self.backbone) or {}).get("pipeline") or {}
        for name, default in DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, fitted.get(name, default))
        if self.int8 and self.backbone.device.type != "cpu":
            raise ValueError("int8 reads run on a CPU backbone only; on a GPU the bf16 read is faster")
        if not (isinstance(self.depth, int) and self.depth >= 1):
            raise ValueError(f"depth must be a whole number of candidates >= 1, got {self.depth!r}.")
        if not (isinstance(self.read_tokens, int) and self.read_tokens >= 8):
            raise ValueError(f"read_tokens must be a whole number of tokens >= 8, got {self.read_tokens!r}.")
        unknown = set(self.weights) - {"bm25", "heads", "hop2"}
        if unknown:
            raise ValueError(f"Unknown stage score(s) {sorted(unknown)}; the pipeline weighs bm25, heads and hop2.")

    def candidates(self, corpus: CorpusMap, passages: Passages, question: str, depth: int | None = None,
                   where=None) -> tuple[np.ndarray, np.ndarray]:
        """Stage 1: (passage indices, BM25 scores) of the best `depth` passages, best first (ties: corpus order);
        `where(metadata)`: only passages of the documents it accepts."""
        query = words(question)
        scores = passages.bm25.get_scores(query) if query else np.zeros(len(passages))
        order = np.argsort(-scores, kind="stable")
        if where is not None:  # a document's passages stay when `where` accepts its metadata (index -1: none)
            accepted = np.array([bool(where(d.metadata)) for d in corpus.documents()] + [False])
            order = order[accepted[corpus.locate(passages.starts[order])[0]]]
        top = order[: depth or self.depth]
        return top, scores[top]

    def read_texts(self, corpus: CorpusMap, passages: Passages, top: np.ndarray, question: str) -> list[str]:
        """What the model reads of each candidate (`best_part`), pieces of one passage joined by ' ... '."""
        q = set(words(question))
        return [part_text(corpus, best_part(corpus, passages.sentences, int(passages.starts[i]),
                                            int(passages.ends[i]), q, self.read_tokens)) for i in top]

    def stage_scores(self, corpus: CorpusMap, passages: Passages, question: str, depth: int | None = None,
                     where=None) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, float]]:
        """(candidate passage indices, {stage: score per candidate}, {stage: milliseconds})."""
        from endo_retrieval.methods.heads import passage_signals

        t0 = time.perf_counter()
        top, bm25 = self.candidates(corpus, passages, question, depth, where)
        t1 = time.perf_counter()
        texts = self.read_texts(corpus, passages, top, question)
        order = np.arange(len(top))[::-1] if self.best_last else np.arange(len(top))
        signals = {"bm25": bm25}
        if len(top):
            read = passage_signals(self.backbone, [texts[i] for i in order], question, self.heads,
                                   second_hop=bool(self.weights.get("hop2")), int8=self.int8,
                                   first_stage=bm25[order])
            for name, s in read.items():
                signals[name] = np.empty(len(top))
                signals[name][order] = s
        t2 = time.perf_counter()
        return top, signals, {"bm25": 1000 * (t1 - t0), "heads": 1000 * (t2 - t1)}

    def search(self, corpus: CorpusMap, passages: Passages, question: str, k: int, budget: int | None = None,
               where=None) -> list[Span]:
        """The k best passages, best first, as spans: score = the fused stage scores (higher is better), each
        stage's own score in `stage_scores`. `budget`: at most that many tokens in all, each passage cut to its
        best part (`best_part`) of budget // k tokens; a cut passage's text joins its pieces with ' ... ', and its
        character offsets run from the first piece's start to the last one's end."""
        t0 = time.perf_counter()
        top, signals, ms = self.stage_scores(corpus, passages, question, where=where)
        if not len(top):  # no document passes `where`
            return []
        fused = fuse(signals, self.weights)
        rank = np.lexsort((np.arange(len(top)), -fused))[:k]  # ties keep stage 1's order
        ms["total"] = 1000 * (time.perf_counter() - t0)
        q, spans = set(words(question)), []
        for r in rank:
            i = int(top[r])
            a, b = int(passages.starts[i]), int(passages.ends[i])
            parts = [(a, b)] if budget is None else best_part(corpus, passages.sentences, a, b, q,
                                                             max(1, budget // k))
            doc_id, c0, _, _ = corpus.span_text(parts[0][0], parts[0][1])
            _, _, c1, _ = corpus.span_text(parts[-1][0], parts[-1][1])
            doc = corpus.doc(doc_id)
            text = part_text(corpus, parts) if len(parts) > 1 else doc.text[c0:c1]
            scores = {name: round(float(s[r]), 6) for name, s in signals.items()} | {"fused": float(fused[r])}
            spans.append(Span(parts[0][0], parts[-1][1], c0, c1, text, float(fused[r]),
                              tuple(s for s, w in self.weights.items() if w), doc_id, doc.metadata,
                              stage_scores=scores, stage_ms=dict(ms),
                              whole_document=(parts[0][0], parts[-1][1]) == (doc.start, doc.end)))
        return spans
