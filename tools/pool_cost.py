"""What reading the second pool costs: `endo`'s search time per question with the profile's pools (the hybrid and
the dense ranking's, each read as its own context) and with the hybrid pool alone, side by side on the same
questions (alternating), and the adaptive rule's own time (its weights from the candidates' scores).

    python tools/pool_cost.py SPEC [--docs N] [--questions Q] [--device cpu|cuda] [--model M] [--out FILE.json]

SPEC: a labelled set as `endo calibrate-fusion --data` takes it (a HotpotQA file, or PATH:SPLIT).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from endo_retrieval.calibration.datasets import corpus_questions
from endo_retrieval.calibration.signals import corpus_index
from endo_retrieval.methods.pipeline import EndoPipeline
from endo_retrieval.model.backbone import Backbone


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("spec")
    p.add_argument("--docs", type=int, default=400)
    p.add_argument("--questions", type=int, default=20)
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--model", default=None, help="a model as Backbone.of takes it (default: the default model)")
    args = p.parse_args()
    bb = Backbone.of(args.model, device=args.device)
    titles, texts, questions = corpus_questions(args.spec, args.questions)
    keep = list(dict.fromkeys([t for q in questions for t, _ in q["supporting_facts"]] + titles))[: args.docs]
    text_of = dict(zip(titles, texts))
    index = corpus_index(bb, keep, [text_of[t] for t in keep])
    corpus, passages = index.corpus, index.passages()
    two = EndoPipeline(bb)
    one = EndoPipeline(bb, pools=two.pools[:1])
    ms = {"two pools": [], "one pool": [], "rule": []}
    for q in questions:
        for name, pipe in (("two pools", two), ("one pool", one)):
            t0 = time.perf_counter()
            pipe.passage_hits(corpus, passages, q["question"], k=5)
            ms[name].append(1000 * (time.perf_counter() - t0))
        top, signals, _ = two.stage_scores(corpus, passages, q["question"])
        if two.adaptive is not None:
            t0 = time.perf_counter()
            two.adaptive.weights(signals)
            ms["rule"].append(1000 * (time.perf_counter() - t0))
    out = {"spec": args.spec, "model": bb.model_id, "device": str(bb.device), "docs": len(keep),
           "questions": len(questions),
           "pools": list(two.pools), "depth": two.depth, "load_average": os.getloadavg()[0],
           "p50_ms": {k: round(float(np.median(v)), 2) for k, v in ms.items() if v},
           "ratio_two_to_one": round(float(np.median(ms["two pools"]) / np.median(ms["one pool"])), 2)}
    print(json.dumps(out))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
