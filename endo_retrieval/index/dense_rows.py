"""Each document's rows of a saved array (its passages' vectors, or their cells) without an object per document:
the saved ids as one column with its hash index (`corpus_columns`), each document's first row, a mask of the
documents removed since, and a dict of the documents added since. `RowMap` reads as the dict of doc id -> rows it
replaces; `stacked` hands back the rows of every document in the corpus's order without copying the saved array
where nothing changed, and with a row map (`GatheredRows`) instead of a copy where documents were removed.
"""
from __future__ import annotations

from collections.abc import Iterator, MutableMapping

import numpy as np

from endo_retrieval.corpus_columns import (decode_ids, encoded_ids, find_id, live_ids, row_starts,
                                           with_id_index)


class RowMap(MutableMapping):
    """doc id -> its rows of `data` (saved: a memory map; `ids`: an id column with its index, `row_at`: each
    document's first row and the end), plus the documents added since (`added`)."""

    def __init__(self, data: np.ndarray | None = None, ids: dict | None = None, row_at: np.ndarray | None = None):
        self.data, self.row_at = data, row_at
        self.ids = ids or {}  # "ids", "id_at", "id_hash", "id_order"
        self.live = np.ones(len(row_at) - 1 if row_at is not None else 0, bool)
        self.added: dict[str, np.ndarray] = {}

    @classmethod
    def of(cls, rows: dict[str, np.ndarray]) -> "RowMap":
        """A map of documents given in memory (none saved)."""
        out = cls()
        out.added = dict(rows)
        return out

    @classmethod
    def saved(cls, data: np.ndarray, doc_ids: list[str], counts: np.ndarray) -> "RowMap":
        ids, at = encoded_ids(doc_ids)
        return cls(data, with_id_index({"ids": ids, "id_at": at}), row_starts(np.asarray(counts, np.int64)))

    def _saved_row(self, doc_id: str) -> int:
        if not len(self.live):
            return -1
        i = find_id(self.ids, doc_id)
        return i if i >= 0 and self.live[i] else -1

    def __getitem__(self, doc_id: str) -> np.ndarray:
        if doc_id in self.added:
            return self.added[doc_id]
        i = self._saved_row(doc_id)
        if i < 0:
            raise KeyError(doc_id)
        return self.data[self.row_at[i]: self.row_at[i + 1]]

    def __setitem__(self, doc_id: str, rows: np.ndarray) -> None:
        i = self._saved_row(doc_id)
        if i >= 0:
            self.live[i] = False
        self.added[doc_id] = rows

    def __delitem__(self, doc_id: str) -> None:
        if self.added.pop(doc_id, None) is None:
            i = self._saved_row(doc_id)
            if i < 0:
                raise KeyError(doc_id)
            self.live[i] = False

    def __contains__(self, doc_id) -> bool:
        return isinstance(doc_id, str) and (doc_id in self.added or self._saved_row(doc_id) >= 0)

    def __iter__(self) -> Iterator[str]:
        if len(self.live):
            yield from decode_ids(self.ids["ids"], self.ids["id_at"], None if self.live.all()
                                  else np.flatnonzero(self.live))
        yield from list(self.added)

    def __len__(self) -> int:
        return int(self.live.sum()) + len(self.added)

    def id_column(self) -> tuple[np.ndarray, np.ndarray]:
        """The ids in this map's order as one column (bytes, row starts)."""
        saved = live_ids(self.ids["ids"], self.ids["id_at"], self.live) if len(self.live) else \
            (np.zeros(0, np.uint8), np.zeros(1, np.int64))
        if not self.added:
            return saved
        more, at = encoded_ids(self.added)
        return np.concatenate([saved[0], more]), np.concatenate([saved[1][:-1], at + len(saved[0])])

    def stacked(self, doc_ids: list[str] | None = None, id_column=None, width: int = 0):
        """The rows of `doc_ids` in that order (None: this map's order, which `id_column`, the corpus's ids,
        confirms): the saved array itself where nothing changed, a `GatheredRows` over it where documents were
        removed or added, a new array otherwise. `width`: the rows' width where there are none."""
        if doc_ids is None and id_column is not None:
            mine = self.id_column() if len(self.live) else None
            if mine is not None and np.array_equal(mine[1], id_column[1]) and np.array_equal(mine[0], id_column[0]):
                rows = np.flatnonzero(np.repeat(self.live, np.diff(self.row_at)))
                extra = [self.added[d] for d in self.added]
                if len(rows) == len(self.data) and not extra:
                    return self.data
                return GatheredRows(self.data, rows, np.concatenate(extra) if extra else None)
            doc_ids = decode_ids(*id_column)
        doc_ids = list(self) if doc_ids is None else doc_ids
        if not doc_ids:
            return np.zeros((0, width) if width else 0, self.data.dtype if self.data is not None else np.float32)
        return np.concatenate([self[d] for d in doc_ids])


class GatheredRows:
    """Rows `rows` of a saved array followed by `extra` ones, read as the matrix they make (len, shape,
    indexing by integer arrays, `@`) without copying the saved array."""

    ndim = 2

    def __init__(self, data: np.ndarray, rows: np.ndarray, extra: np.ndarray | None = None):
        self.data, self.rows = data, rows
        self.extra = extra if extra is not None else np.zeros((0, *data.shape[1:]), data.dtype)
        self.dtype = data.dtype

    def __len__(self) -> int:
        return len(self.rows) + len(self.extra)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self), *self.data.shape[1:])

    def __getitem__(self, index) -> np.ndarray:
        index = np.arange(len(self))[index] if not isinstance(index, np.ndarray) else index
        if index.dtype == bool:
            index = np.flatnonzero(index)
        index = np.where(index < 0, index + len(self), index)
        if not len(self.extra):  # saved rows only: one gather
            return self.data[self.rows[index]]
        out = np.empty((*index.shape, *self.data.shape[1:]), self.dtype)
        saved = index < len(self.rows)
        out[saved] = self.data[self.rows[index[saved]]]
        out[~saved] = self.extra[index[~saved] - len(self.rows)]
        return out

    def __matmul__(self, other: np.ndarray) -> np.ndarray:
        return np.concatenate([(self.data @ other)[self.rows], self.extra @ other])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = np.concatenate([self.data[self.rows], self.extra])
        return whole if dtype is None else whole.astype(dtype)
