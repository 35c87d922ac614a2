"""`endo bench ann`: the recall of the dense stage's cells (index/dense_cells.py) against the exact product, on real
embeddings and on a synthetic million made from them.

Real: every document of the corpora in ../shared/data (HotpotQA dev300, fit300 and dev30 paragraphs, one per title;
SciFact's abstracts; the five domain sets' corpora) indexed as `endo index` indexes them (the model's tokenizer and
sentences, `Passages.build` over the corpus map: runs of whole sentences of at most PASSAGE_TOKENS), each passage
embedded by the index's own code (`dense.embed`, all-MiniLM-L6-v2 by default) and timed. The questions are the
evaluation splits' (HotpotQA dev300 and dev30, SciFact test, each domain set's test), embedded the same way.
On a slow machine --embed-budget embeds passages in random order until the time is spent and measures those (a
random sample); --limit and --questions take random samples for a quick run. --texts and --vectors keep the cut
texts and the embeddings in files, so another run (another probe list, another synthetic size) reads them back.

Each question's exact top-K is the matrix product's; the cells' top-K is what the index's search scores
(`Cells.scores`: the exact cosines of the passages in the question's `probe` nearest cells, -inf elsewhere), the
passages left at -inf not counted as found. The cells are trained as a saved index trains them
(`spherical_kmeans(matrix, int(sqrt(n)))`, then every passage's `nearest_cells`), at the cell count of the index
at this size and at the million-passage index's (int(sqrt(1e6)) = 1,000 cells; none above the passages' count),
each probed at PROBE and at the other counts of --probes. recall@K is the share of a question's exact top-K the
cells find, a passage scoring the same as the K-th (a tie, e.g. a duplicated passage) counting as any of them.

Synthetic million (--synthetic N): the real passage vectors repeated to N rows, each copy moved by Gaussian noise
of standard deviation --noise per dimension and renormalised, so every real neighbourhood becomes a cloud of
copies the cells must keep together. The default noise makes two copies of one passage as far apart as a real
passage is from its nearest other passage (the median over a sample: `noise = sqrt((1 / c - 1) / dim)` puts the
expected cosine of two copies at c), so a copy is no nearer duplicate than real neighbours are. The questions are a
sample (--synthetic-queries) of the real ones, unperturbed.

Reported per setting: recall@K (mean over questions, with a 95% bootstrap interval), the share of passages scored,
the build (k-means on the sample, then every passage's cell, then the inverted file) and the p50 of one question's
scoring and top-K selection, exact and cells, over --timed questions, with one BLAS thread. Writes --out (JSON)
and a Markdown table beside it.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from endo_retrieval.cli.commands import int_list, model_argument

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
HOTPOTQA = ("dev300", "fit300", "dev30")  # documents from all three; questions from the two that are not for fitting
HOTPOTQA_QUESTIONS = ("dev300", "dev30")
K = 20
CHUNK = 512  # passages per `embed` call: what an --embed-budget stops between
MILLION_CELLS = int(np.sqrt(1_000_000))  # the cell count a saved index of a million passages trains
OUT = "bench/results/scale/ann_recall.json"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from endo_retrieval.index.dense import DEFAULT_EMBEDDER

    p.add_argument("--data", default=str(SHARED), help="the shared data folder (hotpotqa/, scifact/, domains/)")
    p.add_argument("--limit", type=int, default=None,
                   help="passages: a random sample of this many of the real ones (default all), for a quick run")
    p.add_argument("--embedder", default=DEFAULT_EMBEDDER, help="the sentence-transformers model (default %(default)s)")
    p.add_argument("--device", default="cpu", help="where the embedder runs: cpu or cuda (default %(default)s)")
    p.add_argument("--questions", type=int, default=None,
                   help="questions: a random sample of this many (default all), for a quick run")
    p.add_argument("--embed-budget", type=float, default=None, metavar="SECONDS",
                   help="stop embedding passages after this long (CHUNK at a time, in random order) and measure "
                        "those embedded: the largest sample a slow machine embeds in that time (default: no limit)")
    p.add_argument("--k", type=int, default=K, help="recall@k (default %(default)s)")
    p.add_argument("--probes", type=int_list, default=[16, 32, 64, 128, 256],
                   help="cells probed per question, besides the index's PROBE (default %(default)s)")
    p.add_argument("--timed", type=int, default=200, help="questions timed one at a time (default %(default)s)")
    p.add_argument("--synthetic", type=int, default=1_000_000,
                   help="rows of the synthetic set made from the real vectors (0: none; default %(default)s)")
    p.add_argument("--synthetic-queries", type=int, default=200,
                   help="questions of the synthetic set's recall (default %(default)s)")
    p.add_argument("--noise", type=float, default=None,
                   help="the synthetic copies' noise per dimension (default: two copies of a passage as close as a "
                        "real passage is to its nearest other, median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--texts", default=None, metavar="FILE.json.gz",
                   help="the passages' and questions' texts: read from FILE where it exists (no tokenizer needed, "
                        "e.g. on a GPU machine), else cut and written there")
    p.add_argument("--vectors", default=None, metavar="FILE.npz",
                   help="the embeddings: read from FILE where it exists (the record keeps the speed measured when "
                        "it was written), else embedded and written there")
    p.add_argument("--out", default=OUT,
                   help="the JSON record; its Markdown table goes beside it (default %(default)s)")
    model_argument(p)


# ------------------------------------------------------------------------------------------------ the corpora
def real_texts(data: Path, model: str | None) -> dict:
    """Every passage of the shared corpora, cut as the index cuts them, and the evaluation questions:
    {"passages": [text], "source": [set of each passage], "queries": [text], "query_source": [...], "sets": {...}}."""
    from endo_retrieval.calibration.datasets import corpus_questions
    from endo_retrieval.index.engine import Document
    from endo_retrieval.index.passages import Passages
    from endo_retrieval.methods.search import EndoIndex
    from endo_retrieval.model.backbone import Backbone

    docs, sets, seen, queries, query_source = [], {}, set(), [], []
    specs = [(name, data / "hotpotqa" / f"{name}.json") for name in HOTPOTQA]
    specs += [("scifact", data / "scifact" / "scifact.json.gz")]
    specs += [(p.name.split(".")[0], p) for p in sorted((data / "domains").glob("*.json.gz"))]
    for name, path in specs:
        titles, texts, asked = corpus_questions(path)
        where = "hotpotqa" if name in HOTPOTQA else name  # a Wikipedia paragraph once over the three files
        counts = sets.setdefault(where, {"documents": 0, "passages": 0, "queries": 0})
        for title, text in zip(titles, texts):
            if (where, title) not in seen and text.strip():
                seen.add((where, title))
                docs.append(Document(f"d{len(docs)}", text, {"set": where}))
                counts["documents"] += 1
        if name in HOTPOTQA_QUESTIONS or name not in HOTPOTQA:
            queries += [q["question"] for q in asked]
            query_source += [where] * len(asked)
            counts["queries"] += len(asked)
    backbone = Backbone.default() if model is None else Backbone(model)
    clock = time.perf_counter()
    index = EndoIndex(backbone, "endo", first_stage="bm25")  # the corpus map alone: tokens and sentences
    index.add_documents(docs, progress=sys.stderr.isatty())
    passages = Passages.build(index.corpus)
    texts, source = [], []
    for a, b in zip(passages.starts.tolist(), passages.ends.tolist()):
        doc, _, _, text = index.corpus.span_text(a, b)
        texts.append(text)
        source.append(index.corpus.doc(doc).metadata["set"])
    for name in source:
        sets[name]["passages"] += 1
    return {"passages": texts, "source": source, "queries": queries, "query_source": query_source, "sets": sets,
            "tokenizer": backbone.model_id, "cut_s": time.perf_counter() - clock}


def load_texts(args) -> dict:
    path = Path(args.texts) if args.texts else None
    if path is not None and path.exists():
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return json.load(f)
    texts = real_texts(Path(args.data), args.model)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(path, "wt", encoding="utf-8") as f:
            json.dump(texts, f)
    return texts


def load_vectors(args, passages: list[str], queries: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
    """(the passages embedded: their numbers in `passages`, in order; their vectors; the questions' vectors; the
    embedding's measure) by the index's own `dense.embed`. The passages go in the seed's random order, CHUNK at a
    time, up to --limit and until --embed-budget seconds are spent: what is measured is a random sample."""
    from tqdm import tqdm

    from endo_retrieval.index.dense import BATCH, embed, load_embedder

    path = Path(args.vectors) if args.vectors else None
    if path is not None and path.exists():
        with np.load(path, allow_pickle=False) as saved:
            measure = json.loads(str(saved["measure"]))
            if (measure["of"], measure["queries"], measure["embedder"]) != (len(passages), len(queries), args.embedder):
                raise SystemExit(f"{path} holds passages of {measure['of']} and {measure['queries']} questions by "
                                 f"{measure['embedder']}, not of {len(passages)} and {len(queries)} by "
                                 f"{args.embedder}: pass another --vectors")
            return saved["ids"], saved["passages"], saved["queries"], {**measure, "read_from": str(path)}
    import torch

    load_embedder(args.embedder, args.device)  # loading is not embedding
    clock = time.perf_counter()
    asked = embed(args.embedder, queries, args.device)
    query_s = time.perf_counter() - clock
    order = np.random.default_rng(args.seed).permutation(len(passages))[: args.limit]
    done, parts, seconds = 0, [], 0.0
    bar = tqdm(total=len(order), desc="embedding passages", unit="passage", file=sys.stderr)
    while done < len(order) and (args.embed_budget is None or seconds < args.embed_budget):
        chunk = order[done: done + CHUNK]
        clock = time.perf_counter()
        parts.append(embed(args.embedder, [passages[i] for i in chunk], args.device))
        seconds += time.perf_counter() - clock
        done += len(chunk)
        bar.update(len(chunk))
    bar.close()
    ids = order[:done]
    vectors = np.concatenate(parts)[np.argsort(ids)]
    ids = np.sort(ids)
    measure = {"embedder": args.embedder, "device": args.device, "batch": BATCH, "of": len(passages),
               "passages": int(done), "seconds": seconds, "passages_per_s": done / seconds,
               "budget_s": args.embed_budget, "stopped_by_budget": bool(done < len(order)),
               "queries": len(queries), "queries_s": query_s, "queries_per_s": len(queries) / query_s,
               "torch_threads": torch.get_num_threads(), "load_average": os.getloadavg()}
    if args.device.startswith("cuda"):
        measure["gpu"] = torch.cuda.get_device_name()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            np.savez(f, ids=ids, passages=vectors, queries=asked, measure=np.array(json.dumps(measure)))
    return ids, vectors, asked, measure


# ------------------------------------------------------------------------------------------- the measures
def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k highest scores, best first; fewer where fewer than k are finite (the cells' -inf is not
    found)."""
    if len(scores) > k:
        ids = np.argpartition(-scores, k - 1)[:k]
    else:
        ids = np.arange(len(scores))
    ids = ids[np.isfinite(scores[ids])]
    return ids[np.argsort(-scores[ids], kind="stable")]


def exact_top(matrix: np.ndarray, queries: np.ndarray, k: int, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """(ids, scores), each questions x k, best first: the exact product's top-k, `block` questions at a time."""
    ids, scores = np.empty((len(queries), k), np.int64), np.empty((len(queries), k), np.float32)
    for a in range(0, len(queries), block):
        s = queries[a: a + block] @ matrix.T
        top = np.argpartition(-s, k - 1, axis=1)[:, :k]
        order = np.argsort(-np.take_along_axis(s, top, 1), axis=1, kind="stable")
        ids[a: a + block] = np.take_along_axis(top, order, 1)
        scores[a: a + block] = np.take_along_axis(s, ids[a: a + block], 1)
    return ids, scores


def recall(matrix: np.ndarray, queries: np.ndarray, found: list[np.ndarray], kth: np.ndarray, k: int,
           tol: float = 1e-5) -> np.ndarray:
    """Each question's recall@k: the share of its exact top-k among `found` (its ids, at most k), a found passage
    scoring at least the exact k-th score `kth` (less `tol`, float rounding) counting as one of them."""
    out = np.empty(len(queries))
    for i, (q, ids) in enumerate(zip(queries, found)):
        ids = np.asarray(ids, np.int64)[:k]
        exact = matrix[ids] @ q if len(ids) else np.zeros(0)
        out[i] = min(k, int((exact >= kth[i] - tol).sum())) / k
    return out


def train_cells(matrix: np.ndarray, cells: int) -> tuple[object, dict]:
    """The inverted file a saved index builds over `matrix` (`DenseVectors.train_cells`, then the search's `Cells`),
    with the seconds of each step."""
    from endo_retrieval.index.dense_cells import Cells, nearest_cells, spherical_kmeans

    clock = time.perf_counter()
    centroids = spherical_kmeans(matrix, cells)
    kmeans_s = time.perf_counter() - clock
    assigned = nearest_cells(matrix, centroids)
    assign_s = time.perf_counter() - clock - kmeans_s
    inverted = Cells(centroids, assigned)
    build_s = time.perf_counter() - clock
    sizes = np.diff(inverted.bounds)
    return inverted, {"kmeans_s": kmeans_s, "assign_s": assign_s, "build_s": build_s, "cell_size_max": int(sizes.max()),
                      "empty_cells": int((sizes == 0).sum())}


def cells_found(inverted, matrix: np.ndarray, queries: np.ndarray, k: int, probe: int) -> tuple[list, np.ndarray]:
    """Each question's top-k by the cells (as the index scores them) and the share of passages it scored."""
    found, scored = [], np.empty(len(queries))
    for i, q in enumerate(queries):
        s = inverted.scores(matrix, q, probe)
        found.append(top_k(s, k))
        near = np.argsort(-(inverted.centroids @ q))[:probe]
        scored[i] = (inverted.bounds[near + 1] - inverted.bounds[near]).sum() / len(matrix)
    return found, scored


def p50_ms(fn, queries: np.ndarray) -> tuple[float, float]:
    """(wall, CPU) p50 of `fn(q)` over the questions, in ms, with one BLAS thread (one question on one core: two
    threads on a loaded 2-core machine wait for each other's time slice, ~16 ms whatever the work)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # then the BLAS library's own thread count
        from contextlib import nullcontext as threadpool_limits
    wall, cpu = [], []
    with threadpool_limits(1):
        for q in queries:
            clock, own = time.perf_counter(), time.thread_time()
            fn(q)
            wall.append(time.perf_counter() - clock)
            cpu.append(time.thread_time() - own)
    return 1000 * float(np.median(wall)), 1000 * float(np.median(cpu))


def interval(values: np.ndarray, seed: int = 0, rounds: int = 1000) -> list[float]:
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), (rounds, len(values)))].mean(axis=1)
    return [float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))]


def measure_set(name: str, matrix: np.ndarray, queries: np.ndarray, k: int, settings: list[int], probes: list[int],
                timed: int, seed: int) -> list[dict]:
    """The rows of one set: for each cell count, each probe's recall@k and timing, beside the exact product's."""
    from endo_retrieval.index.dense import PROBE

    rng = np.random.default_rng(seed)
    clock = time.perf_counter()
    exact_ids, exact_scores = exact_top(matrix, queries, k)
    exact_all_s = time.perf_counter() - clock
    timing = queries[np.sort(rng.choice(len(queries), min(timed, len(queries)), replace=False))]
    exact_ms, exact_cpu_ms = p50_ms(lambda q: top_k(np.asarray(matrix @ q, np.float64), k), timing)  # dense_scores
    print(f"{name}: {len(matrix):,} passages, {len(queries):,} questions; exact top-{k} of all in {exact_all_s:.1f} s, "
          f"one question p50 {exact_ms:.2f} ms", flush=True)
    rows = []
    for cells in settings:
        inverted, built = train_cells(matrix, cells)
        for probe in sorted({*probes, PROBE}):
            if probe > cells:
                continue
            found, scored = cells_found(inverted, matrix, queries, k, probe)
            per_query = recall(matrix, queries, found, exact_scores[:, -1], k)
            cells_ms, cells_cpu_ms = p50_ms(lambda q: top_k(inverted.scores(matrix, q, probe), k), timing)
            rows.append({"set": name, "passages": len(matrix), "queries": len(queries), "cells": cells,
                         "probe": probe, "index_setting": probe == PROBE and cells == int(np.sqrt(len(matrix))),
                         "million_setting": probe == PROBE and cells == MILLION_CELLS,
                         f"recall_at_{k}": float(per_query.mean()), f"recall_at_{k}_ci95": interval(per_query, seed),
                         "queries_below_0_9": float((per_query < 0.9).mean()),
                         "scored_share": float(scored.mean()), **built, "exact_ms_p50": exact_ms,
                         "exact_cpu_ms_p50": exact_cpu_ms, "cells_ms_p50": cells_ms, "cells_cpu_ms_p50": cells_cpu_ms,
                         "timed": len(timing), "exact_all_s": exact_all_s, "load_average": os.getloadavg()})
            print(line(rows[-1], k), flush=True)
    return rows


def nn_cosine(matrix: np.ndarray, sample: int, seed: int) -> float:
    """The median cosine of a passage with its nearest other passage (a sample; copies of it, >= 0.9999, aside)."""
    rng = np.random.default_rng(seed)
    rows = rng.choice(len(matrix), min(sample, len(matrix)), replace=False)
    best = np.empty(len(rows))
    for a in range(0, len(rows), 256):
        s = matrix[rows[a: a + 256]] @ matrix.T
        s[s >= 0.9999] = -1  # itself, and exact duplicates
        best[a: a + 256] = s.max(axis=1)
    return float(np.median(best))


def synthetic(base: np.ndarray, size: int, noise: float, seed: int, block: int = 65536) -> np.ndarray:
    """`size` rows: row i a copy of base[i % len(base)] plus N(0, noise^2) per dimension, renormalised."""
    rng = np.random.default_rng(seed)
    out = np.empty((size, base.shape[1]), np.float32)
    for a in range(0, size, block):
        rows = base[np.arange(a, min(size, a + block)) % len(base)]
        rows = rows + noise * rng.standard_normal(rows.shape, dtype=np.float32)
        out[a: a + len(rows)] = rows / np.linalg.norm(rows, axis=1, keepdims=True)
    return out


# ------------------------------------------------------------------------------------------------ the run
def run(args) -> int:
    from endo_retrieval.index.dense import ANN_MIN, PROBE

    command = "endo bench ann " + shlex.join(sys.argv[3:] if sys.argv[1:3] == ["bench", "ann"] else sys.argv[1:])
    out = Path(args.out)
    load_start, started = os.getloadavg(), time.perf_counter()
    texts = load_texts(args)
    phases = {"texts_s": time.perf_counter() - started, "cut_s": texts.get("cut_s")}  # cut_s: when first cut
    passages, queries = texts["passages"], texts["queries"]
    if args.questions is not None and args.questions < len(queries):
        asks = np.sort(np.random.default_rng(args.seed).choice(len(queries), args.questions, replace=False))
        queries = [queries[i] for i in asks]
    print(f"{len(passages):,} passages, {len(queries):,} questions", flush=True)
    clock = time.perf_counter()
    ids, vectors, asked, embedding = load_vectors(args, passages, queries)
    phases["embedding_s"] = time.perf_counter() - clock
    print(f"embedded {embedding['passages']:,} passages at {embedding['passages_per_s']:.1f}/s on "
          f"{embedding['device']}", flush=True)
    measured = np.bincount(np.searchsorted(sorted(texts["sets"]), np.asarray(texts["source"])[ids]),
                           minlength=len(texts["sets"]))
    for name, count in zip(sorted(texts["sets"]), measured.tolist()):
        texts["sets"][name]["passages_measured"] = count
    n = len(vectors)
    result = {"schema": "endo-bench-ann/1", "command": command,
              "config": {"data": str(args.data), "limit": args.limit, "questions": args.questions,
                         "embed_budget": args.embed_budget,
                         "embedder": args.embedder,
                         "device": args.device, "k": args.k, "probes": args.probes, "timed": args.timed,
                         "synthetic": args.synthetic, "synthetic_queries": args.synthetic_queries,
                         "noise": args.noise, "seed": args.seed, "ann_min": ANN_MIN, "probe": PROBE},
              "machine": {"cpus": os.cpu_count(), "load_average_start": load_start}, "phases": phases,
              "sets": texts["sets"], "passages_total": len(texts["passages"]),
              "tokenizer": texts.get("tokenizer"), "embedding": embedding, "rows": []}
    settings = sorted(c for c in {int(np.sqrt(n)), MILLION_CELLS} if c <= n)  # no more cells than passages
    clock = time.perf_counter()
    result["rows"] += measure_set("real", vectors, asked, args.k, settings, args.probes, args.timed, args.seed)
    phases["real_s"] = time.perf_counter() - clock
    write(out, result)
    if args.synthetic:
        clock = time.perf_counter()
        c = nn_cosine(vectors, 2000, args.seed)
        noise = args.noise if args.noise is not None else float(np.sqrt((1 / c - 1) / vectors.shape[1]))
        made = time.perf_counter()
        matrix = synthetic(vectors, args.synthetic, noise, args.seed)
        made_s = time.perf_counter() - made
        pairs, firsts, nan = max(0, min(n, args.synthetic - n)), min(n, args.synthetic), float("nan")
        twins = matrix[:pairs] * matrix[n: n + pairs]  # row i and row i + n: two copies of passage i
        sample = np.random.default_rng(args.seed).choice(len(asked), min(args.synthetic_queries, len(asked)),
                                                         replace=False)
        result["synthetic"] = {"rows": args.synthetic, "copies_per_passage": args.synthetic / n, "noise": noise,
                               "real_nn_cosine_median": c,
                               "copies_cosine_median": float(np.median(twins.sum(axis=1))) if len(twins) else nan,
                               "copy_original_cosine_median": float(np.median(
                                   (matrix[:firsts] * vectors[:firsts]).sum(axis=1))),
                               "made_s": made_s, "queries": len(sample)}
        del twins
        exact_ids, _ = exact_top(matrix, asked[sample], args.k)
        result["synthetic"]["originals_in_exact_top"] = float(np.mean([len(np.unique(r % n)) for r in exact_ids]))
        print(f"synthetic: {args.synthetic:,} rows, noise {noise:.4f} (real nearest-neighbour cosine median {c:.3f}, "
              f"two copies' {result['synthetic']['copies_cosine_median']:.3f}); the exact top-{args.k} holds "
              f"{result['synthetic']['originals_in_exact_top']:.1f} distinct real passages", flush=True)
        result["rows"] += measure_set("synthetic", matrix, asked[sample], args.k,
                                      [int(np.sqrt(args.synthetic))], args.probes, min(args.timed, 100), args.seed)
        phases["synthetic_s"] = time.perf_counter() - clock
    phases["total_s"] = time.perf_counter() - started
    result["machine"]["load_average_end"] = os.getloadavg()
    write(out, result)
    print(markdown(result))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


def write(out: Path, result: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    out.with_suffix(".md").write_text(markdown(result), encoding="utf-8")


def line(r: dict, k: int) -> str:
    setting = "sqrt(n) cells, PROBE" if r["index_setting"] else "1M index's" if r["million_setting"] else ""
    low, high = r[f"recall_at_{k}_ci95"]
    return (f"| {r['set']} | {r['passages']:,} | {r['queries']:,} | {r['cells']:,} | {r['probe']} | {setting} | "
            f"{r[f'recall_at_{k}']:.3f} ({low:.3f}-{high:.3f}) | {100 * r['scored_share']:.1f}% | "
            f"{r['build_s']:.1f} ({r['kmeans_s']:.1f}) | {r['exact_ms_p50']:.2f} ({r['exact_cpu_ms_p50']:.2f}) | "
            f"{r['cells_ms_p50']:.2f} ({r['cells_cpu_ms_p50']:.2f}) |")


def markdown(result: dict) -> str:
    k, e = result["config"]["k"], result["embedding"]
    lines = [f"`{result['command']}` on {result['machine']['cpus']} CPU cores (load average "
             f"{result['machine']['load_average_start'][0]:.1f} at the start): {result['passages_total']:,} real "
             f"passages ({e['passages']:,} measured), embedded by {e['embedder']} on {e['device']} at "
             f"{e['passages_per_s']:,.1f} passages/s; cells probed at PROBE = {result['config']['probe']} by "
             f"the index.", ""]
    if "synthetic" in result:
        s = result["synthetic"]
        lines += [f"Synthetic: {s['rows']:,} rows, {s['copies_per_passage']:.1f} noisy copies of each real passage "
                  f"(noise {s['noise']:.4f} per dimension: two copies' cosine {s['copies_cosine_median']:.3f}, "
                  f"a real passage's nearest other {s['real_nn_cosine_median']:.3f}, medians); "
                  f"{s['queries']} questions; the exact top-{k} holds {s['originals_in_exact_top']:.1f} distinct "
                  "real passages.", ""]
    header = (f"| set | passages | questions | cells | probe | setting | recall@{k} (95% CI) | scored | "
              "build s (k-means) | exact p50 ms (CPU) | cells p50 ms (CPU) |")
    lines += [header, "|" + "---|" * header.count(" | ") + "---|"]
    lines += [line(r, k) for r in result["rows"]]
    return "\n".join(lines) + "\n"
