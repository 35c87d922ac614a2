"""What opening the dense stage checks (`DenseVectors.read`): dense.json's fields (`DenseMeta`), each file against
the checksums it records, the arrays' headers and shapes; and what a damaged file becomes (`DenseDamage`: refused,
or with `deferred_damage()` the index opened without its dense stage)."""
from __future__ import annotations

import contextlib
import os
import time
import zipfile
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Iterator

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from endo_retrieval.array_file import ArrayFile, crcs_match, file_crcs
from endo_retrieval.corpus_columns import check_id_index
from endo_retrieval.files import MAX_VALUE, IndexCorruptError, read_sealed_json, sha256_of

VECTORS_FILE, META_FILE, CELLS_FILE = "dense.npy", "dense.json", "dense_cells.npz"
BY_CELL_FILE = "dense_by_cell.npy"  # dense.npy's rows in cell order, where there are cells (`Cells.ordered`)
ROWS_FILE = "dense_rows.arrays"  # each document's id and first row (an array file); dense.json listed them before
ROWS_KIND = "dense-rows"
DELTA_FILE, DELTA_KIND = "dense_delta.arrays", "dense-delta"  # the documents added since the base files, its removed
HEADER = "endo-index.json"  # the index's header (engine.py), which records whether it has a dense stage


# ---- what opening checks ---------------------------------------------------------------------------------------
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class DenseMeta(BaseModel):
    """dense.json, every field typed and strict (no "3" for 3, no true for 1): a field of another type or range is
    a damaged file, refused on open rather than a traceback at the first question."""

    model_config = ConfigDict(strict=True, extra="forbid")

    embedder: str = Field(min_length=1, description="the sentence-transformers model that embedded the passages")
    dim: int = Field(ge=0, lt=1 << 20, description="the embeddings' dimensions (0: no passage yet)")
    doc_ids: list[str] | None = Field(default=None, description="the documents, in the order of their rows in "
                                      "dense.npy; None: in dense_rows.arrays (saved since array files)")
    counts: list[Annotated[int, Field(ge=0, lt=MAX_VALUE)]] | None = Field(default=None,
                                                                          description="each document's rows")
    cells: bool = Field(description="whether dense_cells.npz holds the cells (from ANN_MIN passages)")
    sha256: dict[str, Sha256] | None = Field(default=None, description="each array file's SHA-256 (saved before "
                                             "array files); None: not recorded")
    crc32: dict[str, list[Annotated[int, Field(ge=0, lt=1 << 32)]]] | None = Field(
        default=None, description="each array file's CRC-32 by block (array_file.file_crcs)")

    @model_validator(mode="after")
    def _consistent(self) -> "DenseMeta":
        if (self.doc_ids is None) != (self.counts is None) or (self.doc_ids is None and self.crc32 is None):
            raise ValueError("doc_ids and counts go together, and without them the files' crc32")
        if self.doc_ids is not None and len(self.counts) != len(self.doc_ids):
            raise ValueError(f"{len(self.counts)} counts for {len(self.doc_ids)} doc_ids")
        if self.doc_ids is not None and len(set(self.doc_ids)) != len(self.doc_ids):
            raise ValueError("a document id is listed twice")
        files = {VECTORS_FILE, CELLS_FILE} if self.cells else {VECTORS_FILE}
        for name, sums in (("sha256", self.sha256), ("crc32", self.crc32)):
            if sums is not None and set(sums) - {BY_CELL_FILE} != files:
                raise ValueError(f"{name} lists {sorted(sums)}, not {sorted(files)}")
        if BY_CELL_FILE in (self.crc32 or {}) and not self.cells or BY_CELL_FILE in (self.sha256 or {}):
            raise ValueError(f"{BY_CELL_FILE} is listed where it cannot be: without cells, or by SHA-256")
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


def _check_sums(f, path: Path, meta: DenseMeta) -> float:
    """Seconds spent checking the file against the CRC-32s (or, saved before array files, the SHA-256) dense.json
    records (0: none recorded)."""
    crcs, want = (meta.crc32 or {}).get(path.name), (meta.sha256 or {}).get(path.name)
    if crcs is None and want is None:
        return 0.0
    clock = time.perf_counter()
    if not (crcs_match(f, crcs) if crcs is not None else sha256_of(f) == want):
        raise DenseDamage(path, "damaged (checksum mismatch)", meta.embedder)
    f.seek(0)
    return time.perf_counter() - clock


def _read_rows(f, path: Path, meta: DenseMeta) -> tuple[dict, np.ndarray]:
    """dense_rows.arrays: the documents' id column with its index, and each one's number of rows."""
    try:
        arrays = ArrayFile._read(f, ROWS_KIND).arrays
        counts = arrays.pop("counts")
        if counts.dtype != np.int64 or counts.ndim != 1 or (len(counts) and counts.min() < 0):
            raise ValueError(f"its counts are {counts.dtype} of shape {counts.shape}")
        check_id_index(arrays, len(counts))
    except (ValueError, TypeError, KeyError, OverflowError, OSError, IndexError) as err:
        raise DenseDamage(path, f"damaged ({type(err).__name__}: {err})", meta.embedder) from None
    return arrays, counts


def _read_delta(f, path: Path, meta: DenseMeta, n_base: int, centroids) -> dict:
    """dense_delta.arrays: the documents added since the base files (ids, rows, vectors, cells where there are
    cells) and the base's removed documents, every array checked against the others and the base."""
    try:
        arrays = ArrayFile._read(f, DELTA_KIND)
        a = arrays.arrays
        counts, vectors, cells, removed = a["counts"], a["vectors"], a["cells"], a["removed"]
        check_id_index(a, len(counts))
        n = int(counts.sum()) if len(counts) else 0
        if not (counts.dtype == removed.dtype == np.int64 and (not len(counts) or counts.min() >= 0)
                and vectors.dtype == np.float32 and vectors.shape == (n, meta.dim) and cells.dtype == np.int32
                and cells.shape == ((n,) if centroids is not None else (0,))
                and (not len(cells) or 0 <= cells.min() <= cells.max() < len(centroids))
                and removed.ndim == 1 and (not len(removed) or (removed[0] >= 0 and removed[-1] < n_base))
                and bool(np.all(removed[1:] > removed[:-1]))):
            raise ValueError("its arrays do not fit one another or the base")
    except (ValueError, TypeError, KeyError, OverflowError, OSError, IndexError) as err:
        raise DenseDamage(path, f"damaged ({type(err).__name__}: {err})", meta.embedder) from None
    return a


def _read_matrix(f, path: Path, meta: DenseMeta, rows: int) -> np.ndarray:
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
    if tuple(shape) != (rows, meta.dim) or fortran or dtype != np.float32:
        raise DenseDamage(path, f"damaged (it holds {shape} {dtype}{' Fortran-order' if fortran else ''} vectors "
                          f"where {META_FILE} counts {rows} of {meta.dim} float32)", meta.embedder)
    if os.fstat(f.fileno()).st_size != f.tell() + rows * meta.dim * 4:
        raise DenseDamage(path, "damaged (its size is not its header's; truncated?)", meta.embedder)
    if not rows:
        return np.zeros(shape, np.float32)
    return np.memmap(f, dtype=np.float32, mode="r", offset=f.tell(), shape=shape)


def _read_cells(f, path: Path, meta: DenseMeta, n: int) -> tuple[np.ndarray, np.ndarray]:
    """dense_cells.npz: the centroids (k x dim, float32) and each passage's cell (int32 in [0, k))."""
    damaged = "damaged ({}); its cells cannot be searched"
    try:
        with np.load(f, allow_pickle=False) as saved:
            centroids, cells = saved["centroids"], saved["cells"]
    except (ValueError, OSError, KeyError, EOFError, zipfile.BadZipFile, NotImplementedError, MemoryError) as err:
        raise DenseDamage(path, damaged.format(type(err).__name__), meta.embedder) from None
    if not (centroids.dtype == np.float32 and centroids.ndim == 2 and len(centroids) and centroids.shape[1] == meta.dim
            and np.isfinite(centroids).all()):
        raise DenseDamage(path, damaged.format(f"centroids {centroids.shape} {centroids.dtype}"), meta.embedder)
    if not (cells.dtype == np.int32 and cells.shape == (n,) and (not n or 0 <= cells.min() <= cells.max()
                                                                 < len(centroids))):
        raise DenseDamage(path, damaged.format(f"cells {cells.shape} {cells.dtype} for {n} passages"), meta.embedder)
    return centroids, cells


def _file_crcs(path: Path) -> list[int]:
    with open(path, "rb") as f:
        return file_crcs(f)
