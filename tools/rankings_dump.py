"""Every question's top 10 from `endo bench corpus`, written beside its result, so that two builds' rankings can be
compared question by question (the bench's JSON keeps the gold's ranks only).

    python tools/rankings_dump.py RANKINGS.json.gz [endo bench corpus arguments...]
    python tools/rankings_dump.py --compare A.json.gz B.json.gz

The first form runs the installed bench (whichever `endo_bench` is on the path) with its rows' rankings recorded:
{system: [[paragraph title, ...] per question]}. The second says, per system, on how many questions the two top
10s are the same list, and prints the first that differ.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys


def dump(out: str, bench_args: list[str]) -> None:
    from endo_bench import corpus_bench

    ranked_per_row: list[list[str]] = []
    score = corpus_bench.score_ranking

    def recording(ranked, gold):  # measure() scores each question's ranking here, rows one after another
        ranked_per_row.append(list(ranked[:corpus_bench.TOP]))
        return score(ranked, gold)

    corpus_bench.score_ranking = recording
    p = argparse.ArgumentParser()
    corpus_bench.add_arguments(p)
    args = p.parse_args(bench_args)
    corpus_bench.run(args)
    result = json.loads(open(args.out, encoding="utf-8").read())
    rows, start, out_rows = result["rows"], 0, {}
    for row in rows:
        n = row.get("n", 0)
        out_rows[row["system"]] = ranked_per_row[start:start + n]
        start += n
    with gzip.open(out, "wt", encoding="utf-8") as f:
        json.dump(out_rows, f)


def compare(a: str, b: str) -> int:
    left, right = (json.load(gzip.open(p, "rt", encoding="utf-8")) for p in (a, b))
    differ = 0
    for system in left:
        if system not in right:
            print(f"{system}: only in {a}")
            differ += 1
            continue
        pairs = list(zip(left[system], right[system]))
        same = sum(x == y for x, y in pairs)
        print(f"{system}: {same} of {len(pairs)} questions ranked the same top 10"
              + ("" if len(left[system]) == len(right[system]) else " (the runs asked different numbers)"))
        first = next((i for i, (x, y) in enumerate(pairs) if x != y), None)
        if first is not None:
            differ += 1
            print(f"  first difference, question {first}: {pairs[first][0]} against {pairs[first][1]}")
    return 1 if differ else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--compare"]:
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    dump(sys.argv[1], sys.argv[2:])
