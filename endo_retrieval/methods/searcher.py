"""`Searcher`: the one protocol of whatever answers a question over a corpus (an `EndoIndex` on one process, a
`ReaderPool` or `ShardedIndex` on Ray), which the adapters (integrations.py, both frameworks' retrievers) take.

    search(question, k=4, budget=None, method=None, where=None, depth=None, read_tokens=None, first_stage=None)
        -> list[Span], the k best hits, best first (higher score is better)

`budget`: tokens in all; `method`: None for the searcher's own; `where(metadata)`: only documents it accepts can come
back; `depth`, `read_tokens`, `first_stage`: the `endo` pipeline's candidates read, tokens read of each and stage 1
(None: the model's fitted ones). `check_method` says which methods it serves and `pipeline` checks the pipeline's
options and resolves them (its `depth` is what a retriever reads first), both before any question is asked.
tests/methods/test_searcher.py holds every class with a `search` to this signature.
"""
from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import numpy as np

from endo_retrieval.core import Span


@runtime_checkable
class Searcher(Protocol):
    """What answers a question over a corpus (see the module docstring)."""

    method: str  # the method a search without one uses

    @property
    def methods(self) -> tuple[str, ...]:
        """The methods it searches with."""

    def search(self, question: str, k: int = 4, budget: int | None = None, method: str | None = None,
               where: Callable[[dict], bool] | None = None, depth: int | None = None,
               read_tokens: int | None = None, first_stage: str | None = None) -> list[Span]:
        """The k best hits, best first."""

    def check_method(self, method: str | None) -> str:
        """`method` (None: its own) when it serves it, else a ValueError naming those it does."""

    def pipeline(self, method: str = "endo", depth: int | None = None, read_tokens: int | None = None,
                 first_stage: str | None = None):
        """The pipeline's settings (`depth`, `read_tokens`, `first_stage`, ...) as a search with these options
        runs them; a bad option is a ValueError."""


def check_search_k(k) -> int:
    """`k` when it is a whole number >= 1, else a ValueError saying so."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be a whole number >= 1, got {k!r}.")
    return int(k)


def best_spans(spans: list[Span], k: int, where: Callable[[dict], bool] | None = None) -> list[Span]:
    """The ranking tail of the methods that fill a budget with spans: those whose document `where` accepts, best
    first (ties keep source order), cut to k."""
    return sorted([s for s in spans if where is None or where(s.metadata)], key=lambda s: -s.score)[:k]
