"""Retrieval methods, one small class each, one protocol (`compress(context, question, budget) -> Compressed`)."""
from __future__ import annotations

import importlib

from endo_retrieval.methods.base import Compressed, Method, Span

# method name -> "module:Class"; imported on first use so optional dependencies stay optional
REGISTRY = {
    "s3": "endo_retrieval.methods.s3:S3",
    "s3-hybrid": "endo_retrieval.methods.s3:S3Hybrid",
    "bm25": "endo_retrieval.methods.s3:BM25",
    "ilre": "endo_retrieval.methods.ilre:ILRe",
    "heads": "endo_retrieval.methods.heads:RetrievalHeads",
    "endo": "endo_retrieval.methods.endo:Endo",
}


def get_method(name: str, **kwargs) -> Method:
    """An instance of the method called `name` (see REGISTRY); kwargs go to its constructor."""
    if name not in REGISTRY:
        raise ValueError(f"Unknown method {name!r}; known methods: {', '.join(REGISTRY)}.")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)(**kwargs)


# the best method measured: on HotpotQA haystacks (dev30, 4096/512 and 8192/1024) `endo` keeps more gold sentences
# and answers than BM25 over sentences, which in turn beats s3-hybrid (docs/results.md)
DEFAULT_METHOD = "endo"


def compress(context: str, question: str, budget: int = 1024, method: str = DEFAULT_METHOD, backbone=None
             ) -> Compressed:
    """Compress one long context for one question: `.text` holds at most `budget` backbone tokens, in source
    order, and `.spans` the kept pieces with their character offsets and the signals that chose them.
    `backbone`: a loaded Backbone, a model folder or GGUF file (loaded once per process), or None (the default)."""
    from endo_retrieval.backbone import Backbone

    backbone = Backbone.of(backbone) if method in REGISTRY else None  # an unknown name fails before any loading
    return get_method(method, backbone=backbone).compress(context, question, budget)


__all__ = ["Compressed", "Method", "Span", "REGISTRY", "DEFAULT_METHOD", "get_method", "compress"]
