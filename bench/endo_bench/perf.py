"""`endo bench perf`: speed and memory of the endogenous index, side by side with what it is built on.

Sections (`--sections`, each measured in one run on the same text):
* index  - tokens/s of real indexing (EndoIndex.add_documents: tokenise, early-exit stream, SAE encode, postings,
           ready for queries) beside the bare early-exit forward to the deepest SAE layer, same chunks; saved bytes.
* memory - peak accelerator memory and host RSS versus streamed length (S3 section 3.4: memory O(1) in length).
* query  - EndoIndex.select latency (question forward, [S3 Eq. 9] scores, BM25, spans) and each of those stages alone
           (`stage_*` rows, with their share of the query), and the `endo` pipeline's first stage (BM25 over
           passages) alone, versus corpus size; larger corpora are copies of one indexed text (`tile_index`). On
           the smallest corpus, the whole `endo` pipeline per question: latency, its stages, the model's forwards
           and, on CUDA, the launches and kernels of a few warm questions (`endo_pipeline_rows`).
* e2e    - index or compress, then generate, per question: full / ilre / s3-hybrid (perf_e2e.py).
* ttft   - time to first token and peak memory, full versus ILRe, optionally on an 8B-shaped random model.
* scale  - 1 Ray worker against 2 in one run: indexing tokens/s, ILRe over several GPUs (perf_scale.py).
* ilre   - ILRe's stages at long lengths, chunks batched against one per forward (perf_ilre.py), optionally on the
           8B-shaped random model; asked for by name.
Rows follow the GUIDE contract (schema endo-bench-perf/1); FILE.md and one PNG per section go beside FILE.json.
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from endo_retrieval.cli.commands import int_list, model_argument
from endo_bench.measure import clock, length_label, peak_accel_mb, peak_rss_mb, questions_from, reset_peak, row

SCHEMA = "endo-bench-perf/1"
DEFAULT_SECTIONS = ("index", "memory", "query", "e2e", "ttft")
SECTIONS = DEFAULT_SECTIONS + ("scale", "ilre")  # asked for by name: Ray workers (perf_scale.py), ILRe's stages
DEFAULT_TEXT = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "pg_essays"
# defaults per device: (index tokens, memory lengths, corpus sizes, e2e lengths, ttft lengths)
DEFAULTS = {"cuda": (262144, [8192, 65536, 262144, 1048576], [65536, 262144, 1048576, 4194304],
                     [8192, 32768, 131072], [8192, 32768, 131072]),
            "cpu": (16384, [4096, 16384], [16384, 65536], [4096], [2048, 4096, 8192])}
SCALE_TOKENS = {"cuda": 1048576, "cpu": 16384}  # scale section: tokens indexed, and ILRe's context
RSS_NOTE = "host RSS is the process maximum so far (lengths run in increasing order)"


# ---- timing and memory ------------------------------------------------------------------------------------------

def stream_throughput(backbone, ids, layer: int, chunk_size: int = 1024, mode: str = "independent") -> float:
    """Tokens per second of streaming `ids` and capturing the keys of `layer` (layers after it never run)."""
    list(backbone.stream(ids[:chunk_size], [layer], chunk_size=chunk_size, mode=mode))  # warm-up
    t = clock(backbone.device)
    touched = 0
    for chunk in backbone.stream(ids, [layer], chunk_size=chunk_size, mode=mode):
        touched = touched + chunk.keys[layer].sum()  # the consumer touches what it gets without a per-chunk sync,
    float(touched)  # as the indexer does
    return len(ids) / (clock(backbone.device) - t)


def memory_rows(backbone, ids, lengths, layer: int, chunk_size: int = 1024, mode: str = "independent") -> list[dict]:
    """Peak host RSS (max so far: lengths run in increasing order, so a flat curve means no growth) and peak
    accelerator memory for streaming the first n tokens of `ids`, for each n in `lengths`."""
    rows = []
    for n in sorted(lengths):
        if n > len(ids):
            raise ValueError(f"need {n} tokens of text, have {len(ids)}")
        reset_peak(backbone.device)
        t = time.perf_counter()
        for chunk in backbone.stream(ids[:n], [layer], chunk_size=chunk_size, mode=mode):
            chunk.keys[layer].sum().item()
        rows.append({"tokens": n, "seconds": time.perf_counter() - t, "peak_rss_mb": peak_rss_mb(),
                     "peak_accel_mb": peak_accel_mb(backbone.device)})
    return rows


# ---- text ---------------------------------------------------------------------------------------------------

@dataclass
class TextSource:
    """The benchmark text: one base text, repeated back to back when a length asks for more (noted in the rows)."""

    text: str  # ends in a paragraph break so copies join cleanly
    offsets: np.ndarray  # (n, 2) character span of each token of `text`
    origin: str
    repeat: bool = True

    @classmethod
    def load(cls, backbone, folder: str | None, repeat: bool = True, seed: int = 0) -> "TextSource":
        if folder is None and not DEFAULT_TEXT.is_dir():
            text, origin = generated_filler(seed), "generated filler (endo_retrieval.cli.demo.FILLER)"
        else:
            path = Path(folder) if folder else DEFAULT_TEXT
            files = sorted(path.glob("*.txt")) if path.is_dir() else []
            if not files:
                raise ValueError(f"--text {path}: no .txt files there; give a folder of plain-text files.")
            text, origin = "\n\n".join(f.read_text(encoding="utf-8", errors="replace").strip() for f in files), \
                str(path)
        text = text.strip() + "\n\n"
        return cls(text, backbone.encode(text).offsets, origin, repeat)

    @property
    def n_tokens(self) -> int:
        return len(self.offsets)

    def check(self, n: int) -> None:
        if n > self.n_tokens and not self.repeat:
            raise ValueError(f"{n} tokens asked for, but the text in {self.origin} holds {self.n_tokens} tokens; "
                             "give --text a folder with more text, ask for less, or drop --no-repeat.")

    def take(self, n: int) -> str:
        """About `n` tokens of text (the base text repeated as needed; re-tokenising a cut can differ by a token)."""
        self.check(n)
        copies, rest = divmod(n, self.n_tokens)
        return self.text * copies + (self.text[: self.offsets[rest - 1, 1]] if rest else "")

    def note(self, n: int) -> str:
        return f"text repeated {n / self.n_tokens:.1f}x" if n > self.n_tokens else ""


def generated_filler(seed: int = 0, sentences: int = 4096) -> str:
    """The demo's filler sentences in seeded order, eight to a paragraph (used when ../shared/data is absent)."""
    import random

    from endo_retrieval.cli.demo import FILLER

    rng = random.Random(seed)
    picked = [rng.choice(FILLER) for _ in range(sentences)]
    return "\n\n".join(" ".join(picked[i:i + 8]) for i in range(0, sentences, 8))


# ---- index and memory -------------------------------------------------------------------------------------------

def build_index(backbone, saes, text: str, chunk_size: int):
    """`text` indexed as one document, ready for queries: whatever the first query would otherwise pay for (a merge
    of small segments) is done here."""
    from endo_retrieval.methods.search import Document, EndoIndex

    index = EndoIndex(backbone, "s3-hybrid", saes=saes, chunk_size=chunk_size)
    index.add_documents([Document("perf", text)])
    for layer in index.index.layers:
        index.index.freq(layer)
    return index


def index_rows(backbone, saes, source: TextSource, n: int, chunk_size: int, rounds: int = 5) -> list[dict]:
    """Indexing beside the bare forward, `rounds` times alternating. The host's speed drifts between runs (the same
    256k build varied by a third from run to run), so the overhead is the median of the rounds' paired ratios, and
    throughputs are medians."""
    device, dev = backbone.device, backbone.device.type
    text = source.take(n)
    ids = backbone.encode(text).ids
    build_index(backbone, saes, source.take(min(n, chunk_size)), chunk_size)  # warm-up: SAE and postings paths
    bares, builds, tokenise_s = [], [], []
    for _ in range(rounds):
        t = clock(device)
        backbone.encode(text)
        tokenise_s.append(clock(device) - t)
        bares.append(stream_throughput(backbone, ids, max(saes.layers), chunk_size))
        t = clock(device)
        index = build_index(backbone, saes, text, chunk_size)
        builds.append(index.corpus.n_tokens / (clock(device) - t))
    bare, indexed, tokenize_s = float(np.median(bares)), float(np.median(builds)), float(np.median(tokenise_s))
    overhead = [b / i - 1 for b, i in zip(bares, builds)]
    from_text = [(len(ids) / i) / (len(ids) / b + t) - 1 for b, i, t in zip(bares, builds, tokenise_s)]
    with tempfile.TemporaryDirectory() as tmp:
        folder = index.save(Path(tmp) / "index")
        feature_bytes = (folder / "features" / "feature_index.bin").stat().st_size
        total_bytes = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    tokens, note = index.corpus.n_tokens, source.note(n)
    return [
        row("index", "index_tokens_per_s", "s3-index", n, indexed, "tok/s", dev, tokens=tokens, per_round=builds,
            note=f"add_documents: tokenise, stream, SAE encode, postings (ready for queries); median of {rounds}"
                 + (f"; {note}" if note else "")),
        row("index", "bare_forward_tokens_per_s", "bare-forward", n, bare, "tok/s", dev, tokens=tokens, per_round=bares,
            note=f"early exit at layer {max(saes.layers)}, keys touched, same chunks ({chunk_size}); median of "
                 f"{rounds}, alternating with the index builds"),
        row("index", "tokenize_tokens_per_s", "tokenizer", n, tokens / tokenize_s, "tok/s", dev, tokens=tokens),
        row("index", "index_overhead", "s3-index", n, float(np.median(overhead)), "ratio", dev, per_round=overhead,
            note="index time / bare forward time - 1, median over rounds (index includes tokenisation)"),
        row("index", "index_overhead_from_text", "s3-index", n, float(np.median(from_text)), "ratio", dev,
            per_round=from_text, note="the same with the bare forward also starting from the text: index time / "
            "(tokenise + bare forward) - 1"),
        row("index", "index_bytes_per_posting", "s3-index", n, feature_bytes / index.index.n_postings, "B/posting",
            dev, postings=index.index.n_postings),
        row("index", "index_bytes_per_token", "s3-index", n, feature_bytes / tokens, "B/token", dev,
            note="feature index file"),
        row("index", "index_bytes_per_token", "s3-index+corpus", n, total_bytes / tokens, "B/token", dev,
            note="whole saved folder: feature index, corpus map with the text, header"),
    ]


def memory_section(backbone, saes, source: TextSource, lengths: list[int], chunk_size: int, bar) -> list[dict]:
    device, dev = backbone.device, backbone.device.type
    no_accel = "no accelerator on this device" if dev != "cuda" else None
    rows = []
    ids = backbone.encode(source.take(max(lengths))).ids
    # once per process, not per length: the first eager matmul on the default stream allocates cuBLAS's workspace
    # (32 MiB on Hopper: measured inside the 256k build, it read as growth with length) and the first build captures the
    # chunk graphs; both happen here, before the peaks are read
    list(backbone.stream(ids[:16], [max(saes.layers)], chunk_size=16))
    build_index(backbone, saes, source.take(min(lengths)), chunk_size)
    for r in memory_rows(backbone, ids, lengths, max(saes.layers), chunk_size):  # bare first: lower RSS
        rows += [row("memory", "peak_accel_mb", "bare-forward", r["tokens"], r["peak_accel_mb"], "MiB", dev,
                     **({"note": no_accel} if no_accel else {})),
                 row("memory", "peak_rss_mb", "bare-forward", r["tokens"], r["peak_rss_mb"], "MiB", dev, note=RSS_NOTE)]
        bar.update()
    del ids
    peaks = {}
    for n in sorted(lengths):
        text = source.take(n)
        reset_peak(device)
        t = clock(device)
        index = build_index(backbone, saes, text, chunk_size)
        seconds = clock(device) - t
        peaks[n] = peak_accel_mb(device)
        rows += [row("memory", "peak_accel_mb", "s3-index", n, peaks[n], "MiB", dev, seconds=seconds,
                     **({"note": no_accel} if no_accel else {})),
                 row("memory", "peak_rss_mb", "s3-index", n, peak_rss_mb(), "MiB", dev, seconds=seconds,
                     note=RSS_NOTE)]
        del index, text
        bar.update()
    lo, hi = min(lengths), max(lengths)
    if dev == "cuda" and hi > lo:
        rows.append(row("memory", "accel_mem_ratio", "s3-index", hi, peaks[hi] / peaks[lo], "ratio", dev,
                        note=f"peak accelerator memory at {hi} / at {lo} tokens"))
    return rows


# ---- query ------------------------------------------------------------------------------------------------------

def tile_index(index, copies: int):
    """`copies` copies of a fresh one-pass index back to back: each document again at positions shifted by the
    corpus length, with the same postings, added in segments of the engine's hand-offs (HANDOFF_TOKENS), as
    queries meet them after a build. This is what indexing the documents `copies` times gives, since each document
    streams from its own start (independent chunks) and its features do not depend on the others."""
    from endo_retrieval.index.engine import HANDOFF_TOKENS
    from endo_retrieval.methods.search import EndoIndex

    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    period = index.corpus.n_positions
    if index.corpus.n_tokens != period:
        raise ValueError("tile_index needs an index without removed documents (its positions must be contiguous).")
    fi = index.index
    tiled = EndoIndex(index.backbone, index.method, saes=index.saes, chunk_size=index.chunk_size,
                      stop_freq=fi.stop_freq, prune=index.prune)
    docs = list(index.corpus.documents())
    for c in range(copies):
        for d in docs:
            tiled.corpus.add_document(f"{d.doc_id}#{c}", d.text, d.offsets, d.metadata)
    for layer in fi.layers:
        indptr, positions = fi.postings(layer)
        feats = np.repeat(np.arange(fi.d_latent, dtype=np.int32), np.diff(indptr))
        # each indexed token's features as one row (-1 pads), so tokens without active features stay counted (they
        # matter for a share-based stop_freq)
        tokens = fi.tokens(layer)
        order = np.argsort(positions, kind="stable")
        row = np.searchsorted(tokens, positions[order])
        slot = np.arange(len(row)) - np.searchsorted(row, row)  # rank of each posting within its token
        feat = np.full((len(tokens), int(slot.max(initial=0)) + 1), -1, np.int32)
        feat[row, slot] = feats[order]
        cuts = np.searchsorted(tokens, np.arange(HANDOFF_TOKENS, period, HANDOFF_TOKENS))
        for c in range(copies):
            for t, f in zip(np.split(tokens, cuts), np.split(feat, cuts)):
                tiled.index.add(layer, t + c * period, f)
        tiled.index.freq(layer)
    return tiled


def percentiles(seconds: list[float]) -> tuple[float, float]:
    p50, p95 = np.percentile(np.asarray(seconds) * 1000, [50, 95])
    return float(p50), float(p95)


def query_section(backbone, saes, source: TextSource, sizes: list[int], base_tokens: int, n_questions: int,
                  budget: int, chunk_size: int, bar) -> list[dict]:
    from endo_retrieval.index.engine import SCORE_ON_ACCELERATOR
    from endo_retrieval.methods.pipeline import EndoPipeline

    device, dev = backbone.device, backbone.device.type
    # the first stage reads no heads: a stand-in lets a model without a heads profile be timed too
    first_stage = EndoPipeline(backbone, heads=[(0, 0)])
    base_text = source.take(base_tokens)
    base = build_index(backbone, saes, base_text, chunk_size)
    questions = questions_from(base_text, n_questions)
    rows = []
    for size in sizes:
        copies = size // base_tokens
        index = tile_index(base, copies)
        n = index.corpus.n_positions
        extra = {"questions": n_questions, "budget": budget, "indexed_positions": n,
                 "note": f"tiled: {copies} copies of a {base.corpus.n_positions}-token index" if copies > 1
                 else "indexed"}
        t = clock(device)
        index.select(questions[0], budget)  # builds BM25 over the sentences once; later queries reuse it
        first = clock(device) - t
        t = clock(device)
        passages = index.passages()  # built once per corpus state, as the first endo query builds it
        first_stage.candidates(index.corpus, passages, questions[0])
        endo_first = clock(device) - t
        forward, scoring, scoring_accel, select, bm25, selection, endo = [], [], [], [], [], [], []
        for q in questions:
            t = clock(device)
            features = index.query_features(q)
            forward.append(clock(device) - t)
            t = clock(device)
            s3 = index.index.score(features, n_positions=n, prune=index.prune)  # [S3 Eq. 9] alone, summed on the host
            scoring.append(clock(device) - t)
            if dev == "cuda":  # the same, summed on the accelerator (what select uses from SCORE_ON_ACCELERATOR)
                t = clock(device)
                index.index.score(features, n_positions=n, prune=index.prune, device=device)
                scoring_accel.append(clock(device) - t)
            t = clock(device)
            lexical = index.bm25_scores(q)
            bm25.append(clock(device) - t)
            t = clock(device)
            index.select(q, budget, scores={"s3": s3, "bm25": lexical})  # density, peaks, spans
            selection.append(clock(device) - t)
            t = clock(device)
            index.select(q, budget)
            select.append(clock(device) - t)
            t = clock(device)
            first_stage.candidates(index.corpus, passages, q)
            endo.append(clock(device) - t)
            bar.update()
        for metric, method, times in (("query", "s3-hybrid", select), ("score", "s3", scoring),
                                      ("score", "s3-accelerator", scoring_accel), ("question_forward", "s3", forward)):
            if not times:
                continue
            p50, p95 = percentiles(times)
            rows += [row("query", f"{metric}_p50_ms", method, size, p50, "ms", dev, **extra),
                     row("query", f"{metric}_p95_ms", method, size, p95, "ms", dev, **extra)]
        rows.append(row("query", "query_first_ms", "s3-hybrid", size, first * 1000, "ms", dev,
                        **{**extra, "questions": 1, "note": extra["note"] + "; includes building BM25"}))
        # each stage of one s3-hybrid query alone, beside its share of the query's p50: together they make the query
        query_p50 = percentiles(select)[0]
        on_accel = dev == "cuda" and n >= SCORE_ON_ACCELERATOR
        note = extra["note"] + "; stage_*: s3-hybrid's query in parts (forward: the question's forward and SAEs, " \
            "[S3 Eq. 6]; s3_score: [S3 Eq. 9]; bm25: BM25 over sentences; selection: density, peaks and spans " \
            "from those scores); share: the stage's p50 over query_p50_ms"
        for stage, times in (("forward", forward), ("s3_score", scoring_accel if on_accel else scoring),
                             ("bm25", bm25), ("selection", selection)):
            p50 = percentiles(times)[0]
            rows.append(row("query", f"stage_{stage}_p50_ms", "s3-hybrid", size, p50, "ms", dev,
                            **{**extra, "note": note}, share=p50 / query_p50))
        p50, p95 = percentiles(endo)
        note = extra["note"] + "; endo's first stage alone: BM25 over passages, the best depth kept (not the " \
            "model's read)"
        rows += [row("query", "first_stage_p50_ms", "endo", size, p50, "ms", dev, **{**extra, "note": note}),
                 row("query", "first_stage_p95_ms", "endo", size, p95, "ms", dev, **{**extra, "note": note}),
                 row("query", "first_stage_first_ms", "endo", size, endo_first * 1000, "ms", dev,
                     **{**extra, "questions": 1, "note": note + "; includes building the passages and their BM25"})]
        if size == sizes[0]:
            rows += endo_pipeline_rows(backbone, index.corpus, passages, questions, size, extra)
        del index
    return rows


def endo_pipeline_rows(backbone, corpus, passages, questions: list[str], size: int, extra: dict, heads=None,
                       k: int = 5) -> list[dict]:
    """The default `endo` pipeline per question (its shipped settings; `heads`: the model's calibrated heads): the
    query's p50/p95, each stage's p50 (`EndoPipeline.passage_hits`'s stage_ms: bm25, then the model's read, question
    and hop2), the model's forwards per question and, on CUDA, the launches, kernels and copies of the first
    LAUNCH_QUESTIONS, warm. A model without a heads profile gets one row saying so."""
    from endo_bench.launches import counting_forwards, launches_per_question
    from endo_retrieval.methods.pipeline import EndoPipeline
    from endo_retrieval.methods.heads import HeadsError

    device, dev = backbone.device, backbone.device.type
    try:
        pipe = EndoPipeline(backbone, heads=heads)
    except HeadsError as err:
        return [row("query", "endo_query_p50_ms", "endo", size, None, "ms", dev, **{**extra, "note": str(err)})]
    pipe.passage_hits(corpus, passages, questions[0], k)  # warm-up
    total, stages, forwards = [], {}, []
    for q in questions:
        with counting_forwards(backbone) as count:
            t = clock(device)
            hits = pipe.passage_hits(corpus, passages, q, k)
            total.append(clock(device) - t)
        forwards.append(count[0])
        for stage, ms in (hits[0].stage_ms if hits else {}).items():
            stages.setdefault(stage, []).append(ms / 1000)
    reads = "batched" if pipe.batched_reads else "plain"
    note = f"{extra['note']}; the endo pipeline (depth {pipe.depth}, {pipe.read_tokens} tokens read a " \
        f"candidate, {reads} reads), top {k}"
    out = [row("query", f"endo_query_{p}_ms", "endo", size, v, "ms", dev, **{**extra, "note": note})
           for p, v in zip(("p50", "p95"), percentiles(total))]
    out += [row("query", f"endo_stage_{stage}_p50_ms", "endo", size, percentiles(v)[0], "ms", dev,
                **{**extra, "note": note}) for stage, v in stages.items() if stage != "total"]
    out.append(row("query", "endo_forwards_per_question", "endo", size, float(np.mean(forwards)), "forwards", dev,
                   **{**extra, "note": note}))
    cuda = launches_per_question(lambda q: pipe.passage_hits(corpus, passages, q, k), questions, device)
    if cuda is not None:
        out += [row("query", f"endo_cuda_{kind}_per_question", "endo", size, value, kind, dev,
                    **{**extra, "questions": cuda["questions"], "note": note + "; torch.profiler's count"})
                for kind, value in cuda.items() if kind != "questions"]
    return out


# ---- arguments --------------------------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    from endo_retrieval.index.engine import CHUNK

    cuda, cpu = DEFAULTS["cuda"], DEFAULTS["cpu"]
    p.add_argument("--out", required=True, help="FILE.json; FILE.md and FILE.<section>.png go beside it")
    p.add_argument("--sections", default=",".join(DEFAULT_SECTIONS), help=f"comma-separated: {', '.join(SECTIONS)} "
                   f"(default all but scale, which needs the ray extra)")
    p.add_argument("--text", default=None, help="folder of .txt files (default ../shared/data/pg_essays, else "
                   "generated filler); repeated back to back when a length needs more")
    p.add_argument("--no-repeat", action="store_true", help="refuse lengths longer than the text instead")
    p.add_argument("--index-tokens", type=int, default=None, help=f"index section length (default {cuda[0]} on "
                   f"CUDA, {cpu[0]} on CPU)")
    p.add_argument("--lengths", type=int_list, default=None, help=f"memory section lengths (default "
                   f"{','.join(map(str, cuda[1]))}; CPU {','.join(map(str, cpu[1]))})")
    p.add_argument("--corpus-sizes", type=int_list, default=None, help=f"query section corpus sizes in tokens, "
                   f"multiples of --query-base (default {','.join(map(str, cuda[2]))}; CPU "
                   f"{','.join(map(str, cpu[2]))})")
    p.add_argument("--query-base", type=int, default=None, help="tokens really indexed for the query section; "
                   "larger corpora are copies of it (default: the smallest corpus size)")
    p.add_argument("--query-questions", type=int, default=20, help="questions timed per corpus size (default 20)")
    p.add_argument("--e2e-lengths", type=int_list, default=None, help=f"e2e context lengths (default "
                   f"{','.join(map(str, cuda[3]))}; CPU {','.join(map(str, cpu[3]))})")
    p.add_argument("--questions", type=int, default=10, help="questions one s3-hybrid index serves in e2e "
                   "(the amortised row; default 10)")
    p.add_argument("--ttft-lengths", type=int_list, default=None, help=f"ttft lengths on the model (default "
                   f"{','.join(map(str, cuda[4]))}; CPU {','.join(map(str, cpu[4]))})")
    p.add_argument("--random-llama-8b", action="store_true", help="also time ttft and e2e on a Llama-3-8B-shaped "
                   "model with RANDOM weights (CUDA only)")
    p.add_argument("--ttft-lengths-8b", type=int_list, default=[131072, 262144, 524288, 1048576],
                   help="ttft lengths of the 8B-shaped model (default 131072,262144,524288,1048576)")
    p.add_argument("--e2e-lengths-8b", type=int_list, default=[32768, 131072],
                   help="e2e lengths of the 8B-shaped model (default 32768,131072)")
    p.add_argument("--ilre-lengths", type=int_list, default=[131072, 262144, 1048576],
                   help="ilre section lengths (default 131072,262144,1048576; also the 8B shape's)")
    p.add_argument("--scale-tokens", type=int, default=None, help=f"scale section: tokens indexed and ILRe's "
                   f"context (default {SCALE_TOKENS['cuda']} on CUDA, {SCALE_TOKENS['cpu']} on CPU)")
    p.add_argument("--scale-docs", type=int, default=64, help="scale section: documents the text is cut into (64)")
    p.add_argument("--scale-workers", type=int, default=2, help="scale section: Ray workers beside one (default 2)")
    p.add_argument("--ray", default=None, metavar="ADDRESS", help="scale section: the Ray cluster to join "
                   "(default: a local one, a worker per GPU)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="scale and ilre sections: the accelerator's "
                   "dense bf16 peak for ILRe's compute share (default 989, an H100 or H200 SXM)")
    p.add_argument("--budget", type=int, default=1024, help="context tokens ilre and s3-hybrid keep (default 1024)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per question in e2e (default 64)")
    p.add_argument("--chunk-size", type=int, default=CHUNK, help=f"indexing chunk (default {CHUNK})")
    model_argument(p)
    p.add_argument("--sae", default=None, help="SAE folder (`endo train-sae --out`; default: the shipped SAEs)")
    p.add_argument("--ilre-layer", type=int, default=None, help="ILRe retrieval layer (default: the calibrated one)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated filler text")


def resolve_settings(args, device: str) -> dict:
    """The lengths to run, defaults filled in per device; ValueError (saying what to change) for bad values."""
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown or not sections:
        raise ValueError(f"unknown section {unknown[0] if unknown else '(none)'!r}; choose from {', '.join(SECTIONS)}")
    index_tokens, lengths, sizes, e2e, ttft = DEFAULTS["cuda" if device == "cuda" else "cpu"]
    s = {"sections": sections, "index_tokens": args.index_tokens or index_tokens, "lengths": args.lengths or lengths,
         "corpus_sizes": args.corpus_sizes or sizes, "e2e_lengths": args.e2e_lengths or e2e,
         "ttft_lengths": args.ttft_lengths or ttft, "ttft_lengths_8b": args.ttft_lengths_8b,
         "e2e_lengths_8b": args.e2e_lengths_8b, "ilre_lengths": args.ilre_lengths}
    s["query_base"] = args.query_base or min(s["corpus_sizes"])
    s["scale_tokens"] = args.scale_tokens or SCALE_TOKENS["cuda" if device == "cuda" else "cpu"]
    for name in ("index_tokens", "query_base", "query_questions", "questions", "budget", "max_new_tokens",
                 "chunk_size"):
        value = s.get(name, getattr(args, name))
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    for name in ("lengths", "corpus_sizes", "e2e_lengths", "ttft_lengths", "ttft_lengths_8b", "e2e_lengths_8b"):
        if not s[name] or min(s[name]) < 1:
            raise ValueError(f"--{name.replace('_', '-')} needs positive token counts, got {s[name]}")
    bad = [n for n in s["corpus_sizes"] if n % s["query_base"]]
    if bad:
        raise ValueError(f"corpus size {bad[0]} is not a multiple of --query-base {s['query_base']}: larger corpora "
                         "are whole copies of the indexed base text.")
    for name in ("e2e_lengths", "ttft_lengths", "ttft_lengths_8b", "e2e_lengths_8b"):
        short = [n for n in s[name] if n <= args.budget]
        if short and (not name.endswith("_8b") or args.random_llama_8b):
            raise ValueError(f"--{name.replace('_', '-')} {short[0]} is not longer than --budget {args.budget}: "
                             "there would be nothing to compress.")
    if args.random_llama_8b and device != "cuda":
        raise ValueError("--random-llama-8b needs a CUDA device (an 8B model in float32 does not fit a CPU run).")
    return s


def longest(s: dict, random_8b: bool) -> int:
    """The most text any chosen section takes from the source (the 8B lengths only count when asked for)."""
    need = {"index": [s["index_tokens"]], "memory": s["lengths"], "query": [s["query_base"]],
            "e2e": s["e2e_lengths"] + (s["e2e_lengths_8b"] if random_8b else []),
            "ttft": s["ttft_lengths"] + (s["ttft_lengths_8b"] if random_8b else []), "scale": [s["scale_tokens"]],
            "ilre": s["ilre_lengths"]}
    return max(max(need[name]) for name in s["sections"])


# ---- outputs ----------------------------------------------------------------------------------------------------

def series_label(r: dict) -> str:
    label = r["method"] or ""
    if r.get("questions", 1) > 1 and r["section"] == "e2e":
        label += f" ({r['questions']} q, amortised)"
    if r.get("model"):
        label += f" [{r['model']}]"
    return label


def _cell(r: dict | None) -> str:
    if r is None:
        return "-"
    if r["value"] is None:
        return "OOM" if "out of memory" in r.get("note", "") else "n/a"
    v = r["value"]
    return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"


def markdown(result: dict) -> str:
    """One table per section: a line per (metric, series), a column per length."""
    lines = [f"Device: {result['config']['device_name']}; model {result['config']['model']}; "
             f"torch {result['config']['torch']}.", ""]
    for section in SECTIONS:
        rows = [r for r in result["rows"] if r["section"] == section]
        if not rows:
            continue
        lengths = sorted({r["context_tokens"] for r in rows})
        series = list(dict.fromkeys((r["metric"], series_label(r), r["unit"]) for r in rows))
        lines += [f"### {section}", "", "| metric | method | unit | " + " | ".join(map(length_label, lengths)) + " |",
                  "|---|---|---|" + "---|" * len(lengths)]
        for metric, label, unit in series:
            cells = {r["context_tokens"]: r for r in rows if (r["metric"], series_label(r)) == (metric, label)}
            lines.append(f"| {metric} | {label} | {unit} | " + " | ".join(_cell(cells.get(n)) for n in lengths) + " |")
        notes = sorted({r["note"] for r in rows if r.get("note")})
        lines += [""] + [f"- {n}" for n in notes] + ([""] if notes else [])
    for fit in result.get("ttft_fit", []):
        lines.append(f"- ttft fit, {fit['method']} [{fit['model']}]: time = {fit['intercept_ms']:.1f} ms + "
                     f"{fit['ms_per_1k_tokens']:.2f} ms per 1k tokens, R^2 = "
                     f"{'n/a' if fit['r2'] is None else format(fit['r2'], '.4f')} ({fit['points']} points)")
    return "\n".join(lines) + "\n"


PLOTS = {"memory": (("peak_accel_mb", "peak_rss_mb"), "peak memory (MiB)"),
         "query": (("query_p50_ms", "query_p95_ms", "score_p50_ms", "first_stage_p50_ms"), "latency (ms)"),
         "e2e": (("e2e_ms",), "end to end per question (ms)"),
         "ttft": (("ttft_ms",), "time to first token (ms)")}


def plot(rows: list[dict], section: str, path: Path) -> bool:
    """Log-log lines per (metric, series) of `section` versus length; False when matplotlib or data is missing."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics, ylabel = PLOTS[section]
    rows = [r for r in rows if r["section"] == section and r["metric"] in metrics and r["value"] is not None]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for metric, label in dict.fromkeys((r["metric"], series_label(r)) for r in rows):
        points = sorted((r["context_tokens"], r["value"]) for r in rows
                        if (r["metric"], series_label(r)) == (metric, label))
        ax.plot(*zip(*points), marker="o", label=f"{label}: {metric}" if len(metrics) > 1 else label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("corpus tokens" if section == "query" else "context tokens")
    ax.set_ylabel(ylabel)
    ax.set_title(f"endo bench perf: {section}")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_outputs(result: dict, out: Path, plots: bool = True) -> list[Path]:
    from endo_retrieval.files import atomic_write

    atomic_write(out, lambda p: p.write_text(json.dumps(result, indent=1), encoding="utf-8"))
    atomic_write(out.with_suffix(".md"), lambda p: p.write_text(markdown(result), encoding="utf-8"))
    written = [out, out.with_suffix(".md")]
    for section in PLOTS if plots else ():
        path = out.with_suffix(f".{section}.png")
        if plot(result["rows"], section, path):
            written.append(path)
    return written


# ---- the run ----------------------------------------------------------------------------------------------------

def config_of(backbone, saes, source: TextSource, settings: dict, args) -> dict:
    import transformers

    dev = backbone.device
    return {"device": dev.type, "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda"
            else platform.processor() or platform.machine(), "torch": torch.__version__,
            "transformers": transformers.__version__, "model": backbone.model_id,
            "model_hash": backbone.model_hash[:12], "dtype": str(backbone.dtype).replace("torch.", ""),
            "sae_layers": saes.layers, "chunk_size": args.chunk_size, "budget": args.budget,
            "max_new_tokens": args.max_new_tokens, "eos": "ignored: every method decodes max_new_tokens",
            "text": source.origin, "text_tokens": source.n_tokens, **settings}


def run(args) -> int:
    from tqdm.auto import tqdm

    from endo_retrieval.model.backbone import Backbone
    from endo_bench import perf_e2e
    from endo_retrieval.model.sae import SAEBank

    out = Path(args.out)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    settings = resolve_settings(args, device)  # bad arguments fail before the model loads
    out.parent.mkdir(parents=True, exist_ok=True)
    backbone = Backbone(args.model) if args.model else Backbone.default()
    saes = SAEBank.load(args.sae, backbone.model_hash, backbone.device) if args.sae else \
        SAEBank.for_backbone(backbone)
    source = TextSource.load(backbone, args.text, repeat=not args.no_repeat, seed=args.seed)
    source.check(longest(settings, args.random_llama_8b))
    if {"e2e", "ttft"} & set(settings["sections"]):
        from endo_retrieval.methods.ilre import ILRe

        ILRe(backbone, layer=args.ilre_layer)  # a missing calibration or a bad layer fails now, not an hour in
    result = {"schema": SCHEMA, "config": config_of(backbone, saes, source, settings, args), "rows": [],
              "ttft_fit": []}
    s, rows = settings, result["rows"]
    steps = {"index": 1, "memory": 2 * len(s["lengths"]), "query": len(s["corpus_sizes"]) * args.query_questions,
             "e2e": len(s["e2e_lengths"]), "ttft": len(s["ttft_lengths"]), "scale": 1,
             "ilre": len(args.ilre_lengths)}
    bar = tqdm(total=sum(steps[name] for name in s["sections"]), desc="perf", disable=None)
    for section in s["sections"]:
        bar.set_postfix_str(section)
        if section == "index":
            rows += index_rows(backbone, saes, source, s["index_tokens"], args.chunk_size)
            bar.update()
        elif section == "memory":
            rows += memory_section(backbone, saes, source, s["lengths"], args.chunk_size, bar)
        elif section == "query":
            rows += query_section(backbone, saes, source, s["corpus_sizes"], s["query_base"], args.query_questions,
                                  args.budget, args.chunk_size, bar)
        elif section == "e2e":
            rows += perf_e2e.e2e_rows(backbone, saes, source, s["e2e_lengths"], args, bar)
        elif section == "ttft":
            new = perf_e2e.ttft_rows(backbone, source, s["ttft_lengths"], args.budget, args.ilre_layer, saes,
                                     args.chunk_size, bar=bar)
            rows += new
            result["ttft_fit"] += perf_e2e.fits(new, backbone.model_id)
        elif section == "scale":
            from endo_bench.perf_scale import scale_rows

            rows += scale_rows(source, s["scale_tokens"], args, args.scale_workers)
            bar.update()
        elif section == "ilre":
            from endo_bench.perf_ilre import ilre_rows

            rows += ilre_rows(backbone, source, args.ilre_lengths, args.budget, args.ilre_layer, args.peak_tflops,
                              bar=bar)
        write_outputs(result, out, plots=False)  # after every section: a later failure keeps what was measured
    bar.close()
    if "ilre" in s["sections"] and args.random_llama_8b:
        rows += perf_e2e.random_8b_ilre_rows(source, args)
    if {"e2e", "ttft"} & set(s["sections"]) and args.random_llama_8b:
        new = perf_e2e.random_8b_rows(source, s["sections"], s["ttft_lengths_8b"], s["e2e_lengths_8b"], args)
        rows += new
        result["ttft_fit"] += perf_e2e.fits([r for r in new if r["section"] == "ttft"], backbone.model_id)
    written = write_outputs(result, out)
    print(markdown(result))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0
