"""The Ray cluster and its workers: joining a cluster, one `ModelWorker` per accelerator holding the model (index
shares, ILRe chunk parts), actors started one per GPU (else per CPU slot), calls spread over free actors."""
from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from endo_retrieval.index import segments
from endo_retrieval.methods.ilre import dca_key_positions
from endo_retrieval.methods.search import Document, EndoIndex
from endo_retrieval.model.backbone import Backbone
from endo_retrieval.model.sae import SAEBank, SAEError
from endo_retrieval.scoring.attention import ContextLogits


def ray_cluster():
    """The `ray` module, joined to a cluster: the one `ray.init` or `connect` joined, else a new local one."""
    try:
        import ray
    except ImportError:
        raise ImportError("Ray is not installed: pip install 'endo-retrieval[ray]'") from None
    if not ray.is_initialized():
        ray.init()
    return ray


def connect(address: str | None = None):
    """Join the Ray cluster at `address` ("auto": the one `ray start` made on this node; "HEAD:6379"), or start a
    local one when None. ValueError (printed by the CLI) when Ray is missing."""
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray: pip install 'endo-retrieval[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)
    return ray


class BuildError(RuntimeError):
    """A worker failed while building; nothing was committed, and the index that was there is unchanged."""


@dataclass
class ModelRecipe:
    """How a worker loads the driver's model and SAEs itself (weights are read once per worker, never shipped):
    `model` a folder or GGUF file (None: the default model), `sae` an SAE folder (None: the shipped SAEs; None
    where the model has none, which serves `endo` and `bm25`: an S3 build then fails with what to run)."""

    model: str | None = None
    sae: str | None = None

    def __call__(self):
        backbone = Backbone(self.model) if self.model else Backbone.default()
        if self.sae:
            return backbone, SAEBank.load(self.sae, backbone.model_hash, backbone.device)
        try:
            return backbone, SAEBank.for_backbone(backbone)
        except SAEError:
            return backbone, None


class ModelWorker:
    """One process holding the backbone and SAEs (`setup()` builds them): index shares, ILRe chunk parts."""

    def __init__(self, setup: Callable):
        self.backbone, self.saes = setup()

    def pid(self) -> int:
        return os.getpid()

    def index(self, docs: list[Document], settings: dict) -> dict[str, bytes]:
        """One segment's files: `docs` indexed with `settings` (EndoIndex's; the passages embedded where its first
        stage reads them, so the shards run the hybrid stage 1)."""
        part = EndoIndex(self.backbone, saes=self.saes, **settings)
        part.add_documents(docs)
        return segments.as_files(part)

    # ILRe: keys of the context chunks [start, end) at l_R, kept here between the calls of one context
    def ilre_prefill(self, context_ids: np.ndarray, query_ids: np.ndarray, start: int, end: int, s: dict):
        length, last = len(context_ids), end >= len(context_ids)
        ids = np.concatenate([context_ids, query_ids]) if last else context_ids[:end]
        keys, key_pos, queries, query_pos = [], [], [], []
        for ch in self.backbone.stream(ids, [s["layer"]], chunk_size=s["chunk_size"], mode="sink_window",
                                       sink=s["sink"], window=s["window"], capture=("k", "q") if last else ("k",),
                                       split_at=length, positions=s["positions"], start=start):
            if ch.start < length:
                keys.append(ch.keys[s["layer"]])
                key_pos.append(ch.rope_positions.cpu())
            else:
                queries.append(ch.queries[s["layer"]])
                query_pos.append(ch.rope_positions.cpu())
        key_pos = torch.cat(key_pos)
        if s["positions"] == "dca":  # [ILRe Eq. 7] moves each chunk's keys by its distance to the chunk before the last
            key_pos = dca_key_positions(torch.arange(length), list(range(0, length, s["chunk_size"])))[start:end]
        self._part = (torch.cat(keys, dim=1), key_pos)
        return (torch.cat(queries, dim=1).cpu(), torch.cat(query_pos)) if last else None

    def ilre_logsumexp(self, queries: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
        keys, key_pos = self._part
        self._logits = ContextLogits(keys, queries.to(self.backbone.device), key_pos, query_positions,
                                     self.backbone.apply_rope)
        return self._logits.logsumexp().cpu()

    def ilre_probabilities(self, lse: torch.Tensor) -> np.ndarray:
        out = self._logits.probabilities(lse)
        del self._part, self._logits
        return out


def start_workers(n: int | None = None, setup: Callable | None = None, kind: type | None = None, *args,
                  max_concurrency: int = 1) -> list:
    """`n` actors of `kind` (default ModelWorker; built as kind(setup, *args)), by default one per GPU in the
    cluster, else one per CPU; one GPU each when the cluster has GPUs, else one CPU each. `max_concurrency` > 1:
    calls run in threads (the backbone's lock keeps its model calls one at a time)."""
    ray = ray_cluster()
    gpus = int(ray.cluster_resources().get("GPU", 0))
    n = n or gpus or int(ray.cluster_resources().get("CPU", 1))
    resources = {"num_gpus": 1} if gpus else {"num_cpus": 1}
    actor = ray.remote(max_restarts=0)(kind or ModelWorker)
    return [actor.options(**resources, max_concurrency=max_concurrency).remote(setup or ModelRecipe(), *args)
            for _ in range(n)]


def spread(items: Iterable, slots: Sequence, submit: Callable) -> Iterator[tuple[object, object]]:
    """`submit(slot, item)` (an actor call; its ref) for every item, each on a free slot; yields (item, ready ref)
    in the order the calls finish, and frees the slot when the consumer asks for the next one. A slot is an actor,
    listed once per call it may run at a time. Calls still pending when the consumer stops early (an error) are
    cancelled."""
    ray = ray_cluster()
    todo, idle, pending = deque(items), deque(slots), {}
    try:
        while todo or pending:
            while todo and idle:
                item, slot = todo.popleft(), idle.popleft()
                pending[submit(slot, item)] = (item, slot)
            (ready,), _ = ray.wait(list(pending), num_returns=1)
            item, slot = pending.pop(ready)
            yield item, ready
            idle.append(slot)
    finally:
        for ref in pending:
            ray.cancel(ref)  # an actor's call cannot be forced; a pending one is dropped, a running one flagged

