"""endo-retrieval: a local language model finds evidence with its own attention signals."""
from endo_retrieval.model.backbone import Backbone, BackboneError
from endo_retrieval.index.corpus import CorpusMap
from endo_retrieval.index.engine import Document, EndoIndex
from endo_retrieval.index.inverted import FeatureIndex
from endo_retrieval.methods import REGISTRY, compress, get_method
from endo_retrieval.methods.base import Compressed, Span
from endo_retrieval.methods.s3 import BM25, S3, S3Hybrid
from endo_retrieval.model.sae import SAEBank, TopKSAE

__version__ = "0.1.0"
__all__ = ["Backbone", "BackboneError", "BM25", "Compressed", "CorpusMap", "Document", "EndoIndex",
           "FeatureIndex", "REGISTRY", "S3", "S3Hybrid", "SAEBank", "Span", "TopKSAE", "compress", "get_method"]


def __getattr__(name):  # ILRe imports lazily (it is optional to the S3 path)
    if name == "ILRe":
        from endo_retrieval.methods.ilre import ILRe

        return ILRe
    raise AttributeError(name)
