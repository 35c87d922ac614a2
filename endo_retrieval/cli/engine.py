"""The heavy half of the command line: the index engine and its documents, the model, and the adapters' search, with
torch and transformers behind them. Commands reach it through `commands.engine()` once they need the model."""
from __future__ import annotations

from endo_retrieval.integrations import search_hits
from endo_retrieval.methods.search import Document, EndoIndex
from endo_retrieval.model.backbone import SUPPORTED_FAMILIES, Backbone

__all__ = ["SUPPORTED_FAMILIES", "Backbone", "Document", "EndoIndex", "search_hits"]
