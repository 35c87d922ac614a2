"""`endo bench scale`: an `endo` index (BM25 over passages and the dense stage) at 10k, 100k and 1M passages, and
what it costs: build time, index bytes per passage on disk, RAM when opened, stage 1 and whole-question p50.

Sizes up to --real-max are built for real: HotpotQA paragraphs and SciFact abstracts (../shared/data) tokenised
by the model and embedded by all-MiniLM-L6-v2, as `endo index` builds. Larger sizes fill the same structures (the
corpus map, its passages' BM25, the dense vectors and their cells) from SYNTHETIC data, as embedding a million
passages takes hours on a CPU: each passage is one document of sentences of words drawn at random from WikiText-2
(its word frequencies; words shuffled between passages, so no passage has a topic), its tokens are those words
and full stops (not the model's tokenizer), and its embedding a random unit vector of MiniLM's 384 dimensions.
The timings over synthetic passages are real timings of the real code; what they cannot show is retrieval quality
(random vectors have no neighbours, so the cells' recall is measured on the real size only).

Each index is opened in a fresh process, which measures RAM (resident anonymous memory before and after opening:
the index's own; the memory-mapped embeddings are file pages and counted apart), opening time (reading it and
building BM25 over its passages; of it, the dense stage's checks apart: dense.json's fields and the SHA-256 of its
array files), stage 1 over --questions questions (BM25, the dense product or cells, the
fusion, the top depth; the question's MiniLM forward timed apart), --whole whole questions (`EndoIndex.search`,
the model's read included) and an update (UPDATE_DOCS documents removed and the passages brought up to date, then
saved as the next generation: `saved s`, the base files linked; beside building the passages anew). The corpus map
and the passages are memory-mapped: their pages are file pages (RssFile, reported apart), not the index's own memory,
so "RAM besides text" is the anonymous memory less any text held there. Writes scale.json and scale.md into --out.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from endo_retrieval.cli.commands import int_list, model_argument

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
SENTENCE_WORDS = (8, 24)  # a synthetic sentence's words
UPDATE_DOCS = 100  # documents removed to time an update
PASSAGE_WORDS = 110  # a synthetic passage's words (~118 tokens with its full stops; the real passages average ~130)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=int_list, default=[10_000, 100_000, 1_000_000], help="passages, e.g. 10000,100000")
    p.add_argument("--real-max", type=int, default=10_000,
                   help="sizes up to this are built from real text, tokenised and embedded; larger ones synthetic")
    p.add_argument("--data", default=str(SHARED), help="the shared data folder (hotpotqa/, scifact/, wikitext2/)")
    p.add_argument("--questions", type=int, default=50, help="questions timed through stage 1")
    p.add_argument("--whole", type=int, default=5, help="questions timed whole (the model's read included)")
    p.add_argument("--ann-min", type=int, default=None,
                   help="passages from which the saved index holds cells (default index.dense.ANN_MIN)")
    p.add_argument("--work", default=None, help="folder for the indexes (default a temporary one, deleted)")
    p.add_argument("--keep", action="store_true",
                   help="keep each size's index in --work as WORK/nSIZE/index (after the measured update)")
    p.add_argument("--reopen", default=None, metavar="DIR",
                   help="build nothing: measure the index `--keep` left in DIR again (a quieter moment), without "
                        "rebuilding BM25; writes reopen.json into --out")
    p.add_argument("--out", default="bench/results/scale", help="folder for scale.json and scale.md")
    model_argument(p)


# ------------------------------------------------------------------------------------------------ the corpora
def real_documents(data: Path) -> tuple[list, list[str]]:
    """(documents, questions): HotpotQA paragraphs (dev300, fit300, dev30; one per title) then SciFact abstracts."""
    from endo_retrieval.calibration.datasets import corpus_questions
    from endo_retrieval.index.engine import Document

    docs, seen, questions = [], set(), []
    for spec in ("hotpotqa/dev300.json", "hotpotqa/fit300.json", "hotpotqa/dev30.json", "scifact/scifact.json.gz"):
        titles, texts, asked = corpus_questions(data / spec)
        for title, text in zip(titles, texts):
            if title not in seen:
                seen.add(title)
                docs.append(Document(f"d{len(docs)}", text))
        questions += [q["question"] for q in asked]
    return docs, questions


def build_real(folder: Path, size: int, data: Path, backbone) -> dict:
    """The first real documents holding about `size` passages (a document of t tokens holds about t / 256), built
    as `endo index` builds: tokenised, cut, embedded, saved."""
    from endo_retrieval.methods.search import EndoIndex

    docs, questions = real_documents(data)
    tokens = [len(ids) for ids in backbone.tokenizer([d.text for d in docs], add_special_tokens=False)["input_ids"]]
    take = int(np.searchsorted(np.cumsum(np.ceil(np.asarray(tokens) / 256)), size)) + 1
    if take > len(docs):
        raise SystemExit(f"the real text holds about {int(np.ceil(np.asarray(tokens) / 256).sum())} passages, "
                         f"fewer than {size}; lower --real-max")
    t = time.perf_counter()
    index = EndoIndex(backbone, "endo", first_stage="hybrid")
    index.add_documents(docs[:take], progress=False)
    index.save(folder)
    return {"build_s": time.perf_counter() - t, "questions": questions, "text": "real"}


def wikitext_words(data: Path) -> np.ndarray:
    words = []
    for name in ("test.txt", "valid.txt"):
        for line in (data / "wikitext2" / name).read_text(encoding="utf-8").splitlines():
            if line.strip() and not line.strip().startswith("="):
                words += [w for w in line.split() if re.fullmatch(r"[A-Za-z0-9][\w'-]*", w)]
    return np.asarray(words, dtype=object)


def build_synthetic(folder: Path, size: int, data: Path, backbone, seed: int = 0) -> dict:
    """`size` one-passage documents of WikiText-2 words drawn at random, their tokens the words and full stops,
    their embeddings random unit vectors: the real corpus map, BM25 and dense structures, saved as `endo index`
    saves them."""
    from endo_retrieval.index.dense import DenseVectors
    from endo_retrieval.index.dense_rows import RowMap
    from endo_retrieval.methods.search import EndoIndex

    rng = np.random.default_rng(seed)
    pool = wikitext_words(data)
    t = time.perf_counter()
    index = EndoIndex(backbone, "endo", first_stage="bm25")
    for i in range(size):
        words = pool[rng.integers(0, len(pool), PASSAGE_WORDS)].tolist()
        cuts = np.cumsum(rng.integers(*SENTENCE_WORDS, PASSAGE_WORDS // SENTENCE_WORDS[0]))
        cuts = [0, *cuts[cuts < PASSAGE_WORDS].tolist(), PASSAGE_WORDS]
        tokens, firsts = [], []
        for a, b in zip(cuts[:-1], cuts[1:]):
            firsts.append(len(tokens))
            tokens += [words[a].capitalize(), *words[a + 1: b], "."]
        lengths = np.fromiter(map(len, tokens), np.int64, len(tokens))
        starts = np.concatenate(([0], np.cumsum(lengths[:-1] + 1)))
        offsets = np.stack([starts, starts + lengths], axis=1)
        index.corpus.add_document(f"s{i}", " ".join(tokens), offsets, sentence_chars=starts[firsts])
    folder.mkdir(parents=True, exist_ok=True)
    vectors = np.lib.format.open_memmap(folder / "vectors.tmp.npy", "w+", np.float32, (size, 384))
    for a in range(0, size, 65536):  # random unit vectors, a block at a time
        block = rng.standard_normal((min(65536, size - a), 384), dtype=np.float32)
        vectors[a: a + len(block)] = block / np.linalg.norm(block, axis=1, keepdims=True)
    index.dense = DenseVectors()
    index.dense.rows = RowMap.saved(vectors, [f"s{i}" for i in range(size)], np.ones(size, np.int64))
    index.save(folder / "index")
    del index, vectors
    (folder / "vectors.tmp.npy").unlink()
    return {"build_s": time.perf_counter() - t, "text": "synthetic"}


# ------------------------------------------------------------------------------------------- the measurement
def memory() -> dict[str, int]:
    """Resident anonymous memory (the process's own) and file pages (memory maps, libraries), bytes, after the
    freed heap went back to the system (else memory freed before opening, and reused by it, hides its cost)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the figure may then be low by what was freed before
        pass
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssFile")}


def parts(index, passages) -> dict[str, int]:
    """Bytes of the opened index's arrays, by part: what the RAM figures are made of (a memory-mapped part is file
    pages, counted in RssFile as far as it was read, not in the index's own memory)."""
    runs = index.corpus._runs
    column = lambda *names: sum(r.a[n].nbytes for r in runs for n in names)
    bm25 = passages.bm25
    out = {"text": column("text"), "corpus_offsets": column("offsets", "tok_at", "sentences", "sent_at"),
           "corpus_ids_meta": column("ids", "id_at", "meta", "meta_at", "id_hash", "id_order", "starts", "ends"),
           "bm25_postings": sum(a.nbytes for a in (bm25.indptr, bm25.docs, bm25.tf, bm25.norm, bm25.okapi.doc_len)),
           "passage_bounds": passages.starts.nbytes + passages.ends.nbytes + passages.sentences.nbytes}
    if index.dense is not None and index.dense.centroids is not None:
        out["dense_cells"] = np.asarray(index.dense.cells.data).nbytes
        if passages.cells:
            out["dense_cells"] += passages.cells.nbytes
    return out


def text_in_memory(index) -> int:
    """Bytes of document text the index holds in its own memory: none where the text column is mapped."""
    return sum(r.a["text"].nbytes for r in index.corpus._runs if not isinstance(r.a["text"], np.memmap))


def measure(folder: str, questions: list[str], whole: int, model: str | None, rebuild: bool = True) -> dict:
    """In a fresh process: open the index, then time its stage 1 and whole questions."""
    from endo_retrieval.model.backbone import Backbone
    from endo_retrieval.index.dense import load_embedder
    from endo_retrieval.methods.search import EndoIndex

    backbone = Backbone.default() if model is None else Backbone(model)
    load_embedder()
    load_before = os.getloadavg()
    before = memory()
    t = time.perf_counter()
    index = EndoIndex.load(folder, backbone=backbone)
    passages = index.passages()
    opened_s = time.perf_counter() - t
    # the integrity checks inside opened_s: the dense files' and the passages' (checksums, array checks)
    check_ms = 1000 * ((index.dense.check_s if index.dense is not None else 0.0)
                       + getattr(index.passages(), "check_s", 0.0))
    pipe = index.pipeline("endo", first_stage="hybrid")
    n = len(passages)
    vectors = {q: passages.dense.query(q) for q in questions}  # the question's forward, timed apart below
    embed_ms = []
    for q in questions[:10]:
        t = time.perf_counter()
        passages.dense.query(q)
        embed_ms.append(1000 * (time.perf_counter() - t))
    query, passages.dense.query = passages.dense.query, vectors.__getitem__
    pipe.candidates(index.corpus, passages, questions[0])  # the cells' lists are built at the first question
    after = memory()
    first_ms, first_cpu = [], []
    for q in questions:
        t, c = time.perf_counter(), time.thread_time()
        pipe.candidates(index.corpus, passages, q)
        first_ms.append(1000 * (time.perf_counter() - t))
        first_cpu.append(1000 * (time.thread_time() - c))
    passages.dense.query = query
    whole_ms = []
    for q in questions[:whole]:
        t = time.perf_counter()
        index.search(q, k=5, first_stage="hybrid")
        whole_ms.append(1000 * (time.perf_counter() - t))
    sizes = parts(index, passages)
    # an update: UPDATE_DOCS documents removed, then the passages brought up to date (BM25 merged, the vectors
    # gathered again), beside cutting them and building BM25 anew (what opening or saving did before)
    from endo_retrieval.index.passages import Passages

    step = max(10, len(index.corpus) // UPDATE_DOCS)  # a tenth of the documents at most
    gone = index.corpus.doc_ids()[::step][:UPDATE_DOCS]
    t = time.perf_counter()
    for doc_id in gone:
        index.remove_document(doc_id)
    index.passages()
    update_s = time.perf_counter() - t
    t = time.perf_counter()
    index.save(folder)  # the update made durable: a new generation, swapped in
    update_save_s = time.perf_counter() - t
    t = time.perf_counter()
    if rebuild:
        Passages.build(index.corpus)
    rebuild_s = time.perf_counter() - t if rebuild else None
    own = after["RssAnon"] - before["RssAnon"] - sys.getsizeof(vectors) - sum(v.nbytes + 112 for v in vectors.values())
    text = text_in_memory(index)
    return {"passages": n, "documents": len(index.corpus), "opened_s": opened_s, "open_check_ms": check_ms,
            "ram_bytes": own,
            "ram_file_bytes": after["RssFile"] - before["RssFile"], "parts": sizes,
            "ram_besides_text_per_passage": (own - text) / n, "text_mapped": text == 0,
            "cells": bool(passages.cells), "depth": pipe.depth,
            "stage1_ms_p50": float(np.median(first_ms)), "stage1_ms_p95": float(np.percentile(first_ms, 95)),
            "stage1_cpu_ms_p50": float(np.median(first_cpu)), "embed_question_ms_p50": float(np.median(embed_ms)),
            "whole_ms_p50": float(np.median(whole_ms)) if whole_ms else None, "whole_n": len(whole_ms),
            "stage1_n": len(first_ms), "update_docs": len(gone), "update_s": update_s, "update_save_s": update_save_s,
            "rebuild_s": rebuild_s, "load_average_before": load_before, "load_average": os.getloadavg()}


def folder_bytes(folder: Path) -> dict[str, int]:
    files = [p for p in folder.rglob("*") if p.is_file()]
    return {"total": sum(p.stat().st_size for p in files),
            "embeddings": sum(p.stat().st_size for p in files if p.name == "dense.npy")}


# ----------------------------------------------------------------------------------------------------- the run
def run(args) -> int:
    from endo_retrieval.index import dense
    from endo_retrieval.model.backbone import Backbone

    if args.ann_min is not None:
        dense.ANN_MIN = args.ann_min
    data, out = Path(args.data), Path(args.out)
    backbone = Backbone.default() if args.model is None else Backbone(args.model)
    _, real_questions = real_documents(data)
    rng = np.random.default_rng(0)
    questions = [real_questions[i] for i in rng.choice(len(real_questions), args.questions, replace=False)]
    if args.reopen:
        child = subprocess.run([sys.executable, "-m", "endo_bench.scale", json.dumps(
            [args.reopen, questions, args.whole, args.model, False])], capture_output=True, text=True,
            env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)})
        if child.returncode:
            sys.stderr.write(child.stderr)
            return 1
        got = json.loads(child.stdout.strip().splitlines()[-1])
        out.mkdir(parents=True, exist_ok=True)
        (out / "reopen.json").write_text(json.dumps({"bench": "scale --reopen", "cpus": os.cpu_count(),
                                                     "model": backbone.model_id, "row": got}, indent=1))
        print(json.dumps(got))
        return 0
    rows = []
    if args.keep and not args.work:
        raise SystemExit("--keep keeps the indexes in --work: name that folder")
    with tempfile.TemporaryDirectory(dir=args.work) as temp:
        work = args.work if args.keep else temp
        for size in args.sizes:
            folder = Path(work) / f"n{size}"
            if size <= args.real_max:
                built = build_real(folder / "index", size, data, backbone)
            else:
                built = build_synthetic(folder, size, data, backbone)
            on_disk = folder_bytes(folder / "index")
            child = subprocess.run([sys.executable, "-m", "endo_bench.scale", json.dumps(
                [str(folder / "index"), questions, args.whole, args.model])], capture_output=True, text=True,
                env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)})
            if child.returncode:
                sys.stderr.write(child.stderr)
                return 1
            got = json.loads(child.stdout.strip().splitlines()[-1])
            rows.append({"size": size, "text": built["text"], "build_s": built["build_s"],
                         "disk_bytes_per_passage": on_disk["total"] / got["passages"],
                         "disk_embedding_bytes_per_passage": on_disk["embeddings"] / got["passages"], **got})
            print(table_line(rows[-1]), flush=True)
            if not args.keep:
                subprocess.run(["rm", "-rf", str(folder)], check=False)  # the next size's room on disk
            write(out, backbone, questions, rows)  # after every size: a long run keeps what it measured
    print(markdown(json.loads((out / "scale.json").read_text())))
    return 0


def write(out: Path, backbone, questions: list[str], rows: list[dict]) -> None:
    from endo_retrieval.index import dense

    out.mkdir(parents=True, exist_ok=True)
    result = {"bench": "scale", "device": "cpu", "cpus": os.cpu_count(), "load_average": os.getloadavg(),
              "model": backbone.model_id, "questions": len(questions), "ann_min": dense.ANN_MIN,
              "probe": dense.PROBE, "rows": rows}
    (out / "scale.json").write_text(json.dumps(result, indent=1))
    (out / "scale.md").write_text(markdown(result))


HEADER = ("| passages | text | build s | disk B/passage (embedding) | open s (checks ms) | "
          "RAM B/passage besides text | stage 1 p50 ms (CPU ms) | question embedding ms | whole question p50 ms | "
          f"dense | update s ({UPDATE_DOCS} removed) | saved s | BM25 rebuilt s |")


def table_line(r: dict) -> str:
    whole = f"{r['whole_ms_p50']:,.0f}" if r["whole_ms_p50"] is not None else "-"
    checks = f" ({r['open_check_ms']:,.0f})" if "open_check_ms" in r else ""  # rows measured before: none
    saved = f"{r['update_save_s']:.2f}" if "update_save_s" in r else "-"
    return (f"| {r['passages']:,} | {r['text']} | {r['build_s']:,.0f} | {r['disk_bytes_per_passage']:,.0f} "
            f"({r['disk_embedding_bytes_per_passage']:,.0f}) | {r['opened_s']:,.1f}{checks} | "
            f"{r['ram_besides_text_per_passage']:,.0f} | {r['stage1_ms_p50']:.1f} ({r['stage1_cpu_ms_p50']:.1f}) | "
            f"{r['embed_question_ms_p50']:.1f} | {whole} | {'cells' if r['cells'] else 'exact'} | "
            f"{r.get('update_s', float('nan')):.2f} | {saved} | {r.get('rebuild_s') or float('nan'):.1f} |")


def markdown(result: dict) -> str:
    lines = [f"`endo bench scale` on {result['cpus']} CPU cores (load average at the end "
             f"{result['load_average'][0]:.1f}), {result['questions']} questions through stage 1; model "
             f"{result['model']}; cells from {result['ann_min']:,} passages, {result['probe']} probed.", "",
             HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    lines += [table_line(r) for r in result["rows"]]
    lines += ["", "Bytes per passage by part (the corpus map and the passages are memory-mapped: file pages, read as "
              "needed, not the index's own memory), beside the index's own memory measured:", "",
              "| passages | " + " | ".join(result["rows"][0]["parts"]) + " | measured, besides text |",
              "|---|" + "---|" * (len(result["rows"][0]["parts"]) + 1)]
    for r in (r for r in result["rows"] if r.get("parts")):  # a row joined from a table line has none
        lines.append(f"| {r['passages']:,} | " + " | ".join(f"{r['parts'].get(k, 0) / r['passages']:,.0f}"
                                                             for k in result["rows"][0]["parts"])
                     + f" | {r['ram_besides_text_per_passage']:,.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # the measuring child: argv[1] is [folder, questions, whole, model]
    print(json.dumps(measure(*json.loads(sys.argv[1]))))
