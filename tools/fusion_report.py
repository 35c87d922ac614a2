"""Fixed and adaptive fusions judged on the signals `endo_retrieval.calibration.signals` wrote (one folder of
DOMAIN_train / DOMAIN_test files; HotpotQA's are fit300 / dev300): nDCG@10 on each test split, every rule fitted on
the train splits of all the domains and again with the tested domain left out, each beside BM25 and the embedder alone,
with paired 95% bootstrap intervals.

    python tools/fusion_report.py SIGNALS_DIR [--out FILE.json] [--baselines DIR]   (FILE.md beside it: the tables)
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from endo_retrieval.calibration.fusion_rule import (PARTS, POOLED_PART, GridTables, fit_balanced, items, per_question,
                                                   ranked)
from endo_retrieval.calibration.pipeline import recall_at
from endo_retrieval.calibration.signals import load
from endo_retrieval.scoring.fusion import fuse

PAIRS = {"hotpotqa": ("fit300", "dev300")}
# the fusions shipped before the adaptive rule (the 135M profile: GPU hybrid, CPU hybrid, both rerankers)
SHIPPED = {"pipe": {"bm25": 0.2, "dense": 0.4, "heads": 0.1, "hop2": 0.3},
           "cpu": {"bm25": 0.3, "dense": 0.3, "heads": 0.4},
           "minilm": {"first_stage": 0.3, "heads": 0.7}, "bm25": {"first_stage": 0.5, "heads": 0.5}}


def domains(folder: Path) -> dict[str, tuple[list, list]]:
    out = {}
    for f in sorted(folder.glob("*_train.jsonl.gz")):
        name = f.name[: -len("_train.jsonl.gz")]
        test = folder / f"{name}_test.jsonl.gz"
        if test.exists():
            out[name] = (load(f), load(test))
    for name, (train, test) in PAIRS.items():
        if (folder / f"{train}.jsonl.gz").exists() and (folder / f"{test}.jsonl.gz").exists():
            out[name] = (load(folder / f"{train}.jsonl.gz"), load(folder / f"{test}.jsonl.gz"))
    return out


def interval(x: np.ndarray, seed: int = 0, n: int = 2000) -> list[float]:
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), (n, len(x)))].mean(1)
    return [round(100 * float(np.percentile(means, 2.5)), 1), round(100 * float(np.percentile(means, 97.5)), 1)]


def first_stage_alone(records, part):
    its = items(records, part)
    return per_question(its, lambda s: s["first_stage"])




def report(folder: Path) -> dict:
    data = domains(folder)
    out = {}
    pooled = all("dense" in r for tr, te in data.values() for r in tr + te)
    for entry, part in POOLED_PART.items():  # `before`: the part the fusion shipped before read (one pool)
        before = entry
        part = part if pooled else before
        stages = PARTS[part]
        train = {d: items(tr, part) for d, (tr, _) in data.items()}
        test = {d: items(te, part) for d, (_, te) in data.items()}
        test_before = {d: items(te, before) for d, (_, te) in data.items()}
        tables = GridTables(train, stages)
        fixed_all, temperature = tables.fit()
        rule_all = fit_balanced(train, stages, start=fixed_all)
        rows = {}
        for d in data:
            held = {k: v for k, v in train.items() if k != d}
            fixed_lodo = tables.fit(list(held))[0]
            rule_lodo = fit_balanced(held, stages, start=fixed_lodo)
            scores = {
                "bm25": first_stage_alone(data[d][1], "bm25"), "minilm": first_stage_alone(data[d][1], "minilm"),
                "shipped": per_question(test_before[d], lambda s: fuse(s, SHIPPED[entry])),
                "fixed_all": per_question(test[d], lambda s: fuse(s, fixed_all)),
                "fixed_lodo": per_question(test[d], lambda s: fuse(s, fixed_lodo)),
                "adaptive_all": per_question(test[d], rule_all.fuse),
                "adaptive_lodo": per_question(test[d], rule_lodo.fuse)}
            best = "bm25" if scores["bm25"].mean() >= scores["minilm"].mean() else "minilm"
            ref = {"pipe": best, "cpu": best, "minilm": "minilm", "bm25": "bm25"}[entry]
            rows[d] = {"n": len(test[d]), "reference": ref} | {
                k: {"ndcg10": round(100 * float(v.mean()), 1), "ci": interval(v),
                    "minus_reference": round(100 * float((v - scores[ref]).mean()), 1),
                    "minus_reference_ci": interval(v - scores[ref])} for k, v in scores.items()}
            rows[d]["recall"] = {name: {f"@{k}": round(100 * float(np.mean(
                [recall_at(ranked(docs, score(s)), gold, k) for s, docs, gold in its])), 1) for k in (2, 5, 10)}
                for name, score, its in (("shipped", lambda s: fuse(s, SHIPPED[entry]), test_before[d]),
                                         ("adaptive_all", rule_all.fuse, test[d]),
                                         ("fixed_all", lambda s: fuse(s, fixed_all), test[d]),
                                         ("fixed_lodo", lambda s: fuse(s, fixed_lodo), test[d]))}
            print(entry, d, {k: (r["ndcg10"], r["minus_reference"]) for k, r in rows[d].items()
                            if isinstance(r, dict) and "ndcg10" in r}, flush=True)
        out[entry] = {"part": part, "fixed_all": fixed_all, "temperature": temperature, "rule_all": rule_all.to_json(),
                      "rows": rows}
    return out


NAMES = {"hotpotqa": "HotpotQA dev300 (multi-hop Wikipedia)", "scifact": "SciFact (scientific claims)",
         "arguana": "ArguAna (argument -> counterargument)", "conala": "CoNaLa (intent -> Python line)",
         "csn_style_python": "code search (docstring -> function)", "fiqa2018_pooled": "FiQA (financial QA)",
         "stackfaq": "StackFAQ (paraphrased FAQ)"}


def markdown(result: dict, baselines: Path | None = None, shipped: dict | None = None) -> str:
    """The tables of docs/results.md: `endo` on a GPU and a CPU, and both rerankers, per domain; `shipped`: {entry:
    "adaptive" | "fixed"}, which fusion the profile holds (its columns "held out" and after are that one's)."""
    shipped = shipped or {}

    def base(domain: str, system: str) -> str:
        name = {"hotpotqa": "dev300", "scifact": "scifact"}.get(domain, domain)
        path = baselines / f"base_{name}.json" if baselines else None
        if not path or not path.exists():
            return "-"
        rows = {r["system"]: r for r in json.loads(path.read_text())["rows"]}
        return f"{100 * rows[system]['ndcg@10']['value']:.1f}" if system in rows else "-"

    def cell(row, key, diff=False):
        r = row[key]
        if diff:
            lo, hi = r["minus_reference_ci"]
            return f"{r['minus_reference']:+.1f} [{lo:+.1f}, {hi:+.1f}]"
        return f"{r['ndcg10']:.1f}"

    def lodo(entry: str) -> str:
        return f"{shipped.get(entry, 'adaptive')}_lodo"

    def minus_frameworks(d: str, row: dict) -> str:
        both = [base(d, "llamaindex-bm25"), base(d, "minilm")]
        return "-" if "-" in both else f"{row[lodo('pipe')]['ndcg10'] - max(map(float, both)):+.1f}"

    out = ["| domain (test questions) | LlamaIndex BM25 | MiniLM store | BM25 | dense | before | fixed | adaptive "
           "| shipped, domain held out | held out minus the better of BM25 and dense | held out minus the better "
           "of LlamaIndex BM25 and the MiniLM store |", "|" + "---|" * 11]
    for d, row in result["pipe"]["rows"].items():
        out.append(f"| {NAMES.get(d, d)} ({row['n']}) | {base(d, 'llamaindex-bm25')} | {base(d, 'minilm')} | "
                   f"{cell(row, 'bm25')} | {cell(row, 'minilm')} | {cell(row, 'shipped')} | {cell(row, 'fixed_all')} | "
                   f"{cell(row, 'adaptive_all')} | {cell(row, lodo('pipe'))} | {cell(row, lodo('pipe'), True)} | "
                   f"{minus_frameworks(d, row)} |")
    out += ["", "| domain | CPU entry: before | fixed | adaptive | shipped, held out | minus the better | MiniLM + "
            "`EndoReranker`: before | shipped, held out | minus MiniLM | BM25 + `EndoReranker`: before | shipped, "
            "held out | minus BM25 |", "|" + "---|" * 12]
    for d in result["pipe"]["rows"]:
        c, m, b = (result[p]["rows"][d] for p in ("cpu", "minilm", "bm25"))
        out.append(f"| {NAMES.get(d, d).split(' (')[0]} | {cell(c, 'shipped')} | {cell(c, 'fixed_all')} | "
                   f"{cell(c, 'adaptive_all')} | {cell(c, lodo('cpu'))} | {cell(c, lodo('cpu'), True)} | "
                   f"{cell(m, 'shipped')} | {cell(m, lodo('minilm'))} | {cell(m, lodo('minilm'), True)} | "
                   f"{cell(b, 'shipped')} | {cell(b, lodo('bm25'))} | {cell(b, lodo('bm25'), True)} |")
    return "\n".join(out) + "\n"


def profile_entries(profile: dict) -> dict[str, dict]:
    """{entry: its fusion's part of the profile}, for each entry `report` judges."""
    hybrid = profile["pipeline"]["first_stages"]["hybrid"]
    return {"pipe": hybrid, "cpu": hybrid.get("cpu", {})} | dict(profile.get("reranker", {}))


def shipped_fusions(profile: Path) -> dict[str, str]:
    """{entry: "adaptive" | "fixed"}: which fusion a profile holds for each entry `report` judges."""
    entries = profile_entries(json.loads(profile.read_text()))
    return {k: "adaptive" if "adaptive" in v else "fixed" for k, v in entries.items()}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("folder", type=Path)
    p.add_argument("--out", type=Path)
    p.add_argument("--from-json", type=Path, help="a report written before: only its tables")
    p.add_argument("--baselines", type=Path, help="folder of `endo bench corpus` runs base_DOMAIN.json "
                   "(llamaindex-bm25, minilm) on the same questions")
    p.add_argument("--profile", type=Path, help="the profile `endo calibrate-fusion` wrote: which fusion it ships")
    args = p.parse_args()
    result = json.loads(args.from_json.read_text()) if args.from_json else report(args.folder)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
        shipped = shipped_fusions(args.profile) if args.profile else None
        args.out.with_suffix(".md").write_text(markdown(result, args.baselines, shipped))
