"""Retrieval methods, one small class each, one protocol (`compress(context, question, budget) -> Compressed`)."""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from endo_retrieval.core import Compressed, Compressors, Span, capped_question
from endo_retrieval.methods.base import Method


@dataclass(frozen=True)
class Entry:
    """What one method name runs and serves."""

    cls: str | None  # "module:Class" that compresses one context; imported on first use so optional dependencies
    # stay optional; None: the method ranks a corpus only
    corpus: bool = False  # an index of a corpus searches with it (`EndoIndex.search`)
    saes: bool = False  # it reads the SAE feature postings, so the index is built with the SAEs
    passages: bool = False  # over a corpus it ranks passages with the model (the corpus pipeline)


# The one list of method names; every other list is read from it. The default comes first, then the other corpus
# methods, then those for one context only.
METHODS = {
    "endo": Entry("endo_retrieval.methods.endo:Endo", corpus=True, passages=True),
    # endo with a second hop that asks the index again with the bridge the heads found (opt-in)
    "endo-2hop": Entry(None, corpus=True, passages=True),
    "s3-hybrid": Entry("endo_retrieval.methods.s3:S3Hybrid", corpus=True, saes=True),
    "s3": Entry("endo_retrieval.methods.s3:S3", corpus=True, saes=True),
    "bm25": Entry("endo_retrieval.methods.s3:BM25", corpus=True),
    "ilre": Entry("endo_retrieval.methods.ilre:ILRe"),
    "heads": Entry("endo_retrieval.methods.heads:RetrievalHeads"),
}
REGISTRY = {name: e.cls for name, e in METHODS.items() if e.cls}  # method name -> "module:Class", for one context
SEARCH_METHODS = tuple(name for name, e in METHODS.items() if e.corpus)  # the methods an index searches with
S3_METHODS = tuple(name for name, e in METHODS.items() if e.saes)
PIPELINE_METHODS = tuple(name for name, e in METHODS.items() if e.passages)


def method_class(name: str) -> type:
    """The class of the method called `name` (see REGISTRY), imported on first use."""
    if name not in REGISTRY:
        if name in SEARCH_METHODS:  # a corpus method with no one-context twin: a second hop has no index to ask
            raise ValueError(f"{name!r} ranks a corpus (EndoIndex.search, the retrievers); for one context use "
                             f"'endo', which reads all of it: known methods here: {', '.join(REGISTRY)}.")
        raise ValueError(f"Unknown method {name!r}; known methods: {', '.join(REGISTRY)}.")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


def get_method(name: str, **kwargs) -> Method:
    """An instance of the method called `name` (see REGISTRY); kwargs go to its constructor."""
    return method_class(name)(**kwargs)


def check_search_method(method: str) -> str:
    """`method` when an index searches with it, else a ValueError naming those it does."""
    if method not in SEARCH_METHODS:
        raise ValueError(f"Unknown method {method!r}; the index searches with one of {', '.join(SEARCH_METHODS)}.")
    return method


# The one default of every entry point (compress, EndoIndex, both retrievers, both compressors, MCP, the CLI): the
# best pipeline measured on dev300 (docs/results.md): BM25 candidates, the model reads them, its heads rank them.
DEFAULT_METHOD = "endo"


def compress(context: str, question: str, budget: int = 1024, method: str = DEFAULT_METHOD, backbone=None
             ) -> Compressed:
    """Compress one long context for one question: `.text` holds at most `budget` backbone tokens, in source
    order, and `.spans` the kept pieces with their character offsets and the signals that chose them.
    `backbone`: a loaded Backbone, a model folder or GGUF file (loaded once per process), or None (the default).
    A question longer than MAX_QUESTION_CHARS (base.py) is cut to that length, with a warning."""
    from endo_retrieval.model.backbone import Backbone  # torch: the CLI reads the method names from here

    question = capped_question(question)
    backbone = Backbone.of(backbone) if method in REGISTRY else None  # an unknown name fails before any loading
    return get_method(method, backbone=backbone).compress(context, question, budget)


Compressors.register(compress, DEFAULT_METHOD)  # what the model's `compress_to` compresses with


__all__ = ["Compressed", "Method", "Span", "METHODS", "REGISTRY", "DEFAULT_METHOD", "SEARCH_METHODS", "get_method",
           "method_class", "check_search_method", "compress"]
