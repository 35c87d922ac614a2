"""endo-retrieval: a local language model finds evidence with its own attention signals."""
from endo_retrieval.backbone import Backbone, BackboneError
from endo_retrieval.methods.base import Compressed, Span

__version__ = "0.1.0"
__all__ = ["Backbone", "BackboneError", "Compressed", "Span"]
