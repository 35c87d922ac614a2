"""`endo bench corpus`: corpus retrieval as a LlamaIndex user runs it (GUIDE, 'How we judge quality').

Every paragraph of a HotpotQA-layout file is pooled into one corpus, one `TextNode` per title ('Title: s1 s2 ...',
metadata {"title": title}); each question is asked through a retriever built the way a user builds it, and its
gold is the distinct titles of its supporting facts. Rows:
- `endo`, `bm25`, `s3-hybrid`: `EndoRetriever` with that method, one hit per paragraph (its best passage or span);
- `llamaindex-bm25`: LlamaIndex's own `BM25Retriever`; `minilm`: a `VectorStoreIndex` of all-MiniLM-L6-v2
  embeddings;
- rerankers after either first stage's top `--candidates`: `minilm+reranker` and `bm25+reranker` (`EndoReranker`
  as users build it, fusing the first stage's scores with the retrieval heads'), `minilm+heads` (`EndoReranker(
  fuse=False)`: the heads alone), `minilm+llmrerank` and `bm25+llmrerank` (LlamaIndex's `LLMRerank` reading the
  same local model's answers through `EndoLLM`; where it parses fewer than TOP paragraphs from them, the first
  stage's order fills the rest, and the row's note counts those questions).
Per row: paragraph recall@k and all-gold@k (k = 2, 5, 10) and MRR over the top 10 distinct paragraphs, each with a
95% bootstrap interval over questions and its paired difference to the `--reference` row; latency p50/p95 of the
whole query and of each stage known; the model's forwards per question and, on CUDA, the launches and kernels of a
few warm questions (`launches.py`); the index build time. `--plain-reads`: the pipeline reads one query part per
forward, as before its reads were batched (the same rankings, more forwards). Writes JSON (schema
endo-bench-corpus/1), with each question's hits so rows can be compared later, and a Markdown table beside it.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np

from endo_retrieval.methods import PIPELINE_METHODS

logger = logging.getLogger(__name__)

SCHEMA = "endo-bench-corpus/1"
TOP = 10  # distinct paragraphs ranked per question
KS = (2, 5, TOP)
METRICS = (*(f"recall@{k}" for k in KS), *(f"all@{k}" for k in KS), "mrr", "hit@1", f"ndcg@{TOP}")
ENDO_SYSTEMS = ("endo", "endo-2hop", "bm25", "s3-hybrid")
# `endo@bm25`, `endo-2hop@dense`...: a pipeline with that first stage; `stage1@hybrid`: a first stage alone, its
# candidates in its own order (no model read)
STAGE_NAMES = ("hybrid", "bm25", "dense")
STAGED = tuple(f"{m}@{s}" for m in (*PIPELINE_METHODS, "stage1") for s in STAGE_NAMES)
FIRST_STAGES = ("minilm", "bm25")  # FirstStage kinds, named as the reranker's fitted weights are
FIRST_STAGE_ROWS = {"llamaindex-bm25": "bm25", "minilm": "minilm"}  # a first stage alone
RERANKED = ("minilm+reranker", "minilm+heads", "bm25+reranker", "minilm+llmrerank", "bm25+llmrerank")
SYSTEMS = (*ENDO_SYSTEMS, *FIRST_STAGE_ROWS, *RERANKED, *STAGED)
CHOICE_BATCH = 10  # LLMRerank's own default: candidates shown to the model per call
# cl100k_base.tiktoken as tiktoken caches it: the SHA-1 of its download address
CL100K_FILE = "9b5ad71b2ce5302211f9c61530b329a4922fc6a4"
REFERENCE, FALLBACK_REFERENCE = "llamaindex-bm25", "bm25"
RESAMPLES = 1000
# asked once after each build, its time counted in the index's: lazily built parts (a BM25 table on the first
# query, a reranker's profile) are then not charged to the first question
WARM_UP = "Which river flows through the old town?"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from endo_retrieval.cli.commands import model_argument

    p.add_argument("--data", required=True, help="HotpotQA PATH.json (supporting facts are the gold), or a "
                   "BEIR-layout PATH.json[.gz]:SPLIT (relevant documents are the gold; e.g. SciFact's test)")
    p.add_argument("--out", required=True, help="FILE.json; FILE.md is written beside it")
    p.add_argument("--systems", default="", help=f"comma-separated (default all): {', '.join(SYSTEMS)}")
    p.add_argument("--reference", default=REFERENCE, choices=SYSTEMS,
                   help=f"the row every difference is taken to (default {REFERENCE}; {FALLBACK_REFERENCE} when "
                        "that row is not run)")
    p.add_argument("--candidates", type=int, default=20,
                   help=f"the first stage's top-k handed to a reranker (default 20; at least {TOP})")
    p.add_argument("--choice-batch-size", type=int, default=CHOICE_BATCH,
                   help=f"LLMRerank's candidates per model call (default {CHOICE_BATCH}, LlamaIndex's)")
    p.add_argument("--limit", type=int, default=None, help="the first N questions (the corpus is still every "
                   "paragraph of the file)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap resampling seed")
    p.add_argument("--plain-reads", action="store_true", help="the endo pipelines read one query part per forward "
                   "(five per question, not two; the same rankings): the path before batching, for timing beside it")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="the model's weights and reads in this type (default: bfloat16 on CUDA and on a CPU "
                        "with avx512_bf16 or AMX units, float32 on other CPUs)")
    p.add_argument("--eager", action="store_true", help="on CUDA, the batched reads' forwards run eagerly, not "
                   "replayed from CUDA graphs (the same rankings to float tolerance): for timing beside them")
    p.add_argument("--depth", type=int, default=None, help="candidates the endo pipelines read (default: the "
                   "model's profile)")
    p.add_argument("--read-tokens", type=int, default=None, help="tokens the endo pipelines read of each candidate "
                   "(default: the model's profile)")
    p.add_argument("--unstemmed", action="store_true", help="the endo pipelines' stage 1 indexes words, not their "
                   "stems (before stemming, for quality beside it)")
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
    ranks = [i + 1 for i, t in enumerate(ranked[:TOP]) if t in gold]
    return {**hits, "first_gold_rank": ranks[0] if ranks else None, "gold_ranks": ranks}


def question_metrics(per_question: dict[str, list], gold_counts) -> dict[str, np.ndarray]:
    """Per-question recall@k (share of gold paragraphs in the top k), all@k (1 when every gold paragraph is) and
    reciprocal rank (0 past the top TOP), from the stored hits."""
    gold = np.asarray(gold_counts, dtype=np.float64)
    out = {}
    for k in KS:
        hits = np.asarray(per_question[f"hits@{k}"], dtype=np.float64)
        out[f"recall@{k}"], out[f"all@{k}"] = hits / gold, (hits == gold).astype(np.float64)
    out["mrr"] = np.array([0.0 if r is None else 1.0 / r for r in per_question["first_gold_rank"]])
    out["hit@1"] = np.array([float(r == 1) for r in per_question["first_gold_rank"]])
    if "gold_ranks" in per_question:  # nDCG@TOP, binary gain (BEIR's): results written before it lack the ranks
        ideal = np.array([sum(1 / np.log2(i + 2) for i in range(min(int(g), TOP))) for g in gold])
        out[f"ndcg@{TOP}"] = np.array([sum(1 / np.log2(r + 1) for r in ranks)
                                       for ranks in per_question["gold_ranks"]]) / ideal
    return out


# ---------------------------------------------------------------- the systems, each as a user builds it


class Row:
    """One system of the table: `load` its models (untimed), `build` its index over the nodes, `ask` a question
    for its ranked paragraph ids and the milliseconds of each stage it knows."""

    reused_s = 0.0  # the build time of a structure an earlier row built and this row shares

    def reset(self) -> None:
        """Forget what the warm-up question counted."""

    def note(self) -> str | None:
        return None


class EndoSpans(Row):
    """`EndoRetriever` with one method. It returns one hit per node, the node's best passage or span, under the
    node's own id (also in metadata["doc_id"]): that id is the paragraph."""

    def __init__(self, name: str, bb, depth: int | None = None, read_tokens: int | None = None):
        self.name, self.bb = name, bb
        self.method, _, first_stage = name.partition("@")
        self.knobs = {"depth": depth, "read_tokens": read_tokens} if self.method in PIPELINE_METHODS else {}
        if first_stage:
            self.knobs["first_stage"] = first_stage

    def load(self, shared: dict) -> None:
        pass  # the backbone is loaded before any system

    def build(self, nodes: list, shared: dict) -> None:
        from llama_index.retrievers.endo import EndoRetriever

        # the index shows its own progress bar on a terminal
        self.retriever = EndoRetriever.from_defaults(nodes=nodes, method=self.method, backbone=self.bb,
                                                     similarity_top_k=TOP, **self.knobs)

    def ask(self, question: str) -> tuple[list[str], dict[str, float]]:
        found = self.retriever.retrieve(question)
        return distinct(n.node.node_id for n in found), _stage_ms(found)


def _stage_ms(found: list) -> dict[str, float]:
    """The per-stage milliseconds a retriever reports on its nodes (the first node that carries them)."""
    for n in found:
        stages = n.node.metadata.get("endo_stage_ms")
        if isinstance(stages, dict):
            return {str(k): float(v) for k, v in stages.items()}
    return {}


class Stage1(Row):
    """The `endo` pipeline's first stage alone (`stage1@hybrid`, `@bm25`, `@dense`): its candidates in its own
    order, one per paragraph, nothing read by the model."""

    def __init__(self, name: str, bb):
        self.name, self.bb, self.stage = name, bb, name.partition("@")[2]

    def load(self, shared: dict) -> None:
        pass

    def build(self, nodes: list, shared: dict) -> None:
        from endo_retrieval.methods.search import Document, EndoIndex

        self.index = EndoIndex(self.bb, "endo", first_stage="bm25" if self.stage == "bm25" else "hybrid")
        self.index.add_documents([Document(n.node_id, n.get_content()) for n in nodes])
        self.pipeline = self.index.pipeline("endo", first_stage=self.stage)

    def ask(self, question: str) -> tuple[list[str], dict[str, float]]:
        corpus, passages = self.index.corpus, self.index.passages()
        start = time.perf_counter()
        top, _ = self.pipeline.candidates(corpus, passages, question, depth=4 * TOP)
        ids = corpus.locate(passages.starts[top])[0]
        docs = [d.doc_id for d in corpus.documents()]
        return distinct(docs[i] for i in ids), {"first_stage": 1e3 * (time.perf_counter() - start)}


class FirstStage:
    """A retriever that needs no language model, asked for its top k: 'bm25' (LlamaIndex's BM25Retriever, the
    package llama-index-retrievers-bm25) or 'minilm' (a VectorStoreIndex of all-MiniLM-L6-v2 embeddings)."""

    def __init__(self, kind: str, k: int):
        if kind not in FIRST_STAGES:
            raise ValueError(f"Unknown first stage {kind!r}; known: {', '.join(FIRST_STAGES)}.")
        self.kind, self.k = kind, k

    def load(self, shared: dict) -> None:
        if self.kind == "minilm":
            load_embedder(shared)
            return
        # bm25s imports JAX where it is installed, and JAX's first use takes 75% of the GPU's memory for itself
        # (beside the model, the next allocation fails); its top-k is as fast on the CPU
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        try:
            from llama_index.retrievers.bm25 import BM25Retriever
        except ImportError as err:
            raise Unavailable("llama-index-retrievers-bm25 is not installed (pip install "
                              f"'llama-index-retrievers-bm25==0.8.0', part of the bench extra): {err}") from err
        logging.getLogger("bm25s").setLevel(logging.WARNING)  # bm25s sets its own logger to DEBUG on import
        self.bm25 = BM25Retriever

    def build(self, nodes: list, shared: dict) -> float:
        """Build the retriever; returns the seconds of a shared structure an earlier row built (else 0)."""
        k = min(self.k, len(nodes))  # BM25 refuses a k past the corpus
        if self.kind == "bm25":
            self.retriever = self.bm25.from_defaults(nodes=nodes, similarity_top_k=k)
            return 0.0
        index, reused_s = vector_index(nodes, shared)
        self.retriever = index.as_retriever(similarity_top_k=k)
        return reused_s

    def retrieve(self, question: str) -> list:
        return self.retriever.retrieve(question)


def load_embedder(shared: dict) -> None:
    if "embedder" not in shared:
        from llama_index.postprocessor.endo import MiniLMEmbedding

        shared["embedder"] = MiniLMEmbedding()


def vector_index(nodes: list, shared: dict) -> tuple[object, float]:
    """One MiniLM VectorStoreIndex for every MiniLM row: (the index, the seconds of its build when an earlier row
    built it, else 0: the caller's own clock is running)."""
    if "vector" in shared:
        return shared["vector"]
    from llama_index.core import VectorStoreIndex

    start = time.perf_counter()
    index = VectorStoreIndex(nodes, embed_model=shared["embedder"], show_progress=sys.stderr.isatty())
    shared["vector"] = index, time.perf_counter() - start
    return index, 0.0


class Retrieved(Row):
    """A first stage alone, its top TOP."""

    def __init__(self, name: str, first: FirstStage):
        self.name, self.first = name, first

    def load(self, shared: dict) -> None:
        self.first.load(shared)

    def build(self, nodes: list, shared: dict) -> None:
        self.reused_s = self.first.build(nodes, shared)

    def ask(self, question: str) -> tuple[list[str], dict[str, float]]:
        return distinct(n.node.node_id for n in self.first.retrieve(question)), {}


class Reranked(Row):
    """A first stage's top `--candidates`, then a node postprocessor that keeps the best TOP. When the
    postprocessor hands back fewer distinct nodes than it was asked for (LLMRerank keeps only what it can parse of
    the model's answer), the rest of the top TOP follow in the first stage's order; `filled` counts those
    questions, `empty` those where it handed back none."""

    def __init__(self, name: str, first: FirstStage, make_postprocessor):
        self.name, self.first, self.make_postprocessor = name, first, make_postprocessor
        self.reset()

    def reset(self) -> None:
        self.filled = self.empty = 0

    def load(self, shared: dict) -> None:
        self.first.load(shared)
        self.postprocessor = self.make_postprocessor()

    def build(self, nodes: list, shared: dict) -> None:
        self.reused_s = self.first.build(nodes, shared)

    def ask(self, question: str) -> tuple[list[str], dict[str, float]]:
        start = time.perf_counter()
        candidates = self.first.retrieve(question)
        middle = time.perf_counter()
        try:
            best = self.postprocessor.postprocess_nodes(candidates, query_str=question)
        except IndexError:  # LLMRerank indexes its batch with the model's numbers: one out of range raises
            best = []
        stages = {"first_stage": 1e3 * (middle - start), "rerank": 1e3 * (time.perf_counter() - middle)}
        kept = distinct(n.node.node_id for n in best)
        first = [n.node.node_id for n in candidates]
        if len(kept) < min(TOP, len(set(first))):
            self.filled += 1
            self.empty += not kept
        return distinct(kept + first), stages

    def note(self) -> str | None:
        if not self.filled:
            return None
        return (f"questions with fewer than {TOP} distinct paragraphs from the reranker: {self.filled} (with none: "
                f"{self.empty}); the rest of their top {TOP} came in the first stage's order")


def endo_llm(bb):
    """The local model as the LLM that LLMRerank reads its answers from (a function, so tests can stub it)."""
    from llama_index.llms.endo import EndoLLM

    return EndoLLM(backbone=bb)


class Unavailable(RuntimeError):
    """A row that cannot run here; its reason is reported instead of a crash."""


def make_system(name: str, args, bb) -> Row:
    if name.startswith("stage1@"):
        return Stage1(name, bb)
    if name in ENDO_SYSTEMS or name in STAGED:
        return EndoSpans(name, bb, args.depth, args.read_tokens)
    if name in FIRST_STAGE_ROWS:
        return Retrieved(name, FirstStage(FIRST_STAGE_ROWS[name], TOP))
    kind, second = name.split("+")
    first = FirstStage(kind, args.candidates)
    if second == "llmrerank":
        def make():
            from llama_index.core.postprocessor import LLMRerank

            return LLMRerank(llm=endo_llm(bb), top_n=TOP, choice_batch_size=args.choice_batch_size)
    else:
        def make():
            from llama_index.postprocessor.endo import EndoReranker

            # "reranker": as a user builds it, fused with the first stage; "heads": the retrieval heads alone
            return EndoReranker(top_n=TOP, backbone=bb, fuse=second == "reranker", first_stage=kind)
    return Reranked(name, first, make)


def pipeline_settings(bb, args) -> dict:
    """The endo pipelines' settings this run read with: those given, else the model's profile's (else defaults)."""
    from endo_retrieval.methods.pipeline import EndoPipeline

    pipe = EndoPipeline(bb, depth=args.depth, read_tokens=args.read_tokens)
    return {"depth": pipe.depth, "read_tokens": pipe.read_tokens, "best_last": pipe.best_last,
            "weights": pipe.weights}


def load_backbone(model, dtype: str | None = None):
    """The local model, loaded once before any index is timed (a function, so tests can stub it); `dtype`
    ("float32", "bfloat16"): its weights' type, else the device's default (Backbone)."""
    import torch

    from endo_retrieval.model.backbone import Backbone

    return Backbone.of(model) if dtype is None else Backbone(model, dtype=getattr(torch, dtype))


def use_shipped_tiktoken_cache() -> None:
    """LlamaIndex counts tokens with tiktoken's cl100k_base, which tiktoken downloads unless it finds the file in
    TIKTOKEN_CACHE_DIR. llama_index.core points that variable at the copy it ships only while the variable is
    unset, so on a machine that sets it elsewhere (without the file) and has no network, building a
    VectorStoreIndex fails. There, point the variable at the shipped copy."""
    import importlib.util
    import os

    cache = os.environ.get("TIKTOKEN_CACHE_DIR")
    if cache is None or (cache and (Path(cache) / CL100K_FILE).is_file()):
        return  # unset: llama_index.core uses its own copy; or the file is where the variable says
    spec = importlib.util.find_spec("llama_index.core")
    if spec is None or spec.origin is None:
        return  # no LlamaIndex: nothing here counts tokens with it
    shipped = Path(spec.origin).parent / "_static" / "tiktoken_cache"
    if (shipped / CL100K_FILE).is_file():
        logger.info("TIKTOKEN_CACHE_DIR=%r lacks cl100k_base; using LlamaIndex's copy in %s", cache, shipped)
        os.environ["TIKTOKEN_CACHE_DIR"] = str(shipped)


# ---------------------------------------------------------------- one row


def measure(system, nodes: list, items: list[dict], titles_of: dict[str, str], shared: dict, bb=None) -> dict:
    """Load the system's models (untimed), build its index (timed, with its warm-up question), then ask every
    question, counting the forwards of the model `bb` (when given) each takes; on CUDA, profile the first
    LAUNCH_QUESTIONS again, warm (each asked once more first, so what the profile counts is the steady state: CUDA
    graphs replayed, not captured), for their launches."""
    from tqdm import tqdm

    from endo_bench.launches import counting_forwards, launches_per_question

    system.load(shared)
    start = time.perf_counter()
    system.build(nodes, shared)
    system.ask(WARM_UP)
    index_s = time.perf_counter() - start + system.reused_s
    system.reset()
    per_question = {**{f"hits@{k}": [] for k in KS}, "first_gold_rank": [], "gold_ranks": [], "query_ms": []}
    stage_ms: dict[str, list[float]] = {}
    for item in tqdm(items, desc=f"corpus {system.name}", unit="question", disable=None):
        with counting_forwards(bb) if bb is not None else nullcontext([None]) as forwards:
            start = time.perf_counter()
            ids, stages = system.ask(item["question"])
            per_question["query_ms"].append(round(1e3 * (time.perf_counter() - start), 3))
        if bb is not None:
            per_question.setdefault("forwards", []).append(forwards[0])
        for key, value in score_ranking([titles_of[i] for i in ids], gold_titles(item)).items():
            per_question[key].append(value)
        for stage, ms in stages.items():
            stage_ms.setdefault(stage, []).append(ms)
    latency = {"query": percentiles(per_question["query_ms"]), **{s: percentiles(v) for s, v in stage_ms.items()}}
    row = {"system": system.name, "n": len(items), "latency_ms": latency, "index_s": round(index_s, 3),
           "per_question": per_question}
    if bb is not None:
        row["forwards_per_question"] = round(float(np.mean(per_question["forwards"])), 2)
        cuda = launches_per_question(system.ask, [item["question"] for item in items], bb.device)
        if cuda is not None:
            row["cuda_per_question"] = cuda
    if system.note():
        row["note"] = system.note()
    return row


def percentiles(ms: list[float]) -> dict[str, float]:
    p50, p95 = np.percentile(np.asarray(ms, dtype=np.float64), [50, 95])
    return {"p50": round(float(p50), 2), "p95": round(float(p95), 2)}


def interval(value_lo_hi: tuple) -> dict:
    return dict(zip(("value", "lo", "hi"), (None if v is None else round(v, 4) for v in value_lo_hi)))


def add_intervals(rows: list[dict], gold_counts: list[int], reference: str | None, seed: int,
                  types: list[str] | None = None) -> None:
    """Each measured row's metrics with bootstrap intervals, and its paired difference to the reference row
    (the same seed, so every row and metric resamples the same questions); where the questions have more than one
    `types` (HotpotQA's "bridge" and "comparison"), the recalls of each type apart (`by_type`)."""
    from endo_bench.metrics import bootstrap_ci, paired_diff_ci

    values = {r["system"]: question_metrics(r["per_question"], gold_counts) for r in rows if "skipped" not in r}
    for row in rows:
        if "skipped" in row:
            continue
        mine = values[row["system"]]
        row.update({m: interval(bootstrap_ci(mine[m], seed, RESAMPLES)) for m in METRICS if m in mine})
        row["diff"] = {} if reference is None else {
            m: interval(paired_diff_ci(mine[m], values[reference][m], seed, RESAMPLES)) for m in METRICS
            if m in mine and m in values[reference]}
        if types is not None and len(set(types)) > 1:
            row["by_type"] = by_type(mine, values.get(reference), types, seed)


def by_type(mine: dict[str, np.ndarray], reference: dict[str, np.ndarray] | None, types: list[str], seed: int
            ) -> dict[str, dict]:
    """{type: n, recall@k with its interval and paired difference to the reference row} over the questions of
    each type: a pipeline fitted on a mix of question types can gain on one and lose on another, which the
    whole set's mean hides."""
    from endo_bench.metrics import bootstrap_ci, paired_diff_ci

    kinds = np.asarray(types)
    out = {}
    for kind in sorted(set(types)):
        m = kinds == kind
        out[kind] = {"n": int(m.sum())} | {
            f"recall@{k}": interval(bootstrap_ci(mine[f"recall@{k}"][m], seed, RESAMPLES)) for k in KS}
        if reference is not None:
            out[kind]["diff"] = {f"recall@{k}": interval(paired_diff_ci(mine[f"recall@{k}"][m],
                                                                        reference[f"recall@{k}"][m], seed, RESAMPLES))
                                 for k in KS}
    return out


def question_types(items: list[dict]) -> list[str] | None:
    """Each question's `type` field (HotpotQA's "bridge" / "comparison"), None where any question has none."""
    types = [it.get("type") for it in items]
    return None if any(not isinstance(t, str) or not t for t in types) else types


def pick_reference(asked: str, rows: list[dict]) -> str | None:
    measured = [r["system"] for r in rows if "skipped" not in r]
    return next((s for s in (asked, FALLBACK_REFERENCE) if s in measured), None)


# ---------------------------------------------------------------- the run and its outputs


def run(args) -> int:
    from endo_retrieval.calibration.datasets import corpus_questions

    systems = parse_systems(args.systems)
    if args.candidates < TOP:
        raise ValueError(f"--candidates must be at least {TOP} (the reranker keeps {TOP}), got {args.candidates}")
    if args.choice_batch_size < 1:
        raise ValueError(f"--choice-batch-size must be at least 1, got {args.choice_batch_size}")
    out = Path(args.out)
    if out.suffix != ".json":
        raise ValueError(f"--out must name a .json file, got {out}")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    wall = time.perf_counter()
    use_shipped_tiktoken_cache()
    titles, texts, items = corpus_questions(args.data, args.limit)
    no_gold = [it["_id"] for it in items if not it["supporting_facts"]]
    items = [it for it in items if it["supporting_facts"]]  # recall is undefined without gold
    if not items:
        raise ValueError(f"{args.data}: no question with supporting facts to score")
    nodes = corpus_nodes(titles, texts)
    titles_of = {n.node_id: t for n, t in zip(nodes, titles)}
    bb = load_backbone(args.model, args.dtype) if any(s not in FIRST_STAGE_ROWS for s in systems) else None
    if bb is not None:
        bb.parts_graphs.enabled = not args.eager
    # resolved (and checked: a bad --depth fails here, not after the rows) before any row runs
    settings = pipeline_settings(bb, args) if any(s in PIPELINE_METHODS for s in systems) else None
    from endo_retrieval.index import passages
    from endo_retrieval.methods import pipeline

    rows, shared, batched, stems = [], {}, pipeline.BATCHED_READS, passages.STEMS
    pipeline.BATCHED_READS, passages.STEMS = not args.plain_reads, not args.unstemmed
    try:
        for name in systems:
            try:
                rows.append(measure(make_system(name, args, bb), nodes, items, titles_of, shared, bb))
            except Exception as err:  # noqa: BLE001 - one row that cannot run must not lose the others
                logger.warning("%s: skipped: %s", name, err)
                rows.append({"system": name, "n": 0, "skipped": f"{type(err).__name__}: {err}"})
    finally:
        pipeline.BATCHED_READS, passages.STEMS = batched, stems
    reference = pick_reference(args.reference, rows)
    gold_counts = [len(gold_titles(it)) for it in items]
    add_intervals(rows, gold_counts, reference, args.seed, question_types(items))
    result = {"schema": SCHEMA, "config": run_config(args, bb, settings, systems, reference, len(nodes), items,
                                                     gold_counts, no_gold, time.perf_counter() - wall),
              "rows": [order_keys(r) for r in rows]}
    write_outputs(result, out)
    for row in rows:
        if "skipped" in row:
            print(f"skipped: {row['system']}: {row['skipped']}", file=sys.stderr)
    print(out.with_suffix(".md").read_text(encoding="utf-8"))
    print(f"wrote {out} and, beside it, {out.with_suffix('.md').name}")
    return 0


def run_config(args, bb, settings, systems, reference, n_paragraphs, items, gold_counts, no_gold, wall_s) -> dict:
    return {"model": bb.model_id if bb else None, "model_hash": bb.model_hash if bb else None,
            "data": str(args.data), "limit": args.limit, "seed": args.seed, "systems": systems,
            "reference": reference, "candidates": args.candidates, "choice_batch_size": args.choice_batch_size,
            "top": TOP, "ks": list(KS), "bootstrap": {"resamples": RESAMPLES, "level": 0.95},
            "corpus_paragraphs": n_paragraphs, "n_questions": len(items), "embedder": "all-MiniLM-L6-v2",
            "device": str(bb.device) if bb else "cpu", "reads": "plain" if args.plain_reads else "batched",
            "cuda_graphs": bool(bb and bb.device.type == "cuda" and not args.eager),
            "dtype": str(bb.dtype).removeprefix("torch.") if bb else None,
            "stage1_terms": "words" if args.unstemmed else "stems",
            "pipeline": settings,
            "question_ids": [it["_id"] for it in items],
            "gold_per_question": gold_counts, "left_out_no_gold": no_gold, "wall_s": round(wall_s, 1),
            "notes": ["gold: the distinct titles of a question's supporting facts; a paragraph counts once, at its "
                      "first (best) hit",
                      "index_s: building the index plus one warm-up question; the MiniLM rows share one vector "
                      "index and each reports its build",
                      "latency_ms.query: the whole question; other keys are the stages a system reports "
                      "(first_stage and rerank for the rerankers; the endo pipelines: bm25, then heads: the model's "
                      "read of the candidates, itself read, question and hop2, each waited for on CUDA)",
                      "forwards_per_question: calls of the model's decoder per question (mean); cuda_per_question: "
                      "torch.profiler's count over the first questions, each asked once more first (the steady "
                      "state: graphs replayed, not captured): launches (host calls that start a kernel or a captured "
                      "graph), kernels run, memory copies",
                      "llmrerank rows: LLMRerank keeps only the paragraphs it parses from the model's answer; "
                      "where that is fewer than the top, the first stage's order fills the rest, and the row's "
                      "note says for how many questions",
                      "intervals: 95% percentile bootstrap over questions; diff: row minus reference, paired "
                      "(the same resampled questions for both)"]}


def order_keys(row: dict) -> dict:
    """The row's keys in reading order, the bulky per-question lists last."""
    head = ["system", "n", "skipped", *METRICS, "diff", "by_type", "latency_ms", "forwards_per_question",
            "cuda_per_question", "index_s", "note", "per_question"]
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
    names = [m.replace("mrr", "MRR").replace("ndcg", "nDCG") for m in METRICS]
    lines = [f"Corpus retrieval: {cfg['corpus_paragraphs']} paragraphs of `{cfg['data']}` pooled, "
             f"{cfg['n_questions']} questions, model {cfg['model'] or '–'}; wall time {cfg['wall_s']} s. "
             f"Cells: mean [95% bootstrap interval over questions, {cfg['bootstrap']['resamples']} resamples, "
             f"seed {cfg['seed']}].", ""]
    head = ["system", "n", *names, "query p50 / p95 ms", "index s"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in measured:
        q = r["latency_ms"]["query"]
        lines.append(f"| {r['system']} | {r['n']} | " + " | ".join(cell(r.get(m)) for m in METRICS)
                     + f" | {q['p50']:.1f} / {q['p95']:.1f} | {r['index_s']:.2f} |")
    counted = [r for r in measured if "forwards_per_question" in r]
    if counted:
        lines += ["", f"Model work per question ({cfg.get('reads', 'batched')} reads):", "",
                  "| system | forwards | CUDA launches | CUDA kernels | copies |", "|---|---|---|---|---|"]
        for r in counted:
            cuda = r.get("cuda_per_question") or {}
            lines.append(f"| {r['system']} | {r['forwards_per_question']:g} | "
                         + " | ".join(f"{cuda[k]:g}" if k in cuda else "–" for k in ("launches", "kernels", "copies"))
                         + " |")
    if cfg["reference"]:
        lines += ["", f"Difference to `{cfg['reference']}` (row minus reference; paired bootstrap 95% interval):",
                  "", "| system | " + " | ".join(f"Δ {n}" for n in names) + " |", "|" + "---|" * (len(names) + 1)]
        lines += [f"| {r['system']} | " + (" | ".join(["reference"] * len(METRICS)) if r["system"] == cfg["reference"]
                                           else " | ".join(cell(r["diff"].get(m), signed=True) for m in METRICS)) + " |"
                  for r in measured]
    typed = [r for r in measured if r.get("by_type")]
    if typed:
        ks = [f"recall@{k}" for k in KS]
        lines += ["", "Recall by question type" + (f" (Δ: minus `{cfg['reference']}`, paired)" if cfg["reference"]
                                                   else "") + ":", "",
                  "| system | type | n | " + " | ".join(ks) + " | " + " | ".join(f"Δ {k}" for k in ks) + " |",
                  "|" + "---|" * (3 + 2 * len(ks))]
        for r in typed:
            for kind, v in r["by_type"].items():
                diffs = [cell(v["diff"][k], signed=True) if "diff" in v and r["system"] != cfg["reference"] else "–"
                         for k in ks]
                lines.append(f"| {r['system']} | {kind} | {v['n']} | " + " | ".join(cell(v[k]) for k in ks) + " | "
                             + " | ".join(diffs) + " |")
    staged = [(r["system"], s, v) for r in measured for s, v in r["latency_ms"].items() if s != "query"]
    if staged:
        lines += ["", "Latency by stage:", "", "| system | stage | p50 ms | p95 ms |", "|---|---|---|---|"]
        lines += [f"| {name} | {s} | {v['p50']:.1f} | {v['p95']:.1f} |" for name, s, v in staged]
    lines += [""] + [f"- skipped {r['system']}: {r['skipped']}" for r in rows if "skipped" in r]
    lines += [f"- {r['system']}: {r['note']}" for r in measured if r.get("note")]
    lines += [f"- {note}" for note in cfg["notes"]]
    return "\n".join(lines) + "\n"
