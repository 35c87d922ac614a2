"""An index in segments: parts built apart (by Ray workers, `distributed/`) and committed together by a manifest.

    DIR/segments/<name>/   each an index in the usual layout (`EndoIndex.save`: features/, corpus.arrays, header)
    DIR/endo-index.json    the manifest: the usual header plus "segments", the parts in position order

The manifest is written last (`atomic_write`), so a worker or driver that dies before it leaves the previous index
whole: readers see the old manifest, which lists only old segments; parts no manifest lists are swept by the next
commit. Loading lays the segments end to end, positions shifted; since every document streams from its own start
(independent chunks), that is the postings of one build over the same documents in the same order.
"""
from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path


from endo_retrieval.corpus import CORPUS_FILE, OLD_CORPUS_FILE, CorpusMap
from endo_retrieval.corpus import DELTA_FILE as CORPUS_DELTA
from endo_retrieval.files import IndexCorruptError, atomic_write, fsync_dir, read_folder
from endo_retrieval.index.dense import BY_CELL_FILE, CELLS_FILE, META_FILE, ROWS_FILE, VECTORS_FILE, DenseVectors
from endo_retrieval.index.dense import DELTA_FILE as DENSE_DELTA
from endo_retrieval.index.inverted import FeatureIndex
from endo_retrieval.index.passages import OLD_PASSAGES_FILE, PASSAGES_FILE

SEGMENTS = "segments"
HEAD = "endo-index.json"
# segments must agree ("embedder": the passages' embedder, None where they hold no embeddings)
SAME = ("format", "version", "model_hash", "method", "chunk_size", "sae_layers", "prune", "embedder")
PLAIN_FILES = (CORPUS_FILE, CORPUS_DELTA, OLD_CORPUS_FILE, PASSAGES_FILE, OLD_PASSAGES_FILE, VECTORS_FILE, META_FILE,
               CELLS_FILE, BY_CELL_FILE, ROWS_FILE, DENSE_DELTA)  # a plain index's, beside features/


def new_name() -> str:
    return f"seg-{uuid.uuid4().hex[:16]}"


def as_files(index) -> dict[str, bytes]:
    """An EndoIndex saved, as {relative path: bytes}: what a worker sends back (no shared file system needed)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        folder = index.save(Path(tmp) / "part")
        return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}


def write(directory: str | Path, files: dict[str, bytes]) -> dict:
    """Write one segment under DIR/segments/ (not yet part of the index); returns its manifest entry."""
    name = new_name()
    folder = Path(directory) / SEGMENTS / name
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    for sub in {(folder / rel).parent for rel in files}:
        fsync_dir(sub)
    return entry(folder)


def entry(folder: Path) -> dict:
    """The manifest entry of a segment folder: its name, header and sizes."""
    head = json.loads((folder / HEAD).read_text())
    corpus = _corpus(folder)
    return {"name": folder.name, "header": {k: head.get(k) for k in ("model",) + SAME},
            "documents": corpus.doc_ids(), "positions": corpus.n_positions, "tokens": corpus.n_tokens}


def _corpus(folder: Path) -> CorpusMap:
    """A segment's corpus map (its columns mapped, or the .npz of one saved before array files)."""
    columns = json.loads((folder / HEAD).read_text()).get("columns") is True
    return read_folder(folder, lambda open_file: CorpusMap.read_saved(open_file, folder, columns))


def listed(directory: str | Path) -> list[dict]:
    """The segments the index in DIR is made of: its manifest's, or a plain index (`EndoIndex.save`) adopted as one
    segment by copy (the plain files stay until the manifest is written); [] when DIR holds no index."""
    directory = Path(directory)
    head = directory / HEAD
    if not head.exists():
        return []
    meta = json.loads(head.read_text())
    if "segments" in meta:
        return meta["segments"]
    folder = directory / SEGMENTS / new_name()
    folder.mkdir(parents=True)
    shutil.copytree(directory / "features", folder / "features")
    for name in (*PLAIN_FILES, HEAD):  # every file the header may record (its passages, their embeddings)
        if name == HEAD or (directory / name).exists():
            shutil.copy2(directory / name, folder / name)
    return [entry(folder)]


def commit(directory: str | Path, parts: list[dict]) -> Path:
    """Make `parts` (entries of written segments, in position order) the index in DIR: the manifest is written
    last, in one atomic replace; then files it does not list (older segments, a plain index's) are swept."""
    directory = Path(directory)
    if not parts:
        raise ValueError("nothing to commit: no segments")
    first = parts[0]["header"]
    for p in parts[1:]:
        differ = [k for k in SAME if p["header"].get(k) != first.get(k)]
        if differ:
            raise ValueError(f"segment {p['name']} differs from {parts[0]['name']} in {', '.join(differ)}; "
                             "segments of one index must share model, SAEs and settings")
    ids = [d for p in parts for d in p["documents"]]
    if len(set(ids)) != len(ids):
        raise ValueError("a document id appears in two segments; ids must be unique")
    manifest = {**first, "segments": parts}
    atomic_write(directory / HEAD, lambda p: p.write_text(json.dumps(manifest, indent=1)))
    keep = {p["name"] for p in parts}
    for stale in (directory / SEGMENTS).iterdir():
        if stale.name not in keep:
            shutil.rmtree(stale, ignore_errors=True)
    shutil.rmtree(directory / "features", ignore_errors=True)
    for name in PLAIN_FILES:
        (directory / name).unlink(missing_ok=True)
    return directory


def load_parts(directory: str | Path, parts: list[dict]) -> tuple[FeatureIndex, CorpusMap]:
    """The feature index and corpus map of `parts` laid end to end (positions from 0 at the first of them)."""
    features, corpus = None, CorpusMap()
    for p in parts:
        folder = Path(directory) / SEGMENTS / p["name"]
        shift = corpus.extend(_corpus(folder))
        part = FeatureIndex.load(folder / "features")
        if features is None:
            features = FeatureIndex(part.layers, part.d_latent, part.stop_freq, part.meta)
        features.extend(part, shift)
    return features, corpus


def load_dense(directory: str | Path, parts: list[dict], device: str = "cpu") -> DenseVectors | None:
    """The passage embeddings of `parts` as one `DenseVectors` (each segment's files checked as `EndoIndex.load`
    checks them), compared with every passage: a segment's cells were trained on it alone. None where a segment
    holds none."""
    whole = None
    for p in parts:
        folder = Path(directory) / SEGMENTS / p["name"]
        head = json.loads((folder / HEAD).read_text())
        dense = read_folder(folder, lambda open_file: DenseVectors.read(open_file, folder, device, head.get("dense"),
                                                                        head.get("embedder")))
        if dense is None:
            return None
        whole = whole or DenseVectors(dense.embedder, device)
        if dense.embedder != whole.embedder:
            raise IndexCorruptError(f"segment {p['name']} of {directory} embedded its passages with "
                                    f"{dense.embedder!r}, another with {whole.embedder!r}; rebuild the index.")
        whole.rows.update(dense.rows)
    return whole


def load_segments(cls, directory: Path, meta: dict, backbone=None, saes=None, int8_queries=None):
    """`EndoIndex.load` of a manifest: the first segment's index, the others' appended, their embeddings too."""
    parts = meta["segments"]
    index = cls.load(Path(directory) / SEGMENTS / parts[0]["name"], backbone, saes, int8_queries)
    index.index, index.corpus = load_parts(directory, parts)
    if index.dense is not None:
        index.dense = load_dense(directory, parts, index.dense.device)
    return index


def listed_committed(directory: str | Path) -> list[dict]:
    """The committed manifest's segments ([] for a plain index or none), adopting nothing."""
    head = Path(directory) / HEAD
    return json.loads(head.read_text()).get("segments", []) if head.exists() else []

