"""Per-corpus fusion from made questions, judged: would the questions `endo prepare` makes from a corpus's own text
(zero_label: keyword and cloze questions, a third two-hop) choose that corpus's fusion well?

    python tools/made_fusion.py sets OUT_DIR [--n 150]        # made questions over each test corpus (BEIR layout,
                                                               # split "made"), for signals.collect on the GPU:
    python -m endo_retrieval.calibration.signals SIG_DIR OUT_DIR/made_NAME.json.gz:made --parts pipe,dense,cpu,cpu_dense
    python tools/made_fusion.py judge SIG_DIR SIGNALS_DIR [--part union] > OUT.json

`judge` takes, for each domain, the fixed fusion of the grid its made questions rank best, and reports it on the
domain's real test questions beside the fusion fitted across the labelled domains (SIGNALS_DIR's train splits) and
each stage alone on both kinds of question. Needs ../shared/data.
"""
from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import numpy as np
from fusion_report import PAIRS, domains

from endo_retrieval.calibration import zero_label
from endo_retrieval.calibration.datasets import corpus_questions
from endo_retrieval.calibration.fusion_rule import PARTS, GridTables, items
from endo_retrieval.calibration.signals import load

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
SETS = {"dev300": "hotpotqa/dev300.json", "scifact": "scifact/scifact.json.gz:test",
        **{n: f"domains/{n}.json.gz:test" for n in ("arguana", "conala", "csn_style_python", "fiqa2018_pooled",
                                                      "stackfaq")}}


def made_sets(out: Path, n: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, spec in SETS.items():
        titles, texts, _ = corpus_questions(str(DATA / spec))
        chunks = zero_label.chunk_documents(list(zip(titles, texts)), lambda s: len(s.split()) * 4 // 3)
        single = zero_label.make_tasks(chunks, 8 * n, 0)
        linked = zero_label.two_hop_tasks(chunks, 8 * round(zero_label.TWO_HOP_SHARE * n), 0)
        tasks = zero_label.mixed(single, linked, chunks, n, zero_label.TWO_HOP_SHARE, depth=20)
        queries = [{"id": t.id, "text": t.question, "relevant": sorted({chunks[g].doc for g in t.golds})}
                   for t in tasks]
        with gzip.open(out / f"made_{name}.json.gz", "wt", encoding="utf-8") as f:
            json.dump({"corpus": [{"id": i, "title": "", "text": x} for i, x in zip(titles, texts)],
                       "queries": {"made": queries}}, f)
        print(name, len(tasks), zero_label.forms(tasks), flush=True)


def judge(made_dir: Path, signals: Path, part: str) -> dict:
    stages = PARTS[part]
    data = domains(signals)
    named = {d: PAIRS[d][1] if d in PAIRS else d for d in data}  # the made set of HotpotQA is dev300's
    made = {d: items(load(made_dir / f"made_{named[d]}_made.jsonl.gz"), part) for d in data}
    on_made, on_test = GridTables(made, stages), GridTables({d: items(te, part) for d, (_, te) in data.items()}, stages)
    fitted, _ = GridTables({d: items(tr, part) for d, (tr, _) in data.items()}, stages).fit()
    at = on_test.grid.index(fitted)
    alone = {s: on_test.grid.index(next(g for g in on_test.grid if g.get(s) == 1.0)) for s in stages}
    rows = {}
    for d in data:
        chosen = int(np.argmax(on_made.means[d]))
        rows[d] = {"chosen_by_made": {k: v for k, v in on_made.grid[chosen].items() if v},
                   "test_ndcg10": {"chosen_by_made": round(float(on_test.means[d][chosen]), 1),
                                   "fitted_across_domains": round(float(on_test.means[d][at]), 1),
                                   "best_of_grid": round(float(on_test.means[d].max()), 1)},
                   "alone_made": {s: round(float(on_made.means[d][i]), 1) for s, i in alone.items()},
                   "alone_test": {s: round(float(on_test.means[d][i]), 1) for s, i in alone.items()}}
    return {"part": part, "fitted_across_domains": {k: v for k, v in fitted.items() if v}, "domains": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sets")
    s.add_argument("out", type=Path)
    s.add_argument("--n", type=int, default=150)
    j = sub.add_parser("judge")
    j.add_argument("made", type=Path)
    j.add_argument("signals", type=Path)
    j.add_argument("--part", default="union", choices=sorted(PARTS))
    args = ap.parse_args()
    if args.command == "sets":
        made_sets(args.out, args.n)
    else:
        print(json.dumps(judge(args.made, args.signals, args.part), indent=1))


if __name__ == "__main__":
    main()
