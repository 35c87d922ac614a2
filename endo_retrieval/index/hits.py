"""What a search hands back, shaped for a reader: one hit per document, a hit as its whole document, the section a
hit lies in. Light to import (no torch): the command line shapes the hits it reads from a saved index without loading
the model."""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from endo_retrieval.core import Span
from endo_retrieval.index.sections import section_metadata


def best_per_document(spans: Sequence[Span]) -> list[Span]:
    """The first (best) span of each document, in the given order."""
    best: dict[str, Span] = {}
    for span in spans:
        best.setdefault(span.doc_id, span)
    return list(best.values())


def whole_document(index, span: Span) -> Span:
    """The hit as its whole document: the document's text (character offsets 0 to its length), its score and
    signals those of its best passage, whose character offsets in the document are `endo_passage_start` and
    `endo_passage_end` in the metadata (so `text[endo_passage_start:endo_passage_end]` is the passage). `index`:
    anything holding the documents as `.corpus` (a CorpusMap)."""
    check_whole_documents(index)
    doc = index.corpus.doc(span.doc_id)
    return replace(span, start=doc.start, end=doc.end, char_start=0, char_end=len(doc.text), text=doc.text,
                   metadata={**span.metadata, "endo_passage_start": span.char_start,
                             "endo_passage_end": span.char_end}, whole_document=True)


def check_whole_documents(index) -> None:
    """A retriever asked for whole documents needs their text on this process (an `EndoIndex`)."""
    if getattr(index, "corpus", None) is None:
        raise ValueError(f"return_document=True needs the documents' text, which this index "
                         f"({type(index).__name__}) does not hold on this process; open the folder with EndoIndex.")


def with_section(index, span: Span) -> Span:
    """The hit with where it lies in its file in its metadata (`sections.section_metadata`: "file_name", "title",
    "section"), where its document was read from one; the document's own metadata keeps its keys. `index`: anything
    holding the documents as `.corpus`; without one (a pool of readers) the hit as it is."""
    corpus = getattr(index, "corpus", None)
    if corpus is None or span.doc_id not in corpus:
        return span
    where = section_metadata(corpus.doc(span.doc_id), span.char_start)
    return replace(span, metadata={**where, **span.metadata}) if where else span
