"""The reranker: passages another retriever returned, read by the model in one context and ranked by its calibrated
retrieval heads (`methods.heads.rank_passages`, the reader the `endo` pipeline shares), alone or fused with the first
stage's own scores; the passages fit to the model's window (`fit_to_window`, `water_level`); the fusion rule or
weights the model's profile holds per first stage (`reranker_rule`, `reranker_weights`). The adapters' EndoReranker
(both frameworks) and the calibrations call it."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from endo_retrieval.corpus import CorpusMap
from endo_retrieval.index.passages import best_part, part_text
from endo_retrieval.methods import heads as retrieval_heads  # looked up per call: a test replaces rank_passages
from endo_retrieval.methods.read_time import long_read
from endo_retrieval.model.backbone import Backbone
from endo_retrieval.model.profiles import heads_profile, heads_profile_path
from endo_retrieval.scoring.adaptive import AdaptiveWeights
from endo_retrieval.scoring.bm25 import words
from endo_retrieval.scoring.fusion import fuse as fused

READ_TOKENS_HINT = 128  # the pipeline's read of each candidate, named in the reranker's hint


# The model reads the candidates with the first stage's best last, nearest the question: chosen over the first
# stage's own order on calib100's gold-only paragraphs (`endo bench rerank --order`: a tie keeping 5 of 20, 230
# against 226 gold sentences keeping 2; bench/results/quality/rerank_calib100*.md).
RERANK_BEST_LAST = True


# The reranker's fusion where the model's heads profile holds no fitted weights for the first stage: the first stage
# and the heads, each standardised over the candidates, weigh the same. `fit_reranker_section`
# (endo_retrieval.calibration.reranker) fits them into the profile's `reranker` section, one entry per first stage.
RERANK_WEIGHTS = {"first_stage": 0.5, "heads": 0.5}
RERANK_FIRST_STAGES = ("minilm", "bm25")  # the profile's entries: a dense vector store (MiniLM's kind), BM25
DEFAULT_RERANK_FIRST_STAGE = "minilm"  # a vector store is the usual first stage before a reranker


def rerank_passages(passages: Sequence[str], question: str, top_n: int, backbone=None,
                    best_last: bool = RERANK_BEST_LAST, *, fuse: bool = False,
                    first_stage_scores: Sequence[float | None] | None = None,
                    first_stage: str = DEFAULT_RERANK_FIRST_STAGE, weights: dict | None = None,
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


def reranker_rule(backbone, first_stage: str = DEFAULT_RERANK_FIRST_STAGE) -> AdaptiveWeights | None:
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


def reranker_weights(backbone, first_stage: str = DEFAULT_RERANK_FIRST_STAGE) -> dict[str, float]:
    """The fusion weights the model's heads profile holds for `first_stage` (its `reranker` section, fitted by
    `endo_retrieval.calibration.reranker`), else RERANK_WEIGHTS."""
    fitted = (heads_profile(backbone) or {}).get("reranker") or {}
    if first_stage not in fitted:
        if first_stage not in RERANK_FIRST_STAGES:
            raise ValueError(f"No reranker weights for the first stage {first_stage!r}; name one of "
                             f"{', '.join(sorted({*RERANK_FIRST_STAGES, *fitted}))}, or pass weights.")
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


def rerank_faster(n: int, read_tokens: int | None) -> str:
    """The reranker's settings that read less, for the hint."""
    ways = [f"hand the reranker fewer candidates (the first stage's similarity_top_k or k; {n} now)"]
    if read_tokens is None or read_tokens > READ_TOKENS_HINT:
        ways.append(f"read_tokens={READ_TOKENS_HINT} (each candidate's best {READ_TOKENS_HINT} tokens, as the endo "
                    "pipeline reads them)")
    ways.append("or passages instead of whole documents from the first stage (EndoRetriever's endo pipeline: BM25 "
                "candidates, read in part)")
    return "; ".join(ways)
