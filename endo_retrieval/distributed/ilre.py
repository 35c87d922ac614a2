"""ILRe over several workers: the chunks of one long context spread over `ModelWorker`s (each chunk needs only its
sink and window frame); [ILRe Eq. 5]'s softmax over the whole context merged with a per-part logsumexp."""
from __future__ import annotations

import math

import numpy as np
import torch

from endo_retrieval.distributed.cluster import ray_cluster


def ilre_scores(ilre, context_ids: np.ndarray, query_ids: np.ndarray, workers: list) -> np.ndarray:
    """`ILRe.scores` (A^C at l_R, [ILRe Eq. 4-5]) with the context's chunks split into contiguous parts, one per worker
    (each holding the same model as `ilre.backbone`). Each part streams its chunks behind their sink and window
    frames; the last also streams the query part. [ILRe Eq. 5]'s softmax runs over the whole context: every part's
    logsumexp is combined with logaddexp before each part turns its logits into probabilities."""
    ray = ray_cluster()
    ilre.check_query(query_ids)
    context_ids, query_ids = np.asarray(context_ids), np.asarray(query_ids)
    n_chunks = math.ceil(len(context_ids) / ilre.chunk_size)
    cuts = [round(n_chunks * i / len(workers)) * ilre.chunk_size for i in range(len(workers) + 1)]
    parts = [(a, min(b, len(context_ids))) for a, b in zip(cuts, cuts[1:]) if a < min(b, len(context_ids))]
    workers = workers[:len(parts)]
    settings = {"layer": ilre.layer, "sink": ilre.sink, "window": ilre.window, "chunk_size": ilre.chunk_size,
                "positions": ilre.positions}
    ids = ray.put(context_ids)
    *_, (queries, query_positions) = ray.get([w.ilre_prefill.remote(ids, query_ids, a, b, settings)
                                              for w, (a, b) in zip(workers, parts)])
    lse = None
    for part in ray.get([w.ilre_logsumexp.remote(queries, query_positions) for w in workers]):
        lse = part if lse is None else torch.logaddexp(lse, part)
    return np.concatenate(ray.get([w.ilre_probabilities.remote(lse) for w in workers]))


def ilre_select(ilre, context_ids: np.ndarray, query_ids: np.ndarray, budget: int, workers: list) -> np.ndarray:
    """`ILRe.select` with the prefill spread over `workers`: [ILRe Alg. 1] on the merged A^C."""
    if len(context_ids) <= budget:
        return np.arange(len(context_ids), dtype=np.int64)
    return ilre.allocate(ilre_scores(ilre, context_ids, query_ids, workers), budget)

