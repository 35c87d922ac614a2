"""An index's folder on disk: the header (`endo-index.json`, every field checked), and its files written as a new
folder swapped in whole (`files.replacing_folder`: a crash leaves the old index or the new one) and read as one
state of the folder (`files.read_folder`), each checked as it is read.

    endo-index.json      the header, written last
    features/            the S3 feature postings (inverted.py; empty for an index for `endo` or `bm25`)
    corpus.arrays        the corpus map's columns (corpus.py), memory-mapped when opened, and corpus_delta.arrays:
                         the documents added since it was written and its removed rows (a save links the first
                         from the last generation while the delta stays small)
    passages.arrays      the passages and their BM25 (passages.py), memory-mapped when opened
    dense*               the passages' embeddings where the index has a dense stage (dense.py), base and delta too

An index saved before array files holds `corpus.npz` and `passages.npz` instead (its header has no "columns"); it
opens as it did, more slowly, and its next save writes the array files.
"""
from __future__ import annotations

import json
import os
import re
import zipfile
from pathlib import Path

from endo_retrieval.corpus import CorpusMap
from endo_retrieval.files import atomic_write, read_folder, replacing_folder, writer_lock
from endo_retrieval.index.dense import DenseVectors
from endo_retrieval.index.inverted import INDEX_FILE, FeatureIndex, IndexCorruptError, IndexVersionError
from endo_retrieval.index.passages import OLD_PASSAGES_FILE, PASSAGES_FILE, Passages, saved_names

FORMAT = "endo-index"
VERSION = 1
HEADER = "endo-index.json"
HEADER_FIELDS = {"format": str, "version": int, "model": str, "model_hash": str, "method": str, "chunk_size": int,
                 "sae_layers": list}  # and "prune": a share in (0, 1] or null; "dense", "embedder", "columns" and
# "sha256" (passages.npz's, before array files checked themselves), which an index saved before them lacks
SHA256 = re.compile(r"[0-9a-f]{64}")
REBUILD = "delete the index folder and rebuild it with `endo index PATH... --out DIR`."


def write_index(store, directory: Path) -> int:
    """Save `store` (an IndexStore) into `directory` as a new generation; returns the generation."""
    header = {"format": FORMAT, "version": VERSION, "model": store.backbone.model_id,
              "model_hash": store.backbone.model_hash, "method": store.method, "chunk_size": store.chunk_size,
              "sae_layers": store.saes.layers, "prune": store.prune, "columns": True,
              # recorded, so an index whose dense files are all gone is refused, not opened as one without them
              "dense": store.dense is not None}
    if store.dense is not None:
        header["embedder"] = store.dense.embedder
    with writer_lock(directory):
        if directory.is_dir() and any(directory.iterdir()) and not (directory / HEADER).exists():
            raise ValueError(f"{directory} exists and holds no endo index (no {HEADER}); refusing to replace "
                             "it. Pass a new folder, or delete that one first.")
        # one more than the folder's own: a count per folder, which a rebuild over it continues
        header["generation"] = committed_generation(directory) + 1
        with replacing_folder(directory) as tmp:
            store.index.save(tmp / "features")
            store.corpus.save_in(tmp, directory)  # the large files of the last generation linked, not copied
            if store.dense is not None:
                store.dense.save(tmp, store.corpus.id_column(), directory)
            # the passages' BM25, built here where no question built it, so opening the index reads no text
            store.passages().save(tmp / PASSAGES_FILE, store.corpus)
            atomic_write(tmp / HEADER, lambda p: p.write_text(json.dumps(header, indent=1)))
    return header["generation"]


def read_index(directory: Path, method_names: tuple[str, ...]):
    """(header, feature index, corpus map, dense vectors or None, passages or None) of the index in `directory`,
    one state of it; for a manifest of segments, (header, None, None, None, None). IndexCorruptError saying what
    to do for every failure."""
    def read(open_file):
        with open_file(HEADER) as f:
            meta = check_header(f.read(), directory / HEADER, method_names)
        if "segments" in meta:
            return meta, None, None, None, None
        with open_file(f"features/{INDEX_FILE}") as f:
            index = FeatureIndex.read(f, directory / "features" / INDEX_FILE)
        corpus = CorpusMap.read_saved(open_file, directory, meta.get("columns") is True)
        passages = _read_passages(open_file, directory, meta, corpus)
        dense = DenseVectors.read(open_file, directory, recorded=meta.get("dense"), embedder=meta.get("embedder"))
        return meta, index, corpus, dense, passages

    try:
        return read_folder(directory, read)
    except FileNotFoundError as err:
        if err.filename not in (None, HEADER, str(directory)):
            raise IndexCorruptError(f"the index in {directory} is damaged: {err.filename} is missing; delete "
                                    "the folder and rebuild the index with `endo index PATH... --out DIR`."
                                    ) from None
        raise IndexCorruptError(f"{directory} holds no endo index (no {HEADER}); build one with "
                                "`endo index PATH... --out DIR` or EndoIndex.save().") from None
    except IsADirectoryError as err:
        raise IndexCorruptError(f"the index in {directory} is damaged ({err}); delete the folder and rebuild "
                                "the index.") from None


def _read_passages(open_file, directory: Path, meta: dict, corpus: CorpusMap) -> Passages | None:
    """The saved passages; None for an index saved before they were (built at the first question)."""
    name = saved_names(meta)[1]
    recorded = meta.get("sha256", {})  # {}: saved before checksums (or since array files check themselves)
    try:
        with open_file(name) as f:
            return Passages.read(f, corpus, recorded.get(name))
    except FileNotFoundError:
        if name == PASSAGES_FILE or name in recorded:
            raise  # missing (named by read_index), or the folder was replaced while read (read_folder reads again)
        return None
    except (ValueError, OSError, KeyError, EOFError, TypeError, OverflowError, MemoryError, zipfile.BadZipFile,
            NotImplementedError) as err:
        # NotImplementedError: zipfile's, for a compression method it does not know (a changed byte)
        raise IndexCorruptError(f"{directory / name} is damaged ({err}); {REBUILD}") from None


def check_header(raw: bytes, path: Path, method_names: tuple[str, ...]) -> dict:
    """endo-index.json with every field checked: IndexCorruptError names what is wrong and says what to do."""
    damaged = f"{path} is damaged ({{}}); {REBUILD}"
    try:
        meta = json.loads(raw.decode("utf-8"))
    except ValueError as err:  # not UTF-8, not JSON
        raise IndexCorruptError(damaged.format(f"{type(err).__name__}: {err}")) from None
    if not isinstance(meta, dict):
        raise IndexCorruptError(damaged.format("not a JSON object"))
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise IndexVersionError(f"{path.parent} is not a version-{VERSION} endo index (format "
                                f"{meta.get('format')!r}, version {meta.get('version')!r}); rebuild it with this "
                                "version: `endo index PATH... --out DIR`.")
    if "segments" in meta:  # a manifest of segments: its own loader checks the rest
        return meta
    for key, kind in HEADER_FIELDS.items():
        if not isinstance(meta.get(key), kind) or isinstance(meta.get(key), bool):
            raise IndexCorruptError(damaged.format(f"{key!r} is {meta.get(key)!r}, not a {kind.__name__}"))
    prune, sha256 = meta.get("prune"), meta.get("sha256", {})
    checks = {"method": meta["method"] in method_names, "chunk_size": 0 < meta["chunk_size"] < 1 << 31,
              "sae_layers": all(type(l) is int and 0 <= l < 1 << 16 for l in meta["sae_layers"]),
              "prune": prune is None or (type(prune) in (int, float) and 0 < prune <= 1),
              "generation": type(meta.get("generation", 0)) is int and 0 <= meta.get("generation", 0) < 1 << 62,
              "dense": type(meta.get("dense", False)) is bool,
              "columns": type(meta.get("columns", False)) is bool,
              "embedder": isinstance(meta.get("embedder"), str) and meta["embedder"] != ""
              if meta.get("dense") is True else "embedder" not in meta,  # the dense stage's, and only with one
              "sha256": isinstance(sha256, dict) and set(sha256) <= {OLD_PASSAGES_FILE}
              and all(isinstance(v, str) and SHA256.fullmatch(v) for v in sha256.values())}
    for key, ok in checks.items():
        if not ok:
            raise IndexCorruptError(damaged.format(f"{key!r} is {meta.get(key)!r}"))
    return meta


def committed_generation(directory: str | os.PathLike) -> int:
    """The generation in the header of the index saved in `directory`: 0 where there is none, or where it cannot be
    read (a save then replaces what is there)."""
    def read(open_file):
        with open_file(HEADER) as f:
            return json.loads(f.read().decode("utf-8")).get("generation", 0)

    try:
        generation = read_folder(directory, read)
    except (OSError, ValueError, AttributeError):
        return 0
    return generation if type(generation) is int and generation >= 0 else 0
