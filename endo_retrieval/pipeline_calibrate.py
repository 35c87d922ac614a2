"""`endo calibrate-pipeline`: the `endo` pipeline's settings fitted on labelled questions over a corpus.

Every paragraph of a HotpotQA-layout file is pooled into one corpus (one document per title) and each question
asks it, as `endo bench corpus` does. For every candidate depth, tokens read per candidate and reading order, the
stage scores of each question's candidates are computed once; then the weights of the fusion are searched on a grid
of the simplex (BM25 alone is a corner, so the fit never falls below stage 1 on this data). The setting with the
best mean of paragraph recall@2 and recall@5 is written into the model's heads profile (`pipeline`); ties go to the
cheaper setting.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from endo_retrieval.fusion import fuse
from endo_retrieval.methods.endo import simplex

STAGES = ("bm25", "heads", "hop2")
ORDERS = {"best-last": True, "first-stage": False}
KS = (2, 5, 10)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from endo_retrieval.commands import model_argument
    from endo_retrieval.eval.measure import int_list

    p.add_argument("--data", required=True, help="HotpotQA-layout JSON with gold supporting facts (e.g. fit300.json)")
    p.add_argument("--limit", type=int, default=None, help="first N questions (the corpus is every paragraph)")
    p.add_argument("--depths", type=int_list, default=[10, 20, 30], help="candidate depths to try (default 10,20,30)")
    p.add_argument("--read-tokens", type=int_list, default=[64, 128, 256],
                   help="tokens read per candidate to try (default 64,128,256)")
    p.add_argument("--orders", nargs="+", choices=list(ORDERS), default=list(ORDERS))
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help="profile to update (default: the model's heads profile)")
    p.add_argument("--dump", default=None, help="also write every question's stage scores here (.npz)")
    model_argument(p)


def recall_at(ranked_docs: list[str], gold: set[str], k: int) -> float:
    """Share of the gold documents among the first k distinct documents of a ranking."""
    seen: list[str] = []
    for d in ranked_docs:
        if d not in seen:
            seen.append(d)
        if len(seen) == k:
            break
    return len(gold & set(seen)) / max(1, len(gold))


def objective(items: list[tuple[dict, list[str], set[str]]], weights: dict) -> dict[int, float]:
    """Mean paragraph recall@k over the items [(stage scores, candidate documents, gold documents)]."""
    out = {k: [] for k in KS}
    for signals, docs, gold in items:
        fused = fuse(signals, weights)
        ranked = [docs[i] for i in np.lexsort((np.arange(len(docs)), -fused))]
        for k in KS:
            out[k].append(recall_at(ranked, gold, k))
    return {k: float(np.mean(v)) for k, v in out.items()}


def fit(items, step: float = 0.1) -> tuple[dict, dict]:
    """(weights, recall@k) maximising the mean of recall@2 and recall@5; the corners come first, so a tie keeps
    the simpler fusion."""
    best_w, best, best_r = None, -1.0, None
    for w in sorted(simplex(list(STAGES), step), key=lambda w: (-max(w.values()), -w["bm25"])):
        r = objective(items, w)
        if (r[2] + r[5]) / 2 > best + 1e-9:
            best_w, best, best_r = w, (r[2] + r[5]) / 2, r
    return best_w, best_r


def run(args) -> dict:
    from tqdm import tqdm

    from endo_retrieval.backbone import Backbone
    from endo_retrieval.engine import Document, EndoIndex
    from endo_retrieval.eval.rerank import hotpotqa_corpus
    from endo_retrieval.pipeline import EndoPipeline
    from endo_retrieval.profiles import heads_profile_path

    start = time.perf_counter()
    bb = Backbone.of(args.model, device=args.device)
    titles, paragraphs, questions = hotpotqa_corpus(args.data, args.limit)
    index = EndoIndex(bb, method="endo")
    index.add_documents([Document(t, p) for t, p in zip(titles, paragraphs)])
    corpus, passages = index.corpus, index.passages()
    doc_of = {int(p): corpus.span_text(int(p), int(p) + 1)[0] for p in passages.starts}
    table, dump = [], {}
    for depth in sorted(args.depths):
        for read_tokens in sorted(args.read_tokens):
            for order in args.orders:
                pipe = EndoPipeline(bb, depth=depth, read_tokens=read_tokens, best_last=ORDERS[order],
                                    weights=dict.fromkeys(STAGES, 1.0))
                items = []
                for q_i, q in enumerate(tqdm(questions, desc=f"depth {depth}, {read_tokens} tokens, {order}",
                                             disable=None)):
                    top, signals, _ = pipe.stage_scores(corpus, passages, q["question"])
                    docs = [doc_of[int(passages.starts[i])] for i in top]
                    items.append((signals, docs, {t for t, _ in q["supporting_facts"]}))
                    key = f"{depth}/{read_tokens}/{order}/{q_i}"
                    dump |= {f"{key}/{name}": s for name, s in signals.items()}
                    dump |= {f"{key}/docs": np.array(docs), f"{key}/gold": np.array(sorted(items[-1][2]))}
                weights, recall = fit(items)
                table.append({"depth": depth, "read_tokens": read_tokens, "order": order, "weights": weights,
                              "recall": {f"@{k}": round(r, 4) for k, r in recall.items()},
                              "stage1": {f"@{k}": round(r, 4) for k, r in objective(items, {"bm25": 1.0}).items()}})
                print(json.dumps(table[-1]))
    best = max(table, key=lambda r: ((r["recall"]["@2"] + r["recall"]["@5"]) / 2, -r["depth"], -r["read_tokens"]))
    out = Path(args.out) if args.out else heads_profile_path(bb)
    profile = json.loads(out.read_text()) if out.exists() else {}
    profile["pipeline"] = {"depth": best["depth"], "read_tokens": best["read_tokens"],
                           "best_last": ORDERS[best["order"]], "weights": best["weights"],
                           "fit": {"data": Path(args.data).name, "n_questions": len(questions),
                                   "recall": best["recall"], "table": table,
                                   "wall_s": round(time.perf_counter() - start, 1)}}
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile, indent=1))
    tmp.replace(out)
    if args.dump:
        np.savez_compressed(args.dump, **dump)
    print(json.dumps({k: v for k, v in profile["pipeline"].items() if k != "fit"} | {"recall": best["recall"]}))
    return profile
