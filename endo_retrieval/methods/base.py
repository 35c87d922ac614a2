"""The one protocol every retrieval method follows (the kvpress idea: one small class per paper).

A method turns (context, question, budget) into a `Compressed`: the kept source text, in source order, and the
spans that make it up. Token positions are positions in the backbone tokenizer's encoding of the context.
`BaseMethod` is what most methods derive from: they write how they rank, it checks and fills the budget.
"""
from __future__ import annotations

import numbers
import warnings
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Protocol

# The longest question read. A question is read whole in one forward, after the context or the candidates, never
# streamed in chunks as documents are: its memory grows with it, and it takes the room of the evidence in the model's
# window. Real questions are a few dozen tokens; 8,000 characters (about 2,000 tokens of English) is far past them
# and leaves most of an 8k window to the evidence.
MAX_QUESTION_CHARS = 8_000


@dataclass(frozen=True)
class Span:
    """A kept run of the source: tokens [start, end) and the characters [char_start, char_end) they cover."""

    start: int
    end: int
    char_start: int
    char_end: int
    text: str
    score: float = 0.0
    signals: tuple[str, ...] = ()  # which signals chose it: "s3", "bm25", "lead", "tail", "ilre", ...
    doc_id: str | None = None
    metadata: dict = field(default_factory=dict, compare=False, hash=False)  # the document's own
    stage_scores: dict = field(default_factory=dict, compare=False, hash=False)  # a pipeline's score per stage
    stage_ms: dict = field(default_factory=dict, compare=False, hash=False)  # the search's time per stage
    whole_document: bool = False  # the span is its document's whole text (a framework can name it by the document)

    @property
    def n_tokens(self) -> int:
        return self.end - self.start


@dataclass
class Compressed:
    """What `compress()` returns: `.text` is at most `budget` backbone tokens, in source order."""

    text: str
    spans: list[Span]
    n_tokens: int
    method: str
    budget: int

    def __str__(self) -> str:
        return self.text


class Method(Protocol):
    name: ClassVar[str]

    def compress(self, context: str, question: str, budget: int) -> Compressed: ...


def check_budget(budget) -> None:
    """Every entry point's budget check: a positive whole number of tokens, else a ValueError that says so."""
    if isinstance(budget, bool) or not isinstance(budget, numbers.Integral) or budget <= 0:
        raise ValueError(f"budget must be a positive whole number of tokens, got {budget!r}.")


def capped_question(question):
    """The question every entry point reads (`compress()`, `EndoIndex.search`, and through them the command line and
    the adapters): cut to its first MAX_QUESTION_CHARS characters, with a warning, when it is longer. Anything but a
    str is returned as it is, for the caller's own checks."""
    if isinstance(question, str) and len(question) > MAX_QUESTION_CHARS:
        warnings.warn(f"The question has {len(question):,} characters; only its first {MAX_QUESTION_CHARS:,} are "
                      "read. Put long material into the context or the indexed documents instead.", stacklevel=3)
        return question[:MAX_QUESTION_CHARS]
    return question


def join_spans(spans: list[Span], method: str, budget: int) -> Compressed:
    """Spans in source order; adjacent spans join as the source text, others with a newline between."""
    spans = sorted(spans, key=lambda s: s.start)
    parts = []
    for i, s in enumerate(spans):
        if i and s.start != spans[i - 1].end:
            parts.append("\n")
        parts.append(s.text)
    return Compressed("".join(parts), spans, sum(s.n_tokens for s in spans), method, budget)


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
