"""Recall by question type from `endo bench corpus` result files (their stored per-question hits), each row paired
with one reference row, as the bench itself now reports for new runs (`corpus_bench.by_type`).

    .venv/bin/python tools/corpus_by_type.py ../shared/data/hotpotqa/dev300.json \
        bench/results/quality/sizes/refit_corpus_dev300_qwen1.5b.json \
        bench/results/quality/sizes/zero_label_near_corpus_dev300_qwen1.5b.json

The reference is the first file's `llamaindex-bm25` row (`--reference FILE:SYSTEM` names another); every file must
hold the same questions in the same order as the reference's.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

from endo_bench.corpus_bench import KS, by_type, question_metrics, question_types  # noqa: E402


def rows(path: str):
    result = json.load(open(path))
    cfg = result["config"]
    for row in result["rows"]:
        if "per_question" in row:
            yield row["system"], cfg["question_ids"], question_metrics(row["per_question"], cfg["gold_per_question"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", help="the HotpotQA-layout file the runs asked (its `type` field)")
    ap.add_argument("results", nargs="+", help="endo bench corpus JSON files")
    ap.add_argument("--reference", help="FILE:SYSTEM (default: the first file's llamaindex-bm25 row)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    item_of = {it["_id"]: it for it in json.load(open(args.data))}
    ref_file, ref_system = (args.reference.rsplit(":", 1) if args.reference
                            else (args.results[0], "llamaindex-bm25"))
    ref_ids, ref = next((ids, m) for s, ids, m in rows(ref_file) if s == ref_system)
    types = question_types([item_of[i] for i in ref_ids])  # the bench's rule: every question has a type
    if types is None:
        raise SystemExit(f"{args.data}: a question the runs asked has no `type`")
    head = [f"{t} recall@{k} (Δ)" for t in sorted(set(types)) for k in KS]
    print(f"reference: {ref_system} of {os.path.basename(ref_file)}\n")
    print("| file | system | " + " | ".join(head) + " |\n|" + "---|" * (2 + len(head)))
    for path in args.results:
        for system, ids, metrics in rows(path):
            if ids != ref_ids:
                raise SystemExit(f"{path}: {system} asked other questions than the reference")
            split = by_type(metrics, ref, types, args.seed)
            cells = [f"{100 * v[f'recall@{k}']['value']:.1f} ({100 * v['diff'][f'recall@{k}']['value']:+.1f})"
                     for _, v in sorted(split.items()) for k in KS]
            print(f"| {os.path.basename(path)} | {system} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
