"""Stage 1's time on an opened index (`EndoPipeline.candidates`, hybrid), p50 over the same questions as
tools/cells_in_place.py makes (words drawn from the index's own passages, embedded once before the timing). Run it
under two checkouts in turn (PYTHONPATH=CHECKOUT) to compare two versions of stage 1 on the same index.

    python tools/stage1_p50.py INDEX_DIR LABEL     # prints one JSON line: label, p50 ms, load average
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from endo_retrieval.index.dense import load_embedder
from endo_retrieval.methods.search import EndoIndex
from endo_retrieval.model.backbone import Backbone


def main() -> None:
    folder, label = sys.argv[1], sys.argv[2]
    load_embedder()
    index = EndoIndex.load(folder, backbone=Backbone.default())
    passages = index.passages()
    pipe = index.pipeline("endo", first_stage="hybrid")
    rng = np.random.default_rng(0)
    rows = rng.choice(len(index.corpus), 200, replace=False)
    pool = [w for i in rows for w in index.corpus.document_at(int(i)).text.split()[:30]]
    questions = [" ".join(rng.choice(pool, 8)) for _ in range(40)]
    vectors = {q: passages.dense.query(q) for q in questions}
    passages.dense.query = vectors.__getitem__
    pipe.candidates(index.corpus, passages, questions[0])
    times = []
    for _ in range(2):
        for q in questions:
            t = time.perf_counter()
            pipe.candidates(index.corpus, passages, q)
            times.append(1000 * (time.perf_counter() - t))
    print(json.dumps({"label": label, "passages": len(passages), "questions": len(questions),
                      "stage1_ms_p50": round(float(np.median(times)), 2), "load_average": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
