"""endo-retrieval: a local language model finds evidence with its own attention signals."""
import importlib

__version__ = "0.1.0"
# public name -> the module that defines it, imported on first use: `import endo_retrieval.cli` (the `endo`
# command) then loads no torch, so an argument error or --help answers at once
_EXPORTS = {
    "Backbone": "endo_retrieval.model.backbone", "BackboneError": "endo_retrieval.model.backbone",
    "CorpusMap": "endo_retrieval.corpus", "Document": "endo_retrieval.index.engine",
    "EndoIndex": "endo_retrieval.methods.search", "FeatureIndex": "endo_retrieval.index.inverted",
    "REGISTRY": "endo_retrieval.methods", "compress": "endo_retrieval.methods", "get_method": "endo_retrieval.methods",
    "Compressed": "endo_retrieval.core", "Span": "endo_retrieval.core",
    "BM25": "endo_retrieval.methods.s3", "S3": "endo_retrieval.methods.s3", "S3Hybrid": "endo_retrieval.methods.s3",
    "SAEBank": "endo_retrieval.model.sae", "TopKSAE": "endo_retrieval.model.sae",
    "ILRe": "endo_retrieval.methods.ilre",
}
__all__ = sorted(name for name in _EXPORTS if name != "ILRe")  # ILRe is optional to the S3 path


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'endo_retrieval' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # the next look-up is a plain attribute
    return value


def __dir__():
    return sorted({*globals(), *_EXPORTS})
