"""`endo mcp`: serve an endogenous index to agents over the Model Context Protocol (stdio, the official `mcp` SDK).

Tools: `search_evidence` (the question's own query projections find evidence spans, [S3 Alg. 1]),
`add_documents` (index more text, skipping documents whose text cannot be indexed; saved atomically to --index
when given) and `list_documents`.
The model loads on the first tool call, so the handshake is immediate.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from endo_retrieval.cli.commands import engine, model_argument
from endo_retrieval.methods import DEFAULT_METHOD, SEARCH_METHODS
from endo_retrieval.core import MAX_QUESTION_CHARS
from endo_retrieval.files import writer_lock
from endo_retrieval.index.text_files import Unreadable, indexable_text

if TYPE_CHECKING:  # the engine imports torch: `endo mcp --help` should not wait for it
    from endo_retrieval.methods.search import Document, EndoIndex


log = logging.getLogger(__name__)


class Evidence(BaseModel):
    doc_id: str
    text: str
    char_start: int = Field(description="offset of the span in its document's text")
    char_end: int
    score: float
    signals: list[str] = Field(description="the signals that chose the span: bm25, heads, hop2, s3, lead, tail")
    metadata: dict[str, Any]


class NewDocument(BaseModel):
    doc_id: str = Field(description="unique id of the document")
    text: str
    metadata: dict[str, Any] = Field(default_factory=dict)


class Skipped(BaseModel):
    doc_id: str
    reason: str = Field(description="why its text cannot be indexed: empty, binary, not valid Unicode")


class Added(BaseModel):
    added: list[str] = Field(description="ids of the documents now indexed")
    skipped: list[Skipped] = Field(description="documents left out because their text cannot be indexed")


class IndexHolder:
    """The served index: loaded from (or later saved to) `folder`, created on first use. Tools run in worker
    threads, so a search never sees a half-added document."""

    def __init__(self, folder: str | None, method: str, model: str | None = None):
        self.folder = Path(folder) if folder else None
        self.method, self.model = method, model  # model: a folder or GGUF path, None for the default model
        self._index: EndoIndex | None = None
        self._lock = threading.RLock()

    def index(self) -> EndoIndex:
        EndoIndex = engine().EndoIndex
        with self._lock:
            if self._index is None:
                exists = self.folder is not None and (self.folder / "endo-index.json").exists()
                self._index = EndoIndex.load(self.folder, self.model) if exists else \
                    EndoIndex(self.model, method=self.method)
            return self._index

    def search_evidence(self, question: str, k: int, budget: int | None) -> list:
        with self._lock:  # the k best passages: the pipeline reads at least k candidates
            return engine().search_hits(self.index(), question, k, budget, self.method, return_passages=True,
                                        progress=False)

    def add(self, docs: list[Document]) -> list[str]:
        with self._lock, writer_lock(self.folder) if self.folder else contextlib.nullcontext():
            index = self.index()
            ids = index.add_documents(docs)
            if self.folder is not None:
                try:
                    index.save(self.folder)
                except BaseException:  # what is served stays what is on disk
                    for doc_id in ids:
                        index.remove_document(doc_id)
                    raise
            return ids


def build_server(holder: IndexHolder, k: int = 4, budget: int | None = None):
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    Document = engine().Document
    server = MCPServer("endo-retrieval", instructions="Evidence retrieval with a local model's own attention "
                       "signals: search_evidence(question) returns the best evidence spans of the indexed documents.")

    @server.tool()
    def search_evidence(question: str, k: int = k, budget: int | None = budget) -> list[Evidence]:
        """The k best evidence spans for the question, best first, with their document ids and offsets."""
        if len(question) > MAX_QUESTION_CHARS:  # refused, not cut: an agent sees no warning, only the answer
            raise ToolError(f"The question has {len(question)} characters; ask with at most {MAX_QUESTION_CHARS} "
                            "(put long material into add_documents instead).")
        try:
            spans = holder.search_evidence(question, k, budget)
        except (ValueError, OSError) as e:
            raise ToolError(str(e)) from None
        return [Evidence(doc_id=s.doc_id, text=s.text, char_start=s.char_start, char_end=s.char_end,
                         score=s.score, signals=list(s.signals), metadata=s.metadata) for s in spans]

    @server.tool()
    def add_documents(documents: list[NewDocument]) -> Added:
        """Index documents (ids must be new); a document whose text cannot be indexed (empty, binary) is skipped
        and listed with why, the rest are indexed. Saved to the server's index folder, if any."""
        readable, skipped = [], []
        for d in documents:
            try:
                readable.append(Document(d.doc_id, indexable_text(d.text)[0], d.metadata))
            except Unreadable as e:
                log.warning("add_documents: skipping %r: %s", d.doc_id, e)
                skipped.append(Skipped(doc_id=d.doc_id, reason=str(e)))
        if skipped and not readable:
            raise ToolError("None of the documents can be indexed: " +
                            "; ".join(f"{s.doc_id!r}: {s.reason}" for s in skipped))
        try:
            return Added(added=holder.add(readable), skipped=skipped)
        except (ValueError, OSError) as e:  # a bad document, a busy or damaged index folder, a full disk
            raise ToolError(str(e)) from None

    @server.tool()
    def list_documents() -> list[str]:
        """The ids of the indexed documents."""
        try:
            return holder.index().doc_ids
        except (ValueError, OSError) as e:
            raise ToolError(str(e)) from None

    return server


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--index", default=None, help="index folder to serve (from `endo index`); created there by "
                        "add_documents when absent. Without it the index lives in memory only")
    parser.add_argument("--method", default=DEFAULT_METHOD, choices=SEARCH_METHODS,
                        help=f"retrieval method (default {DEFAULT_METHOD})")
    parser.add_argument("--k", type=int, default=4, help="default number of evidence spans per search")
    parser.add_argument("--budget", type=int, default=None, help="default token budget per search")
    model_argument(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    if args.index and Path(args.index).exists() and not (Path(args.index) / "endo-index.json").exists():
        raise ValueError(f"{args.index} exists but holds no endo index; pass an index folder or a new path.")
    build_server(IndexHolder(args.index, args.method, args.model), args.k, args.budget).run("stdio")
    return 0


if __name__ == "__main__":
    raise SystemExit(run(add_arguments(argparse.ArgumentParser(prog="endo mcp")).parse_args()))
