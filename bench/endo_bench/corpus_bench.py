"""`endo bench corpus`: corpus retrieval as a LlamaIndex user runs it (GUIDE, 'How we judge quality').

Every paragraph of a HotpotQA-layout file is pooled into one corpus, one `TextNode` per title ('Title: s1 s2 ...',
metadata {"title": title}); each question is asked through a retriever built the way a user builds it, and its
gold is the distinct titles of its supporting facts. Rows:
- `endo`, `bm25`, `s3-hybrid`: `EndoRetriever` with that method. It returns evidence spans, several of which may
  come from one paragraph: paragraphs are ranked by their first span, and the retriever is asked for
  SPANS_PER_PARAGRAPH spans per wanted paragraph (twice as many again while too few distinct ones come back);
- `llamaindex-bm25`: LlamaIndex's own `BM25Retriever`;
- `minilm`: a `VectorStoreIndex` of all-MiniLM-L6-v2 embeddings; `minilm+reranker`: its top `--candidates`
  re-ordered by `EndoReranker`.
Per row: paragraph recall@k and all-gold@k (k = 2, 5, 10) and MRR over the top 10 distinct paragraphs, each with a
95% bootstrap interval over questions and its paired difference to the `--reference` row; latency p50/p95 of the
whole query and of each stage known; the index build time. Writes JSON (schema endo-bench-corpus/1), with each
question's hits so rows can be compared later, and a Markdown table beside it.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import re
import sys
import time
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

SCHEMA = "endo-bench-corpus/1"
TOP = 10  # distinct paragraphs ranked per question
KS = (2, 5, TOP)
METRICS = (*(f"recall@{k}" for k in KS), *(f"all@{k}" for k in KS), "mrr")
SPANS_PER_PARAGRAPH = 4
WIDENINGS = 4  # at most this many doublings of the span count for one question
ENDO_SYSTEMS = ("endo", "bm25", "s3-hybrid")
SYSTEMS = (*ENDO_SYSTEMS, "llamaindex-bm25", "minilm", "minilm+reranker")
REFERENCE, FALLBACK_REFERENCE = "llamaindex-bm25", "bm25"
RESAMPLES = 1000
# asked once after each build, its time counted in the index's: lazily built parts (a BM25 table on the first
# query, a reranker's profile) are then not charged to the first question
WARM_UP = "Which river flows through the old town?"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from endo_retrieval.cli.commands import model_argument

    p.add_argument("--data", required=True, help="HotpotQA PATH.json (supporting facts are the gold)")
    p.add_argument("--out", required=True, help="FILE.json; FILE.md is written beside it")
    p.add_argument("--systems", default="", help=f"comma-separated (default all): {', '.join(SYSTEMS)}")
    p.add_argument("--reference", default=REFERENCE, choices=SYSTEMS,
                   help=f"the row every difference is taken to (default {REFERENCE}; {FALLBACK_REFERENCE} when "
                        "that row is not run)")
    p.add_argument("--candidates", type=int, default=20,
                   help=f"MiniLM's top-k handed to the reranker (default 20; at least {TOP})")
    p.add_argument("--limit", type=int, default=None, help="the first N questions (the corpus is still every "
                   "paragraph of the file)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap resampling seed")
    model_argument(p)


def parse_systems(spec: str | None) -> list[str]:
    """'a,b' -> ['a', 'b'] (every system when empty); an unknown name is a ValueError listing the known ones."""
    names = [s.strip() for s in (spec or "").split(",") if s.strip()]
    unknown = [s for s in names if s not in SYSTEMS]
    if unknown:
        raise ValueError(f"Unknown system(s) {', '.join(map(repr, unknown))}; known systems: {', '.join(SYSTEMS)}.")
    return list(dict.fromkeys(names)) or list(SYSTEMS)


# ---------------------------------------------------------------- the corpus and the gold


def paragraph_id(title: str) -> str:
    """A node id that depends on the title alone, so runs and files agree on it."""
    return "p" + hashlib.sha1(title.encode("utf-8")).hexdigest()[:16]


def corpus_nodes(titles: list[str], texts: list[str]) -> list:
    from llama_index.core.schema import TextNode

    return [TextNode(id_=paragraph_id(t), text=text, metadata={"title": t}) for t, text in zip(titles, texts)]


def gold_titles(item: dict) -> list[str]:
    return list(dict.fromkeys(title for title, _ in item["supporting_facts"]))


# ---------------------------------------------------------------- metrics over one ranking


def distinct(ids, top: int = TOP) -> list[str]:
    """The first `top` distinct ids, in the order they first appear."""
    return list(dict.fromkeys(ids))[:top]


def score_ranking(ranked: list[str], gold) -> dict:
    """Gold paragraphs among the top k of `ranked` for each k, and the 1-based rank of the first (None: none in
    the top TOP)."""
    gold = set(gold)
    hits = {f"hits@{k}": sum(t in gold for t in ranked[:k]) for k in KS}
    rank = next((i + 1 for i, t in enumerate(ranked[:TOP]) if t in gold), None)
    return {**hits, "first_gold_rank": rank}


def question_metrics(per_question: dict[str, list], gold_counts) -> dict[str, np.ndarray]:
    """Per-question recall@k (share of gold paragraphs in the top k), all@k (1 when every gold paragraph is) and
    reciprocal rank (0 past the top TOP), from the stored hits."""
    gold = np.asarray(gold_counts, dtype=np.float64)
    out = {}
    for k in KS:
        hits = np.asarray(per_question[f"hits@{k}"], dtype=np.float64)
        out[f"recall@{k}"], out[f"all@{k}"] = hits / gold, (hits == gold).astype(np.float64)
    out["mrr"] = np.array([0.0 if r is None else 1.0 / r for r in per_question["first_gold_rank"]])
    return out


# ---------------------------------------------------------------- the systems, each as a user builds it


class EndoSpans:
    """`EndoRetriever` with one method; spans are mapped to their paragraphs through metadata["doc_id"]."""

    def __init__(self, method: str, bb):
        self.name, self.method, self.bb = method, method, bb
        self.widened = 0  # questions that needed more spans than the first ask

    def load(self, shared: dict) -> None:
        pass  # the backbone is loaded before any system

    def build(self, nodes: list, shared: dict) -> None:
        from llama_index.retrievers.endo import EndoRetriever

        self.n_paragraphs = len(nodes)  # the index shows its own progress bar on a terminal
        self.retriever = EndoRetriever.from_defaults(nodes=nodes, method=self.method, backbone=self.bb,
                                                     similarity_top_k=SPANS_PER_PARAGRAPH * TOP)

    def ask(self, question: str) -> tuple[list[str], dict[str, float]]:
        want = min(TOP, self.n_paragraphs)
        k, stages = SPANS_PER_PARAGRAPH * TOP, {}
        for attempt in range(WIDENINGS + 1):
            self.retriever.similarity_top_k = k
            found = self.retriever.retrieve(question)
            for stage, ms in _stage_ms(found).items():  # summed over the asks this question took
                stages[stage] = stages.get(stage, 0.0) + ms
            ids = distinct(n.node.metadata["doc_id"] for n in found)
            if len(ids) >= want or len(found) < k:  # enough, or the retriever has nothing more to give
                break
            k *= 2
        self.widened += attempt > 0
        return ids, stages


def _stage_ms(found: list) -> dict[str, float]:
    """The per-stage milliseconds a retriever reports on its nodes (the first node that carries them)."""
    for n in found:
        stages = n.node.metadata.get("endo_stage_ms")
        if isinstance(stages, dict):
            return {str(k): float(v) for k, v in stages.items()}
    return {}


class LlamaIndexBM25:
    """LlamaIndex's own BM25Retriever (the package llama-index-retrievers-bm25)."""

    name = "llamaindex-bm25"

    def load(self, shared: dict) -> None:
        try:
            from llama_index.retrievers.bm25 import BM25Retriever
        except ImportError as err:
            raise Unavailable("llama-index-retrievers-bm25 is not installed (pip install "
                              f"'llama-index-retrievers-bm25==0.8.0', part of the bench extra): {err}") from err
        logging.getLogger("bm25s").setLevel(logging.WARNING)  # bm25s sets its own logger to DEBUG on import
        self.cls = BM25Retriever

    def build(self, nodes: list, shared: dict) -> None:
        self.retriever = self.cls.from_defaults(nodes=nodes, similarity_top_k=min(TOP, len(nodes)))

    def ask(self, question: str) -> tuple[list[str], dict[str, float]]:
        return distinct(n.node.node_id for n in self.retriever.retrieve(question)), {}


def load_embedder(shared: dict) -> None:
    if "embedder" not in shared:
        from endo_bench.embedding import MiniLMEmbedding

        shared["embedder"] = MiniLMEmbedding()


def vector_index(nodes: list, shared: dict) -> tuple[object, float]:
    """One MiniLM VectorStoreIndex for both vector rows: (the index, the seconds of its build when an earlier
    row built it, else 0: the caller's own clock is running)."""
    if "vector" in shared:
        return shared["vector"]
    from llama_index.core import VectorStoreIndex

    start = time.perf_counter()
    index = VectorStoreIndex(nodes, embed_model=shared["embedder"], show_progress=sys.stderr.isatty())
    shared["vector"] = index, time.perf_counter() - start
    return index, 0.0


class MiniLM:
    name = "minilm"

    def load(self, shared: dict) -> None:
        load_embedder(shared)

    def build(self, nodes: list, shared: dict) -> None:
        index, self.reused_s = vector_index(nodes, shared)
        self.retriever = index.as_retriever(similarity_top_k=min(TOP, len(nodes)))

    def ask(self, question: str) -> tuple[list[str], dict[str, float]]:
        return distinct(n.node.node_id for n in self.retriever.retrieve(question)), {}


class MiniLMReranker:
    """MiniLM's top `candidates`, then EndoReranker keeps the best TOP."""

    name = "minilm+reranker"

    def __init__(self, candidates: int, bb):
        self.candidates, self.bb = candidates, bb

    def load(self, shared: dict) -> None:
        from llama_index.postprocessor.endo import EndoReranker

        load_embedder(shared)
        self.reranker = EndoReranker(top_n=TOP, backbone=self.bb)

    def build(self, nodes: list, shared: dict) -> None:
        index, self.reused_s = vector_index(nodes, shared)
        self.retriever = index.as_retriever(similarity_top_k=min(self.candidates, len(nodes)))

    def ask(self, question: str) -> tuple[list[str], dict[str, float]]:
        start = time.perf_counter()
        candidates = self.retriever.retrieve(question)
        middle = time.perf_counter()
        best = self.reranker.postprocess_nodes(candidates, query_str=question)
        stages = {"first_stage": 1e3 * (middle - start), "rerank": 1e3 * (time.perf_counter() - middle)}
        return distinct(n.node.node_id for n in best), stages


class Unavailable(RuntimeError):
    """A row that cannot run here; its reason is reported instead of a crash."""


def make_system(name: str, args, bb):
    if name in ENDO_SYSTEMS:
        return EndoSpans(name, bb)
    if name == "llamaindex-bm25":
        return LlamaIndexBM25()
    return MiniLM() if name == "minilm" else MiniLMReranker(args.candidates, bb)


# ---------------------------------------------------------------- one row


def measure(system, nodes: list, items: list[dict], titles_of: dict[str, str], shared: dict) -> dict:
    """Load the system's models (untimed), build its index (timed, with its warm-up question), then ask every
    question."""
    from tqdm import tqdm

    system.load(shared)
    start = time.perf_counter()
    system.build(nodes, shared)
    system.ask(WARM_UP)
    index_s = time.perf_counter() - start + getattr(system, "reused_s", 0.0)
    if hasattr(system, "widened"):
        system.widened = 0  # the warm-up's asks are not the questions'
    per_question = {**{f"hits@{k}": [] for k in KS}, "first_gold_rank": [], "query_ms": []}
    stage_ms: dict[str, list[float]] = {}
    for item in tqdm(items, desc=f"corpus {system.name}", unit="question", disable=None):
        start = time.perf_counter()
        ids, stages = system.ask(item["question"])
        per_question["query_ms"].append(round(1e3 * (time.perf_counter() - start), 3))
        for key, value in score_ranking([titles_of[i] for i in ids], gold_titles(item)).items():
            per_question[key].append(value)
        for stage, ms in stages.items():
            stage_ms.setdefault(stage, []).append(ms)
    latency = {"query": percentiles(per_question["query_ms"]), **{s: percentiles(v) for s, v in stage_ms.items()}}
    row = {"system": system.name, "n": len(items), "latency_ms": latency, "index_s": round(index_s, 3),
           "per_question": per_question}
    if getattr(system, "widened", 0):
        row["note"] = f"{system.widened} questions needed more than {SPANS_PER_PARAGRAPH * TOP} spans"
    return row


def percentiles(ms: list[float]) -> dict[str, float]:
    p50, p95 = np.percentile(np.asarray(ms, dtype=np.float64), [50, 95])
    return {"p50": round(float(p50), 2), "p95": round(float(p95), 2)}


def interval(value_lo_hi: tuple) -> dict:
    return dict(zip(("value", "lo", "hi"), (None if v is None else round(v, 4) for v in value_lo_hi)))


def add_intervals(rows: list[dict], gold_counts: list[int], reference: str | None, seed: int) -> None:
    """Each measured row's metrics with bootstrap intervals, and its paired difference to the reference row
    (the same seed, so every row and metric resamples the same questions)."""
    from endo_bench.metrics import bootstrap_ci, paired_diff_ci

    values = {r["system"]: question_metrics(r["per_question"], gold_counts) for r in rows if "skipped" not in r}
    for row in rows:
        if "skipped" in row:
            continue
        mine = values[row["system"]]
        row.update({m: interval(bootstrap_ci(mine[m], seed, RESAMPLES)) for m in METRICS})
        row["diff"] = {} if reference is None else {
            m: interval(paired_diff_ci(mine[m], values[reference][m], seed, RESAMPLES)) for m in METRICS}


def pick_reference(asked: str, rows: list[dict]) -> str | None:
    measured = [r["system"] for r in rows if "skipped" not in r]
    return next((s for s in (asked, FALLBACK_REFERENCE) if s in measured), None)


# ---------------------------------------------------------------- the run and its outputs


def run(args) -> int:
    from endo_retrieval.calibration.datasets import hotpotqa_corpus

    systems = parse_systems(args.systems)
    if args.candidates < TOP:
        raise ValueError(f"--candidates must be at least {TOP} (the reranker keeps {TOP}), got {args.candidates}")
    out = Path(args.out)
    if out.suffix != ".json":
        raise ValueError(f"--out must name a .json file, got {out}")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    wall = time.perf_counter()
    titles, texts, items = hotpotqa_corpus(args.data, args.limit)
    no_gold = [it["_id"] for it in items if not it["supporting_facts"]]
    items = [it for it in items if it["supporting_facts"]]  # recall is undefined without gold
    if not items:
        raise ValueError(f"{args.data}: no question with supporting facts to score")
    nodes = corpus_nodes(titles, texts)
    titles_of = {n.node_id: t for n, t in zip(nodes, titles)}
    bb = None
    if any(s not in ("llamaindex-bm25", "minilm") for s in systems):
        from endo_retrieval.model.backbone import Backbone

        bb = Backbone.of(args.model)  # loaded once, before any index is timed
    rows, shared = [], {}
    for name in systems:
        try:
            rows.append(measure(make_system(name, args, bb), nodes, items, titles_of, shared))
        except Exception as err:  # noqa: BLE001 - one row that cannot run must not lose the others
            logger.warning("%s: skipped: %s", name, err)
            rows.append({"system": name, "n": 0, "skipped": f"{type(err).__name__}: {err}"})
    reference = pick_reference(args.reference, rows)
    gold_counts = [len(gold_titles(it)) for it in items]
    add_intervals(rows, gold_counts, reference, args.seed)
    result = {"schema": SCHEMA, "config": run_config(args, bb, systems, reference, len(nodes), items, gold_counts,
                                                     no_gold, time.perf_counter() - wall),
              "rows": [order_keys(r) for r in rows]}
    write_outputs(result, out)
    for row in rows:
        if "skipped" in row:
            print(f"skipped: {row['system']}: {row['skipped']}", file=sys.stderr)
    print(out.with_suffix(".md").read_text(encoding="utf-8"))
    print(f"wrote {out} and, beside it, {out.with_suffix('.md').name}")
    return 0


def run_config(args, bb, systems, reference, n_paragraphs, items, gold_counts, no_gold, wall_s) -> dict:
    return {"model": bb.model_id if bb else None, "model_hash": bb.model_hash if bb else None,
            "data": str(args.data), "limit": args.limit, "seed": args.seed, "systems": systems,
            "reference": reference, "candidates": args.candidates, "top": TOP, "ks": list(KS),
            "spans_per_paragraph": SPANS_PER_PARAGRAPH, "bootstrap": {"resamples": RESAMPLES, "level": 0.95},
            "corpus_paragraphs": n_paragraphs, "n_questions": len(items), "embedder": "all-MiniLM-L6-v2",
            "device": str(bb.device) if bb else "cpu", "question_ids": [it["_id"] for it in items],
            "gold_per_question": gold_counts, "left_out_no_gold": no_gold, "wall_s": round(wall_s, 1),
            "notes": ["gold: the distinct titles of a question's supporting facts; a paragraph counts once, at its "
                      "first (best) span",
                      "index_s: building the index plus one warm-up question; the two MiniLM rows share one "
                      "vector index and both report its build",
                      "latency_ms.query: the whole question, every ask included when an EndoRetriever was asked "
                      "again for more spans; other keys are the stages a system reports",
                      "intervals: 95% percentile bootstrap over questions; diff: row minus reference, paired "
                      "(the same resampled questions for both)"]}


def order_keys(row: dict) -> dict:
    """The row's keys in reading order, the bulky per-question lists last."""
    head = ["system", "n", "skipped", *METRICS, "diff", "latency_ms", "index_s", "note", "per_question"]
    return {k: row[k] for k in head if k in row}


def write_outputs(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(compact_lists(json.dumps(result, indent=1)) + "\n", encoding="utf-8")
    tmp.replace(out)
    out.with_suffix(".md").write_text(markdown(result), encoding="utf-8")


def compact_lists(text: str) -> str:
    """Indented JSON with each list of plain values on one line (the per-question lists would take a line per
    number). JSON strings hold no raw newlines, so only the indentation between items is removed."""
    def one_line(m: re.Match) -> str:
        return re.sub(r"\n\s*", "", re.sub(r",\n\s*", ", ", m.group(0)))

    return re.sub(r"\[[^\[\]{}]*\]", one_line, text)


def cell(ci: dict | None, signed: bool = False) -> str:
    if not ci or ci["value"] is None:
        return "–"
    f = "{:+.3f}" if signed else "{:.3f}"
    return f"{f.format(ci['value'])} [{f.format(ci['lo'])}, {f.format(ci['hi'])}]"


def markdown(result: dict) -> str:
    cfg, rows = result["config"], result["rows"]
    measured = [r for r in rows if "skipped" not in r]
    names = [m.replace("mrr", "MRR") for m in METRICS]
    lines = [f"Corpus retrieval: {cfg['corpus_paragraphs']} paragraphs of `{cfg['data']}` pooled, "
             f"{cfg['n_questions']} questions, model {cfg['model'] or '–'}; wall time {cfg['wall_s']} s. "
             f"Cells: mean [95% bootstrap interval over questions, {cfg['bootstrap']['resamples']} resamples, "
             f"seed {cfg['seed']}].", ""]
    head = ["system", "n", *names, "query p50 / p95 ms", "index s"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in measured:
        q = r["latency_ms"]["query"]
        lines.append(f"| {r['system']} | {r['n']} | " + " | ".join(cell(r[m]) for m in METRICS)
                     + f" | {q['p50']:.1f} / {q['p95']:.1f} | {r['index_s']:.2f} |")
    if cfg["reference"]:
        lines += ["", f"Difference to `{cfg['reference']}` (row minus reference; paired bootstrap 95% interval):",
                  "", "| system | " + " | ".join(f"Δ {n}" for n in names) + " |", "|" + "---|" * (len(names) + 1)]
        lines += [f"| {r['system']} | " + (" | ".join(["reference"] * len(METRICS)) if r["system"] == cfg["reference"]
                                           else " | ".join(cell(r["diff"][m], signed=True) for m in METRICS)) + " |"
                  for r in measured]
    staged = [(r["system"], s, v) for r in measured for s, v in r["latency_ms"].items() if s != "query"]
    if staged:
        lines += ["", "Latency by stage:", "", "| system | stage | p50 ms | p95 ms |", "|---|---|---|---|"]
        lines += [f"| {name} | {s} | {v['p50']:.1f} | {v['p95']:.1f} |" for name, s, v in staged]
    lines += [""] + [f"- skipped {r['system']}: {r['skipped']}" for r in rows if "skipped" in r]
    lines += [f"- {r['system']}: {r['note']}" for r in measured if r.get("note")]
    lines += [f"- {note}" for note in cfg["notes"]]
    return "\n".join(lines) + "\n"
