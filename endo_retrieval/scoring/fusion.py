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
