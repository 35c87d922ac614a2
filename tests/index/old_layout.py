"""An index folder turned into the layout saved before array files, byte for byte as that version wrote it:
`corpus.npz` (a JSON header of every document, offsets and sentence starts), `passages.npz` (its SHA-256 in the
header, which has no "columns"), and dense.json listing every document's id and rows with the files' SHA-256. The
tests open such a folder to hold the reader of the old layout to what it read."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from endo_retrieval.array_file import ArrayFile
from endo_retrieval.corpus import CorpusMap
from endo_retrieval.corpus_columns import decode_ids
from endo_retrieval.files import read_sealed_json, sealed_json, sha256_of


def _arrays(path: Path, kind: str) -> dict:
    with open(path, "rb") as f:
        return {k: np.array(v) for k, v in ArrayFile.read(f, path, kind).arrays.items()}


def to_old_layout(folder: Path) -> None:
    corpus = CorpusMap.load(folder / "corpus.arrays")
    docs = list(corpus.documents())
    header = {"format": "endo-corpus-map", "version": 1, "next": corpus.n_positions,
              "docs": [{"id": d.doc_id, "start": d.start, "end": d.end, "text": d.text, "metadata": d.metadata,
                        "n_sentences": len(d.sentence_starts)} for d in docs]}
    with open(folder / "corpus.npz", "wb") as f:
        np.savez(f, header=np.frombuffer(json.dumps(header).encode(), np.uint8),
                 offsets=np.concatenate([np.asarray(d.offsets) for d in docs]),
                 sentence_starts=np.asarray(corpus.sentence_starts()))
    (folder / "corpus.arrays").unlink()
    with open(folder / "passages.npz", "w+b") as f:
        np.savez(f, **_arrays(folder / "passages.arrays", "passages"))
        sha = sha256_of(f)
    (folder / "passages.arrays").unlink()
    head = json.loads((folder / "endo-index.json").read_text())
    del head["columns"]
    head["sha256"] = {"passages.npz": sha}
    (folder / "endo-index.json").write_text(json.dumps(head, indent=1))
    if (folder / "dense.json").exists():
        meta = read_sealed_json((folder / "dense.json").read_bytes())
        rows = _arrays(folder / "dense_rows.arrays", "dense-rows")
        meta["doc_ids"], meta["counts"] = decode_ids(rows["ids"], rows["id_at"]), rows["counts"].tolist()
        sums = {}
        for name in meta.pop("crc32"):
            with open(folder / name, "rb") as f:
                sums[name] = sha256_of(f)
        meta["sha256"] = sums
        (folder / "dense.json").write_bytes(sealed_json({k: meta[k] for k in ("embedder", "dim", "doc_ids", "counts",
                                                                              "cells", "sha256")}))
        (folder / "dense_rows.arrays").unlink()
