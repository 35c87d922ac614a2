"""`endo calibrate-pipeline`: the `endo` pipeline's settings fitted on labelled questions over a corpus.

Every paragraph of a HotpotQA-layout file is pooled into one corpus (one document per title) and each question
asks it, as `endo bench corpus` does. For every candidate depth, tokens read per candidate and reading order, the
stage scores of each question's candidates are computed once; then the weights of the fusion are searched on a grid
of the simplex (BM25 alone is a corner, so the fit never falls below stage 1 on this data). Within a setting the
weights order the candidates, so they are fitted for the mean of paragraph recall@2 and recall@5; across settings
the depth also decides what reaches the top 10, so the setting with the best mean of recall@2, @5 and @10 is
written into the model's heads profile (`pipeline`); ties go to the cheaper setting (`choose`).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from endo_retrieval.scoring.fusion import fuse
from endo_retrieval.methods.endo import simplex
from endo_retrieval.model.backbone import Backbone
from endo_retrieval.calibration.datasets import corpus_questions, hotpotqa_corpus
from endo_retrieval.index.dense import embed
from endo_retrieval.scoring.bm25 import words
from endo_retrieval.model.profiles import heads_profile_path
from endo_retrieval.methods.search import Document, EndoIndex
from endo_retrieval.calibration.heads import cached_arrays, steps
from endo_retrieval.calibration.zero_label import near_best
from endo_retrieval.index.first_stage import fused_top
from endo_retrieval.methods.pipeline import EndoPipeline

STAGES = ("bm25", "heads", "hop2")
ORDERS = {"best-last": True, "first-stage": False}
KS = (2, 5, 10)


def recall_at(ranked_docs: list[str], gold: set[str], k: int) -> float:
    """Share of the gold documents among the first k distinct documents of a ranking."""
    seen: list[str] = []
    for d in ranked_docs:
        if d not in seen:
            seen.append(d)
        if len(seen) == k:
            break
    return len(gold & set(seen)) / max(1, len(gold))


def per_item(items: list[tuple[dict, list[str], set[str]]], weights: dict) -> dict[int, np.ndarray]:
    """Paragraph recall@k of each item [(stage scores, candidate documents, gold documents)]."""
    out = {k: [] for k in KS}
    for signals, docs, gold in items:
        fused = fuse(signals, weights)
        ranked = [docs[i] for i in np.lexsort((np.arange(len(docs)), -fused))]
        for k in KS:
            out[k].append(recall_at(ranked, gold, k))
    return {k: np.array(v) for k, v in out.items()}


def objective(items: list[tuple[dict, list[str], set[str]]], weights: dict) -> dict[int, float]:
    """Mean paragraph recall@k over the items."""
    return {k: float(v.mean()) if len(v) else 0.0 for k, v in per_item(items, weights).items()}


def fit(items, step: float = 0.1, stages: tuple[str, ...] = STAGES, choose=None) -> tuple[dict, dict]:
    """(weights, recall@k) maximising the mean of recall@2 and recall@5; the corners come first (`stages[0]`, the
    first stage, before the others), so a tie keeps the simpler fusion. `choose(grid, per weight x item)`: picks
    among the weights by their per-item mean of recall@2 and @5 instead (zero-label: zero_label.flattest)."""
    grid = sorted(simplex(list(stages), step), key=lambda w: (-max(w.values()), -w[stages[0]]))
    if choose is not None:
        scores = [per_item(items, w) for w in grid]
        best = choose(grid, np.stack([(r[2] + r[5]) / 2 for r in scores]))
        return grid[best], {k: float(v.mean()) for k, v in scores[best].items()}
    best_w, best, best_r = None, -1.0, None
    for w in grid:
        r = objective(items, w)
        if (r[2] + r[5]) / 2 > best + 1e-9:
            best_w, best, best_r = w, (r[2] + r[5]) / 2, r
    return best_w, best_r


def run(args) -> dict:
    start = time.perf_counter()
    bb = Backbone.of(args.model, device=args.device)
    titles, paragraphs, questions = hotpotqa_corpus(args.data, args.limit)
    out = Path(args.out) if args.out else heads_profile_path(bb)
    profile = json.loads(out.read_text()) if out.exists() else {}
    cpu = args.cpu
    best, table, dump = fit_settings(bb, titles, paragraphs, questions, args.depths, args.read_tokens, args.orders,
                                     heads=profile.get("heads"), choose_weights=cheapest_weights if cpu else None)
    fitted = section(best, table, Path(args.data).name, len(questions), time.perf_counter() - start)
    if cpu:  # beside the main setting, which a GPU keeps reading
        fitted["fit"]["rule"] = CPU_RULE
        profile.setdefault("pipeline", {})["cpu"] = fitted
    else:
        profile["pipeline"] = fitted
    write_json(profile, out)
    if args.dump:
        np.savez_compressed(args.dump, **dump)
    print(json.dumps({k: v for k, v in fitted.items() if k != "fit"} | {"recall": best["recall"]}))
    return profile


def fit_settings(bb, titles: list[str], paragraphs: list[str], questions: list[dict], depths, read_tokens, orders,
                 *, heads=None, progress=None, cache: Path | None = None, choose_weights=None,
                 choose_setting=None) -> tuple[dict, list[dict], dict]:
    """(best row, every row, the stage scores) over a corpus of `paragraphs` (one document per title) and
    `questions` ({"question", "supporting_facts": [[title, i], ...]}: HotpotQA's, or zero_label.py's). `heads`: the
    retrieval heads to read with (None: the model's profile); `progress`, `cache`: as heads_calibrate.calibrate.
    `choose_weights`: as `fit`'s `choose`; `choose_setting(rows, per row x question)`: picks the row by its
    per-question mean of recall@2, @5 and @10 (default `choose`; zero-label: zero_label.cheapest_setting)."""
    index = EndoIndex(bb, method="endo")
    index.add_documents([Document(t, p) for t, p in zip(titles, paragraphs)])
    corpus, passages = index.corpus, index.passages()
    doc_of = {int(p): corpus.span_text(int(p), int(p) + 1)[0] for p in passages.starts}
    table, dump, scored = [], {}, []
    for depth in sorted(depths):
        for n_read in sorted(read_tokens):
            for order in orders:
                pipe = EndoPipeline(bb, depth=depth, read_tokens=n_read, best_last=ORDERS[order],
                                    weights=dict.fromkeys(STAGES, 1.0), heads=heads)
                items = []
                for q_i, q in enumerate(steps(questions, f"depth {depth}, {n_read} tokens, {order}", progress)):
                    key = f"stage/{bb.model_hash}/{pipe.heads}/{depth}/{n_read}/{order}/{len(titles)}/{q['question']}"
                    got = cached_arrays(cache, key, lambda: _stage(pipe, corpus, passages, q["question"], doc_of))
                    signals = {name: got[name] for name in STAGES if name in got}
                    docs = [str(d) for d in got["docs"]]
                    items.append((signals, docs, {t for t, _ in q["supporting_facts"]}))
                    key = f"{depth}/{n_read}/{order}/{q_i}"
                    dump |= {f"{key}/{name}": s for name, s in signals.items()}
                    dump |= {f"{key}/docs": np.array(docs), f"{key}/gold": np.array(sorted(items[-1][2]))}
                weights, recall = fit(items, choose=choose_weights)
                if choose_setting:  # per question, for a choice among the settings
                    scored.append(np.mean(list(per_item(items, weights).values()), axis=0))
                table.append({"depth": depth, "read_tokens": n_read, "order": order, "weights": weights,
                              "recall": {f"@{k}": round(r, 4) for k, r in recall.items()},
                              "stage1": {f"@{k}": round(r, 4) for k, r in objective(items, {"bm25": 1.0}).items()}})
                if progress is None:
                    print(json.dumps(table[-1]))
    best = table[choose_setting(table, np.stack(scored))] if choose_setting else choose(table)
    return best, table, dump


CPU_RULE = ("weights: near the best mean of recall@2 and @5 (within one paired standard error), without the second "
            "hop where one is; setting: the best mean of recall@2, @5 and @10 among those tried")


def cheapest_weights(grid: list[dict], table: np.ndarray) -> int:
    """Of the weights `grid` scored per question in `table` (weights x questions), one near the best
    (`zero_label.near_best`) that gives the second hop no weight, where there is one; the better mean among equals.
    A weight of 0 skips the hop's forward, which on a CPU costs about a fifth of a question: on fit300 at depth 12
    the 135M model's best fusion without it lost 0.3 [-1.3, +0.5] points of the mean of recall@2 and @5."""
    means = table.mean(1)
    return min(near_best(table), key=lambda i: (grid[i].get("hop2", 0.0) > 0, -means[i], i))


def choose(table: list[dict]) -> dict:
    """The setting of `table` (rows of `fit_settings`) with the best mean of recall@2, @5 and @10, the cheaper on a
    tie. @10 counts here, not in the weights' fit: with the stemmed first stage, the 135M model's fit300 grid tied
    depth 10 with depth 20 on the mean of @2 and @5 (0.778 against 0.777), and depth 10, whose top 10 is stage 1's,
    lost 3.2 [1.5, 5.0] points of recall@10 on dev300 for nothing measurable at @2 or @5."""
    return max(table, key=lambda r: (float(np.mean([r["recall"][f"@{k}"] for k in KS])), -r["depth"],
                                     -r["read_tokens"]))


def _stage(pipe, corpus, passages, question: str, doc_of: dict) -> dict[str, np.ndarray]:
    top, signals, _ = pipe.stage_scores(corpus, passages, question)
    return signals | {"docs": np.array([doc_of[int(passages.starts[i])] for i in top])}


def section(best: dict, table: list[dict], data: str, n_questions: int, seconds: float) -> dict:
    """The profile's `pipeline` section: the best setting, and the fit that chose it."""
    return {"depth": best["depth"], "read_tokens": best["read_tokens"], "best_last": ORDERS[best["order"]],
            "weights": best["weights"], "fit": {"data": data, "n_questions": n_questions, "recall": best["recall"],
                                                "table": table, "wall_s": round(seconds, 1)}}


def write_json(profile: dict, out: Path) -> None:
    tmp = Path(out).with_suffix(".tmp")
    tmp.write_text(json.dumps(profile, indent=1))
    tmp.replace(out)


# --------------------------------------------------------------------- a first stage with the dense embedder

SHARES = tuple(round(0.1 * i, 1) for i in range(11))  # the dense ranking's share of stage 1's fusion, tried
FIRST_STAGE_SCORES = ("bm25", "dense", "heads", "hop2")


def stage1_coverage(index: EndoIndex, questions: list[dict], depth: int, shares) -> dict[float, float]:
    """{share: mean share of each question's gold documents among the documents of stage 1's `depth` candidates
    when the dense ranking weighs `share`}: what the model can rank at all, whatever it reads. Each question's two
    rankings are computed once for every share."""

    corpus, passages = index.corpus, index.passages()
    doc_of = corpus.locate(passages.starts)[0]
    docs = [d.doc_id for d in corpus.documents()]
    asked = embed(passages.dense.embedder, [q["question"] for q in questions], passages.dense.device)
    found = {s: [] for s in shares}
    for q, vector in zip(questions, asked):
        query = words(q["question"])
        bm25 = passages.bm25.get_scores(query) if query else np.zeros(len(passages))
        dense = np.asarray(passages.vectors @ vector, np.float64)
        gold = {t for t, _ in q["supporting_facts"]}
        for s in shares:
            got = {docs[i] for i in doc_of[fused_top(bm25, dense, s, depth)]}
            found[s].append(len(gold & got) / len(gold))
    return {s: float(np.mean(v)) for s, v in found.items()}


def fit_first_stage(bb, sets: dict[str, tuple[list[str], list[str], list[dict]]], first_stage: str = "hybrid",
                    heads=None, progress=None, stages: tuple[str, ...] = FIRST_STAGE_SCORES) -> dict:
    """The profile's `first_stages` entry for `first_stage` ("hybrid" or "dense"), fitted on labelled sets
    {name: (titles, texts, questions)} at the model's fitted depth, reading and order (its BM25 setting): the dense
    share that covers the most gold in stage 1's candidates (each set weighing the same; ties: the nearer to an
    even share), then the fusion weights of BM25's score, the cosine, the heads' and the second read's, fitted as
    `fit` does (the mean of recall@2 and @5, each set weighing the same; BM25 and the cosine alone are corners).
    `stages`: the scores fused (without "hop2" the second read is never made: a CPU's entry)."""
    base = EndoPipeline(bb, first_stage="bm25", heads=heads)
    pipe = EndoPipeline(bb, first_stage=first_stage, depth=base.depth, read_tokens=base.read_tokens,
                        best_last=base.best_last, weights=dict.fromkeys(stages, 1.0), heads=heads)
    indexes = {}
    for name, (titles, texts, _) in sets.items():
        indexes[name] = EndoIndex(bb, method="endo", first_stage="hybrid")
        indexes[name].add_documents([Document(t, p) for t, p in zip(titles, texts)])
    shares = SHARES if first_stage == "hybrid" else (1.0,)
    by_set = {name: stage1_coverage(indexes[name], q, pipe.depth, shares) for name, (_, _, q) in sets.items()}
    coverage = {s: {name: by_set[name][s] for name in sets} for s in shares}
    share = max(shares, key=lambda s: (round(float(np.mean(list(coverage[s].values()))), 4), -abs(s - 0.5)))
    pipe.dense_share = share
    items = {}
    for name, (titles, texts, questions) in sets.items():
        corpus, passages = indexes[name].corpus, indexes[name].passages()
        doc_of = {int(p): corpus.span_text(int(p), int(p) + 1)[0] for p in passages.starts}
        items[name] = []
        for q in steps(questions, f"{name}: reading ({first_stage}, share {share})", progress):
            got = _stage(pipe, corpus, passages, q["question"], doc_of)
            items[name].append(({s: got[s] for s in stages if s in got}, [str(d) for d in got["docs"]],
                                {t for t, _ in q["supporting_facts"]}))
    grid = sorted(simplex(list(stages), 0.1), key=lambda w: (-max(w.values()), -w["bm25"]))

    def score(w):
        per_set = [objective(its, w) for its in items.values()]
        return float(np.mean([(r[2] + r[5]) / 2 for r in per_set])), per_set

    best = max(grid, key=lambda w: score(w)[0])  # max keeps the first of equals: the simpler corner
    recall = {name: {f"@{k}": round(v, 4) for k, v in r.items()} for name, r in zip(items, score(best)[1])}
    stage1 = {name: {f"@{k}": round(v, 4) for k, v in objective(its, {"bm25": 1.0} if first_stage == "bm25" else
                                                                  {"bm25": 1 - share, "dense": share}).items()}
              for name, its in items.items()}
    return {"dense_share": share, "weights": best,
            "fit": {"data": list(sets), "n_questions": {n: len(s[2]) for n, s in sets.items()},
                    "depth": pipe.depth, "read_tokens": pipe.read_tokens, "best_last": pipe.best_last,
                    "stage1_coverage": {str(s): c for s, c in coverage.items()}, "recall": recall,
                    "stage_scores_fused_alone": stage1}}


def run_first_stage(args) -> dict:
    """`endo calibrate-pipeline --first-stage hybrid --data A --data B`: fit the entry, write it into the profile
    and make that first stage the model's default."""

    start = time.perf_counter()
    bb = Backbone.of(args.model, device=args.device)
    out = Path(args.out) if args.out else heads_profile_path(bb)
    profile = json.loads(out.read_text()) if out.exists() else {}
    sets = {Path(str(d).split(":")[0]).name + (":" + str(d).split(":")[1] if ":" in str(d) else ""):
            corpus_questions(d, args.limit) for d in args.data}
    # --cpu: the entry a CPU backbone reads (at the CPU's depth), without the second read, a fifth of a CPU question
    stages = tuple(s for s in FIRST_STAGE_SCORES if s != "hop2") if args.cpu else FIRST_STAGE_SCORES
    entry = fit_first_stage(bb, sets, args.first_stage, heads=profile.get("heads"), stages=stages)
    entry["fit"]["wall_s"] = round(time.perf_counter() - start, 1)
    section = profile.setdefault("pipeline", {})
    if args.cpu:
        section.setdefault("first_stages", {}).setdefault(args.first_stage, {})["cpu"] = entry
    else:
        section.setdefault("first_stages", {})[args.first_stage] = entry | (
            {"cpu": section["first_stages"][args.first_stage]["cpu"]}
            if "cpu" in section.get("first_stages", {}).get(args.first_stage, {}) else {})
        section["first_stage"] = args.first_stage
    write_json(profile, out)
    print(json.dumps({k: v for k, v in entry.items() if k != "fit"} | {"recall": entry["fit"]["recall"]}))
    return profile
