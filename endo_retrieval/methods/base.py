"""The one protocol every retrieval method follows (the kvpress idea: one small class per paper).

A method turns (context, question, budget) into a `Compressed`: the kept source text, in source order, and the
spans that make it up. Token positions are positions in the backbone tokenizer's encoding of the context.
`BaseMethod` is what most methods derive from: they write how they rank, it checks and fills the budget.
"""
from __future__ import annotations

from typing import Callable, ClassVar, Protocol

from endo_retrieval.core import Compressed, Span, check_budget, join_spans


class Method(Protocol):
    name: ClassVar[str]

    def compress(self, context: str, question: str, budget: int) -> Compressed: ...


def fit_to_budget(choose: Callable[[int], list[Span]], budget: int, backbone, name: str) -> Compressed:
    """The spans `choose(target)` keeps under `target` tokens, joined in source order, at most `budget` tokens of
    text: spans cut inside words, and the newlines between spans, can re-tokenise longer than the spans' sum, so
    the target shrinks by the excess until the joined text fits."""
    target = budget
    for _ in range(8):
        out = join_spans(choose(target), name, budget)
        out.n_tokens = backbone.count_tokens(out.text)
        if out.n_tokens <= budget:
            return out
        target -= out.n_tokens - budget
    raise RuntimeError(f"could not fit the selection into {budget} tokens")  # pragma: no cover


class BaseMethod:
    """The base class of a method that ranks a prepared context (kvpress's BasePress, whose presses write only
    `score`). A method writes `prepare(context)`, the work that does not depend on the question (an index, the
    model's reading; the bench times it apart), and `rank(prepared, question, budget)`, which scores once and
    returns how it keeps spans under a target of tokens (select.py's `sentence_spans` for a ranking of
    sentences). The base class checks the budget and fits the text into it (`fit_to_budget`)."""

    name: ClassVar[str] = ""
    backbone: object = None

    def prepare(self, context: str):
        raise NotImplementedError

    def rank(self, prepared, question: str, budget: int) -> Callable[[int], list[Span]]:
        raise NotImplementedError

    def select(self, prepared, question: str, budget: int) -> Compressed:
        check_budget(budget)
        return fit_to_budget(self.rank(prepared, question, budget), budget, self.backbone, self.name)

    def compress(self, context: str, question: str, budget: int = 1024) -> Compressed:
        check_budget(budget)  # before the reading or indexing work
        return self.select(self.prepare(context), question, budget)
