"""Past one machine, on Ray: index segments built by workers, an index opened as shards, ILRe's chunks over GPUs.

Ray (`pip install endo-retrieval[ray]`) starts and places the processes and moves the bytes; this module only says
what each process does. Call `ray.init()` first: with no address it starts a local cluster; `ray start --head` on
one node and `ray start --address=HEAD:6379` on the others make a cluster that `ray.init(address="auto")` joins.

* `RayIndexer`: one `ModelWorker` per accelerator (or per CPU slot where there is none) loads the backbone and
  SAEs once and indexes a contiguous share of the documents into a segment of the usual format, sent back as
  bytes; the driver writes the segments and commits them with a manifest written last (`segments.py`).
* `ShardedIndex`: a committed index opened as shards held by actors (plain actors: a query is one fan-out and one
  merge, which needs no HTTP layer; Ray Serve can wrap `ShardedIndex.search` as a deployment unchanged). A
  question is encoded once by the driver; every shard scores it with the whole index's statistics ([S3 Eq. 10]'s
  feature frequencies, BM25's idf and mean length) and streams its density peaks; the driver merges the streams by
  (density, position) and fills the budget as one index does, so spans and ranking equal the union's.
* `ilre_scores`: the chunks of one long context spread over workers (each chunk needs only its sink and window
  frame); [ILRe Eq. 5]'s softmax over the whole context is merged with a per-part logsumexp, then [ILRe Alg. 1]
  allocates.
* the default pipeline `endo` over shards and readers: `distributed_pipeline.py` (`ReaderPool`), whose stage 1
  runs on these shards (`Shard.passage_candidates`) with the whole index's BM25 statistics.
"""
from __future__ import annotations

import contextlib
import heapq
import math
import os
import shutil
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from endo_retrieval.index import segments
from endo_retrieval.index.engine import CHUNK
from endo_retrieval.methods import METHODS, SEARCH_METHODS, check_search_method, method_class
from endo_retrieval.methods.s3 import interleave, peak_width, scored_spans
from endo_retrieval.methods.search import Document, EndoIndex
from endo_retrieval.files import writer_lock
from endo_retrieval.index.inverted import FeatureIndex
from endo_retrieval.index.passages import Passages, best_part, part_text
from endo_retrieval.core import Span, check_budget
from endo_retrieval.scoring.select import QA_KERNEL, density, enclosing, ranked_peaks, runs
from endo_retrieval.model.backbone import Backbone, as_text
from endo_retrieval.model.sae import SAEBank, SAEError
from endo_retrieval.methods.ilre import dca_key_positions
from endo_retrieval.scoring.attention import ContextLogits
from endo_retrieval.scoring.bm25 import SentenceBM25, words

PEAK_BATCH = 64  # peaks a shard sends per signal and round trip (a budget of 512 tokens takes ~10-30)


def ray_cluster():
    """The `ray` module, joined to a cluster: the one `ray.init` or `connect` joined, else a new local one."""
    try:
        import ray
    except ImportError:
        raise ImportError("Ray is not installed: pip install 'endo-retrieval[ray]'") from None
    if not ray.is_initialized():
        ray.init()
    return ray


def connect(address: str | None = None):
    """Join the Ray cluster at `address` ("auto": the one `ray start` made on this node; "HEAD:6379"), or start a
    local one when None. ValueError (printed by the CLI) when Ray is missing."""
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray: pip install 'endo-retrieval[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)
    return ray


class BuildError(RuntimeError):
    """A worker failed while building; nothing was committed, and the index that was there is unchanged."""


@dataclass
class ModelRecipe:
    """How a worker loads the driver's model and SAEs itself (weights are read once per worker, never shipped):
    `model` a folder or GGUF file (None: the default model), `sae` an SAE folder (None: the shipped SAEs; None
    where the model has none, which serves `endo` and `bm25`: an S3 build then fails with what to run)."""

    model: str | None = None
    sae: str | None = None

    def __call__(self):
        backbone = Backbone(self.model) if self.model else Backbone.default()
        if self.sae:
            return backbone, SAEBank.load(self.sae, backbone.model_hash, backbone.device)
        try:
            return backbone, SAEBank.for_backbone(backbone)
        except SAEError:
            return backbone, None


class ModelWorker:
    """One process holding the backbone and SAEs (`setup()` builds them): index shares, ILRe chunk parts."""

    def __init__(self, setup: Callable):
        self.backbone, self.saes = setup()

    def pid(self) -> int:
        return os.getpid()

    def index(self, docs: list[Document], settings: dict) -> dict[str, bytes]:
        part = EndoIndex(self.backbone, saes=self.saes, first_stage="bm25", **settings)  # shards hold BM25 only
        part.add_documents(docs)
        return segments.as_files(part)

    # ILRe: keys of the context chunks [start, end) at l_R, kept here between the calls of one context
    def ilre_prefill(self, context_ids: np.ndarray, query_ids: np.ndarray, start: int, end: int, s: dict):
        length, last = len(context_ids), end >= len(context_ids)
        ids = np.concatenate([context_ids, query_ids]) if last else context_ids[:end]
        keys, key_pos, queries, query_pos = [], [], [], []
        for ch in self.backbone.stream(ids, [s["layer"]], chunk_size=s["chunk_size"], mode="sink_window",
                                       sink=s["sink"], window=s["window"], capture=("k", "q") if last else ("k",),
                                       split_at=length, positions=s["positions"], start=start):
            if ch.start < length:
                keys.append(ch.keys[s["layer"]])
                key_pos.append(ch.rope_positions.cpu())
            else:
                queries.append(ch.queries[s["layer"]])
                query_pos.append(ch.rope_positions.cpu())
        key_pos = torch.cat(key_pos)
        if s["positions"] == "dca":  # [ILRe Eq. 7] moves each chunk's keys by its distance to the chunk before the last
            key_pos = dca_key_positions(torch.arange(length), list(range(0, length, s["chunk_size"])))[start:end]
        self._part = (torch.cat(keys, dim=1), key_pos)
        return (torch.cat(queries, dim=1).cpu(), torch.cat(query_pos)) if last else None

    def ilre_logsumexp(self, queries: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
        keys, key_pos = self._part
        self._logits = ContextLogits(keys, queries.to(self.backbone.device), key_pos, query_positions,
                                     self.backbone.apply_rope)
        return self._logits.logsumexp().cpu()

    def ilre_probabilities(self, lse: torch.Tensor) -> np.ndarray:
        out = self._logits.probabilities(lse)
        del self._part, self._logits
        return out


def start_workers(n: int | None = None, setup: Callable | None = None, kind: type | None = None, *args,
                  max_concurrency: int = 1) -> list:
    """`n` actors of `kind` (default ModelWorker; built as kind(setup, *args)), by default one per GPU in the
    cluster, else one per CPU; one GPU each when the cluster has GPUs, else one CPU each. `max_concurrency` > 1:
    calls run in threads (the backbone's lock keeps its model calls one at a time)."""
    ray = ray_cluster()
    gpus = int(ray.cluster_resources().get("GPU", 0))
    n = n or gpus or int(ray.cluster_resources().get("CPU", 1))
    resources = {"num_gpus": 1} if gpus else {"num_cpus": 1}
    actor = ray.remote(max_restarts=0)(kind or ModelWorker)
    return [actor.options(**resources, max_concurrency=max_concurrency).remote(setup or ModelRecipe(), *args)
            for _ in range(n)]


def spread(items: Iterable, slots: Sequence, submit: Callable) -> Iterator[tuple[object, object]]:
    """`submit(slot, item)` (an actor call; its ref) for every item, each on a free slot; yields (item, ready ref)
    in the order the calls finish, and frees the slot when the consumer asks for the next one. A slot is an actor,
    listed once per call it may run at a time. Calls still pending when the consumer stops early (an error) are
    cancelled."""
    ray = ray_cluster()
    todo, idle, pending = deque(items), deque(slots), {}
    try:
        while todo or pending:
            while todo and idle:
                item, slot = todo.popleft(), idle.popleft()
                pending[submit(slot, item)] = (item, slot)
            (ready,), _ = ray.wait(list(pending), num_returns=1)
            item, slot = pending.pop(ready)
            yield item, ready
            idle.append(slot)
    finally:
        for ref in pending:
            ray.cancel(ref)  # an actor's call cannot be forced; a pending one is dropped, a running one flagged


def shares(docs: Sequence[Document], n: int) -> list[list[Document]]:
    """Contiguous runs of `docs` (their order is the index's position order), about equal in characters."""
    n = max(1, min(n, len(docs)))
    ends = np.cumsum([len(d.text) for d in docs])
    cuts = np.searchsorted(ends, ends[-1] * np.arange(1, n) / n, side="left") + 1
    cuts = np.unique(np.clip(cuts, 1, len(docs) - 1)) if len(docs) > 1 else []
    return [list(part) for part in np.split(np.array(docs, dtype=object), cuts) if len(part)]


class RayIndexer:
    """Builds an index directory from documents on Ray workers; `build(..., append=True)` adds to the index there.
    Identical postings to `EndoIndex.add_documents` over the same documents in the same order (a test)."""

    def __init__(self, workers: list | int | None = None, setup: Callable | None = None, method: str = "s3-hybrid",
                 chunk_size: int = CHUNK, stop_freq: int | float | None = 5000, prune: float | None = None,
                 shares_per_worker: int = 1):
        self.workers = workers if isinstance(workers, list) else start_workers(workers, setup)
        self.settings = {"method": check_search_method(method), "chunk_size": chunk_size, "stop_freq": stop_freq,
                         "prune": prune}
        self.shares_per_worker = shares_per_worker

    def build(self, directory: str | os.PathLike, docs: Sequence[Document | str], append: bool = False) -> Path:
        """Index `docs` into DIR (replacing the index there, or after it with `append`), holding the folder's writer
        lock from reading the old manifest to writing the new one. BuildError when a worker fails or dies."""
        with writer_lock(directory):
            return self._build(Path(directory), docs, append)

    def _build(self, directory: Path, docs: Sequence[Document | str], append: bool) -> Path:
        ray = ray_cluster()
        (directory / segments.SEGMENTS).mkdir(parents=True, exist_ok=True)
        old = segments.listed(directory) if append else []
        docs = [d if isinstance(d, Document) else Document(f"doc-{i}", d) for i, d in enumerate(docs)]
        if not docs:
            raise ValueError("No documents given; pass at least one Document or text.")
        seen = {d for p in old for d in p["documents"]}
        for d in docs:
            if d.doc_id in seen:
                raise ValueError(f"Duplicate document id {d.doc_id!r}; ids must be unique (remove the old one first).")
            seen.add(d.doc_id)
        todo = enumerate(shares(docs, len(self.workers) * self.shares_per_worker))
        written = {}
        try:
            with contextlib.closing(spread(todo, self.workers, lambda w, job: w.index.remote(job[1], self.settings))
                                    ) as finished:
                for (i, share), ready in finished:
                    try:
                        written[i] = segments.write(directory, ray.get(ready))
                    except Exception as e:
                        raise BuildError(f"a worker failed indexing documents {share[0].doc_id!r}.."
                                         f"{share[-1].doc_id!r} ({type(e).__name__}: {_first_line(e)}); nothing was "
                                         f"committed and the index in {directory} is as it was") from e
        except BaseException:
            for entry in written.values():
                shutil.rmtree(directory / segments.SEGMENTS / entry["name"], ignore_errors=True)
            raise
        return segments.commit(directory, old + [written[i] for i in sorted(written)])


def _first_line(e: BaseException) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    return lines[-1] if lines else ""


# ---- sharded queries -------------------------------------------------------------------------------------------

class _WholeIndexStats(FeatureIndex):
    """A shard's postings scored with the whole index's freq(f) and token counts ([S3 Eq. 10]'s IDF, stop features)."""

    def freq(self, layer: int) -> np.ndarray:
        return self.totals["freq"][layer]

    def n_tokens(self, layer: int) -> int:
        return self.totals["n_tokens"][layer]


def _okapi_stats(postings) -> dict:
    """What rank-bm25 needs of one shard to compute the whole corpus's idf and mean length: document frequencies
    in first-seen order (its idf average sums in that order), the number of documents and of words."""
    df = np.diff(postings.indptr)
    return {"df": {t: int(df[r]) for t, r in postings.terms.items()}, "n": postings.okapi.corpus_size,
            "words": int(sum(postings.okapi.doc_len)), "epsilon": postings.okapi.epsilon}


def _okapi_totals(parts: list[dict]) -> dict:
    from rank_bm25 import BM25Okapi

    df: dict[str, int] = {}
    for p in parts:  # shards in position order: first-seen order of the union
        for t, c in p["df"].items():
            df[t] = df.get(t, 0) + c
    whole = BM25Okapi.__new__(BM25Okapi)
    whole.corpus_size, whole.epsilon, whole.idf = sum(p["n"] for p in parts), parts[0]["epsilon"], {}
    whole._calc_idf(df)  # rank-bm25's own code, on the union's counts
    return {"idf": whole.idf, "avgdl": sum(p["words"] for p in parts) / whole.corpus_size}


def _use_okapi_totals(postings, whole: dict) -> None:
    """Score one shard's BM25 postings with the whole corpus's idf and mean length (`_okapi_totals`)."""
    okapi = postings.okapi
    okapi.idf, okapi.avgdl = whole["idf"], whole["avgdl"]
    doc_len = np.asarray(okapi.doc_len, dtype=np.float64)
    postings.norm = okapi.k1 * (1 - okapi.b + okapi.b * doc_len / okapi.avgdl)


class Shard:
    """Some of an index's segments in one process, answering with the whole index's statistics: S3 and BM25 over
    sentences (`open`, `more`), and the `endo` pipeline's stage 1, BM25 over passages (`passage_candidates`)."""

    def __init__(self, directory: str, parts: list[dict], shift: int, prune: float | None):
        self.index, self.corpus = segments.load_parts(directory, parts)
        self.shift, self.prune, self.streams, self._bm25, self._passages = shift, prune, {}, None, None

    @property
    def bm25(self):
        if self._bm25 is None:
            self._bm25 = SentenceBM25.build(self.corpus)
        return self._bm25

    @property
    def passages(self):
        if self._passages is None:
            self._passages = Passages.build(self.corpus)
        return self._passages

    def stats(self) -> dict:
        return {"freq": {l: self.index.freq(l) for l in self.index.layers},
                "n_tokens": {l: self.index.n_tokens(l) for l in self.index.layers},
                "bm25": {k: _okapi_stats(getattr(self.bm25, k)) for k in ("sentences", "windows")}
                | {"passages": _okapi_stats(self.passages.bm25)}}

    def use_totals(self, totals: dict) -> None:
        self.index.__class__, self.index.totals = _WholeIndexStats, totals
        for k in ("sentences", "windows"):
            _use_okapi_totals(getattr(self.bm25, k), totals["bm25"][k])
        _use_okapi_totals(self.passages.bm25, totals["bm25"]["passages"])

    def passage_candidates(self, stage1, question: str, where=None) -> list[tuple]:
        """The `endo` pipeline's stage 1 over this shard's passages, scored with the whole index's BM25 statistics:
        its best `stage1.depth` as (-score, global start, passage here, what the model reads of it), best first.
        `stage1`: the reader's EndoPipeline without its model (stage 1 and `read_texts` read only its settings)."""
        top, scores = stage1.candidates(self.corpus, self.passages, question, where=where)
        scores = scores["bm25"]
        texts = stage1.read_texts(self.corpus, self.passages, top, question)
        starts = self.passages.starts[top] + self.shift
        return list(zip((-scores).tolist(), starts.tolist(), top.tolist(), texts))

    def passage_spans(self, picks: list[int], question: str, max_tokens: int | None) -> list[tuple]:
        """The passages `picks` (indices here) as `EndoPipeline.search` returns them: each whole, or cut to its best
        part (`best_part`) of `max_tokens`; (start, end, char start, char end, text, doc id, metadata, whole
        document), positions global."""
        corpus, passages, q, out = self.corpus, self.passages, set(words(question)), []
        for i in picks:
            a, b = int(passages.starts[i]), int(passages.ends[i])
            parts = [(a, b)] if max_tokens is None else best_part(corpus, passages.sentences, a, b, q, max_tokens)
            doc_id, c0, _, _ = corpus.span_text(parts[0][0], parts[0][1])
            _, _, c1, _ = corpus.span_text(parts[-1][0], parts[-1][1])
            doc = corpus.doc(doc_id)
            text = part_text(corpus, parts) if len(parts) > 1 else doc.text[c0:c1]
            out.append((parts[0][0] + self.shift, parts[-1][1] + self.shift, c0, c1, text, doc_id, doc.metadata,
                        (parts[0][0], parts[-1][1]) == (doc.start, doc.end)))
        return out

    def open(self, qid: str, features, question: str, signals: list[str], kernel: int) -> dict:
        """Score the question here, and start one peak stream per signal; returns their first batches."""
        n, bounds = self.corpus.n_positions, self.corpus.segment_bounds()
        sentences = self.corpus.sentence_starts()
        streams = {}
        for name in signals:
            scores = self.index.score(features, n_positions=n, prune=self.prune) if name == "s3" else \
                self.bm25.token_scores(question)
            width = peak_width(name, kernel)
            curve = density(scores, width, bounds)
            streams[name] = self._records(ranked_peaks(curve, width, bounds), sentences, bounds, n, curve)
        self.streams[qid] = streams
        return self.more(qid)

    def _records(self, peaks, sentences, bounds, n, curve) -> Iterator[tuple]:
        """(-density, candidate, centre, sentence start, sentence end, document start, document end), global."""
        for c, p in peaks:
            start, end = enclosing(sentences, p, n)
            doc_start, doc_end = enclosing(bounds, p, n)
            yield (-float(curve[c]), c, p, max(start, doc_start), min(end, doc_end), doc_start, doc_end)

    def more(self, qid: str, names: list[str] | None = None, batch: int = PEAK_BATCH) -> dict:
        out = {}
        for name in names or list(self.streams[qid]):
            got = [r for _, r in zip(range(batch), self.streams[qid][name])]
            out[name] = ([(r[0],) + tuple(v + self.shift for v in r[1:]) for r in got], len(got) < batch)
        return out

    def close(self, qid: str) -> None:
        self.streams.pop(qid, None)

    def span(self, a: int, b: int) -> tuple:
        doc_id, c0, c1, text = self.corpus.span_text(a - self.shift, b - self.shift)
        return doc_id, c0, c1, text, self.corpus.doc(doc_id).metadata


class ShardedIndex:
    """A committed index (`RayIndexer`) opened as `shards` actors, each holding a contiguous run of its segments.
    `select` and `search` answer as `EndoIndex.load(directory)` would, spans and ranking alike (a test), for the
    methods the shards answer alone (`methods`); `endo` needs the model's readers: `ReaderPool(this index)`.
    `backbone`, `saes`: the question's encoder for S3, loaded only for an index that holds S3 postings."""

    def __init__(self, directory: str | os.PathLike, shards: int = 2, backbone=None, saes=None,
                 int8_queries: bool | None = None):
        ray = ray_cluster()
        parts = segments.listed_committed(directory)
        if not parts:
            raise ValueError(f"{directory} holds no index of segments; build it with RayIndexer "
                             "(`endo index --ray`), or open a plain index with EndoIndex.load")
        head = parts[0]["header"]
        self.directory, self.method, self.prune = Path(directory), head["method"], head.get("prune")
        self.model, self.model_hash = head["model"], head["model_hash"]
        self.encoder = None  # the question's encoder for S3: the model and SAEs, no postings (encoded once, here)
        if METHODS[self.method].saes:
            self.encoder = EndoIndex(backbone, self.method, saes=saes, chunk_size=head["chunk_size"],
                                     prune=self.prune, int8_queries=int8_queries)
            if self.encoder.backbone.model_hash != self.model_hash:
                raise ValueError(f"The index in {directory} was built with model {self.model}, not with the loaded "
                                 f"{self.encoder.backbone.model_id}; load that model.")
        runs_ = shares_of(parts, shards)
        shifts = np.cumsum([0] + [sum(p["positions"] for p in run) for run in runs_])[:-1]
        actor = ray.remote(Shard)
        self.shards = [actor.remote(str(directory), run, int(shift), self.prune) for run, shift in zip(runs_, shifts)]
        stats = ray.get([s.stats.remote() for s in self.shards])
        layers = list(stats[0]["freq"])
        totals = {"freq": {l: sum(s["freq"][l] for s in stats) for l in layers},
                  "n_tokens": {l: sum(s["n_tokens"][l] for s in stats) for l in layers},
                  "bm25": {k: _okapi_totals([s["bm25"][k] for s in stats])
                           for k in ("sentences", "windows", "passages")}}
        ray.get([s.use_totals.remote(totals) for s in self.shards])

    @property
    def methods(self) -> tuple[str, ...]:
        """The methods the shards answer alone: S3's where the index holds its postings, and BM25."""
        return tuple(m for m in SEARCH_METHODS if not METHODS[m].passages
                     and (METHODS[self.method].saes or not METHODS[m].saes))

    def check_method(self, method: str | None) -> str:
        """`method` (None: the index's own) when the shards answer it alone, else a ValueError saying what does."""
        method = check_search_method(method or self.method)
        if METHODS[method].passages:
            raise ValueError(f"{method!r} ranks passages with the model: open readers over this index, "
                             "ReaderPool(index) (endo_retrieval.distributed_pipeline), and search there.")
        if method not in self.methods:
            raise ValueError(f"This index was built with method={self.method!r} and holds no S3 feature postings, so "
                             f"it cannot search with {method!r}; it searches with {', '.join(self.methods)}.")
        return method

    def select(self, question: str, budget: int, method: str | None = None, kernel: int = QA_KERNEL,
               s3_share: float = 0.5) -> list[Span]:
        """`EndoIndex.select` over the shards (lead_tail 0, as `search` uses it)."""
        ray = ray_cluster()
        check_budget(budget)
        method, question, qid = self.check_method(method), as_text(question), uuid.uuid4().hex
        signals = list(method_class(method).signals)  # in the order the method fuses them
        features = self.encoder.query_features(question) if "s3" in signals else None
        first = ray.get([s.open.remote(qid, features, question, signals, kernel) for s in self.shards])
        try:
            records: dict[int, tuple] = {}
            streams = {name: self._merged(qid, name, [f[name] for f in first], records) for name in signals}
            taken: list[tuple[str, int]] = []
            peaks = interleave(streams, taken, s3_share, lambda p: records[p][1])  # the sentence's start
            spans = _fill(peaks, records, budget)
        finally:
            for s in self.shards:
                s.close.remote(qid)
        texts = ray.get([self.shards[self._owner(records, a)].span.remote(a, b) for a, b in spans])
        return scored_spans(spans, texts, taken)

    def search(self, question: str, k: int = 4, budget: int | None = None, method: str | None = None,
               where: Callable[[dict], bool] | None = None) -> list[Span]:
        """`EndoIndex.search` for the methods the shards answer alone (`methods`)."""
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"k must be a whole number >= 1, got {k!r}.")
        spans = [s for s in self.select(question, budget or 128 * k, method) if where is None or where(s.metadata)]
        return sorted(spans, key=lambda s: -s.score)[:k]

    def _merged(self, qid: str, name: str, firsts: list, records: dict) -> Iterator[int]:
        """One signal's peaks over all shards, in the order NMS takes them over the union: (density desc, position
        asc) of their candidates; a shard whose batch runs out is asked for the next one."""
        buffers = [(deque(got), done) for got, done in firsts]
        heap: list[tuple] = []

        def refill(i: int) -> None:
            got, done = buffers[i]
            while not got and not done:
                more, done = ray_cluster().get(self.shards[i].more.remote(qid, [name]))[name]
                got.extend(more)
                buffers[i] = (got, done)
            if got:
                heapq.heappush(heap, (got[0][0], got[0][1], i))

        for i in range(len(buffers)):
            refill(i)
        while heap:
            *_, i = heapq.heappop(heap)
            rec = buffers[i][0].popleft()
            records[rec[2]] = rec[2:] + (i,)  # centre -> (centre, sentence start, end, doc start, doc end, shard)
            refill(i)
            yield rec[2]

    def _owner(self, records: dict, a: int) -> int:
        return next(r[5] for r in records.values() if r[3] <= a < r[4])


def shares_of(parts: list[dict], n: int) -> list[list[dict]]:
    """Contiguous runs of segments, about equal in tokens (at most one run per segment)."""
    n = max(1, min(n, len(parts)))
    ends = np.cumsum([p["tokens"] for p in parts])
    cuts = np.unique(np.clip(np.searchsorted(ends, ends[-1] * np.arange(1, n) / n) + 1, 1, len(parts) - 1))
    return [list(r) for r in np.split(np.array(parts, dtype=object), cuts if len(parts) > 1 else []) if len(r)]


def _fill(peaks: Iterator[int], records: dict, budget: int) -> list[tuple[int, int]]:
    """`select.spans_from_peaks` over the merged peaks, with sentences known only where peaks fell: each peak's
    sentence (clipped to its document) is added, the one that overflows trimmed around the peak to what is left."""
    covered, bounds, left = set(), set(), budget
    for p in peaks:
        _, start, end, doc_start, doc_end, _ = records[p]
        bounds |= {doc_start, doc_end}
        new = np.array([t for t in range(start, end) if t not in covered], dtype=np.int64)
        if len(new) > left:
            new = new[np.argsort(np.abs(new - p), kind="stable")[:left]]
        covered.update(new.tolist())
        left -= len(new)
        if left <= 0:
            break
    return runs(np.array(sorted(covered), dtype=np.int64), breaks=np.array(sorted(bounds), dtype=np.int64))


# ---- ILRe over several workers ---------------------------------------------------------------------------------

def ilre_scores(ilre, context_ids: np.ndarray, query_ids: np.ndarray, workers: list) -> np.ndarray:
    """`ILRe.scores` (A^C at l_R, [ILRe Eq. 4-5]) with the context's chunks split into contiguous parts, one per worker
    (each holding the same model as `ilre.backbone`). Each part streams its chunks behind their sink and window
    frames; the last also streams the query part. [ILRe Eq. 5]'s softmax runs over the whole context: every part's
    logsumexp is combined with logaddexp before each part turns its logits into probabilities."""
    ray = ray_cluster()
    ilre.check_query(query_ids)
    context_ids, query_ids = np.asarray(context_ids), np.asarray(query_ids)
    n_chunks = math.ceil(len(context_ids) / ilre.chunk_size)
    cuts = [round(n_chunks * i / len(workers)) * ilre.chunk_size for i in range(len(workers) + 1)]
    parts = [(a, min(b, len(context_ids))) for a, b in zip(cuts, cuts[1:]) if a < min(b, len(context_ids))]
    workers = workers[:len(parts)]
    settings = {"layer": ilre.layer, "sink": ilre.sink, "window": ilre.window, "chunk_size": ilre.chunk_size,
                "positions": ilre.positions}
    ids = ray.put(context_ids)
    *_, (queries, query_positions) = ray.get([w.ilre_prefill.remote(ids, query_ids, a, b, settings)
                                              for w, (a, b) in zip(workers, parts)])
    lse = None
    for part in ray.get([w.ilre_logsumexp.remote(queries, query_positions) for w in workers]):
        lse = part if lse is None else torch.logaddexp(lse, part)
    return np.concatenate(ray.get([w.ilre_probabilities.remote(lse) for w in workers]))


def ilre_select(ilre, context_ids: np.ndarray, query_ids: np.ndarray, budget: int, workers: list) -> np.ndarray:
    """`ILRe.select` with the prefill spread over `workers`: [ILRe Alg. 1] on the merged A^C."""
    if len(context_ids) <= budget:
        return np.arange(len(context_ids), dtype=np.int64)
    return ilre.allocate(ilre_scores(ilre, context_ids, query_ids, workers), budget)
