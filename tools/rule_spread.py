"""How far a shipped adaptive rule moves its weights from question to question: per domain of a signals folder (its
test splits), each stage's mean weight, its standard deviation and its range over the questions.

    python tools/rule_spread.py SIGNALS_DIR PROFILE.json [--entry cpu|pipe|minilm|bm25] > OUT.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from fusion_report import domains, profile_entries

from endo_retrieval.calibration.fusion_rule import POOLED_PART, items
from endo_retrieval.scoring.adaptive import AdaptiveWeights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("signals")
    ap.add_argument("profile")
    ap.add_argument("--entry", default="cpu", choices=sorted(POOLED_PART))
    args = ap.parse_args()
    entry = profile_entries(json.loads(Path(args.profile).read_text()))[args.entry]
    if "adaptive" not in entry:
        raise SystemExit(f"the {args.entry} entry of {args.profile} ships fixed weights, no rule")
    rule = AdaptiveWeights.from_json(entry["adaptive"])
    out = {"profile": Path(args.profile).name, "entry": args.entry, "domains": {}}
    for name, (_, test) in domains(Path(args.signals)).items():
        w = np.array([list(rule.weights(s).values()) for s, _, _ in items(test, POOLED_PART[args.entry])])
        out["domains"][name] = {"questions": len(w), **{stage: {
            "mean": round(float(w[:, i].mean()), 2), "sd": round(float(w[:, i].std()), 3),
            "min": round(float(w[:, i].min()), 2), "max": round(float(w[:, i].max()), 2)}
            for i, stage in enumerate(rule.stages)}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
