"""`endo bench rerank`: a MiniLM vector store alone, and the same store followed by the retrieval-heads reranker.

The corpus is every paragraph of a HotpotQA-layout file, rendered 'Title: s1 s2 ...', one per title. Per question:
all-MiniLM-L6-v2's top `--candidates` paragraphs by cosine, then `rerank_passages` (what EndoReranker runs in the
LlamaIndex and LangChain adapters) keeps the best `--top`. Per system: the gold supporting sentences found in the
top passages (a gold sentence counts when its paragraph is kept), recall as the mean share per question, and the
per-query latency (question embedding, search, and the reranker). Writes JSON (schema endo-bench-rerank/1) and a
Markdown table beside it.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from endo_retrieval.calibration.datasets import hotpotqa_corpus

SCHEMA = "endo-bench-rerank/1"
ORDERS = {"best-last": True, "first-stage": False}  # the order the model reads the candidates in -> best_last


def add_arguments(p: argparse.ArgumentParser) -> None:
    from endo_retrieval.cli.commands import int_list, model_argument
    from endo_retrieval.integrations import RERANK_BEST_LAST

    default_order = next(name for name, best_last in ORDERS.items() if best_last == RERANK_BEST_LAST)
    p.add_argument("--data", required=True, help="HotpotQA PATH.json (gold supporting sentences are needed)")
    p.add_argument("--out", required=True, help="FILE.json; FILE.md is written beside it")
    p.add_argument("--candidates", type=int_list, action="extend", default=None,
                   help="the vector store's top-k handed to the reranker, one row each (default 20, chosen over "
                        "10 on calib100: bench/results/quality/rerank_calib100.md)")
    p.add_argument("--top", type=int, default=5, help="passages kept (default 5)")
    p.add_argument("--order", action="extend", nargs="+", choices=list(ORDERS), default=None,
                   help=f"the order the model reads the candidates in, one row each (default {default_order}: "
                        "the adapters' order)")
    p.add_argument("--limit", type=int, default=None)
    model_argument(p)


def found(kept_titles: list[str], item: dict) -> tuple[int, int]:
    """(gold sentences whose paragraph is kept, gold sentences) of one question."""
    gold = {(title, int(i)) for title, i in item["supporting_facts"]}
    return sum(title in set(kept_titles) for title, _ in gold), len(gold)


def summary(system: str, hits: list[tuple[int, int]], latency_s: list[float], **extra) -> dict:
    ms = 1000 * np.asarray(latency_s)
    return {"system": system, **extra, "n": len(hits), "n_gold": sum(g for _, g in hits),
            "gold_found": sum(f for f, _ in hits), "recall": round(float(np.mean([f / g for f, g in hits])), 4),
            "latency_ms": {"p50": round(float(np.median(ms)), 2), "mean": round(float(ms.mean()), 2)}}


def run(args) -> int:
    from sentence_transformers import SentenceTransformer
    from tqdm import tqdm

    from endo_retrieval.model.backbone import Backbone
    from endo_retrieval.integrations import RERANK_BEST_LAST, rerank_passages
    from endo_bench.baselines import minilm_folder

    if args.top <= 0:
        raise ValueError(f"--top must be positive, got {args.top}")
    candidates = args.candidates or [20]
    orders = args.order or [next(n for n, b in ORDERS.items() if b == RERANK_BEST_LAST)]
    if min(candidates) < args.top:
        raise ValueError(f"--candidates must be at least --top ({args.top}), got {min(candidates)}")
    bb = Backbone.of(args.model)
    titles, texts, items = hotpotqa_corpus(args.data, args.limit)
    embedder = SentenceTransformer(str(minilm_folder()), device="cpu", local_files_only=True)
    t0 = time.perf_counter()
    vectors = embedder.encode(texts, normalize_embeddings=True, convert_to_numpy=True, batch_size=64)
    index_s = time.perf_counter() - t0
    vector_hits, vector_s = [], []
    reranked: dict[tuple[int, str], tuple[list, list]] = {(k, o): ([], []) for k in candidates for o in orders}
    for item in tqdm(items, desc="rerank", disable=None):
        t0 = time.perf_counter()
        q = embedder.encode([item["question"]], normalize_embeddings=True, convert_to_numpy=True)[0]
        ranking = np.argsort(-(vectors @ q), kind="stable")[:max(candidates)]  # unit vectors: dot = cosine
        search_s = time.perf_counter() - t0
        vector_hits.append(found([titles[i] for i in ranking[:args.top]], item))
        vector_s.append(search_s)
        for (k, order), (hits, seconds) in reranked.items():
            t0 = time.perf_counter()
            best = rerank_passages([texts[i] for i in ranking[:k]], item["question"], args.top, bb,
                                   best_last=ORDERS[order])
            seconds.append(search_s + time.perf_counter() - t0)
            hits.append(found([titles[ranking[i]] for i, _ in best], item))
    rows = [summary("vector", vector_hits, vector_s, top=args.top, candidates=args.top, order=None)]
    rows += [summary("vector+rerank", hits, seconds, top=args.top, candidates=k, order=order)
             for (k, order), (hits, seconds) in reranked.items()]
    result = {"schema": SCHEMA, "config": {"model": bb.model_id, "data": str(args.data), "limit": args.limit,
                                           "corpus_paragraphs": len(texts), "embedder": "all-MiniLM-L6-v2",
                                           "embed_corpus_s": round(index_s, 2), "device": str(bb.device)},
              "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    table = [f"| system | candidates | order the model reads | gold sentences in top {args.top} | "
             f"recall@{args.top} | latency p50 (mean) ms |", "|---|---|---|---|---|---|"]
    table += [f"| {r['system']} | {r['candidates']} | {r['order'] or '-'} | {r['gold_found']}/{r['n_gold']} | "
              f"{100 * r['recall']:.1f}% | {r['latency_ms']['p50']:.1f} ({r['latency_ms']['mean']:.1f}) |"
              for r in rows]
    out.with_suffix(".md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return 0
