"""The corpus cut into candidate passages (a document as the user gave it, or a run of whole sentences of at most
PASSAGE_TOKENS of a longer one) with BM25 over their words, and the part of a passage the model reads
(`best_part`): what the corpus pipeline (methods/pipeline.py) ranks, built once per corpus state."""
from __future__ import annotations

import time
from array import array
from dataclasses import dataclass

import numpy as np

from endo_retrieval.core import Span
from endo_retrieval.corpus import CORPUS_FILE, OLD_CORPUS_FILE, CorpusMap
from endo_retrieval.array_file import ArrayFile, is_array_file, write_arrays
from endo_retrieval.files import sha256_of
from endo_retrieval.index.sections import file_path, headings, markup, paragraph_starts, token_positions
from endo_retrieval.scoring.bm25 import OkapiPostings, words

PASSAGE_TOKENS = 256  # a document longer than this is cut into passages of whole sentences up to this many tokens
# stage 1 indexes the passages' words by their English stems, as LlamaIndex's BM25Retriever does: on dev300 its
# recall@2 / @5 / @20 rose from 55.5 / 71.2 / 93.3 to 58.5 / 73.3 / 94.5 (tools/stage1_recall.py; docs/results.md
# "The first stage indexes stems")
STEMS = True
PASSAGES_FILE = "passages.arrays"  # the passages and their BM25, saved with the index: opening it maps them
OLD_PASSAGES_FILE = "passages.npz"  # what an index saved before array files holds instead (read only)
KIND = "passages"  # the array file's kind


def saved_names(meta: dict) -> tuple[str, str]:
    """(corpus map's file, passages' file) of an index folder whose header is `meta`: array files, or the .npz files
    of an index saved before them (its header has no "columns")."""
    return (CORPUS_FILE, PASSAGES_FILE) if meta.get("columns") is True else (OLD_CORPUS_FILE, OLD_PASSAGES_FILE)


@dataclass
class Passages:
    """The corpus cut into candidate passages (token ranges [starts[i], ends[i]) inside one document), their
    sentences and BM25 over their words; built once per corpus state."""

    starts: np.ndarray
    ends: np.ndarray
    sentences: np.ndarray  # sorted global sentence starts (every passage start is one)
    bm25: OkapiPostings
    vectors: np.ndarray | None = None  # the dense stage's embedding of each passage (IndexStore.passages)
    dense: object = None  # the DenseVectors that made them, which embeds a question the same way
    cells: object = None  # dense.Cells over `vectors` where the index holds cells (built at the first question)
    built_to: int = 0  # the corpus's n_positions when they were cut: a document from there on is new to them
    check_s = 0.0  # seconds `read` spent checking the saved file (its SHA-256 and arrays)

    @classmethod
    def build(cls, corpus: CorpusMap, max_tokens: int = PASSAGE_TOKENS, stem: bool | None = None) -> "Passages":
        starts, ends, bm25 = cut(corpus.documents(), max_tokens, STEMS if stem is None else stem)
        return cls(starts, ends, corpus.sentence_starts(), bm25, built_to=corpus.n_positions)

    def updated(self, corpus: CorpusMap) -> "Passages":
        """These passages after documents were added to or removed from `corpus` (positions are never reused, so a
        passage whose document is gone goes, and a document that starts at or past `built_to` is new): only the new
        documents' words are read; BM25 is merged, not rebuilt (`OkapiPostings.merged`). The same passages and
        scores as `build(corpus)` (bit for bit after adds only; to float rounding of the idf after removes)."""
        keep = corpus.locate(self.starts)[0] >= 0
        if not keep.any():  # nothing left to merge into
            return Passages.build(corpus, stem=self.bm25.stem)
        starts, ends, new = self.starts[keep], self.ends[keep], None
        docs = list(corpus.documents_from(self.built_to))
        if docs:
            more_starts, more_ends, new = cut(iter(docs), PASSAGE_TOKENS, self.bm25.stem)
            starts, ends = np.concatenate([starts, more_starts]), np.concatenate([ends, more_ends])
        return Passages(starts, ends, corpus.sentence_starts(), self.bm25.merged(keep, new),
                        built_to=corpus.n_positions)

    def save(self, path, corpus: CorpusMap) -> None:
        """Write the passages and their BM25 to `path` (an array file, checked in blocks when read), with what they
        were cut from (the corpus state, PASSAGE_TOKENS), so `read` can tell when they are stale."""
        state = np.asarray([corpus.n_positions, len(corpus), PASSAGE_TOKENS], np.int64)
        write_arrays(path, KIND, {"state": state, "starts": self.starts, "ends": self.ends, **self.bm25.arrays()})

    @classmethod
    def read(cls, f, corpus: CorpusMap, sha256: str | None = None) -> "Passages | None":
        """The passages `save` wrote, for `corpus`, mapped; None where they were cut another way (another
        PASSAGE_TOKENS or STEMS: they are built again). ValueError saying what is wrong where the file is damaged
        (its checksums, an array's type, shape or range) or does not fit the corpus; the seconds the checks took:
        `check_s`. A file saved before array files (.npz) is checked against `sha256` (None: not recorded, not
        checked) and read into memory."""
        clock = time.perf_counter()
        if is_array_file(f):
            arrays = ArrayFile._read(f, KIND).arrays
        else:
            if sha256 is not None:
                if sha256_of(f) != sha256:
                    raise ValueError("checksum mismatch")
                f.seek(0)
            with np.load(f, allow_pickle=False) as saved:
                arrays = {name: saved[name] for name in saved.files}
        _check_arrays(arrays)
        check_s = time.perf_counter() - clock
        state, starts, ends = arrays["state"].tolist(), arrays["starts"], arrays["ends"]
        bm25 = OkapiPostings.from_arrays(arrays)
        if len(bm25.terms) != len(arrays["idf"]):
            raise ValueError("a term is listed twice")
        if state[2] != PASSAGE_TOKENS or bm25.stem != STEMS:
            return None
        if state[:2] != [corpus.n_positions, len(corpus)] or not len(starts) == len(ends) == bm25.okapi.corpus_size:
            raise ValueError(f"the saved passages (of {state[1]} documents, {len(starts)} passages) do not fit the "
                             f"corpus ({len(corpus)} documents)")
        clock = time.perf_counter()  # inside the corpus, in its order, none overlapping the next (O(n) compares)
        if len(starts) and not (starts[0] >= 0 and ends[-1] <= corpus.n_positions and np.all(starts < ends)
                                and np.all(ends[:-1] <= starts[1:])):
            raise ValueError("its passages do not lie in the corpus's order inside it")
        check_s += time.perf_counter() - clock
        self = cls(starts, ends, corpus.sentence_starts(), bm25, built_to=state[0])
        self.check_s = check_s
        return self

    def __len__(self) -> int:
        return len(self.starts)

    def dense_scores(self, corpus: CorpusMap, query: np.ndarray) -> np.ndarray:
        """Each passage's cosine with the question's embedding `query`: all of them, or where the index holds cells
        (dense.py), those of the passages in the cells nearest the question, -inf for the rest."""
        if self.cells is None and self.dense.centroids is not None:
            self.cells = self.dense.cells_for(corpus.doc_ids(), self.vectors) or False
        if self.cells:
            return self.cells.scores(self.vectors, query)
        return np.asarray(self.vectors @ query, np.float64)


# passages.npz's arrays and their types ("u": any unsigned integer: the counts take the smallest that holds them)
ARRAYS = {"state": np.int64, "starts": np.int64, "ends": np.int64, "terms": np.uint8, "indptr": np.int64,
          "docs": np.int32, "tf": "u", "doc_len": np.int64, "idf": np.float64, "settings": np.float64}


def _check_arrays(arrays: dict[str, np.ndarray]) -> None:
    """ValueError naming the first array of passages.npz of another type, shape or range than `save` writes, so a
    damaged file never reaches BM25 (where it would fail as a TypeError or IndexError at a question, or score
    otherwise). One pass over the postings, no copy: ~20 ms at a million passages."""
    if set(arrays) != set(ARRAYS):
        raise ValueError(f"it holds the arrays {sorted(arrays)}, not {sorted(ARRAYS)}")
    for name, dtype in ARRAYS.items():
        a = arrays[name]
        if a.ndim != 1 or not (a.dtype.kind == "u" if dtype == "u" else a.dtype == dtype):
            raise ValueError(f"its {name} is {a.dtype} of shape {a.shape}, not a vector of "
                             f"{'unsigned integers' if dtype == 'u' else np.dtype(dtype).name}")
    n, indptr, docs, tf = len(arrays["starts"]), arrays["indptr"], arrays["docs"], arrays["tf"]
    checks = [("state", len(arrays["state"]) == 3), ("settings", len(arrays["settings"]) == 4),
              ("ends", len(arrays["ends"]) == n), ("doc_len", len(arrays["doc_len"]) == n),
              ("indptr", len(indptr) == len(arrays["idf"]) + 1 and indptr[0] == 0 and indptr[-1] == len(docs)
               and bool(np.all(indptr[1:] >= indptr[:-1]))),
              ("tf", len(tf) == len(docs) and (not len(tf) or tf.min() > 0)),
              ("docs", not len(docs) or docs.view(np.uint32).max() < n),  # one pass: below 0 reads as 2**31 up
              ("doc_len", not n or arrays["doc_len"].min() >= 0),
              ("idf", bool(np.isfinite(arrays["idf"]).all())),
              ("settings", bool(np.isfinite(arrays["settings"]).all()))]
    for name, ok in checks:
        if not ok:
            raise ValueError(f"its {name} does not fit the other arrays")


def cut(documents, max_tokens: int, stem: bool) -> tuple[np.ndarray, np.ndarray, OkapiPostings]:
    """(starts, ends, BM25 over their words) of the passages of `documents` (an iterator, read once): no list of
    every passage's text or words is held."""
    starts, ends = array("q"), array("q")

    def texts():
        for doc in documents:
            cuts = document_cuts(doc, max_tokens)
            starts.extend(cuts[:-1])
            ends.extend(cuts[1:])
            for a, b in zip(cuts[:-1], cuts[1:]):  # corpus.span_text(a, b)'s text, without its lookup
                own = doc.offsets[a - doc.start: b - doc.start]
                yield words(doc.text[int(own[0, 0]): int(own[:, 1].max())])

    bm25 = OkapiPostings.build(texts(), stem)
    return np.frombuffer(starts, np.int64).copy(), np.frombuffer(ends, np.int64).copy(), bm25


def passage_cuts(sentence_starts: np.ndarray, end: int, max_tokens: int, paragraphs: np.ndarray | None = None
                 ) -> list[int]:
    """Bounds [start, ..., end] of a document's passages: each as many whole sentences as fit in `max_tokens`
    (a longer sentence is a passage of its own, cut every `max_tokens`). `paragraphs` (starts of paragraphs, among
    the sentence starts): a passage ends before the last paragraph that starts in the second half of its room, where
    one does."""
    cuts = [int(sentence_starts[0])]
    while end - cuts[-1] > max_tokens:
        fits = sentence_starts[(sentence_starts > cuts[-1]) & (sentence_starts <= cuts[-1] + max_tokens)]
        if paragraphs is not None:
            late = paragraphs[(paragraphs > cuts[-1] + max_tokens // 2) & (paragraphs <= cuts[-1] + max_tokens)]
            fits = late if len(late) else fits
        cuts.append(int(fits[-1]) if len(fits) else cuts[-1] + max_tokens)
    return cuts + [int(end)]


def document_cuts(doc, max_tokens: int) -> list[int]:
    """Bounds [start, ..., end] of the passages of `doc` (a corpus DocumentView): a document read from a file
    (sections.py) is cut at its headings, each section into passages that end at paragraphs where they can, and no
    passage starts inside a heading (between its text and its underline); any other document as `passage_cuts`."""
    if file_path(doc.metadata) is None:
        return passage_cuts(doc.sentence_starts, doc.end, max_tokens)
    found = headings(doc.text, markup(doc.metadata))
    heads = token_positions(doc, [h.start for h in found])
    # a heading's other lines (its underline; its title under an overline) start sentences where no passage may start
    inner = token_positions(doc, [h.start + i + 1 for h in found for i, c in enumerate(doc.text[h.start:h.end])
                                  if c == "\n"])
    starts = np.setdiff1d(doc.sentence_starts, np.setdiff1d(inner, heads))
    paragraphs = token_positions(doc, paragraph_starts(doc.text))
    bounds = np.unique(np.concatenate(([doc.start], heads, [doc.end])))
    cuts = []
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        own = np.union1d([a], starts[(starts > a) & (starts < b)])
        cuts += passage_cuts(own, b, max_tokens, paragraphs[(paragraphs > a) & (paragraphs < b)])[:-1]
    return cuts + [int(doc.end)]


def best_part(corpus: CorpusMap, sentences: np.ndarray, a: int, b: int, question_words: set[str], max_tokens: int
              ) -> list[tuple[int, int]]:
    """Token ranges, in source order, of what to keep of the passage [a, b) in `max_tokens`: its first sentence,
    then its sentences with the most distinct question words (ties: earlier first), whole while they fit; the
    first one is cut to `max_tokens` if it alone is longer."""
    if b - a <= max_tokens:
        return [(a, b)]
    inner = sentences[(sentences > a) & (sentences < b)]
    bounds = np.concatenate(([a], inner, [b]))
    pieces = list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))
    overlap = [len(question_words & set(words(corpus.span_text(s, e)[3]))) for s, e in pieces[1:]]
    keep, used = [pieces[0]], min(pieces[0][1] - pieces[0][0], max_tokens)
    keep[0] = (a, a + used)
    for i in np.argsort(-np.asarray(overlap), kind="stable"):
        s, e = pieces[1 + int(i)]
        if used + e - s <= max_tokens and overlap[i] > 0:
            keep.append((s, e))
            used += e - s
    return sorted(keep)


def part_text(corpus: CorpusMap, parts: list[tuple[int, int]]) -> str:
    """The text of `best_part`'s pieces, joined by ' ... ' where something was left out between them."""
    return " ... ".join(corpus.span_text(a, b)[3].strip() for a, b in parts)


def passage_span(corpus: CorpusMap, passages: "Passages", i: int, score: float, question_words: set[str],
                 budget: int | None, k: int, sources: tuple[str, ...] = ("bm25",), **stages) -> Span:
    """Passage i as a hit scored `score` (by `sources`; `stages`: Span's stage_scores and stage_ms); under a `budget`
    of k passages, its best part of budget // k tokens (a cut passage's text joins its pieces with ' ... ', and its
    character offsets run from the first piece's start to the last one's end)."""
    a, b = int(passages.starts[i]), int(passages.ends[i])
    parts = [(a, b)] if budget is None else best_part(corpus, passages.sentences, a, b, question_words,
                                                     max(1, budget // k))
    doc_id, c0, _, _ = corpus.span_text(parts[0][0], parts[0][1])
    _, _, c1, _ = corpus.span_text(parts[-1][0], parts[-1][1])
    doc = corpus.doc(doc_id)
    text = part_text(corpus, parts) if len(parts) > 1 else doc.text[c0:c1]
    return Span(parts[0][0], parts[-1][1], c0, c1, text, score, sources, doc_id, doc.metadata, **stages,
                whole_document=(parts[0][0], parts[-1][1]) == (doc.start, doc.end))
