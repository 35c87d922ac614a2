"""Another model's reads judged under the default model's fitted fusion, as `endo prepare` hands it over
(`fusion_rule.transferred`): nDCG@10 on each test split's signals (`signals.py`, parts pipe, dense), with the
profile's GPU entry (its pools merged, its rule where it has one, else its fixed weights) and, beside it, the fusion
the model ran when the signals were read (`--ran FILE`: `endo bench corpus` records endo_DOMAIN.json in the same
folder) and the better of LlamaIndex's BM25 and a MiniLM store (`--baselines DIR`).

    python tools/fusion_transfer.py SIGNALS_DIR --profile PROFILE.json [--baselines DIR] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from endo_retrieval.calibration.fusion_rule import items, per_question
from endo_retrieval.calibration.signals import load
from endo_retrieval.scoring.adaptive import AdaptiveWeights
from endo_retrieval.scoring.fusion import fuse


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("folder", type=Path)
    p.add_argument("--profile", type=Path, required=True)
    p.add_argument("--baselines", type=Path)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    entry = json.loads(args.profile.read_text())["pipeline"]["first_stages"]["hybrid"]
    rule = AdaptiveWeights.from_json(entry["adaptive"]) if entry.get("adaptive") else None
    score = rule.fuse if rule else (lambda s: fuse(s, entry["weights"]))
    part = "union" if entry.get("pools") == ["hybrid", "dense"] else "pipe"
    rows = {}
    for f in sorted(args.folder.glob("*.jsonl.gz")):
        name = f.name.split(".")[0].removesuffix("_test")
        got = per_question(items(load(f), part), score)
        row = {"n": len(got), "ndcg10": round(100 * float(got.mean()), 1)}
        ran = args.folder / f"endo_{name}.json"
        if ran.exists():
            row["ran"] = round(100 * json.loads(ran.read_text())["rows"][0]["ndcg@10"]["value"], 1)
        base = args.baselines / f"base_{name}.json" if args.baselines else None
        if base and base.exists():
            best = max(r["ndcg@10"]["value"] for r in json.loads(base.read_text())["rows"])
            row["better_of_bm25_minilm"] = round(100 * best, 1)
            row["minus_better"] = round(row["ndcg10"] - row["better_of_bm25_minilm"], 1)
        rows[name] = row
        print(name, row, flush=True)
    out = {"profile": args.profile.name, "part": part, "rule": "adaptive" if rule else "fixed", "rows": rows,
           "mean_minus_better": round(float(np.mean([r["minus_better"] for r in rows.values()
                                                      if "minus_better" in r])), 2)}
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
