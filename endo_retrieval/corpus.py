"""Token positions <-> documents, character spans and sentence boundaries.

Documents are laid out one after another in one global position space (the positions the feature index stores).
A removed document's range is never reused, so positions held elsewhere stay valid. The documents are held as
columns (`corpus_columns.py`): saved as one array file (`array_file.py`, written atomically) that opening maps, and a
`DocumentView` is made when one is asked for. A map saved before columns (`.npz`, a JSON header of every
document) still reads.
"""
from __future__ import annotations

import io
import json
import os
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from endo_retrieval.array_file import ArrayFile, is_array_file, write_arrays
from endo_retrieval.corpus_columns import (Columns, check_columns, check_delta, columns_of_header, joined, live_ids,
                                           row_starts)
from endo_retrieval.files import MAX_VALUE, IndexCorruptError, check_json, link_unchanged
from endo_retrieval.sentences import ABBREVIATIONS, split_sentences  # noqa: F401 (the corpus's, re-exported)

FORMAT_NAME = "endo-corpus-map"  # the .npz map saved before columns (read only)
FORMAT_VERSION = 1
KIND = "corpus-map"  # the array file's kind
CORPUS_FILE, OLD_CORPUS_FILE = "corpus.arrays", "corpus.npz"  # its name in an index folder, now and before
# in an index folder the corpus is a base file, kept (hard-linked) from one generation to the next while it holds
# most of the documents, and a delta rewritten at each save: the documents added since and the base's removed rows
DELTA_FILE, DELTA_KIND = "corpus_delta.arrays", "corpus-delta"
COMPACT_SHARE = 0.1  # once removed and added documents pass this share of the base, a save writes a new base
VIEWS_KEPT = 256  # DocumentViews kept for the next lookup (a hit's text is read several times per question)

@dataclass(frozen=True, eq=False)
class DocumentView:
    """A document as the corpus holds it: its global positions, text, token offsets and sentence starts (the
    document a user indexes is index.engine's `Document`)."""

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
    """Global token positions <-> (document, token offset, character span), plus sentence boundaries. The
    documents are runs of columns (`Columns`: the saved file's, mapped, then those added since), with a mask of
    the rows still live; documents added since the last lookup wait as `DocumentView`s until one is asked for."""

    def __init__(self) -> None:
        self._runs: list[Columns] = []
        self._run_at = np.zeros(1, np.int64)  # first global row of each run, and the total
        self._live = np.zeros(0, bool)  # per global row: not removed
        self._added: dict[str, DocumentView] = {}  # documents added since the runs were last joined
        self._next = 0  # positions are never reused, even after removal
        self._state: dict | None = None  # what lookups read, made once per state (`_view`)
        self._views: dict[int, DocumentView] = {}
        self._changes = 0  # adds and removes so far
        self._written: tuple[int, Columns] | None = None  # the base a save wrote anew, after that many changes
        # readers share the index (a writer is alone), but lookups fill the lazy parts above: one at a time
        self._lazy = threading.RLock()

    # building ---------------------------------------------------------------------------------------------------

    def add_document(self, doc_id: str, text: str, offsets: np.ndarray, metadata: dict | None = None,
                     sentence_chars: np.ndarray | None = None) -> tuple[int, int]:
        """Give the document's tokens the global positions [start, end), right after the last document.
        `sentence_chars`: `split_sentences(text)` if already computed."""
        if not isinstance(doc_id, str) or not doc_id:
            raise ValueError(f"doc_id must be a non-empty string, got {doc_id!r}")
        self._adopt_written()
        if doc_id in self:
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
        self._added[doc_id] = DocumentView(doc_id, start, end, text, offsets, metadata, sentences)
        self._next, self._state, self._changes = end, None, self._changes + 1
        return start, end

    def _join_added(self) -> None:
        """The documents added since, as one more run of columns."""
        with self._lazy:
            if self._added:
                self._append_run(Columns.of_documents(list(self._added.values())))
                self._added = {}

    def _append_run(self, run: Columns) -> None:
        # bounds first, the run last: a reader walking `_runs` meanwhile finds every run's rows in `_live`
        self._live = np.concatenate([self._live, np.ones(run.n, bool)])
        self._run_at = np.append(self._run_at, self._run_at[-1] + run.n)
        self._state = None
        self._runs.append(run)

    def _row(self, doc_id: str) -> int:
        """The global row of a live document in the runs, -1 where there is none (or it waits in `_added`)."""
        for k, run in enumerate(self._runs):
            i = run.find(doc_id)
            if i >= 0 and self._live[self._run_at[k] + i]:
                return int(self._run_at[k] + i)
        return -1

    def remove_document(self, doc_id: str) -> tuple[int, int]:
        """Forget a document; returns its (start, end) so the caller can drop the same range from the index."""
        self._adopt_written()
        doc = self.doc(doc_id)  # joins the documents added since: every live one has a row
        self._live[self._row(doc_id)] = False
        self._state, self._views, self._changes = None, {}, self._changes + 1
        return doc.start, doc.end

    def extend(self, other: "CorpusMap") -> int:
        """Append `other`'s documents after this map's positions (removed ranges kept); returns the shift."""
        self._adopt_written()
        shift = self._next
        self._changes += 1
        for doc_id in other.doc_ids():
            if doc_id in self:
                raise ValueError(f"document id {doc_id!r} is in both corpus maps; ids must be unique")
        self._join_added()
        other._join_added()
        if len(other._live):
            self._append_run(joined(other._runs).taken(other._live, shift))
        self._next, self._state = shift + other._next, None
        return shift

    # lookup -----------------------------------------------------------------------------------------------------

    def _view(self) -> dict:
        """The live documents' rows and bounds in position order, made once per state."""
        with self._lazy:
            self._join_added()
            if self._state is None:
                rows = np.flatnonzero(self._live)
                starts, ends = (np.concatenate([r.a[c] for r in self._runs]) if len(self._runs) > 1 else
                                self._runs[0].a[c] if self._runs else np.zeros(0, np.int64)
                                for c in ("starts", "ends"))
                every = len(rows) == len(self._live)
                self._state = {"rows": rows, "starts": starts if every else starts[rows],
                               "ends": ends if every else ends[rows]}
            return self._state

    def _run_of(self, row: int) -> tuple[Columns, int]:
        k = int(np.searchsorted(self._run_at, row, side="right")) - 1
        return self._runs[k], row - int(self._run_at[k])

    def _document(self, row: int) -> DocumentView:
        """The view of global row `row` (the last VIEWS_KEPT are kept)."""
        with self._lazy:
            doc = self._views.get(row)
            if doc is None:
                run, i = self._run_of(row)
                doc = DocumentView(run.doc_id(i), int(run.a["starts"][i]), int(run.a["ends"][i]), run.text(i),
                                   run.offsets(i), run.metadata(i), run.sentence_starts(i))
                if len(self._views) >= VIEWS_KEPT:
                    self._views.pop(next(iter(self._views)))
                self._views[row] = doc
            return doc

    def __contains__(self, doc_id: str) -> bool:
        return isinstance(doc_id, str) and (doc_id in self._added or self._row(doc_id) >= 0)

    def __len__(self) -> int:
        return int(self._live.sum()) + len(self._added)

    @property
    def n_positions(self) -> int:
        """One past the last position ever assigned (removed ranges included): the length of a score array."""
        return self._next

    @property
    def n_tokens(self) -> int:
        view = self._view()
        return int((view["ends"] - view["starts"]).sum())

    def doc(self, doc_id: str) -> DocumentView:
        if isinstance(doc_id, str) and doc_id in self._added:
            self._join_added()
        row = self._row(doc_id) if isinstance(doc_id, str) else -1
        if row < 0:
            raise KeyError(f"no document {doc_id!r} in the corpus")
        return self._document(row)

    def doc_ids(self) -> list[str]:
        """The live documents' ids in position order (decoded from the id column, no DocumentView made)."""
        self._join_added()
        out = []
        for k, run in enumerate(self._runs):
            live = self._live[self._run_at[k]: self._run_at[k + 1]]
            out += run.doc_ids(None if live.all() else np.flatnonzero(live))
        return out

    def id_column(self) -> tuple[np.ndarray, np.ndarray]:
        """The live documents' ids in position order as one column (UTF-8 bytes, row starts): what the dense
        stage's rows are matched against without a string per document."""
        self._join_added()
        parts = [live_ids(run.a["ids"], run.a["id_at"], self._live[self._run_at[k]: self._run_at[k + 1]])
                 for k, run in enumerate(self._runs)]
        if len(parts) == 1:
            return parts[0]
        ids = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.uint8)
        return ids, row_starts(np.concatenate([np.diff(p[1]) for p in parts]) if parts else np.zeros(0, np.int64))

    def documents(self) -> Iterator[DocumentView]:
        """Live documents in position order; `locate()`'s document indices index this order. Each is a view made
        as the iteration reaches it."""
        rows = self._view()["rows"]
        return (self._view_of(int(r)) for r in rows)

    def documents_from(self, position: int) -> Iterator[DocumentView]:
        """The live documents that start at or after `position`, in position order (views, as `documents()`)."""
        view = self._view()
        first = int(np.searchsorted(view["starts"], position))
        return (self._view_of(int(r)) for r in view["rows"][first:])

    def _view_of(self, row: int) -> DocumentView:
        run, i = self._run_of(row)
        return DocumentView(run.doc_id(i), int(run.a["starts"][i]), int(run.a["ends"][i]), run.text(i),
                            run.offsets(i), run.metadata(i), run.sentence_starts(i))

    def document_at(self, index: int) -> DocumentView:
        """The document at `index` in `documents()` order (what `locate()` returns)."""
        return self._document(int(self._view()["rows"][index]))

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """(starts, ends) of the live documents in position order."""
        view = self._view()
        return view["starts"], view["ends"]

    def segment_bounds(self) -> np.ndarray:
        """Sorted start and end positions of the live documents (for select.py's segment_bounds)."""
        starts, ends = self.bounds()
        return np.union1d(starts, ends)

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(document index in `documents()` order, token offset inside it) per position; (-1, -1) for a position
        that belongs to no live document (a removed range or past the end)."""
        positions = np.asarray(positions, dtype=np.int64)
        starts, ends = self.bounds()
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
        doc = self.document_at(d_start)
        char_start, char_end = int(doc.offsets[o_start, 0]), int(doc.offsets[o_start:o_last + 1, 1].max())
        return doc.doc_id, char_start, char_end, doc.text[char_start:char_end]

    def sentence_bounds(self, doc: str | DocumentView) -> np.ndarray:
        """Global token positions where the document's sentences start (its first position included)."""
        return (self.doc(doc) if isinstance(doc, str) else doc).sentence_starts

    def sentence_starts(self) -> np.ndarray:
        """Sorted global positions where any sentence starts, every document start included."""
        view = self._view()
        if "sentences" not in view:
            parts = []
            for k, run in enumerate(self._runs):
                live = self._live[self._run_at[k]: self._run_at[k + 1]]
                sent = run.a["sentences"]
                parts.append(sent if live.all() else sent[np.repeat(live, np.diff(run.a["sent_at"]))])
            view["sentences"] = (parts[0] if len(parts) == 1 else np.concatenate(parts)) if parts \
                else np.zeros(0, np.int64)
        return view["sentences"]

    # persistence ------------------------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> Path:
        """Write the live documents' columns to the file `path` atomically (an array file: temp file beside it,
        then os.replace)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._join_added()
        runs = [run.taken(self._live[self._run_at[k]: self._run_at[k + 1]]) for k, run in enumerate(self._runs)]
        columns = joined(runs) if runs else Columns.of_documents([])
        return write_arrays(path, KIND, columns.a, {"next": self._next})

    def save_in(self, folder: Path, previous: Path | None = None) -> None:
        """Write the map into an index folder being filled: the base file, hard-linked from the committed folder
        `previous` where it is the one this map was read from and the changes since stay under COMPACT_SHARE of
        it (else written anew, all live documents), and the delta file."""
        self._join_added()
        base = self._runs[0] if self._runs else None
        n = base.n if base is not None else 0
        removed = np.flatnonzero(~self._live[:n])
        changes = len(removed) + int(self._live[n:].sum())
        if base is not None and changes <= COMPACT_SHARE * n and \
                link_unchanged(previous, folder, CORPUS_FILE, base.source):
            delta = [run.taken(self._live[self._run_at[k]: self._run_at[k + 1]]) for k, run in
                     enumerate(self._runs) if k > 0]
        else:  # compacted: one new base of the live documents, which this map reads from its next change on
            self.save(folder / CORPUS_FILE)
            with open(folder / CORPUS_FILE, "rb") as f:
                saved = ArrayFile.read(f, folder / CORPUS_FILE, KIND, check=False)  # just written
                self._written = (self._changes, Columns(saved.arrays, source=os.fstat(f.fileno())))
            delta, removed = [], np.zeros(0, np.int64)
        columns = joined(delta) if delta else Columns.of_documents([])
        write_arrays(folder / DELTA_FILE, DELTA_KIND, {**columns.a, "removed": removed}, {"next": self._next})

    def _adopt_written(self) -> None:
        """Before a change: where the last save wrote a new base and nothing changed since, read that base in place
        of these runs (so the next save links it). Only changes call it, which the index makes alone (its write
        lock), so no question reads the runs while they are replaced."""
        written, self._written = self._written, None
        if written is not None and written[0] == self._changes:
            self._runs, self._run_at, self._live = [], np.zeros(1, np.int64), np.zeros(0, bool)
            self._append_run(written[1])
            self._views = {}

    @classmethod
    def read_in(cls, open_file, folder: Path) -> CorpusMap:
        """The map of an index folder (`save_in`'s files, through files.read_folder's `open_file`), every file
        checked; IndexCorruptError naming the damaged one."""
        with open_file(CORPUS_FILE) as f:
            base, source = ArrayFile.read(f, folder / CORPUS_FILE, KIND), os.fstat(f.fileno())
        with open_file(DELTA_FILE) as f:
            delta = ArrayFile.read(f, folder / DELTA_FILE, DELTA_KIND)
        removed, nxt = delta.arrays.pop("removed", None), delta.meta.get("next")
        for path, arrays in ((folder / CORPUS_FILE, base.arrays), (folder / DELTA_FILE, delta.arrays)):
            try:
                if type(nxt) is not int or not 0 <= nxt < MAX_VALUE:
                    raise ValueError(f"'next' is {nxt!r}")
                check_columns(arrays, nxt)
                if path.name == DELTA_FILE:
                    check_delta(base.arrays, arrays, removed)
            except (ValueError, TypeError, IndexError) as err:
                raise IndexCorruptError(f"corpus map {path} is damaged or inconsistent ({err}); delete the index "
                                        "folder and rebuild it") from None
        corpus = cls()
        corpus._append_run(Columns(base.arrays, source=source))
        if len(delta.arrays["starts"]):
            corpus._append_run(Columns(delta.arrays))
        corpus._live[removed] = False
        corpus._next = nxt
        return corpus

    @classmethod
    def read_saved(cls, open_file, folder: Path, columns: bool) -> CorpusMap:
        """The map of an index folder: `read_in`'s files (`columns`), or the corpus.npz saved before them."""
        if columns:
            return cls.read_in(open_file, folder)
        with open_file(OLD_CORPUS_FILE) as f:
            return cls.read(f, folder / OLD_CORPUS_FILE)

    @classmethod
    def load(cls, path: str | os.PathLike) -> CorpusMap:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no corpus map at {path}; build one and save() it there first")
        with open(path, "rb") as f:
            return cls.read(f, path)

    @classmethod
    def read(cls, f, path: Path) -> CorpusMap:
        """`load()` from an open file (`path` names it in messages): the columns mapped after every check
        (`check_columns`), or a map saved before columns (.npz). IndexCorruptError for anything else."""
        if not is_array_file(f):
            return cls._read_npz(f, path)
        saved = ArrayFile.read(f, path, KIND)
        nxt = saved.meta.get("next")
        try:
            if type(nxt) is not int or not 0 <= nxt < MAX_VALUE:
                raise ValueError(f"'next' is {nxt!r}")
            check_columns(saved.arrays, nxt)
        except (ValueError, TypeError, IndexError) as err:
            raise IndexCorruptError(f"corpus map {path} is damaged or inconsistent ({err}); delete it and rebuild "
                                    "the index") from None
        corpus = cls()
        corpus._append_run(Columns(saved.arrays))
        corpus._next = nxt
        return corpus

    @classmethod
    def _read_npz(cls, f, path: Path) -> CorpusMap:
        """A map saved before columns: its JSON header of every document and two arrays, made columns and checked
        as the columns of an array file are."""
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
            nxt = header["next"]
            if type(nxt) is not int or not 0 <= nxt < MAX_VALUE:
                raise ValueError("'next' lies outside the positions")
            columns = columns_of_header(header["docs"], offsets, sentences)
            check_columns(columns.a, nxt)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError) as err:
            raise IndexCorruptError(f"corpus map {path} is damaged or inconsistent ({type(err).__name__}: {err}); "
                                    "delete it and rebuild the index") from None
        corpus = cls()
        corpus._append_run(columns)
        corpus._next = nxt
        return corpus
