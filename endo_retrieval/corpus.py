"""Token positions <-> documents, character spans and sentence boundaries.

Documents are laid out one after another in one global position space (the positions the feature index stores).
A removed document's range is never reused, so positions held elsewhere stay valid. Saved as one `.npz` file (a JSON
header stored as bytes plus integer arrays; loaded with allow_pickle=False), written atomically.
"""
from __future__ import annotations

import io
import json
import os
import re
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from endo_retrieval.files import MAX_VALUE, IndexCorruptError, atomic_write, check_json

FORMAT_NAME = "endo-corpus-map"
FORMAT_VERSION = 1

# Words whose trailing period does not end a sentence (compared lower-case, without the final period).
ABBREVIATIONS = frozenset(
    "e.g i.e cf vs al mr mrs ms dr prof sr jr st mt no fig figs eq eqs approx ca inc ltd co corp dept est "
    "jan feb mar apr jun jul aug sep sept oct nov dec u.s u.k ph.d".split()
)
# . ! ? then whitespace; a newline; or the full-width 。！？ of scripts written without spaces (no space follows them)
_SENTENCE_END = re.compile(r"[.!?]+[\"'\u201d\u2019)\]]*\s+|\n\s*"
                           r"|[\u3002\uff01\uff1f]+[\u300d\u300f\u201d\u2019\uff09]*\s*")


def split_sentences(text: str, start: int = 0, end: int | None = None) -> np.ndarray:
    """Character offsets where sentences start: after . ! ? (plus closing quotes/brackets) and whitespace, and after
    every newline. A period does not split after a known abbreviation ('e.g.'), a single-letter initial ('J.'), or
    when the next word starts in lower case; decimals ('3.5') never split since no whitespace follows the period.

    `start`, `end`: only the starts in [start, end), where `start` is 0 or follows a newline and a non-blank
    character (a cut of `Backbone.encode_pieces`): no match crosses such a point, so the starts are the whole
    text's (the indexer splits each piece while the accelerator runs)."""
    end = len(text) if end is None else end
    starts = [start]
    for m in _SENTENCE_END.finditer(text, start, end):
        nxt = m.end()
        if nxt >= end:
            break
        if "\n" not in m.group():
            if text[nxt].islower():
                continue
            if set(m.group().rstrip().rstrip("\"'\u201d\u2019)]")) == {"."}:  # ended by periods only
                before = text[max(0, m.start() - 64): m.start()].split()  # the word before (not the whole prefix)
                word = before[-1].lstrip("(\"'[").lower() if before else ""
                if word in ABBREVIATIONS or (len(word) == 1 and word.isalpha()):
                    continue
        starts.append(nxt)
    return np.unique(np.asarray(starts, dtype=np.int64))


@dataclass(frozen=True, eq=False)
class Document:
    doc_id: str
    start: int  # first global position
    end: int  # one past the last global position
    text: str
    offsets: np.ndarray = field(repr=False)  # (n, 2) character span of each token: int32 (int64 past 2**31 chars)
    metadata: dict
    sentence_starts: np.ndarray = field(repr=False)  # global positions where sentences start

    @property
    def n_tokens(self) -> int:
        return self.end - self.start


class CorpusMap:
    """Global token positions <-> (document, token offset, character span), plus sentence boundaries."""

    def __init__(self) -> None:
        self._docs: dict[str, Document] = {}  # insertion order == position order
        self._next = 0  # positions are never reused, even after removal
        self._cache: tuple[np.ndarray, np.ndarray, list[Document]] | None = None

    # building ---------------------------------------------------------------------------------------------------

    def add_document(self, doc_id: str, text: str, offsets: np.ndarray, metadata: dict | None = None,
                     sentence_chars: np.ndarray | None = None) -> tuple[int, int]:
        """Give the document's tokens the global positions [start, end), right after the last document.
        `sentence_chars`: `split_sentences(text)` if already computed."""
        if not isinstance(doc_id, str) or not doc_id:
            raise ValueError(f"doc_id must be a non-empty string, got {doc_id!r}")
        if doc_id in self._docs:
            raise ValueError(f"document id {doc_id!r} is already in the corpus; remove it first or use a new id")
        if not isinstance(text, str):
            raise ValueError(f"document {doc_id!r}: text must be str (decode bytes first), got {type(text).__name__}")
        if "\x00" in text:
            raise ValueError(f"document {doc_id!r} contains NUL bytes and looks binary; pass extracted text instead")
        offsets = np.asarray(offsets, dtype=np.int64)
        if offsets.ndim != 2 or offsets.shape[1] != 2:
            raise ValueError(f"document {doc_id!r}: offsets must have shape (n_tokens, 2), got {offsets.shape}")
        if len(offsets) == 0:
            raise ValueError(f"document {doc_id!r} has no tokens; skip empty documents")
        if offsets.min() < 0 or offsets.max() > len(text) or np.any(offsets[:, 0] > offsets[:, 1]):
            raise ValueError(f"document {doc_id!r}: token offsets must be spans [a, b) inside the text")
        metadata = dict(metadata or {})
        check_json(metadata, f"metadata of document {doc_id!r}")
        start, end = self._next, self._next + len(offsets)
        # a sentence starting at character c starts at the first token whose span ends after c
        ends = np.maximum.accumulate(offsets[:, 1])
        chars = split_sentences(text) if sentence_chars is None else np.asarray(sentence_chars, dtype=np.int64)
        local = np.searchsorted(ends, chars, side="right")
        sentences = start + np.unique(np.concatenate(([0], local[local < len(offsets)])))
        # int32 halves the map's largest part (16 bytes a token in int64, most of an index's RAM at a million passages)
        offsets = offsets.astype(np.int32) if len(text) < 2 ** 31 else offsets
        self._docs[doc_id] = Document(doc_id, start, end, text, offsets, metadata, sentences)
        self._next, self._cache = end, None
        return start, end

    def remove_document(self, doc_id: str) -> tuple[int, int]:
        """Forget a document; returns its (start, end) so the caller can drop the same range from the index."""
        doc = self.doc(doc_id)
        del self._docs[doc_id]
        self._cache = None
        return doc.start, doc.end

    def extend(self, other: "CorpusMap") -> int:
        """Append `other`'s documents after this map's positions (removed ranges kept); returns the shift."""
        shift = self._next
        for doc_id in other._docs:
            if doc_id in self._docs:
                raise ValueError(f"document id {doc_id!r} is in both corpus maps; ids must be unique")
        for d in other._docs.values():
            self._docs[d.doc_id] = Document(d.doc_id, d.start + shift, d.end + shift, d.text, d.offsets, d.metadata,
                                            d.sentence_starts + shift)
        self._next, self._cache = shift + other._next, None
        return shift

    # lookup -----------------------------------------------------------------------------------------------------

    def _arrays(self) -> tuple[np.ndarray, np.ndarray, list[Document]]:
        if self._cache is None:
            docs = list(self._docs.values())
            self._cache = (np.array([d.start for d in docs], np.int64), np.array([d.end for d in docs], np.int64), docs)
        return self._cache

    def __contains__(self, doc_id: str) -> bool:
        return doc_id in self._docs

    def __len__(self) -> int:
        return len(self._docs)

    @property
    def n_positions(self) -> int:
        """One past the last position ever assigned (removed ranges included): the length of a score array."""
        return self._next

    @property
    def n_tokens(self) -> int:
        return sum(d.n_tokens for d in self._docs.values())

    def doc(self, doc_id: str) -> Document:
        if doc_id not in self._docs:
            raise KeyError(f"no document {doc_id!r} in the corpus")
        return self._docs[doc_id]

    def documents(self) -> Iterator[Document]:
        """Live documents in position order; `locate()`'s document indices index this order."""
        return iter(self._arrays()[2])

    def segment_bounds(self) -> np.ndarray:
        """Sorted start and end positions of the live documents (for select.py's segment_bounds)."""
        starts, ends, _ = self._arrays()
        return np.union1d(starts, ends)

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(document index in `documents()` order, token offset inside it) per position; (-1, -1) for a position
        that belongs to no live document (a removed range or past the end)."""
        positions = np.asarray(positions, dtype=np.int64)
        starts, ends, _ = self._arrays()
        if len(starts) == 0:
            return np.full(positions.shape, -1), np.full(positions.shape, -1)
        doc = np.searchsorted(starts, positions, side="right") - 1
        clipped = np.maximum(doc, 0)
        inside = (doc >= 0) & (positions < ends[clipped])
        return np.where(inside, doc, -1), np.where(inside, positions - starts[clipped], -1)

    def span_text(self, start: int, end: int) -> tuple[str, int, int, str]:
        """(doc_id, char_start, char_end, text) of the tokens [start, end), which must lie in one document."""
        if end <= start:
            raise ValueError(f"span [{start}, {end}) is empty")
        (d_start, d_last), (o_start, o_last) = self.locate(np.array([start, end - 1]))
        if d_start < 0 or d_start != d_last:
            raise ValueError(f"span [{start}, {end}) does not lie inside one document; split it at document bounds")
        doc = self._arrays()[2][d_start]
        char_start, char_end = int(doc.offsets[o_start, 0]), int(doc.offsets[o_start:o_last + 1, 1].max())
        return doc.doc_id, char_start, char_end, doc.text[char_start:char_end]

    def sentence_bounds(self, doc: str | Document) -> np.ndarray:
        """Global token positions where the document's sentences start (its first position included)."""
        return (self.doc(doc) if isinstance(doc, str) else doc).sentence_starts

    def sentence_starts(self) -> np.ndarray:
        """Sorted global positions where any sentence starts, every document start included."""
        docs = self._arrays()[2]
        return np.concatenate([d.sentence_starts for d in docs]) if docs else np.zeros(0, np.int64)

    # persistence ------------------------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> Path:
        """Write the map to the file `path` (.npz) atomically (temp file beside it, then os.replace)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        docs = list(self._docs.values())
        header = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "next": self._next,
                  "docs": [{"id": d.doc_id, "start": d.start, "end": d.end, "text": d.text, "metadata": d.metadata,
                            "n_sentences": len(d.sentence_starts)} for d in docs]}
        arrays = {
            "header": np.frombuffer(json.dumps(header).encode(), dtype=np.uint8),
            "offsets": np.concatenate([d.offsets for d in docs]) if docs else np.zeros((0, 2), np.int32),
            "sentence_starts": self.sentence_starts(),
        }
        def write(tmp: Path) -> None:
            with open(tmp, "wb") as f:
                np.savez(f, **arrays)

        atomic_write(path, write)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> CorpusMap:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no corpus map at {path}; build one and save() it there first")
        with open(path, "rb") as f:
            return cls.read(f, path)

    @classmethod
    def read(cls, f, path: Path) -> CorpusMap:
        """`load()` from an open file (`path` names it in messages). IndexCorruptError for anything but a map
        this version wrote, the header's every field checked, so no other exception comes out of a damaged file."""
        try:
            with np.load(f, allow_pickle=False) as data:  # zip CRCs catch damaged members
                header = json.loads(data["header"].tobytes())
                offsets, sentences = data["offsets"], data["sentence_starts"]
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, io.UnsupportedOperation,
                MemoryError, NotImplementedError) as err:  # NotImplementedError: a zip compression method changed
            raise IndexCorruptError(f"corpus map {path} is damaged ({err}); delete it and rebuild the index") from None
        if not isinstance(header, dict) or header.get("format") != FORMAT_NAME or \
                header.get("version") != FORMAT_VERSION:
            version = header.get("version") if isinstance(header, dict) else None
            raise IndexCorruptError(f"corpus map {path} is not a {FORMAT_NAME!r} version {FORMAT_VERSION} "
                                    f"(version {version!r}); rebuild the index with this version.")
        try:
            return cls._from_header(header, offsets, sentences)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError) as err:
            raise IndexCorruptError(f"corpus map {path} is damaged or inconsistent ({type(err).__name__}: {err}); "
                                    "delete it and rebuild the index") from None

    @classmethod
    def _from_header(cls, header: dict, offsets: np.ndarray, sentences: np.ndarray) -> CorpusMap:
        """The map a saved header and its arrays describe; ValueError where they do not fit together."""
        def need(ok, what: str) -> None:
            if not ok:
                raise ValueError(what)

        need(offsets.dtype.kind == "i" and offsets.ndim == 2 and offsets.shape[1] == 2, "offsets are not (n, 2) ints")
        need(sentences.dtype.kind == "i" and sentences.ndim == 1, "sentence starts are not ints")
        corpus, tok, sent, end = cls(), 0, 0, 0
        for d in header["docs"]:
            start, stop, m, text = d["start"], d["end"], d["n_sentences"], d["text"]
            need(all(type(v) is int for v in (start, stop, m)) and end <= start < stop and m >= 1,
                 f"document {d['id']!r} has bad bounds")
            need(isinstance(d["id"], str) and d["id"] and d["id"] not in corpus._docs, "a document id is bad")
            need(isinstance(text, str) and isinstance(d["metadata"], dict), f"document {d['id']!r} has bad fields")
            n, own, starts = stop - start, offsets[tok:tok + stop - start], sentences[sent:sent + m]
            need(len(own) == n and len(starts) == m, "the arrays are shorter than the documents")
            need(own.min() >= 0 and own.max() <= len(text) and np.all(own[:, 0] <= own[:, 1]),
                 f"document {d['id']!r}: token offsets lie outside its text")
            need(starts[0] == start and np.all(np.diff(starts) > 0) and starts[-1] < stop,
                 f"document {d['id']!r}: sentence starts lie outside it")
            corpus._docs[d["id"]] = Document(d["id"], start, stop, text, own, d["metadata"], starts)
            tok, sent, end = tok + n, sent + m, stop
        need(tok == len(offsets) and sent == len(sentences), "the arrays hold more than the documents")
        need(type(header["next"]) is int and end <= header["next"] < MAX_VALUE, "'next' lies outside the positions")
        corpus._next = header["next"]
        return corpus
