"""Fusion weights that follow the question: how far to trust each stage's scores, read from the scores themselves.

A fixed fusion trusts BM25, the embedder and the model's heads the same on every corpus; where the question's words
are not the document's (code search, reworded questions) BM25's ranking is noise and pulls the others down, where
they are (names, rare terms) it is the sharpest signal there is. What tells the two apart is there in every query's
candidates, before any label: how far each stage's best candidate stands out of the rest (a flat BM25 curve means no
word matched anything in particular), how far the stages agree with each other, how close the question's embedding
comes to its best passage. `AdaptiveWeights` maps these features (standardised with the fit's means) to one weight a
stage by a softmax of a linear map,

    w(q) = softmax(A f(q) + b),    score_i = sum_s w_s(q) z_s,i

(z_s: stage s's scores standardised over the candidates, as `fusion.fuse` weighs them), fitted across labelled
domains by `endo_retrieval.calibration.fusion_rule` (the listwise likelihood of the gold candidates). With A = 0 it is
the fixed fusion with weights softmax(b): a rule never needs more than the fixed fusion had.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

import numpy as np

from endo_retrieval.scoring.fusion import fuse, standardise


def _ranks(x: np.ndarray) -> np.ndarray:
    r = np.empty(len(x))
    r[np.argsort(x, kind="stable")] = np.arange(len(x))
    return r


def question_features(scores: dict[str, np.ndarray], stages: tuple[str, ...]) -> dict[str, float]:
    """The features of one question's candidates: per stage, its best candidate's standard score ("top") and the
    gap to its second ("gap"); per pair of stages, the rank correlation of their scores ("agree"); the best and the
    mean cosine of the question's embedding with the candidates, where the dense stage scored them."""
    out = {}
    for s in stages:
        z = np.sort(standardise(scores[s]))[::-1]
        out[f"top:{s}"] = float(z[0]) if len(z) else 0.0
        out[f"gap:{s}"] = float(z[0] - z[1]) if len(z) > 1 else 0.0
    for a, b in combinations(stages, 2):
        ra, rb = _ranks(scores[a]), _ranks(scores[b])
        sd = ra.std() * rb.std()
        out[f"agree:{a}:{b}"] = float(((ra - ra.mean()) * (rb - rb.mean())).mean() / sd) if sd > 0 else 0.0
    if "dense" in stages and len(scores["dense"]):
        out["cos:top"], out["cos:mean"] = float(np.max(scores["dense"])), float(np.mean(scores["dense"]))
    return out


def feature_names(stages: tuple[str, ...]) -> tuple[str, ...]:
    """`question_features`' names for these stages, in the order a rule's columns hold them."""
    ones = np.ones(3)
    return tuple(question_features({s: ones for s in stages}, stages))


@dataclass(frozen=True)
class AdaptiveWeights:
    """One question's fusion weights from its candidates' scores (the module docstring). `stages`: the scores fused,
    in the order of `coef`'s rows; `coef` (stages x features), `bias` (stages); `mean`, `scale`: the features'
    standardisation, as fitted."""

    stages: tuple[str, ...]
    coef: np.ndarray
    bias: np.ndarray
    mean: np.ndarray
    scale: np.ndarray

    @property
    def features(self) -> tuple[str, ...]:
        return feature_names(self.stages)

    def weights(self, scores: dict[str, np.ndarray]) -> dict[str, float]:
        """{stage: weight}, summing to 1, for one question's candidates' `scores`."""
        f = np.array(list(question_features(scores, self.stages).values()))
        logits = self.coef @ ((f - self.mean) / self.scale) + self.bias
        w = np.exp(logits - logits.max())
        return dict(zip(self.stages, (w / w.sum()).tolist()))

    def fuse(self, scores: dict[str, np.ndarray]) -> np.ndarray:
        """The fused score of each candidate: `fusion.fuse` with this question's weights."""
        return fuse(scores, self.weights(scores))

    def to_json(self) -> dict:
        return {"stages": list(self.stages), "features": list(self.features),
                "coef": np.round(self.coef, 6).tolist(), "bias": np.round(self.bias, 6).tolist(),
                "mean": np.round(self.mean, 6).tolist(), "scale": np.round(self.scale, 6).tolist()}

    @classmethod
    def from_json(cls, entry: dict) -> "AdaptiveWeights":
        """The rule a profile holds; a ValueError saying what is wrong when the entry does not make one."""
        try:
            stages = tuple(str(s) for s in entry["stages"])
            rule = cls(stages, np.asarray(entry["coef"], np.float64), np.asarray(entry["bias"], np.float64),
                       np.asarray(entry["mean"], np.float64), np.asarray(entry["scale"], np.float64))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"not an adaptive fusion rule ({type(err).__name__}: {err})") from None
        n = len(feature_names(stages))
        if (rule.coef.shape != (len(stages), n) or rule.bias.shape != (len(stages),) or rule.mean.shape != (n,)
                or rule.scale.shape != (n,) or not (rule.scale > 0).all()
                or not all(np.isfinite(a).all() for a in (rule.coef, rule.bias, rule.mean))):
            raise ValueError(f"an adaptive fusion rule over {len(stages)} stages needs coef {len(stages)} x {n}, "
                             f"bias {len(stages)}, mean and scale {n} (scale > 0), all finite")
        if list(entry.get("features", rule.features)) != list(rule.features):
            raise ValueError("the rule was fitted on other features than this version computes; fit it again")
        return rule
