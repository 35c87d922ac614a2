"""A saved index read without its model: the corpus map and the passages with their BM25 are on disk, so `endo query
--method bm25`, `endo info DIR` and `endo remove`'s check of its ids answer without importing torch (which alone
takes seconds on a small CPU) or loading the model."""
from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from endo_retrieval.core import Span, capped_question
from endo_retrieval.corpus import CorpusMap
from endo_retrieval.files import IndexCorruptError, read_folder
from endo_retrieval.index.hits import whole_document, with_section
from endo_retrieval.index.passages import PASSAGES_FILE, Passages, passage_span, saved_names
from endo_retrieval.scoring.bm25 import words

SHAPES = ("document", "passages", "whole")  # a hit per document (its best passage), the best passages, whole documents


@dataclass
class Saved:
    """What a saved index holds on disk: its header, and unless it is a manifest of segments (`endo index --ray`),
    its corpus map and (when asked for) its passages."""

    folder: Path
    meta: dict
    corpus: CorpusMap | None
    passages: Passages | None = None


def read_saved(folder: Path, passages: bool = False) -> Saved:
    """The index in `folder`, one committed state of it, read without the model. ValueError saying what to do where
    there is no index or it is damaged. `passages`: read them too (cut again, without the model, where they were
    saved another way)."""
    def read(open_file):
        with open_file("endo-index.json") as f:
            meta = json.loads(f.read().decode("utf-8"))
        if not isinstance(meta, dict) or "segments" in meta:
            return meta, None, None
        passages_file = saved_names(meta)[1]
        corpus = CorpusMap.read_saved(open_file, folder, meta.get("columns") is True)
        if not passages:
            return meta, corpus, None
        recorded = (meta.get("sha256") or {}).get(passages_file)
        try:
            with open_file(passages_file) as f:
                return meta, corpus, Passages.read(f, corpus, sha256=recorded) or Passages.build(corpus)
        except FileNotFoundError:  # saved before passages were; missing since, or where the header records them: damage
            if recorded or passages_file == PASSAGES_FILE:
                raise IndexCorruptError(f"{folder / passages_file} is missing; delete the folder and rebuild the "
                                        "index with `endo index PATH... --out DIR`.") from None
            return meta, corpus, Passages.build(corpus)
        except (ValueError, KeyError, EOFError, TypeError, OverflowError, zipfile.BadZipFile,
                NotImplementedError) as err:
            raise IndexCorruptError(f"{folder / passages_file} is damaged ({err}); delete the folder and rebuild "
                                    "the index with `endo index PATH... --out DIR`.") from None

    try:
        meta, corpus, cut = read_folder(folder, read)
    except FileNotFoundError:
        raise ValueError(f"{folder} holds no endo index; build one with `endo index PATH... --out {folder}`.") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise IndexCorruptError(f"{folder / 'endo-index.json'} is damaged ({err}); delete the folder and rebuild "
                                "the index with `endo index PATH... --out DIR`.") from None
    if not isinstance(meta, dict) or meta.get("format") != "endo-index":
        raise IndexCorruptError(f"{folder} holds no endo index ({folder / 'endo-index.json'} is not one); rebuild "
                                "it with `endo index PATH... --out DIR`.")
    return Saved(folder, meta, corpus, cut)


def read_header(folder: Path) -> dict:
    """The header of the index in `folder` (its model, method, generation), alone; {} where it cannot be read (the
    full read says why)."""
    def read(open_file):
        with open_file("endo-index.json") as f:
            return json.loads(f.read().decode("utf-8"))

    try:
        meta = read_folder(folder, read)
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def bm25_hits(saved: Saved, question: str, k: int, budget: int | None = None, shape: str = "document"
              ) -> list[Span]:
    """The index's passages ranked by BM25 over their stems alone (the `endo` pipeline's first stage), best first:
    the best passage of each of the k best documents, the k best passages (`shape="passages"`), or the k best
    documents whole (`"whole"`). Only passages that hold a word of the question come back. `budget`: at most
    that many tokens in all, each passage cut to its best part, as the pipeline cuts them."""
    question = capped_question(question)
    corpus, passages = saved.corpus, saved.passages
    query = words(question)
    scores = passages.bm25.get_scores(query) if query else np.zeros(len(passages))
    order = np.lexsort((np.arange(len(scores)), -scores))  # best first, ties in corpus order
    order = order[sharing(passages.bm25, query)[order]]
    if shape != "passages":  # each document's first passage in that order is its best
        _, first = np.unique(corpus.locate(passages.starts[order])[0], return_index=True)
        order = order[np.sort(first)]
    hits = [with_section(saved, passage_span(corpus, passages, int(i), float(scores[i]), set(query), budget, k))
            for i in order[:k]]
    return [whole_document(saved, h) for h in hits] if shape == "whole" else hits


def sharing(bm25, query: list[str]) -> np.ndarray:
    """Which passages hold a word of the query (a score's sign says nothing of it: in a corpus of one or two
    documents every idf is below zero)."""
    found = np.zeros(bm25.okapi.corpus_size, dtype=bool)
    for term in {bm25.term(w) for w in query} & bm25.terms.keys():
        row = bm25.terms[term]
        found[bm25.docs[bm25.indptr[row]:bm25.indptr[row + 1]]] = True
    return found


def typed_ids(corpus: CorpusMap, typed: list[str]) -> dict[str, str | None]:
    """The document each typed name names (None: none): an id as the index lists it, or a file's path however it is
    typed (relative to this folder, ./, absolute), found by the resolved path its document records."""
    by_path = {d.metadata.get("path"): d.doc_id for d in corpus.documents()}
    return {t: t if t in corpus else by_path.get(str(Path(t).expanduser().resolve())) for t in typed}
