"""`endo`: the fused ranking. Per sentence, the signals the model and the text give (BM25 over sentence windows,
the retrieval heads' calibrated attention, a second hop of the heads, ILRe's attention mass at l_R) are
standardised within the context and summed with weights fitted on labelled calibration data (`endo
calibrate-heads`). The fit searches a grid on the simplex that contains every single signal's corner, so on the
data it was fitted on the fusion is never below its best single signal.

Two signals of S3-Hybrid stay out: S3's density needs the SAE pass over the context and ranks gold sentences far
below the others (15.7 sp_recall alone at 8k/1024), and the lead/tail bias is not about the question (fitted on
haystacks, it learns where the shuffle happened to put gold paragraphs).

The second hop serves bridge questions, whose second gold sentence often shares no word with the question: the
model re-reads its best first-hop sentences (ranked by reciprocal-rank fusion of heads and BM25, parameter-free so
the hop does not depend on the weights it feeds) in front of the question, and the heads score the context again;
the evidence's own rows are not scored, and the content-free question carries the same evidence (ICR).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from endo_retrieval.scoring.fusion import fuse, rrf, standardise
from endo_retrieval.scoring.select import sentence_spans, sentences_in_budget
from endo_retrieval.methods.heads import (HeadsError, Prepared, RetrievalHeads, calibrated_attention, calibrated_scores,
                                          checked_question, sentence_max)
from endo_retrieval.model.profiles import heads_profile, ilre_profile
from endo_retrieval.scoring.attention import attention_scores

SIGNALS = ("bm25", "heads", "hop2", "ilre")
HOP_SENTENCES = 2  # first-hop sentences the second hop re-reads
GRID_STEP = 0.05


def kept_in_budget(scores: np.ndarray, lengths: np.ndarray, budget: int) -> np.ndarray:
    """bool per sentence: taken when whole sentences go in score order into `budget` tokens."""
    kept = np.zeros(len(scores), dtype=bool)
    kept[sentences_in_budget(np.argsort(-scores, kind="stable"), lengths, budget)] = True
    return kept


def recall_in_budget(scores: np.ndarray, gold: np.ndarray, lengths: np.ndarray, budget: int) -> float:
    """Share of gold sentences kept when whole sentences are taken in score order into `budget` tokens."""
    return float((gold & kept_in_budget(scores, lengths, budget)).sum() / max(1, gold.sum()))


def simplex(names: list[str], step: float = GRID_STEP):
    """Every weight vector on the simplex grid of `step` (corners included: each signal alone)."""
    n = round(1 / step)
    for cut in itertools.combinations(range(n + len(names) - 1), len(names) - 1):
        parts = np.diff(np.concatenate(([-1], cut, [n + len(names) - 1]))) - 1
        yield dict(zip(names, (parts * step).round(6).tolist()))


def fit_weights(items: list[tuple[dict, np.ndarray, np.ndarray, int]], names: tuple[str, ...] = SIGNALS,
                step: float = GRID_STEP) -> dict:
    """Weights maximising the mean gold-sentence recall in budget over `items` = [(signals, gold, lengths,
    budget)]. Ties go to the weight vector found first (single signals come before mixtures of them)."""
    items = [it for it in items if it[1].any()]
    if not items:
        raise HeadsError("No labelled item has a gold sentence in its haystack: check the calibration data.")
    names = [s for s in names if all(s in it[0] for it in items)]
    z = [{s: standardise(sig[s]) for s in names} for sig, *_ in items]

    def score(w: dict) -> float:
        return float(np.mean([recall_in_budget(sum(w[s] * zi[s] for s in names), gold, lengths, budget)
                              for zi, (_, gold, lengths, budget) in zip(z, items)]))

    single = {s: score({t: float(t == s) for t in names}) for s in names}
    best_w, best = None, -1.0
    for w in sorted(simplex(names, step), key=lambda w: -max(w.values())):  # corners first
        r = score(w)
        if r > best + 1e-12:
            best_w, best = w, r
    return {"weights": best_w, "recall": round(best, 4), "single": {s: round(r, 4) for s, r in single.items()},
            "step": step, "n_items": len(items)}


@dataclass
class Endo(RetrievalHeads):
    """`endo`: sentences ranked by the fitted fusion of BM25, the retrieval heads, their second hop and ILRe's mass;
    every span names the signals that would have chosen it alone within the same budget. Signals without weight
    are not computed (the second hop and ILRe each cost a forward of the question)."""

    name: ClassVar[str] = "endo"

    weights: dict[str, float] | None = None  # None: the model's fitted weights (heads profile)
    ilre_layer: int | None = None  # None: the calibrated l_R when ILRe has weight
    second_hop: bool | None = None  # None: when the fitted weights give hop2 weight

    def __post_init__(self):
        super().__post_init__()
        if self.weights is None:
            profile = heads_profile(self.backbone) or {}
            self.weights = (profile.get("fusion") or {}).get("weights")
            if self.weights is None:
                raise HeadsError(f"No fitted fusion weights for model {self.backbone.model_id}: run "
                                 "`endo calibrate-heads`, or pass weights={'bm25': .., 'heads': .., ...}.")
        unknown = set(self.weights) - set(SIGNALS)
        if unknown:
            raise HeadsError(f"Unknown signal(s) {sorted(unknown)}; the fusion knows {', '.join(SIGNALS)}.")
        if self.second_hop is None:
            self.second_hop = bool(self.weights.get("hop2"))
        if self.ilre_layer is None and self.weights.get("ilre"):
            profile = ilre_profile(self.backbone)
            if profile is None:
                raise HeadsError("The fusion weighs ILRe but the model has no ILRe layer: run `endo calibrate-ilre`.")
            self.ilre_layer = int(profile["layer"])

    @property
    def layers(self) -> list[int]:
        return sorted({l for l, _ in self.heads} | ({self.ilre_layer} if self.ilre_layer is not None else set()))

    def prepare(self, context: str) -> Prepared:
        """The reading, and BM25 over the context's sentences where it has weight: it needs no question, and built
        here the host builds it while a GPU still runs the read's kernels (in `select` it came after them)."""
        prepared = super().prepare(context)
        if self.weights.get("bm25"):
            prepared.bm25  # noqa: B018 - built and kept (a cached property)
        return prepared

    def signals(self, prepared: Prepared, question: str) -> dict[str, np.ndarray]:
        return signals(self.backbone, prepared, question, self.heads, self.ilre_layer, self.second_hop)

    def rank(self, prepared: Prepared, question: str, budget: int):
        sig = self.signals(prepared, checked_question(question))
        score = fuse(sig, self.weights)
        order = np.argsort(-score, kind="stable")
        lengths = np.diff(np.append(prepared.sentence_starts, prepared.corpus.n_positions))
        k = max(1, len(sentences_in_budget(order, lengths, budget)))
        chose: dict[int, list[str]] = {}
        for s, w in self.weights.items():  # which signals would have chosen the sentence alone, same budget
            if w and s in sig:
                for i in np.argsort(-sig[s], kind="stable")[:k]:
                    chose.setdefault(int(i), []).append(s)
        chose = {i: tuple(v) for i, v in chose.items()}
        return lambda target: sentence_spans(prepared.corpus, order, target, self.name, chose, score)


def signals(backbone, prepared: Prepared, question: str, heads, ilre_layer: int | None = None,
            second_hop: bool = True) -> dict[str, np.ndarray]:
    """Every per-sentence signal of the fusion for one question (see the module docstring). The question is read
    once for the heads and ILRe; the second hop reads it again behind its evidence."""
    starts = prepared.sentence_starts
    calibrated, queries = calibrated_attention(backbone, prepared, heads, question,
                                               layers=[ilre_layer] if ilre_layer is not None else [])
    out = {"bm25": prepared.bm25.sentence_scores(question), "heads": sentence_max(calibrated, starts).sum(0)}
    if ilre_layer is not None:  # [ILRe Eq. 4-5] at l_R: max over heads and query positions; a sentence takes its max
        mass = [attention_scores(segment.keys[ilre_layer], q[ilre_layer], None, None, rope=None)  # both rotated
                for segment, q in zip(prepared.reading.segments, queries)]
        out["ilre"] = np.maximum.reduceat(np.concatenate(mass), starts)
    if second_hop:
        first = np.argsort(-rrf(out["heads"], out["bm25"]), kind="stable")[:HOP_SENTENCES]
        evidence = " ".join(prepared.sentence_text(int(i)).strip() for i in sorted(first))
        out["hop2"] = calibrated_scores(backbone, prepared, heads, question, prefix=f"\n\nEvidence: {evidence}")
    return out
