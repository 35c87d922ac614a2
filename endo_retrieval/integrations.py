"""Framework-free glue shared by the LlamaIndex and LangChain adapters and the MCP server (imports as
`endo_retrieval.integrations`; needs neither framework).

- `open_index`: build, load, or build-and-save an `EndoIndex` with the checks every adapter wants;
- `check_k`: the one rule for how many hits a retriever returns;
- `search_hits`: the retrievers' hits, one per document unless passages are asked for;
- `provenance`: the metadata an evidence span carries back into a framework (document id, character offsets);
- `compress_passages`: the S3 paper's compression of one long context, applied to the passages another retriever
  returned, with each kept piece mapped back to the passage it came from;
- `rerank_passages`: the passages another retriever returned, best first by the retrieval heads' score, alone or
  fused with the first stage's;
- `long_read`, `pipeline_progress`: where the model's read will take a while (a CPU), a progress bar and, once, a
  hint naming the settings that read less;
- `GenerationSettings`: the settings of the local LLM adapters (EndoLLM, ChatEndo), one pydantic model both inherit.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
from pydantic import BaseModel, Field

from endo_retrieval.attention import get_backend
from endo_retrieval.methods.search import Document, EndoIndex
from endo_retrieval.index.hits import (best_per_document, check_whole_documents,  # noqa: F401 (the adapters' import)
                                      whole_document, with_section)
from endo_retrieval.index.passages import best_part, part_text
from endo_retrieval.corpus import CorpusMap
from endo_retrieval.scoring.bm25 import words
from endo_retrieval.methods import DEFAULT_METHOD, PIPELINE_METHODS, REGISTRY, compress
from endo_retrieval.methods import heads as retrieval_heads  # looked up per call: a test replaces rank_passages
from endo_retrieval.methods.heads import PASSAGE_SEPARATOR
from endo_retrieval.core import Span
from endo_retrieval.model.backbone import Backbone
from endo_retrieval.scoring.adaptive import AdaptiveWeights
from endo_retrieval.scoring.fusion import fuse as fused
from endo_retrieval.model.profiles import heads_profile, heads_profile_path

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


def search_hits(index: EndoIndex, question: str, k: int, budget: int | None = None, method: str | None = None,
                where=None, return_passages: bool = False, depth: int | None = None,
                read_tokens: int | None = None, *, return_document: bool = False,
                progress: bool | None = None, first_stage: str | None = None) -> list[Span]:
    """The k best hits, best first. By default each from another document: a document's best passage (`endo`) or
    span (`s3-hybrid`, `s3`, `bm25`), with that passage's offsets in its document. Fewer than k come back only when
    fewer documents are found: `endo` ranks the candidates the model read (its `depth` passages), the other methods
    what fits `budget` (default: as many spans as it takes). `return_passages=True`: the k best passages as the
    index ranks them, several of which may come from one document. `return_document=True`: each hit is its whole
    document (`whole_document`), ranked by its best passage, whose offsets are in the metadata. `depth`,
    `read_tokens`: the pipeline's (`EndoIndex.search`). `progress`: a progress bar while the model reads, when that
    takes more than a few seconds (None: when standard error is a terminal; `pipeline_progress`)."""
    check_document_options(return_passages, return_document)
    pipeline = {"depth": depth, "read_tokens": read_tokens} | ({"first_stage": first_stage} if first_stage else {})
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


def check_pipeline_settings(index: EndoIndex, method: str | None, depth: int | None, read_tokens: int | None,
                            first_stage: str | None = None) -> None:
    """A retriever's `depth` / `read_tokens`, checked when it is built (a bad value fails there, not at the first
    query); they tune the `endo` pipelines and are refused for another method, which they would not change."""
    if depth is None and read_tokens is None and first_stage is None:
        return
    method = index.check_method(method)
    if method not in PIPELINE_METHODS:
        raise ValueError(f"depth, read_tokens and first_stage tune the endo pipelines; {method!r} reads no "
                         "candidates.")
    index.pipeline(method, depth, read_tokens, first_stage)
    if first_stage not in (None, "bm25") and index.dense is None:
        raise ValueError(f"first_stage={first_stage!r} needs passage embeddings, which this index does not hold (it "
                         "was built with first_stage='bm25'): call index.add_embeddings(), or rebuild it.")


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


# The model reads the candidates with the first stage's best last, nearest the question: chosen over the first
# stage's own order on calib100's gold-only paragraphs (`endo bench rerank --order`: a tie keeping 5 of 20, 230
# against 226 gold sentences keeping 2; bench/results/quality/rerank_calib100*.md).
RERANK_BEST_LAST = True


# The reranker's fusion where the model's heads profile holds no fitted weights for the first stage: the first stage
# and the heads, each standardised over the candidates, weigh the same. `fit_reranker_section`
# (endo_retrieval.calibration.reranker) fits them into the profile's `reranker` section, one entry per first stage.
RERANK_WEIGHTS = {"first_stage": 0.5, "heads": 0.5}
FIRST_STAGES = ("minilm", "bm25")  # the profile's entries: a dense vector store (MiniLM's kind), BM25
DEFAULT_FIRST_STAGE = "minilm"  # a vector store is the usual first stage before a reranker


def rerank_passages(passages: Sequence[str], question: str, top_n: int, backbone=None,
                    best_last: bool = RERANK_BEST_LAST, *, fuse: bool = False,
                    first_stage_scores: Sequence[float | None] | None = None,
                    first_stage: str = DEFAULT_FIRST_STAGE, weights: dict | None = None,
                    read_tokens: int | None = None, progress: bool | None = None) -> list[tuple[int, float]]:
    """(passage index, score) of the `top_n` best passages, best first; ties keep the first stage's order.
    `passages` come in the first stage's order, best first. fuse=False: the score is the retrieval heads' alone
    (`passage_heads_scores`). fuse=True: the first stage's score (`first_stage_signal`) and the heads', each
    standardised over the passages, summed with `weights` ({"first_stage": w, "heads": 1 - w}; None: the model's
    fitted weights for `first_stage`, `reranker_weights`). `read_tokens`: the model reads each passage's best part
    of at most that many tokens (None: whole, as far as the window allows), `progress`: `passage_heads_scores`'s."""
    if isinstance(top_n, bool) or not isinstance(top_n, (int, np.integer)) or top_n <= 0:
        raise ValueError(f"top_n must be a positive whole number of passages to keep, got {top_n!r}.")
    check_read_tokens(read_tokens)
    if not isinstance(question, str) or not question.strip():
        raise ValueError("Reranking needs the question (the query string): the heads rank passages by its attention.")
    if not passages:
        return []
    if weights is not None:
        check_rerank_weights(weights)
    heads = passage_heads_scores(passages, question, backbone, best_last, read_tokens=read_tokens, progress=progress)
    scores = heads
    if fuse:
        signals = {"first_stage": first_stage_signal(first_stage_scores, len(passages)), "heads": heads}
        rule = None if weights else reranker_rule(Backbone.of(backbone), first_stage)
        scores = rule.fuse(signals) if rule else fused(signals, weights or reranker_weights(Backbone.of(backbone),
                                                                                              first_stage))
    return [(int(i), float(scores[i])) for i in np.argsort(-scores, kind="stable")[:top_n]]


def passage_heads_scores(passages: Sequence[str], question: str, backbone=None,
                         best_last: bool = RERANK_BEST_LAST, read_tokens: int | None = None,
                         progress: bool | None = None) -> np.ndarray:
    """The retrieval heads' score of each passage (`endo_retrieval.methods.heads.rank_passages`), in the given order.
    `best_last` hands the passages (the first stage's best first) to the model reversed. Passages longer together
    than the model's window are each read in part (`fit_to_window`), never dropped; `read_tokens` reads at most
    that many tokens of each. A read that will take more than a few seconds shows a progress bar (`progress`; None:
    when standard error is a terminal) and logs once how to read less (`long_read`)."""
    backbone = Backbone.of(backbone)
    read, tokens = _fit(backbone, passages, question, None, check_read_tokens(read_tokens))
    order = np.arange(len(passages))[::-1] if best_last else np.arange(len(passages))
    scores = np.empty(len(passages))
    what = f"reranking {len(passages)} passages ({tokens:,} tokens{'' if read_tokens else ', read whole'})"
    with long_read(backbone, tokens, what, rerank_faster(len(passages), read_tokens), "rerank", progress):
        scores[order] = retrieval_heads.rank_passages(backbone, [read[i] for i in order], question)
    return scores


def check_read_tokens(read_tokens) -> int | None:
    """None, or a whole number of tokens >= 8 (the pipeline's rule), else a ValueError saying so."""
    if read_tokens is not None and (isinstance(read_tokens, bool) or not isinstance(read_tokens, (int, np.integer))
                                    or read_tokens < 8):
        raise ValueError(f"read_tokens must be a whole number of tokens >= 8 (or None: read whole), got "
                         f"{read_tokens!r}.")
    return None if read_tokens is None else int(read_tokens)


def first_stage_signal(scores: Sequence[float | None] | None, n: int) -> np.ndarray:
    """The first stage's score of each of its n passages (given best first): its own scores when it gave a finite one
    for every passage, else -rank, so that either can be standardised and fused with the heads'."""
    if scores is not None and len(scores) == n and all(
            isinstance(s, (int, float, np.number)) and not isinstance(s, bool) and np.isfinite(s) for s in scores):
        return np.asarray(scores, dtype=np.float64)
    return -np.arange(n, dtype=np.float64)


def check_rerank_weights(weights) -> dict[str, float]:
    """{"first_stage": w, "heads": v} with numbers >= 0, not both 0, else a ValueError saying so."""
    ok = (isinstance(weights, dict) and set(weights) == set(RERANK_WEIGHTS)
          and all(isinstance(w, (int, float)) and not isinstance(w, bool) and np.isfinite(w) and w >= 0
                  for w in weights.values()) and sum(weights.values()) > 0)
    if not ok:
        raise ValueError(f"Reranker weights must be {{'first_stage': w, 'heads': v}}, two numbers >= 0 and not both "
                         f"0 (e.g. w in [0, 1] and v = 1 - w), got {weights!r}.")
    return {name: float(w) for name, w in weights.items()}


def reranker_rule(backbone, first_stage: str = DEFAULT_FIRST_STAGE) -> AdaptiveWeights | None:
    """The adaptive fusion (scoring/adaptive.py) the model's profile holds for reranking after `first_stage`, fitted
    across domains by `endo calibrate-fusion`; None where it holds none (the fixed weights then)."""
    entry = ((heads_profile(backbone) or {}).get("reranker") or {}).get(first_stage) or {}
    if not isinstance(entry, dict) or not entry.get("adaptive"):
        return None
    try:
        return AdaptiveWeights.from_json(entry["adaptive"])
    except ValueError as err:
        raise ValueError(f"The reranker entry {first_stage!r} of {heads_profile_path(backbone)} is damaged ({err}); "
                         "fit it again (endo calibrate-fusion) or pass weights.") from None


def reranker_weights(backbone, first_stage: str = DEFAULT_FIRST_STAGE) -> dict[str, float]:
    """The fusion weights the model's heads profile holds for `first_stage` (its `reranker` section, fitted by
    `endo_retrieval.calibration.reranker`), else RERANK_WEIGHTS."""
    fitted = (heads_profile(backbone) or {}).get("reranker") or {}
    if first_stage not in fitted:
        if first_stage not in FIRST_STAGES:
            raise ValueError(f"No reranker weights for the first stage {first_stage!r}; name one of "
                             f"{', '.join(sorted({*FIRST_STAGES, *fitted}))}, or pass weights.")
        return dict(RERANK_WEIGHTS)
    entry = fitted[first_stage]
    try:
        return check_rerank_weights({name: entry.get(name) for name in RERANK_WEIGHTS})
    except (AttributeError, ValueError):
        raise ValueError(f"The reranker entry {first_stage!r} of {heads_profile_path(backbone)} is damaged "
                         f"({entry!r}); fit it again (endo_retrieval.calibration.reranker) or pass weights.") from None


QUESTION_ROOM = 256  # tokens of the window kept for the question, its template and the passages' separators
MIN_SHARE = 16  # fewer tokens per passage than this read as nothing: refuse instead


def fit_to_window(backbone, passages: Sequence[str], question: str, window: int | None = None,
                  read_tokens: int | None = None) -> list[str]:
    """What the model reads of each passage: all of it when the passages fit in `window` tokens (default: the
    model's trained window less QUESTION_ROOM) together; else each passage longer than an equal share keeps its
    best part of that share (`pipeline.best_part`: its first sentence, then the sentences with the most question
    words), the share being as large as the shorter passages, read whole, leave room for. No passage is dropped.
    `read_tokens`: the share is at most that many tokens (each passage's best part of it, as the pipeline reads)."""
    return _fit(backbone, passages, question, window, read_tokens)[0]


def _fit(backbone, passages: Sequence[str], question: str, window: int | None, read_tokens: int | None
         ) -> tuple[list[str], int]:
    """`fit_to_window`'s texts and how many tokens they hold together (the read's length, less the separators)."""
    window = window or (backbone.max_position or 8192) - QUESTION_ROOM
    corpus = CorpusMap()
    for i, text in enumerate(passages):
        corpus.add_document(str(i), text, backbone.encode(text).offsets)
    docs = [corpus.doc(str(i)) for i in range(len(passages))]
    lengths = np.array([d.n_tokens for d in docs], dtype=np.int64)
    share = None
    if lengths.sum() > window:
        share = water_level(lengths, window)
        if share < MIN_SHARE:
            raise ValueError(f"{len(passages)} passages do not fit in the model's window of {window} tokens even at "
                             f"{MIN_SHARE} tokens each; hand the reranker fewer candidates (the first stage's top_k).")
    if read_tokens is not None:
        share = read_tokens if share is None else min(share, read_tokens)
    if share is None or lengths.max(initial=0) <= share:
        return list(passages), int(lengths.sum())
    q, sentences = set(words(question)), corpus.sentence_starts()
    return ([text if n <= share else part_text(corpus, best_part(corpus, sentences, d.start, d.end, q, share))
             for text, n, d in zip(passages, lengths, docs)], int(np.minimum(lengths, share).sum()))


def water_level(lengths: np.ndarray, room: int) -> int:
    """The largest share s with sum(min(length, s)) <= room: the short passages whole, the long ones s each."""
    ordered = np.sort(lengths)
    whole = np.concatenate(([0], np.cumsum(ordered)))  # tokens of the i shortest passages
    for i, n in enumerate(ordered):
        share = (room - whole[i]) // (len(ordered) - i)
        if share < n:
            return int(share)
    return int(ordered[-1])


# ---------------------------------------------------------------- long reads: progress and a hint

log = logging.getLogger(__name__)

SLOW_S = 3.0  # a read expected (or found) to take longer shows a progress bar where asked and logs the hint once
# A read of n tokens costs about n * (1 + n / QUADRATIC_FROM) units: the layers' cost grows with n, attention's with
# n squared. CPU_UNITS_PER_S is the rate of SmolLM2-135M (REFERENCE_PARAMS) on two CPU cores: the pipeline's 12
# candidates x 128 tokens in 1.62 s p50 when idle (~1,100 units/s), rank_passages over 1k to 8k tokens at 580 to 800
# beside other work; another model scales it by its parameters, until one of its reads is timed (`_rates` keeps the
# last reads' rate per backbone).
QUADRATIC_FROM = 8192
CPU_UNITS_PER_S = 1000.0
REFERENCE_PARAMS = 135e6
READ_TOKENS_HINT = 128  # the pipeline's read of each candidate, named in the reranker's hint
_rates: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_params: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_hinted: set[str] = set()  # the kinds of read whose hint was logged in this process


def read_cost(tokens: int) -> float:
    return tokens * (1 + tokens / QUADRATIC_FROM)


def expected_seconds(backbone, tokens: int) -> float | None:
    """How long the model will take to read `tokens` tokens: from its last reads' rate, else on a CPU from its size;
    None on an accelerator not yet timed (fast, until a read there says otherwise)."""
    try:
        rate = _rates.get(backbone)
    except TypeError:  # a backbone stand-in that cannot be weakly referenced
        return None
    if rate is None:
        device = getattr(getattr(backbone, "device", None), "type", None)
        if device != "cpu":
            return None
        rate = CPU_UNITS_PER_S * REFERENCE_PARAMS / _n_params(backbone)
    return read_cost(tokens) / rate


def _n_params(backbone) -> float:
    if backbone not in _params:
        model = getattr(backbone, "model", None)
        _params[backbone] = float(sum(p.numel() for p in model.parameters())) if model is not None else \
            REFERENCE_PARAMS
    return max(_params[backbone], 1.0)


def _timed(backbone, tokens: int, seconds: float) -> None:
    """Record a read's rate, averaged with the last one (the CPU's load varies)."""
    if seconds <= 0 or tokens <= 0:
        return
    rate = read_cost(tokens) / seconds
    try:
        before = _rates.get(backbone)
        _rates[backbone] = rate if before is None else (before + rate) / 2
    except TypeError:
        pass


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 10 else f"{s:.0f} s"


def _hint(kind: str, message: str) -> None:
    if kind not in _hinted:
        _hinted.add(kind)
        log.warning("%s (this hint is logged once)", message)


def progress_enabled(progress: bool | None) -> bool:
    """`progress` as asked; None: when standard error is a terminal."""
    if progress is None:
        isatty = getattr(sys.stderr, "isatty", None)
        return bool(isatty and isatty())
    return bool(progress)


@contextmanager
def long_read(backbone, tokens: int, what: str, faster: str, kind: str, progress: bool | None = None
              ) -> Iterator[None]:
    """Around one read of `tokens` tokens by the model: where it is expected to take more than SLOW_S seconds (on a
    CPU; `expected_seconds`), or turns out to, the hint "`what` takes about N s on this device; faster: `faster`" is
    logged once per process and `kind` (a warning of this module's logger); and where `progress` (None: standard
    error is a terminal), a progress bar on standard error (tqdm) shows after SLOW_S seconds, advancing at the
    expected rate (it stops short of the end until the read is done). The read's time updates the expected rate."""
    expected = expected_seconds(backbone, tokens)
    device = getattr(getattr(backbone, "device", None), "type", None) or "this device"
    if expected is not None and expected > SLOW_S:
        _hint(kind, f"{what} takes about {_seconds(expected)} on this {device.upper() if device == 'cpu' else device}; "
                    f"faster: {faster}")
    show = progress_enabled(progress) and (expected is None or expected > SLOW_S / 4)
    bar = _Ticker(tokens, expected, what) if show else None
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds = time.perf_counter() - start
        if bar is not None:
            bar.close()
    _timed(backbone, tokens, seconds)
    if seconds > SLOW_S and (expected is None or expected <= SLOW_S):
        _hint(kind, f"{what} took {_seconds(seconds)} on this {device.upper() if device == 'cpu' else device}; "
                    f"faster: {faster}")


class _Ticker:
    """A tqdm bar over the read's tokens on standard error, shown once SLOW_S seconds have passed, moved by a
    daemon thread at the expected rate (without one, it counts the seconds)."""

    def __init__(self, tokens: int, expected: float | None, what: str):
        from tqdm.auto import tqdm

        self.expected, self.tokens, self.start = expected, max(int(tokens), 1), time.perf_counter()
        known = expected is not None and expected > 0
        self.bar = tqdm(total=self.tokens if known else None, desc=what.split(" (")[0], unit="tok" if known else "s",
                        unit_scale=known, leave=False, file=sys.stderr, delay=SLOW_S, dynamic_ncols=True)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="endo-progress", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(0.25):
            elapsed = time.perf_counter() - self.start
            target = min(self.tokens - 1, int(self.tokens * elapsed / self.expected)) if self.expected else \
                int(elapsed)
            if target > self.bar.n:
                self.bar.update(target - self.bar.n)

    def close(self) -> None:
        self.done.set()
        self.thread.join()
        if self.bar.total is not None and self.bar.n < self.bar.total:
            self.bar.update(self.bar.total - self.bar.n)
        self.bar.close()


def rerank_faster(n: int, read_tokens: int | None) -> str:
    """The reranker's settings that read less, for the hint."""
    ways = [f"hand the reranker fewer candidates (the first stage's similarity_top_k or k; {n} now)"]
    if read_tokens is None or read_tokens > READ_TOKENS_HINT:
        ways.append(f"read_tokens={READ_TOKENS_HINT} (each candidate's best {READ_TOKENS_HINT} tokens, as the endo "
                    "pipeline reads them)")
    ways.append("or passages instead of whole documents from the first stage (EndoRetriever's endo pipeline: BM25 "
                "candidates, read in part)")
    return "; ".join(ways)


@contextmanager
def pipeline_progress(index, method: str, depth: int | None = None, read_tokens: int | None = None,
                      progress: bool | None = None, first_stage: str | None = None) -> Iterator[None]:
    """`long_read` around a search whose `endo` pipeline reads candidates with the model (on this process); the
    hint names depth, read_tokens, the first stage where it is not BM25, and method="bm25" (no model read).
    `depth`, `read_tokens`, `first_stage`: the search's own (None: the index's pipeline as fitted)."""
    backbone = getattr(index, "backbone", None) if isinstance(index, EndoIndex) else None
    if method not in PIPELINE_METHODS or backbone is None:
        yield
        return
    pipeline = index.pipeline(method, depth, read_tokens, *([first_stage] if first_stage is not None else []))
    reads = pipeline.depth
    if getattr(pipeline, "two_hop", False):
        settings = pipeline.two_hop_settings or {}
        reads += sum(settings.get(name, 0) for name in ("anchors", "refs", "depth2"))
    try:  # the passages as read: at most read_tokens of each, no more candidates than passages
        passages = index.passages()
        read = np.minimum(np.asarray(passages.ends) - np.asarray(passages.starts), pipeline.read_tokens)
        tokens = int(min(reads, len(read)) * read.mean()) if len(read) else 0
    except Exception:  # an estimate only: never the reason a search fails
        tokens = reads * pipeline.read_tokens
    ways = [f"depth={max(1, pipeline.depth // 2)} (--depth; candidates read: {pipeline.depth} now)"]
    if pipeline.read_tokens > 64:
        ways.append(f"read_tokens={max(8, pipeline.read_tokens // 2)} (--read-tokens; {pipeline.read_tokens} now)")
    first_stage = getattr(pipeline, "first_stage", None)
    if isinstance(first_stage, str) and first_stage != "bm25":
        ways.append(f'first_stage="bm25" (EndoIndex.search; {first_stage} now)')
    ways.append('or method="bm25" (--method bm25: no model read)')
    what = f"the {method} pipeline's read of {pipeline.depth} candidates x {pipeline.read_tokens} tokens"
    with long_read(backbone, tokens, what, "; ".join(ways), "retrieve", progress):
        yield


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
