"""LlamaIndex: compare the endo retriever with LlamaIndex's own BM25 retriever in LlamaIndex's RetrieverEvaluator.

By default a small built-in task (notes and questions whose answering note is known); with
`--data FILE.json` a HotpotQA-layout file: every paragraph one node, each question's supporting paragraphs the
expected ids. Hit rate and MRR over the top `--k`. Runs offline.
"""
import argparse
import asyncio
import os
import json

from llama_index.core.evaluation import RetrieverEvaluator
from llama_index.core.schema import TextNode
from llama_index.retrievers.endo import EndoRetriever

NOTES = {
    "bridge": "The Zephyr bridge crosses the Varna river. It was painted green in 1932 by the city council.",
    "chemist": "Marta Kowal is a chemist from Lodz. She discovered the compound lodzite in 1971.",
    "cafe": "The Orion cafe serves espresso and cardamom buns. It opens at seven every weekday.",
    "ship": "The research ship Albatross has been based in Gdansk since 1988.",
    "mill": "The old mill on the Varna burned down in 1904 and was rebuilt in brick.",
    "school": "Lodz has a film school whose students made the short film Blue Hour.",
}
QUESTIONS = [("What colour was the Zephyr bridge painted?", ["bridge"]),
             ("Which compound did the chemist from Lodz discover?", ["chemist"]),
             ("When does the Orion cafe open?", ["cafe"]),
             ("Where is the research ship Albatross based?", ["ship"]),
             ("What happened to the old mill in 1904?", ["mill"])]


def task(data: str | None, limit: int | None) -> tuple[list[TextNode], list[tuple[str, list[str]]]]:
    if data is None:
        return [TextNode(id_=k, text=v) for k, v in NOTES.items()], QUESTIONS
    items = json.load(open(data, encoding="utf-8"))
    paragraphs = {}
    for item in items:
        for title, sentences in item["context"]:
            paragraphs.setdefault(title, f"{title}: {' '.join(s.strip() for s in sentences)}")
    questions = [(it["question"], sorted({t for t, _ in it["supporting_facts"]})) for it in items[:limit]]
    return [TextNode(id_=t, text=p) for t, p in paragraphs.items()], questions


def evaluate(retriever, questions) -> dict:
    evaluator = RetrieverEvaluator.from_metric_names(["hit_rate", "mrr"], retriever=retriever)
    results = [asyncio.run(evaluator.aevaluate(q, expected_ids=ids)) for q, ids in questions]
    return {m: sum(r.metric_vals_dict[m] for r in results) / len(results) for m in ("hit_rate", "mrr")}


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data", default=None, help="a HotpotQA-layout JSON file (default: the built-in task)")
    p.add_argument("--limit", type=int, default=None, help="the first N questions")
    p.add_argument("--k", type=int, default=2, help="nodes retrieved per question (default 2)")
    args = p.parse_args(argv)
    nodes, questions = task(args.data, args.limit)
    systems = {"endo (EndoRetriever)": EndoRetriever.from_defaults(nodes=nodes, similarity_top_k=args.k)}
    # bm25s imports JAX where it is installed, and JAX's first use takes 75% of the GPU's memory for itself
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        from llama_index.retrievers.bm25 import BM25Retriever

        systems["LlamaIndex BM25Retriever"] = BM25Retriever.from_defaults(nodes=nodes, similarity_top_k=args.k)
    except ImportError:
        print("llama-index-retrievers-bm25 is not installed: only the endo retriever is evaluated")
    scores = {name: evaluate(r, questions) for name, r in systems.items()}
    print(f"{len(questions)} questions, {len(nodes)} nodes, top {args.k}")
    for name, s in scores.items():
        print(f"{name:28s} hit rate {s['hit_rate']:.3f}  MRR {s['mrr']:.3f}")
    endo = scores["endo (EndoRetriever)"]
    answer = f"endo hit rate {endo['hit_rate']:.3f}, MRR {endo['mrr']:.3f}"
    print(f"Q: how does the endo retriever do in RetrieverEvaluator?\nA: {answer}")
    return answer


if __name__ == "__main__":
    main()
