"""A file of named arrays, memory-mapped when read and checked in blocks: what an index's corpus and passages are
saved as, so opening one maps its columns instead of rebuilding objects in Python.

    MAGIC (8 bytes) | header length (uint64 LE) | sealed JSON header | arrays, each at a multiple of ALIGN

The header (`files.sealed_json`, its own SHA-256 as its last field) names the format, a `kind` (what the arrays
are), small JSON `meta`, and per array its dtype, shape, offset and the CRC-32 of each BLOCK of its bytes. Reading
checks the header's seal, the file's size and every block's CRC-32 (read through the file with `pread`, in threads:
zlib releases the GIL, so a gigabyte is checked in well under a second on two cores; a memory map would pull every
page into the process), then maps each array read-only. CRC-32, like the zip members `.npz` files relied on, finds
damage (flipped bits, truncation, overwritten blocks); it is no defence against a deliberate forgery.
"""
from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from endo_retrieval.files import IndexCorruptError, atomic_write, read_sealed_json, sealed_json

MAGIC = b"ENDOARR\x01"
FORMAT_NAME = "endo-arrays"
ALIGN = 64  # every array starts at a multiple of this (a cache line; any dtype's alignment)
BLOCK = 1 << 24  # bytes per CRC-32: 16 MiB, so a gigabyte is ~64 checks spread over the cores
DTYPES = frozenset({"uint8", "int32", "int64", "uint64", "float32", "float64", "uint16", "uint32", "bool"})


def _blocks(nbytes: int) -> list[tuple[int, int]]:
    return [(a, min(BLOCK, nbytes - a)) for a in range(0, nbytes, BLOCK)]


def _crcs(data: memoryview) -> list[int]:
    return [zlib.crc32(data[a: a + n]) for a, n in _blocks(len(data))]


def write_arrays(path: str | os.PathLike, kind: str, arrays: dict[str, np.ndarray], meta: dict | None = None
                 ) -> Path:
    """Write `arrays` (name -> numpy array) and `meta` to `path` atomically (`files.atomic_write`)."""
    arrays = {name: np.ascontiguousarray(a) for name, a in arrays.items()}
    for name, a in arrays.items():
        if a.dtype.name not in DTYPES:
            raise ValueError(f"array {name!r} is {a.dtype}; an array file holds {sorted(DTYPES)}")
    views = {name: memoryview(a.reshape(-1).view(np.uint8)) if a.size else memoryview(b"") for name, a in
             arrays.items()}
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # CRC-32 releases the GIL: the arrays in parallel
        crcs = dict(zip(views, pool.map(_crcs, views.values())))
    entries, offset = {}, 0
    for name, a in arrays.items():
        entries[name] = {"dtype": a.dtype.name, "shape": list(a.shape), "offset": offset, "crc32": crcs[name]}
        offset += -(-len(views[name]) // ALIGN) * ALIGN
    header = sealed_json({"format": FORMAT_NAME, "version": 1, "kind": kind, "meta": meta or {},
                          "payload_nbytes": offset, "arrays": entries})
    start = -(-(16 + len(header)) // ALIGN) * ALIGN

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            f.write(MAGIC + len(header).to_bytes(8, "little") + header)
            f.write(b"\0" * (start - 16 - len(header)))
            for view in views.values():
                f.write(view)
                f.write(b"\0" * (-len(view) % ALIGN))

    return atomic_write(path, write)


class ArrayFile:
    """An array file read back: `kind`, `meta` and `arrays` (name -> read-only memory map)."""

    def __init__(self, kind: str, meta: dict, arrays: dict[str, np.ndarray]):
        self.kind, self.meta, self.arrays = kind, meta, arrays

    @classmethod
    def read(cls, f, path: Path, kind: str, check: bool = True) -> "ArrayFile":
        """The arrays of the open file `f` (`path` names it in messages), after every check; IndexCorruptError
        saying to rebuild where one fails. `check=False`: the blocks' CRC-32 unchecked (a file just written)."""
        try:
            return cls._read(f, kind, check)
        except (ValueError, TypeError, KeyError, OverflowError, OSError, MemoryError) as err:
            raise IndexCorruptError(f"{path} is damaged ({type(err).__name__}: {err}); delete the index folder and "
                                    "rebuild it with `endo index PATH... --out DIR`.") from None

    @classmethod
    def _read(cls, f, kind: str, check: bool = True) -> "ArrayFile":
        fd = f.fileno()
        size = os.fstat(fd).st_size
        prefix = os.pread(fd, 16, 0)
        if len(prefix) < 16 or prefix[:8] != MAGIC:
            raise ValueError("not an array file (its first bytes)")
        n = int.from_bytes(prefix[8:], "little")
        if 16 + n > size:
            raise ValueError("its header runs past the end of the file")
        header = read_sealed_json(os.pread(fd, n, 16))
        if header.get("format") != FORMAT_NAME or header.get("version") != 1 or header.get("kind") != kind:
            raise ValueError(f"a {header.get('format')!r} file of kind {header.get('kind')!r}, not {kind!r}")
        start = -(-(16 + n) // ALIGN) * ALIGN
        if size != start + header["payload_nbytes"]:
            raise ValueError(f"{size} bytes where its header says {start + header['payload_nbytes']} (truncated?)")
        checks, shapes = [], {}
        for name, e in header["arrays"].items():
            dtype, shape = np.dtype(e["dtype"]), tuple(e["shape"])
            if e["dtype"] not in DTYPES or not all(type(d) is int and d >= 0 for d in shape):
                raise ValueError(f"array {name!r} has dtype {e['dtype']!r} and shape {shape}")
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            at = start + e["offset"]
            if type(e["offset"]) is not int or e["offset"] < 0 or at + nbytes > size or \
                    len(e["crc32"]) != len(_blocks(nbytes)):
                raise ValueError(f"array {name!r} lies outside the file")
            checks += [(name, at + a, m, crc) for (a, m), crc in zip(_blocks(nbytes), e["crc32"]) if check]
            shapes[name] = (dtype, shape, at, nbytes)
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            for name, ok in pool.map(lambda c: (c[0], zlib.crc32(os.pread(fd, c[2], c[1])) == c[3]), checks):
                if not ok:
                    raise ValueError(f"array {name!r} fails its CRC-32")
        arrays = {name: np.memmap(f, dtype=dtype, mode="r", offset=at, shape=shape) if nbytes
                  else np.zeros(shape, dtype) for name, (dtype, shape, at, nbytes) in shapes.items()}
        meta = header.get("meta")
        if not isinstance(meta, dict):
            raise ValueError("its meta is not a JSON object")
        return cls(kind, meta, arrays)


def is_array_file(f) -> bool:
    """Whether the open file starts as an array file does (else it is of an older format, e.g. `.npz`)."""
    return os.pread(f.fileno(), 8, 0) == MAGIC


def dumps(obj) -> bytes:
    """Compact JSON bytes of a document's metadata (one per document, joined into one column)."""
    return json.dumps(obj, separators=(",", ":")).encode("utf-8")


def file_crcs(f) -> list[int]:
    """The CRC-32 of each BLOCK of the open file `f` (any format), read in threads."""
    fd = f.fileno()
    size = os.fstat(fd).st_size
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        return list(pool.map(lambda b: zlib.crc32(os.pread(fd, b[1], b[0])), _blocks(size)))


def crcs_match(f, crcs: list[int]) -> bool:
    """Whether the open file `f` has the blocks `file_crcs` gave."""
    return file_crcs(f) == crcs
