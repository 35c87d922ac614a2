"""BM25: one tokenizer rule (`words`), rank-bm25's Okapi scores over term postings, and BM25 over a corpus's
sentences and sentence windows (the lexical signal of S3-Hybrid [S3 Eq. 8] and of `endo`).

`BM25Okapi.get_scores` walks every document once per query term in Python, which dominated a query over the
sentences of more than 256k tokens (docs/papers.md). `OkapiPostings` keeps rank-bm25 as the source of the model (its
idf with the epsilon floor, k1, b, document lengths) and only changes how the sum is taken: per query term, over the
documents that hold it.
"""
from __future__ import annotations

import functools
import re
import threading
from array import array
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from endo_retrieval.corpus import CorpusMap

_WORD = re.compile(r"\w+", re.UNICODE)
_STOP = frozenset("a an and are as at be by did do does for from had has have he her his how i in is it its of on "
                  "or she that the their them they this to was were what when where which who whom whose why will "
                  "with you".split())


# scripts written without spaces between words: Chinese, Japanese kana and kanji, Korean hangul
_NO_SPACES = re.compile(r"([\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]+)")


SHORT_TEXT = 1_000  # characters: a question's words are kept for the next stage that asks (`words`)


def words(text: str) -> list[str]:
    """The one tokenizer rule of every BM25 here: lowercased runs of Unicode word characters, English stop words
    dropped; a run in a script written without spaces gives each character and each pair of neighbours (the usual
    unigram + bigram terms for Chinese and Japanese), so a query term need not match a whole unsegmented clause.
    A short text's words are kept (a question's are asked by each pool's first stage, its read and its hits), a
    document's are not (they would pin its text)."""
    return list(_short_words(text)) if len(text) <= SHORT_TEXT else _words(text)


@functools.lru_cache(maxsize=256)
def _short_words(text: str) -> tuple[str, ...]:
    return tuple(_words(text))


def _words(text: str) -> list[str]:
    lowered = text.lower()
    if not _NO_SPACES.search(lowered):  # the common case, one search per text instead of one per word
        return [w for w in _WORD.findall(lowered) if w not in _STOP]
    out = []
    for w in _WORD.findall(lowered):
        if w in _STOP:
            continue
        if not _NO_SPACES.search(w):
            out.append(w)
            continue
        for part in filter(None, _NO_SPACES.split(w)):
            if _NO_SPACES.fullmatch(part):
                out += list(part) + [part[i:i + 2] for i in range(len(part) - 1)]
            else:
                out.append(part)
    return out


def stems(words_: list[str]) -> list[str]:
    """English Snowball stems of `words` (PyStemmer, as LlamaIndex's BM25Retriever indexes): "universities"
    meets "university", "runs" meets "running"; a word of another script comes back as it was."""
    return _stemmer().stemWords(words_)


_STEMMERS = threading.local()  # a PyStemmer object is not safe to share between threads (its cache)


def _stemmer():
    if not hasattr(_STEMMERS, "english"):
        import Stemmer

        _STEMMERS.english = Stemmer.Stemmer("english")
    return _STEMMERS.english


def _okapi(doc_len: np.ndarray, k1: float = 1.5, b: float = 0.75, epsilon: float = 0.25):
    """rank-bm25's BM25Okapi over documents of these lengths (its defaults), without its per-document dicts and
    with no idf yet."""
    from rank_bm25 import BM25Okapi

    okapi = BM25Okapi.__new__(BM25Okapi)
    okapi.k1, okapi.b, okapi.epsilon, okapi.idf, okapi.doc_freqs = k1, b, epsilon, {}, []
    okapi.corpus_size, okapi.doc_len = len(doc_len), doc_len
    okapi.avgdl = int(doc_len.sum()) / max(len(doc_len), 1)  # no documents: every score 0
    return okapi


def _norm(okapi) -> np.ndarray:
    """k1 (1 - b + b |d| / avgdl) per document: the part of a score's denominator that does not depend on tf."""
    return okapi.k1 * (1 - okapi.b + okapi.b * okapi.doc_len / (okapi.avgdl or 1))


def _kept_starts(indptr: np.ndarray, alive: np.ndarray) -> np.ndarray:
    """Each term's first posting among the `alive` ones (CSR row starts of the postings kept): the row starts less
    the postings removed before each, found from the few removed ones (no row index a posting)."""
    gone = np.flatnonzero(~alive)
    removed = np.bincount(np.searchsorted(indptr, gone, side="right") - 1, minlength=len(indptr) - 1)
    return indptr - np.concatenate(([0], np.cumsum(removed)))


def _insert_rows(starts: np.ndarray, arrays: list[np.ndarray], rows: np.ndarray, indptr: np.ndarray,
                 added: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    """CSR postings (`starts`, the `arrays` they index) with `added`'s (CSR `indptr`, rows `rows`, each row once)
    put after each row's own: (the new row starts, the joined arrays). The postings between two rows that gain some
    move by the same amount, so they are copied as one slice each: O(postings) with a loop over the rows touched,
    not a sort of all of them (most of an update at a million passages)."""
    n_rows = max(len(starts) - 1, int(rows.max()) + 1 if len(rows) else 0)
    starts = np.concatenate([starts, np.full(n_rows + 1 - len(starts), starts[-1])])
    more = np.zeros(n_rows, np.int64)
    more[rows] = np.diff(indptr)
    out_starts = np.concatenate(([0], np.cumsum(np.diff(starts) + more)))
    order = np.argsort(rows, kind="stable")  # the rows touched, in row order
    out = [np.empty(int(out_starts[-1]), np.promote_types(a.dtype, b.dtype)) for a, b in zip(arrays, added)]
    at, shift = 0, 0
    for i in order:
        r = int(rows[i])
        end = int(starts[r + 1])  # row r's own postings end here: its new ones go after them
        for o, a in zip(out, arrays):
            o[at + shift: end + shift] = a[at: end]
        for o, a in zip(out, added):
            o[end + shift: end + shift + int(more[r])] = a[indptr[i]: indptr[i + 1]]
        at, shift = end, shift + int(more[r])
    for o, a in zip(out, arrays):
        o[at + shift:] = a[at:]
    return out_starts, out


@dataclass
class OkapiPostings:
    """rank-bm25's Okapi model held as postings. `okapi` is a BM25Okapi with its statistics (idf, k1, b, epsilon,
    avgdl, corpus_size, doc_len as an array) but without its per-document dicts (`doc_freqs`), which took several
    KB per document; postings are int32 documents and the smallest integer type that holds the counts, so a
    passage costs about 5 bytes per distinct term (1M passages: docs/scale.md)."""

    okapi: object          # rank_bm25.BM25Okapi, statistics only
    terms: dict[str, int]  # term -> row of the postings
    indptr: np.ndarray     # (n_terms + 1,) CSR row starts
    docs: np.ndarray       # (n_postings,) int32 document of each posting
    tf: np.ndarray         # (n_postings,) the term's count in that document (an unsigned integer type)
    norm: np.ndarray       # (n_docs,) k1 * (1 - b + b * |d| / avgdl)
    stem: bool = False     # terms are the words' stems (`stems`); queries are stemmed the same way

    @classmethod
    def build(cls, corpus: Iterable[list[str]], stem: bool = False) -> "OkapiPostings":
        """One pass over the documents' words (an iterator is read once, never held): each document's counts go
        into flat arrays as it is read, then rank-bm25's own `_calc_idf` runs on the document frequencies in
        first-seen order (the order its sum of idfs takes, so the floor and every score are rank-bm25's)."""
        terms: dict[str, int] = {}
        term_ids, tf, distinct, doc_len = array("i"), array("i"), array("i"), array("q")
        for doc in corpus:
            freqs = Counter(stems(doc) if stem else doc)  # first occurrences in order, as rank-bm25's dict
            term_ids.extend([terms.setdefault(w, len(terms)) for w in freqs])
            tf.extend(freqs.values())
            distinct.append(len(freqs))
            doc_len.append(sum(freqs.values()))
        docs = np.repeat(np.arange(len(doc_len), dtype=np.int32), np.frombuffer(distinct, np.int32))
        return cls._assemble(terms, np.frombuffer(term_ids, np.int32), docs, np.frombuffer(tf, np.int32),
                             np.frombuffer(doc_len, np.int64).copy(), stem)

    @classmethod
    def _assemble(cls, terms: dict[str, int], rows: np.ndarray, docs: np.ndarray, tf: np.ndarray,
                  doc_len: np.ndarray, stem: bool) -> "OkapiPostings":
        """The model of postings given as (term row, document, count) triples, each term's in document order."""
        order = np.argsort(rows, kind="stable")  # by term; within a term the documents keep their order
        indptr = np.concatenate(([0], np.cumsum(np.bincount(rows, minlength=len(terms)))))
        return cls._of_rows(terms, indptr, docs[order], tf[order], doc_len, stem)

    @classmethod
    def _of_rows(cls, terms: dict[str, int], indptr: np.ndarray, docs: np.ndarray, tf: np.ndarray,
                 doc_len: np.ndarray, stem: bool) -> "OkapiPostings":
        """The model of CSR postings (term rows `indptr`, each term's in document order), with rank-bm25's idf of
        its document frequencies in the terms' order."""
        okapi = _okapi(doc_len)
        if terms:  # rank-bm25 averages the idfs: none to average without a term
            okapi._calc_idf(dict(zip(terms, np.diff(indptr).tolist())))
        small = np.min_scalar_type(int(tf.max())) if len(tf) else np.uint8  # counts are small: 1 byte mostly
        return cls(okapi, terms, indptr, docs.astype(np.int32, copy=False), tf.astype(small, copy=False),
                   _norm(okapi), stem)

    def merged(self, keep: np.ndarray, new: "OkapiPostings | None" = None) -> "OkapiPostings":
        """The model of this one's documents where `keep` (a mask over them) followed by `new`'s (if any), without
        reading any text again: the postings are filtered, renumbered and joined, and the idf recomputed from the new
        document frequencies (terms no document holds any more go, as a fresh build never sees them). Equal to
        `build` over the same documents, bit for bit where nothing was removed (the terms keep first-seen order)."""
        if new is not None and new.stem != self.stem:
            raise ValueError("merging postings of stems with postings of words")
        terms = dict(self.terms)
        alive = keep[self.docs]
        renumber = np.cumsum(keep, dtype=np.int64).astype(np.int32) - 1
        starts, arrays = _kept_starts(self.indptr, alive), [renumber[self.docs[alive]], self.tf[alive]]
        doc_len = [self.okapi.doc_len[keep]]
        if new is not None:
            rows = np.fromiter((terms.setdefault(t, len(terms)) for t in new.terms), np.int64, len(new.terms))
            starts, arrays = _insert_rows(starts, arrays, rows, new.indptr, [new.docs + np.int32(keep.sum()), new.tf])
            doc_len.append(new.okapi.doc_len)
        held = np.diff(starts) > 0
        if not held.all():  # drop the terms only removed documents held, keeping the others' order
            row_of = np.cumsum(held) - 1
            terms = {t: int(row_of[r]) for t, r in terms.items() if held[r]}
            starts = np.concatenate(([0], np.cumsum(np.diff(starts)[held])))
        return self._of_rows(terms, starts, *arrays, np.concatenate(doc_len), self.stem)

    def arrays(self) -> dict[str, np.ndarray]:
        """Everything the model is, as arrays (`from_arrays` reads them back): an index saves them beside its corpus,
        so opening it does not read every passage again. Terms are runs of word characters, so one newline-joined
        UTF-8 string holds them all."""
        okapi = self.okapi
        return {"terms": np.frombuffer("\n".join(self.terms).encode("utf-8"), np.uint8), "indptr": self.indptr,
                "docs": self.docs, "tf": self.tf, "doc_len": okapi.doc_len,
                "idf": np.fromiter((okapi.idf[t] for t in self.terms), np.float64, len(self.terms)),
                "settings": np.asarray([okapi.k1, okapi.b, okapi.epsilon, float(self.stem)])}

    @classmethod
    def from_arrays(cls, saved) -> "OkapiPostings":
        """The model that `arrays` gave, with the same scores."""
        text = bytes(saved["terms"]).decode("utf-8")
        terms = text.split("\n") if text else []
        k1, b, epsilon, stem = (float(v) for v in saved["settings"])
        okapi = _okapi(np.asarray(saved["doc_len"], np.int64), k1, b, epsilon)
        okapi.idf = dict(zip(terms, saved["idf"].tolist()))
        indptr, docs, tf = (np.asarray(saved[k]) for k in ("indptr", "docs", "tf"))  # an .npz reads at each lookup
        if len(indptr) != len(terms) + 1 or len(docs) != indptr[-1] or len(tf) != indptr[-1]:
            raise ValueError(f"saved BM25 postings disagree: {len(terms)} terms, {len(indptr)} row starts, "
                             f"{len(docs)} postings")
        return cls(okapi, {t: i for i, t in enumerate(terms)}, indptr, docs, tf, _norm(okapi), bool(stem))

    def term(self, word: str) -> str:
        """The term a word is indexed under."""
        return stems([word])[0] if self.stem else word

    def get_scores(self, query: list[str]) -> np.ndarray:
        """Equal to `BM25Okapi.get_scores(query)`: sum over query terms (repeats count) of
        idf(q) * tf (k1 + 1) / (tf + k1 (1 - b + b |d| / avgdl))."""
        score = np.zeros(self.okapi.corpus_size)
        for q in (stems(query) if self.stem else query):
            row = self.terms.get(q)
            if row is None:
                continue
            a, b = self.indptr[row], self.indptr[row + 1]
            docs, tf = self.docs[a:b], self.tf[a:b]
            score[docs] += self.okapi.idf[q] * (tf * (self.okapi.k1 + 1) / (tf + self.norm[docs]))
        return score


@dataclass
class SentenceBM25:
    """BM25 (rank-bm25 Okapi) over a corpus's sentences and sentence windows, built once per corpus state."""

    bounds: list[np.ndarray]  # per document: sentence start positions + its end
    sentences: OkapiPostings  # rank-bm25 Okapi over single sentences
    windows: OkapiPostings  # ... over each sentence with `window` neighbours each side
    n_positions: int

    @classmethod
    def build(cls, corpus: CorpusMap, window: int = 1) -> "SentenceBM25":
        bounds, own_all, windows = [], [], []
        for doc in corpus.documents():
            starts = np.append(doc.sentence_starts, doc.end)
            own = [words(corpus.span_text(a, b)[3]) for a, b in zip(starts[:-1], starts[1:])]
            bounds.append(starts)
            own_all += own
            windows += [sum(own[max(0, i - window): i + window + 1], []) for i in range(len(own))]
        return cls(bounds, OkapiPostings.build(own_all), OkapiPostings.build(windows), corpus.n_positions)

    def sentence_scores(self, question: str, context_weight: float = 0.5) -> np.ndarray:
        """Each sentence's own score plus `context_weight` times its window's: the own score puts the peak on the
        matching sentence; the window lets a neighbour (a title line) lend context."""
        query = words(question)
        if not query:
            return np.zeros(self.sentences.okapi.corpus_size)
        return np.maximum(self.sentences.get_scores(query), 0.0) + \
            context_weight * np.maximum(self.windows.get_scores(query), 0.0)

    def token_scores(self, question: str, context_weight: float = 0.5) -> np.ndarray:
        """`sentence_scores` spread over each sentence's tokens."""
        scores = np.zeros(self.n_positions, dtype=np.float32)
        if not words(question):
            return scores
        per_sentence = self.sentence_scores(question, context_weight)
        i = 0
        for starts in self.bounds:
            n = len(starts) - 1
            scores[starts[0]: starts[-1]] = np.repeat(per_sentence[i: i + n], np.diff(starts))
            i += n
        return scores
