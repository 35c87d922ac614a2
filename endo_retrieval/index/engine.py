"""The stored index of a corpus for S3-Attention (S3 sections 3.4-3.6, [S3 Alg. 1]): what it holds and how it is
built, saved and loaded.

Phase 1 [S3 Eq. 4-5]: documents stream through the backbone (early exit at the deepest target layer, independent
chunks of 2048 as in Table 6); each chunk's pre-RoPE keys are encoded by the layer's SAE and appended to the
`FeatureIndex` as postings; the chunk is then dropped, so accelerator memory is bounded by the chunk.
Phase 2 [S3 Eq. 6-7/9]: the question's pre-RoPE queries go through the same SAEs; S[t] sums w_q * IDF over shared
features (`IndexStore.s3_scores`), beside BM25's scores of the same positions (`bm25_scores`).
Phase 3 [S3 Eq. 8], the selection that fuses them, belongs to the methods (methods/s3.py), and searching belongs
to `EndoIndex` (methods/search.py), which adds it to this store: the store only knows which method it was built
for, from the names the layer above gives it (`method_names`, `feature_methods`).
"""
from __future__ import annotations

import contextlib
import sys
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar, Iterable, Iterator

import numpy as np
import torch

from endo_retrieval.model.backbone import PIECES_PER_BATCH, Backbone, Encoding, as_text
from endo_retrieval.scoring.bm25 import SentenceBM25
from endo_retrieval.model.chunk_graph import MIN_REPLAYS
from endo_retrieval.corpus import CorpusMap, split_sentences
from endo_retrieval.index.folder import HEADER, committed_generation, read_index, write_index  # noqa: F401
from endo_retrieval.index.inverted import (SEGMENT_TOKENS, FeatureIndex, IndexCorruptError,
                                           sorted_postings)
from endo_retrieval.index.dense import DEFAULT_EMBEDDER, DenseVectors, EmbedderError, load_embedder
from endo_retrieval.index.passages import PASSAGE_TOKENS, Passages, document_cuts
from endo_retrieval.index.indexing import (HandOff, ahead, index_streams, progress_bar, recorded_event, to_host,
                                           whole_chunks)
from endo_retrieval.index.rwlock import ReadWriteLock, locked
from endo_retrieval.model.sae import SAEBank, SAEError, TopKSAE
from endo_retrieval.index.segments import load_segments

CHUNK = 2048  # Table 6: streaming chunk size
GROUP_CHUNKS = MIN_REPLAYS  # whole chunks per stream call while the text arrives: a call replays these shapes
HANDOFF_TOKENS = SEGMENT_TOKENS  # features kept on the accelerator before one copy to the host (~3 MB for 3 layers,
# k 16; 64k: its sort's buffers, ~40 MiB, were most of the peak once the forward ran from CUDA graphs). Each hand-off
# is one index segment, which queries read without a merge
AHEAD_PIECES = 2 * PIECES_PER_BATCH  # pieces tokenised ahead of the stream: the next batch while one is streamed
# indexed positions from which a CUDA backbone sums [S3 Eq. 9] on the accelerator: below, the host's sum is as fast
# (bench/results/perf/perf_h100_query_s8.json; docs/papers.md, queries)
SCORE_ON_ACCELERATOR = 1 << 18


@dataclass
class Document:
    """A document to index: its id, text, and JSON-serialisable metadata carried to every span it yields."""

    doc_id: str
    text: str
    metadata: dict = field(default_factory=dict)


class IndexStore:
    """A persistent endogenous index over documents: the corpus map, BM25 over its passages and sentences, and
    for S3 the feature postings. `method`: the method it is built for, kept in its header. `endo` (the default
    pipeline: pipeline.py) and `bm25` need only the corpus map, so an index built for them holds no feature
    postings and cannot score with S3; one built for `s3` or `s3-hybrid` serves every method.
    `int8_queries`: forward questions through int8-quantized linear maps (None: on an fp32 CPU backbone, where it halves
    the question's forward at unchanged S3-Hybrid recall on dev30, docs/papers.md 'Questions on a CPU go
    through int8 linear maps'); documents stay fp32/bf16."""

    # set by the layer above (EndoIndex): the method names an index may be built for, and those that read the SAE
    # feature postings, so only an index built for one of them streams its documents through the SAEs
    method_names: ClassVar[tuple[str, ...]] = ()
    generation = 0  # the committed generation of the folder this index was loaded from or last saved to (0: none)
    feature_methods: ClassVar[tuple[str, ...]] = ()

    def __init__(self, backbone: Backbone | None, method: str, saes=None,
                 chunk_size: int = CHUNK, stop_freq: int | float | None = 5000, prune: float | None = None,
                 int8_queries: bool | None = None, first_stage: str = "bm25", embedder: str | None = None):
        self.backbone = Backbone.of(backbone)  # None: the default model; a folder or GGUF path: that model
        on_cpu = self.backbone.device.type == "cpu"
        if int8_queries and not on_cpu:
            raise ValueError("int8_queries runs on a CPU backbone only; on a GPU the bf16 question forward is faster")
        fp32 = self.backbone.dtype == torch.float32  # int8 maps quantize fp32 ones; bf16 is as fast on its CPU
        self.int8_queries = on_cpu and fp32 if int8_queries is None else bool(int8_queries)
        if method not in self.method_names:
            raise ValueError(f"Unknown method {method!r}; the index searches with one of "
                             f"{', '.join(self.method_names)}.")
        self.method = method
        self.saes = saes or _model_saes(self.backbone, self.holds_features)
        self.chunk_size = chunk_size
        self.prune = prune
        self.index = FeatureIndex(self.saes.layers, self.saes.card["d_latent"], stop_freq=stop_freq,
                                  meta={"model_hash": self.backbone.model_hash})
        self.corpus = CorpusMap()
        if first_stage not in FIRST_STAGES:
            raise ValueError(f"Unknown first stage {first_stage!r}; use one of {', '.join(FIRST_STAGES)}.")
        # the passages' embeddings (dense.py), kept where a first stage reads them
        self.dense = None if first_stage == "bm25" else DenseVectors(embedder or DEFAULT_EMBEDDER,
                                                                     _embed_device(self.backbone))
        if self.dense is not None:
            load_embedder(self.dense.embedder, self.dense.device)  # a name that cannot load fails before any work
        self._rw = ReadWriteLock()  # queries share the index, an add or remove has it alone

    @property
    def holds_features(self) -> bool:
        """Whether documents stream through the SAEs into feature postings (an index for s3 or s3-hybrid)."""
        return self.method in self.feature_methods

    # ---- phase 1: streaming semantic indexing [S3 Eq. 4-5] ------------------------------------------------------
    @locked("write")
    def add_documents(self, docs: Iterable[Document | str], progress: bool | None = None,
                      replace: bool = False) -> list[str]:
        """Index documents one after another; returns their ids. A bad document raises before anything is added.
        `progress`: a progress bar (None: when standard error is a terminal). `replace`: a document whose id is
        indexed already replaces that one (the old version goes once the new one is indexed), instead of an error."""
        docs = [d if isinstance(d, Document) else Document(f"doc-{len(self.corpus) + i}", d)
                for i, d in enumerate(docs)]
        if not docs:
            raise ValueError("No documents given; pass at least one Document or text.")
        seen = set()
        checked = []
        for d in docs:  # validate all first, so a bad document leaves the index untouched
            if d.doc_id in seen or not replace and d.doc_id in self.corpus:
                raise ValueError(f"Duplicate document id {d.doc_id!r}; ids must be unique (remove the old one first).")
            seen.add(d.doc_id)
            try:
                text = unicode_text(as_text(d.text))
            except ValueError as e:
                raise ValueError(f"Document {d.doc_id!r}: {e}") from None
            if not text:
                raise ValueError(f"Document {d.doc_id!r} is empty; skip empty documents.")
            if "\x00" in text:
                raise ValueError(f"Document {d.doc_id!r} contains NUL bytes and looks binary; pass extracted text.")
            try:
                json.dumps(d.metadata)
            except TypeError as e:
                raise ValueError(f"Document {d.doc_id!r}: metadata must be JSON-serialisable ({e}).") from None
            checked.append((d, text))
        bar = progress_bar(sum(len(text) for _, text in checked), "indexing",
                           sys.stderr.isatty() if progress is None else progress)
        for d, text in checked:
            start, pieces, sentences = self.corpus.n_positions, [], []

            def tokenised(text=text, pieces=pieces, sentences=sentences) -> Iterator[Encoding]:
                # the pieces are tokenised and their sentences split a batch ahead, in a thread, while the stream
                # launches the chunks before them (the Rust tokenizer runs without the GIL)
                split = ((a, b, enc, split_sentences(text, a, b)) for a, b, enc in self.backbone.encode_pieces(text))
                for a, b, enc, starts in ahead(split, AHEAD_PIECES):
                    pieces.append(enc)
                    sentences.append(starts)
                    bar.update(b - a)
                    yield enc

            stream = tokenised()
            try:
                if not self.holds_features:  # BM25 and endo read only the corpus map: no SAE pass
                    list(stream)
                else:
                    self._index_tokens(stream, start)
                if d.doc_id in self.corpus:  # replace: the new version is indexed, the old one can go
                    self.remove_document(d.doc_id)
                self.corpus.add_document(d.doc_id, text, np.concatenate([p.offsets for p in pieces]), d.metadata,
                                         sentence_chars=np.concatenate(sentences))
            except BaseException:  # a document half indexed (NaN keys, out of memory, Ctrl-C) leaves no trace
                stream.close()  # stops the tokenising thread now, not when the traceback is freed
                if d.doc_id in self.corpus and self.corpus.doc(d.doc_id).start == start:  # not an old version
                    self.corpus.remove_document(d.doc_id)
                self.index.remove_range(start, start + sum(len(p) for p in pieces))
                raise
        bar.close()
        if self.dense is not None:
            try:
                self._embed([d.doc_id for d in docs], progress)
            except BaseException:  # no document without its vectors: the whole add is undone
                for d in docs:
                    start, end = self.corpus.remove_document(d.doc_id)
                    self.index.remove_range(start, end)
                raise
        return [d.doc_id for d in docs]

    def _embed(self, doc_ids: list[str], progress: bool | None = None) -> None:
        """The dense stage's vectors of these documents' passages (the runs `Passages.build` cuts)."""
        texts = []
        for doc_id in doc_ids:
            doc = self.corpus.doc(doc_id)
            cuts = document_cuts(doc, PASSAGE_TOKENS)
            texts.append([self.corpus.span_text(a, b)[3] for a, b in zip(cuts[:-1], cuts[1:])])
        self.dense.add(doc_ids, texts, sys.stderr.isatty() if progress is None else progress)

    @locked("write")
    def add_embeddings(self, embedder: str | None = None, progress: bool | None = None) -> int:
        """Give an index without a dense stage (built with first_stage='bm25') its passages' embeddings, or embed
        the documents that lack them; returns how many documents were embedded. Save the index to keep them."""
        if self.dense is None:
            self.dense = DenseVectors(embedder or DEFAULT_EMBEDDER, _embed_device(self.backbone))
        elif embedder is not None and embedder != self.dense.embedder:
            raise EmbedderError(f"This index's passages were embedded with {self.dense.embedder!r}, not {embedder!r}; "
                                "build a new index to change the embedder.")
        missing = self.dense.missing(self.doc_ids)
        if missing:
            self._embed(missing, progress)
        if getattr(self, "_passages", None) is not None:  # the corpus is the same; its passages now carry vectors
            self._passages = (self._passages[0], self._with_vectors(self._passages[1]))
        self.__dict__.pop("_pipelines", None)  # the default first stage changes with them
        return len(missing)

    def _index_tokens(self, pieces: Iterable[Encoding], start: int) -> None:
        """Stream the document's tokens as its pieces arrive, encode each chunk's keys [S3 Eq. 4] and append postings
        [S3 Eq. 5], with no wait for the accelerator until the end (with the forward replayed from CUDA graphs,
        the host is idle while it runs). The chunks are those of one stream over the whole document. The
        features stay on the accelerator until HANDOFF_TOKENS of them wait, are sorted into postings there, and
        copied to the host without waiting; the host adds them one hand-off later, when they have arrived."""
        layers = self.saes.layers
        waiting: list[tuple[int, int, dict[int, torch.Tensor]]] = []  # positions in the document, features
        sent: list[HandOff] = []  # on their way to the host
        finite = torch.ones((), dtype=torch.bool, device=self.backbone.device)  # every key seen so far
        main, encoder = index_streams(self.backbone.device)
        on_encoder = torch.cuda.stream(encoder) if encoder is not None else contextlib.nullcontext()

        def hand_off() -> None:
            if waiting:
                positions = np.concatenate([np.arange(start + s, start + e, dtype=np.int64) for s, e, _ in waiting])
                postings = []  # sorted on the accelerator, a layer at a time (each sort's buffers freed before
                for layer in layers:  # the next one's): the host only appends
                    sorted_ = sorted_postings(torch.cat([f[layer] for *_, f in waiting]), self.index.d_latent)
                    postings.append(tuple(to_host(t) for t in sorted_))
                sent.append(HandOff(waiting[0][0], waiting[-1][1], positions, postings, to_host(finite),
                                     recorded_event() if finite.is_cuda else None))  # the copies are async
                waiting.clear()

        def receive() -> None:
            h = sent.pop(0)
            h.arrived()
            if not h.finite:
                raise SAEError(f"The model's key states hold NaN or inf at or before tokens {h.start}-{h.end} of "
                               "the document, which was not indexed. Check the model's weights and dtype (float16 "
                               "can overflow; use bfloat16 or float32).")
            for layer, (counts, rows, keep) in zip(layers, h.postings):
                self.index.add_postings(layer, h.positions, counts.numpy(), rows.numpy()[keep.numpy()])

        for first, ids in whole_chunks(pieces, self.chunk_size, GROUP_CHUNKS):
            for chunk in self.backbone.stream(ids, layers, chunk_size=self.chunk_size, mode="independent"):
                if encoder is not None:  # the SAE encodes this chunk while the next one's forward runs
                    encoder.wait_stream(main)
                features = {}
                with on_encoder:
                    for layer in layers:
                        keys = chunk.keys[layer]
                        if encoder is not None:
                            keys.record_stream(encoder)  # not reused by the forward before the SAE has read it
                        finite &= torch.isfinite(keys).all()  # read at hand-off: here it would wait for the device
                        feat, act = self.saes.encode_keys(layer, keys, check_finite=False)
                        # padding of tokens with fewer than k active features; int16 holds any id below 2**15
                        features[layer] = torch.where(act > 0, feat, -1).to(
                            torch.int16 if self.index.d_latent < 2**15 else torch.int32)
                    waiting.append((first + chunk.start, first + chunk.end, features))
                    if sum(e - s for s, e, _ in waiting) >= HANDOFF_TOKENS:
                        hand_off()
                if len(sent) > 1:  # the hand-off before the last one: the accelerator is long past it
                    receive()
        with on_encoder:
            hand_off()
        while sent:
            receive()

    @locked("write")
    def remove_document(self, doc_id: str) -> None:
        start, end = self.corpus.remove_document(doc_id)
        self.index.remove_range(start, end)
        if self.dense is not None:
            self.dense.remove(doc_id)

    def __len__(self) -> int:
        return len(self.corpus)

    @property
    def doc_ids(self) -> list[str]:
        return self.corpus.doc_ids()

    # ---- phase 2: endogenous scores [S3 Eq. 6-7/9] --------------------------------------------------------------
    def query_features(self, question: str) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """[S3 Eq. 6]: the question's pre-RoPE queries through the same SAEs -> {layer: (feature ids, weights)}."""
        states = self.backbone.query_states(question, self.saes.layers, int8=self.int8_queries)
        out = {}
        for layer, q in states.items():
            feat, act = self.saes.encode_queries(layer, q)
            keep = act > 0
            out[layer] = (feat[keep].cpu().numpy(), act[keep].float().cpu().numpy())
        return out

    @locked("read")
    def s3_scores(self, question: str) -> np.ndarray:
        """S[t] = sum_l sum_f w_{q,f} IDF(f) 1[t in I_l[f]] [S3 Eq. 7/9], vectorised over postings."""
        if not self.holds_features:
            raise ValueError(f"This index was built with method={self.method!r} and holds no S3 feature postings; "
                             "build it with method='s3' or 's3-hybrid' to search with S3.")
        n, device = self.corpus.n_positions, self.backbone.device
        return self.index.score(self.query_features(question), n_positions=n, prune=self.prune,
                                device=device if device.type == "cuda" and n >= SCORE_ON_ACCELERATOR else None)

    @locked("read")
    def bm25_scores(self, question: str) -> np.ndarray:
        return self._of_corpus_state("_bm25", SentenceBM25.build).token_scores(question)

    def _corpus_state(self) -> tuple[int, int]:
        return self.corpus.n_positions, len(self.corpus)  # an add or remove changes it

    def _of_corpus_state(self, name: str, build: Callable):
        """`build(corpus)`, made once per corpus state and reused by every query."""
        key = self._corpus_state()
        if getattr(self, name, None) is None or getattr(self, name)[0] != key:
            setattr(self, name, (key, build(self.corpus)))
        return getattr(self, name)[1]

    @locked("read")
    def passages(self):
        """The corpus's candidate passages with BM25 over them (passages.py) and, where the index keeps them, their
        embeddings for the dense stage; built once per corpus state (or read with a saved index)."""
        def build(corpus):  # after adds and removes the last state's passages are updated, not cut again
            last = getattr(self, "_passages", None)
            return self._with_vectors(last[1].updated(corpus) if last is not None else Passages.build(corpus))

        return self._of_corpus_state("_passages", build)

    def _with_vectors(self, passages: Passages) -> Passages:
        """`passages` with the dense stage's embeddings where the index holds them for every document."""
        passages.dense = passages.vectors = passages.cells = None
        if self.dense is not None and self.dense.covers(self.corpus.id_column()):
            passages.dense = self.dense
            passages.vectors = self.dense.matrix(self.corpus.id_column())
            if len(passages.vectors) != len(passages):
                raise IndexCorruptError(f"The index holds {len(passages.vectors)} passage embeddings for "
                                        f"{len(passages)} passages; rebuild it.")
        return passages

    # ---- persistence (folder.py) ---------------------------------------------------------------------------
    @locked("read")
    def save(self, directory: str | os.PathLike) -> Path:
        """Write the index atomically: a new folder beside `directory` is filled, then swapped in (files.py), by one
        writer at a time (IndexBusyError for another). A crash leaves the old index or the new one."""
        directory = Path(directory)
        self.generation = write_index(self, directory)
        return directory

    @classmethod
    def load(cls, directory: str | os.PathLike, backbone: Backbone | None = None, saes=None,
             int8_queries: bool | None = None, embedder: str | None = None) -> "IndexStore":
        """The index saved in `directory`, read as one state even while a writer replaces it. Every failure is an
        IndexCorruptError (a ValueError) whose message says what to do. `embedder`: refuse the index unless its
        passages were embedded with this one (None: whichever it holds)."""
        directory = Path(directory)
        meta, index, corpus, dense, passages = read_index(directory, cls.method_names)
        if "segments" in meta:  # a manifest of index segments (`segments.commit`: Ray workers' builds)
            return load_segments(cls, directory, meta, backbone, saes, int8_queries)
        backbone = Backbone.of(backbone)
        if meta["model_hash"] != backbone.model_hash:
            raise IndexCorruptError(f"The index in {directory} was built with model {meta['model']} "
                                    f"({meta['model_hash'][:12]}), not with the loaded {backbone.model_id} "
                                    f"({backbone.model_hash[:12]}); load that model or rebuild the index.")
        self = cls(backbone, meta["method"], saes=saes, chunk_size=meta["chunk_size"], prune=meta.get("prune"),
                   int8_queries=int8_queries)
        if self.holds_features and (self.saes.layers != meta["sae_layers"] or index.layers != meta["sae_layers"]
                                          or index.d_latent != self.saes.card["d_latent"]):
            raise IndexCorruptError(f"The index in {directory} holds SAE layers {index.layers} of {index.d_latent} "
                                    f"latents (header: {meta['sae_layers']}); the loaded SAEs have {self.saes.layers} "
                                    f"of {self.saes.card['d_latent']}; load those SAEs or rebuild the index.")
        if index.positions_span > corpus.n_positions:
            raise IndexCorruptError(f"the index in {directory} is damaged (postings past the corpus map's "
                                    f"{corpus.n_positions} positions); delete the folder and rebuild the index.")
        if dense is not None:
            if embedder is not None and embedder != dense.embedder:
                raise EmbedderError(f"The index in {directory} embedded its passages with {dense.embedder!r}, not "
                                    f"{embedder!r}; query it with {dense.embedder!r} (or embedder=None), or rebuild "
                                    f"it with {embedder!r}.")
            if not dense.covers(corpus.id_column()):
                raise IndexCorruptError(f"the index in {directory} is damaged (documents without passage "
                                        "embeddings); delete the folder and rebuild the index.")
            dense.device = _embed_device(backbone)
        self.index, self.corpus, self.dense = index, corpus, dense
        if passages is not None:
            self._passages = (self._corpus_state(), self._with_vectors(passages))
        self.generation = meta.get("generation", 0)  # 0: saved before generations were counted
        return self


FIRST_STAGES = ("hybrid", "bm25", "dense")  # the pipeline's candidates: BM25 and dense fused, or either alone


def _embed_device(backbone: Backbone) -> str:
    """Where the dense stage's encoder runs: beside the model."""
    return str(backbone.device)


def _model_saes(backbone: Backbone, needed: bool):
    """The model's SAEs for an index for s3 or s3-hybrid (`needed`: `endo train-sae` first where there are none);
    a method that reads none (bm25, endo, endo-2hop) gets a stand-in of one untrained layer without reading the SAEs
    from disk, which every `compress()` used to pay (about 10 ms of a 73 ms `bm25` one on a 2-core CPU)."""
    if needed:
        return SAEBank.for_backbone(backbone)
    return SAEBank({0: TopKSAE(backbone.head_dim, 64, 1)}, {"d_latent": 64, "k": 1, "stand_in": True,
                                                            "model_hash": backbone.model_hash})


def unicode_text(text: str, what: str = "text") -> str:
    """`text`, refused with a ValueError where it holds a lone surrogate (not Unicode; the tokenizer cannot take it)."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"the {what} holds a lone surrogate at character {e.start}, which is not valid Unicode; "
                             "decode its bytes with errors='replace' first.") from None
    return text
