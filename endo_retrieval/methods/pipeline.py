"""`endo`, the default pipeline over a corpus: BM25 and a dense embedder find candidates, the model reads them, its
retrieval heads rank them.

Stage 1, cheap and over everything: passages (a document as the user gave it, or a run of whole sentences of at most
PASSAGE_TOKENS of a longer one) ranked by BM25 and by the cosine of their embedding with the question's (dense.py),
the two rankings fused by weighted reciprocal-rank fusion, `dense_share` the dense ranking's weight (`first_stage`
"hybrid"; "bm25" or "dense" is one ranking alone); the best `depth` go on. BM25 finds the passages that share the
question's rare words, the embedder those that say it in other words.
Stage 2: the model reads the candidates as one context, each cut to its best `read_tokens` (its first sentence,
which names what the passage is about, then the sentences that share the most question words), in the order chosen
on labelled data (best last: nearest the question), then the question; a candidate scores each calibrated
retrieval head's attention at its strongest token, summed over the heads (QRHead, calibrated as In-Context
Re-ranking does: `methods.heads.passage_signals`). A second hop re-reads the best first-hop candidates before the
question, for bridge questions whose second passage shares no word with the question.
The final score is the weighted sum of the stage scores (BM25's, the cosine, the heads', the second read's), each
standardised over the candidates. Where the first stage's fit holds an adaptive rule (`endo calibrate-fusion`,
fitted across labelled domains) the weights follow the question (scoring/adaptive.py); else they are fixed, fitted
per first stage (`endo calibrate-pipeline`). Stage 1 itself is index/first_stage.py's.

`endo-2hop` (opt-in, `two_hop=True`) adds a second hop that retrieves: the hop above only re-ranks what BM25 found,
so a passage sharing no word with the question stays out of reach however well the model reads. From the tokens
the heads attend to most inside the best first-hop passages, the words the question does not hold (a name, grown
to its whole span: `methods.heads.bridge_terms`) ask BM25 again; the new passages are read behind the best
first-hop ones, as stage 2 reads, and join the ranking (`second_hop`). No text is generated.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from endo_retrieval.core import Span
from endo_retrieval.corpus import CorpusMap
from endo_retrieval.index.passages import Passages, best_part, part_text, passage_span
from endo_retrieval.methods.heads import bridge_terms, profile_heads, read_passages
from endo_retrieval.model.profiles import heads_profile
from endo_retrieval.model.watchdog import Watchdog
from endo_retrieval.scoring.bm25 import OkapiPostings, words
from endo_retrieval.index.first_stage import DENSE_SHARE, FIRST_STAGES, FirstStage, first_stage as make_first_stage
from endo_retrieval.scoring.adaptive import AdaptiveWeights
from endo_retrieval.scoring.fusion import fuse, merge_reads, rrf, standardise

# the pipeline's settings where the model's profile has none (the shipped profile holds the values fitted on data)
DEFAULTS = {"depth": 20, "read_tokens": 128, "best_last": True, "weights": {"bm25": 0.5, "heads": 0.5}}
# a first stage's own settings where the profile's `first_stages` entry has none: the dense ranking's share of the
# fusion, and the final weights (the profile's BM25 weights split between BM25 and the cosine where not fitted)
STAGE_SCORES = ("bm25", "dense", "heads", "hop2")
# `endo-2hop`'s settings where the profile has no `pipeline2hop` section (not fitted yet): first-hop passages the
# bridge is taken from and read again (`anchors`), bridge terms taken from each (`terms`), the next first-hop
# passages read again beside them as a reference (`refs`), new passages read (`depth2`), and the weight of "reached
# through the bridge" in the final fusion (`bridge`, see `second_hop`; 0 until fitted)
TWO_HOP_DEFAULTS = {"anchors": 2, "terms": 3, "refs": 2, "depth2": 4, "bridge": 0.0}
# False: every pipeline reads one query part per forward, the plain path (`endo bench corpus --plain-reads` times it)
BATCHED_READS = True


def fitted_setting(pipeline: dict, device_type: str) -> dict:
    """The profile's `pipeline` section as this device reads by default: on a CPU, where the read's time follows
    the arithmetic, its `cpu` entry (`endo calibrate-pipeline --cpu`: fewer candidates, the second hop only where
    it pays) sets depth, tokens, order and weights."""
    keys = ("depth", "read_tokens", "best_last", "weights")
    cpu = {k: v for k, v in (pipeline.get("cpu") or {}).items() if k in keys}
    if device_type != "cpu" or not cpu:
        return pipeline
    setting = pipeline | cpu
    if "weights" not in cpu:  # an entry written without its own: those fitted for its setting, where tried
        setting["weights"] = fitted_weights(pipeline, setting.get("depth"), setting.get("read_tokens"),
                                            setting.get("best_last", True)) or pipeline.get("weights")
    return setting


def fitted_weights(pipeline: dict, depth: int, read_tokens: int, best_last: bool) -> dict | None:
    """The weights `endo calibrate-pipeline` fitted for this setting (its `fit` table's row), None where it was
    not tried: a caller who reads 10 candidates gets the weights fitted for 10, not those of the profile's 20."""
    order = "best-last" if best_last else "first-stage"
    tables = [(section.get("fit") or {}).get("table", []) for section in (pipeline, pipeline.get("cpu") or {})]
    for row in (row for table in tables for row in table):
        if (row.get("depth"), row.get("read_tokens"), row.get("order")) == (depth, read_tokens, order):
            return dict(row["weights"])
    return None


def bridge_reach(bm25: OkapiPostings):
    """word -> how far it can lead as a bridge: its BM25 idf where at least two passages hold it, else 0. A word
    only one passage holds leads nowhere past that passage (the anchor it was read in), and one that most passages
    hold leads to none in particular (idf near 0)."""
    def leads(word: str) -> float:
        term = bm25.term(word)
        row = bm25.terms.get(term)
        if row is None or bm25.indptr[row + 1] - bm25.indptr[row] < 2:
            return 0.0
        return max(float(bm25.okapi.idf[term]), 0.0)

    return leads


@dataclass
class EndoPipeline:
    """The `endo` ranking of a corpus's passages for a question (see the module docstring). Settings left None come
    from the model's heads profile (`pipeline`, fitted by `endo calibrate-pipeline`), else DEFAULTS."""

    backbone: object
    depth: int | None = None  # candidates stage 1 hands to the model
    read_tokens: int | None = None  # tokens the model reads of each candidate
    best_last: bool | None = None  # the model reads the candidates best last (nearest the question)
    weights: dict[str, float] | None = None  # stage score -> weight: "bm25", "dense", "heads", "hop2"
    # "hybrid": BM25 and the dense embedder fused; "bm25" / "dense": one alone. None: the profile's `first_stage`,
    # else "bm25" where the profile holds a pipeline fitted before the dense stage, else "hybrid"
    first_stage: str | None = None
    dense_share: float | None = None  # the dense ranking's weight in stage 1's fusion (None: the fitted one)
    # the model's linear maps in int8 (CPU only): the read takes about half the time, but on dev300's first 100
    # questions recall@5 fell from 80.5 (fp32, as bf16 on a GPU) to 75.5, so it is off unless asked for
    int8: bool = False
    heads: list | None = None
    # a second hop that asks the index again with the bridge (`second_hop`); None: where the first stage's fit
    # turned it on (`first_stages` entry `two_hop`), `endo-2hop` asks for it always
    two_hop: bool | None = None
    two_hop_settings: dict | None = None  # TWO_HOP_DEFAULTS' keys; None: the profile's `pipeline2hop`, else those
    # the question parts read together: two forwards per question (the read with the question and the content-free
    # question behind it, then the second hop's two), where one part at a time takes five; the same scores
    # (`methods.heads`). None: BATCHED_READS
    batched_reads: bool | None = None
    # the fusion's weights per question (scoring/adaptive.py), where the first stage's fit holds a rule and no
    # `weights` are given; False: the fixed weights always
    adaptive: AdaptiveWeights | bool | None = None
    # first stages whose candidates are read, each as its own context, and merged (`fusion.merge_reads`): a BM25-led
    # pool and the dense ranking's own, so a passage the dense ranking alone finds is read even where BM25 fills the
    # fused list. None: the first stage's fitted `pools`, else the first stage alone. One pool with the second hop
    pools: tuple[str, ...] | None = None
    # a question's model work (`ranked`: both hops) past its timeout raises GPUStallError naming the GPU's other
    # processes (model/watchdog.py); None: one on the backbone's device, timed by ENDO_GPU_TIMEOUT_S (default 120 s)
    watchdog: Watchdog | None = None

    def __post_init__(self):
        self.watchdog = self.watchdog or Watchdog(self.backbone.device)
        self.heads = [tuple(map(int, h)) for h in (self.heads or profile_heads(self.backbone))]
        self.batched_reads = BATCHED_READS if self.batched_reads is None else self.batched_reads
        pipeline = (heads_profile(self.backbone) or {}).get("pipeline") or {}
        self.first_stage_asked = self.first_stage is not None  # a default one falls back to BM25 without vectors
        self.first_stage = self.first_stage or pipeline.get("first_stage") or ("bm25" if pipeline else "hybrid")
        if self.first_stage not in FIRST_STAGES:
            raise ValueError(f"Unknown first stage {self.first_stage!r}; use one of {', '.join(FIRST_STAGES)}.")
        fitted = fitted_setting(pipeline, self.backbone.device.type)
        # a first stage fitted on its own (`first_stages`): its weights and share; depth and reading as fitted
        stage = (pipeline.get("first_stages") or {}).get(self.first_stage) or {}
        cpu = stage.get("cpu") or {}  # fitted on a CPU at its depth, without the second read: read at that depth
        if self.backbone.device.type == "cpu" and cpu and self.depth in (None, cpu.get("fit", {}).get("depth")):
            stage = stage | cpu
        if self.dense_share is None:
            self.dense_share = float(stage.get("dense_share", DENSE_SHARE[self.first_stage]))
        if self.two_hop is None:
            self.two_hop = bool(stage.get("two_hop", False))
        self.pools = tuple(self.pools or stage.get("pools") or (self.first_stage,))
        if set(self.pools) - set(FIRST_STAGES):
            raise ValueError(f"Unknown first stage(s) {sorted(set(self.pools) - set(FIRST_STAGES))} in pools; use "
                             f"{', '.join(FIRST_STAGES)}.")
        if self.two_hop:  # the bridge is taken from one read's attention
            self.pools = self.pools[:1]
        if self.adaptive is None and self.weights is None and stage.get("adaptive"):
            try:
                self.adaptive = AdaptiveWeights.from_json(stage["adaptive"])
            except ValueError as err:
                raise ValueError(f"The {self.first_stage!r} fusion rule of the model's heads profile is damaged "
                                 f"({err}); fit it again (endo calibrate-fusion) or pass weights.") from None
        self.adaptive = self.adaptive or None
        if self.weights is None and stage.get("weights"):
            self.weights = dict(stage["weights"])
        if self.weights is None and self.first_stage != "bm25" and "weights" in fitted:
            bm25 = fitted["weights"].get("bm25", 0.0)
            self.weights = dict(fitted["weights"]) | {"bm25": bm25 / 2, "dense": bm25 / 2}
        for name in ("depth", "read_tokens", "best_last"):
            if getattr(self, name) is None:
                setattr(self, name, fitted.get(name, DEFAULTS[name]))
        if self.weights is None:  # the fitted setting's weights, else those fitted for the setting read, where tried
            same = all(getattr(self, k) == fitted.get(k) for k in ("depth", "read_tokens", "best_last"))
            self.weights = ((fitted.get("weights") if same else None)
                            or fitted_weights(fitted, self.depth, self.read_tokens, self.best_last)
                            or fitted.get("weights", DEFAULTS["weights"]))
        if self.int8 and self.backbone.device.type != "cpu":
            raise ValueError("int8 reads run on a CPU backbone only; on a GPU the bf16 read is faster")
        if not (isinstance(self.depth, int) and self.depth >= 1):
            raise ValueError(f"depth must be a whole number of candidates >= 1, got {self.depth!r}.")
        if not (isinstance(self.read_tokens, int) and self.read_tokens >= 8):
            raise ValueError(f"read_tokens must be a whole number of tokens >= 8, got {self.read_tokens!r}.")
        unknown = set(self.weights) - set(STAGE_SCORES)
        if unknown:
            raise ValueError(f"Unknown stage score(s) {sorted(unknown)}; the pipeline weighs "
                             f"{', '.join(STAGE_SCORES)}.")
        if not 0.0 <= self.dense_share <= 1.0:
            raise ValueError(f"dense_share must be a share in [0, 1], got {self.dense_share!r}.")
        given = self.two_hop_settings or (heads_profile(self.backbone) or {}).get("pipeline2hop") or {}
        unknown = set(given) - set(TWO_HOP_DEFAULTS) - {"fit"}
        if unknown:
            raise ValueError(f"Unknown two-hop setting(s) {sorted(unknown)}; known: {', '.join(TWO_HOP_DEFAULTS)}.")
        self.two_hop_settings = {name: given.get(name, default) for name, default in TWO_HOP_DEFAULTS.items()}

    def candidates(self, corpus: CorpusMap, passages: Passages, question: str, depth: int | None = None,
                   where=None, first_stage: str | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Stage 1: (passage indices of the best `depth`, best first (ties: corpus order), {"bm25": their BM25
        scores, "dense": their cosine with the question where the dense stage ran}); `where(metadata)`: only
        passages of the documents it accepts."""
        vectors = getattr(passages, "vectors", None) is not None
        return self.stage_one(vectors, first_stage).candidates(corpus, passages, question, depth or self.depth, where)

    def stage_one(self, vectors: bool, first_stage: str | None = None) -> FirstStage:
        """The first stage this pipeline runs over passages with (`vectors`) or without embeddings: `first_stage`
        (None: its own), a default dense one falling back to BM25 where there are no vectors."""
        stage = first_stage or self.first_stage
        if stage != "bm25" and not vectors and not (first_stage or self.first_stage_asked):
            stage = "bm25"  # passages without embeddings, no dense stage asked for: BM25's candidates
        share = self.dense_share if stage == self.first_stage else None
        return make_first_stage(stage, share)

    @property
    def reads_hop2(self) -> bool:
        """Whether a score of the second read is fused (its two forwards are skipped where not)."""
        return bool(self.weights.get("hop2")) or (self.adaptive is not None and "hop2" in self.adaptive.stages)

    def fuse(self, signals: dict[str, np.ndarray]) -> np.ndarray:
        """The candidates' fused score: the adaptive rule's weights for this question where there is one and every
        stage it reads scored them, else the fixed `weights` (`fusion.fuse`: the weighted sum of the standardised
        stage scores; passages without embeddings have no cosine, and BM25's candidates are read as before)."""
        if self.adaptive is not None and set(self.adaptive.stages) <= set(signals):
            return self.adaptive.fuse(signals)
        return fuse(signals, self.weights)

    def read_texts(self, corpus: CorpusMap, passages: Passages, top: np.ndarray, question: str) -> list[str]:
        """What the model reads of each candidate (`best_part`), pieces of one passage joined by ' ... '."""
        q = set(words(question))
        return [part_text(corpus, best_part(corpus, passages.sentences, int(passages.starts[i]),
                                            int(passages.ends[i]), q, self.read_tokens)) for i in top]

    def stage_scores(self, corpus: CorpusMap, passages: Passages, question: str, depth: int | None = None,
                     where=None) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, float]]:
        """(candidate passage indices, {stage: score per candidate}, {stage: milliseconds})."""
        top, signals, ms, _ = self.first_hop(corpus, passages, question, depth, where)
        return top, signals, ms

    def pool_candidates(self, corpus: CorpusMap, passages: Passages, question: str, depth: int | None = None,
                        where=None) -> list[tuple[np.ndarray, dict[str, np.ndarray]]]:
        """Stage 1 of each pool read (`candidates`): one, the first stage's, unless `pools` names several and the
        passages have embeddings (without them a default first stage is BM25's alone)."""
        vectors = getattr(passages, "vectors", None) is not None
        if len(self.pools) == 1 or not (vectors or self.first_stage_asked):
            return [self.candidates(corpus, passages, question, depth, where)]
        return [self.candidates(corpus, passages, question, depth, where, pool) for pool in self.pools]

    def first_hop(self, corpus: CorpusMap, passages: Passages, question: str, depth: int | None = None, where=None):
        """`stage_scores` and the read it came from: (top, signals, ms, (PassageReading, read order)); with several
        pools, their reads merged (`fusion.merge_reads`: standard scores) and no single read (None, None)."""
        t0 = time.perf_counter()
        pools = self.pool_candidates(corpus, passages, question, depth, where)
        t1 = time.perf_counter()
        reads = [self.read_candidates(corpus, passages, question, top, first) for top, first in pools]
        t2 = time.perf_counter()
        if len(reads) > 1:  # a pool `where` leaves empty adds nothing to the merge
            reads = [r for r in reads if len(r[0])] or reads[:1]
        if len(reads) == 1:
            top, signals, reading, order = reads[0]
        else:
            keys, signals = merge_reads([(top.tolist(), signals) for top, signals, _, _ in reads])
            top, reading, order = np.asarray(keys, np.int64), None, None
        # "heads": the model's whole part; its stages (`PassageReading.ms`) beside it
        ms = {"first_stage": 1000 * (t1 - t0), "heads": 1000 * (t2 - t1)}
        for _, _, r, _ in reads:
            for name, v in (r.ms if r else {}).items():
                ms[name] = ms.get(name, 0.0) + v
        return top, signals, ms, (reading, order)

    def read_candidates(self, corpus: CorpusMap, passages: Passages, question: str, top: np.ndarray,
                        first: dict[str, np.ndarray]):
        """Stage 2 over one pool's candidates: (top, {stage: score} with stage 1's, PassageReading, read order)."""
        texts = self.read_texts(corpus, passages, top, question)
        order = np.arange(len(top))[::-1] if self.best_last else np.arange(len(top))
        signals, reading = dict(first), None
        if len(top):  # stage 1's order is what the second read's evidence is chosen by, beside the heads
            reading = read_passages(self.backbone, [texts[i] for i in order], question, self.heads,
                                    second_hop=self.reads_hop2, int8=self.int8,
                                    first_stage=-order.astype(np.float64), batched=self.batched_reads)
            for name, s in reading.signals.items():
                signals[name] = np.empty(len(top))
                signals[name][order] = s
        return top, signals, reading, order

    def bridge(self, reading, order: np.ndarray, best: np.ndarray, question: str, leads=None
               ) -> list[tuple[str, float]]:
        """The bridge terms (`bridge_terms`) of the first-hop candidates at positions `best` of the candidate list,
        from the first read's token attention: `terms` of each passage in turn, distinct. Each passage gives its
        own, as the other might hold the stronger words while only this one names the bridge. `leads(word)`: how
        far a word can lead (`bridge_reach`); a term's attention is weighed by its best word's, and a term that
        leads nowhere is dropped (the heads pick what to look at, the corpus what can lead somewhere)."""

        read, position = reading, np.argsort(order)  # candidate i was read at position[i]
        out: dict[str, tuple[str, float]] = {}
        for i in best:
            a, b = read.chars[int(position[i])]
            inside = (read.offsets[:, 1] > a) & (read.offsets[:, 0] < b)
            scores = np.where(inside, read.token_scores, -np.inf)
            found = bridge_terms(read.text, read.offsets, scores, question, len(read.offsets))
            if leads is not None:
                rarity = [max([leads(w) for w in words(t)] or [0.0]) for t, _ in found]
                found = [(t, round(s * r, 6)) for (t, s), r in zip(found, rarity) if s > 0 and r > 0]
                found.sort(key=lambda ts: -ts[1])
            for term, score in found[: self.two_hop_settings["terms"]]:
                out.setdefault(term.lower(), (term, score))
        return list(out.values())

    def second_hop(self, corpus: CorpusMap, passages: Passages, question: str, top: np.ndarray, fused: np.ndarray,
                   first, where=None):
        """`endo-2hop`'s second hop: (new passage indices, their scores on the first hop's scale, their stage
        scores, {passage: bridge terms it holds}, {stage: ms}); nothing new when no bridge term finds a passage
        outside the first hop's candidates.

        The bridge: the terms the heads attend to most inside the `anchors` best first-hop passages (by fused
        score), not the question's. BM25 ranks the passages (under the same `where`) for the bridge terms alone
        and for the question plus them; a passage holding no bridge word is left out (the question alone reached
        it, which is the first hop's job), the rest go by reciprocal-rank fusion of the two rankings, and the
        first `depth2` not among the first hop's candidates are new.
        The second read: the anchors, the `refs` first-hop candidates ranked next, and the new passages, as one
        context (what stage 2 reads of each, in its order), then the question: "heads" as in stage 2, "hop2" with
        the anchors as the evidence in front of the question, so the bridge is read before the question asks
        about it. Their weighted sum (the first hop's weights; BM25 of the question is left out, as it ranked the
        new passages low by construction) is standardised over this read.
        The score, on the first hop's scale: the refs, read in both hops, tie the two scales by their means (the
        anchors where there are no refs; not the anchors beside them, whose first-hop score is far above the
        rest and which the second read sees twice, in the context and as evidence). Both scales are standardised,
        so one standard deviation is one in either (matching the spread too, over two to four passages, swung a
        new passage's score by several units). A new passage the second read scores like the refs' average so
        gets their first-hop average; then `bridge` is added: the weight of the signal "reached through the
        bridge" (1 for a new passage) in the same weighted sum, 0 by default (until fitted, a passage is ranked
        for what the model reads in it, not for how it was found)."""

        t0 = time.perf_counter()
        cfg = self.two_hop_settings
        reading, order = first
        anchors = np.lexsort((np.arange(len(top)), -fused))[: cfg["anchors"]]
        terms = self.bridge(reading, order, anchors, question, bridge_reach(passages.bm25))
        none = (np.zeros(0, np.int64), np.zeros(0), {}, {}, {"bridge": 1000 * (time.perf_counter() - t0)})
        if not terms:
            return none
        asked = " ".join(t for t, _ in terms)
        alone, alone_scores = self.candidates(corpus, passages, asked, len(passages), where, "bm25")
        alone_scores = alone_scores["bm25"]
        with_question, _ = self.candidates(corpus, passages, f"{question} {asked}", len(passages), where, "bm25")
        holds = set(alone[alone_scores > 0].tolist())
        fusion = dict(zip(alone.tolist(), rrf(-np.arange(len(alone), dtype=float))))
        for i, r in zip(with_question.tolist(), rrf(-np.arange(len(with_question), dtype=float))):
            fusion[i] = fusion.get(i, 0.0) + r
        seen = set(top.tolist())
        new = [i for i in sorted(holds, key=lambda i: (-fusion[i], i)) if i not in seen][: cfg["depth2"]]
        t1 = time.perf_counter()
        if not new:
            return none
        known = np.lexsort((np.arange(len(top)), -fused))[: cfg["anchors"] + cfg["refs"]]  # anchors first
        read = np.concatenate([top[known], new]).astype(np.int64)
        texts = self.read_texts(corpus, passages, read, question)
        order2 = np.arange(len(read))[::-1] if self.best_last else np.arange(len(read))
        position = np.argsort(order2)
        signals = read_passages(self.backbone, [texts[i] for i in order2], question, self.heads, second_hop=True,
                                int8=self.int8, evidence=position[: len(anchors)].tolist(),
                                batched=self.batched_reads).signals
        signals = {name: s[position] for name, s in signals.items()}  # back to: anchors, refs, new
        weights = {name: self.weights.get(name, 0.0) for name in ("heads", "hop2")}
        z = standardise(fuse(signals, weights if any(weights.values()) else {"hop2": 1.0}))
        tie = slice(len(anchors), len(known)) if len(known) > len(anchors) else slice(0, len(known))
        score = fused[known][tie].mean() + (z[len(known):] - z[: len(known)][tie].mean()) + cfg["bridge"]
        bm25 = passages.bm25.get_scores(words(question))[new] if words(question) else np.zeros(len(new))
        stage = {"bm25": bm25} | {name: s[len(known):] for name, s in signals.items()}
        lowered = {t: set(words(t)) for t, _ in terms}
        found_by = {}
        for i in new:
            held = set(words(corpus.span_text(int(passages.starts[i]), int(passages.ends[i]))[3]))
            found_by[i] = [t for t, w in lowered.items() if w & held]
        t2 = time.perf_counter()
        return (np.asarray(new, np.int64), score, stage, found_by,
                {"bridge": 1000 * (t1 - t0), "hop2_read": 1000 * (t2 - t1)})

    @property
    def sources(self) -> tuple[str, ...]:
        """The stage scores the fusion weighs (a hit's `signals`)."""
        return tuple(s for s, w in self.weights.items() if w)

    def ranked(self, corpus: CorpusMap, passages: Passages, question: str, k: int, where=None) -> Ranked | None:
        """Both hops read and fused, the k best picked (`Ranked`); None when no document passes `where`. The Ray
        reader runs it on a copy whose stage 1 the shards gave (distributed_pipeline.py). The one place a
        question's GPU work runs under the watchdog: past its timeout, GPUStallError."""
        return self.watchdog.run(self._ranked, corpus, passages, question, k, where)

    def _ranked(self, corpus: CorpusMap, passages: Passages, question: str, k: int, where=None) -> Ranked | None:
        t0 = time.perf_counter()
        top, signals, ms, first = self.first_hop(corpus, passages, question, where=where)
        if not len(top):  # no document passes `where`
            return None
        fused = self.fuse(signals)
        scores = [{name: round(float(s[r]), 6) for name, s in signals.items()} | {"fused": float(fused[r])}
                  for r in range(len(top))]
        if self.two_hop:
            new, score, stage, found_by, hop_ms = self.second_hop(corpus, passages, question, top, fused, first,
                                                                  where)
            ms |= hop_ms
            scores = [s | {"hop": 1} for s in scores] + [
                {name: round(float(s[r]), 6) for name, s in stage.items()} | {"fused": float(score[r]), "hop": 2,
                                                                               "bridge": "; ".join(found_by[i])}
                for r, i in enumerate(new.tolist())]
            top, fused = np.concatenate([top, new]), np.concatenate([fused, score])
        rank = np.lexsort((np.arange(len(top)), -fused))[:k]  # ties keep stage 1's order (then hop 2's)
        ms["total"] = 1000 * (time.perf_counter() - t0)
        return Ranked(top, fused, scores, ms, rank)

    def passage_hits(self, corpus: CorpusMap, passages: Passages, question: str, k: int, budget: int | None = None,
                     where=None) -> list[Span]:
        """The k best passages, best first, as spans: score = the fused stage scores (higher is better), each
        stage's own score in `stage_scores`. `budget`: at most that many tokens in all, each passage cut to its
        best part (`best_part`) of budget // k tokens; a cut passage's text joins its pieces with ' ... ', and its
        character offsets run from the first piece's start to the last one's end."""
        ranked = self.ranked(corpus, passages, question, k, where)
        if ranked is None:
            return []
        q = set(words(question))
        return [passage_span(corpus, passages, int(ranked.top[r]), float(ranked.fused[r]), q, budget, k,
                             self.sources, stage_scores=ranked.scores[r], stage_ms=dict(ranked.ms))
                for r in ranked.rank]


@dataclass
class Ranked:
    """A question's candidates as the pipeline ranked them: passage indices (first hop, then second), their fused
    scores and stage scores, the search's time per stage, and the k best (positions in `top`, best first)."""

    top: np.ndarray
    fused: np.ndarray
    scores: list[dict]
    ms: dict[str, float]
    rank: np.ndarray
