"""Retrieval methods, one small class each, one protocol (`compress(context, question, budget) -> Compressed`)."""
from __future__ import annotations

import importlib

from endo_retrieval.core import Compressed, Span, capped_question
from endo_retrieval.methods.base import Method

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
        if name in SEARCH_METHODS:  # a corpus method with no one-context twin: a second hop has no index to ask
            raise ValueError(f"{name!r} ranks a corpus (EndoIndex.search, the retrievers); for one context use "
                             f"'endo', which reads all of it: known methods here: {', '.join(REGISTRY)}.")
        raise ValueError(f"Unknown method {name!r}; known methods: {', '.join(REGISTRY)}.")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)(**kwargs)


# The one default of every entry point (compress, EndoIndex, both retrievers, both compressors, MCP, the CLI): the
# best pipeline measured on dev300 (docs/results.md): BM25 candidates, the model reads them, its heads rank them.
DEFAULT_METHOD = "endo"
# the methods an index of a corpus searches with (`EndoIndex.search`); s3 and s3-hybrid need its feature postings
# `endo-2hop`: endo with a second hop that asks the index again with the bridge the heads found (opt-in)
SEARCH_METHODS = ("endo", "endo-2hop", "s3-hybrid", "s3", "bm25")


def compress(context: str, question: str, budget: int = 1024, method: str = DEFAULT_METHOD, backbone=None
             ) -> Compressed:
    """Compress one long context for one question: `.text` holds at most `budget` backbone tokens, in source
    order, and `.spans` the kept pieces with their character offsets and the signals that chose them.
    `backbone`: a loaded Backbone, a model folder or GGUF file (loaded once per process), or None (the default).
    A question longer than MAX_QUESTION_CHARS (base.py) is cut to that length, with a warning."""
    from endo_retrieval.model.backbone import Backbone

    question = capped_question(question)
    backbone = Backbone.of(backbone) if method in REGISTRY else None  # an unknown name fails before any loading
    return get_method(method, backbone=backbone).compress(context, question, budget)


__all__ = ["Compressed", "Method", "Span", "REGISTRY", "DEFAULT_METHOD", "SEARCH_METHODS", "get_method", "compress"]
