"""The saved cells read in place against gathered, side by side on one opened index: the dense stage's scores and
the whole stage 1 (`EndoPipeline.candidates`), p50 over the same questions, alternating the two paths in rounds.

    python tools/cells_in_place.py INDEX_DIR [--questions 40] [--rounds 3] --out FILE.json

INDEX_DIR: an index with cells (from ANN_MIN passages), e.g. the one `endo bench scale --keep` leaves. The questions
are words drawn from its own passages; their embeddings are made once before the timing (the forward is not timed).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from endo_retrieval.index.dense import load_embedder
from endo_retrieval.methods.search import EndoIndex
from endo_retrieval.model.backbone import Backbone


def p50(run, questions) -> float:
    times = []
    for q in questions:
        t = time.perf_counter()
        run(q)
        times.append(1000 * (time.perf_counter() - t))
    return float(np.median(times))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("index", type=Path)
    p.add_argument("--questions", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    load_embedder()
    index = EndoIndex.load(args.index, backbone=Backbone.default())
    passages, dense = index.passages(), index.dense
    if dense is None or dense.by_cell is None:
        raise SystemExit(f"{args.index} holds no cells saved in cell order: build it with cells (ANN_MIN passages)")
    pipe = index.pipeline("endo", first_stage="hybrid")
    rng = np.random.default_rng(0)
    rows = rng.choice(len(index.corpus), 200, replace=False)
    pool = [w for i in rows for w in index.corpus.document_at(int(i)).text.split()[:30]]
    questions = [" ".join(rng.choice(pool, 8)) for _ in range(args.questions)]
    vectors = {q: dense.query(q) for q in questions}
    passages.dense.query = vectors.__getitem__
    in_place, rows = dense.by_cell, []  # one row a round and path
    for r in range(args.rounds):
        for path in ("gathered", "in place"):
            dense.by_cell = None if path == "gathered" else in_place
            passages.cells = None  # made again at the next question, over the path chosen
            pipe.candidates(index.corpus, passages, questions[0])
            rows.append({"round": r, "path": path, "cells": type(passages.cells).__name__,
                         "dense_ms_p50": p50(lambda q: passages.dense_scores(index.corpus, vectors[q]), questions),
                         "stage1_ms_p50": p50(lambda q: pipe.candidates(index.corpus, passages, q), questions)})
            print(rows[-1], flush=True)
    summary = {path: {k: float(np.median([r[k] for r in rows if r["path"] == path]))
                      for k in ("dense_ms_p50", "stage1_ms_p50")} for path in ("gathered", "in place")}
    args.out.write_text(json.dumps({"index": str(args.index), "passages": len(passages), "questions": len(questions),
                                    "rounds": args.rounds, "cores": os.cpu_count(), "load_average": os.getloadavg(),
                                    "rows": rows, "median_of_rounds": summary}, indent=1) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
