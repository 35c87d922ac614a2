"""Decode-time attention backends for the local generator, by name in BACKENDS: `get_backend("reattention")`."""
from __future__ import annotations

from endo_retrieval.attention.base import AttentionBackend, AttentionError, KVCache, installed
from endo_retrieval.attention.completion import Completion
from endo_retrieval.attention.dense import Dense
from endo_retrieval.attention.prhs import PrHS
from endo_retrieval.attention.reattention import ReAttention

BACKENDS: dict[str, type[AttentionBackend]] = {"dense": Dense, "reattention": ReAttention, "prhs": PrHS,
                                                 "completion": Completion}


def get_backend(attention: "str | AttentionBackend | None", **settings) -> AttentionBackend | None:
    """A backend instance from its name (settings go to its constructor); an instance, or None, as it is."""
    if attention is None or isinstance(attention, AttentionBackend):
        return attention
    if attention not in BACKENDS:
        raise AttentionError(f"Unknown attention backend {attention!r}; known: {', '.join(BACKENDS)}.")
    return BACKENDS[attention](**settings)


__all__ = ["AttentionBackend", "AttentionError", "BACKENDS", "Dense", "KVCache", "ReAttention", "get_backend",
           "installed"]
