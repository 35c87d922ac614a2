"""The corpus map's documents as columns: one run of documents (a saved file, or the documents added since) held as
flat arrays (ids, UTF-8 text, JSON metadata, token spans, sentence starts, each with its row starts), never as one
Python object per document. A saved run is a memory map of its array file (`array_file.py`), so opening a corpus of
a million documents maps its columns instead of building a million objects.

Ids are found through a hash of their bytes (`id_hashes`, sorted, with the rows in that order), computed with
numpy over the whole column, so a lookup is a binary search and a byte compare.
"""
from __future__ import annotations

import json
import os

import numpy as np

from endo_retrieval.array_file import dumps

HASH_BASE = np.uint64(0x100000001B3)  # FNV's 64-bit prime as a polynomial base: ids' bytes mix well under it
COLUMNS = ("starts", "ends", "ids", "id_at", "text", "text_at", "meta", "meta_at", "offsets", "tok_at",
           "sentences", "sent_at", "id_hash", "id_order")


def id_hashes(data: np.ndarray, at: np.ndarray) -> np.ndarray:
    """A 64-bit polynomial hash of each id, data[at[i]:at[i + 1]] (ids are never empty), wrapping mod 2**64."""
    lengths = np.diff(at)
    if not len(lengths):
        return np.zeros(0, np.uint64)
    powers = np.cumprod(np.full(int(lengths.max()), HASH_BASE, np.uint64))  # base ** 1, 2, ...; wraps, as meant
    within = np.arange(len(data), dtype=np.int64) - np.repeat(at[:-1], lengths)
    terms = (np.asarray(data, np.uint64) + np.uint64(1)) * powers[within]
    return np.add.reduceat(terms, at[:-1]) ^ lengths.astype(np.uint64)


def row_starts(lengths) -> np.ndarray:
    lengths = lengths if isinstance(lengths, np.ndarray) else np.fromiter(lengths, np.int64)
    return np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))


class Columns:
    """One run of documents, rows in position order. `arrays` holds COLUMNS (read-only maps for a saved run)."""

    def __init__(self, arrays: dict[str, np.ndarray], source: os.stat_result | None = None):
        self.a = arrays
        self.n = len(arrays["starts"])
        self.source = source  # the file the run was read from (a save may link it), None for one in memory

    @classmethod
    def of_documents(cls, docs: list) -> "Columns":
        """The columns of corpus DocumentViews (their offsets kept in int32 where every text is below 2**31 chars)."""
        ids = [d.doc_id.encode("utf-8") for d in docs]
        texts = [d.text.encode("utf-8") for d in docs]
        metas = [dumps(d.metadata) for d in docs]
        wide = any(o.dtype == np.int64 for o in (d.offsets for d in docs))
        arrays = {"starts": np.array([d.start for d in docs], np.int64),
                  "ends": np.array([d.end for d in docs], np.int64),
                  "ids": np.frombuffer(b"".join(ids), np.uint8), "id_at": row_starts(map(len, ids)),
                  "text": np.frombuffer(b"".join(texts), np.uint8), "text_at": row_starts(map(len, texts)),
                  "meta": np.frombuffer(b"".join(metas), np.uint8), "meta_at": row_starts(map(len, metas)),
                  "offsets": np.concatenate([d.offsets for d in docs]).astype(np.int64 if wide else np.int32)
                  if docs else np.zeros((0, 2), np.int32),
                  "tok_at": row_starts(d.end - d.start for d in docs),
                  "sentences": np.concatenate([d.sentence_starts for d in docs]).astype(np.int64)
                  if docs else np.zeros(0, np.int64),
                  "sent_at": row_starts(len(d.sentence_starts) for d in docs)}
        return cls(with_id_index(arrays))

    # ---- one row -------------------------------------------------------------------------------------------
    def doc_id(self, i: int) -> str:
        return bytes(self.a["ids"][self.a["id_at"][i]: self.a["id_at"][i + 1]]).decode("utf-8")

    def text(self, i: int) -> str:
        return bytes(self.a["text"][self.a["text_at"][i]: self.a["text_at"][i + 1]]).decode("utf-8")

    def metadata(self, i: int) -> dict:
        return json.loads(bytes(self.a["meta"][self.a["meta_at"][i]: self.a["meta_at"][i + 1]]))

    def offsets(self, i: int) -> np.ndarray:
        return self.a["offsets"][self.a["tok_at"][i]: self.a["tok_at"][i + 1]]

    def sentence_starts(self, i: int) -> np.ndarray:
        return self.a["sentences"][self.a["sent_at"][i]: self.a["sent_at"][i + 1]]

    def find(self, doc_id: str) -> int:
        """The row of `doc_id`, -1 where this run holds none."""
        return find_id(self.a, doc_id)

    def doc_ids(self, rows: np.ndarray | None = None) -> list[str]:
        """The ids of `rows` (all: None), decoded from the column in one pass."""
        return decode_ids(self.a["ids"], self.a["id_at"], rows)

    # ---- many rows -----------------------------------------------------------------------------------------
    def taken(self, keep: np.ndarray, shift: int = 0) -> "Columns":
        """The rows where `keep` (a mask), positions moved by `shift`: what a save or a join writes."""
        if keep.all() and shift == 0:
            return self
        a = self.a
        out = {"starts": a["starts"][keep] + shift, "ends": a["ends"][keep] + shift}
        for data, at in (("ids", "id_at"), ("text", "text_at"), ("meta", "meta_at"), ("offsets", "tok_at"),
                         ("sentences", "sent_at")):
            lengths = np.diff(a[at])
            out[data] = a[data][np.repeat(keep, lengths)]
            out[at] = row_starts(lengths[keep])
        out["sentences"] = out["sentences"] + shift
        return Columns(with_id_index(out))


def find_id(a: dict[str, np.ndarray], doc_id: str) -> int:
    """The row of `doc_id` in columns `a` ("ids", "id_at" and their index "id_hash", "id_order"), -1 where none."""
    key = doc_id.encode("utf-8")
    h = id_hashes(np.frombuffer(key, np.uint8), np.array([0, len(key)]))[0]
    hashes = a["id_hash"]
    for j in range(int(np.searchsorted(hashes, h)), int(np.searchsorted(hashes, h, side="right"))):
        row = int(a["id_order"][j])
        if bytes(a["ids"][a["id_at"][row]: a["id_at"][row + 1]]) == key:
            return row
    return -1


def decode_ids(ids: np.ndarray, at: np.ndarray, rows: np.ndarray | None = None) -> list[str]:
    """The ids of `rows` (all: None) of an id column, decoded in one pass where they are ASCII."""
    if rows is None:
        joined = bytes(ids).decode("utf-8")
        if joined.isascii():  # characters are bytes: slice the one string
            return [joined[a:b] for a, b in zip(at[:-1].tolist(), at[1:].tolist())]
        rows = np.arange(len(at) - 1)
    return [bytes(ids[a:b]).decode("utf-8") for a, b in zip(at[rows].tolist(), at[rows + 1].tolist())]


def live_ids(ids: np.ndarray, at: np.ndarray, live: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The id column (bytes, row starts) of the rows where `live`."""
    if live.all():
        return ids, at
    lengths = np.diff(at)
    return ids[np.repeat(live, lengths)], row_starts(lengths[live])


def encoded_ids(doc_ids) -> tuple[np.ndarray, np.ndarray]:
    """An id column of `doc_ids` (str)."""
    raw = [d.encode("utf-8") for d in doc_ids]
    return np.frombuffer(b"".join(raw), np.uint8), row_starts(map(len, raw))


def columns_of_header(docs: list, offsets: np.ndarray, sentences: np.ndarray) -> Columns:
    """The columns of a corpus map saved before array files: the JSON header's documents (id, start, end, text,
    metadata, n_sentences) beside the token offsets and sentence starts of all of them. ValueError or TypeError
    where a field has another type; `check_columns` checks how they fit together."""
    if not isinstance(docs, list):
        raise ValueError("its documents are not a list")
    for d in docs:
        if not (isinstance(d["id"], str) and d["id"] and isinstance(d["text"], str)
                and isinstance(d["metadata"], dict)
                and all(type(d[k]) is int for k in ("start", "end", "n_sentences"))):
            raise ValueError(f"document {d.get('id')!r} has bad fields")
    ids = [d["id"].encode("utf-8") for d in docs]
    if len(set(ids)) != len(ids):
        raise ValueError("a document id is listed twice")
    texts = [d["text"].encode("utf-8") for d in docs]
    metas = [dumps(d["metadata"]) for d in docs]
    if offsets.dtype.kind != "i" or sentences.dtype.kind != "i":
        raise ValueError("its offsets or sentence starts are not integers")
    arrays = {"starts": np.array([d["start"] for d in docs], np.int64),
              "ends": np.array([d["end"] for d in docs], np.int64),
              "ids": np.frombuffer(b"".join(ids), np.uint8), "id_at": row_starts(map(len, ids)),
              "text": np.frombuffer(b"".join(texts), np.uint8), "text_at": row_starts(map(len, texts)),
              "meta": np.frombuffer(b"".join(metas), np.uint8), "meta_at": row_starts(map(len, metas)),
              "offsets": offsets, "tok_at": row_starts(d["end"] - d["start"] for d in docs),
              "sentences": sentences.astype(np.int64, copy=False),
              "sent_at": row_starts(d["n_sentences"] for d in docs)}
    if arrays["tok_at"][-1] != len(offsets) or arrays["sent_at"][-1] != len(sentences):
        raise ValueError("the arrays do not hold what the documents count")
    return Columns(with_id_index(arrays))


def with_id_index(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    hashes = id_hashes(arrays["ids"], arrays["id_at"])
    order = np.argsort(hashes, kind="stable")
    return {**arrays, "id_hash": hashes[order], "id_order": order.astype(np.int64)}


def joined(runs: list[Columns]) -> Columns:
    """One run of several, in order."""
    if len(runs) == 1:
        return runs[0]
    out = {"starts": np.concatenate([r.a["starts"] for r in runs]),
           "ends": np.concatenate([r.a["ends"] for r in runs])}
    for data, at in (("ids", "id_at"), ("text", "text_at"), ("meta", "meta_at"), ("offsets", "tok_at"),
                     ("sentences", "sent_at")):
        parts = [r.a[data] for r in runs]
        if data == "offsets":
            parts = [p.astype(np.int64) for p in parts] if any(p.dtype == np.int64 for p in parts) else parts
        out[data] = np.concatenate(parts)
        out[at] = row_starts(np.concatenate([np.diff(r.a[at]) for r in runs]))
    return Columns(with_id_index(out))


def check_columns(a: dict[str, np.ndarray], next_position: int) -> None:
    """ValueError naming the first column that does not fit the others: types, shapes, bounds and order, each in
    one vectorised pass (no Python loop over documents), so a file of another shape never reaches a question."""
    want = {"starts": "i", "ends": "i", "ids": "u", "id_at": "i", "text": "u", "text_at": "i", "meta": "u",
            "meta_at": "i", "offsets": "i", "tok_at": "i", "sentences": "i", "sent_at": "i", "id_hash": "u",
            "id_order": "i"}
    if set(a) != set(want):
        raise ValueError(f"it holds the columns {sorted(a)}, not {sorted(want)}")
    for name, kind in want.items():
        if a[name].dtype.kind != kind or a[name].ndim != (2 if name == "offsets" else 1):
            raise ValueError(f"its {name} is {a[name].dtype} of shape {a[name].shape}")
    n, starts, ends = len(a["starts"]), a["starts"], a["ends"]

    def need(ok, what: str) -> None:
        if not ok:
            raise ValueError(what)

    need(len(ends) == n and len(a["id_hash"]) == n and len(a["id_order"]) == n, "its row columns differ in length")
    need(a["offsets"].shape[1:] == (2,), "its offsets are not pairs")
    for data, at in (("ids", "id_at"), ("text", "text_at"), ("meta", "meta_at"), ("offsets", "tok_at"),
                     ("sentences", "sent_at")):
        r = a[at]
        need(len(r) == n + 1 and r[0] == 0 and r[-1] == len(a[data]) and bool(np.all(r[1:] >= r[:-1])),
             f"its {at} does not fit its {data}")
    if not n:
        return
    need(bool(np.all(starts < ends)) and starts[0] >= 0 and bool(np.all(ends[:-1] <= starts[1:]))
         and ends[-1] <= next_position, "its documents are not in position order inside the positions")
    need(bool(np.all(np.diff(a["tok_at"]) == ends - starts)), "its token spans do not fit its documents")
    need(bool(np.all(np.diff(a["id_at"]) > 0)) and bool(np.all(np.diff(a["sent_at"]) > 0)),
         "a document has no id or no sentence")
    sent = a["sentences"]
    need(bool(np.all(sent[a["sent_at"][:-1]] == starts)) and bool(np.all(sent[1:] > sent[:-1]))
         and bool(np.all(sent[a["sent_at"][1:] - 1] < ends)), "its sentence starts lie outside their documents")
    offsets = a["offsets"]
    need(offsets.min() >= 0 and bool(np.all(np.maximum.reduceat(offsets[:, 1], a["tok_at"][:-1])
                                            <= np.diff(a["text_at"]))),  # chars <= UTF-8 bytes
         "its token offsets lie outside their texts")
    check_id_index(a, n)


def check_delta(base: dict[str, np.ndarray], delta: dict[str, np.ndarray], removed: np.ndarray | None) -> None:
    """ValueError where a delta's removed rows (of the base, ascending) or its first position do not fit the base."""
    n = len(base["starts"])
    if not (removed is not None and removed.dtype == np.int64 and removed.ndim == 1
            and (not len(removed) or (removed[0] >= 0 and removed[-1] < n)) and bool(np.all(removed[1:] > removed[:-1]))
            and (not n or not len(delta["starts"]) or delta["starts"][0] >= base["ends"][-1])):
        raise ValueError("its removed rows or its first position do not fit the base")


def check_id_index(a: dict[str, np.ndarray], n: int) -> None:
    """ValueError where the id column of `n` rows ("ids", "id_at") or its index ("id_hash", "id_order") is not
    what `with_id_index` makes: one vectorised pass."""
    for name, kind in (("ids", "u"), ("id_at", "i"), ("id_hash", "u"), ("id_order", "i")):
        if a[name].dtype.kind != kind or a[name].ndim != 1:
            raise ValueError(f"its {name} is {a[name].dtype} of shape {a[name].shape}")
    at, order, hashes = a["id_at"], a["id_order"], a["id_hash"]
    if not (len(at) == n + 1 and at[0] == 0 and at[-1] == len(a["ids"]) and bool(np.all(at[1:] > at[:-1]))
            and len(order) == n == len(hashes)):
        raise ValueError("its ids do not fit their row starts")
    if n and not (order.min() >= 0 and order.max() < n and bool(np.all(np.bincount(order, minlength=n) == 1))
                  and bool(np.all(hashes[1:] >= hashes[:-1]))
                  and bool(np.array_equal(hashes, id_hashes(a["ids"], at)[order]))):
        raise ValueError("its id index is stale")
