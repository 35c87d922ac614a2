"""The signals an adaptive fusion is fitted on: for each labelled question over a corpus, every score each stage gives
its candidates, written once (`collect`) so that rules are fitted and compared without the model (`fusion_rule`).

Per question, four candidate lists, each with the gold documents beside it:
  * "pipe": the `endo` pipeline's stage-1 candidates (hybrid, `share`, `depth`), with BM25's score, the cosine, the
    heads' and the second read's ("hop2");
  * "cpu": the first `cpu_depth` of them read again as a CPU reads them (no second read): the heads' score;
  * "minilm", "bm25": a dense vector store's and BM25's `rerank` best documents, read whole by the reranker's read
    (`passage_heads_scores`), with the first stage's score beside the heads'.
Records are JSON lines (gzip), one a question.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np

from endo_retrieval.calibration.datasets import corpus_questions
from endo_retrieval.calibration.heads import steps
from endo_retrieval.integrations import passage_heads_scores
from endo_retrieval.model.backbone import Backbone
from endo_retrieval.methods.pipeline import EndoPipeline
from endo_retrieval.methods.search import Document, EndoIndex
from endo_retrieval.scoring.bm25 import words

PIPE_SIGNALS = ("bm25", "dense", "heads", "hop2")
# the reads the signals come from: stage 1's dense share and depth (a GPU's; a CPU reads the first CPU_DEPTH), the
# first stage's documents a reranker reads
SHARE, DEPTH, CPU_DEPTH, RERANK = 0.5, 20, 12, 20


def _doc_best(scores: np.ndarray, doc_of: np.ndarray, n_docs: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(the n best documents by their best passage's score, best first; those scores)."""
    best = np.full(n_docs, -np.inf)
    np.maximum.at(best, doc_of, scores)
    top = np.lexsort((np.arange(n_docs), -best))[:n]
    return top, best[top]


def corpus_index(bb, titles: list[str], texts: list[str]) -> EndoIndex:
    """The hybrid index of a labelled set's corpus, one document a title."""
    index = EndoIndex(bb, method="endo", first_stage="hybrid")
    index.add_documents([Document(t, p) for t, p in zip(titles, texts)])
    return index


def collect(bb, index: EndoIndex, questions: list[dict], out: Path, share: float = SHARE, depth: int = DEPTH,
            cpu_depth: int = CPU_DEPTH, rerank: int = RERANK, progress=None) -> Path:
    """Write one record a question (module docstring) to `out` (.jsonl.gz)."""
    corpus, passages = index.corpus, index.passages()
    doc_ids = [d.doc_id for d in corpus.documents()]
    doc_of = corpus.locate(passages.starts)[0]
    text_of = {d.doc_id: d.text for d in corpus.documents()}
    weights = dict.fromkeys(PIPE_SIGNALS, 1.0)
    pipe = EndoPipeline(bb, first_stage="hybrid", dense_share=share, depth=depth, read_tokens=128, best_last=True,
                        weights=weights)
    cpu = EndoPipeline(bb, first_stage="hybrid", dense_share=share, depth=cpu_depth, read_tokens=128,
                       best_last=True, weights=dict.fromkeys(("bm25", "dense", "heads"), 1.0))
    tmp = Path(out).with_suffix(".part")
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        for q in steps(questions, f"signals of {Path(out).name}", progress):
            question = q["question"]
            top, signals, _ = pipe.stage_scores(corpus, passages, question)
            record = {"id": q.get("_id"), "gold": sorted({t for t, _ in q["supporting_facts"]}),
                      "pipe": {"docs": [doc_ids[doc_of[i]] for i in top]}
                      | {s: np.round(v, 6).tolist() for s, v in signals.items()}}
            _, cpu_signals, _ = cpu.stage_scores(corpus, passages, question)
            record["cpu"] = {"heads": np.round(cpu_signals["heads"], 6).tolist()}
            query = words(question)
            bm25 = passages.bm25.get_scores(query) if query else np.zeros(len(passages))
            dense = np.asarray(passages.vectors @ passages.dense.query(question), np.float64)
            for name, scores in (("minilm", dense), ("bm25", bm25)):
                docs, first = _doc_best(scores, doc_of, len(doc_ids), rerank)
                ids = [doc_ids[d] for d in docs]
                heads = passage_heads_scores([text_of[i] for i in ids], question, bb, progress=False)
                record[name] = {"docs": ids, "first": np.round(first, 6).tolist(),
                                "heads": np.round(heads, 6).tolist()}
            f.write(json.dumps(record) + "\n")
    tmp.replace(out)
    return Path(out)


def load(path: Path) -> list[dict]:
    """The records `collect` wrote, as lists of numpy arrays."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    for r in rows:
        for part in ("pipe", "cpu", "minilm", "bm25"):
            for k, v in r.get(part, {}).items():
                if k != "docs":
                    r[part][k] = np.asarray(v, np.float64)
    return rows


def collect_specs(bb, specs: list[str], folder: Path, share: float = SHARE) -> list[Path]:
    """One signals file a labelled set `SPEC[@LIMIT]` (`corpus_questions`' specs: a HotpotQA file, or a BEIR-layout
    PATH:SPLIT), its first LIMIT questions where given, written under `folder`; the index of a corpus is built once
    for all its splits."""
    folder.mkdir(parents=True, exist_ok=True)
    built, written = {}, []
    for given in specs:
        spec, _, limit = given.partition("@")
        path, _, split = spec.partition(":")
        name = Path(path).name.split(".")[0] + (f"_{split}" if split else "")
        titles, texts, questions = corpus_questions(spec, int(limit) if limit else None)
        if path not in built:
            built[path] = corpus_index(bb, titles, texts)
        written.append(collect(bb, built[path], questions, folder / f"{name}.jsonl.gz", share=share))
    return written


def main(argv=None) -> None:
    """python -m endo_retrieval.calibration.signals OUT_DIR SPEC[@LIMIT]... [--model M] [--share S]"""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("specs", nargs="+")
    p.add_argument("--model", default=None)
    p.add_argument("--share", type=float, default=SHARE)
    args = p.parse_args(argv)
    for path in collect_specs(Backbone.of(args.model), args.specs, Path(args.out), args.share):
        print(f"wrote {path.name}", flush=True)


if __name__ == "__main__":
    main()
