"""Paired time differences between two runs over the same questions, as the perf docs report them: the median of
the per-question differences (second run minus first) with a 95% bootstrap interval (2,000 resamples). Reads
`endo bench corpus` results (each question's `query_ms`, and the same over the last half, past most captures) or
`endo bench quality` records (one method's index, select and their sum, per example).

    python tools/paired_times.py BEFORE.json AFTER.json
    python tools/paired_times.py BEFORE.records.jsonl[.gz] AFTER.records.jsonl[.gz] [METHOD]   (default endo)
"""
import gzip
import json
import sys

import numpy as np


def corpus_times(path: str) -> dict[str, dict[int, float]]:
    row = next(r for r in json.load(open(path))["rows"] if r["system"] == "endo")
    q = row["per_question"]["query_ms"]
    return {"query": dict(enumerate(q)), "query, last half": {i: t for i, t in enumerate(q) if i >= len(q) // 2}}


def quality_times(path: str, method: str) -> dict[str, dict[str, float]]:
    out = {"index": {}, "select": {}, "index + select": {}}
    for line in (gzip.open if path.endswith(".gz") else open)(path, "rt"):
        r = json.loads(line)
        if r.get("method") == method and "latency_ms" in r:
            index, select = r["latency_ms"]["index"], r["latency_ms"]["query"]
            for name, t in (("index", index), ("select", select), ("index + select", index + select)):
                out[name][r["example"]] = t
    return out


def paired_median(before: dict, after: dict, seed: int = 0) -> tuple[float, float, float, int]:
    keys = sorted(set(before) & set(after))
    d = np.array([after[k] - before[k] for k in keys])
    rng = np.random.default_rng(seed)
    boot = [np.median(rng.choice(d, len(d))) for _ in range(2000)]
    return float(np.median(d)), float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5)), len(keys)


if __name__ == "__main__":
    a, b = sys.argv[1:3]
    read = corpus_times if a.endswith(".json") else lambda p: quality_times(p, sys.argv[3] if len(sys.argv) > 3
                                                                              else "endo")
    before, after = read(a), read(b)
    for name in before:
        med, lo, hi, n = paired_median(before[name], after[name])
        print(f"{name}: median of {n} paired differences {med:+.1f} ms [{lo:+.1f}, {hi:+.1f}]; "
              f"medians {np.median(list(before[name].values())):.1f} -> {np.median(list(after[name].values())):.1f}")
