"""The types every layer shares: a kept `Span` of the source, the `Compressed` result, and the checks every entry
point makes on its budget and its question. Token positions are positions in the backbone tokenizer's encoding of the
context."""
from __future__ import annotations

import numbers
import warnings
from dataclasses import dataclass, field

# The longest question read. A question is read whole in one forward, after the context or the candidates, never
# streamed in chunks as documents are: its memory grows with it, and it takes the room of the evidence in the model's
# window. Real questions are a few dozen tokens; 8,000 characters (about 2,000 tokens of English) is far past them
# and leaves most of an 8k window to the evidence.
MAX_QUESTION_CHARS = 8_000



class Compressors:
    """Where the model's `compress_to` finds the compressor: the methods sit above the model, so they register
    theirs here, one floor below both (torch-free, so parsing the CLI loads no torch), when endo_retrieval.methods
    is imported; a caller may pass its own to `generate` instead (`compressor=`)."""

    _registered: tuple | None = None  # (compress(context, question, budget, method, backbone), its default method)

    @classmethod
    def register(cls, compress, default_method: str) -> None:
        cls._registered = (compress, default_method)

    @classmethod
    def get(cls) -> tuple:
        """(compress, its default method); ValueError saying what to import where none is registered."""
        if cls._registered is None:
            raise ValueError("compress_to compresses with endo_retrieval's methods: `import endo_retrieval.methods` "
                             "(the LlamaIndex and LangChain adapters do) before generating with it, or pass "
                             "compressor=endo_retrieval.compress.")
        return cls._registered


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
