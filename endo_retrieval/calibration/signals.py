"""The signals an adaptive fusion is fitted on: for each labelled question over a corpus, every score each stage gives
its candidates, written once (`collect`) so that rules are fitted and compared without the model (`fusion_rule`).

Per question, four candidate lists, each with the gold documents beside it:
  * "pipe": the `endo` pipeline's stage-1 candidates (hybrid, `share`, `depth`), with BM25's score, the cosine, the
    heads' and the second read's ("hop2");
  * "cpu": the first `cpu_depth` of them read again as a CPU reads them (no second read): the heads' score;
  * "minilm", "bm25": a dense vector store's and BM25's `rerank` best documents, read whole by the reranker's read
    (`passage_heads_scores`), with the first stage's score beside the heads';
  * "dense", "cpu_dense": as "pipe" and "cpu", the candidates the dense ranking alone finds (the pool a question
    whose words are not its passage's is given: `index.first_stage.PoolSwitch`);
  * "stage1": BM25's and the dense ranking's best STAGE1 passages over the whole corpus (indices, scores), what the
    pool switch reads.
Records are JSON lines (gzip), one a question; `parts` chooses which (another collection's parts join by question).
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np

from endo_retrieval.calibration.datasets import corpus_questions
from endo_retrieval.calibration.heads import steps
from endo_retrieval.methods.rerank import passage_heads_scores
from endo_retrieval.model.backbone import Backbone
from endo_retrieval.methods.pipeline import EndoPipeline
from endo_retrieval.methods.search import Document, EndoIndex
from endo_retrieval.scoring.bm25 import words

PIPE_SIGNALS = ("bm25", "dense", "heads", "hop2")
PARTS = ("pipe", "cpu", "minilm", "bm25", "dense", "cpu_dense", "stage1")
# the reads the signals come from: stage 1's dense share and depth (a GPU's; a CPU reads the first CPU_DEPTH), the
# first stage's documents a reranker reads
SHARE, DEPTH, CPU_DEPTH, RERANK, STAGE1 = 0.5, 20, 12, 20, 30


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
            cpu_depth: int = CPU_DEPTH, rerank: int = RERANK, progress=None, parts: tuple[str, ...] = PARTS) -> Path:
    """Write one record a question (module docstring) to `out` (.jsonl.gz), with the `parts` named."""
    corpus, passages = index.corpus, index.passages()
    doc_ids = [d.doc_id for d in corpus.documents()]
    doc_of = corpus.locate(passages.starts)[0]
    text_of = {d.doc_id: d.text for d in corpus.documents()}
    weights = dict.fromkeys(PIPE_SIGNALS, 1.0)
    reads = {}  # part -> (pipeline, the part its CPU read goes to)
    for part, stage, cpu_part in (("pipe", "hybrid", "cpu"), ("dense", "dense", "cpu_dense")):
        if part in parts or cpu_part in parts:
            gpu = EndoPipeline(bb, first_stage=stage, dense_share=share, depth=depth, read_tokens=128,
                               best_last=True, weights=weights, pools=(stage,))
            cpu = EndoPipeline(bb, first_stage=stage, dense_share=share, depth=cpu_depth, read_tokens=128,
                               best_last=True, weights=dict.fromkeys(("bm25", "dense", "heads"), 1.0), pools=(stage,))
            reads[part] = (gpu, cpu_part, cpu)
    tmp = Path(out).with_suffix(".part")
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        for q in steps(questions, f"signals of {Path(out).name}", progress):
            question = q["question"]
            record = {"id": q.get("_id"), "gold": sorted({t for t, _ in q["supporting_facts"]})}
            for part, (gpu, cpu_part, cpu) in reads.items():
                if part in parts:
                    top, signals, _ = gpu.stage_scores(corpus, passages, question)
                    record[part] = {"docs": [doc_ids[doc_of[i]] for i in top]} | {
                        s: np.round(v, 6).tolist() for s, v in signals.items()}
                if cpu_part in parts:
                    top, cpu_signals, _ = cpu.stage_scores(corpus, passages, question)
                    record[cpu_part] = {"heads": np.round(cpu_signals["heads"], 6).tolist()}
                    if part not in parts:
                        record[cpu_part] |= {"docs": [doc_ids[doc_of[i]] for i in top]} | {
                            s: np.round(v, 6).tolist() for s, v in cpu_signals.items() if s != "heads"}
            query = words(question)
            bm25 = passages.bm25.get_scores(query) if query else np.zeros(len(passages))
            dense = np.asarray(passages.vectors @ passages.dense.query(question), np.float64)
            if "stage1" in parts:
                record["stage1"] = {}
                for name, scores in (("bm25", bm25), ("dense", dense)):
                    best = np.lexsort((np.arange(len(scores)), -scores))[:STAGE1]
                    record["stage1"][name] = best.tolist()
                    record["stage1"][f"{name}_scores"] = np.round(scores[best], 6).tolist()
            for name, scores in (("minilm", dense), ("bm25", bm25)):
                if name not in parts:
                    continue
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
        for part in PARTS:
            for k, v in r.get(part, {}).items():
                if k != "docs" and not (part == "stage1" and k in ("bm25", "dense")):  # names and indices stay
                    r[part][k] = np.asarray(v, np.float64)
    return rows


def collect_specs(bb, specs: list[str], folder: Path, share: float = SHARE, parts: tuple[str, ...] = PARTS
                  ) -> list[Path]:
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
        written.append(collect(bb, built[path], questions, folder / f"{name}.jsonl.gz", share=share,
                               parts=parts))
    return written


def main(argv=None) -> None:
    """python -m endo_retrieval.calibration.signals OUT_DIR SPEC[@LIMIT]... [--model M] [--share S]"""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("specs", nargs="+")
    p.add_argument("--model", default=None)
    p.add_argument("--share", type=float, default=SHARE)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    args = p.parse_args(argv)
    parts = tuple(x.strip() for x in args.parts.split(",") if x.strip())
    if set(parts) - set(PARTS):
        p.error(f"unknown part(s) {sorted(set(parts) - set(PARTS))}; known: {', '.join(PARTS)}")
    for path in collect_specs(Backbone.of(args.model), args.specs, Path(args.out), args.share, parts):
        print(f"wrote {path.name}", flush=True)


if __name__ == "__main__":
    main()
