"""`endo serve DIR`: `endo query DIR ... --json` over HTTP from one long-lived process, so the model loads once and
each question costs only its search. Built on Starlette and uvicorn (the `mcp` extra brings them).

    GET  /query?q=QUESTION&k=4&method=bm25&passages=true   (also whole, budget, depth, read_tokens, first_stage)
    POST /query  {"question": "...", "k": 4, ...}          the same fields as JSON
    GET  /health                                            the index's generation, method and documents

Each answer is the JSON list `endo query --json` prints; a bad request is a 400 with {"error": "..."} saying what to
fix. A new generation committed to DIR (`endo index --append`, `endo remove`) is read at the next question.
"""
from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

from endo_retrieval.cli import check_arguments
from endo_retrieval.cli.commands import (bm25_query, check_index_folder, check_question, engine, model_argument,
                                         model_query, span_json)
from endo_retrieval.cli.saved import read_header, read_saved
from endo_retrieval.files import IndexCorruptError
from endo_retrieval.methods import SEARCH_METHODS

FIRST_STAGES = ("hybrid", "bm25", "dense")
WHOLE_NUMBERS = ("k", "budget", "depth", "read_tokens")
TRUE, FALSE = ("1", "true", "yes"), ("0", "false", "no", "")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("index", metavar="DIR", help="an index folder made by `endo index`")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1: this machine "
                   "only; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8765, help="the port to listen on (default 8765)")
    model_argument(p)  # the index's own model: an index answers only with the model that built it


def run(args) -> int:
    check_index_folder(Path(args.index))
    try:
        import uvicorn
    except ImportError:
        raise ValueError("`endo serve` needs Starlette and uvicorn: pip install 'endo-retrieval[mcp]'.") from None
    served = Served(Path(args.index), args.model)
    served.warm()  # the model loads before the first question, not during it
    print(f"endo serve: {args.index} at http://{args.host}:{args.port}/query?q=... (Ctrl-C stops it)",
          file=sys.stderr)
    uvicorn.run(build_app(served), host=args.host, port=args.port,
                log_level="info" if getattr(args, "verbose", False) else "warning")  # --verbose: each request
    return 0


class Served:
    """The index the server answers from: the folder as read without the model (for bm25 and /health) and, once a
    method needs it, the index with its model; both read again when a writer commits a new generation. One
    question at a time: the model's read takes the CPU's cores."""

    def __init__(self, folder: Path, model: str | None = None):
        self.folder, self.model = folder, model
        self.saved, self.index = None, None
        self.lock = threading.Lock()

    def current(self):
        """The folder as now committed (read again where its generation changed)."""
        generation = read_header(self.folder).get("generation")
        if self.saved is None or generation != self.saved.meta.get("generation"):
            self.saved, self.index = read_saved(self.folder, passages=True), None
        return self.saved

    def loaded(self):
        """The index with its model, loaded at the first question that needs it."""
        if self.index is None:
            self.index = engine().EndoIndex.load(self.folder, self.model)
        return self.index

    def warm(self) -> None:
        with self.lock:
            if self.current().meta.get("method") != "bm25" or self.saved.corpus is None:
                self.loaded()

    def answer(self, params: dict) -> list[dict]:
        """`endo query --json`'s list for the request's fields; ValueError saying what is wrong with them."""
        args, shape = request(params, self.folder, self.model)
        if args.k == 0:
            return []
        with self.lock:
            saved = self.current()
            hits, _ = bm25_query(args, self.folder, shape, saved) or \
                model_query(args, shape, self.loaded(), progress=False)
        return [span_json(h) for h in hits]

    def health(self) -> dict:
        with self.lock:
            saved = self.current()
        return {"index": str(self.folder), "generation": saved.meta.get("generation"),
                "method": saved.meta.get("method"), "model": saved.meta.get("model"),
                "documents": len(saved.corpus) if saved.corpus is not None else None}


def request(params: dict, folder: Path, model: str | None) -> tuple[argparse.Namespace, str]:
    """The query's arguments, as `endo query` parses them, from a request's fields (strings from a URL, or JSON),
    and its shape ("document", "passages", "whole"); ValueError naming the field to fix."""
    if not isinstance(params, dict):
        raise ValueError('send the fields as a JSON object, e.g. {"question": "...", "k": 4}.')
    question = params.get("question", params.get("q"))
    if not isinstance(question, str):
        raise ValueError("ask with a question: ?q=... or {\"question\": \"...\"}.")
    check_question(question)
    args = argparse.Namespace(command="query", index=str(folder), model=model, question=question,
                              method=params.get("method"), first_stage=params.get("first_stage"),
                              **{name: whole_number(params, name) for name in WHOLE_NUMBERS})
    args.k = 4 if args.k is None else args.k
    if args.method is not None and args.method not in SEARCH_METHODS:
        raise ValueError(f"method must be one of {', '.join(SEARCH_METHODS)}, got {args.method!r}.")
    if args.first_stage is not None and args.first_stage not in FIRST_STAGES:
        raise ValueError(f"first_stage must be one of {', '.join(FIRST_STAGES)}, got {args.first_stage!r}.")
    problem = check_arguments(args)
    if problem:
        raise ValueError(problem.replace("--read-tokens", "read_tokens").replace("--", ""))
    passages, whole = flag(params, "passages"), flag(params, "whole")
    if passages and whole:
        raise ValueError("ask for passages or whole documents, not both.")
    return args, "whole" if whole else "passages" if passages else "document"


def whole_number(params: dict, name: str) -> int | None:
    value = params.get(name)
    if value is None or isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise ValueError(f"{name} must be a whole number, got {value!r}.")


def flag(params: dict, name: str) -> bool:
    value = params.get(name, False)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in TRUE + FALSE:
        return value.lower() in TRUE
    raise ValueError(f"{name} must be true or false, got {value!r}.")


def build_app(served: Served):
    """The Starlette app of `endo serve` over `served`."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def query(request):
        try:
            params = dict(request.query_params) if request.method == "GET" else await request.json()
        except ValueError:
            return JSONResponse({"error": "the body is not JSON; send the fields as a JSON object."}, 400)
        try:
            return JSONResponse(await run_in_threadpool(served.answer, params))
        except (IndexCorruptError, OSError) as e:  # the index, not the request: the server's to fix
            return JSONResponse({"error": " ".join(str(e).split())}, 500)
        except ValueError as e:
            return JSONResponse({"error": " ".join(str(e).split())}, 400)

    async def health(request):
        return JSONResponse(await run_in_threadpool(served.health))

    return Starlette(routes=[Route("/query", query, methods=["GET", "POST"]), Route("/health", health)])
