"""Fusing per-item scores of several signals: standardised weighted sums, and reciprocal-rank fusion."""
from __future__ import annotations

import numpy as np

RRF_K = 60  # reciprocal-rank fusion constant (Cormack et al. 2009)


def standardise(x: np.ndarray) -> np.ndarray:
    """z-score within one context or candidate list, so weights fitted on some transfer to others of other sizes."""
    x = np.asarray(x, dtype=np.float64)
    sd = x.std()
    return (x - x.mean()) / sd if sd > 0 else np.zeros_like(x)


def fuse(signals: dict[str, np.ndarray], weights: dict[str, float]) -> np.ndarray:
    """sum_s w_s z_s: the weighted sum of the standardised signals (signals without a weight count 0)."""
    n = len(next(iter(signals.values())))
    return sum((w * standardise(signals[s]) for s, w in weights.items() if w and s in signals), np.zeros(n))


def rrf(*scores: np.ndarray) -> np.ndarray:
    """Reciprocal-rank fusion: sum over the rankings of 1 / (RRF_K + rank)."""
    out = np.zeros(len(scores[0]))
    for s in scores:
        rank = np.empty(len(s))
        rank[np.argsort(-np.asarray(s), kind="stable")] = np.arange(len(s))
        out += 1.0 / (RRF_K + rank)
    return out


def merge_reads(reads: list[tuple[list, dict[str, np.ndarray]]]) -> tuple[list, dict[str, np.ndarray]]:
    """Several reads of candidate lists as one: (keys, {stage: score}) each, `keys` naming the candidates. Each
    stage's scores are standardised within their read (a read's scores are on its own scale: the heads' attention
    is shared among the passages read together), and a candidate several reads hold gets the mean of its standard
    scores. The first read's candidates come first, then each later read's new ones, in their order."""
    at: dict = {}
    for keys, scores in reads:
        z = {name: standardise(np.asarray(s, np.float64)) for name, s in scores.items()}
        for i, key in enumerate(keys):
            at.setdefault(key, []).append({name: s[i] for name, s in z.items()})
    stages = [name for name in reads[0][1] if all(name in scores for _, scores in reads)]
    keys = list(at)
    return keys, {name: np.array([np.mean([z[name] for z in at[k]]) for k in keys]) for name in stages}
