"""The reranker's fusion weight fitted on labelled questions: how much of the first stage EndoReranker keeps beside
the retrieval heads (both adapters).

For each question: the candidates one first stage returned (a MiniLM vector store, BM25, ...), best first, its
scores, and which candidates are gold. The heads score every candidate once, as the reranker reads them; then each w
in {0, step, ..., 1} weighs the standardised first stage (w) against the standardised heads (1 - w), as the reranker
fuses them, and the w with the best mean of recall@2 and recall@5 wins (the objective of `calibration.pipeline.fit`).
w = 1 (the first stage alone) is tried first and w = 0 (the heads alone) next, so a tie keeps the simpler ranking and
the fit never falls below the first stage on its own data.

The fitted entry goes into the model's heads profile under `reranker`, one entry per kind of first stage:
`{"reranker": {"minilm": {"first_stage": w, "heads": 1 - w, "fit": {...}}, "bm25": {...}}}`; `save_reranker_entry`
writes it there.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from endo_retrieval.calibration.pipeline import fit, objective, write_json
from endo_retrieval.methods.rerank import first_stage_signal, passage_heads_scores
from endo_retrieval.model.backbone import Backbone
from endo_retrieval.model.profiles import heads_profile_path

STAGES = ("first_stage", "heads")  # the reranker's two signals, the first stage first (it wins ties)


def fit_reranker_weights(per_question_first_stage_scores: Sequence[Sequence[float]],
                         per_question_heads_scores: Sequence[Sequence[float]],
                         per_question_gold_mask: Sequence[Sequence[bool]], step: float = 0.1
                         ) -> tuple[dict[str, float], dict[int, float]]:
    """({"first_stage": w, "heads": 1 - w}, {k: mean recall@k}) for the w on the grid of `step` over [0, 1] with
    the best mean of recall@2 and recall@5. Per question, the three sequences hold one entry per candidate."""
    if not 0 < step <= 1:
        raise ValueError(f"step must be in (0, 1], got {step!r}.")
    items = reranker_items(per_question_first_stage_scores, per_question_heads_scores, per_question_gold_mask)
    return fit(items, step, STAGES)  # w = 1, 0, 0.9, 0.1, ...: corners first


def reranker_items(first_stage, heads, gold) -> list[tuple[dict, list[str], set[str]]]:
    """The questions as `calibration.pipeline.objective` reads them: (signals, candidate ids, gold ids)."""
    if not (len(first_stage) == len(heads) == len(gold)) or not len(gold):
        raise ValueError(f"Give one entry per question in each list (got {len(first_stage)} first-stage, "
                         f"{len(heads)} heads and {len(gold)} gold lists), and at least one question.")
    items = []
    for q, (f, h, g) in enumerate(zip(first_stage, heads, gold)):
        if not (len(f) == len(h) == len(g)):
            raise ValueError(f"Question {q}: {len(f)} first-stage scores, {len(h)} heads scores and {len(g)} gold "
                             "flags; give one of each per candidate.")
        ids = [str(i) for i in range(len(g))]
        items.append(({"first_stage": np.asarray(f, np.float64), "heads": np.asarray(h, np.float64)}, ids,
                      {ids[i] for i, is_gold in enumerate(g) if is_gold}))
    return items


def fit_reranker_section(backbone, questions: Sequence[dict], step: float = 0.1, progress: bool = False) -> dict:
    """The profile entry for one kind of first stage, fitted on `questions`: each a dict with "question",
    "candidates" (the first stage's texts, best first), "first_stage_scores" (its score per candidate, or None to
    use the ranks, as the reranker does) and "gold" (one flag per candidate). The heads score the candidates as
    EndoReranker reads them (`passage_heads_scores`). Returns {"first_stage": w, "heads": 1 - w, "fit": {...}} with
    the recall of the fit and of either signal alone."""
    from tqdm import tqdm


    backbone = Backbone.of(backbone)
    first, heads, gold = [], [], []
    for q in tqdm(questions, desc="reranker heads", unit="question", disable=not progress):
        n = len(q["candidates"])
        first.append(first_stage_signal(q.get("first_stage_scores"), n))
        heads.append(passage_heads_scores(q["candidates"], q["question"], backbone))
        gold.append([bool(g) for g in q["gold"]])
    weights, recall = fit_reranker_weights(first, heads, gold, step)
    items = reranker_items(first, heads, gold)

    def rounded(r: dict[int, float]) -> dict[str, float]:
        return {f"@{k}": round(v, 4) for k, v in r.items()}

    return weights | {"fit": {"n_questions": len(questions), "step": step, "recall": rounded(recall),
                              "first_stage_alone": rounded(objective(items, {"first_stage": 1.0})),
                              "heads_alone": rounded(objective(items, {"heads": 1.0}))}}


def save_reranker_entry(backbone, first_stage: str, entry: dict, out: str | Path | None = None) -> Path:
    """Write `entry` (from `fit_reranker_section`) as the heads profile's `reranker` entry for `first_stage`
    ("minilm", "bm25"); `out`: the profile to update (default: the model's heads profile, which must exist)."""
    import json


    out = Path(out) if out else heads_profile_path(backbone)
    if not out.exists():
        raise FileNotFoundError(f"No heads profile at {out}; make it first (endo calibrate-heads), or pass out=.")
    profile = json.loads(out.read_text())
    profile.setdefault("reranker", {})[first_stage] = entry
    write_json(profile, out)
    return out
