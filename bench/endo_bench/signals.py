"""`endo bench signals`: each ranking signal of the fused method alone, and what it finds that BM25 misses.

On the quality bench's haystacks, every sentence gets each signal's score (BM25 over sentence windows, the
retrieval heads, their second hop, ILRe's mass at l_R, the fitted fusion `endo`, and reciprocal-rank fusion of
heads and BM25 as a parameter-free reference). Per signal: the share of gold sentences kept when whole sentences
are taken in its order into the budget, and the complementarity table: gold sentences it keeps that BM25 does not
(and the reverse). Writes JSON (schema endo-bench-signals/1) and a Markdown table beside it.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

SCHEMA = "endo-bench-signals/1"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from endo_retrieval.cli.commands import model_argument
    from endo_retrieval.cli.commands import int_list

    p.add_argument("--data", required=True, help="HotpotQA PATH.json (gold supporting sentences are needed)")
    p.add_argument("--out", required=True, help="FILE.json; FILE.md is written beside it")
    p.add_argument("--context-tokens", type=int_list, action="extend", default=None, help="default 4096")
    p.add_argument("--budget", type=int_list, action="extend", default=None,
                   help="one per context length (default: an eighth of each)")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    model_argument(p)


def run(args) -> int:
    from tqdm import tqdm

    from endo_retrieval.model.backbone import Backbone
    from endo_retrieval.calibration.datasets import load_examples
    from endo_retrieval.calibration.heads import gold_sentences
    from endo_retrieval.scoring.fusion import fuse, rrf
    from endo_retrieval.methods.endo import Endo, kept_in_budget
    from endo_retrieval.model.profiles import ilre_profile

    bb = Backbone(args.model) if args.model else Backbone.default()
    ilre = ilre_profile(bb)
    endo = Endo(backbone=bb, second_hop=True, ilre_layer=int(ilre["layer"]) if ilre else None)
    lengths_L = args.context_tokens or [4096]
    budgets = args.budget or [L // 8 for L in lengths_L]
    rows = []
    for L, budget in zip(lengths_L, budgets):
        examples = load_examples(args.data, count_tokens=bb.count_tokens, context_tokens=L, limit=args.limit,
                                 seed=args.seed)
        found: dict[str, list[np.ndarray]] = {}
        golds = []
        for e in tqdm(examples, desc=f"signals {L}/{budget}", disable=None):
            prepared = endo.prepare(e.context)
            sig = endo.signals(prepared, e.question)
            sig["endo"] = fuse(sig, endo.weights)
            sig["rrf(heads,bm25)"] = rrf(sig["heads"], sig["bm25"])
            lengths = np.diff(np.append(prepared.sentence_starts, prepared.corpus.n_positions))
            gold = gold_sentences(prepared, e.supporting)
            golds.append(gold)
            for name, s in sig.items():
                found.setdefault(name, []).append(kept_in_budget(s, lengths, budget) & gold)
        n_gold = int(sum(g.sum() for g in golds))
        bm25 = found["bm25"]
        for name, hits in found.items():
            rows.append({"signal": name, "context_tokens": L, "budget": budget, "n": len(golds), "n_gold": n_gold,
                         "recall": round(float(np.mean([h.sum() / max(1, g.sum()) for h, g in zip(hits, golds)])), 4),
                         "found": int(sum(h.sum() for h in hits)),
                         "only_this": int(sum((h & ~b).sum() for h, b in zip(hits, bm25))),
                         "only_bm25": int(sum((b & ~h).sum() for h, b in zip(hits, bm25)))})
    result = {"schema": SCHEMA, "config": {"model": bb.model_id, "data": str(args.data), "seed": args.seed,
                                           "heads": [list(h) for h in endo.heads], "weights": endo.weights,
                                           "ilre_layer": endo.ilre_layer, "limit": args.limit},
              "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    table = ["| context | budget | signal | recall | gold found | found, not by BM25 | found by BM25, not this |",
             "|---|---|---|---|---|---|---|"]
    table += [f"| {r['context_tokens']} | {r['budget']} | {r['signal']} | {100 * r['recall']:.1f} | "
              f"{r['found']}/{r['n_gold']} | {r['only_this']} | {r['only_bm25']} |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return 0
