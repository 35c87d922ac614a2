"""`RayIndexer`: an index built by Ray workers, each indexing a contiguous share of the documents into a segment
(`index/segments.py`) committed together by a manifest written last."""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from endo_retrieval.distributed.cluster import BuildError, ray_cluster, spread, start_workers
from endo_retrieval.files import writer_lock
from endo_retrieval.index import segments
from endo_retrieval.index.engine import CHUNK
from endo_retrieval.methods import check_search_method
from endo_retrieval.methods.search import Document


def shares(docs: Sequence[Document], n: int) -> list[list[Document]]:
    """Contiguous runs of `docs` (their order is the index's position order), about equal in characters."""
    n = max(1, min(n, len(docs)))
    ends = np.cumsum([len(d.text) for d in docs])
    cuts = np.searchsorted(ends, ends[-1] * np.arange(1, n) / n, side="left") + 1
    cuts = np.unique(np.clip(cuts, 1, len(docs) - 1)) if len(docs) > 1 else []
    return [list(part) for part in np.split(np.array(docs, dtype=object), cuts) if len(part)]


class RayIndexer:
    """Builds an index directory from documents on Ray workers; `build(..., append=True)` adds to the index there.
    Identical postings to `EndoIndex.add_documents` over the same documents in the same order (a test).
    `first_stage`, `embedder`: EndoIndex's (None: as EndoIndex decides, the passages embedded for `endo`; appending,
    as the segments there were built, so that every shard holds embeddings or none does)."""

    def __init__(self, workers: list | int | None = None, setup: Callable | None = None, method: str = "s3-hybrid",
                 chunk_size: int = CHUNK, stop_freq: int | float | None = 5000, prune: float | None = None,
                 shares_per_worker: int = 1, first_stage: str | None = None, embedder: str | None = None):
        self.workers = workers if isinstance(workers, list) else start_workers(workers, setup)
        self.settings = {"method": check_search_method(method), "chunk_size": chunk_size, "stop_freq": stop_freq,
                         "prune": prune, "first_stage": first_stage, "embedder": embedder}
        self.shares_per_worker = shares_per_worker

    def _settings(self, old: list[dict]) -> dict:
        """The workers' EndoIndex settings; appended segments embed (or not) as the committed ones do."""
        if not old or self.settings["first_stage"] is not None:
            return self.settings
        embedder = old[0]["header"].get("embedder")
        return self.settings | ({"embedder": embedder} if embedder else {"first_stage": "bm25"})

    def build(self, directory: str | os.PathLike, docs: Sequence[Document | str], append: bool = False) -> Path:
        """Index `docs` into DIR (replacing the index there, or after it with `append`), holding the folder's writer
        lock from reading the old manifest to writing the new one. BuildError when a worker fails or dies."""
        with writer_lock(directory):
            return self._build(Path(directory), docs, append)

    def _build(self, directory: Path, docs: Sequence[Document | str], append: bool) -> Path:
        ray = ray_cluster()
        (directory / segments.SEGMENTS).mkdir(parents=True, exist_ok=True)
        old = segments.listed(directory) if append else []
        docs = [d if isinstance(d, Document) else Document(f"doc-{i}", d) for i, d in enumerate(docs)]
        if not docs:
            raise ValueError("No documents given; pass at least one Document or text.")
        seen = {d for p in old for d in p["documents"]}
        for d in docs:
            if d.doc_id in seen:
                raise ValueError(f"Duplicate document id {d.doc_id!r}; ids must be unique (remove the old one first).")
            seen.add(d.doc_id)
        todo = enumerate(shares(docs, len(self.workers) * self.shares_per_worker))
        written, settings = {}, self._settings(old)
        try:
            with contextlib.closing(spread(todo, self.workers, lambda w, job: w.index.remote(job[1], settings))
                                    ) as finished:
                for (i, share), ready in finished:
                    try:
                        written[i] = segments.write(directory, ray.get(ready))
                    except Exception as e:
                        raise BuildError(f"a worker failed indexing documents {share[0].doc_id!r}.."
                                         f"{share[-1].doc_id!r} ({type(e).__name__}: {_first_line(e)}); nothing was "
                                         f"committed and the index in {directory} is as it was") from e
        except BaseException:
            for entry in written.values():
                shutil.rmtree(directory / segments.SEGMENTS / entry["name"], ignore_errors=True)
            raise
        return segments.commit(directory, old + [written[i] for i in sorted(written)])


def _first_line(e: BaseException) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    return lines[-1] if lines else ""

