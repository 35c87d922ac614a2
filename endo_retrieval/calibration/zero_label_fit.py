"""The whole-context fusion's fit on zero-label haystacks (zero_label.py's tasks), and the rule every zero-label fit
chooses by: of the options as good as the best (within NEAR standard errors, paired per item), the one that hedges
most (the flattest weights, the most heads, the cheapest pipeline setting), since the best on made tasks is partly
the draw's luck.
"""
from __future__ import annotations

import numpy as np

from endo_retrieval.methods.endo import GRID_STEP, SIGNALS, recall_in_budget, simplex
from endo_retrieval.methods.heads import HeadsError
from endo_retrieval.scoring.fusion import standardise

# Made haystacks are easy: every signal finds the one evidence sentence within an eighth of the context, so at that
# budget every weight ties and a tie-break decides. The fit halves the budget while the best single signal still
# keeps more than SATURATED of the gold: below it, at least a tenth of the evidence is missed by the best signal,
# which is where the signals can differ.
SATURATED = 0.9
# never below this budget: a made evidence sentence is at most 60 words (about 80 tokens), so it always fits
MIN_BUDGET = 128
# weights whose recall is within this many standard errors of the best (paired over the items) are as good as it
NEAR = 1.0


def _flatness(w: dict) -> float:
    return sum(v * v for v in w.values())  # least for equal weights, most for one signal alone


def near_best(table: np.ndarray) -> list[int]:
    """The options (rows of `table`, options x items, higher is better) as good as the best: its row first, then
    every row whose mean is within NEAR standard errors of its mean (paired per-item differences), in row order.
    Fitted on made tasks, the best row is partly the draw's luck; any near row is as likely the method's best."""
    means = table.mean(1)
    best = int(np.argmax(means))
    diff = table[best] - table  # per item, how much each option loses to the best
    n = table.shape[1]
    se = diff.std(1, ddof=1) / np.sqrt(n) if n > 1 else np.zeros(len(table))
    return [best] + [i for i in range(len(table)) if i != best and diff[i].mean() <= NEAR * se[i] + 1e-12]


def flattest(grid: list[dict], table: np.ndarray) -> int:
    """Of the weights `grid` scored per item in `table` (weights x items), the flattest near the best: when the
    signals cannot be told apart the fusion hedges over them instead of falling to whichever corner a tie-break
    lists first; when one mixture is clearly best, only it and its close neighbours are near."""
    return min(near_best(table), key=lambda i: (_flatness(grid[i]), i))


def most_heads(counts: list[int], table: np.ndarray) -> int:
    """Of the head counts scored per item in `table` (counts x items), the most heads near the best: two
    zero-label runs on the same documents kept 4 and 12 heads of the 1.5B model (recall 0.978 against 0.975), and
    more heads average out what one draw of tasks favours."""
    return max(counts[i] for i in near_best(table))


def cheapest_setting(rows: list[dict], table: np.ndarray) -> int:
    """Of the pipeline's settings (`rows` of pipeline.fit_settings, scored per task in `table`), the one that reads
    least (depth x tokens per candidate) near the best; the better mean among equals."""
    means = table.mean(1)
    return min(near_best(table), key=lambda i: (rows[i]["depth"] * rows[i]["read_tokens"], -means[i]))


def fit_fusion(items: list[tuple[dict, np.ndarray, np.ndarray, int]], names: tuple[str, ...] | None = None,
               step: float | None = None) -> dict:
    """The whole-context fusion's weights on zero-label haystacks, `items` = [(signals, gold, lengths, budget)]
    as heads_calibrate.calibrate makes them:

    1. balanced: as many items on which BM25 does not rank the gold sentences first as items on which it does
       (the surplus of the larger kind dropped, in item order), as `balanced` does for the pipeline's tasks;
    2. budget: every item's budget halved, all together, while the best single signal's mean recall is above
       SATURATED and every budget stays at or above MIN_BUDGET;
    3. weights: on the simplex grid, the best mean recall; among the weights within NEAR standard errors of it
       (paired per-item differences), the flattest. When the signals cannot be told apart the fusion hedges over
       them instead of falling to whichever corner a tie-break lists first; when one mixture is clearly best, only
       it and its close neighbours are near, so the fit still picks it.
    """
    step = step or GRID_STEP
    items = [it for it in items if it[1].any()]
    if not items:
        raise HeadsError("No calibration item has a gold sentence in its haystack: check the documents.")
    names = [s for s in (names or SIGNALS) if all(s in it[0] for it in items)]
    z = [{s: standardise(sig[s]) for s in names} for sig, *_ in items]

    if "bm25" in names:
        first = [bool(g[np.argsort(-zi["bm25"], kind="stable")[: int(g.sum())]].all())
                 for zi, (_, g, *_) in zip(z, items)]
        hard = [i for i, f in enumerate(first) if not f]
        easy = [i for i, f in enumerate(first) if f]
        k = min(len(hard), len(easy))
        keep = sorted(hard[:k] + easy[:k]) if k else list(range(len(items)))
        items, z = [items[i] for i in keep], [z[i] for i in keep]

    def recalls(w: dict, scale: int) -> np.ndarray:
        return np.array([recall_in_budget(sum(w[s] * zi[s] for s in names), gold, lengths, budget // scale)
                         for zi, (_, gold, lengths, budget) in zip(z, items)])

    corners = {s: {t: float(t == s) for t in names} for s in names}
    scale = 1
    while True:
        single = {s: float(recalls(w, scale).mean()) for s, w in corners.items()}
        if max(single.values()) <= SATURATED or min(b for *_, b in items) // (2 * scale) < MIN_BUDGET:
            break
        scale *= 2

    grid = list(simplex(names, step))
    table = np.stack([recalls(w, scale) for w in grid])  # weights x items
    means = table.mean(1)
    near = near_best(table)
    best, chosen = near[0], flattest(grid, table)
    return {"weights": grid[chosen], "recall": round(float(means[chosen]), 4),
            "best": {"weights": grid[best], "recall": round(float(means[best]), 4)},
            "single": {s: round(r, 4) for s, r in single.items()}, "step": step, "n_items": len(items),
            "budget_scale": 1 / scale, "near_best": len(near),
            "rule": "zero-label: balanced items, budget halved past saturation, flattest near-best weights"}
