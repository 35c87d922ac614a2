"""Query-focused retrieval heads (`heads`): the context's sentences ranked by the attention that a few selected
heads pay from the question's tokens to each sentence's tokens, calibrated by a content-free question.

QRHead (Zhang et al., "Query-Focused Retrieval Heads Improve Long-Context Reasoning and Re-ranking", EMNLP 2025):
a document's score is the attention from the query tokens to its tokens, summed over a small set of heads chosen
on labelled data, not over all heads of a layer (a max or sum over all heads drowns the few that retrieve). We
score sentences, each by its most attended token (`sentence_max`), and sum that over the heads.
In-Context Re-ranking (Chen et al., ICLR 2025): subtract the same mass under a content-free query ("N/A"), which
removes what the model attends to whatever the question (the first tokens, punctuation, recent tokens).

The model reads the context once and asks it the question, the content-free question and a second hop
(`model/reading.py`); with the default segments the question sees every token at every layer. Batched (the
default), the question and the content-free question are read in the context's own forward and the second hop's
two in one more (`reading.ask_parts`): two forwards for what took five one part at a time (`batched=False`, the
plain twin the tests hold the batched reads against). `stream=True`
reads with ILRe's streaming prefill instead, bounded without segments, but the heads rank worse (docs/papers.md
has both measurements).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import ClassVar, Sequence

import numpy as np
import torch

from endo_retrieval.corpus import CorpusMap
from endo_retrieval.scoring.bm25 import _STOP as STOP_WORDS, SentenceBM25
from endo_retrieval.methods.base import BaseMethod
from endo_retrieval.model.profiles import heads_profile, heads_profile_path, missing
from endo_retrieval.model.reading import Reading, StageClock, ask, ask_parts, read, segment_cuts
from endo_retrieval.scoring.attention import logits
from endo_retrieval.scoring.select import sentence_spans
from endo_retrieval.model.backbone import Backbone
from endo_retrieval.scoring.fusion import rrf

QUESTION_TEMPLATE = "\n\nQuestion: {question}\nAnswer:"
NULL_QUESTION = "N/A"  # In-Context Re-ranking's content-free query


class HeadsError(ValueError):
    """Bad input or a missing retrieval-heads profile; the message says what to do."""


def head_attention(reading: Reading, queries: list[dict[int, torch.Tensor]], heads: Sequence[tuple[int, int]],
                   rows: slice = slice(None)) -> torch.Tensor:
    """Per head (layer, h): softmax over a segment's keys of q K^T / sqrt(d) ([ILRe Eq. 4]'s softmax_C, `logits`),
    averaged over the query part's `rows`, segment after segment: (len(heads), L); each segment's part of a row is
    a distribution over that segment."""
    layers = sorted({layer for layer, _ in heads})
    pick = _head_index(tuple(map(tuple, heads)), queries[0][layers[0]].device)  # where `logits` leaves its result
    out = []
    for segment, q_by_layer in zip(reading.segments, queries):
        # every layer's heads in one batched `logits` (layers as the batch), not one per layer: a question on a
        # GPU is bound by its launches
        q = torch.stack([q_by_layer[layer][:, rows] for layer in layers])  # (layers, n_heads, Lq, d)
        k = torch.stack([segment.keys[layer] for layer in layers])  # (layers, n_kv, L, d)
        probs = logits(q, k).softmax(-1).mean(2)  # (layers, n_heads, L)
        out.append(probs[pick])
    return torch.cat(out, dim=1)


@lru_cache(maxsize=64)
def _head_index(heads: tuple[tuple[int, int], ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row of the heads' layers, head) per head, on `device`, made once: each made anew cost a host-to-device wait."""
    row_of = {layer: i for i, layer in enumerate(sorted({layer for layer, _ in heads}))}
    return (torch.tensor([row_of[layer] for layer, _ in heads], device=device),
            torch.tensor([h for _, h in heads], device=device))


def sentence_max(token_scores: np.ndarray, sentence_starts: np.ndarray) -> np.ndarray:
    """Per sentence ([starts[i], starts[i+1]) in token positions), the highest token score; along the last axis.
    QRHead sums a document's tokens; over sentences the maximum ranked gold sentences better on the calibration
    data (gold share in budget 0.888 against 0.866 for the sum, docs/papers.md), as one strongly attended token
    (a name) marks the sentence however long it is."""
    return np.maximum.reduceat(np.asarray(token_scores, dtype=np.float64), np.asarray(sentence_starts), axis=-1)


def query_part(backbone, question: str, prefix: str = "") -> tuple[np.ndarray, slice]:
    """The query part's ids and the rows that are the question (from "Question:" on): a prefix (a second hop's
    evidence) is read but its own rows are not scored, since they would find their own copies in the context."""
    head_ids = backbone.encode(prefix).ids if prefix else np.empty(0, np.int64)
    ids = backbone.encode(prefix + QUESTION_TEMPLATE.format(question=question)).ids
    return ids, slice(min(len(head_ids), len(ids) - 1), None)


# ---------------------------------------------------------------- one context, prepared for questions


@dataclass
class Prepared:
    """A context read once: its sentences (a one-document corpus map), the model's reading, and BM25 over the
    sentences (built on first use: the pipeline's reads of candidates never ask it, and it cost them ~5 ms)."""

    text: str
    corpus: CorpusMap
    reading: Reading
    null: dict = field(default_factory=dict)  # the content-free question's attention, per set of heads

    @cached_property
    def bm25(self) -> SentenceBM25:
        return SentenceBM25.build(self.corpus)

    @property
    def sentence_starts(self) -> np.ndarray:
        return self.corpus.sentence_starts()

    def sentence_text(self, i: int) -> str:
        starts = np.append(self.sentence_starts, self.corpus.n_positions)
        return self.corpus.span_text(int(starts[i]), int(starts[i + 1]))[3]


def prepare_context(backbone, context: str, layers: Sequence[int], segment: int | None = None, **read_options
                    ) -> Prepared:
    """The context's sentences and the model's reading in segments of at most `segment` tokens
    (default: the model's trained window) cut at sentence starts. A context of one segment is split into
    sentences after its read is launched: on a GPU the host does it while the read's kernels run."""
    segment = segment or backbone.max_position or 8192
    enc = backbone.encode(context)
    corpus = CorpusMap()
    if len(enc) <= segment:
        reading = read(backbone, enc.ids, layers, cuts=[0, len(enc)], **read_options)
        corpus.add_document("context", context, enc.offsets)
    else:  # the segments are cut at sentence starts
        corpus.add_document("context", context, enc.offsets)
        cuts = segment_cuts(corpus.sentence_starts(), len(enc), segment)
        reading = read(backbone, enc.ids, layers, cuts=cuts, **read_options)
    return Prepared(context, corpus, reading)


def calibrated_attention(backbone, prepared: Prepared, heads: Sequence[tuple[int, int]], question: str,
                         prefix: str = "", layers: Sequence[int] = (), batched: bool = True
                         ) -> tuple[np.ndarray, dict]:
    """Per head, the question's attention over the context minus the content-free question's (ICR): (len(heads),
    L), and the question's queries at the heads' layers plus `layers`. Without a prefix the content-free
    attention is the same for every question, so it is computed once per context. batched: the two query parts
    in one forward per segment (`ask_parts`, or none where the read asked them), else one each (`ask`)."""
    layers = sorted({l for l, _ in heads} | set(layers))
    ids, rows = query_part(backbone, question, prefix)
    key = (prefix, tuple(heads))
    null = prepared.null.get(key)
    parts = [(ids, rows)] + ([query_part(backbone, NULL_QUESTION, prefix)] if null is None else [])
    asked = ask_parts(backbone, prepared.reading, [p for p, _ in parts], layers) if batched else \
        [ask(backbone, prepared.reading, p, layers) for p, _ in parts]
    if null is None:
        null = head_attention(prepared.reading, asked[1], heads, parts[1][1])
        if not prefix:
            prepared.null[key] = null
    real = head_attention(prepared.reading, asked[0], heads, rows)
    return (real - null).cpu().numpy(), asked[0]


def calibrated_scores(backbone, prepared: Prepared, heads: Sequence[tuple[int, int]], question: str,
                      prefix: str = "", per_head: bool = False) -> np.ndarray:
    """Per sentence: each head's calibrated attention (`calibrated_attention`) at its strongest token of the
    sentence, summed over the heads; per_head: one row per head, (len(heads), n_sentences)."""
    calibrated, _ = calibrated_attention(backbone, prepared, heads, question, prefix)
    per_sentence = sentence_max(calibrated, prepared.sentence_starts)
    return per_sentence if per_head else per_sentence.sum(0)


def profile_heads(backbone) -> list[tuple[int, int]]:
    profile = heads_profile(backbone)
    if profile is None:
        raise HeadsError(missing(backbone, "heads", heads_profile_path(backbone)) +
                         " Or pass heads=[(layer, head), ...].")
    return [tuple(h) for h in profile["heads"]]


# ---------------------------------------------------------------- the method


@dataclass
class RetrievalHeads(BaseMethod):
    """`heads`: sentences in the order of their calibrated retrieval-head attention (QRHead + ICR), whole
    sentences into the budget. heads None takes the model's calibrated heads (`endo calibrate-heads`)."""

    name: ClassVar[str] = "heads"
    index_kind: ClassVar[str] = "heads"  # `endo` prepares the same reading: the bench reuses it

    backbone: object = None
    heads: list[tuple[int, int]] | None = None
    sink: int = 4
    window: int = 512
    chunk_size: int = 2048
    segment: int | None = None  # one forward per segment of at most this many tokens (None: the trained window)
    stream: bool = False  # read with ILRe's sink + window streaming instead (bounded memory, worse ranking)

    def __post_init__(self):
        self.backbone = Backbone.of(self.backbone)  # None: the default model; a folder or GGUF path: that model
        self.heads = [tuple(map(int, h)) for h in (self.heads or profile_heads(self.backbone))]
        bad = [h for h in self.heads if not (0 <= h[0] < self.backbone.n_layers and 0 <= h[1] < self.backbone.n_heads)]
        if bad or not self.heads:
            raise HeadsError(f"heads must be (layer, head) pairs of this model ({self.backbone.n_layers} layers, "
                             f"{self.backbone.n_heads} heads); got {bad or 'none'}.")

    @property
    def layers(self) -> list[int]:
        return sorted({l for l, _ in self.heads})

    def prepare(self, context: str) -> Prepared:
        if not isinstance(context, str) or not context.strip():
            raise HeadsError("The context is empty; give the text to retrieve from.")
        return prepare_context(self.backbone, context, self.layers, segment=self.segment, stream=self.stream,
                               sink=self.sink, window=self.window, chunk_size=self.chunk_size)

    def sentence_scores(self, prepared: Prepared, question: str) -> np.ndarray:
        return calibrated_scores(self.backbone, prepared, self.heads, checked_question(question))

    def rank(self, prepared: Prepared, question: str, budget: int):
        score = self.sentence_scores(prepared, question)
        order = np.argsort(-score, kind="stable")
        return lambda target: sentence_spans(prepared.corpus, order, target, self.name, score=score)


def checked_question(question: str) -> str:
    """The question, stripped; a HeadsError when it is empty (the heads rank by its attention)."""
    if not isinstance(question, str) or not question.strip():
        raise HeadsError("question is empty: the heads rank the context by the question's attention; give one.")
    return question.strip()


# ---------------------------------------------------------------- the same signal as a reranker


PASSAGE_SEPARATOR = "\n\n"


def rank_passages(backbone, passages: Sequence[str], question: str, heads: Sequence[tuple[int, int]] | None = None
                  ) -> np.ndarray:
    """One score per passage, higher is better: the model reads the passages (in the given order, as one context)
    and then the question; a passage scores each head's calibrated attention at its most attended token, summed
    over the heads (as a sentence does in `heads`). For pipelines that already have a first stage."""
    return passage_signals(backbone, passages, question, heads)["heads"] if passages else np.zeros(0)


HOP_PASSAGES = 2  # first-hop passages the second hop re-reads


def passage_signals(backbone, passages: Sequence[str], question: str, heads: Sequence[tuple[int, int]] | None = None,
                    second_hop: bool = False, int8: bool = False, first_stage: np.ndarray | None = None,
                    evidence: Sequence[int] | None = None, batched: bool = True) -> dict[str, np.ndarray]:
    """Per passage: "heads", `rank_passages`'s score; with second_hop, "hop2": the same heads when the question
    comes behind the HOP_PASSAGES best first-hop passages (by reciprocal-rank fusion of the heads and
    `first_stage`'s scores when given; `evidence`: these passages instead), which a bridge question needs to find
    a passage that shares no word with it. int8 (CPU): the model reads through int8 linear maps. batched: the query
    parts read together (the module docstring), else one forward each."""
    return read_passages(backbone, passages, question, heads, second_hop, int8, first_stage, evidence,
                         batched).signals


@dataclass
class PassageReading:
    """What one read of passages gives: the per-passage `signals`, and per token of the read `text` the heads'
    calibrated attention summed over the heads (`token_scores`), its character `offsets`, each passage's
    character range [start, end) in `text` (`chars`), and the milliseconds of each stage (`ms`): "read" (the
    forward through the passages; batched, with the question and the content-free question behind them),
    "question" (their attention; not batched, their two forwards too), "hop2" (the second hop's two query parts)."""

    signals: dict
    text: str
    offsets: np.ndarray
    token_scores: np.ndarray
    chars: list[tuple[int, int]]
    ms: dict = field(default_factory=dict)


def read_passages(backbone, passages: Sequence[str], question: str, heads: Sequence[tuple[int, int]] | None = None,
                  second_hop: bool = False, int8: bool = False, first_stage: np.ndarray | None = None,
                  evidence: Sequence[int] | None = None, batched: bool = True) -> PassageReading:
    """`passage_signals` with the token-level attention it was taken from (for a bridge: `bridge_terms`)."""
    if not passages:
        empty = {"heads": np.zeros(0)} | ({"hop2": np.zeros(0)} if second_hop else {})
        return PassageReading(empty, "", np.zeros((0, 2), np.int64), np.zeros(0), [])
    if any(not isinstance(p, str) for p in passages):
        raise HeadsError("passages must be strings")
    heads = [tuple(map(int, h)) for h in (heads or profile_heads(backbone))]
    question = checked_question(question)
    text, chars = "", []
    for p in passages:
        body = p.strip() or "-"
        chars.append((len(text), len(text) + len(body)))
        text += body + PASSAGE_SEPARATOR
    starts = [a for a, _ in chars]
    clock = StageClock(backbone.device)
    # batched: the question and the content-free question ride in the read's own forward (int8 reads ask one part
    # per forward: `model.reading.read`)
    parts = [query_part(backbone, q)[0] for q in (question, NULL_QUESTION)] if batched and not int8 else ()
    prepared = prepare_context(backbone, text, sorted({l for l, _ in heads}), int8=int8, parts=parts)
    clock.lap("read")
    offsets = prepared.corpus.doc("context").offsets  # the tokens the model read: each passage's first one
    token_of = np.minimum(np.searchsorted(np.maximum.accumulate(offsets[:, 1]), np.asarray(starts), side="right"),
                          len(offsets) - 1)
    calibrated, _ = calibrated_attention(backbone, prepared, heads, question, batched=batched)
    out = {"heads": sentence_max(calibrated, token_of).sum(0)}
    clock.lap("question")
    if second_hop:
        if evidence is None:
            ranks = rrf(out["heads"], first_stage) if first_stage is not None else out["heads"]
            evidence = np.argsort(-ranks, kind="stable")[:HOP_PASSAGES].tolist()
        read_first = " ".join(passages[i].strip() for i in sorted(evidence))
        hop, _ = calibrated_attention(backbone, prepared, heads, question, prefix=f"\n\nEvidence: {read_first}",
                                      batched=batched)
        out["hop2"] = sentence_max(hop, token_of).sum(0)
        clock.lap("hop2")
    return PassageReading(out, text, offsets, calibrated.sum(0), chars, clock.ms)


# ---------------------------------------------------------------- the bridge of a second hop that retrieves

BRIDGE_TERMS = 4  # words or names a second hop asks the index with
STEM = 5
_TERM = re.compile(r"\w+(?:['\u2019]\w+)*")  # a word, an apostrophe inside it kept (O'Neill, Kelly's)


def _base(word: str) -> str:
    """The word lowercased, without what follows an apostrophe: "town's" is the question's "town"."""
    return re.split("['\u2019]", word.lower())[0]


def bridge_terms(text: str, offsets: np.ndarray, token_scores: np.ndarray, question: str, n: int = BRIDGE_TERMS
                 ) -> list[tuple[str, float]]:
    """The words of `text` the question's heads attend to most that the question does not hold: [(term, score)],
    best first, at most `n`, distinct (case-insensitive). A token scores its word (a word takes its strongest
    token, as a passage does); neighbouring capitalised words separated only by spaces join into one term (a name:
    "Jonas Eberle") scored by its strongest word; stop words, words without a letter and the question's words are
    skipped and break such a run. Tokens scored -inf (outside the passages to take a bridge from) give nothing."""
    asked = {_base(w) for w in _TERM.findall(question)}
    # a crude stem: a word sharing its first STEM letters with a question word is the question's ("founded" for
    # "founder"), so the bridge is what the passage adds, not another form of what was asked
    stems = {w[:STEM] for w in asked if len(w) >= STEM}
    ends = np.maximum.accumulate(offsets[:, 1]) if len(offsets) else np.zeros(0, np.int64)
    units: list[tuple[str, float, int]] = []  # (term, score, char end) of the open run, then closed terms
    best: dict[str, tuple[str, float]] = {}
    run: list[tuple[str, float, int, int]] = []  # the capitalised words of the current run: (word, score, a, b)

    def close_run():
        if run:
            term, score = " ".join(w for w, *_ in run), max(s for _, s, *_ in run)
            units.append((term, score, run[-1][3]))
            run.clear()

    for m in _TERM.finditer(text):
        word, a, b = m.group(), m.start(), m.end()
        first, last = int(np.searchsorted(ends, a, side="right")), int(np.searchsorted(offsets[:, 0], b))
        score = float(np.max(token_scores[first:last])) if last > first else -np.inf
        low = _base(word)
        skip = (low in asked or low[:STEM] in stems or low in STOP_WORDS or not any(c.isalpha() for c in word)
                or not np.isfinite(score))
        joins = bool(run) and not skip and word[0].isupper() and text[run[-1][3]:a].isspace()
        if not joins:
            close_run()
        if skip:
            continue
        if word[0].isupper():
            run.append((word, score, a, b))
        else:
            units.append((word, score, b))
    close_run()
    for term, score, _ in units:
        key = term.lower()
        if key not in best or score > best[key][1]:
            best[key] = (term, score)
    ranked = sorted(best.values(), key=lambda t: -t[1])
    return [(term, round(score, 6)) for term, score in ranked[:n]]
