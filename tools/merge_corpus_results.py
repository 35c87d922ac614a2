"""Join `endo bench corpus` results of the same questions (rows run in several processes) into one result, with
every row's intervals and paired differences to one reference recomputed over the same resampled questions, and its
Markdown table beside it.

    python tools/merge_corpus_results.py OUT.json IN.json [IN.json ...] [--reference llamaindex-bm25] [--data FILE]
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from endo_bench.corpus_bench import add_intervals, order_keys, write_outputs  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("inputs", nargs="+")
    p.add_argument("--reference", default="llamaindex-bm25")
    p.add_argument("--data", default=None, help="the data file here, for recalls by question type")
    args = p.parse_args()
    results = [json.loads(Path(f).read_text()) for f in args.inputs]
    first = results[0]["config"]
    for r, f in zip(results, args.inputs):
        if r["config"]["question_ids"] != first["question_ids"]:
            raise SystemExit(f"{f} asks other questions than {args.inputs[0]}; only runs over the same ones join")
    rows = [row for r in results for row in r["rows"] if "skipped" not in row]
    gold = first["gold_per_question"]
    types = None
    if args.data:
        from endo_bench.corpus_bench import question_types
        from endo_retrieval.calibration.datasets import corpus_questions

        by_id = {q["_id"]: q for q in corpus_questions(args.data)[2]}
        types = question_types([by_id[i] for i in first["question_ids"]])
    add_intervals(rows, gold, args.reference if any(r["system"] == args.reference for r in rows) else None,
                  first["seed"], types)
    config = dict(first, systems=[r["system"] for r in rows], reference=args.reference,
                  wall_s=round(sum(r["config"]["wall_s"] for r in results), 1),
                  joined_from=[Path(f).name for f in args.inputs])
    write_outputs({"schema": results[0]["schema"], "config": config, "rows": [order_keys(r) for r in rows]},
                  Path(args.out))
    print(Path(args.out).with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
